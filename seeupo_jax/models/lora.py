"""LoRA adapters on the decoder's projections: init, split from the base, merge, PEFT names.

A projection y = x W (W [in, out]) with an adapter computes

    y = x W + s * (x A) B,        A [in, r], B [r, out], s = alpha / r      (Hu et al., 2021)

A starts uniform in +-1/sqrt(in) and B at zero (PEFT's default init), so a fresh adapter
changes nothing. The adapters live in the params tree beside the kernel they adapt, stacked on
the layer axis like it:

  layers/attn/{q,k,v,o}_proj/{lora_a [L, in, r], lora_b [L, r, out]}
  layers/mlp/{gate,up,down}_proj/{lora_a [L, in, r], lora_b [L, r, out]}
  lm_head/{lora_a [D, r], lora_b [r, V]}            (target "lm_head": the output projection)

The model applies an adapter wherever the params hold one (`layers._lora_delta`), so the same
functions run the base (the KL reference: the params without adapters) and the adapted policy.
The learner trains the adapters (float32, with their own optimizer state) and keeps the base
frozen (`split`, `learner.init_state(..., base=)`); the sampler decodes the params with their
adapters unmerged; `merge` gives the base structure with W + s A B, for a HF export.

Implemented here rather than with qwix: qwix's LoRA intercepts the dot_generals of Flax
modules and creates its adapters inside them, one per call site, while our decoder runs one
concatenated q/k/v matmul and one gate/up matmul per layer over kernels stacked for
`lax.scan`, and the learner needs the adapters as a tree of their own (the state it steps and
checkpoints, the PEFT export); a projection's adapter here is two params beside its kernel.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from seeupo_jax.models import quant
from seeupo_jax.models.config import LORA_LAYER_TARGETS

Params = Any

# The decoder layers' adaptable projections: config name -> (module, HF submodule), in PEFT's
# naming. The other target, "lm_head", is the output projection (`HEAD`).
TARGETS = {
  "q_proj": ("attn", "self_attn"),
  "k_proj": ("attn", "self_attn"),
  "v_proj": ("attn", "self_attn"),
  "o_proj": ("attn", "self_attn"),
  "gate_proj": ("mlp", "mlp"),
  "up_proj": ("mlp", "mlp"),
  "down_proj": ("mlp", "mlp"),
}
assert tuple(TARGETS) == LORA_LAYER_TARGETS, LORA_LAYER_TARGETS
HEAD = "lm_head"
ADAPTER_LEAVES = ("lora_a", "lora_b")


def projection_shape(config, name: str) -> tuple[int, int]:
  """(in, out) features of projection `name` (a `LORA_TARGETS` name) of `config`."""
  d, f = config.hidden_size, config.intermediate_size
  if name == HEAD:
    return d, config.vocab_size
  q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
  return {
    "q_proj": (d, q),
    "k_proj": (d, kv),
    "v_proj": (d, kv),
    "o_proj": (q, d),
    "gate_proj": (d, f),
    "up_proj": (d, f),
    "down_proj": (f, d),
  }[name]


def init_adapters(config, key: jax.Array) -> Params:
  """Fresh adapters for `config.lora_targets` at rank `config.lora_rank`, float32.

  A_l ~ U(-1/sqrt(in), 1/sqrt(in)) [L, in, r] (PEFT's kaiming-uniform with a = sqrt(5)),
  B_l = 0 [L, r, out]: the adapted model equals the base until B moves. The head's adapter has
  no layer axis: A [D, r], B [r, V].

  Returns:
    {"layers": {module: {name: {"lora_a", "lora_b"}}}, "lm_head": {"lora_a", "lora_b"}} (the
    targets configured), empty when lora_rank is 0.
  """
  r, num_layers = config.lora_rank, config.num_layers
  tree: dict = {}
  if not r:
    return tree
  keys = jax.random.split(key, len(TARGETS) + 1)
  for k, name in zip(keys, tuple(TARGETS) + (HEAD,)):
    if name not in config.lora_targets:
      continue
    fan_in, fan_out = projection_shape(config, name)
    bound = fan_in**-0.5
    lead = () if name == HEAD else (num_layers,)
    adapter = {
      "lora_a": jax.random.uniform(k, lead + (fan_in, r), jnp.float32, -bound, bound),
      "lora_b": jnp.zeros(lead + (r, fan_out), jnp.float32),
    }
    if name == HEAD:
      tree[HEAD] = adapter
    else:
      tree.setdefault("layers", {}).setdefault(TARGETS[name][0], {})[name] = adapter
  return tree


def head_delta(params: Params, scale: float):
  """scale * A B [D, V] float32 of the head's adapter where `params` holds one, else None."""
  ab = params.get(HEAD, {})
  if "lora_a" not in ab:
    return None
  a, b = ab["lora_a"].astype(jnp.float32), ab["lora_b"].astype(jnp.float32)
  return scale * (a @ b)


def is_adapter_path(path) -> bool:
  """True for a tree path ending in an adapter leaf (`lora_a`/`lora_b`)."""
  return bool(path) and str(getattr(path[-1], "key", "")) in ADAPTER_LEAVES


def has_adapters(params: Params) -> bool:
  """True when `params` holds some adapter."""
  return any(is_adapter_path(p) for p, _ in jax.tree_util.tree_leaves_with_path(params))


def _filter(tree: Params, keep) -> Params:
  """The nested dicts of `tree` holding only the leaves `keep(path)` accepts."""
  out: dict = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if not keep(path):
      continue
    node = out
    for k in path[:-1]:
      node = node.setdefault(k.key, {})
    node[path[-1].key] = leaf
  return out


def split(params: Params) -> tuple[Params, Params]:
  """(adapters, base): the adapter leaves of `params` and all the others, as nested dicts."""
  return _filter(params, is_adapter_path), _filter(params, lambda p: not is_adapter_path(p))


def combine(base: Params, adapters: Params) -> Params:
  """`base` with the leaves of `adapters` added beside it (no leaf is copied)."""
  if not adapters:
    return base
  out = dict(base)
  for k, v in adapters.items():
    out[k] = combine(base[k], v) if isinstance(v, dict) and k in base else v
  return out


def merge(params: Params, scale: float) -> Params:
  """The base structure of `params` with each adapted kernel W replaced by W + scale A B,
  computed in float32 and cast to W's dtype (the adapters dropped). A quantized base
  (`models/quant.py`) is dequantized first: every projection comes out as a float32 "kernel".

  Args:
    params: a model's params with adapters (stacked [L, ...] layer leaves).
    scale: alpha / rank (`ModelConfig.lora_scale`).
  """
  adapters, base = split(params)
  base = quant.dequantize_params(base, jnp.float32)
  if not adapters:
    return base
  out = jax.tree.map(lambda x: x, base)  # new dicts, the same leaves
  delta = head_delta(adapters, scale)
  if delta is not None:  # untied: ModelConfig refuses a head adapter on a tied head
    kernel = out[HEAD]["kernel"]
    out[HEAD]["kernel"] = (kernel.astype(jnp.float32) + delta).astype(kernel.dtype)
  for module, projections in adapters.get("layers", {}).items():
    for name, ab in projections.items():
      kernel = out["layers"][module][name]["kernel"]
      delta = jnp.einsum(
        "lir,lro->lio", ab["lora_a"].astype(jnp.float32), ab["lora_b"].astype(jnp.float32)
      )
      out["layers"][module][name]["kernel"] = (kernel.astype(jnp.float32) + scale * delta).astype(
        kernel.dtype
      )
  return out
