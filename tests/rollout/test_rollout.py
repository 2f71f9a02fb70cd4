"""The rollout loop: token in / token out, limits, environment failures, collation."""

import dataclasses
import threading
import time

import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np
import pytest

from seeupo_jax import envs, learner, rollout, sampling
from seeupo_jax.text import tokenizer as tokenizer_lib
from seeupo_jax.envs import base
from seeupo_jax.learner.batch import PROMPT_OR_ENV
from seeupo_jax.models import qwen
import tiny

MODEL = tiny.model_config()


@pytest.fixture(scope="module")
def params():
  return qwen.init_params(MODEL, jax.random.key(0))


class ScriptedEnv:
  """Task "<turns>/<obs words>/<fail>" : ends after <turns> replies; observations of <obs words>
  words; fail in {"", "reset", "step", "score"} raises there; "once" raises in the first step
  of that task only (across instances: a server that recovers). Reward = number of replies whose
  text starts with a letter a-m (so it depends on what was sampled); each turn's own reward is
  1 for such a reply, and its state "start", then the replies so far joined by "|"."""

  calls = []
  failed_once = set()
  lock = threading.Lock()
  open_now = 0  # instances between reset and close
  most_open = 0
  stepping_now = 0  # steps running
  most_stepping = 0
  # A step waits (at most 10 s) until this many steps have been running at once: steps that run
  # in parallel get there whatever the machine's speed; steps run one at a time never do.
  gather = 0
  gathered = threading.Condition(lock)

  def __init__(self, delay=0.0):
    self.delay = delay

  def reset(self, task_id):
    turns, words, fail = task_id.split("/")
    self.turns, self.words, self.fail, self.replies = int(turns), int(words), fail, []
    self.task_id = task_id
    with self.lock:
      ScriptedEnv.open_now += 1
      ScriptedEnv.most_open = max(ScriptedEnv.most_open, ScriptedEnv.open_now)
    if fail == "reset":
      raise ConnectionError("server down")
    return base.Reset([{"role": "user", "content": f"task {task_id}"}], state="start")

  def step(self, text):
    with self.lock:
      ScriptedEnv.stepping_now += 1
      ScriptedEnv.most_stepping = max(ScriptedEnv.most_stepping, ScriptedEnv.stepping_now)
      ScriptedEnv.gathered.notify_all()
      ScriptedEnv.gathered.wait_for(lambda: ScriptedEnv.most_stepping >= ScriptedEnv.gather, 10.0)
    time.sleep(self.delay)
    with self.lock:
      ScriptedEnv.stepping_now -= 1
      ScriptedEnv.calls.append(text)
    self.replies.append(text)
    if self.fail == "step":
      raise ConnectionError("server down")
    if self.fail == "once":
      with self.lock:
        first = self.task_id not in ScriptedEnv.failed_once
        ScriptedEnv.failed_once.add(self.task_id)
      if first:
        raise ConnectionError("server hiccup")
    done = len(self.replies) >= self.turns
    obs = [] if done else [{"role": "tool", "content": " ".join(["word"] * self.words)}]
    return base.Step(obs, done, {}, state="|".join(self.replies), reward=float(_good(text)))

  def score(self):
    if self.fail == "score":
      raise ConnectionError("server down")
    good = sum(_good(r) for r in self.replies)
    return base.Score(float(good), good == len(self.replies), {"replies": len(self.replies)})

  def close(self):
    with self.lock:
      ScriptedEnv.open_now -= 1


def _good(reply):
  return reply.lstrip()[:1].lower() in "abcdefghijklm" and reply.strip() != ""


def _spec(max_turns=4, delay=0.0):
  return base.EnvSpec(
    make=lambda: ScriptedEnv(delay), task_ids=lambda split: [], max_turns=max_turns
  )


def _roller(chat, tok, *, max_turns=4, max_new=5, delay=0.0, decode_slots=64, **kw):
  sc = sampling.SamplingConfig(
    max_new_tokens=max_new,
    stop_token_ids=tuple(tokenizer_lib.stop_token_ids(tok)),
    pad_id=tok.pad_token_id,
  )
  config = rollout.RolloutConfig(max_turns=max_turns, **kw)
  session = config.session_config(rows=decode_slots)
  return rollout.Roller(_spec(max_turns, delay), chat, MODEL, sc, config, session_config=session)


