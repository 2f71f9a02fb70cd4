"""Env workers: every environment call of the rollout, in threads or in worker processes.

    workers = make_workers(spec, WorkerConfig(isolation="process", workers=8, call_timeout_s=10))
    episode, reset = workers.reset("multi_turn_base_15")
    step = workers.step(episode, reply_text)   # an error observation if the call ran too long
    score = workers.score(episode)
    workers.close(episode)
    workers.shutdown()

One interface (`EnvWorkers`), two kinds:

- `ThreadWorkers` ("thread"): the environments live in this process and each
  call runs in the caller's thread. Nothing is isolated, and no time limit can
  stop a call that holds the GIL: for environments that cannot hang (the
  synthetic task) or that bound their own calls (AppWorld's HTTP client has
  per-request timeouts). The cheapest per call.
- `ProcessWorkers` ("process"): `workers` child processes
  (`seeupo_jax/envs/worker.py`), each holding the environments of many episodes,
  built there from the spec's picklable factory. Every call has a time limit; a
  child that runs past it is killed (SIGKILL) and replaced, and so is one that
  dies or runs out of memory under `memory_limit_mb` (RLIMIT_AS). A hung or
  crashed backend then costs one call, never the run.

Whose fault is it:
- a `step` that runs past `call_timeout_s`, or runs its worker out of memory, is
  the model's doing (its arguments: `power(base=10, exponent=10**9)`): the call
  answers with an error observation (`stopped_step`) and the episode goes on,
  its environment as it was before that reply;
- everything else is the environment's own fault and raises `EnvCallFailed` with
  a one-line message (the traceback goes to the log at INFO): an exception the
  environment raised, a worker that died during a call, `reset` or `score` past
  its limit, an episode that could not be restored. The rollout retries such an
  episode from the start and finally drops its group (`roller.py`).

Restoring: a replaced worker's episodes lost their environments. Each is rebuilt
on its next call, in the fresh worker, by replaying its reset and the replies
that ran (BFCL's backends are deterministic), and every replayed answer must
equal the recorded one (a digest), or the episode cannot be restored
(`EnvCallFailed`). A worker killed between two calls (by the OOM killer, a
user) is therefore invisible to the rollout but for the time of the replay.

Calls of one episode come one at a time (the rollout never overlaps them); calls
of different episodes may come from any number of threads. In a worker process
they run one at a time: `affinity(episode)` says which worker an episode lives
on, so that a caller can give each thread one worker's calls.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import multiprocessing
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Callable, Optional, Protocol

from absl import logging

from seeupo_jax import fields
from seeupo_jax.envs import base

ISOLATIONS = ("thread", "process")
_MESSAGE_CHARS = 500


class EnvCallFailed(RuntimeError):
  """An environment call failed through the environment's own fault (one-line message)."""


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
  """How environment calls run.

  isolation: "thread" (in this process) or "process" (worker processes).
  workers: worker processes ("process"); ignored by "thread" (the caller's threads).
  call_timeout_s: the time limit of `reset`, each `step`, `close` and each replayed call
    ("process"); `score` gets call_timeout_s x (1 + the episode's replies), since a checker
    may replay every call.
  memory_limit_mb: each worker process's address-space limit (RLIMIT_AS); 0: none.
  start_timeout_s: the most a worker process may take to start.
  """

  isolation: str = fields.field(fields.one_of(ISOLATIONS), "thread")
  workers: int = fields.field(fields.int_at_least(1), 4)
  call_timeout_s: float = fields.field(fields.number_above(0), 10.0)
  memory_limit_mb: int = fields.field(fields.described(fields.int_at_least(0), "0: none"), 4096)
  start_timeout_s: float = fields.field(fields.number_above(0), 60.0)

  def __post_init__(self):
    fields.check(self)


