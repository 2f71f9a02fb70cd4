"""Stale samples on the bandits: `lag` k samples iteration i with the params of iteration
max(0, i - 1 - k), `tis` weighs each turn's policy loss by min(pi_prox / pi_behav, C). The ring
of params by hand, several iterations of SeeUPO, GRPO and GSPO against float64 NumPy
re-derivations, TIS at lag 0 equal to no TIS, the staleness table on hand-made cells, and the
config keys' errors."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from experiments.configs import bandit as bandit_config
from seeupo_jax.theory import algorithms
from seeupo_jax.theory import bandit as bandit_lib
from seeupo_jax.theory import grid
from seeupo_jax.theory import instances
from seeupo_jax.theory import policies
from seeupo_jax.theory import sweep


def _config(**overrides):
  config = bandit_config.get_config()
  config.update(overrides)
  return config


# ----------------------------------------------------------------------------------------------
# The ring of params.


@pytest.mark.parametrize("lag", [0, 1, 2, 3])
def test_ring_gives_the_params_of_iteration_i_minus_1_minus_lag(lag):
  # theta_m = m (a scalar and a vector leaf): after m iterations the params are m.
  theta = lambda m: {"a": jnp.float32(m), "b": jnp.full((2,), m, jnp.float32)}
  ring = algorithms.ring_start(theta(0), lag)
  assert ring["b"].shape == (lag + 1, 2)
  for j in range(8):  # 0-based iteration j = 1-based iteration i = j + 1
    got = algorithms.ring_read(ring, jnp.int32(j))
    want = max(0, (j + 1) - 1 - lag)
    assert float(got["a"]) == want and np.all(np.asarray(got["b"]) == want), (lag, j)
    ring = algorithms.ring_write(ring, jnp.int32(j), theta(j + 1))


# ----------------------------------------------------------------------------------------------
# Several iterations against NumPy.


def _log_softmax(logits):
  z = logits - logits.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _advantages(rewards, groups, normalisation):
  """GRAE: group mean, then batch whitening and clamp 3 (SeeUPO) or group std (GRPO/GSPO)."""
  rewards = np.asarray(rewards, np.float64)
  adv = rewards - np.array([rewards[groups == g].mean() for g in groups])
  if normalisation == "batch":
    return np.clip((adv - adv.mean()) / adv.std(ddof=1), -3.0, 3.0)
  std = np.array([rewards[groups == g].std(ddof=1) for g in groups])
  return adv / (std + 1e-6)


def _tis_weights(log_ratio, tis, cap):
  """[B, T] w from log pi_prox - log pi_behav of each turn's action: per turn (token; SeeUPO's
  sequence level, one token a turn) or the row's geometric mean (sequence, one ratio a row)."""
  if tis == "off":
    return np.ones_like(log_ratio)
  if tis == "sequence":
    log_ratio = np.repeat(log_ratio.mean(1, keepdims=True), log_ratio.shape[1], 1)
  return np.minimum(np.exp(log_ratio), cap)


def _grad_log_pi(logits, states, actions, weight):
  """sum_i weight_i d log pi(a_i | s_i) / d logits, tabular; [S, K]."""
  probs = np.exp(_log_softmax(logits))
  k = logits.shape[1]
  grad = np.zeros_like(logits)
  for s, a, w in zip(states, actions, weight):
    grad[s] += w * (np.eye(k)[a] - probs[s])
  return grad


def _seeupo_step(logits, r, w, lr, order=(2, 1, 0)):
  """One SeeUPO iteration, 1 epoch x 1 mini-batch per turn (the ratio is 1 at the only step):
  turn t ascends (1/B) sum_i A_i w_it M_i log pi(a_it | s_it); M from the proximal chain."""
  states, actions = np.asarray(r.states), np.asarray(r.actions)
  adv = _advantages(r.rewards, np.asarray(r.contexts), "batch")
  b = len(adv)
  correction = np.ones(b)
  for t in order:
    old = _log_softmax(logits)[states[:, t], actions[:, t]]
    logits = logits + lr * _grad_log_pi(
      logits, states[:, t], actions[:, t], adv * w[:, t] * correction / b
    )
    new = _log_softmax(logits)[states[:, t], actions[:, t]]
    correction = np.clip(correction * np.clip(np.exp(new - old), 0.8, 1.2), 0.8, 1.2)
  return logits


def _simultaneous_step(logits, r, w, lr):
  """One GRPO / GSPO iteration (1 x 1, ratio 1): ascends (1/(B T)) sum_it A_i w_it log pi."""
  states, actions = np.asarray(r.states), np.asarray(r.actions)
  adv = _advantages(r.rewards, np.asarray(r.contexts), "group")
  b, t_ = states.shape
  weight = (adv[:, None] * w / (b * t_)).reshape(-1)
  return logits + lr * _grad_log_pi(logits, states.reshape(-1), actions.reshape(-1), weight)