class Recorder:
  """Wraps the roller's sampler session and keeps every reply it returned."""

  def __init__(self, roller):
    self.inner, self.replies = roller.session.decode, []
    roller.session.decode = self

  def __call__(self, *args, **kwargs):
    replies = self.inner(*args, **kwargs)
    self.replies.extend(replies)
    return replies


def _teacher_forced(params, batch):
  return np.asarray(learner.qwen_logprob_fn(MODEL)(params, jax.tree.map(np.asarray, batch)))


def test_tokens_in_tokens_out(params, chat, tok):
  """Every generated token in the batch is the sampler's id with the sampler's log-prob; the
  learner's teacher-forced log-probs of the batch equal them; env/prompt tokens have turn -1."""
  roller = _roller(chat, tok, max_turns=4, max_new=6)
  recorder = Recorder(roller)
  tasks = ["3/2/", "1/5/", "4/1/", "2/9/"]
  result = roller.run(params, tasks, 3, jax.random.key(1))
  roller.close()
  trajectories = result.trajectories
  # Replies in the trajectories against the sampler's raw replies (every reply, once).
  sampled = [(r.tokens.tolist(), r.logprobs) for r in recorder.replies]
  mine = []
  for t in trajectories:
    for turn in range(t.num_turns):
      ids = [x for x, k in zip(t.tokens, t.turn_ids) if k == turn]
      lps = [x for x, k in zip(t.logprobs, t.turn_ids) if k == turn]
      mine.append((ids, np.asarray(lps, np.float32)))
  assert sorted(m[0] for m in mine) == sorted(s[0] for s in sampled)
  by_ids = {tuple(s[0]): s[1] for s in sampled}
  for ids, lps in mine:
    np.testing.assert_array_equal(lps, by_ids[tuple(ids)])
  assert [t.num_turns for t in trajectories] == [3] * 3 + [1] * 3 + [4] * 3 + [2] * 3
  assert all(t.finish_reason == "done" for t in trajectories)

  batch = rollout.collate(trajectories, num_turns=4, max_len=2048, length_bucket=16)
  learner.validate(batch, 4)
  logp = _teacher_forced(params, batch)
  generated = batch.turn_ids >= 0
  np.testing.assert_allclose(logp[generated], batch.sample_logp[generated], atol=2e-5)
  # Prompt and environment tokens: turn -1 and log-prob 0; the text is the conversation.
  assert np.all(batch.sample_logp[~generated] == 0)
  t = trajectories[0]
  text = tok.decode([x for x, k in zip(t.tokens, t.turn_ids) if k == PROMPT_OR_ENV])
  assert text.startswith("<|im_start|>system\n") and "task 3/2/" in text
  assert text.count("<tool_response>\nword word\n</tool_response>") == 2
  # The environment got exactly the decoded replies.
  for t in trajectories:
    for turn, reply in enumerate(t.replies):
      ids = [x for x, k in zip(t.tokens, t.turn_ids) if k == turn]
      assert reply == tok.decode(ids, skip_special_tokens=True)


def test_limits_end_trajectories_cleanly(params, chat, tok):
  # max_turns below the environment's: "max_turns"; the env still scores.
  roller = _roller(chat, tok, max_turns=2, max_new=4)
  result = roller.run(params, ["5/1/"], 2, jax.random.key(2))
  roller.close()
  assert {t.finish_reason for t in result.trajectories} == {"max_turns"}
  assert all(t.num_turns == 2 and t.score_details == {"replies": 2} for t in result.trajectories)

  # The context limit: observations of 40 words stop fitting; no crash, finish reason "context".
  roller = _roller(chat, tok, max_turns=6, max_new=4, max_context_tokens=150)
  result = roller.run(params, ["6/40/"], 2, jax.random.key(3))
  roller.close()
  for t in result.trajectories:
    assert t.finish_reason == "context"
    assert len(t.tokens) <= 150
    assert 1 <= t.num_turns < 6
    assert t.score_details == {"replies": t.num_turns}

  # Environment output cut to max_env_tokens, with the marker, and counted.
  roller = _roller(chat, tok, max_turns=2, max_new=4, max_env_tokens=5)
  result = roller.run(params, ["2/30/"], 1, jax.random.key(4))
  roller.close()
  (t,) = result.trajectories
  assert t.truncated_env_tokens > 0
  assert rollout.TRUNCATION_MARKER.strip() in tok.decode(t.tokens)
  assert result.metrics["truncated_env_tokens"] == t.truncated_env_tokens

  # A reply cut by max_new_tokens is counted, and the environment side closes its turn.
  roller = _roller(chat, tok, max_turns=2, max_new=1)
  result = roller.run(params, ["2/1/"], 4, jax.random.key(5))
  roller.close()
  for t in result.trajectories:
    (reply,) = [x for x, k in zip(t.tokens, t.turn_ids) if k == 0]  # one token per reply
    closed = reply == chat.end_of_turn_id
    after = t.tokens[t.turn_ids.index(0) + 1]  # the first observation token
    assert (after == chat.end_of_turn_id) != closed  # closed by the model xor by the env side
    cut = sum(x != chat.end_of_turn_id for x, k in zip(t.tokens, t.turn_ids) if k >= 0)
    assert t.truncated_replies == cut


