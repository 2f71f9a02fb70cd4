"""Environments, chosen by name from a fixed registry (never imported from a config string).

    from seeupo_jax import envs
    spec = envs.make_spec("synthetic", {"num_dials": 3})
    env = spec.make(); reset = env.reset(spec.task_ids("train")[0])

See `base.py` for the protocol every environment follows.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from seeupo_jax.envs import appworld
from seeupo_jax.envs import synthetic
from seeupo_jax.envs.base import (
  EnvSpec,
  Environment,
  EnvironmentUnavailable,
  Message,
  Reset,
  Score,
  Step,
)


def _synthetic(options: Mapping[str, Any]) -> EnvSpec:
  return synthetic.spec(synthetic.SyntheticConfig(**options))


def _bfcl_module():
  from seeupo_jax.envs import bfcl  # noqa: PLC0415  (reads the bfcl-eval package on use)

  return bfcl


def _bfcl(options: Mapping[str, Any]) -> EnvSpec:
  bfcl = _bfcl_module()
  return bfcl.spec(bfcl.BfclConfig(**options))


REGISTRY: dict[str, Callable[[Mapping[str, Any]], EnvSpec]] = {
  "synthetic": _synthetic,
  "bfcl": _bfcl,
  "appworld": appworld.make_spec,
}


_OPTIONS: dict[str, Callable[[], type]] = {
  "synthetic": lambda: synthetic.SyntheticConfig,
  "bfcl": lambda: _bfcl_module().BfclConfig,
  "appworld": lambda: appworld.AppWorldConfig,
}
"""Each environment's options dataclass (its fields declared and checked with `seeupo_jax.fields`)."""


def options_class(name: str) -> type:
  """The dataclass of environment `name`'s options (`SyntheticConfig`, `BfclConfig`, ...).

  Raises:
    ValueError: unknown name (the message lists the registered ones).
  """
  if name not in _OPTIONS:
    raise ValueError(f"unknown environment {name!r}; allowed: {sorted(REGISTRY)}")
  return _OPTIONS[name]()


def check_options(name: str, options: Mapping[str, Any]) -> None:
  """Checks environment `name`'s options against its dataclass, without building anything.

  Raises:
    ValueError: an unknown environment or option (naming the known ones).
    seeupo_jax.fields.FieldError: a refused value, named as the options' field.
  """
  cls = options_class(name)
  known = [f.name for f in dataclasses.fields(cls)]
  unknown = sorted(set(options) - set(known))
  if unknown:
    raise ValueError(f"{unknown[0]}: unknown option of environment {name!r}; known: {known}")
  cls(**options)


# Environments whose instances live on servers: each process of a multi-process run gets its
# own (`appworld.options_for_process`). The others run in each process as they are.
_PER_PROCESS: dict[str, Callable[..., dict]] = {"appworld": appworld.options_for_process}


def process_options(
  name: str, options: Mapping[str, Any], index: int, count: int, local_index: int
) -> dict:
  """The options of environment `name` for process `index` of `count` (`local_index`: its rank
  on its host); the options as they are for one process or an environment without servers.

  Raises:
    ValueError: options that cannot be split between the processes.
  """
  options = dict(options)
  if count == 1 or name not in _PER_PROCESS:
    return options
  return _PER_PROCESS[name](options, index, count, local_index)


def make_spec(name: str, options: Mapping[str, Any] | None = None) -> EnvSpec:
  """The `EnvSpec` of environment `name` with its `options` (the config's `env.<name>` section).

  Raises:
    ValueError: unknown name (the message lists the registered ones) or bad options.
    EnvironmentUnavailable: a registered environment that cannot run here.
  """
  if name not in REGISTRY:
    raise ValueError(f"unknown environment {name!r}; allowed: {sorted(REGISTRY)}")
  options = dict(options or {})
  try:
    return REGISTRY[name](options)
  except TypeError as e:  # an unknown option
    raise ValueError(f"bad options for environment {name!r}: {e}") from None


__all__ = [
  "EnvSpec",
  "Environment",
  "EnvironmentUnavailable",
  "Message",
  "REGISTRY",
  "Reset",
  "Score",
  "Step",
  "check_options",
  "make_spec",
  "options_class",
  "process_options",
]
