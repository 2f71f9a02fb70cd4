r"""Where the paper's claims bite: the bandit comparison over horizon, actions, sparsity, scales.

    python benchmarks/bench_theory_grid.py --workdir=/tmp/theory_grid
    python benchmarks/bench_theory_grid.py --workdir=/tmp/theory_grid --axes=scale --num_seeds=16
    python benchmarks/bench_theory_grid.py --workdir=/tmp/theory_grid --plot_only
    python benchmarks/bench_theory_grid.py --workdir=/tmp/theory_lag --axes=lag,lag_tis --num_seeds=32

Runs `seeupo_jax.theory.grid.DEFAULT_AXES` (docs/theory.md, "Where the claims bite"): every
cell is a `--config=bandit` sweep (all its algorithms and families over the learning-rate grid,
the best rate per algorithm), with the axis' key set and the cell's policy class. Finished cells
are kept in `WORKDIR/cells/`, with the config they ran, and read back on a rerun; a cell run with
another config (e.g. other `--num_seeds`) is refused in one line (exit 2). Writes `WORKDIR/regions.md` (the map:
SeeUPO's final J / J*_class minus each other algorithm's, paired over seeds, with "+", "-" or "="
for SeeUPO significantly better, worse, or not distinguishable at 95%), `regions_drops.md` (the
same for the share of iterations where the exact J dropped: the other's minus SeeUPO's),
`WORKDIR/table.md` (every row) and `WORKDIR/grid_<axis>.png`. With the axes `lag` and `lag_tis`
(`grid.LAG_AXES`, not in the default grid: stale samples without and with TIS) it also writes
`WORKDIR/staleness.md` (`grid.staleness_table`).
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

from seeupo_jax.theory import grid  # noqa: E402
from seeupo_jax.theory import sweep  # noqa: E402

_WORKDIR = flags.DEFINE_string(
  "workdir", None, "Output folder (cells, tables, plots).", required=True
)
_AXES = flags.DEFINE_string(
  "axes", ",".join(a.name for a in grid.DEFAULT_AXES), "Comma-separated axis names."
)
_SEEDS = flags.DEFINE_integer("num_seeds", 48, "Runs per (cell, algorithm, family).")
_ITERATIONS = flags.DEFINE_integer("num_iterations", 200, "Iterations per run.")
_LRS = flags.DEFINE_string("learning_rates", "0.3,1,3,10", "The SGD grid; each row uses its best.")
_PLOT_ONLY = flags.DEFINE_bool("plot_only", False, "Only read finished cells.")


def main(_):
  by_name = grid.AXES
  names = [n.strip() for n in _AXES.value.split(",") if n.strip()]
  unknown = [n for n in names if n not in by_name]
  if unknown:
    raise app.UsageError(f"--axes: unknown {unknown}; allowed: {sorted(by_name)}")
  base = sweep.default_config()
  base.update(num_seeds=_SEEDS.value, num_iterations=_ITERATIONS.value, learning_rates=_LRS.value)
  start = time.perf_counter()
  try:
    rows = grid.run_grid(
      base, [by_name[n] for n in names], _WORKDIR.value, compute=not _PLOT_ONLY.value
    )
  except ValueError as e:  # a bad config value, or cells run with another config
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  regions, drops = grid.region_table(rows), grid.region_table(rows, "drops")
  print("SeeUPO's final J / J*_class minus each other algorithm's:\n")
  print(regions)
  print("Each other algorithm's share of iterations where J dropped minus SeeUPO's:\n")
  print(drops)
  outputs = (
    ("regions.md", regions),
    ("regions_drops.md", drops),
    ("table.md", grid.full_table(rows)),
  )
  if {a.name for a in grid.LAG_AXES} <= set(names):
    staleness = "\n\n".join(
      f"{policy} policy:\n\n" + grid.staleness_table(base, _WORKDIR.value, policy)
      for policy in grid.LAG_AXES[0].policies
    )
    print("Final J / J*_class with stale samples, without and with TIS:\n")
    print(staleness)
    outputs += (("staleness.md", staleness),)
  for name, text in outputs:
    with open(os.path.join(_WORKDIR.value, name), "w", encoding="utf-8") as f:
      f.write(text + "\n")
  for name in dict.fromkeys(r.axis for r in rows):
    path = os.path.join(_WORKDIR.value, f"grid_{name}.png")
    grid.plot_axis(path, rows, name)
    print(f"wrote {path}")
  print(f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
  app.run(main)
