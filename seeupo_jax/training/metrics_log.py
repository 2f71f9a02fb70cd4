"""Training metrics on the host: a JSON-lines log, TensorBoard events, curves and tables.

    log = MetricsLog(workdir, resume_from=first_iteration)
    log.write(iteration, metrics)          # {"loss": 0-d array, ...}: one line, flushed
    log.close()
    plot_panels(read_metrics(log.path), workdir + "/curves.png", [Panel("reward", ("reward",))])
    print(format_table(rows, ("split", "avg@4", "pass@4")))

`metrics.jsonl` holds one JSON object per line, `{"iteration": i, "time": unix seconds,
<metric>: float or null, ...}`; NaN and infinities are written as null, so every line is valid
JSON. A resumed run first drops the lines of the iterations it will write again, so the log never
holds an iteration twice. In a multi-host run only one process should write.

A line that is not a JSON record (torn by a crash or a full disk, wherever it is in the file) is
skipped with a warning when read (`read_records`, `read_metrics`), and dropped when the file is
rewritten (`drop_records_from`, which the trainer also applies to `trajectories.jsonl`); the
records around it are kept.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
import tempfile
import time
from typing import Any, Mapping, Optional, Sequence

import numpy as np
from absl import logging

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
_RESERVED = ("iteration", "time")


# ----------------------------------------------------------------------------------------------
# Reading and repairing the JSON-lines file.


def _parse_lines(text: str, path: str) -> list[tuple[str, dict[str, Any]]]:
  """[(line, record)] of a JSON-lines text whose records are objects with an int "iteration".

  Any other line (one cut short by a crash, garbage), wherever it is, is skipped; one warning
  names the file, the lines and their count. Blank lines are skipped silently.
  """
  out, torn = [], []
  for number, line in enumerate(text.split("\n"), start=1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except ValueError:  # JSONDecodeError, or bytes that are not text
      record = None
    iteration = record.get("iteration") if isinstance(record, dict) else None
    if not isinstance(iteration, int) or isinstance(iteration, bool):
      torn.append(number)
      continue
    out.append((line, record))
  if torn:
    shown = ", ".join(str(n) for n in torn[:5]) + (", ..." if len(torn) > 5 else "")
    logging.warning(
      "%s: skipped %d line(s) that are not JSON records with an 'iteration' (line %s; a write "
      "cut short?)",
      path,
      len(torn),
      shown,
    )
  return out


def read_records(path: str) -> list[dict[str, Any]]:
  """The records of a JSON-lines log (metrics.jsonl, trajectories.jsonl), in file order.

  Lines that are not JSON objects with an int "iteration" are skipped with a warning.
  """
  with open(path, encoding="utf-8", errors="replace") as f:
    return [record for _, record in _parse_lines(f.read(), path)]


def read_metrics(path: str) -> list[dict[str, Any]]:
  """The records of a metrics.jsonl file, in file order (NaN/inf values read back as None).

  Args:
    path: the file written by `MetricsLog`. Torn lines are skipped with a warning.
  """
  return read_records(path)


def _atomic_write(path: str, text: str) -> None:
  """Writes `text` to `path` through a temporary file in the same directory and os.replace; an
  existing file keeps its permission bits (mkstemp's file is 0600)."""
  mode = stat.S_IMODE(os.stat(path).st_mode) if os.path.exists(path) else None
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".metrics-", suffix=".tmp")
  try:
    if mode is not None:
      os.fchmod(fd, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def drop_records_from(path: str, first: Optional[int]) -> None:
  """Rewrites a JSON-lines log without its records of iterations >= `first` and its torn lines.

  Atomic (a temporary file and os.replace), and only when something is dropped; a missing file
  is left missing. Also called with `first=None` before appending, so that no record is written
  after a line without its newline.

  Args:
    path: metrics.jsonl or trajectories.jsonl.
    first: the first iteration to drop (a resumed run's first iteration), or None to drop only
      the torn lines.
  """
  if not os.path.exists(path):
    return
  with open(path, encoding="utf-8", errors="replace") as f:
    text = f.read()
  kept = [
    line
    for line, record in _parse_lines(text, path)
    if first is None or record["iteration"] < first
  ]
  new_text = "".join(line + "\n" for line in kept)
  if new_text != text:
    _atomic_write(path, new_text)


# ----------------------------------------------------------------------------------------------
# Writing.


def _scalar(value: Any) -> Optional[float]:
  """float(value) for a number or a 0-d numeric array (NumPy or jax); None for anything else."""
  if isinstance(value, (str, bytes)) or value is None:
    return None
  array = np.asarray(value)  # fetches a jax array from its device
  if array.ndim != 0 or array.dtype.kind not in "biuf":
    return None
  return float(array)


def _json_value(value: float) -> Optional[float]:
  return value if math.isfinite(value) else None


class MetricsLog:
  """Per-iteration metrics to `workdir/metrics.jsonl` and TensorBoard (`workdir/tensorboard`).

  Args:
    workdir: the run's directory (created).
    tensorboard: also write TensorBoard events (tensorboardX).
    resume_from: None for a run that does not resume: lines already in the file are kept and
      new ones appended. Otherwise the first iteration this run will write: lines with
      iteration >= resume_from are dropped first (those of a crashed run logged after its last
      checkpoint), and TensorBoard purges its events from that step on. Pass the first
      iteration (e.g. 0) for a fresh start to drop the lines of an earlier attempt.
  """

  def __init__(self, workdir: str, *, tensorboard: bool = True, resume_from: Optional[int] = None):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, METRICS_FILE)
    drop_records_from(self.path, resume_from)
    self._file = open(self.path, "a", encoding="utf-8")
    self._writer = None
    if tensorboard:
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top

      # Event files are named by the second they were opened and opened with "wb": the suffix
      # keeps a writer opened in the same second as the last one from overwriting its file.
      self._writer = SummaryWriter(
        logdir=os.path.join(workdir, TENSORBOARD_DIR),
        purge_step=resume_from,
        filename_suffix=f".{time.time_ns()}",
      )

  def write(self, iteration: int, metrics: Mapping[str, Any]) -> None:
    """Appends one line {"iteration", "time", metrics...} and the TensorBoard scalars; flushes.

    Args:
      iteration: the training iteration (int).
      metrics: name -> Python number, NumPy or jax scalar or 0-d array. Values that are not
        scalar numbers (arrays with dimensions, strings, None) are skipped; NaN and +-inf go to
        the JSON line as null and to TensorBoard as they are.

    Raises:
      ValueError: a metric is called "iteration" or "time".
    """
    clash = [name for name in _RESERVED if name in metrics]
    if clash:
      raise ValueError(f"metric names {clash} are reserved for the record's own fields")
    values = {}
    for name, value in metrics.items():
      scalar = _scalar(value)
      if scalar is not None:
        values[str(name)] = scalar
    record = {"iteration": int(iteration), "time": time.time()}
    record.update({name: _json_value(value) for name, value in values.items()})
    self._file.write(json.dumps(record, allow_nan=False) + "\n")
    self._file.flush()
    if self._writer is not None:
      for name, value in values.items():
        self._writer.add_scalar(name, value, global_step=int(iteration))
      self._writer.flush()

  def close(self) -> None:
    """Closes the file and the TensorBoard writer."""
    if not self._file.closed:
      self._file.close()
    if self._writer is not None:
      self._writer.close()
      self._writer = None

  def __enter__(self) -> "MetricsLog":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


