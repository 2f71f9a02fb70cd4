"""The rollout engine: episodes of one environment family played by one policy, continuously.

    session = sampling.SamplerSession(model_config, sampling_config, sampling.SessionConfig(...))
    roller = Roller(spec, chat, config=RolloutConfig(max_turns=3), policy=SamplerPolicy(session))
    result = roller.run(params, task_ids, samples_per_task=8, rng=key)
    batch = collate(result.trajectories, num_turns=3, max_len=1024)   # the learner's Batch

One call plays B tasks x n samples = N episodes on the S rows of the policy it is given
(`policy.py`: a `sampling.SamplerSession`, or a text policy), which owns those rows and
reports its counters. The scheduler's loop:

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

Many processes (`Roller(..., processes=distributed.Processes.current())`): every process calls
`run` with the same B tasks and key; each plays its block of the groups (`Processes.block`,
contiguous, in process order) on its own sampler, with the groups' global numbers, so each
trajectory's keys, and so its tokens, are those of a one-process run. `result.trajectories`
are this process's; `result.metrics` are the whole call's (one small all-gather: the
per-trajectory numbers and each process's counters), and the failed-group limit is checked on
the whole call, in every process alike.
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

from seeupo_jax import distributed
from seeupo_jax import fields
from seeupo_jax import sampling
from seeupo_jax.text.chat_tokens import ChatTokens
from seeupo_jax.envs import base as envs_base
from seeupo_jax.learner.batch import PROMPT_OR_ENV
from seeupo_jax.models.config import ModelConfig
from seeupo_jax.rollout import policy as policy_lib
from seeupo_jax.rollout import workers as workers_lib
from seeupo_jax.rollout.keys import trajectory_keys
from seeupo_jax.rollout.metrics import (
  FINISH_REASONS,
  EnvironmentFailure,
  _Counts,
  call_metrics,
  drop_failed_groups,
  first_errors,
)
from seeupo_jax.rollout.trajectory import Trajectory
from seeupo_jax.rollout.truncation import TRUNCATION_MARKER, truncate_observation

SCHEDULERS = ("continuous", "turns")

__all__ = [  # with the names of keys.py, truncation.py and metrics.py it has always exported
  "FINISH_REASONS",
  "SCHEDULERS",
  "TRUNCATION_MARKER",
  "EnvironmentFailure",
  "Roller",
  "RolloutConfig",
  "RolloutResult",
  "trajectory_keys",
  "truncate_observation",
]


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

  The sampler's geometry (its rows, pages, prefill rows and widths, decode steps per sync) is
  the session's (`sampling.SessionConfig`), not the engine's.
  """

  max_turns: int = fields.field(fields.int_at_least(1))
  max_context_tokens: int = fields.field(fields.int_at_least(1), 2048)
  max_env_tokens: int = fields.field(fields.int_at_least(1), 512)
  env_workers: int = fields.field(fields.int_at_least(1), 4)
  env_isolation: str = fields.field(fields.one_of(("auto",) + workers_lib.ISOLATIONS), "auto")
  env_call_timeout_s: float = fields.field(
    fields.allowed_of(workers_lib.WorkerConfig, "call_timeout_s"), 10.0
  )
  env_memory_limit_mb: int = fields.field(
    fields.allowed_of(workers_lib.WorkerConfig, "memory_limit_mb"), 4096
  )
  reset_retries: int = fields.field(fields.int_at_least(0), 2)
  episode_retries: int = fields.field(fields.int_at_least(0), 1)
  max_failed_group_fraction: float = fields.field(fields.number_in(0, 1), 0.25)
  scheduler: str = fields.field(fields.one_of(SCHEDULERS), "continuous")
  # The sampler's geometry given here, as code written before it moved to `SessionConfig` does
  # (`RolloutConfig(max_turns=3, decode_slots=5)`): passed on to `session_config`, where it is
  # declared and checked. Not fields of this config.
  decode_slots: dataclasses.InitVar[Optional[int]] = None
  decode_steps_per_sync: dataclasses.InitVar[Optional[int]] = None
  page_size: dataclasses.InitVar[Optional[int]] = None
  prefill_chunk: dataclasses.InitVar[Optional[int]] = None
  prefill_rows: dataclasses.InitVar[Optional[int]] = None

  def __post_init__(
    self, decode_slots, decode_steps_per_sync, page_size, prefill_chunk, prefill_rows
  ):
    fields.check(self)
    given = dict(
      rows=decode_slots,
      decode_steps_per_sync=decode_steps_per_sync,
      page_size=page_size,
      prefill_chunk=prefill_chunk,
      prefill_rows=prefill_rows,
    )
    # An attribute, not a field: the config's fields stay the engine's own.
    object.__setattr__(self, "_geometry", {k: v for k, v in given.items() if v is not None})

  def worker_config(self, default_isolation: str) -> workers_lib.WorkerConfig:
    """The env workers' config; "auto" isolation becomes `default_isolation` (the spec's)."""
    isolation = default_isolation if self.env_isolation == "auto" else self.env_isolation
    return workers_lib.WorkerConfig(
      isolation=isolation,
      workers=self.env_workers,
      call_timeout_s=self.env_call_timeout_s,
      memory_limit_mb=self.env_memory_limit_mb,
    )

  def session_config(self, **geometry) -> sampling.SessionConfig:
    """A sampler session of this config's `max_context_tokens` and the given geometry
    (`sampling.SessionConfig`'s other fields; then the geometry given to this config; their
    defaults otherwise)."""
    merged = {**self._geometry, **geometry}
    return sampling.SessionConfig(max_context_tokens=self.max_context_tokens, **merged)


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


