"""Forward+backward tokens/s: our Flax Qwen3 vs transformers' PyTorch Qwen3, side by side.

Both models get the same config and the same batch; one step is the mean
next-token cross-entropy and its gradient w.r.t. all parameters (ours:
`token_logprobs` under `jax.value_and_grad`, jitted; torch: `model(ids,
labels=ids).loss.backward()`). Rounds alternate between the two (ABBA order) so
machine noise hits both; the report gives the median step time of each, their
ratio, and the ratio within each round (how many rounds each side won).

  .venv/bin/python benchmarks/bench_model.py                      # CPU, hidden 256, 4 layers, 8 x 512
  .venv/bin/python benchmarks/bench_model.py --mfu --preset qwen3-0.6b --dtype bfloat16 \
      --batch 8 --seq 2048 --no-torch                             # GPU: MFU of the 0.6B preset
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

if "--cpu-devices" in sys.argv:  # must be set before jax is imported
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count="
    + sys.argv[sys.argv.index("--cpu-devices") + 1]
  )
if "--one-core" in sys.argv:  # before jax and torch start their thread pools
  # XLA:CPU's YNNPACK dots run on their own threads whatever --xla_cpu_multi_thread_eigen
  # says (measured: 1.9 cores busy with it off), so pin the whole process to one core.
  os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import NamedSharding

from seeupo_jax import sharding
from seeupo_jax.models import config as config_lib
from seeupo_jax.models import qwen


def make_jax_step(config, chunk_size, splits=1):
  """Jitted (params, ids) -> (loss, grads) of the mean next-token NLL.

  splits > 1 scores the batch in that many independent row groups (same loss
  and gradient): independent chains that XLA:CPU may run on different threads.
  """

  def group_logp(params, ids):
    b, s = ids.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    targets = jnp.concatenate([ids[:, 1:], ids[:, :1]], axis=1)
    return qwen.token_logprobs(
      params, ids, targets, positions, config=config, chunk_size=chunk_size
    )

  def loss_fn(params, ids):
    groups = jnp.split(ids, splits, axis=0)
    logp = jnp.concatenate([group_logp(params, g) for g in groups], axis=0)
    return -jnp.mean(logp[:, :-1])

  return jax.jit(jax.value_and_grad(loss_fn))


def make_torch_step(config, attn_implementation, threads):
  """(ids) -> loss of transformers' Qwen3ForCausalLM with the same config, backward included."""
  import torch
  import transformers

  if threads:
    torch.set_num_threads(threads)
  hf = config.to_hf_dict()
  hf.pop("architectures"), hf.pop("model_type"), hf.pop("torch_dtype"), hf.pop("dtype")
  cls_config = transformers.Qwen3Config if config.qk_norm else transformers.Qwen2Config
  model = transformers.Qwen3ForCausalLM if config.qk_norm else transformers.Qwen2ForCausalLM
  torch.manual_seed(0)
  m = model(cls_config(**hf, attn_implementation=attn_implementation)).float().train()

  def step(ids):
    m.zero_grad(set_to_none=True)
    loss = m(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item()

  return step


def time_steps(step, n):
  times = []
  for _ in range(n):
    start = time.perf_counter()
    step()
    times.append(time.perf_counter() - start)
  return times


def train_flops_per_token(config, seq):
  """6 * (matmul params) + 12 * layers * seq * heads * head_dim (causal attn counted in full)."""
  d, f, l = config.hidden_size, config.intermediate_size, config.num_layers
  attn_params = d * config.head_dim * (2 * config.num_heads + 2 * config.num_kv_heads)
  matmul_params = l * (attn_params + 3 * d * f) + d * config.vocab_size
  return 6 * matmul_params + 12 * l * seq * config.num_heads * config.head_dim


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="qwen3-bench", choices=sorted(config_lib.PRESETS))
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=512)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--steps", type=int, default=3, help="steps per round per framework")
  parser.add_argument("--dtype", default="float32", choices=config_lib.DTYPES)
  # Defaults: remat "dots" and attention blocks of 32 (fastest measured on the 2-core CPU,
  # BENCHMARKS.md); the chunk is token_logprobs' own default.
  parser.add_argument("--remat", default="dots", choices=config_lib.REMAT_POLICIES)
  parser.add_argument("--no-scan", action="store_true", help="unroll the layers")
  parser.add_argument("--attn-block", type=int, default=32, help="ModelConfig.attn_block_size")
  parser.add_argument(
    "--chunk", type=int, default=256, help="token_logprobs chunk_size (its default)"
  )
  parser.add_argument(
    "--splits", type=int, default=1, help="score the batch as N independent row groups"
  )
  parser.add_argument("--torch-attn", default="sdpa", choices=["sdpa", "eager"])
  parser.add_argument("--torch-threads", type=int, default=0)
  parser.add_argument("--no-torch", action="store_true")
  parser.add_argument(
    "--cpu-devices",
    type=int,
    default=0,
    help="split the CPU into N XLA devices and shard the batch over them (data parallel)",
  )
  parser.add_argument(
    "--one-core",
    action="store_true",
    help="pin the process (JAX and torch) to one CPU core; torch then uses 1 thread",
  )
  parser.add_argument("--mfu", action="store_true", help="report MFU (needs --peak-tflops)")
  parser.add_argument("--peak-tflops", type=float, default=989.0, help="H100/H200 bf16 dense")
  args = parser.parse_args()

  config = config_lib.get_preset(
    args.preset,
    dtype=args.dtype,
    param_dtype=args.dtype,
    remat=args.remat,
    scan_layers=not args.no_scan,
    attn_block_size=args.attn_block,
  )
  rng = np.random.default_rng(0)
  ids_np = rng.integers(0, config.vocab_size, (args.batch, args.seq)).astype(np.int32)
  tokens = args.batch * args.seq

  params = qwen.init_params(config, jax.random.key(0))
  ids = jnp.asarray(ids_np)
  if args.cpu_devices:
    mesh = sharding.make_mesh(data=args.cpu_devices, fsdp=1, tensor=1)
    params = jax.device_put(params, sharding.param_shardings(params, mesh))
    ids = jax.device_put(ids, NamedSharding(mesh, sharding.TOKENS))
  jax_step = make_jax_step(config, args.chunk, args.splits)
  t0 = time.perf_counter()
  jax_step = jax_step.lower(params, ids).compile()
  compile_s = time.perf_counter() - t0
  jax.block_until_ready(jax_step(params, ids))

  def run_jax():
    jax.block_until_ready(jax_step(params, ids))

  run_torch = None
  if not args.no_torch:
    import torch

    threads = 1 if args.one_core else args.torch_threads
    torch_step = make_torch_step(config, args.torch_attn, threads)
    ids_t = torch.tensor(ids_np, dtype=torch.long)
    torch_step(ids_t)
    run_torch = functools.partial(torch_step, ids_t)

  runs = {"jax": run_jax, "torch": run_torch} if run_torch else {"jax": run_jax}
  times = {side: [] for side in runs}  # every step's seconds
  cpu_s = {side: 0.0 for side in runs}  # process CPU seconds
  round_ratios = []  # torch median / ours within each round (same machine state)
  for round_index in range(args.rounds):
    # ABBA order: neither side always runs right after the other's allocations.
    order = list(runs) if round_index % 2 == 0 else list(runs)[::-1]
    round_times = {}
    for side in order:
      cpu0 = time.process_time()
      round_times[side] = time_steps(runs[side], args.steps)
      cpu_s[side] += time.process_time() - cpu0
      times[side] += round_times[side]
    if run_torch:
      round_ratios.append(
        statistics.median(round_times["torch"]) / statistics.median(round_times["jax"])
      )
  jax_times = times["jax"]

  result = {
    "preset": args.preset,
    "batch": args.batch,
    "seq": args.seq,
    "dtype": args.dtype,
    "remat": args.remat,
    "scan_layers": not args.no_scan,
    "attn_block": args.attn_block,
    "splits": args.splits,
    "device": jax.devices()[0].device_kind,
    "jax_devices": len(jax.devices()),
    "cpu_cores": len(os.sched_getaffinity(0)),
    "chunk": args.chunk,
    "jax_compile_s": round(compile_s, 2),
    "jax_step_s": round(statistics.median(jax_times), 6),
    "jax_tokens_per_s": round(tokens / statistics.median(jax_times), 1),
    "jax_cores_busy": round(cpu_s["jax"] / sum(jax_times), 2),
    "load_avg_1min": round(os.getloadavg()[0], 2),
  }
  if run_torch:
    result["torch_attn"] = args.torch_attn
    result["torch_threads"] = __import__("torch").get_num_threads()
    torch_times = times["torch"]
    result["torch_step_s"] = round(statistics.median(torch_times), 6)
    result["torch_tokens_per_s"] = round(tokens / statistics.median(torch_times), 1)
    result["torch_cores_busy"] = round(cpu_s["torch"] / sum(torch_times), 2)
    result["ratio_jax_over_torch"] = round(
      statistics.median(torch_times) / statistics.median(jax_times), 3
    )
    result["round_ratios"] = [round(r, 3) for r in round_ratios]
    result["rounds_jax_faster"] = f"{sum(r >= 1.0 for r in round_ratios)}/{len(round_ratios)}"
  if args.mfu:
    flops = train_flops_per_token(config, args.seq) * tokens
    result["model_tflops_per_step"] = round(flops / 1e12, 3)
    result["mfu"] = round(flops / statistics.median(jax_times) / (args.peak_tflops * 1e12), 4)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
