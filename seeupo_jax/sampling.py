"""Jitted KV-cache sampler over a paged cache: every row has its own length.

Two ways in, one set of steps:

* `make_sampler(model_config, sampling_config)` binds the hyper-parameters and returns one
  jitted one-shot function

      sample(params, prompt_ids, prompt_valid, rng, stop_tokens=None, max_new_tokens=None)
          -> SampleOutput(tokens, logprobs, mask, lengths, finish_reason)

  (the session below started from an empty context, inside one compiled program).

* `SamplerSession(model_config, sampling_config, SessionConfig(rows=S))` is the decode batch
  of the rollout engine: S rows that episodes take and give back, a pool of KV pages, and two
  compiled programs, `prefill` (write the tokens that arrived for some rows, chunked; rows
  whose input is complete sample their first token) and `decode` (k steps of every decoding
  row, then one host sync). A row's tokens go where its own context ends: nothing pads one
  row to another, no index is shared.

Prompts of different lengths share one batch (pad anywhere; RoPE positions count only valid
tokens). Each sampled token's log-prob is taken under the distribution it was drawn from,
softmax(filter(logits / temperature)) (`filter_logits`: top-k, then top-p): the behaviour
policy of an importance weight (`LearnerConfig.tis`). With top-k and top-p off (the training
default) that is the full tempered distribution, so it equals the teacher-forced
`qwen.token_logprobs(..., temperature=temperature)` of the same sequence (the learner's
`sample_logp_gap_*` metrics check it); with them on it is log p_full - log(kept mass), and the
gap metrics show the filter's share. Greedy decoding takes the argmax and reports the log-prob
of the full distribution at `temperature`.

Randomness: a row draws the token of its reply's step t with `fold_in(reply_key, t)`. The
one-shot sampler's reply keys are `rng` itself ([B] keys) or `split(rng, B)` (one key); a
session's are given per reply (`SamplerSession.give`). So a reply depends only on its context,
its key and the params, not on the rest of the batch, the row it sits in, or when it ran.

The module-level steps (`write_tokens` -> `begin_replies` -> `decode_loop`, each over a
`DecodeRows` state and a page table) are shared by both entry points.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any, Callable, NamedTuple, Optional, Sequence

import chex
import flax
import jax
import jax.numpy as jnp
import numpy as np

from seeupo_jax import fields
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

  max_new_tokens: int = fields.field(fields.int_at_least(1))
  temperature: float = fields.field(
    fields.described(fields.number_above(0), "use greedy=True for argmax decoding"), 1.0
  )
  top_k: int = fields.field(fields.described(fields.int_at_least(0), "0: off"), 0)
  top_p: float = fields.field(
    fields.described(fields.number_in(0, 1, open_low=True), "1: off"), 1.0
  )
  greedy: bool = fields.field(fields.BOOL, False)
  stop_token_ids: tuple[int, ...] = fields.field(fields.tuple_of(fields.int_at_least(0)), ())
  pad_id: int = fields.field(fields.INT, 0)
  prefill_chunk_size: Optional[int] = fields.field(fields.optional(fields.int_at_least(1)), None)
  scan_layers: Optional[bool] = fields.field(fields.optional(fields.BOOL), None)

  def __post_init__(self):
    fields.check(self)


@flax.struct.dataclass
class SampleOutput:
  """What the sampler returns (N = SamplingConfig.max_new_tokens).

  tokens:        int32[B, N], generated ids (the stop token included), pad_id after the end.
  logprobs:      float32[B, N], log softmax(filter(logits / T))[token], the distribution sampled
                 from (the full one without top-k/top-p, and when greedy); 0 after the end.
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
class DecodeRows:
  """Device state of a batch of S decode rows (N = SamplingConfig.max_new_tokens).

  A row's context is the `lengths[b]` tokens in its pages followed by `last_tokens[b]`, its
  newest token, which the cache does not hold yet (the next decode step, or the caller's next
  given tokens, writes it).

  cache:         the `qwen.PagedKVCache` pool (shared by the rows through the page table).
  lengths:       int32[S], tokens of the row in the cache (= the position of its next token).
  last_tokens:   int32[S], the row's newest token, not in the cache (-1: none).
  keys:          uint32[S, 2], raw PRNG key of the row's current reply.
  decoding:      bool[S], the row is sampling its reply.
  steps:         int32[S], tokens sampled in the current reply (= its next output column).
  limits:        int32[S], most tokens of the current reply.
  stops:         int32[S, K], stop ids of the current reply (-1: unused).
  tokens:        int32[S, N], the current reply's tokens (pad_id after its end).
  logprobs:      float32[S, N], their log-probs (0 after the end).
  finish_reason: int32[S], a `FinishReason` value once the reply has ended.
  """

  cache: qwen.PagedKVCache
  lengths: jax.Array
  last_tokens: jax.Array
  keys: jax.Array
  decoding: jax.Array
  steps: jax.Array
  limits: jax.Array
  stops: jax.Array
  tokens: jax.Array
  logprobs: jax.Array
  finish_reason: jax.Array


