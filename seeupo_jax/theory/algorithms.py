"""RL algorithms on the multi-turn bandit, built from `seeupo_jax.losses`.

Every algorithm runs the same loop: sample n rollouts per context with the
current policy, compute advantages, update the parameters, record the exact
J. "Turn t's tokens" are the action at turn t: per-turn log-probs are [B, T]
and turn t is selected with the mask `one_hot(t, T)` on every row.

* `sequential` (SeeUPO): A = GRAE; M = 1; for t in `update_order`: old
  log-probs of turn t under the current parameters, advantage A * M,
  `epochs_per_turn` x `minibatches_per_turn` SGD steps of
  `losses.sequence_clip_loss` on turn t only, then
  M = `losses.seeupo_correction(M, new, old, mask_t)` (if `correction`).
* `token_ppu` (GRPO): all turns at once, `losses.token_clip_loss`.
* `sequence_ppu` (GSPO): all turns at once, `losses.sequence_clip_loss`
  (one ratio for the whole trajectory).
* `reinforce` (REINFORCE / RLOO): one on-policy step of
  `losses.reinforce_loss` per iteration.
* `ppo_gae` (PPO): `losses.gae_advantages` from a learned tabular critic
  V(state), `losses.token_clip_loss` + `losses.value_loss`.

Discounting: the reward comes after turn T, so turn t's return is
gamma^(T-t) r and its critic-free advantage is gamma^(T-t) A (PPO uses GAE
with the same gamma). The optimum does not depend on gamma; only the
per-turn step sizes do.
"""

from typing import NamedTuple

import chex
import flax
import jax
import jax.numpy as jnp
import ml_collections
import optax

from seeupo_jax import losses
from seeupo_jax.theory import bandit as bandit_lib
from seeupo_jax.theory import policies as policies_lib

UPDATES = ("sequential", "token_ppu", "sequence_ppu", "reinforce", "ppo_gae")
NORMS = ("none", "group", "batch")
ADVANTAGES = ("grae", "rloo", "gae")


class AlgorithmSpec(NamedTuple):
  """What distinguishes one algorithm from another (static).

  Attributes:
    update: one of UPDATES.
    advantage: one of ADVANTAGES.
    norm: advantage normalisation, one of NORMS: "none"; "group" (divide by
      the group std, GRPO); "batch" (whiten over the batch, clamp to [-3, 3]).
    order: update order for `sequential` ("reverse", "forward", "random").
    correction: apply the HAML correction M (`sequential` only).
  """

  update: str
  advantage: str = "grae"
  norm: str = "batch"
  order: str = "reverse"
  correction: bool = True


ALGORITHMS: dict[str, AlgorithmSpec] = {
  "seeupo": AlgorithmSpec("sequential", "grae", "batch", "reverse", True),
  "seeupo_forward": AlgorithmSpec("sequential", "grae", "batch", "forward"),
  "seeupo_random": AlgorithmSpec("sequential", "grae", "batch", "random"),
  "seeupo_nocorr": AlgorithmSpec("sequential", "grae", "batch", "reverse", False),
  "seeupo_groupstd": AlgorithmSpec("sequential", "grae", "group"),
  "seeupo_nonorm": AlgorithmSpec("sequential", "grae", "none"),
  "grpo": AlgorithmSpec("token_ppu", "grae", "group"),
  "gspo": AlgorithmSpec("sequence_ppu", "grae", "group"),
  "reinforce": AlgorithmSpec("reinforce", "grae", "none"),
  "rloo": AlgorithmSpec("reinforce", "rloo", "none"),
  "ppo": AlgorithmSpec("ppo_gae", "gae", "batch"),
}


def get_algorithm(name: str) -> AlgorithmSpec:
  """Looks up an algorithm by name; a bad name lists the allowed ones."""
  if name not in ALGORITHMS:
    raise ValueError(
      f"unknown algorithm {name!r} (config key `algorithms`); allowed: {sorted(ALGORITHMS)}"
    )
  return ALGORITHMS[name]


@flax.struct.dataclass
class TrainState:
  """Learner state of one run.

  Attributes:
    theta: [num_params] float32 policy parameters.
    critic: [S] float32 tabular state values (used by `ppo_gae` only).
  """

  theta: chex.Array
  critic: chex.Array


class TrainOutput(NamedTuple):
  """What one run returns.

  Attributes:
    returns: [I + 1] float32 exact J before training and after each
      iteration.
    clip_fraction: [I] float32 mean clip fraction of the policy loss.
  """

  returns: chex.Array
  clip_fraction: chex.Array


