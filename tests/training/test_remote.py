"""A remote workdir (`gs://`) against a fake bucket (`tests/fake_bucket.py`): the mirror's push and
pull, its lock object, a failing copy, and `experiments/run.py` resuming from the bucket alone.

The in-process tests build a workdir by hand (files of known bytes) and check what reaches the
bucket; the run.py test trains 2 iterations on the bucket, then resumes to 4 on a deleted local
directory, and compares with the uninterrupted local run of `test_train.py` (`whole_run`).
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

import fake_bucket
import processes

from seeupo_jax.training import metrics_log
from seeupo_jax.training import remote
from seeupo_jax.training import trainer
from test_train import RESUME_ARGS, _strip_times, whole_run  # noqa: F401  (the fixture)

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_RUN = os.path.join(_ROOT, "experiments", "run.py")
_FAKE = os.path.join(_ROOT, "tests", "fake_bucket.py")
REMOTE = "gs://bucket/run"


def _write(path, data: bytes) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "wb") as f:
    f.write(data)


def _checkpoint(local, iteration: int, payload: bytes) -> None:
  """A checkpoint directory as the trainer leaves it: files, then the record of their sizes."""
  directory = os.path.join(local, "checkpoints", str(iteration))
  _write(os.path.join(directory, "train_state", "d", "data"), payload)
  _write(os.path.join(directory, "manifest", "metadata"), b"{}")
  sizes = {"train_state/d/data": len(payload), "manifest/metadata": 2}
  _write(os.path.join(directory, "file_sizes.json"), json.dumps(sizes).encode())


def _tree(root) -> dict[str, bytes]:
  """Every file under `root`: relative path -> bytes."""
  out = {}
  for directory, _, files in os.walk(root):
    for name in files:
      path = os.path.join(directory, name)
      out[os.path.relpath(path, root)] = open(path, "rb").read()
  return out


@pytest.fixture
def bucket(tmp_path):
  """The fake bucket's directory; gs://bucket/run is `<it>/gs/bucket/run`."""
  root = tmp_path / "bucket"
  with fake_bucket.install(root):
    yield root


def test_push_copies_complete_checkpoints_and_changed_files_then_pull_brings_them_back(
  bucket, tmp_path
):
  local = str(tmp_path / "local")
  _checkpoint(local, 2, b"two" * 100)
  _write(os.path.join(local, "checkpoints", "4.orbax-checkpoint-tmp-17", "x"), b"half a save")
  _write(os.path.join(local, "checkpoints", "1.unreadable", "x"), b"set aside")
  _write(os.path.join(local, "metrics.jsonl"), b'{"iteration": 1}\n')
  _write(os.path.join(local, "tensorboard", "events.out"), b"\x00\x01")
  _write(os.path.join(local, "lock"), b'{"pid": 1}\n')
  mirror = remote.Mirror(REMOTE, local)
  mirror.check()

  copied = mirror.push()
  assert copied == ["checkpoints/2/", "metrics.jsonl", "tensorboard/events.out"]
  in_bucket = bucket / "gs" / "bucket" / "run"
  expected = {
    k: v for k, v in _tree(local).items() if k.startswith(("checkpoints/2/", "metrics", "tensor"))
  }
  assert _tree(in_bucket) == expected  # not the lock, the save in progress, the set-aside one
  assert mirror.push() == []  # nothing changed

  _write(os.path.join(local, "metrics.jsonl"), b'{"iteration": 1}\n{"iteration": 2}\n')
  _checkpoint(local, 3, b"three" * 10)
  shutil.rmtree(os.path.join(local, "checkpoints", "2"))  # orbax keeps the newest `keep`
  assert mirror.push() == ["checkpoints/3/", "metrics.jsonl"]
  assert sorted(os.listdir(in_bucket / "checkpoints")) == ["3"]

  fresh = remote.Mirror(REMOTE, str(tmp_path / "fresh"))  # a new machine: nothing local
  assert fresh.pull() == ["checkpoints/3/", "metrics.jsonl", "tensorboard/events.out"]
  assert _tree(fresh.local) == _tree(in_bucket)
  assert fresh.push() == []  # what was pulled is not copied back


