"""A sampler session's decode step against the size of its page pool.

A `sampling.SamplerSession` of B rows, each holding a prompt of `--context` tokens, runs one
decode program of `--steps` steps (every row decodes all of them) over page pools of
different sizes (`--pool-pages`, the pages the pool holds; the rows use the same few of them
in each). A step's work is the rows' tokens: the attention reads the blocks of pages the
rows fill and the new keys are scattered into them; nothing should grow with the pool's
unused pages (slicing each layer's pool out of the stacked pools would copy the whole pool,
every layer of every step). The pools' programs alternate within one run; each reports the fastest of
`--repeats` calls, in ms per decode step, and the ratio of the largest pool to the smallest.

  .venv/bin/python benchmarks/bench_decode_step.py                  # qwen3-bench, 25 vs 400
  .venv/bin/python benchmarks/bench_decode_step.py --preset qwen3-tiny --steps 4 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from seeupo_jax import sampling
from seeupo_jax.models import config as config_lib
from seeupo_jax.models import qwen


def prepared_session(model_config, params, args, pages: int):
  """(session, rows after the prompts' prefill, page table) for a pool of `pages` pages."""
  sampling_config = sampling.SamplingConfig(max_new_tokens=args.steps + 1, temperature=1.0)
  session = sampling.SamplerSession(
    model_config,
    sampling_config,
    sampling.SessionConfig(
      rows=args.batch,
      max_context_tokens=args.max_context,
      page_size=args.page_size,
      prefill_chunk=args.context,
      prefill_rows=args.batch,
      decode_steps_per_sync=args.steps,
      initial_pages=pages,
    ),
  )
  ids = np.random.default_rng(0).integers(0, model_config.vocab_size, (args.batch, args.context))
  for b in range(args.batch):
    session.give(b, ids[b], np.array([b, 1], np.uint32), args.steps + 1)
  session.prefill(params)
  # The prompts' prefill calls, and the pages of the decode steps (every row decodes them all).
  table = session.prepare_decode(params)
  return session, jax.block_until_ready(session.rows), table


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--preset", default="qwen3-bench")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--context", type=int, default=32, help="prompt tokens of each row")
  parser.add_argument("--steps", type=int, default=32, help="decode steps per call")
  parser.add_argument(
    "--max-context", type=int, default=384, help="the session's max_context_tokens (table width)"
  )
  parser.add_argument("--page-size", type=int, default=32)
  parser.add_argument("--pool-pages", type=int, nargs="+", default=[25, 400])
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--json", default=None, help="also write the result to this file")
  args = parser.parse_args()
  need = args.batch * -(-(args.context + args.steps) // args.page_size) + 1
  if min(args.batch, args.context, args.steps, args.page_size, args.repeats) < 1:
    parser.error("--batch, --context, --steps, --page-size and --repeats must be >= 1")
  if args.max_context < args.context + args.steps + 1:
    parser.error("--max-context must be >= --context + --steps + 1")
  if min(args.pool_pages) < need:
    parser.error(f"--pool-pages must be >= {need} (the rows' pages and the scratch page)")

  model_config = config_lib.get_preset(args.preset)
  params = jax.jit(qwen.init_params, static_argnums=0)(model_config, jax.random.key(0))
  prepared = {
    pages: prepared_session(model_config, params, args, pages) for pages in args.pool_pages
  }
  best = {pages: float("inf") for pages in prepared}
  for _ in range(args.repeats + 1):  # the first round compiles
    for pages, (session, rows, table) in prepared.items():
      fresh = jax.block_until_ready(jax.tree.map(lambda x: x.copy(), rows))  # donated below
      start = time.perf_counter()
      out, steps = session.decode_program(params, fresh, table)
      jax.block_until_ready(out)
      best[pages] = min(best[pages], time.perf_counter() - start)
      if int(steps) != args.steps:
        raise RuntimeError(f"the decode call ran {int(steps)} steps, not {args.steps}")
  per_step = {pages: 1000 * seconds / args.steps for pages, seconds in best.items()}
  smallest, largest = min(per_step), max(per_step)
  result = dict(
    preset=args.preset,
    batch=args.batch,
    context=args.context,
    max_context=args.max_context,
    steps=args.steps,
    page_size=args.page_size,
    step_ms={str(pages): round(ms, 3) for pages, ms in per_step.items()},
    largest_over_smallest=round(per_step[largest] / per_step[smallest], 3),
  )
  for pages, ms in per_step.items():
    print(f"pool of {pages:5d} pages: {ms:8.2f} ms per decode step")
  print(f"{largest} pages / {smallest} pages: {result['largest_over_smallest']:.2f}x")
  print(json.dumps(result))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  main()
