"""Jitted KV-cache sampler: prefill the prompts, then decode under `lax.while_loop`.

`make_sampler(model_config, sampling_config)` binds the hyper-parameters and
returns one jitted function

    sample(params, prompt_ids, prompt_valid, rng, stop_tokens=None, max_new_tokens=None)
        -> SampleOutput(tokens, logprobs, mask, lengths, finish_reason)

Prompts of different lengths share one batch (pad them on the left; any pad
pattern works because RoPE positions count only valid tokens). Each sampled
token's log-prob is taken under softmax(logits / temperature) of the FULL
distribution (before top-k / top-p), so it equals the teacher-forced
`qwen.token_logprobs(..., temperature=temperature)` of the same sequence and can
serve as `old_logp` in RL. Greedy decoding takes the argmax and reports the
log-prob at `temperature` (1.0 by default).

Randomness: row b draws its token at step t with `fold_in(row_key_b, t)`, where
the row keys are `rng` itself ([B] keys) or `split(rng, B)` (one key). So a row's
sample depends only on its prompt and its key, not on the rest of the batch.

Multi-turn rollouts keep each row's conversation as model state between calls
(`Context`: the KV cache, each row's length and its last sampled token, still
pending). `make_continuer(...)` returns

    continue_sample(params, context, new_ids, new_valid, rng, stop_tokens=None,
                    max_new_tokens=None) -> (SampleOutput, Context)

which writes each row's pending token and its new tokens (the environment's
observation and the next generation prompt) into the cache and samples the
reply, with the same semantics as `sample`. `compact_context`,
`take_context_rows` and `slots_needed` manage the cache between turns. Both
entry points run the same module-level steps: `prefill` -> `emit` ->
`decode_loop` (`sample_from_context` strings them together).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any, Callable, Optional

import chex
import flax
import jax
import jax.numpy as jnp

from seeupo_jax.models import qwen
from seeupo_jax.models.config import ModelConfig

Params = Any


class FinishReason(enum.IntEnum):
  """Why a row stopped: it sampled one of its stop tokens, or hit its max new tokens."""

  STOP = 0
  LENGTH = 1


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """Decoding hyper-parameters, bound when the sampler is built.

  Attributes:
      max_new_tokens: N, the static length of the output buffers and the most
          tokens any row may generate (rows may ask for fewer, see `sample`).
      temperature: T > 0; logits are divided by T before filtering and
          sampling, and the reported log-probs are log softmax(logits / T).
      top_k: keep the k most likely tokens (0 = off).
      top_p: keep the smallest most-likely-first prefix of tokens whose
          probability reaches top_p (nucleus; 1.0 = off). Applied after top_k,
          on the renormalised top-k distribution (the transformers order).
      greedy: take the argmax instead of sampling (top_k/top_p/rng unused).
      stop_token_ids: stop tokens shared by all rows (added to each row's own).
      pad_id: written to `tokens` after a row has finished.
      prefill_chunk_size: run the prompt through the model in chunks of this
          many tokens (bounds the attention buffers of long prompts); None =
          the whole prompt at once.
      scan_layers: override `ModelConfig.scan_layers` while sampling (the
          params layout is the same either way); None keeps the model's. With
          the head-major cache, scanned layers decode faster on CPU than
          unrolled ones (`benchmarks/bench_sampler.py --sampler-scan-layers`):
          under the unrolled stack XLA cannot prove that every layer read the
          cache before the one in-place write, and copies the cache each step.
  """

  max_new_tokens: int
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  greedy: bool = False
  stop_token_ids: tuple[int, ...] = ()
  pad_id: int = 0
  prefill_chunk_size: Optional[int] = None
  scan_layers: Optional[bool] = None

  def __post_init__(self):
    def bad(key, allowed, value):
      raise ValueError(f"SamplingConfig.{key} must be {allowed}, got {value!r}")

    if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
      bad("max_new_tokens", "an int >= 1", self.max_new_tokens)
    if not (isinstance(self.temperature, (int, float)) and self.temperature > 0):
      bad("temperature", "a float > 0 (use greedy=True for argmax decoding)", self.temperature)
    if not isinstance(self.top_k, int) or self.top_k < 0:
      bad("top_k", "an int >= 0 (0 = off)", self.top_k)
    if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
      bad("top_p", "a float in (0, 1] (1 = off)", self.top_p)
    if not isinstance(self.greedy, bool):
      bad("greedy", "a bool", self.greedy)
    if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
      bad("stop_token_ids", "a tuple of non-negative ints", self.stop_token_ids)
    if not isinstance(self.pad_id, int):
      bad("pad_id", "an int", self.pad_id)
    if self.prefill_chunk_size is not None and (
      not isinstance(self.prefill_chunk_size, int) or self.prefill_chunk_size < 1
    ):
      bad("prefill_chunk_size", "None or an int >= 1", self.prefill_chunk_size)
    if self.scan_layers not in (None, True, False):
      bad("scan_layers", "None, True or False", self.scan_layers)


@flax.struct.dataclass
class SampleOutput:
  """What the sampler returns (N = SamplingConfig.max_new_tokens).

  tokens:        int32[B, N], generated ids (the stop token included), pad_id after the end.
  logprobs:      float32[B, N], log softmax(logits / T)[token] of the full distribution; 0 after the end.
  mask:          bool[B, N], True on generated tokens (the first `lengths[b]` of row b).
  lengths:       int32[B], number of generated tokens.
  finish_reason: int32[B], a `FinishReason` value.
  """

  tokens: jax.Array
  logprobs: jax.Array
  mask: jax.Array
  lengths: jax.Array
  finish_reason: jax.Array


@flax.struct.dataclass
class DecodeState:
  """Carry of the decode loop (B rows, N = max new tokens).

  step:          int32 scalar, number of decode steps taken (= output column of the next token).
  cache:         `qwen.KVCache` holding the prompt and the tokens fed back so far.
  last_tokens:   int32[B], the row's newest token, not yet in the cache: the token sampled
                 at step - 1 (fed to the model next), or before the first sample the row's
                 last given token (-1 for a row given no token).
  positions:     int32[B], tokens in the row so far (context + given + generated): the RoPE
                 position of the next token; `last_tokens` sits at positions - 1.
  tokens, logprobs: the output buffers [B, N].
  done:          bool[B], the row has finished.
  lengths:       int32[B], tokens generated so far.
  finish_reason: int32[B].
  """

  step: jax.Array
  cache: qwen.KVCache
  last_tokens: jax.Array
  positions: jax.Array
  tokens: jax.Array
  logprobs: jax.Array
  done: jax.Array
  lengths: jax.Array
  finish_reason: jax.Array


@flax.struct.dataclass
class Context:
  """Each row's conversation so far, as model state, kept between turns.

  The conversation of row b (every token given to it and sampled for it, in
  order) is the `lengths[b]` tokens held in the cache followed by `pending[b]`
  when that is >= 0. The cache never holds a row's newest token: the next call
  writes it (at RoPE position `lengths[b]`) in front of the row's new tokens.

  cache:   `qwen.KVCache` with B rows and `capacity` slots. Row b's valid slots hold its
           first `lengths[b]` tokens in order (keys after RoPE); pad slots lie anywhere.
  lengths: int32[B], tokens of the row held in the cache = the RoPE position of the
           pending token (of the row's next token when nothing is pending). The pending
           token is NOT counted: the conversation has lengths + (pending >= 0) tokens.
  pending: int32[B], the row's newest token, not yet written to the cache (-1 = none).
  """

  cache: qwen.KVCache
  lengths: jax.Array
  pending: jax.Array

  @property
  def capacity(self) -> int:
    """Slots of the cache (static)."""
    return self.cache.valid.shape[1]


# ----------------------------------------------------------------------------------------------
# Token selection (one row; the sampler vmaps over rows).


def filter_logits(logits: jax.Array, *, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
  """Sets the logits outside the top-k / top-p (nucleus) set to -inf.

  With the tokens sorted by logit, most likely first, and p_i the softmax of
  the top-k survivors: token i is kept iff i < k and sum_{j<i} p_j < top_p (so
  the most likely token is always kept). Ties are broken towards lower ids.

  Args:
      logits: float32[V] (already divided by the temperature).
      top_k: int >= 0, 0 = no top-k cut.
      top_p: float in (0, 1], 1 = no nucleus cut.

  Returns:
      float32[V], the kept logits unchanged and -inf elsewhere.
  """
  chex.assert_rank(logits, 1)
  vocab = logits.shape[0]
  if top_k == 0 and top_p >= 1.0:
    return logits
  k = vocab if top_k == 0 else min(top_k, vocab)
  values, indices = jax.lax.top_k(logits, k)  # descending
  if top_p < 1.0:
    probs = jax.nn.softmax(values)
    mass_before = jnp.cumsum(probs) - probs
    values = jnp.where(mass_before < top_p, values, -jnp.inf)
  return jnp.full_like(logits, -jnp.inf).at[indices].set(values)


def select_token(
  key: jax.Array, logits: jax.Array, *, temperature: float, top_k: int, top_p: float, greedy: bool
) -> tuple[jax.Array, jax.Array]:
  """Picks the next token of one row and its log-prob under the unfiltered distribution.

  token = argmax(logits) if greedy else a draw from softmax(filter(logits / T));
  logp = log softmax(logits / T)[token].

  Args:
      key: PRNG key of this row and step (unused when greedy).
      logits: float32[V] next-token logits.
      temperature, top_k, top_p, greedy: see `SamplingConfig`.

  Returns:
      (token int32 scalar, logp float32 scalar).
  """
  chex.assert_rank(logits, 1)
  scaled = logits.astype(jnp.float32) / temperature
  if greedy:
    token = jnp.argmax(scaled)
  else:
    token = jax.random.categorical(key, filter_logits(scaled, top_k=top_k, top_p=top_p))
  logp = jax.nn.log_softmax(scaled)[token]
  return token.astype(jnp.int32), logp


# ----------------------------------------------------------------------------------------------
# The steps of the sampler (module-level; `make_sampler` and `make_continuer` bind them).


def prompt_positions(prompt_valid: jax.Array) -> jax.Array:
  """RoPE positions of a padded prompt: the number of valid tokens before each slot.

  positions[b, s] = sum_{j<s} valid[b, j] (pads get the position of the next valid token;
  they are never attended to).

  Args:
      prompt_valid: bool[B, P].

  Returns:
      int32[B, P].
  """
  chex.assert_rank(prompt_valid, 2)
  counts = jnp.cumsum(prompt_valid.astype(jnp.int32), axis=1)
  return counts - prompt_valid.astype(jnp.int32)


def _row_keys(rng: jax.Array, batch: int) -> jax.Array:
  """[B] typed keys from one key or from [B] keys (typed or raw uint32[B, 2])."""
  if not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    rng = jax.random.wrap_key_data(rng)
  if rng.ndim == 0:
    return jax.random.split(rng, batch)
  if rng.shape != (batch,):
    raise ValueError(
      f"rng must be one PRNG key or {batch} keys (one per row), got key shape {rng.shape}"
    )
  return rng


def _last_valid_slot(valid: jax.Array) -> jax.Array:
  """int32[B], the slot of each row's last True in bool[B, S] (0 for a row with none)."""
  s = valid.shape[1]
  return (s - 1 - jnp.argmax(valid[:, ::-1], axis=1)).astype(jnp.int32)


def constrain_cache(
  cache: qwen.KVCache, cache_sharding: Optional[Callable[[qwen.KVCache], Any]]
) -> qwen.KVCache:
  """`cache` under `with_sharding_constraint(cache_sharding(cache))`; unchanged when None."""
  if cache_sharding is None:
    return cache
  return jax.lax.with_sharding_constraint(cache, cache_sharding(cache))


def next_logits(params: Params, h: jax.Array, *, model_config: ModelConfig) -> jax.Array:
  """float32[B, V] next-token logits from final hidden states h [B, D]."""
  chex.assert_rank(h, 2)
  w = qwen.output_kernel(params, model_config).astype(h.dtype)
  return jnp.einsum("bd,dv->bv", h, w, preferred_element_type=jnp.float32)


def prefill(
  params: Params,
  cache: qwen.KVCache,
  ids: jax.Array,
  valid: jax.Array,
  positions: jax.Array,
  *,
  model_config: ModelConfig,
  chunk_size: Optional[int],
  constrain: Callable[[qwen.KVCache], qwen.KVCache],
) -> tuple[jax.Array, qwen.KVCache]:
  """Writes S tokens per row into the cache, `chunk_size` columns at a time.

  The full chunks run under one `lax.scan`, a shorter last chunk after it, so
  the call uses exactly S slots (from `cache.index`) whatever the chunk size.
  Only the hidden state of each row's last valid token goes through the output
  projection: float32 [B, S, V] is never built.

  Args:
      params: the model's params pytree.
      cache: `qwen.KVCache` with B rows and at least cache.index + S slots.
      ids: int32[B, S] token ids (values at invalid slots must be valid ids, e.g. 0).
      valid: bool[B, S], True on tokens to write (valid in the cache); the rest are pads.
      positions: int32[B, S] RoPE positions of the tokens.
      model_config: the `ModelConfig` (static).
      chunk_size: columns per model call (None = all S at once).
      constrain: applied to the cache after every write (sharding constraint or identity).

  Returns:
      (float32[B, V] logits after each row's last valid token, the cache with index += S).
  """
  chex.assert_rank([ids, valid, positions], 2)
  chex.assert_equal_shape([ids, valid, positions])
  b, s = ids.shape
  last = _last_valid_slot(valid)
  chunk = s if chunk_size is None else min(chunk_size, s)
  n_full, rest = divmod(s, chunk)

  def prefill_chunk(carry, chunk_inputs):
    """Runs one chunk of the tokens; keeps the hidden state of each row's last token."""
    cache, h_last = carry
    ids_c, valid_c, pos_c, start = chunk_inputs
    width = ids_c.shape[1]
    h, cache = qwen.hidden_states(params, ids_c, pos_c, valid_c, cache, config=model_config)
    cache = constrain(cache)
    local = jnp.clip(last - start, 0, width - 1)
    h_here = jnp.take_along_axis(h, local[:, None, None], axis=1)[:, 0]
    in_chunk = (last >= start) & (last < start + width)
    h_last = jnp.where(in_chunk[:, None], h_here.astype(h_last.dtype), h_last)
    return (cache, h_last), None

  def by_chunk(x):
    return x[:, : n_full * chunk].reshape(b, n_full, chunk).swapaxes(0, 1)

  carry = (cache, jnp.zeros((b, model_config.hidden_size), model_config.dtype))
  if n_full:
    starts = jnp.arange(n_full, dtype=jnp.int32) * chunk
    carry, _ = jax.lax.scan(
      prefill_chunk, carry, (by_chunk(ids), by_chunk(valid), by_chunk(positions), starts)
    )
  if rest:
    tail = slice(n_full * chunk, s)
    carry, _ = prefill_chunk(
      carry,
      (ids[:, tail], valid[:, tail], positions[:, tail], jnp.int32(n_full * chunk)),
    )
  cache, h_last = carry
  return next_logits(params, h_last, model_config=model_config), cache


def emit(
  state: DecodeState,
  logits: jax.Array,
  row_keys: jax.Array,
  stops: jax.Array,
  limits: jax.Array,
  *,
  sampling_config: SamplingConfig,
) -> DecodeState:
  """Chooses the token of column `state.step` for the rows still running and records it.

  Row b draws with `fold_in(row_keys[b], state.step)`; a row finishes on one of
  its stop ids (STOP) or when it has `limits[b]` tokens (LENGTH).

  Args:
      state: the `DecodeState` before the step.
      logits: float32[B, V] next-token logits of every row.
      row_keys: [B] typed PRNG keys.
      stops: int32[B, K] stop ids per row (-1 = none).
      limits: int32[B] most new tokens per row.
      sampling_config: the `SamplingConfig` (static).

  Returns:
      The `DecodeState` after the step (step + 1).
  """
  sc = sampling_config
  choose = jax.vmap(
    functools.partial(
      select_token, temperature=sc.temperature, top_k=sc.top_k, top_p=sc.top_p, greedy=sc.greedy
    )
  )
  keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys, state.step)
  token, logp = choose(keys, logits)
  active = ~state.done
  col = state.step
  tokens = state.tokens.at[:, col].set(jnp.where(active, token, sc.pad_id))
  logprobs = state.logprobs.at[:, col].set(jnp.where(active, logp, 0.0))
  lengths = state.lengths + active.astype(jnp.int32)
  hit_stop = active & jnp.any(token[:, None] == stops, axis=1)
  hit_length = active & ~hit_stop & (lengths >= limits)
  finish = jnp.where(hit_stop, int(FinishReason.STOP), state.finish_reason)
  finish = jnp.where(hit_length, int(FinishReason.LENGTH), finish)
  return state.replace(
    step=state.step + 1,
    last_tokens=jnp.where(active, token, state.last_tokens),
    positions=state.positions + active.astype(jnp.int32),
    tokens=tokens,
    logprobs=logprobs,
    done=state.done | hit_stop | hit_length,
    lengths=lengths,
    finish_reason=finish,
  )


def decode_step(
  state: DecodeState,
  params: Params,
  row_keys: jax.Array,
  stops: jax.Array,
  limits: jax.Array,
  *,
  model_config: ModelConfig,
  sampling_config: SamplingConfig,
  constrain: Callable[[qwen.KVCache], qwen.KVCache],
) -> DecodeState:
  """Feeds each running row's last token to the model (one cache slot) and emits the next.

  Finished rows ride along: their slot is written invalid. See `emit` for the arguments.
  """
  running = ~state.done
  h, cache = qwen.hidden_states(
    params,
    jnp.maximum(state.last_tokens, 0)[:, None],
    state.positions[:, None] - 1,
    running[:, None],
    state.cache,
    config=model_config,
  )
  state = state.replace(cache=constrain(cache))
  logits = next_logits(params, h[:, 0], model_config=model_config)
  return emit(state, logits, row_keys, stops, limits, sampling_config=sampling_config)


def decode_loop(
  params: Params,
  state: DecodeState,
  row_keys: jax.Array,
  stops: jax.Array,
  limits: jax.Array,
  *,
  model_config: ModelConfig,
  sampling_config: SamplingConfig,
  constrain: Callable[[qwen.KVCache], qwen.KVCache],
) -> DecodeState:
  """`decode_step` under `lax.while_loop` until every row is done or N tokens were emitted.

  Each iteration uses one cache slot (for all rows): at most N - 1 of them after
  the first `emit`. See `emit` for the arguments.
  """

  def still_running(state: DecodeState):
    return (state.step < sampling_config.max_new_tokens) & ~jnp.all(state.done)

  step = functools.partial(
    decode_step,
    params=params,
    row_keys=row_keys,
    stops=stops,
    limits=limits,
    model_config=model_config,
    sampling_config=sampling_config,
    constrain=constrain,
  )
  return jax.lax.while_loop(still_running, step, state)


def sample_from_context(
  params: Params,
  context: Context,
  ids: jax.Array,
  valid: jax.Array,
  row_keys: jax.Array,
  stops: jax.Array,
  limits: jax.Array,
  *,
  model_config: ModelConfig,
  sampling_config: SamplingConfig,
  constrain: Callable[[qwen.KVCache], qwen.KVCache],
  with_pending: bool,
) -> tuple[SampleOutput, Context]:
  """Writes each row's given tokens into its context, then samples its reply.

  The tokens given to row b are its pending token (when `with_pending` and
  pending[b] >= 0), then its valid `ids`; they go to the cache at RoPE
  positions lengths[b], lengths[b] + 1, ... A row that samples (limits[b] > 0
  and at least one given token) emits up to limits[b] tokens; all but the
  last enter the cache, the last becomes its pending token. A row that does
  not sample writes all its given tokens but the last, which becomes (or stays)
  its pending token; a row given nothing is unchanged.

  Args:
      params: the model's params pytree.
      context: the `Context` of the B rows.
      ids: int32[B, S] new tokens, padded anywhere.
      valid: bool[B, S], True on new tokens.
      row_keys: [B] typed PRNG keys.
      stops: int32[B, K] stop ids per row (-1 = none).
      limits: int32[B] most new tokens per row, in [0, N].
      model_config, sampling_config: static configs (`sampling_config.scan_layers` applied).
      constrain: sharding constraint of the cache (or identity).
      with_pending: static; False skips the pending column (the context must have no
          pending token: `make_sampler` starts from an empty context).

  Returns:
      (SampleOutput, the new Context). The call uses S (+ 1 with_pending) slots for the
      prefill and one per decode step (at most max(limits) - 1) from cache.index.
  """
  sc = sampling_config
  b = ids.shape[0]
  n_new = sc.max_new_tokens
  if with_pending:
    has_pending = context.pending >= 0
    ids = jnp.concatenate([jnp.maximum(context.pending, 0)[:, None], ids], axis=1)
    valid = jnp.concatenate([has_pending[:, None], valid], axis=1)
  given = jnp.sum(valid.astype(jnp.int32), axis=1)
  has_tokens = given > 0
  limits = jnp.where(has_tokens, limits, 0)
  sampling_rows = limits > 0
  last = _last_valid_slot(valid)
  last_given = jnp.where(has_tokens, jnp.take_along_axis(ids, last[:, None], axis=1)[:, 0], -1)
  # A row that does not sample keeps its last given token out of the cache (pending), so that
  # its next call can start from it with no new token.
  held_back = ~sampling_rows[:, None] & (jnp.arange(ids.shape[1])[None, :] == last[:, None])
  positions = context.lengths[:, None] + prompt_positions(valid)
  logits, cache = prefill(
    params,
    constrain(context.cache),
    ids,
    valid & ~held_back,
    positions,
    model_config=model_config,
    chunk_size=sc.prefill_chunk_size,
    constrain=constrain,
  )
  state = DecodeState(
    step=jnp.zeros((), jnp.int32),
    cache=cache,
    last_tokens=last_given,
    positions=context.lengths + given,
    tokens=jnp.full((b, n_new), sc.pad_id, jnp.int32),
    logprobs=jnp.zeros((b, n_new), jnp.float32),
    done=~sampling_rows,
    lengths=jnp.zeros((b,), jnp.int32),
    finish_reason=jnp.full((b,), int(FinishReason.LENGTH), jnp.int32),
  )
  state = emit(state, logits, row_keys, stops, limits, sampling_config=sc)
  state = decode_loop(
    params,
    state,
    row_keys,
    stops,
    limits,
    model_config=model_config,
    sampling_config=sc,
    constrain=constrain,
  )
  out = SampleOutput(
    tokens=state.tokens,
    logprobs=state.logprobs,
    mask=jnp.arange(n_new)[None, :] < state.lengths[:, None],
    lengths=state.lengths,
    finish_reason=state.finish_reason,
  )
  pending = state.last_tokens
  context = Context(
    cache=state.cache, lengths=state.positions - (pending >= 0).astype(jnp.int32), pending=pending
  )
  return out, context


def _stops_and_limits(
  sampling_config: SamplingConfig, batch: int, stop_tokens, max_new_tokens
) -> tuple[jax.Array, jax.Array]:
  """(int32[B, K] stop ids: the row's own then the config's; int32[B] limits in [0, N])."""
  shared = jnp.asarray(sampling_config.stop_token_ids, jnp.int32).reshape(1, -1)
  shared = jnp.broadcast_to(shared, (batch, shared.shape[1]))
  if stop_tokens is None:
    stops = shared
  else:
    chex.assert_rank(stop_tokens, 2)
    chex.assert_type(stop_tokens, int)
    chex.assert_axis_dimension(stop_tokens, 0, batch)
    stops = jnp.concatenate([stop_tokens.astype(jnp.int32), shared], axis=1)
  n_new = sampling_config.max_new_tokens
  if max_new_tokens is None:
    limits = jnp.full((batch,), n_new, jnp.int32)
  else:
    chex.assert_shape(max_new_tokens, (batch,))
    chex.assert_type(max_new_tokens, int)
    limits = jnp.clip(max_new_tokens.astype(jnp.int32), 0, n_new)
  return stops, limits


def _check_configs(model_config, sampling_config) -> ModelConfig:
  """Type checks; returns the model config with `sampling_config.scan_layers` applied."""
  if not isinstance(model_config, ModelConfig):
    raise TypeError(f"model_config must be a ModelConfig, got {type(model_config).__name__}")
  if not isinstance(sampling_config, SamplingConfig):
    raise TypeError(
      f"sampling_config must be a SamplingConfig, got {type(sampling_config).__name__}"
    )
  if sampling_config.scan_layers is not None:
    model_config = model_config.replace(scan_layers=sampling_config.scan_layers)
  return model_config


# ----------------------------------------------------------------------------------------------
# One-shot sampling.


def _sample(
  params,
  prompt_ids,
  prompt_valid,
  rng,
  stop_tokens=None,
  max_new_tokens=None,
  *,
  model_config: ModelConfig,
  sampling_config: SamplingConfig,
  cache_sharding,
) -> SampleOutput:
  """`make_sampler`'s function: an empty context of P' + N slots, then one sampling call.

  The prompt is padded at the end to P' (a multiple of the prefill chunk), so that every
  prefill chunk has the same shape.
  """
  chex.assert_rank([prompt_ids, prompt_valid], 2)
  chex.assert_equal_shape([prompt_ids, prompt_valid])
  chex.assert_type([prompt_ids, prompt_valid], [int, bool])
  sc = sampling_config
  b, p = prompt_ids.shape
  row_keys = _row_keys(rng, b)
  stops, limits = _stops_and_limits(sc, b, stop_tokens, max_new_tokens)
  chunk = p if sc.prefill_chunk_size is None else min(sc.prefill_chunk_size, p)
  pad = -(-p // chunk) * chunk - p
  prompt_ids = jnp.pad(prompt_ids.astype(jnp.int32), ((0, 0), (0, pad)))
  prompt_valid = jnp.pad(prompt_valid, ((0, 0), (0, pad)))
  context = init_context(model_config, b, p + pad + sc.max_new_tokens)
  out, _ = sample_from_context(
    params,
    context,
    prompt_ids,
    prompt_valid,
    row_keys,
    stops,
    limits,
    model_config=model_config,
    sampling_config=sc,
    constrain=functools.partial(constrain_cache, cache_sharding=cache_sharding),
    with_pending=False,
  )
  return out


def make_sampler(
  model_config: ModelConfig,
  sampling_config: SamplingConfig,
  *,
  cache_sharding: Optional[Callable[[qwen.KVCache], Any]] = None,
  jit: bool = True,
):
  """Builds the sampling function for one model config and one set of decoding hyper-parameters.

  Args:
      model_config: the policy's `ModelConfig` (static).
      sampling_config: the `SamplingConfig` (static).
      cache_sharding: optional function KVCache -> pytree of `Sharding` (e.g.
          `functools.partial(seeupo_jax.sharding.cache_shardings, mesh=mesh)`);
          the cache is constrained to it after every write. Params and inputs
          keep the shardings they arrive with; nothing here names a device.
      jit: return the function under `jax.jit` (False for debugging).

  Returns:
      sample(params, prompt_ids, prompt_valid, rng, stop_tokens=None,
      max_new_tokens=None) -> SampleOutput, where
        params: the model's params pytree.
        prompt_ids: int32[B, P] prompts, padded (left padding recommended).
        prompt_valid: bool[B, P], True on real tokens; every row needs at least one
          (a row with none generates nothing).
        rng: one PRNG key, or [B] keys (typed, or raw uint32[B, 2]) one per row.
        stop_tokens: optional int32[B, K] per-row stop ids, -1 = unused slot;
          `sampling_config.stop_token_ids` apply to every row as well.
        max_new_tokens: optional int32[B] per-row limits, clipped to
          [0, sampling_config.max_new_tokens]; None = the config's value.
  """
  sample = functools.partial(
    _sample,
    model_config=_check_configs(model_config, sampling_config),
    sampling_config=sampling_config,
    cache_sharding=cache_sharding,
  )
  return jax.jit(sample) if jit else sample


# ----------------------------------------------------------------------------------------------
# Multi-turn: continue each row's conversation from its kept context.


def init_context(model_config: ModelConfig, batch_size: int, capacity: int) -> Context:
  """An empty context: `capacity` invalid slots per row, lengths 0, nothing pending.

  Args:
      model_config: the policy's `ModelConfig` (the cache has its layers, kv heads and dtype).
      batch_size: B rows.
      capacity: slots per row; every call uses `slots_needed(...)` of them.
  """
  return Context(
    cache=qwen.init_cache(model_config, batch_size, capacity),
    lengths=jnp.zeros((batch_size,), jnp.int32),
    pending=jnp.full((batch_size,), -1, jnp.int32),
  )


def slots_needed(context: Context, new_tokens: int, max_new_tokens: int) -> int:
  """Cache slots the next `continue_sample` call uses beyond `context.cache.index` (host side).

  The prefill writes one column for the pending tokens plus the S columns of
  `new_ids` (pads included); decoding writes one slot per step after the first
  token, at most max_new_tokens - 1 (the last token stays pending). So the
  call needs S + max(max_new_tokens, 1) slots, whatever the prefill chunk size;
  compact the context (or fail) when cache.index + that exceeds the capacity.

  Args:
      context: the `Context` the call will continue (its shape is checked).
      new_tokens: S, the width of `new_ids` (columns, pads included).
      max_new_tokens: the most tokens any row may sample in the call.

  Returns:
      int, the number of slots.
  """
  if not isinstance(context, Context):
    raise TypeError(f"context must be a Context, got {type(context).__name__}")
  if new_tokens < 0 or max_new_tokens < 0:
    raise ValueError(
      f"new_tokens and max_new_tokens must be >= 0, got {new_tokens}, {max_new_tokens}"
    )
  return int(new_tokens) + max(int(max_new_tokens), 1)


def compact_context(context: Context) -> Context:
  """Moves each row's valid slots to the left (stable order); index = the most valid slots of a row.

  Attention does not depend on where a key sits (the keys already carry RoPE;
  positions come from `lengths`), so a later call gives the same result (up to
  the order of float sums) with more free slots. Jit-friendly (one gather of
  the cache).

  Args:
      context: a `Context` of B rows.

  Returns:
      The compacted `Context` (lengths and pending unchanged).
  """
  cache = context.cache
  t = cache.valid.shape[1]
  valid = cache.valid & (jnp.arange(t)[None, :] < cache.index)
  order = jnp.argsort(~valid, axis=1, stable=True)  # valid slots first, in their order
  count = jnp.sum(valid.astype(jnp.int32), axis=1)

  def gather(stack):  # [L, B, K, T, hd]
    return jnp.take_along_axis(stack, order[None, :, None, :, None], axis=3)

  return context.replace(
    cache=qwen.KVCache(
      keys=gather(cache.keys),
      values=gather(cache.values),
      valid=jnp.arange(t)[None, :] < count[:, None],
      index=jnp.max(count).astype(jnp.int32),
    )
  )


def grow_context(context: Context, capacity: int) -> Context:
  """The same context with `capacity` slots (>= the current capacity); new slots are invalid.

  Lets a caller start with a cache sized to the first turn and grow it (in a few
  bucketed sizes, each one compile) as conversations get longer: every decode
  step attends over all slots, so a cache sized to the longest possible episode
  costs its full width from the first token.

  Args:
      context: a `Context`.
      capacity: the new number of slots (static under jit).
  """
  extra = capacity - context.capacity
  if extra < 0:
    raise ValueError(f"grow_context: capacity {capacity} < the current {context.capacity}")
  if extra == 0:
    return context
  cache = context.cache
  pad = ((0, 0), (0, 0), (0, 0), (0, extra), (0, 0))
  return context.replace(
    cache=qwen.KVCache(
      keys=jnp.pad(cache.keys, pad),
      values=jnp.pad(cache.values, pad),
      valid=jnp.pad(cache.valid, ((0, 0), (0, extra))),
      index=cache.index,
    )
  )


def take_context_rows(context: Context, rows: jax.Array) -> Context:
  """A context of R rows: rows[r] of `context` (to drop finished episodes, or reorder).

  Args:
      context: a `Context` of B rows.
      rows: int32[R], row indices into `context` (repeats allowed).

  Returns:
      The `Context` of R rows (same capacity and cache index).
  """
  chex.assert_rank(rows, 1)
  chex.assert_type(rows, int)
  cache = context.cache
  return Context(
    cache=qwen.KVCache(
      keys=jnp.take(cache.keys, rows, axis=1),
      values=jnp.take(cache.values, rows, axis=1),
      valid=jnp.take(cache.valid, rows, axis=0),
      index=cache.index,
    ),
    lengths=jnp.take(context.lengths, rows),
    pending=jnp.take(context.pending, rows),
  )


def _continue_sample(
  params,
  context: Context,
  new_ids,
  new_valid,
  rng,
  stop_tokens=None,
  max_new_tokens=None,
  *,
  model_config: ModelConfig,
  sampling_config: SamplingConfig,
  cache_sharding,
) -> tuple[SampleOutput, Context]:
  """`make_continuer`'s traced function (arguments as `continue_sample`)."""
  chex.assert_rank([new_ids, new_valid], 2)
  chex.assert_equal_shape([new_ids, new_valid])
  chex.assert_type([new_ids, new_valid], [int, bool])
  b = new_ids.shape[0]
  chex.assert_shape([context.lengths, context.pending], (b,))
  chex.assert_shape(context.cache.valid, (b, None))
  stops, limits = _stops_and_limits(sampling_config, b, stop_tokens, max_new_tokens)
  return sample_from_context(
    params,
    context,
    new_ids.astype(jnp.int32),
    new_valid,
    _row_keys(rng, b),
    stops,
    limits,
    model_config=model_config,
    sampling_config=sampling_config,
    constrain=functools.partial(constrain_cache, cache_sharding=cache_sharding),
    with_pending=True,
  )


def _check_room(context: Context, new_tokens: int, max_new_tokens, sampling_config) -> None:
  """Raises when the call could write past the cache (only for concrete, untraced inputs)."""
  index = context.cache.index
  if isinstance(index, jax.core.Tracer) or isinstance(max_new_tokens, jax.core.Tracer):
    return
  most = sampling_config.max_new_tokens
  if max_new_tokens is not None:
    most = min(most, max(int(jnp.max(jnp.asarray(max_new_tokens))), 0))
  need = slots_needed(context, new_tokens, most)
  if int(index) + need > context.capacity:
    raise ValueError(
      f"the context has {context.capacity - int(index)} free slots (index {int(index)} of "
      f"{context.capacity}) but this call needs {need} (slots_needed: {new_tokens} new "
      f"columns, up to {most} new tokens); compact_context(...) or a larger capacity"
    )


def make_continuer(
  model_config: ModelConfig,
  sampling_config: SamplingConfig,
  *,
  cache_sharding: Optional[Callable[[qwen.KVCache], Any]] = None,
  jit: bool = True,
):
  """Builds the multi-turn sampling function: continue each row's conversation from its context.

  Args:
      model_config, sampling_config, cache_sharding, jit: as in `make_sampler`.

  Returns:
      continue_sample(params, context, new_ids, new_valid, rng, stop_tokens=None,
      max_new_tokens=None) -> (SampleOutput, Context), where
        params: the model's params pytree.
        context: the `Context` of B rows (`init_context` on the first turn).
        new_ids: int32[B, S] each row's NEW tokens (environment observation and the
          generation prompt; on the first turn the whole prompt), padded anywhere
          (left padding recommended).
        new_valid: bool[B, S], True on new tokens. A row may have none if it has a
          pending token (a row with neither generates nothing).
        rng, stop_tokens, max_new_tokens: as in `make_sampler`'s `sample`
          (max_new_tokens 0: the row samples nothing, a cheap passenger).
      The call writes each row's pending token, then its new tokens, into the cache
      at RoPE positions lengths, lengths + 1, ..., then samples as `sample` does
      (same stop / limit / finish_reason / log-prob semantics, row b's token at step
      t drawn with fold_in(row_key_b, t)). The returned context holds the row's
      whole conversation: its last token (the last sampled one; for a row that
      sampled nothing, its last given token) is pending, the rest in the cache.
      Each call uses `slots_needed(context, S, max new tokens)` slots from
      cache.index; with concrete inputs the function raises ValueError before it
      would run out (one scalar read of cache.index).
  """
  step = functools.partial(
    _continue_sample,
    model_config=_check_configs(model_config, sampling_config),
    sampling_config=sampling_config,
    cache_sharding=cache_sharding,
  )
  run = jax.jit(step) if jit else step

  def continue_sample(
    params, context, new_ids, new_valid, rng, stop_tokens=None, max_new_tokens=None
  ) -> tuple[SampleOutput, Context]:
    _check_room(context, new_ids.shape[1], max_new_tokens, sampling_config)
    return run(params, context, new_ids, new_valid, rng, stop_tokens, max_new_tokens)

  return continue_sample
