"""Exact J, J* and sampling of the multi-turn bandit, against independent
NumPy references (brute force, Monte-Carlo, hand-built cases)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seeupo_jax.theory import bandit as bandit_lib
from seeupo_jax.theory import instances


def _random_log_pi(key, enum, scale=1.5):
  logits = scale * jax.random.normal(key, (enum.num_states, enum.num_actions))
  return jax.nn.log_softmax(logits, -1)


def _numpy_return(rewards, context_probs, policy_fn, k, t_):
  """J by an explicit loop over contexts and action sequences (NumPy)."""
  total = 0.0
  for x in range(rewards.shape[0]):
    for seq in itertools.product(range(k), repeat=t_):
      prob = 1.0
      for t in range(t_):
        prob *= policy_fn(x, seq[:t])[seq[t]]
      leaf = int(np.ravel_multi_index(seq, (k,) * t_))
      total += context_probs[x] * prob * rewards[x, leaf]
  return total


@pytest.mark.parametrize("x_,k,t_", [(2, 2, 2), (3, 3, 2), (2, 2, 4)])
def test_expected_return_matches_explicit_loop(x_, k, t_):
  enum = bandit_lib.enumerate_bandit(x_, k, t_)
  key_r, key_p = jax.random.split(jax.random.PRNGKey(x_ * 100 + k * 10 + t_))
  bandit = instances.random_instance(key_r, x_, k, t_)
  bandit = bandit.replace(context_probs=jnp.arange(1.0, x_ + 1) / sum(range(1, x_ + 1)))
  log_pi = np.asarray(_random_log_pi(key_p, enum))
  per_context = sum(k**u for u in range(t_))

  def policy_fn(x, prefix):
    t = len(prefix)
    idx = sum(a * k ** (t - 1 - u) for u, a in enumerate(prefix))
    state = x * per_context + sum(k**u for u in range(t)) + idx
    return np.exp(log_pi[state])

  want = _numpy_return(
    np.asarray(bandit.rewards), np.asarray(bandit.context_probs), policy_fn, k, t_
  )
  got = bandit_lib.expected_return(bandit, enum, jnp.asarray(log_pi))
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_expected_return_within_monte_carlo_interval():
  x_, k, t_, n = 3, 3, 3, 20000
  enum = bandit_lib.enumerate_bandit(x_, k, t_)
  key_r, key_p, key_s = jax.random.split(jax.random.PRNGKey(7), 3)
  bandit = instances.random_instance(key_r, x_, k, t_)
  log_pi = _random_log_pi(key_p, enum)
  rollouts = bandit_lib.sample_rollouts(key_s, bandit, enum, log_pi, n)
  # Contexts are uniform and every context has n rows: the plain mean is an
  # unbiased estimate of J.
  rewards = np.asarray(rollouts.rewards, np.float64)
  mean, sem = rewards.mean(), rewards.std(ddof=1) / np.sqrt(len(rewards))
  exact = float(bandit_lib.expected_return(bandit, enum, log_pi))
  assert abs(exact - mean) < 4 * sem, (exact, mean, sem)
  # Also per turn: the sampled actions follow pi at the visited state.
  first = np.asarray(rollouts.actions[:, 0]).reshape(x_, n)
  for x in range(x_):
    probs = np.exp(np.asarray(log_pi[enum.traj_states[x * k**t_, 0]]))
    freq = np.bincount(first[x], minlength=k) / n
    np.testing.assert_allclose(freq, probs, atol=4 * np.sqrt(0.25 / n))


def test_rollout_states_and_rewards_are_consistent():
  x_, k, t_ = 2, 3, 3
  enum = bandit_lib.enumerate_bandit(x_, k, t_)
  bandit = instances.random_instance(jax.random.PRNGKey(1), x_, k, t_)
  log_pi = _random_log_pi(jax.random.PRNGKey(2), enum)
  r = bandit_lib.sample_rollouts(jax.random.PRNGKey(3), bandit, enum, log_pi, 5)
  for i in range(x_ * 5):
    x, acts = int(r.contexts[i]), np.asarray(r.actions[i])
    leaf = x * k**t_ + int(np.ravel_multi_index(acts, (k,) * t_))
    np.testing.assert_array_equal(r.states[i], enum.traj_states[leaf])
    assert float(r.rewards[i]) == float(bandit.rewards.reshape(-1)[leaf])
    assert x == i // 5
  np.testing.assert_array_equal(r.turn_rewards, 0.0)  # `random` reports no turn rewards
  additive = instances.additive_instance(jax.random.PRNGKey(1), x_, k, t_)
  r = bandit_lib.sample_rollouts(jax.random.PRNGKey(3), additive, enum, log_pi, 5)
  for i in range(x_ * 5):
    leaf = int(np.ravel_multi_index(np.asarray(r.actions[i]), (k,) * t_))
    want = additive.turn_rewards[int(r.contexts[i]), leaf]
    np.testing.assert_array_equal(r.turn_rewards[i], want)
  # Without environment states or stops: the decision states, every turn.
  np.testing.assert_array_equal(r.turn_states, r.states)
  assert bool(np.all(r.turn_valid))
  for family in ("walk", "stop"):
    inst = instances.get_family(family)(jax.random.PRNGKey(1), x_, k, t_)
    r = bandit_lib.sample_rollouts(jax.random.PRNGKey(3), inst, enum, log_pi, 5)
    for i in range(x_ * 5):
      x, acts = int(r.contexts[i]), np.asarray(r.actions[i])
      leaf = int(np.ravel_multi_index(acts, (k,) * t_))
      np.testing.assert_array_equal(r.states[i], enum.traj_states[x * k**t_ + leaf])
      assert float(r.rewards[i]) == float(inst.rewards[x, leaf])
      if family == "walk":  # the position before each turn, in the family's key
        positions = np.cumsum(acts) - acts
        width = (k - 1) * (t_ - 1) + 1
        np.testing.assert_array_equal(
          r.turn_states[i], (x * t_ + np.arange(t_)) * width + positions
        )
        assert bool(np.all(r.turn_valid[i]))
      else:  # the turns up to and with the first 0
        stop = list(acts).index(0) if 0 in acts else t_ - 1
        np.testing.assert_array_equal(r.turn_valid[i], np.arange(t_) <= stop)
        np.testing.assert_array_equal(r.turn_states[i], r.states[i])


def _brute_force_optimum(rewards, context_probs, k, t_):
  """max over every deterministic policy (a choice per state), by loops."""
  best_total = 0.0
  for x in range(rewards.shape[0]):
    states = [p for t in range(t_) for p in itertools.product(range(k), repeat=t)]
    best = -np.inf
    for choice in itertools.product(range(k), repeat=len(states)):
      table = dict(zip(states, choice))
      prefix = ()
      for _ in range(t_):
        prefix = prefix + (table[prefix],)
      best = max(best, rewards[x, np.ravel_multi_index(prefix, (k,) * t_)])
    best_total += context_probs[x] * best
  return best_total


@pytest.mark.parametrize("family", sorted(instances.FAMILIES))
@pytest.mark.parametrize("x_,k,t_", [(2, 2, 2), (2, 3, 2), (2, 2, 3)])
def test_optimum_equals_brute_force(family, x_, k, t_):
  enum = bandit_lib.enumerate_bandit(x_, k, t_)
  bandit = instances.get_family(family)(jax.random.PRNGKey(k + t_), x_, k, t_)
  want = _brute_force_optimum(np.asarray(bandit.rewards), np.asarray(bandit.context_probs), k, t_)
  np.testing.assert_allclose(bandit_lib.optimal_return(bandit), want, rtol=1e-6)
  # The backward-induction policy attains it, and no random policy beats it.
  log_opt = bandit_lib.optimal_log_policy(bandit, enum)
  np.testing.assert_allclose(bandit_lib.expected_return(bandit, enum, log_opt), want, rtol=1e-5)
  for seed in range(5):
    j = bandit_lib.expected_return(bandit, enum, _random_log_pi(jax.random.PRNGKey(seed), enum))
    assert float(j) <= want + 1e-6


def test_trap_and_decoy_rewards_by_hand():
  k, t_ = 3, 3
  seqs = list(itertools.product(range(k), repeat=t_))
  trap = instances.trap_instance(jax.random.PRNGKey(0), 4, k, t_)
  decoy = instances.decoy_instance(jax.random.PRNGKey(0), 4, k, t_)
  for x in range(4):
    r = np.asarray(trap.rewards[x])
    key = seqs[int(np.argmax(r))]
    assert r.max() == 1.0 and np.sum(r == 1.0) == 1
    for leaf, seq in enumerate(seqs):
      if seq == key:
        continue
      if seq[0] == key[0]:
        assert r[leaf] == 0.0
      else:
        assert 0.5 <= r[leaf] <= 0.6
    r = np.asarray(decoy.rewards[x])
    key = seqs[int(np.argmax(r))]
    assert r.max() == 1.0 and np.sum(r == 1.0) == 1
    decoy_seq = seqs[int(np.argmax(np.where(r < 1.0, r, -1)))]
    assert np.isclose(r.max(where=r < 1.0, initial=0), 0.6)
    assert all(d != c for d, c in zip(decoy_seq, key))
    for leaf, seq in enumerate(seqs):
      if seq != key:
        share = np.mean([a == d for a, d in zip(seq, decoy_seq)])
        np.testing.assert_allclose(r[leaf], 0.6 * share, rtol=1e-6)
  # Under the uniform policy the trap's first key action looks worse.
  one = instances.trap_instance(jax.random.PRNGKey(3), 1, k, t_)
  r = np.asarray(one.rewards[0]).reshape(k, k * k)
  key_first = int(np.argmax(r.max(1)))
  assert r[key_first].mean() == pytest.approx(1.0 / k ** (t_ - 1))
  assert all(r[a].mean() > 0.5 for a in range(k) if a != key_first)


def test_turn_rewards_by_hand():
  """decoy: r_t = 0.6 / T where a_t is the decoy's action (their sum is r off the key);
  additive: r = sum_t r_t, and r_t depends on a_<=t only (one payoff per state and action, so
  the K^(t+1) prefixes hold K^(t+1) distinct values)."""
  k, t_ = 3, 3
  seqs = list(itertools.product(range(k), repeat=t_))
  decoy = instances.decoy_instance(jax.random.PRNGKey(0), 4, k, t_)
  for x in range(4):
    r, per_turn = np.asarray(decoy.rewards[x]), np.asarray(decoy.turn_rewards[x])
    key = seqs[int(np.argmax(r))]
    decoy_seq = seqs[int(np.argmax(np.where(r < 1.0, r, -1)))]
    for leaf, seq in enumerate(seqs):
      want = [0.6 / t_ if a == d else 0.0 for a, d in zip(seq, decoy_seq)]
      np.testing.assert_allclose(per_turn[leaf], want, rtol=1e-6)
      if seq != key:
        np.testing.assert_allclose(per_turn[leaf].sum(), r[leaf], rtol=1e-6)
  additive = instances.additive_instance(jax.random.PRNGKey(1), 2, k, t_)
  assert additive.turn_rewards.shape == (2, k**t_, t_)
  np.testing.assert_allclose(additive.turn_rewards.sum(-1), additive.rewards, rtol=1e-6)
  for x in range(2):
    per_turn = np.asarray(additive.turn_rewards[x])
    assert np.all((per_turn >= 0) & (per_turn <= 1.0 / t_))
    for t in range(t_):
      by_prefix = {}
      for leaf, seq in enumerate(seqs):
        by_prefix.setdefault(seq[: t + 1], set()).add(float(per_turn[leaf, t]))
      assert all(len(values) == 1 for values in by_prefix.values())
      assert len({v for values in by_prefix.values() for v in values}) == k ** (t + 1)
  # The families without turn rewards report none.
  for name in ("random", "trap", "walk", "sparse", "scaled"):
    assert instances.get_family(name)(jax.random.PRNGKey(0), 2, k, t_).turn_rewards is None
  # Only `walk` reports environment states, only `stop` ends episodes early.
  for name in instances.FAMILIES:
    inst = instances.get_family(name)(jax.random.PRNGKey(0), 2, k, t_)
    assert (inst.turn_states is not None) == (name == "walk"), name
    assert (inst.turn_valid is not None) == (name == "stop"), name


def test_walk_and_stop_by_hand():
  """walk: r depends on the end position sum_t a_t only, and the turn-t key on (x, t, p_t)
  only, one key per (x, t, p_t); stop: r = q_x on every sequence with a 0 (one q_x in
  [0.3, 0.5] per context), 1 on the others, paid as a turn reward at the first 0 or at the
  last turn; the turns after the first 0 are not valid."""
  k, t_, x_ = 3, 3, 4
  seqs = list(itertools.product(range(k), repeat=t_))
  walk = instances.walk_instance(jax.random.PRNGKey(5), x_, k, t_)
  keys = np.asarray(walk.turn_states)
  seen = {}
  for x in range(x_):
    by_end = {}
    for leaf, seq in enumerate(seqs):
      by_end.setdefault(sum(seq), set()).add(float(walk.rewards[x, leaf]))
      for t in range(t_):
        seen.setdefault((x, t, sum(seq[:t])), set()).add(int(keys[x, leaf, t]))
    assert sorted(by_end) == list(range((k - 1) * t_ + 1))
    assert all(len(v) == 1 for v in by_end.values())
    assert len({v for vs in by_end.values() for v in vs}) == len(by_end)  # distinct draws
  assert all(len(v) == 1 for v in seen.values())
  assert len({v for vs in seen.values() for v in vs}) == len(seen)  # distinct states, keys
  # Positions recur: turn 2 of one context has 9 histories and 5 positions.
  assert len({keys[0, leaf, 2] for leaf in range(len(seqs))}) == 2 * (k - 1) + 1
  stop = instances.stop_instance(jax.random.PRNGKey(5), x_, k, t_)
  for x in range(x_):
    r = np.asarray(stop.rewards[x])
    quit_pay = r[0]
    assert 0.3 <= quit_pay <= 0.5
    for leaf, seq in enumerate(seqs):
      first = seq.index(0) if 0 in seq else None
      want_valid = [first is None or t <= first for t in range(t_)]
      want_turns = [0.0] * t_
      want_turns[t_ - 1 if first is None else first] = 1.0 if first is None else quit_pay
      np.testing.assert_array_equal(stop.turn_valid[x, leaf], want_valid)
      np.testing.assert_allclose(stop.turn_rewards[x, leaf], want_turns, rtol=1e-6)
      assert r[leaf] == pytest.approx(1.0 if first is None else quit_pay)


def test_bad_family_name_lists_allowed():
  with pytest.raises(ValueError, match="allowed.*decoy.*random.*trap"):
    instances.get_family("nope")


def test_bad_sizes_are_rejected():
  with pytest.raises(ValueError, match="num_actions >= 2"):
    bandit_lib.enumerate_bandit(2, 1, 3)


def test_instances_vmap_over_keys():
  keys = jax.random.split(jax.random.PRNGKey(0), 6)
  batch = jax.vmap(lambda k: instances.trap_instance(k, 2, 2, 3))(keys)
  assert batch.rewards.shape == (6, 2, 8)
  j_star = jax.vmap(bandit_lib.optimal_return)(batch)
  np.testing.assert_allclose(j_star, 1.0)
