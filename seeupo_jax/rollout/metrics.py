"""Rollout metrics and the failure limit: one call's numbers, gathered over processes.

Each process counts its own call (`_Counts`: times, failures, retries, and the policy's counters
as `Policy.stats` reports them) and the numbers of its trajectories (`_Numbers`); `call_metrics`
exchanges them once (`Processes.allgather`), drops every trajectory of a group that failed,
raises `EnvironmentFailure` past `max_failed_group_fraction`, and returns the whole call's
metrics (times: the slowest process's; counts: summed; shares: over the sums).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from absl import logging
import numpy as np

from seeupo_jax import distributed
from seeupo_jax.rollout.policy import PolicyStats
from seeupo_jax.rollout.trajectory import Trajectory

FINISH_REASONS = ("done", "max_turns", "context", "env_error")


class EnvironmentFailure(RuntimeError):
  """Too many environments failed in one rollout call (see `roller.py`'s docstring)."""


def first_errors(trajectories: Sequence[Trajectory], most: int = 3) -> list[str]:
  """The first error of each failed group, in group order (at most `most`)."""
  first = {}
  for t in trajectories:
    if t.error and t.group not in first:
      first[t.group] = f"task {t.task_id!r}: {t.error}"
  return list(first.values())[:most]


def call_metrics(
  trajectories: Sequence[Trajectory],
  counts: "_Counts",
  *,
  num_groups: int,
  max_failed_group_fraction: float,
  processes: distributed.Processes,
) -> dict:
  """The call's metrics (all processes'); raises `EnvironmentFailure` past the limit.

  Args:
    trajectories: this process's trajectories of the call (their failed groups already
      dropped, `drop_failed_groups`).
    counts: this process's counters of the call.
    num_groups: B, the call's groups (all processes').
    max_failed_group_fraction: the limit (`RolloutConfig`).
    processes: the run's processes (one exchange: every process's numbers and counters).
  """
  reports = processes.allgather(([_numbers(t) for t in trajectories], counts))
  rows = [row for part, _ in reports for row in part]
  every = [c for _, c in reports]
  failed = sum(c.failed_groups for c in every)
  if failed and failed > max_failed_group_fraction * num_groups:
    errors = [e for c in every for e in c.errors][:3]
    raise EnvironmentFailure(
      f"{failed} of {num_groups} task groups failed in one rollout (limit "
      f"{max_failed_group_fraction:.0%}); first errors: " + "; ".join(errors)
    )
  for t in trajectories:
    if t.error:
      logging.warning("environment failure in task %s: %s", t.task_id, t.error)
  return _rollout_metrics(rows, every)


@dataclasses.dataclass
class _Counts:
  """One process's counters of one call (summed, or the slowest taken, over processes)."""

  wall: float
  sample: float
  env_wait: float
  host: float
  failed_groups: int
  errors: list
  retried: int
  restarts: int
  restores: int
  policy: Optional[PolicyStats] = None  # the policy's counters of the call (`Policy.stats`)
  slots: int = 0  # S, the policy's rows


@dataclasses.dataclass(frozen=True)
class _Numbers:
  """The numbers of one trajectory that the call's metrics read."""

  reward: float
  success: bool
  num_turns: int
  length: int
  generated: int
  truncated_replies: int
  truncated_env_tokens: int
  env_stopped_calls: int
  finish_reason: str
  dropped: bool


def _numbers(t: Trajectory) -> _Numbers:
  return _Numbers(
    reward=t.reward,
    success=t.success,
    num_turns=t.num_turns,
    length=len(t.tokens),
    generated=sum(1 for x in t.turn_ids if x >= 0),
    truncated_replies=t.truncated_replies,
    truncated_env_tokens=t.truncated_env_tokens,
    env_stopped_calls=t.env_stopped_calls,
    finish_reason=t.finish_reason,
    dropped=t.dropped,
  )


def drop_failed_groups(trajectories: Sequence[Trajectory]) -> set[int]:
  """Marks every trajectory of a group with a failed one as dropped; returns those groups."""
  failed = {t.group for t in trajectories if t.error is not None}
  for t in trajectories:
    t.dropped = t.group in failed
  return failed


def _rollout_metrics(rows: Sequence[_Numbers], counts: Sequence[_Counts]) -> dict:
  """The call's metrics from its trajectories' numbers (in group order) and each process's
  counters: times are the slowest process's, counts summed, shares over the sums."""
  kept = [t for t in rows if not t.dropped]
  generated = sum(t.generated for t in rows)
  wall = max(c.wall for c in counts)
  env_wait = max(c.env_wait for c in counts)
  metrics = {
    "rollout/time": wall,
    "rollout/sample_time": max(c.sample for c in counts),
    "rollout/env_wait_time": env_wait,
    "rollout/host_time": max(c.host for c in counts),
    "rollout/env_wait_share": env_wait / wall if wall > 0 else 0.0,
    "rollout/generated_tokens": float(generated),
    "rollout/tokens_per_s": generated / wall if wall > 0 else 0.0,
    "rollout/failed_groups": float(sum(c.failed_groups for c in counts)),
    "rollout/trajectories": float(len(rows)),
  }
  if kept:
    metrics.update(
      {
        "reward": float(np.mean([t.reward for t in kept])),
        "success": float(np.mean([t.success for t in kept])),
        "turns": float(np.mean([t.num_turns for t in kept])),
        "length": float(np.mean([t.length for t in kept])),
        "reply_tokens": generated / max(1, sum(t.num_turns for t in rows)),
        "truncated_replies": float(sum(t.truncated_replies for t in kept)),
        "truncated_env_tokens": float(sum(t.truncated_env_tokens for t in kept)),
      }
    )
    for reason in FINISH_REASONS:
      metrics[f"finish/{reason}"] = float(np.mean([t.finish_reason == reason for t in rows]))
  metrics["rollout/retried_episodes"] = float(sum(c.retried for c in counts))
  metrics["rollout/env_stopped_calls"] = float(sum(t.env_stopped_calls for t in rows))
  metrics["rollout/env_worker_restarts"] = float(sum(c.restarts for c in counts))
  metrics["rollout/env_restores"] = float(sum(c.restores for c in counts))
  if all(c.policy is not None for c in counts):
    steps = sum(c.policy.decode_steps for c in counts)
    slot_steps = sum(c.policy.decode_steps * c.slots for c in counts)
    peak = sum(c.policy.peak_cache_slots for c in counts)
    live = sum(c.policy.live_tokens_at_peak for c in counts)
    metrics["rollout/decode_steps"] = float(steps)
    metrics["rollout/decode_calls"] = float(sum(c.policy.decode_calls for c in counts))
    metrics["rollout/prefill_calls"] = float(sum(c.policy.prefill_calls for c in counts))
    # Share of the decode rows that were decoding, over the decode steps run.
    metrics["rollout/slot_occupancy"] = (
      sum(c.policy.decode_row_steps for c in counts) / slot_steps if slot_steps else 0.0
    )
    metrics["rollout/decode_steps_per_token"] = steps / generated if generated else 0.0
    metrics["rollout/cache_slots"] = float(peak)
    metrics["rollout/cache_slots_per_live_token"] = peak / live if live else 0.0
  return metrics
