"""Hugging Face checkpoints <-> our params pytree.

Load: `config.json` plus single or sharded `*.safetensors` (with
`model.safetensors.index.json`). Every parameter is built with
`jax.make_array_from_callback` straight onto its target sharding: the callback
slices each device's block out of the memory-mapped tensors, so the host holds
at most one parameter (and, when sharded, only the blocks it needs), never a
second full copy of the model.

Save: safetensors (one file, or several with an index above a size
threshold) plus `config.json`, written tensor by tensor, loadable by
transformers and vLLM.
"""

from __future__ import annotations

import functools
import json
import os
import re
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, Sharding

from seeupo_jax import sharding as sharding_lib
from seeupo_jax.models import quant
from seeupo_jax.models import qwen
from seeupo_jax.models import safetensors_io
from seeupo_jax.models.config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"

# (our path inside params["layers"], HF name inside model.layers.{i}, HF stores [out, in]).
LAYER_TENSORS = (
  (("input_norm", "scale"), "input_layernorm.weight", False),
  (("attn", "q_proj", "kernel"), "self_attn.q_proj.weight", True),
  (("attn", "q_proj", "bias"), "self_attn.q_proj.bias", False),
  (("attn", "k_proj", "kernel"), "self_attn.k_proj.weight", True),
  (("attn", "k_proj", "bias"), "self_attn.k_proj.bias", False),
  (("attn", "v_proj", "kernel"), "self_attn.v_proj.weight", True),
  (("attn", "v_proj", "bias"), "self_attn.v_proj.bias", False),
  (("attn", "o_proj", "kernel"), "self_attn.o_proj.weight", True),
  (("attn", "o_proj", "bias"), "self_attn.o_proj.bias", False),  # Qwen3 attention_bias only
  (("attn", "q_norm", "scale"), "self_attn.q_norm.weight", False),
  (("attn", "k_norm", "scale"), "self_attn.k_norm.weight", False),
  (("post_attn_norm", "scale"), "post_attention_layernorm.weight", False),
  (("mlp", "gate_proj", "kernel"), "mlp.gate_proj.weight", True),
  (("mlp", "up_proj", "kernel"), "mlp.up_proj.weight", True),
  (("mlp", "down_proj", "kernel"), "mlp.down_proj.weight", True),
)
GLOBAL_TENSORS = (
  (("embed", "embedding"), "model.embed_tokens.weight", False),
  (("final_norm", "scale"), "model.norm.weight", False),
  (("lm_head", "kernel"), "lm_head.weight", True),
)

# Tensors some exports carry that the loader skips on purpose: the rotary `inv_freq` buffers
# (old transformers saved them per layer) are derived from rope_theta and head_dim, which
# config.json gives, so they hold nothing the model needs. Any other tensor the loader does not
# consume is an error (`_check_unused`).
IGNORED_TENSORS = re.compile(r"^model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq$")
_MAX_LISTED = 10


def _get(tree, path):
  for key in path:
    if key not in tree:
      return None
    tree = tree[key]
  return tree


def _set(tree, path, value):
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def load_config(directory: str, **overrides: Any) -> ModelConfig:
  """ModelConfig from `directory/config.json`; overrides set dtype, remat, ..."""
  with open(os.path.join(directory, CONFIG_FILE)) as f:
    return ModelConfig.from_hf_dict(json.load(f), **overrides)


def check_files(directory: str) -> None:
  """Opens every safetensors file of the checkpoint in `directory` and checks its header (sizes,
  dtypes, shapes, offsets), reading no tensor data.

  Raises:
    safetensors_io.SafetensorsError: a file is truncated or its header is bad (the message names
      the file and the tensor).
    FileNotFoundError: no safetensors files, or one the index names is missing.
  """
  _TensorSource(directory)


