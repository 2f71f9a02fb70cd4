"""The rollout scheduler (`rollout.Roller`) driven by a scripted policy, with no model.

Every token is hand-chosen (a chat whose ids are the digits of the messages, replies fixed per
turn), so the trajectories, their turn ids, masks and log-probs are checked against values
derived by hand, and the order in which the scheduler gives, decodes and releases rows against
the scheduling rules (continuous and turn-synchronous).
"""

import dataclasses

import jax
import numpy as np
import pytest

from seeupo_jax import rollout
from seeupo_jax.envs import base
from seeupo_jax.rollout import keys as keys_lib

END = 9  # the end-of-turn id
PROMPT, OBS_CLOSED, OBS_OPEN = 1, 2, 3  # the first id of a prompt and of an observation


class Tokenizer:
  def decode(self, ids, skip_special_tokens=True):
    del skip_special_tokens
    return " ".join(str(i) for i in ids)


class Chat:
  """A chat whose ids are the messages' integers: prompt [1, c...], observation [2 or 3, c...]
  (2 after a reply closed with the end of turn, 3 after a cut one)."""

  end_of_turn_id = END
  tokenizer = Tokenizer()

  def encode(self, text):
    return [int(w) for w in text.split()]

  def prompt_ids(self, messages, tools=None):
    return [PROMPT] + [int(m["content"]) for m in messages]

  def observation_ids(self, messages, tools=None, *, reply_closed=True):
    return [OBS_CLOSED if reply_closed else OBS_OPEN] + [int(m["content"]) for m in messages]


class Env:
  """Task "<n>": the prompt's content is n, the episode ends after n replies, the observation
  after reply r (1-based) is 10 + r; reward = the number of replies."""

  def reset(self, task_id):
    self.turns, self.replies = int(task_id), []
    return base.Reset([{"role": "user", "content": task_id}])

  def step(self, text):
    self.replies.append(text)
    done = len(self.replies) >= self.turns
    obs = [] if done else [{"role": "tool", "content": str(10 + len(self.replies))}]
    return base.Step(obs, done, {})

  def score(self):
    return base.Score(float(len(self.replies)), True, {})

  def close(self):
    pass


def _spec(max_turns=4):
  return base.EnvSpec(make=Env, task_ids=lambda split: [], max_turns=max_turns)


def reply_ids(turn):
  """The scripted reply of turn t: two tokens, closed with the end of turn."""
  return [50 + turn, END]


REPLY_LOGP = [-0.5, -0.25]


class ScriptedPolicy:
  """A `rollout.Policy` of `slots` rows whose reply to turn t is `reply_ids(t)` (log-probs
  REPLY_LOGP), ready `delay` decode calls after its tokens were given. Logs every call."""

  def __init__(self, slots, max_reply_tokens=8, delay=1):
    self.slots, self.max_reply_tokens, self.delay = slots, max_reply_tokens, delay
    self.log, self.most_taken = [], 0
    self.hold = lambda row, turn: False  # True: the reply is not ready yet
    self.replied = set()  # (row, turn) of the replies returned
    self._free, self._owed, self._turn = [], {}, {}

  def begin(self, params, version=0):
    self.log.append(("begin", params))
    self._free = list(range(self.slots - 1, -1, -1))

  @property
  def free(self):
    return len(self._free)

  def take(self):
    row = self._free.pop()
    self.most_taken = max(self.most_taken, self.slots - len(self._free))
    self._turn[row] = 0
    self.log.append(("take", row))
    return row

  def give(self, row, trajectory, new_ids, key_data, limit):
    assert row not in self._free and row not in self._owed
    self.log.append(("give", row, trajectory.task_id, list(new_ids), key_data.tolist(), limit))
    self._owed[row] = self.delay

  def prefill(self):
    pass

  def decode(self):
    ready = []
    for row in sorted(self._owed):
      self._owed[row] -= 1
      if self._owed[row] <= 0 and not self.hold(row, self._turn[row]):
        turn = self._turn[row]
        ids = reply_ids(turn)
        ready.append(rollout.PolicyReply(row, ids, list(REPLY_LOGP), False))
        self._turn[row] = turn + 1
        self.log.append(("reply", row, turn))
        self.replied.add((row, turn))
    for r in ready:
      del self._owed[r.row]
    return ready

  def release(self, row):
    assert row not in self._free
    self.log.append(("release", row))
    self._owed.pop(row, None)
    self._free.append(row)

  @property
  def busy(self):
    return bool(self._owed)

  def stats(self):
    return None


