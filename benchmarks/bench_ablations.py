r"""The paper's ablations on the LLM path: SeeUPO's update order, normalisation and correction.

    python benchmarks/bench_ablations.py --workdir=/tmp/ablations              # the whole grid
    python benchmarks/bench_ablations.py --workdir=/tmp/ablations --plot-only  # finished runs only
    python benchmarks/bench_ablations.py --workdir=/tmp/ablations --variants=reverse,nocorr \
        --seeds=3 --config.rollout.tasks_per_iteration=16     # extra flags go to run.py

Each (variant, seed) runs `experiments/run.py --config=synthetic` (the real rollouts, learner
and model) in its own process, one after another, in `WORKDIR/<variant>/seed<S>`; rerunning
resumes unfinished runs. The grid runs seed by seed (every variant's seed 0 first). Variants
change one factor of SeeUPO's default (order reverse, normalisation batch, correction on), see
`VARIANTS`.

The task (`TASK`, smaller than the synthetic config's default so that 6 variants x 5 seeds fit
on a 2-core CPU): 2 dials without decoys (chance 1/4), 2 turns, 16 tasks x 8 samples per
iteration, a 96-token context (a trajectory is 64 tokens), `--iterations` (default 125),
held-out avg@4 on 32 tasks every 50 iterations and at the last.
`--config.seed=S` seeds the model's initialisation, the sampling keys and the order in which
training tasks are drawn; the tasks themselves (`env.seed`) stay the same for every seed, so the
held-out tasks are the same in every run. The JAX compilation cache (`WORKDIR/jax_cache`) is
shared by the runs: it shortens their start, not their iterations.

Writes `WORKDIR/table.md` and `WORKDIR/curves.png`: per variant, the mean over seeds of the
training success (5-iteration trailing mean per seed, as `bench_synthetic`) with its 95%
Student-t interval, the iteration at which each seed's training success first reached
--target (`bench_synthetic.summarise`'s rule: the raw per-iteration success; median over all
seeds, a seed that never reached it counting as later than the budget), the final held-out
avg@4 and the last 10 iterations' success with their intervals, and paired t-test p-values of
these two against the first variant (seed S of every variant starts from the same model).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from typing import Optional, Sequence

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_synthetic import run_algorithm, summarise, trailing_mean  # noqa: E402
from seeupo_jax.training import metrics_log  # noqa: E402

ALGORITHM = "seeupo"
DEFAULT = {"order": "reverse", "normalisation": "batch", "correction": True}
"""SeeUPO's default learner settings; every run sets all three explicitly."""

VARIANTS = {
  "reverse": {},  # the default
  "forward": {"order": "forward"},
  "random": {"order": "random"},
  "group": {"normalisation": "group"},
  "none": {"normalisation": "none"},
  "nocorr": {"correction": False},
}
"""Each variant: what it changes in `DEFAULT` (one factor at a time)."""

TASK = (
  "--config.env.num_dials=2",
  "--config.rollout.max_turns=2",
  "--config.env.decoys=False",
  "--config.env.labels=True",  # "Dial 1: clue 3."
  "--config.rollout.tasks_per_iteration=16",
  "--config.learner.kl_coef=0",
  "--config.rollout.max_context_tokens=96",
  "--config.eval.every=50",
  "--config.eval.num_tasks=32",
)
"""The smaller synthetic task every run uses (before the extra overrides, which win)."""

SMOOTH = 5  # the trailing-mean window of the curves (bench_synthetic's plot)
FINAL = 10  # the final training success: the mean of the last FINAL iterations


def learner_flags(variant: str) -> list[str]:
  """run.py's learner overrides of `variant`: `DEFAULT` with the variant's change."""
  settings = {**DEFAULT, **VARIANTS[variant]}
  return [f"--config.learner.{key}={value}" for key, value in settings.items()]


def t_quantile(df: int, level: float = 0.95) -> float:
  """The two-sided Student-t quantile: P(|T_df| <= q) = level."""
  from scipy import stats  # pylint: disable=g-import-not-at-top

  return float(stats.t.ppf(0.5 + level / 2, df))


