"""A remote workdir (`gs://`, `s3://`): a local directory that the run writes, mirrored to it.

    if remote.is_remote(workdir):
      mirror = remote.Mirror(workdir, remote.local_dir_for(workdir))
      mirror.check()                    # RemoteError: no backend for the scheme, or unreachable
      with mirror.lock():               # RemoteLocked: a lock object of another run is there
        mirror.pull()                   # the remote's newer checkpoints and logs, into local
        uploader = remote.Uploader(mirror)  # pushes in a background thread
        ...                             # train in mirror.local, exactly as in a local workdir
        uploader.request()              # after each completed checkpoint (returns at once)
        uploader.close()                # the last push, waited for

The contract:

- **Everything is written locally first.** The run's workdir is `mirror.local` (`--local_dir`,
  by default `<temp dir>/seeupo_jax/<name>-<hash of the remote path>`): orbax's checkpoints, the
  lock, metrics.jsonl, TensorBoard, trajectories.jsonl, the figures, hf_policy/, error.log.
  Nothing the run writes depends on the remote being up.
- **The mirror is one-way and copies complete file sets** (`push`), through `etils.epath` (gcsfs
  or s3fs through fsspec, or TensorFlow's tf.io.gfile, whichever etils finds): each checkpoint
  once orbax has finalised it and its `file_sizes.json` is written, that record last, so a
  remote checkpoint without the record is one whose copy was cut short and is never pulled;
  every other file that changed since the last push (each an object written whole). Remote
  checkpoints that orbax no longer keeps locally (`checkpoint.keep`) are deleted, record first.
  Not copied: the local lock, orbax's temporary directories of saves in progress, checkpoints
  set aside as unreadable.
- **A push that fails raises `RemoteWriteFailed`**, one line naming the file, the remote path and
  the error. The local directory is left as it was: the checkpoint is there, and the next run on
  it resumes from it and copies what the remote lacks.
- **In the background** (`Uploader`): a run's pushes run in a thread of their own while training
  goes on; the files being written meanwhile (metrics.jsonl grows) are copied as they are when
  read, and again at the next push when they changed; a checkpoint that `checkpoint.keep` drops
  while it is being copied is left without its record (never pulled) and deleted remotely by
  the next push. A failed push is raised at the next save or at the end.
- **`pull` on start**: when the remote holds a newer complete checkpoint than the local
  directory (a fresh machine: none locally), every complete remote checkpoint missing locally
  and every other remote file that is missing or has another size locally is copied in, so the
  run resumes from the newest. When the local directory is as new or newer, nothing is pulled:
  the local directory is the truth and the remote its copy.
- **The lock.** An object store has no flock. The local directory is locked as a local workdir
  is (`workdir.lock`); the remote gets a lock object, `<remote>/lock`, holding the run's host,
  pid, start and local directory, written after checking that there is none and read back
  (`RemoteLock`). A lock object of this host whose pid is dead is stale and taken with a
  warning; any other is refused (a run on another host cannot be seen to be alive or dead)
  unless `take=True` (`--take_remote_lock`). The check and the write are two requests, not one
  atomic operation: two runs that start on different hosts within the same moment can both take
  it. A run that is killed (kill -9, a machine that disappears) leaves its lock object behind;
  one stopped by SIGTERM or SIGINT removes it.
- **Many processes**: process 0 alone locks, pulls and pushes; the local directory must be one
  that every process sees (a shared file system), since every process writes its shards of each
  checkpoint there: the default under the temp dir is per host, so a run of several processes
  names it (`--local_dir`).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import threading
from typing import Iterator, Optional, Sequence

from absl import logging
from etils import epath

from seeupo_jax.training import workdir as workdir_lib

LOCK_OBJECT = "lock"
CHECKPOINTS = "checkpoints"
FILE_SIZES = "file_sizes.json"  # checkpoints.FILE_SIZES: a checkpoint's completion record
_SCHEME = re.compile(r"^([a-z][a-z0-9+.-]*)://")
SCHEMES = ("gs", "s3", "az")  # those etils.epath reaches (through fsspec or tf.io.gfile)
_CHUNK = 8 << 20
_PULLING = ".pulling"  # a file being pulled, renamed into place when complete


class RemoteError(workdir_lib.WorkdirError):
  """The remote workdir cannot be used (no backend for its scheme, unreachable, locked)."""


class RemoteLocked(RemoteError):
  """A lock object of another run is in the remote workdir."""


class RemoteWriteFailed(RemoteError):
  """A copy to the remote failed; the local directory holds every file."""


def is_remote(path: str) -> bool:
  """Whether `path` is a URL (`gs://bucket/run`, `s3://...`) rather than a local path."""
  return bool(_SCHEME.match(str(path))) and not str(path).startswith("file://")


def local_dir_for(remote: str, local_dir: Optional[str] = None) -> str:
  """The local directory of the remote workdir `remote`: `local_dir` if given, else
  `<temp dir>/seeupo_jax/<last part of the path>-<12 hex digits of its sha256>` (the same
  directory for the same remote path, so a rerun on the same machine finds its files)."""
  if local_dir:
    return local_dir
  name = re.sub(r"[^A-Za-z0-9._-]", "_", remote.rstrip("/").rsplit("/", 1)[-1]) or "run"
  digest = hashlib.sha256(remote.rstrip("/").encode()).hexdigest()[:12]
  return os.path.join(tempfile.gettempdir(), "seeupo_jax", f"{name}-{digest}")


def _one_line(error: BaseException) -> str:
  text = " ".join(str(error).split())
  return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _is_iteration(name: str) -> bool:
  return name.isdigit()


def _local_files(root: str, workdir: bool = True) -> Iterator[str]:
  """Paths relative to `root` of its files, but files being pulled; of a workdir (`workdir`),
  not the lock, the checkpoints (`Mirror` copies those as whole directories) or hidden files
  (temporary files being written)."""
  for directory, dirs, files in os.walk(root):
    relative = os.path.relpath(directory, root)
    if relative == "." and workdir:
      dirs[:] = [d for d in dirs if d != CHECKPOINTS]
      files = [f for f in files if f != workdir_lib.LOCK_FILE]
    dirs.sort()
    for name in sorted(files):
      if not name.endswith(_PULLING) and not (workdir and name.startswith(".")):
        yield os.path.normpath(os.path.join(relative, name))


def _remote_files(root: epath.Path, prefix: str = "") -> Iterator[str]:
  """Paths relative to `root` of every object under it (recursively)."""
  if not root.exists():
    return
  for child in sorted(root.iterdir(), key=lambda p: p.name):
    relative = f"{prefix}{child.name}"
    if child.is_dir():
      yield from _remote_files(child, relative + "/")
    else:
      yield relative


class Mirror:
  """The one-way mirror of the local directory `local` to the remote workdir `remote` (the
  module docstring says what it copies and when)."""

  def __init__(self, remote: str, local: str):
    """Raises RemoteError for a scheme not in `SCHEMES`."""
    self.remote = str(remote).rstrip("/")
    self.local = local
    scheme = _SCHEME.match(self.remote).group(1)
    if scheme not in SCHEMES:
      raise RemoteError(
        f"--workdir={self.remote}: the scheme {scheme}:// is not supported; allowed: a local "
        f"path or {', '.join(s + '://' for s in SCHEMES)}"
      )
    self._root = epath.Path(self.remote)
    self._pushed: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns) copied
    self._pushed_checkpoints: dict[int, bytes] = {}  # iteration -> its file_sizes.json copied

  # -- reading and writing one object ----------------------------------------------------------

  def _copy_to_remote(self, relative: str) -> None:
    source = os.path.join(self.local, relative)
    target = self._root / relative
    try:
      target.parent.mkdir(parents=True, exist_ok=True)
      with open(source, "rb") as f, target.open("wb") as g:
        shutil.copyfileobj(f, g, _CHUNK)
    except Exception as e:  # pylint: disable=broad-exception-caught  (each backend its own)
      raise RemoteWriteFailed(
        f"cannot copy {source} to {target}: {_one_line(e)}; the local directory {self.local} "
        "keeps every file: rerun the same command to resume from it and copy again"
      ) from e

  def _copy_to_local(self, relative: str) -> None:
    target = os.path.join(self.local, relative)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    partial = target + _PULLING
    try:
      with (self._root / relative).open("rb") as f, open(partial, "wb") as g:
        shutil.copyfileobj(f, g, _CHUNK)
    except OSError as e:
      raise RemoteError(f"cannot copy {self._root / relative} to {target}: {_one_line(e)}") from e
    os.replace(partial, target)

  def check(self) -> None:
    """Reaches the remote once (whether it exists).

    Raises:
      RemoteError: no backend for the scheme (e.g. gcsfs not installed), or the remote cannot be
        reached.
    """
    try:
      self._root.exists()
    except Exception as e:  # pylint: disable=broad-exception-caught
      hint = ""
      if isinstance(e, (ImportError, NotImplementedError)):
        hint = " (gs:// needs gcsfs, s3:// s3fs, through etils.epath: pip install gcsfs)"
      raise RemoteError(f"cannot reach the workdir {self.remote}: {_one_line(e)}{hint}") from e

  # -- checkpoints -----------------------------------------------------------------------------

  def _local_iterations(self) -> list[int]:
    directory = os.path.join(self.local, CHECKPOINTS)
    if not os.path.isdir(directory):
      return []
    return sorted(
      int(n)
      for n in os.listdir(directory)
      if _is_iteration(n) and os.path.isfile(os.path.join(directory, n, FILE_SIZES))
    )

  def _remote_iterations(self) -> list[int]:
    """The remote's complete checkpoints (those with their `file_sizes.json`)."""
    directory = self._root / CHECKPOINTS
    if not directory.exists():
      return []
    return sorted(
      int(p.name)
      for p in directory.iterdir()
      if _is_iteration(p.name) and (p / FILE_SIZES).exists()
    )

  def _push_checkpoint(self, iteration: int) -> bool:
    """Copies checkpoint `iteration` (its record last) unless the remote has it; True if copied."""
    relative = f"{CHECKPOINTS}/{iteration}"
    record = os.path.join(self.local, relative, FILE_SIZES)
    with open(record, "rb") as f:
      sizes = f.read()
    if self._pushed_checkpoints.get(iteration) == sizes:
      return False
    remote_record = self._root / relative / FILE_SIZES
    try:
      if remote_record.exists() and remote_record.read_bytes() == sizes:
        self._pushed_checkpoints[iteration] = sizes
        return False
      if remote_record.exists():  # another checkpoint of that iteration: uncommit it first
        remote_record.unlink()
    except Exception as e:  # pylint: disable=broad-exception-caught
      raise RemoteWriteFailed(
        f"cannot read {remote_record}: {_one_line(e)}; the local directory {self.local} keeps "
        "every file: rerun the same command to resume from it and copy again"
      ) from e
    files = [
      f"{relative}/{f}"
      for f in _local_files(os.path.join(self.local, relative), workdir=False)
      if f != FILE_SIZES
    ]
    try:
      for f in files:
        self._copy_to_remote(f)
      self._copy_to_remote(f"{relative}/{FILE_SIZES}")  # the record last: the copy is complete
    except RemoteWriteFailed:
      if not os.path.isdir(os.path.join(self.local, relative)):
        # Orbax dropped it (`checkpoint.keep`) while it was being copied from a background
        # thread (`Uploader`): a copy without its record, deleted by the next push.
        return False
      raise
    self._pushed_checkpoints[iteration] = sizes
    return True

  def _drop_remote_checkpoints(self, keep: Sequence[int]) -> None:
    """Deletes the remote checkpoints not in `keep` (those orbax deleted locally), record first."""
    directory = self._root / CHECKPOINTS
    if not directory.exists():
      return
    for path in directory.iterdir():
      if not _is_iteration(path.name) or int(path.name) in keep:
        continue
      try:
        (path / FILE_SIZES).unlink(missing_ok=True)
        path.rmtree()
      except Exception as e:  # pylint: disable=broad-exception-caught
        logging.warning("could not delete the old remote checkpoint %s: %s", path, _one_line(e))

  # -- the mirror ------------------------------------------------------------------------------

  def push(self, names: Optional[Sequence[str]] = None) -> list[str]:
    """Copies what changed locally since the last push to the remote: the complete checkpoints
    it lacks (each its record last), then every other file that changed; deletes the remote
    checkpoints that are gone locally. With `names`, copies only those files (relative paths).

    Returns:
      The relative paths of the files copied (a checkpoint as `checkpoints/<iteration>/`).

    Raises:
      RemoteWriteFailed: a copy failed (the local directory is unchanged).
    """
    copied = []
    if names is None:
      iterations = self._local_iterations()
      for iteration in iterations:
        try:
          if self._push_checkpoint(iteration):
            copied.append(f"{CHECKPOINTS}/{iteration}/")
        except FileNotFoundError:  # its record: dropped by orbax since it was listed
          continue
      candidates = list(_local_files(self.local))
    else:
      iterations, candidates = None, list(names)
    for relative in candidates:
      path = os.path.join(self.local, relative)
      try:
        st = os.stat(path)
      except FileNotFoundError:  # deleted meanwhile (a figure being rewritten)
        continue
      stamp = (st.st_size, st.st_mtime_ns)
      if self._pushed.get(relative) == stamp:
        continue
      try:
        self._copy_to_remote(relative)
      except RemoteWriteFailed:
        if not os.path.exists(path):  # deleted meanwhile
          continue
        raise
      self._pushed[relative] = stamp
      copied.append(relative)
    if iterations is not None:
      self._drop_remote_checkpoints(iterations)
    return copied

  def pull(self) -> list[str]:
    """Copies the remote's files into the local directory when the remote holds a newer
    complete checkpoint than the local directory (see the module docstring); else nothing.

    Returns:
      The relative paths pulled (a checkpoint as `checkpoints/<iteration>/`).

    Raises:
      RemoteError: a read failed.
    """
    try:
      remote_iterations = self._remote_iterations()
      local_iterations = self._local_iterations()
      if not remote_iterations or (
        local_iterations and local_iterations[-1] >= remote_iterations[-1]
      ):
        return []
      pulled = []
      for iteration in remote_iterations:
        if iteration in local_iterations:
          continue
        relative = f"{CHECKPOINTS}/{iteration}"
        files = list(_remote_files(self._root / relative, relative + "/"))
        target = os.path.join(self.local, relative)
        shutil.rmtree(target, ignore_errors=True)  # an incomplete local copy
        for f in sorted(files, key=lambda f: f.endswith("/" + FILE_SIZES)):  # the record last
          self._copy_to_local(f)
        with open(os.path.join(target, FILE_SIZES), "rb") as f:
          self._pushed_checkpoints[iteration] = f.read()
        pulled.append(relative + "/")
      for relative in _remote_files(self._root):
        if relative == LOCK_OBJECT or relative.startswith(CHECKPOINTS + "/"):
          continue
        path = os.path.join(self.local, relative)
        if os.path.isfile(path) and os.path.getsize(path) == (self._root / relative).stat().length:
          continue
        self._copy_to_local(relative)
        pulled.append(relative)
    except RemoteError:
      raise
    except Exception as e:  # pylint: disable=broad-exception-caught
      raise RemoteError(f"cannot read the workdir {self.remote}: {_one_line(e)}") from e
    for relative in _local_files(self.local):  # pulled files are not pushed back unchanged
      st = os.stat(os.path.join(self.local, relative))
      if relative in pulled:
        self._pushed[relative] = (st.st_size, st.st_mtime_ns)
    return pulled

  def lock(self, take: bool = False) -> "RemoteLock":
    """`with mirror.lock():` holds the remote's lock object for the block (`RemoteLock`)."""
    return RemoteLock(self._root / LOCK_OBJECT, self.local, take=take)


