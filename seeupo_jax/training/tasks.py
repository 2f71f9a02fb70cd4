"""The order in which training tasks are drawn, resumable from one integer."""

from __future__ import annotations

from typing import Sequence

import numpy as np


class TaskStream:
  """Tasks in a fresh random order each epoch; `position` (tasks drawn so far) is the whole state.

  Epoch e is the permutation drawn from (seed, e), so a stream rebuilt with the
  same seed and position continues exactly where the saved one stopped.
  """

  def __init__(self, task_ids: Sequence[str], seed: int, position: int = 0):
    if not task_ids:
      raise ValueError("TaskStream needs at least one task")
    if position < 0:
      raise ValueError(f"position must be >= 0, got {position}")
    self.task_ids = list(task_ids)
    self.seed = seed
    self.position = position
    self._epoch, self._order = -1, None

  def _permutation(self, epoch: int) -> np.ndarray:
    if epoch != self._epoch:
      self._epoch = epoch
      self._order = np.random.default_rng([self.seed, epoch]).permutation(len(self.task_ids))
    return self._order

  def take(self, count: int) -> list[str]:
    """The next `count` task ids (crossing into the next epoch when one runs out)."""
    out = []
    for _ in range(count):
      epoch, index = divmod(self.position, len(self.task_ids))
      out.append(self.task_ids[int(self._permutation(epoch)[index])])
      self.position += 1
    return out