def init_rows(
  cache: qwen.PagedKVCache, num_rows: int, num_stops: int, max_new_tokens: int, pad_id: int
) -> DecodeRows:
  """S idle rows (length 0, nothing pending) over `cache`."""
  s, n = num_rows, max_new_tokens
  return DecodeRows(
    cache=cache,
    lengths=jnp.zeros((s,), jnp.int32),
    last_tokens=jnp.full((s,), -1, jnp.int32),
    keys=jnp.zeros((s, 2), jnp.uint32),
    decoding=jnp.zeros((s,), bool),
    steps=jnp.zeros((s,), jnp.int32),
    limits=jnp.zeros((s,), jnp.int32),
    stops=jnp.full((s, num_stops), -1, jnp.int32),
    tokens=jnp.full((s, n), pad_id, jnp.int32),
    logprobs=jnp.zeros((s, n), jnp.float32),
    finish_reason=jnp.full((s,), int(FinishReason.LENGTH), jnp.int32),
  )


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
  """Picks the next token of one row and its log-prob under the distribution drawn from.

  z = logits / T
  sampled: token ~ softmax(filter(z)),  logp = log softmax(filter(z))[token]
           (`sampling_probs.sampled_logprob`; = log softmax(z)[token] with top-k/top-p off)
  greedy:  token = argmax(z),           logp = log softmax(z)[token]

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
    logp = jax.nn.log_softmax(scaled)[token]
  else:
    filtered = filter_logits(scaled, top_k=top_k, top_p=top_p)
    token = jax.random.categorical(key, filtered)
    logp = jax.nn.log_softmax(filtered)[token]
  return token.astype(jnp.int32), logp


# ----------------------------------------------------------------------------------------------
# The steps of the sampler (module-level; `make_sampler` and `SamplerSession` bind them).


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


def next_logits(params: Params, h: jax.Array, *, model_config: ModelConfig) -> jax.Array:
  """float32[B, V] next-token logits from final hidden states h [B, D]."""
  chex.assert_rank(h, 2)
  w = qwen.output_kernel(params, model_config).astype(h.dtype)
  return jnp.einsum("bd,dv->bv", h, w, preferred_element_type=jnp.float32)


def constrain_cache(
  cache: qwen.PagedKVCache, cache_sharding: Optional[Callable[[qwen.PagedKVCache], Any]]
) -> qwen.PagedKVCache:
  """`cache` under `with_sharding_constraint(cache_sharding(cache))`; unchanged when None."""
  if cache_sharding is None:
    return cache
  return jax.lax.with_sharding_constraint(cache, cache_sharding(cache))


def write_tokens(
  params: Params,
  cache: qwen.PagedKVCache,
  page_table: jax.Array,
  lengths: jax.Array,
  ids: jax.Array,
  valid: jax.Array,
  *,
  model_config: ModelConfig,
  chunk_size: Optional[int],
  constrain: Callable[[qwen.PagedKVCache], qwen.PagedKVCache],
) -> tuple[jax.Array, qwen.PagedKVCache, jax.Array]:
  """Writes each row's valid tokens after its context, `chunk_size` columns at a time.

  Row b's valid tokens go to positions lengths[b], lengths[b] + 1, ... in order (pads
  anywhere). The full chunks run under one `lax.scan`, a shorter last chunk after it. Only
  the hidden state of each row's last valid token is kept: float32 [B, S, V] is never built.

  Args:
      params: the model's params pytree.
      cache: the `qwen.PagedKVCache` pool.
      page_table: int32[B, W], each row's pages (room for lengths + its valid tokens).
      lengths: int32[B], tokens of each row in the cache.
      ids: int32[B, S] token ids (values at invalid slots must be valid ids, e.g. 0).
      valid: bool[B, S], True on tokens to write.
      model_config: the `ModelConfig` (static).
      chunk_size: columns per model call (None = all S at once).
      constrain: applied to the cache after every write (sharding constraint or identity).

  Returns:
      (h [B, D] after each row's last valid token (zeros for a row with none), the cache,
      int32[B] the new lengths = lengths + valid tokens).
  """
  chex.assert_rank([ids, valid, page_table, lengths], [2, 2, 2, 1])
  chex.assert_equal_shape([ids, valid])
  b, s = ids.shape
  last = _last_valid_slot(valid)
  positions = lengths[:, None] + prompt_positions(valid)
  chunk = s if chunk_size is None else min(chunk_size, s)
  n_full, rest = divmod(s, chunk)

  def prefill_chunk(carry, chunk_inputs):
    """Runs one chunk of the tokens; keeps the hidden state of each row's last token."""
    cache, lengths, h_last = carry
    ids_c, valid_c, pos_c, start = chunk_inputs
    width = ids_c.shape[1]
    h, cache = qwen.paged_hidden_states(
      params, ids_c, pos_c, valid_c, cache, page_table, lengths, config=model_config
    )
    cache = constrain(cache)
    local = jnp.clip(last - start, 0, width - 1)
    h_here = jnp.take_along_axis(h, local[:, None, None], axis=1)[:, 0]
    in_chunk = (last >= start) & (last < start + width) & jnp.any(valid, axis=1)
    h_last = jnp.where(in_chunk[:, None], h_here.astype(h_last.dtype), h_last)
    lengths = lengths + jnp.sum(valid_c.astype(jnp.int32), axis=1)
    return (cache, lengths, h_last), None

  def by_chunk(x):
    return x[:, : n_full * chunk].reshape(b, n_full, chunk).swapaxes(0, 1)

  carry = (cache, lengths, jnp.zeros((b, model_config.hidden_size), model_config.dtype))
  if n_full:
    starts = jnp.arange(n_full, dtype=jnp.int32) * chunk
    carry, _ = jax.lax.scan(
      prefill_chunk, carry, (by_chunk(ids), by_chunk(valid), by_chunk(positions), starts)
    )
  if rest:
    tail = slice(n_full * chunk, s)
    carry, _ = prefill_chunk(
      carry, (ids[:, tail], valid[:, tail], positions[:, tail], jnp.int32(n_full * chunk))
    )
  cache, lengths, h_last = carry
  return h_last, cache, lengths