@dataclasses.dataclass(eq=False)
class Episode:
  """The caller's handle on one episode's environment (opaque: pass it back to the workers).

  episode_id: unique within the workers object.
  task_id: the task it was reset to.
  replies: the replies whose `step` ran (replayed to restore the episode).
  """

  episode_id: int
  task_id: str
  replies: list[str] = dataclasses.field(default_factory=list)
  # ThreadWorkers: the instance. ProcessWorkers: its worker, the worker's generation that
  # holds its environment (-1: none), and digests of the answers to replay against.
  env: Any = None
  worker: int = -1
  generation: int = -1
  digests: list[str] = dataclasses.field(default_factory=list)
  closed: bool = False


def stopped_step(why: str) -> base.Step:
  """The observation of a reply whose call was stopped (the model's doing), e.g. why =
  "took longer than 10 s"."""
  return base.Step(
    observation=[
      {
        "role": "tool",
        "content": f"Error: the call {why} and was stopped; nothing it did was kept. Call it "
        "with smaller arguments, or do something else.",
      }
    ],
    done=False,
    info={"stopped": why},
  )


@dataclasses.dataclass
class WorkerStats:
  """Counts since the workers were made (the rollout reports the differences per call)."""

  timeouts: int = 0  # steps stopped at their time limit (answered with an error observation)
  out_of_memory: int = 0  # steps whose worker ran out of memory (likewise)
  restarts: int = 0  # worker processes replaced (timeouts, deaths, memory)
  restores: int = 0  # episodes rebuilt in a fresh worker by replay


class EnvWorkers(Protocol):
  """See the module docstring."""

  stats: WorkerStats

  def reset(self, task_id: str) -> tuple[Episode, base.Reset]: ...

  def step(self, episode: Episode, text: str) -> base.Step: ...

  def score(self, episode: Episode) -> base.Score: ...

  def close(self, episode: Episode) -> None: ...

  def affinity(self, episode: Episode) -> Optional[int]: ...

  def shutdown(self) -> None: ...


def make_workers(spec: base.EnvSpec, config: WorkerConfig) -> EnvWorkers:
  """The workers `config.isolation` names, for the environments of `spec`."""
  if config.isolation == "process":
    return ProcessWorkers(spec.make, config)
  return ThreadWorkers(spec.make)


def _one_line(what: str, error: BaseException) -> str:
  text = " ".join(str(error).split())[:_MESSAGE_CHARS]
  return f"{what} failed: {type(error).__name__}" + (f": {text}" if text else "")


# --- threads -----------------------------------------------------------------------------------


class ThreadWorkers:
  """Environments in this process, called in the caller's thread (see the module docstring)."""

  def __init__(self, make: Callable[[], base.Environment]):
    self._make = make
    self._ids = itertools.count()
    self.stats = WorkerStats()

  def _call(self, what: str, fn, *args):
    try:
      return fn(*args)
    except Exception as e:  # pylint: disable=broad-except  (the environment's fault)
      logging.info("%s:\n%s", what, traceback.format_exc())
      raise EnvCallFailed(_one_line(what, e)) from None

  def reset(self, task_id: str) -> tuple[Episode, base.Reset]:
    env = self._call("creating the environment", self._make)
    try:
      reset = self._call(f"reset({task_id!r})", env.reset, task_id)
    except EnvCallFailed:
      _close_quietly(env)
      raise
    return Episode(next(self._ids), task_id, env=env), reset

  def step(self, episode: Episode, text: str) -> base.Step:
    step = self._call("step", episode.env.step, text)
    episode.replies.append(text)
    return step

  def score(self, episode: Episode) -> base.Score:
    return self._call("score", episode.env.score)

  def close(self, episode: Episode) -> None:
    if not episode.closed:
      episode.closed = True
      _close_quietly(episode.env)
      episode.env = None

  def affinity(self, episode: Episode) -> Optional[int]:
    del episode
    return None

  def shutdown(self) -> None:
    pass


def _close_quietly(env) -> None:
  try:
    env.close()
  except Exception:  # pylint: disable=broad-except
    logging.warning("environment close() failed: %s", traceback.format_exc(limit=2))


# --- processes ---------------------------------------------------------------------------------


class _TimedOut(Exception):
  pass


class _Died(Exception):
  pass


class _OutOfMemory(Exception):
  pass


