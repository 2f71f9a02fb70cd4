"""Ahead-of-time compiles of an iteration's programs on abstract arrays, and what each costs a chip.

    state = aot.abstract_state(model_config, optimizer, mesh, master_weights=True, ref=True)
    batch = aot.abstract_batch(rows, length, mesh)
    with jax.set_mesh(mesh):
      lowered = update.lower(state, batch, aot.abstract_key(mesh))  # learner.make_update's
    cost = aot.compile_program("update", lowered)      # ProgramCost: bytes, flops, collectives
    aot.roofline(cost, aot.CHIPS["v5p"])               # the lower bound of its time

The arrays are `jax.ShapeDtypeStruct`s with their `NamedSharding`s: nothing is allocated, and the
mesh may be made of a TPU topology's devices (`jax.experimental.topologies.get_topology_desc`)
on a CPU host, so the TPU compiler itself says what fits (MaxText's `train_compile.py` does the
same). The figures are per chip: XLA partitions the program into one SPMD program per device.

Bytes live at once while a program runs (`peak_bytes`):

    arguments + outputs - outputs aliased to donated arguments + temporaries

XLA's `cost_analysis` counts a `while` loop's body once whatever its trip count (the layers'
`lax.scan`, the update's turn scan): its flops and bytes are a floor, not the program's total.
`model_flops` gives the transformer's count from its shape instead.
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from seeupo_jax import learner
from seeupo_jax import sharding
from seeupo_jax.devtools import hlo_collectives
from seeupo_jax.learner import precision
from seeupo_jax.models import lora
from seeupo_jax.models import qwen
from seeupo_jax.models.config import ModelConfig

GIB = 2.0**30


@dataclasses.dataclass(frozen=True)
class Chip:
  """A chip's published figures (bf16 dense peak; HBM; per-chip ICI or NVLink, both directions)."""

  name: str
  peak_flops: float  # FLOP/s, bf16 dense
  hbm_bytes: float
  hbm_bandwidth: float  # bytes/s
  link_bandwidth: float  # bytes/s, bidirectional, per chip
  source: str


CHIPS = {
  "v5e": Chip("TPU v5e", 197e12, 16e9, 819e9, 400e9, "cloud.google.com/tpu/docs/v5e"),
  "v5p": Chip("TPU v5p", 459e12, 95e9, 2765e9, 600e9, "cloud.google.com/tpu/docs/v5p (4800 Gbps)"),
  "v6e": Chip("TPU v6e", 918e12, 32e9, 1638e9, 800e9, "cloud.google.com/tpu/docs/v6e"),
  "h100": Chip("H100 SXM", 989e12, 80e9, 3.35e12, 900e9, "NVIDIA H100 datasheet"),
  "h200": Chip("H200 SXM", 989e12, 141e9, 4.8e12, 900e9, "NVIDIA H200 datasheet"),
}

SLICES = {  # the slices users rent: name -> (chip, topology for get_topology_desc)
  "v5e-4": ("v5e", "v5e:2x2"),
  "v5e-8": ("v5e", "v5e:2x4"),
  "v5e-16": ("v5e", "v5e:4x4"),
  "v5e-32": ("v5e", "v5e:4x8"),
  "v5p-8": ("v5p", "v5p:2x2x1"),
  "v5p-16": ("v5p", "v5p:2x2x2"),
  "v5p-32": ("v5p", "v5p:2x2x4"),
  "v6e-8": ("v6e", "v6e:2x4"),
  "v6e-16": ("v6e", "v6e:4x4"),
}


# The GPU compiler's description of a chip (XLA's `GpuTargetConfigProto`, the fields it needs to
# compile without the device; figures from XLA's xla/backends/gpu/target_config/specs/*.txtpb).
GPU_TARGETS = {
  "h100": dict(name="NVIDIA H100 80GB HBM3", memory=84942979072, bandwidth=3352320000000),
  "h200": dict(name="NVIDIA H200 141GB HBM3e", memory=151397597184, bandwidth=4800000000000),
}


def gpu_target_config(kind: str) -> str:
  """The text `GpuTargetConfigProto` of a Hopper GPU of `GPU_TARGETS` (132 SMs, sm_90)."""
  t = GPU_TARGETS[kind]
  return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {t["bandwidth"]}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {t["memory"]}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 1 }}
