"""`seeupo_jax.fields`: the one helper that declares and checks what config fields allow."""

import dataclasses
import math

import pytest

from seeupo_jax import fields
from seeupo_jax import learner
from seeupo_jax import rollout
from seeupo_jax import sampling
from seeupo_jax.envs import appworld
from seeupo_jax.envs import bfcl
from seeupo_jax.envs import synthetic
from seeupo_jax.models import config as model_config_lib
from seeupo_jax.rollout import workers
from seeupo_jax.training import config as config_lib


@dataclasses.dataclass(frozen=True)
class Example:
  count: int = fields.field(fields.int_at_least(1))
  share: float = fields.field(fields.number_in(0, 1, open_low=True), 0.5)
  mode: str = fields.field(fields.one_of(("a", "b")), "a")
  limit: int = fields.field(fields.optional(fields.int_at_least(2)), None)
  flag: bool = fields.field(fields.BOOL, False)
  free: str = "no check"

  def __post_init__(self):
    fields.check(self)


@pytest.mark.parametrize(
  "allowed,good,bad",
  [
    (fields.int_at_least(1), [1, 7], [0, -1, 1.0, True, "1", None]),
    (fields.int_in(1, 3), [1, 3], [0, 4, 2.0]),
    (fields.number_above(0), [1e-9, 3, 2.5], [0, -1.0, math.inf, math.nan, True]),
    (fields.number_at_least(0), [0, 0.0, 4], [-1e-9, math.nan, False]),
    (fields.number_in(0, 1), [0, 1, 0.5], [-0.1, 1.1, math.nan]),
    (fields.number_in(0, 1, open_low=True, open_high=True), [0.5], [0, 1]),
    (fields.one_of(("x", 1)), ["x", 1], ["y", 1.0, True]),
    (fields.optional(fields.BOOL), [None, True, False], [0, "True"]),
    (fields.tuple_of(fields.int_at_least(0)), [(), (0, 3)], [[0], (0, -1), (1.0,)]),
  ],
)
def test_each_allowed_accepts_exactly_what_it_says(allowed, good, bad):
  assert all(allowed.ok(v) for v in good), [v for v in good if not allowed.ok(v)]
  assert not any(allowed.ok(v) for v in bad), [v for v in bad if allowed.ok(v)]


def test_descriptions_are_the_words_of_the_message():
  assert fields.number_in(0, 1, open_low=True).description == "a number in (0, 1]"
  assert fields.number_in(0, 1, open_high=True).description == "a number in [0, 1)"
  assert fields.optional(fields.int_at_least(2)).description == "None or an int >= 2"
  assert fields.one_of(("a", "b")).description == "one of ['a', 'b']"
  assert fields.described(fields.int_at_least(0), "0: off").description == "an int >= 0 (0: off)"


def test_check_names_every_bad_field_in_field_order():
  Example(count=1)
  with pytest.raises(fields.FieldError) as error:
    Example(count=0, mode="c", flag=1)
  assert str(error.value) == (
    "Example.count=0; allowed: an int >= 1; Example.mode='c'; allowed: one of ['a', 'b']; "
    "Example.flag=1; allowed: True or False"
  )
  assert [p.name for p in error.value.problems] == ["count", "mode", "flag"]
  assert isinstance(error.value, ValueError)
  renamed = error.value.under("section")
  assert str(renamed).startswith("section.count=0; allowed: an int >= 1; section.mode=")
  assert str(fields.FieldError.of("X", "n", 3, "even")) == "X.n=3; allowed: even"
  assert fields.allowed_of(Example, "share").description == "a number in (0, 1]"
  with pytest.raises(KeyError, match="Example.free declares no Allowed"):
    fields.allowed_of(Example, "free")


CONFIG_CLASSES = [
  rollout.RolloutConfig,
  workers.WorkerConfig,
  sampling.SamplingConfig,
  sampling.SessionConfig,
  learner.LearnerConfig,
  model_config_lib.ModelConfig,
  synthetic.SyntheticConfig,
  bfcl.BfclConfig,
  appworld.AppWorldConfig,
  config_lib.ModelSection,
  config_lib.LoraSection,
  config_lib.RolloutSection,
  config_lib.OptimizerSection,
  config_lib.EvalSection,
  config_lib.CheckpointSection,
  config_lib.LogSection,
  config_lib.MeshSection,
  config_lib.PipelineSection,
]


@pytest.mark.parametrize("cls", CONFIG_CLASSES, ids=lambda c: c.__name__)
def test_every_config_field_declares_what_it_allows(cls):
  """One helper validates every config dataclass: each field declares its `Allowed`."""
  undeclared = [f.name for f in dataclasses.fields(cls) if fields.METADATA_KEY not in f.metadata]
  assert undeclared == []
