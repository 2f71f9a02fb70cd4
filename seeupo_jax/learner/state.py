"""`TrainState`: what the learner carries from one update to the next."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from seeupo_jax import sharding as sharding_lib
from seeupo_jax.learner import precision
from seeupo_jax.models import lora

Params = Any


@flax.struct.dataclass
class SavedState:
  """What checkpoints hold of a `TrainState`: every field but `base` (the frozen base is loaded
  again as it was first), so checkpoints of full fine-tuning keep the tree they always had.

  Attributes:
    params: the policy's params, in the dtype the model computes with (the sampler's too).
    opt_state: the optax state of `params`; a `precision.MasterWeightsState` (float32 master
      weights, then the optimizer's own state) when the params are bf16 (`init_state`).
    ref_params: the frozen reference policy of the KL penalty, or None.
    critic_params: PPO's critic (a separate model, see `qwen_fns.qwen_value_fn`), or None.
    critic_opt_state: the optax state of `critic_params`, or None.
    step: int32 scalar, update calls done (training iterations).
    optimizer_steps: int32 scalar, optimizer steps applied so far.
    skipped_updates: int32 scalar, optimizer steps skipped so far because the
      loss or a gradient was not finite (the state was left as it was).
  """

  params: Params
  opt_state: optax.OptState
  ref_params: Optional[Params]
  critic_params: Optional[Params]
  critic_opt_state: Optional[optax.OptState]
  step: jax.Array
  optimizer_steps: jax.Array
  skipped_updates: jax.Array


@flax.struct.dataclass
class TrainState(SavedState):
  """The learner's state (a pytree; jit donates it): `SavedState`'s fields, and

  Attributes:
    base: with adapters (LoRA, `models/lora.py`), the frozen base weights: `params` holds only
      the adapters, the policy is `policy_params(state)` (the base with the adapters beside
      it), and the KL reference is the base alone. None: `params` is the whole policy.
      Checkpoints leave it out (`without_base`).
  """

  base: Optional[Params] = None


def policy_params(state: TrainState) -> Params:
  """The params the policy runs with: `state.params`, beside `state.base` when it has one
  (`lora.combine`: the base's nested dicts with the adapters added, no leaf copied)."""
  return state.params if state.base is None else lora.combine(state.base, state.params)


def reference_params(state: TrainState) -> Optional[Params]:
  """The KL reference: `state.ref_params`, else the frozen base (adapters left out)."""
  return state.ref_params if state.ref_params is not None else state.base


_SAVED_FIELDS = tuple(f.name for f in dataclasses.fields(SavedState))


def without_base(state: TrainState) -> SavedState:
  """The state as checkpoints hold it (`SavedState`: the frozen base left out)."""
  return SavedState(**{f: getattr(state, f) for f in _SAVED_FIELDS})


def with_base(saved: SavedState, base: Optional[Params]) -> TrainState:
  """The `TrainState` of a restored `SavedState` and the frozen `base` (None without one)."""
  return TrainState(**{f: getattr(saved, f) for f in _SAVED_FIELDS}, base=base)


def _replicated_like(tree) -> Any:
  """The replicated sharding on the devices of the first leaf of `tree`."""
  leaf = jax.tree.leaves(tree)[0]
  sharding = getattr(leaf, "sharding", None)
  if isinstance(sharding, NamedSharding):
    return NamedSharding(sharding.mesh, P())
  if sharding is not None:
    return sharding
  return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def opt_state_shardings(
  optimizer: optax.GradientTransformation, params: Params, *, master_weights: bool = True
) -> Any:
  """Shardings of the optimizer state `init_state(params, optimizer)` builds: each params-like
  leaf (master weights, Adam's moments, ...) on its parameter's sharding, everything else
  (counts, hyper-parameters) replicated. `params`: arrays or ShapeDtypeStructs with shardings."""
  optimizer = precision.resolve(optimizer, params, master_weights)
  shapes = jax.eval_shape(optimizer.init, params)
  param_shardings = jax.tree.map(lambda p: p.sharding, params)
  replicated = _replicated_like(params)
  return optax.tree_map_params(
    optimizer,
    lambda x, s: None if x is None else s,  # None: a float32 leaf that needs no master copy
    shapes,
    param_shardings,
    transform_non_params=lambda _: replicated,
    is_leaf=lambda x: x is None,
  )


def _placed(params: Params) -> bool:
  """True when every leaf is a concrete jax.Array (placed on devices), not a tracer or NumPy
  array: only then do the leaves have shardings to follow. Under jit/vmap (e.g. the bandit
  runs) init_state builds the state like any traced function."""
  leaves = jax.tree.leaves(params)
  return bool(leaves) and all(
    isinstance(p, jax.Array) and not isinstance(p, jax.core.Tracer) for p in leaves
  )


def _init_opt_state(optimizer: optax.GradientTransformation, params: Params) -> optax.OptState:
  """optimizer.init(params), created directly on the params' shardings (never gathered)."""
  if not _placed(params):
    return optimizer.init(params)
  shardings = opt_state_shardings(optimizer, params, master_weights=False)
  return jax.jit(optimizer.init, out_shardings=shardings)(params)


def init_state(
  params: Params,
  optimizer: optax.GradientTransformation,
  ref_params: Optional[Params] = None,
  *,
  critic_params: Optional[Params] = None,
  critic_optimizer: Optional[optax.GradientTransformation] = None,
  master_weights: bool = True,
  base: Optional[Params] = None,
) -> TrainState:
  """The state before the first update.

  Args:
    params: the policy's params, already on their shardings (e.g. from
      `checkpoint.load(dir, mesh)` or `shard_params`).
    optimizer: any `optax.GradientTransformation`.
    ref_params: the reference policy for the KL penalty (usually `params`
      itself: jax arrays are immutable and the update donates only the
      state's own buffers, so passing the same tree is safe); None disables
      the penalty (then `LearnerConfig.kl_coef` must be 0).
    critic_params: PPO's critic params (`algorithm="ppo"` only).
    critic_optimizer: the critic's optimizer (required with critic_params).
    master_weights: when the params (or the critic's) have bf16 (any sub-float32 floating)
      leaves, wrap the optimizer in `precision.with_master_weights`: the optimizer state keeps
      float32 masters and float32 moments, `params` stays the bf16 working copy (the masters
      rounded). Without masters AdamW's small steps round away (logged once as a warning with
      the share of weights lost). No effect on float32 params or an optimizer already wrapped.
      `make_update` follows the state: pass it the unwrapped optimizer.
    base: frozen weights the trained `params` (LoRA adapters: `lora.split`) sit beside; no
      optimizer state, no master copy, no gradient. With a base and no `ref_params` the KL
      reference is the base.

  Returns:
    A `TrainState` with step 0.
  """
  if (critic_params is None) != (critic_optimizer is None):
    raise ValueError(
      "init_state: pass critic_params and critic_optimizer together (PPO), or neither"
    )
  optimizer = precision.resolve(optimizer, params, master_weights)
  precision.warn_if_updates_round_away(params, optimizer)
  if critic_params is not None:
    critic_optimizer = precision.resolve(critic_optimizer, critic_params, master_weights)
    precision.warn_if_updates_round_away(critic_params, critic_optimizer)
  if ref_params is not None:
    # A separate copy: the update donates the state, and params and ref_params must not alias.
    ref_params = jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, ref_params)
  return TrainState(
    params=params,
    opt_state=_init_opt_state(optimizer, params),
    ref_params=ref_params,
    critic_params=critic_params,
    critic_opt_state=None
    if critic_params is None
    else _init_opt_state(critic_optimizer, critic_params),
    step=_counter(params),
    optimizer_steps=_counter(params),
    skipped_updates=_counter(params),
    base=base,
  )


def _counter(params: Params) -> jax.Array:
  """int32 0; on a mesh, replicated on the params' mesh (a NamedSharding), so the update's
  output state has its input's shardings and the second call reuses the first compilation."""
  zero = jnp.zeros((), jnp.int32)
  if _placed(params):
    replicated = _replicated_like(params)
    if isinstance(replicated, NamedSharding):
      return jax.device_put(zero, replicated)
  return zero


def shard_params(params: Params, mesh: Mesh) -> Params:
  """Places params on `mesh` by the model's partition rules (`sharding.param_shardings`)."""
  return jax.device_put(params, sharding_lib.param_shardings(params, mesh))


def state_shardings(state: TrainState) -> TrainState:
  """The sharding of every leaf of `state` (for `jax.jit(..., out_shardings=...)`)."""
  return jax.tree.map(lambda x: x.sharding, state)
