r"""Learning curves on the synthetic task: SeeUPO against GRPO, GSPO and PPO, same budget.

    python benchmarks/bench_synthetic.py --workdir=/tmp/synthetic --iterations=300
    python benchmarks/bench_synthetic.py --workdir=/tmp/synthetic --plot-only   # from finished runs
    python benchmarks/bench_synthetic.py --workdir=/tmp/synthetic --algorithms=dr_grpo,dapo
        # today's baselines (any `learner.ALGORITHMS` name; gspo_token runs gspo's update)

Each algorithm runs `experiments/run.py --config=synthetic` (the default config: a tiny Qwen3
from scratch, 16 tasks x 8 samples per iteration, 3 dials) for the same number of iterations in
its own process, one after another, in `WORKDIR/<algorithm>`; rerunning resumes unfinished runs.
It then writes `WORKDIR/curves.png` (success against iteration and against wall time, with the
held-out avg@4) and prints a markdown table: the iteration and time at which the training success
first reached --target, and the final held-out avg@4 / pass@4.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

from seeupo_jax.training import metrics_log  # noqa: E402


def _parse():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--algorithms", default="seeupo,grpo,gspo,ppo")
  parser.add_argument("--iterations", type=int, default=300)
  parser.add_argument("--target", type=float, default=0.9)
  parser.add_argument("--plot-only", action="store_true", help="only read finished runs")
  parser.add_argument("overrides", nargs="*", help="extra --config.a.b=value flags for run.py")
  return parser.parse_args()


def run_algorithm(workdir: str, algorithm: str, iterations: int, overrides) -> None:
  command = [
    sys.executable,
    os.path.join(_ROOT, "experiments", "run.py"),
    "--config=synthetic",
    f"--workdir={workdir}",
    f"--config.learner.algorithm={algorithm}",
    f"--config.num_iterations={iterations}",
    "--config.log.progress_bar=False",
    *overrides,
  ]
  print("$", " ".join(command), flush=True)
  subprocess.run(command, check=True)


def summarise(records: list[dict], target: float) -> dict:
  """Iteration / seconds (iteration time + evaluation time, cumulative) of the first training
  success >= target, and the last held-out evaluation."""
  elapsed = np.cumsum([r["time/iteration"] + r.get("time/eval", 0.0) for r in records])
  hit = [i for i, r in enumerate(records) if r["success"] >= target]
  evals = [r for r in records if "eval/avg@4" in r]
  return {
    "iterations": len(records),
    "first_iteration": records[hit[0]]["iteration"] if hit else None,
    "first_seconds": float(elapsed[hit[0]]) if hit else None,
    "total_seconds": float(elapsed[-1]),
    "median_iteration_s": float(np.median([r["time/iteration"] for r in records])),
    "final_avg@4": evals[-1]["eval/avg@4"] if evals else None,
    "final_pass@4": evals[-1]["eval/pass@4"] if evals else None,
    "elapsed": elapsed,
  }


def trailing_mean(x: np.ndarray, window: int) -> np.ndarray:
  """Mean of the last `window` values at each point (fewer at the start)."""
  sums = np.cumsum(np.insert(x, 0, 0.0))
  counts = np.minimum(np.arange(1, len(x) + 1), window)
  return (sums[1:] - sums[np.maximum(np.arange(1, len(x) + 1) - window, 0)]) / counts


def plot(curves: dict, png: str, target: float) -> None:
  """Success against iteration (the shared budget); wall time is in the table, not the plot
  (only runs alone on the machine have comparable times)."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

  fig = Figure(figsize=(8, 4.2))
  FigureCanvasAgg(fig)
  ax = fig.add_subplot(1, 1, 1)
  for name, (records, _) in curves.items():
    it = np.array([r["iteration"] for r in records])
    success = trailing_mean(np.array([r["success"] for r in records], float), 5)
    (line,) = ax.plot(it, success, label=name)
    evals = [(r["iteration"], r["eval/avg@4"]) for r in records if "eval/avg@4" in r]
    if evals:
      ax.plot(*zip(*evals), "o", color=line.get_color(), ms=3)
  ax.axhline(1 / 8, color="gray", ls=":", lw=1, label="chance (1/8)")
  ax.axhline(target, color="gray", ls="--", lw=1)
  ax.set_xlabel("iteration (16 tasks x 8 samples each)")
  ax.set_ylabel("success")
  ax.set_ylim(-0.02, 1.02)
  ax.legend(loc="upper left")
  ax.set_title("synthetic lock, 3 dials: train success (5-iteration mean), dots: held-out avg@4")
  fig.tight_layout()
  fig.savefig(png, dpi=110)


def main():
  args = _parse()
  os.makedirs(args.workdir, exist_ok=True)
  curves = {}
  for algorithm in args.algorithms.split(","):
    workdir = os.path.join(args.workdir, algorithm)
    if not args.plot_only:
      run_algorithm(workdir, algorithm, args.iterations, args.overrides)
    records = metrics_log.read_metrics(os.path.join(workdir, "metrics.jsonl"))
    curves[algorithm] = (records, summarise(records, args.target))
  png = os.path.join(args.workdir, "curves.png")
  plot(curves, png, args.target)
  print(f"\ncurves: {png}\n")
  print(
    f"| algorithm | iterations | first success >= {args.target} (iteration) | (minutes) "
    "| median s / iteration | final held-out avg@4 | pass@4 |"
  )
  print("|---|---:|---:|---:|---:|---:|---:|")
  for name, (_, s) in curves.items():
    first = "never" if s["first_iteration"] is None else str(s["first_iteration"])
    minutes = "-" if s["first_seconds"] is None else f"{s['first_seconds'] / 60:.1f}"
    print(
      f"| {name} | {s['iterations']} | {first} | {minutes} | {s['median_iteration_s']:.2f} "
      f"| {s['final_avg@4']:.3f} | {s['final_pass@4']:.3f} |"
    )


if __name__ == "__main__":
  main()
