"""A training run's workdir: checked before use and locked for the run's life.

    workdir.prepare(path)              # WorkdirError: a file, or cannot be created or written
    with workdir.lock(path):           # WorkdirLocked: another live run holds it
      ...                              # train; the lock goes when the block ends

    with workdir.prepared(path):       # prepare(path); if the block raises, the directories
      ...                              # prepare made are removed again while still empty

The lock is `<workdir>/lock`, created with `O_EXCL` and holding one JSON line
`{"host", "pid", "started"}`, with an exclusive `fcntl.flock` on it held until the run ends.
The kernel drops the flock when the process dies, even by kill -9, so a lock file left behind
is recognised as stale: nobody holds its flock, or (a filesystem without flock) its pid is not
alive on this host. A stale lock is reported with a warning and taken; a live one is refused,
naming its pid, host and start time. Taking a stale lock holds the old file's flock while it
unlinks the file, and every taker checks that the path still names the file it locked, so two
runs racing for one stale lock cannot both win.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
from typing import Any, Iterator, Optional

from absl import logging

LOCK_FILE = "lock"
_ATTEMPTS = 5  # create-or-take rounds before giving up (each lost only to a racing run)


class WorkdirError(Exception):
  """The workdir cannot be used (a file, not writable, locked, unreadable checkpoints)."""


class WorkdirLocked(WorkdirError):
  """Another run holds the workdir's lock."""


def prepare(workdir: str) -> None:
  """Creates `workdir` if needed; raises WorkdirError if it is a file or cannot be written."""
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise WorkdirError(f"the workdir {workdir} is a file, not a directory; pick another --workdir")
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:  # a parent that is a file, no permission, a read-only filesystem
    raise WorkdirError(f"cannot create the workdir {workdir}: {e.strerror or e}") from e
  if not os.access(workdir, os.W_OK | os.X_OK):
    raise WorkdirError(f"the workdir {workdir} is not writable")


@contextlib.contextmanager
def prepared(workdir: str) -> Iterator[None]:
  """`prepare(workdir)` for the block. If the block raises (a run refused at start-up: a bad
  config, an environment that cannot run here, a locked workdir), the directories `prepare`
  created (the workdir and any parents it made) are removed again where still empty, so a run
  that did not start leaves nothing behind; a workdir that existed before is kept as it is."""
  created = []
  path = os.path.abspath(workdir)
  while not os.path.exists(path):
    created.append(path)
    path = os.path.dirname(path)
  prepare(workdir)
  try:
    yield
  except BaseException:
    for directory in created:  # the workdir first, then its new parents
      try:
        os.rmdir(directory)  # only an empty directory
      except OSError:
        break
    raise


def _host() -> str:
  return socket.gethostname()


def _pid_alive(pid: Any) -> bool:
  """Whether process `pid` exists on this host (an unreadable pid counts as not alive)."""
  if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # someone else's process
    return True
  return True


def _try_flock(fd: int) -> Optional[bool]:
  """Takes an exclusive flock without waiting: True if taken, False if another open file holds
  it, None if the filesystem has no flock."""
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    return False
  except OSError as e:
    if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
      return False
    return None  # ENOLCK, EOPNOTSUPP, ...
  return True


def _same_file(fd: int, path: str) -> bool:
  """Whether `path` still names the file open as `fd` (not unlinked or replaced since)."""
  try:
    st = os.stat(path)
  except FileNotFoundError:
    return False
  mine = os.fstat(fd)
  return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _read_holder(fd: int) -> dict[str, Any]:
  """The lock file's {"host", "pid", "started"}; {} if it is empty or not JSON (being written)."""
  os.lseek(fd, 0, os.SEEK_SET)
  data = os.read(fd, 4096)
  try:
    holder = json.loads(data.decode("utf-8", errors="replace"))
  except ValueError:
    return {}
  return holder if isinstance(holder, dict) else {}


def _describe(holder: dict[str, Any]) -> str:
  if not holder:
    return "a run that is starting (its lock file is still empty)"
  return (
    f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} "
    f"(started {holder.get('started', '?')})"
  )


class WorkdirLock:
  """The exclusive lock of one workdir (see the module docstring): `acquire` then `release`, or
  `with WorkdirLock(workdir):`."""

  def __init__(self, workdir: str):
    self.workdir = workdir
    self.path = os.path.join(workdir, LOCK_FILE)
    self._fd: Optional[int] = None

  def acquire(self) -> "WorkdirLock":
    """Takes the lock, or a stale one (with a warning).

    Raises:
      WorkdirLocked: a live run holds the lock (the message names its pid, host and start).
    """
    for _ in range(_ATTEMPTS):
      try:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
      except FileExistsError:
        self._take_if_stale()
        continue
      # Between O_EXCL and the flock another run may find the empty file, take it for stale and
      # unlink it: locked, and still the file at the path, means it is ours.
      if _try_flock(fd) is False or not _same_file(fd, self.path):
        os.close(fd)
        continue
      holder = {
        "host": _host(),
        "pid": os.getpid(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
      }
      os.write(fd, (json.dumps(holder) + "\n").encode())
      os.fsync(fd)
      self._fd = fd
      return self
    raise WorkdirLocked(f"could not take {self.path}: other runs keep taking it; try again")

  def _take_if_stale(self) -> None:
    """Unlinks the existing lock file if it is stale; raises WorkdirLocked if it is live."""
    try:
      fd = os.open(self.path, os.O_RDWR)
    except FileNotFoundError:  # released meanwhile
      return
    try:
      holder = _read_holder(fd)
      locked = _try_flock(fd)
      here = holder.get("host") == _host()
      if locked is False and not (here and not _pid_alive(holder.get("pid"))):
        raise WorkdirLocked(
          f"the workdir {self.workdir} is in use by {_describe(holder)}: its lock {self.path} "
          "is held; wait for that run to end or pick another --workdir"
        )
      if locked is None and (not here or _pid_alive(holder.get("pid"))):
        raise WorkdirLocked(
          f"the workdir {self.workdir} is in use by {_describe(holder)} ({self.path}; this "
          "filesystem has no flock, so only a dead pid on this host frees it); wait for that run "
          "to end, or delete the lock file if it is gone"
        )
      if not _same_file(fd, self.path):  # another run took it first
        return
      if not holder:
        why = "an empty lock file that nobody holds"
      elif not here:
        why = "nobody holds it"
      elif _pid_alive(holder.get("pid")):
        why = "nobody holds it (the pid now belongs to another process)"
      else:
        why = "that process is not running"
      logging.warning(
        "taking the stale lock %s of %s: %s", self.path, _describe(holder) if holder else "?", why
      )
      os.unlink(self.path)  # under the old file's flock: a racing taker re-checks the path
    finally:
      os.close(fd)

  def release(self) -> None:
    """Removes the lock file (if it is still ours) and drops the flock."""
    if self._fd is None:
      return
    try:
      if _same_file(self._fd, self.path):
        os.unlink(self.path)
    except OSError as e:
      logging.warning("could not remove the lock %s: %s", self.path, e)
    finally:
      os.close(self._fd)
      self._fd = None

  def __enter__(self) -> "WorkdirLock":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


def lock(workdir: str) -> WorkdirLock:
  """`with lock(workdir):` holds `workdir`'s lock for the block (errors: `WorkdirLock.acquire`)."""
  return WorkdirLock(workdir)
