r"""The quick start over many seeds: does `python experiments/run.py` learn, and how soon?

    python benchmarks/bench_default_seeds.py --workdir=/tmp/seeds               # seeds 0..9
    python benchmarks/bench_default_seeds.py --workdir=/tmp/seeds --seeds=0,3 \
        --config.optimizer.learning_rate=1e-3      # extra flags go to run.py (a variant)
    python benchmarks/bench_default_seeds.py --workdir=/tmp/seeds --report-only

Each seed runs the default config (`experiments/run.py`, `--config=synthetic`, its default
number of iterations) with `--config.seed=S` in its own process, one after another, in
`WORKDIR/seed<S>`; rerunning resumes unfinished runs. `--config.seed` seeds the model's
initialisation, the sampling keys and the order of the training tasks; the tasks themselves
(`env.seed`) and so the held-out tasks are the same for every seed.

Prints one line per seed and a summary: the first iteration at which the held-out avg@4
(evaluated every `eval.every` iterations) reached --target, the run's own time at that point
(the sum of its iterations' and evaluations' times, compilation included, start-up excluded:
`bench_synthetic.summarise`), the first iteration of training success >= --target (one
iteration's batch), and the final held-out avg@4 and pass@4; then how many seeds ended at or
above the target, the median and the worst seed's time to it. A seed that never reached the
target counts as later than every seed that did. `WORKDIR/seeds.md` gets the same table.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Optional

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_synthetic import summarise  # noqa: E402
from seeupo_jax.training import metrics_log  # noqa: E402

AVG = "eval/avg@4"
PASS = "eval/pass@4"


def _parse(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--seeds", default="0,1,2,3,4,5,6,7,8,9", help="comma-separated seeds")
  parser.add_argument("--target", type=float, default=0.9)
  parser.add_argument("--report-only", action="store_true", help="only read the seeds' runs")
  args, overrides = parser.parse_known_args(argv)
  bad = [o for o in overrides if not o.startswith("--config.")]
  if bad:
    parser.error(f"unrecognized arguments: {' '.join(bad)} (run.py overrides are --config.a.b=v)")
  try:
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
  except ValueError:
    parser.error(f"--seeds={args.seeds}: expected comma-separated integers")
  if not args.seeds:
    parser.error("--seeds: no seed given")
  args.overrides = overrides
  return args


def run_seed(workdir: str, seed: int, overrides) -> None:
  command = [
    sys.executable,
    os.path.join(_ROOT, "experiments", "run.py"),
    f"--workdir={workdir}",
    f"--config.seed={seed}",
    "--config.log.progress_bar=False",
    *overrides,
  ]
  print("$", " ".join(command), flush=True)
  subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def seed_summary(records: list[dict], target: float) -> dict:
  """The figures of one seed's run (see the module docstring)."""
  base = summarise(records, target)
  evals = [(i, r) for i, r in enumerate(records) if AVG in r]
  hit = [(i, r) for i, r in evals if r[AVG] >= target]
  return {
    "iterations": base["iterations"],
    "first_eval_iteration": hit[0][1]["iteration"] if hit else None,
    "first_eval_seconds": float(base["elapsed"][hit[0][0]]) if hit else None,
    "first_train_iteration": base["first_iteration"],
    "final_avg": base["final_avg@4"],
    "final_pass": base["final_pass@4"],
    "total_seconds": base["total_seconds"],
  }


def _minutes(seconds: Optional[float]) -> str:
  return "-" if seconds is None else f"{seconds / 60:.1f}"


def report(summaries: dict[int, dict], target: float) -> str:
  """The markdown table and summary lines."""
  lines = [
    f"| seed | first held-out avg@4 >= {target} (iteration) | (minutes) "
    f"| first train success >= {target} | final avg@4 | final pass@4 | iterations | minutes |",
    "|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for seed, s in summaries.items():
    first = "never" if s["first_eval_iteration"] is None else str(s["first_eval_iteration"])
    train = "never" if s["first_train_iteration"] is None else str(s["first_train_iteration"])
    final_avg = "-" if s["final_avg"] is None else f"{s['final_avg']:.3f}"
    final_pass = "-" if s["final_pass"] is None else f"{s['final_pass']:.3f}"
    lines.append(
      f"| {seed} | {first} | {_minutes(s['first_eval_seconds'])} | {train} | {final_avg} "
      f"| {final_pass} | {s['iterations']} | {_minutes(s['total_seconds'])} |"
    )
  finals = [s["final_avg"] for s in summaries.values()]
  ended = sum(f is not None and f >= target for f in finals)
  # A seed that never reached the target is later than any that did.
  times = sorted(
    np.inf if s["first_eval_seconds"] is None else s["first_eval_seconds"]
    for s in summaries.values()
  )
  median = float(np.median(times)) if times else np.inf

  def fmt(t: float) -> str:
    return "not reached" if not np.isfinite(t) else f"{t / 60:.1f} min"

  lines += [
    "",
    f"seeds ending at held-out avg@4 >= {target}: {ended} / {len(summaries)}",
    f"time to held-out avg@4 >= {target}: median {fmt(median)}, worst {fmt(times[-1])}",
  ]
  return "\n".join(lines)


def main(argv=None):
  args = _parse(argv)
  os.makedirs(args.workdir, exist_ok=True)
  summaries = {}
  for seed in args.seeds:
    workdir = os.path.join(args.workdir, f"seed{seed}")
    if not args.report_only:
      run_seed(workdir, seed, args.overrides)
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
      print(f"seed {seed}: no run in {workdir}", flush=True)
      continue
    summaries[seed] = seed_summary(metrics_log.read_metrics(path), args.target)
    s = summaries[seed]
    print(
      f"seed {seed}: first held-out avg@4 >= {args.target} at iteration "
      f"{s['first_eval_iteration']} ({_minutes(s['first_eval_seconds'])} min), final avg@4 "
      f"{s['final_avg']}",
      flush=True,
    )
  if not summaries:
    print("error: no finished seed to report", file=sys.stderr)
    return 2
  text = report(summaries, args.target)
  with open(os.path.join(args.workdir, "seeds.md"), "w", encoding="utf-8") as f:
    f.write(text + "\n")
  print("\n" + text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
