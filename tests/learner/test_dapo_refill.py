"""DAPO's dynamic-sampling refill in the training program (`trainer.refill_informative_groups`):
groups whose rewards are all equal are discarded and more tasks rolled out, on the synthetic task
with a tiny model from scratch; counts checked against ones computed here from the rewards."""

import os
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from seeupo_jax import learner, rollout
from seeupo_jax.training import metrics_log, trainer
from seeupo_jax.training.tasks import TaskStream

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from experiments import configs  # noqa: E402

B, n = 4, 2


def small_config(**learner_changes):
  c = configs.get_config("synthetic")
  c.env.num_dials = 1
  c.rollout.max_turns = 1
  c.rollout.tasks_per_iteration = B
  c.rollout.samples_per_task = n
  c.rollout.max_context_tokens = 128
  c.rollout.env_workers = 2
  c.learner.algorithm = "dapo"
  for key, value in learner_changes.items():
    c.learner[key] = value
  c.eval.num_tasks = 4
  c.eval.k = 1
  c.eval.every = 0
  c.checkpoint.every = 1000
  c.log.progress_bar = False
  c.log.plot = False
  c.log.tensorboard = False
  c.log.trajectories = 0
  return c


class Recording:
  """A Roller that records each call (its tasks, key and result)."""

  def __init__(self, roller):
    self.roller, self.calls = roller, []

  def run(self, params, task_ids, samples_per_task, rng):
    result = self.roller.run(params, task_ids, samples_per_task, rng)
    self.calls.append((list(task_ids), rng, result))
    return result


def _signal(trajectories):
  """{group: True if its kept rewards differ}, from the rewards (float32, as the learner)."""
  groups = {}
  for t in trajectories:
    if t.tokens and not t.dropped:
      groups.setdefault(t.group, []).append(np.float32(t.reward))
  return {g: len(set(r)) > 1 for g, r in groups.items()}


REFILLS = 2  # the training run's learner.dapo_max_refills


@pytest.fixture(scope="module")
def program():
  """One program for every test (its sampler and update compile once)."""
  program = trainer.build(small_config(dapo_max_refills=REFILLS))
  yield program
  program.close()


def _refill(program, max_refills, seed):
  state = program.init_state()
  params = program.decode(state.params)
  stream = TaskStream(program.spec.task_ids("train"), seed)
  key = jax.device_put(jax.random.key(seed), NamedSharding(program.decode.mesh, P()))
  recording = Recording(program.roller)
  with jax.set_mesh(program.decode.mesh):
    first = recording.run(params, stream.take(B), n, key)
    out = trainer.refill_informative_groups(
      recording,
      stream,
      params,
      key,
      first,
      tasks_per_iteration=B,
      samples_per_task=n,
      max_refills=max_refills,
    )
  return out, recording.calls, stream, key


@pytest.mark.parametrize("max_refills", [3, 0])
def test_refill_counts_and_batch_from_the_rewards(program, max_refills):
  out, calls, stream, key = _refill(program, max_refills, seed=1)
  # Expected, from the recorded rollouts' rewards alone.
  informative = []  # (call, group) in the order drawn
  for c, (_, _, result) in enumerate(calls):
    signal = _signal(result.trajectories)
    informative += [(c, g) for g in range(B) if signal.get(g, False)]
  refills = len(calls) - 1
  assert refills <= max_refills
  # It stopped at the first call that completed B informative groups, or at the limit.
  before_last = sum(1 for c, _ in informative if c < refills)
  assert before_last < B
  assert len(informative) >= B or refills == max_refills
  used = informative[:B]
  assert out.metrics["dapo/refill_rollouts"] == refills
  assert out.metrics["dapo/informative_groups"] == len(used)
  assert out.metrics["dapo/discarded_groups"] == B * len(calls) - len(used)
  assert out.metrics["reward"] == calls[0][2].metrics["reward"]  # the first rollout's metrics
  # The batch: those groups, renumbered in order, and every one informative.
  want = [
    (new, t.task_id, t.reward)
    for new, (c, g) in enumerate(used)
    for t in calls[c][2].trajectories
    if t.group == g
  ]
  assert [(t.group, t.task_id, t.reward) for t in out.trajectories] == want
  assert all(_signal(out.trajectories).values())
  # Keys and tasks: refill r plays the stream's next B tasks with the folded key (a rollout is a
  # function of its tasks and key, so a resumed run, at the same stream position, draws the same).
  for r, (tasks, rng, _) in enumerate(calls[1:], start=1):
    folded = jax.random.fold_in(jax.random.fold_in(key, trainer.REFILL_STREAM), r)
    assert np.array_equal(jax.random.key_data(rng), jax.random.key_data(folded))
    assert tasks == TaskStream(program.spec.task_ids("train"), 1, B * r).take(B)
  assert stream.position == B * len(calls)
  # Collated to B x n rows, padding rows invalid.
  batch = rollout.collate(out.trajectories, num_turns=1, max_len=128, num_rows=B * n)
  learner.validate(batch, 1)
  assert batch.tokens.shape[0] == B * n
  assert int(batch.row_valid.sum()) == sum(
    1 for t in out.trajectories if t.tokens and not t.dropped
  )
  if max_refills == 3:
    assert refills >= 1  # this seed's first rollout had a group without signal
  else:
    assert len(used) < B  # ... so without refills the batch is short, and padded
    assert int(batch.row_valid.sum()) < B * n


def test_training_logs_the_refill_metrics(program, tmp_path):
  """Two DAPO iterations of the training program: the dapo/ counters in metrics.jsonl add up and
  every group of the batch has signal (the update's own filter drops none)."""
  c = small_config(dapo_max_refills=REFILLS)
  c.num_iterations = 2
  trainer._train(c, str(tmp_path), program)  # train() without building (and closing) a program
  records = metrics_log.read_metrics(str(tmp_path / "metrics.jsonl"))
  assert [r["iteration"] for r in records] == [1, 2]
  for r in records:
    refills = r["dapo/refill_rollouts"]
    assert 0 <= refills <= REFILLS
    assert r["dapo/informative_groups"] + r["dapo/discarded_groups"] == B * (1 + refills)
    assert r["dapo/informative_groups"] == B or refills == REFILLS
    assert r["groups_dropped"] == 0.0
    assert r["rows_dropped"] == 0.0
