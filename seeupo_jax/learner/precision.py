"""Float32 master weights for params stored in bfloat16, and the check for lost updates.

bfloat16 keeps 8 significant bits: w + u rounds back to w when |u| is below half w's spacing,
which lies between |w| / 512 and |w| / 256 (by where w sits in its binade). AdamW moves a weight
by about its learning rate per step, so at the authors' lr 1e-6 no bf16 weight with
|w| >= 2^-11 = 4.9e-4 can move: nearly all of a Qwen model (weights ~1e-2).

`with_master_weights(inner)` is an optax wrapper that keeps a float32 copy of every
lower-precision leaf in its state and runs `inner` on the float32 copy (so Adam's moments are
float32 too); the params it is given are the working copy the model computes with, and the
updates it returns make that copy the float32 masters rounded to its dtype. `init_state` wraps
the optimizer in it by default when the params have such leaves; see docs/learner.md
("Precision").
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax
from absl import logging

Params = Any


class MasterWeightsState(NamedTuple):
  """State of `with_master_weights`.

  Attributes:
    params: the master weights, a tree like the params: a float32 copy of each floating leaf of
      lower precision (bf16 [...] -> float32 [...]); None where the leaf needs none (already
      float32, or not floating), so float32 params cost nothing here.
    inner_state: the wrapped optimizer's state over the masters (Adam's mu and nu float32 [...]
      wherever the masters are).
  """

  params: Params
  inner_state: optax.OptState


class _MasterWeights(optax.GradientTransformation):
  """The transformation `with_master_weights` returns (a marker: it is already wrapped)."""


def _is_none(x) -> bool:
  return x is None


def needs_master(x, dtype=jnp.float32) -> bool:
  """True for a floating leaf (array or ShapeDtypeStruct) of less precision than `dtype`."""
  leaf_dtype = getattr(x, "dtype", None)
  if leaf_dtype is None or not jnp.issubdtype(leaf_dtype, jnp.floating):
    return False
  return jnp.finfo(leaf_dtype).bits < jnp.finfo(dtype).bits


def has_low_precision(params: Params, dtype=jnp.float32) -> bool:
  """True when some leaf of `params` is floating with less precision than `dtype`."""
  return any(needs_master(x, dtype) for x in jax.tree.leaves(params))


def _full(masters: Params, params: Params) -> Params:
  """The params as the inner optimizer sees them: the masters where kept, else the params."""
  return jax.tree.map(lambda m, p: p if m is None else m, masters, params, is_leaf=_is_none)


def with_master_weights(
  inner: optax.GradientTransformation, dtype: str = "float32"
) -> optax.GradientTransformation:
  """Runs `inner` on `dtype` master copies of the lower-precision params.

  A step: g <- grads cast to the masters' dtype; (u, s) <- inner.update(g, s, masters);
  masters <- masters + u (in float32); returned updates = masters - params (float32), so
  `optax.apply_updates(params, updates)` gives the new masters rounded to the params' dtype.
  Leaves already in `dtype` keep no copy and get `inner`'s update unchanged (bit-identical to
  the unwrapped optimizer there).

  Args:
    inner: any optax transformation (e.g. `default_optimizer()`).
    dtype: the masters' dtype.

  Returns:
    A `GradientTransformation` whose state is a `MasterWeightsState`. Its `update` needs the
    params (the working copy), as AdamW's does.
  """
  dtype = jnp.dtype(dtype)

  def init(params):
    masters = jax.tree.map(lambda p: p.astype(dtype) if needs_master(p, dtype) else None, params)
    return MasterWeightsState(masters, inner.init(_full(masters, params)))

  def update(updates, state, params=None):
    if params is None:
      raise ValueError("with_master_weights: update(grads, state, params) needs the params")
    full = _full(state.params, params)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), updates, full)
    steps, inner_state = inner.update(grads, state.inner_state, full)
    new_full = optax.apply_updates(full, steps)
    masters = jax.tree.map(
      lambda m, n: None if m is None else n, state.params, new_full, is_leaf=_is_none
    )
    out = jax.tree.map(
      lambda m, s, n, p: s if m is None else n - p.astype(n.dtype),
      state.params,
      steps,
      new_full,
      params,
      is_leaf=_is_none,
    )
    return out, MasterWeightsState(masters, inner_state)

  return _MasterWeights(init, update)


def is_master_weights(optimizer) -> bool:
  """True for a transformation built by `with_master_weights`."""
  return isinstance(optimizer, _MasterWeights)


def resolve(
  optimizer: optax.GradientTransformation, params: Params, master_weights: bool = True
) -> optax.GradientTransformation:
  """The optimizer `init_state` uses: wrapped in `with_master_weights` when `master_weights`
  and `params` has lower-precision floating leaves (and it is not wrapped already)."""
  if master_weights and has_low_precision(params) and not is_master_weights(optimizer):
    return with_master_weights(optimizer)
  return optimizer


def for_state(optimizer: optax.GradientTransformation, opt_state) -> optax.GradientTransformation:
  """The optimizer that steps `opt_state` (the update follows the state `init_state` built)."""
  if isinstance(opt_state, MasterWeightsState):
    return optimizer if is_master_weights(optimizer) else with_master_weights(optimizer)
  if is_master_weights(optimizer):
    raise ValueError(
      "make_update got an optimizer wrapped in with_master_weights but the state has no master "
      "weights: pass the same optimizer to init_state"
    )
  return optimizer


def stepped_params(params: Params, opt_state) -> Params:
  """What the optimizer steps: the float32 masters where `opt_state` keeps them, else `params`
  (e.g. for the dtype of the gradients to hand it)."""
  if isinstance(opt_state, MasterWeightsState):
    return _full(opt_state.params, params)
  return params


def master_params(state) -> Params:
  """The policy's float32 master weights of a `TrainState` (its params where none are kept)."""
  return stepped_params(state.params, state.opt_state)


