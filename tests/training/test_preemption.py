"""`training/preemption.py`: the first SIGTERM/SIGINT is a request, the second ends the process;
every process stops after the same iteration. (The whole run stopped by SIGTERM and resumed:
tests/training/test_train.py.)"""

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from seeupo_jax.training import preemption

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Processes:
  """`distributed.Processes.allgather` of a run whose processes hold `flags`, this one first."""

  def __init__(self, *others):
    self.others = others
    self.calls = 0

  def allgather(self, obj):
    self.calls += 1
    return [obj, *self.others]


def test_no_signal_no_stop_and_a_signal_on_any_process_stops_every_one():
  with preemption.Watch() as watch:
    assert watch.active and not watch.requested
    assert watch.agreed(_Processes()) is None
    assert watch.agreed(_Processes(None, None)) is None
    # Another process got SIGTERM: this one stops after the same iteration.
    assert watch.agreed(_Processes(None, "SIGTERM")) == "SIGTERM"
    # This one got it: its name, whatever the others say.
    watch.signal_name = "SIGINT"
    assert watch.agreed(_Processes("SIGTERM")) == "SIGINT"


def test_the_previous_handlers_are_back_after_the_watch():
  before = {sig: signal.getsignal(sig) for sig in preemption.SIGNALS}
  with preemption.Watch():
    for sig in preemption.SIGNALS:
      assert signal.getsignal(sig) != before[sig]
  assert {sig: signal.getsignal(sig) for sig in preemption.SIGNALS} == before


def test_outside_the_main_thread_the_watch_is_inactive():
  seen = {}

  def body():
    with preemption.Watch() as watch:
      seen["active"] = watch.active
      seen["handler"] = signal.getsignal(signal.SIGTERM)

  thread = threading.Thread(target=body)
  thread.start()
  thread.join()
  assert seen == {"active": False, "handler": signal.getsignal(signal.SIGTERM)}


_SCRIPT = textwrap.dedent(
  """
  import os, signal, sys, time
  from seeupo_jax.training import preemption

  with preemption.Watch() as watch:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)  # the handler runs between bytecodes
    print("requested", watch.signal_name, flush=True)
    if sys.argv[1] == "twice":
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(5)
      print("still running", flush=True)
  print("exited the watch", flush=True)
  """
)


@pytest.mark.parametrize("times", ["once", "twice"])
def test_the_first_signal_is_a_request_and_the_second_ends_the_process(times):
  proc = subprocess.run(
    [sys.executable, "-c", _SCRIPT, times],
    capture_output=True,
    text=True,
    cwd=_ROOT,
    timeout=120,
  )
  assert "requested SIGTERM" in proc.stdout
  assert "SIGTERM: saving after the iteration in flight, then exiting" in proc.stderr
  if times == "once":
    assert proc.returncode == 0 and "exited the watch" in proc.stdout
  else:  # killed by the second signal's default action, at once
    assert proc.returncode == -signal.SIGINT, (proc.returncode, proc.stderr)
    assert "SIGINT again: exiting at once, without saving" in proc.stderr
    assert "still running" not in proc.stdout


def test_preempted_names_the_iteration_the_signal_and_how_to_resume():
  error = preemption.Preempted(6, "SIGTERM", "/runs/x/checkpoints")
  assert (error.iteration, error.signal_name) == (6, "SIGTERM")
  assert str(error) == (
    "stopped by SIGTERM after saving iteration 6 in /runs/x/checkpoints; run the same command "
    "again to resume from it"
  )
  assert preemption.EXIT_STATUS == 75
