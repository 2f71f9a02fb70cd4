"""RL algorithms on the multi-turn bandit, run by the LLM learner itself.

Every algorithm is a `seeupo_jax.learner.LearnerConfig` and every update is
the learner's own `make_update` step (the code that trains LLMs), applied to
a bandit rollout batch written as a learner `Batch`:

    L = T + 1 positions per row (one row per rollout, B = X n rows)
    tokens[:, 0]     = x, the context (a "prompt" token, turn_ids -1)
    tokens[:, 1 + t] = a_t, the action at turn t (turn_ids t)
    token_valid = the turns the rollout has (all True but after a stop: `stop`), and the
    context column; turn_ids -1 after a stop; row_valid all True; group_ids = x (one group
    per context); rewards = r(x, a_1..a_T); sample_logp = the behaviour log-probs;
    turn_states = the family's environment state key of each turn (GiGPO's anchor states:
    `walk`'s positions, which different histories share), else the decision state s_t (rows
    of a context that share a prefix of actions share it); turn_rewards = the family's
    r_t(x, a_<=t) (MT-GRPO's; `decoy`, `additive` and `stop` report them, the other families
    none, where MT-GRPO's advantage is GRPO's).

The policy's `logprob_fn(theta, batch)` recovers each turn's decision state
from the tokens (`decision_states`: the state numbering of `bandit.py`) and
returns log pi(a_t | s_t) at column 1 + t (0 at column 0). PPO's critic is a
table V(state) read the same way (`value_fn`).

Each loop iteration samples n rollouts per context with the current policy,
calls the learner's update once, and records the exact J. With `lag` k >= 1
(asynchronous training) iteration i (1-based) samples with the params of
iteration max(0, i - 1 - k), kept in a ring of the last k + 1 params in the
scan carry (`ring_start`, `ring_read`, `ring_write`), and the update starts
from the current params: the ratios' and clips' "old" policy is the current
(proximal) one, and the batch's `sample_logp` are the behaviour policy's.
With `tis` on, the learner weighs each turn's policy loss by
w = min(pi_prox / pi_behav, tis_cap) (`LearnerConfig.tis`); off, the behaviour
policy is ignored (the naive stale update). The learning rate
is a traced value (`optax.inject_hyperparams(optax.sgd)`, set in the
optimizer state), so one optimizer state lives across iterations and the
whole run vmaps over seeds and learning rates.

| name | learner config |
|---|---|
| seeupo, seeupo_forward, seeupo_random | algorithm="seeupo", order reverse / forward / random, batch normalisation |
| seeupo_nocorr | same, correction=False (M stays 1) |
| seeupo_groupstd, seeupo_nonorm | same, normalisation group / none |
| grpo, gspo | "grpo" / "gspo" (group std) |
| reinforce, rloo | "reinforce" / "rloo", 1 epoch x 1 mini-batch |
| ppo | "ppo": GAE from a tabular critic with its own SGD (rate `critic_lr`), whitened, no clamp |
| gigpo | "gigpo" (group std; step groups = the rollouts at the same decision state) |
| mt_grpo | "mt_grpo" (group std; the family's turn rewards, outcome weight 1) |
| gigpo_nonorm, mt_grpo_nonorm | the same, normalisation none (each group's and step group's mean subtracted, no std) |

Every algorithm takes `lag` and `tis`; each bandit turn is one token, so the
token-level weight of turn t is w_t = min(pi_prox(a_t | s_t) / pi_behav(a_t | s_t), C),
and the sequence level ("sequence") is the same for SeeUPO (one segment per
turn) and the geometric mean over the T turns of the row for the others. PPO's
critic loss is not weighted (the learner weighs the policy loss only).

Discounting: the reward comes after turn T, so turn t's return is
gamma^(T-1-t) r (0-based t); the learner's `gamma` scales the critic-free
advantage of turn t by gamma^(T-1-t), and is GAE's discount for PPO. The
optimum does not depend on gamma; only the per-turn step sizes do.
"""

import functools
from typing import Callable, NamedTuple

import chex
import jax
import jax.numpy as jnp
import ml_collections
import optax

from seeupo_jax import learner
from seeupo_jax.theory import bandit as bandit_lib
from seeupo_jax.theory import policies as policies_lib


