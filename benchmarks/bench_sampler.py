"""Decode tokens/s: our jitted KV-cache sampler vs transformers' PyTorch `generate`, side by side.

Both get the same weights (a random transformers Qwen3 of the preset's config,
saved with `save_pretrained` and read back with `checkpoint.load`), the same
left-padded batch of prompts, greedy decoding and exactly `--new` new tokens
per row (no stop tokens). One timed call = prefill + the whole decode, for
both. torch runs once per setting of `--torch-threads` (on a busy 2-core machine
one thread is often faster than two, so both are measured). Rounds alternate
between all contestants so machine noise hits each; the report gives the
median of each, the ratio ours / torch for each torch setting, and the share of
generated ids that agree.

  .venv/bin/python benchmarks/bench_sampler.py            # qwen3-bench: hidden 256, 4 layers, batch 8, 128 new
  .venv/bin/python benchmarks/bench_sampler.py --one-core --torch-threads 1   # both pinned to one core
  .venv/bin/python benchmarks/bench_sampler.py --preset qwen3-tiny --rounds 3
  .venv/bin/python benchmarks/bench_sampler.py --no-torch --step-cache-lens 192,640,2048   # model step vs cache size
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

if "--one-core" in sys.argv:  # before jax and torch start their thread pools
  # XLA:CPU's YNNPACK dots run on their own threads whatever --xla_cpu_multi_thread_eigen
  # says, so pin the whole process to one core.
  os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})

import functools

import jax
import jax.numpy as jnp
import numpy as np

from seeupo_jax import sampling
from seeupo_jax.models import checkpoint
from seeupo_jax.models import config as config_lib
from seeupo_jax.models import qwen


def build_torch_model(config):
  """transformers Qwen3/Qwen2 ForCausalLM with `config`, random weights (std 0.05), eval mode."""
  import torch
  import transformers

  hf = config.to_hf_dict()
  for key in ("architectures", "model_type", "torch_dtype", "dtype"):
    hf.pop(key)
  cls_config = transformers.Qwen3Config if config.qk_norm else transformers.Qwen2Config
  cls_model = transformers.Qwen3ForCausalLM if config.qk_norm else transformers.Qwen2ForCausalLM
  torch.manual_seed(0)
  model = cls_model(cls_config(**hf)).float().eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if not name.endswith("norm.weight"):
        p.normal_(0.0, 0.05)
  return model


def time_model_step(config, params, batch, cache_len, steps=50):
  """Milliseconds per one-token `qwen.hidden_states` step with a cache of `cache_len` slots.

  `steps` steps run inside one jitted fori_loop (writing slot 100 each time), so
  dispatch is excluded: this is the model's own cost of one decode step.
  """

  @functools.partial(jax.jit, donate_argnums=1)
  def run(params, cache, tokens):
    def model_step(i, cache):
      _, cache = qwen.hidden_states(
        params, tokens, jnp.full_like(tokens, 100) + i, None, cache, config=config
      )
      return cache.replace(index=cache.index - 1)

    return jax.lax.fori_loop(0, steps, model_step, cache)

  cache = qwen.init_cache(config, batch, cache_len).replace(index=jnp.int32(100))
  tokens = jnp.ones((batch, 1), jnp.int32)
  cache = jax.block_until_ready(run(params, cache, tokens))
  times = []
  for _ in range(3):
    start = time.perf_counter()
    cache = jax.block_until_ready(run(params, cache, tokens))
    times.append(time.perf_counter() - start)
  return 1000 * statistics.median(times) / steps


def make_bare_model_loop(config, cache_len, new):
  """Jitted (params, ids, valid) -> cache: prefill + `new - 1` one-token model steps, no sampling.

  The floor of any sampler built on `qwen.hidden_states`: same cache, same
  number of model calls, but no logits, token choice or bookkeeping.
  """

  @jax.jit
  def run(params, ids, valid):
    b = ids.shape[0]
    positions = sampling.prompt_positions(valid)
    cache = qwen.init_cache(config, b, cache_len)
    _, cache = qwen.hidden_states(params, ids, positions, valid, cache, config=config)
    tokens = ids[:, -1:]

    def model_step(i, cache):
      _, cache = qwen.hidden_states(
        params, tokens, positions[:, -1:] + 1 + i, None, cache, config=config
      )
      return cache

    return jax.lax.fori_loop(0, new - 1, model_step, cache)

  return run


def make_prompts(batch, prompt_len, vocab, seed=0):
  """Left-padded int32 ids [B, P] and bool valid [B, P]; row lengths spread over [P/2, P]."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, vocab, size=(batch, prompt_len)).astype(np.int32)
  lengths = np.linspace(prompt_len // 2, prompt_len, batch).astype(int)
  valid = np.arange(prompt_len)[None, :] >= (prompt_len - lengths)[:, None]
  return np.where(valid, ids, 0).astype(np.int32), valid


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--preset", default="qwen3-bench")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--prompt", type=int, default=64, help="prompt width P (left-padded)")
  parser.add_argument("--new", type=int, default=128, help="new tokens per row")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument(
    "--torch-threads",
    default="1,0",
    help="comma-separated torch thread counts to measure (0 = torch default)",
  )
  parser.add_argument("--no-torch", action="store_true")
  parser.add_argument(
    "--sampler-scan-layers",
    choices=("model", "true", "false"),
    default="model",
    help="SamplingConfig.scan_layers: keep the model's, or force scan/unroll",
  )
  parser.add_argument(
    "--bare-loop",
    action="store_true",
    help="also time a bare loop of the same model steps (no sampling)",
  )
  parser.add_argument(
    "--step-cache-lens",
    default="",
    help="also time one model decode step at these cache lengths (e.g. 192,640)",
  )
  parser.add_argument(
    "--one-core", action="store_true", help="pin the process (JAX and torch) to one CPU core"
  )
  args = parser.parse_args()

  config = config_lib.get_preset(args.preset)
  ids, valid = make_prompts(args.batch, args.prompt, config.vocab_size)
  result = dict(
    preset=args.preset,
    batch=args.batch,
    prompt=args.prompt,
    new=args.new,
    backend=jax.default_backend(),
    devices=jax.device_count(),
    one_core=args.one_core,
    cpu_cores=len(os.sched_getaffinity(0)),
  )

  import torch

  default_threads = torch.get_num_threads()
  thread_counts = sorted({int(t) or default_threads for t in args.torch_threads.split(",")})
  torch_model = build_torch_model(config)
  with tempfile.TemporaryDirectory() as directory:
    torch_model.save_pretrained(directory)
    config, params = checkpoint.load(directory)

  scan_layers = {"model": None, "true": True, "false": False}[args.sampler_scan_layers]
  result["sampler_scan_layers"] = scan_layers
  sample = sampling.make_sampler(
    config, sampling.SamplingConfig(max_new_tokens=args.new, greedy=True, scan_layers=scan_layers)
  )
  ids_j, valid_j, key = jnp.asarray(ids), jnp.asarray(valid), jax.random.key(0)
  start = time.perf_counter()
  ours = jax.block_until_ready(sample(params, ids_j, valid_j, key))
  result["jax_first_call_s"] = round(time.perf_counter() - start, 2)

  def run_jax():
    return jax.block_until_ready(sample(params, ids_j, valid_j, key))

  gen_config = None
  if not args.no_torch:
    import transformers

    gen_config = transformers.GenerationConfig(
      max_new_tokens=args.new,
      min_new_tokens=args.new,
      do_sample=False,
      pad_token_id=0,
      eos_token_id=None,
      bos_token_id=None,
    )
    ids_t = torch.from_numpy(ids.astype(np.int64))
    mask_t = torch.from_numpy(valid.astype(np.int64))

    def run_torch():
      with torch.no_grad():
        return torch_model.generate(
          input_ids=ids_t, attention_mask=mask_t, generation_config=gen_config
        )

    theirs = run_torch()  # warm-up
    theirs = theirs[:, args.prompt :].numpy()
    result["ids_agree"] = float(np.mean(theirs == np.asarray(ours.tokens)))
  else:
    thread_counts = []

  bare_times = []
  if args.bare_loop:
    bare_config = config if scan_layers is None else config.replace(scan_layers=scan_layers)
    bare = make_bare_model_loop(bare_config, args.prompt + args.new, args.new)
    jax.block_until_ready(bare(params, ids_j, valid_j))

  jax_times, torch_times = [], {t: [] for t in thread_counts}
  for _ in range(args.rounds):
    start = time.perf_counter()
    run_jax()
    jax_times.append(time.perf_counter() - start)
    if args.bare_loop:
      start = time.perf_counter()
      jax.block_until_ready(bare(params, ids_j, valid_j))
      bare_times.append(time.perf_counter() - start)
    for threads in thread_counts:
      torch.set_num_threads(threads)
      start = time.perf_counter()
      run_torch()
      torch_times[threads].append(time.perf_counter() - start)

  for cache_len in [int(x) for x in args.step_cache_lens.split(",") if x]:
    for scan in (True, False):
      result[f"model_step_ms_cache{cache_len}_scan{scan}"] = round(
        time_model_step(config.replace(scan_layers=scan), params, args.batch, cache_len), 2
      )

  tokens = args.batch * args.new
  jax_s = statistics.median(jax_times)
  result["jax_s"] = round(jax_s, 3)
  result["jax_tok_per_s"] = round(tokens / jax_s, 1)
  if bare_times:
    result["bare_model_loop_s"] = round(statistics.median(bare_times), 3)
  for threads, times in torch_times.items():
    torch_s = statistics.median(times)
    result[f"torch{threads}_s"] = round(torch_s, 3)
    result[f"torch{threads}_tok_per_s"] = round(tokens / torch_s, 1)
    result[f"ratio_vs_torch{threads}"] = round(torch_s / jax_s, 2)
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
