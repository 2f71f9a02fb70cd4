"""The rollout engine: episodes of one environment family played by one policy, continuously.

    roller = Roller(spec, chat, model_config, sampling_config, RolloutConfig(max_turns=3))
    result = roller.run(params, task_ids, samples_per_task=8, rng=key)
    batch = collate(result.trajectories, num_turns=3, max_len=1024)   # the learner's Batch

One call plays B tasks x n samples = N episodes on `decode_slots` rows of the policy (a
`sampling.SamplerSession`, or a text policy). The scheduler's loop:

    while episodes are pending or live:
      admit        free rows take pending episodes (their `reset` goes to the env workers)
      env results  observations that came back are given to their rows (their tokens queued
                   for prefill); finished episodes are scored; scored ones retire (row freed)
      prefill      the policy writes what arrived (chunked; rows whose input is complete
                   sample their first token)
      decode       k decode steps of every decoding row, one host read
      hand off     each finished reply goes to the env workers at once (asynchronously)

so one slow reply or one slow environment holds up only its own episode. The host blocks
only when the policy has nothing to do (`rollout/env_wait_share`).

`scheduler="turns"` is the turn-synchronous baseline in the same loop: a barrier holds every
environment result (and every admission) until no environment call is in flight and no reply
is being decoded, so all live episodes take each turn together.

Deterministic whatever the timing: the reply of turn t of (group g, sample i, attempt a)
samples from fold_in(fold_in(fold_in(fold_in(rng, g), i), a), t) (`trajectory_keys`), and a
session row's tokens depend only on its own context, so the trajectories of a call do not
depend on environment latencies, the order in which observations return, or the number of
slots (up to float rounding of batched matmuls, which flips a token with a probability of
order 1e-6 per token).

Token in, token out: a trajectory's tokens are the prompt's, then each reply's sampled ids
with the sampler's log-probs (`turn_ids` = the turn), then each observation's ids
(`turn_ids` -1). No text is ever tokenized back into a reply.

Limits (all end a trajectory cleanly, with the reward its environment gives for where it
stopped and a finish reason kept in its metadata):
  - max_turns: "max_turns" after the last allowed reply;
  - max_context_tokens: "context" when the next observation and at least one reply token no
    longer fit (the observation is not added);
  - max_reply_tokens (the sampler's max_new_tokens, also cut to the context left): the reply
    is cut and the environment sees the cut text; counted;
  - max_env_tokens: each turn's observation text is cut to this many tokens with
    `TRUNCATION_MARKER`; counted.

Capacity: an environment family that can hold only so many episodes at once
(`EnvSpec.capacity`, e.g. one AppWorld server per episode) gets at most that many live
episodes: the same mechanism as the decode slots.

Environment calls go through the env workers (`workers.py`): in this process ("thread") or
in worker processes with a time limit per call ("process"; BFCL's default). A reply whose
call runs past `env_call_timeout_s` (or out of memory) is the model's doing: it gets an error
observation and the episode goes on (counted: `rollout/env_stopped_calls`).

Environment failures: the environment's own faults (`workers.EnvCallFailed`) fail that
episode; `reset` is retried on a fresh instance first (`reset_retries`). A failed episode is
played again from the start on a fresh instance (`episode_retries` times, queued behind the
others, with the same params, so it is a fair sample of its group). If it still fails
("env_error"), every trajectory of its task's group is dropped (`row_valid` False), so no
group's advantages are computed from a biased subset. If more than
`max_failed_group_fraction` of the groups fail in one call, `EnvironmentFailure` is raised
with the first errors: a broken environment server surfaces as an error, never as zero
rewards.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import queue
import time
from typing import Callable, Optional, Sequence

from absl import logging
import jax
import numpy as np

from seeupo_jax import sampling
from seeupo_jax.chat_tokens import ChatTokens
from seeupo_jax.envs import base as envs_base
from seeupo_jax.learner.batch import PROMPT_OR_ENV
from seeupo_jax.models.config import ModelConfig
from seeupo_jax.rollout import policy as policy_lib
from seeupo_jax.rollout import workers as workers_lib
from seeupo_jax.rollout.trajectory import Trajectory

TRUNCATION_MARKER = "\n[... observation truncated]"
FINISH_REASONS = ("done", "max_turns", "context", "env_error")
SCHEDULERS = ("continuous", "turns")


class EnvironmentFailure(RuntimeError):
  """Too many environments failed in one rollout call (see the module docstring)."""


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """Limits and plumbing of the rollout engine (validated on construction).

  max_turns: most assistant turns per trajectory (the learner's num_turns).
  max_context_tokens: most tokens in a trajectory (prompt + replies + observations).
  max_env_tokens: most tokens of one turn's observation text (cut with a marker).
  env_workers: environment calls in flight at once: threads, and with "process" isolation as
    many worker processes.
  env_isolation: "auto" (the environment's own choice, `EnvSpec.isolation`), "thread" or
    "process" (see `workers.py`).
  env_call_timeout_s: the time limit of each environment call in worker processes (a reply's
    `step` past it is answered with an error observation; `score` gets this x (1 + replies)).
  env_memory_limit_mb: the address-space limit of each worker process (0: none).
  reset_retries: extra attempts of a failing `reset`, each on a fresh instance.
  episode_retries: extra attempts of an episode whose environment failed (in reset, step or
    score), each played from the start on a fresh instance.
  max_failed_group_fraction: raise `EnvironmentFailure` above this share of failed groups.
  scheduler: "continuous" (episodes advance on their own) or "turns" (a barrier per turn:
    the turn-synchronous baseline).
  decode_slots: S, the policy's rows: the most episodes live at once.
  decode_steps_per_sync: k, decode steps between host reads of finished replies.
  page_size: slots per KV-cache page (`sampling.SessionConfig`).
  prefill_chunk: the width of every prefill call (a longer input takes several).
  prefill_rows: the rows of every prefill call (more rows with new tokens: several calls).
  """

  max_turns: int
  max_context_tokens: int = 2048
  max_env_tokens: int = 512
  env_workers: int = 16
  env_isolation: str = "auto"
  env_call_timeout_s: float = 10.0
  env_memory_limit_mb: int = 4096
  reset_retries: int = 2
  episode_retries: int = 1
  max_failed_group_fraction: float = 0.25
  scheduler: str = "continuous"
  decode_slots: int = 64
  decode_steps_per_sync: int = 8
  page_size: int = 32
  prefill_chunk: int = 64
  prefill_rows: int = 8

  def __post_init__(self):
    for name in ("max_turns", "max_context_tokens", "max_env_tokens", "env_workers"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"RolloutConfig.{name} must be an int >= 1, got {value!r}")
    for name in ("reset_retries", "episode_retries"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 0:
        raise ValueError(f"RolloutConfig.{name} must be an int >= 0, got {value!r}")
    for name in (
      "decode_slots",
      "decode_steps_per_sync",
      "page_size",
      "prefill_chunk",
      "prefill_rows",
    ):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"RolloutConfig.{name} must be an int >= 1, got {value!r}")
    if self.scheduler not in SCHEDULERS:
      raise ValueError(f"RolloutConfig.scheduler={self.scheduler!r}; allowed: {list(SCHEDULERS)}")
    if self.env_isolation not in ("auto",) + workers_lib.ISOLATIONS:
      raise ValueError(
        f"RolloutConfig.env_isolation={self.env_isolation!r}; allowed: "
        f"{['auto', *workers_lib.ISOLATIONS]}"
      )
    self.worker_config("thread")  # validates the time and memory limits
    if not 0.0 <= self.max_failed_group_fraction <= 1.0:
      raise ValueError(
        "RolloutConfig.max_failed_group_fraction must be in [0, 1], got "
        f"{self.max_failed_group_fraction!r}"
      )

  def worker_config(self, default_isolation: str) -> workers_lib.WorkerConfig:
    """The env workers' config; "auto" isolation becomes `default_isolation` (the spec's)."""
    isolation = default_isolation if self.env_isolation == "auto" else self.env_isolation
    try:
      return workers_lib.WorkerConfig(
        isolation=isolation,
        workers=self.env_workers,
        call_timeout_s=self.env_call_timeout_s,
        memory_limit_mb=self.env_memory_limit_mb,
      )
    except ValueError as e:
      raise ValueError(f"RolloutConfig: {e}") from None

  def session_config(self, max_new_tokens: int) -> sampling.SessionConfig:
    """The sampler session's geometry."""
    return sampling.SessionConfig(
      rows=self.decode_slots,
      max_context_tokens=self.max_context_tokens,
      page_size=self.page_size,
      prefill_chunk=self.prefill_chunk,
      prefill_rows=self.prefill_rows,
      decode_steps_per_sync=self.decode_steps_per_sync,
    )


@dataclasses.dataclass
class RolloutResult:
  trajectories: list[Trajectory]
  metrics: dict[str, float]


@dataclasses.dataclass
class _Episode:
  """Host-side state of one episode (one attempt of one trajectory)."""

  trajectory: Trajectory
  attempt: int
  turn_keys: np.ndarray  # uint32[max_turns, 2], the raw key of each turn's reply
  row: int = -1
  handle: Optional[workers_lib.Episode] = None  # its environment, in the env workers
  tools: Optional[list] = None


@dataclasses.dataclass
class _Timers:
  sample: float = 0.0  # the policy's prefill and decode calls (device time and host reads)
  env_wait: float = 0.0  # blocked on the environments with nothing for the policy to do
  host: float = 0.0


def _fold_keys(rng, groups, samples, attempts, turns: int) -> np.ndarray:
  def one(g, i, a):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(rng, g), i), a)
    return jax.vmap(lambda t: jax.random.key_data(jax.random.fold_in(key, t)))(
      np.arange(turns, dtype=np.uint32)
    )

  return jax.vmap(one)(groups, samples, attempts)