@pytest.mark.parametrize("where", ["reset", "step", "score"])
def test_a_failing_environment_drops_its_whole_group(params, chat, tok, where):
  roller = _roller(chat, tok, max_turns=3, max_new=3, max_failed_group_fraction=0.5)
  result = roller.run(params, ["2/1/", f"2/1/{where}", "3/1/"], 2, jax.random.key(6))
  roller.close()
  failed = [t for t in result.trajectories if t.task_id.endswith(where)]
  assert all(t.finish_reason == "env_error" and "server down" in t.error for t in failed)
  assert all(t.dropped for t in failed)
  # Each failed episode was played again from the start (episode_retries=1), and failed again.
  assert all(len(t.retried_errors) == 1 and "server down" in t.retried_errors[0] for t in failed)
  assert result.metrics["rollout/retried_episodes"] == 2
  assert not any(t.dropped for t in result.trajectories if t not in failed)
  assert result.metrics["rollout/failed_groups"] == 1
  batch = rollout.collate(result.trajectories, num_turns=3, max_len=1024)
  np.testing.assert_array_equal(batch.row_valid, [True, True, False, False, True, True])


def test_an_episode_whose_server_recovers_is_replayed_from_the_start(params, chat, tok):
  """One of the group's episodes fails mid-way once; it is played again on a fresh instance and
  the group is kept: whole, fresh trajectories, no invented reward."""
  ScriptedEnv.failed_once.clear()
  roller = _roller(chat, tok, max_turns=3, max_new=3)
  result = roller.run(params, ["2/1/", "2/1/once"], 3, jax.random.key(8))
  roller.close()
  assert result.metrics["rollout/failed_groups"] == 0
  assert result.metrics["rollout/retried_episodes"] == 1
  retried = [t for t in result.trajectories if t.retried_errors]
  assert len(retried) == 1 and "server hiccup" in retried[0].retried_errors[0]
  for t in result.trajectories:
    assert t.error is None and not t.dropped and t.finish_reason == "done" and t.num_turns == 2
    assert sorted(set(t.turn_ids)) == [-1, 0, 1]
    assert t.score_details == {"replies": 2}  # the replay's two replies, not the failed three
    # The state before each turn and each turn's reward, the replay's own.
    assert t.turn_states == ["start", t.replies[0]]
    assert t.turn_rewards == [float(_good(r)) for r in t.replies]
  batch = rollout.collate(result.trajectories, num_turns=3, max_len=1024)
  assert batch.row_valid.all()
  for i, t in enumerate(result.trajectories):
    keys = [rollout.trajectory.state_key(s) for s in t.turn_states]
    assert batch.turn_states[i].tolist() == keys + [-1]  # no third turn: no state
    assert batch.turn_rewards[i].tolist() == t.turn_rewards + [0.0]


