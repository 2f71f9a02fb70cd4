"""A frozen base in int8 or NF4 (QLoRA): quantize the decoder's projection kernels, dequantize
them where they are used.

A kernel W [..., in, out] (stacked layers lead) becomes, beside its bias:

  int8   kernel_int8  int8 [..., in, out]     q = clip(round(W / s), -127, 127)
         kernel_scale [..., 1, out]           s_j = max_i |W_ij| / 127 (one per output feature)
         W' = q * s; |W - W'| <= s / 2 elementwise.
  nf4    kernel_nf4   uint8 [..., in/2, out]  two 4-bit codes per byte along `in`: the code of
                                              row 2i in the low nibble, of row 2i+1 in the high
         kernel_scale [..., in/64, out]       a_b = max |W| over block b of 64 input rows
         code = argmin_k |W / a_b - NF4[k]|, W' = NF4[code] * a_b
         (NF4: the 16 quantiles of a standard normal scaled to [-1, 1], Dettmers et al. 2023,
         as bitsandbytes tabulates them.)

The bytes per weight of a bf16 base: 1 + 2/in (int8), 0.5 + 2/64 (NF4), against 2. Only the seven
projections of the decoder layers are quantized; the embedding, the norms and the lm_head keep
their dtype (as QLoRA does). The scales are computed in float32 and kept in the kernel's dtype
(bf16 for a bf16 base: what the sampler's copy holds too, so the learner and the sampler
dequantize the same numbers); QLoRA's second quantization of them is not done. The model
(`layers._Kernel`) dequantizes one layer's kernel, in param_dtype, where it is used (inside the
layer scan): no full-precision copy of the model exists. Nothing here has a gradient: a
quantized base is frozen (LoRA trains beside it).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from seeupo_jax.models.config import QUANTIZE_FORMATS

Params = Any

FORMATS = QUANTIZE_FORMATS
NF4_BLOCK = 64
NF4 = np.array(
  [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
  ],
  np.float32,
)
_NF4_MIDPOINTS = (NF4[1:] + NF4[:-1]) / 2  # code = number of midpoints below the value
CODES = ("kernel_int8", "kernel_nf4")  # the leaves that replace "kernel"
PROJECTIONS = {
  "attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
  "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def check_nf4_shape(in_features: int) -> None:
  if in_features % NF4_BLOCK:
    raise ValueError(
      f"nf4 quantizes blocks of {NF4_BLOCK} input features; this kernel has {in_features}"
    )


def quantize_int8(w: jax.Array) -> dict:
  """{"kernel_int8" int8 [..., in, out], "kernel_scale" f32 [..., 1, out]} of W [..., in, out]:
  s = max_in |W| / 127 (1 where a column is all zero), q = clip(round(W / s), -127, 127)."""
  w = w.astype(jnp.float32)
  absmax = jnp.max(jnp.abs(w), axis=-2, keepdims=True)
  scale = jnp.where(absmax > 0, absmax / 127.0, 1.0)
  q = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
  return {"kernel_int8": q, "kernel_scale": scale}


def quantize_nf4(w: jax.Array) -> dict:
  """{"kernel_nf4" uint8 [..., in/2, out], "kernel_scale" f32 [..., in/64, out]} of W [..., in,
  out]: per block of 64 input rows, a = max |W| (1 if zero), code = nearest NF4 value to W / a
  (ties to the lower code), two codes per byte (row 2i low nibble, 2i+1 high)."""
  *lead, fan_in, fan_out = w.shape
  check_nf4_shape(fan_in)
  w = w.astype(jnp.float32).reshape(*lead, fan_in // NF4_BLOCK, NF4_BLOCK, fan_out)
  absmax = jnp.max(jnp.abs(w), axis=-2, keepdims=True)
  absmax = jnp.where(absmax > 0, absmax, 1.0)
  normed = (w / absmax).reshape(*lead, fan_in, fan_out)
  codes = jnp.zeros(normed.shape, jnp.uint8)
  for m in _NF4_MIDPOINTS:  # 15 compares, no [..., 16] intermediate
    codes = codes + (normed > m).astype(jnp.uint8)
  pairs = codes.reshape(*lead, fan_in // 2, 2, fan_out)
  packed = pairs[..., 0, :] | (pairs[..., 1, :] << 4)
  return {"kernel_nf4": packed, "kernel_scale": jnp.squeeze(absmax, -2)}


def dequantize(leaves: dict, dtype) -> jax.Array:
  """The kernel W' [..., in, out] in `dtype` of a projection's quantized leaves."""
  scale = leaves["kernel_scale"].astype(jnp.float32)
  if "kernel_int8" in leaves:
    return (leaves["kernel_int8"].astype(jnp.float32) * scale).astype(dtype)
  packed = leaves["kernel_nf4"]
  *lead, half, fan_out = packed.shape
  codes = jnp.stack([packed & 15, packed >> 4], axis=-2).reshape(*lead, 2 * half, fan_out)
  values = jnp.asarray(NF4)[codes.astype(jnp.int32)]
  blocks = values.reshape(*lead, 2 * half // NF4_BLOCK, NF4_BLOCK, fan_out)
  return (blocks * scale[..., None, :]).reshape(*lead, 2 * half, fan_out).astype(dtype)


def is_quantized(leaves: dict) -> bool:
  """True for a projection's params holding quantized codes instead of "kernel"."""
  return any(c in leaves for c in CODES)


def quantize_params(params: Params, fmt: str) -> Params:
  """`params` with the decoder layers' projection kernels quantized to `fmt` (`FORMATS`); every
  other leaf (biases, norms, embedding, lm_head, LoRA adapters) is the same array. Projections
  `params` lacks are skipped (one projection at a time: `checkpoint._quantize_on`).

  Raises:
    ValueError: fmt is not one of `FORMATS`, or an nf4 kernel's input features are not a
      multiple of 64.
  """
  if fmt not in FORMATS:
    raise ValueError(f"quantization format must be one of {FORMATS}, got {fmt!r}")
  if fmt == "none":
    return params
  quantize = quantize_int8 if fmt == "int8" else quantize_nf4
  out = dict(params)
  out["layers"] = layers = dict(params["layers"])
  for module, names in PROJECTIONS.items():
    if module not in layers:
      continue
    layers[module] = dict(layers[module])
    for name in names:
      if name not in layers[module]:
        continue
      leaves = dict(layers[module][name])
      kernel = leaves.pop("kernel")
      leaves.update(quantize(kernel))
      # The scales in the kernel's dtype, as the sampler's copy holds them (the decode layout
      # casts floats to the compute dtype): learner and sampler dequantize the same numbers.
      leaves["kernel_scale"] = leaves["kernel_scale"].astype(kernel.dtype)
      layers[module][name] = leaves
  return out


def dequantize_params(params: Params, dtype) -> Params:
  """`params` with every quantized projection's kernel back as "kernel" in `dtype`."""
  if not any(is_quantized(p) for m in PROJECTIONS for p in params["layers"].get(m, {}).values()):
    return params
  out = dict(params)
  out["layers"] = layers = dict(params["layers"])
  for module in PROJECTIONS:
    if module not in layers:
      continue
    layers[module] = dict(layers[module])
    for name, leaves in layers[module].items():
      if isinstance(leaves, dict) and is_quantized(leaves):
        kept = {k: v for k, v in leaves.items() if k not in (*CODES, "kernel_scale")}
        layers[module][name] = {"kernel": dequantize(leaves, dtype), **kept}
  return out
