"""The session's compiled programs: prefill of staged rows, the decode loop, and pool growth.

Module-level jitted functions (the rows donated), so sessions of the same configs share their
compiled programs; `session.SamplerSession` stages their host-side inputs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from seeupo_jax.models import qwen
from seeupo_jax.models.config import ModelConfig
from seeupo_jax.sampling.config import SamplingConfig
from seeupo_jax.sampling.steps import (
  DecodeRows,
  begin_replies,
  constrain_cache,
  decode_loop,
  next_logits,
  write_tokens,
)


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
