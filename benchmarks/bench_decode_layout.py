"""Collective bytes per decode step: the learner's layout vs the decode layout, 8 simulated devices.

The sampler (`sampling.make_continuer`, one multi-turn call: prefill + decode loop) is compiled
on 8 simulated CPU devices for each layout of its params:

  learner       the learner's mesh data=1, fsdp=8: FSDP shards in the param dtype (what the
                trainer decoded with before `DecodeLayout`)
  tensor=8      `DecodeLayout(model_config, mesh)`: compute dtype, tensor-parallel over the
                8 devices
  tensor=4,data=2  `DecodeLayout(model_config, mesh, tensor=4)`: two replicas of 4-way tensor
                parallelism, the rows split over them

and the collective ops of one decode step (one iteration of the decode `while` loop, the layer
scan inside it counted once per layer) are read from the compiled HLO text
(`seeupo_jax.hlo_collectives`), with their bytes per device. Also measured: the compiled
memory (`compiled.memory_analysis()`), the reshard's collectives, memory and time, and, on the
small model, that every layout samples the same tokens. The same compilation (shapes only,
nothing allocated) for `--big-preset` (Qwen3-14B) feeds a time estimate for 8 H100s.

  .venv/bin/python benchmarks/bench_decode_layout.py                       # qwen3-bench 16/8 heads + Qwen3-14B
  .venv/bin/python benchmarks/bench_decode_layout.py --preset qwen3-tiny --big-preset none   # quick

The JSON report goes to stdout, a table to stderr.
"""

from __future__ import annotations

import os

# 8 simulated CPU devices, before jax is imported.
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from seeupo_jax import decode_layout  # noqa: E402
from seeupo_jax import hlo_collectives  # noqa: E402
from seeupo_jax import sampling  # noqa: E402
from seeupo_jax import sharding  # noqa: E402
from seeupo_jax.models import config as config_lib  # noqa: E402
from seeupo_jax.models import qwen  # noqa: E402

LAYOUTS = ("learner", "tensor=8", "tensor=4,data=2")


def _abstract(tree, shardings):
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
  )


def _bytes_per_device(tree) -> int:
  """Bytes one device holds of a tree of (abstract) sharded arrays."""
  total = 0
  for x in jax.tree.leaves(tree):
    shard = x.sharding.shard_shape(x.shape)
    total += int(np.prod(shard)) * jnp.dtype(x.dtype).itemsize
  return total


def _memory(compiled) -> dict[str, int]:
  m = compiled.memory_analysis()
  return {
    "argument_bytes": int(m.argument_size_in_bytes),
    "output_bytes": int(m.output_size_in_bytes),
    "alias_bytes": int(m.alias_size_in_bytes),
    "temp_bytes": int(m.temp_size_in_bytes),
  }


def make_layouts(model_config, mesh):
  """{name: (mesh, model config, params shardings, DecodeLayout or None)}."""
  out = {
    "learner": (
      mesh,
      model_config,
      sharding.param_shardings(qwen.params_shape(model_config), mesh),
      None,
    )
  }
  for name, tensor in (("tensor=8", 8), ("tensor=4,data=2", 4)):
    layout = decode_layout.DecodeLayout(model_config, mesh, tensor=tensor)
    out[name] = (layout.mesh, layout.model_config, layout.shardings, layout)
  return out


def _context_shardings(context, mesh):
  replicated = NamedSharding(mesh, P())
  return sampling.Context(
    cache=sharding.cache_shardings(context.cache, mesh), lengths=replicated, pending=replicated
  )


