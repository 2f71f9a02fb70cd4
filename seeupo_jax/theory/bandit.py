"""Multi-turn contextual bandit: enumeration, exact expected return, optimum.

A T-turn contextual bandit has contexts x in {0..X-1} drawn from p(x), K
actions per turn, and a reward r(x, a_1..a_T) in [0, 1] paid once, after the
last turn. A policy picks a_t from pi_t(. | x, a_<t). The problem is small
enough to enumerate every trajectory, so the expected return

    J(pi) = sum_x p(x) sum_{a_1..a_T} prod_t pi(a_t | x, a_<t) r(x, a_1..a_T)

and the optimum J* (backward induction, V_T = r, V_t(x, a_<t) =
max_a V_{t+1}(x, a_<t, a)) are exact, not estimated.

Decision states. A state is (x, t, a_<t). States are numbered
`x * P + offset[t] + prefix`, where `P = sum_{t<T} K^t`, `offset[t] =
sum_{u<t} K^u` and `prefix = sum_{u<t} a_u K^(t-1-u)` (a_1 most significant).
Trajectories are numbered `x * K^T + sum_t a_t K^(T-1-t)`, which is the row
major order of `rewards[x].reshape(K, ..., K)`.

Turn rewards. A family may also report a reward for each turn, r_t(x, a_<=t) (what an
environment that checks each step would tell MT-GRPO, `losses.mt_grpo_advantages`), beside the
outcome r. They are information for the learner only: J and J* are those of r.

Environment states. The decision state (x, t, a_<t) is the whole history: no two histories
share one. A family may also report an environment state key per turn, s_t(x, a_<t), that
different histories can share (a position reached by different paths): what GiGPO groups its
anchor states by (`losses.gigpo_advantages`). Where a family reports none, the key is the
decision state. The policy still sees the history: the key is information for the learner only.

Stopping. A family may let the policy end an episode early: `turn_valid` marks the turns a
trajectory has (a prefix of the T turns). The reward of a trajectory that stopped at turn t
does not depend on the actions after t, so every completion of its prefix carries the same r
and the sums over K^T trajectories above stay exact (the actions after the stop are sampled
and ignored: their probabilities sum to 1).
"""

from typing import NamedTuple, Optional

import chex
import flax
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class Bandit:
  """One bandit instance (a pytree; vmap over instances is fine).

  Attributes:
    rewards: [X, K^T] float32 in [0, 1], r(x, a_1..a_T), trajectory order.
    context_probs: [X] float32, p(x), sums to 1.
    num_turns: T (static).
    num_actions: K (static).
    turn_rewards: [X, K^T, T] float32 or None, r_t(x, a_<=t) of each trajectory's turn t
      (it depends on the actions up to t only); None: the family reports none (all 0).
    turn_states: [X, K^T, T] int32 or None, the environment state key s_t(x, a_<t) >= 0 before
      each turn (see the module doc); None: the decision states.
    turn_valid: [X, K^T, T] bool or None, True on the turns the trajectory has (a prefix:
      False after the policy stopped); None: all T turns.
  """

  rewards: chex.Array
  context_probs: chex.Array
  num_turns: int = flax.struct.field(pytree_node=False)
  num_actions: int = flax.struct.field(pytree_node=False)
  turn_rewards: Optional[chex.Array] = None
  turn_states: Optional[chex.Array] = None
  turn_valid: Optional[chex.Array] = None

  @property
  def num_contexts(self) -> int:
    return self.rewards.shape[-2]


class Enumeration(NamedTuple):
  """Static index tables for (X, K, T); NumPy arrays, built once.

  Attributes:
    num_contexts: X.
    num_actions: K.
    num_turns: T.
    num_states: S = X * sum_{t<T} K^t.
    traj_context: [N] int32, x of each of the N = X * K^T trajectories.
    traj_states: [N, T] int32, decision state at each turn.
    traj_actions: [N, T] int32, action at each turn.
    state_context: [S] int32, x of each state.
    state_turn: [S] int32, t (0-based) of each state.
    state_prefix: [S, T] int32, a_<t padded with -1.
  """

  num_contexts: int
  num_actions: int
  num_turns: int
  num_states: int
  traj_context: np.ndarray
  traj_states: np.ndarray
  traj_actions: np.ndarray
  state_context: np.ndarray
  state_turn: np.ndarray
  state_prefix: np.ndarray

  @property
  def states_per_context(self) -> int:
    return self.num_states // self.num_contexts

  def turn_offset(self, t: int) -> int:
    return sum(self.num_actions**u for u in range(t))


