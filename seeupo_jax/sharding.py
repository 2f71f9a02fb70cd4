"""Device mesh with data/fsdp/tensor axes and the partition rules of the model.

Parameters are sharded FSDP-style over "fsdp" and Megatron-style over "tensor";
activations over ("data", "fsdp") on the batch axis. A dimension that a mesh
axis does not divide is left replicated on that axis, so every preset shards
on every mesh without errors.

Usage:
  mesh = make_mesh(data=2, fsdp=2, tensor=2)
  params = jax.device_put(params, param_shardings(params, mesh))
  with jax.set_mesh(mesh):   # turns on the activation constraints
    logits, _ = jax.jit(functools.partial(qwen.forward, config=cfg))(params, ...)
"""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")

# Activation specs (leading axis = batch).
HIDDEN = P(BATCH, None, None)  # [B, S, D]
MLP_HIDDEN = P(BATCH, None, "tensor")  # [B, S, F]
LOGITS = P(BATCH, None, "tensor")  # [B, S, V]
TOKENS = P(BATCH, None)  # [B, S]

# (regex on the "/"-joined parameter path, spec). The first match wins; layer
# parameters carry a leading layer axis (they are stacked for the scan).
PARAM_RULES: tuple[tuple[str, P], ...] = (
  (
    r"(^|/)embed/embedding$",
    P(("fsdp", "tensor"), None),
  ),  # [V, D] (also under a prefix: a critic's trunk)
  (r"(^|/)lm_head/kernel$", P("fsdp", "tensor")),  # [D, V]
  (r"attn/[qkv]_proj/kernel(_int8|_nf4|_scale)?$", P(None, "fsdp", "tensor")),  # [L, D, N*hd]
  (r"attn/[qkv]_proj/bias$", P(None, "tensor")),  # [L, N*hd]
  (r"attn/o_proj/kernel(_int8|_nf4|_scale)?$", P(None, "tensor", "fsdp")),  # [L, H*hd, D]
  (r"attn/o_proj/bias$", P(None, None)),  # [L, D], Qwen3 with attention_bias only
  (r"mlp/(gate|up)_proj/kernel(_int8|_nf4|_scale)?$", P(None, "fsdp", "tensor")),  # [L, D, F]
  (r"mlp/down_proj/kernel(_int8|_nf4|_scale)?$", P(None, "tensor", "fsdp")),  # [L, F, D]
  # (A quantized kernel's codes and scales, models/quant.py, lie like the kernel; a scale's
  # axis of size 1 stays whole.)
  # LoRA adapters (models/lora.py): A [L, in, r] split like its kernel's input features, B
  # [L, r, out] like its output features, so x A and (x A) B need no other layout than x W's.
  (r"(attn/[qkv]_proj|mlp/(gate|up)_proj)/lora_a$", P(None, "fsdp", None)),
  (r"(attn/[qkv]_proj|mlp/(gate|up)_proj)/lora_b$", P(None, None, "tensor")),
  (r"(attn/o_proj|mlp/down_proj)/lora_a$", P(None, "tensor", None)),
  (r"(attn/o_proj|mlp/down_proj)/lora_b$", P(None, None, "fsdp")),
  (r"(^|/)lm_head/lora_a$", P("fsdp", None)),  # [D, r]
  (r"(^|/)lm_head/lora_b$", P(None, "tensor")),  # [r, V]
  (r"scale$", P()),  # norms
)


def make_mesh(
  data: int = 1, fsdp: int = -1, tensor: int = 1, devices: Optional[Sequence[jax.Device]] = None
) -> Mesh:
  """A ("data", "fsdp", "tensor") mesh; one size may be -1 (fills the rest).

  Raises:
    ValueError: the sizes do not multiply to the number of devices.
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = [data, fsdp, tensor]
  if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
    raise ValueError(
      f"mesh sizes (data, fsdp, tensor) must be positive with at most one -1, got {sizes}"
    )
  known = int(np.prod([s for s in sizes if s != -1]))
  if -1 in sizes:
    if len(devices) % known:
      raise ValueError(f"{len(devices)} devices are not divisible by mesh sizes {sizes}")
    sizes[sizes.index(-1)] = len(devices) // known
  if int(np.prod(sizes)) != len(devices):
    raise ValueError(
      f"mesh sizes (data, fsdp, tensor)={tuple(sizes)} need "
      f"{int(np.prod(sizes))} devices, have {len(devices)}"
    )
  return Mesh(np.asarray(devices).reshape(sizes), AXES, axis_types=(AxisType.Auto,) * 3)


def _axis_size(mesh, axis) -> int:
  names = axis if isinstance(axis, tuple) else (axis,)
  return int(np.prod([mesh.shape[n] for n in names]))


def fit_spec(spec: P, shape: Sequence[int], mesh) -> P:
  """Drops the mesh axes of `spec` that do not divide the matching dimension."""
  entries = list(spec) + [None] * (len(shape) - len(spec))
  fitted = []
  for dim, axis in zip(shape, entries):
    fitted.append(axis if axis is not None and dim % _axis_size(mesh, axis) == 0 else None)
  return P(*fitted)


def path_name(path) -> str:
  """'layers/attn/q_proj/kernel' from a jax tree path."""
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def param_spec(name: str) -> P:
  """The rule spec of the parameter called `name` (replicated if none matches)."""
  for pattern, spec in PARAM_RULES:
    if re.search(pattern, name):
      return spec
  return P()


def param_shardings(params: Any, mesh: Mesh) -> Any:
  """NamedSharding per leaf of `params` (arrays or ShapeDtypeStructs)."""

  def one(path, leaf):
    return NamedSharding(mesh, fit_spec(param_spec(path_name(path)), leaf.shape, mesh))

  return jax.tree_util.tree_map_with_path(one, params)


def cache_shardings(cache: Any, mesh: Mesh) -> Any:
  """NamedSharding per field of a `KVCache` (batch over data+fsdp, kv heads over tensor) or of
  a `PagedKVCache` (kv heads over tensor; the page pool is shared by all rows, so it is not
  split over the batch axes: with data > 1 every data shard holds every row's pages)."""
  if not hasattr(cache, "valid"):  # PagedKVCache [L, pages, K, page, hd]
    paged = P(None, None, "tensor", None, None)
    return type(cache)(
      keys=NamedSharding(mesh, fit_spec(paged, cache.keys.shape, mesh)),
      values=NamedSharding(mesh, fit_spec(paged, cache.values.shape, mesh)),
    )
  kv = P(None, BATCH, "tensor", None, None)  # [L, B, K, T, hd]
  return type(cache)(
    keys=NamedSharding(mesh, fit_spec(kv, cache.keys.shape, mesh)),
    values=NamedSharding(mesh, fit_spec(kv, cache.values.shape, mesh)),
    valid=NamedSharding(mesh, fit_spec(P(BATCH, None), cache.valid.shape, mesh)),
    index=NamedSharding(mesh, P()),
  )


def constrain(x: jax.Array, spec: P) -> jax.Array:
  """with_sharding_constraint(x, spec) under a context mesh (`jax.set_mesh`), else x.

  Axes that do not divide the dimension, or that the context mesh lacks, are
  dropped, so model code may call this unconditionally.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not set(AXES) <= set(mesh.axis_names):
    return x
  return jax.lax.with_sharding_constraint(x, fit_spec(spec, x.shape, mesh))
