"""A fake bucket: `gs://` and `s3://` paths of `etils.epath` kept in a local directory.

    with fake_bucket.install(tmp_path / "bucket"):       # gs://b/run is tmp_path/bucket/gs/b/run
      epath.Path("gs://b/run/x").write_text("...")

    python tests/fake_bucket.py ROOT [FAIL] experiments/run.py --workdir=gs://b/run ...

`install` mocks epath's backends (`etils.epath.testing.mock_epath`): a path with a URL scheme is
mapped to `<root>/<scheme>/<rest>` and handled by the local file system, every other path is
left as it is. With `fail`, opening a remote path that contains `fail` for writing raises
OSError (a bucket that refuses those objects); everything else still works. With `on_write`, it
is called with the remote path before each remote object is opened for writing (a test blocks
there, or changes the local files in the middle of a copy).

Run as a program, it installs the fake and runs the script that follows with the remaining
arguments (`experiments/run.py` in the tests: the run's own process sees the fake bucket).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import runpy
import sys
from typing import Callable, Iterator, Optional

from etils.epath import testing as epath_testing

_SCHEME = re.compile(r"^([a-z][a-z0-9]*)://(.*)$")


def local_path(root: str, path) -> str:
  """Where the fake keeps the remote `path` (a local path is returned as it is)."""
  match = _SCHEME.match(os.fspath(path))
  if not match:
    return os.fspath(path)
  return os.path.join(str(root), match.group(1), match.group(2))


@contextlib.contextmanager
def install(
  root, fail: Optional[str] = None, on_write: Optional[Callable[[str], None]] = None
) -> Iterator[None]:
  """Maps remote paths to `root` for the block (see the module docstring)."""
  os.makedirs(root, exist_ok=True)

  def mapped(original, path, *args, **kwargs):
    return original(local_path(root, path), *args, **kwargs)

  def two(original, path, dst, *args, **kwargs):
    return original(local_path(root, path), local_path(root, dst), *args, **kwargs)

  def open_(original, path, mode="r"):
    remote = _SCHEME.match(os.fspath(path)) is not None
    writing = any(c in mode for c in "wax+")
    if remote and writing and on_write is not None:
      on_write(os.fspath(path))
    if remote and fail and fail in os.fspath(path) and writing:
      raise OSError(errno.EIO, f"503 Service Unavailable: the fake bucket refuses {path}")
    return original(local_path(root, path), mode)

  def walk(original, top, **kwargs):
    local = local_path(root, top)
    for directory, dirs, files in original(local, **kwargs):
      yield os.fspath(top) + directory[len(local) :], dirs, files

  with epath_testing.mock_epath(
    copy=two,
    exists=mapped,
    isdir=mapped,
    listdir=mapped,
    makedirs=mapped,
    mkdir=mapped,
    open=open_,
    remove=mapped,
    rename=two,
    replace=two,
    rmtree=mapped,
    stat=mapped,
    walk=walk,
  ):
    yield


def main(argv: list[str]) -> None:
  """`fake_bucket.py ROOT [FAIL] SCRIPT ARGS...`: runs SCRIPT with the fake installed."""
  root, rest = argv[1], argv[2:]
  fail = None
  if not rest[0].endswith(".py"):
    fail, rest = rest[0], rest[1:]
  sys.argv = rest
  with install(root, fail):
    runpy.run_path(rest[0], run_name="__main__")


if __name__ == "__main__":
  main(sys.argv)