def _exit_description(code: Optional[int]) -> str:
  if code is None:
    return "still running"
  if code < 0:
    try:
      return f"killed by {signal.Signals(-code).name}"
    except ValueError:
      return f"killed by signal {-code}"
  return f"exit status {code}"


class _Launcher:
  """Starts the worker processes from one long-lived thread.

  PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, so the
  children are started here and not in the callers' (pool) threads.
  """

  def __init__(self):
    self._requests: queue.Queue = queue.Queue()
    self._thread = threading.Thread(target=self._loop, name="env-launcher", daemon=True)
    self._thread.start()

  def _loop(self):
    while True:
      request = self._requests.get()
      if request is None:
        return
      command, fds, env, reply = request
      try:
        reply.put(
          subprocess.Popen(
            command,
            pass_fds=fds,
            env=env,
            stdin=subprocess.DEVNULL,
            close_fds=True,
            start_new_session=True,
          )
        )
      except OSError as e:
        reply.put(e)

  def popen(self, command: list[str], fds: tuple[int, ...], env: dict) -> subprocess.Popen:
    reply: queue.Queue = queue.Queue()
    self._requests.put((command, fds, env, reply))
    result = reply.get()
    if isinstance(result, BaseException):
      raise result
    return result

  def stop(self):
    self._requests.put(None)
    self._thread.join(timeout=5)