device_description_str: "{t["name"]}"
"""


def topology_devices(topology: str) -> list:
  """Compile-only devices of a slice, on any host:

  a TPU slice of `SLICES` ("v5p-16") or a libtpu topology ("v5p:2x2x2"): needs `libtpu`
    (the pip extra `tpu-compile`);
  "h100:8", "h200:8": N GPUs of one node; needs jax's CUDA plugin (`jax-cuda12-plugin` and
    `jax-cuda12-pjrt` at jax's version, installed with --no-deps: no CUDA libraries, no GPU).
  """
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top

  kind, _, count = topology.partition(":")
  if kind in GPU_TARGETS:
    desc = topologies.get_topology_desc(
      platform="cuda", topology=f"1x1x{int(count or 8)}", target_config=gpu_target_config(kind)
    )
    return list(desc.devices)
  name = SLICES[topology][1] if topology in SLICES else topology
  return list(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)


# ----------------------------------------------------------------------------------------------
# Abstract arguments.


def abstract(tree, shardings):
  """`tree`'s leaves as ShapeDtypeStructs on `shardings` (a tree of the same structure)."""
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
  )


def abstract_params(model_config: ModelConfig, mesh: Mesh):
  """The params `qwen.init_params` makes, on the learner's shardings (`sharding.param_shardings`)."""
  shapes = qwen.params_shape(model_config)
  return abstract(shapes, sharding.param_shardings(shapes, mesh))


def abstract_state(
  model_config: ModelConfig,
  optimizer,
  mesh: Mesh,
  *,
  master_weights: bool,
  ref: bool,
  ref_dtype: Optional[str] = None,
) -> learner.TrainState:
  """The `TrainState` `learner.init_state(params, optimizer, ref_params=...,
  master_weights=..., base=...)` builds, as ShapeDtypeStructs on the params' shardings.

  ref: the state holds KL reference params (`LearnerConfig.kl_coef > 0`), in `ref_dtype`
  (default: the params' dtype). With LoRA (`model_config.lora_rank` > 0) the state's params
  are the adapters, the base (quantized with `model_config.quantize`) is `base` and is the KL
  reference itself: `ref` adds nothing.
  """
  params = abstract_params(model_config, mesh)
  base = None
  if model_config.lora_rank:
    params, base = lora.split(params)
    ref = False
  optimizer = precision.resolve(optimizer, params, master_weights)
  opt_state = abstract(
    jax.eval_shape(optimizer.init, params),
    learner.opt_state_shardings(optimizer, params, master_weights=False),
  )
  ref_params = None
  if ref:
    ref_params = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, jnp.dtype(ref_dtype or x.dtype), sharding=x.sharding),
      params,
    )
  counter = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))
  return learner.TrainState(
    params, opt_state, ref_params, None, None, counter, counter, counter, base=base
  )


def abstract_batch(rows: int, length: int, mesh: Mesh) -> learner.Batch:
  """A `learner.Batch` of `rows` trajectories of `length` tokens, rows over the batch axes."""
  shapes = learner.Batch(
    tokens=jax.ShapeDtypeStruct((rows, length), jnp.int32),
    token_valid=jax.ShapeDtypeStruct((rows, length), jnp.bool_),
    turn_ids=jax.ShapeDtypeStruct((rows, length), jnp.int32),
    sample_logp=jax.ShapeDtypeStruct((rows, length), jnp.float32),
    rewards=jax.ShapeDtypeStruct((rows,), jnp.float32),
    group_ids=jax.ShapeDtypeStruct((rows,), jnp.int32),
    row_valid=jax.ShapeDtypeStruct((rows,), jnp.bool_),
  )
  return abstract(shapes, learner.batch_shardings(shapes, mesh))


def abstract_key(mesh: Mesh):
  """A typed PRNG key, replicated."""
  dtype = jax.eval_shape(jax.random.key, 0).dtype  # no array: the mesh may not run here
  return jax.ShapeDtypeStruct((), dtype, sharding=NamedSharding(mesh, P()))


def bytes_per_device(tree) -> int:
  """Bytes of the shard each device holds of every leaf of `tree` (ShapeDtypeStructs or arrays
  with shardings)."""
  total = 0
  for x in jax.tree.leaves(tree):
    size = 1
    for d in x.sharding.shard_shape(x.shape):
      size *= d
    total += size * jnp.dtype(x.dtype).itemsize
  return total


def state_bytes(state: learner.TrainState) -> dict[str, int]:
  """Bytes per device of each part of the state: params, base (LoRA's frozen weights),
  ref_params, masters, optimizer."""
  out = {"params": bytes_per_device(state.params)}
  if state.base is not None:
    out["base"] = bytes_per_device(state.base)
  if state.ref_params is not None:
    out["ref_params"] = bytes_per_device(state.ref_params)
  if isinstance(state.opt_state, learner.MasterWeightsState):
    out["masters"] = bytes_per_device(state.opt_state.params)
    out["optimizer"] = bytes_per_device(state.opt_state.inner_state)
  else:
    out["optimizer"] = bytes_per_device(state.opt_state)
  return out