class AlgorithmSpec(NamedTuple):
  """What distinguishes one algorithm from another (static).

  Attributes:
    algorithm: the learner's algorithm, one of `learner.ALGORITHMS`.
    normalisation: advantage normalisation, one of `learner.NORMALISATIONS`
      ("batch": whiten over the batch, clamp to [-3, 3] for SeeUPO, no clamp
      for PPO; "group": divide by the group std; "none").
    order: SeeUPO's update order (`losses.UPDATE_ORDERS`).
    correction: SeeUPO's HAML correction M.
  """

  algorithm: str
  normalisation: str = "batch"
  order: str = "reverse"
  correction: bool = True


ALGORITHMS: dict[str, AlgorithmSpec] = {
  "seeupo": AlgorithmSpec("seeupo", "batch", "reverse", True),
  "seeupo_forward": AlgorithmSpec("seeupo", "batch", "forward"),
  "seeupo_random": AlgorithmSpec("seeupo", "batch", "random"),
  "seeupo_nocorr": AlgorithmSpec("seeupo", "batch", "reverse", False),
  "seeupo_groupstd": AlgorithmSpec("seeupo", "group"),
  "seeupo_nonorm": AlgorithmSpec("seeupo", "none"),
  "grpo": AlgorithmSpec("grpo", "group"),
  "gspo": AlgorithmSpec("gspo", "group"),
  "reinforce": AlgorithmSpec("reinforce", "none"),
  "rloo": AlgorithmSpec("rloo", "none"),
  "ppo": AlgorithmSpec("ppo", "batch"),
  "gigpo": AlgorithmSpec("gigpo", "group"),
  "mt_grpo": AlgorithmSpec("mt_grpo", "group"),
  "gigpo_nonorm": AlgorithmSpec("gigpo", "none"),
  "mt_grpo_nonorm": AlgorithmSpec("mt_grpo", "none"),
}


def get_algorithm(name: str) -> AlgorithmSpec:
  """Looks up an algorithm by name; a bad name lists the allowed ones."""
  if name not in ALGORITHMS:
    raise ValueError(
      f"unknown algorithm {name!r} (config key `algorithms`); allowed: {sorted(ALGORITHMS)}"
    )
  return ALGORITHMS[name]


class TrainOutput(NamedTuple):
  """What one run returns.

  Attributes:
    returns: [I + 1] float32 exact J before training and after each
      iteration.
    clip_fraction: [I] float32, the learner's `clip_fraction` metric of each
      iteration (mean over its applied optimizer steps, and over turns for
      SeeUPO; 0 for REINFORCE/RLOO).
  """

  returns: chex.Array
  clip_fraction: chex.Array


# ----------------------------------------------------------------------------------------------
# A bandit rollout batch as a learner Batch.


def decision_states(enum: bandit_lib.Enumeration, tokens: chex.Array) -> chex.Array:
  """The decision state of every turn, read from a row's tokens.

  State of turn t = x * P + offset[t] + prefix_t with prefix_t = sum_{u<t}
  a_u K^(t-1-u) (`bandit.py`'s numbering; the same as `Rollouts.states`).

  Args:
    enum: tables of the (X, K, T) bandit.
    tokens: int32[B, T + 1], the context then the T actions.

  Returns:
    int32[B, T].
  """
  chex.assert_shape(tokens, (None, enum.num_turns + 1))
  context, actions = tokens[:, 0], tokens[:, 1:]
  prefix = jnp.zeros_like(context)
  states = []
  for t in range(enum.num_turns):
    states.append(context * enum.states_per_context + enum.turn_offset(t) + prefix)
    prefix = prefix * enum.num_actions + actions[:, t]
  return jnp.stack(states, 1).astype(jnp.int32)


