"""What each algorithm optimises: its advantages and its mini-batch loss.

Pure functions of arrays, built from `seeupo_jax.losses`; the hyper-parameters
come from a `LearnerConfig`. The update ladder in `update.py` calls them and
knows nothing of the algorithms' formulas.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp

from seeupo_jax import losses
from seeupo_jax.learner.config import LearnerConfig

Array = jax.Array


def trajectory_advantages(
  rewards: Array, group_ids: Array, row_valid: Array, config: LearnerConfig
) -> Array:
  """Critic-free advantages, one per trajectory (every algorithm but PPO).

    seeupo (batch):  A = clip((D - mean_B D) / std_B D, -c, c), D_i = R_i - mean_{G(i)} R
    grpo, gspo (group): A_i = (R_i - mean_{G(i)} R) / (std_{G(i)} R + 1e-6)
    reinforce (none): A_i = R_i - mean_{G(i)} R
    rloo: A_i = R_i - mean_{j in G(i), j != i} R_j
  See `losses.grae_advantages` / `losses.rloo_advantages`.

  Args:
    rewards: float32[N] outcome rewards.
    group_ids: int32[N] in [0, N).
    row_valid: bool[N]; invalid rows get 0 and count in no statistic.
    config: the learner config (algorithm, normalisation, advantage_clip).

  Returns:
    float32[N].
  """
  chex.assert_rank([rewards, group_ids, row_valid], 1)
  num_groups = rewards.shape[0]
  if config.spec.advantage == "rloo":
    return losses.rloo_advantages(rewards, group_ids, num_groups, valid=row_valid)
  norm = config.advantage_normalisation
  return losses.grae_advantages(
    rewards,
    group_ids,
    num_groups,
    group_std=norm == "group",
    batch_norm=norm == "batch",
    clip=config.advantage_clip if norm == "batch" else None,
    valid=row_valid,
  )


def overlong_penalty(lengths: Array, max_tokens: int, cache_tokens: int) -> Array:
  """DAPO's soft overlong punishment, added to the outcome reward.

    R_len(|y|) = 0                                 |y| <= L_max - L_cache
               = ((L_max - L_cache) - |y|) / L_cache   L_max - L_cache < |y| <= L_max
               = -1                                L_max < |y|
  See "DAPO" (https://arxiv.org/abs/2503.14476), eq. 13.

  Args:
    lengths: float32[N], |y|: the generated tokens of each trajectory (all its turns).
    max_tokens: L_max.
    cache_tokens: L_cache in [0, L_max].

  Returns:
    float32[N], in [-1, 0].
  """
  chex.assert_rank(lengths, 1)
  start = float(max_tokens - cache_tokens)
  ramp = (start - lengths) / max(cache_tokens, 1)
  return jnp.where(lengths > max_tokens, -1.0, jnp.where(lengths > start, ramp, 0.0)).astype(
    jnp.float32
  )


def informative_groups(rewards: Array, group_ids: Array, row_valid: Array) -> tuple[Array, Array]:
  """DAPO's dynamic-sampling filter: a group whose valid rows' rewards are all equal has no signal.

  Args:
    rewards: float32[N]; group_ids: int32[N] in [0, N); row_valid: bool[N].

  Returns:
    (keep bool[N]: valid rows of groups whose rewards differ, dropped groups float32 scalar:
    groups with a valid row and all rewards equal).
  """
  chex.assert_rank([rewards, group_ids, row_valid], 1)
  n = rewards.shape[0]
  high = jax.ops.segment_max(jnp.where(row_valid, rewards, -jnp.inf), group_ids, num_segments=n)
  low = jax.ops.segment_min(jnp.where(row_valid, rewards, jnp.inf), group_ids, num_segments=n)
  present = jax.ops.segment_sum(row_valid.astype(jnp.float32), group_ids, num_segments=n) > 0
  informative = high > low
  dropped = jnp.sum((present & ~informative).astype(jnp.float32))
  return row_valid & informative[group_ids], dropped


def turn_discounts(turn_ids: Array, mask: Array, gamma: float) -> Array:
  """float32[N, L]: gamma^(T_i - 1 - t) on the tokens of turn t of a row with T_i turns.

  The critic-free algorithms' discount (the outcome reward comes after the last
  turn, so turn t's return is gamma^(T_i - 1 - t) R); 1 everywhere when gamma = 1.

  Args:
    turn_ids: int32[N, L].
    mask: float32[N, L], generated tokens (T_i = 1 + the largest turn id under it).
    gamma: discount in (0, 1].
  """
  chex.assert_equal_shape([turn_ids, mask])
  turns = jnp.max(jnp.where(mask > 0, turn_ids, -1), axis=1, keepdims=True) + 1
  steps_to_end = jnp.maximum(turns - 1 - turn_ids, 0).astype(jnp.float32)
  return jnp.where(mask > 0, jnp.float32(gamma) ** steps_to_end, 0.0)


def outcome_token_rewards(rewards: Array, mask: Array) -> Array:
  """float32[N, L]: each row's reward on its last generated token, 0 elsewhere (for GAE)."""
  chex.assert_rank([rewards, mask], [1, 2])
  length = mask.shape[1]
  last = length - 1 - jnp.argmax(mask[:, ::-1] > 0, axis=1)
  on_last = (jnp.arange(length)[None, :] == last[:, None]) & (mask > 0)
  return jnp.where(on_last, rewards[:, None], 0.0).astype(jnp.float32)


def whiten_tokens(advantages: Array, mask: Array, clip: Optional[float]) -> Array:
  """PPO's batch normalisation over generated tokens (`losses.batch_normalise`), clamped to +-clip.

  Args:
    advantages: float32[N, L].
    mask: float32[N, L], 1 on generated tokens (statistics over these only).
    clip: clamp bound after whitening, or None.

  Returns:
    float32[N, L], 0 where mask is 0.
  """
  out = losses.batch_normalise(advantages, mask > 0)
  if clip is not None:
    out = jnp.clip(out, -clip, clip)
  return out * mask


def ppo_advantages(
  rewards: Array, values: Array, mask: Array, config: LearnerConfig
) -> tuple[Array, Array]:
  """GAE advantages and critic targets for PPO (environment tokens skipped).

  Args:
    rewards: float32[N] outcome rewards (placed on each row's last generated token).
    values: float32[N, L] the critic's values at rollout time.
    mask: float32[N, L] generated tokens of valid rows.
    config: gamma, gae_lambda, normalisation, advantage_clip.

  Returns:
    (advantages float32[N, L], returns float32[N, L]).
  """
  advantages, returns = losses.gae_advantages(
    outcome_token_rewards(rewards, mask), values, mask, gamma=config.gamma, lam=config.gae_lambda
  )
  if config.advantage_normalisation == "batch":
    advantages = whiten_tokens(advantages, mask, config.advantage_clip)
  return advantages, returns


class LossInputs(NamedTuple):
  """The constants of one mini-batch (or micro-batch) loss; rows = R.

  Attributes:
    old_logp: float32[R, L], log-probs at the params before this turn's (or
      this call's) optimisation; None: the loss's own forward pass is at those
      params (one epoch of one mini-batch), so stop_gradient of its log-probs.
    ref_logp: float32[R, L] reference log-probs, or None (no KL term).
    advantages: float32[R] (critic-free) or float32[R, L] (PPO, or turn
      discounts); for SeeUPO already weighted by M (`weigh_advantages`).
    mask: float32[R, L], the tokens this loss trains on.
    old_values, returns: float32[R, L] PPO critic inputs, else None.
  """

  old_logp: Optional[Array]
  ref_logp: Optional[Array]
  advantages: Array
  mask: Array
  old_values: Optional[Array] = None
  returns: Optional[Array] = None


class Correction(NamedTuple):
  """SeeUPO's HAML factor M, one per trajectory, with the last updated turn's factor pending.

  rho of turn t needs the log-probs after turn t's update, which the next updated
  turn's first forward pass gives; until then turn t's old log-probs and mask wait here.

  Attributes:
    factor: float32[N], M up to (not including) the last updated turn.
    pending_old_logp: float32[N, L], the last updated turn's old log-probs.
    pending_mask: float32[N, L], the last updated turn's mask (zeros before the first turn).
  """

  factor: Array
  pending_old_logp: Array
  pending_mask: Array

  @classmethod
  def start(cls, shape: tuple[int, int]) -> "Correction":
    """M = 1 for every trajectory, nothing pending."""
    zeros = jnp.zeros(shape, jnp.float32)
    return cls(jnp.ones(shape[:1], jnp.float32), zeros, zeros)

  def take(self, rows: Array) -> "Correction":
    return jax.tree.map(lambda x: x[rows], self)

  def corrected(self, logp: Array, config: LearnerConfig) -> Array:
    """float32[N]: M with the pending factor folded in (unchanged with `config.correction` off).

      M <- clip(M * clip(s, 1 - c_lo, 1 + c_hi), 1 - c_lo, 1 + c_hi),
      s = exp(mean over the pending turn's tokens of (logp - pending_old_logp))
    (`losses.seeupo_correction`; rows without the pending turn keep M).

    Args:
      logp: float32[N, L], log-probs at the current params (after the pending turn's
        update), no gradient.
      config: the correction clips and switch.
    """
    if not config.correction:
      return self.factor
    return losses.seeupo_correction(
      self.factor,
      logp,
      self.pending_old_logp,
      self.pending_mask,
      clip_low=config.correction_clip_low,
      clip_high=config.correction_clip_high,
    )


def weigh_advantages(inputs: LossInputs, correction: Array) -> LossInputs:
  """The turn's advantages A * M (M float32[R] a constant, per trajectory)."""
  factor = correction if inputs.advantages.ndim == 1 else correction[:, None]
  return inputs._replace(advantages=inputs.advantages * factor)


def turn_inputs(
  first_logp: Array, inputs: LossInputs, correction: Optional[Correction], config: LearnerConfig
) -> tuple[LossInputs, Array]:
  """The box's "correct M -> A * M" from the turn's first forward pass (SeeUPO).

  Args:
    first_logp: float32[R, L], log-probs at the params the turn starts from (after the
      previous updated turn's update), no gradient.
    inputs: `LossInputs` with the advantages A.
    correction: the `Correction` of these rows, or None (not sequential: nothing to weigh).
    config: the correction clips and switch.

  Returns:
    (inputs with advantages A * M, M float32[R]; ones without a correction).
  """
  if correction is None:
    return inputs, jnp.ones(inputs.mask.shape[:1], jnp.float32)
  factor = correction.corrected(first_logp, config)
  return weigh_advantages(inputs, factor), factor


def aggregation_denominator(mask: Array, agg: str) -> Array:
  """The denominator `losses.aggregate(., mask, agg)` divides by (before its max with 1).

  token-mean: the number of masked tokens; seq-mean-*: the number of rows with
  tokens. Used to weight micro-batches so that their gradients add up to the
  mini-batch's exactly.
  """
  if agg == "token-mean":
    return jnp.sum(mask)
  return jnp.sum(jnp.any(mask > 0, axis=-1).astype(jnp.float32))


def policy_loss(logp: Array, inputs: LossInputs, config: LearnerConfig) -> tuple[Array, dict]:
  """The algorithm's policy objective plus the KL penalty, on `inputs.mask`.

    loss "sequence_clip" (seeupo, gspo): losses.sequence_clip_loss (one ratio per row of the mask)
    loss "token_clip" (grpo, ppo):       losses.token_clip_loss
    loss "reinforce" (reinforce, rloo):  losses.reinforce_loss
    + kl_coef * aggregate(kl_penalty(logp, ref_logp, kl_kind), mask, agg)

  Args:
    logp: float32[R, L] log-probs at the params being optimised.
    inputs: `LossInputs`.
    config: the learner config.

  Returns:
    (scalar float32 loss, metrics: pg_loss, kl, clip_fraction, ratio_mean, approx_kl).
  """
  if inputs.old_logp is None:
    inputs = inputs._replace(old_logp=jax.lax.stop_gradient(logp))
  clip = dict(
    clip_low=config.clip_low, clip_high=config.clip_high, dual_clip=config.dual_clip, agg=config.agg
  )
  kind = config.spec.loss
  if kind == "sequence_clip":
    pg, metrics = losses.sequence_clip_loss(
      logp, inputs.old_logp, inputs.advantages, inputs.mask, **clip
    )
  elif kind == "token_clip":
    pg, metrics = losses.token_clip_loss(
      logp, inputs.old_logp, inputs.advantages, inputs.mask, **clip
    )
  else:
    pg, metrics = losses.reinforce_loss(logp, inputs.advantages, inputs.mask, agg=config.agg)
  if inputs.ref_logp is None:
    kl = jnp.zeros((), jnp.float32)
  else:
    kl = losses.aggregate(
      losses.kl_penalty(logp, inputs.ref_logp, config.kl_kind), inputs.mask, config.agg
    )
  return pg + config.kl_coef * kl, {
    "pg_loss": pg,
    "kl": kl,
    "clip_fraction": metrics["clip_fraction"],
    "ratio_mean": metrics["ratio_mean"],
    "approx_kl": metrics["approx_kl"],
  }


def critic_loss(values: Array, inputs: LossInputs, config: LearnerConfig) -> tuple[Array, dict]:
  """PPO critic regression (token-mean over the mask); see `losses.value_loss`."""
  return losses.value_loss(
    values, inputs.old_values, inputs.returns, inputs.mask, clip=config.value_clip, agg="token-mean"
  )
