"""DAPO's shaping of a batch: dynamic sampling (only groups with signal) and the overlong penalty.

A group is informative when the rewards of its kept trajectories are not all equal (in float32):
a group without signal has zero advantage everywhere. One rule, two sides:
`informative_group_ids` on the host's trajectories (the training loop's refill,
`training/dynamic_sampling.py`) and `informative_rows` on the batch's arrays (the update's filter,
`shape_rewards`). See "DAPO" (https://arxiv.org/abs/2503.14476).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

from seeupo_jax.learner import batch as batch_lib
from seeupo_jax.learner.batch import Batch
from seeupo_jax.learner.config import LearnerConfig

Array = jax.Array


def informative_group_ids(trajectories) -> list[int]:
  """The informative groups of a rollout: those (`Trajectory.group`) whose kept trajectories'
  rewards are not all equal, sorted (on the host; the training loop's refill).

  Kept: not `dropped` and not empty, the rows `collate` makes valid. Rewards are compared in
  float32, as the batch holds them, so a group is informative here exactly when
  `informative_rows` keeps its rows in the update.

  Args:
    trajectories: `rollout.Trajectory`s (their `tokens`, `dropped`, `group` and `reward`).
  """
  rewards: dict[int, set] = {}
  for t in trajectories:
    if t.tokens and not t.dropped:
      rewards.setdefault(t.group, set()).add(float(np.float32(t.reward)))
  return sorted(g for g, values in rewards.items() if len(values) > 1)


def informative_rows(rewards: Array, group_ids: Array, row_valid: Array) -> tuple[Array, Array]:
  """The rows dynamic sampling keeps: the valid rows of informative groups, in the jitted update.

  The rule of `informative_group_ids`, on the batch's arrays.

  Args:
    rewards: float32[N]; group_ids: int32[N] in [0, N); row_valid: bool[N].

  Returns:
    (keep bool[N]: valid rows of groups whose rewards differ, dropped groups float32 scalar:
    groups with a valid row and all rewards equal).
  """
  chex.assert_rank([rewards, group_ids, row_valid], 1)
  n = rewards.shape[0]
  high = jax.ops.segment_max(jnp.where(row_valid, rewards, -jnp.inf), group_ids, num_segments=n)
  low = jax.ops.segment_min(jnp.where(row_valid, rewards, jnp.inf), group_ids, num_segments=n)
  present = jax.ops.segment_sum(row_valid.astype(jnp.float32), group_ids, num_segments=n) > 0
  informative = high > low
  dropped = jnp.sum((present & ~informative).astype(jnp.float32))
  return row_valid & informative[group_ids], dropped


def overlong_penalty(lengths: Array, max_tokens: int, cache_tokens: int) -> Array:
  """DAPO's soft overlong punishment, added to the outcome reward.

    R_len(|y|) = 0                                 |y| <= L_max - L_cache
               = ((L_max - L_cache) - |y|) / L_cache   L_max - L_cache < |y| <= L_max
               = -1                                L_max < |y|
  See "DAPO" (https://arxiv.org/abs/2503.14476), eq. 13.

  Args:
    lengths: float32[N], |y|: the generated tokens of each trajectory (all its turns).
    max_tokens: L_max.
    cache_tokens: L_cache in [0, L_max].

  Returns:
    float32[N], in [-1, 0].
  """
  chex.assert_rank(lengths, 1)
  start = float(max_tokens - cache_tokens)
  ramp = (start - lengths) / max(cache_tokens, 1)
  return jnp.where(lengths > max_tokens, -1.0, jnp.where(lengths > start, ramp, 0.0)).astype(
    jnp.float32
  )


def shape_rewards(config: LearnerConfig, batch: Batch) -> tuple[Batch, dict[str, Array]]:
  """DAPO's options on the batch: dynamic sampling (rows of groups whose rewards are all equal
  become invalid rows: `informative_rows`) and overlong reward shaping (`overlong_penalty`);
  with both off the batch is unchanged.

  Returns:
    (the batch, its metrics: "groups_dropped" and "rows_dropped" with dynamic sampling,
    "overlong_penalty_mean" with overlong shaping).
  """
  metrics = {}
  if config.dynamic_sampling:
    keep, dropped = informative_rows(batch.rewards, batch.group_ids, batch.row_valid)
    metrics["groups_dropped"] = dropped
    metrics["rows_dropped"] = jnp.sum((batch.row_valid & ~keep).astype(jnp.float32))
    batch = batch.replace(row_valid=keep)
  if config.overlong_max_tokens is not None:
    lengths = jnp.sum(batch_lib.generated_mask(batch, config.num_turns), axis=1)
    penalty = overlong_penalty(lengths, config.overlong_max_tokens, config.overlong_cache_tokens)
    metrics["overlong_penalty_mean"] = jnp.sum(penalty * batch.row_valid) / jnp.maximum(
      jnp.sum(batch.row_valid.astype(jnp.float32)), 1.0
    )
    batch = batch.replace(rewards=batch.rewards.astype(jnp.float32) + penalty)
  return batch, metrics
