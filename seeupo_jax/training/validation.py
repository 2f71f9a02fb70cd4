"""The numeric ranges of a training config, checked before anything is built or started.

    validation.check(config)   # ConfigError: "rollout.tasks_per_iteration=0; allowed: an int >= 1"

The config's own dataclasses check their fields when `trainer.build` makes them (RolloutConfig,
SamplingConfig, LearnerConfig, the mesh, the model preset); `RANGES` covers the keys that the
trainer reads directly, where a bad value would otherwise surface late and far from its cause
(`rollout.tasks_per_iteration=0` as an environment's "capacity 0") or not at all (a negative
learning rate trains, uphill).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import ml_collections


class ConfigError(ValueError):
  """A bad config value; the message names the key and the allowed values."""


@dataclasses.dataclass(frozen=True)
class Range:
  """What one config key allows: `ok(value)` and its description for the message."""

  ok: Callable[[Any], bool]
  allowed: str


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def int_at_least(low: int) -> Range:
  return Range(lambda v: _is_int(v) and v >= low, f"an int >= {low}")


def number_above(low: float) -> Range:
  return Range(lambda v: _is_number(v) and v > low, f"a finite number > {low:g}")


def number_at_least(low: float) -> Range:
  return Range(lambda v: _is_number(v) and v >= low, f"a finite number >= {low:g}")


BOOL = Range(lambda v: isinstance(v, bool), "True or False")

RANGES: dict[str, Range] = {
  "seed": int_at_least(0),
  "num_iterations": int_at_least(1),
  "save_hf": BOOL,
  "eval_only": BOOL,
  "rollout.tasks_per_iteration": int_at_least(1),
  "rollout.samples_per_task": int_at_least(1),
  "rollout.max_reply_tokens": int_at_least(1),
  "rollout.decode_tensor_parallel": int_at_least(0),
  "optimizer.learning_rate": number_above(0),
  "optimizer.weight_decay": number_at_least(0),
  "optimizer.max_grad_norm": number_above(0),
  "optimizer.warmup_steps": int_at_least(0),
  "optimizer.master_weights": BOOL,
  "eval.every": int_at_least(0),
  "eval.num_tasks": int_at_least(1),
  "eval.k": int_at_least(1),
  "eval.tasks_per_call": int_at_least(1),
  "eval.greedy": BOOL,
  "checkpoint.every": int_at_least(1),
  "checkpoint.keep": int_at_least(1),
  "log.trajectories": int_at_least(0),
  "log.tensorboard": BOOL,
  "log.progress_bar": BOOL,
  "log.plot": BOOL,
}
"""Dotted key -> what it allows. A key the config lacks is not checked."""


_MISSING = object()


def _get(config: ml_collections.ConfigDict, key: str) -> Any:
  node = config
  for part in key.split("."):
    if not isinstance(node, (ml_collections.ConfigDict, dict)) or part not in node:
      return _MISSING
    node = node[part]
  return node


def _batch_split(config: ml_collections.ConfigDict) -> list[str]:
  """The batch's B x n rows must split into learner.minibatches x learner.microbatches parts
  (else the first update fails, mid-run)."""
  keys = (
    "rollout.tasks_per_iteration",
    "rollout.samples_per_task",
    "learner.minibatches",
    "learner.microbatches",
  )
  tasks, samples, minibatches, microbatches = (_get(config, key) for key in keys)
  if not all(_is_int(v) and v >= 1 for v in (tasks, samples, minibatches, microbatches)):
    return []  # absent, or refused elsewhere (LearnerConfig checks its own fields)
  if (tasks * samples) % (minibatches * microbatches) == 0:
    return []
  return [
    f"rollout.tasks_per_iteration x rollout.samples_per_task = {tasks} x {samples} rows per "
    f"batch, which learner.minibatches x learner.microbatches = {minibatches} x {microbatches} "
    "must divide"
  ]


def check(config: ml_collections.ConfigDict) -> None:
  """Raises ConfigError naming every key of `RANGES` whose value is out of its range.

  Args:
    config: a training config (`experiments/configs/base.py`'s shape), with overrides applied.
  """
  bad = []
  for key, allowed in RANGES.items():
    value = _get(config, key)
    if value is not _MISSING and not allowed.ok(value):
      bad.append(f"{key}={value!r}; allowed: {allowed.allowed}")
  if not bad:
    bad += _batch_split(config)
  if bad:
    raise ConfigError("; ".join(bad))
