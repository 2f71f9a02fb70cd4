"""A workdir that survives: its lock, unreadable checkpoints, torn log lines, bad input.

The in-process tests check each piece (`workdir.WorkdirLock`, `Checkpointer.restore_latest`,
`metrics_log`, the safetensors reader, `config.typed`, `trainer.build`); the `_run` tests
check what a user of `experiments/run.py` sees: the exit status, one `error: ...` line and no
traceback, and that nothing in the workdir was lost or overwritten.

The workdir the run.py tests resume is written in-process by the trainer's own `Checkpointer`
(`trainer._checkpointer`, the learner state of `trainer.build(config).init_state()`) and
`MetricsLog`, as two iterations of a tiny run would leave it, without the minute a real run
spends compiling its update. Each resume asks for no more iterations than the checkpoint it
restores has done, so it restores, checks and rewrites the logs, and stops.
"""

import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import processes

from experiments import configs
from seeupo_jax.models import checkpoint as hf_checkpoint
from seeupo_jax.models import qwen
from seeupo_jax.models import safetensors_io
from seeupo_jax.training import checkpoints
from seeupo_jax.training import config as config_lib
from seeupo_jax.training import metrics_log
from seeupo_jax.training import trainer
from seeupo_jax.training import workdir as workdir_lib
import tiny

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_RUN = os.path.join(_ROOT, "experiments", "run.py")

TINY = {
  "env.num_dials": 2,
  "rollout.max_turns": 2,
  "rollout.tasks_per_iteration": 2,
  "rollout.samples_per_task": 2,
  "rollout.max_context_tokens": 128,
  "eval.num_tasks": 2,
  "eval.k": 1,
  "eval.every": 0,
  "checkpoint.every": 1,
  "num_iterations": 2,
  "log.progress_bar": False,
  "log.plot": False,
  "log.tensorboard": False,
}


def _flags(**changes) -> list[str]:
  values = dict(TINY, **{k.replace("__", "."): v for k, v in changes.items()})
  return [f"--config.{key}={value}" for key, value in values.items()]


def _config(**changes):
  config = configs.get_config("synthetic")
  config.update_from_flattened_dict(
    dict(TINY, **{k.replace("__", "."): v for k, v in changes.items()})
  )
  return config


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
  """A compilation cache the run.py subprocesses of this module share (each compiles the
  same parameter initialisation)."""
  return str(tmp_path_factory.mktemp("jax_cache"))


def _run(workdir, *args, cache=None, timeout=300):
  env = processes.env()
  if cache:
    env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  return subprocess.run(
    [sys.executable, _RUN, f"--workdir={workdir}", *args],
    capture_output=True,
    text=True,
    env=env,
    cwd=_ROOT,
    timeout=timeout,
  )


def _one_error_line(proc, status=2) -> str:
  """The run's `error: ...` line, after checking the status, that it is the only error line
  and that no traceback was printed."""
  assert proc.returncode == status, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1 and proc.stderr.rstrip().endswith(errors[0]), proc.stderr[-3000:]
  return errors[0]


def _warnings(proc) -> list[str]:
  """absl's warning lines (`W<mmdd> <time> <thread> <file>:<line>] message`) of a run."""
  return [line for line in proc.stderr.splitlines() if re.match(r"W\d{4} ", line)]


def _tree_bytes(path) -> dict[str, bytes]:
  """Every file under `path` with its bytes (to show that nothing was changed)."""
  out = {}
  for directory, _, files in os.walk(path):
    for name in files:
      full = os.path.join(directory, name)
      out[os.path.relpath(full, path)] = open(full, "rb").read()
  return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A workdir as two iterations of the TINY run leave it: checkpoints 1 and 2, one metrics
  line and one trajectory line per iteration."""
  workdir = str(tmp_path_factory.mktemp("trained"))
  config = _config()
  program = trainer.build(config)
  try:
    state = program.init_state()
  finally:
    program.close()
  checkpointer = trainer._checkpointer(config, workdir, configs.get_config("synthetic"))
  with checkpointer:
    for iteration in (1, 2):
      progress = {"iteration": iteration, "task_position": 2 * iteration}
      checkpointer.save(iteration, state, jax.random.key(iteration), progress, force=True)
  with metrics_log.MetricsLog(workdir, tensorboard=False) as log:
    for iteration in (1, 2):
      log.write(iteration, {"reward": 0.25 * iteration})
  with open(os.path.join(workdir, "trajectories.jsonl"), "w") as f:
    for iteration in (1, 2):
      f.write(json.dumps({"iteration": iteration, "text": f"episode {iteration}"}) + "\n")
  return workdir


@pytest.fixture
def workdir(trained, tmp_path):
  """A fresh copy of `trained`."""
  path = str(tmp_path / "run")
  shutil.copytree(trained, path)
  return path


def _data_file(checkpoint_dir) -> str:
  """The largest array-data file of a checkpoint's train state."""
  data = os.path.join(checkpoint_dir, "train_state", "ocdbt.process_0", "d")
  files = [os.path.join(data, name) for name in os.listdir(data)]
  return max(files, key=os.path.getsize)


def _truncate(path, keep=0.5):
  size = os.path.getsize(path)
  with open(path, "r+b") as f:
    f.truncate(int(size * keep))


