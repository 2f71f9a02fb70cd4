"""Where the paper's claims bite: the bandit comparison swept over problem axes.

A grid is a list of `Axis`: one config key (the horizon `num_turns`, the
number of actions, the reward density of the `sparse` family, the reward
scales of the `scaled` family) swept over values, each value crossed with
policy classes, and run through `sweep.run_sweep` (every algorithm, family
and learning rate, common random numbers across algorithms). Each cell keeps
the best learning rate's curves of every algorithm, and every algorithm is
compared with a reference (SeeUPO) run by run:

    d_s = q_s(reference) - q_s(other),   q_s = final J / J*_class of seed s
    mean d +- 1.96 sd(d) / sqrt(runs)     (paired: seed s is the same instance
                                           and the same sampling keys for both)

and likewise for each run's share of iterations where the exact J dropped,
as other minus reference: both gaps are positive where the reference does
better (a higher J, fewer drops). A gap is significant when its 95% interval
excludes 0.

`run_grid` writes each finished cell, with the config it ran, to
`workdir/cells/` and reads finished cells back when run again (a cell run with
another config is an error, not a silent reuse); `region_table` is the map "where SeeUPO is better,
worse, or not distinguishable" in final J or in J drops, one line per (axis,
policy, family, other algorithm) and one column per value.
"""

from __future__ import annotations

import json
import os
from typing import Callable, NamedTuple, Sequence

import ml_collections
import numpy as np

from seeupo_jax.theory import report
from seeupo_jax.theory import sweep

REFERENCE = "seeupo"


class Axis(NamedTuple):
  """One swept config key.

  Attributes:
    name: the axis' name in tables, file names and `--axes`.
    key: the `sweep.default_config` key it sets.
    values: the values of `key`, in plot order.
    policies: policy classes crossed with every value.
    overrides: other config keys for every cell of this axis (families,
      algorithms, fixed problem sizes).
  """

  name: str
  key: str
  values: tuple
  policies: tuple[str, ...]
  overrides: dict


_HORIZON_ALGORITHMS = "seeupo,seeupo_forward,seeupo_random,grpo,gspo,ppo"
_BASELINES = "seeupo,grpo,gspo,ppo"

DEFAULT_AXES: tuple[Axis, ...] = (
  Axis(
    "horizon",
    "num_turns",
    (2, 4, 6, 8, 10),
    ("tabular", "shared"),
    {"families": "random,trap", "algorithms": _HORIZON_ALGORITHMS},
  ),
  Axis(
    "actions",
    "num_actions",
    (2, 3, 4),
    ("tabular", "shared"),
    {"num_turns": 3, "families": "random,trap", "algorithms": _BASELINES},
  ),
  Axis(
    "density",
    "density",
    (0.5, 0.125, 0.03, 0.01),
    ("tabular", "shared"),
    {"num_turns": 6, "families": "sparse", "algorithms": _HORIZON_ALGORITHMS},
  ),
  Axis(
    "scale",
    "scale_orders",
    (0.0, 1.0, 2.0, 3.0),
    ("blind", "shared", "tabular"),
    {"families": "scaled", "algorithms": "seeupo,seeupo_groupstd,seeupo_nonorm,grpo"},
  ),
)
"""The grid of `benchmarks/bench_theory_grid.py` (docs/theory.md, "Where the claims bite")."""

_LAG_OVERRIDES = {"families": "random,trap,decoy", "algorithms": "seeupo,grpo"}

LAG_AXES: tuple[Axis, ...] = (
  Axis("lag", "lag", (0, 1, 2, 4, 8), ("tabular", "shared"), dict(_LAG_OVERRIDES, tis="off")),
  Axis("lag_tis", "lag", (0, 1, 2, 4, 8), ("tabular", "shared"), dict(_LAG_OVERRIDES, tis="token")),
)
"""Stale samples (docs/theory.md, "Stale samples"): iteration i samples with the params of
iteration i - 1 - lag; `lag` updates them as they are (the naive stale update), `lag_tis` weighs
each turn's policy loss by min(pi_prox / pi_behav, tis_cap)."""

AXES: dict[str, Axis] = {a.name: a for a in DEFAULT_AXES + LAG_AXES}
"""Every axis `benchmarks/bench_theory_grid.py --axes` knows, by name."""


LABELS = {
  "horizon": "turns T",
  "actions": "actions K",
  "density": "share of trajectories that pay (density)",
  "scale": "orders of magnitude between context scales",
  "lag": "lag k (iterations between sampling and update), no TIS",
  "lag_tis": "lag k (iterations between sampling and update), TIS",
}
"""The x-axis label of each default axis in `plot_axis`."""

