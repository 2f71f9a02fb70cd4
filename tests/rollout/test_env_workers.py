"""The env workers: time limits, worker processes that die or run out of memory, restores."""

import functools
import os
import pickle
import re
import signal
import time

import pytest

import env_scripts
from seeupo_jax.envs import base
from seeupo_jax.rollout import workers as workers_lib

LIMIT = 1.0  # seconds: each call's time limit in these tests


def _workers(n=2, nondeterministic=False, **kw):
  config = workers_lib.WorkerConfig(isolation="process", workers=n, call_timeout_s=LIMIT, **kw)
  return workers_lib.ProcessWorkers(
    functools.partial(env_scripts.Scripted, nondeterministic), config
  )


@pytest.fixture
def pool():
  workers = _workers()
  yield workers
  workers.shutdown()
  assert workers_lib.wait_gone(workers.started_pids) == []


def _text(step: base.Step) -> str:
  return step.observation[0]["content"]


def test_calls_run_in_worker_processes_and_episodes_are_spread(pool):
  episodes = [pool.reset(f"t{i}")[0] for i in range(4)]
  assert [pool.affinity(e) for e in episodes] == [0, 1, 0, 1]
  for e in episodes:
    assert _text(pool.step(e, "hello")) == "step 1: hello"
  assert _text(pool.step(episodes[2], "again")) == "step 2: again"
  assert [pool.score(e).reward for e in episodes] == [1.0, 1.0, 2.0, 1.0]
  assert len(pool.started_pids) == 2 and os.getpid() not in pool.started_pids
  for e in episodes:
    pool.close(e)


def test_a_step_past_the_limit_is_an_error_observation_and_the_episode_goes_on(pool):
  hung, same_worker, other_worker = (pool.reset(t)[0] for t in ("hung", "b", "c"))
  assert pool.affinity(hung) == pool.affinity(other_worker) != pool.affinity(same_worker)
  for e in (hung, same_worker, other_worker):
    pool.step(e, "first")
  pid_before = pool.started_pids[pool.affinity(hung)]
  t0 = time.perf_counter()
  step = pool.step(hung, "spin")  # spins for ever: it returns only if the worker is stopped
  assert time.perf_counter() - t0 >= LIMIT  # not stopped before its limit
  assert not step.done and step.info["stopped"] == "took longer than 1 s"
  assert _text(step).startswith("Error: the call took longer than 1 s and was stopped")
  # The episode goes on from its state before the stopped reply (replayed in a fresh worker).
  assert _text(pool.step(hung, "second")) == "step 2: second"
  assert pool.score(hung).details["replies"] == ["first", "second"]
  # The other episode of the killed worker is rebuilt too; the other worker never noticed.
  assert _text(pool.step(other_worker, "second")) == "step 2: second"
  assert _text(pool.step(same_worker, "second")) == "step 2: second"
  assert pool.stats == workers_lib.WorkerStats(timeouts=1, restarts=1, restores=2)
  assert workers_lib.wait_gone([pid_before]) == []
  assert len(pool.started_pids) == 3


def test_a_worker_killed_between_calls_is_replaced_and_its_episodes_restored(pool):
  episode, _ = pool.reset("t")
  pool.step(episode, "a")
  os.kill(pool.started_pids[pool.affinity(episode)], signal.SIGKILL)
  time.sleep(0.1)
  assert _text(pool.step(episode, "b")) == "step 2: b"
  assert pool.stats.restarts == 1 and pool.stats.restores == 1


def test_a_worker_dying_during_a_call_is_the_environments_failure(pool):
  episode, _ = pool.reset("t")
  with pytest.raises(workers_lib.EnvCallFailed, match=r"died \(killed by SIGKILL\)"):
    pool.step(episode, "die")
  fresh, _ = pool.reset("u")  # the run goes on
  assert _text(pool.step(fresh, "x")) == "step 1: x"