def _roller(policy, *, max_turns=3, **kw):
  config = rollout.RolloutConfig(max_turns=max_turns, env_workers=2, **kw)
  return rollout.Roller(_spec(), Chat(), config=config, policy=policy)


def _run(roller, tasks, samples=1, key=0):
  try:
    return roller.run("params", tasks, samples, jax.random.key(key))
  finally:
    roller.close()


def test_trajectory_tokens_masks_and_logprobs_by_hand():
  policy = ScriptedPolicy(slots=2)
  result = _run(_roller(policy, max_turns=3), ["2", "1"])
  two, one = result.trajectories
  # Task "2": prompt [1, 2]; reply 0; observation 11 after a closed reply; reply 1; done.
  assert two.tokens == [PROMPT, 2, 50, END, OBS_CLOSED, 11, 51, END]
  assert two.turn_ids == [-1, -1, 0, 0, -1, -1, 1, 1]
  assert two.logprobs == [0, 0, *REPLY_LOGP, 0, 0, *REPLY_LOGP]
  assert two.replies == ["50 9", "51 9"]
  assert (two.num_turns, two.finish_reason, two.reward) == (2, "done", 2.0)
  # Task "1": one reply, done.
  assert one.tokens == [PROMPT, 1, 50, END]
  assert one.turn_ids == [-1, -1, 0, 0]
  assert (one.num_turns, one.finish_reason, one.reward) == (1, "done", 1.0)
  # The learner's batch: generated tokens carry their turn and log-prob, the rest -1 and 0.
  batch = rollout.collate(result.trajectories, num_turns=3, max_len=16, length_bucket=8)
  np.testing.assert_array_equal(
    batch.turn_ids, [[-1, -1, 0, 0, -1, -1, 1, 1], [-1, -1, 0, 0, -1, -1, -1, -1]]
  )
  np.testing.assert_array_equal(batch.token_valid, [[True] * 8, [True] * 4 + [False] * 4])
  np.testing.assert_allclose(batch.sample_logp[0], [0, 0, -0.5, -0.25, 0, 0, -0.5, -0.25])
  np.testing.assert_array_equal(batch.rewards, [2.0, 1.0])
  # Every row was given back, and the policy's stats (none) give no sampler metrics.
  assert policy.log[-1][0] == "release" and policy.free == 2
  assert result.metrics["finish/done"] == 1.0 and "rollout/decode_steps" not in result.metrics


def test_each_give_carries_the_new_tokens_the_turn_key_and_the_limit():
  policy = ScriptedPolicy(slots=1, max_reply_tokens=3)
  config_turns, context = 3, 12
  roller = _roller(policy, max_turns=config_turns, max_context_tokens=context)
  _run(roller, ["2"], key=7)
  gives = [e for e in policy.log if e[0] == "give"]
  want_keys = keys_lib.trajectory_keys(jax.random.key(7), [0], [0], [0], config_turns)[0]
  # Turn 0: the prompt, limit min(3, 12 - 2); turn 1: the observation, min(3, 12 - 6).
  assert [(g[3], g[5]) for g in gives] == [([PROMPT, 2], 3), ([OBS_CLOSED, 11], 3)]
  assert [g[4] for g in gives] == want_keys[:2].tolist()


def test_max_turns_ends_the_episode_after_its_last_reply():
  policy = ScriptedPolicy(slots=1)
  (t,) = _run(_roller(policy, max_turns=2), ["3"]).trajectories
  assert t.num_turns == 2 and t.finish_reason == "max_turns"
  assert t.tokens == [PROMPT, 3, 50, END, OBS_CLOSED, 11, 51, END]  # no last observation