LOG_AXES = ("density",)
"""Axes `plot_axis` draws on a log scale."""


class Paired(NamedTuple):
  """A paired difference over runs: `mean` +- `ci` (95%, normal)."""

  mean: float
  ci: float

  @property
  def verdict(self) -> str:
    """ "+" (reference significantly higher), "-" (lower) or "=" (interval contains 0)."""
    if self.mean - self.ci > 0:
      return "+"
    if self.mean + self.ci < 0:
      return "-"
    return "="


def paired_difference(reference: np.ndarray, other: np.ndarray) -> Paired:
  """mean(reference - other) +- 1.96 sd / sqrt(runs); [runs] arrays of the same runs."""
  reference, other = np.asarray(reference, np.float64), np.asarray(other, np.float64)
  if reference.shape != other.shape or reference.ndim != 1 or len(reference) < 2:
    raise ValueError(f"need two [runs >= 2] arrays, got {reference.shape} and {other.shape}")
  d = reference - other
  return Paired(float(d.mean()), float(1.96 * d.std(ddof=1) / np.sqrt(len(d))))


def drop_shares(curves: np.ndarray) -> np.ndarray:
  """[runs] share of each run's iterations where J dropped by more than `report.DROP`."""
  return (np.diff(np.asarray(curves, np.float64), axis=1) < -report.DROP).mean(1)


class Row(NamedTuple):
  """One algorithm in one cell, compared with the reference.

  Attributes:
    axis, value, policy, family, algorithm: where.
    lr: the grid's best learning rate for this algorithm here.
    summary: `report.summarise` of its best-rate curves.
    final_gap: reference minus this algorithm, final J / J*_class (None for the reference).
    drop_gap: this algorithm minus the reference, share of iterations with a drop (None for
      the reference).
  """

  axis: str
  value: float
  policy: str
  family: str
  algorithm: str
  lr: float
  summary: report.Summary
  final_gap: Paired | None
  drop_gap: Paired | None


def cell_config(base: ml_collections.ConfigDict, axis: Axis, value, policy: str):
  """The sweep config of one cell: `base`, the axis' overrides, key = value, policy."""
  config = ml_collections.ConfigDict(base.to_dict())
  config.update(axis.overrides)
  config[axis.key] = type(config[axis.key])(value)
  config.policy = policy
  return config


def cell_rows(
  axis: Axis, value, policy: str, curves: dict[tuple[str, str], tuple[float, np.ndarray]]
) -> list[Row]:
  """Rows of one cell from {(algorithm, family): (best lr, [runs, I + 1] curves)}."""
  rows = []
  for (algorithm, family), (lr, c) in curves.items():
    final_gap = drop_gap = None
    if algorithm != REFERENCE and (REFERENCE, family) in curves:
      ref = curves[(REFERENCE, family)][1]
      final_gap = paired_difference(ref[:, -1], c[:, -1])
      drop_gap = paired_difference(drop_shares(c), drop_shares(ref))
    rows.append(
      Row(
        axis.name,
        value,
        policy,
        family,
        algorithm,
        lr,
        report.summarise(c),
        final_gap,
        drop_gap,
      )
    )
  return rows


_CONFIG = "config_json"  # the cell's sweep config, stored with its curves


def _cell_path(workdir: str, axis: Axis, value, policy: str) -> str:
  return os.path.join(workdir, "cells", f"{axis.name}__{value:g}__{policy}.npz")


def _save_cell(path: str, curves, config: ml_collections.ConfigDict) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  arrays = {_CONFIG: np.array(config.to_json(sort_keys=True))}
  for (algorithm, family), (lr, c) in curves.items():
    arrays[f"{algorithm}__{family}__curves"] = c
    arrays[f"{algorithm}__{family}__lr"] = np.float64(lr)
  tmp = path + ".tmp.npz"
  np.savez_compressed(tmp, **arrays)
  os.replace(tmp, path)  # a killed run leaves no half-written cell


def _load_cell(path: str, config: ml_collections.ConfigDict):
  """The cell's curves; an error if it was run with another config than `config`.

  A key the stored config lacks counts as its default (`sweep.default_config`): a key's default
  is the program the cell ran before the key existed (e.g. `lag` 0).
  """
  with np.load(path) as data:
    stored = json.loads(str(data[_CONFIG])) if _CONFIG in data.files else None
    if stored is not None:  # a key added to the config since: the cell ran with its default
      stored = {**sweep.default_config().to_dict(), **stored}
    wanted = json.loads(config.to_json(sort_keys=True))
    if stored != wanted:
      differ = sorted(
        k for k in set(wanted) | set(stored or {}) if (stored or {}).get(k) != wanted.get(k)
      )
      raise ValueError(
        f"{path} was run with another config (keys {', '.join(differ)}); use another workdir "
        "or delete the cell"
      )
    names = list(dict.fromkeys(k.rsplit("__", 1)[0] for k in data.files if k != _CONFIG))
    return {
      tuple(name.split("__")): (float(data[f"{name}__lr"]), data[f"{name}__curves"])
      for name in names
    }


