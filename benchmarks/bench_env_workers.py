"""Env workers: what a call costs in threads vs worker processes, and what a stopped call costs.

On the synthetic lock task (environment calls of a few microseconds, so what is
measured is the worker layer itself):

  latency     one thread plays `--episodes` episodes (reset, one step per dial,
              score, close) through `ThreadWorkers` and through `ProcessWorkers`
              (one worker), alternating episode by episode; microseconds per call
              (median) and their ratio;
  throughput  `--threads` threads play them all at once, through thread workers and
              through `--processes` worker processes; episodes per second;
  stop        a step that hangs (`while True`) under a `--limit` s time limit, in a
              worker holding `--others` other episodes: the stopped call's seconds
              (the limit), then the next call of each episode (a fresh worker, its
              episode replayed): the price of a hung call beyond the limit.

  .venv/bin/python benchmarks/bench_env_workers.py
  .venv/bin/python benchmarks/bench_env_workers.py --episodes 64 --limit 0.5
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import platform
import sys
import time

import numpy as np

from seeupo_jax import envs
from seeupo_jax.envs import base
from seeupo_jax.rollout import workers as workers_lib
from seeupo_jax.training import oracle

_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")


def _episode_calls(env_workers, task_id: str, dials: int) -> list[float]:
  """Seconds of each call of one episode: reset, `dials` steps, score, close."""
  times = []
  t0 = time.perf_counter()
  episode, _ = env_workers.reset(task_id)
  times.append(time.perf_counter() - t0)
  for _ in range(dials):
    t0 = time.perf_counter()
    env_workers.step(episode, "a")
    times.append(time.perf_counter() - t0)
  for call in (env_workers.score, env_workers.close):
    t0 = time.perf_counter()
    call(episode)
    times.append(time.perf_counter() - t0)
  return times


def latency(spec: base.EnvSpec, ids: list[str], dials: int) -> dict:
  thread = workers_lib.ThreadWorkers(spec.make)
  process = workers_lib.ProcessWorkers(
    spec.make, workers_lib.WorkerConfig(isolation="process", workers=1)
  )
  try:
    for task_id in ids[:8]:  # warm-up
      _episode_calls(thread, task_id, dials)
      _episode_calls(process, task_id, dials)
    calls = {"thread": [], "process": []}
    for task_id in ids:
      calls["thread"] += _episode_calls(thread, task_id, dials)
      calls["process"] += _episode_calls(process, task_id, dials)
  finally:
    process.shutdown()
  out = {name: float(np.median(times) * 1e6) for name, times in calls.items()}
  return {
    "calls": len(calls["thread"]),
    "thread_us_median": out["thread"],
    "process_us_median": out["process"],
    "process_minus_thread_us": out["process"] - out["thread"],
  }


def throughput(spec: base.EnvSpec, ids: list[str], dials: int, threads: int, processes: int):
  routes = {
    "thread": lambda: workers_lib.ThreadWorkers(spec.make),
    "process": lambda: workers_lib.ProcessWorkers(
      spec.make, workers_lib.WorkerConfig(isolation="process", workers=processes)
    ),
  }
  out = {"episodes": len(ids), "threads": threads, "processes": processes}
  replies = ["a"] * dials
  for name, make in routes.items():
    env_workers = make()
    try:
      with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda i: oracle.play(env_workers, i, replies), ids[: 4 * processes]))
        t0 = time.perf_counter()
        list(pool.map(lambda i: oracle.play(env_workers, i, replies), ids))
        seconds = time.perf_counter() - t0
    finally:
      env_workers.shutdown()
    out[f"{name}_episodes_per_s"] = len(ids) / seconds
  out["process_over_thread"] = out["process_episodes_per_s"] / out["thread_episodes_per_s"]
  return out


def stop_cost(limit: float, others: int) -> dict:
  """A hung step among `others` episodes of one worker: its seconds, then the next calls'."""
  sys.path.insert(0, _TESTS)
  import env_scripts  # noqa: PLC0415  (the tests' scripted environment: "spin" hangs)

  config = workers_lib.WorkerConfig(isolation="process", workers=1, call_timeout_s=limit)
  env_workers = workers_lib.ProcessWorkers(env_scripts.Scripted, config)
  try:
    episodes = [env_workers.reset(f"t{k}")[0] for k in range(others + 1)]
    for episode in episodes:
      for _ in range(3):
        env_workers.step(episode, "a")
    t0 = time.perf_counter()
    stopped = env_workers.step(episodes[0], "spin")
    stopped_s = time.perf_counter() - t0
    assert stopped.info["stopped"]
    after = []
    for episode in episodes:  # each: restored in the fresh worker (the first also starts it)
      t0 = time.perf_counter()
      env_workers.step(episode, "a")
      after.append(time.perf_counter() - t0)
    steady = []
    for episode in episodes:
      t0 = time.perf_counter()
      env_workers.step(episode, "a")
      steady.append(time.perf_counter() - t0)
    stats = dataclasses.asdict(env_workers.stats)
  finally:
    env_workers.shutdown()
  return {
    "limit_s": limit,
    "episodes_on_the_worker": others + 1,
    "stopped_call_s": stopped_s,
    "first_call_after_s": after[0],  # a worker process started, then this episode replayed
    "other_calls_after_ms_median": float(np.median(after[1:]) * 1e3) if others else 0.0,
    "steady_call_ms_median": float(np.median(steady) * 1e3),
    "stats": stats,
  }


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--episodes", type=int, default=256)
  parser.add_argument("--dials", type=int, default=3)
  parser.add_argument("--threads", type=int, default=8)
  parser.add_argument("--processes", type=int, default=2)
  parser.add_argument("--limit", type=float, default=1.0)
  parser.add_argument("--others", type=int, default=15)
  args = parser.parse_args(argv)
  spec = envs.make_spec("synthetic", {"num_dials": args.dials, "num_train_tasks": args.episodes})
  ids = list(spec.task_ids("train"))
  result = {
    "machine": platform.processor() or platform.machine(),
    "cpus": os.cpu_count(),
    "args": vars(args),
    "latency": latency(spec, ids, args.dials),
    "throughput": throughput(spec, ids, args.dials, args.threads, args.processes),
    "stop": stop_cost(args.limit, args.others),
  }
  lat, thr, stop = result["latency"], result["throughput"], result["stop"]
  print(
    f"latency per call ({lat['calls']} calls): thread {lat['thread_us_median']:.1f} us, "
    f"process {lat['process_us_median']:.1f} us"
  )
  print(
    f"throughput ({thr['episodes']} episodes, {thr['threads']} threads): thread workers "
    f"{thr['thread_episodes_per_s']:.0f}/s, {thr['processes']} processes "
    f"{thr['process_episodes_per_s']:.0f}/s ({thr['process_over_thread']:.2f}x)"
  )
  print(
    f"a hung step (limit {stop['limit_s']:g} s, {stop['episodes_on_the_worker']} episodes on its "
    f"worker): stopped after {stop['stopped_call_s']:.2f} s; next call {stop['first_call_after_s']:.2f}"
    f" s (new worker + replay), the others' next calls {stop['other_calls_after_ms_median']:.2f} ms"
    f" (replay), then {stop['steady_call_ms_median']:.2f} ms"
  )
  print(json.dumps(result, indent=1))
  return result


if __name__ == "__main__":
  main()
