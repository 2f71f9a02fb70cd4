"""Tabular and shared log-linear policies against hand-computed logits."""

import jax
import jax.numpy as jnp
import numpy as np

from seeupo_jax.theory import bandit as bandit_lib
from seeupo_jax.theory import policies


def test_uniform_at_init_and_tabular_is_free():
  enum = bandit_lib.enumerate_bandit(2, 3, 3)
  for name in policies.POLICIES:
    policy = policies.get_policy(name, enum)
    log_pi = policies.log_policy(policy, policies.init_params(policy))
    np.testing.assert_allclose(np.exp(log_pi), 1.0 / 3, rtol=1e-6)
  tab = policies.tabular_policy(enum)
  theta = jax.random.normal(jax.random.PRNGKey(0), (tab.num_params,))
  np.testing.assert_allclose(
    policies.log_policy(tab, theta),
    jax.nn.log_softmax(theta.reshape(enum.num_states, 3), -1),
    rtol=1e-6,
  )


def test_shared_logits_by_hand():
  x_, k, t_ = 2, 2, 3
  enum = bandit_lib.enumerate_bandit(x_, k, t_)
  policy = policies.shared_policy(enum)
  sizes = [x_ * k, t_ * k, x_ * (k + 1) * k, (k + 1) ** 2 * k]
  assert policy.num_params == sum(sizes)
  theta = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (policy.num_params,)))
  w1, w2, w3, w4 = np.split(theta, np.cumsum(sizes)[:-1])
  w1, w2 = w1.reshape(x_, k), w2.reshape(t_, k)
  w3, w4 = w3.reshape(x_, k + 1, k), w4.reshape(k + 1, k + 1, k)
  log_pi = np.asarray(policies.log_policy(policy, jnp.asarray(theta)))
  # State (x=1, t=2, a_1=1, a_2=0): prev = 0, prev2 = 1.
  per_context = 1 + k + k * k
  state = 1 * per_context + (1 + k) + (1 * k + 0)
  logits = w1[1] + w2[2] + w3[1, 0] + w4[1, 0]
  want = logits - np.log(np.exp(logits).sum())
  np.testing.assert_allclose(log_pi[state], want, rtol=1e-5)
  # State (x=0, t=0): both previous actions are "none" (index k).
  logits = w1[0] + w2[0] + w3[0, k] + w4[k, k]
  np.testing.assert_allclose(log_pi[0], logits - np.log(np.exp(logits).sum()), rtol=1e-5)


def test_action_log_probs_gathers_log_policy():
  enum = bandit_lib.enumerate_bandit(2, 3, 3)
  policy = policies.shared_policy(enum)
  theta = jax.random.normal(jax.random.PRNGKey(2), (policy.num_params,))
  log_pi = policies.log_policy(policy, theta)
  bandit = bandit_lib.Bandit(jnp.zeros((2, 27)), jnp.full((2,), 0.5), 3, 3)
  r = bandit_lib.sample_rollouts(jax.random.PRNGKey(3), bandit, enum, log_pi, 4)
  got = policies.action_log_probs(policy, theta, r.states, r.actions)
  want = np.asarray(log_pi)[np.asarray(r.states), np.asarray(r.actions)]
  np.testing.assert_allclose(got, want, rtol=1e-6)