def test_pull_takes_only_complete_remote_checkpoints_and_only_when_newer(bucket, tmp_path):
  writer = str(tmp_path / "writer")
  _checkpoint(writer, 4, b"four")
  remote.Mirror(REMOTE, writer).push()
  half = bucket / "gs" / "bucket" / "run" / "checkpoints" / "6"  # a copy cut short: no record
  _write(str(half / "train_state" / "d" / "data"), b"six")

  fresh = str(tmp_path / "fresh")
  assert remote.Mirror(REMOTE, fresh).pull() == ["checkpoints/4/"]
  assert sorted(os.listdir(os.path.join(fresh, "checkpoints"))) == ["4"]

  newer = str(tmp_path / "newer")  # a local directory ahead of the bucket is the truth
  _checkpoint(newer, 5, b"five")
  _write(os.path.join(newer, "metrics.jsonl"), b"local\n")
  assert remote.Mirror(REMOTE, newer).pull() == []
  assert sorted(os.listdir(os.path.join(newer, "checkpoints"))) == ["5"]


def test_a_refused_copy_is_one_line_leaves_the_local_files_and_no_complete_remote_checkpoint(
  tmp_path,
):
  local = str(tmp_path / "local")
  _checkpoint(local, 2, b"two")
  before = _tree(local)
  root = tmp_path / "bucket"
  with fake_bucket.install(root, fail="file_sizes.json"):  # refused: the last object of the set
    with pytest.raises(remote.RemoteWriteFailed) as raised:
      remote.Mirror(REMOTE, local).push()
  message = str(raised.value)
  assert "\n" not in message
  assert f"cannot copy {local}/checkpoints/2/file_sizes.json to {REMOTE}/checkpoints/2/" in message
  assert "503 Service Unavailable" in message and f"{local} keeps every file" in message
  assert _tree(local) == before
  with fake_bucket.install(root):  # the data files arrived, the record did not: never pulled
    assert (root / "gs" / "bucket" / "run" / "checkpoints" / "2" / "train_state").is_dir()
    assert remote.Mirror(REMOTE, str(tmp_path / "fresh")).pull() == []
    # The next push, the bucket back, completes it.
    assert remote.Mirror(REMOTE, local).push() == ["checkpoints/2/"]
    assert remote.Mirror(REMOTE, str(tmp_path / "fresh")).pull() == ["checkpoints/2/"]


def _wait_for(condition, timeout: float = 60.0) -> None:
  deadline = time.monotonic() + timeout
  while not condition():
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.01)


def test_the_uploader_returns_at_once_and_serves_requests_made_during_a_push_with_one_more(
  tmp_path,
):
  """`Uploader.request` returns while the bucket holds the copy up; the three requests made
  meanwhile are served by one more push, and `close` pushes once more: the remote then holds
  every local file, the checkpoints complete."""
  local = str(tmp_path / "local")
  _checkpoint(local, 2, b"two")
  root = tmp_path / "bucket"
  in_bucket = root / "gs" / "bucket" / "run"
  copying, release = threading.Event(), threading.Event()

  def on_write(path):
    copying.set()
    assert release.wait(60)

  with fake_bucket.install(root, on_write=on_write):
    uploader = remote.Uploader(remote.Mirror(REMOTE, local))
    uploader.request(2)
    assert copying.wait(60)  # the push is in its first copy, held there by the bucket
    assert not (in_bucket / "checkpoints" / "2" / "file_sizes.json").exists()
    _checkpoint(local, 4, b"four")  # training goes on: the next save, a log line
    _write(os.path.join(local, "metrics.jsonl"), b'{"iteration": 1}\n')
    for _ in range(3):
      uploader.request(4)
    assert uploader.pushes == 0
    release.set()
    uploader.wait()
    assert uploader.pushes == 2
    uploader.close()
    assert uploader.pushes == 3
    fresh = str(tmp_path / "fresh")
    assert remote.Mirror(REMOTE, fresh).pull() == [
      "checkpoints/2/",
      "checkpoints/4/",
      "metrics.jsonl",
    ]
  assert _tree(fresh) == _tree(local)


def test_a_failed_background_push_is_raised_by_the_next_request_and_by_close(tmp_path):
  local = str(tmp_path / "local")
  _checkpoint(local, 2, b"two")
  with fake_bucket.install(tmp_path / "bucket", fail="file_sizes.json"):
    uploader = remote.Uploader(remote.Mirror(REMOTE, local))
    uploader.request(2)  # returns: the push fails in the background
    _wait_for(lambda: uploader.pushes == 1)
    with pytest.raises(remote.RemoteWriteFailed) as raised:
      uploader.request(3)
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"cannot copy {local}/checkpoints/2/")
    assert uploader.pushes == 1  # the failed request asked for no push
    with pytest.raises(remote.RemoteWriteFailed, match="503 Service Unavailable"):
      uploader.close()  # its last push fails the same way
    assert uploader.pushes == 2


