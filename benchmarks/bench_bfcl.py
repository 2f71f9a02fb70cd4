"""BFCL environment overhead per episode, without a model: our environment vs the bare official path.

For every selected entry, the oracle's replies (the ground-truth calls as
`<tool_call>` blocks, built before the clock starts) are played through

  (a) ours: `BfclEnv` reset, one step per reply (parse with json, check against
      the docs, rebuild the executor strings, run them with BFCL's executor,
      format the tool messages), score (BFCL's checker) and close (drop the
      backend instances);
  (b) bare: the same calls as BFCL's own strings, given straight to
      `execute_multi_turn_func_call` turn by turn, then `multi_turn_checker`,
      then the same instance cleanup: what any BFCL-based environment pays;
  (c) process: route (a) through the env workers in a worker process
      (`ProcessWorkers`, one worker: the training default for BFCL), so (c) - (a)
      is the price of isolation (a pickled request and answer per call, over a
      socket pair);
  (d) signals: route (a) with `turn_signals=True` (a backend digest after every
      reply, the ground truth's replay and the per-turn check at the end of every
      user turn: what GiGPO and MT-GRPO need).

Routes alternate entry by entry (A B C D A B C D, `--repeats` rounds), one thread,
so (a) / (b) is the price of our parsing, checking and bookkeeping, (c) / (a)
that of the worker process and (d) / (a) that of the turn signals. Reported: median and p99 milliseconds per episode
of each route and their ratios, per split, and the share of entries the oracle
finishes within `--max-turns`.

Throughput (`--throughput-workers`, 0 to skip): every entry of the first split
played by 8 threads at once through thread workers (one process: the GIL runs
one backend call at a time) and through that many worker processes; episodes
per second of each and their ratio.

  .venv/bin/python benchmarks/bench_bfcl.py                      # all 800 entries, 3 rounds
  .venv/bin/python benchmarks/bench_bfcl.py --splits multi_turn_base --entries 20 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import uuid

import numpy as np

from seeupo_jax.envs import bfcl
from seeupo_jax.rollout import workers as workers_lib
from seeupo_jax.training import oracle


def play_ours(
  data: bfcl.BfclData, entry_id: str, replies: list[str], config=bfcl.BfclConfig()
) -> tuple[float, bool]:
  t0 = time.perf_counter()
  env = bfcl.BfclEnv(data, config)
  env.reset(entry_id)
  for reply in replies:
    if env.step(reply).done:
      break
  success = env.score().success
  env.close()
  return time.perf_counter() - t0, success


def play_process(
  workers: workers_lib.ProcessWorkers, entry_id: str, replies: list[str]
) -> tuple[float, bool]:
  t0 = time.perf_counter()
  episode = oracle.play(workers, entry_id, replies)
  return time.perf_counter() - t0, episode.success


def throughput(data: bfcl.BfclData, ids: list[str], processes: int) -> dict:
  """Episodes per second of every entry in `ids`, 8 at a time, on threads vs processes."""
  spec = bfcl.spec(bfcl.BfclConfig())
  out = {"threads": 8, "processes": processes, "episodes": len(ids)}
  routes = {
    "thread": lambda: workers_lib.ThreadWorkers(spec.make),
    "process": lambda: workers_lib.ProcessWorkers(
      spec.make, workers_lib.WorkerConfig(isolation="process", workers=processes)
    ),
  }
  for name, make in routes.items():
    env_workers = make()
    try:
      oracle.run_oracle(spec, ids[: 2 * processes], 8, env_workers)  # warm every worker
      t0 = time.perf_counter()
      episodes = oracle.run_oracle(spec, ids, 8, env_workers)
      seconds = time.perf_counter() - t0
    finally:
      env_workers.shutdown()
    assert all(e.success for e in episodes), name
    out[f"{name}_episodes_per_s"] = len(ids) / seconds
  out["process_over_thread"] = out["process_episodes_per_s"] / out["thread_episodes_per_s"]
  return out


def play_bare(data: bfcl.BfclData, entry_id: str) -> tuple[float, bool]:
  entry = data.entry(entry_id)
  t0 = time.perf_counter()
  name = f"bare_{uuid.uuid4().hex}"
  decoded = []
  for calls in entry.ground_truth:
    if calls:
      data.utils.execute_multi_turn_func_call(
        calls,
        entry.initial_config,
        entry.involved_classes,
        name,
        entry.entry_id,
        long_context="long_context" in entry.category,
      )
    decoded.append([calls] if calls else [])
  verdict = data.checker.multi_turn_checker(
    decoded, entry.ground_truth, entry.checker_entry(), entry.category, name
  )
  bfcl.drop_instances(data.utils, name)
  return time.perf_counter() - t0, bool(verdict["valid"])


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--splits", default=",".join(bfcl.SPLITS))
  parser.add_argument("--entries", type=int, default=200, help="first N entries of each split")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--max-turns", type=int, default=10)
  parser.add_argument(
    "--throughput-workers", type=int, default=2, help="worker processes of the throughput run"
  )
  args = parser.parse_args(argv)
  data = bfcl.load_data()
  spec = bfcl.spec(bfcl.BfclConfig())
  workers = workers_lib.ProcessWorkers(
    spec.make, workers_lib.WorkerConfig(isolation="process", workers=1)
  )
  rows = []
  try:
    for split in args.splits.split(","):
      ids = [f"{split}_{k}" for k in range(args.entries)]
      replies = {i: bfcl.oracle_replies(data, i) for i in ids}
      signals_config = bfcl.BfclConfig(turn_signals=True)
      for i in ids[:5]:  # warm-up: first calls of each backend class
        play_ours(data, i, replies[i])
        play_bare(data, i)
        play_process(workers, i, replies[i])
        play_ours(data, i, replies[i], signals_config)
      ours, bare, process, signals, solved = [], [], [], [], []
      for _ in range(args.repeats):
        for i in ids:
          for times, (seconds, ok) in (
            (ours, play_ours(data, i, replies[i])),
            (bare, play_bare(data, i)),
            (process, play_process(workers, i, replies[i])),
            (signals, play_ours(data, i, replies[i], signals_config)),
          ):
            times.append(seconds)
            solved.append(ok)
      ours_ms, bare_ms = np.asarray(ours) * 1e3, np.asarray(bare) * 1e3
      process_ms, signals_ms = np.asarray(process) * 1e3, np.asarray(signals) * 1e3
      rows.append(
        {
          "split": split,
          "entries": len(ids),
          "ours_ms_median": float(np.median(ours_ms)),
          "ours_ms_p99": float(np.percentile(ours_ms, 99)),
          "bare_ms_median": float(np.median(bare_ms)),
          "bare_ms_p99": float(np.percentile(bare_ms, 99)),
          "process_ms_median": float(np.median(process_ms)),
          "process_ms_p99": float(np.percentile(process_ms, 99)),
          "ratio_median": float(np.median(ours_ms) / np.median(bare_ms)),
          "process_over_ours": float(np.median(process_ms) / np.median(ours_ms)),
          "signals_ms_median": float(np.median(signals_ms)),
          "signals_over_ours": float(np.median(signals_ms) / np.median(ours_ms)),
          "oracle_success": float(np.mean(solved)),
          "oracle_turns_median": float(np.median([len(r) for r in replies.values()])),
          "within_max_turns": float(np.mean([len(r) <= args.max_turns for r in replies.values()])),
        }
      )
  finally:
    workers.shutdown()
  print(
    "| split | entries | ours median ms | ours p99 | bare median ms | bare p99 | ours/bare "
    "| process median ms | process p99 | process/ours | signals median ms | signals/ours |"
  )
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  for r in rows:
    print(
      f"| {r['split']} | {r['entries']} | {r['ours_ms_median']:.2f} | {r['ours_ms_p99']:.2f} | "
      f"{r['bare_ms_median']:.2f} | {r['bare_ms_p99']:.2f} | {r['ratio_median']:.2f}x | "
      f"{r['process_ms_median']:.2f} | {r['process_ms_p99']:.2f} | "
      f"{r['process_over_ours']:.2f}x | {r['signals_ms_median']:.2f} | "
      f"{r['signals_over_ours']:.2f}x |"
    )
  result = {
    "machine": platform.processor() or platform.machine(),
    "cpus": os.cpu_count(),
    "args": vars(args),
    "rows": rows,
  }
  if args.throughput_workers > 0:
    first = args.splits.split(",")[0]
    ids = [f"{first}_{k}" for k in range(args.entries)]
    result["throughput"] = throughput(data, ids, args.throughput_workers)
    t = result["throughput"]
    print(
      f"throughput, {t['episodes']} episodes of {first}, 8 threads: thread workers "
      f"{t['thread_episodes_per_s']:.0f}/s, {t['processes']} worker processes "
      f"{t['process_episodes_per_s']:.0f}/s ({t['process_over_thread']:.2f}x)"
    )
  print(json.dumps(result, indent=1))
  return result


if __name__ == "__main__":
  main()