def test_an_environment_of_limited_capacity_gets_at_most_that_many_live_episodes(params, chat, tok):
  """capacity 3 (e.g. 3 healthy servers): 8 episodes run 3 at a time (a freed slot takes the
  next), never more than 3 open at once, and come back in their places with their groups."""
  roller = _roller(chat, tok, max_turns=2, max_new=3)
  roller.spec = dataclasses.replace(roller.spec, capacity=lambda: 3)
  ScriptedEnv.open_now = ScriptedEnv.most_open = 0
  result = roller.run(params, ["1/1/", "2/1/"], 4, jax.random.key(9))
  roller.close()
  assert ScriptedEnv.most_open == 3 and ScriptedEnv.open_now == 0
  assert [(t.task_id, t.group, t.sample) for t in result.trajectories] == [
    (task, g, s) for g, task in enumerate(["1/1/", "2/1/"]) for s in range(4)
  ]
  assert all(
    t.finish_reason == "done" and t.num_turns == int(t.task_id[0]) for t in result.trajectories
  )
  roller.spec = dataclasses.replace(roller.spec, capacity=lambda: 0)
  with pytest.raises(rollout.EnvironmentFailure, match="capacity 0"):
    roller.run(params, ["1/1/"], 1, jax.random.key(9))


def test_too_many_failures_raise_instead_of_zero_rewards(params, chat, tok):
  roller = _roller(chat, tok, max_turns=3, max_new=3, max_failed_group_fraction=0.25)
  with pytest.raises(
    rollout.EnvironmentFailure, match="(?s)2 of 3 task groups failed.*task '2/1/step'.*server down"
  ):
    roller.run(params, ["2/1/step", "2/1/reset", "2/1/"], 2, jax.random.key(7))
  roller.close()


def test_more_episodes_than_decode_slots(params, chat, tok):
  """16 episodes on 4 decode slots: never more than 4 live, a finished episode's slot takes the
  next one (its pages back in the pool), and every reply is still the sampler's own."""
  roller = _roller(chat, tok, max_turns=3, max_new=3, decode_slots=4)
  ScriptedEnv.open_now = ScriptedEnv.most_open = 0
  result = roller.run(params, ["1/1/"] * 3 + ["3/1/"], 4, jax.random.key(8))
  roller.close()
  assert ScriptedEnv.most_open == 4 and ScriptedEnv.open_now == 0
  assert [t.num_turns for t in result.trajectories] == [1] * 12 + [3] * 4
  assert roller.session.cache_slots == 0  # every row released
  batch = rollout.collate(result.trajectories, num_turns=3, max_len=1024, length_bucket=16)
  logp = _teacher_forced(params, batch)
  generated = batch.turn_ids >= 0
  np.testing.assert_allclose(logp[generated], batch.sample_logp[generated], atol=2e-5)


def test_environments_run_in_parallel_and_wait_share_is_measured(params, chat, tok):
  roller = _roller(chat, tok, max_turns=2, max_new=2, delay=0.2, env_workers=16)
  ScriptedEnv.most_stepping, ScriptedEnv.gather = 0, 8
  start = time.perf_counter()
  try:
    result = roller.run(params, ["2/1/"], 16, jax.random.key(9))
  finally:
    ScriptedEnv.gather = 0
  wall = time.perf_counter() - start
  roller.close()
  # 16 environments whose steps take 0.2 s each: 8 steps run at the same time (each waits for
  # the others: one env worker would run them one at a time, each waiting in vain). The host
  # waits for most of the last step at least (0.2 s: with every reply sampled it has nothing
  # else to do); it may decode other rows during the earlier steps, so not for all of them.
  assert ScriptedEnv.most_stepping >= 8, ScriptedEnv.most_stepping
  assert 0.15 < result.metrics["rollout/env_wait_time"] < wall
  assert 0 < result.metrics["rollout/env_wait_share"] < 1
  # Sampling, env wait and host time are disjoint parts of the call (the env wait inside the
  # host's hand-offs counted once): they sum to at most the call's own wall time.
  m = result.metrics
  parts = m["rollout/sample_time"] + m["rollout/env_wait_time"] + m["rollout/host_time"]
  assert parts <= m["rollout/time"] <= wall