def _iterations(path) -> list[int]:
  return [r["iteration"] for r in metrics_log.read_records(path)]


# ----------------------------------------------------------------------------------------------
# The lock.


def test_the_lock_refuses_a_second_holder_and_is_gone_after_release(tmp_path):
  first = workdir_lib.WorkdirLock(str(tmp_path)).acquire()
  holder = json.loads((tmp_path / "lock").read_text())
  assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
  with pytest.raises(workdir_lib.WorkdirLocked) as error:
    workdir_lib.WorkdirLock(str(tmp_path)).acquire()
  message = str(error.value)
  assert f"pid {os.getpid()} on host {socket.gethostname()}" in message
  assert holder["started"] in message
  first.release()
  assert not (tmp_path / "lock").exists()
  with workdir_lib.lock(str(tmp_path)):
    assert json.loads((tmp_path / "lock").read_text())["pid"] == os.getpid()
  assert not (tmp_path / "lock").exists()


def _dead_pid() -> int:
  child = subprocess.Popen([sys.executable, "-c", "pass"])
  child.wait()
  return child.pid


@pytest.mark.parametrize(
  "holder,why",
  [
    (lambda: {"host": socket.gethostname(), "pid": _dead_pid()}, "that process is not running"),
    # The flock is free: the holder is gone, whatever its pid now names.
    (lambda: {"host": socket.gethostname(), "pid": os.getppid()}, "nobody holds it (the pid"),
    (lambda: {"host": "elsewhere", "pid": 1}, "nobody holds it"),
    (lambda: None, "an empty lock file"),
  ],
  ids=["dead-pid", "pid-reused", "other-host", "empty"],
)
def test_a_stale_lock_is_taken_with_a_warning(tmp_path, caplog, holder, why):
  holder = holder()
  text = "" if holder is None else json.dumps(dict(holder, started="2026-01-01T00:00:00"))
  (tmp_path / "lock").write_text(text)
  with caplog.at_level(logging.WARNING):
    with workdir_lib.lock(str(tmp_path)):
      assert json.loads((tmp_path / "lock").read_text())["pid"] == os.getpid()
  (warning,) = [r.getMessage() for r in caplog.records if "stale lock" in r.getMessage()]
  assert str(tmp_path / "lock") in warning and why in warning
  if holder is not None:
    assert f"pid {holder['pid']}" in warning
  assert not (tmp_path / "lock").exists()


def test_prepare_refuses_a_file_and_a_path_under_a_file(tmp_path):
  path = tmp_path / "a_file"
  path.write_text("keep me")
  with pytest.raises(workdir_lib.WorkdirError, match="is a file, not a directory"):
    workdir_lib.prepare(str(path))
  with pytest.raises(workdir_lib.WorkdirError, match="cannot create the workdir"):
    workdir_lib.prepare(str(path / "sub"))
  assert path.read_text() == "keep me"
  workdir_lib.prepare(str(tmp_path / "new" / "dir"))
  assert (tmp_path / "new" / "dir").is_dir()


_HOLDER = r"""
import sys
from seeupo_jax.training import workdir
with workdir.lock(sys.argv[1]):
  print("locked", flush=True)
  sys.stdin.read()  # holds the lock until the test closes stdin
"""


def test_run_py_on_a_locked_workdir_exits_with_one_line_naming_the_holder(workdir):
  before = _tree_bytes(workdir)
  holder = subprocess.Popen(
    [sys.executable, "-c", _HOLDER, workdir],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    text=True,
    cwd=_ROOT,
    env=dict(os.environ, PYTHONPATH=_ROOT),
  )
  try:
    assert holder.stdout.readline().strip() == "locked"
    lock_text = open(os.path.join(workdir, "lock")).read()
    proc = _run(workdir, *_flags(), timeout=120)
    line = _one_error_line(proc)
    assert f"is in use by pid {holder.pid} on host {socket.gethostname()}" in line
    assert "--config=synthetic" in line
    # The holder's lock, the checkpoints and the logs are as they were.
    assert open(os.path.join(workdir, "lock")).read() == lock_text
    after = _tree_bytes(workdir)
    del after["lock"]
    assert after == before
  finally:
    holder.stdin.close()
    holder.wait(timeout=60)
  assert holder.returncode == 0
  assert not os.path.exists(os.path.join(workdir, "lock"))


# ----------------------------------------------------------------------------------------------
# Asynchronous saves.


