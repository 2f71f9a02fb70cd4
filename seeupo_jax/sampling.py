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
  last_tokens:   int32[B], the token sampled at step - 1 (fed to the model next).
  positions:     int32[B], tokens in the row so far (valid prompt + generated): the RoPE
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
# The sampler.


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
        prompt_valid: bool[B, P], True on real tokens; every row needs at least one.
        rng: one PRNG key, or [B] keys (typed, or raw uint32[B, 2]) one per row.
        stop_tokens: optional int32[B, K] per-row stop ids, -1 = unused slot;
          `sampling_config.stop_token_ids` apply to every row as well.
        max_new_tokens: optional int32[B] per-row limits, clipped to
          [0, sampling_config.max_new_tokens]; None = the config's value.
  """
  if not isinstance(model_config, ModelConfig):
    raise TypeError(f"model_config must be a ModelConfig, got {type(model_config).__name__}")
  if not isinstance(sampling_config, SamplingConfig):
    raise TypeError(
      f"sampling_config must be a SamplingConfig, got {type(sampling_config).__name__}"
    )
  sc = sampling_config
  if sc.scan_layers is not None:
    model_config = model_config.replace(scan_layers=sc.scan_layers)
  n_new = sc.max_new_tokens
  choose = jax.vmap(
    functools.partial(
      select_token, temperature=sc.temperature, top_k=sc.top_k, top_p=sc.top_p, greedy=sc.greedy
    )
  )
  shared_stops = jnp.asarray(sc.stop_token_ids, jnp.int32).reshape(1, -1)

  def constrain_cache(cache):
    if cache_sharding is None:
      return cache
    return jax.lax.with_sharding_constraint(cache, cache_sharding(cache))

  def _prefill_chunks(p):
    """(chunk length, number of chunks) of a prompt of length p."""
    chunk = p if sc.prefill_chunk_size is None else min(sc.prefill_chunk_size, p)
    return chunk, -(-p // chunk)

  def next_logits(params, h):
    """float32[B, V] logits from final hidden states h [B, D]."""
    w = qwen.output_kernel(params, model_config).astype(h.dtype)
    return jnp.einsum("bd,dv->bv", h, w, preferred_element_type=jnp.float32)

  def prefill(params, prompt_ids, prompt_valid, positions, cache):
    """Writes the prompt into the cache; returns (logits at each row's last valid token, cache)."""
    b, p = prompt_ids.shape
    last = p - 1 - jnp.argmax(prompt_valid[:, ::-1], axis=1)  # [B] slot of the last valid token
    chunk, n_chunks = _prefill_chunks(p)
    pad = n_chunks * chunk - p
    if pad:  # pad at the end with invalid slots: they stay invalid in the cache
      prompt_ids = jnp.pad(prompt_ids, ((0, 0), (0, pad)))
      prompt_valid = jnp.pad(prompt_valid, ((0, 0), (0, pad)))
      positions = jnp.pad(positions, ((0, 0), (0, pad)))

    def prefill_chunk(carry, chunk_inputs):
      """Runs one chunk of the prompt; keeps the hidden state of each row's last token."""
      cache, h_last = carry
      ids, valid, pos, start = chunk_inputs
      h, cache = qwen.hidden_states(params, ids, pos, valid, cache, config=model_config)
      cache = constrain_cache(cache)
      local = jnp.clip(last - start, 0, chunk - 1)
      h_here = jnp.take_along_axis(h, local[:, None, None], axis=1)[:, 0]
      in_chunk = (last >= start) & (last < start + chunk)
      h_last = jnp.where(in_chunk[:, None], h_here.astype(h_last.dtype), h_last)
      return (cache, h_last), None

    def by_chunk(x):
      return x.reshape(b, n_chunks, chunk).swapaxes(0, 1)

    starts = jnp.arange(n_chunks, dtype=jnp.int32) * chunk
    h0 = jnp.zeros((b, model_config.hidden_size), model_config.dtype)
    (cache, h_last), _ = jax.lax.scan(
      prefill_chunk,
      (cache, h0),
      (by_chunk(prompt_ids), by_chunk(prompt_valid), by_chunk(positions), starts),
    )
    return next_logits(params, h_last), cache

  def emit(state: DecodeState, logits, row_keys, stops, limits) -> DecodeState:
    """Chooses the token of column `state.step` for the rows still running and records it."""
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

  def sample(
    params, prompt_ids, prompt_valid, rng, stop_tokens=None, max_new_tokens=None
  ) -> SampleOutput:
    chex.assert_rank([prompt_ids, prompt_valid], 2)
    chex.assert_equal_shape([prompt_ids, prompt_valid])
    chex.assert_type([prompt_ids, prompt_valid], [int, bool])
    b, p = prompt_ids.shape
    prompt_ids = prompt_ids.astype(jnp.int32)
    row_keys = _row_keys(rng, b)
    if stop_tokens is None:
      stops = jnp.broadcast_to(shared_stops, (b, shared_stops.shape[1]))
    else:
      chex.assert_rank(stop_tokens, 2)
      chex.assert_type(stop_tokens, int)
      chex.assert_axis_dimension(stop_tokens, 0, b)
      stops = jnp.concatenate(
        [stop_tokens.astype(jnp.int32), jnp.broadcast_to(shared_stops, (b, shared_stops.shape[1]))],
        axis=1,
      )
    if max_new_tokens is None:
      limits = jnp.full((b,), n_new, jnp.int32)
    else:
      chex.assert_shape(max_new_tokens, (b,))
      chex.assert_type(max_new_tokens, int)
      limits = jnp.clip(max_new_tokens.astype(jnp.int32), 0, n_new)

    # Prefill.
    positions = prompt_positions(prompt_valid)
    chunk, n_chunks = _prefill_chunks(p)
    cache = constrain_cache(qwen.init_cache(model_config, b, chunk * n_chunks + n_new))
    logits, cache = prefill(params, prompt_ids, prompt_valid, positions, cache)
    no_room = limits <= 0
    state = DecodeState(
      step=jnp.zeros((), jnp.int32),
      cache=cache,
      last_tokens=jnp.zeros((b,), jnp.int32),
      positions=jnp.sum(prompt_valid.astype(jnp.int32), axis=1),
      tokens=jnp.full((b, n_new), sc.pad_id, jnp.int32),
      logprobs=jnp.zeros((b, n_new), jnp.float32),
      done=no_room,
      lengths=jnp.zeros((b,), jnp.int32),
      finish_reason=jnp.full((b,), int(FinishReason.LENGTH), jnp.int32),
    )
    state = emit(state, logits, row_keys, stops, limits)

    # Decode: feed the last token back, choose the next one, until every row is done.
    def still_running(state: DecodeState):
      return (state.step < n_new) & ~jnp.all(state.done)

    def decode_step(state: DecodeState) -> DecodeState:
      running = ~state.done
      h, cache = qwen.hidden_states(
        params,
        state.last_tokens[:, None],
        state.positions[:, None] - 1,
        running[:, None],
        state.cache,
        config=model_config,
      )
      state = state.replace(cache=constrain_cache(cache))
      return emit(state, next_logits(params, h[:, 0]), row_keys, stops, limits)

    state = jax.lax.while_loop(still_running, decode_step, state)
    mask = jnp.arange(n_new)[None, :] < state.lengths[:, None]
    return SampleOutput(
      tokens=state.tokens,
      logprobs=state.logprobs,
      mask=mask,
      lengths=state.lengths,
      finish_reason=state.finish_reason,
    )

  return jax.jit(sample) if jit else sample
