"""The rollout/update schedule: which params sample which batch (`pipeline.lag`), and the batches
that wait to be trained.

With lag k (`pipeline.lag`, 0 by default) the batch trained at iteration i (1-based) was sampled
with the params of iteration max(0, i - 1 - k), version v = the number of updates those params
had seen:

    k = 0   B_i ~ pi(theta_{i-1})            sample, then update (the synchronous program)
    k = 1   B_i ~ pi(theta_{i-2})            the update of B_i runs while B_{i+1} is sampled
    k       B_i ~ pi(theta_{max(0,i-1-k)})   B_1 .. B_k are sampled with theta_0 first

The schedule is fixed, not a race: at iteration i the loop dispatches the update of B_i (JAX
dispatches it asynchronously and returns) and then samples B_{i+k} with the params the update
starts from (theta_{i-1}), so the sampler's host work (environment calls, scoring, collation)
and, where the devices allow, its decoding overlap the update. Which params sample which batch,
with which key and tasks, does not depend on timing: a run's trajectories and params equal those
of the same schedule run one step after the other (`loop.run` with `overlap=False`).

Partial rollouts (`pipeline.partial_rollouts`) give up that determinism for fresher tokens: the
sampler of B_{i+k} swaps to theta_i as soon as the update of B_i has finished, inside the
episodes in progress (`Roller.run(refresh=)`), each token tagged with the version that sampled
it (`Trajectory.versions`; `token_lag_metrics`). With many processes each swaps at its own
point, to a copy of theta_i all of them began beside the update (`DecodeLayout.stage`).

The batches sampled but not yet trained (k of them between iterations) are part of the
loop's state: a checkpoint holds them, every process's, in its `progress` item
(`to_progress` / `from_progress`), so a resumed run trains exactly the batches the uninterrupted
one would. The last k iterations still sample their batch (trained only if a resumed run goes on
past `num_iterations`), so the schedule of a run extended later is the schedule of a longer run.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax

from seeupo_jax.rollout.roller import RolloutResult
from seeupo_jax.rollout.trajectory import Trajectory

PROGRESS_KEY = "pending"  # the `progress` entry that holds the batches waiting to be trained
_PROLOGUE_OFFSET = 2_000_003  # the prologue's keys: a stream of their own (see `prologue_key`)


@dataclasses.dataclass
class Sampled:
  """A batch sampled and not yet trained: this process's rollout result, and the version of
  the params that sampled it (the updates they had seen)."""

  result: RolloutResult
  version: int


def version_lag(iteration: int, version: int) -> int:
  """How many updates older than the update's starting params (iteration - 1 updates) the
  params that sampled a batch trained at 1-based `iteration` are."""
  return iteration - 1 - version


def token_lag_metrics(trajectories, iteration: int, version: int, processes) -> dict[str, float]:
  """Per-token staleness of a batch trained at 1-based `iteration` and begun with params of
  `version`: over its reply tokens (of trajectories not dropped; every process's, whose counts
  are exchanged: a collective, every process calls it), how many updates older than the
  update's starting params the params that sampled each were (`version_lag` of the token's
  `Trajectory.versions` entry; records without versions: the batch's version).

    pipeline/token_lag_mean, pipeline/token_lag_min   the mean and least token lag
    pipeline/swapped_token_share                      the share sampled with params newer than
                                                      the batch's first (partial rollouts)
  """
  lags = []
  for t in trajectories:
    if t.dropped:
      continue
    versions = t.versions if len(t.versions) == len(t.tokens) else [version] * len(t.tokens)
    lags.extend(
      version_lag(iteration, v) for turn, v in zip(t.turn_ids, versions, strict=True) if turn >= 0
    )
  first = version_lag(iteration, version)
  mine = (len(lags), sum(lags), min(lags, default=None), sum(lag < first for lag in lags))
  everyone = processes.allgather(mine)
  count = sum(part[0] for part in everyone)
  if not count:
    return {}
  return {
    "pipeline/token_lag_mean": sum(part[1] for part in everyone) / count,
    "pipeline/token_lag_min": float(min(part[2] for part in everyone if part[0])),
    "pipeline/swapped_token_share": sum(part[3] for part in everyone) / count,
  }


def prologue_key(seed: int, index: int) -> jax.Array:
  """The rollout key of prologue batch `index` (1 .. k, sampled with theta_0 before iteration 1):
  from (seed, index), never from the training key, so lag 0 keeps the synchronous program's
  keys."""
  return jax.random.fold_in(jax.random.key(seed + _PROLOGUE_OFFSET), index)


def _trajectory_json(t: Trajectory) -> dict[str, Any]:
  return dataclasses.asdict(t)


def _trajectory(record: dict[str, Any]) -> Trajectory:
  return Trajectory(**record)


def to_progress(pending: list[Sampled], processes) -> list[dict[str, Any]]:
  """The pending batches as JSON for the checkpoint's `progress`: per batch, its version and
  every process's trajectories and metrics (gathered: a collective, every process calls it; the
  checkpoint's JSON items are written by process 0)."""
  mine = [
    {
      "trajectories": [_trajectory_json(t) for t in s.result.trajectories],
      "metrics": dict(s.result.metrics),
    }
    for s in pending
  ]
  everyone = processes.allgather(mine)
  return [
    {"version": s.version, "processes": [part[j] for part in everyone]}
    for j, s in enumerate(pending)
  ]


def batch_trajectories(entry: dict[str, Any]) -> list[Trajectory]:
  """Every process's trajectories of a pending batch (an entry of `to_progress`), process 0's
  first: the whole batch, for reading a checkpoint of any number of processes."""
  return [_trajectory(r) for part in entry["processes"] for r in part["trajectories"]]


def from_progress(progress: dict[str, Any], processes, lag: int) -> Optional[list[Sampled]]:
  """This process's pending batches from a checkpoint's `progress` (None where it holds none:
  a checkpoint of a synchronous run).

  Raises:
    ValueError: the checkpoint was written by another number of processes.
  """
  entries = progress.get(PROGRESS_KEY)
  if entries is None:
    return None
  out = []
  for entry in entries:
    parts = entry["processes"]
    if len(parts) != processes.count:
      raise ValueError(
        f"the checkpoint's pending batches were sampled by {len(parts)} processes, this run has "
        f"{processes.count}; resume with as many processes (pipeline.lag={lag})"
      )
    part = parts[processes.index]
    result = RolloutResult(
      trajectories=[_trajectory(r) for r in part["trajectories"]], metrics=dict(part["metrics"])
    )
    out.append(Sampled(result, int(entry["version"])))
  return out
