"""The environment registry and the synthetic lock task."""

import itertools

import numpy as np
import pytest

from seeupo_jax import envs
from seeupo_jax.envs import synthetic


def test_registry_names_the_allowed_environments():
  with pytest.raises(
    ValueError, match=r"unknown environment 'nope'.*'appworld', 'bfcl', 'synthetic'"
  ):
    envs.make_spec("nope")


def test_bad_option_names_the_environment():
  with pytest.raises(ValueError, match="bad options for environment 'synthetic'.*num_dails"):
    envs.make_spec("synthetic", {"num_dails": 3})
  with pytest.raises(ValueError, match="synthetic.num_dials=0; allowed: an int >= 1"):
    envs.make_spec("synthetic", {"num_dials": 0})


@pytest.mark.parametrize(
  "text,dial",
  [
    ("apple", "left"),
    ("  Nope", "right"),
    ("  Moon", "left"),
    ("m", "left"),
    ("n", "right"),
    ("Zebra", "right"),
    ("", "right"),
    ("7 up", "right"),
    ("\u00e9t\u00e9", "right"),  # not an ASCII letter
    ("\nhello", "left"),
  ],
)
def test_dial_of_reply(text, dial):
  assert synthetic.dial_of_reply(text) == dial


def _play(env, task_id, replies):
  reset = env.reset(task_id)
  observations = [reset.messages[-1]["content"]]
  for i, reply in enumerate(replies):
    step = env.step(reply)
    assert step.done == (i == len(replies) - 1)
    observations.extend(m["content"] for m in step.observation)
  return observations, env.score()


def _right_replies(observations):
  """The replies a perfect reader gives: parse each observation's clue word."""
  replies = []
  for text in observations:
    clue = text.split("clue ")[1][0]
    replies.append("go" if clue in synthetic.LEFT_CLUES else "stop")
  return replies


def test_reading_the_clues_opens_every_lock_and_one_wrong_dial_fails():
  spec = envs.make_spec("synthetic", {"num_dials": 4, "partial_credit": 0.0})
  env = spec.make()
  for task_id in spec.task_ids("train")[:50]:
    reset = env.reset(task_id)
    replies, obs = [], reset.messages[-1]["content"]
    for t in range(4):
      replies.append(_right_replies([obs])[0])
      step = env.step(replies[-1])
      if not step.done:
        obs = step.observation[0]["content"]
    score = env.score()
    assert score.success and score.reward == 1.0
    # The same task with dial 2 flipped: reward 0.
    flipped = list(replies)
    flipped[2] = "stop" if flipped[2] == "go" else "go"
    _, score = _play(env, task_id, flipped)
    assert not score.success and score.reward == 0.0
    assert score.details == {"dials_set": 4, "dials_right": 3}


def test_the_lock_reports_each_turns_state_and_reward_for_the_turn_level_algorithms():
  spec = envs.make_spec("synthetic", {"num_dials": 3})
  assert spec.turn_states and spec.turn_rewards
  env = spec.make()
  reset = env.reset("train/5")
  right = synthetic.draw_lock(synthetic.SyntheticConfig(num_dials=3), "train/5").directions
  replies = ["go", "stop", "go"]  # left, right, left
  states, rewards = [reset.state], []
  for reply in replies:
    step = env.step(reply)
    states.append(step.state)
    rewards.append(step.reward)
  assert states == ["", "left", "left,right", "left,right,left"]
  assert rewards == [float(d == r) for d, r in zip(["left", "right", "left"], right)]
  # Outside what the model sees: the observations carry no reward.
  assert env.score().details["dials_right"] == sum(rewards)


def test_chance_level_is_two_to_the_minus_dials():
  """A policy that ignores the observations opens 1/2^D of the locks (exact over all replies)."""
  spec = envs.make_spec("synthetic", {"num_dials": 3, "num_train_tasks": 4000, "partial_credit": 0})
  env = spec.make()
  # For each fixed reply sequence (blind policy), the success rate over tasks is ~1/8; averaged
  # over all 8 blind sequences it is exactly the share of tasks matched by exactly one: 1/8.
  tasks = spec.task_ids("train")
  rates = []
  for seq in itertools.product(["go", "stop"], repeat=3):
    rates.append(np.mean([_play(env, t, seq)[1].success for t in tasks[:800]]))
  assert np.isclose(np.mean(rates), 1 / 8)  # every task is opened by exactly one sequence
  assert all(abs(r - 1 / 8) < 0.05 for r in rates)  # and each blind sequence is near chance


def test_tasks_are_deterministic_and_splits_differ():
  config = synthetic.SyntheticConfig(num_dials=3)
  a = synthetic.draw_lock(config, "train/5")
  assert a == synthetic.draw_lock(config, "train/5")
  eval_locks = {synthetic.draw_lock(config, f"eval/{i}") for i in range(20)}
  train_locks = {synthetic.draw_lock(config, f"train/{i}") for i in range(20)}
  assert eval_locks != train_locks
  with pytest.raises(ValueError, match="unknown synthetic task 'eval/999'"):
    synthetic.draw_lock(config, "eval/999")
  with pytest.raises(ValueError, match="unknown synthetic task 'test/1'"):
    synthetic.draw_lock(config, "test/1")