def mean_interval(values, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
  """Mean over axis 0 (the seeds) and the half width of its Student-t interval,
  t_{n-1} * std(ddof=1) / sqrt(n) (NaN with one seed)."""
  values = np.asarray(values, np.float64)
  n = values.shape[0]
  mean = values.mean(0)
  if n < 2:
    return mean, np.full_like(mean, np.nan)
  return mean, t_quantile(n - 1, level) * values.std(0, ddof=1) / math.sqrt(n)


def first_reach(records: Sequence[dict], target: float) -> Optional[int]:
  """The iteration of the first training success >= target (None: never), as bench_synthetic."""
  return summarise(list(records), target)["first_iteration"]


def reach_stats(firsts: Sequence[Optional[int]]) -> dict:
  """Median and range over seeds of the first-reach iterations, None (never) ranking last.

  Returns {"median", "min", "max"} (math.inf where the order statistic is a seed that never
  reached the target) and "reached" (how many seeds did) of "seeds".
  """
  ranked = sorted(math.inf if f is None else f for f in firsts)
  n = len(ranked)
  median = ranked[n // 2] if n % 2 else (ranked[n // 2 - 1] + ranked[n // 2]) / 2
  return {
    "median": median,
    "min": ranked[0],
    "max": ranked[-1],
    "reached": sum(f is not None for f in firsts),
    "seeds": n,
  }


def summarise_variant(runs: Sequence[Sequence[dict]], target: float) -> dict:
  """Statistics of one variant over its seeds' metrics records (one list per seed).

  Curves are cut to the shortest run. Returns the iterations, the mean and interval of the
  smoothed training success per iteration, the first-reach statistics (`reach_stats`), and the
  mean and interval of the final held-out avg@4 and of the last `FINAL` iterations' success.
  """
  length = min(len(r) for r in runs)
  runs = [list(r)[:length] for r in runs]
  success = np.array([[r["success"] for r in run] for run in runs], np.float64)
  smoothed = np.array([trailing_mean(s, SMOOTH) for s in success])
  curve, curve_ci = mean_interval(smoothed)
  finals = [[r["eval/avg@4"] for r in run if "eval/avg@4" in r] for run in runs]
  avg4_seeds = np.array([f[-1] for f in finals] if all(finals) else [np.nan] * len(runs))
  avg4, avg4_ci = mean_interval(avg4_seeds)
  last_seeds = success[:, -FINAL:].mean(1)
  last, last_ci = mean_interval(last_seeds)
  return {
    "iterations": np.array([r["iteration"] for r in runs[0]]),
    "curve": curve,
    "curve_ci": curve_ci,
    "reach": reach_stats([first_reach(run, target) for run in runs]),
    "final_success": (float(last), float(last_ci)),
    "final_avg@4": (float(avg4), float(avg4_ci)),
    "seeds_success": last_seeds,
    "seeds_avg@4": avg4_seeds,
  }


def paired_p(a, b) -> float:
  """Two-sided p-value of the paired t-test that a[i] - b[i] has mean 0 (seed i of two
  variants starts from the same model; NaN when every difference is 0)."""
  from scipy import stats  # pylint: disable=g-import-not-at-top

  with warnings.catch_warnings():  # nearly constant differences: scipy warns, the p is still right
    warnings.simplefilter("ignore", RuntimeWarning)
    return float(stats.ttest_rel(a, b).pvalue)


def _iteration(x, budget: int) -> str:
  return f">{budget}" if x == math.inf else f"{x:g}"


def _p(a, b) -> str:
  p = paired_p(a, b)
  return "-" if np.isnan(p) else f"{p:.2f}"


def format_table(summaries: dict, target: float) -> str:
  """Markdown table, one line per variant; paired p-values against the first variant."""
  base = next(iter(summaries))
  lines = [
    f"| variant | change | seeds reaching {target} | median first iteration >= {target} "
    f"| range | last {FINAL} iterations' success (95% CI) | final held-out avg@4 (95% CI) "
    f"| paired t p vs {base} (success / avg@4) |",
    "|---|---|---:|---:|---:|---:|---:|---:|",
  ]
  for name, s in summaries.items():
    budget = int(s["iterations"][-1])
    reach = s["reach"]
    change = ", ".join(f"{k}={v}" for k, v in VARIANTS.get(name, {}).items()) or "(default)"
    b = summaries[base]
    p = (
      ""
      if name == base
      else " / ".join(_p(s[key], b[key]) for key in ("seeds_success", "seeds_avg@4"))
    )
    lines.append(
      f"| {name} | {change} | {reach['reached']}/{reach['seeds']} "
      f"| {_iteration(reach['median'], budget)} "
      f"| {_iteration(reach['min'], budget)} to {_iteration(reach['max'], budget)} "
      f"| {s['final_success'][0]:.3f} ± {s['final_success'][1]:.3f} "
      f"| {s['final_avg@4'][0]:.3f} ± {s['final_avg@4'][1]:.3f} | {p} |"
    )
  return "\n".join(lines) + "\n"


PANELS = {
  "update order": ("reverse", "forward", "random"),
  "normalisation, correction": ("reverse", "group", "none", "nocorr"),
}
"""The plot's panels: the default against the variants of one factor."""


def plot(summaries: dict, png: str, target: float, seeds: int) -> None:
  """Mean training success against iteration with its shaded 95% interval (clipped to [0, 1]),
  a panel per factor (`PANELS`)."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

  fig = Figure(figsize=(10, 4.2))
  FigureCanvasAgg(fig)
  colors = {name: f"C{i}" for i, name in enumerate(VARIANTS)}
  axes = fig.subplots(1, len(PANELS), sharey=True)
  for ax, (title, names) in zip(axes, PANELS.items()):
    for name in (n for n in names if n in summaries):
      s = summaries[name]
      ax.plot(s["iterations"], s["curve"], label=name, lw=1.3, color=colors[name])
      lo = np.clip(s["curve"] - s["curve_ci"], 0, 1)
      hi = np.clip(s["curve"] + s["curve_ci"], 0, 1)
      ax.fill_between(s["iterations"], lo, hi, color=colors[name], alpha=0.15, lw=0)
    ax.axhline(target, color="gray", ls="--", lw=1)
    ax.set_xlabel("iteration")
    ax.set_title(title)
    ax.set_ylim(-0.02, 1.02)
    ax.legend(loc="upper left")
  axes[0].set_ylabel(f"training success ({SMOOTH}-iteration mean)")
  fig.suptitle(f"SeeUPO ablations, synthetic lock: mean over {seeds} seeds, 95% t interval")
  fig.tight_layout()
  fig.savefig(png, dpi=90)


def _parse():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1")
  parser.add_argument("--iterations", type=int, default=125)
  parser.add_argument("--target", type=float, default=0.9)
  parser.add_argument("--plot-only", action="store_true", help="only read finished runs")
  # Any other --config.a.b=value flag goes to run.py, after TASK (so it wins).
  args, overrides = parser.parse_known_args()
  bad = [o for o in overrides if not o.startswith("--config.")]
  if bad:
    parser.error(f"unrecognized arguments: {' '.join(bad)} (run.py overrides are --config.a.b=v)")
  args.overrides = overrides
  return args


def run_one(workdir: str, variant: str, seed: int, iterations: int, overrides) -> float:
  """Runs (or resumes) one (variant, seed) with bench_synthetic's command; returns its wall
  time in seconds."""
  flags = [
    *learner_flags(variant),
    f"--config.seed={seed}",
    "--config.log.tensorboard=False",
    *TASK,
    *overrides,
  ]
  start = time.perf_counter()
  run_algorithm(workdir, ALGORITHM, iterations, flags)
  return time.perf_counter() - start


def main():
  args = _parse()
  os.makedirs(args.workdir, exist_ok=True)
  variants = args.variants.split(",")
  unknown = [v for v in variants if v not in VARIANTS]
  if unknown:
    sys.exit(f"error: unknown variants {unknown}; allowed: {', '.join(VARIANTS)}")
  cache = os.path.join(args.workdir, "jax_cache")
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", cache)
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

  def workdir(variant: str, seed: int) -> str:
    return os.path.join(args.workdir, variant, f"seed{seed}")

  # Seed by seed, so that a grid stopped part way has the same seeds of every variant.
  for seed in range(args.seeds if not args.plot_only else 0):
    for variant in variants:
      seconds = run_one(workdir(variant, seed), variant, seed, args.iterations, args.overrides)
      print(f"{variant} seed {seed}: {seconds:.0f} s", flush=True)
  summaries = {}
  for variant in variants:
    runs = [
      metrics_log.read_metrics(os.path.join(workdir(variant, seed), "metrics.jsonl"))
      for seed in range(args.seeds)
    ]
    summaries[variant] = summarise_variant(runs, args.target)
  png = os.path.join(args.workdir, "curves.png")
  plot(summaries, png, args.target, args.seeds)
  table = format_table(summaries, args.target)
  with open(os.path.join(args.workdir, "table.md"), "w") as f:
    f.write(table)
  print(f"\ncurves: {png}\n\n{table}")


if __name__ == "__main__":
  main()
