"""One SeeUPO update with LoRA adapters against one with every weight trained, side by side.

Same model, batch and algorithm (SeeUPO, T turns, the authors' settings: one epoch of one
mini-batch per turn, AdamW, KL to the reference). `full`: every weight trained, float32 Adam
moments, the KL reference a second copy of the weights. `lora`: adapters of rank r on every
projection (q/k/v/o, gate/up/down), the base frozen (no gradient, no optimizer state) and the KL
reference the base itself. Each round times both updates, interleaved in one process (ABBA);
medians over rounds. Memory: the compiled update's `memory_analysis()` (arguments, outputs not
aliased to the donated state, temporaries) and the train state's bytes, for both.

  .venv/bin/python benchmarks/bench_lora.py                         # qwen3-bench, 16 x 512, T = 4, r = 16
  .venv/bin/python benchmarks/bench_lora.py --rank 64 --rounds 5 --json out.json
  .venv/bin/python benchmarks/bench_lora.py --part decode --batch 8     # the sampler's side

`--part decode` times one sampler call (prefill of `--prompt` tokens, `--new` greedy tokens)
with the base alone, the adapters unmerged (the sampler's way), merged into the kernels, and
unmerged on an NF4 base, and the merge itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from seeupo_jax import learner, sharding  # noqa: E402
from seeupo_jax.devtools import aot  # noqa: E402
from seeupo_jax.models import config as config_lib  # noqa: E402
from seeupo_jax.models import lora  # noqa: E402
from seeupo_jax.models import qwen  # noqa: E402

import bench_learner  # noqa: E402

_MIB = 2.0**20


def build(name: str, args, mesh, batch):
  """(compiled update, state, facts) of variant `name` ("full" or "lora")."""
  rank = args.rank if name == "lora" else 0
  config = config_lib.get_preset(
    args.preset,
    dtype=args.dtype,
    param_dtype=args.dtype,
    remat=args.remat,
    attn_block_size=args.attn_block,
    lora_rank=rank,
    lora_alpha=2.0 * max(rank, 1),
  )
  params = learner.shard_params(qwen.init_params(config, jax.random.key(0)), mesh)
  optimizer = learner.default_optimizer(learning_rate=1e-6)
  if rank:
    adapters, base = lora.split(params)
    state = learner.init_state(adapters, optimizer, base=base)
  else:
    state = learner.init_state(params, optimizer, ref_params=jax.tree.map(jnp.copy, params))
  cfg = learner.LearnerConfig(algorithm="seeupo", num_turns=args.turns)
  step = learner.make_update(learner.qwen_logprob_fn(config), optimizer, cfg, jit=False)
  start = time.perf_counter()
  with jax.set_mesh(mesh):
    compiled = jax.jit(step, donate_argnums=(0,)).lower(state, batch, jax.random.key(0)).compile()
  compile_s = time.perf_counter() - start
  ma = compiled.memory_analysis()
  facts = {
    "compile_s": round(compile_s, 1),
    "trained_params": sum(x.size for x in jax.tree.leaves(state.params)),
    "state_MiB": {k: round(v / _MIB, 2) for k, v in aot.state_bytes(state).items()},
    "temp_MiB": round(ma.temp_size_in_bytes / _MIB, 2),
    "peak_MiB": round(
      (
        ma.argument_size_in_bytes
        + ma.output_size_in_bytes
        - ma.alias_size_in_bytes
        + ma.temp_size_in_bytes
      )
      / _MIB,
      2,
    ),
  }
  return compiled, state, facts


def decode(args) -> dict:
  """One sampler call (prefill + `--new` tokens, greedy) per variant and round: the base alone,
  the base with the adapters unmerged (what the sampler runs), the adapters merged into a copy
  of the kernels (what a merge per iteration would give), the adapters unmerged on an NF4
  base, and unmerged with one more on the lm_head; plus the time of the merge itself."""
  from seeupo_jax import sampling  # noqa: PLC0415
  from seeupo_jax.models import quant  # noqa: PLC0415

  config = config_lib.get_preset(
    args.preset,
    dtype=args.dtype,
    param_dtype=args.dtype,
    lora_rank=args.rank,
    lora_alpha=2.0 * args.rank,
  )
  params = qwen.init_params(config, jax.random.key(0))
  keys = iter(jax.random.split(jax.random.key(1), 64))
  adapters, base = lora.split(params)
  adapters = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(next(keys), x.shape), adapters)
  plain = config.replace(lora_rank=0)
  merge = jax.jit(lambda p: lora.merge(p, config.lora_scale))
  variants = {
    "base": (plain, base),
    "unmerged": (config, lora.combine(base, adapters)),
    "merged": (plain, merge(lora.combine(base, adapters))),
    "nf4_unmerged": (
      config.replace(quantize="nf4"),
      lora.combine(quant.quantize_params(base, "nf4"), adapters),
    ),
  }
  # The same adapters plus one on the lm_head (target "lm_head": W + s A B each step).
  head_config = config.replace(lora_targets=config_lib.LORA_TARGETS)
  head = lora.init_adapters(head_config, jax.random.key(2))["lm_head"]
  head = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(next(keys), x.shape), head)
  variants["unmerged_with_head"] = (head_config, lora.combine(base, {**adapters, "lm_head": head}))
  sampling_config = sampling.SamplingConfig(max_new_tokens=args.new, greedy=True)
  rng = np.random.default_rng(0)
  prompt = jnp.asarray(rng.integers(1, config.vocab_size, (args.batch, args.prompt)), jnp.int32)
  valid = jnp.ones(prompt.shape, bool)
  samplers = {name: sampling.make_sampler(c, sampling_config) for name, (c, _) in variants.items()}
  for name, (_, p) in variants.items():  # compile
    jax.block_until_ready(samplers[name](p, prompt, valid, jax.random.key(0)).tokens)
  times = {name: [] for name in (*variants, "merge")}
  unmerged = variants["unmerged"][1]
  jax.block_until_ready(merge(unmerged))
  for r in range(args.rounds):
    order = list(times) if r % 2 == 0 else list(times)[::-1]
    for name in order:
      start = time.perf_counter()
      if name == "merge":
        jax.block_until_ready(merge(unmerged))
      else:
        p = variants[name][1]
        jax.block_until_ready(samplers[name](p, prompt, valid, jax.random.key(r)).tokens)
      times[name].append(time.perf_counter() - start)
  med = {name: statistics.median(v) for name, v in times.items()}
  return {
    "device": f"{jax.devices()[0].platform} x {len(jax.devices())}",
    "preset": args.preset,
    "dtype": args.dtype,
    "batch": args.batch,
    "prompt": args.prompt,
    "new": args.new,
    "rank": args.rank,
    "call_s": {k: round(v, 4) for k, v in med.items()},
    "over_base": {k: round(med[k] / med["base"], 3) for k in variants},
    "rounds": {k: [round(x, 4) for x in v] for k, v in times.items()},
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--part", default="update", choices=("update", "decode"))
  parser.add_argument("--prompt", type=int, default=64, help="decode: prompt tokens")
  parser.add_argument("--new", type=int, default=64, help="decode: new tokens per row")
  parser.add_argument("--preset", default="qwen3-bench", choices=sorted(config_lib.PRESETS))
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--seq", type=int, default=512)
  parser.add_argument("--turns", type=int, default=4)
  parser.add_argument("--rank", type=int, default=16)
  parser.add_argument("--rounds", type=int, default=4)
  parser.add_argument("--dtype", default="float32", choices=config_lib.DTYPES)
  parser.add_argument("--remat", default="dots", choices=config_lib.REMAT_POLICIES)
  parser.add_argument("--attn-block", type=int, default=32)
  parser.add_argument("--json", default="")
  args = parser.parse_args()
  if args.part == "decode":
    result = decode(args)
    print(json.dumps(result, indent=1))
    if args.json:
      with open(args.json, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    return

  mesh = sharding.make_mesh(data=-1, fsdp=1, tensor=1)
  vocab = config_lib.get_preset(args.preset).vocab_size
  host_batch = bench_learner.make_batch(args.batch, args.seq, args.turns, vocab)
  batch = learner.shard_batch(host_batch, mesh)
  variants = {name: build(name, args, mesh, batch) for name in ("full", "lora")}
  states = {name: v[1] for name, v in variants.items()}
  times = {name: [] for name in variants}
  with jax.set_mesh(mesh):
    for name, (compiled, _, _) in variants.items():  # a first call outside the timing
      states[name], metrics = compiled(states[name], batch, jax.random.key(0))
      jax.block_until_ready(metrics)
    for r in range(args.rounds):
      order = list(variants) if r % 2 == 0 else list(variants)[::-1]
      for name in order:
        start = time.perf_counter()
        states[name], metrics = variants[name][0](states[name], batch, jax.random.key(r + 1))
        jax.block_until_ready(metrics)
        times[name].append(time.perf_counter() - start)
  med = {name: statistics.median(v) for name, v in times.items()}
  result = {
    "device": f"{jax.devices()[0].platform} x {len(jax.devices())}",
    "preset": args.preset,
    "dtype": args.dtype,
    "batch": [args.batch, args.seq],
    "turns": args.turns,
    "rank": args.rank,
    "update_s": {k: round(v, 4) for k, v in med.items()},
    "lora_over_full": round(med["lora"] / med["full"], 3),
    "rounds": {k: [round(x, 4) for x in v] for k, v in times.items()},
    **{name: v[2] for name, v in variants.items()},
  }
  print(json.dumps(result, indent=1))
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
