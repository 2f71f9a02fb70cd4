"""The bandit algorithms: convergence claim on random instances, basic
properties of the updates, and config errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.configs import bandit as bandit_config
from seeupo_jax.theory import algorithms
from seeupo_jax.theory import bandit as bandit_lib
from seeupo_jax.theory import instances
from seeupo_jax.theory import policies
from seeupo_jax.theory import sweep


def _config(**overrides):
  config = bandit_config.get_config()
  config.update(overrides)
  return config


def test_seeupo_reaches_optimum_on_random_instances():
  # 3 contexts x 2 actions x 3 turns, 16 rollouts per context, 200
  # iterations, lr 3 (the best of the grid for this size in the sweep).
  config = _config(num_turns=3, num_seeds=100, learning_rates="3")
  bandits = sweep.make_instances(config, "random")
  _, keys = sweep._seed_keys(config)  # pylint: disable=protected-access
  curves = np.asarray(sweep.make_setting_fn(config, "seeupo")(bandits, keys, jnp.array([3.0])))[0]
  final = curves[:, -1]
  # J* is the global optimum, so no run can exceed it.
  assert final.max() <= 1.0 + 1e-5
  assert np.mean(final >= 0.99) >= 0.95, np.sort(final)[:10]


def _one_run(algorithm, **overrides):
  config = _config(num_iterations=15, **overrides)
  enum = bandit_lib.enumerate_bandit(config.num_contexts, config.num_actions, config.num_turns)
  policy = policies.get_policy(config.policy, enum)
  train = jax.jit(
    algorithms.make_train_fn(config, enum, policy, algorithms.get_algorithm(algorithm))
  )
  bandit = instances.random_instance(jax.random.PRNGKey(0), 3, 2, 3)
  return train(jax.random.PRNGKey(1), bandit, jnp.float32(10.0)), bandit


_SHORT = dict(num_turns=3, num_iterations=15, num_seeds=3)


@pytest.fixture(scope="module")
def short_curves():
  """[3 runs, 16] J/J* of every algorithm, 15 iterations, lr 10."""
  config = _config(**_SHORT)
  bandits = sweep.make_instances(config, "random")
  _, keys = sweep._seed_keys(config)  # pylint: disable=protected-access
  return {
    name: np.asarray(sweep.make_setting_fn(config, name)(bandits, keys, jnp.array([10.0])))[0]
    for name in sorted(algorithms.ALGORITHMS)
  }, bandits


@pytest.mark.slow  # the fixture compiles all 11 algorithms (~60 s)
def test_every_algorithm_runs_and_improves(short_curves):
  curves, bandits = short_curves
  j_star = np.asarray(jax.vmap(bandit_lib.optimal_return)(bandits))
  # Uniform start: J_0 = mean reward over leaves (uniform contexts).
  j0 = np.asarray(bandits.rewards).mean((1, 2)) / j_star
  for name, c in curves.items():
    assert c.shape == (3, 16), name
    assert np.all(c <= 1.0 + 1e-5), name
    np.testing.assert_allclose(c[:, 0], j0, rtol=1e-5, err_msg=name)
    assert np.all(c[:, -1] > c[:, 0]), name


@pytest.mark.slow
def test_correction_and_order_change_the_result(short_curves):
  curves, _ = short_curves
  for other in ("seeupo_nocorr", "seeupo_forward", "seeupo_random"):
    assert not np.allclose(curves["seeupo"], curves[other]), other


def test_clipping_acts_with_several_steps_per_turn():
  out, _ = _one_run("seeupo", num_turns=3, epochs_per_turn=4, minibatches_per_turn=2)
  assert float(np.max(out.clip_fraction)) > 0.0


def test_gamma_below_one_runs():
  out, _ = _one_run("seeupo", num_turns=3, gamma=0.5)
  assert out.returns[-1] > out.returns[0]
  out, _ = _one_run("ppo", num_turns=3, gamma=0.5)
  assert np.all(np.isfinite(out.returns))


def test_bad_config_values_name_the_key():
  with pytest.raises(ValueError, match="algorithms.*allowed.*seeupo"):
    algorithms.get_algorithm("ppo2")
  with pytest.raises(ValueError, match="minibatches_per_turn"):
    _one_run("seeupo", minibatches_per_turn=5)
  with pytest.raises(ValueError, match="gamma"):
    _one_run("seeupo", gamma=1.5)
  with pytest.raises(ValueError, match="policy.*allowed"):
    sweep.validate(_config(policy="mlp"))
  with pytest.raises(ValueError, match="learning_rates"):
    sweep.validate(_config(learning_rates="fast"))


def _numpy_seeupo_iteration(rollouts, num_states, k, t_, lr, gamma, order):
  """One SeeUPO iteration with 1 epoch x 1 minibatch per turn, by hand.

  At the single step the ratio is 1, so the gradient of the sequence-level
  clipped loss on turn t is -(1/B) sum_i A_i M_i d log pi(a_it | s_it).
  """
  states = np.asarray(rollouts.states)
  actions = np.asarray(rollouts.actions)
  rewards = np.asarray(rollouts.rewards, np.float64)
  groups = np.asarray(rollouts.contexts)
  b = len(rewards)
  adv = rewards - np.array([rewards[groups == g].mean() for g in groups])
  adv = (adv - adv.mean()) / adv.std(ddof=1)
  adv = np.clip(adv, -3.0, 3.0)
  logits = np.zeros((num_states, k))
  correction = np.ones(b)

  def log_pi():
    z = logits - logits.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))

  for t in order:
    old = log_pi()[states[:, t], actions[:, t]]
    probs = np.exp(log_pi())
    grad = np.zeros_like(logits)
    weight = adv * correction * gamma ** (t_ - 1 - t)
    for i in range(b):
      s, a = states[i, t], actions[i, t]
      grad[s] -= weight[i] * (np.eye(k)[a] - probs[s]) / b
    logits -= lr * grad
    new = log_pi()[states[:, t], actions[:, t]]
    rho = np.clip(np.exp(new - old), 0.8, 1.2)
    correction = np.clip(correction * rho, 0.8, 1.2)
  return log_pi()


@pytest.mark.parametrize(
  "algorithm,gamma,order",
  [("seeupo", 1.0, (2, 1, 0)), ("seeupo", 0.5, (2, 1, 0)), ("seeupo_forward", 1.0, (0, 1, 2))],
)
def test_one_seeupo_iteration_matches_numpy(algorithm, gamma, order):
  config = _config(
    num_turns=3, num_iterations=1, epochs_per_turn=1, minibatches_per_turn=1, gamma=gamma
  )
  enum = bandit_lib.enumerate_bandit(3, 2, 3)
  policy = policies.tabular_policy(enum)
  train = algorithms.make_train_fn(config, enum, policy, algorithms.get_algorithm(algorithm))
  bandit = instances.random_instance(jax.random.PRNGKey(4), 3, 2, 3)
  key, lr = jax.random.PRNGKey(5), 30.0  # large lr: M is clipped for some rows
  out = train(key, bandit, jnp.float32(lr))
  # The rollouts of iteration 0, drawn with the same keys as `train`.
  key_sample, _ = jax.random.split(jax.random.split(key, 1)[0])
  uniform = policies.log_policy(policy, policies.init_params(policy))
  rollouts = bandit_lib.sample_rollouts(key_sample, bandit, enum, uniform, config.group_size)
  want_log_pi = _numpy_seeupo_iteration(rollouts, enum.num_states, 2, 3, lr, gamma, order)
  want = bandit_lib.expected_return(bandit, enum, jnp.asarray(want_log_pi))
  np.testing.assert_allclose(out.returns[1], want, rtol=1e-5)
  assert not np.isclose(float(out.returns[1]), float(out.returns[0]))
