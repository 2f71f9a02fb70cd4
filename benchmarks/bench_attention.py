"""Causal attention forward+backward alone: `layers.causal_attend` vs torch SDPA, side by side.

One layer's attention at the `qwen3-bench` shapes (8 query / 4 key-value heads of
width 32, batch 8 x 512 tokens, float32): the sum of the output times a fixed
random cotangent, and its gradient w.r.t. q, k and v. Ours is jitted (blocks of
`--block` queries); torch is `scaled_dot_product_attention(is_causal=True,
enable_gqa=True)` with autograd. Rounds alternate the order (ABBA); the report
gives each median, the ratio, and the minor page faults of each side's calls.

Alone, each of our calls faults its temporaries in afresh (XLA:CPU allocates
them per execution; inside the model's layer scan they are faulted once per
step, not once per layer). To compare the kernels without that, run with the
glibc settings that keep freed memory mapped:

  .venv/bin/python benchmarks/bench_attention.py
  MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=4000000000 \
      .venv/bin/python benchmarks/bench_attention.py
  .venv/bin/python benchmarks/bench_attention.py --one-core   # both pinned to one core
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

if "--one-core" in sys.argv:  # before jax and torch start their thread pools
  os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})

import jax
import jax.numpy as jnp
import numpy as np

from seeupo_jax.models import layers


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=512)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--kv-heads", type=int, default=4)
  parser.add_argument("--head-dim", type=int, default=32)
  parser.add_argument("--block", type=int, default=32, help="query block (attn_block_size)")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--steps", type=int, default=3, help="steps per round per side")
  parser.add_argument("--one-core", action="store_true", help="pin to one core, torch 1 thread")
  args = parser.parse_args()

  import torch

  if args.one_core:
    torch.set_num_threads(1)
  b, s, h, kv, hd = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
  rng = np.random.default_rng(0)
  q_np, k_np, v_np = (
    rng.standard_normal(shape).astype(np.float32)
    for shape in ((b, s, h, hd), (b, s, kv, hd), (b, s, kv, hd))
  )
  cotangent_np = rng.standard_normal((b, s, h * hd)).astype(np.float32)
  q, k, v, cotangent = map(jnp.asarray, (q_np, k_np, v_np, cotangent_np))
  key_valid = jnp.ones((b, s), bool)

  loss = lambda q, k, v: jnp.sum(layers.causal_attend(q, k, v, key_valid, args.block) * cotangent)
  grad_fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  ours = jax.block_until_ready(grad_fn(q, k, v))

  tq, tk, tv = (
    torch.tensor(x).transpose(1, 2).contiguous().requires_grad_() for x in (q_np, k_np, v_np)
  )
  t_cotangent = torch.tensor(cotangent_np).view(b, s, h, hd).transpose(1, 2)

  def run_torch():
    tq.grad = tk.grad = tv.grad = None
    out = torch.nn.functional.scaled_dot_product_attention(
      tq, tk, tv, is_causal=True, enable_gqa=True
    )
    (out * t_cotangent).sum().backward()

  run_torch()
  # Same gradients (torch's are [B, H, S, hd]; ours [B, S, H, hd]).
  max_grad_diff = max(
    float(np.max(np.abs(np.asarray(g) - t.grad.transpose(1, 2).numpy())))
    for g, t in zip(ours, (tq, tk, tv))
  )

  runs = {"jax": lambda: jax.block_until_ready(grad_fn(q, k, v)), "torch": run_torch}
  times = {side: [] for side in runs}
  faults = {side: [] for side in runs}
  for round_index in range(args.rounds):
    order = list(runs) if round_index % 2 == 0 else list(runs)[::-1]
    for side in order:
      for _ in range(args.steps):
        faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        runs[side]()
        times[side].append(time.perf_counter() - start)
        faults[side].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0)
  median_ms = {side: statistics.median(t) * 1e3 for side, t in times.items()}
  print(
    json.dumps(
      {
        "batch": b,
        "seq": s,
        "heads": h,
        "kv_heads": kv,
        "head_dim": hd,
        "block": args.block,
        "cpu_cores": len(os.sched_getaffinity(0)),
        "device": jax.devices()[0].device_kind,
        "max_grad_diff": max_grad_diff,
        "jax_ms": round(median_ms["jax"], 3),
        "torch_ms": round(median_ms["torch"], 3),
        "ratio_torch_over_jax": round(median_ms["torch"] / median_ms["jax"], 3),
        "jax_page_faults_per_call": int(statistics.median(faults["jax"])),
        "torch_page_faults_per_call": int(statistics.median(faults["torch"])),
      }
    )
  )


if __name__ == "__main__":
  main()