def test_an_asynchronous_save_holds_the_state_of_its_call_and_finishes_before_the_next(tmp_path):
  """`save` returns once the arrays are on the host: the device buffers may then be deleted (as
  the next update donates them) and the checkpoint still holds the values of the call; `finish`
  and the next `save` wait for the files; `close` waits too."""
  directory = str(tmp_path / "ckpt")
  trees = {i: _small_tree(i) for i in (1, 2)}
  want = {i: jax.tree.map(np.asarray, trees[i]) for i in (1, 2)}
  ckpt = checkpoints.Checkpointer(directory, every=1, asynchronous=True)
  assert ckpt.save(1, trees[1], jax.random.key(1), {"at": 1})
  for leaf in jax.tree.leaves(trees[1]):
    leaf.delete()  # what donation does to the buffers
  assert ckpt.finish() == 1 and ckpt.finish() is None
  assert checkpoints.check_file_sizes(os.path.join(directory, "1"))
  assert ckpt.save(2, trees[2], jax.random.key(2), {"at": 2})
  ckpt.close()  # waits for iteration 2
  assert checkpoints.check_file_sizes(os.path.join(directory, "2"))
  with checkpoints.Checkpointer(directory, every=1) as reader:
    for iteration in (2, 1):
      _, state, _, progress = reader._restore(iteration, *_abstract())
      assert progress == {"at": iteration}
      chex.assert_trees_all_equal(jax.tree.map(np.asarray, state), want[iteration])


_KILLED_DURING_A_SAVE = textwrap.dedent(
  """
  import os, signal, sys
  import jax, jax.numpy as jnp, numpy as np
  from seeupo_jax.training import checkpoints

  ckpt = checkpoints.Checkpointer(sys.argv[1], every=1, asynchronous=True)
  small = {"w": jnp.ones((1000,), jnp.float32), "n": jnp.int32(1)}
  ckpt.save(1, small, jax.random.key(1), {"at": 1})
  ckpt.finish()
  big = {"w": jnp.asarray(np.random.default_rng(0).random(60_000_000, dtype=np.float32)),
         "n": jnp.int32(2)}
  ckpt.save(2, big, jax.random.key(2), {"at": 2})  # returns with the files still being written
  os.kill(os.getpid(), signal.SIGKILL)
  """
)


def test_a_kill_during_an_asynchronous_save_leaves_the_previous_checkpoint(tmp_path):
  directory = tmp_path / "ckpt"
  proc = subprocess.run(
    [sys.executable, "-c", _KILLED_DURING_A_SAVE, str(directory)],
    capture_output=True,
    text=True,
    env=processes.env(JAX_ENABLE_COMPILATION_CACHE="false"),
    cwd=_ROOT,
    timeout=300,
  )
  assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
  names = sorted(os.listdir(directory))
  # Iteration 2 was cut off mid-write (a temporary directory, or nothing), never a whole-looking
  # "2" (orbax renames a save into place only when it is complete).
  assert "1" in names and "2" not in names, names
  abstract = {
    "w": jax.ShapeDtypeStruct((1000,), jnp.float32),
    "n": jax.ShapeDtypeStruct((), jnp.int32),
  }
  rng = jax.eval_shape(lambda: jax.random.key(0))
  with checkpoints.Checkpointer(str(directory), every=1) as ckpt:
    iteration, state, _, progress = ckpt.restore_latest(abstract, rng)
  assert iteration == 1 and progress == {"at": 1}
  np.testing.assert_array_equal(np.asarray(state["w"]), np.ones(1000, np.float32))
  assert not any(".orbax-checkpoint-tmp" in n for n in os.listdir(directory))  # cleaned up


# ----------------------------------------------------------------------------------------------
# Unreadable checkpoints.


def _small_tree(value):
  rng = np.random.default_rng(int(value))
  return {"w": jnp.asarray(rng.random(20_000, dtype=np.float32)), "n": jnp.int32(value)}


def _abstract():
  return checkpoints.abstract_of(_small_tree(0)), jax.eval_shape(lambda: jax.random.key(0))


def _two_checkpoints(directory):
  with checkpoints.Checkpointer(directory, every=1) as ckpt:
    for iteration in (1, 2):
      ckpt.save(iteration, _small_tree(iteration), jax.random.key(iteration), {"at": iteration})


@pytest.mark.parametrize(
  "damage,cause",
  [
    (lambda d: _truncate(_data_file(os.path.join(d, "2"))), "bytes, {size} when saved"),
    (lambda d: shutil.rmtree(os.path.join(d, "2", "manifest")), "manifest/metadata is missing"),
    (
      lambda d: _truncate(os.path.join(d, "2", "progress", "metadata")),
      "progress/metadata has",
    ),
    # Without the size record (an older checkpoint), orbax's reads find the damage.
    (lambda d: _without_record(d) or _truncate(_data_file(os.path.join(d, "2"))), "OUT_OF_RANGE"),
    (
      lambda d: _without_record(d) or shutil.rmtree(os.path.join(d, "2", "manifest")),
      'Item "manifest" was not found',
    ),
    (
      lambda d: _without_record(d) or _truncate(os.path.join(d, "2", "progress", "metadata")),
      "JSONDecodeError",
    ),
  ],
  ids=[
    "truncated-data",
    "manifest-deleted",
    "truncated-progress",
    "truncated-data-no-record",
    "manifest-deleted-no-record",
    "truncated-progress-no-record",
  ],
)
def test_an_unreadable_latest_checkpoint_falls_back_and_is_moved_aside(
  tmp_path, caplog, damage, cause
):
  directory = str(tmp_path / "ckpt")
  _two_checkpoints(directory)
  size = os.path.getsize(_data_file(os.path.join(directory, "2")))
  cause = cause.format(size=size)
  damage(directory)
  damaged = _tree_bytes(os.path.join(directory, "2"))
  with caplog.at_level(logging.WARNING), checkpoints.Checkpointer(directory, every=1) as ckpt:
    iteration, tree, _, progress = ckpt.restore_latest(*_abstract())
    assert (iteration, progress, int(tree["n"])) == (1, {"at": 1}, 1)
    np.testing.assert_array_equal(tree["w"], _small_tree(1)["w"])
    # The run that resumes from 1 saves its iteration 2 again, beside the unreadable one.
    assert ckpt.all_iterations() == [1]
    assert ckpt.save(2, _small_tree(5), jax.random.key(5), {"at": 2})
  skipped = [r.getMessage() for r in caplog.records if "is unreadable, skipped" in r.getMessage()]
  assert len(skipped) == 1 and os.path.join(directory, "2") in skipped[0] and cause in skipped[0]
  assert "\n" not in skipped[0] and len(skipped[0]) < 600
  assert any("2.unreadable" in r.getMessage() for r in caplog.records)
  assert _tree_bytes(os.path.join(directory, "2.unreadable")) == damaged  # kept as it was
  with checkpoints.Checkpointer(directory, every=1) as ckpt:
    assert ckpt.restore_latest(*_abstract())[3] == {"at": 2}