def compile_continuer(model_config, sampling_config, mesh, params, batch, capacity, width):
  """The compiled `continue_sample` for `params` (arrays or abstract), cache sharded on `mesh`."""
  cache_sharding = functools.partial(sharding.cache_shardings, mesh=mesh)
  run = jax.jit(
    sampling.make_continuer(model_config, sampling_config, cache_sharding=cache_sharding, jit=False)
  )
  context = jax.eval_shape(lambda: sampling.init_context(model_config, batch, capacity))
  context = _abstract(context, _context_shardings(context, mesh))
  ids = jax.ShapeDtypeStruct((batch, width), jnp.int32)
  valid = jax.ShapeDtypeStruct((batch, width), jnp.bool_)
  key = jax.eval_shape(lambda: jax.random.key(0))
  params = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params
  )
  with jax.set_mesh(mesh):
    return run, run.lower(params, context, ids, valid, key).compile(), context


def sampler_stats(compiled, context) -> dict:
  text = compiled.as_text()
  return {
    "decode_step": hlo_collectives.summarize(
      hlo_collectives.collectives(text, hlo_collectives.dynamic_loop(text))
    ),
    "call": hlo_collectives.summarize(hlo_collectives.collectives(text)),
    "memory": _memory(compiled),
    "cache_bytes_per_device": _bytes_per_device(context.cache),
  }


def reshard_stats(layout, learner_params) -> dict:
  """Collectives and memory of the donating reshard (the one every iteration after the first runs)."""
  previous = _abstract(
    jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, jnp.dtype(layout.model_config.dtype)), learner_params
    ),
    layout.shardings,
  )
  compiled = layout.reshard_into.lower(learner_params, previous).compile()
  return {
    "collectives": hlo_collectives.summarize(hlo_collectives.collectives(compiled.as_text())),
    "memory": _memory(compiled),
  }


