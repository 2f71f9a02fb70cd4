"""The bandit algorithms (run by `seeupo_jax.learner`): a rollout batch as a
learner Batch, one iteration of every algorithm against a NumPy re-derivation,
the convergence claim on random instances, basic properties, config errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shared_runs  # tests/shared_runs.py

from experiments.configs import bandit as bandit_config
from seeupo_jax import learner
from seeupo_jax.learner import batch as batch_lib
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
def short_curves(tmp_path_factory):
  """[3 runs, 16] J/J* of every algorithm, 15 iterations, lr 10, and the 3 instances. The curves
  are made once per test session, whichever xdist worker asks first (`shared_runs.once`: a module
  fixture would compile every algorithm again on each worker that runs one of its tests)."""
  config = _config(**_SHORT)
  bandits = sweep.make_instances(config, "random")

  def make(directory):
    del directory
    _, keys = sweep._seed_keys(config)  # pylint: disable=protected-access
    return {
      name: np.asarray(sweep.make_setting_fn(config, name)(bandits, keys, jnp.array([10.0])))[
        0
      ].tolist()
      for name in sorted(algorithms.ALGORITHMS)
    }

  curves = shared_runs.once(tmp_path_factory, "theory_short_curves", make)
  return {name: np.asarray(c, np.float32) for name, c in curves.items()}, bandits


@pytest.mark.slow  # the fixture compiles every algorithm of the registry (15)
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


def _iteration_rollouts(key, bandit, enum, log_pi, group_size, iteration=0, iterations=1):
  """The rollouts `train` draws at `iteration` (same keys), under the policy log_pi."""
  key_sample, _ = jax.random.split(jax.random.split(key, iterations)[iteration])
  return bandit_lib.sample_rollouts(key_sample, bandit, enum, jnp.asarray(log_pi), group_size)


@pytest.mark.parametrize("policy_name", sorted(policies.POLICIES))
def test_rollout_batch_is_a_learner_batch(policy_name):
  x_, k, t_, n = 3, 3, 3, 4
  enum = bandit_lib.enumerate_bandit(x_, k, t_)
  policy = policies.get_policy(policy_name, enum)
  theta = jax.random.normal(jax.random.PRNGKey(0), (policy.num_params,))
  log_pi = policies.log_policy(policy, theta)
  bandit = instances.random_instance(jax.random.PRNGKey(1), x_, k, t_)
  r = bandit_lib.sample_rollouts(jax.random.PRNGKey(2), bandit, enum, log_pi, n)
  batch = algorithms.rollout_batch(r, log_pi)
  learner.validate(jax.tree.map(np.asarray, batch), t_)
  tokens = np.asarray(batch.tokens)
  np.testing.assert_array_equal(tokens[:, 0], r.contexts)
  np.testing.assert_array_equal(tokens[:, 1:], r.actions)
  np.testing.assert_array_equal(batch.turn_ids, np.tile(np.arange(-1, t_), (x_ * n, 1)))
  np.testing.assert_array_equal(batch.group_ids, np.repeat(np.arange(x_), n))
  np.testing.assert_array_equal(batch.rewards, r.rewards)
  assert np.all(batch.token_valid) and np.all(batch.row_valid)
  # States from the tokens alone, by the numbering x P + offset[t] + prefix (by hand).
  per_context = 1 + k + k * k
  for i in range(x_ * n):
    x, a = tokens[i, 0], tokens[i, 1:]
    want = [x * per_context, x * per_context + 1 + a[0], x * per_context + 1 + k + a[0] * k + a[1]]
    np.testing.assert_array_equal(algorithms.decision_states(enum, batch.tokens)[i], want)
  np.testing.assert_array_equal(algorithms.decision_states(enum, batch.tokens), r.states)
  # logprob_fn: log pi(a_t | s_t) at column 1 + t, 0 at the context.
  logp = np.asarray(algorithms.make_logprob_fn(enum, policy)(theta, batch))
  want = np.asarray(log_pi)[np.asarray(r.states), np.asarray(r.actions)]
  np.testing.assert_allclose(logp[:, 1:], want, rtol=1e-6)
  np.testing.assert_array_equal(logp[:, 0], 0.0)
  np.testing.assert_allclose(batch.sample_logp, logp, rtol=1e-6)
  critic = jnp.arange(enum.num_states, dtype=jnp.float32)
  values = np.asarray(algorithms.make_value_fn(enum)(critic, batch))
  np.testing.assert_array_equal(values[:, 1:], r.states)
  np.testing.assert_array_equal(values[:, 0], 0.0)
  # GiGPO's anchor states are the decision states; MT-GRPO's turn rewards the family's.
  np.testing.assert_array_equal(batch.turn_states, r.states)
  np.testing.assert_array_equal(batch.turn_rewards, 0.0)  # `random` reports none
  additive = instances.additive_instance(jax.random.PRNGKey(1), x_, k, t_)
  r = bandit_lib.sample_rollouts(jax.random.PRNGKey(2), additive, enum, log_pi, n)
  batch = algorithms.rollout_batch(r, log_pi)
  np.testing.assert_array_equal(batch.turn_rewards, r.turn_rewards)
  np.testing.assert_allclose(np.asarray(batch.turn_rewards).sum(1), r.rewards, rtol=1e-6)
  # `walk`: the anchor states are the positions' keys, which different histories share.
  walk = instances.walk_instance(jax.random.PRNGKey(1), x_, k, t_)
  r = bandit_lib.sample_rollouts(jax.random.PRNGKey(2), walk, enum, log_pi, n)
  batch = algorithms.rollout_batch(r, log_pi)
  learner.validate(jax.tree.map(np.asarray, batch), t_)
  actions = np.asarray(r.actions)
  positions = np.cumsum(actions, 1) - actions
  width = (k - 1) * (t_ - 1) + 1
  want = (np.asarray(r.contexts)[:, None] * t_ + np.arange(t_)) * width + positions
  np.testing.assert_array_equal(batch.turn_states, want)
  assert np.all(batch.token_valid)
  # `stop`: a row's turns end at its first 0; the tokens after it are neither valid nor a turn.
  stop = instances.stop_instance(jax.random.PRNGKey(1), x_, k, t_)
  r = bandit_lib.sample_rollouts(jax.random.PRNGKey(2), stop, enum, log_pi, n)
  batch = algorithms.rollout_batch(r, log_pi)
  learner.validate(jax.tree.map(np.asarray, batch), t_)
  stopped = 0
  for i, acts in enumerate(np.asarray(r.actions)):
    last = list(acts).index(0) if 0 in acts else t_ - 1
    stopped += last < t_ - 1
    np.testing.assert_array_equal(batch.token_valid[i], np.arange(t_ + 1) <= last + 1)
    np.testing.assert_array_equal(
      batch.turn_ids[i], np.where(np.arange(t_ + 1) <= last + 1, np.arange(-1, t_), -1)
    )
  np.testing.assert_array_equal(batch_lib.row_turns(batch, t_), r.turn_valid)
  assert stopped > 0


def test_learner_configs():
  config = _config(epochs_per_turn=3, minibatches_per_turn=2, clip_eps=0.1, correction_clip=0.3)
  enum = bandit_lib.enumerate_bandit(3, 2, 4)
  got = {
    name: algorithms.learner_config(config, enum, spec)
    for name, spec in algorithms.ALGORITHMS.items()
  }
  for name, c in got.items():
    assert c.kl_coef == 0.0 and c.num_turns == 4, name
    assert (c.clip_low, c.clip_high) == (0.1, 0.1), name
    assert (c.correction_clip_low, c.correction_clip_high) == (0.3, 0.3), name
    on_policy = name in ("reinforce", "rloo")
    assert (c.epochs, c.minibatches) == ((1, 1) if on_policy else (3, 2)), name
  assert [got[n].order for n in ("seeupo", "seeupo_forward", "seeupo_random")] == [
    "reverse",
    "forward",
    "random",
  ]
  assert not got["seeupo_nocorr"].correction and got["seeupo"].correction
  norms = {n: c.advantage_normalisation for n, c in got.items()}
  assert norms["seeupo"] == "batch" and norms["seeupo_groupstd"] == "group"
  assert norms["grpo"] == norms["gspo"] == "group" and norms["seeupo_nonorm"] == "none"
  assert norms["gigpo"] == norms["mt_grpo"] == "group"
  assert norms["gigpo_nonorm"] == norms["mt_grpo_nonorm"] == "none"
  assert got["seeupo"].advantage_clip == 3.0
  assert got["ppo"].advantage_clip is None and got["ppo"].value_clip is None


def _log_softmax(logits):
  z = logits - logits.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _numpy_advantages(rewards, groups, normalisation):
  """GRAE (group mean; group std / batch whitening + clamp 3 / none) or RLOO, by hand."""
  rewards = np.asarray(rewards, np.float64)
  same = groups[:, None] == groups[None, :]
  mean = (same * rewards[None]).sum(1) / same.sum(1)
  if normalisation == "rloo":
    leave_one_out = ((same * rewards[None]).sum(1) - rewards) / (same.sum(1) - 1)
    return rewards - leave_one_out
  adv = rewards - mean
  if normalisation == "group":
    std = np.array([rewards[groups == g].std(ddof=1) for g in groups])
    adv = adv / (std + 1e-6)
  elif normalisation == "batch":
    adv = np.clip((adv - adv.mean()) / adv.std(ddof=1), -3.0, 3.0)
  return adv


def _first_iteration(algorithm, instance, gamma=1.0):
  """One iteration (1 epoch x 1 mini-batch, lr 3) of `algorithm` on a 3-context, 2-action,
  3-turn instance of `instance`: (its output, the bandit, its tables, the rollouts it drew)."""
  x_, k, t_ = 3, 2, 3
  config = _config(
    num_turns=t_, num_iterations=1, epochs_per_turn=1, minibatches_per_turn=1, gamma=gamma
  )
  enum = bandit_lib.enumerate_bandit(x_, k, t_)
  policy = policies.tabular_policy(enum)
  train = algorithms.make_train_fn(config, enum, policy, algorithms.get_algorithm(algorithm))
  bandit = instance(jax.random.PRNGKey(6), x_, k, t_)
  key = jax.random.PRNGKey(7)
  out = train(key, bandit, jnp.float32(_LR))
  uniform = np.full((enum.num_states, k), -np.log(k))
  return out, bandit, enum, _iteration_rollouts(key, bandit, enum, uniform, config.group_size)


_LR = 3.0


def _check_one_step(out, bandit, enum, rollouts, advantages):
  """The policy-gradient step from the uniform policy with per-turn advantages [B, T]:
  theta = -lr * grad, grad = -(1/B) sum_i (1/T_i) sum_{t < T_i} A_it d log pi(a_it | s_it)
  (T_i: row i's turns, `rollouts.turn_valid`), whose exact J must be the run's J after its
  iteration."""
  states, actions = np.asarray(rollouts.states), np.asarray(rollouts.actions)
  turn_valid = np.asarray(rollouts.turn_valid)
  (b, t_), k = states.shape, enum.num_actions
  grad = np.zeros((enum.num_states, k))
  for i in range(b):
    turns = int(turn_valid[i].sum())
    for t in range(turns):
      s, a = states[i, t], actions[i, t]
      grad[s] -= advantages[i, t] * (np.eye(k)[a] - 1.0 / k) / (b * turns)
  want = bandit_lib.expected_return(bandit, enum, jnp.asarray(_log_softmax(-_LR * grad)))
  np.testing.assert_allclose(out.returns[1], want, rtol=1e-5)
  assert not np.isclose(float(out.returns[1]), float(out.returns[0]))


@pytest.mark.parametrize("gamma", [1.0, 0.5])
@pytest.mark.parametrize("algorithm", ["grpo", "gspo", "reinforce", "rloo"])
def test_one_simultaneous_iteration_matches_numpy(algorithm, gamma):
  """1 epoch x 1 mini-batch: the ratio is 1 at the single step, so every critic-free
  simultaneous loss has the gradient -(1/B) sum_i (1/T) sum_t A_i gamma^(T-1-t) d log pi(a_it|s_it)
  (seq-mean-token-mean over the T actions of each row)."""
  out, bandit, enum, r = _first_iteration(algorithm, instances.random_instance, gamma)
  norm = {"grpo": "group", "gspo": "group", "reinforce": "none", "rloo": "rloo"}[algorithm]
  adv = _numpy_advantages(r.rewards, np.asarray(r.contexts), norm)
  t_ = enum.num_turns
  _check_one_step(out, bandit, enum, r, adv[:, None] * gamma ** (t_ - 1 - np.arange(t_)))


@pytest.mark.parametrize("algorithm", ["gigpo", "mt_grpo"])
def test_one_turn_level_iteration_matches_numpy(algorithm):
  """GiGPO and MT-GRPO on `additive` (turn rewards = the outcome's terms), 1 epoch x 1
  mini-batch (ratio 1): the gradient is -(1/B) sum_i (1/T) sum_t A_it d log pi(a_it|s_it) with
  A the float64 references of tests/losses_reference.py (GiGPO's anchor states = the decision
  states; MT-GRPO's turn rewards = the family's)."""
  import losses_reference as lref  # noqa: PLC0415  (tests/losses_reference.py)

  out, bandit, enum, r = _first_iteration(algorithm, instances.additive_instance)
  groups, rewards = np.asarray(r.contexts), np.asarray(r.rewards, np.float64)
  every = np.ones(r.states.shape, bool), np.ones(len(rewards), bool)
  if algorithm == "gigpo":
    adv = lref.gigpo(rewards, groups, np.asarray(r.states), *every, 1.0, 1.0, True)
  else:
    turn_rewards = np.asarray(r.turn_rewards, np.float64)
    np.testing.assert_allclose(turn_rewards.sum(1), rewards, rtol=1e-6)
    adv = lref.mt_grpo(rewards, turn_rewards, groups, *every, 1.0, True)
  _check_one_step(out, bandit, enum, r, adv)


@pytest.mark.parametrize(
  "algorithm,family", [("gigpo", "walk"), ("gigpo", "stop"), ("mt_grpo", "stop")]
)
def test_turn_level_iteration_with_shared_states_and_stops_matches_numpy(algorithm, family):
  """The same check on `walk` (GiGPO's anchor states = the positions, shared by different
  histories) and `stop` (rows end at their first 0: a row's turns, T_i, are a prefix; each
  turn's group holds only the rows that reached it): A from the float64 references with the
  family's keys and turn_valid, the gradient averaged over each row's own T_i turns."""
  import losses_reference as lref  # noqa: PLC0415  (tests/losses_reference.py)

  out, bandit, enum, r = _first_iteration(algorithm, instances.get_family(family))
  groups, rewards = np.asarray(r.contexts), np.asarray(r.rewards, np.float64)
  turn_valid, every = np.asarray(r.turn_valid), np.ones(len(rewards), bool)
  if family == "walk":  # some anchor state holds rows of different histories
    keys, states = np.asarray(r.turn_states), np.asarray(r.states)
    assert any(len({*states[keys == key]}) > 1 for key in np.unique(keys))
  else:
    assert not turn_valid.all() and turn_valid[:, 0].all()
  if algorithm == "gigpo":
    keys = np.asarray(r.turn_states)
    adv = lref.gigpo(rewards, groups, keys, turn_valid, every, 1.0, 1.0, True)
  else:
    adv = lref.mt_grpo(
      rewards, np.asarray(r.turn_rewards, np.float64), groups, turn_valid, every, 1.0, True
    )
  _check_one_step(out, bandit, enum, r, adv)


def _numpy_ppo_step(theta, critic, rollouts, lr, critic_lr, gamma, lam):
  """One PPO iteration (1 x 1, ratio 1) with a tabular critic, by hand.

  GAE over the T actions (reward after the last), whitened over the B T tokens
  (unbiased std, no clamp); policy gradient -(1/(B T)) sum_it A_it d log pi;
  critic: token-mean of 1/2 (V - R)^2, one SGD step at rate critic_lr.
  """
  states, actions = np.asarray(rollouts.states), np.asarray(rollouts.actions)
  rewards = np.asarray(rollouts.rewards, np.float64)
  b, t_ = states.shape
  values = critic[states]
  adv = np.zeros((b, t_))
  next_value, next_adv = np.zeros(b), np.zeros(b)
  for t in reversed(range(t_)):
    reward = rewards if t == t_ - 1 else 0.0
    adv[:, t] = reward + gamma * next_value - values[:, t] + gamma * lam * next_adv
    next_value, next_adv = values[:, t], adv[:, t]
  returns = adv + values
  adv = (adv - adv.mean()) / adv.std(ddof=1)
  log_pi = _log_softmax(theta)
  grad, critic_grad = np.zeros_like(theta), np.zeros_like(critic)
  k = theta.shape[1]
  for i in range(b):
    for t in range(t_):
      s, a = states[i, t], actions[i, t]
      grad[s] -= adv[i, t] * (np.eye(k)[a] - np.exp(log_pi[s])) / (b * t_)
      critic_grad[s] += (values[i, t] - returns[i, t]) / (b * t_)
  return theta - lr * grad, critic - critic_lr * critic_grad


def test_two_ppo_iterations_match_numpy():
  x_, k, t_ = 3, 2, 3
  gamma, lam, critic_lr, lr = 0.8, 0.5, 0.7, 3.0
  config = _config(
    num_turns=t_,
    num_iterations=2,
    epochs_per_turn=1,
    minibatches_per_turn=1,
    gamma=gamma,
    gae_lambda=lam,
    critic_lr=critic_lr,
  )
  enum = bandit_lib.enumerate_bandit(x_, k, t_)
  policy = policies.tabular_policy(enum)
  train = algorithms.make_train_fn(config, enum, policy, algorithms.get_algorithm("ppo"))
  bandit = instances.random_instance(jax.random.PRNGKey(8), x_, k, t_)
  key = jax.random.PRNGKey(9)
  out = train(key, bandit, jnp.float32(lr))
  theta, critic = np.zeros((enum.num_states, k)), np.zeros(enum.num_states)
  for it in range(2):
    r = _iteration_rollouts(
      key, bandit, enum, _log_softmax(theta).astype(np.float32), config.group_size, it, 2
    )
    theta, critic = _numpy_ppo_step(theta, critic, r, lr, critic_lr, gamma, lam)
    want = bandit_lib.expected_return(bandit, enum, jnp.asarray(_log_softmax(theta)))
    # Iteration 2's advantages come from the critic learned in iteration 1.
    np.testing.assert_allclose(out.returns[it + 1], want, rtol=1e-5)
  assert np.any(critic != 0)


def test_learning_rates_vmap_like_separate_runs():
  config = _config(num_turns=3, num_iterations=4)
  enum = bandit_lib.enumerate_bandit(3, 2, 3)
  policy = policies.tabular_policy(enum)
  train = algorithms.make_train_fn(config, enum, policy, algorithms.get_algorithm("seeupo"))
  bandit = instances.random_instance(jax.random.PRNGKey(0), 3, 2, 3)
  key, lrs = jax.random.PRNGKey(1), jnp.array([0.3, 10.0])
  both = jax.jit(jax.vmap(lambda lr: train(key, bandit, lr).returns))(lrs)
  for i, lr in enumerate(lrs):
    np.testing.assert_allclose(both[i], jax.jit(train)(key, bandit, lr).returns, rtol=1e-5)
  assert not np.allclose(both[0], both[1])


def test_optimizer_state_lives_across_iterations():
  """With momentum, `train` equals a Python loop of learner updates that keeps one state,
  and differs from one that starts a fresh optimizer state every iteration."""
  config = _config(num_turns=3, num_iterations=3, epochs_per_turn=1, minibatches_per_turn=1)
  enum = bandit_lib.enumerate_bandit(3, 2, 3)
  policy = policies.tabular_policy(enum)
  spec = algorithms.get_algorithm("grpo")
  momentum = lambda learning_rate: optax.sgd(learning_rate, momentum=0.9)
  train = algorithms.make_train_fn(config, enum, policy, spec, optimizer=momentum)
  bandit = instances.random_instance(jax.random.PRNGKey(2), 3, 2, 3)
  key, lr = jax.random.PRNGKey(3), 1.0
  got = jax.jit(train)(key, bandit, jnp.float32(lr)).returns
  update = learner.make_update(
    algorithms.make_logprob_fn(enum, policy),
    momentum(lr),
    algorithms.learner_config(config, enum, spec),
    jit=False,
  )

  def loop(fresh_state_each_iteration):
    theta = policies.init_params(policy)
    opt_state = momentum(lr).init(theta)
    returns = []
    for iter_key in jax.random.split(key, 3):
      if fresh_state_each_iteration:
        opt_state = momentum(lr).init(theta)
      key_sample, key_update = jax.random.split(iter_key)
      log_pi = policies.log_policy(policy, theta)
      r = bandit_lib.sample_rollouts(key_sample, bandit, enum, log_pi, config.group_size)
      state = learner.TrainState(theta, opt_state, None, None, None, 0, 0, 0)
      state, _ = update(state, algorithms.rollout_batch(r, log_pi), key_update)
      theta, opt_state = state.params, state.opt_state
      returns.append(bandit_lib.expected_return(bandit, enum, policies.log_policy(policy, theta)))
    return np.array(returns)

  np.testing.assert_allclose(got[1:], loop(False), rtol=1e-5)
  assert not np.allclose(got[1:], loop(True), rtol=1e-3)