def rollout_batch(rollouts: bandit_lib.Rollouts, behaviour_log_pi: chex.Array) -> learner.Batch:
  """The learner `Batch` of a rollout batch (see the module doc).

  Args:
    rollouts: B rollouts (contexts [B]; states, actions, turn_states, turn_valid [B, T];
      rewards [B]).
    behaviour_log_pi: [S, K] float32, the policy that sampled them.

  Returns:
    A `learner.Batch` with N = B rows of L = T + 1 tokens.
  """
  b, t_ = rollouts.actions.shape
  tokens = jnp.concatenate([rollouts.contexts[:, None], rollouts.actions], 1).astype(jnp.int32)
  token_valid = jnp.concatenate([jnp.ones((b, 1), bool), rollouts.turn_valid], 1)
  turn_ids = jnp.broadcast_to(jnp.arange(-1, t_, dtype=jnp.int32), (b, t_ + 1))
  turn_ids = jnp.where(token_valid, turn_ids, -1)
  sample_logp = behaviour_log_pi[rollouts.states, rollouts.actions]
  return learner.Batch(
    tokens=tokens,
    token_valid=token_valid,
    turn_ids=turn_ids,
    sample_logp=jnp.concatenate([jnp.zeros((b, 1), jnp.float32), sample_logp], 1),
    rewards=rollouts.rewards.astype(jnp.float32),
    group_ids=rollouts.contexts.astype(jnp.int32),
    row_valid=jnp.ones((b,), bool),
    turn_rewards=rollouts.turn_rewards.astype(jnp.float32),
    turn_states=rollouts.turn_states.astype(jnp.int32),
  )


def _prepend_zero(per_turn: chex.Array) -> chex.Array:
  """[B, T] -> [B, T + 1] with column 0 (the context token) = 0."""
  return jnp.concatenate([jnp.zeros_like(per_turn[:, :1]), per_turn], 1)


def make_logprob_fn(enum: bandit_lib.Enumeration, policy: policies_lib.Policy):
  """The policy as a learner `logprob_fn(theta, batch) -> float32[B, T + 1]`.

  Entry [i, 1 + t] = log pi(a_t | s_t) with s_t from `decision_states`;
  column 0 (the context, predicted by nothing) is 0.
  """

  def logprob_fn(theta: chex.Array, batch: learner.Batch) -> chex.Array:
    states = decision_states(enum, batch.tokens)
    log_pi = policies_lib.log_policy(policy, theta)  # [S, K]
    return _prepend_zero(log_pi[states, batch.tokens[:, 1:]])

  return logprob_fn


def make_value_fn(enum: bandit_lib.Enumeration):
  """PPO's tabular critic as a learner `value_fn(critic [S], batch) -> float32[B, T + 1]`.

  Entry [i, 1 + t] = V(s_t), the value of the state before action a_t.
  """

  def value_fn(critic: chex.Array, batch: learner.Batch) -> chex.Array:
    return _prepend_zero(critic[decision_states(enum, batch.tokens)])

  return value_fn


# ----------------------------------------------------------------------------------------------
# Compiling the runs.

_NO_YNN_FUSIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


@functools.lru_cache(maxsize=None)
def _xla_knows(options: tuple[tuple[str, str], ...]) -> bool:
  try:
    jax.jit(lambda x: x.sum(-1), compiler_options=dict(options))(jnp.ones((2, 3)))
  except Exception:  # pylint: disable=broad-except  # e.g. "No such compile option"
    return False
  return True


def compiler_options() -> dict[str, str]:
  """XLA options for `jax.jit` of the bandit runs (`sweep.make_setting_fn` uses them).

  On CPU: no YNNPACK library fusions. XLA:CPU (jaxlib 0.10) hands reductions
  and element-wise ops to YNNPACK, which is slow on the bandit's tiny trailing
  axes (e.g. the learner's per-row sums over L = T + 1 = 5 tokens): with them,
  1,000 seeds of SeeUPO ran 1.6x slower through the learner than through the
  old hand-written update; without them both run faster and at the same speed
  (docs/theory.md). Other backends, or an XLA that does not know the option:
  no options.
  """
  if jax.default_backend() != "cpu" or not _xla_knows(tuple(_NO_YNN_FUSIONS.items())):
    return {}
  return dict(_NO_YNN_FUSIONS)


# ----------------------------------------------------------------------------------------------
# The learner's config and the training loop.


def _check(config: ml_collections.ConfigDict, spec: AlgorithmSpec, batch_size: int) -> None:
  for key in ("epochs_per_turn", "minibatches_per_turn", "group_size", "num_iterations"):
    if int(config[key]) < 1:
      raise ValueError(f"config key `{key}` must be >= 1, got {config[key]}")
  if not 0.0 < config.gamma <= 1.0:
    raise ValueError(f"config key `gamma` must be in (0, 1], got {config.gamma}")
  if spec.algorithm not in ("reinforce", "rloo") and batch_size % int(config.minibatches_per_turn):
    raise ValueError(
      f"config key `minibatches_per_turn`={config.minibatches_per_turn} must divide "
      f"the batch size num_contexts * group_size = {batch_size}"
    )


