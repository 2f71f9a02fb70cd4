"""training/save_timer.py: saves by time, decided by the primary's clock."""

import pytest

from seeupo_jax.training import save_timer


class _Clock:
  """A clock the test moves by hand."""

  def __init__(self):
    self.now = 100.0

  def __call__(self):
    return self.now


class _Processes:
  """`allgather` of several processes whose answers the test sets (this process's own object is
  replaced by `others`' entries, as if each process had its own clock)."""

  def __init__(self, others=None):
    self.others = others
    self.calls = 0

  def allgather(self, obj):
    self.calls += 1
    return [obj] if self.others is None else list(self.others)


def _timer(every_minutes):
  """(the fake clock, a timer on it, a one-process `allgather`)."""
  clock = _Clock()
  return clock, save_timer.SaveTimer(every_minutes=every_minutes, clock=clock), _Processes()


def test_due_after_every_minutes_since_the_last_restart():
  clock, timer, processes = _timer(2)
  clock.now += 119.0
  assert not timer.due(processes)
  clock.now += 1.0  # 120 s: two minutes
  assert timer.due(processes)
  timer.restart()
  assert not timer.due(processes)
  clock.now += 119.5
  assert not timer.due(processes)
  clock.now += 0.5
  assert timer.due(processes)
  assert processes.calls == 5  # a collective at every call


def test_off_never_due_and_no_collective():
  clock, timer, processes = _timer(0)
  clock.now += 1e9
  assert not timer.due(processes)
  assert processes.calls == 0


@pytest.mark.parametrize("primary,other,due", [(True, False, True), (False, True, False)])
def test_the_primary_clock_decides_for_every_process(primary, other, due):
  timer = save_timer.SaveTimer(every_minutes=1, clock=_Clock())
  assert timer.due(_Processes(others=[primary, other])) is due


def test_negative_minutes_refused():
  with pytest.raises(ValueError, match="every_minutes must be >= 0"):
    save_timer.SaveTimer(every_minutes=-1)