def run_grid(
  base: ml_collections.ConfigDict,
  axes: Sequence[Axis],
  workdir: str,
  log: Callable[[str], None] = print,
  compute: bool = True,
) -> list[Row]:
  """Runs (or, with `compute=False`, only reads) every cell; returns all rows."""
  rows = []
  for axis in axes:
    for value in axis.values:
      for policy in axis.policies:
        path = _cell_path(workdir, axis, value, policy)
        config = cell_config(base, axis, value, policy)
        if not os.path.exists(path):
          if not compute:
            log(f"{axis.name}={value:g} {policy}: not run yet")
            continue
          log(f"== {axis.name}: {axis.key}={value:g}, {policy} policy")
          results = sweep.run_sweep(config, log=log)
          curves = {
            name: (float(r.learning_rates[r.best]), r.best_curves) for name, r in results.items()
          }
          _save_cell(path, curves, config)
        rows.extend(cell_rows(axis, value, policy, _load_cell(path, config)))
  return rows


def _gap(p: Paired | None) -> str:
  return "" if p is None else f"{p.mean:+.3f} ± {p.ci:.3f} ({p.verdict})"


def full_table(rows: Sequence[Row]) -> str:
  """Every row: summary and the paired gaps to the reference."""
  header = (
    "axis",
    "value",
    "policy",
    "family",
    "algorithm",
    "lr",
    "reach>=0.99",
    "final J/J*c (95% CI)",
    "J drops",
    f"{REFERENCE} - this, final (95% CI)",
    f"this - {REFERENCE}, J drops (95% CI)",
  )
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for r in rows:
    s = r.summary
    lines.append(
      f"| {r.axis} | {r.value:g} | {r.policy} | {r.family} | {r.algorithm} | {r.lr:g} | "
      f"{s.reach_share:.0%} | {s.final_mean:.3f} ± {s.final_ci:.3f} | "
      f"{s.violation_share:.1%} | {_gap(r.final_gap)} | {_gap(r.drop_gap)} |"
    )
  return "\n".join(lines)


METRICS = ("final", "drops")


def region_table(rows: Sequence[Row], metric: str = "final") -> str:
  """The map: one line per (axis, policy, family, other algorithm), one column per value.

  Each entry is the reference's advantage, `final`: its final J / J*_class
  minus the other's; `drops`: the other's share of iterations with a drop of J
  minus the reference's. "+" marks the reference significantly better, "-"
  significantly worse, "=" a 95% interval that contains 0. The reference's
  own line gives its mean final J / J*_class, or its drop share.
  """
  if metric not in METRICS:
    raise ValueError(f"metric={metric!r}; allowed: {METRICS}")
  lines = []
  for axis in dict.fromkeys(r.axis for r in rows):
    axis_rows = [r for r in rows if r.axis == axis]
    values = list(dict.fromkeys(r.value for r in axis_rows))
    lines += [
      "| " + " | ".join([axis, "policy", "family", "vs"] + [f"{v:g}" for v in values]) + " |",
      "|" + "---|" * (4 + len(values)),
    ]
    keys = sorted(
      dict.fromkeys((r.policy, r.family, r.algorithm) for r in axis_rows),
      key=lambda k: [_first_index(axis_rows, i, v) for i, v in enumerate(k)],
    )
    for policy, family, algorithm in keys:
      entries = []
      for v in values:
        match = [
          r
          for r in axis_rows
          if (r.value, r.policy, r.family, r.algorithm) == (v, policy, family, algorithm)
        ]
        if not match:
          entries.append("")
        elif match[0].final_gap is None:
          s = match[0].summary
          entries.append(f"{s.final_mean:.3f}" if metric == "final" else f"{s.violation_share:.1%}")
        else:
          g = match[0].final_gap if metric == "final" else match[0].drop_gap
          entries.append(
            f"{g.mean:+.4f} {g.verdict}" if metric == "final" else f"{g.mean:+.3f} {g.verdict}"
          )
      own = "J/J*c" if metric == "final" else "J drops"
      label = f"({REFERENCE} {own})" if algorithm == REFERENCE else algorithm
      lines.append("| " + " | ".join(["", policy, family, label] + entries) + " |")
    lines.append("")
  return "\n".join(lines).rstrip() + "\n"


