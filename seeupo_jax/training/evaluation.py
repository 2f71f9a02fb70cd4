"""Held-out evaluation: avg@k and pass@k of k samples per task."""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from seeupo_jax.rollout import Roller, Trajectory


def pass_at_k(trajectories: Sequence[Trajectory], k: int) -> dict[str, float | int]:
  """avg@k = mean success over all samples; pass@k = share of tasks with a success in k samples.

  Trajectories of failed groups (dropped) are left out and counted: "tasks" and "failed_tasks"
  are ints, the rest floats.
  """
  by_task: dict[str, list[bool]] = {}
  for t in trajectories:
    if not t.dropped:
      by_task.setdefault(t.task_id, []).append(t.success)
  samples = [s for v in by_task.values() for s in v]
  return {
    f"avg@{k}": float(np.mean(samples)) if samples else float("nan"),
    f"pass@{k}": float(np.mean([any(v) for v in by_task.values()])) if by_task else float("nan"),
    "reward": float(np.mean([t.reward for t in trajectories if not t.dropped]))
    if samples
    else float("nan"),
    "tasks": len(by_task),
    "failed_tasks": len({t.task_id for t in trajectories if t.dropped}),
  }


def evaluate(
  roller: Roller, params, task_ids: Sequence[str], k: int, rng: jax.Array, tasks_per_call: int
) -> dict[str, float | int]:
  """Runs k samples of every task (in calls of `tasks_per_call` tasks) and scores them.

  With many processes (`roller.processes`), each plays its block of every call's tasks; the
  scores are of all tasks (each process's outcomes gathered, in task order), in every process.
  """
  trajectories: list[Trajectory] = []
  outcomes = []  # (task index, sample, task id, reward, success, dropped)
  for start in range(0, len(task_ids), tasks_per_call):
    rng, key = jax.random.split(rng)
    result = roller.run(params, task_ids[start : start + tasks_per_call], k, key)
    trajectories.extend(result.trajectories)
    outcomes.extend(
      (start + t.group, t.sample, t.task_id, t.reward, t.success, t.dropped)
      for t in result.trajectories
    )
  if roller.processes.count > 1:  # every process's outcomes (what pass_at_k reads), in order
    trajectories = [
      Trajectory(task_id, group, sample, reward=reward, success=success, dropped=dropped)
      for group, sample, task_id, reward, success, dropped in sorted(
        roller.processes.concat(outcomes)
      )
    ]
  return pass_at_k(trajectories, k)
