"""What a checkpoint records of its run besides the arrays, and the checks a resume makes
against it: the tree manifest (every leaf's path, shape and dtype) and the config.

    manifest = tree_manifest(state)          # [{"path": ..., "dtype": ..., "shape": [...]}, ...]
    check_manifest(manifest, abstract_of(state), "checkpoint 25")   # ValueError on a mismatch
    check_config(saved_config, config, defaults=defaults)           # ValueError naming each key

Used by `checkpoints.Checkpointer`, which writes both with every save.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Optional, Sequence

import jax
import numpy as np

from seeupo_jax import learner

PyTree = Any

DEFAULT_ALLOWED_TO_DIFFER = ("num_iterations", "eval", "log", "checkpoint")
"""Top-level config sections (dotted prefixes) that may change when a run resumes."""

MANIFEST_FORMAT = 1


# ----------------------------------------------------------------------------------------------
# Describing trees: the manifest stored with each checkpoint.


def abstract_of(tree: PyTree) -> PyTree:
  """`jax.ShapeDtypeStruct` of every array leaf, with its sharding (None for NumPy arrays).

  Args:
    tree: a pytree of jax arrays (e.g. a freshly initialised `TrainState` or a PRNG key), or of
      ShapeDtypeStructs.

  Returns:
    The same tree of `jax.ShapeDtypeStruct(shape, dtype, sharding=...)`: a restore target that
    puts every restored array on the sharding of the matching leaf of `tree`. A learner
    `TrainState` keeps its frozen `base` as it is (checkpoints never hold it: the restored state
    carries the target's base, `Checkpointer.restore_latest`).
  """
  if isinstance(tree, learner.TrainState):
    return learner.with_base(abstract_of(learner.without_base(tree)), tree.base)
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree
  )


def _path_name(path) -> str:
  """'opt_state/1/0/mu/layers/attn/q_proj/kernel' from a jax tree path."""
  return jax.tree_util.keystr(path, simple=True, separator="/")


def describe(dtype, shape) -> str:
  return f"{dtype}[{', '.join(str(d) for d in shape)}]"


def tree_manifest(tree: PyTree) -> list[dict[str, Any]]:
  """[{"path": str, "dtype": str, "shape": [int, ...]}] of the leaves of `tree`, in flatten order.

  Args:
    tree: a pytree of arrays or ShapeDtypeStructs (None subtrees have no leaves).
  """
  return [
    {"path": _path_name(path), "dtype": str(leaf.dtype), "shape": [int(d) for d in leaf.shape]}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
  ]


def is_typed_key(x) -> bool:
  return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def rng_manifest(rng) -> dict[str, Any]:
  """{"dtype": "key<fry>" or "uint32", "shape": [...]} of a typed or raw PRNG key (or its abstract)."""
  return {"dtype": str(rng.dtype), "shape": [int(d) for d in rng.shape]}


def check_manifest(saved: Sequence[Mapping[str, Any]], target: PyTree, where: str) -> None:
  """Raises ValueError unless `target`'s leaves have the saved paths, shapes and dtypes.

  Args:
    saved: `tree_manifest` of the tree that was saved.
    target: the tree to restore into (arrays or ShapeDtypeStructs).
    where: the checkpoint, for the message.

  Raises:
    ValueError: naming the first leaf (in the target's flatten order, then the checkpoint's extra
      leaves) that is missing on one side or differs in shape or dtype.
  """
  wanted = tree_manifest(target)
  saved_by_path = {entry["path"]: entry for entry in saved}
  wanted_by_path = {entry["path"]: entry for entry in wanted}
  order = [e["path"] for e in wanted] + [
    e["path"] for e in saved if e["path"] not in wanted_by_path
  ]

  def leaf(entry):
    return "nothing" if entry is None else describe(entry["dtype"], entry["shape"])

  differing = []
  for path in order:
    old, new = saved_by_path.get(path), wanted_by_path.get(path)
    if old is None or new is None or (old["dtype"], old["shape"]) != (new["dtype"], new["shape"]):
      differing.append((path, old, new))
  if differing:
    path, old, new = differing[0]
    raise ValueError(
      f"checkpoint {where} does not fit the train state to restore into "
      f"({len(differing)} of {len(order)} leaves differ); first difference at {path!r}: the "
      f"checkpoint has {leaf(old)}, the target has {leaf(new)}. The model or learner "
      "config has probably changed while the workdir was reused: restore the old config or "
      "start in a new workdir"
    )


# ----------------------------------------------------------------------------------------------
# Configs.


def _json_default(value: Any) -> Any:
  """NumPy/jax scalars (and 0-d arrays) as Python numbers; anything else is an error."""
  if isinstance(value, (np.generic, np.ndarray, jax.Array)) and np.ndim(value) == 0:
    return np.asarray(value).item()
  raise TypeError(f"{type(value).__name__} {value!r} is not JSON-serialisable")


def jsonable(value: Any, what: str) -> Any:
  """`value` after a JSON round trip (tuples become lists, a ConfigDict a dict, NumPy and jax
  scalars Python numbers)."""
  if hasattr(value, "to_dict"):
    value = value.to_dict()
  try:
    return json.loads(json.dumps(value, default=_json_default))
  except (TypeError, ValueError) as e:
    raise ValueError(f"{what} must be JSON-serialisable: {e}") from e


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """{"learner.kl_coef": 0.0, ...}: nested mappings flattened to dotted keys (lists are values)."""
  flat = {}
  for key, value in config.items():
    name = f"{prefix}{key}"
    if isinstance(value, Mapping) and value:
      flat.update(flatten_config(value, name + "."))
    else:
      flat[name] = value
  return flat


def _allowed(key: str, allowed_to_differ: Sequence[str]) -> bool:
  return any(key == a or key.startswith(a + ".") for a in allowed_to_differ)


def check_config(
  saved: Mapping[str, Any],
  current: Mapping[str, Any],
  allowed_to_differ: Sequence[str] = DEFAULT_ALLOWED_TO_DIFFER,
  defaults: Optional[Mapping[str, Any]] = None,
  moved: Optional[Mapping[str, str]] = None,
) -> None:
  """Raises ValueError if a resumed run's config differs from the checkpoint's.

  Args:
    saved: the config stored with the checkpoint (a JSON-able nested dict).
    current: the config of the run that resumes (nested dict or ConfigDict); compared after a
      JSON round trip, so a tuple equals the list it was saved as.
    allowed_to_differ: dotted keys or prefixes that may change ("eval" allows "eval.every", ...).
    defaults: the config's defaults (nested dict or ConfigDict), e.g. the config file's
      `get_config()` before overrides. A key absent from the checkpoint (one added to the
      config after the checkpoint was written) whose current value equals its default counts
      as unchanged: the old run behaved as the default does. None: every absent key differs.
    moved: dotted key -> the key that holds its value since (a value given one name, e.g.
      "env.max_turns" -> "rollout.max_turns"): a saved key that the config no longer has counts
      as unchanged while its saved value equals the current value of the key it moved to.

  Raises:
    ValueError: listing every other dotted key that was added, removed or changed, with its
      saved and current values (and, for a key the checkpoint lacks, its default).
  """
  old = flatten_config(jsonable(saved, "the saved config"))
  new = flatten_config(jsonable(current, "the current config"))
  default = {} if defaults is None else flatten_config(jsonable(defaults, "the defaults"))
  moved = dict(moved or {})
  missing = object()
  show = lambda v: "(absent)" if v is missing else json.dumps(v)  # noqa: E731
  changed = []
  for key in sorted(set(old) | set(new)):
    a, b = old.get(key, missing), new.get(key, missing)
    if a == b or _allowed(key, allowed_to_differ):
      continue
    if b is missing and key in moved:
      if a == new.get(moved[key], missing):
        continue  # the value under its one name now, unchanged
      changed.append(
        f"{key}: {show(a)} in the checkpoint, now {moved[key]} (the key it moved to) is "
        f"{show(new.get(moved[key], missing))}"
      )
      continue
    if a is missing and key in default:
      if b == default[key]:
        continue  # a key added since, at its default
      changed.append(
        f"{key}: (absent) in the checkpoint (written before the key existed; its default "
        f"{json.dumps(default[key])} is what that run used), {show(b)} now"
      )
      continue
    changed.append(f"{key}: {show(a)} in the checkpoint, {show(b)} now")
  if changed:
    raise ValueError(
      f"the config differs from the checkpoint's in {len(changed)} key(s) that must not change "
      "when a run resumes:\n  " + "\n  ".join(changed) + "\nRestore these values or start in a "
      f"new workdir (keys allowed to differ: {', '.join(allowed_to_differ)})"
    )
