"""Time-based saves: `checkpoint.every_minutes` beside `checkpoint.every`.

    timer = SaveTimer(every_minutes=30)
    ...                                         # one iteration
    if checkpointer.should_save(i) or timer.due(processes):   # a collective when timed
      checkpointer.save(i, ..., force=True); timer.restart()

An iteration of a large model can take many minutes, and its length changes as replies grow: an
interval in iterations alone can leave hours unsaved. The timer is due once `every_minutes` have
passed since its last restart (the loop restarts it at every save). With many processes the
primary's clock decides, sent to all of them (`due` is a collective then), so every process saves
the same iterations.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol


class _Processes(Protocol):
  def allgather(self, obj: Any) -> list: ...


class SaveTimer:
  """Whether `every_minutes` have passed since the last save (0: never by time).

  Args:
    every_minutes: minutes between time-based saves (a number >= 0; 0 turns them off).
    clock: seconds, monotonic (`time.monotonic`; tests give a fake).
  """

  def __init__(self, every_minutes: float, clock: Callable[[], float] = time.monotonic):
    if not every_minutes >= 0:
      raise ValueError(f"every_minutes must be >= 0, got {every_minutes}")
    self.seconds = 60.0 * every_minutes
    self._clock = clock
    self._start = clock()

  def elapsed(self) -> float:
    """Seconds since the last restart (or since the timer was made)."""
    return self._clock() - self._start

  def due(self, processes: _Processes) -> bool:
    """Whether a save is due by time, by the primary process's clock.

    A collective (`processes.allgather`) when the timer is on: every process calls it at the same
    point of every iteration. Off (`every_minutes=0`), False without communicating.
    """
    if self.seconds <= 0:
      return False
    return bool(processes.allgather(self.elapsed() >= self.seconds)[0])

  def restart(self) -> None:
    """Starts the next interval now (call it when a checkpoint is saved)."""
    self._start = self._clock()
