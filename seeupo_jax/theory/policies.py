"""Policies for the multi-turn bandit: tabular and shared log-linear.

Both are log-linear policies on one-hot features, written as a sum of
parameter look-ups:

    logits(s, a) = sum_f theta[feature_ids[s, a, f]],   pi(. | s) = softmax

* Tabular (one table per turn, the paper's virtual agents): one parameter per
  (state, action), F = 1; turns share nothing, so updating turn t leaves
  every other turn's policy unchanged.
* Shared (one LLM acting at every turn): F = 4 one-hot blocks shared across
  turns, (x, a_t), (t, a_t), (x, a_{t-1}, a_t) and (a_{t-2}, a_{t-1}, a_t),
  where a missing previous action is a "none" symbol. Updating turn t's
  log-probs moves the other turns' policies too, and for T >= 3 the class
  cannot represent every tabular policy, so J* (over all policies) may be out
  of reach.
* Blind (one model that cannot tell the contexts apart): one logit per (t,
  a_<t, a) shared by every context, pi(a_t | a_<t). Contexts with different
  rewards compete for the same parameters; its own optimum is the best single
  action sequence (`bandit.open_loop_optimum`), so J / J*_class is exact.

`class_optimum(name, bandit)` is the best return a class can reach where it is
known exactly (tabular: J*; blind: the open-loop optimum), and J* for the shared
class, whose own optimum is not computed.
"""

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from seeupo_jax.theory import bandit as bandit_lib


class Policy(NamedTuple):
  """A log-linear policy class over the states of one (X, K, T) bandit.

  Attributes:
    feature_ids: [S, K, F] int32 NumPy array, parameter indices summed into
      logits(s, a).
    num_params: length of the parameter vector theta.
  """

  feature_ids: np.ndarray
  num_params: int


def tabular_policy(enum: bandit_lib.Enumeration) -> Policy:
  """One free logit per (state, action): theta has S * K entries."""
  s, k = enum.num_states, enum.num_actions
  ids = np.arange(s * k, dtype=np.int32).reshape(s, k, 1)
  return Policy(ids, s * k)


def shared_policy(enum: bandit_lib.Enumeration) -> Policy:
  """Log-linear policy on turn-shared one-hot features (see module doc)."""
  x_, k, t_ = enum.num_contexts, enum.num_actions, enum.num_turns
  none = k  # the "no previous action" symbol
  prefix = enum.state_prefix  # [S, T], -1 padded
  turn = enum.state_turn
  rows = np.arange(enum.num_states)
  prev1 = np.where(turn >= 1, prefix[rows, np.maximum(turn - 1, 0)], none)
  prev2 = np.where(turn >= 2, prefix[rows, np.maximum(turn - 2, 0)], none)
  a = np.arange(k)[None, :]
  sizes = [x_ * k, t_ * k, x_ * (k + 1) * k, (k + 1) * (k + 1) * k]
  offsets = np.cumsum([0] + sizes)
  blocks = [
    enum.state_context[:, None] * k + a,
    turn[:, None] * k + a,
    (enum.state_context[:, None] * (k + 1) + prev1[:, None]) * k + a,
    (prev2[:, None] * (k + 1) + prev1[:, None]) * k + a,
  ]
  ids = np.stack([b + o for b, o in zip(blocks, offsets[:-1])], -1)
  return Policy(ids.astype(np.int32), int(offsets[-1]))


def blind_policy(enum: bandit_lib.Enumeration) -> Policy:
  """One logit per (t, a_<t, a), the same in every context: theta has (S / X) * K entries."""
  k, per_context = enum.num_actions, enum.states_per_context
  within = np.arange(enum.num_states) % per_context  # the state (t, a_<t) without x
  ids = (within[:, None] * k + np.arange(k)[None, :]).astype(np.int32)[..., None]
  return Policy(ids, per_context * k)


POLICIES = {"tabular": tabular_policy, "shared": shared_policy, "blind": blind_policy}


def class_optimum(name: str, bandit: bandit_lib.Bandit) -> chex.Array:
  """The best return of policy class `name` (see module doc); scalar float32."""
  if name not in POLICIES:
    raise ValueError(f"unknown policy {name!r} (config key `policy`); allowed: {sorted(POLICIES)}")
  if name == "blind":
    return bandit_lib.open_loop_optimum(bandit)
  return bandit_lib.optimal_return(bandit)


def get_policy(name: str, enum: bandit_lib.Enumeration) -> Policy:
  """Builds a policy class by name; a bad name lists the allowed ones."""
  if name not in POLICIES:
    raise ValueError(f"unknown policy {name!r} (config key `policy`); allowed: {sorted(POLICIES)}")
  return POLICIES[name](enum)


def init_params(policy: Policy) -> chex.Array:
  """theta = 0: the uniform policy. [num_params] float32."""
  return jnp.zeros((policy.num_params,), jnp.float32)


def log_policy(policy: Policy, theta: chex.Array) -> chex.Array:
  """log pi(a | s) for every state.

  Args:
    policy: the policy class.
    theta: [num_params] float32.

  Returns:
    [S, K] float32, log_softmax_a(sum_f theta[feature_ids[s, a, f]]).
  """
  chex.assert_shape(theta, (policy.num_params,))
  ids = policy.feature_ids
  if ids.shape[-1] == 1 and np.array_equal(ids.ravel(), np.arange(ids.size)):
    logits = theta.reshape(ids.shape[:2])  # tabular: no gather needed
  else:
    logits = theta[ids].sum(-1)
  return jax.nn.log_softmax(logits, -1)


def action_log_probs(
  policy: Policy, theta: chex.Array, states: chex.Array, actions: chex.Array
) -> chex.Array:
  """Per-turn log-probs of sampled trajectories ("turn t's tokens").

  Args:
    policy: the policy class.
    theta: [num_params] float32.
    states: [B, T] int32 decision states.
    actions: [B, T] int32 actions.

  Returns:
    [B, T] float32, log pi(a_t | s_t); gradients flow to theta.
  """
  chex.assert_equal_shape([states, actions])
  log_pi = log_policy(policy, theta)  # [S, K]
  return log_pi[states, actions]