_fold_keys_jit = jax.jit(_fold_keys, static_argnums=4)


def trajectory_keys(
  rng: jax.Array, groups: Sequence[int], samples: Sequence[int], attempts: Sequence[int], turns: int
) -> np.ndarray:
  """uint32[E, turns, 2]: the raw reply key of each turn of each episode (see the docstring).

  Args:
    rng: the call's PRNG key (typed or raw).
    groups, samples, attempts: [E] the episodes' group, sample index and attempt.
    turns: the most turns of an episode.
  """
  if not jax.numpy.issubdtype(rng.dtype, jax.dtypes.prng_key):
    rng = jax.random.wrap_key_data(rng)
  as_u32 = lambda x: np.asarray(x, np.uint32)  # noqa: E731
  return np.asarray(_fold_keys_jit(rng, as_u32(groups), as_u32(samples), as_u32(attempts), turns))


def truncate_observation(
  messages: Sequence[envs_base.Message],
  budget: int,
  count_tokens: Callable[[str], list[int]],
  decode: Callable[[list[int]], str],
) -> tuple[list[envs_base.Message], int]:
  """Cuts the messages' text to `budget` tokens in all, marking each cut message.

  Returns (messages, number of tokens cut).
  """
  texts = [m.get("content") for m in messages if isinstance(m.get("content"), str)]
  if sum(len(t.encode("utf-8")) for t in texts) <= budget:  # byte-level BPE: tokens <= bytes
    return list(messages), 0
  out, cut = [], 0
  for message in messages:
    content = message.get("content")
    if not isinstance(content, str):
      out.append(message)
      continue
    ids = count_tokens(content)
    if len(ids) <= budget:
      budget -= len(ids)
      out.append(message)
      continue
    cut += len(ids) - budget
    out.append({**message, "content": decode(ids[:budget]) + TRUNCATION_MARKER})
    budget = 0
  return out, cut