def _child_environment() -> dict:
  """This process's environment, with the directory holding `seeupo_jax` on PYTHONPATH (so a
  checkout that was never installed starts its workers too)."""
  package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  paths = [package_root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
  # One hash seed for every worker: equal answers pickle to equal bytes (sets of strings too),
  # which is what a restore compares.
  return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONHASHSEED": "0"}


class _Worker:
  """One worker process slot: its process (replaced in place) and the lock of its calls."""

  def __init__(self, index: int):
    self.index = index
    self.lock = threading.Lock()  # one call at a time; held by the caller for its whole call
    self.process: Optional[subprocess.Popen] = None
    self.conn = None
    self.generation = 0  # bumped at each (re)start: environments of older generations are gone
    self.episodes = 0  # live episodes placed here (for placement)
    self.ready = False  # its process said "ready"


class ProcessWorkers:
  """Environments in worker processes, with time limits (see the module docstring)."""

  def __init__(self, make: Callable[[], base.Environment], config: WorkerConfig):
    try:
      self._factory = pickle.dumps(make)
    except Exception as e:  # pylint: disable=broad-except
      raise ValueError(
        "this environment's factory cannot be sent to a worker process "
        f"({type(e).__name__}: {e}); use env isolation 'thread'"
      ) from None
    self.config = config
    self.stats = WorkerStats()
    self._stats_lock = threading.Lock()  # counts come from the threads of different workers
    self.started_pids: list[int] = []  # every worker process ever started (tests check them)
    self._ids = itertools.count()
    self._placement = threading.Lock()
    self._workers = [_Worker(i) for i in range(config.workers)]
    self._launcher = _Launcher()
    self._closed = False
    for worker in self._workers:  # start them all now, side by side; each is waited for on use
      self._spawn(worker)

  def _count(self, name: str) -> None:
    with self._stats_lock:
      setattr(self.stats, name, getattr(self.stats, name) + 1)

  # --- worker processes (called with worker.lock held) --------------------------------------------

  def _spawn(self, worker: _Worker) -> None:
    parent, child = multiprocessing.Pipe(duplex=True)
    command = [
      sys.executable,
      "-m",
      "seeupo_jax.envs.worker",
      str(child.fileno()),
      str(self.config.memory_limit_mb),
      str(os.getpid()),
    ]
    try:
      worker.process = self._launcher.popen(command, (child.fileno(),), _child_environment())
    finally:
      child.close()
    self.started_pids.append(worker.process.pid)
    try:
      parent.send((list(sys.path), self._factory))
    except OSError:  # it died at once: `_ensure_running` reads the EOF and says so
      pass
    worker.conn = parent
    worker.generation += 1
    worker.ready = False

  def _ensure_running(self, worker: _Worker) -> None:
    """A live, started worker process in the slot (replaced if it died while idle)."""
    if worker.process is not None and worker.process.poll() is not None:
      logging.warning(
        "env worker %d (pid %d) died while idle (%s); starting another",
        worker.index,
        worker.process.pid,
        _exit_description(worker.process.returncode),
      )
      self._discard(worker)
      self._count("restarts")
    if worker.process is None:
      self._spawn(worker)
    if not worker.ready:
      if not worker.conn.poll(self.config.start_timeout_s):
        self._discard(worker)
        raise EnvCallFailed(
          f"an env worker process did not start within {self.config.start_timeout_s:g} s"
        )
      try:
        status, *rest = worker.conn.recv()
      except (EOFError, OSError):
        code = self._discard(worker)
        raise EnvCallFailed(
          f"an env worker process died while starting ({_exit_description(code)})"
        ) from None
      if status != "ready":
        self._discard(worker)
        raise EnvCallFailed(f"an env worker process could not start: {rest[0]}")
      worker.ready = True

  def _discard(self, worker: _Worker) -> Optional[int]:
    """Kills the slot's process (if any) and forgets it; returns its exit code."""
    process, worker.process = worker.process, None
    if worker.conn is not None:
      worker.conn.close()
      worker.conn = None
    if process is None:
      return None
    if process.poll() is None:
      process.kill()
    try:
      return process.wait(timeout=10)
    except subprocess.TimeoutExpired:  # unkillable (D state): leave it to the OS
      return None

  def _request(self, worker: _Worker, op: str, episode_id: int, arg: Any, timeout: float):
    """One request to the slot's process: (its answer, a digest of the answer's bytes).

    Raises _TimedOut / _Died / _OutOfMemory / EnvCallFailed (the environment raised). A
    timed-out, dead or out-of-memory process is discarded (a restart: the next call starts
    another).
    """
    self._ensure_running(worker)
    try:
      worker.conn.send((op, episode_id, arg))
      answered = worker.conn.poll(timeout)
    except (BrokenPipeError, OSError):
      answered = True  # recv below reports the death
    if not answered:
      self._discard(worker)
      self._count("restarts")
      raise _TimedOut()
    try:
      raw = worker.conn.recv_bytes()
    except (EOFError, OSError):
      code = self._discard(worker)
      self._count("restarts")
      raise _Died(f"its env worker process died ({_exit_description(code)})") from None
    status, *rest = pickle.loads(raw)
    if status == "ok":
      return rest[0], hashlib.sha1(raw).hexdigest()
    message, trace = rest
    logging.info("env worker %d, %s:\n%s", worker.index, op, trace)
    if status == "fatal":
      self._discard(worker)
      self._count("restarts")
      raise _OutOfMemory(message)
    raise EnvCallFailed(f"{op} failed: {message}")

  def _environment_call(self, worker, op, episode_id, arg, limit, what: str):
    """`_request` where a stopped or dead worker is the environment's fault (everything but a
    reply's step): its answer and digest, or EnvCallFailed("<what> took longer than ..." or
    "<what> failed: ...")."""
    try:
      return self._request(worker, op, episode_id, arg, limit)
    except _TimedOut:
      raise EnvCallFailed(f"{what} took longer than {limit:g} s") from None
    except (_Died, _OutOfMemory) as e:
      raise EnvCallFailed(f"{what} failed: {e}") from None

  def _restore(self, worker: _Worker, episode: Episode) -> None:
    """Rebuilds the episode's environment in the slot's current process, if it is not there."""
    self._ensure_running(worker)
    if episode.generation == worker.generation:
      return
    limit = self.config.call_timeout_s
    calls = [("reset", episode.task_id)] + [("step", text) for text in episode.replies]
    for k, ((op, arg), digest) in enumerate(zip(calls, episode.digests)):
      what = "its reset" if k == 0 else f"its reply {k}"
      _, answer = self._environment_call(
        worker,
        op,
        episode.episode_id,
        arg,
        limit,
        f"restoring the episode in a fresh worker: replaying {what}",
      )
      if answer != digest:
        raise EnvCallFailed(
          f"restoring the episode in a fresh worker: replaying {what} answered differently (the "
          "environment is not deterministic, so its state cannot be rebuilt)"
        )
    episode.generation = worker.generation
    self._count("restores")

  # --- the interface ------------------------------------------------------------------------------

  def reset(self, task_id: str) -> tuple[Episode, base.Reset]:
    with self._placement:
      worker = min(self._workers, key=lambda w: (w.episodes, w.index))
      worker.episodes += 1
    episode = Episode(next(self._ids), task_id, worker=worker.index)
    limit = self.config.call_timeout_s
    try:
      with worker.lock:
        reset, digest = self._environment_call(
          worker, "reset", episode.episode_id, task_id, limit, f"reset({task_id!r})"
        )
        episode.generation = worker.generation
    except BaseException:
      with self._placement:
        worker.episodes -= 1
      episode.closed = True
      raise
    episode.digests.append(digest)
    return episode, reset

  def step(self, episode: Episode, text: str) -> base.Step:
    worker = self._workers[episode.worker]
    limit = self.config.call_timeout_s
    with worker.lock:
      self._restore(worker, episode)
      try:
        step, digest = self._request(worker, "step", episode.episode_id, text, limit)
      except _TimedOut:
        self._count("timeouts")
        logging.warning(
          "task %s: a step ran past %g s; its worker was replaced", episode.task_id, limit
        )
        return stopped_step(f"took longer than {limit:g} s")
      except _OutOfMemory as e:
        self._count("out_of_memory")
        logging.warning("task %s: a step ran its worker out of memory (%s)", episode.task_id, e)
        return stopped_step(f"needed more than {self.config.memory_limit_mb} MB of memory")
      except _Died as e:
        raise EnvCallFailed(f"step failed: {e}") from None
    episode.replies.append(text)
    episode.digests.append(digest)
    return step

  def score(self, episode: Episode) -> base.Score:
    worker = self._workers[episode.worker]
    limit = self.config.call_timeout_s * (1 + len(episode.replies))
    with worker.lock:
      self._restore(worker, episode)
      return self._environment_call(worker, "score", episode.episode_id, None, limit, "score")[0]

  def close(self, episode: Episode) -> None:
    if episode.closed:
      return
    episode.closed = True
    worker = self._workers[episode.worker]
    with self._placement:
      worker.episodes -= 1
    with worker.lock:
      if worker.process is None or episode.generation != worker.generation:
        return  # its environment went with an earlier process
      try:
        self._request(worker, "close", episode.episode_id, None, self.config.call_timeout_s)
      except (_TimedOut, _Died, _OutOfMemory, EnvCallFailed) as e:
        logging.warning("task %s: close() failed: %s", episode.task_id, e or type(e).__name__)

  def affinity(self, episode: Episode) -> Optional[int]:
    return episode.worker

  def shutdown(self) -> None:
    """Stops every worker process (asks, then kills after a second)."""
    if self._closed:
      return
    self._closed = True
    for worker in self._workers:
      with worker.lock:
        if worker.process is not None and worker.conn is not None:
          try:
            worker.conn.send(("exit", -1, None))
            worker.process.wait(timeout=1.0)
          except (OSError, subprocess.TimeoutExpired):
            pass
        self._discard(worker)
    self._launcher.stop()

  def __del__(self):
    try:
      self.shutdown()
    except Exception:  # pylint: disable=broad-except  (interpreter shutdown)
      pass


def live_pids(pids) -> list[int]:
  """The processes of `pids` still running (not zombies): for tests of a clean shutdown."""
  alive = []
  for pid in pids:
    try:
      with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
      continue
    if state != "Z":
      alive.append(pid)
  return alive


def wait_gone(pids, seconds: float = 5.0) -> list[int]:
  """Waits up to `seconds` for `pids` to end; returns those still alive."""
  deadline = time.monotonic() + seconds
  while True:
    alive = live_pids(pids)
    if not alive or time.monotonic() > deadline:
      return alive
    time.sleep(0.05)