class _TensorSource:
  """Name -> memory-mapped tensor over the checkpoint's safetensors files (headers checked)."""

  def __init__(self, directory: str):
    index_path = os.path.join(directory, INDEX_FILE)
    if os.path.exists(index_path):
      with open(index_path) as f:
        weight_map = json.load(f)["weight_map"]
      files = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(directory, SINGLE_FILE)):
      files = [SINGLE_FILE]
    else:
      files = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    if not files:
      raise FileNotFoundError(f"no *.safetensors files in {directory}")
    self._readers = {}
    for name in files:
      reader = safetensors_io.SafetensorsReader(os.path.join(directory, name))
      for key in reader.keys():
        self._readers[key] = reader

  def __contains__(self, name: str) -> bool:
    return name in self._readers

  def names(self) -> list[str]:
    """Every tensor name in the checkpoint's files."""
    return list(self._readers)

  def get(self, name: str) -> np.ndarray:
    return self._readers[name].tensor(name)


def _index_tuple(index, ndim):
  return tuple(index) + (slice(None),) * (ndim - len(index))


def _global_block(source, hf_name, transpose, dtype):
  def callback(index):
    tensor = source.get(hf_name)
    tensor = tensor.T if transpose else tensor
    return np.asarray(tensor[_index_tuple(index, tensor.ndim)], dtype=dtype)

  return callback


def _layer_block(source, hf_suffix, transpose, dtype, num_layers):
  def callback(index):
    index = _index_tuple(index, 1)
    rows = []
    for layer in range(num_layers)[index[0]]:
      tensor = source.get(f"model.layers.{layer}.{hf_suffix}")
      tensor = tensor.T if transpose else tensor
      rows.append(np.asarray(tensor[index[1:]], dtype=dtype))
    return np.stack(rows)

  return callback


def load_params(
  directory: str, config: ModelConfig, shardings: Union[None, Mesh, Any] = None
) -> qwen.Params:
  """Reads HF safetensors into the params pytree, parameter by parameter.

  Args:
    directory: checkpoint directory (config.json and *.safetensors).
    config: the model config (e.g. from `load_config`); params are cast to
      config.param_dtype.
    shardings: None (default device), a Mesh (partition rules of
      `sharding.param_shardings`), or a pytree of `jax.sharding.Sharding`
      matching the params.

  Returns:
    params pytree, each leaf a jax.Array placed on its sharding.

  Every tensor in the files must be consumed, so that no checkpoint variant
  (an extra bias, a new module) loads half-read. Two exceptions: rotary
  `inv_freq` buffers (`IGNORED_TENSORS`, derived from the config) and, for a
  tied config, an `lm_head.weight` identical to `model.embed_tokens.weight`.

  Raises:
    KeyError: a tensor the config needs is missing.
    ValueError: a tensor's shape does not match the config; the files hold
      tensors the config does not use (up to 10 named, and their count); a
      tied config's file holds an `lm_head.weight` that differs from the
      embedding.
  """
  source = _TensorSource(directory)
  fmt = config.quantize  # the base is read in param_dtype, then quantized kernel by kernel
  if fmt != "none" and not (shardings is None or isinstance(shardings, Mesh)):
    raise ValueError("load_params: with config.quantize, shardings must be None or a Mesh")
  mesh = shardings if isinstance(shardings, Mesh) else None
  # A HF checkpoint holds the base (adapters: models/lora.py), unquantized.
  config = config.replace(lora_rank=0, quantize="none")
  shapes = qwen.params_shape(config)
  if shardings is None:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: device, shapes)
  elif isinstance(shardings, Mesh):
    shardings = sharding_lib.param_shardings(shapes, shardings)
  dtype = np.dtype(jnp.dtype(config.param_dtype))

  # (our path, HF names, callback, transpose) of every parameter, checked before any is read.
  plan = []
  for path, hf_name, transpose in GLOBAL_TENSORS:
    if _get(shapes, path) is not None:
      plan.append((path, [hf_name], _global_block(source, hf_name, transpose, dtype), transpose))
  for path, suffix, transpose in LAYER_TENSORS:
    full = ("layers",) + path
    if _get(shapes, full) is not None:
      names = [f"model.layers.{i}.{suffix}" for i in range(config.num_layers)]
      callback = _layer_block(source, suffix, transpose, dtype, config.num_layers)
      plan.append((full, names, callback, transpose))

  for path, hf_names, _, transpose in plan:
    target = _get(shapes, path)
    for hf_name in hf_names:
      if hf_name not in source:
        raise KeyError(
          f"checkpoint {directory} lacks tensor {hf_name!r} needed by {'/'.join(path)}"
        )
      shape = tuple(source.get(hf_name).shape)
      ours = tuple(reversed(shape)) if transpose else shape
      if ours != tuple(target.shape[len(target.shape) - len(ours) :]):
        raise ValueError(
          f"tensor {hf_name!r} has shape {shape}, config needs {target.shape} for {'/'.join(path)}"
        )
  _check_unused(source, {name for _, names, _, _ in plan for name in names}, config, directory)

  params = {}
  for path, _, callback, _ in plan:
    target = _get(shapes, path)
    _set(params, path, jax.make_array_from_callback(target.shape, _get(shardings, path), callback))
  if fmt != "none":
    params = _quantize_on(params, fmt, mesh)
  return params


