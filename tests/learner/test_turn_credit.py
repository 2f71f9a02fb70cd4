"""GiGPO's and MT-GRPO's per-turn advantages (`losses.gigpo_advantages`,
`losses.mt_grpo_advantages`) against float64 NumPy references written from the papers'
definitions with dicts and loops, and hand-derived cases."""

import functools

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np

import losses_reference as lref
from seeupo_jax import losses


@functools.partial(jax.jit, static_argnames=("num_groups", "gamma", "step_weight", "group_std"))
def _gigpo(rewards, groups, keys, turn_valid, *, num_groups, **kwargs):
  return losses.gigpo_advantages(rewards, groups, num_groups, keys, turn_valid, **kwargs)


@functools.partial(jax.jit, static_argnames=("num_groups", "outcome_weight", "group_std"))
def _mt_grpo(rewards, turn_rewards, groups, turn_valid, *, num_groups, **kwargs):
  return losses.mt_grpo_advantages(rewards, turn_rewards, groups, num_groups, turn_valid, **kwargs)


@st.composite
def _batches(draw):
  b, t = 8, 4  # one shape: one compile (rows and turns vary through `valid` and `turn_valid`)
  groups = np.asarray(draw(st.lists(st.integers(0, 2), min_size=b, max_size=b)), np.int32)
  # Few distinct rewards and states, so groups and anchor states repeat.
  rewards = np.asarray(draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=b, max_size=b)))
  n_turns = np.asarray(draw(st.lists(st.integers(0, t), min_size=b, max_size=b)))
  turn_valid = np.arange(t)[None, :] < n_turns[:, None]
  keys = np.asarray(draw(st.lists(st.integers(-1, 2), min_size=b * t, max_size=b * t)))
  turn_rewards = np.asarray(
    draw(st.lists(st.sampled_from([0.0, 1.0, -0.5]), min_size=b * t, max_size=b * t))
  )
  valid = np.asarray(draw(st.lists(st.booleans(), min_size=b, max_size=b)))
  return dict(
    rewards=rewards.astype(np.float32),
    groups=groups,
    keys=keys.reshape(b, t).astype(np.int32),
    turn_rewards=turn_rewards.reshape(b, t).astype(np.float32),
    turn_valid=turn_valid,
    valid=valid | (np.arange(b) == 0),
  )


@hypothesis.given(
  _batches(), st.sampled_from([1.0, 0.9]), st.sampled_from([1.0, 0.5]), st.booleans()
)
def test_gigpo_equals_the_numpy_reference(batch, gamma, omega, group_std):
  got = _gigpo(
    jnp.asarray(batch["rewards"]),
    jnp.asarray(batch["groups"]),
    jnp.asarray(batch["keys"]),
    jnp.asarray(batch["turn_valid"]),
    num_groups=len(batch["rewards"]),
    gamma=gamma,
    step_weight=omega,
    group_std=group_std,
    valid=jnp.asarray(batch["valid"]),
  )
  want = lref.gigpo(
    batch["rewards"].astype(np.float64),
    batch["groups"],
    batch["keys"],
    batch["turn_valid"],
    batch["valid"],
    gamma,
    omega,
    group_std,
  )
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


