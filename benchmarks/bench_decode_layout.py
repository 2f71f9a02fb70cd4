"""Collective bytes per decode step: the learner's layout vs the decode layout, 8 simulated devices.

The sampler's decode program (the session's `sampling._decode_jit`: the decode loop alone, all
B rows to the end of their replies in one call, over a paged KV cache `qwen.PagedKVCache` of
ceil(capacity / page size) pages per row; the prefill is its own program, `_prefill_jit`, whose
collectives are reported apart) is compiled on 8 simulated CPU devices for each layout of its
params:

  learner       the learner's mesh data=1, fsdp=8: FSDP shards in the param dtype (what the
                trainer decoded with before `DecodeLayout`)
  tensor=8      `DecodeLayout(model_config, mesh)`: compute dtype, tensor-parallel over the
                8 devices
  tensor=4,data=2  `DecodeLayout(model_config, mesh, tensor=4)`: two replicas of 4-way tensor
                parallelism, the rows split over them

and the collective ops of one decode step (one iteration of the decode `while` loop, the layer scan
inside it counted once per layer) are read from the compiled HLO text
(`seeupo_jax.devtools.hlo_collectives`), with their bytes per device ("call": the whole decode
program; "prefill_call": the whole prefill program of `--prompt` / `--big-width` tokens per row).
Also measured: the compiled memory (`compiled.memory_analysis()`), the reshard's collectives, memory
and time, and, on the small model (prefill then decode on real arrays), that every layout samples
the same tokens. The same compilation (shapes only, nothing allocated) for `--big-preset`
(Qwen3-14B) feeds a time estimate for 8 H100s.

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

from seeupo_jax.sampling import layout as decode_layout  # noqa: E402
from seeupo_jax.devtools import hlo_collectives  # noqa: E402
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


def _rows_shardings(rows, mesh):
  """`DecodeRows` shardings: the paged cache as `sharding.cache_shardings`, the rest replicated."""
  replicated = NamedSharding(mesh, P())
  return jax.tree.map(lambda _: replicated, rows).replace(
    cache=sharding.cache_shardings(rows.cache, mesh)
  )


def _init_rows(model_config, sampling_config, batch, capacity, page_size):
  """B idle session rows over a pool of 1 + B x ceil(capacity / page_size) pages."""
  pages = 1 + batch * -(-capacity // page_size)  # page 0: the scratch page
  cache = qwen.init_paged_cache(model_config, pages, page_size)
  return sampling.init_rows(
    cache,
    batch,
    len(sampling_config.stop_token_ids),
    sampling_config.max_new_tokens,
    sampling_config.pad_id,
  )


def _page_table(batch, capacity, page_size):
  """int32[B, W]: row b owns pages 1 + b W .. (b + 1) W."""
  width = -(-capacity // page_size)
  return jnp.asarray(1 + np.arange(batch * width).reshape(batch, width), jnp.int32)


def compile_session(model_config, sampling_config, mesh, params, batch, capacity, page_size, width):
  """The session's compiled (decode, prefill) programs for `params` (arrays or abstract), the
  cache sharded on `mesh`, and the abstract rows.

  decode(params, rows, page_table) runs max_new_tokens steps at most (one call to the end);
  prefill(params, rows, page_table, row_ids, fresh, ids, valid, begin, keys, limits) writes
  `width` tokens of each of the B rows and begins their replies."""
  statics = dict(
    model_config=model_config,
    sampling_config=sampling_config,
    cache_sharding=functools.partial(sharding.cache_shardings, mesh=mesh),
  )
  rows = jax.eval_shape(
    lambda: _init_rows(model_config, sampling_config, batch, capacity, page_size)
  )
  rows = _abstract(rows, _rows_shardings(rows, mesh))
  replicated = NamedSharding(mesh, P())  # the session's host inputs

  def spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)

  table = spec((batch, -(-capacity // page_size)), jnp.int32)

  b = batch
  prefill_args = sampling.PrefillCall(
    row_ids=spec((b,), jnp.int32),
    fresh=spec((b,), jnp.bool_),
    ids=spec((b, width), jnp.int32),
    valid=spec((b, width), jnp.bool_),
    begin=spec((b,), jnp.bool_),
    keys=spec((b, 2), jnp.uint32),
    limits=spec((b,), jnp.int32),
  )
  params = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params
  )
  with jax.set_mesh(mesh):
    decode = sampling._decode_jit.lower(
      params, rows, table, num_steps=sampling_config.max_new_tokens, **statics
    ).compile()
    prefill = sampling._prefill_jit.lower(params, rows, table, *prefill_args, **statics).compile()
  return decode, prefill, rows


def sampler_stats(decode, prefill, rows) -> dict:
  text = decode.as_text()
  return {
    "decode_step": hlo_collectives.summarize(
      hlo_collectives.collectives(text, hlo_collectives.dynamic_loop(text))
    ),
    "call": hlo_collectives.summarize(hlo_collectives.collectives(text)),
    "prefill_call": hlo_collectives.summarize(hlo_collectives.collectives(prefill.as_text())),
    "memory": _memory(decode),
    "prefill_memory": _memory(prefill),
    "cache_bytes_per_device": _bytes_per_device(rows.cache),
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
  keys = jax.random.key_data(jax.random.split(jax.random.key(1), b))
  table = _page_table(b, args.capacity, args.page_size)
  report, outputs = {}, {}
  for name, (m, mc, shardings, layout) in make_layouts(model_config, mesh).items():
    p = learner_params if layout is None else layout(learner_params)
    decode, prefill, rows_abstract = compile_session(
      mc, sampling_config, m, p, b, args.capacity, args.page_size, s
    )
    entry = sampler_stats(decode, prefill, rows_abstract)
    entry["params_bytes_per_device"] = _bytes_per_device(p)
    rows = jax.device_put(
      _init_rows(mc, sampling_config, b, args.capacity, args.page_size),
      _rows_shardings(rows_abstract, m),
    )
    with jax.set_mesh(m):
      rows = prefill(
        p,
        rows,
        table,
        jnp.arange(b, dtype=jnp.int32),
        jnp.ones((b,), bool),
        new_ids,
        new_valid,
        jnp.ones((b,), bool),
        keys,
        jnp.full((b,), sampling_config.max_new_tokens, jnp.int32),
      )
      rows, _ = decode(p, rows, table)
      jax.block_until_ready(rows)
    rows = jax.device_get(rows)
    n = sampling_config.max_new_tokens
    outputs[name] = sampling.SampleOutput(
      tokens=rows.tokens,
      logprobs=rows.logprobs,
      mask=np.arange(n)[None, :] < rows.steps[:, None],
      lengths=rows.steps,
      finish_reason=rows.finish_reason,
    )
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
    decode, prefill, rows = compile_session(
      mc, sampling_config, m, p, args.big_batch, args.big_capacity, args.page_size, args.big_width
    )
    entry = sampler_stats(decode, prefill, rows)
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
  parser.add_argument("--capacity", type=int, default=128, help="most tokens of a row")
  parser.add_argument("--page-size", type=int, default=32, help="slots per KV-cache page")
  parser.add_argument("--reshard-repeats", type=int, default=5)
  parser.add_argument("--big-preset", default="qwen3-14b", help="'none' to skip")
  parser.add_argument("--big-batch", type=int, default=64)
  parser.add_argument("--big-capacity", type=int, default=4096, help="most tokens of a row")
  parser.add_argument("--big-width", type=int, default=128, help="prefill tokens per row per call")
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
      f"{args.prompt} new tokens + {args.new} sampled, capacity {args.capacity} tokens a row "
      f"in pages of {args.page_size}"
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