def _numpy_run(algorithm, key, bandit, enum, config, lr):
  """`train` by hand in float64: iteration j samples (same keys) with theta_{max(0, j - lag)},
  weighs with the current params' log-probs against the sampler's, steps from the current
  params. Returns ([I] J after each iteration, [I] share of weights truncated at the cap)."""
  iterations, lag = int(config.num_iterations), int(config.lag)
  step = _seeupo_step if algorithm == "seeupo" else _simultaneous_step
  thetas, returns, truncated = [np.zeros((enum.num_states, enum.num_actions))], [], []
  for j in range(iterations):
    behaviour = _log_softmax(thetas[max(0, j - lag)]).astype(np.float32)
    key_sample, _ = jax.random.split(jax.random.split(key, iterations)[j])
    r = bandit_lib.sample_rollouts(
      key_sample, bandit, enum, jnp.asarray(behaviour), config.group_size
    )
    states, actions = np.asarray(r.states), np.asarray(r.actions)
    log_ratio = _log_softmax(thetas[j])[states, actions] - behaviour[states, actions]
    w = _tis_weights(log_ratio, config.tis, config.tis_cap)
    truncated.append(np.mean(w >= config.tis_cap))
    thetas.append(step(thetas[j], r, w, lr))
    returns.append(float(bandit_lib.expected_return(bandit, enum, _log_softmax(thetas[-1]))))
  return np.array(returns), np.array(truncated)


@pytest.mark.parametrize(
  "algorithm,lag,tis,cap",
  [
    ("seeupo", 1, "token", 1.2),
    ("seeupo", 2, "off", 1.2),
    ("grpo", 2, "token", 1.2),
    ("gspo", 1, "sequence", 1.05),  # the geometric mean over 3 turns moves less than a turn
  ],
)
def test_lagged_iterations_match_numpy(algorithm, lag, tis, cap):
  x_, k, t_ = 3, 2, 3
  iterations, lr = lag + 3, 10.0  # lag + 2 iterations sample with theta_0, then theta_1, ...
  config = _config(
    num_turns=t_,
    num_iterations=iterations,
    epochs_per_turn=1,
    minibatches_per_turn=1,
    lag=lag,
    tis=tis,
    tis_cap=cap,
  )
  enum = bandit_lib.enumerate_bandit(x_, k, t_)
  policy = policies.tabular_policy(enum)
  train = algorithms.make_train_fn(config, enum, policy, algorithms.get_algorithm(algorithm))
  bandit = instances.random_instance(jax.random.PRNGKey(10 + lag), x_, k, t_)
  key = jax.random.PRNGKey(11)
  got = np.asarray(jax.jit(train)(key, bandit, jnp.float32(lr)).returns)
  want, truncated = _numpy_run(algorithm, key, bandit, enum, config, lr)
  np.testing.assert_allclose(got[1:], want, rtol=2e-5)
  # The check can fail: sampling with the current params (lag 0), or not weighing, gives
  # other returns.
  on_policy, _ = _numpy_run(
    algorithm, key, bandit, enum, _config(**{**config.to_dict(), "lag": 0}), lr
  )
  assert np.max(np.abs(on_policy - want)) > 1e-3
  if tis != "off":
    unweighted, _ = _numpy_run(
      algorithm, key, bandit, enum, _config(**{**config.to_dict(), "tis": "off"}), lr
    )
    assert np.max(np.abs(unweighted - want)) > 1e-3
    # Until the first update the behaviour is the current policy (w = 1); then some truncate.
    assert truncated[0] == 0.0 and truncated.max() > 0.0


# ----------------------------------------------------------------------------------------------
# Lag 0: TIS changes nothing.


