"""`LearnerConfig`: the hyper-parameters of one learner, validated on construction.

Every algorithm of the paper's comparison runs in the same learner and is chosen
here by name; a bad value raises a `fields.FieldError` (a ValueError) that names the field and
the allowed values.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from seeupo_jax import fields
from seeupo_jax import losses
from seeupo_jax.learner import algorithms

ALGORITHMS = tuple(algorithms.REGISTRY)
"""The algorithm names, one `algorithms.Algorithm` record each (`algorithms.REGISTRY`)."""

NORMALISATIONS = ("none", "group", "batch")

TIS_LEVELS = ("off", "token", "sequence")
"""`LearnerConfig.tis`: truncated importance sampling between the sampler and the learner."""

DEFAULT_NORMALISATION = {name: spec.normalisation for name, spec in algorithms.REGISTRY.items()}
"""The advantage normalisation each algorithm is defined with (`normalisation=None`)."""


_POSITIVE = fields.int_at_least(1)
_CLIP = fields.number_in(0, 1, open_high=True)


def _bad(field: str, allowed: str, value) -> fields.FieldError:
  """The refusal of a value that its field allows on its own but not with the others."""
  return fields.FieldError.of("LearnerConfig", field, value, allowed)


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
  """Hyper-parameters of the learner (bound when `make_update` builds the step).

  Defaults are the authors' (Qwen3-14B runs): clip 0.2/0.2, correction clip
  0.2/0.2, KL `low_var_kl` with coefficient 0.002, one epoch and one mini-batch
  per turn, seq-mean-token-mean aggregation.

  Attributes:
    algorithm: one of `ALGORITHMS`; its `algorithms.Algorithm` record is `spec`.
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
      sequence ratio for seeupo/gspo); clip_high None: the algorithm's
      (`algorithms.COMMON_DEFAULTS`, or its record's `defaults`).
    dual_clip: optional dual-clip bound c > 1 for negative advantages.
    correction_clip_low, correction_clip_high: the clip of rho and M.
    advantage_clip: clamp after batch normalisation (None: no clamp).
    kl_coef: weight of the KL penalty to the reference params (0: off, and no
      reference forward pass is run).
    kl_kind: one of `losses.KL_KINDS`.
    agg: loss aggregation, one of `losses.AGGREGATION_MODES` (the KL term uses
      the same); None: the algorithm's.
    norm_length: C, an int >= 1: the constant by which agg="seq-mean-token-sum-norm" (Dr. GRPO)
      divides each row's token sum, in the policy loss and the KL term (`losses.aggregate`);
      None: the batch's padded length L, which follows the batch's shape (the training program
      pads to the longest trajectory, so L changes between iterations and rescales the loss;
      it sets C to the run's generation budget instead, docs/learner.md). Only with that agg.
    gamma: discount. PPO: GAE's per-token discount. Critic-free algorithms: turn t
      of a trajectory with T_i turns gets advantage A * gamma^(T_i - 1 - t)
      (`objectives.turn_discounts`); 1 (the paper's) leaves A as it is.
    gae_lambda: PPO's GAE lambda.
    value_clip: PPO critic's value clip (None: unclipped).
    dynamic_sampling: DAPO's dynamic sampling inside the update: the rows of groups whose
      rewards are all equal (no signal) are dropped, counted in `groups_dropped` and
      `rows_dropped`; None: the algorithm's (on for dapo). Group-relative algorithms only.
      (The training program can also draw more tasks to refill the batch.)
    overlong_max_tokens, overlong_cache_tokens: DAPO's overlong reward shaping, for any
      algorithm; None: off. A trajectory with |y| generated tokens (all turns) gets
      R + 0 if |y| <= L_max - L_cache, R + ((L_max - L_cache) - |y|) / L_cache if
      L_max - L_cache < |y| <= L_max, R - 1 beyond (`objectives.overlong_penalty`).
    tis: the sampler-mismatch correction, one of `TIS_LEVELS`, any algorithm ("off", the
      default: none). Each token's policy loss is weighted by w = min(pi_old / pi_sampler,
      tis_cap), pi_sampler from `Batch.sample_logp`, pi_old the learner's own log-probs at
      the params the update starts from; per token ("token") or one geometric-mean weight
      per sequence ("sequence": the row's generated tokens; SeeUPO: the turn's)
      (`objectives.sampler_weights`).
    tis_cap: C >= 1, the truncation of the TIS weight.
    turn_buckets: K, SeeUPO only: each turn's passes run on the rows that have the turn (in
      chunks of 1/K of a micro-batch; chunks without such rows are skipped) and on the prefix
      that ends with the turn's last token (and the pending turn's, whose M factor the pass
      gives), rounded up to one of K static lengths ceil(k L / K); 1: every turn runs on the
      whole batch at full length. The update is the same to float rounding; compile time
      grows with K (K length programs), not with num_turns (docs/learner.md, "Cost").
    dapo_max_refills: with `dynamic_sampling`, the training program's extra rollouts per
      iteration to replace the groups whose rewards are all equal (0: none); the update
      does not read it.
    step_weight: GiGPO's omega, the weight of the step-level (anchor-state) advantage; None:
      1.0 (the paper's). GiGPO only. GiGPO discounts the step returns by `gamma` (the paper's
      0.95; our default 1).
    outcome_weight: MT-GRPO's lambda, the weight of the outcome advantage beside the turn
      rewards'; None: 1.0 (the paper's). MT-GRPO only.
  """

  algorithm: str = fields.field(fields.one_of(ALGORITHMS), "seeupo")
  num_turns: int = fields.field(_POSITIVE, 10)
  order: str = fields.field(fields.one_of(losses.UPDATE_ORDERS), "reverse")
  custom_order: tuple[int, ...] = fields.field(fields.tuple_of(fields.int_at_least(0)), ())
  normalisation: Optional[str] = fields.field(fields.optional(fields.one_of(NORMALISATIONS)), None)
  correction: bool = fields.field(fields.BOOL, True)
  epochs: int = fields.field(_POSITIVE, 1)
  minibatches: int = fields.field(_POSITIVE, 1)
  microbatches: int = fields.field(_POSITIVE, 1)
  clip_low: float = fields.field(_CLIP, 0.2)
  clip_high: Optional[float] = fields.field(fields.optional(_CLIP), None)
  dual_clip: Optional[float] = fields.field(fields.optional(fields.number_above(1)), None)
  correction_clip_low: float = fields.field(_CLIP, 0.2)
  correction_clip_high: float = fields.field(_CLIP, 0.2)
  advantage_clip: Optional[float] = fields.field(fields.optional(fields.number_above(0)), 3.0)
  kl_coef: float = fields.field(fields.number_at_least(0), 0.002)
  kl_kind: str = fields.field(fields.one_of(losses.KL_KINDS), "low_var_kl")
  agg: Optional[str] = fields.field(fields.optional(fields.one_of(losses.AGGREGATION_MODES)), None)
  norm_length: Optional[int] = fields.field(fields.optional(_POSITIVE), None)
  gamma: float = fields.field(fields.number_in(0, 1, open_low=True), 1.0)
  gae_lambda: float = fields.field(fields.number_in(0, 1), 1.0)
  value_clip: Optional[float] = fields.field(fields.optional(fields.number_above(0)), 0.5)
  dynamic_sampling: Optional[bool] = fields.field(fields.optional(fields.BOOL), None)
  overlong_max_tokens: Optional[int] = fields.field(fields.optional(_POSITIVE), None)
  overlong_cache_tokens: int = fields.field(fields.int_at_least(0), 0)
  tis: str = fields.field(fields.one_of(TIS_LEVELS), "off")
  tis_cap: float = fields.field(
    fields.described(fields.number_at_least(1), "C in min(pi_old / pi_sampler, C)"), 2.0
  )
  turn_buckets: int = fields.field(_POSITIVE, 4)
  dapo_max_refills: int = fields.field(fields.int_at_least(0), 3)
  step_weight: Optional[float] = fields.field(fields.optional(fields.number_at_least(0)), None)
  outcome_weight: Optional[float] = fields.field(fields.optional(fields.number_at_least(0)), None)

  def __post_init__(self):
    fields.check(self)  # each field on its own; then what involves the algorithm or other fields
    spec = algorithms.get(self.algorithm)
    defaulted = []
    for field, default in algorithms.COMMON_DEFAULTS.items():
      if getattr(self, field) is None:
        object.__setattr__(self, field, spec.defaults.get(field, default))
        defaulted.append(field)
    # Not a field: the fields left None that took the algorithm's default (`replace` resets them).
    object.__setattr__(self, "_defaulted", tuple(defaulted))
    if self.order == "custom":
      if sorted(self.custom_order) != list(range(self.num_turns)):
        raise _bad(
          "custom_order",
          f"a permutation of 0..{self.num_turns - 1} (order='custom')",
          self.custom_order,
        )
    elif self.custom_order:
      raise _bad("custom_order", "empty unless order='custom'", self.custom_order)
    if not spec.sequential:
      if self.order != "reverse":
        raise _bad(
          "order", "'reverse' (the update order applies to algorithm='seeupo' only)", self.order
        )
      if not self.correction:
        raise _bad(
          "correction", "True (the correction applies to algorithm='seeupo' only)", self.correction
        )
    if spec.on_policy:
      for field in ("epochs", "minibatches"):
        if getattr(self, field) != 1:
          raise _bad(
            field,
            f"1 for algorithm={self.algorithm!r} (on-policy policy gradient)",
            getattr(self, field),
          )
    if self.advantage_normalisation not in spec.normalisations:
      allowed = ", ".join(repr(n) for n in spec.normalisations)
      raise _bad(
        "normalisation", f"None, {allowed} for algorithm={self.algorithm!r}", self.normalisation
      )
    if self.norm_length is not None and self.agg != "seq-mean-token-sum-norm":
      raise _bad(
        "norm_length",
        f"None unless agg='seq-mean-token-sum-norm' (agg is {self.agg!r})",
        self.norm_length,
      )
    if self.dynamic_sampling and "dynamic_sampling" not in spec.options:
      raise _bad(
        "dynamic_sampling",
        f"False for algorithm={self.algorithm!r} (it applies to group-relative advantages only)",
        self.dynamic_sampling,
      )
    for field, group in (
      ("step_weight", algorithms.GIGPO_OPTIONS),
      ("outcome_weight", algorithms.MT_GRPO_OPTIONS),
    ):
      if getattr(self, field) is not None and field not in spec.options:
        owner = "gigpo" if group is algorithms.GIGPO_OPTIONS else "mt_grpo"
        raise _bad(field, f"None unless algorithm={owner!r}", getattr(self, field))
    if self.overlong_max_tokens is not None:
      if self.overlong_cache_tokens > self.overlong_max_tokens:
        raise _bad(
          "overlong_cache_tokens", "an int in [0, overlong_max_tokens]", self.overlong_cache_tokens
        )
    elif self.overlong_cache_tokens:
      raise _bad(
        "overlong_cache_tokens", "0 unless overlong_max_tokens is set", self.overlong_cache_tokens
      )

  @property
  def spec(self) -> algorithms.Algorithm:
    """The algorithm's record: how it computes advantages, its loss, its options."""
    return algorithms.REGISTRY[self.algorithm]

  @property
  def advantage_normalisation(self) -> str:
    """The normalisation that runs: `normalisation`, or the algorithm's own."""
    return self.normalisation or self.spec.normalisation

  @property
  def sequential(self) -> bool:
    """True for SeeUPO: turns are updated one at a time."""
    return self.spec.sequential

  def replace(self, **changes) -> "LearnerConfig":
    """A copy with `changes` applied (validated again); fields that took the algorithm's
    default take the new algorithm's unless `changes` sets them."""
    reset = {field: None for field in self._defaulted if field not in changes}
    return dataclasses.replace(self, **{**reset, **changes})
