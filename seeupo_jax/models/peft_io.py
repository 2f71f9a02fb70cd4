"""LoRA adapters <-> PEFT's adapter format (`adapter_config.json` + `adapter_model.safetensors`).

PEFT (the torch library) names a Qwen2/Qwen3 adapter's tensors

    base_model.model.model.layers.{i}.{self_attn|mlp}.{name}.lora_A.weight   [r, in]
    base_model.model.model.layers.{i}.{self_attn|mlp}.{name}.lora_B.weight   [out, r]
    base_model.model.lm_head.lora_A.weight / lora_B.weight     [r, D] / [V, r]  (target lm_head)

and scales their product by lora_alpha / r, as `models/lora.py` does: our A_l [in, r] is the
transpose of lora_A, our B_l [r, out] the transpose of lora_B. `save` writes what
`peft.PeftModel.from_pretrained(hf_model, directory)` loads onto the HF base checkpoint
(`models/checkpoint.save` of the base); `load` reads such a directory back into our adapters,
refusing what our adapters cannot express (rsLoRA, per-module ranks, regex targets, biases,
adapters on other modules).
"""

from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from seeupo_jax.models import lora
from seeupo_jax.models import safetensors_io
from seeupo_jax.models.config import LORA_TARGETS, ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_KEY = re.compile(
  r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
_HEAD_KEY = re.compile(r"^(?:base_model\.model\.)?lm_head\.lora_([AB])\.weight$")
# PEFT's copy of the frozen head, written beside an lm_head adapter (`save_embedding_layers`):
# not read, the head is the base's.
_HEAD_COPY = re.compile(r"^(?:base_model\.model\.)?lm_head\.(?:base_layer\.)?weight$")


def _peft_name(layer: int, name: str, which: str) -> str:
  return f"{_PREFIX}model.layers.{layer}.{lora.TARGETS[name][1]}.{name}.lora_{which}.weight"


def adapter_config(config: ModelConfig, base_model_name_or_path: str = "") -> dict:
  """The `adapter_config.json` of `config`'s adapters (PEFT's `LoraConfig` fields)."""
  return {
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "base_model_name_or_path": base_model_name_or_path or None,
    "r": config.lora_rank,
    "lora_alpha": config.lora_alpha,
    "target_modules": sorted(config.lora_targets),
    "lora_dropout": 0.0,
    "bias": "none",
    "fan_in_fan_out": False,
    "use_rslora": False,
    "use_dora": False,
    "modules_to_save": None,
    "layers_to_transform": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "inference_mode": True,
  }


def save(
  adapters: lora.Params,
  config: ModelConfig,
  directory: str,
  *,
  base_model_name_or_path: str = "",
) -> None:
  """Writes `adapters` (`lora.split(params)[0]`, stacked [L, ...]) as a PEFT adapter directory.

  Args:
    adapters: {"layers": {module: {name: {"lora_a" [L, in, r], "lora_b" [L, r, out]}}}}, and
      "lm_head": {"lora_a" [D, r], "lora_b" [r, V]} with that target.
    config: the model's config (rank, alpha, targets, layers).
    directory: output directory (created).
    base_model_name_or_path: recorded in the config: the HF base the adapter belongs to.
  """
  if not config.lora_rank:
    raise ValueError("ModelConfig.lora_rank is 0: there are no adapters to export")
  os.makedirs(directory, exist_ok=True)
  entries = []
  for module, projections in sorted(adapters.get("layers", {}).items()):
    for name, ab in sorted(projections.items()):
      a, b = ab["lora_a"], ab["lora_b"]
      for layer in range(config.num_layers):
        for which, leaf in (("A", a), ("B", b)):
          shape = tuple(reversed(leaf.shape[1:]))

          def fetch(leaf=leaf, layer=layer):
            return np.asarray(jax.device_get(leaf[layer]), np.float32).T

          entries.append((_peft_name(layer, name, which), shape, fetch))
  for which, leaf in (("A", "lora_a"), ("B", "lora_b")):
    if lora.HEAD in adapters:
      value = adapters[lora.HEAD][leaf]

      def fetch_head(value=value):
        return np.asarray(jax.device_get(value), np.float32).T

      entries.append((f"{_PREFIX}lm_head.lora_{which}.weight", value.shape[::-1], fetch_head))
  entries.sort(key=lambda e: e[0])
  fetchers = {name: fetch for name, _, fetch in entries}
  safetensors_io.write_file(
    os.path.join(directory, WEIGHTS_FILE),
    [(name, shape, np.dtype(np.float32)) for name, shape, _ in entries],
    lambda name: fetchers[name](),
    metadata={"format": "pt"},
  )
  with open(os.path.join(directory, CONFIG_FILE), "w") as f:
    json.dump(adapter_config(config, base_model_name_or_path), f, indent=2)


def _refuse(directory: str, key: str, value, allowed: str):
  raise ValueError(
    f"{os.path.join(directory, CONFIG_FILE)}: {key}={value!r} is not supported; allowed: {allowed}"
  )


def read_config(directory: str) -> dict:
  """The adapter config of a PEFT directory, checked to be one our adapters express.

  Returns:
    {"rank", "alpha", "targets"} (targets sorted in `lora.TARGETS` order).
  """
  path = os.path.join(directory, CONFIG_FILE)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{directory} is not a PEFT adapter: {CONFIG_FILE} is missing")
  with open(path) as f:
    cfg = json.load(f)
  if cfg.get("peft_type") != "LORA":
    _refuse(directory, "peft_type", cfg.get("peft_type"), "'LORA'")
  for key, allowed in (
    ("use_rslora", False),
    ("use_dora", False),
    ("fan_in_fan_out", False),
    ("bias", "none"),
  ):
    if cfg.get(key, allowed) != allowed:
      _refuse(directory, key, cfg[key], repr(allowed))
  for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
    if cfg.get(key):
      _refuse(directory, key, cfg[key], "empty (one rank and alpha for every layer)")
  targets = cfg.get("target_modules")
  if isinstance(targets, str) or not targets or any(t not in LORA_TARGETS for t in targets):
    _refuse(directory, "target_modules", targets, f"a list of some of {list(LORA_TARGETS)}")
  return {
    "rank": int(cfg["r"]),
    "alpha": float(cfg["lora_alpha"]),
    "targets": tuple(t for t in LORA_TARGETS if t in targets),
  }


def load(directory: str, config: ModelConfig) -> lora.Params:
  """The adapters of a PEFT directory as our float32 tree (stacked [L, ...]).

  Args:
    directory: holds `adapter_config.json` and `adapter_model.safetensors`.
    config: the model the adapters go on; its lora_rank, lora_alpha and lora_targets must be
      the adapter's (`read_config`), so the scale and the tree are the ones trained.

  Raises:
    ValueError: the adapter does not match `config`, or holds a tensor we do not map, or lacks one.
  """
  cfg = read_config(directory)
  ours = {
    "rank": config.lora_rank,
    "alpha": float(config.lora_alpha),
    "targets": tuple(config.lora_targets),
  }
  for key in ours:
    if cfg[key] != ours[key]:
      raise ValueError(
        f"{directory}: the adapter's {key} is {cfg[key]!r} but the model's lora_{key} is "
        f"{ours[key]!r}"
      )
  reader = safetensors_io.SafetensorsReader(os.path.join(directory, WEIGHTS_FILE))
  per_layer: dict = {}
  head: dict = {}
  for key in reader.keys():
    if lora.HEAD in cfg["targets"] and _HEAD_COPY.match(key):
      want = lora.projection_shape(config, lora.HEAD)[::-1]
      if tuple(reader.shape(key)) != want:
        raise ValueError(
          f"{directory}: {key} has shape {reader.shape(key)}, the model's head {want}"
        )
      continue
    value = reader.tensor(key)
    m = _HEAD_KEY.match(key)
    if m is not None and lora.HEAD in cfg["targets"]:
      head["lora_" + m.group(1).lower()] = jnp.asarray(np.asarray(value, np.float32).T)
      continue
    m = _KEY.match(key)
    if m is None or m.group(3) not in cfg["targets"]:
      raise ValueError(f"{directory}: tensor {key!r} is not an adapter of {list(cfg['targets'])}")
    layer, name, which = int(m.group(1)), m.group(3), m.group(4)
    per_layer[(name, which, layer)] = np.asarray(value, np.float32).T
  tree: dict = {}
  if lora.HEAD in cfg["targets"]:
    want = lora.projection_shape(config, lora.HEAD)
    want = {"lora_a": (want[0], config.lora_rank), "lora_b": (config.lora_rank, want[1])}
    for leaf, shape in want.items():
      if leaf not in head:
        raise ValueError(f"{directory}: the lm_head adapter's {leaf} is missing")
      if head[leaf].shape != shape:
        raise ValueError(
          f"{directory}: lm_head {leaf} has shape {head[leaf].shape}, the model needs {shape}"
        )
    tree[lora.HEAD] = head
  for name in (t for t in cfg["targets"] if t != lora.HEAD):
    module = lora.TARGETS[name][0]
    stacked = {}
    for which, leaf in (("A", "lora_a"), ("B", "lora_b")):
      missing = [i for i in range(config.num_layers) if (name, which, i) not in per_layer]
      if missing:
        raise ValueError(f"{directory}: {name}.lora_{which} is missing for layers {missing}")
      stacked[leaf] = jnp.asarray(
        np.stack([per_layer[(name, which, i)] for i in range(config.num_layers)])
      )
    fan_in, fan_out = lora.projection_shape(config, name)
    want = {"lora_a": (config.num_layers, fan_in, config.lora_rank)}
    want["lora_b"] = (config.num_layers, config.lora_rank, fan_out)
    for leaf, shape in want.items():
      if stacked[leaf].shape != shape:
        raise ValueError(
          f"{directory}: {name} {leaf} has shape {stacked[leaf].shape}, the model needs {shape}"
        )
    tree.setdefault("layers", {}).setdefault(module, {})[name] = stacked
  return tree