class Roller:
  """Plays batches of episodes of one environment family with one policy (the engine).

  The Roller drives the `policy.Policy` it is given and holds none of its state: the policy
  owns its rows (the Roller takes and releases them) and reports its counters (`stats`).

      policy = rollout.SamplerPolicy(sampling.SamplerSession(model_config, sc, session_config))
      roller = Roller(spec, chat, config=RolloutConfig(max_turns=3), policy=policy)

  Without `policy`, the Roller is given what builds one (`policy.make_policy`): `model_config`,
  `sampling_config`, `session_config`, `cache_sharding` and `text_policy`.

  Args:
    spec: the environment family (`seeupo_jax.envs.make_spec`).
    chat: the tokenizer's `ChatTokens`.
    model_config: the policy's `ModelConfig` (without `policy`).
    sampling_config: decoding settings; `max_new_tokens` is the reply limit and its stop
      tokens should include the chat template's end of turn (without `policy`).
    config: the `RolloutConfig`.
    policy: the policy to drive (its `slots` the most episodes live at once, its
      `max_reply_tokens` the reply limit).
    session_config: the sampler session's geometry (`sampling.SessionConfig`, its
      `max_context_tokens` at least `config.max_context_tokens`; without `policy`); None: the
      defaults (`config.session_config()`). Its `rows` are the most episodes live at once, for
      a text policy too.
    cache_sharding: optional PagedKVCache -> shardings (see `sampling.SamplerSession`; without
      `policy`).
    workers: the env workers to use (shared, e.g. by training and evaluation; the caller shuts
      them down); None: the Roller makes its own from `config` and `close` shuts them down.
    text_policy: replies from a function instead of the model: trajectory so far -> the reply
      text (scripted tests, the oracle); `run`'s params are then unused and the replies'
      log-probs 0 (`policy.TextPolicy`; without `policy`).
    processes: the run's processes (`distributed.Processes`); each plays its block of every
      call's groups (see the module docstring). None: one process.
  """

  def __init__(
    self,
    spec: envs_base.EnvSpec,
    chat: ChatTokens,
    model_config: Optional[ModelConfig] = None,
    sampling_config: Optional[sampling.SamplingConfig] = None,
    config: Optional[RolloutConfig] = None,
    *,
    policy: Optional[policy_lib.Policy] = None,
    session_config: Optional[sampling.SessionConfig] = None,
    cache_sharding=None,
    workers: Optional[workers_lib.EnvWorkers] = None,
    text_policy: Optional[Callable[[Trajectory], str]] = None,
    processes: Optional[distributed.Processes] = None,
  ):
    if config is None:
      raise TypeError("Roller needs a RolloutConfig (config=)")
    if config.max_turns > spec.max_turns:
      logging.info(
        "RolloutConfig.max_turns=%d exceeds the environment's %d", config.max_turns, spec.max_turns
      )
    self.spec = spec
    self.chat = chat
    self.config = config
    self.processes = processes or distributed.Processes()
    if policy is None:
      session_config = session_config or config.session_config()
      if session_config.max_context_tokens < config.max_context_tokens:
        raise ValueError(
          f"session_config.max_context_tokens={session_config.max_context_tokens} < "
          f"config.max_context_tokens={config.max_context_tokens}"
        )
      policy = policy_lib.make_policy(
        chat,
        model_config,
        sampling_config,
        session_config,
        cache_sharding=cache_sharding,
        text_policy=text_policy,
      )
    elif any(
      x is not None
      for x in (model_config, sampling_config, session_config, cache_sharding, text_policy)
    ):
      raise ValueError(
        "give the Roller a policy or what builds one (model_config, sampling_config, "
        "session_config, cache_sharding, text_policy), not both"
      )
    self.policy: policy_lib.Policy = policy
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
  def session(self) -> Optional[sampling.SamplerSession]:
    """The sampler session of a `SamplerPolicy` (None for other policies)."""
    return getattr(self.policy, "session", None)

  @property
  def cache_slots(self) -> int:
    """The most KV-cache slots the policy's rows held at once (0 for a text policy)."""
    stats = self.policy.stats()
    return 0 if stats is None else stats.peak_cache_slots

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
    return handle, reset.tools, self.chat.prompt_ids(reset.messages, reset.tools), reset.state

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
    self,
    params,
    task_ids: Sequence[str],
    samples_per_task: int,
    rng: jax.Array,
    *,
    on_env_wait: Optional[Callable[[], None]] = None,
    version: int = 0,
    refresh: Optional[Callable[[], Optional[tuple]]] = None,
  ) -> RolloutResult:
    """Plays len(task_ids) x samples_per_task episodes; returns them with timing metrics.

    With many processes, this process plays its block of the groups (the trajectories
    returned); the metrics are the whole call's.

    Args:
      params: the policy's params.
      task_ids: the B tasks of this call (group g = task g).
      samples_per_task: n, trajectories per task.
      rng: a PRNG key.
      on_env_wait: called once, the first time the policy has decoded a round and then has
        nothing to do but wait for the environments' answers (not called if that never
        happens): the training loop dispatches an update there, whose device time then
        overlaps the environments' time (`pipeline.lag`). What it does must not change the
        sampler's device state: the trajectories are the same with or without it.
      version: the version of `params` (the updates they have seen): each reply token's
        `Trajectory.versions` entry.
      refresh: partial rollouts (`pipeline.partial_rollouts`): called between the policy's
        rounds (no device work of the sampler in flight); where it returns (params, version),
        every later token is sampled with those params, also inside the episodes and replies
        in progress (`Policy.swap`), and tagged with that version. None: no swap.
    """
    t_start = time.perf_counter()
    self._timers = _Timers()
    self._on_env_wait = on_env_wait
    self._version = version
    self._refresh = refresh
    self._decoded = False  # a decode round has run (the first env wait before it is resets')
    self._rng = rng
    stats_before = dataclasses.replace(self.workers.stats)
    policy_before = self.policy.stats()
    trajectories = [
      Trajectory(task_ids[group], group, sample)
      for group in self.processes.block(len(task_ids))
      for sample in range(samples_per_task)
    ]
    keys = (
      trajectory_keys(
        rng,
        [t.group for t in trajectories],
        [t.sample for t in trajectories],
        [0] * len(trajectories),
        self.config.max_turns,
      )
      if trajectories
      else []
    )
    self._final: dict[tuple[int, int], Trajectory] = {}
    self._retried = 0
    capacity = None if self.spec.capacity is None else int(self.spec.capacity())
    if capacity is not None and capacity < 1:
      raise EnvironmentFailure("the environment can run no episode now (capacity 0)")
    rows = self.policy.slots
    most_live = rows if capacity is None else min(capacity, rows)
    self._schedule(
      params,  # of `version`
      collections.deque(_Episode(t, 0, k) for t, k in zip(trajectories, keys)),
      most_live,
    )
    trajectories = [self._final[(t.group, t.sample)] for t in trajectories]
    return RolloutResult(
      trajectories,
      self._metrics(trajectories, len(task_ids), t_start, stats_before, policy_before),
    )

  def _schedule(self, params, pending: collections.deque, most_live: int) -> None:
    """The main loop (see the module docstring); at most `most_live` episodes at once."""
    self._inbox: queue.SimpleQueue = queue.SimpleQueue()
    self._in_flight = 0
    self._just_handed = 0  # steps submitted by the last hand-off
    self._step_seconds = 0.0  # moving average of a step's latency
    self._policy_seconds = 0.0  # moving average of one prefill + decode round
    self._held: list = []  # env results held by the turns barrier
    self._pending = pending
    self._most_live = most_live
    self._live: dict[int, _Episode] = {}  # the policy's row -> its episode
    barrier = self.config.scheduler == "turns"
    self.policy.begin(params, self._version)
    while self._pending or self._live:
      t_host, waited_before = time.perf_counter(), self._timers.env_wait
      if self._refresh is not None:
        newer = self._refresh()
        if newer is not None:  # a partial rollout: later tokens from the newer params
          params, self._version = newer
          self.policy.swap(params, self._version)
      at_barrier = barrier and self._in_flight == 0 and not self.policy.busy
      if not barrier or at_barrier:
        self._admit()
      self._take_env_results(barrier, at_barrier)
      # The host's time, less the env wait inside (counted once, as env wait).
      waited = self._timers.env_wait - waited_before
      self._timers.host += time.perf_counter() - t_host - waited
      t_sample = time.perf_counter()
      self.policy.prefill()
      replies = self.policy.decode()
      seconds = time.perf_counter() - t_sample
      self._timers.sample += seconds
      self._policy_seconds = 0.9 * self._policy_seconds + 0.1 * seconds
      self._decoded = self._decoded or bool(replies)
      t_host = time.perf_counter()
      self._just_handed = len(replies)
      for reply in replies:
        self._hand_off(reply)
      self._timers.host += time.perf_counter() - t_host

  def _admit(self) -> None:
    """Free rows take pending episodes; their resets go to the env workers."""
    while self._pending and len(self._live) < self._most_live and self.policy.free:
      episode = self._pending.popleft()
      episode.row = self.policy.take()
      self._live[episode.row] = episode
      self._submit("reset", episode, self._reset, episode.trajectory.task_id)

  def _take_env_results(self, barrier: bool, at_barrier: bool) -> None:
    """Handles the environment results that came back; blocks only when the policy has
    nothing to do (the time counts as env wait). The turns barrier holds resets' and steps'
    results until no call is in flight and no reply is being decoded."""
    results = []
    if not self.policy.busy and self._in_flight and not (barrier and self._held and at_barrier):
      if self._on_env_wait is not None and self._decoded:
        hook, self._on_env_wait = self._on_env_wait, None
        hook()
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
      episode.handle, episode.tools, prompt, state = result
      trajectory.turn_states.append(state)
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
      trajectory.turn_rewards.append(step.reward)
      if step.done:
        trajectory.finish_reason = "done"
      elif trajectory.num_turns == self.config.max_turns:
        trajectory.finish_reason = "max_turns"
      else:
        trajectory.turn_states.append(step.state)
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
    limit = min(self.policy.max_reply_tokens, room)
    key = episode.turn_keys[trajectory.num_turns]
    self.policy.give(episode.row, trajectory, new_ids, key, limit)

  def _hand_off(self, reply: policy_lib.PolicyReply) -> None:
    """A finished reply joins its trajectory and goes to the environment at once."""
    episode = self._live[reply.row]
    trajectory = episode.trajectory
    turn = trajectory.num_turns
    versions = reply.versions or [self._version] * len(reply.ids)
    trajectory.append(reply.ids, turn, reply.logprobs, versions)
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

  def _metrics(self, trajectories, num_groups, t_start, stats_before, policy_before) -> dict:
    """The call's metrics (all processes'); raises `EnvironmentFailure` past the limit."""
    failed_groups = drop_failed_groups(trajectories)
    counts = _Counts(
      wall=time.perf_counter() - t_start,
      sample=self._timers.sample,
      env_wait=self._timers.env_wait,
      host=self._timers.host,
      failed_groups=len(failed_groups),
      errors=first_errors(trajectories),
      retried=self._retried,
      restarts=self.workers.stats.restarts - stats_before.restarts,
      restores=self.workers.stats.restores - stats_before.restores,
    )
    now = self.policy.stats()
    if now is not None:
      counts.policy, counts.slots = now.since(policy_before), self.policy.slots
    return call_metrics(
      trajectories,
      counts,
      num_groups=num_groups,
      max_failed_group_fraction=self.config.max_failed_group_fraction,
      processes=self.processes,
    )
