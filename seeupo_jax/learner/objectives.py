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
  if config.algorithm == "rloo":
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
      discounts), before SeeUPO's correction M when `correction` is set.
    mask: float32[R, L], the tokens this loss trains on.
    old_values, returns: float32[R, L] PPO critic inputs, else None.
    correction: SeeUPO: float32[R] M before the last updated turn's factor
      (pending, see `fold_pending_correction`); None elsewhere.
    previous_old_logp, previous_mask: float32[R, L], the last updated turn's old
      log-probs and mask (zeros before the first turn), with `correction`.
  """

  old_logp: Optional[Array]
  ref_logp: Optional[Array]
  advantages: Array
  mask: Array
  old_values: Optional[Array] = None
  returns: Optional[Array] = None
  correction: Optional[Array] = None
  previous_old_logp: Optional[Array] = None
  previous_mask: Optional[Array] = None


def fold_pending_correction(
  logp: Array, inputs: LossInputs, config: LearnerConfig
) -> tuple[LossInputs, Array]:
  """Folds the last updated turn's factor into M, and M into the advantages.

    M <- clip(M * clip(s, 1 - c_lo, 1 + c_hi), 1 - c_lo, 1 + c_hi),
    s = exp(mean over the previous turn's tokens of (logp - previous_old_logp))
  (`losses.seeupo_correction`; rows without the previous turn keep M; nothing
  changes with `config.correction` False), then advantages <- A * M.

  Args:
    logp: float32[R, L], log-probs at the current params (after the previous
      turn's update), no gradient.
    inputs: `LossInputs`; without `correction` they are returned as they are.
    config: the correction clips and switch.

  Returns:
    (inputs with advantages A * M and no pending correction, M float32[R]).
  """
  if inputs.correction is None:
    return inputs, jnp.ones(inputs.mask.shape[:1], jnp.float32)
  correction = inputs.correction
  if config.correction:
    correction = losses.seeupo_correction(
      correction,
      logp,
      inputs.previous_old_logp,
      inputs.previous_mask,
      clip_low=config.correction_clip_low,
      clip_high=config.correction_clip_high,
    )
  factor = correction if inputs.advantages.ndim == 1 else correction[:, None]
  folded = inputs._replace(
    advantages=inputs.advantages * factor,
    correction=None,
    previous_old_logp=None,
    previous_mask=None,
  )
  return folded, correction


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

    seeupo, gspo: losses.sequence_clip_loss (one ratio per row of the mask)
    grpo, ppo:    losses.token_clip_loss
    reinforce, rloo: losses.reinforce_loss
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
  if config.algorithm in ("seeupo", "gspo"):
    pg, metrics = losses.sequence_clip_loss(
      logp, inputs.old_logp, inputs.advantages, inputs.mask, **clip
    )
  elif config.algorithm in ("grpo", "ppo"):
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
