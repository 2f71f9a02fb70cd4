"""The rollout loop: a batch of environments driven turn by turn by the jitted sampler.

    roller = Roller(spec, chat, model_config, sampling_config, RolloutConfig(max_turns=3))
    result = roller.run(params, task_ids, samples_per_task=8, rng=key)
    batch = collate(result.trajectories, num_turns=3, max_len=1024)   # the learner's Batch

One call runs B tasks x n samples = N trajectories:

  1. reset every environment (thread pool) and render its opening messages
     with the chat template (`ChatTokens.prompt_ids`);
  2. each turn: the sampler continues every running trajectory from its kept
     KV cache, prefilling only the new tokens (`sampling.make_continuer`); the
     decoded replies go to the environments (thread pool), whose observations
     are rendered and tokenized in the worker threads, ready to append;
  3. at the end (done, a limit, or the turn limit) each environment scores its
     episode.

Token in, token out: a trajectory's tokens are the prompt's, then each reply's
sampled ids with the sampler's log-probs (`turn_ids` = the turn), then each
observation's ids (`turn_ids` -1). No text is ever tokenized back into a reply.

Limits (all end a trajectory cleanly, with the reward its environment gives
for where it stopped and a finish reason kept in its metadata):
  - max_turns: "max_turns" after the last allowed reply;
  - max_context_tokens: "context" when the next observation and at least one
    reply token no longer fit (the observation is not added);
  - max_reply_tokens (the sampler's max_new_tokens, also cut to the context
    left): the reply is cut and the environment sees the cut text; counted;
  - max_env_tokens: each turn's observation text is cut to this many tokens
    with `TRUNCATION_MARKER`; counted.

Capacity: an environment family that can hold only so many episodes at once
(`EnvSpec.capacity`, e.g. one AppWorld server per episode) gets them in waves,
each a sampler pass of its own.

Environment calls go through the env workers (`workers.py`): in this process
("thread") or in worker processes with a time limit per call ("process"; BFCL's
default). A reply whose call runs past `env_call_timeout_s` (or out of memory) is
the model's doing: it gets an error observation and the episode goes on
(counted: `rollout/env_stopped_calls`).

Environment failures: the environment's own faults (`workers.EnvCallFailed`: an
exception in `reset`, `step` or `score`, a worker that died during a call, a
`reset`/`score` past its limit) fail that trajectory; `reset` is retried on a
fresh instance first (`reset_retries`).
A failed episode is then played again from the start on a fresh environment
instance (`episode_retries` times; the retries run as one more sampler pass
after the others finish, with the same policy, so they are fair samples of
their group). If it still fails ("env_error"), every trajectory of its task's
group is dropped (`row_valid` False), so no group's advantages are computed
from a biased subset, and the failure is counted and logged. If more than
`max_failed_group_fraction` of the groups fail in one call,
`EnvironmentFailure` is raised with the first errors: a broken environment
server surfaces as an error, never as zero rewards.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Callable, Optional, Sequence

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from seeupo_jax import sampling
from seeupo_jax.chat_tokens import ChatTokens
from seeupo_jax.envs import base as envs_base
from seeupo_jax.learner.batch import PROMPT_OR_ENV
from seeupo_jax.models.config import ModelConfig
from seeupo_jax.rollout import workers as workers_lib
from seeupo_jax.rollout.trajectory import Trajectory
from seeupo_jax.rollout.trajectory import bucket as _bucket

TRUNCATION_MARKER = "\n[... observation truncated]"
FINISH_REASONS = ("done", "max_turns", "context", "env_error")


class EnvironmentFailure(RuntimeError):
  """Too many environments failed in one rollout call (see the module docstring)."""


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """Limits and plumbing of the rollout loop (validated on construction).

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
  token_bucket: widths of the new-token blocks are rounded up to a multiple of this
    (fewer distinct shapes to compile).
  cache_bucket: the KV cache starts at the first turn's size and grows as the
    conversations do, in multiples of this many slots (each decode step attends over
    every slot, so a cache sized for the longest possible episode would cost its full
    width from the first token).
  min_row_bucket: the sampler's batch shrinks as trajectories finish, in powers of two
    down to this many rows (finished trajectories stop costing decode work).
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
  token_bucket: int = 32
  cache_bucket: int = 128
  min_row_bucket: int = 8

  def __post_init__(self):
    for name in ("max_turns", "max_context_tokens", "max_env_tokens", "env_workers"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"RolloutConfig.{name} must be an int >= 1, got {value!r}")
    for name in ("reset_retries", "episode_retries"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 0:
        raise ValueError(f"RolloutConfig.{name} must be an int >= 0, got {value!r}")
    for name in ("token_bucket", "cache_bucket", "min_row_bucket"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"RolloutConfig.{name} must be an int >= 1, got {value!r}")
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


@dataclasses.dataclass
class RolloutResult:
  trajectories: list[Trajectory]
  metrics: dict[str, float]


@dataclasses.dataclass
class _Slot:
  """Host-side state of one running trajectory."""

  trajectory: Trajectory
  episode: Optional[workers_lib.Episode] = None  # its environment, in the env workers
  tools: Optional[list] = None
  new_ids: list[int] = dataclasses.field(default_factory=list)  # tokens to prefill next
  running: bool = True


def _row_bucket(n: int, minimum: int) -> int:
  size = minimum
  while size < n:
    size *= 2
  return size


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
  """Runs batches of episodes of one environment family with one policy.

  Args:
    spec: the environment family (`seeupo_jax.envs.make_spec`).
    chat: the tokenizer's `ChatTokens`.
    model_config: the policy's `ModelConfig`.
    sampling_config: decoding settings; `max_new_tokens` is the reply limit and
      its stop tokens should include the chat template's end of turn.
    config: the `RolloutConfig`.
    cache_sharding: optional KVCache -> shardings (see `sampling.make_sampler`).
    workers: the env workers to use (shared, e.g. by training and evaluation; the caller shuts
      them down); None: the Roller makes its own from `config` and `close` shuts them down.
    text_policy: replies from a function instead of the model: trajectory so far -> the reply
      text (scripted tests, the oracle); `run`'s params are then unused and the replies'
      log-probs 0. The replies are tokenized (no model sampled them) and closed with the
      end-of-turn token.
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
    self.continue_sample = sampling.make_continuer(
      model_config, sampling_config, cache_sharding=cache_sharding
    )
    self.compact = jax.jit(sampling.compact_context)
    self.take_rows = jax.jit(sampling.take_context_rows)
    self.grow = jax.jit(sampling.grow_context, static_argnums=1)
    # The most slots a call can need after compaction: the longest context, the widest
    # observation block, one reply, the pending token.
    obs_width = _bucket(config.max_env_tokens + 128, config.token_bucket)
    self.max_capacity = _bucket(
      _bucket(config.max_context_tokens, config.token_bucket)
      + obs_width
      + sampling_config.max_new_tokens
      + 1,
      config.cache_bucket,
    )
    self.cache_slots = 0  # the KV cache's slots at the end of the last `run` (grown as needed)
    self.text_policy = text_policy
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

  # --- environment calls (worker threads) -----------------------------------------------------

  def _map(self, fn, jobs):
    """Runs fn(*args) for each (slot, args) job on the pool; yields (slot, result, error).

    The jobs go out in `env_workers` chunks (one future per chunk, not per job:
    hundreds of tiny futures cost more than cheap environments do), and each
    chunk's results come back as soon as it finishes. With worker processes, a
    chunk holds the jobs of one worker (whose calls run one at a time anyway).
    `error` is the message of an `EnvCallFailed` (the environment's fault);
    anything else is a bug and raises.
    """

    def run_chunk(chunk):
      out = []
      for slot, args in chunk:
        try:
          out.append((slot, fn(*args), None))
        except workers_lib.EnvCallFailed as e:
          out.append((slot, None, str(e)))
      return out

    by_worker: dict[int, list] = {}
    for job in jobs:
      episode = job[0].episode
      worker = None if episode is None else self.workers.affinity(episode)
      by_worker.setdefault(-1 if worker is None else worker, []).append(job)
    unplaced = by_worker.pop(-1, [])
    size = -(-len(unplaced) // self.config.env_workers) if unplaced else 1
    chunks = [unplaced[k : k + size] for k in range(0, len(unplaced), size)]
    chunks += list(by_worker.values())
    futures = [self._pool.submit(run_chunk, chunk) for chunk in chunks]
    for future in concurrent.futures.as_completed(futures):
      yield from future.result()

  def _reset(self, task_id: str):
    """A fresh episode, its prompt ids and tools; retried on fresh instances."""
    for attempt in range(self.config.reset_retries + 1):
      try:
        episode, reset = self.workers.reset(task_id)
        break
      except workers_lib.EnvCallFailed:
        if attempt == self.config.reset_retries:
          raise
    return episode, reset.tools, self.chat.prompt_ids(reset.messages, reset.tools)

  def _step(self, slot: _Slot, text: str, reply_closed: bool, last_turn: bool):
    """env.step + the observation's ids (cut to max_env_tokens); runs in a pool thread."""
    step = self.workers.step(slot.episode, text)
    if step.info.get("stopped"):
      slot.trajectory.env_stopped_calls += 1
    if step.done or last_turn:
      return step, [], 0
    observation, cut = truncate_observation(
      step.observation, self.config.max_env_tokens, self.chat.encode, self.chat.tokenizer.decode
    )
    ids = self.chat.observation_ids(observation, slot.tools, reply_closed=reply_closed)
    return step, ids, cut

  def _score(self, slot: _Slot):
    return self.workers.score(slot.episode)

  # --- the loop ---------------------------------------------------------------------------------

  def run(
    self, params, task_ids: Sequence[str], samples_per_task: int, rng: jax.Array
  ) -> RolloutResult:
    """Runs len(task_ids) x samples_per_task episodes; returns them with timing metrics.

    Args:
      params: the policy's params.
      task_ids: the B tasks of this call (group g = task g).
      samples_per_task: n, trajectories per task.
      rng: a PRNG key.
    """
    t_start = time.perf_counter()
    timers = {"sample": 0.0, "env_wait": 0.0, "host": 0.0}
    stats_before = dataclasses.replace(self.workers.stats)
    slots = [
      _Slot(Trajectory(task_id, group, sample))
      for group, task_id in enumerate(task_ids)
      for sample in range(samples_per_task)
    ]
    pending, retried, passes = list(range(len(slots))), 0, 0
    context = None
    for attempt in range(self.config.episode_retries + 1):
      for wave in self._waves(pending):
        # The first pass samples from `rng` itself (a call without retries or waves draws what
        # it always drew); later passes from keys folded in from their index.
        pass_key = rng if passes == 0 else jax.random.fold_in(rng, passes)
        context = self._play([slots[i] for i in wave], params, pass_key, timers) or context
        passes += 1
      pending = [i for i in pending if slots[i].trajectory.error is not None]
      if not pending or attempt == self.config.episode_retries:
        break
      for i in pending:  # start over on a fresh environment
        old = slots[i].trajectory
        logging.warning("retrying task %s from the start: %s", old.task_id, old.error)
        fresh = Trajectory(old.task_id, old.group, old.sample)
        fresh.retried_errors = old.retried_errors + [old.error]
        slots[i] = _Slot(fresh)
        retried += 1

    trajectories = [s.trajectory for s in slots]
    failed_groups = _drop_failed_groups(trajectories)
    num_groups = len(task_ids)
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
    metrics = _rollout_metrics(trajectories, wall, timers, len(failed_groups))
    metrics["rollout/retried_episodes"] = float(retried)
    metrics["rollout/passes"] = float(passes)  # sampler passes: the waves, then the retries' waves
    self.cache_slots = 0 if context is None else context.capacity
    metrics["rollout/cache_slots"] = float(self.cache_slots)
    stats = self.workers.stats
    metrics["rollout/env_stopped_calls"] = float(sum(t.env_stopped_calls for t in trajectories))
    metrics["rollout/env_worker_restarts"] = float(stats.restarts - stats_before.restarts)
    metrics["rollout/env_restores"] = float(stats.restores - stats_before.restores)
    return RolloutResult(trajectories=trajectories, metrics=metrics)

  def _waves(self, pending: list[int]) -> list[list[int]]:
    """`pending` (slot indices, group by group) in waves of at most `EnvSpec.capacity()`."""
    capacity = len(pending) if self.spec.capacity is None else int(self.spec.capacity())
    if capacity < 1:
      raise EnvironmentFailure("the environment can run no episode now (capacity 0)")
    if capacity >= len(pending):
      return [pending] if pending else []
    logging.info("%d episodes in waves of at most %d", len(pending), capacity)
    return [pending[k : k + capacity] for k in range(0, len(pending), capacity)]

  def _play(self, slots: list[_Slot], params, rng: jax.Array, timers: dict):
    """Plays the slots' episodes to the end (reset, turns, score, close); returns the context."""
    t0 = time.perf_counter()
    for slot, result, error in self._map(
      self._reset, [(s, (s.trajectory.task_id,)) for s in slots]
    ):
      if error is not None:
        _fail(slot, error)
        continue
      slot.episode, slot.tools, slot.new_ids = result
      if len(slot.new_ids) + 1 > self.config.max_context_tokens:
        _fail(
          slot,
          f"the prompt of task {slot.trajectory.task_id!r} has {len(slot.new_ids)} tokens; "
          f"max_context_tokens={self.config.max_context_tokens} leaves no room for a reply",
        )
    timers["env_wait"] += time.perf_counter() - t0

    context_rows: list[int] = []  # slot index of each context row (-1: a filler row)
    context = None
    eot = self.chat.end_of_turn_id
    for turn in range(self.config.max_turns):
      t_host = time.perf_counter()
      for slot in slots:  # the context limit: the new tokens and one reply token must fit
        if slot.running and (
          len(slot.trajectory.tokens) + len(slot.new_ids) + 1 > self.config.max_context_tokens
        ):
          slot.running = False
          slot.trajectory.finish_reason = "context"
      running = [i for i, s in enumerate(slots) if s.running]
      if not running:
        break
      timers["host"] += time.perf_counter() - t_host
      if self.text_policy is None:
        rng, turn_key = jax.random.split(rng)
        context, context_rows, replies = self._sample_replies(
          slots, running, context, context_rows, params, turn_key, timers
        )
      else:
        replies = self._text_replies(slots, running)

      t_host = time.perf_counter()
      jobs = []
      for i, reply, logprobs, cut in replies:
        slot, trajectory = slots[i], slots[i].trajectory
        trajectory.append(reply, turn, logprobs)
        trajectory.num_turns = turn + 1
        closed = bool(reply) and reply[-1] == eot
        trajectory.truncated_replies += int(cut)
        text = self.chat.tokenizer.decode(reply, skip_special_tokens=True)
        trajectory.replies.append(text)
        last = turn + 1 == self.config.max_turns
        jobs.append((slot, (slot, text, closed, last)))
      timers["host"] += time.perf_counter() - t_host

      t_wait = time.perf_counter()
      for slot, result, error in self._map(self._step, jobs):
        if error is not None:
          _fail(slot, error)
          continue
        step, ids, cut = result
        slot.trajectory.truncated_env_tokens += cut
        if step.done:
          slot.running = False
          slot.trajectory.finish_reason = "done"
        elif turn + 1 == self.config.max_turns:
          slot.running = False
          slot.trajectory.finish_reason = "max_turns"
        else:
          slot.new_ids = ids
      timers["env_wait"] += time.perf_counter() - t_wait

    # Score every episode that did not fail.
    t_wait = time.perf_counter()
    jobs = [(s, (s,)) for s in slots if s.episode is not None and s.trajectory.error is None]
    for slot, score, error in self._map(self._score, jobs):
      if error is not None:
        _fail(slot, error)
        continue
      slot.trajectory.reward = float(score.reward)
      slot.trajectory.success = bool(score.success)
      slot.trajectory.score_details = dict(score.details)
    timers["env_wait"] += time.perf_counter() - t_wait
    for slot in slots:
      if slot.episode is not None:
        self.workers.close(slot.episode)
        slot.episode = None
      if slot.running:  # never happens: the turn loop ends every trajectory
        slot.trajectory.finish_reason = slot.trajectory.finish_reason or "max_turns"
    return context

  def _sample_replies(self, slots, running, context, context_rows, params, key, timers):
    """One sampler call for the running slots: their new tokens prefilled, a reply decoded.

    Returns (context, context_rows, [(slot index, reply ids, their log-probs, cut)]).
    """
    t_host = time.perf_counter()
    context, context_rows = self._arrange(context, context_rows, running)
    rows = len(context_rows)
    width = _bucket(max(len(slots[i].new_ids) for i in running), self.config.token_bucket)
    new_ids = np.zeros((rows, width), np.int32)
    new_valid = np.zeros((rows, width), bool)
    limits = np.zeros((rows,), np.int32)
    is_running = np.zeros((rows,), bool)
    for r, i in enumerate(context_rows):
      if i < 0 or not slots[i].running:  # a filler row, or a finished trajectory
        continue
      slot = slots[i]
      ids = slot.new_ids
      new_ids[r, width - len(ids) :] = ids  # left padding
      new_valid[r, width - len(ids) :] = True
      slot.trajectory.append(ids, PROMPT_OR_ENV)
      slot.new_ids = []
      room = self.config.max_context_tokens - len(slot.trajectory.tokens)
      limits[r] = min(self.sampling_config.max_new_tokens, room)
      is_running[r] = True
    context = self._make_room(context, width)
    timers["host"] += time.perf_counter() - t_host

    t_sample = time.perf_counter()
    output, context = self.continue_sample(
      params,
      context,
      jnp.asarray(new_ids),
      jnp.asarray(new_valid),
      key,
      max_new_tokens=jnp.asarray(limits),
    )
    out = jax.device_get(output)
    timers["sample"] += time.perf_counter() - t_sample
    replies = []
    for r, i in enumerate(context_rows):
      if is_running[r]:
        n = int(out.lengths[r])
        cut = out.finish_reason[r] == int(sampling.FinishReason.LENGTH)
        replies.append((i, out.tokens[r, :n].tolist(), out.logprobs[r, :n].tolist(), cut))
    return context, context_rows, replies

  def _text_replies(self, slots, running):
    """The text policy's reply for each running slot, as ids closed by the end of turn (cut,
    without it, to the reply and context limits); log-probs 0 (no model sampled them)."""
    replies = []
    for i in running:
      trajectory = slots[i].trajectory
      trajectory.append(slots[i].new_ids, PROMPT_OR_ENV)
      slots[i].new_ids = []
      ids = self.chat.encode(self.text_policy(trajectory)) + [self.chat.end_of_turn_id]
      room = self.config.max_context_tokens - len(trajectory.tokens)
      limit = min(self.sampling_config.max_new_tokens, room)
      replies.append((i, ids[:limit], None, len(ids) > limit))
    return replies

  def _make_room(self, context, width: int):
    """Compacts, then grows, the cache until the next call fits (see `cache_bucket`)."""
    needed = sampling.slots_needed(context, width, self.sampling_config.max_new_tokens)
    if int(context.cache.index) + needed <= context.capacity:
      return context
    context = self.compact(context)
    end = int(context.cache.index) + needed
    if end > context.capacity:
      capacity = _bucket(end, self.config.cache_bucket)
      if capacity > self.max_capacity:  # cannot happen within the context limit
        raise RuntimeError(f"the rollout needs {capacity} cache slots > {self.max_capacity}")
      context = self.grow(context, capacity)
    return context

  def _arrange(self, context, context_rows, running):
    """The context batch for this turn: created, or shrunk to the running rows' bucket."""
    bucket = _row_bucket(len(running), self.config.min_row_bucket)
    if context is None:
      rows = running + [running[0]] * (bucket - len(running))
      rows = [i if k < len(running) else -1 for k, i in enumerate(rows)]
      context = sampling.init_context(self.model_config, bucket, self.config.cache_bucket)
      return context, rows
    if bucket >= len(context_rows):
      return context, context_rows
    where = {i: r for r, i in enumerate(context_rows) if i >= 0}
    keep = [where[i] for i in running] + [where[running[0]]] * (bucket - len(running))
    context = self.take_rows(context, jnp.asarray(keep, jnp.int32))
    rows = running + [-1] * (bucket - len(running))
    return context, rows


def _fail(slot: _Slot, error: str) -> None:
  slot.running = False
  slot.trajectory.error = error
  slot.trajectory.finish_reason = "env_error"


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
    "rollout/sample_time": timers["sample"],
    "rollout/env_wait_time": timers["env_wait"],
    "rollout/host_time": timers["host"],
    "rollout/env_wait_share": timers["env_wait"] / wall if wall > 0 else 0.0,
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
