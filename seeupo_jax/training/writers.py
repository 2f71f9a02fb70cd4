"""The writers the training loop's `progress_fn(iteration, metrics)` feeds: the metrics log
(JSONL and TensorBoard), the figures, the progress bar; and the trajectory log.

Process 0 alone writes; the other processes get no writers (`trajectory_log` still gathers their
trajectories, so every process calls it).
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Optional, Sequence

ProgressFn = Callable[[int, dict], None]
"""progress_fn(iteration, metrics): called once per iteration, after the update (and the
evaluation when one was due), with the iteration's metrics (floats by name)."""


def say(text: str, program: Optional[Any] = None) -> None:
  """Prints above the progress bar (tqdm.write), so the bar stays one line; in process 0 only."""
  import tqdm  # pylint: disable=g-import-not-at-top

  if program is None or program.processes.is_main:
    tqdm.tqdm.write(text)


class ProgressBar:
  """The progress bar: one step per iteration, the iteration's reward and success beside it."""

  def __init__(self, total: int, start: int):
    import tqdm  # pylint: disable=g-import-not-at-top

    self._bar = tqdm.tqdm(total=total, initial=start, desc="train", unit="it")

  def __call__(self, iteration: int, metrics: dict) -> None:
    del iteration
    self._bar.update(1)
    self._bar.set_postfix(
      reward=f"{metrics.get('reward', float('nan')):.3f}",
      success=f"{metrics.get('success', float('nan')):.3f}",
    )

  def close(self) -> None:
    self._bar.close()


def every_evaluation(plot: Callable[[], Any], due: Callable[[int], bool]) -> ProgressFn:
  """A writer that redraws the figures (`plot()`) at the iterations `due` says were evaluated."""

  def write(iteration: int, metrics: dict) -> None:
    del metrics
    if due(iteration):
      plot()

  return write


def fan_out(writers: Sequence[ProgressFn]) -> ProgressFn:
  """One progress_fn that calls each writer in turn (in order: a writer may read what an earlier
  one wrote, as the figures read metrics.jsonl)."""

  def progress_fn(iteration: int, metrics: dict) -> None:
    for write in writers:
      write(iteration, metrics)

  return progress_fn


def trajectory_log(workdir: str, program, count: int):
  """trajectories_fn(iteration, trajectories): appends the first `count` trajectories' text and
  metadata to trajectories.jsonl.

  Many processes: the first `count` of the batch (each process's first ones gathered, in
  process order), written by process 0; every process calls it.
  """

  def write(iteration: int, trajectories) -> None:
    if count <= 0:
      return
    records = []
    for t in trajectories[:count]:
      record = {"iteration": iteration, **t.metadata(), "replies": t.replies}
      record["text"] = program.tokenizer.decode(t.tokens)
      records.append(record)
    records = program.processes.concat(records)[:count]
    if not program.processes.is_main:
      return
    with open(os.path.join(workdir, "trajectories.jsonl"), "a", encoding="utf-8") as f:
      for record in records:
        f.write(json.dumps(record) + "\n")

  return write
