"""The rollout engine: continuous scheduling, the turns barrier, determinism whatever the timing,
cache memory, and text policies."""

import itertools
import random
import re
import threading
import time

import jax
import numpy as np
import pytest

from seeupo_jax import envs, rollout, sampling
from seeupo_jax.text import tokenizer as tokenizer_lib
from seeupo_jax.envs import base
from seeupo_jax.models import qwen
import tiny

MODEL = tiny.model_config()


@pytest.fixture(scope="module")
def params():
  return qwen.init_params(MODEL, jax.random.key(0))


class TimedEnv:
  """Task "<turns>/<obs words>": done after <turns> replies, observations of <obs words> words.

  Each step may sleep (`jitter`) and logs (task, turn, start, end), where start and end are
  the step's places in the order of all steps' starts and ends (an event counter, not a
  clock); the observation echoes the reply's length so that the next turn depends on what was
  sampled.
  """

  log = []
  lock = threading.Lock()
  events = itertools.count()  # the order of the steps' starts and ends
  jitter = None  # None: no sleep; else a random.Random drawing the sleeps

  def reset(self, task_id):
    self.task_id, (turns, words) = task_id, task_id.split("/")[:2]
    self.turns, self.words, self.replies = int(turns), int(words), []
    return base.Reset([{"role": "user", "content": f"task {task_id}"}])

  def step(self, text):
    with TimedEnv.lock:
      start = next(TimedEnv.events)
    if TimedEnv.jitter is not None:
      with TimedEnv.lock:
        pause = TimedEnv.jitter.expovariate(1 / 0.004)
      time.sleep(pause)
    self.replies.append(text)
    with TimedEnv.lock:
      TimedEnv.log.append((self.task_id, len(self.replies), start, next(TimedEnv.events)))
    done = len(self.replies) >= self.turns
    words = " ".join(["word"] * self.words)
    obs = [] if done else [{"role": "tool", "content": f"{len(text)} {words}"}]
    return base.Step(obs, done, {})

  def score(self):
    return base.Score(float(len(self.replies)), True, {})

  def close(self):
    pass


class SlowTaskEnv(TimedEnv):
  """Tasks whose id ends with "/slow" sleep 0.4 s per step; the others do not.

  With `fast_finished` set to an unset threading.Event and `fast_left` to the number of the
  other tasks, the slow task's first step first waits for the event (recording in
  `waited_for_fast` whether it came within `WAIT_S`), and the other tasks' last steps set it
  once all of them have ended.
  """

  WAIT_S = 120.0  # only ends a wait for an event that never comes
  fast_finished = None
  fast_left = 0
  waited_for_fast = None

  def step(self, text):
    slow = self.task_id.endswith("/slow")
    if slow and not self.replies and SlowTaskEnv.fast_finished is not None:
      SlowTaskEnv.waited_for_fast = SlowTaskEnv.fast_finished.wait(SlowTaskEnv.WAIT_S)
    if slow:
      time.sleep(0.4)
    result = super().step(text)
    if not slow and result.done and SlowTaskEnv.fast_finished is not None:
      with TimedEnv.lock:
        SlowTaskEnv.fast_left -= 1
        if SlowTaskEnv.fast_left == 0:
          SlowTaskEnv.fast_finished.set()
    return result


GEOMETRY = {"decode_slots": "rows", "page_size": "page_size", "decode_steps_per_sync": None}


def _roller(chat, tok, env=TimedEnv, *, max_new=6, max_turns=4, **kw):
  sc = sampling.SamplingConfig(
    max_new_tokens=max_new,
    stop_token_ids=tuple(tokenizer_lib.stop_token_ids(tok)),
    pad_id=tok.pad_token_id,
  )
  spec = base.EnvSpec(make=env, task_ids=lambda split: [], max_turns=max_turns)
  geometry = {GEOMETRY[k] or k: kw.pop(k) for k in list(kw) if k in GEOMETRY}
  config = rollout.RolloutConfig(max_turns=max_turns, env_workers=8, **kw)
  session = config.session_config(**geometry)
  return rollout.Roller(spec, chat, MODEL, sc, config, session_config=session)


TASKS = ["4/1", "1/3", "3/2", "2/6", "4/9"]


def _play(params, chat, tok, **kw):
  roller = _roller(chat, tok, **kw)
  try:
    return roller.run(params, TASKS, 3, jax.random.key(5))
  finally:
    roller.close()


def test_trajectories_do_not_depend_on_timing_slots_or_scheduler(params, chat, tok):
  """One iteration (same params and key) played with instant and with jittered environments
  (random sleeps per call, so observations return in another order), on 16 slots and on 3
  slots, continuously and turn by turn: the same trajectories, token for token (and bit for
  bit on the same slot count)."""
  TimedEnv.jitter = None
  reference = _play(params, chat, tok, decode_slots=16).trajectories
  runs = {}
  try:
    for scheduler in rollout.SCHEDULERS:
      for slots in (16, 3):
        TimedEnv.jitter = random.Random(slots)
        runs[scheduler, slots] = _play(
          params, chat, tok, decode_slots=slots, scheduler=scheduler
        ).trajectories
  finally:
    TimedEnv.jitter = None
  assert len({t.num_turns for t in reference}) > 1  # episodes of different lengths
  replies = [len(t.replies[0]) for t in reference]
  assert len(set(replies)) > 1  # sampled replies that differ
  for (scheduler, slots), trajectories in runs.items():
    for mine, ref in zip(trajectories, reference):
      where = f"{scheduler}, {slots} slots, task {ref.task_id} sample {ref.sample}"
      assert (mine.task_id, mine.group, mine.sample) == (ref.task_id, ref.group, ref.sample)
      assert mine.tokens == ref.tokens, where
      assert mine.turn_ids == ref.turn_ids, where
      if slots == 16:  # the same programs: the same bits, whatever the timing
        assert mine.logprobs == ref.logprobs, where
      else:  # another decode batch: its matmuls may round differently
        np.testing.assert_allclose(mine.logprobs, ref.logprobs, atol=1e-5, err_msg=where)
      assert (mine.reward, mine.finish_reason) == (ref.reward, ref.finish_reason)