class Uploader:
  """Runs a mirror's pushes in a background thread, so that a save does not wait for the bucket.

        uploader = remote.Uploader(mirror)
        checkpointer = Checkpointer(..., on_saved=uploader.request)   # returns at once
        ...
        uploader.close()              # the last push, waited for: the remote is complete

  `request` asks for a push (`Mirror.push`: what changed since the last one) and returns at once;
  requests made while a push runs are served by one more push after it, so a slow bucket copies
  the newest files and never queues a backlog. A push that fails is remembered and raised by the
  next `request`, `wait` or `close` (`RemoteWriteFailed`, one line naming the file): a run learns
  of it at its next save, with its local directory holding every file. The thread is a daemon: a
  process that dies without `close` abandons the push in flight, which leaves at most a remote
  checkpoint without its `file_sizes.json` record (never pulled) and an object of an older size.
  """

  def __init__(self, mirror: Mirror):
    self.mirror = mirror
    self.pushes = 0  # pushes completed (tests and benchmarks read it)
    self._cond = threading.Condition()
    self._requested = False
    self._busy = False
    self._closed = False
    self._error: Optional[RemoteError] = None
    self._thread = threading.Thread(target=self._loop, name="remote-push", daemon=True)
    self._thread.start()

  def _loop(self) -> None:
    while True:
      with self._cond:
        while not (self._requested or self._closed):
          self._cond.wait()
        if not self._requested:
          return
        self._requested, self._busy = False, True
      error = None
      try:
        self.mirror.push()
      except RemoteError as e:
        error = e
      except Exception as e:  # pylint: disable=broad-exception-caught  (a bug: still one line)
        error = RemoteWriteFailed(f"copying {self.mirror.local} to {self.mirror.remote}: {e!r}")
        error.__cause__ = e
      with self._cond:
        self._busy = False
        self.pushes += 1
        if error is not None and self._error is None:
          self._error = error
        self._cond.notify_all()

  def _raise_error(self) -> None:
    """Raises (once) the error of a failed push; call with the condition held."""
    error, self._error = self._error, None
    if error is not None:
      raise error

  def request(self, iteration: Optional[int] = None) -> None:  # pylint: disable=unused-argument
    """Asks for a push (`iteration`: the checkpoint just saved, for `Checkpointer.on_saved`).

    Raises:
      RemoteWriteFailed: an earlier push failed (no push is requested then).
      RuntimeError: the uploader is closed.
    """
    with self._cond:
      if self._closed:
        raise RuntimeError("Uploader.request after close")
      self._raise_error()
      self._requested = True
      self._cond.notify_all()

  def wait(self) -> None:
    """Returns when no push is requested or running; raises what a failed push raised."""
    with self._cond:
      while self._requested or self._busy:
        self._cond.wait()
      self._raise_error()

  def close(self, push: bool = True) -> None:
    """Pushes once more (unless `push` is False or a push failed), waits for it, and stops the
    thread.

    Raises:
      RemoteWriteFailed: a push failed (the last one, or an earlier one not yet raised).
    """
    with self._cond:
      if self._closed:
        return
      if push and self._error is None:
        self._requested = True
      self._closed = True
      self._cond.notify_all()
    self._thread.join()
    with self._cond:
      self._raise_error()