def _without_record(directory):
  os.remove(os.path.join(directory, "2", checkpoints.FILE_SIZES))


def test_the_size_record_lists_every_file_of_the_checkpoint_and_checks_them(tmp_path):
  directory = str(tmp_path / "ckpt")
  _two_checkpoints(directory)
  where = os.path.join(directory, "2")
  with open(os.path.join(where, checkpoints.FILE_SIZES)) as f:
    recorded = json.load(f)["sizes"]
  on_disk = {
    os.path.relpath(os.path.join(root, name), where): os.path.getsize(os.path.join(root, name))
    for root, _, names in os.walk(where)
    for name in names
    if name != checkpoints.FILE_SIZES
  }
  assert recorded == on_disk and len(recorded) > 5
  assert checkpoints.check_file_sizes(where)
  data = _data_file(where)
  with open(data, "ab") as f:  # one byte more is a change too
    f.write(b"\0")
  with pytest.raises(checkpoints.CheckpointFilesChanged, match="1 of its"):
    checkpoints.check_file_sizes(where)
  _without_record(directory)
  assert not checkpoints.check_file_sizes(where)


def test_no_readable_checkpoint_is_an_error_and_nothing_is_moved(tmp_path):
  directory = str(tmp_path / "ckpt")
  _two_checkpoints(directory)
  for iteration in ("1", "2"):
    _truncate(_data_file(os.path.join(directory, iteration)))
  before = _tree_bytes(directory)
  with checkpoints.Checkpointer(directory, every=1) as ckpt:
    with pytest.raises(checkpoints.CheckpointsUnreadable) as error:
      ckpt.restore_latest(*_abstract())
  message = str(error.value)
  assert "none of the 2 checkpoint(s)" in message and "2: " in message and "1: " in message
  assert _tree_bytes(directory) == before


def test_a_read_only_checkpointer_moves_and_deletes_nothing(tmp_path):
  directory = str(tmp_path / "ckpt")
  _two_checkpoints(directory)
  _truncate(_data_file(os.path.join(directory, "2")))
  leftover = os.path.join(directory, "3.orbax-checkpoint-tmp")  # a trainer's save under way
  shutil.copytree(os.path.join(directory, "1"), leftover)
  before = _tree_bytes(directory)
  with checkpoints.Checkpointer(directory, every=1, read_only=True) as ckpt:
    assert ckpt.restore_latest(*_abstract())[0] == 1
    with pytest.raises(ValueError, match="read-only"):
      ckpt.save(3, _small_tree(3), jax.random.key(3), {})
  assert _tree_bytes(directory) == before


def test_a_readable_checkpoint_of_another_config_is_refused_not_skipped(tmp_path):
  directory = str(tmp_path / "ckpt")
  with checkpoints.Checkpointer(directory, every=1, config={"lr": 1.0}) as ckpt:
    ckpt.save(1, _small_tree(1), jax.random.key(1), {"at": 1})
  with checkpoints.Checkpointer(directory, every=1, config={"lr": 2.0}) as ckpt:
    with pytest.raises(ValueError, match="lr: 1.0 in the checkpoint, 2.0 now"):
      ckpt.restore_latest(*_abstract())
  assert os.listdir(directory) == ["1"]


def test_run_py_resumes_from_the_newest_readable_checkpoint(workdir, jax_cache):
  # A truncated data file; other damage (a deleted manifest, ...) is the in-process test's.
  checkpoints_dir = os.path.join(workdir, "checkpoints")
  _truncate(_data_file(os.path.join(checkpoints_dir, "2")))
  first = _tree_bytes(os.path.join(checkpoints_dir, "1"))
  damaged = _tree_bytes(os.path.join(checkpoints_dir, "2"))
  # num_iterations=1: the run resumes from checkpoint 1 and has nothing left to train.
  proc = _run(workdir, *_flags(num_iterations=1), cache=jax_cache)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  (skipped,) = [line for line in _warnings(proc) if "is unreadable, skipped" in line]
  assert os.path.join(checkpoints_dir, "2") in skipped
  assert f"resuming {workdir} from iteration 1" in proc.stdout
  assert sorted(os.listdir(checkpoints_dir)) == ["1", "2.unreadable"]
  assert _tree_bytes(os.path.join(checkpoints_dir, "1")) == first
  assert _tree_bytes(os.path.join(checkpoints_dir, "2.unreadable")) == damaged
  # The logs keep iteration 1 (a run on to 2 writes 2 again).
  assert _iterations(os.path.join(workdir, "metrics.jsonl")) == [1]
  assert _iterations(os.path.join(workdir, "trajectories.jsonl")) == [1]


