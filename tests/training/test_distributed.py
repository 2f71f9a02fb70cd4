"""Many processes without a cluster: `distributed.Processes` simulated by threads.

Each "process" is a thread with its own Roller (a text policy on the synthetic task) and a
`Processes` whose all-gather is a thread barrier, so the host-side logic of a multi-process
run (blocks of groups, the call's metrics and failure limit, DAPO's refill and its moves of
groups, evaluation) is checked against one process in seconds. The real multi-process run
(JAX's runtime, gloo): tests/training/test_run_multiprocess.py.
"""

import concurrent.futures
import dataclasses
import os
import re
import sys
import threading
import zlib
from typing import Any

import jax
import pytest

from seeupo_jax import distributed, envs, rollout, sampling
from seeupo_jax.text import chat_tokens
from seeupo_jax.envs import appworld
from seeupo_jax.training import evaluation, trainer
from seeupo_jax.training.tasks import TaskStream
import tiny

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

MODEL = tiny.model_config()
TIMES = (
  "rollout/time",
  "rollout/sample_time",
  "rollout/env_wait_time",
  "rollout/host_time",
  "rollout/env_wait_share",
  "rollout/tokens_per_s",
)


class _Exchange:
  """The all-gather of `count` threads: each puts its object, all wait, all read."""

  def __init__(self, count: int):
    self.barrier = threading.Barrier(count, timeout=60)
    self.slots: list = [None] * count

  def allgather(self, index: int, obj):
    self.barrier.wait()  # the previous exchange has been read by everyone
    self.slots[index] = obj
    self.barrier.wait()
    return list(self.slots)


@dataclasses.dataclass(frozen=True)
class ThreadProcesses(distributed.Processes):
  exchange: Any = None

  def allgather(self, obj):
    return self.exchange.allgather(self.index, obj)


def _group(count: int) -> list[distributed.Processes]:
  exchange = _Exchange(count)
  return [ThreadProcesses(i, count, 0, exchange=exchange) for i in range(count)]


def _each(processes, fn):
  """fn(process) in one thread per process; the results in process order."""
  with concurrent.futures.ThreadPoolExecutor(len(processes)) as pool:
    return [f.result(timeout=120) for f in [pool.submit(fn, p) for p in processes]]


def _policy(tok):
  """Answers each dial's clue, except sample 0 of tasks whose crc32 is even (wrong dial):
  those groups have two rewards (informative), the others one."""

  def reply(trajectory):
    clue = int(re.findall(r"clue (\d)", tok.decode(trajectory.tokens))[-1])
    wrong = trajectory.sample == 0 and zlib.crc32(trajectory.task_id.encode()) % 2 == 0
    return "a" if (clue < 5) != wrong else "z"

  return reply


def _roller(tok, processes=None):
  spec = envs.make_spec("synthetic", {"num_dials": 2})
  return rollout.Roller(
    spec,
    chat_tokens.ChatTokens(tok),
    MODEL,
    sampling.SamplingConfig(max_new_tokens=4),
    rollout.RolloutConfig(max_turns=2, env_workers=2),
    session_config=sampling.SessionConfig(rows=3, max_context_tokens=2048),
    text_policy=_policy(tok),
    processes=processes,
  )


def _summary(trajectories):
  return [(t.task_id, t.group, t.sample, t.tokens, t.reward, t.success) for t in trajectories]


def test_blocks_split_n_items_in_process_order():
  for count in (1, 2, 3, 4):
    for n in range(0, 11):
      blocks = [distributed.Processes(i, count).block(n) for i in range(count)]
      assert [x for b in blocks for x in b] == list(range(n))
      assert max(map(len, blocks)) - min(map(len, blocks)) <= 1
  assert distributed.Processes().allgather({"a": 1}) == [{"a": 1}]


@dataclasses.dataclass(frozen=True)
class _Device:
  id: int
  process_index: int