def _quantize_on(params: qwen.Params, fmt: str, mesh: Optional[Mesh]) -> qwen.Params:
  """`quant.quantize_params` one projection at a time, each kernel deleted once its codes
  exist (the host and devices never hold the whole base twice), placed on `mesh`'s rules."""
  quantize = functools.partial(quant.quantize_params, fmt=fmt)
  out = dict(params)
  out["layers"] = {k: dict(v) for k, v in params["layers"].items()}
  for module, names in quant.PROJECTIONS.items():
    for name in names:
      leaves = dict(out["layers"][module][name])
      kernel = leaves.pop("kernel")
      one = {"layers": {module: {name: {"kernel": kernel}}}}
      shardings = None
      if mesh is not None:
        shardings = sharding_lib.param_shardings(jax.eval_shape(quantize, one), mesh)
      codes = jax.jit(quantize, out_shardings=shardings)(one)["layers"][module][name]
      kernel.delete()
      out["layers"][module][name] = {**leaves, **codes}
  return out


def _check_unused(source: _TensorSource, used: set, config: ModelConfig, directory: str):
  """Raises ValueError if the checkpoint holds tensors that `load_params` would not read.

  Tolerated: `IGNORED_TENSORS` (rotary inv_freq buffers), and for a tied config an
  `lm_head.weight` equal to `model.embed_tokens.weight` (transformers' save_pretrained
  of a tied model omits it, but some exporters write the shared matrix twice).
  """
  unused = sorted(n for n in source.names() if n not in used and not IGNORED_TENSORS.match(n))
  if config.tie_word_embeddings and "lm_head.weight" in unused:
    head, embed = source.get("lm_head.weight"), source.get("model.embed_tokens.weight")
    if head.shape != embed.shape or not np.array_equal(head, embed):
      raise ValueError(
        f"checkpoint {directory} has tie_word_embeddings=true but holds an lm_head.weight "
        "that differs from model.embed_tokens.weight; a tied model uses the embedding as "
        "its output projection, so this lm_head.weight would be silently dropped "
        "(set tie_word_embeddings=false in config.json if the head is a separate matrix)"
      )
    unused.remove("lm_head.weight")
  if unused:
    listed = ", ".join(repr(n) for n in unused[:_MAX_LISTED])
    more = f", ... ({len(unused) - _MAX_LISTED} more)" if len(unused) > _MAX_LISTED else ""
    raise ValueError(
      f"checkpoint {directory} holds {len(unused)} tensors that a {config.family} model with "
      f"this config does not use: {listed}{more}. Loading would silently drop them; the "
      "config.json probably describes a different architecture variant"
    )