def test_run_py_refuses_a_workdir_whose_checkpoints_are_all_unreadable(workdir, jax_cache):
  checkpoints_dir = os.path.join(workdir, "checkpoints")
  for iteration in ("1", "2"):
    _truncate(_data_file(os.path.join(checkpoints_dir, iteration)))
  before = _tree_bytes(workdir)
  proc = _run(workdir, *_flags(), cache=jax_cache)
  line = _one_error_line(proc)
  assert f"cannot resume {workdir}: none of the 2 checkpoint(s)" in line
  assert "to start from iteration 0 instead, move" in line
  assert _tree_bytes(workdir) == before  # no restart: checkpoints and logs untouched


# ----------------------------------------------------------------------------------------------
# Torn lines in the logs.


def test_torn_lines_anywhere_are_skipped_with_a_warning(tmp_path, caplog):
  path = tmp_path / "metrics.jsonl"
  path.write_text(
    '{"iteration": 1, "loss": 1.0}\n'
    '{"iteration": 2, "lo\n'  # torn, then a newline: the next run appended after it
    '{"iteration": 3, "loss": 3.0}\n'
    "7\n"  # JSON, but not a record
    '{"iteration": 4, "loss": 4.0}\n'
    '{"iteration": 5, "loss"'  # torn, at the end
  )
  with caplog.at_level(logging.WARNING):
    assert _iterations(str(path)) == [1, 3, 4]
  (warning,) = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
  assert str(path) in warning and "3 line(s)" in warning and "line 2, 4, 6" in warning

  # Resuming after the checkpoint of iteration 3 drops 4.. and the torn lines, keeps 1 and 3.
  with metrics_log.MetricsLog(str(tmp_path), tensorboard=False, resume_from=4) as log:
    log.write(4, {"loss": 40.0})
  records = [json.loads(line) for line in path.read_text().splitlines()]
  assert [(r["iteration"], r["loss"]) for r in records] == [(1, 1.0), (3, 3.0), (4, 40.0)]


