"""Save on preemption: SIGTERM or SIGINT ends the run at the next safe point, saved.

    with preemption.Watch() as watch:             # handlers for SIGTERM and SIGINT
      while ...:
        ...                                        # one iteration, its logs
        if watch.agreed(processes):                # a collective: every process, same place
          save(iteration); raise Preempted(...)    # the trainer's part

A cloud VM that is preempted (spot capacity, maintenance) gets SIGTERM and a grace period (about
30 s on a TPU VM, up to minutes on GPU nodes). The first SIGTERM or SIGINT only records the
request and says so in one line; the training loop finishes the iteration in flight, then every
process agrees (`agreed`: an allgather of each process's flag after every iteration, so a signal
that reached one process stops all of them at the same iteration), saves that iteration as a
regular checkpoint and exits with `EXIT_STATUS`. The rerun of the same command resumes there,
exactly as from any checkpoint. A second signal ends the process at once, by that signal (the
default action), without saving.

Not here: abandoning an iteration in flight (an iteration longer than the grace period is lost,
and the run resumes from its last checkpoint).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any, Optional, Protocol, Sequence

EXIT_STATUS = 75
"""The status of a run that stopped on a signal after saving (EX_TEMPFAIL of sysexits.h: a
temporary failure, run the same command again to resume)."""

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
  """The run stopped on a signal, after saving `iteration` (raised by the trainer).

  Attributes:
    iteration: the iteration saved; the rerun resumes from it.
    signal_name: "SIGTERM" or "SIGINT".
    checkpoints: the directory of the checkpoints.
  """

  def __init__(self, iteration: int, signal_name: str, checkpoints: str):
    self.iteration = iteration
    self.signal_name = signal_name
    self.checkpoints = checkpoints
    super().__init__(
      f"stopped by {signal_name} after saving iteration {iteration} in {checkpoints}; run the "
      "same command again to resume from it"
    )


class _Processes(Protocol):
  def allgather(self, obj: Any) -> list: ...


class Watch:
  """Handlers for SIGTERM and SIGINT while the context is open (the previous ones restored on
  exit). The first signal sets `signal_name`; a second one, of either kind, ends the process by
  that signal at once.

  Outside the main thread (where Python cannot install handlers) the watch is inactive: it never
  requests a stop, and the signals keep their previous handling.
  """

  def __init__(self, signals: Sequence[int] = SIGNALS):
    self._signals = tuple(signals)
    self._previous: dict[int, Any] = {}
    self.signal_name: Optional[str] = None
    self.active = False

  def __enter__(self) -> "Watch":
    if threading.current_thread() is not threading.main_thread():
      return self
    for sig in self._signals:
      self._previous[sig] = signal.signal(sig, self._handle)
    self.active = True
    return self

  def __exit__(self, *exc) -> None:
    for sig, previous in self._previous.items():
      signal.signal(sig, previous)
    self._previous.clear()
    self.active = False

  @property
  def requested(self) -> bool:
    """Whether this process received a signal."""
    return self.signal_name is not None

  def _handle(self, signum: int, frame) -> None:
    del frame
    name = signal.Signals(signum).name
    if self.signal_name is not None:  # the second signal: its default action, now
      os.write(2, f"{name} again: exiting at once, without saving\n".encode())
      for sig in self._signals:
        signal.signal(sig, signal.SIG_DFL)
      os.kill(os.getpid(), signum)
      return
    self.signal_name = name
    os.write(
      2,
      f"{name}: saving after the iteration in flight, then exiting (a second signal exits at "
      "once)\n".encode(),
    )

  def agreed(self, processes: _Processes) -> Optional[str]:
    """Whether any process received a signal: the first such process's signal name, else None.

    A collective (`processes.allgather`): every process calls it at the same point of every
    iteration, so all of them stop after the same iteration.
    """
    names = processes.allgather(self.signal_name)
    return next((n for n in names if n is not None), None)