# ----------------------------------------------------------------------------------------------
# Lost updates.


@jax.jit
def _kept(x: jax.Array, step: jax.Array) -> jax.Array:
  """Number of entries of x that a step of +step (float32, rounded to x's dtype) moves."""
  moved = (x.astype(jnp.float32) + step).astype(x.dtype) != x
  return jnp.sum(moved, dtype=jnp.float32)


def rounded_away_share(params: Params, step_size: float) -> float:
  """Share of the floating entries w of `params` that a step of `step_size` leaves unchanged:
  round_to_dtype(w + step_size) == w. AdamW's step is about its learning rate, so at
  `step_size=lr` this is about the share of weights an unwrapped bf16 run cannot move."""
  leaves = [x for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)]
  total = sum(x.size for x in leaves)
  if not total:
    return 0.0
  step = jnp.float32(step_size)
  kept = sum(float(_kept(x, step)) for x in leaves)
  return 1.0 - kept / total


WARN_STEP_SIZES = (1e-6, 1e-5, 1e-4)
"""Step sizes the warning reports (AdamW moves a weight by about its lr per step)."""

_warned = False


def rounding_message(params: Params, step_sizes: Sequence[float] = WARN_STEP_SIZES) -> str:
  """The warning for lower-precision params stepped without master weights."""
  dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(params) if needs_master(x)})
  shares = ", ".join(f"{rounded_away_share(params, s):.1%} at {s:g}" for s in step_sizes)
  return (
    f"the params are {'/'.join(dtypes)} and the optimizer keeps no float32 master weights: an "
    "update smaller than |w|/512 to |w|/256 rounds away. AdamW moves each weight by about its "
    f"learning rate per step; the share of these weights a step of that size cannot move: "
    f"{shares}. Keep master weights (init_state(..., master_weights=True), the default; "
    "optimizer.master_weights=True in a training config) or use float32 params"
  )


def warn_if_updates_round_away(params: Params, optimizer: optax.GradientTransformation) -> bool:
  """Logs `rounding_message` once per process when `params` has lower-precision leaves that
  `optimizer` would step without masters. Returns True when the configuration rounds."""
  global _warned
  if is_master_weights(optimizer) or not has_low_precision(params):
    return False
  leaves = jax.tree.leaves(params)
  concrete = all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) for x in leaves)
  if not _warned and concrete:
    _warned = True
    logging.warning("%s", rounding_message(params))
  return True
