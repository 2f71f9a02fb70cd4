"""Per-device memory of one learner update, with and without float32 master weights.

An ahead-of-time compile of the SeeUPO update (`jax.jit(update).lower(...).compile()`) on
abstract arrays (ShapeDtypeStructs with their shardings: nothing is allocated), read with
`memory_analysis()`, for each precision scheme:

  bf16               params bf16, optax's moments bf16 (no master weights: updates round away)
  bf16+masters       params bf16 (the working copy: model, sampler), float32 masters and float32
                     moments in the optimizer state (`learner.with_master_weights`; the default)
  f32params          params float32, computed in bf16 (the model casts at each use), ref float32
  f32params+bf16ref  the same with a bf16 reference copy for the KL term
  lora               LoRA adapters (rank 16, every projection) float32 with float32 Adam
                     moments; the bf16 base frozen and the KL reference (no copy)
  qlora-int8/-nf4    the same on a base whose layer projections are int8 / NF4 (models/quant.py)

The KL reference params are in the state (the authors' kl_coef 0.002). The mesh is fsdp over
all devices. The layers are a `lax.scan`, so compile time does not grow with depth.

  .venv/bin/python benchmarks/bench_learner_memory.py                     # Qwen3-14B, 8 devices
  .venv/bin/python benchmarks/bench_learner_memory.py --schemes bf16+masters,lora,qlora-nf4
  .venv/bin/python benchmarks/bench_learner_memory.py --layers 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

_DEVICES = sys.argv[sys.argv.index("--devices") + 1] if "--devices" in sys.argv else "8"
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_DEVICES}"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from seeupo_jax import learner, sharding  # noqa: E402
from seeupo_jax.devtools import aot  # noqa: E402
from seeupo_jax.models import config as config_lib  # noqa: E402

SCHEMES = {  # name: (param dtype, master weights, reference dtype, LoRA rank, base format)
  "bf16": ("bfloat16", False, "bfloat16", 0, "none"),
  "bf16+masters": ("bfloat16", True, "bfloat16", 0, "none"),
  "f32params": ("float32", False, "float32", 0, "none"),
  "f32params+bf16ref": ("float32", False, "bfloat16", 0, "none"),
  # LoRA on every projection: float32 adapters and Adam moments, the frozen base the reference.
  "lora": ("bfloat16", True, None, 16, "none"),
  "qlora-int8": ("bfloat16", True, None, 16, "int8"),
  "qlora-nf4": ("bfloat16", True, None, 16, "nf4"),
}


def measure(args, scheme: str) -> dict:
  param_dtype, master_weights, ref_dtype, rank, quantize = SCHEMES[scheme]
  rank = rank and args.lora_rank
  overrides = dict(dtype="bfloat16", param_dtype=param_dtype, remat=args.remat)
  overrides.update(lora_rank=rank, lora_alpha=2.0 * max(rank, 1), quantize=quantize)
  if args.layers:
    overrides["num_layers"] = args.layers
  model_config = config_lib.get_preset(args.preset, **overrides)
  mesh = sharding.make_mesh(data=1, fsdp=-1, tensor=1)
  optimizer = learner.default_optimizer()
  config = learner.LearnerConfig(algorithm="seeupo", num_turns=args.turns)
  step = learner.make_update(learner.qwen_logprob_fn(model_config), optimizer, config, jit=False)
  state = aot.abstract_state(
    model_config, optimizer, mesh, master_weights=master_weights, ref=True, ref_dtype=ref_dtype
  )
  batch = aot.abstract_batch(args.rows, args.length, mesh)
  key = aot.abstract_key(mesh)
  out_shardings = (jax.tree.map(lambda x: x.sharding, state), None)
  t0 = time.perf_counter()
  with jax.set_mesh(mesh):
    lowered = jax.jit(step, donate_argnums=(0,), out_shardings=out_shardings).lower(
      state, batch, key
    )
    compiled = lowered.compile()
  seconds = time.perf_counter() - t0
  ma = compiled.memory_analysis()
  gib = 2.0**30
  result = {
    "scheme": scheme,
    "preset": args.preset,
    "layers": model_config.num_layers,
    "devices": jax.device_count(),
    "rows": args.rows,
    "length": args.length,
    "remat": args.remat,
    "lora_rank": rank,
    "quantize": quantize,
    "trained_params": sum(x.size for x in jax.tree.leaves(state.params)),
    "compile_s": round(seconds, 1),
    "argument_GiB": ma.argument_size_in_bytes / gib,
    "output_GiB": ma.output_size_in_bytes / gib,
    "alias_GiB": ma.alias_size_in_bytes / gib,
    "temp_GiB": ma.temp_size_in_bytes / gib,
    # Live at once: the (donated) inputs, the outputs not aliased to them, the temporaries.
    "peak_GiB": (
      ma.argument_size_in_bytes
      + ma.output_size_in_bytes
      - ma.alias_size_in_bytes
      + ma.temp_size_in_bytes
    )
    / gib,
  }
  result.update({f"state/{k}_GiB": v / gib for k, v in aot.state_bytes(state).items()})
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="qwen3-14b")
  parser.add_argument("--layers", type=int, default=0, help="override num_layers (0: preset's)")
  parser.add_argument("--devices", default="8", help="simulated CPU devices (fsdp over all)")
  parser.add_argument("--rows", type=int, default=8)
  parser.add_argument("--length", type=int, default=2048)
  parser.add_argument("--turns", type=int, default=10)
  parser.add_argument("--remat", default="full")
  parser.add_argument("--schemes", default=",".join(SCHEMES))
  parser.add_argument("--lora-rank", type=int, default=16, help="the LoRA schemes' rank")
  parser.add_argument("--json", default="")
  args = parser.parse_args()
  results = []
  for scheme in args.schemes.split(","):
    result = measure(args, scheme)
    results.append(result)
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))
    sys.stdout.flush()
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