def test_a_torn_last_line_is_not_glued_to_the_next_record(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"iteration": 1, "loss": 1.0}\n{"iteration": 2, "lo')
  with metrics_log.MetricsLog(str(tmp_path), tensorboard=False) as log:  # no resume: append
    log.write(2, {"loss": 2.0})
  assert [json.loads(line)["iteration"] for line in path.read_text().splitlines()] == [1, 2]


def test_run_py_resumes_a_crashed_runs_workdir_stale_lock_and_torn_lines(workdir, jax_cache):
  """What a run killed while writing its logs leaves: its lock (pid gone) and torn lines."""
  pid = _dead_pid()
  lock = {"host": socket.gethostname(), "pid": pid, "started": "2026-01-01T00:00:00+00:00"}
  with open(os.path.join(workdir, "lock"), "w") as f:
    json.dump(lock, f)
  metrics = os.path.join(workdir, "metrics.jsonl")
  trajectories = os.path.join(workdir, "trajectories.jsonl")
  kept = {}
  for path in (metrics, trajectories):
    lines = open(path).read().splitlines()
    with open(path, "w") as f:  # a torn line between the two records, and one at the end
      f.write(lines[0] + "\n" + lines[1][:15] + "\n" + lines[1] + "\n" + '{"iteration": 3, "x')
    kept[path] = lines
  proc = _run(workdir, *_flags(), cache=jax_cache)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  (stale,) = [line for line in _warnings(proc) if "stale lock" in line]
  assert f"pid {pid} on host {socket.gethostname()}" in stale and "not running" in stale
  torn = [line for line in _warnings(proc) if "skipped 2 line(s)" in line]
  assert any("metrics.jsonl" in line for line in torn)
  assert any("trajectories.jsonl" in line for line in torn)
  assert f"resuming {workdir} from iteration 2" in proc.stdout
  for path, lines in kept.items():  # both records kept, the torn lines gone
    assert open(path).read().splitlines() == lines
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["1", "2"]
  assert not os.path.exists(os.path.join(workdir, "lock"))  # taken, then released at exit


# ----------------------------------------------------------------------------------------------
# A saved config without keys added since.


def test_check_config_takes_a_key_absent_from_the_checkpoint_at_its_default():
  defaults = {"learner": {"kl_coef": 0.0, "tis": "off"}, "seed": 0}
  saved = {"learner": {"kl_coef": 0.0}, "seed": 0}  # written before learner.tis existed
  checkpoints.check_config(saved, defaults, defaults=defaults)
  changed = {"learner": {"kl_coef": 0.0, "tis": "token"}, "seed": 0}
  with pytest.raises(ValueError) as error:
    checkpoints.check_config(saved, changed, defaults=defaults)
  assert (
    'learner.tis: (absent) in the checkpoint (written before the key existed; its default "off" '
    'is what that run used), "token" now'
  ) in str(error.value)
  assert "1 key(s)" in str(error.value)
  with pytest.raises(ValueError, match="learner.tis: .absent. in the checkpoint, .off. now"):
    checkpoints.check_config(saved, defaults)  # without defaults every absent key differs


def test_check_config_follows_a_key_to_the_one_name_it_moved_to():
  """AppWorld's checkpoints before commit 6308e64 hold env.max_turns, a copy of rollout.max_turns;
  the config has only rollout.max_turns now. Equal values resume; a copy that differed (a run
  whose env limit was not its rollout limit) is refused, naming both keys."""
  moved = config_lib.MOVED_KEYS
  saved = {"env": {"max_turns": 30, "name": "appworld"}, "rollout": {"max_turns": 30}}
  current = {"env": {"name": "appworld"}, "rollout": {"max_turns": 30}}
  checkpoints.check_config(saved, current, moved=moved)
  with pytest.raises(ValueError, match=r"env.max_turns: 30 in the checkpoint, \(absent\) now"):
    checkpoints.check_config(saved, current)  # not followed: a removed key differs
  saved["env"]["max_turns"] = 20
  with pytest.raises(ValueError) as error:
    checkpoints.check_config(saved, current, moved=moved)
  assert (
    "env.max_turns: 20 in the checkpoint, now rollout.max_turns (the key it moved to) is 30"
  ) in str(error.value)


def _drop_saved_key(workdir, section, key):
  """Removes `section.key` from the config in every checkpoint's manifest (as a checkpoint
  written before the key was added, and before the size record)."""
  for iteration in ("1", "2"):
    os.remove(os.path.join(workdir, "checkpoints", iteration, checkpoints.FILE_SIZES))
    path = os.path.join(workdir, "checkpoints", iteration, "manifest", "metadata")
    with open(path) as f:
      manifest = json.load(f)
    del manifest["config"][section][key]
    with open(path, "w") as f:
      json.dump(manifest, f)


def test_run_py_resumes_a_checkpoint_without_a_newer_key_at_its_default(workdir, jax_cache):
  _drop_saved_key(workdir, "rollout", "top_k")
  proc = _run(workdir, *_flags(), cache=jax_cache)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "from iteration 2" in proc.stdout
  proc = _run(workdir, *_flags(rollout__top_k=5), cache=jax_cache)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert "rollout.top_k: (absent) in the checkpoint" in proc.stderr and "5 now" in proc.stderr
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["1", "2"]


# ----------------------------------------------------------------------------------------------
# Bad input: safetensors, config values.


def _write(path, tensors):
  entries = [(name, array.shape, array.dtype) for name, array in tensors.items()]
  safetensors_io.write_file(str(path), entries, tensors.__getitem__)


def _header_length(path) -> int:
  return int.from_bytes(open(path, "rb").read(8), "little")


def _rewrite_header(path, change):
  data = open(path, "rb").read()
  n = _header_length(path)
  header = json.loads(data[8 : 8 + n])
  change(header)
  blob = json.dumps(header).encode()
  blob += b" " * (-len(blob) % 8)
  open(path, "wb").write(len(blob).to_bytes(8, "little") + blob + data[8 + n :])


@pytest.mark.parametrize(
  "damage,message",
  [
    (
      lambda p: _truncate(p, keep=0.9),
      "tensor 'b' needs bytes [400, 4400) of the data section, which holds only",
    ),
    (
      lambda p: open(p, "r+b").truncate(20),
      "the header claims",
    ),
    (lambda p: open(p, "r+b").truncate(3), "too short for a safetensors header"),
    (
      lambda p: _rewrite_header(p, lambda h: h["b"].update(shape=[10, 11])),
      "tensor 'b' is F32[10, 11] (440 bytes) but its data_offsets [400, 4400] span 4000 bytes",
    ),
    (
      lambda p: _rewrite_header(p, lambda h: h["a"].update(dtype="F8")),
      "tensor 'a' has unsupported dtype 'F8'",
    ),
    (
      lambda p: _rewrite_header(p, lambda h: h["a"].update(data_offsets=[8, 4])),
      "tensor 'a' has data_offsets [8, 4]",
    ),
  ],
  ids=["truncated-data", "truncated-header", "too-short", "shape", "dtype", "offsets"],
)
def test_the_safetensors_reader_names_the_file_and_tensor_of_a_bad_file(tmp_path, damage, message):
  path = tmp_path / "model.safetensors"
  _write(path, {"a": np.ones((10, 10), np.float32), "b": np.ones((10, 100), np.float32)})
  safetensors_io.SafetensorsReader(str(path))  # intact: reads
  damage(str(path))
  with pytest.raises(safetensors_io.SafetensorsError) as error:
    safetensors_io.SafetensorsReader(str(path))
  assert str(error.value).startswith(f"{path}: ") and message in str(error.value)


def test_run_py_refuses_a_truncated_model_safetensors_naming_it(tmp_path, jax_cache):
  model = tmp_path / "hf"
  config = tiny.model_config()
  hf_checkpoint.save(qwen.init_params(config, jax.random.key(0)), config, str(model))
  trainer.build_model(_config())[1].save_pretrained(str(model))  # the preset's tokenizer
  weights = model / "model.safetensors"
  _truncate(str(weights), keep=0.6)
  size = os.path.getsize(weights)
  proc = _run(tmp_path / "run", *_flags(), f"--config.model.path={model}", cache=jax_cache)
  line = _one_error_line(proc)
  assert f"model.path={str(model)!r}: {weights}: tensor " in line and "truncated" in line
  assert os.path.getsize(weights) == size


@pytest.mark.parametrize(
  "key,value,allowed",
  [
    ("rollout.tasks_per_iteration", 0, "an int >= 1"),
    ("rollout.samples_per_task", -1, "an int >= 1"),
    ("optimizer.learning_rate", -1e-3, "a finite number > 0"),
    ("optimizer.learning_rate", float("nan"), "a finite number > 0"),
    ("optimizer.max_grad_norm", 0.0, "a finite number > 0"),
    ("optimizer.weight_decay", -0.1, "a finite number >= 0"),
    ("optimizer.warmup_steps", -5, "an int >= 0"),
    ("eval.k", 0, "an int >= 1"),
    ("eval.every", -1, "an int >= 0"),
    ("checkpoint.keep", 0, "an int >= 1"),
    ("checkpoint.every", 0, "an int >= 1"),
    ("log.trajectories", -1, "an int >= 0"),
    ("num_iterations", 0, "an int >= 1"),
    ("env.num_dials", 0, "an int >= 1"),
    ("env.partial_credit", 1.5, "a number in [0, 1]"),
  ],
)
def test_validation_names_the_key_and_what_is_allowed(key, value, allowed):
  config = _config(**{key: value})
  with pytest.raises(config_lib.ConfigError) as error:
    config_lib.typed(config)
  assert str(error.value) == f"{key}={value!r}; allowed: {allowed}"


def test_validation_checks_the_batch_splits_into_minibatches():
  config_lib.typed(_config())
  with pytest.raises(
    config_lib.ConfigError,
    match=r"2 x 2 rows per batch, which learner.minibatches x learner.microbatches = 3 x 1",
  ):
    config_lib.typed(_config(**{"learner.minibatches": 3}))


def test_typed_config_is_one_frozen_tree_with_one_name_per_value():
  """The ConfigDict becomes `TrainConfig` once: frozen sections, the learner a LearnerConfig whose
  num_turns is rollout.max_turns (no second key for it), every bad key named at once."""
  typed = config_lib.typed(_config(**{"rollout.max_turns": 2}))
  assert config_lib.typed(typed) is typed
  assert typed.rollout.max_turns == 2 and typed.learner.num_turns == 2
  assert isinstance(typed.learner, trainer.learner.LearnerConfig)
  with pytest.raises(dataclasses.FrozenInstanceError):
    typed.rollout.max_turns = 5
  with pytest.raises(TypeError):
    typed.env.options["num_dials"] = 5  # a read-only mapping
  config = _config()
  assert "num_turns" not in config.learner
  # A setting the learner refuses is named as the config's key, not LearnerConfig's field.
  with pytest.raises(config_lib.ConfigError) as error:
    config_lib.typed(_config(**{"learner.clip_low": 1.5}))
  assert str(error.value) == "learner.clip_low=1.5; allowed: a number in [0, 1)"
  # Several bad keys: every one in the one message, in the tree's order.
  with pytest.raises(config_lib.ConfigError) as error:
    config_lib.typed(_config(**{"rollout.top_p": 0.0, "eval.k": 0, "mesh.fsdp": 0}))
  assert str(error.value) == (
    "rollout.top_p=0.0; allowed: a number in (0, 1] (1: off); eval.k=0; allowed: an int >= 1; "
    "mesh.fsdp=0; allowed: an int >= 1, or -1 (the devices left)"
  )


def test_every_key_has_its_default_from_the_one_dataclass_that_declares_it():
  """`config_lib.defaults()` holds every key `typed` reads; a value shared with a library
  dataclass (or `default_optimizer`) is that declaration's default, read here from the library
  itself; the task's keys are unset, and `typed` names each of them."""
  import inspect  # noqa: PLC0415

  from seeupo_jax import learner, rollout, sampling  # noqa: PLC0415
  from seeupo_jax.models import config as model_config  # noqa: PLC0415

  def declared(cls, name):
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)

  optimizer = inspect.signature(learner.default_optimizer).parameters
  shared = {
    "rollout.env_workers": declared(rollout.RolloutConfig, "env_workers"),
    "rollout.scheduler": declared(rollout.RolloutConfig, "scheduler"),
    "rollout.episode_retries": declared(rollout.RolloutConfig, "episode_retries"),
    "rollout.decode_slots": declared(sampling.SessionConfig, "rows"),
    "rollout.prefill_rows": declared(sampling.SessionConfig, "prefill_rows"),
    "rollout.page_size": declared(sampling.SessionConfig, "page_size"),
    "rollout.temperature": declared(sampling.SamplingConfig, "temperature"),
    "rollout.top_p": declared(sampling.SamplingConfig, "top_p"),
    "model.dtype": declared(model_config.ModelConfig, "dtype"),
    "model.scan_layers": declared(model_config.ModelConfig, "scan_layers"),
    "learner.kl_coef": declared(learner.LearnerConfig, "kl_coef"),
    "learner.clip_low": declared(learner.LearnerConfig, "clip_low"),
    "learner.algorithm": declared(learner.LearnerConfig, "algorithm"),
    "optimizer.learning_rate": optimizer["learning_rate"].default,
    "optimizer.weight_decay": optimizer["weight_decay"].default,
    "optimizer.max_grad_norm": optimizer["max_grad_norm"].default,
  }
  config = config_lib.defaults()
  flat = {}
  for section, values in config.items():
    if hasattr(values, "items"):
      flat.update({f"{section}.{k}": v for k, v in values.items()})
    else:
      flat[section] = values
  for key, value in shared.items():
    assert flat[key] == value, key
  # The same keys as the shipped config files, no more and no fewer (the env options aside).
  synthetic = configs.get_config("synthetic")
  for section, values in synthetic.items():
    if section != "env" and hasattr(values, "keys"):
      assert sorted(values.keys()) == sorted(config[section].keys()), section
  assert sorted(k for k in synthetic.keys()) == sorted(config.keys())
  # The task's keys have no default: `typed` names each one a config file left unset.
  with pytest.raises(config_lib.ConfigError) as error:
    config_lib.typed(config)
  for key in ("rollout.max_turns", "rollout.max_reply_tokens", "rollout.max_context_tokens"):
    assert f"{key}=None; allowed: an int >= 1" in str(error.value), key
  assert "env.name: missing" in str(error.value)


