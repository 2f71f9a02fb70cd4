"""SIGTERM at every phase of an iteration: during the rollout, the update, the evaluation, or a
checkpoint save in progress. Each time the run finishes the iteration in flight, saves it
(although no checkpoint is due), raises `Preempted` naming it, and the rerun on the same workdir
ends with the parameters (the HF export, bit for bit) and the metrics of a run that was never
stopped.

One process, in-process, with one built program (its sampler and update compile once); the
signal is sent by the process to itself from inside the phase's call. The same through
`experiments/run.py` (exit status 75, the line it prints): tests/training/test_train.py, and with
two processes tests/training/test_run_multiprocess.py.
"""

import dataclasses
import os
import signal
import sys

import pytest

from seeupo_jax.training import checkpoints, loop, metrics_log, preemption, trainer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from experiments import configs  # noqa: E402

ITERATIONS = 4
EVERY = 2  # regular saves at 2 and 4
STOPPED = 3  # the iteration every phase's signal arrives in (the save: iteration 2's save)


def small_config():
  c = configs.get_config("synthetic")
  c.env.num_dials = 1
  c.rollout.max_turns = 1
  c.rollout.tasks_per_iteration = 4
  c.rollout.samples_per_task = 2
  c.rollout.max_context_tokens = 128
  c.rollout.env_workers = 2
  c.num_iterations = ITERATIONS
  c.eval.num_tasks = 4
  c.eval.k = 1
  c.eval.every = 1  # an evaluation in every iteration, so a signal can arrive during one
  c.checkpoint.every = EVERY
  c.checkpoint.keep = 10
  c.log.progress_bar = False
  c.log.plot = False
  c.log.tensorboard = False
  c.save_hf = True
  return c


@pytest.fixture(scope="module")
def program():
  program = trainer.build(small_config())
  yield program
  program.close()


@pytest.fixture(scope="module")
def whole(program, tmp_path_factory):
  """The run never stopped."""
  workdir = tmp_path_factory.mktemp("whole")
  trainer._train(small_config(), str(workdir), program)
  return workdir


def _sigterm():
  os.kill(os.getpid(), signal.SIGTERM)


class _SignalOnCall:
  """Wraps a callable: its `at`-th call (1-based) sends SIGTERM to this process as it starts (the
  watch records the signal then; the loop reads it only once the iteration is done)."""

  def __init__(self, fn, at):
    self.fn, self.at, self.calls = fn, at, 0

  def __call__(self, *args, **kwargs):
    self.calls += 1
    if self.calls == self.at:
      _sigterm()
    return self.fn(*args, **kwargs)


class _Roller:
  def __init__(self, roller, at):
    self._roller, self.run = roller, _SignalOnCall(roller.run, at)

  def __getattr__(self, name):
    return getattr(self._roller, name)


def _stopped_program(program, phase, monkeypatch):
  """The program (or the module it calls) with SIGTERM sent during the phase of iteration
  STOPPED (or iteration EVERY's save)."""
  if phase == "rollout":
    return dataclasses.replace(program, roller=_Roller(program.roller, STOPPED))
  if phase == "update":
    return dataclasses.replace(program, update=_SignalOnCall(program.update, STOPPED))
  if phase == "evaluation":
    monkeypatch.setattr(loop, "_evaluate", _SignalOnCall(loop._evaluate, STOPPED))
    return program
  assert phase == "save"
  save = checkpoints.Checkpointer.save

  def save_with_signal(self, iteration, *args, **kwargs):
    if iteration == EVERY:
      _sigterm()
    return save(self, iteration, *args, **kwargs)

  monkeypatch.setattr(checkpoints.Checkpointer, "save", save_with_signal)
  return program


def _timing(key):
  """Whether a metric is a clock reading or the engine's schedule (`rollout/`: its calls and
  timings depend on when the environments answer, not on the trajectories)."""
  return key == "time" or key.startswith(("time/", "rollout/"))


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["rollout", "update", "evaluation", "save"])
def test_sigterm_in_any_phase_saves_that_iteration_and_the_rerun_ends_as_never_stopped(
  program, whole, phase, tmp_path, monkeypatch
):
  workdir = tmp_path / "stopped"
  handler = signal.getsignal(signal.SIGTERM)
  with monkeypatch.context() as patch:
    stopped = _stopped_program(program, phase, patch)
    with pytest.raises(preemption.Preempted) as raised:
      trainer._train(small_config(), str(workdir), stopped)
  assert raised.value.iteration == STOPPED and raised.value.signal_name == "SIGTERM"
  assert signal.getsignal(signal.SIGTERM) is handler  # the watch's handler is gone
  # The regular save and the preempted one; nothing exported, nothing logged past the stop.
  assert sorted(os.listdir(workdir / "checkpoints")) == [str(EVERY), str(STOPPED)]
  assert not (workdir / "hf_policy").exists()
  records = metrics_log.read_metrics(str(workdir / "metrics.jsonl"))
  assert [r["iteration"] for r in records] == list(range(1, STOPPED + 1))

  trainer._train(small_config(), str(workdir), program)  # the rerun: resumes at STOPPED
  a = (whole / "hf_policy" / "model.safetensors").read_bytes()
  b = (workdir / "hf_policy" / "model.safetensors").read_bytes()
  assert a == b
  timeless = lambda log: [{k: v for k, v in r.items() if not _timing(k)} for r in log]
  whole_log = metrics_log.read_metrics(str(whole / "metrics.jsonl"))
  resumed_log = metrics_log.read_metrics(str(workdir / "metrics.jsonl"))
  assert [r["iteration"] for r in resumed_log] == list(range(1, ITERATIONS + 1))
  assert timeless(resumed_log) == timeless(whole_log)