class Roller:
  """Plays batches of episodes of one environment family with one policy (the engine).

  Args:
    spec: the environment family (`seeupo_jax.envs.make_spec`).
    chat: the tokenizer's `ChatTokens`.
    model_config: the policy's `ModelConfig`.
    sampling_config: decoding settings; `max_new_tokens` is the reply limit and its stop
      tokens should include the chat template's end of turn.
    config: the `RolloutConfig`.
    cache_sharding: optional PagedKVCache -> shardings (see `sampling.SamplerSession`).
    workers: the env workers to use (shared, e.g. by training and evaluation; the caller shuts
      them down); None: the Roller makes its own from `config` and `close` shuts them down.
    text_policy: replies from a function instead of the model: trajectory so far -> the reply
      text (scripted tests, the oracle); `run`'s params are then unused and the replies'
      log-probs 0 (`policy.TextPolicy`).
  """

  def __init__(
    self,
    spec: envs_base.EnvSpec,
    chat: ChatTokens,
    model_config: ModelConfig,
    sampling_config: sampling.SamplingConfig,
    config: RolloutConfig,
    *,
    cache_sharding=None,
    workers: Optional[workers_lib.EnvWorkers] = None,
    text_policy: Optional[Callable[[Trajectory], str]] = None,
  ):
    if config.max_turns > spec.max_turns:
      logging.info(
        "RolloutConfig.max_turns=%d exceeds the environment's %d", config.max_turns, spec.max_turns
      )
    self.spec = spec
    self.chat = chat
    self.model_config = model_config
    self.sampling_config = sampling_config
    self.config = config
    if text_policy is None:
      self.session = sampling.SamplerSession(
        model_config,
        sampling_config,
        config.session_config(sampling_config.max_new_tokens),
        cache_sharding=cache_sharding,
      )
      self.policy: policy_lib.Policy = policy_lib.SamplerPolicy(self.session)
    else:
      self.session = None
      self.policy = policy_lib.TextPolicy(text_policy, chat)
    self._owns_workers = workers is None
    if workers is None:
      workers = workers_lib.make_workers(spec, config.worker_config(spec.isolation))
    self.workers = workers
    self._pool = concurrent.futures.ThreadPoolExecutor(
      max_workers=config.env_workers, thread_name_prefix="env"
    )

  def close(self) -> None:
    self._pool.shutdown(wait=True)
    if self._owns_workers:
      self.workers.shutdown()

  @property
  def cache_slots(self) -> int:
    """The most KV-cache slots the sampler's rows held at once (0 for a text policy)."""
    return 0 if self.session is None else self.session.stats.peak_cache_slots

  # --- environment calls (worker threads) -----------------------------------------------------

  def _reset(self, task_id: str):
    """A fresh episode, its prompt ids and tools; retried on fresh instances."""
    for attempt in range(self.config.reset_retries + 1):
      try:
        handle, reset = self.workers.reset(task_id)
        break
      except workers_lib.EnvCallFailed:
        if attempt == self.config.reset_retries:
          raise
    return handle, reset.tools, self.chat.prompt_ids(reset.messages, reset.tools)

  def _step(self, episode: _Episode, text: str, reply_closed: bool, last_turn: bool):
    """env.step + the observation's ids (cut to max_env_tokens)."""
    step = self.workers.step(episode.handle, text)
    if step.info.get("stopped"):
      episode.trajectory.env_stopped_calls += 1
    if step.done or last_turn:
      return step, [], 0
    observation, cut = truncate_observation(
      step.observation, self.config.max_env_tokens, self.chat.encode, self.chat.tokenizer.decode
    )
    ids = self.chat.observation_ids(observation, episode.tools, reply_closed=reply_closed)
    return step, ids, cut

  def _submit(self, kind: str, episode: _Episode, fn, *args) -> None:
    """Runs fn(*args) on the pool; its (kind, episode, result, error) lands in the inbox.

    `error` is the message of an `EnvCallFailed` (the environment's fault); any other
    exception is a bug and is raised in the loop.
    """

    def call():
      t0 = time.perf_counter()
      try:
        out = (kind, episode, fn(*args), None)
      except workers_lib.EnvCallFailed as e:
        out = (kind, episode, None, str(e))
      except BaseException as e:  # noqa: BLE001 - re-raised by the loop
        out = ("bug", episode, e, None)
      seconds = time.perf_counter() - t0
      episode.trajectory.env_seconds += seconds
      if kind == "step":  # the typical step latency, for the wait for quick answers
        self._step_seconds = 0.9 * self._step_seconds + 0.1 * seconds
      self._inbox.put(out)

    self._in_flight += 1
    self._pool.submit(call)

  # --- the loop -----------------------------------------------------------------------------

  def run(
    self, params, task_ids: Sequence[str], samples_per_task: int, rng: jax.Array
  ) -> RolloutResult:
    """Plays len(task_ids) x samples_per_task episodes; returns them with timing metrics.

    Args:
      params: the policy's params.
      task_ids: the B tasks of this call (group g = task g).
      samples_per_task: n, trajectories per task.
      rng: a PRNG key.
    """
    t_start = time.perf_counter()
    self._timers = _Timers()
    self._rng = rng
    stats_before = dataclasses.replace(self.workers.stats)
    session_before = None if self.session is None else dataclasses.replace(self.session.stats)
    trajectories = [
      Trajectory(task_id, group, sample)
      for group, task_id in enumerate(task_ids)
      for sample in range(samples_per_task)
    ]
    keys = trajectory_keys(
      rng,
      [t.group for t in trajectories],
      [t.sample for t in trajectories],
      [0] * len(trajectories),
      self.config.max_turns,
    )
    self._final: dict[tuple[int, int], Trajectory] = {}
    self._retried = 0
    capacity = None if self.spec.capacity is None else int(self.spec.capacity())
    if capacity is not None and capacity < 1:
      raise EnvironmentFailure("the environment can run no episode now (capacity 0)")
    slots = (
      self.config.decode_slots if capacity is None else min(capacity, self.config.decode_slots)
    )
    self._schedule(
      params,
      collections.deque(_Episode(t, 0, k) for t, k in zip(trajectories, keys)),
      slots,
    )
    trajectories = [self._final[(t.group, t.sample)] for t in trajectories]
    return RolloutResult(
      trajectories,
      self._metrics(trajectories, len(task_ids), t_start, stats_before, session_before),
    )

  def _schedule(self, params, pending: collections.deque, slots: int) -> None:
    """The main loop (see the module docstring)."""
    self._inbox: queue.SimpleQueue = queue.SimpleQueue()
    self._in_flight = 0
    self._just_handed = 0  # steps submitted by the last hand-off
    self._step_seconds = 0.0  # moving average of a step's latency
    self._policy_seconds = 0.0  # moving average of one prefill + decode round
    self._held: list = []  # env results held by the turns barrier
    self._pending = pending
    self._free_rows = list(range(slots - 1, -1, -1))
    self._live: dict[int, _Episode] = {}
    barrier = self.config.scheduler == "turns"
    self.policy.begin(params)
    while self._pending or self._live:
      t_host = time.perf_counter()
      at_barrier = barrier and self._in_flight == 0 and not self.policy.busy
      if not barrier or at_barrier:
        self._admit()
      self._take_env_results(barrier, at_barrier)
      self._timers.host += time.perf_counter() - t_host
      t_sample = time.perf_counter()
      self.policy.prefill()
      replies = self.policy.decode()
      seconds = time.perf_counter() - t_sample
      self._timers.sample += seconds
      self._policy_seconds = 0.9 * self._policy_seconds + 0.1 * seconds
      t_host = time.perf_counter()
      self._just_handed = len(replies)
      for reply in replies:
        self._hand_off(reply)
      self._timers.host += time.perf_counter() - t_host

  def _admit(self) -> None:
    """Free rows take pending episodes; their resets go to the env workers."""
    while self._free_rows and self._pending:
      episode = self._pending.popleft()
      episode.row = self._free_rows.pop()
      self._live[episode.row] = episode
      self._submit("reset", episode, self._reset, episode.trajectory.task_id)

  def _take_env_results(self, barrier: bool, at_barrier: bool) -> None:
    """Handles the environment results that came back; blocks only when the policy has
    nothing to do (the time counts as env wait). The turns barrier holds resets' and steps'
    results until no call is in flight and no reply is being decoded."""
    results = []
    if not self.policy.busy and self._in_flight and not (barrier and self._held and at_barrier):
      t_wait = time.perf_counter()
      results.append(self._inbox.get())
      self._timers.env_wait += time.perf_counter() - t_wait
    elif not barrier and self._just_handed and self._step_seconds < 0.25 * self._policy_seconds:
      # Environments much faster than a decode round: the replies just handed off are about
      # to come back; a short wait lets their rows join the next round instead of idling a
      # round (at most twice a typical step).
      t_wait = time.perf_counter()
      deadline = t_wait + 2 * self._step_seconds
      for _ in range(min(self._just_handed, self._in_flight)):
        try:
          results.append(self._inbox.get(timeout=max(0.0, deadline - time.perf_counter())))
        except queue.Empty:
          break
      self._timers.env_wait += time.perf_counter() - t_wait
    while True:
      try:
        results.append(self._inbox.get_nowait())
      except queue.Empty:
        break
    self._in_flight -= len(results)
    for result in results:
      if result[0] == "bug":
        raise result[2]
      if barrier and result[0] in ("reset", "step"):
        self._held.append(result)
      else:
        self._handle(*result)
    if barrier and self._in_flight == 0 and not self.policy.busy:
      held, self._held = self._held, []
      for result in held:
        self._handle(*result)

  def _handle(self, kind: str, episode: _Episode, result, error: Optional[str]) -> None:
    trajectory = episode.trajectory
    if error is not None:
      self._fail(episode, error)
      return
    if kind == "reset":
      episode.handle, episode.tools, prompt = result
      if len(prompt) + 1 > self.config.max_context_tokens:
        self._fail(
          episode,
          f"the prompt of task {trajectory.task_id!r} has {len(prompt)} tokens; "
          f"max_context_tokens={self.config.max_context_tokens} leaves no room for a reply",
        )
        return
      self._give(episode, prompt)
    elif kind == "step":
      step, ids, cut = result
      trajectory.truncated_env_tokens += cut
      if step.done:
        trajectory.finish_reason = "done"
      elif trajectory.num_turns == self.config.max_turns:
        trajectory.finish_reason = "max_turns"
      else:
        self._give(episode, ids)
        return
      self._submit("score", episode, self.workers.score, episode.handle)
    elif kind == "score":
      trajectory.reward = float(result.reward)
      trajectory.success = bool(result.success)
      trajectory.score_details = dict(result.details)
      self._retire(episode)

  def _give(self, episode: _Episode, new_ids: list[int]) -> None:
    """The episode's new tokens go to its row, which owes the next reply (or the episode
    ends on the context limit: the new tokens and one reply token must fit)."""
    trajectory = episode.trajectory
    if len(trajectory.tokens) + len(new_ids) + 1 > self.config.max_context_tokens:
      trajectory.finish_reason = "context"
      self._submit("score", episode, self.workers.score, episode.handle)
      return
    trajectory.append(new_ids, PROMPT_OR_ENV)
    room = self.config.max_context_tokens - len(trajectory.tokens)
    limit = min(self.sampling_config.max_new_tokens, room)
    key = episode.turn_keys[trajectory.num_turns]
    self.policy.give(episode.row, trajectory, new_ids, key, limit)

  def _hand_off(self, reply: policy_lib.PolicyReply) -> None:
    """A finished reply joins its trajectory and goes to the environment at once."""
    episode = self._live[reply.row]
    trajectory = episode.trajectory
    turn = trajectory.num_turns
    trajectory.append(reply.ids, turn, reply.logprobs)
    trajectory.num_turns = turn + 1
    trajectory.truncated_replies += int(reply.cut)
    text = self.chat.tokenizer.decode(reply.ids, skip_special_tokens=True)
    trajectory.replies.append(text)
    closed = bool(reply.ids) and reply.ids[-1] == self.chat.end_of_turn_id
    last = turn + 1 == self.config.max_turns
    self._submit("step", episode, self._step, episode, text, closed, last)

  def _fail(self, episode: _Episode, error: str) -> None:
    episode.trajectory.error = error
    episode.trajectory.finish_reason = "env_error"
    self._retire(episode)

  def _retire(self, episode: _Episode) -> None:
    """The episode leaves its row; a failed one is queued again from the start if it may."""
    if episode.handle is not None:
      self.workers.close(episode.handle)
      episode.handle = None
    self.policy.release(episode.row)
    del self._live[episode.row]
    self._free_rows.append(episode.row)
    old = episode.trajectory
    if old.error is not None and episode.attempt < self.config.episode_retries:
      logging.warning("retrying task %s from the start: %s", old.task_id, old.error)
      fresh = Trajectory(old.task_id, old.group, old.sample)
      fresh.retried_errors = old.retried_errors + [old.error]
      attempt = episode.attempt + 1
      keys = trajectory_keys(
        self._rng, [old.group], [old.sample], [attempt], self.config.max_turns
      )[0]
      self._pending.append(_Episode(fresh, attempt, keys))
      self._retried += 1
      return
    self._final[(old.group, old.sample)] = old

  def _metrics(self, trajectories, num_groups, t_start, stats_before, session_before) -> dict:
    failed_groups = _drop_failed_groups(trajectories)
    if failed_groups and len(failed_groups) > self.config.max_failed_group_fraction * num_groups:
      first = {}
      for t in trajectories:
        if t.error and t.group not in first:
          first[t.group] = f"task {t.task_id!r}: {t.error}"
      errors = list(first.values())[:3]
      raise EnvironmentFailure(
        f"{len(failed_groups)} of {num_groups} task groups failed in one rollout (limit "
        f"{self.config.max_failed_group_fraction:.0%}); first errors: " + "; ".join(errors)
      )
    for t in trajectories:
      if t.error:
        logging.warning("environment failure in task %s: %s", t.task_id, t.error)
    wall = time.perf_counter() - t_start
    metrics = _rollout_metrics(trajectories, wall, self._timers, len(failed_groups))
    metrics["rollout/retried_episodes"] = float(self._retried)
    stats = self.workers.stats
    metrics["rollout/env_stopped_calls"] = float(sum(t.env_stopped_calls for t in trajectories))
    metrics["rollout/env_worker_restarts"] = float(stats.restarts - stats_before.restarts)
    metrics["rollout/env_restores"] = float(stats.restores - stats_before.restores)
    if self.session is not None:
      now, slots = self.session.stats, self.config.decode_slots
      steps = now.decode_steps - session_before.decode_steps
      row_steps = now.decode_row_steps - session_before.decode_row_steps
      generated = metrics["rollout/generated_tokens"]
      metrics["rollout/decode_steps"] = float(steps)
      metrics["rollout/decode_calls"] = float(now.decode_calls - session_before.decode_calls)
      metrics["rollout/prefill_calls"] = float(now.prefill_calls - session_before.prefill_calls)
      # Share of the decode rows that were decoding, over the decode steps run.
      metrics["rollout/slot_occupancy"] = row_steps / (steps * slots) if steps else 0.0
      metrics["rollout/decode_steps_per_token"] = steps / generated if generated else 0.0
      metrics["rollout/cache_slots"] = float(now.peak_cache_slots)
      metrics["rollout/cache_slots_per_live_token"] = (
        now.peak_cache_slots / now.live_tokens_at_peak if now.live_tokens_at_peak else 0.0
      )
    return metrics