def test_the_turns_barrier_and_the_continuous_schedule(params, chat, tok):
  """With one slow environment: turn by turn, no episode's step of turn t + 1 starts before
  every step of turn t has ended; continuously, the fast episodes finish all their turns while
  the slow one is still in its first step (which waits for them: turn by turn, it would wait
  in vain)."""
  tasks = ["3/0/slow", "3/0", "3/0", "3/0"]
  for scheduler in rollout.SCHEDULERS:
    # 16 slots: the reference play's session geometry, so its programs.
    roller = _roller(chat, tok, SlowTaskEnv, max_turns=3, scheduler=scheduler, decode_slots=16)
    TimedEnv.log = []
    if scheduler == "continuous":
      SlowTaskEnv.fast_finished, SlowTaskEnv.fast_left = threading.Event(), len(tasks) - 1
      SlowTaskEnv.waited_for_fast = None
    try:
      result = roller.run(params, tasks, 1, jax.random.key(2))
    finally:
      SlowTaskEnv.fast_finished = None
      roller.close()
    assert all(t.num_turns == 3 for t in result.trajectories)
    log = TimedEnv.log
    assert len(log) == 4 * 3
    if scheduler == "turns":
      for turn in (1, 2):
        ends = max(end for _, k, _, end in log if k == turn)
        starts = min(start for _, k, start, _ in log if k == turn + 1)
        assert ends < starts
    else:
      assert SlowTaskEnv.waited_for_fast is True
      slow_first_end = min(end for task, k, _, end in log if task.endswith("/slow"))
      fast_last_end = max(end for task, k, _, end in log if not task.endswith("/slow"))
      assert fast_last_end < slow_first_end
      # The slow environment is the critical path: after the fast episodes the host only waits
      # on it (1.2 s of sleeps).
      assert result.metrics["rollout/env_wait_time"] > 0.8


def test_cache_memory_follows_the_live_tokens(params, chat, tok):
  """Episodes of very different lengths (one of 4 turns with observations of 60 words, seven
  of 1-2 short turns): the pages held never exceed the live tokens plus one page and one
  sync's tokens per row, and stay far below rows x the longest context."""
  roller = _roller(chat, tok, max_new=8, decode_slots=8, page_size=16, decode_steps_per_sync=4)
  session = roller.session
  seen = []
  inner = session.decode

  def watched(p):
    seen.append((session.cache_slots, session.live_tokens))
    return inner(p)

  session.decode = watched
  tasks = ["4/60", "1/1", "2/1", "1/1", "2/1", "1/1", "2/1", "1/1"]
  result = roller.run(params, tasks, 1, jax.random.key(3))
  roller.close()
  longest = max(len(t.tokens) for t in result.trajectories)
  bound = 8 * (16 + 4)
  assert seen
  for slots, live in seen:
    assert live <= slots <= live + bound
  peak = result.metrics["rollout/cache_slots"]
  assert peak == session.stats.peak_cache_slots
  assert longest > 500 and peak < 0.35 * 8 * longest
  assert 1.0 <= result.metrics["rollout/cache_slots_per_live_token"] < 2.0
  assert session.cache_slots == 0  # all pages back in the pool


def test_engine_metrics(params, chat, tok):
  # 3 slots: the programs of the 3-slot plays above (compiled once per process, or read from the
  # compilation cache).
  result = _play(params, chat, tok, decode_slots=3)
  m = result.metrics
  generated = sum(sum(1 for k in t.turn_ids if k >= 0) for t in result.trajectories)
  assert m["rollout/generated_tokens"] == generated
  assert 0 < m["rollout/slot_occupancy"] <= 1
  # Each decode step computes every slot: at least generated / slots steps minus the first
  # tokens (sampled in prefill), at most one per generated token.
  replies = sum(t.num_turns for t in result.trajectories)
  assert (generated - replies) / 3 <= m["rollout/decode_steps"] <= generated
  assert m["rollout/decode_steps_per_token"] == pytest.approx(m["rollout/decode_steps"] / generated)
  assert 0 <= m["rollout/env_wait_share"] < 1


def _clue_policy(tok):
  """Reads the newest dial clue of the synthetic lock and answers it: solves every lock."""

  def reply(trajectory):
    text = tok.decode(trajectory.tokens)
    clue = int(re.findall(r"clue (\d)", text)[-1])
    return "a" if clue < 5 else "z"

  return reply


def test_a_text_policy_solves_the_synthetic_task_through_the_engine(chat, tok):
  spec = envs.make_spec("synthetic", {"num_dials": 3})
  sc = sampling.SamplingConfig(max_new_tokens=4)
  for scheduler in rollout.SCHEDULERS:
    roller = rollout.Roller(
      spec,
      chat,
      MODEL,
      sc,
      rollout.RolloutConfig(max_turns=3, scheduler=scheduler),
      session_config=sampling.SessionConfig(rows=5, max_context_tokens=2048),
      text_policy=_clue_policy(tok),
    )
    result = roller.run(None, spec.task_ids("train")[:6], 2, jax.random.key(0))
    roller.close()
    assert all(t.success and t.reward == 1.0 for t in result.trajectories)
    for t in result.trajectories:
      assert t.num_turns == 3 and t.replies[0] in ("a", "z")
      assert all(lp == 0.0 for lp, k in zip(t.logprobs, t.turn_ids) if k >= 0)
