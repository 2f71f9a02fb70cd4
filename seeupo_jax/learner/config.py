"""`LearnerConfig`: the hyper-parameters of one learner, validated on construction.

Every algorithm of the paper's comparison runs in the same learner and is chosen
here by name; a bad value raises a `ValueError` that names the field and the
allowed values.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from seeupo_jax import losses

ALGORITHMS = ("seeupo", "grpo", "gspo", "reinforce", "rloo", "ppo")
"""seeupo: turn by turn (HAML), sequence-level clip, correction M.
grpo: token-level clipped loss on all turns at once, group std.
gspo: sequence-level clipped loss on all turns at once (one ratio per trajectory).
reinforce: on-policy policy gradient with GRAE advantages.
rloo: on-policy policy gradient with leave-one-out advantages.
ppo: token-level clipped loss with GAE from a separately trained critic."""

NORMALISATIONS = ("none", "group", "batch")

DEFAULT_NORMALISATION = {
  "seeupo": "batch",
  "grpo": "group",
  "gspo": "group",
  "reinforce": "none",
  "rloo": "none",
  "ppo": "batch",
}
"""The advantage normalisation each algorithm is defined with (`normalisation=None`)."""

SEQUENTIAL = ("seeupo",)
ON_POLICY = ("reinforce", "rloo")


def _bad(field: str, allowed: str, value) -> ValueError:
  return ValueError(f"LearnerConfig.{field} must be {allowed}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
  """Hyper-parameters of the learner (bound when `make_update` builds the step).

  Defaults are the authors' (Qwen3-14B runs): clip 0.2/0.2, correction clip
  0.2/0.2, KL `low_var_kl` with coefficient 0.002, one epoch and one mini-batch
  per turn, seq-mean-token-mean aggregation.

  Attributes:
    algorithm: one of `ALGORITHMS`.
    num_turns: T, the most turns a trajectory may have (static). Turn ids in
      the batch are in [0, T); turns that no row has cost nothing and change
      nothing.
    order: SeeUPO's update order, one of `losses.UPDATE_ORDERS` ("reverse" is
      the paper's; "random" draws a permutation per call from the key).
    custom_order: the permutation of 0..T-1 used when order == "custom".
    normalisation: advantage normalisation, one of `NORMALISATIONS`, or None
      for the algorithm's own (`DEFAULT_NORMALISATION`). "batch" whitens over
      the batch's valid rows (PPO: over generated tokens) and clamps to
      +-advantage_clip; "group" divides by the group std (GRPO/GSPO).
    correction: SeeUPO's HAML correction M (False: the ablation without it).
    epochs: optimisation epochs per turn (SeeUPO) or per call (the others).
    minibatches: mini-batches per epoch (rows reshuffled every epoch); each is
      one optimizer step.
    microbatches: each mini-batch's gradient is accumulated over this many
      micro-batches (memory only: the step is the same). Also the row chunk of
      the forward-only log-prob passes.
    clip_low, clip_high: the policy ratio clip (token ratio for grpo/ppo,
      sequence ratio for seeupo/gspo).
    dual_clip: optional dual-clip bound c > 1 for negative advantages.
    correction_clip_low, correction_clip_high: the clip of rho and M.
    advantage_clip: clamp after batch normalisation (None: no clamp).
    kl_coef: weight of the KL penalty to the reference params (0: off, and no
      reference forward pass is run).
    kl_kind: one of `losses.KL_KINDS`.
    agg: loss aggregation, one of `losses.AGGREGATION_MODES` (the KL term uses
      the same).
    gamma: discount. PPO: GAE's per-token discount. Critic-free algorithms: turn t
      of a trajectory with T_i turns gets advantage A * gamma^(T_i - 1 - t)
      (`objectives.turn_discounts`); 1 (the paper's) leaves A as it is.
    gae_lambda: PPO's GAE lambda.
    value_clip: PPO critic's value clip (None: unclipped).
  """

  algorithm: str = "seeupo"
  num_turns: int = 10
  order: str = "reverse"
  custom_order: tuple[int, ...] = ()
  normalisation: Optional[str] = None
  correction: bool = True
  epochs: int = 1
  minibatches: int = 1
  microbatches: int = 1
  clip_low: float = 0.2
  clip_high: float = 0.2
  dual_clip: Optional[float] = None
  correction_clip_low: float = 0.2
  correction_clip_high: float = 0.2
  advantage_clip: Optional[float] = 3.0
  kl_coef: float = 0.002
  kl_kind: str = "low_var_kl"
  agg: str = "seq-mean-token-mean"
  gamma: float = 1.0
  gae_lambda: float = 1.0
  value_clip: Optional[float] = 0.5

  def __post_init__(self):
    if self.algorithm not in ALGORITHMS:
      raise _bad("algorithm", f"one of {ALGORITHMS}", self.algorithm)
    for field in ("num_turns", "epochs", "minibatches", "microbatches"):
      value = getattr(self, field)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _bad(field, "an int >= 1", value)
    if self.order not in losses.UPDATE_ORDERS:
      raise _bad("order", f"one of {losses.UPDATE_ORDERS}", self.order)
    if self.order == "custom":
      if sorted(self.custom_order) != list(range(self.num_turns)):
        raise _bad(
          "custom_order",
          f"a permutation of 0..{self.num_turns - 1} (order='custom')",
          self.custom_order,
        )
    elif self.custom_order:
      raise _bad("custom_order", "empty unless order='custom'", self.custom_order)
    if self.algorithm not in SEQUENTIAL:
      if self.order != "reverse":
        raise _bad(
          "order", "'reverse' (the update order applies to algorithm='seeupo' only)", self.order
        )
      if not self.correction:
        raise _bad(
          "correction", "True (the correction applies to algorithm='seeupo' only)", self.correction
        )
    if self.algorithm in ON_POLICY and (self.epochs, self.minibatches) != (1, 1):
      raise ValueError(
        f"LearnerConfig.epochs and .minibatches must be 1 for algorithm={self.algorithm!r} "
        f"(on-policy policy gradient), got epochs={self.epochs}, minibatches={self.minibatches}"
      )
    if self.normalisation is not None and self.normalisation not in NORMALISATIONS:
      raise _bad("normalisation", f"None or one of {NORMALISATIONS}", self.normalisation)
    if self.algorithm == "rloo" and self.advantage_normalisation != "none":
      raise _bad("normalisation", "None or 'none' for algorithm='rloo'", self.normalisation)
    if self.algorithm == "ppo" and self.advantage_normalisation == "group":
      raise _bad("normalisation", "None, 'none' or 'batch' for algorithm='ppo'", self.normalisation)
    for field in ("clip_low", "clip_high", "correction_clip_low", "correction_clip_high"):
      value = getattr(self, field)
      if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise _bad(field, "a float in [0, 1)", value)
    if self.dual_clip is not None and not self.dual_clip > 1.0:
      raise _bad("dual_clip", "None or a float > 1", self.dual_clip)
    if self.advantage_clip is not None and not self.advantage_clip > 0:
      raise _bad("advantage_clip", "None or a float > 0", self.advantage_clip)
    if not (isinstance(self.kl_coef, (int, float)) and self.kl_coef >= 0):
      raise _bad("kl_coef", "a float >= 0", self.kl_coef)
    if self.kl_kind not in losses.KL_KINDS:
      raise _bad("kl_kind", f"one of {losses.KL_KINDS}", self.kl_kind)
    if self.agg not in losses.AGGREGATION_MODES:
      raise _bad("agg", f"one of {losses.AGGREGATION_MODES}", self.agg)
    if not 0.0 < self.gamma <= 1.0:
      raise _bad("gamma", "a float in (0, 1]", self.gamma)
    if not 0.0 <= self.gae_lambda <= 1.0:
      raise _bad("gae_lambda", "a float in [0, 1]", self.gae_lambda)
    if self.value_clip is not None and not self.value_clip > 0:
      raise _bad("value_clip", "None or a float > 0", self.value_clip)

  @property
  def advantage_normalisation(self) -> str:
    """The normalisation that runs: `normalisation`, or the algorithm's own."""
    return self.normalisation or DEFAULT_NORMALISATION[self.algorithm]

  @property
  def sequential(self) -> bool:
    """True for SeeUPO: turns are updated one at a time."""
    return self.algorithm in SEQUENTIAL

  def replace(self, **changes) -> "LearnerConfig":
    """A copy with `changes` applied (validated again)."""
    return dataclasses.replace(self, **changes)