def _rows_are_taken_and_released_in_turn(log, slots):
  """Each row alternates take -> release; at most `slots` taken at once; gives only to taken
  rows."""
  taken = set()
  for event in log:
    if event[0] == "take":
      assert event[1] not in taken
      taken.add(event[1])
      assert len(taken) <= slots
    elif event[0] == "release":
      taken.remove(event[1])
    elif event[0] == "give":
      assert event[1] in taken
  assert not taken


def test_more_episodes_than_slots_reuse_the_rows_given_back():
  policy = ScriptedPolicy(slots=2)
  result = _run(_roller(policy), ["1", "2", "1", "3", "1"])
  assert policy.most_taken == 2
  assert [t.num_turns for t in result.trajectories] == [1, 2, 1, 3, 1]
  assert [t.reward for t in result.trajectories] == [1.0, 2.0, 1.0, 3.0, 1.0]
  _rows_are_taken_and_released_in_turn(policy.log, 2)
  assert sum(e[0] == "take" for e in policy.log) == 5
  assert {e[1] for e in policy.log if e[0] == "take"} == {0, 1}
  assert policy.free == 2


def test_turns_scheduler_takes_each_turn_together():
  """ "turns": every live episode's reply of turn t comes before any reply of turn t + 1 (a
  barrier per turn), with one episode's replies taking 1 decode call and the other's 3."""
  policy = ScriptedPolicy(slots=2)
  inner = policy.give

  def give(row, trajectory, new_ids, key_data, limit):
    inner(row, trajectory, new_ids, key_data, limit)
    policy._owed[row] = 3 if row == 1 else 1

  policy.give = give
  _run(_roller(policy, scheduler="turns"), ["3", "3"])
  replies = [(e[1], e[2]) for e in policy.log if e[0] == "reply"]
  assert sorted(replies) == [(r, t) for r in (0, 1) for t in range(3)]
  assert [turn for _, turn in replies] == [0, 0, 1, 1, 2, 2]
  # Each turn's gives come together: both rows' new tokens before the next decode call.
  events = [e[0] for e in policy.log if e[0] in ("give", "reply")]
  assert events == ["give", "give", "reply", "reply"] * 3
  _rows_are_taken_and_released_in_turn(policy.log, 2)


def test_continuous_scheduler_lets_an_episode_run_ahead():
  """ "continuous": row 1's first reply is held until row 0 has replied twice; the engine does
  not wait for it (row 0's episode goes on alone)."""
  policy = ScriptedPolicy(slots=2)
  policy.hold = lambda row, turn: row == 1 and turn == 0 and (0, 1) not in policy.replied
  _run(_roller(policy), ["3", "3"])
  replies = [(e[1], e[2]) for e in policy.log if e[0] == "reply"]
  assert sorted(replies) == [(r, t) for r in (0, 1) for t in range(3)]
  assert replies.index((0, 1)) < replies.index((1, 0))
  _rows_are_taken_and_released_in_turn(policy.log, 2)


def test_capacity_limits_the_live_episodes_below_the_slots():
  policy = ScriptedPolicy(slots=4)
  spec = dataclasses.replace(_spec(), capacity=lambda: 1)
  config = rollout.RolloutConfig(max_turns=3, env_workers=2)
  roller = rollout.Roller(spec, Chat(), config=config, policy=policy)
  result = _run(roller, ["2", "1", "2"])
  assert policy.most_taken == 1
  assert [t.num_turns for t in result.trajectories] == [2, 1, 2]
  _rows_are_taken_and_released_in_turn(policy.log, 1)


def test_a_policy_and_the_configs_that_build_one_are_not_both_given():
  from seeupo_jax import sampling

  with pytest.raises(ValueError, match="not both"):
    rollout.Roller(
      _spec(),
      Chat(),
      sampling_config=sampling.SamplingConfig(max_new_tokens=2),
      config=rollout.RolloutConfig(max_turns=2),
      policy=ScriptedPolicy(slots=1),
    )