def test_a_checkpoint_dropped_while_it_is_copied_is_left_incomplete_then_deleted(tmp_path):
  """Orbax deletes a checkpoint beyond `checkpoint.keep` while the background push copies it:
  the push goes on without error, the remote copy has no record (never pulled), and the next
  push deletes it."""
  local = str(tmp_path / "local")
  _checkpoint(local, 2, b"two")
  root = tmp_path / "bucket"

  def on_write(path):  # the first object of checkpoint 2: orbax drops the checkpoint now
    if path.endswith("/checkpoints/2/manifest/metadata"):
      shutil.rmtree(os.path.join(local, "checkpoints", "2"))

  mirror = remote.Mirror(REMOTE, local)
  with fake_bucket.install(root, on_write=on_write):
    assert mirror.push() == []
  in_bucket = root / "gs" / "bucket" / "run" / "checkpoints"
  assert (in_bucket / "2" / "manifest" / "metadata").exists()
  assert not (in_bucket / "2" / "file_sizes.json").exists()
  _checkpoint(local, 4, b"four")
  with fake_bucket.install(root):
    assert mirror.push() == ["checkpoints/4/"]
    assert sorted(os.listdir(in_bucket)) == ["4"]
    assert remote.Mirror(REMOTE, str(tmp_path / "fresh")).pull() == ["checkpoints/4/"]


def test_a_run_that_stops_waits_for_its_last_copy_only_when_stopped_by_a_signal(tmp_path):
  """On a stop by SIGTERM/SIGINT the trainer makes the last copy and reports it failing; on a
  failure it only lets the copy in flight finish, a failing copy a warning beside it."""
  local = str(tmp_path / "local")
  _checkpoint(local, 2, b"two")
  root = tmp_path / "bucket"
  in_bucket = root / "gs" / "bucket" / "run"
  preempted = trainer.Preempted(2, "SIGTERM", os.path.join(local, "checkpoints"))
  with fake_bucket.install(root):
    trainer._close_uploader_after(preempted, remote.Uploader(remote.Mirror(REMOTE, local)))
  assert (in_bucket / "checkpoints" / "2" / "file_sizes.json").exists()
  _checkpoint(local, 4, b"four")
  with fake_bucket.install(root, fail="file_sizes.json"):
    with pytest.raises(remote.RemoteWriteFailed):
      trainer._close_uploader_after(preempted, remote.Uploader(remote.Mirror(REMOTE, local)))
    uploader = remote.Uploader(remote.Mirror(REMOTE, local))
    trainer._close_uploader_after(RuntimeError("a bug"), uploader)  # no push, nothing raised
    assert uploader.pushes == 0
    uploader = remote.Uploader(remote.Mirror(REMOTE, local))
    uploader.request(4)
    trainer._close_uploader_after(RuntimeError("a bug"), uploader)  # its push fails: a warning
    assert uploader.pushes == 1
  assert not (in_bucket / "checkpoints" / "4" / "file_sizes.json").exists()


def test_the_lock_object_refuses_another_host_and_takes_a_dead_pid_of_this_one(bucket, tmp_path):
  mirror = remote.Mirror(REMOTE, str(tmp_path / "local"))
  path = bucket / "gs" / "bucket" / "run" / "lock"
  with mirror.lock():
    holder = json.loads(path.read_text())
    assert holder["host"] == socket.gethostname() and holder["pid"] == os.getpid()
    assert holder["local_dir"] == str(tmp_path / "local")
    with pytest.raises(remote.RemoteLocked, match=f"pid {os.getpid()} on host"):
      mirror.lock().acquire()  # a live pid of this host
  assert not path.exists()  # released

  other = {"host": "elsewhere", "pid": 12, "started": "2026-12-01T00:00:00+00:00"}
  path.write_text(json.dumps(other))
  with pytest.raises(remote.RemoteLocked) as raised:
    mirror.lock().acquire()
  assert "pid 12 on host elsewhere (started 2026-12-01T00:00:00+00:00)" in str(raised.value)
  assert "--take_remote_lock" in str(raised.value)
  assert json.loads(path.read_text()) == other  # untouched
  with mirror.lock(take=True):
    assert json.loads(path.read_text())["host"] == socket.gethostname()

  dead = subprocess.run(
    [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
  )
  path.write_text(json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout)}))
  with mirror.lock():  # stale: taken
    assert json.loads(path.read_text())["pid"] == os.getpid()