def test_typed_config_checks_the_environment_options_against_their_family():
  """The `env` section is checked at the boundary against the family's options dataclass: an
  unknown environment, an unknown option and a refused range, each named as the config's key."""
  config = _config()
  config.env.name = "nope"
  with pytest.raises(config_lib.ConfigError) as error:
    config_lib.typed(config)
  assert str(error.value) == "env.name='nope'; allowed: one of ['appworld', 'bfcl', 'synthetic']"
  config = _config()
  config.env.unlock()
  config.env.num_dails = 3
  with pytest.raises(config_lib.ConfigError, match=r"^env.num_dails: unknown key; known: \["):
    config_lib.typed(config)
  bfcl = configs.get_config("bfcl")
  bfcl.env.train_tasks = "multi_turn_base:5-1"
  with pytest.raises(config_lib.ConfigError) as error:
    config_lib.typed(bfcl)
  assert str(error.value) == "env.train_tasks: empty range 'multi_turn_base:5-1'"
  appworld = configs.get_config("appworld")
  appworld.env.num_servers = 70000
  with pytest.raises(config_lib.ConfigError, match=r"^env.num_servers=70000; allowed: at most "):
    config_lib.typed(appworld)


def test_typed_config_refuses_a_key_nothing_reads_and_a_missing_key():
  """A config file with a key that no part reads (a typo in a file of experiments/configs) or
  without one that the program needs is refused, naming it."""
  config = _config()
  config.unlock()
  config.rollout.max_turn = 3
  del config.eval["greedy"]
  with pytest.raises(config_lib.ConfigError) as error:
    config_lib.typed(config)
  message = str(error.value)
  assert "rollout.max_turn: unknown key; known: [" in message
  assert "eval.greedy: missing" in message