def _first_index(rows: Sequence[Row], field: int, value) -> int:
  """Where `value` of (policy, family, algorithm)[field] first appears: the rows' own order."""
  return next(i for i, r in enumerate(rows) if (r.policy, r.family, r.algorithm)[field] == value)


def plot_axis(path: str, rows: Sequence[Row], axis: str) -> None:
  """One panel per (policy, family): final J / J*_class against the value, 95% bars."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  axis_rows = [r for r in rows if r.axis == axis]
  panels = list(dict.fromkeys((r.policy, r.family) for r in axis_rows))
  algorithms = list(dict.fromkeys(r.algorithm for r in axis_rows))
  fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.4), squeeze=False)
  for ax, (policy, family) in zip(axes[0], panels):
    for i, algorithm in enumerate(algorithms):
      sel = [
        r for r in axis_rows if (r.policy, r.family, r.algorithm) == (policy, family, algorithm)
      ]
      if not sel:
        continue
      x = np.array([r.value for r in sel], np.float64)
      y = np.array([r.summary.final_mean for r in sel])
      e = np.array([r.summary.final_ci for r in sel])
      offset = i - (len(algorithms) - 1) / 2  # side by side, not on top of each other
      if axis in LOG_AXES:
        x = x * 10.0 ** (0.02 * offset)
      else:
        x = x + 0.02 * offset * (np.ptp(x) or 1.0)
      ax.errorbar(x, y, yerr=e, marker="o", ms=3, lw=1.2, capsize=2, label=algorithm)
    ax.set(
      title=f"{policy} policy, {family}", xlabel=LABELS.get(axis, axis), ylabel="final J / J*class"
    )
    if axis in LOG_AXES:
      ax.set_xscale("log")
  axes[0][0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def staleness_table(base: ml_collections.ConfigDict, workdir: str, policy: str = "tabular") -> str:
  """The `LAG_AXES` cells side by side: final J / J*_class at each lag, without and with TIS.

  One line per (family, algorithm, lag k): without TIS (`lag` axis) and with it (`lag_tis`),
  each at its own best learning rate, the mean final J / J*_class over runs +- its 95% interval,
  the rate and the share of iterations where the exact J dropped
  (`report.Summary.violation_share`); then two paired gaps (`paired_difference` over seeds:
  seed s is the same instance and the same sampling keys in every cell), TIS minus no TIS at
  lag k, and no TIS at lag k minus no TIS at lag 0 (what the staleness costs), each with "+",
  "-" or "=" (significantly positive, negative, or an interval that contains 0). Lags whose
  two cells are not both run are left out.

  Args:
    base: the grid's base config (as given to `run_grid`).
    workdir: the grid's folder.
    policy: the policy class of the cells.
  """
  plain, weighted = LAG_AXES
  cells = {}
  for axis in LAG_AXES:
    for value in axis.values:
      path = _cell_path(workdir, axis, value, policy)
      if os.path.exists(path):
        cells[(axis.name, value)] = _load_cell(path, cell_config(base, axis, value, policy))
  lags = [v for v in plain.values if (plain.name, v) in cells and (weighted.name, v) in cells]
  header = (
    "family",
    "algorithm",
    "lag",
    "no TIS: final J/J*c (95% CI)",
    "lr",
    "J drops",
    "TIS: final J/J*c (95% CI)",
    "lr",
    "J drops",
    "TIS - no TIS (95% CI)",
    "no TIS: lag k - lag 0 (95% CI)",
  )
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  if not lags:
    return "\n".join(lines)
  names = list(cells[(plain.name, lags[0])])  # (algorithm, family), the sweep's order
  for algorithm, family in sorted(names, key=lambda n: (_FAMILY_ORDER.get(n[1], 9), n[0])):
    reference = cells[(plain.name, lags[0])][(algorithm, family)][1][:, -1]
    for k in lags:
      lr0, c0 = cells[(plain.name, k)][(algorithm, family)]
      lr1, c1 = cells[(weighted.name, k)][(algorithm, family)]
      s0, s1 = report.summarise(c0), report.summarise(c1)
      entries = [family, algorithm, str(k)]
      for summary, lr in ((s0, lr0), (s1, lr1)):
        entries += [
          f"{summary.final_mean:.4f} ± {summary.final_ci:.4f}",
          f"{lr:g}",
          f"{summary.violation_share:.1%}",
        ]
      for gap in (
        paired_difference(c1[:, -1], c0[:, -1]),
        paired_difference(c0[:, -1], reference),
      ):
        entries.append(f"{gap.mean:+.4f} ± {gap.ci:.4f} ({gap.verdict})")
      lines.append("| " + " | ".join(entries) + " |")
  return "\n".join(lines)


_FAMILY_ORDER = {"random": 0, "trap": 1, "decoy": 2, "additive": 3}