# ----------------------------------------------------------------------------------------------
# Curves and tables.


@dataclasses.dataclass(frozen=True)
class Panel:
  """One subplot of `plot_panels`: the metrics drawn in it, one line each, and how.

  title: the subplot's title.
  keys: the metrics (one line per key that some record holds; a panel none of whose keys is in
    any record is left out).
  smooth: > 0: each key's raw points are drawn faint, with a trailing mean over this many
    records (fewer at the start) as the line over them.
  chance: a horizontal dotted line at this value (the level of a policy that ignores what it
    sees), or None for none.
  chance_label: the line's legend entry.
  log_y: a logarithmic y axis (values <= 0 are not drawn).
  unit_range: the y axis spans [0, 1] (shares, success rates).
  """

  title: str
  keys: tuple[str, ...]
  smooth: int = 0
  chance: Optional[float] = None
  chance_label: str = "chance"
  log_y: bool = False
  unit_range: bool = False


def trailing_mean(values: np.ndarray, window: int) -> np.ndarray:
  """The mean of each value and the (window - 1) before it (fewer at the start); NaNs (gaps)
  are left out of the means, and a window of only NaNs is NaN."""
  values = np.asarray(values, np.float64)
  finite = np.isfinite(values)
  sums = np.cumsum(np.where(finite, values, 0.0))
  counts = np.cumsum(finite)
  start = np.maximum(np.arange(len(values)) - window, -1)
  before_sums = np.where(start >= 0, sums[np.maximum(start, 0)], 0.0)
  before_counts = np.where(start >= 0, counts[np.maximum(start, 0)], 0)
  n = counts - before_counts
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(n > 0, (sums - before_sums) / np.maximum(n, 1), np.nan)