@pytest.mark.parametrize(
  "flag,message",
  [
    (
      "--config.rollout.tasks_per_iteration=0",
      "rollout.tasks_per_iteration=0; allowed: an int >= 1",
    ),
    (
      "--config.optimizer.learning_rate=-0.001",
      "optimizer.learning_rate=-0.001; allowed: a finite number > 0",
    ),
  ],
)
def test_run_py_refuses_a_bad_value_before_anything_starts(tmp_path, flag, message):
  proc = _run(tmp_path / "run", *_flags(), flag, timeout=120)
  line = _one_error_line(proc)
  assert line == f"error: bad config for --config=synthetic: {message}"
  assert not (tmp_path / "run").exists()  # not even the workdir was made


def test_run_py_refuses_a_workdir_that_is_a_file(tmp_path):
  path = tmp_path / "notes.txt"
  path.write_text("keep me")
  line = _one_error_line(_run(path, *_flags(), timeout=120))
  assert line == (
    f"error: --config=synthetic: the workdir {path} is a file, not a directory; pick another "
    "--workdir"
  )
  assert path.read_text() == "keep me"


def test_build_turns_only_validation_errors_into_config_errors(monkeypatch):
  with pytest.raises(trainer.ConfigError, match=r"^rollout.max_turns=0; allowed: an int >= 1$"):
    trainer.build(_config(**{"rollout.max_turns": 0}))

  def buggy(*args, **kwargs):
    raise TypeError("a bug in the update")

  monkeypatch.setattr(trainer.learner, "make_update", buggy)
  with pytest.raises(TypeError, match="a bug in the update") as error:
    trainer.build(_config())
  assert not isinstance(error.value, trainer.ConfigError)