def test_on_env_wait_is_called_once_at_the_first_wait_for_tool_calls_and_changes_nothing(
  params, chat, tok
):
  """`Roller.run(on_env_wait=)` is called once: after a decode round handed replies to the
  environments, when the policy has nothing to do but wait for them (not at the resets' wait).
  A hook that runs device work there (what the training loop's update is) leaves the
  trajectories as they are without it."""
  tasks, key = ["2/1/", "3/2/"], jax.random.key(4)
  plain = _roller(chat, tok, max_turns=3, max_new=3, delay=0.05, env_workers=8)
  expected = plain.run(params, tasks, 4, key).trajectories
  plain.close()

  roller = _roller(chat, tok, max_turns=3, max_new=3, delay=0.05, env_workers=8)
  recorder = Recorder(roller)
  seen = []

  def hook():
    seen.append((len(recorder.replies), roller._in_flight, roller.policy.busy))
    x = jax.numpy.ones((256, 256))
    for _ in range(20):  # dispatched, not waited for: it runs while the envs answer
      x = jax.numpy.tanh(x @ x)
    seen.append(x)

  result = roller.run(params, tasks, 4, key, on_env_wait=hook)
  roller.close()
  assert len(seen) == 2  # called once
  replies_before, in_flight, busy = seen[0]
  assert replies_before >= 1 and in_flight >= 1 and not busy
  assert replies_before < len(recorder.replies)  # more turns were sampled after it
  for got, want in zip(result.trajectories, expected, strict=True):
    assert got.tokens == want.tokens and got.logprobs == want.logprobs
    assert got.reward == want.reward


def _partial_roller(chat, tok):
  return _roller(chat, tok, max_turns=3, max_new=8, decode_steps_per_sync=1)


def test_a_partial_rollout_swaps_the_params_inside_replies_and_tags_each_token(params, chat, tok):
  """`Roller.run(refresh=)`: the first time a reply is in progress (tokens sampled, not ended),
  the refresh swaps params A (version 3) for B (version 4). Every reply token is tagged with
  the version that sampled it (-1 on prompt and observation tokens, never decreasing along a
  trajectory), some reply holds both versions, and each trajectory up to its first version-4
  token is the run of A alone, token for token and log-prob for log-prob. Swapped before the
  first token, the call is the run of B alone."""
  other = qwen.init_params(MODEL, jax.random.key(1))
  tasks, key = ["3/2/", "2/1/"], jax.random.key(7)

  def run(first, refresh=None):
    roller = _partial_roller(chat, tok)
    hook = None if refresh is None else refresh(roller)
    result = roller.run(first, tasks, 4, key, version=3, refresh=hook)
    roller.close()
    return result.trajectories

  def mid_reply(roller):
    def refresh():
      if any(n > 0 for n in roller.session.reply_progress().values()) and not swaps:
        swaps.append(dict(roller.session.reply_progress()))
        return other, 4
      return None

    return refresh

  swaps = []
  only_a, only_b = run(params), run(other)
  swapped = run(params, mid_reply)
  assert len(swaps) == 1
  both = 0
  for t, a in zip(swapped, only_a, strict=True):
    assert len(t.versions) == len(t.tokens)
    reply = np.asarray(t.turn_ids) >= 0
    versions = np.asarray(t.versions)
    assert np.all(versions[~reply] == -1)
    assert set(versions[reply]) <= {3, 4}
    assert np.all(np.diff(versions[reply]) >= 0)
    for turn in range(t.num_turns):
      both += set(versions[np.asarray(t.turn_ids) == turn]) == {3, 4}
    # Up to the first token of B: the run of A.
    first_b = int(np.argmax(versions == 4)) if np.any(versions == 4) else len(t.tokens)
    assert t.tokens[:first_b] == a.tokens[:first_b]
    np.testing.assert_allclose(t.logprobs[:first_b], a.logprobs[:first_b], atol=1e-5)
  assert both >= 1  # a swap inside a reply
  assert any(4 in t.versions for t in swapped)

  at_once = run(params, lambda roller: lambda: (other, 4))
  for t, b in zip(at_once, only_b, strict=True):
    assert t.tokens == b.tokens
    np.testing.assert_allclose(t.logprobs, b.logprobs, atol=1e-5)
    assert {v for v, turn in zip(t.versions, t.turn_ids) if turn >= 0} == {4}
  assert any(t.tokens != a.tokens for t, a in zip(only_b, only_a))  # A and B sample apart


def test_synthetic_rollout_scores_match_the_replies(params, chat, tok):
  spec = envs.make_spec("synthetic", {"num_dials": 3})
  sc = sampling.SamplingConfig(max_new_tokens=3, stop_token_ids=(chat.end_of_turn_id,))
  roller = rollout.Roller(spec, chat, MODEL, sc, rollout.RolloutConfig(max_turns=3))
  result = roller.run(params, spec.task_ids("train")[:4], 4, jax.random.key(10))
  roller.close()
  for t in result.trajectories:
    env = spec.make()
    env.reset(t.task_id)
    for reply in t.replies:
      env.step(reply)
    assert env.score().reward == t.reward


