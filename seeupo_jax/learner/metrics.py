"""The names of the learner's metrics: one list, read by the update, its tests and its docs.

Every metric is a float32 array. Scalars for every algorithm; SeeUPO also returns each
per-turn metric as float32[T] under "turn/<name>", indexed by turn id.
"""

from __future__ import annotations

LOSS = (
  "loss",  # the objective the step minimised (policy + kl_coef * KL)
  "pg_loss",  # the policy term
  "kl",  # KL(pi || pi_ref), aggregated like the loss
  "clip_fraction",  # share of tokens (token clip) or rows (sequence clip) on the clipped branch
  "ratio_mean",  # mean ratio (token, or sequence)
  "approx_kl",  # k3 of the policy's move
  "value_loss",  # PPO's critic regression (0 elsewhere)
  "value_error",  # PPO: token-mean |V - R|
)
"""Per optimizer step, from the loss; reported as means over the steps that ran."""

STEP = LOSS + ("grad_norm",)
"""Per optimizer step (`update.StepStats`): the loss's and the gradient's global norm before
clipping; reported as means over the steps that ran."""

COUNTS = ("optimizer_steps", "skipped_updates")
"""Optimizer steps this call took, and steps skipped for a non-finite loss or gradient."""

GAP = ("sample_logp_gap_mean", "sample_logp_gap_max")
"""|sampler log-prob - learner log-prob| over generated tokens at the starting params."""

BATCH = ("advantage_abs_mean", "generated_tokens")
"""Of the batch: mean |advantage| over generated tokens, and their number."""

CORRECTION = ("M_mean", "M_min", "M_max", "M_clipped")
"""SeeUPO: the M each turn was weighted with, over the rows that have the turn."""

TURN = STEP + COUNTS + CORRECTION + ("trajectories",)
"""SeeUPO: per turn, "turn/<name>" float32[T] by turn id (`trajectories`: rows with the turn)."""

SEQUENTIAL = ("turns_updated",)
"""SeeUPO: the number of turns some row has."""

DYNAMIC_SAMPLING = ("groups_dropped", "rows_dropped")
"""With `dynamic_sampling`: groups whose rewards were all equal, and their valid rows."""

OVERLONG = ("overlong_penalty_mean",)
"""With `overlong_max_tokens`: the mean overlong penalty over valid rows."""

TIS = ("tis_weight_mean", "tis_truncated_share")
"""With `tis` on: the mean TIS weight min(pi_old / pi_sampler, C) and the share of weights
truncated at C, over the generated tokens ("token") or sequences ("sequence"; SeeUPO: the
(trajectory, turn) pairs), at the update's starting params."""


def scalar_names(config) -> tuple[str, ...]:
  """The scalar metrics an update with `config` (a `LearnerConfig`) returns."""
  names = STEP + COUNTS + GAP + BATCH
  if config.spec.sequential:
    names += CORRECTION + ("trajectories",) + SEQUENTIAL
  if config.dynamic_sampling:
    names += DYNAMIC_SAMPLING
  if config.overlong_max_tokens is not None:
    names += OVERLONG
  if config.tis != "off":
    names += TIS
  return names


def names(config) -> tuple[str, ...]:
  """Every metric an update with `config` returns (scalars, then SeeUPO's per-turn arrays)."""
  per_turn = tuple(f"turn/{name}" for name in TURN) if config.spec.sequential else ()
  return scalar_names(config) + per_turn