def learner_config(
  config: ml_collections.ConfigDict, enum: bandit_lib.Enumeration, spec: AlgorithmSpec
) -> learner.LearnerConfig:
  """The `learner.LearnerConfig` of one bandit algorithm.

  Reads `epochs_per_turn`, `minibatches_per_turn` (REINFORCE/RLOO: 1 x 1,
  on-policy), `clip_eps`, `correction_clip`, `gamma`, `gae_lambda`, `tis`,
  `tis_cap` (the sampler-mismatch weight, `LearnerConfig.tis`). No KL
  penalty (the bandits have no reference policy); PPO's critic loss is
  unclipped and its whitened advantages are not clamped.
  """
  on_policy = spec.algorithm in ("reinforce", "rloo")
  sequential = spec.algorithm == "seeupo"
  eps, c_eps = float(config.clip_eps), float(config.correction_clip)
  return learner.LearnerConfig(
    algorithm=spec.algorithm,
    num_turns=enum.num_turns,
    order=spec.order if sequential else "reverse",
    normalisation=spec.normalisation,
    correction=spec.correction if sequential else True,
    epochs=1 if on_policy else int(config.epochs_per_turn),
    minibatches=1 if on_policy else int(config.minibatches_per_turn),
    clip_low=eps,
    clip_high=eps,
    correction_clip_low=c_eps,
    correction_clip_high=c_eps,
    advantage_clip=None if spec.algorithm == "ppo" else 3.0,
    kl_coef=0.0,
    gamma=float(config.gamma),
    gae_lambda=float(config.gae_lambda),
    value_clip=None,
    tis=str(config.tis),
    tis_cap=float(config.tis_cap),
    # The bandits' log-prob function reads whole rows (one position per turn, not a causal LM
    # over a prefix): every turn's passes run on the full batch.
    turn_buckets=1,
  )


def ring_start(params: chex.ArrayTree, lag: int) -> chex.ArrayTree:
  """The ring of the last lag + 1 params before the first iteration: every slot holds `params`.

  Args:
    params: the initial params theta_0 (any pytree of arrays).
    lag: k >= 0.

  Returns:
    The pytree with a leading axis of size k + 1 on every leaf, each slot theta_0.
  """
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (lag + 1,) + x.shape), params)


def ring_read(ring: chex.ArrayTree, iteration: chex.Array) -> chex.ArrayTree:
  """The behaviour params of 0-based iteration j: slot j mod (k + 1).

  With `ring_write` after each iteration, that slot was last written at
  iteration j - (k + 1) with theta_{j - k} (theta_m: the params after m
  iterations), or holds theta_0: so it is theta_{max(0, j - k)}, the params of
  1-based iteration max(0, i - 1 - k) for i = j + 1.

  Args:
    ring: the ring (leading axis k + 1).
    iteration: int32 scalar j >= 0 (may be traced).
  """
  size = jax.tree.leaves(ring)[0].shape[0]
  return jax.tree.map(lambda x: x[iteration % size], ring)


def ring_write(ring: chex.ArrayTree, iteration: chex.Array, params: chex.ArrayTree):
  """The ring with slot j mod (k + 1) set to `params` (theta_{j + 1}, after iteration j)."""
  size = jax.tree.leaves(ring)[0].shape[0]
  return jax.tree.map(lambda r, p: r.at[iteration % size].set(p), ring, params)


def _set_learning_rate(opt_state, lr: chex.Array):
  """The `inject_hyperparams` state with its learning rate set to `lr` (may be traced)."""
  hyperparams = dict(opt_state.hyperparams, learning_rate=jnp.asarray(lr, jnp.float32))
  return opt_state._replace(hyperparams=hyperparams)