# ----------------------------------------------------------------------------------------------
# Compiling and reading a program.


@dataclasses.dataclass(frozen=True)
class ProgramCost:
  """One compiled program's cost per chip (`compile_program`).

  error: the compiler's refusal (None when it compiled); then `needed_bytes` is what its
  message says the program needs (HLO temporaries or total, when it says so), and the
  other figures are 0.
  """

  name: str
  compile_s: float
  argument_bytes: int = 0
  output_bytes: int = 0
  alias_bytes: int = 0
  temp_bytes: int = 0
  flops: float = 0.0  # XLA's count: each loop body once (see the module doc)
  bytes_accessed: float = 0.0
  collectives: dict = dataclasses.field(default_factory=dict)  # hlo_collectives.summarize
  error: Optional[str] = None
  needed_bytes: float = 0.0
  available_bytes: float = 0.0

  @property
  def peak_bytes(self) -> int:
    """Live at once: the (donated) arguments, the outputs not aliased to them, the temporaries."""
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

  @property
  def link_bytes(self) -> float:
    """What one device sends over the interconnect in one run (ring algorithms)."""
    return float(sum(c["link_bytes"] for c in self.collectives.values()))


_SIZE = re.compile(r"([0-9.]+)([KMGT]?)\b")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _size(text: str) -> float:
  match = _SIZE.match(text)
  return float(match.group(1)) * _UNITS[match.group(2)] if match else 0.0


def parse_refusal(message: str) -> tuple[float, float]:
  """(bytes needed, bytes available) from the TPU compiler's RESOURCE_EXHAUSTED message, e.g.
  "... HLO temporaries (564.89G) exceeds available HBM (95.74G) ..." (0 where it says nothing)."""
  needed = re.search(
    r"(?:temporaries|[Uu]sed|requires?|total)\D{0,40}?\(?([0-9.]+[KMGT]?)\)?", message
  )
  available = re.search(r"available HBM\D{0,10}([0-9.]+[KMGT]?)", message) or re.search(
    r"exceeds[^0-9]{0,40}([0-9.]+[KMGT]?)", message
  )
  return (
    _size(needed.group(1)) if needed else 0.0,
    _size(available.group(1)) if available else 0.0,
  )


def compile_program(name: str, lowered) -> ProgramCost:
  """Compiles `lowered` (a `jax.stages.Lowered`) and reads its memory, flops, bytes and
  collectives; a refusal for memory (RESOURCE_EXHAUSTED) comes back as `error`, any other
  compile error propagates."""
  t0 = time.perf_counter()
  try:
    compiled = lowered.compile()
  except Exception as e:  # pylint: disable=broad-except  # XlaRuntimeError, by message
    message = " ".join(str(e).split())
    if "RESOURCE_EXHAUSTED" not in message and "exceeds" not in message:
      raise
    needed, available = parse_refusal(message)
    return ProgramCost(
      name,
      time.perf_counter() - t0,
      error=message[:400],
      needed_bytes=needed,
      available_bytes=available,
    )
  seconds = time.perf_counter() - t0
  ma = compiled.memory_analysis()
  cost = compiled.cost_analysis() or {}
  if isinstance(cost, (list, tuple)):  # older jax: one dict per program
    cost = cost[0] if cost else {}
  ops = hlo_collectives.collectives(compiled.as_text())
  return ProgramCost(
    name,
    seconds,
    argument_bytes=int(ma.argument_size_in_bytes),
    output_bytes=int(ma.output_size_in_bytes),
    alias_bytes=int(ma.alias_size_in_bytes),
    temp_bytes=int(ma.temp_size_in_bytes),
    flops=float(cost.get("flops", 0.0)),
    bytes_accessed=float(cost.get("bytes accessed", 0.0)),
    collectives=hlo_collectives.summarize(ops),
  )


# ----------------------------------------------------------------------------------------------
# Model flops and roofline bounds.


def params_count(model_config: ModelConfig) -> int:
  """Parameters of the model (embedding and head counted once each, once if tied)."""
  return sum(int(x.size) for x in jax.tree.leaves(qwen.params_shape(model_config)))


