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

Environment failures: an exception in `reset`, `step` or `score` fails that
trajectory; `reset` is retried on a fresh instance first (`reset_retries`).
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
import traceback
from typing import Any, Callable, Optional, Sequence

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from seeupo_jax import sampling
from seeupo_jax.chat_tokens import ChatTokens
from seeupo_jax.envs import base as envs_base
from seeupo_jax.learner.batch import PROMPT_OR_ENV
from seeupo_jax.models.config import ModelConfig
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
  env_workers: threads running environment calls.
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
    if not 0.0 <= self.max_failed_group_fraction <= 1.0:
      raise ValueError(
        "RolloutConfig.max_failed_group_fraction must be in [0, 1], got "
        f"{self.max_failed_group_fraction!r}"
      )


@dataclasses.dataclass
class RolloutResult:
  trajectories: list[Trajectory]
  metrics: dict[str, float]


@dataclasses.dataclass
class _Slot:
  """Host-side state of one running trajectory."""

  trajectory: Trajectory
  env: Any = None
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
    self._pool = concurrent.futures.ThreadPoolExecutor(
      max_workers=config.env_workers, thread_name_prefix="env"
    )

  def close(self) -> None:
    self._pool.shutdown(wait=True)

  # --- environment calls (worker threads) -----------------------------------------------------

  def _map(self, fn, jobs):
    """Runs fn(*args) for each (slot, args) job on the pool; yields (slot, result, error).

    The jobs go out in `env_workers` chunks (one future per chunk, not per job:
    hundreds of tiny futures cost more than cheap environments do), and each
    chunk's results come back as soon as it finishes. `error` is the message of
    an `_EnvCallFailed` (the environment's fault); anything else is a bug and raises.
    """

    def run_chunk(chunk):
      out = []
      for slot, args in chunk:
        try:
          out.append((slot, fn(*args), None))
        except _EnvCallFailed as e:
          out.append((slot, None, str(e)))
      return out

    size = -(-len(jobs) // self.config.env_workers) if jobs else 1
    chunks = [jobs[k : k + size] for k in range(0, len(jobs), size)]
    futures = [self._pool.submit(run_chunk, chunk) for chunk in chunks]
    for future in concurrent.futures.as_completed(futures):
      yield from future.result()

  def _reset(self, task_id: str):
    """A fresh environment, its prompt ids and tools; retried on fresh instances."""
    last_error = None
    for _ in range(self.config.reset_retries + 1):
      env = None
      try:
        env = self.spec.make()
        reset = env.reset(task_id)
        return env, reset.tools, self.chat.prompt_ids(reset.messages, reset.tools)
      except Exception:  # pylint: disable=broad-except
        last_error = traceback.format_exc(limit=4)
        if env is not None:
          _close_quietly(env)
    raise _EnvCallFailed(f"reset({task_id!r}) failed: {last_error}")

  def _step(self, slot: _Slot, text: str, reply_closed: bool, last_turn: bool):
    """env.step + the observation's ids (cut to max_env_tokens); runs in a worker thread."""
    try:
      step = slot.env.step(text)
    except Exception:  # pylint: disable=broad-except
      raise _EnvCallFailed(f"step failed: {traceback.format_exc(limit=4)}") from None
    if step.done or last_turn:
      return step, [], 0
    observation, cut = truncate_observation(
      step.observation, self.config.max_env_tokens, self.chat.encode, self.chat.tokenizer.decode
    )
    ids = self.chat.observation_ids(observation, slot.tools, reply_closed=reply_closed)
    return step, ids, cut

  def _score(self, slot: _Slot):
    try:
      return slot.env.score()
    except Exception:  # pylint: disable=broad-except
      raise _EnvCallFailed(f"score failed: {traceback.format_exc(limit=4)}") from None

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
        f"{self.config.max_failed_group_fraction:.0%}); first errors:\n" + "\n".join(errors)
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
      slot.env, slot.tools, slot.new_ids = result
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
      rng, turn_key = jax.random.split(rng)
      output, context = self.continue_sample(
        params,
        context,
        jnp.asarray(new_ids),
        jnp.asarray(new_valid),
        turn_key,
        max_new_tokens=jnp.asarray(limits),
      )
      out = jax.device_get(output)
      timers["sample"] += time.perf_counter() - t_sample

      t_host = time.perf_counter()
      jobs = []
      for r, i in enumerate(context_rows):
        if not is_running[r]:
          continue
        slot, trajectory = slots[i], slots[i].trajectory
        n = int(out.lengths[r])
        reply = out.tokens[r, :n].tolist()
        trajectory.append(reply, turn, out.logprobs[r, :n].tolist())
        trajectory.num_turns = turn + 1
        closed = n > 0 and reply[-1] == eot
        if out.finish_reason[r] == int(sampling.FinishReason.LENGTH):
          trajectory.truncated_replies += 1
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
    jobs = [(s, (s,)) for s in slots if s.env is not None and s.trajectory.error is None]
    for slot, score, error in self._map(self._score, jobs):
      if error is not None:
        _fail(slot, error)
        continue
      slot.trajectory.reward = float(score.reward)
      slot.trajectory.success = bool(score.success)
      slot.trajectory.score_details = dict(score.details)
    timers["env_wait"] += time.perf_counter() - t_wait
    for slot in slots:
      if slot.env is not None:
        _close_quietly(slot.env)
        slot.env = None
      if slot.running:  # never happens: the turn loop ends every trajectory
        slot.trajectory.finish_reason = slot.trajectory.finish_reason or "max_turns"
    return context

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


class _EnvCallFailed(Exception):
  pass


def _fail(slot: _Slot, error: str) -> None:
  slot.running = False
  slot.trajectory.error = error
  slot.trajectory.finish_reason = "env_error"


def _close_quietly(env) -> None:
  try:
    env.close()
  except Exception:  # pylint: disable=broad-except
    logging.warning("environment close() failed: %s", traceback.format_exc(limit=2))


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
