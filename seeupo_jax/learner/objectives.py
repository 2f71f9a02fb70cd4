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
from seeupo_jax.learner import algorithms
from seeupo_jax.learner import batch as batch_lib
from seeupo_jax.learner.config import LearnerConfig
from seeupo_jax.learner.dapo import overlong_penalty  # noqa: F401
from seeupo_jax.learner.dapo import informative_rows as informative_groups  # noqa: F401

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


def turn_advantages(batch, config: LearnerConfig) -> Array:
  """float32[N, T]: the turn-level advantages of `config.algorithm` (gigpo or mt_grpo).

    gigpo:   `losses.gigpo_advantages` over `batch.turn_states`, discount `config.gamma`,
             step weight `config.step_weight` (None: 1)
    mt_grpo: `losses.mt_grpo_advantages` of `batch.turn_rewards`, outcome weight
             `config.outcome_weight` (None: 1)
  Both divide by the group's std with normalisation "group" (their default) and only centre
  with "none".

  Raises:
    ValueError (at trace time): the batch lacks the field the algorithm reads.
  """
  name = config.spec.advantage
  needs, what = algorithms.TURN_INPUTS[name]
  if getattr(batch, needs) is None:
    raise ValueError(
      f"algorithm={config.algorithm!r} needs Batch.{needs} [N, T] (the environment's "
      f"{what.removeprefix('a ')} per turn); this batch has none"
    )
  turns = batch_lib.row_turns(batch, config.num_turns)
  group_std = config.advantage_normalisation == "group"
  n = batch.rewards.shape[0]
  if name == "gigpo":
    return losses.gigpo_advantages(
      batch.rewards,
      batch.group_ids,
      n,
      batch.turn_states,
      turns,
      gamma=config.gamma,
      step_weight=1.0 if config.step_weight is None else config.step_weight,
      group_std=group_std,
      valid=batch.row_valid,
    )
  return losses.mt_grpo_advantages(
    batch.rewards,
    batch.turn_rewards,
    batch.group_ids,
    n,
    turns,
    outcome_weight=1.0 if config.outcome_weight is None else config.outcome_weight,
    group_std=group_std,
    valid=batch.row_valid,
  )