def enumerate_bandit(num_contexts: int, num_actions: int, num_turns: int) -> Enumeration:
  """Builds the state and trajectory tables of an (X, K, T) bandit."""
  x_, k, t_ = num_contexts, num_actions, num_turns
  if x_ < 1 or k < 2 or t_ < 1:
    raise ValueError(
      f"need num_contexts >= 1, num_actions >= 2, num_turns >= 1; got "
      f"{num_contexts}, {num_actions}, {num_turns}"
    )
  per_context = sum(k**u for u in range(t_))
  offsets = np.cumsum([0] + [k**u for u in range(t_)])[:t_]
  actions = np.array(np.unravel_index(np.arange(k**t_), (k,) * t_)).T
  traj_actions = np.tile(actions, (x_, 1)).astype(np.int32)
  traj_context = np.repeat(np.arange(x_), k**t_).astype(np.int32)
  traj_states = np.zeros_like(traj_actions)
  for t in range(t_):
    prefix = np.zeros(len(actions), np.int64)
    for u in range(t):
      prefix = prefix * k + actions[:, u]
    traj_states[:, t] = traj_context * per_context + offsets[t] + np.tile(prefix, x_)
  num_states = x_ * per_context
  state_context = np.zeros(num_states, np.int32)
  state_turn = np.zeros(num_states, np.int32)
  state_prefix = -np.ones((num_states, t_), np.int32)
  for t in range(t_):
    for x in range(x_):
      for p in range(k**t):
        s = x * per_context + offsets[t] + p
        state_context[s], state_turn[s] = x, t
        if t:
          state_prefix[s, :t] = np.unravel_index(p, (k,) * t)
  return Enumeration(
    x_,
    k,
    t_,
    num_states,
    traj_context,
    traj_states,
    traj_actions,
    state_context,
    state_turn,
    state_prefix,
  )


def trajectory_log_probs(enum: Enumeration, log_pi: chex.Array) -> chex.Array:
  """log P(a_1..a_T | x) of every trajectory.

  Args:
    enum: tables from `enumerate_bandit`.
    log_pi: [S, K] float32, log pi(a | state).

  Returns:
    [N] float32, sum_t log pi(a_t | x, a_<t), trajectory order.
  """
  chex.assert_shape(log_pi, (enum.num_states, enum.num_actions))
  per_turn = log_pi[enum.traj_states, enum.traj_actions]  # [N, T]
  return per_turn.sum(-1)


def expected_return(bandit: Bandit, enum: Enumeration, log_pi: chex.Array) -> chex.Array:
  """Exact J = sum_x p(x) sum_a P(a | x) r(x, a) by enumeration.

  Args:
    bandit: the instance; rewards [X, K^T], context_probs [X].
    enum: tables from `enumerate_bandit` for the same (X, K, T).
    log_pi: [S, K] float32, log-probabilities of the policy at each state.

  Returns:
    scalar float32.
  """
  chex.assert_shape(bandit.rewards, (enum.num_contexts, enum.num_actions**enum.num_turns))
  probs = jnp.exp(trajectory_log_probs(enum, log_pi))
  probs = probs.reshape(bandit.rewards.shape)
  return jnp.sum(bandit.context_probs * jnp.sum(probs * bandit.rewards, -1))


def optimal_values(bandit: Bandit) -> chex.Array:
  """Backward induction: V_T = r, V_t(x, a_<t) = max_a V_{t+1}(x, a_<t, a).

  Args:
    bandit: rewards [X, K^T].

  Returns:
    [X] float32, V_1(x) = max over action sequences of r(x, .).
  """
  k, t_ = bandit.num_actions, bandit.num_turns
  values = bandit.rewards.reshape(bandit.rewards.shape[:-1] + (k,) * t_)
  for _ in range(t_):  # one backup per turn, last turn first
    values = values.max(-1)
  return values


def optimal_return(bandit: Bandit) -> chex.Array:
  """J* = sum_x p(x) V_1(x); scalar float32."""
  return jnp.sum(bandit.context_probs * optimal_values(bandit), -1)


def open_loop_optimum(bandit: Bandit) -> chex.Array:
  """max_a sum_x p(x) r(x, a): the best return of a policy that does not see x.

  A policy pi(a_t | a_<t) that ignores the context induces one distribution
  P(a) over action sequences for every context, so J = sum_a P(a) R(a) with
  R(a) = sum_x p(x) r(x, a), linear in P: its maximum over all P is the best
  single sequence. Scalar float32.
  """
  return jnp.max(bandit.context_probs @ bandit.rewards, -1)