def test_an_environment_exception_is_one_line_and_keeps_the_worker(pool):
  episode, _ = pool.reset("t")
  pid = pool.started_pids[pool.affinity(episode)]
  with pytest.raises(workers_lib.EnvCallFailed) as info:
    pool.step(episode, "raise")
  assert str(info.value) == "step failed: ConnectionError: server down"
  assert "Traceback" not in str(info.value) and "\n" not in str(info.value)
  assert _text(pool.step(episode, "ok")) == "step 1: ok"  # same process, same episode
  assert pool.started_pids[pool.affinity(episode)] == pid and pool.stats.restarts == 0


def test_reset_and_score_past_their_limits_are_environment_failures(pool):
  with pytest.raises(workers_lib.EnvCallFailed, match="reset.*took longer than 1 s"):
    pool.reset("slow-reset:30")
  episode, _ = pool.reset("slow-score:30")
  pool.step(episode, "a")  # score's limit: LIMIT x (1 + 1 reply) = 2 s
  live = workers_lib.live_pids(pool.started_pids)
  t0 = time.perf_counter()
  with pytest.raises(workers_lib.EnvCallFailed, match="score took longer than 2 s"):
    pool.score(episode)  # sleeps 30 s: stopped at its limit
  assert time.perf_counter() - t0 >= 2 * LIMIT  # the scaled limit, not the step's 1 s
  # The reset's and the score's worker processes were stopped (killed, not waited for).
  assert pool.stats.restarts == 2 and len(live) == 2 and len(workers_lib.live_pids(live)) == 1


def test_running_out_of_memory_is_stopped_like_a_timeout():
  workers = _workers(n=1, memory_limit_mb=400)
  try:
    episode, _ = workers.reset("t")
    workers.step(episode, "small")
    step = workers.step(episode, "alloc:1000")
    assert step.info["stopped"] == "needed more than 400 MB of memory"
    assert _text(workers.step(episode, "after")) == "step 2: after"
    assert workers.stats.out_of_memory == 1 and workers.stats.restores == 1
  finally:
    workers.shutdown()


def test_an_episode_that_replays_differently_cannot_be_restored():
  workers = _workers(n=1, nondeterministic=True)
  try:
    episode, _ = workers.reset("t")
    workers.step(episode, "a")
    assert workers.step(episode, "spin").info["stopped"]
    with pytest.raises(workers_lib.EnvCallFailed, match="answered differently"):
      workers.step(episode, "b")
  finally:
    workers.shutdown()


def test_shutdown_leaves_no_process_and_factories_must_be_picklable():
  workers = _workers(n=3)
  episode, _ = workers.reset("t")
  workers.step(episode, "spin")  # one worker killed, replaced at the next call
  workers.step(episode, "b")
  pids = list(workers.started_pids)
  assert len(pids) == 4 and len(workers_lib.live_pids(pids)) == 3
  workers.shutdown()
  assert workers_lib.wait_gone(pids) == []
  with pytest.raises(ValueError, match="cannot be sent to a worker process.*'thread'"):
    workers_lib.ProcessWorkers(lambda: env_scripts.Scripted(), workers_lib.WorkerConfig())


def test_thread_workers_report_environment_exceptions_on_one_line():
  workers = workers_lib.ThreadWorkers(env_scripts.Scripted)
  episode, _ = workers.reset("t")
  assert _text(workers.step(episode, "a")) == "step 1: a"
  with pytest.raises(workers_lib.EnvCallFailed, match=r"\Astep failed: ConnectionError: server"):
    workers.step(episode, "raise")
  workers.close(episode)


@pytest.mark.parametrize(
  "kwargs, message",
  [
    ({"isolation": "fork"}, "WorkerConfig.isolation='fork'; allowed: one of ['thread', 'process']"),
    ({"workers": 0}, "WorkerConfig.workers=0; allowed: an int >= 1"),
    ({"call_timeout_s": 0}, "WorkerConfig.call_timeout_s=0; allowed: a finite number > 0"),
    ({"memory_limit_mb": -1}, "WorkerConfig.memory_limit_mb=-1; allowed: an int >= 0 (0: none)"),
  ],
)
def test_bad_worker_configs_name_the_key(kwargs, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    workers_lib.WorkerConfig(**kwargs)


def test_the_scripted_environment_pickles():
  make = functools.partial(env_scripts.Scripted, False)
  assert pickle.loads(pickle.dumps(make))().reset("x").messages
