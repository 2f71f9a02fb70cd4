"""The learner's input: a batch of whole trajectories, one row each.

Row i of every field is trajectory i for the whole update (the HAML correction
M is indexed by row, so no field may be re-sorted on its own). Tokens are the
exact ids the sampler produced (never re-tokenized text); `turn_ids` says which
of them the policy generated, and at which turn.
"""

from __future__ import annotations

from typing import Any, Optional

import chex
import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from seeupo_jax import sharding as sharding_lib

PROMPT_OR_ENV = -1
"""`turn_ids` of every token the policy did not generate (prompt, environment, padding)."""


@flax.struct.dataclass
class Batch:
  """N trajectories of at most L tokens (right-padded; valid tokens contiguous).

  Attributes:
    tokens: int32[N, L], token ids.
    token_valid: bool[N, L], True on real tokens, False on padding.
    turn_ids: int32[N, L], t on the tokens the model generated at turn t
      (0-based, < num_turns), -1 on prompt, chat-template, environment and
      padding tokens.
    sample_logp: float32[N, L], the sampler's log-prob of each generated token
      (0 elsewhere); only compared with the learner's (a metric).
    rewards: float32[N], the trajectory's outcome reward.
    group_ids: int32[N], the task of each row, in [0, N): rows with the same
      id form a GRAE group.
    row_valid: bool[N], False for padding rows that fill a fixed batch shape
      (they count nowhere).
    turn_rewards: float32[N, T] or None, the environment's reward for each turn (0 where it
      gives none); MT-GRPO's input (`losses.mt_grpo_advantages`).
    turn_states: int32[N, T] or None, a key of the environment's state before each turn
      (equal keys = the same state; -1 where unknown); GiGPO's anchor states
      (`losses.gigpo_advantages`).
  """

  tokens: jax.Array
  token_valid: jax.Array
  turn_ids: jax.Array
  sample_logp: jax.Array
  rewards: jax.Array
  group_ids: jax.Array
  row_valid: jax.Array
  turn_rewards: Optional[jax.Array] = None
  turn_states: Optional[jax.Array] = None

  @property
  def num_rows(self) -> int:
    return self.tokens.shape[0]


def check_shapes(batch: Batch) -> None:
  """chex checks of ranks, shapes and dtypes (static; runs under jit)."""
  chex.assert_rank([batch.tokens, batch.token_valid, batch.turn_ids, batch.sample_logp], 2)
  chex.assert_equal_shape([batch.tokens, batch.token_valid, batch.turn_ids, batch.sample_logp])
  chex.assert_rank([batch.rewards, batch.group_ids, batch.row_valid], 1)
  chex.assert_shape([batch.rewards, batch.group_ids, batch.row_valid], (batch.tokens.shape[0],))
  chex.assert_type([batch.tokens, batch.turn_ids, batch.group_ids], int)
  chex.assert_type([batch.token_valid, batch.row_valid], bool)
  chex.assert_type([batch.sample_logp, batch.rewards], float)
  for name, kind in (("turn_rewards", float), ("turn_states", int)):
    value = getattr(batch, name)
    if value is not None:
      chex.assert_rank(value, 2)
      chex.assert_axis_dimension(value, 0, batch.tokens.shape[0])
      chex.assert_type(value, kind)


def row_turns(batch: Batch, num_turns: int) -> jax.Array:
  """bool[N, T]: entry (i, t) is True if valid row i has a generated token at turn t."""
  on = generated_mask(batch, num_turns) > 0
  slots = jnp.where(on, batch.turn_ids, num_turns)  # T = "no turn": dropped below
  count = jax.vmap(lambda s: jnp.zeros((num_turns,), jnp.int32).at[s].add(1, mode="drop"))
  return count(slots) > 0


def generated_mask(batch: Batch, num_turns: int) -> jax.Array:
  """float32[N, L]: 1 on every token the policy generated (turns 0..T-1) in a valid row."""
  on = (batch.turn_ids >= 0) & (batch.turn_ids < num_turns) & batch.token_valid
  return (on & batch.row_valid[:, None]).astype(jnp.float32)


def turn_mask(batch: Batch, turn: jax.Array) -> jax.Array:
  """float32[N, L]: 1 on the tokens generated at `turn` (int32 scalar) in a valid row.

  The one mask of the turn: advantage, ratio, KL, denominators and M all use it.
  """
  on = (batch.turn_ids == turn) & batch.token_valid & batch.row_valid[:, None]
  return on.astype(jnp.float32)