def on_turn_tokens(per_turn: Array, turn_ids: Array, mask: Array) -> Array:
  """float32[N, L]: per_turn[i, turn_ids[i, l]] on the tokens of `mask`, 0 elsewhere.

  Args:
    per_turn: float32[N, T].
    turn_ids: int32[N, L] (-1 off the generated tokens).
    mask: float32[N, L], the generated tokens that count.
  """
  chex.assert_rank([per_turn, turn_ids, mask], 2)
  slots = jnp.clip(turn_ids, 0, per_turn.shape[1] - 1)
  return jnp.take_along_axis(per_turn, slots, axis=1) * mask


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
    sample_logp: float32[R, L], the sampler's log-probs, when the first forward pass is still
      to weigh the advantages by the TIS weight (`LearnerConfig.tis` on, one-pass algorithms;
      `turn_inputs`); None: nothing left to weigh (TIS off, or folded in already: SeeUPO).
  """

  old_logp: Optional[Array]
  ref_logp: Optional[Array]
  advantages: Array
  mask: Array
  old_values: Optional[Array] = None
  returns: Optional[Array] = None
  sample_logp: Optional[Array] = None


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
  """What the first forward pass settles: TIS's A * w (one-pass algorithms), then the box's
  "correct M -> A * M" (SeeUPO).

  Args:
    first_logp: float32[R, L], log-probs at the params the turn (or the call) starts from
      (after the previous updated turn's update), no gradient.
    inputs: `LossInputs` with the advantages A (and, for TIS still to apply, `sample_logp`).
    correction: the `Correction` of these rows, or None (not sequential: nothing to weigh).
    config: the correction clips and switch, the TIS level and cap.

  Returns:
    (inputs with advantages A * w * M and no `sample_logp` left, M float32[R]; ones without a
    correction).
  """
  if inputs.sample_logp is not None:
    weights = sampler_weights(first_logp, inputs.sample_logp, inputs.mask, config)
    inputs = inputs._replace(
      advantages=sampler_weighted(inputs.advantages, weights.weight), sample_logp=None
    )
  if correction is None:
    return inputs, jnp.ones(inputs.mask.shape[:1], jnp.float32)
  factor = correction.corrected(first_logp, config)
  return weigh_advantages(inputs, factor), factor


class SamplerWeights(NamedTuple):
  """Truncated importance weights between the sampler and the learner's old policy (TIS).

  Attributes:
    weight: float32[R, L], w on the masked tokens (at the sequence level one value per
      segment, repeated on its tokens), 1 elsewhere; a constant (no gradient).
    truncated: float32[R, L], 1 on the masked tokens whose ratio exceeded the cap C.
    share: float32[R, L], each masked token's share of one weighting decision: 1 (token level)
      or 1/n for the n tokens of its segment (sequence level); 0 elsewhere. sum(share) is the
      number of decisions, so sum(share * x) / sum(share) is a mean over decisions.
  """

  weight: Array
  truncated: Array
  share: Array


def sampler_weights(
  old_logp: Array,
  sample_logp: Array,
  mask: Array,
  config: LearnerConfig,
  segments: Optional[Array] = None,
) -> SamplerWeights:
  """The TIS weights ("rollout correction") of `LearnerConfig.tis` and `.tis_cap` (C).

    token:     w_it = min(exp(log pi_old(y_it) - log pi_sampler(y_it)), C)
    sequence:  w_it = min(exp((1/|S|) sum_{u in S} (log pi_old(y_iu) - log pi_sampler(y_iu))), C)
               for every token t of the segment S that holds it: the masked tokens of row i,
               or, with `segments`, those of row i with the same segment id (SeeUPO: the turn)
  The sequence level takes the geometric mean of the token ratios (GSPO's length-normalised
  ratio, over the same tokens as `losses.sequence_clip_loss`'s s_i), not their product: the
  product's spread grows exponentially with the length, so a cap C ~ 2 would truncate nearly
  every long reply and drive the others to ~0. The weight multiplies the policy loss of each
  token (`sampler_weighted`: the advantages are constants, and every loss is positively
  homogeneous in them); KL and the critic's loss are not weighted. With pi_old = pi_sampler,
  w = 1 exactly (C >= 1). See "Your Efficient RL Framework Secretly Brings You Off-Policy RL
  Training" (Yao et al., 2025, https://fengyao.notion.site/off-policy-rl) and "IMPALA"
  (https://arxiv.org/abs/1802.01561) for truncated importance sampling.

  Args:
    old_logp: float32[R, L], the learner's log-probs at the params the rollout was drawn with
      (the update's starting params), no gradient.
    sample_logp: float32[R, L], the log-probs the sampler recorded (`Batch.sample_logp`).
    mask: float32[R, L], the tokens weighted.
    config: `tis` ("token" or "sequence") and `tis_cap`; `num_turns` bounds `segments`.
    segments: int32[R, L] in [0, num_turns) on the masked tokens, or None (one segment a row).

  Returns:
    `SamplerWeights`.
  """
  chex.assert_equal_shape([old_logp, sample_logp, mask])
  mask = mask.astype(jnp.float32)
  on = mask > 0
  log_ratio = jnp.where(on, old_logp.astype(jnp.float32) - sample_logp.astype(jnp.float32), 0.0)
  if config.tis == "token":
    share = mask
  elif segments is None:
    tokens = jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True), 1.0)
    log_ratio = jnp.where(on, jnp.sum(log_ratio, axis=-1, keepdims=True) / tokens, 0.0)
    share = mask / tokens
  else:
    chex.assert_equal_shape([segments, mask])
    rows, per_row = mask.shape[0], config.num_turns
    ids = jnp.arange(rows, dtype=jnp.int32)[:, None] * per_row + segments
    ids = jnp.where(on, ids, rows * per_row).reshape(-1)  # rows * per_row: "none", dropped
    sums = jnp.zeros((rows * per_row,), jnp.float32).at[ids].add(log_ratio.reshape(-1), mode="drop")
    counts = jnp.zeros((rows * per_row,), jnp.float32).at[ids].add(mask.reshape(-1), mode="drop")
    tokens = jnp.maximum(counts.at[ids].get(mode="fill", fill_value=1.0), 1.0).reshape(mask.shape)
    segment_sum = sums.at[ids].get(mode="fill", fill_value=0.0).reshape(mask.shape)
    log_ratio = jnp.where(on, segment_sum / tokens, 0.0)
    share = mask / tokens
  ratio = jnp.exp(log_ratio)
  cap = jnp.float32(config.tis_cap)
  weight = jnp.where(on, jnp.minimum(ratio, cap), 1.0)
  truncated = (on & (ratio > cap)).astype(jnp.float32)
  return SamplerWeights(jax.lax.stop_gradient(weight), truncated, share)


def sampler_weighted(advantages: Array, weight: Array) -> Array:
  """float32[R, L]: the advantages (float32[R] or [R, L]) times the TIS weight float32[R, L]."""
  if advantages.ndim == 1:
    advantages = advantages[:, None]
  return advantages * weight


def sampler_weight_stats(weights: SamplerWeights) -> dict[str, Array]:
  """`metrics.TIS`: the mean weight and the share truncated, over the weighting decisions
  (tokens, or segments at the sequence level)."""
  count = jnp.maximum(jnp.sum(weights.share), 1e-6)
  return {
    "tis_weight_mean": jnp.sum(weights.weight * weights.share) / count,
    "tis_truncated_share": jnp.sum(weights.truncated * weights.share) / count,
  }


def aggregation_denominator(mask: Array, agg: str) -> Array:
  """The denominator `losses.aggregate(., mask, agg)` divides its sum of row (or token) values
  by (before its max with 1).

  token-mean: the number of masked tokens; seq-mean-*: the number of rows with
  tokens. Used to weight micro-batches so that their gradients add up to the
  mini-batch's exactly. seq-mean-token-sum-norm's per-row constant C
  (`LearnerConfig.norm_length`, or L) is part of the row values, not of this count: it is
  the same in every micro-batch and chunk of a call (they all see the full width L,
  `shapes.prefix_logprobs`), so it cancels in the micro-batch shares.
  """
  if agg == "token-mean":
    return jnp.sum(mask)
  return jnp.sum(jnp.any(mask > 0, axis=-1).astype(jnp.float32))


def policy_loss(logp: Array, inputs: LossInputs, config: LearnerConfig) -> tuple[Array, dict]:
  """The algorithm's policy objective plus the KL penalty, on `inputs.mask`.

    loss "sequence_clip" (seeupo, gspo): losses.sequence_clip_loss (one ratio per row of the mask)
    loss "token_clip" (grpo, ppo):       losses.token_clip_loss
    loss "reinforce" (reinforce, rloo):  losses.reinforce_loss
    + kl_coef * aggregate(kl_penalty(logp, ref_logp, kl_kind), mask, agg, norm_length)
  (agg and norm_length: `LearnerConfig`'s; norm_length is C of "seq-mean-token-sum-norm").

  Args:
    logp: float32[R, L] log-probs at the params being optimised.
    inputs: `LossInputs`.
    config: the learner config.

  Returns:
    (scalar float32 loss, metrics: pg_loss, kl, clip_fraction, ratio_mean, approx_kl).
  """
  if inputs.old_logp is None:
    inputs = inputs._replace(old_logp=jax.lax.stop_gradient(logp))
  agg = dict(agg=config.agg, norm_length=config.norm_length)
  clip = dict(
    clip_low=config.clip_low, clip_high=config.clip_high, dual_clip=config.dual_clip, **agg
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
    pg, metrics = losses.reinforce_loss(logp, inputs.advantages, inputs.mask, **agg)
  if inputs.ref_logp is None:
    kl = jnp.zeros((), jnp.float32)
  else:
    kl = losses.aggregate(
      losses.kl_penalty(logp, inputs.ref_logp, config.kl_kind),
      inputs.mask,
      config.agg,
      norm_length=config.norm_length,
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