def _drop_failed_groups(trajectories: Sequence[Trajectory]) -> set[int]:
  failed = {t.group for t in trajectories if t.error is not None}
  for t in trajectories:
    t.dropped = t.group in failed
  return failed


def _rollout_metrics(trajectories, wall: float, timers: dict, failed_groups: int) -> dict:
  kept = [t for t in trajectories if not t.dropped]
  generated = sum(sum(1 for x in t.turn_ids if x >= 0) for t in trajectories)
  metrics = {
    "rollout/time": wall,
    "rollout/sample_time": timers.sample,
    "rollout/env_wait_time": timers.env_wait,
    "rollout/host_time": timers.host,
    "rollout/env_wait_share": timers.env_wait / wall if wall > 0 else 0.0,
    "rollout/generated_tokens": float(generated),
    "rollout/tokens_per_s": generated / wall if wall > 0 else 0.0,
    "rollout/failed_groups": float(failed_groups),
    "rollout/trajectories": float(len(trajectories)),
  }
  if kept:
    metrics.update(
      {
        "reward": float(np.mean([t.reward for t in kept])),
        "success": float(np.mean([t.success for t in kept])),
        "turns": float(np.mean([t.num_turns for t in kept])),
        "length": float(np.mean([len(t.tokens) for t in kept])),
        "reply_tokens": generated / max(1, sum(t.num_turns for t in trajectories)),
        "truncated_replies": float(sum(t.truncated_replies for t in kept)),
        "truncated_env_tokens": float(sum(t.truncated_env_tokens for t in kept)),
      }
    )
    for reason in FINISH_REASONS:
      metrics[f"finish/{reason}"] = float(
        np.mean([t.finish_reason == reason for t in trajectories])
      )
  return metrics