class RemoteLock:
  """The lock object `<remote>/lock` (the module docstring says what it guarantees)."""

  def __init__(self, path: epath.Path, local: str, *, take: bool = False):
    self.path = path
    self.take = take
    self.holder = {
      "host": socket.gethostname(),
      "pid": os.getpid(),
      "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
      "local_dir": os.path.abspath(local),
    }
    self._held = False

  def _read(self) -> Optional[dict]:
    if not self.path.exists():
      return None
    try:
      holder = json.loads(self.path.read_text())
    except ValueError:
      return {}
    return holder if isinstance(holder, dict) else {}

  def acquire(self) -> "RemoteLock":
    """Writes the lock object, unless another run's is there.

    Raises:
      RemoteLocked: another run's lock object is there (and `take` is False).
      RemoteError: the lock object cannot be read or written.
    """
    try:
      holder = self._read()
      if holder is not None:
        self._check(holder)
      self.path.parent.mkdir(parents=True, exist_ok=True)
      mine = json.dumps(self.holder) + "\n"
      self.path.write_text(mine)
      if self.path.read_text() != mine:  # another run wrote it between our read and write
        raise RemoteLocked(
          f"the remote workdir {self.path.parent} was locked by another run while this one "
          f"started ({self.path}: {self.path.read_text().strip()}); wait for it to end"
        )
    except RemoteError:
      raise
    except Exception as e:  # pylint: disable=broad-exception-caught
      raise RemoteError(f"cannot write the lock object {self.path}: {_one_line(e)}") from e
    self._held = True
    return self

  def _check(self, holder: dict) -> None:
    """Raises RemoteLocked unless `holder`'s lock may be taken (warning when it is)."""
    here = holder.get("host") == self.holder["host"]
    dead = here and not workdir_lib._pid_alive(holder.get("pid"))  # pylint: disable=protected-access
    described = workdir_lib._describe(holder)  # pylint: disable=protected-access
    if dead:
      logging.warning(
        "taking the stale lock %s of %s: that process is not running", self.path, described
      )
    elif self.take:
      logging.warning("taking the lock %s of %s (--take_remote_lock)", self.path, described)
    else:
      where = f", local directory {holder['local_dir']}" if holder.get("local_dir") else ""
      raise RemoteLocked(
        f"the remote workdir {self.path.parent} is locked by {described}{where}: {self.path} "
        "is there (an object store has no flock: a run on another host cannot be seen to be "
        "alive); if that run is gone, rerun with --take_remote_lock"
      )

  def release(self) -> None:
    """Deletes the lock object if it is still this run's."""
    if not self._held:
      return
    self._held = False
    try:
      if self._read() == self.holder:
        self.path.unlink()
    except Exception as e:  # pylint: disable=broad-exception-caught
      logging.warning("could not remove the lock object %s: %s", self.path, _one_line(e))

  def __enter__(self) -> "RemoteLock":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()
