"""The registry of algorithms: one record per algorithm, looked up once.

Everything the learner does differently for an algorithm is read from its
`Algorithm` record: how advantages are computed, which loss, whether turns are
updated one at a time, whether a critic is trained, the defaults it is defined
with and the options that apply to it. Adding an algorithm is one record here
plus its tests (`tests/learner/test_learner_reference.py` runs every record against the
NumPy reference).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Mapping

ADVANTAGES = ("grae", "rloo", "gae", "gigpo", "mt_grpo")
"""grae: R - group mean, then the configured normalisation (`losses.grae_advantages`).
rloo: leave-one-out baseline (`losses.rloo_advantages`).
gae: GAE from a separately trained critic, over generated tokens (`losses.gae_advantages`).
gigpo: per turn, the episode's group-relative advantage plus one over the turns of the group
  that start from the same environment state (`losses.gigpo_advantages`; `Batch.turn_states`).
mt_grpo: per turn, group-normalised turn rewards to go plus the outcome's group-relative
  advantage (`losses.mt_grpo_advantages`; `Batch.turn_rewards`)."""

TURN_INPUTS = {
  "gigpo": ("turn_states", "a state key"),
  "mt_grpo": ("turn_rewards", "a reward"),
}
"""The advantages given per turn ([N, T]), from what the environment reports per turn: the
`Batch` field each reads (and the `EnvSpec` flag of the same name that says an environment
reports it), and what that field holds per turn, for messages."""

TURN_LEVEL = tuple(TURN_INPUTS)
"""The advantages given per turn ([N, T])."""

LOSSES = ("sequence_clip", "token_clip", "reinforce")
"""sequence_clip: `losses.sequence_clip_loss` (one ratio per row of the mask, GSPO).
token_clip: `losses.token_clip_loss` (PPO's token ratio).
reinforce: `losses.reinforce_loss` (on-policy policy gradient)."""

SEQUENTIAL_OPTIONS = ("order", "custom_order", "correction")
"""The options of the sequential (HAML) update: they apply to sequential algorithms only."""

GIGPO_OPTIONS = ("step_weight",)
"""GiGPO's weight of the step-level (anchor-state) term."""

MT_GRPO_OPTIONS = ("outcome_weight",)
"""MT-GRPO's weight of the outcome term."""

DYNAMIC_SAMPLING_OPTIONS = ("dynamic_sampling",)
"""DAPO's dynamic sampling, in the update: the rows of groups whose rewards are all equal are
dropped (they count nowhere). It applies to group-relative advantages only."""


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """One algorithm of the comparison (static; selected by `LearnerConfig.algorithm`).

  Attributes:
    name: the `LearnerConfig.algorithm` value.
    summary: one line, for docs and error messages.
    advantage: one of `ADVANTAGES`.
    loss: one of `LOSSES`.
    normalisation: the advantage normalisation it is defined with (`normalisation=None`).
    normalisations: the normalisations it accepts.
    sequential: True: turns are updated one at a time, each weighted by the HAML factor M
      (SeeUPO); False: one optimisation on all turns at once.
    critic: True: trains a critic (make_update's value_fn, init_state's critic_params).
    on_policy: True: one epoch of one mini-batch only (no ratio, so no clip).
    defaults: `LearnerConfig` fields whose default differs for this algorithm (the field's
      declared default is None, meaning "the algorithm's").
    options: option groups that apply to it beyond the common ones (`SEQUENTIAL_OPTIONS`,
      `DYNAMIC_SAMPLING_OPTIONS`); setting one elsewhere is refused, never ignored.
  """

  name: str
  summary: str
  advantage: str
  loss: str
  normalisation: str
  normalisations: tuple[str, ...] = ("none", "group", "batch")
  sequential: bool = False
  critic: bool = False
  on_policy: bool = False
  defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  options: tuple[str, ...] = ()

  def __post_init__(self):
    assert self.advantage in ADVANTAGES, self.advantage
    assert self.loss in LOSSES, self.loss
    assert self.normalisation in self.normalisations, self.normalisation
    object.__setattr__(self, "defaults", types.MappingProxyType(dict(self.defaults)))


COMMON_DEFAULTS = types.MappingProxyType(
  {"clip_high": 0.2, "agg": "seq-mean-token-mean", "dynamic_sampling": False}
)
"""The defaults of the fields an algorithm may redefine (`Algorithm.defaults`)."""

_RECORDS = (
  Algorithm(
    "seeupo",
    "turn by turn (HAML, reverse order), sequence-level clip on the turn, advantage A * M",
    advantage="grae",
    loss="sequence_clip",
    normalisation="batch",
    sequential=True,
    options=SEQUENTIAL_OPTIONS + DYNAMIC_SAMPLING_OPTIONS,
  ),
  Algorithm(
    "grpo",
    "token-level clipped loss on all turns at once, group std",
    advantage="grae",
    loss="token_clip",
    normalisation="group",
    options=DYNAMIC_SAMPLING_OPTIONS,
  ),
  Algorithm(
    "gspo",
    "sequence-level clipped loss on all turns at once (one ratio per trajectory)",
    advantage="grae",
    loss="sequence_clip",
    normalisation="group",
    options=DYNAMIC_SAMPLING_OPTIONS,
  ),
  Algorithm(
    "reinforce",
    "on-policy policy gradient with GRAE advantages",
    advantage="grae",
    loss="reinforce",
    normalisation="none",
    on_policy=True,
    options=DYNAMIC_SAMPLING_OPTIONS,
  ),
  Algorithm(
    "rloo",
    "on-policy policy gradient with leave-one-out advantages",
    advantage="rloo",
    loss="reinforce",
    normalisation="none",
    normalisations=("none",),
    on_policy=True,
    options=DYNAMIC_SAMPLING_OPTIONS,
  ),
  Algorithm(
    "ppo",
    "token-level clipped loss with GAE from a separately trained critic",
    advantage="gae",
    loss="token_clip",
    normalisation="batch",
    normalisations=("none", "batch"),
    critic=True,
  ),
  Algorithm(
    "dr_grpo",
    "GRPO done right: token-level clip, no group std, no per-sequence length normalisation",
    advantage="grae",
    loss="token_clip",
    normalisation="none",
    defaults={"agg": "seq-mean-token-sum-norm"},
    options=DYNAMIC_SAMPLING_OPTIONS,
  ),
  Algorithm(
    "gspo_token",
    "GSPO-token: the sequence ratio sg(s_i) pi/sg(pi) on each token, token advantages A_it",
    advantage="grae",
    loss="sequence_clip",
    normalisation="group",
    options=DYNAMIC_SAMPLING_OPTIONS,
  ),
  Algorithm(
    "dapo",
    "decoupled clip 0.2/0.28, token-mean aggregation, dynamic sampling, group std",
    advantage="grae",
    loss="token_clip",
    normalisation="group",
    defaults={"clip_high": 0.28, "agg": "token-mean", "dynamic_sampling": True},
    options=DYNAMIC_SAMPLING_OPTIONS,
  ),
  Algorithm(
    "gigpo",
    "GiGPO: token-level clip; per turn, the episode's group advantage + the anchor state's",
    advantage="gigpo",
    loss="token_clip",
    normalisation="group",
    normalisations=("none", "group"),
    options=GIGPO_OPTIONS,
  ),
  Algorithm(
    "mt_grpo",
    "MT-GRPO: token-level clip; per turn, the group-normalised turn rewards to go + the outcome's",
    advantage="mt_grpo",
    loss="token_clip",
    normalisation="group",
    normalisations=("none", "group"),
    options=MT_GRPO_OPTIONS,
  ),
)

REGISTRY: Mapping[str, Algorithm] = types.MappingProxyType({a.name: a for a in _RECORDS})
"""name -> `Algorithm`, in the order of the paper's comparison."""


def get(name: str) -> Algorithm:
  """The record of `name`; an unknown name lists the allowed ones."""
  if name not in REGISTRY:
    raise ValueError(f"LearnerConfig.algorithm must be one of {tuple(REGISTRY)}, got {name!r}")
  return REGISTRY[name]
