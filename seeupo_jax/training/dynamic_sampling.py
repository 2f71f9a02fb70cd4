"""DAPO's dynamic sampling on the host: more tasks until the batch holds B informative groups.

The training loop calls `refill_informative_groups` after the iteration's rollout when
`learner.dynamic_sampling` is on. Which groups are informative is `learner.dapo`'s rule
(`informative_group_ids` here, `informative_rows` in the update's filter), so the update then
finds every group of the batch informative.
"""

from __future__ import annotations

import dataclasses

import jax

from seeupo_jax import distributed
from seeupo_jax import rollout
from seeupo_jax.learner import dapo
from seeupo_jax.training.tasks import TaskStream


REFILL_STREAM = 0x0DA905
"""Folded into the iteration's rollout key before the refill index: refill r plays with
fold_in(fold_in(k_rollout, REFILL_STREAM), r), a key no pass of the first rollout uses."""


def refill_informative_groups(
  roller,
  stream: TaskStream,
  params,
  key: jax.Array,
  first: rollout.RolloutResult,
  *,
  tasks_per_iteration: int,
  samples_per_task: int,
  max_refills: int,
) -> rollout.RolloutResult:
  """DAPO's dynamic sampling on the host: informative groups only, refilled with more tasks.

  The groups of `first` whose rewards are all equal (no signal: `dapo.informative_group_ids`), or
  that failed, are discarded.
  While fewer than `tasks_per_iteration` (B) informative groups are held and fewer than
  `max_refills` refills ran, refill r = 1, 2, ... plays the next B tasks of `stream` with the key
  fold_in(fold_in(key, REFILL_STREAM), r) (same shapes as the first rollout: no recompilation;
  the stream's position is checkpointed, so a resumed run draws the same). The first B
  informative groups in the order drawn are kept, renumbered 0..k-1; informative groups beyond
  B are discarded with the others. k < B when the refills run out: `collate(num_rows=B x n)`
  pads the batch with invalid rows.

  Many processes (`roller.processes`): which groups are informative is decided on all of them
  (their group numbers gathered); kept group j becomes rows [j x n, (j + 1) x n) of the batch,
  which belong to the process whose block of B holds j, so the kept groups that another process
  played move there (one all-gather of those trajectories). Each process returns its block.

  Returns:
    The kept trajectories (this process's block of them), with `first`'s metrics (the policy's
    reward and rollout statistics on B fresh tasks, as without dynamic sampling) and
    "dapo/refill_rollouts" (refills run), "dapo/informative_groups" (k, the groups in the
    batch), "dapo/discarded_groups" (every group rolled out this iteration and not in the batch).
  """
  processes = getattr(roller, "processes", None) or distributed.Processes()
  kept: dict[int, list] = {}  # batch position -> the group's trajectories (played here)
  count, refills, result = 0, 0, first
  while True:
    informative = processes.concat(dapo.informative_group_ids(result.trajectories))
    for group in sorted(informative):
      if count < tasks_per_iteration:
        members = [t for t in result.trajectories if t.group == group]
        if members:
          kept[count] = members
        count += 1
    if count == tasks_per_iteration or refills == max_refills:
      break
    refills += 1
    refill_key = jax.random.fold_in(jax.random.fold_in(key, REFILL_STREAM), refills)
    result = roller.run(params, stream.take(tasks_per_iteration), samples_per_task, refill_key)
  if processes.count > 1:  # the groups move to the process whose rows they are
    mine = processes.block(tasks_per_iteration)
    moving = {j: members for j, members in kept.items() if j not in mine}
    arrived = {j: g for part in processes.allgather(moving) for j, g in part.items() if j in mine}
    kept = {j: kept.get(j) or arrived[j] for j in mine if j < count}
  trajectories = [dataclasses.replace(t, group=j) for j in sorted(kept) for t in kept[j]]
  metrics = dict(first.metrics)
  metrics["dapo/refill_rollouts"] = float(refills)
  metrics["dapo/informative_groups"] = float(count)
  metrics["dapo/discarded_groups"] = float((refills + 1) * tasks_per_iteration - count)
  return rollout.RolloutResult(trajectories=trajectories, metrics=metrics)