def _series(records: Sequence[Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
  """(iterations, values) of the records that hold `key` (None, a NaN in the log, as NaN)."""
  points = [(r["iteration"], r[key]) for r in records if key in r]
  x = np.asarray([p[0] for p in points], np.float64)
  y = np.asarray([np.nan if p[1] is None else p[1] for p in points], np.float64)
  return x, y


def plot_panels(
  records: Sequence[Mapping[str, Any]],
  png_path: str,
  panels: Sequence[Panel],
  *,
  title: str = "",
  columns: int = 2,
):
  """Draws the panels against the iteration on a grid and writes the PNG (matplotlib, Agg).

  The PNG is written to a temporary file and renamed into place, so a run killed while it
  draws leaves the previous figure whole. No axis uses an offset (`+1.089e2`): tick labels
  are the values.

  Args:
    records: metrics records (e.g. `read_metrics`), each with "iteration".
    png_path: the output file (its directory is created).
    panels: the subplots, row by row; panels with no key in any record are left out (a figure
      with a note if none is left).
    title: the figure's title, above the panels.
    columns: panels per row (fewer if there are fewer panels).

  Returns:
    The matplotlib `Figure` (its axes in panel order; each axis's title is its panel's).
  """
  # The Figure API with an Agg canvas: no display and no global pyplot state.
  import matplotlib  # pylint: disable=g-import-not-at-top
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  from matplotlib.ticker import MaxNLocator  # pylint: disable=g-import-not-at-top

  present = [p for p in panels if any(key in r for r in records for key in p.keys)]
  columns = max(1, min(columns, len(present)))
  rows = max(1, -(-len(present) // columns))
  with matplotlib.rc_context({"axes.formatter.useoffset": False}):
    width = 6.0 * columns if columns <= 2 else 5.0 * columns
    fig = Figure(figsize=(width, 0.5 + 3.5 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    if present:
      axes = fig.subplots(rows, columns, sharex=True, squeeze=False).ravel()
      for ax, panel in zip(axes, present):
        _draw(ax, panel, records)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelbottom=True)  # every panel its own iteration ticks
      for ax in axes[len(present) :]:
        ax.set_visible(False)
    else:
      names = [key for p in panels for key in p.keys]
      fig.text(0.5, 0.5, f"no records hold any of {names}", ha="center", va="center")
    if title:
      fig.suptitle(title)
    directory = os.path.dirname(png_path)
    if directory:
      os.makedirs(directory, exist_ok=True)
    tmp = f"{png_path}.tmp"  # one writer per workdir (process 0, under the workdir's lock)
    try:
      with open(tmp, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
      os.replace(tmp, png_path)
    except BaseException:
      if os.path.exists(tmp):
        os.remove(tmp)
      raise
  return fig


def _draw(ax, panel: Panel, records: Sequence[Mapping[str, Any]]) -> None:
  """One panel's lines, chance line, axes and legend."""
  labelled = 0
  for key in panel.keys:
    x, y = _series(records, key)
    if not len(x):
      continue
    sparse = len(x) <= 50 or len(x) < 0.5 * len(records)
    if panel.smooth > 0:
      (raw,) = ax.plot(x, y, ".", markersize=4, alpha=0.4, label=f"{key}, each iteration")
      ax.plot(
        x,
        trailing_mean(y, panel.smooth),
        color=raw.get_color(),
        linewidth=1.6,
        label=f"{key} ({panel.smooth}-iteration mean)",
      )
    else:
      ax.plot(x, y, marker="." if sparse else None, linewidth=1.2, label=key)
    labelled += 1
  if panel.chance is not None:
    ax.axhline(panel.chance, color="gray", linestyle=":", linewidth=1.2, label=panel.chance_label)
    labelled += 1
  ax.set_title(panel.title)
  ax.set_xlabel("iteration")
  if panel.log_y:
    ax.set_yscale("log")
  if panel.unit_range:
    ax.set_ylim(-0.03, 1.03)
  ax.grid(True, alpha=0.3)
  if labelled > 1 or panel.smooth > 0:
    ax.legend(fontsize="small", loc="best")


def _cell(value: Any) -> tuple[str, bool]:
  """(text, is_number) of one table cell: floats with 3 decimals, None/missing as '-'."""
  if value is None:
    return "-", False
  if isinstance(value, (bool, np.bool_)):
    return str(bool(value)), False
  if isinstance(value, (int, np.integer)):
    return str(int(value)), True
  scalar = _scalar(value)
  if scalar is not None:
    return f"{scalar:.3f}", True
  return str(value), False


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
  """A plain-text table: a header, a rule, one line per row (no trailing newline).

  Args:
    rows: one mapping per row; a column missing from a row shows '-'.
    columns: the columns, left to right (the header names).

  Returns:
    The table; columns are two spaces apart, floats have 3 decimals; a column of numbers (and
    '-') is right-aligned, any other column left-aligned.
  """
  cells = [[_cell(row.get(column)) for column in columns] for row in rows]
  widths = [
    max([len(str(column))] + [len(line[i][0]) for line in cells])
    for i, column in enumerate(columns)
  ]
  numeric = [
    bool(cells) and all(line[i][1] or line[i][0] == "-" for line in cells)
    for i in range(len(columns))
  ]

  def render(texts):
    parts = [
      text.rjust(width) if right else text.ljust(width)
      for text, width, right in zip(texts, widths, numeric)
    ]
    return "  ".join(parts).rstrip()

  rule = "  ".join("-" * width for width in widths)
  lines = [render([str(c) for c in columns]), rule]
  return "\n".join(lines + [render([text for text, _ in line]) for line in cells])