def _check(config: ml_collections.ConfigDict, spec: AlgorithmSpec) -> None:
  for key, value, allowed in (
    ("update", spec.update, UPDATES),
    ("norm", spec.norm, NORMS),
    ("advantage", spec.advantage, ADVANTAGES),
    ("order", spec.order, losses.UPDATE_ORDERS),
  ):
    if value not in allowed:
      raise ValueError(f"algorithm {key}={value!r}; allowed: {allowed}")
  for key in ("epochs_per_turn", "minibatches_per_turn", "group_size", "num_iterations"):
    if int(config[key]) < 1:
      raise ValueError(f"config key `{key}` must be >= 1, got {config[key]}")
  if not 0.0 < config.gamma <= 1.0:
    raise ValueError(f"config key `gamma` must be in (0, 1], got {config.gamma}")


def _sgd_step(params, grads, lr):
  """One optax SGD step with a traced learning rate."""
  tx = optax.sgd(lr)
  updates, _ = tx.update(grads, tx.init(params), params)
  return optax.apply_updates(params, updates)


def _whiten(advantages: chex.Array) -> chex.Array:
  """PPO's advantage whitening over all [B, T] entries (all are valid)."""
  return (advantages - advantages.mean()) / (advantages.std() + 1e-8)


def make_train_fn(
  config: ml_collections.ConfigDict,
  enum: bandit_lib.Enumeration,
  policy: policies_lib.Policy,
  spec: AlgorithmSpec,
):
  """Builds `train(key, bandit, lr) -> TrainOutput` for one algorithm.

  Args:
    config: hyper-parameters; reads `num_iterations` (I), `group_size` (n),
      `epochs_per_turn` (E), `minibatches_per_turn` (MB), `clip_eps`,
      `correction_clip`, `gamma`, `gae_lambda`, `critic_lr`.
    enum: tables of the (X, K, T) bandit.
    policy: the policy class.
    spec: the algorithm.

  Returns:
    A pure function (key: PRNGKey, bandit: Bandit, lr: f32 scalar) ->
    TrainOutput; jit and vmap it freely.
  """
  _check(config, spec)
  t_, n = enum.num_turns, int(config.group_size)
  b = enum.num_contexts * n
  epochs, mbs = int(config.epochs_per_turn), int(config.minibatches_per_turn)
  if spec.update == "reinforce":
    epochs, mbs = 1, 1  # on-policy: one gradient step per batch
  if b % mbs:
    raise ValueError(
      f"config key `minibatches_per_turn`={mbs} must divide "
      f"the batch size num_contexts * group_size = {b}"
    )
  eps, c_eps = float(config.clip_eps), float(config.correction_clip)
  gamma = float(config.gamma)
  turn_discount = gamma ** jnp.arange(t_ - 1, -1, -1, dtype=jnp.float32)  # [T]
  all_turns = jnp.ones((b, t_), jnp.float32)

  def _advantages(rollouts: bandit_lib.Rollouts) -> chex.Array:
    """Critic-free trajectory advantages, [B]."""
    groups, g = rollouts.contexts, enum.num_contexts
    if spec.advantage == "rloo":
      return losses.rloo_advantages(rollouts.rewards, groups, g)
    return losses.grae_advantages(
      rollouts.rewards,
      groups,
      g,
      group_std=spec.norm == "group",
      batch_norm=spec.norm == "batch",
      clip=3.0 if spec.norm == "batch" else None,
    )

  def _run_epochs(key, params, loss_fn, lr):
    """E epochs x MB minibatches of SGD on loss_fn(params, rows)."""

    def _update_minibatch(params, rows):
      grads = jax.grad(loss_fn)(params, rows)
      return _sgd_step(params, grads, lr), None

    def _update_epoch(params, epoch_key):
      perm = jax.random.permutation(epoch_key, b).reshape(mbs, b // mbs)
      params, _ = jax.lax.scan(_update_minibatch, params, perm)
      return params, None

    params, _ = jax.lax.scan(_update_epoch, params, jax.random.split(key, epochs))
    return params

  def _sequential_update(key, state, rollouts, lr):
    """SeeUPO: one turn at a time in `spec.order`, with the correction M."""
    key_order, key_turns = jax.random.split(key)
    order = losses.update_order(t_, spec.order, key=key_order if spec.order == "random" else None)
    advantages = _advantages(rollouts)
    logp_fn = lambda theta, rows=slice(None): policies_lib.action_log_probs(
      policy, theta, rollouts.states[rows], rollouts.actions[rows]
    )

    def _update_turn(carry, inputs):
      theta, correction = carry
      turn, turn_key = inputs
      mask = jnp.broadcast_to(jax.nn.one_hot(turn, t_), (b, t_))
      old_logp = jax.lax.stop_gradient(logp_fn(theta))
      turn_adv = advantages * correction * turn_discount[turn]

      def _turn_loss(theta, rows):
        loss, _ = losses.sequence_clip_loss(
          logp_fn(theta, rows),
          old_logp[rows],
          turn_adv[rows],
          mask[rows],
          clip_low=eps,
          clip_high=eps,
        )
        return loss

      theta = _run_epochs(turn_key, theta, _turn_loss, lr)
      new_logp = logp_fn(theta)
      _, metrics = losses.sequence_clip_loss(
        new_logp, old_logp, turn_adv, mask, clip_low=eps, clip_high=eps
      )
      if spec.correction:
        correction = losses.seeupo_correction(
          correction, new_logp, old_logp, mask, clip_low=c_eps, clip_high=c_eps
        )
      return (theta, correction), metrics["clip_fraction"]

    (theta, _), clip_fraction = jax.lax.scan(
      _update_turn,
      (state.theta, jnp.ones((b,), jnp.float32)),
      (order, jax.random.split(key_turns, t_)),
    )
    return state.replace(theta=theta), clip_fraction.mean()

  def _simultaneous_update(key, state, rollouts, lr):
    """GRPO / GSPO / REINFORCE: every turn in one loss."""
    advantages = _advantages(rollouts)[:, None] * turn_discount[None]  # [B,T]
    logp_fn = lambda theta, rows=slice(None): policies_lib.action_log_probs(
      policy, theta, rollouts.states[rows], rollouts.actions[rows]
    )
    old_logp = jax.lax.stop_gradient(logp_fn(state.theta))
    clip_loss = losses.token_clip_loss if spec.update == "token_ppu" else losses.sequence_clip_loss

    def _loss(theta, rows):
      if spec.update == "reinforce":
        loss, _ = losses.reinforce_loss(logp_fn(theta, rows), advantages[rows], all_turns[rows])
        return loss
      loss, _ = clip_loss(
        logp_fn(theta, rows),
        old_logp[rows],
        advantages[rows],
        all_turns[rows],
        clip_low=eps,
        clip_high=eps,
      )
      return loss

    theta = _run_epochs(key, state.theta, _loss, lr)
    if spec.update == "reinforce":
      return state.replace(theta=theta), jnp.zeros(())
    _, metrics = clip_loss(
      logp_fn(theta), old_logp, advantages, all_turns, clip_low=eps, clip_high=eps
    )
    return state.replace(theta=theta), metrics["clip_fraction"]

  def _ppo_update(key, state, rollouts, lr):
    """PPO + GAE with a tabular critic V(state)."""
    token_rewards = jnp.zeros((b, t_)).at[:, -1].set(rollouts.rewards)
    values = state.critic[rollouts.states]  # [B, T]
    advantages, returns = losses.gae_advantages(
      token_rewards, values, all_turns, gamma=gamma, lam=float(config.gae_lambda)
    )
    if spec.norm == "batch":
      advantages = _whiten(advantages)
    logp_fn = lambda theta, rows=slice(None): policies_lib.action_log_probs(
      policy, theta, rollouts.states[rows], rollouts.actions[rows]
    )
    old_logp = jax.lax.stop_gradient(logp_fn(state.theta))

    def _loss(params, rows):
      theta, critic = params
      policy_loss, _ = losses.token_clip_loss(
        logp_fn(theta, rows),
        old_logp[rows],
        advantages[rows],
        all_turns[rows],
        clip_low=eps,
        clip_high=eps,
      )
      critic_loss, _ = losses.value_loss(
        critic[rollouts.states[rows]], values[rows], returns[rows], all_turns[rows]
      )
      # The critic has its own step size: scale its loss by critic_lr / lr.
      return policy_loss + float(config.critic_lr) / lr * critic_loss

    theta, critic = _run_epochs(key, (state.theta, state.critic), _loss, lr)
    _, metrics = losses.token_clip_loss(
      logp_fn(theta), old_logp, advantages, all_turns, clip_low=eps, clip_high=eps
    )
    return TrainState(theta, critic), metrics["clip_fraction"]

  update = {
    "sequential": _sequential_update,
    "token_ppu": _simultaneous_update,
    "sequence_ppu": _simultaneous_update,
    "reinforce": _simultaneous_update,
    "ppo_gae": _ppo_update,
  }[spec.update]

  def train(key: chex.PRNGKey, bandit: bandit_lib.Bandit, lr: chex.Array) -> TrainOutput:
    """I iterations from the uniform policy; exact J after each."""

    def _exact_return(theta):
      return bandit_lib.expected_return(bandit, enum, policies_lib.log_policy(policy, theta))

    def _iteration(state, iter_key):
      key_sample, key_update = jax.random.split(iter_key)
      log_pi = policies_lib.log_policy(policy, state.theta)
      rollouts = bandit_lib.sample_rollouts(key_sample, bandit, enum, log_pi, n)
      state, clip_fraction = update(key_update, state, rollouts, lr)
      return state, (_exact_return(state.theta), clip_fraction)

    state = TrainState(policies_lib.init_params(policy), jnp.zeros((enum.num_states,), jnp.float32))
    _, (returns, clip_fraction) = jax.lax.scan(
      _iteration, state, jax.random.split(key, int(config.num_iterations))
    )
    returns = jnp.concatenate([_exact_return(state.theta)[None], returns])
    return TrainOutput(returns, clip_fraction)

  return train