def test_tis_at_lag_zero_is_no_tis():
  """At lag 0 the sampler is the current policy, so w = min(1, C) = 1: SeeUPO's curves with TIS
  equal those without (float rounding of the separately computed log-probs at most)."""
  config = _config(num_turns=3, num_iterations=8, num_seeds=2, lag=0, tis_cap=1.0)
  bandits = sweep.make_instances(config, "trap")
  _, keys = sweep._seed_keys(config)  # pylint: disable=protected-access
  curves = {}
  for tis in ("off", "token"):
    config.tis = tis
    curves[tis] = np.asarray(
      sweep.make_setting_fn(config, "seeupo")(bandits, keys, jnp.array([3.0]))
    )
  assert np.all(curves["off"][..., -1] > curves["off"][..., 0] + 0.01)
  np.testing.assert_allclose(curves["token"], curves["off"], rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# The staleness table and the config keys.


def test_staleness_table_on_hand_made_cells(tmp_path):
  base = sweep.default_config()
  plain, weighted = grid.LAG_AXES
  assert (plain.key, weighted.key) == ("lag", "lag")
  assert (plain.overrides["tis"], weighted.overrides["tis"]) == ("off", "token")
  # Finals per seed: without TIS [0.9, 0.8, 0.7], with [1.0, 0.8, 0.9] at lag 1: paired gap
  # [0.1, 0, 0.2], mean 0.1, sd 0.1, half width 1.96 * 0.1 / sqrt(3) = 0.1132 (interval
  # contains 0: "=").
  finals = {("lag", 1): [0.9, 0.8, 0.7], ("lag_tis", 1): [1.0, 0.8, 0.9]}
  for axis in grid.LAG_AXES:
    for value in (0, 1):
      final = np.array(finals.get((axis.name, value), [0.5, 0.6, 0.7]))
      start = 0.65 if (axis.name, value) == ("lag", 0) else 0.25  # 0.65 -> 0.5, 0.6: 2 drops
      curves = np.stack([np.full(3, start), final], 1)
      cell = {("seeupo", "trap"): (3.0 if axis is plain else 1.0, curves)}
      path = grid._cell_path(str(tmp_path), axis, value, "tabular")  # pylint: disable=protected-access
      grid._save_cell(path, cell, grid.cell_config(base, axis, value, "tabular"))  # pylint: disable=protected-access
  table = grid.staleness_table(base, str(tmp_path))
  lines = table.splitlines()
  assert lines[0].startswith("| family | algorithm | lag | no TIS: final J/J*c (95% CI) | lr |")
  assert len(lines) == 4  # header, rule, lag 0, lag 1 (lag 2 not run)
  half = 1.96 * 0.1 / np.sqrt(3)  # every final column here has sd 0.1
  # Lag 0: 0.65 -> [0.5, 0.6, 0.7]: 2 of 3 iterations drop; with TIS [0.5, 0.6, 0.7] from 0.25.
  assert lines[2] == (
    f"| trap | seeupo | 0 | 0.6000 ± {half:.4f} | 3 | 66.7% | 0.6000 ± {half:.4f} | 1 | 0.0% | "
    "+0.0000 ± 0.0000 (=) | +0.0000 ± 0.0000 (=) |"
  )
  # Lag 1: TIS - no TIS = [0.1, 0, 0.2] (mean 0.1, sd 0.1: "="); no TIS at lag 1 - lag 0 =
  # [0.4, 0.2, 0]: mean 0.2, sd 0.2, half width 1.96 * 0.2 / sqrt(3) = 0.2263 ("=").
  assert lines[3] == (
    f"| trap | seeupo | 1 | 0.8000 ± {half:.4f} | 3 | 0.0% | 0.9000 ± {half:.4f} | 1 | 0.0% | "
    f"+0.1000 ± {half:.4f} (=) | +0.2000 ± {2 * half:.4f} (=) |"
  )


def test_lag_and_tis_keys_name_their_allowed_values():
  config = _config(lag=-1, tis="tok", tis_cap=0.5)
  with pytest.raises(ValueError) as error:
    sweep.validate(config)
  assert str(error.value) == (
    "lag=-1; allowed: an int >= 0; tis='tok'; allowed: one of ['off', 'token', 'sequence']; "
    "tis_cap=0.5; allowed: a finite number >= 1"
  )
  config = _config(lag=2, tis="sequence", tis_cap=1.5)
  sweep.validate(config)
  assert (
    "lag 2 (iteration i samples with the params of iteration i-1-2), TIS sequence (cap 1.5)"
    in (sweep.describe(config))
  )
  assert "lag" not in sweep.describe(_config()) and "TIS" not in sweep.describe(_config())
  lconfig = algorithms.learner_config(
    config, bandit_lib.enumerate_bandit(3, 2, 4), algorithms.get_algorithm("grpo")
  )
  assert (lconfig.tis, lconfig.tis_cap) == ("sequence", 1.5)


def test_a_cell_stored_without_the_lag_keys_reads_as_lag_zero(tmp_path):
  base = sweep.default_config()
  older = ml_collections.ConfigDict(
    {k: v for k, v in base.to_dict().items() if k not in ("lag", "tis", "tis_cap")}
  )
  curves = {("seeupo", "trap"): (1.0, np.array([[0.5, 0.75], [0.5, 1.0]]))}
  path = str(tmp_path / "cells" / "cell.npz")
  grid._save_cell(path, curves, older)  # pylint: disable=protected-access
  got = grid._load_cell(path, base)  # pylint: disable=protected-access
  np.testing.assert_array_equal(got[("seeupo", "trap")][1], curves[("seeupo", "trap")][1])
  base.lag = 1
  with pytest.raises(ValueError, match=r"another config \(keys lag\)"):
    grid._load_cell(path, base)  # pylint: disable=protected-access