def load(directory: str, shardings: Union[None, Mesh, Any] = None, **overrides: Any):
  """(config, params) of a HF Qwen2/Qwen3 checkpoint directory; see `load_params`."""
  config = load_config(directory, **overrides)
  return config, load_params(directory, config, shardings)


def _hf_entries(params, config: ModelConfig, out_dtype):
  """[(hf_name, hf_shape, fetch)] in HF order; fetch() -> host np.ndarray."""
  entries = []

  def add(hf_name, leaf, transpose, layer=None):
    shape = leaf.shape[1:] if layer is not None else leaf.shape
    shape = tuple(reversed(shape)) if transpose else tuple(shape)

    def fetch():
      value = leaf if layer is None else leaf[layer]
      value = np.asarray(jax.device_get(value)).astype(out_dtype)
      return value.T if transpose else value

    entries.append((hf_name, shape, fetch))

  add("model.embed_tokens.weight", params["embed"]["embedding"], False)
  for i in range(config.num_layers):
    for path, suffix, transpose in LAYER_TENSORS:
      leaf = _get(params["layers"], path)
      if leaf is not None:
        add(f"model.layers.{i}.{suffix}", leaf, transpose, layer=i)
  add("model.norm.weight", params["final_norm"]["scale"], False)
  if not config.tie_word_embeddings:
    add("lm_head.weight", params["lm_head"]["kernel"], True)
  return entries


def save(
  params: qwen.Params,
  config: ModelConfig,
  directory: str,
  *,
  dtype: Optional[str] = None,
  max_shard_bytes: int = 5 * 2**30,
) -> list[str]:
  """Writes params as a HF checkpoint (safetensors + config.json).

  One `model.safetensors` when everything fits in max_shard_bytes, otherwise
  `model-0000k-of-0000n.safetensors` files plus `model.safetensors.index.json`.
  Tensors are fetched from the devices and written one at a time.

  Args:
    params: params pytree (any sharding, fully addressable).
    config: its ModelConfig.
    directory: output directory (created).
    dtype: storage dtype, "float32" or "bfloat16"; default config.param_dtype.
    max_shard_bytes: size threshold of one safetensors file.

  Returns:
    the safetensors file names written.
  """
  dtype = dtype or config.param_dtype
  if dtype not in ("float32", "bfloat16"):
    raise ValueError(f"save dtype must be one of ('float32', 'bfloat16'), got {dtype!r}")
  if max_shard_bytes <= 0:
    raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
  np_dtype = np.dtype(jnp.dtype(dtype))
  os.makedirs(directory, exist_ok=True)
  entries = _hf_entries(params, config, np_dtype)
  fetchers = {name: fetch for name, _, fetch in entries}
  groups = safetensors_io.shard_entries([(n, s, np_dtype) for n, s, _ in entries], max_shard_bytes)
  if len(groups) == 1:
    files = [SINGLE_FILE]
  else:
    files = [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
  weight_map, total = {}, 0
  for file_name, group in zip(files, groups):
    safetensors_io.write_file(
      os.path.join(directory, file_name),
      group,
      lambda name: fetchers[name](),
      metadata={"format": "pt"},
    )
    for name, shape, _ in group:
      weight_map[name] = file_name
      total += int(np.prod(shape, dtype=np.int64)) * np_dtype.itemsize
  if len(groups) > 1:
    with open(os.path.join(directory, INDEX_FILE), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  elif os.path.exists(os.path.join(directory, INDEX_FILE)):
    os.remove(os.path.join(directory, INDEX_FILE))
  hf_config = config.replace(param_dtype=dtype).to_hf_dict()
  with open(os.path.join(directory, CONFIG_FILE), "w") as f:
    json.dump(hf_config, f, indent=2)
  return files