@hypothesis.given(_batches(), st.sampled_from([1.0, 0.3]), st.booleans())
def test_mt_grpo_equals_the_numpy_reference(batch, lam, group_std):
  got = _mt_grpo(
    jnp.asarray(batch["rewards"]),
    jnp.asarray(batch["turn_rewards"]),
    jnp.asarray(batch["groups"]),
    jnp.asarray(batch["turn_valid"]),
    num_groups=len(batch["rewards"]),
    outcome_weight=lam,
    group_std=group_std,
    valid=jnp.asarray(batch["valid"]),
  )
  want = lref.mt_grpo(
    batch["rewards"].astype(np.float64),
    batch["turn_rewards"].astype(np.float64),
    batch["groups"],
    batch["turn_valid"],
    batch["valid"],
    lam,
    group_std,
  )
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def test_gigpo_by_hand():
  """One group of 3 rows, 2 turns each, centred (no std), gamma 0.5, omega 1.

  Rewards 1, 0, 0: A^E = 2/3, -1/3, -1/3. Returns: turn 0 gets 0.5 R, turn 1 gets R.
  States: turn 0 of every row is the task's start (key 7); turn 1: rows 0 and 1 reach key 3,
  row 2 key 4 (alone). Step terms: turn 0: 0.5 R - mean(0.5, 0, 0) = 1/3, -1/6, -1/6;
  turn 1: rows 0, 1: R - mean(1, 0) = 1/2, -1/2; row 2: 0 (a group of one).
  """
  got = losses.gigpo_advantages(
    jnp.asarray([1.0, 0.0, 0.0]),
    jnp.zeros(3, jnp.int32),
    3,
    jnp.asarray([[7, 3], [7, 3], [7, 4]], jnp.int32),
    jnp.ones((3, 2), bool),
    gamma=0.5,
    group_std=False,
  )
  want = [
    [2 / 3 + 1 / 3, 2 / 3 + 1 / 2],
    [-1 / 3 - 1 / 6, -1 / 3 - 1 / 2],
    [-1 / 3 - 1 / 6, -1 / 3],
  ]
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-6)


def test_mt_grpo_by_hand():
  """One group of 3 rows, centred. Row 2 stops after one turn.

  Outcome 1, 0, 1: A^O = 1/3, -2/3, 1/3. Turn rewards r_0 = 1, 0, 0 (all three have turn 0):
  A^r_0 = 2/3, -1/3, -1/3; r_1 = 1, 0 (rows 0, 1 only): A^r_1 = 1/2, -1/2.
  Turn 0 gets A^r_0 + A^r_1 + A^O (row 2: A^r_0 + A^O), turn 1 gets A^r_1 + A^O.
  """
  got = losses.mt_grpo_advantages(
    jnp.asarray([1.0, 0.0, 1.0]),
    jnp.asarray([[1.0, 1.0], [0.0, 0.0], [0.0, 9.0]]),  # row 2's 9 is past its last turn
    jnp.zeros(3, jnp.int32),
    3,
    jnp.asarray([[True, True], [True, True], [True, False]]),
    group_std=False,
  )
  want = [
    [2 / 3 + 1 / 2 + 1 / 3, 1 / 2 + 1 / 3],
    [-1 / 3 - 1 / 2 - 2 / 3, -1 / 2 - 2 / 3],
    [-1 / 3 + 1 / 3, 0.0],
  ]
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-6)


def test_a_turn_level_algorithm_names_the_batch_field_it_lacks():
  """`objectives.turn_advantages` on a batch without the field the algorithm reads: a ValueError
  naming the field (what `run.py` refuses at config time, `program._check_turn_inputs`)."""
  import pytest  # noqa: PLC0415

  from seeupo_jax import learner  # noqa: PLC0415
  from seeupo_jax.learner import batch as batch_lib  # noqa: PLC0415
  from seeupo_jax.learner import objectives  # noqa: PLC0415

  n, length = 2, 4
  batch = batch_lib.Batch(
    tokens=jnp.zeros((n, length), jnp.int32),
    token_valid=jnp.ones((n, length), bool),
    turn_ids=jnp.zeros((n, length), jnp.int32),
    sample_logp=jnp.zeros((n, length), jnp.float32),
    rewards=jnp.array([0.0, 1.0], jnp.float32),
    group_ids=jnp.zeros((n,), jnp.int32),
    row_valid=jnp.ones((n,), bool),
    turn_rewards=jnp.ones((n, 1), jnp.float32),
    turn_states=jnp.zeros((n, 1), jnp.int32),
  )
  for algorithm, field, what in (
    ("gigpo", "turn_states", "state key"),
    ("mt_grpo", "turn_rewards", "reward"),
  ):
    config = learner.LearnerConfig(algorithm=algorithm, num_turns=1)
    assert objectives.turn_advantages(batch, config).shape == (n, 1)  # with the field
    lacking = batch.replace(**{field: None})
    with pytest.raises(ValueError, match=f"needs Batch.{field} .*environment's {what} per turn"):
      objectives.turn_advantages(lacking, config)