def test_remote_paths_and_their_local_directories(tmp_path):
  assert remote.is_remote("gs://b/run") and remote.is_remote("s3://b/run")
  assert not remote.is_remote("runs/x") and not remote.is_remote("/abs/x")
  a, b = remote.local_dir_for("gs://b/run"), remote.local_dir_for("gs://b/run/")
  assert a == b and os.path.basename(a).startswith("run-")
  assert remote.local_dir_for("gs://c/run") != a
  assert remote.local_dir_for("gs://b/run", "/given") == "/given"
  with pytest.raises(remote.RemoteError, match=r"ftp:// is not supported; allowed: .*gs://"):
    remote.Mirror("ftp://host/run", str(tmp_path))


def _run(bucket, *args, fail=None, **env):
  return subprocess.run(
    [sys.executable, _FAKE, str(bucket), *([fail] if fail else []), _RUN, *args],
    capture_output=True,
    text=True,
    env=processes.env(**env),
    cwd=_ROOT,
    timeout=600,
  )


def test_run_py_refuses_a_bucket_locked_from_another_host_in_one_line(tmp_path):
  bucket, local = tmp_path / "bucket", tmp_path / "local"
  lock = bucket / "gs" / "bucket" / "run" / "lock"
  lock.parent.mkdir(parents=True)
  lock.write_text('{"host": "elsewhere", "pid": 7, "started": "2026-12-01T10:00:00+00:00"}')
  before = lock.read_text()
  proc = _run(bucket, f"--workdir={REMOTE}", f"--local_dir={local}", "--config.num_iterations=1")
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines() == [
    f"error: --config=synthetic: the remote workdir {REMOTE} is locked by pid 7 on host "
    f"elsewhere (started 2026-12-01T10:00:00+00:00): {REMOTE}/lock is there (an object store "
    "has no flock: a run on another host cannot be seen to be alive); if that run is gone, "
    "rerun with --take_remote_lock"
  ]
  assert lock.read_text() == before and not local.exists()  # nothing changed or left behind


@pytest.mark.slow
def test_a_run_on_a_bucket_resumes_from_the_bucket_alone_as_never_stopped(
  whole_run,  # noqa: F811
  tmp_path,
):
  """run.py with --workdir=gs://... for 2 iterations copies its checkpoints, logs and lock-free
  workdir to the bucket; with the local directory deleted (a fresh machine), the rerun pulls
  checkpoint 2 from the bucket, resumes there, and ends at iteration 4 with the uninterrupted
  local run's parameters, metrics and trajectories, every file copied back. (A refused copy:
  `test_a_refused_copy_is_one_line_leaves_the_local_files_and_no_complete_remote_checkpoint`.)"""
  whole, cache = whole_run
  bucket, local = tmp_path / "bucket", tmp_path / "local"
  in_bucket = bucket / "gs" / "bucket" / "run"
  args = (f"--workdir={REMOTE}", f"--local_dir={local}", *RESUME_ARGS)

  proc = _run(bucket, *args, "--config.num_iterations=2", **cache)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert sorted(os.listdir(in_bucket / "checkpoints")) == ["2"]
  assert not (in_bucket / "lock").exists()
  for name in ("metrics.jsonl", "trajectories.jsonl"):
    assert (in_bucket / name).read_bytes() == (local / name).read_bytes(), name

  shutil.rmtree(local)  # a fresh machine
  proc = _run(bucket, *args, **cache)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "pulled checkpoints/2/" in proc.stdout + proc.stderr
  assert f"resuming {local} from iteration 2" in proc.stdout + proc.stderr
  assert sorted(os.listdir(in_bucket / "checkpoints")) == ["2", "4"]
  for name in ("metrics.jsonl", "trajectories.jsonl", "hf_policy/model.safetensors"):
    assert (in_bucket / name).read_bytes() == (local / name).read_bytes(), name
  assert os.listdir(in_bucket / "tensorboard")
  ours = (local / "hf_policy" / "model.safetensors").read_bytes()
  assert ours == (whole / "hf_policy" / "model.safetensors").read_bytes()
  log = metrics_log.read_metrics(str(local / "metrics.jsonl"))
  whole_log = metrics_log.read_metrics(str(whole / "metrics.jsonl"))
  assert [r["iteration"] for r in log] == [1, 2, 3, 4]
  # Iteration 2 ended the first, 2-iteration run, which evaluated it (the whole run did not).
  assert "eval/avg@2" in log[1] and "eval/avg@2" not in whole_log[1]
  log[1] = {k: v for k, v in log[1].items() if not k.startswith("eval/")}
  assert _strip_times(log) == _strip_times(whole_log)
  assert _texts(local / "trajectories.jsonl") == _texts(whole / "trajectories.jsonl")


def _texts(path) -> list[str]:
  return [json.loads(line)["text"] for line in path.read_text().splitlines()]
