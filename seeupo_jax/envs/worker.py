"""The process that hosts environments for `seeupo_jax.rollout.workers.ProcessWorkers`.

    python -m seeupo_jax.envs.worker FD MEMORY_LIMIT_MB PARENT_PID

Speaks over the `multiprocessing.connection.Connection` on file descriptor FD:

  <- (sys.path of the parent, pickled factory)      the factory builds one environment
  -> ("ready", pid)                                  or ("fatal", message) and exit
  <- (op, episode_id, arg)                           op: reset (arg: task id), step (arg: the
                                                     reply text), score, close, exit
  -> ("ok", value)                                   Reset / Step / Score / None
  -> ("error", one-line message, traceback text)     the environment raised
  -> ("fatal", one-line message, traceback text)     MemoryError: the process exits after it

It runs one call at a time and holds any number of episodes' environments
(episode id -> instance). It never prints: what goes wrong is sent back. It
dies with its parent (PR_SET_PDEATHSIG, checked against PARENT_PID), ignores
the terminal's Ctrl-C (the parent shuts it down), and lives under an address-
space limit of MEMORY_LIMIT_MB (RLIMIT_AS; 0: none), so a runaway allocation
is a MemoryError here instead of the machine swapping.

This module imports only the standard library and `seeupo_jax.envs.base`
(unpickling the factory imports the environment's own module): a worker starts
in well under a second.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import resource
import signal
import sys
import traceback
from multiprocessing.connection import Connection

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
  """SIGKILL when the parent dies (Linux), even while a call holds the GIL."""
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
  except (OSError, AttributeError):  # not Linux: the parent's shutdown and EOF still end us
    pass
  if os.getppid() != parent_pid:  # the parent died before prctl took effect
    os._exit(0)


_MESSAGE_CHARS = 500


def _one_line(error: BaseException) -> str:
  text = " ".join(str(error).split())[:_MESSAGE_CHARS]
  return f"{type(error).__name__}: {text}" if text else type(error).__name__


def serve(conn: Connection) -> int:
  """The request loop (see the module docstring); returns the exit status."""
  try:
    path, factory = conn.recv()
  except (EOFError, OSError):
    return 0
  sys.path[:0] = [p for p in path if p not in sys.path]
  try:
    make = pickle.loads(factory)
  except Exception as e:  # pylint: disable=broad-except
    conn.send(("fatal", f"cannot load the environment factory: {_one_line(e)}", ""))
    return 2
  conn.send(("ready", os.getpid()))
  envs = {}
  while True:
    try:
      op, episode_id, arg = conn.recv()
    except (EOFError, OSError):  # the parent is gone
      return 0
    if op == "exit":
      return 0
    try:
      if op == "reset":
        envs.pop(episode_id, None)
        env = make()
        value = env.reset(arg)
        envs[episode_id] = env
      elif op == "step":
        value = envs[episode_id].step(arg)
      elif op == "score":
        value = envs[episode_id].score()
      elif op == "close":
        env = envs.pop(episode_id, None)
        value = None if env is None else env.close()
      else:
        raise ValueError(f"unknown request {op!r}")
      conn.send(("ok", value))
    except MemoryError as e:
      conn.send(("fatal", _one_line(e), traceback.format_exc()))
      return 3
    except Exception as e:  # pylint: disable=broad-except
      if op == "reset":
        envs.pop(episode_id, None)
      conn.send(("error", _one_line(e), traceback.format_exc()))


def main(argv: list[str]) -> int:
  fd, memory_limit_mb, parent_pid = int(argv[1]), int(argv[2]), int(argv[3])
  _die_with_parent(parent_pid)
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  if memory_limit_mb > 0:
    limit = memory_limit_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  sys.stdout = open(os.devnull, "w", encoding="utf-8")  # environments that print stay quiet
  return serve(Connection(fd))


if __name__ == "__main__":
  sys.exit(main(sys.argv))