def _run_small(args, model_config, mesh, sampling_config) -> dict:
  """The small model with real arrays: stats, tokens per layout, reshard timing."""
  params = qwen.init_params(model_config, jax.random.key(0))
  learner_params = jax.device_put(params, sharding.param_shardings(params, mesh))
  rng = np.random.default_rng(0)
  b, s = args.batch, args.prompt
  new_ids = jnp.asarray(rng.integers(0, model_config.vocab_size, (b, s)), jnp.int32)
  new_valid = jnp.asarray(np.arange(s)[None, :] >= rng.integers(0, s // 2, (b,))[:, None])
  key = jax.random.key(1)
  report, outputs = {}, {}
  for name, (m, mc, shardings, layout) in make_layouts(model_config, mesh).items():
    p = learner_params if layout is None else layout(learner_params)
    run, compiled, context_abstract = compile_continuer(
      mc, sampling_config, m, p, b, args.capacity, s
    )
    entry = sampler_stats(compiled, context_abstract)
    entry["params_bytes_per_device"] = _bytes_per_device(p)
    context = jax.device_put(
      sampling.init_context(mc, b, args.capacity), _context_shardings(context_abstract, m)
    )
    with jax.set_mesh(m):
      out, _ = compiled(p, context, new_ids, new_valid, key)
      jax.block_until_ready(out)
    outputs[name] = jax.device_get(out)
    if layout is not None:
      times = []
      for i in range(args.reshard_repeats + 1):  # the first call allocates, the rest donate
        fresh = jax.tree.map(lambda x, i=i: x + i * 1e-3, learner_params)
        jax.block_until_ready(fresh)
        t0 = time.perf_counter()
        jax.block_until_ready(layout(fresh))
        if i:
          times.append(time.perf_counter() - t0)
      entry["reshard"] = reshard_stats(layout, learner_params)
      entry["reshard"]["ms_cpu"] = 1e3 * statistics.median(times)
    report[name] = entry
  base = outputs["learner"]
  agree = {}
  for name, out in outputs.items():
    m = base.mask & out.mask
    agree[name] = {
      "tokens_equal": bool(np.array_equal(out.tokens, base.tokens)),
      "tokens_agree": float(np.mean(out.tokens == base.tokens)),
      "logp_max_diff": float(np.max(np.abs(np.where(m, out.logprobs - base.logprobs, 0.0)))),
    }
  return {"layouts": report, "vs_learner": agree}


def _run_big(args, model_config, mesh, sampling_config) -> dict:
  """Shapes only: the compiled sampler and reshard of `model_config` on every layout."""
  learner_params = _abstract(
    qwen.params_shape(model_config),
    sharding.param_shardings(qwen.params_shape(model_config), mesh),
  )
  report = {}
  for name, (m, mc, shardings, layout) in make_layouts(model_config, mesh).items():
    p = learner_params if layout is None else _abstract(qwen.params_shape(mc), shardings)
    _, compiled, context = compile_continuer(
      mc, sampling_config, m, p, args.big_batch, args.big_capacity, args.big_width
    )
    entry = sampler_stats(compiled, context)
    entry["params_bytes_per_device"] = _bytes_per_device(p)
    if layout is not None:
      entry["reshard"] = reshard_stats(layout, learner_params)
    report[name] = entry
  return report


def estimate(big: dict, model_config, args) -> dict:
  """Per decode step and per reshard on 8 H100s, from the compiled figures (lower bounds).

  interconnect = link bytes / NVLink bandwidth + collectives x latency; HBM = (weights the
  step reads + its KV-cache shard) / HBM bandwidth. On the GPU, bf16 collectives carry bf16:
  XLA:CPU promoted them to float32, so their bytes count at half here (bf16 compute only).
  """
  nvlink, hbm, latency = args.nvlink_gbps * 1e9, args.hbm_tbps * 1e12, args.latency_us * 1e-6
  narrow = jnp.dtype(model_config.dtype).itemsize / 4  # the CPU ran bf16 collectives in float32
  full_model = sum(
    int(np.prod(x.shape)) * jnp.dtype(model_config.param_dtype).itemsize
    for x in jax.tree.leaves(qwen.params_shape(model_config))
  )
  out = {}
  for name, entry in big.items():
    step = entry["decode_step"]["total"]
    link = step["link_bytes"] - (1 - narrow) * step["promoted_link_bytes"]
    # The learner layout gathers every layer's weights and reads them whole on every device.
    weights = full_model if name == "learner" else entry["params_bytes_per_device"]
    row = {
      "step_link_bytes_gpu": link,
      "step_interconnect_ms": 1e3 * (link / nvlink + step["ops"] * latency),
      "step_weights_read_bytes": weights,
      "step_hbm_ms": 1e3 * (weights + entry["cache_bytes_per_device"]) / hbm,
    }
    row["step_ms"] = row["step_interconnect_ms"] + row["step_hbm_ms"]
    if "reshard" in entry:
      r = entry["reshard"]["collectives"]["total"]
      r_link = r["link_bytes"] * narrow  # every reshard collective carries compute-dtype values
      moved = full_model / 8 + entry["params_bytes_per_device"]  # read the shard, write the copy
      row["reshard_link_bytes_gpu"] = r_link
      row["reshard_ms"] = 1e3 * (r_link / nvlink + r["ops"] * latency + moved / hbm)
    out[name] = row
  base = out["learner"]["step_ms"]
  for row in out.values():
    row["speedup_vs_learner"] = base / row["step_ms"]
  return out


def _table(report: dict) -> str:
  lines = []
  for section in ("small", "big"):
    if section not in report:
      continue
    layouts = report[section]["layouts"] if section == "small" else report[section]
    lines.append(f"{section}: {report[section + '_model']}")
    lines.append(
      "layout | step collectives | step MB/device (link) | params MB/device | sampler temp MB"
      " | reshard link MB | reshard temp MB | reshard ms (CPU)"
    )
    for name, e in layouts.items():
      step = e["decode_step"]["total"]
      r = e.get("reshard")
      lines.append(
        f"{name} | {step['ops']} | {step['link_bytes'] / 1e6:.2f} | "
        f"{e['params_bytes_per_device'] / 1e6:.1f} | {e['memory']['temp_bytes'] / 1e6:.1f} | "
        + (
          f"{r['collectives']['total']['link_bytes'] / 1e6:.1f} | "
          f"{r['memory']['temp_bytes'] / 1e6:.1f} | {r.get('ms_cpu', float('nan')):.1f}"
          if r
          else "- | - | -"
        )
      )
  if "estimate" in report:
    lines.append("estimate, 8 H100 | link GB/step | interconnect ms | HBM ms | step ms | speed-up")
    for name, row in report["estimate"].items():
      lines.append(
        f"{name} | {row['step_link_bytes_gpu'] / 1e9:.3f} | {row['step_interconnect_ms']:.2f} | "
        f"{row['step_hbm_ms']:.2f} | {row['step_ms']:.2f} | {row['speedup_vs_learner']:.1f}"
      )
  return "\n".join(lines)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="qwen3-bench")
  parser.add_argument("--heads", type=int, default=16, help="query heads (0: the preset's)")
  parser.add_argument("--kv-heads", type=int, default=8, help="kv heads (0: the preset's)")
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--param-dtype", default="float32")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--prompt", type=int, default=16)
  parser.add_argument("--new", type=int, default=16)
  parser.add_argument("--capacity", type=int, default=128)
  parser.add_argument("--reshard-repeats", type=int, default=5)
  parser.add_argument("--big-preset", default="qwen3-14b", help="'none' to skip")
  parser.add_argument("--big-batch", type=int, default=64)
  parser.add_argument("--big-capacity", type=int, default=4096)
  parser.add_argument("--big-width", type=int, default=128, help="new tokens per row per call")
  parser.add_argument("--big-new", type=int, default=512)
  parser.add_argument("--nvlink-gbps", type=float, default=450.0, help="per direction, per GPU")
  parser.add_argument("--hbm-tbps", type=float, default=3.35)
  parser.add_argument("--latency-us", type=float, default=10.0, help="per collective")
  args = parser.parse_args(argv)
  assert jax.device_count() == 8, jax.devices()

  overrides = dict(dtype=args.dtype, param_dtype=args.param_dtype)
  small = config_lib.get_preset(args.preset, **overrides)
  if args.heads:
    small = small.replace(num_heads=args.heads)
  if args.kv_heads:
    small = small.replace(num_kv_heads=args.kv_heads)
  mesh = sharding.make_mesh(data=1, fsdp=-1, tensor=1)
  report = {
    "devices": jax.device_count(),
    "small_model": (
      f"{args.preset} (heads {small.num_heads}, kv heads {small.num_kv_heads}), "
      f"{args.param_dtype} params, {args.dtype} compute, batch {args.batch}, "
      f"{args.prompt} new tokens + {args.new} sampled, capacity {args.capacity}"
    ),
  }
  sc = sampling.SamplingConfig(max_new_tokens=args.new, temperature=1.0)
  report["small"] = _run_small(args, small, mesh, sc)
  if args.big_preset != "none":
    big = config_lib.get_preset(args.big_preset, **overrides)
    report["big_model"] = (
      f"{args.big_preset}, {args.param_dtype} params, {args.dtype} compute, batch "
      f"{args.big_batch}, capacity {args.big_capacity}, {args.big_width} new tokens + "
      f"{args.big_new} sampled (shapes only)"
    )
    big_sc = sampling.SamplingConfig(max_new_tokens=args.big_new, temperature=1.0)
    report["big"] = _run_big(args, big, mesh, big_sc)
    report["estimate"] = estimate(report["big"], big, args)
    report["assumptions"] = {
      "nvlink_gbps_per_direction": args.nvlink_gbps,
      "hbm_tbps": args.hbm_tbps,
      "latency_us_per_collective": args.latency_us,
    }
  print(_table(report), file=sys.stderr)
  print(json.dumps(report, indent=1))
  return report


if __name__ == "__main__":
  main()