def emit(rows: DecodeRows, logits: jax.Array, *, sampling_config: SamplingConfig) -> DecodeRows:
  """Every decoding row chooses the token of its column `steps[b]` and records it.

  Row b draws with `fold_in(keys[b], steps[b])`; it finishes on one of its stop ids (STOP)
  or when it has `limits[b]` tokens (LENGTH). The token becomes the row's `last_tokens`.

  Args:
      rows: the `DecodeRows` before the step.
      logits: float32[S, V] next-token logits of every row.
      sampling_config: the `SamplingConfig` (static).
  """
  sc = sampling_config
  choose = jax.vmap(
    functools.partial(
      select_token, temperature=sc.temperature, top_k=sc.top_k, top_p=sc.top_p, greedy=sc.greedy
    )
  )
  keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(rows.keys), rows.steps)
  token, logp = choose(keys, logits)
  active = rows.decoding
  s, n = rows.tokens.shape
  col = jnp.where(active, rows.steps, n)  # out of bounds: dropped
  tokens = rows.tokens.at[jnp.arange(s), col].set(token, mode="drop")
  logprobs = rows.logprobs.at[jnp.arange(s), col].set(logp, mode="drop")
  steps = rows.steps + active.astype(jnp.int32)
  hit_stop = active & jnp.any(token[:, None] == rows.stops, axis=1)
  hit_length = active & ~hit_stop & (steps >= rows.limits)
  finish = jnp.where(hit_stop, int(FinishReason.STOP), rows.finish_reason)
  finish = jnp.where(hit_length, int(FinishReason.LENGTH), finish)
  return rows.replace(
    last_tokens=jnp.where(active, token, rows.last_tokens),
    tokens=tokens,
    logprobs=logprobs,
    steps=steps,
    decoding=active & ~hit_stop & ~hit_length,
    finish_reason=finish,
  )


def begin_replies(
  rows: DecodeRows,
  begin: jax.Array,
  logits: jax.Array,
  keys: jax.Array,
  limits: jax.Array,
  stops: jax.Array,
  *,
  sampling_config: SamplingConfig,
) -> DecodeRows:
  """The rows in `begin` start a reply: fresh output buffers, their key, limit and stops,
  and their first token chosen from `logits` (the logits after their last given token).

  Args:
      rows: `DecodeRows` of S rows.
      begin: bool[S], the rows that start a reply (others are unchanged). A row with limit 0
          starts and ends at once (no token, finish reason LENGTH).
      logits: float32[S, V].
      keys: uint32[S, 2] raw reply keys; limits: int32[S] in [0, N]; stops: int32[S, K].
      sampling_config: the `SamplingConfig` (static).
  """
  sc = sampling_config
  fresh = rows.replace(
    keys=jnp.where(begin[:, None], keys, rows.keys),
    limits=jnp.where(begin, limits, rows.limits),
    stops=jnp.where(begin[:, None], stops, rows.stops),
    steps=jnp.where(begin, 0, rows.steps),
    tokens=jnp.where(begin[:, None], sc.pad_id, rows.tokens),
    logprobs=jnp.where(begin[:, None], 0.0, rows.logprobs),
    finish_reason=jnp.where(begin, int(FinishReason.LENGTH), rows.finish_reason),
    decoding=jnp.where(begin, limits > 0, rows.decoding),
  )
  emitted = emit(fresh.replace(decoding=begin & (limits > 0)), logits, sampling_config=sc)
  return emitted.replace(decoding=jnp.where(begin, emitted.decoding, rows.decoding))


def decode_step(
  rows: DecodeRows,
  params: Params,
  page_table: jax.Array,
  *,
  model_config: ModelConfig,
  sampling_config: SamplingConfig,
  constrain: Callable[[qwen.PagedKVCache], qwen.PagedKVCache],
) -> DecodeRows:
  """Writes each decoding row's last token (at its own position) and emits its next one.

  Rows that are not decoding ride along: their token goes to the scratch page.
  """
  decoding = rows.decoding
  h, cache = qwen.paged_hidden_states(
    params,
    jnp.maximum(rows.last_tokens, 0)[:, None],
    rows.lengths[:, None],
    decoding[:, None],
    rows.cache,
    page_table,
    rows.lengths,
    config=model_config,
  )
  rows = rows.replace(cache=constrain(cache), lengths=rows.lengths + decoding.astype(jnp.int32))
  logits = next_logits(params, h[:, 0], model_config=model_config)
  return emit(rows, logits, sampling_config=sampling_config)