def test_decoy_appears_and_can_be_turned_off():
  spec = envs.make_spec("synthetic", {"decoys": True})
  reset = spec.make().reset("train/0")
  assert "noise" in reset.messages[-1]["content"] and "clue" in reset.messages[-1]["content"]
  spec = envs.make_spec("synthetic", {"decoys": False})
  reset = spec.make().reset("train/0")
  assert "noise" not in reset.messages[-1]["content"]


@pytest.mark.parametrize("decoys", [False, True])
def test_bare_digits_show_the_clue_last_and_reading_it_opens_the_lock(decoys):
  config = {"num_dials": 3, "decoys": decoys, "labels": False, "partial_credit": 0.0}
  spec = envs.make_spec("synthetic", config)
  env = spec.make()
  for task_id in spec.task_ids("train")[:30]:
    lock = synthetic.draw_lock(synthetic.SyntheticConfig(**config), task_id)
    obs = env.reset(task_id).messages[-1]["content"]
    for t in range(3):
      expected = f"{lock.noises[t]} {lock.clues[t]}" if decoys else lock.clues[t]
      assert obs == expected  # no words, no dial number: the clue is the last character
      step = env.step("go" if obs[-1] in synthetic.LEFT_CLUES else "stop")
      obs = step.observation[0]["content"] if not step.done else None
    assert env.score().success


def test_score_of_an_unfinished_episode_is_zero():
  env = envs.make_spec("synthetic", {"partial_credit": 0.0}).make()
  env.reset("train/1")
  env.step("go")
  score = env.score()
  assert score.reward == 0.0 and score.details["dials_set"] == 1


@pytest.mark.parametrize("credit", [0.0, 0.5, 1.0])
def test_partial_credit_reward(credit):
  """reward = (1 - c) * opened + c * right / D, by hand for every number of right dials."""
  spec = envs.make_spec("synthetic", {"num_dials": 3, "partial_credit": credit})
  env = spec.make()
  obs = [env.reset("train/7").messages[-1]["content"]]
  right = []
  for _ in range(3):
    right.append(_right_replies(obs[-1:])[0])
    step = env.step(right[-1])
    obs.extend(m["content"] for m in step.observation)
  flip = {"go": "stop", "stop": "go"}
  for wrong in range(4):
    replies = [flip[r] if i < wrong else r for i, r in enumerate(right)]
    _, score = _play(env, "train/7", replies)
    opened = wrong == 0
    assert score.success == opened
    assert score.reward == pytest.approx((1 - credit) * opened + credit * (3 - wrong) / 3)
  with pytest.raises(
    ValueError, match=r"synthetic.partial_credit=1.5; allowed: a number in \[0, 1\]"
  ):
    envs.make_spec("synthetic", {"partial_credit": 1.5})


def test_simulated_latency_is_fixed_or_log_normal_with_its_median_and_p99(monkeypatch):
  fixed = synthetic.SyntheticConfig(latency_ms=30.0)
  assert synthetic.step_latency_s(fixed, "train/1", 1) == 0.03
  assert synthetic.step_latency_s(synthetic.SyntheticConfig(), "train/1", 1) == 0.0
  tail = synthetic.SyntheticConfig(latency_ms=30.0, latency_p99_ms=300.0)
  draws = np.array([synthetic.step_latency_s(tail, f"train/{i}", 2) for i in range(20000)])
  # log-normal: median 30 ms and 99th percentile 300 ms, within the sampling error of 20000 draws
  np.testing.assert_allclose(np.median(draws), 0.03, rtol=0.03)
  np.testing.assert_allclose(np.quantile(draws, 0.99), 0.3, rtol=0.08)
  assert synthetic.step_latency_s(tail, "train/5", 2) == draws[5]  # by (seed, task, turn)
  assert synthetic.step_latency_s(tail, "train/5", 3) != draws[5]
  # Each step sleeps its latency; the episode is the same as without it.
  slept = []
  monkeypatch.setattr(synthetic.time, "sleep", slept.append)
  config = synthetic.SyntheticConfig(num_dials=3, latency_ms=30.0, latency_p99_ms=300.0)
  env = synthetic.SyntheticEnv(config)
  env.reset("train/5")
  for _ in range(3):
    env.step("a")
  assert slept == [synthetic.step_latency_s(config, "train/5", t) for t in (1, 2, 3)]
  with pytest.raises(ValueError, match=r"synthetic.latency_p99_ms=10 is below latency_ms=30"):
    synthetic.SyntheticConfig(latency_ms=30.0, latency_p99_ms=10.0)