def make_train_fn(
  config: ml_collections.ConfigDict,
  enum: bandit_lib.Enumeration,
  policy: policies_lib.Policy,
  spec: AlgorithmSpec,
  optimizer: Callable[..., optax.GradientTransformation] = optax.sgd,
):
  """Builds `train(key, bandit, lr) -> TrainOutput` for one algorithm.

  Args:
    config: hyper-parameters; reads `num_iterations` (I), `group_size` (n),
      `epochs_per_turn` (E), `minibatches_per_turn` (MB), `clip_eps`,
      `correction_clip`, `gamma`, `gae_lambda`, `critic_lr`, `lag` (k: iteration
      i samples with the params of iteration max(0, i - 1 - k)), `tis`, `tis_cap`.
    enum: tables of the (X, K, T) bandit.
    policy: the policy class.
    spec: the algorithm.
    optimizer: the policy's optax optimizer as a function of `learning_rate`
      (default plain SGD, the comparison's); wrapped in
      `optax.inject_hyperparams`, and its state is carried across iterations.

  Returns:
    A pure function (key: PRNGKey, bandit: Bandit, lr: f32 scalar) ->
    TrainOutput; jit and vmap it freely. The policy's optimizer runs at rate
    lr, PPO's critic takes SGD steps at rate `critic_lr` (its own optimizer).
  """
  n, lag = int(config.group_size), int(config.lag)
  _check(config, spec, enum.num_contexts * n)
  lconfig = learner_config(config, enum, spec)
  optimizer = optax.inject_hyperparams(optimizer)(learning_rate=1.0)
  value_fn = critic_optimizer = None
  if spec.algorithm == "ppo":
    value_fn, critic_optimizer = make_value_fn(enum), optax.sgd(float(config.critic_lr))
  update = learner.make_update(
    make_logprob_fn(enum, policy),
    optimizer,
    lconfig,
    value_fn=value_fn,
    critic_optimizer=critic_optimizer,
    jit=False,
  )

  def _initial_state(lr) -> learner.TrainState:
    critic = None
    if critic_optimizer is not None:
      critic = jnp.zeros((enum.num_states,), jnp.float32)
    state = learner.init_state(
      policies_lib.init_params(policy),
      optimizer,
      critic_params=critic,
      critic_optimizer=critic_optimizer,
    )
    return state.replace(opt_state=_set_learning_rate(state.opt_state, lr))

  def train(key: chex.PRNGKey, bandit: bandit_lib.Bandit, lr: chex.Array) -> TrainOutput:
    """I iterations from the uniform policy; exact J after each."""

    def _exact_return(theta):
      return bandit_lib.expected_return(bandit, enum, policies_lib.log_policy(policy, theta))

    def _iteration(state: learner.TrainState, iter_key):
      key_sample, key_update = jax.random.split(iter_key)
      log_pi = policies_lib.log_policy(policy, state.params)
      rollouts = bandit_lib.sample_rollouts(key_sample, bandit, enum, log_pi, n)
      state, metrics = update(state, rollout_batch(rollouts, log_pi), key_update)
      return state, (_exact_return(state.params), metrics["clip_fraction"])

    def _lagged_iteration(carry, xs):
      """Samples with the ring's theta_{max(0, j - k)}, updates the current params."""
      state, ring = carry
      iter_key, iteration = xs
      key_sample, key_update = jax.random.split(iter_key)
      behaviour = policies_lib.log_policy(policy, ring_read(ring, iteration))
      rollouts = bandit_lib.sample_rollouts(key_sample, bandit, enum, behaviour, n)
      state, metrics = update(state, rollout_batch(rollouts, behaviour), key_update)
      ring = ring_write(ring, iteration, state.params)
      return (state, ring), (_exact_return(state.params), metrics["clip_fraction"])

    state = _initial_state(lr)
    keys = jax.random.split(key, int(config.num_iterations))
    if lag == 0:  # on-policy: sampled with the current params, no ring in the carry
      _, (returns, clip_fraction) = jax.lax.scan(_iteration, state, keys)
    else:
      iterations = jnp.arange(int(config.num_iterations), dtype=jnp.int32)
      carry = (state, ring_start(state.params, lag))
      _, (returns, clip_fraction) = jax.lax.scan(_lagged_iteration, carry, (keys, iterations))
    returns = jnp.concatenate([_exact_return(state.params)[None], returns])
    return TrainOutput(returns, clip_fraction)

  return train