def turns_present(batch: Batch, num_turns: int) -> jax.Array:
  """bool[T]: entry t is True if some valid row has a generated token at turn t."""
  on = generated_mask(batch, num_turns) > 0
  slots = jnp.where(on, batch.turn_ids, num_turns)  # T = "no turn": dropped below
  counts = jnp.zeros((num_turns,), jnp.int32).at[slots.reshape(-1)].add(1, mode="drop")
  return counts > 0


def take_rows(batch: Batch, rows: jax.Array) -> Batch:
  """The rows `rows` (int32[R]) of every field, kept sharded over the batch axes."""
  return jax.tree.map(lambda x: sharding_lib.constrain(x[rows], P(sharding_lib.BATCH)), batch)


def validate(batch: Any, num_turns: int, *, num_rows: Optional[int] = None) -> None:
  """Host-side value checks of a batch before it is sent to the learner.

  The jitted update cannot raise on values, so the rollout collator (and any
  user building batches by hand) calls this. Raises a ValueError that says
  which rows are wrong and why.

  Args:
    batch: a `Batch` of NumPy or fully addressable arrays.
    num_turns: the learner's `LearnerConfig.num_turns`.
    num_rows: N, the rows of the whole batch that group ids index (multi-host: each
      process checks its own rows of a batch of N); default: the rows of `batch`.
  """
  check_shapes(batch)
  tokens, valid = np.asarray(batch.tokens), np.asarray(batch.token_valid)
  turns, groups = np.asarray(batch.turn_ids), np.asarray(batch.group_ids)
  row_valid = np.asarray(batch.row_valid)
  n = tokens.shape[0] if num_rows is None else num_rows

  def fail(what: str, rows) -> None:
    rows = np.flatnonzero(rows)
    raise ValueError(f"invalid Batch: {what} (rows {rows[:10].tolist()}, {rows.size} in all)")

  if np.any(turns[valid] < -1) or np.any(turns >= num_turns):
    fail(
      f"turn_ids must be in [-1, num_turns={num_turns})",
      np.any((turns < -1) | (turns >= num_turns), 1),
    )
  if np.any((turns >= 0) & ~valid):
    fail("turn_ids >= 0 on a padding token", np.any((turns >= 0) & ~valid, 1))
  if np.any(turns[:, 0] >= 0):
    fail("the first token of a row cannot be generated (nothing predicts it)", turns[:, 0] >= 0)
  starts = np.diff(valid.astype(np.int8), axis=1) == 1
  if np.any(starts) or np.any(~valid[:, 0] & valid.any(1)):
    fail(
      "valid tokens must be one contiguous run starting at column 0 (right padding)",
      starts.any(1) | (~valid[:, 0] & valid.any(1)),
    )
  if np.any((groups < 0) | (groups >= n)):
    fail(f"group_ids must be in [0, N={n})", (groups < 0) | (groups >= n))
  if not np.all(np.isfinite(np.asarray(batch.rewards))[row_valid]):
    fail("rewards must be finite", ~np.isfinite(np.asarray(batch.rewards)) & row_valid)
  for name in ("turn_rewards", "turn_states"):
    value = getattr(batch, name)
    if value is not None and np.shape(value)[1] != num_turns:
      raise ValueError(
        f"invalid Batch: {name} has {np.shape(value)[1]} turns, the learner's num_turns is "
        f"{num_turns}"
      )
  if batch.turn_rewards is not None:
    finite = np.isfinite(np.asarray(batch.turn_rewards)).all(1)
    if not np.all(finite[row_valid]):
      fail("turn_rewards must be finite", ~finite & row_valid)


def batch_shardings(batch: Batch, mesh: Mesh) -> Batch:
  """NamedSharding per field: rows over the mesh's ("data", "fsdp") axes."""
  return jax.tree.map(
    lambda x: NamedSharding(mesh, sharding_lib.fit_spec(P(sharding_lib.BATCH), x.shape, mesh)),
    batch,
  )


def shard_batch(local_batch: Batch, mesh: Mesh) -> Batch:
  """Places a batch on `mesh`, rows sharded over ("data", "fsdp").

  Single process: `local_batch` is the whole batch. Multi-host (after
  `jax.distributed.initialize`): each process passes its own rows (its share
  of N, in process order) and gets back the global batch.
  """
  global_rows = local_batch.tokens.shape[0] * jax.process_count()

  def place(x):
    x = np.asarray(x)
    spec = sharding_lib.fit_spec(P(sharding_lib.BATCH), (global_rows,) + x.shape[1:], mesh)
    return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), x)

  return jax.tree.map(place, local_batch)
