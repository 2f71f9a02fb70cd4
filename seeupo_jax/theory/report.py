"""Summary statistics of learning curves and the comparison table.

All statistics are computed from normalised curves q = J / J*, one row per
run, I + 1 points (before training and after each iteration).
"""

from typing import NamedTuple, Sequence

import numpy as np

REACH = 0.99  # a run "reaches the optimum" when its final J >= 0.99 J*.
FAST = 0.95  # iterations to 0.95 J*.
DROP = 1e-6  # a monotonic-improvement violation: J_{k+1} < J_k - 1e-6.


class Summary(NamedTuple):
  """Statistics of one (algorithm, family) setting over its runs.

  Attributes:
    reach_share: share of runs with final J >= 0.99 J*.
    final_mean: mean final J / J*.
    final_ci: half width of the 95% normal interval of `final_mean`,
      1.96 * std / sqrt(runs).
    violation_share: share of iterations (all runs pooled) where J dropped
      by more than 1e-6.
    iters_to_95: median over runs of the first iteration with J >= 0.95 J*,
      among the runs that got there (NaN if none did).
    share_to_95: share of runs that reached 0.95 J* at some iteration.
  """

  reach_share: float
  final_mean: float
  final_ci: float
  violation_share: float
  iters_to_95: float
  share_to_95: float


def summarise(curves: np.ndarray) -> Summary:
  """Summarises [runs, I + 1] normalised curves J / J*."""
  curves = np.asarray(curves, np.float64)
  if curves.ndim != 2 or curves.shape[1] < 2:
    raise ValueError(f"curves must be [runs, iterations + 1], got {curves.shape}")
  final = curves[:, -1]
  runs = len(final)
  ci = 1.96 * final.std(ddof=1) / np.sqrt(runs) if runs > 1 else np.nan
  drops = np.diff(curves, axis=1) < -DROP
  hit = curves >= FAST
  reached = hit.any(1)
  first = np.argmax(hit, 1).astype(np.float64)
  median_first = float(np.median(first[reached])) if reached.any() else np.nan
  return Summary(
    float(np.mean(final >= REACH)),
    float(final.mean()),
    float(ci),
    float(drops.mean()),
    median_first,
    float(reached.mean()),
  )


HEADER = (
  "algorithm",
  "family",
  "lr",
  "reach>=0.99J*",
  "final J/J* (95% CI)",
  "J drops",
  "iters to 0.95J*",
)


def format_table(rows: Sequence[tuple[str, str, float, Summary]]) -> str:
  """Markdown table, one line per (algorithm, family, chosen lr, summary)."""
  lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
  for algo, family, lr, s in rows:
    iters = (
      "never" if np.isnan(s.iters_to_95) else f"{s.iters_to_95:.0f} ({s.share_to_95:.0%} of runs)"
    )
    lines.append(
      f"| {algo} | {family} | {lr:g} | {s.reach_share:.1%} | "
      f"{s.final_mean:.4f} ± {s.final_ci:.4f} | {s.violation_share:.1%} | "
      f"{iters} |"
    )
  return "\n".join(lines)


def plot_curves(path: str, family: str, curves: dict[str, np.ndarray]) -> None:
  """Writes mean J/J* with a 10-90% band per algorithm to a PNG file.

  Args:
    path: output .png path.
    family: instance family name (the title).
    curves: algorithm name -> [runs, I + 1] normalised curves.
  """
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name, c in curves.items():
    steps = np.arange(c.shape[1])
    ax.plot(steps, c.mean(0), label=name, lw=1.5)
    lo, hi = np.quantile(c, [0.1, 0.9], axis=0)
    ax.fill_between(steps, lo, hi, alpha=0.12)
  ax.axhline(REACH, color="k", ls=":", lw=0.8)
  ax.set(
    xlabel="iteration",
    ylabel="J / J*  (mean, 10-90% band)",
    title=f"{family} instances",
    ylim=(None, 1.005),
  )
  ax.legend(fontsize=7, ncol=2, loc="lower right")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
