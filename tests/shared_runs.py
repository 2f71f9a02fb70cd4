"""A run made once per test session and shared by every xdist worker (`once`).

A module fixture is made once per worker process, and pytest tears it down whenever the next
test a worker gets belongs to another module, so a fixture that trains a whole run (minutes on
2 cores) could be made two or three times in one session. `once` keeps the run on disk in the
session's shared temporary directory, behind a file lock: the first worker to ask makes it, every
later request, on any worker, reads what it returned.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from typing import Any, Callable


def once(tmp_path_factory, name: str, make: Callable[[Any], Any]) -> Any:
  """`make(directory)`'s result, made once per session across the xdist workers.

  Args:
    tmp_path_factory: pytest's fixture of that name.
    name: the run's directory name under the session's shared temporary directory.
    make: makes the run in the empty directory it is given (a `pathlib.Path`) and returns a
      JSON-able result (paths as strings). If it raises, the next request tries again.

  Returns:
    What `make` returned, read back from JSON.
  """
  base = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    base = (
      base.parent
    )  # pytest-N/popen-gwK -> pytest-N: shared by every xdist worker of one pytest run
  root, done = base / name, base / f"{name}.json"
  with open(base / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    if not done.exists():
      shutil.rmtree(root, ignore_errors=True)  # an earlier attempt that raised
      root.mkdir()
      done.write_text(json.dumps(make(root)))
    return json.loads(done.read_text())