def optimal_log_policy(bandit: Bandit, enum: Enumeration) -> chex.Array:
  """A deterministic optimal policy as [S, K] log-probs (0 / -inf -> -1e9).

  At state (x, t, a_<t) it picks argmax_a V_{t+1}(x, a_<t, a), the backward
  induction policy; `expected_return` of it equals `optimal_return`.
  """
  k, t_ = bandit.num_actions, bandit.num_turns
  tables = [bandit.rewards.reshape((-1,) + (k,) * t_)]
  for _ in range(t_ - 1):
    tables.append(tables[-1].max(-1))
  tables = tables[::-1]  # tables[t]: [X, K^(t+1)] values after a_t.
  rows = []
  for t in range(t_):
    q = tables[t].reshape(enum.num_contexts, k**t, k)
    rows.append((t, jax.nn.one_hot(q.argmax(-1), k)))
  log_pi = jnp.zeros((enum.num_states, k))
  per_context = enum.states_per_context
  for t, best in rows:
    idx = (
      np.arange(enum.num_contexts)[:, None] * per_context
      + enum.turn_offset(t)
      + np.arange(k**t)[None]
    )
    log_pi = log_pi.at[idx.reshape(-1)].set(jnp.where(best.reshape(-1, k) > 0, 0.0, -1e9))
  return log_pi


class Rollouts(NamedTuple):
  """A batch of sampled trajectories; B = X * n (n rollouts per context).

  Attributes:
    contexts: [B] int32, x of each row (also its group id).
    states: [B, T] int32, decision state at each turn.
    actions: [B, T] int32, a_t.
    rewards: [B] float32, r(x, a_1..a_T).
    turn_rewards: [B, T] float32, r_t(x, a_<=t) (`Bandit.turn_rewards`; 0 where it has none).
    turn_states: [B, T] int32, the environment state key of each turn (`Bandit.turn_states`;
      the decision states where it has none).
    turn_valid: [B, T] bool, the turns the rollout has (`Bandit.turn_valid`; all True where
      it has none).
  """

  contexts: chex.Array
  states: chex.Array
  actions: chex.Array
  rewards: chex.Array
  turn_rewards: chex.Array
  turn_states: chex.Array
  turn_valid: chex.Array


def sample_rollouts(
  key: chex.PRNGKey, bandit: Bandit, enum: Enumeration, log_pi: chex.Array, group_size: int
) -> Rollouts:
  """Samples `group_size` trajectories for every context (one group each).

  Args:
    key: PRNG key.
    bandit: the instance.
    enum: tables for the same (X, K, T).
    log_pi: [S, K] float32, log pi(a | state) of the behaviour policy.
    group_size: n, rollouts per context.

  Returns:
    `Rollouts` with B = X * n rows, grouped by context (row i in group
    i // n).
  """
  chex.assert_shape(log_pi, (enum.num_states, enum.num_actions))
  k, t_ = enum.num_actions, enum.num_turns
  contexts = jnp.repeat(jnp.arange(enum.num_contexts), group_size)
  prefix = jnp.zeros_like(contexts)
  states, actions = [], []
  for t, turn_key in enumerate(jax.random.split(key, t_)):
    state = contexts * enum.states_per_context + enum.turn_offset(t) + prefix
    action = jax.random.categorical(turn_key, log_pi[state])
    states.append(state)
    actions.append(action)
    prefix = prefix * k + action
  rewards = bandit.rewards[contexts, prefix]
  if bandit.turn_rewards is None:
    turn_rewards = jnp.zeros((contexts.shape[0], t_), jnp.float32)
  else:
    turn_rewards = bandit.turn_rewards[contexts, prefix].astype(jnp.float32)
  states = jnp.stack(states, 1).astype(jnp.int32)
  if bandit.turn_states is None:
    turn_states = states
  else:
    turn_states = bandit.turn_states[contexts, prefix].astype(jnp.int32)
  if bandit.turn_valid is None:
    turn_valid = jnp.ones((contexts.shape[0], t_), bool)
  else:
    turn_valid = bandit.turn_valid[contexts, prefix].astype(bool)
  return Rollouts(
    contexts.astype(jnp.int32),
    states,
    jnp.stack(actions, 1).astype(jnp.int32),
    rewards,
    turn_rewards,
    turn_states,
    turn_valid,
  )
