"""The one-shot sampler: B prompts to B replies in one jitted program (`make_sampler`).

The session's steps (`steps.py`) from an empty context: one prefill of the prompts, then the
decode loop to the end.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import chex
import flax
import jax
import jax.numpy as jnp

from seeupo_jax.models import qwen
from seeupo_jax.models.config import ModelConfig
from seeupo_jax.sampling.config import SamplingConfig
from seeupo_jax.sampling.steps import (
  _check_configs,
  begin_replies,
  constrain_cache,
  decode_loop,
  init_rows,
  next_logits,
  write_tokens,
)


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