# --- collate: a pure NumPy function ---------------------------------------------------------


@st.composite
def _trajectories(draw):
  count = draw(st.integers(1, 6))
  out = []
  for i in range(count):
    t = rollout.Trajectory(task_id=f"t{i}", group=draw(st.integers(0, count - 1)), sample=i)
    t.append(draw(st.lists(st.integers(0, 500), min_size=1, max_size=5)), PROMPT_OR_ENV)
    for turn in range(draw(st.integers(0, 3))):
      ids = draw(st.lists(st.integers(0, 500), min_size=1, max_size=4))
      t.append(ids, turn, [-float(x) / 100 for x in ids])
      t.append(draw(st.lists(st.integers(0, 500), max_size=3)), PROMPT_OR_ENV)
    t.reward = draw(st.floats(-1, 1))
    t.dropped = draw(st.booleans())
    turns = len(set(t.turn_ids) - {PROMPT_OR_ENV})
    t.turn_states = draw(
      st.lists(st.none() | st.sampled_from(["", "a", "a,b"]), min_size=turns, max_size=turns)
    )
    t.turn_rewards = draw(st.lists(st.none() | st.floats(-1, 1), min_size=turns, max_size=turns))
    out.append(t)
  return out


@hypothesis.settings(deadline=None, max_examples=50)
@hypothesis.given(_trajectories(), st.integers(1, 16), st.integers(0, 3))
def test_collate_places_each_trajectory_in_its_row(trajectories, bucket, extra_rows):
  n = len(trajectories) + extra_rows
  batch = rollout.collate(trajectories, num_turns=3, max_len=64, length_bucket=bucket, num_rows=n)
  learner.validate(batch, 3)
  longest = max(len(t.tokens) for t in trajectories)
  assert batch.tokens.shape == (n, min(64, -(-longest // bucket) * bucket))
  for i, t in enumerate(trajectories):
    k = len(t.tokens)
    assert batch.tokens[i, :k].tolist() == t.tokens
    assert batch.turn_ids[i, :k].tolist() == t.turn_ids
    np.testing.assert_array_equal(batch.sample_logp[i, :k], np.float32(t.logprobs))
    assert batch.token_valid[i].sum() == k and not batch.token_valid[i, k:].any()
    assert np.all(batch.turn_ids[i, k:] == PROMPT_OR_ENV)
    assert batch.row_valid[i] == (not t.dropped)
    assert batch.group_ids[i] == t.group
    assert batch.rewards[i] == np.float32(t.reward)
    states = [-1 if s is None else rollout.trajectory.state_key(s) for s in t.turn_states]
    assert batch.turn_states[i].tolist() == states + [-1] * (3 - len(states))
    rewards = [0.0 if r is None else r for r in t.turn_rewards]
    np.testing.assert_array_equal(
      batch.turn_rewards[i], np.float32(rewards + [0.0] * (3 - len(rewards)))
    )
  assert not batch.row_valid[len(trajectories) :].any()
  # Equal states, equal keys; different states, different keys (31-bit digests).
  keys = {s: rollout.trajectory.state_key(s) for s in ("", "a", "a,b")}
  assert len(set(keys.values())) == 3 and all(0 <= k < 2**31 for k in keys.values())


def test_collate_refuses_what_it_cannot_hold():
  t = rollout.Trajectory("a", 0, 0)
  t.append(list(range(10)), PROMPT_OR_ENV)
  with pytest.raises(ValueError, match="more than max_len=8"):
    rollout.collate([t], num_turns=1, max_len=8)
  t.append([1], 2, [0.0])
  with pytest.raises(ValueError, match="turn id >= num_turns=2"):
    rollout.collate([t], num_turns=2, max_len=64)
  with pytest.raises(ValueError, match="num_rows=0"):
    rollout.collate([t], num_turns=3, max_len=64, num_rows=0)


def test_rollout_config_names_bad_values():
  with pytest.raises(ValueError, match="RolloutConfig.max_turns=0; allowed: an int >= 1"):
    rollout.RolloutConfig(max_turns=0)
  with pytest.raises(
    ValueError, match=r"max_failed_group_fraction=2.0; allowed: a number in \[0, 1\]"
  ):
    dataclasses.replace(rollout.RolloutConfig(max_turns=1), max_failed_group_fraction=2.0)
