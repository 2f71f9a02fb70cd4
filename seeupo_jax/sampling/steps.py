"""The sampler's device steps over a batch of rows: the row state, token writes, reply starts,
decode steps and the decode loop.

The steps (`write_tokens` -> `begin_replies` -> `decode_loop`, each over a `DecodeRows` state and
a page table) are shared by the one-shot sampler (`sampler.py`) and the session's compiled
programs (`programs.py`).
"""

from __future__ import annotations

import enum
import functools
from typing import Any, Callable, Optional

import chex
import flax
import jax
import jax.numpy as jnp

from seeupo_jax.models import qwen
from seeupo_jax.models.config import ModelConfig
from seeupo_jax.sampling.config import SamplingConfig
from seeupo_jax.sampling.selection import select_token

Params = Any


class FinishReason(enum.IntEnum):
  """Why a row stopped: it sampled one of its stop tokens, or hit its max new tokens."""

  STOP = 0
  LENGTH = 1


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
