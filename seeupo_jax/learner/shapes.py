"""Where a SeeUPO turn's passes run: its rows and its prefix, in a few static shapes.

A compute optimisation of the update (`LearnerConfig.turn_buckets` = K): turn t's loss reads only
the rows that have turn t, and, attention being causal, only the positions up to its last token.
So each turn's passes run on those rows, compacted to the front of each mini-batch and cut into
chunks of 1/K of a micro-batch (`compact_rows`; chunks without such rows are skipped by
`lax.cond`), and on the prefix that ends with the turn, rounded up to one of K static lengths
ceil(k L / K) (`at_length`: `lax.switch` over K programs, one per length; the log-probs are
padded back to L with zeros before the loss, so every loss and aggregation, Dr. GRPO's division
by L (`norm_length` None) included, sees the full-width arrays). A turn's first pass also covers
the pending turn's tokens, from which M is corrected (`TurnShapes`). The shape is chosen inside
the one jitted update from the turn's masks (`turn_shape`), so one program serves every batch
and the turn scan stays one scan body: compile time grows with K, not with num_turns. Rows and
positions left out hold no token of the loss (their log-probs enter nothing but zeros), so the
update is the same to float rounding.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, NamedTuple, Optional

import flax
import jax
import jax.numpy as jnp

from seeupo_jax.learner.batch import Batch
from seeupo_jax.learner.config import LearnerConfig

Array = jax.Array
Params = Any
LogprobFn = Callable[[Params, Batch], Array]
"""logprob_fn(params, batch) -> float32[N, L]: entry [i, j] = log pi(tokens[i, j] | tokens[i, :j]),
0 where j predicts nothing."""


@flax.struct.dataclass
class TurnShape:
  """Where one turn's passes run, chosen inside the jitted update from the tokens they need.

  Attributes:
    rows: bool[N], rows with a token the passes need (the turn's; for its first pass also
      the pending turn's): the others are left out, in chunks (`compact_rows`).
    length: int32 scalar, index into `sizes`: the passes run on the prefix of that many
      positions, the shortest that holds every needed token.
    sizes: the static prefix lengths (`prefix_lengths`), the last one L.
  """

  rows: Array
  length: Array
  sizes: tuple[int, ...] = flax.struct.field(pytree_node=False)


def length_buckets(config: LearnerConfig, length: int) -> tuple[int, ...]:
  """The K static prefix lengths ceil(k L / K), k = 1..K (fewer if L < K); the last is L."""
  k = config.turn_buckets
  return tuple(sorted({-(-length * i // k) for i in range(1, k + 1)}))


def prefix_lengths(
  config: LearnerConfig, logprob_fn: LogprobFn, params: Params, batch: Batch
) -> tuple[int, ...]:
  """The static prefix lengths of the turns' passes: `length_buckets`, or (L,) (with a
  warning) when `logprob_fn` does not run on a shorter batch (it must be causal and take any
  length to be run on a prefix)."""
  sizes = length_buckets(config, batch.tokens.shape[1])
  if len(sizes) == 1:
    return sizes
  head = jax.tree.map(lambda x: x[:, : sizes[0]] if x.ndim == 2 else x, batch)
  try:
    out = jax.eval_shape(logprob_fn, params, head)
  except (TypeError, ValueError, AssertionError):  # AssertionError: chex's shape checks
    out = None
  if getattr(out, "shape", None) != head.tokens.shape:
    warnings.warn(
      "learner: logprob_fn does not run on a prefix of the batch (a shorter L), so SeeUPO's "
      "turns run at full length (LearnerConfig.turn_buckets still leaves out rows)",
      stacklevel=2,
    )
    return sizes[-1:]
  return sizes


def turn_shape(config: LearnerConfig, sizes: tuple[int, ...], needed: Array) -> Optional[TurnShape]:
  """The `TurnShape` of the tokens `needed` (float32[N, L] > 0); None with turn_buckets = 1."""
  if config.turn_buckets == 1:
    return None
  length = needed.shape[1]
  on = needed > 0
  end = jnp.max(jnp.where(on, jnp.arange(1, length + 1, dtype=jnp.int32)[None, :], 0))
  index = jnp.minimum(jnp.searchsorted(jnp.asarray(sizes, jnp.int32), end), len(sizes) - 1)
  return TurnShape(jnp.any(on, axis=1), index.astype(jnp.int32), sizes)


def covered(shape: Optional[TurnShape], length: int) -> Array:
  """float32[N, L] (or a scalar 1 without a shape): 1 on the positions a pass of `shape` computes."""
  if shape is None:
    return jnp.ones((), jnp.float32)
  inside = jnp.arange(length)[None, :] < jnp.asarray(shape.sizes, jnp.int32)[shape.length]
  return (shape.rows[:, None] & inside).astype(jnp.float32)


def row_parts(config: LearnerConfig, rows: int) -> int:
  """Chunks per micro-batch of `rows` rows: the largest parts <= K that divides it.

  Independent of the mesh, so that an update computes the same sums on any mesh; a chunk's
  rows are split over the devices holding the batch where they divide (`take_rows`), so pick
  micro-batches of a multiple of K x those devices' rows.
  """
  for parts in range(config.turn_buckets, 1, -1):
    if rows % parts == 0:
      return parts
  return 1


def compact_rows(rows: Array, needed: Array, parts: int) -> tuple[Array, Array]:
  """A mini-batch's rows with the needed ones first, in chunks, and which chunks to run.

  Args:
    rows: int32[micro, R], the mini-batch's rows by micro-batch.
    needed: bool[N], rows the passes need.
    parts: chunks per micro-batch (R % parts == 0).

  Returns:
    (int32[micro * parts, R / parts]: the same rows, needed ones first (stable), in
    consecutive chunks; bool[micro * parts]: chunks that hold a needed row).
  """
  flat = rows.reshape(-1)
  flat = flat[jnp.argsort(~needed[flat], stable=True)]
  chunks = flat.reshape(rows.shape[0] * parts, -1)
  count = jnp.sum(needed[flat].astype(jnp.int32))
  return chunks, jnp.arange(chunks.shape[0]) * chunks.shape[1] < count


def prefix_logprobs(logprob_fn: LogprobFn, params: Params, batch: Batch, prefix: int) -> Array:
  """logprob_fn on the first `prefix` positions (static), padded back to L with zeros.

  Exact for a causal `logprob_fn` (entry j reads tokens[:, :j + 1] only): the entries kept
  are those of the full pass.
  """
  length = batch.tokens.shape[1]
  if prefix >= length:
    return logprob_fn(params, batch)
  head = jax.tree.map(lambda x: x[:, :prefix] if x.ndim == 2 else x, batch)
  logp = logprob_fn(params, head)
  return jnp.pad(logp, ((0, 0), (0, length - prefix)))


def at_length(shape: Optional[TurnShape], length: int, fn):
  """fn(prefix) for the shape's length bucket (`lax.switch` over its static lengths), or
  fn(L) without a shape (or with one length)."""
  if shape is None or len(shape.sizes) == 1:
    return fn(length)
  branches = [functools.partial(fn, prefix) for prefix in shape.sizes]
  return jax.lax.switch(shape.length, branches)


def scatter_rows(rows: Array, values: Array, num_rows: int) -> Array:
  """values[..., R, ...] by `rows` (int32[..., R], a permutation of 0..N-1) back to row order."""
  flat = values.reshape((-1,) + values.shape[rows.ndim :])
  out = jnp.zeros((num_rows,) + flat.shape[1:], flat.dtype)
  return out.at[rows.reshape(-1)].set(flat)


class TurnShapes(NamedTuple):
  """Where a turn's passes run (`TurnShape`s): its first pass needs the turn's tokens and the
  pending turn's (M's "after" log-probs); its optimizer steps only the turn's."""

  first: TurnShape
  steps: TurnShape