def decode_loop(
  params: Params,
  rows: DecodeRows,
  page_table: jax.Array,
  num_steps: int,
  *,
  model_config: ModelConfig,
  sampling_config: SamplingConfig,
  constrain: Callable[[qwen.PagedKVCache], qwen.PagedKVCache],
) -> tuple[DecodeRows, jax.Array]:
  """`decode_step` under `lax.while_loop`, `num_steps` times or until no row decodes.

  A decoding row writes one token per step at its own position: the page table must give
  each decoding row room for positions lengths[b] .. lengths[b] + num_steps - 1.

  Returns (the rows after the loop, int32 scalar: the steps run).
  """

  def go_on(carry):
    i, rows = carry
    return (i < num_steps) & jnp.any(rows.decoding)

  def body(carry):
    i, rows = carry
    rows = decode_step(
      rows,
      params,
      page_table,
      model_config=model_config,
      sampling_config=sampling_config,
      constrain=constrain,
    )
    return i + 1, rows

  steps, rows = jax.lax.while_loop(go_on, body, (jnp.zeros((), jnp.int32), rows))
  return rows, steps


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
# One-shot sampling: the session's steps from an empty context, in one program.


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
  """`make_sampler`'s function: B rows with one page each of P' + N slots, one prefill
  (P' = P padded to a multiple of the prefill chunk), then the decode loop to the end."""
  chex.assert_rank([prompt_ids, prompt_valid], 2)
  chex.assert_equal_shape([prompt_ids, prompt_valid])
  chex.assert_type([prompt_ids, prompt_valid], [int, bool])
  sc = sampling_config
  b, p = prompt_ids.shape
  keys = jax.random.key_data(_row_keys(rng, b))
  stops, limits = _stops_and_limits(sc, b, stop_tokens, max_new_tokens)
  chunk = p if sc.prefill_chunk_size is None else min(sc.prefill_chunk_size, p)
  pad = -(-p // chunk) * chunk - p
  prompt_ids = jnp.pad(prompt_ids.astype(jnp.int32), ((0, 0), (0, pad)))
  prompt_valid = jnp.pad(prompt_valid, ((0, 0), (0, pad)))
  constrain = functools.partial(constrain_cache, cache_sharding=cache_sharding)
  cache = constrain(qwen.init_paged_cache(model_config, b + 1, p + pad + sc.max_new_tokens))
  page_table = jnp.arange(1, b + 1, dtype=jnp.int32)[:, None]  # row b: page b + 1
  rows = init_rows(cache, b, stops.shape[1], sc.max_new_tokens, sc.pad_id)
  h_last, cache, lengths = write_tokens(
    params,
    rows.cache,
    page_table,
    rows.lengths,
    prompt_ids,
    prompt_valid,
    model_config=model_config,
    chunk_size=sc.prefill_chunk_size,
    constrain=constrain,
  )
  has_tokens = jnp.any(prompt_valid, axis=1)
  rows = rows.replace(cache=cache, lengths=lengths)
  rows = begin_replies(
    rows,
    jnp.ones((b,), bool),
    next_logits(params, h_last, model_config=model_config),
    keys,
    jnp.where(has_tokens, limits, 0),
    stops,
    sampling_config=sc,
  )
  rows, _ = decode_loop(
    params,
    rows,
    page_table,
    sc.max_new_tokens,
    model_config=model_config,
    sampling_config=sc,
    constrain=constrain,
  )
  n = sc.max_new_tokens
  return SampleOutput(
    tokens=rows.tokens,
    logprobs=rows.logprobs,
    mask=jnp.arange(n)[None, :] < rows.steps[:, None],
    lengths=rows.steps,
    finish_reason=rows.finish_reason,
  )


def make_sampler(
  model_config: ModelConfig,
  sampling_config: SamplingConfig,
  *,
  cache_sharding: Optional[Callable[[qwen.PagedKVCache], Any]] = None,
  jit: bool = True,
):
  """Builds the one-shot sampling function for one model config and one set of decoding
  hyper-parameters.

  Args:
      model_config: the policy's `ModelConfig` (static).
      sampling_config: the `SamplingConfig` (static).
      cache_sharding: optional function PagedKVCache -> pytree of `Sharding` (e.g.
          `functools.partial(seeupo_jax.sharding.cache_shardings, mesh=mesh)`);
          the cache is constrained to it after every write. Params and inputs
          keep the shardings they arrive with; nothing here names a device.
      jit: return the function under `jax.jit` (False for debugging).

  Returns:
      sample(params, prompt_ids, prompt_valid, rng, stop_tokens=None,
      max_new_tokens=None) -> SampleOutput, where
        params: the model's params pytree.
        prompt_ids: int32[B, P] prompts, padded anywhere (left padding recommended).
        prompt_valid: bool[B, P], True on real tokens; a row with none generates nothing.
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
# The session: a decode batch that episodes join and leave (the rollout engine's sampler).


@dataclasses.dataclass(frozen=True)
class SessionConfig:
  """Geometry and schedule of a `SamplerSession` (validated on construction).

  rows: S, the decode slots: rows that decode together in one program.
  max_context_tokens: the most tokens one row may hold (its context and reply); sets the
      widest page table.
  page_size: slots per KV page. A row holds ceil(its tokens / page_size) pages (plus room for
      the next `decode_steps_per_sync` tokens while it decodes); pages return to the pool when
      the row is released.
  prefill_chunk: C, the widest prefill call: the most tokens of one row written per call (a
      longer input is written over several calls, each with decode steps of the other rows).
      Calls come in the widths `prefill_widths(C)` (C / 8, C / 4, C / 2, C; those >= 8), a row's
      chunk in the smallest that holds it: the width depends on the row's own tokens only, so
      a row's tokens and log-probs do not depend on what else was prefilled with it
      (bit-exact whatever the timing).
  prefill_rows: R, the rows of every prefill call (more rows with tokens: several calls).
  decode_steps_per_sync: k, decode steps per decode call: the host reads the rows' state
      (finished replies) once per k steps, never per token; a call ends early when no row
      is decoding.
  initial_pages: the pool's first size (None: 1 + rows x the pages of one prefill chunk);
      it doubles when full (each size one compile).
  """

  rows: int = fields.field(fields.int_at_least(1))
  max_context_tokens: int = fields.field(fields.int_at_least(1))
  page_size: int = fields.field(fields.int_at_least(1), 32)
  prefill_chunk: int = fields.field(fields.int_at_least(1), 64)
  prefill_rows: int = fields.field(fields.int_at_least(1), 8)
  decode_steps_per_sync: int = fields.field(fields.int_at_least(1), 8)
  initial_pages: Optional[int] = fields.field(fields.optional(fields.int_at_least(2)), None)

  def __post_init__(self):
    fields.check(self)


@dataclasses.dataclass(frozen=True)
class Reply:
  """A finished reply of one session row: its sampled tokens, their log-probs, why it ended."""

  row: int
  tokens: np.ndarray  # int32[n]
  logprobs: np.ndarray  # float32[n]
  finish_reason: FinishReason


@dataclasses.dataclass
class SessionStats:
  """Counters of a session (cumulative; `SamplerSession.stats`)."""

  prefill_calls: int = 0
  prefill_tokens: int = 0
  decode_calls: int = 0
  decode_steps: int = 0  # batch steps run (each computes every row)
  decode_row_steps: int = 0  # steps x rows that were decoding (generated tokens after the first)
  replies: int = 0
  peak_cache_slots: int = 0  # pages in use x page_size, at its peak
  live_tokens_at_peak: int = 0  # the rows' tokens in the cache at that moment
  pool_pages: int = 0


def prefill_widths(chunk: int) -> tuple[int, ...]:
  """The widths of a session's prefill calls: C / 8, C / 4, C / 2 and C (C = `prefill_chunk`),
  those >= 8, ascending. A row's chunk of L tokens goes in a call of the smallest width >= L,
  so it pays for at most 2L tokens (or C / 8, or 8), never C; a run compiles at most 4
  prefill programs per pool size."""
  return tuple(sorted({w for w in (chunk // 8, chunk // 4, chunk // 2) if w >= 8} | {chunk}))


def _prefill_program(
  params,
  rows: DecodeRows,
  page_table,
  row_ids,
  fresh,
  ids,
  valid,
  begin,
  keys,
  limits,
  *,
  model_config: ModelConfig,
  sampling_config: SamplingConfig,
  constrain,
) -> DecodeRows:
  """Writes R rows' new tokens (rows `row_ids`; S = padding) and begins the replies of `begin`.

  fresh[r]: the row starts a new context (its length is reset to 0 first).
  """
  s = rows.lengths.shape[0]
  real = row_ids < s
  safe = jnp.clip(row_ids, 0, s - 1)
  lengths = jnp.where(fresh, 0, rows.lengths[safe])
  h_last, cache, lengths = write_tokens(
    params,
    rows.cache,
    page_table[safe],
    lengths,
    ids,
    valid & real[:, None],
    model_config=model_config,
    chunk_size=None,
    constrain=constrain,
  )
  fields = {
    f.name: getattr(rows, f.name)[safe] for f in dataclasses.fields(rows) if f.name != "cache"
  }
  sub = DecodeRows(cache=cache, **{**fields, "lengths": lengths})
  sub = begin_replies(
    sub,
    begin & real,
    next_logits(params, h_last, model_config=model_config),
    keys,
    limits,
    sub.stops,
    sampling_config=sampling_config,
  )
  merged = {
    name: getattr(rows, name).at[row_ids].set(getattr(sub, name), mode="drop") for name in fields
  }
  return DecodeRows(cache=cache, **merged)


def _decode_program(
  params, rows: DecodeRows, page_table, *, num_steps, model_config, sampling_config, constrain
):
  """(rows after up to `num_steps` decode steps, int32 steps run): `decode_loop`."""
  return decode_loop(
    params,
    rows,
    page_table,
    num_steps,
    model_config=model_config,
    sampling_config=sampling_config,
    constrain=constrain,
  )


_STATICS = ("model_config", "sampling_config", "cache_sharding")


@functools.partial(jax.jit, static_argnames=_STATICS, donate_argnums=1)
def _prefill_jit(params, rows, *args, model_config, sampling_config, cache_sharding):
  constrain = functools.partial(constrain_cache, cache_sharding=cache_sharding)
  return _prefill_program(
    params,
    rows,
    *args,
    model_config=model_config,
    sampling_config=sampling_config,
    constrain=constrain,
  )


@functools.partial(jax.jit, static_argnames=_STATICS + ("num_steps",), donate_argnums=1)
def _decode_jit(
  params, rows, page_table, *, num_steps, model_config, sampling_config, cache_sharding
):
  constrain = functools.partial(constrain_cache, cache_sharding=cache_sharding)
  return _decode_program(
    params,
    rows,
    page_table,
    num_steps=num_steps,
    model_config=model_config,
    sampling_config=sampling_config,
    constrain=constrain,
  )


@functools.partial(jax.jit, static_argnums=1, static_argnames="cache_sharding")
def _grow_jit(rows: DecodeRows, pages: int, *, cache_sharding) -> DecodeRows:
  """The rows over a pool of `pages` pages (the old pages kept, new ones empty)."""
  extra = pages - rows.cache.num_pages
  pad = ((0, 0), (0, extra), (0, 0), (0, 0), (0, 0))
  cache = qwen.PagedKVCache(
    keys=jnp.pad(rows.cache.keys, pad), values=jnp.pad(rows.cache.values, pad)
  )
  return rows.replace(cache=constrain_cache(cache, cache_sharding))


class PrefillCall(NamedTuple):
  """The host-side inputs of one staged prefill call (R = `prefill_rows` rows of width W, one
  of `prefill_widths`; S = the session's rows, a padding row id).

  row_ids: int32[R], the session rows written (S: padding).
  fresh:   bool[R], the row starts a new context (its length is reset to 0 first).
  ids:     int32[R, W], the rows' new tokens, left-aligned.
  valid:   bool[R, W], True on those tokens.
  begin:   bool[R], the row's input is then complete: it begins its reply.
  keys:    uint32[R, 2], the raw PRNG keys of the replies begun.
  limits:  int32[R], their token limits.
  """

  row_ids: np.ndarray
  fresh: np.ndarray
  ids: np.ndarray
  valid: np.ndarray
  begin: np.ndarray
  keys: np.ndarray
  limits: np.ndarray


class SamplerSession:
  """A decode batch of S rows over a paged KV cache, driven from the host.

  Episodes take a row, `give` it tokens (a prompt, then each observation) and get `Reply`s
  back from `decode`; `release` returns the row and its pages. The session owns the cache:
  rows, their positions, the page pool (grown by doubling when it runs out), the page
  table, and the insertion of new tokens (chunked `prefill`). Two kinds of compiled program:

      prefill(R = prefill_rows rows, W tokens each; W in prefill_widths(prefill_chunk))
      decode(k steps of all S rows)

  each also keyed by the pool size; a row's prefill width follows from its own chunk, so a
  row's tokens and log-probs are the same bits whatever else shares its calls. The page table has one width (the most pages a row can need); attention visits
  only the blocks of pages the longest live row fills. The programs are module-level: sessions of the same
  configs share them.

      session = SamplerSession(model_config, sampling_config, SessionConfig(rows=16, ...))
      session.give(row, prompt_ids, key_data, limit)       # the row owes a reply
      session.prefill(params); replies = session.decode(params)
      session.give(row, observation_ids, key_data, limit)  # the reply's last token goes first
      session.release(row)

  A reply's last token is not written to the cache when it ends; the row's next `give` writes
  it in front of the new tokens. So a row's cache always holds its conversation so far
  except that token, at positions 0, 1, ... (its RoPE positions).
  """

  def __init__(
    self,
    model_config: ModelConfig,
    sampling_config: SamplingConfig,
    config: SessionConfig,
    *,
    cache_sharding: Optional[Callable[[qwen.PagedKVCache], Any]] = None,
  ):
    if not isinstance(config, SessionConfig):
      raise TypeError(f"config must be a SessionConfig, got {type(config).__name__}")
    self.model_config = _check_configs(model_config, sampling_config)
    self.sampling_config = sampling_config
    self.config = config
    self.num_stops = len(sampling_config.stop_token_ids)
    pages = -(-(config.max_context_tokens + config.decode_steps_per_sync + 1) // config.page_size)
    per_block = max(1, self.model_config.attn_block_size // config.page_size)
    # One page-table width for every program: the work of attention follows the longest row
    # (`layers.paged_attend`), not the width, and a row's numbers do not depend on it.
    self.max_pages_per_row = -(-pages // per_block) * per_block
    self._constrain = functools.partial(constrain_cache, cache_sharding=cache_sharding)
    statics = dict(
      model_config=self.model_config, sampling_config=sampling_config, cache_sharding=cache_sharding
    )
    # Module-level jitted programs: sessions of the same configs share their compiled programs.
    self._decode = functools.partial(_decode_jit, num_steps=config.decode_steps_per_sync, **statics)
    self._prefill = functools.partial(_prefill_jit, **statics)
    self._grow = functools.partial(_grow_jit, cache_sharding=cache_sharding)
    self.prefill_widths = prefill_widths(config.prefill_chunk)
    self._staged: list[PrefillCall] = []  # run by the next decode call
    self.stats = SessionStats()
    self.rows: Optional[DecodeRows] = None
    s = config.rows
    self._pages: list[list[int]] = [[] for _ in range(s)]
    self._free: list[int] = []
    self._lengths = np.zeros((s,), np.int64)  # tokens of the row in the cache (host mirror)
    self._pending = np.full((s,), -1, np.int64)  # the last reply's last token, not in the cache
    self._input: list[list[int]] = [[] for _ in range(s)]  # tokens still to write
    self._reply_args: list[Optional[tuple]] = [None] * s  # (key data, limit) once input is written
    self._fresh = np.ones((s,), bool)  # the row's next write starts a new context
    self._awaiting = np.zeros((s,), bool)  # the row owes a reply (begun on device)

  # --- rows ---------------------------------------------------------------------------------

  def give(self, row: int, ids: Sequence[int], key_data: np.ndarray, limit: int) -> None:
    """Queues the row's new tokens; once they are written the row samples a reply of at most
    `limit` tokens (>= 1) from `key_data` (raw uint32[2] PRNG key)."""
    if self._awaiting[row] or self._reply_args[row] is not None:
      raise ValueError(f"row {row} still owes a reply")
    if not 1 <= limit <= self.sampling_config.max_new_tokens:
      raise ValueError(f"limit must be in [1, {self.sampling_config.max_new_tokens}], got {limit}")
    new = ([int(self._pending[row])] if self._pending[row] >= 0 else []) + [int(t) for t in ids]
    if not new:
      raise ValueError(f"row {row} was given no token to continue from")
    if self._lengths[row] + len(new) + limit > self.config.max_context_tokens:
      raise ValueError(
        f"row {row}: {self._lengths[row]} tokens + {len(new)} new + a reply of {limit} exceed "
        f"max_context_tokens={self.config.max_context_tokens}"
      )
    self._pending[row] = -1
    self._input[row] = new
    self._reply_args[row] = (np.asarray(key_data, np.uint32).reshape(2), int(limit))

  def release(self, row: int) -> None:
    """Ends the row's context: its pages go back to the pool."""
    self._free.extend(self._pages[row])
    self._pages[row] = []
    self._lengths[row] = 0
    self._pending[row] = -1
    self._input[row] = []
    self._reply_args[row] = None
    self._fresh[row] = True
    self._awaiting[row] = False

  @property
  def busy(self) -> bool:
    """Some row has tokens to write or a reply to finish."""
    return bool(self._awaiting.any()) or any(self._input)

  @property
  def cache_slots(self) -> int:
    """Slots of the pages rows hold now."""
    return sum(len(p) for p in self._pages) * self.config.page_size

  @property
  def live_tokens(self) -> int:
    """Tokens the rows hold in the cache now."""
    return int(self._lengths.sum())

  # --- pages --------------------------------------------------------------------------------

  def _start(self) -> None:
    s, cfg = self.config.rows, self.config
    pages = cfg.initial_pages or 1 + s * -(
      -min(cfg.prefill_chunk, cfg.max_context_tokens) // cfg.page_size
    )
    cache = self._constrain(qwen.init_paged_cache(self.model_config, pages, cfg.page_size))
    rows = init_rows(
      cache, s, self.num_stops, self.sampling_config.max_new_tokens, self.sampling_config.pad_id
    )
    shared = jnp.asarray(self.sampling_config.stop_token_ids, jnp.int32).reshape(1, -1)
    self.rows = rows.replace(stops=jnp.broadcast_to(shared, (s, self.num_stops)))
    self._free = list(range(pages - 1, 0, -1))  # page 0 is the scratch page
    self.stats.pool_pages = pages

  def _reserve(self, row: int, tokens: int) -> None:
    """Gives the row pages for its first `tokens` positions."""
    need = -(-tokens // self.config.page_size)
    if need > self.max_pages_per_row:
      raise ValueError(f"row {row} needs {need} pages > {self.max_pages_per_row}")
    while len(self._pages[row]) < need:
      if not self._free:
        old = self.rows.cache.num_pages
        self.rows = self._grow(self.rows, 2 * old)
        self._free = list(range(2 * old - 1, old - 1, -1))
        self.stats.pool_pages = 2 * old
      self._pages[row].append(self._free.pop())

  def page_table(self) -> np.ndarray:
    """int32[S, max_pages_per_row]: row r's pages in order, 0 (the scratch page) after."""
    table = np.zeros((self.config.rows, self.max_pages_per_row), np.int32)
    for r, pages in enumerate(self._pages):
      table[r, : len(pages)] = pages
    return table

  def _note_peak(self) -> None:
    slots = self.cache_slots
    if slots > self.stats.peak_cache_slots:
      self.stats.peak_cache_slots = slots
      self.stats.live_tokens_at_peak = self.live_tokens

  # --- the programs ---------------------------------------------------------------------------

  def prefill(self, params) -> int:
    """Writes up to `prefill_chunk` queued tokens of every row that has some (one call);
    rows whose input is then complete begin their reply. Returns the tokens written.

    The calls are dispatched by the next `decode` (before its decode steps, with no host
    read in between): `decode` must follow (before `give` or `release`)."""
    if self.rows is None:
      self._start()
    cfg = self.config
    todo = [r for r in range(cfg.rows) if self._input[r]]
    if not todo:
      return 0
    # R rows a call, and a width that is a function of the row's own chunk alone (the
    # smallest of `prefill_widths` that holds it): a row's numbers do not depend on what
    # else was prefilled with it, or when (a wider or taller call changes the float
    # rounding of its matmuls). Rows of one width share calls; more than R: several calls.
    n = min(cfg.prefill_rows, cfg.rows)
    by_width: dict[int, list[int]] = {}
    for r in todo:
      chunk_len = min(len(self._input[r]), cfg.prefill_chunk)
      width = next(w for w in self.prefill_widths if w >= chunk_len)
      by_width.setdefault(width, []).append(r)
    written = 0
    for width, start, group in (
      (width, start, rows)
      for width, rows in sorted(by_width.items())
      for start in range(0, len(rows), n)
    ):
      row_ids = np.full((n,), cfg.rows, np.int32)
      fresh = np.zeros((n,), bool)
      ids = np.zeros((n, width), np.int32)
      valid = np.zeros((n, width), bool)
      begin = np.zeros((n,), bool)
      keys = np.zeros((n, 2), np.uint32)
      limits = np.zeros((n,), np.int32)
      for i, r in enumerate(group[start : start + n]):
        chunk = self._input[r][:width]
        self._input[r] = self._input[r][len(chunk) :]
        self._reserve(r, int(self._lengths[r]) + len(chunk))
        row_ids[i], fresh[i] = r, self._fresh[r]
        ids[i, : len(chunk)] = chunk
        valid[i, : len(chunk)] = True
        self._fresh[r] = False
        self._lengths[r] += len(chunk)
        written += len(chunk)
        if not self._input[r]:
          begin[i] = True
          keys[i], limits[i] = self._reply_args[r]
          self._reply_args[r] = None
          self._awaiting[r] = True
      self._staged.append(PrefillCall(row_ids, fresh, ids, valid, begin, keys, limits))
      self.stats.prefill_calls += 1
    self._note_peak()
    self.stats.prefill_tokens += written
    return written

  @property
  def staged_prefills(self) -> tuple[PrefillCall, ...]:
    """The prefill calls `prefill` staged, in the order the next decode call runs them."""
    return tuple(self._staged)

  def prepare_decode(self, params) -> np.ndarray:
    """The first half of `decode`, with no host read: reserves the pages of the next k
    decode steps of every decoding row, dispatches the staged prefill calls on the session's
    rows, and returns the page table the decode program reads (`page_table()`)."""
    k = self.config.decode_steps_per_sync
    for r in np.flatnonzero(self._awaiting):
      self._reserve(int(r), int(self._lengths[r]) + k)
    self._note_peak()
    table = self.page_table()
    staged, self._staged = self._staged, []
    for call in staged:
      self.rows = self.prefill_program(params, self.rows, table, call)
    return table

  def prefill_program(self, params, rows: DecodeRows, table: np.ndarray, call: PrefillCall):
    """The session's compiled prefill program on `rows` (donated) for one `PrefillCall`:
    writes its rows' tokens and begins the replies of its `begin` rows. Returns the rows
    after. `prepare_decode` runs the staged calls with it; a benchmark times it alone."""
    return self._prefill(params, rows, table, *call)

  def decode_program(self, params, rows: DecodeRows, table: np.ndarray):
    """The session's compiled decode program on `rows` (donated): up to k decode steps of
    every decoding row. Returns (rows after, int32 steps run). `decode` runs it on the
    session's rows; a benchmark times it alone after `prepare_decode`."""
    return self._decode(params, rows, table)

  def decode(self, params) -> list[Reply]:
    """Up to k decode steps of every decoding row, then one host read; returns the replies
    that ended (also those that ended on their first token, in `prefill`)."""
    if not self._awaiting.any() and not self._staged:
      return []
    table = self.prepare_decode(params)
    self.rows, steps = self.decode_program(params, self.rows, table)
    state = jax.device_get(
      (self.rows.lengths, self.rows.decoding, self.rows.steps, self.rows.finish_reason, steps)
    )
    lengths, decoding, reply_steps, finish, steps = state
    self.stats.decode_calls += 1
    self.stats.decode_steps += int(steps)
    self.stats.decode_row_steps += int(np.sum((lengths - self._lengths)[self._awaiting]))
    # Only the rows that were decoding moved (released rows keep a stale device length).
    self._lengths = np.where(self._awaiting, lengths, self._lengths).astype(np.int64)
    done = np.flatnonzero(self._awaiting & ~decoding)
    if not len(done):
      return []
    tokens, logprobs = jax.device_get((self.rows.tokens, self.rows.logprobs))
    replies = []
    for r in done:
      n = int(reply_steps[r])
      self._awaiting[r] = False
      self._pending[r] = int(tokens[r, n - 1]) if n else -1
      replies.append(
        Reply(int(r), tokens[r, :n].copy(), logprobs[r, :n].copy(), FinishReason(int(finish[r])))
      )
    self.stats.replies += len(replies)
    return replies
