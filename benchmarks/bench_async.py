"""Iterations per hour with the rollout sampled ahead of the update (`pipeline.lag` k = 1, 2)
against the synchronous program (k = 0), side by side in one run.

Each scenario builds one training program (`trainer.build`, the synthetic config with the sizes
and environment latency of the flags) and trains it with each lag in turn, in the order
0, 1, 2, then 2, 1, 0 in the next round, so machine noise hits every lag alike. A run is
`trainer._train`, the loop `experiments/run.py` runs: `--warmup` iterations (compilation), then
`--iterations` timed ones. Reported per lag: iterations per hour over the timed iterations
(3600 / mean `time/iteration`), the medians of `time/rollout` (sampling the next batch) and
`time/update` (from the update's dispatch to its metrics: with a lag, the sampling it overlaps
included), and the speed-up over k = 0 (the ratio of iterations per hour, each round's own and
their median). With `--rollout_devices r` each lag > 0 also runs on a second program whose
sampler has the last r devices to itself (`pipeline.rollout_devices`), against the same k = 0
baseline on all the devices; simulate the devices with
XLA_FLAGS=--xla_force_host_platform_device_count=N. With `--partial_rollouts` each lag > 0 (and
placement) also runs with `pipeline.partial_rollouts` (the sampler swaps to the update's params
once they are ready, inside the episodes in progress); every run reports its reply tokens' mean
lag (`pipeline/token_lag_mean`) and the share sampled with the newer params
(`pipeline/swapped_token_share`), means over the timed iterations.

Scenarios (environment latency per step, `env.latency_ms` / `env.latency_p99_ms`):
  instant     no latency: the overlap is the sampler's device work and host work with the update's
  balanced    median 5 ms, p99 20 ms per step: on a 2-core CPU, a rollout about as long as the update
  tools       median 30 ms, p99 300 ms per step: a tool call's heavy tail
  default     the synthetic config's own sizes (B = 32, n = 8, 3 dials), no latency

    python benchmarks/bench_async.py                                  # instant and tools
    python benchmarks/bench_async.py --scenarios=default --iterations=6 --rounds=2
    python benchmarks/bench_async.py --tasks 4 --samples 2 --iterations 2 --rounds 1 --json out.json
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/bench_async.py --rollout_devices=1
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/bench_async.py \
        --lags=0,1 --rollout_devices=1 --partial_rollouts
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from experiments.configs import synthetic as synthetic_config  # noqa: E402
from seeupo_jax.training import metrics_log, trainer  # noqa: E402

SCENARIOS = {  # name: (latency_ms, latency_p99_ms, use the config's own sizes)
  "instant": (0.0, 0.0, False),
  "balanced": (5.0, 20.0, False),
  "tools": (30.0, 300.0, False),
  "default": (0.0, 0.0, True),
}


def make_config(
  args, scenario: str, lag: int, iterations: int, own: int = 0, partial: bool = False
):
  """The synthetic config of `scenario`, with `lag`, the sampler on `own` devices of its own (0:
  the learner's), partial rollouts or not, and the benchmark's sizes; no evaluation but the
  last, no logs but metrics.jsonl, checkpoints only at the end."""
  latency, p99, own_sizes = SCENARIOS[scenario]
  c = synthetic_config.get_config()
  if not own_sizes:
    c.rollout.tasks_per_iteration = args.tasks
    c.rollout.samples_per_task = args.samples
    c.env.num_dials = args.num_dials
  c.env.latency_ms = latency
  c.env.latency_p99_ms = p99
  c.pipeline.lag = lag
  c.pipeline.rollout_devices = own
  c.pipeline.partial_rollouts = partial
  c.num_iterations = iterations
  c.eval.every = 0
  c.eval.num_tasks = 4
  c.eval.k = 1
  c.checkpoint.every = 1_000_000
  c.log.progress_bar = False
  c.log.plot = False
  c.log.tensorboard = False
  c.log.trajectories = 0
  return c


def run_lag(args, program, scenario: str, lag: int, own: int = 0, partial: bool = False) -> dict:
  """One training run of `warmup + iterations` iterations at `lag`; its timed iterations."""
  total = args.warmup + args.iterations
  with tempfile.TemporaryDirectory(prefix="bench_async_") as workdir:
    trainer._train(make_config(args, scenario, lag, total, own, partial), workdir, program)
    records = metrics_log.read_metrics(os.path.join(workdir, "metrics.jsonl"))
  timed = records[args.warmup :]
  seconds = [r["time/iteration"] for r in timed]
  return {
    "iterations_per_hour": 3600.0 / statistics.mean(seconds),
    "rollout_s": statistics.median(r["time/rollout"] for r in timed),
    "update_s": statistics.median(r["time/update"] for r in timed),
    "iteration_s": statistics.median(seconds),
    "lag_trained": max(int(r.get("pipeline/lag", 0)) for r in timed),  # the schedule's own word
    "token_lag_mean": statistics.mean(r.get("pipeline/token_lag_mean", 0.0) for r in timed),
    "swapped_token_share": statistics.mean(
      r.get("pipeline/swapped_token_share", 0.0) for r in timed
    ),
  }


def variants(args) -> list[tuple[int, int, bool]]:
  """(lag, devices of the sampler's own, partial rollouts) of each run: every lag on the
  learner's devices, then, with --rollout_devices r, every lag > 0 with the sampler on r devices
  of its own; with --partial_rollouts each lag > 0 of each placement also with them."""
  out = [(lag, 0) for lag in args.lags]
  if args.rollout_devices:
    out += [(lag, args.rollout_devices) for lag in args.lags if lag > 0]
  runs = [(lag, own, False) for lag, own in out]
  if args.partial_rollouts:
    runs += [(lag, own, True) for lag, own in out if lag > 0]
  return runs


def label(lag: int, own: int, partial: bool = False) -> str:
  out = str(lag) if not own else f"{lag}, sampler on {own} of {jax.device_count()} devices"
  return out + (", partial rollouts" if partial else "")


def run_scenario(args, scenario: str) -> dict:
  runs = variants(args)
  programs = {}
  rounds = []
  try:
    for own in sorted({own for _, own, _ in runs}):
      programs[own] = trainer.build(make_config(args, scenario, 0, 1, own))
    for r in range(args.rounds):
      order = runs if r % 2 == 0 else list(reversed(runs))
      rounds.append({run: run_lag(args, programs[run[1]], scenario, *run) for run in order})
  finally:
    for program in programs.values():
      program.close()
  out = {"scenario": scenario, "lags": {}}
  base = runs[0]
  for run in runs:
    per_round = [rnd[run] for rnd in rounds]
    speedups = [
      rnd[run]["iterations_per_hour"] / rnd[base]["iterations_per_hour"] for rnd in rounds
    ]
    out["lags"][label(*run)] = {
      "iterations_per_hour": statistics.median(x["iterations_per_hour"] for x in per_round),
      "rollout_s": statistics.median(x["rollout_s"] for x in per_round),
      "update_s": statistics.median(x["update_s"] for x in per_round),
      "iteration_s": statistics.median(x["iteration_s"] for x in per_round),
      "lag_trained": max(x["lag_trained"] for x in per_round),
      "token_lag_mean": statistics.mean(x["token_lag_mean"] for x in per_round),
      "swapped_token_share": statistics.mean(x["swapped_token_share"] for x in per_round),
      "speedup": statistics.median(speedups),
      "speedup_per_round": speedups,
    }
  return out


def markdown_table(results: list[dict], base: int) -> str:
  lines = [
    f"| scenario | lag | iterations / hour | median rollout s | median update s | "
    f"median iteration s | mean token lag | swapped token share | "
    f"speed-up over lag {base} (per round) |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---|",
  ]
  for result in results:
    for lag, x in result["lags"].items():
      rounds = ", ".join(f"{s:.2f}" for s in x["speedup_per_round"])
      lines.append(
        f"| {result['scenario']} | {lag} | {x['iterations_per_hour']:.0f} | {x['rollout_s']:.3f} | "
        f"{x['update_s']:.3f} | {x['iteration_s']:.3f} | {x['token_lag_mean']:.2f} | "
        f"{x['swapped_token_share']:.2f} | {x['speedup']:.2f}x ({rounds}) |"
      )
  return "\n".join(lines)


def parse_args(argv=None):
  defaults = synthetic_config.get_config()
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--scenarios", default="instant,tools")
  parser.add_argument("--lags", default="0,1,2", help="the first is the baseline of the ratios")
  parser.add_argument(
    "--rollout_devices",
    type=int,
    default=0,
    help="also run each lag > 0 with the sampler on this many devices of its own "
    "(pipeline.rollout_devices; simulate devices with XLA_FLAGS)",
  )
  parser.add_argument(
    "--partial_rollouts",
    action="store_true",
    help="also run each lag > 0 (and placement) with pipeline.partial_rollouts",
  )
  parser.add_argument("--tasks", type=int, default=8, help="B (not in the default scenario)")
  parser.add_argument("--samples", type=int, default=defaults.rollout.samples_per_task, help="n")
  parser.add_argument("--num-dials", type=int, default=defaults.env.num_dials, help="turns")
  parser.add_argument("--iterations", type=int, default=8, help="timed iterations per run")
  parser.add_argument("--warmup", type=int, default=2, help="untimed iterations per run")
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--json", default=None, help="also write the result to this file")
  args = parser.parse_args(argv)
  names = args.scenarios.split(",")
  for name in names:
    if name not in SCENARIOS:
      parser.error(f"--scenarios: {name!r}; allowed: {sorted(SCENARIOS)}")
  args.scenarios = names
  try:
    args.lags = [int(x) for x in args.lags.split(",")]
  except ValueError:
    parser.error(f"--lags: {args.lags!r}; allowed: comma-separated ints in [0, 8]")
  if args.iterations < 1 or args.rounds < 1 or args.warmup < 1:
    parser.error("--iterations, --rounds and --warmup must be >= 1")
  return args


def main(argv=None):
  args = parse_args(argv)
  print(f"jax {jax.__version__}, devices {jax.devices()}, {os.cpu_count()} CPUs", flush=True)
  results = [run_scenario(args, name) for name in args.scenarios]
  print(markdown_table(results, args.lags[0]))
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