def test_split_last_of_each_sets_each_process_s_last_devices_apart():
  """2 hosts of 4 in blocks (0-3, 4-7), and 2 hosts whose devices alternate in the order (as a
  slice's topology order may give them)."""
  blocks = [_Device(i, i // 4) for i in range(8)]
  rest, apart = distributed.split_last_of_each(blocks, 2)
  assert [d.id for d in rest] == [0, 1, 4, 5]
  assert {p: [d.id for d in ds] for p, ds in apart.items()} == {0: [2, 3], 1: [6, 7]}
  alternating = [_Device(i, i % 2) for i in range(6)]
  rest, apart = distributed.split_last_of_each(alternating, 1)
  assert [d.id for d in rest] == [0, 1, 2, 3]
  assert {p: [d.id for d in ds] for p, ds in apart.items()} == {0: [4], 1: [5]}
  rest, apart = distributed.split_last_of_each(blocks, 0)
  assert rest == blocks and apart == {0: [], 1: []}


def test_processes_play_their_blocks_and_report_the_whole_call(tok):
  tasks = envs.make_spec("synthetic", {"num_dials": 2}).task_ids("train")[:5]
  key = jax.random.key(3)
  one = _roller(tok)
  want = one.run(None, tasks, 2, key)
  one.close()
  for count in (2, 3):
    rollers = [_roller(tok, p) for p in _group(count)]
    results = _each(rollers, lambda r: r.run(None, tasks, 2, key))
    for r in rollers:
      r.close()
    # Process p played its block of the groups, with their global numbers.
    for p, result in enumerate(results):
      groups = {t.group for t in result.trajectories}
      assert groups == set(distributed.Processes(p, count).block(len(tasks)))
    got = [t for result in results for t in result.trajectories]
    assert _summary(got) == _summary(want.trajectories)
    # Every process has the whole call's metrics (times aside).
    for result in results:
      assert set(result.metrics) == set(want.metrics)
      for key_name, value in want.metrics.items():
        if key_name not in TIMES:
          assert result.metrics[key_name] == pytest.approx(value, abs=1e-12), key_name
    assert results[0].metrics["rollout/trajectories"] == 10.0


def test_the_failed_group_limit_is_the_whole_call_s_in_every_process(tok):
  """One process's groups all fail: 2 of 4 groups is over a 25% limit for the call, so every
  process raises, also the one whose groups did not fail."""
  tasks = envs.make_spec("synthetic", {"num_dials": 2}).task_ids("train")[:4]
  rollers = [_roller(tok, p) for p in _group(2)]

  class Broken:
    def __init__(self, workers):
      self.workers = workers
      self.stats = workers.stats

    def reset(self, task_id):
      raise rollout.EnvCallFailed("broken server")

    def __getattr__(self, name):
      return getattr(self.workers, name)

  rollers[1].workers = Broken(rollers[1].workers)
  rollers[1].config = dataclasses.replace(rollers[1].config, episode_retries=0, reset_retries=0)

  def run(r):
    try:
      r.run(None, tasks, 2, jax.random.key(0))
    except rollout.EnvironmentFailure as e:
      return str(e)
    return None

  messages = _each(rollers, run)
  for r in rollers:
    r.close()
  assert all(m and "2 of 4 task groups failed" in m and "broken server" in m for m in messages)


def test_dapo_refill_over_processes_gives_each_its_block_of_the_one_process_batch(tok):
  train = envs.make_spec("synthetic", {"num_dials": 2}).task_ids("train")
  B, n, refills = 4, 2, 3
  key = jax.random.key(1)

  def refill(roller):
    stream = TaskStream(train, seed=5)
    first = roller.run(None, stream.take(B), n, key)
    out = trainer.refill_informative_groups(
      roller,
      stream,
      None,
      key,
      first,
      tasks_per_iteration=B,
      samples_per_task=n,
      max_refills=refills,
    )
    return out, stream.position

  one = _roller(tok)
  want, position = refill(one)
  one.close()
  assert want.metrics["dapo/refill_rollouts"] >= 1  # the first rollout had groups without signal
  rollers = [_roller(tok, p) for p in _group(2)]
  results = _each(rollers, refill)
  for r in rollers:
    r.close()
  blocks = [out for out, _ in results]
  assert all(pos == position for _, pos in results)  # the same tasks drawn everywhere
  # Process p holds the batch positions of its block (kept group j: rows j x n ...).
  for p, out in enumerate(blocks):
    mine = distributed.Processes(p, 2).block(B)
    assert {t.group for t in out.trajectories} <= set(mine)
  got = [t for out in blocks for t in out.trajectories]
  assert _summary(got) == _summary(want.trajectories)
  for out in blocks:
    for name in ("dapo/refill_rollouts", "dapo/informative_groups", "dapo/discarded_groups"):
      assert out.metrics[name] == want.metrics[name], name


def test_evaluation_is_split_and_gathered(tok):
  ids = envs.make_spec("synthetic", {"num_dials": 2}).task_ids("eval")[:5]
  key = jax.random.key(2)
  one = _roller(tok)
  want = evaluation.evaluate(one, None, ids, 2, key, tasks_per_call=3)
  one.close()
  rollers = [_roller(tok, p) for p in _group(2)]
  got = _each(rollers, lambda r: evaluation.evaluate(r, None, ids, 2, key, tasks_per_call=3))
  for r in rollers:
    r.close()
  assert got[0] == got[1] == want and want["tasks"] == 5.0


def test_appworld_servers_per_process():
  base = {"urls": "", "base_port": 8000, "num_servers": 16}
  assert appworld.options_for_process(base, 1, 2, 1)["base_port"] == 8016  # 2nd on its host
  assert appworld.options_for_process(base, 3, 4, 0)["base_port"] == 8000  # alone on its host
  lists = dict(base, urls="http://a:1,http://a:2;http://b:1")
  assert appworld.options_for_process(lists, 1, 2, 0)["urls"] == "http://b:1"
  with pytest.raises(ValueError, match="2 ';'-separated lists, but the run has 3"):
    appworld.options_for_process(lists, 0, 3, 0)
  with pytest.raises(ValueError, match="shared by several processes of one host"):
    appworld.options_for_process(dict(base, urls="http://127.0.0.1:8000"), 1, 2, 1)
  assert envs.process_options("synthetic", {"num_dials": 2}, 1, 2, 1) == {"num_dials": 2}
  assert envs.process_options("appworld", base, 0, 1, 0) == base


def test_initialize_starts_nothing_for_one_process(monkeypatch):
  for name in ("SLURM_STEP_NODELIST", "TPU_WORKER_HOSTNAMES", "OMPI_COMM_WORLD_SIZE"):
    monkeypatch.delenv(name, raising=False)
  assert distributed.initialize("auto") is False
  assert (
    distributed.initialize("no", num_processes=2, process_id=0, coordinator_address="h:1") is False
  )
  assert (
    distributed.initialize("auto", num_processes=1, process_id=0, coordinator_address="h:1")
    is False
  )
  with pytest.raises(distributed.DistributedError, match="go together"):
    distributed.initialize("auto", num_processes=2)
  with pytest.raises(distributed.DistributedError, match=r"must be in \[0, 2\)"):
    distributed.initialize("auto", num_processes=2, process_id=2, coordinator_address="h:1")
  with pytest.raises(distributed.DistributedError, match="allowed"):
    distributed.initialize("maybe")