def matmul_params(model_config: ModelConfig) -> int:
  """The parameters a token multiplies through: every layer's and the LM head (not the
  embedding lookup)."""
  c = model_config
  return params_count(c) - (0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size)


def forward_flops(model_config: ModelConfig, tokens: float, context: float) -> float:
  """Forward FLOPs of `tokens` tokens attending to `context` positions each on average:
  2 x matmul params per token, plus attention's 4 x layers x heads x head_dim x context
  (scores and values)."""
  c = model_config
  attention = 4.0 * c.num_layers * c.num_heads * c.head_dim * context
  return tokens * (2.0 * matmul_params(c) + attention)


def update_flops(
  model_config: ModelConfig, rows: int, length: int, turns: int, *, kl: bool, remat: str
) -> float:
  """Model FLOPs of one SeeUPO update on `rows` x `length` tokens, its T = `turns` turns
  updated one by one, with the turn buckets off (every pass runs on the whole batch):

      per turn:  forward + backward            3 F   (backward = 2 forward)
                 + the recompute of remat       F    ("full"; "dots" and "none": 0)
      once:      the reference pass             F    (KL only)

  where F = the forward FLOPs of the batch (causal: each token attends to length / 2
  positions on average). Turn buckets (`LearnerConfig.turn_buckets`) cut the early turns'
  passes to their prefix; this is the bound without them.
  """
  f = forward_flops(model_config, rows * length, length / 2)
  per_turn = 3.0 * f + (f if remat == "full" else 0.0)
  return turns * per_turn + (f if kl else 0.0)


def decode_step_flops(model_config: ModelConfig, rows: int, context: float) -> float:
  """Model FLOPs of one decode step of `rows` rows that hold `context` tokens each."""
  return forward_flops(model_config, rows, context)


@dataclasses.dataclass(frozen=True)
class Roofline:
  """Lower bounds of one run of a program on `chips` chips, in seconds: no program runs faster
  than its flops at peak, its HBM traffic at full bandwidth, or its collectives at full link
  bandwidth. `seconds` is the largest of the three (they may overlap), `mfu_ceiling` the
  model-flops utilisation at that time."""

  compute_s: float
  memory_s: float
  link_s: float

  @property
  def seconds(self) -> float:
    return max(self.compute_s, self.memory_s, self.link_s)

  @property
  def bound(self) -> str:
    return max(
      ("compute", self.compute_s),
      ("memory", self.memory_s),
      ("link", self.link_s),
      key=lambda kv: kv[1],
    )[0]


def roofline(
  flops_per_chip: float, hbm_bytes_per_chip: float, link_bytes: float, chip: Chip
) -> Roofline:
  """The three lower bounds of a program's time on one chip of kind `chip` (SPMD: every chip
  runs its share at once). `link_bytes` is what one chip sends; the link's bandwidth counts
  both directions, so one direction carries half."""
  return Roofline(
    compute_s=flops_per_chip / chip.peak_flops,
    memory_s=hbm_bytes_per_chip / chip.hbm_bandwidth,
    link_s=link_bytes / (chip.link_bandwidth / 2),
  )


def fits(cost: ProgramCost, hbm_bytes: Optional[float]) -> bool:
  """The program compiled and its peak bytes are within `hbm_bytes` (None: no limit known)."""
  return cost.error is None and (hbm_bytes is None or cost.peak_bytes <= hbm_bytes)


def as_row(cost: ProgramCost, hbm_bytes: Optional[float] = None) -> dict[str, Any]:
  """A ProgramCost as a flat dict (GiB, GFLOP), for JSON and tables; `fits` against
  `hbm_bytes` (the chip's HBM)."""
  row = {
    "program": cost.name,
    "compile_s": round(cost.compile_s, 1),
    "fits": fits(cost, hbm_bytes),
  }
  if cost.error is not None:
    row.update(
      needed_GiB=cost.needed_bytes / GIB, available_GiB=cost.available_bytes / GIB, error=cost.error
    )
    return row
  row.update(
    argument_GiB=cost.argument_bytes / GIB,
    output_GiB=cost.output_bytes / GIB,
    alias_GiB=cost.alias_bytes / GIB,
    temp_GiB=cost.temp_bytes / GIB,
    peak_GiB=cost.peak_bytes / GIB,
    xla_GFLOP=cost.flops / 1e9,
    xla_GB_accessed=cost.bytes_accessed / 1e9,
    link_GB=cost.link_bytes / 1e9,
    collectives={
      k: {"ops": v["ops"], "GB": v["operand_bytes"] / 1e9} for k, v in cost.collectives.items()
    },
  )
  return row
