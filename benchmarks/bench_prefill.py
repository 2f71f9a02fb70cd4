"""A sampler session's prefill call against its rows R and width W, beside a decode step.

A `sampling.SamplerSession` of `--rows` S rows, each holding a prompt of `--context` tokens,
times one prefill program (`SamplerSession.prefill_program`) of R rows x W new tokens, every
row of the call carrying W tokens (`--prefill-rows`, `--widths`: W must be one of
`sampling.prefill_widths(max W)`), and one decode program of `--steps` steps of all S rows.
R is a fixed shape of the session (`rollout.prefill_rows`): a call computes its R rows however
many of them have new tokens. The programs alternate within one run; each reports the fastest
of `--repeats` calls. Output: ms per prefill call, us per token of a full call, the call's
cost in decode steps, and the cost of one row's W tokens at R against at the smallest R.

  .venv/bin/python benchmarks/bench_prefill.py                     # qwen3-tiny, R 1,2,4,8
  .venv/bin/python benchmarks/bench_prefill.py --preset qwen3-bench --widths 16,32
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


def _ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",")]


def prepared_session(model_config, params, args, prefill_rows: int):
  """(session, its rows after the prompts' prefill, the page table) for R = prefill_rows."""
  sampling_config = sampling.SamplingConfig(max_new_tokens=args.steps + 1, temperature=1.0)
  session = sampling.SamplerSession(
    model_config,
    sampling_config,
    sampling.SessionConfig(
      rows=args.rows,
      max_context_tokens=args.context + max(args.widths) + args.steps + 1,
      page_size=args.page_size,
      prefill_chunk=max(args.widths),
      prefill_rows=prefill_rows,
      decode_steps_per_sync=args.steps,
    ),
  )
  ids = np.random.default_rng(0).integers(0, model_config.vocab_size, (args.rows, args.context))
  for b in range(args.rows):
    session.give(b, ids[b], np.array([b, 1], np.uint32), args.steps + 1)
  # The prompts' calls (a prompt longer than the widest call takes several), and the pages of
  # the decode steps. A timed call's tokens past those pages go to the scratch page (the
  # same work; nothing reads them).
  table = None
  while session.prefill(params):
    table = session.prepare_decode(params)
  return session, jax.block_until_ready(session.rows), table


def prefill_call(rows: int, session_rows: int, width: int, vocab: int) -> sampling.PrefillCall:
  """R rows (0 .. R - 1 of the session) x `width` new tokens each, no reply begun."""
  ids = np.random.default_rng(width).integers(0, vocab, (rows, width)).astype(np.int32)
  return sampling.PrefillCall(
    row_ids=np.arange(rows, dtype=np.int32) % session_rows,
    fresh=np.zeros((rows,), bool),
    ids=ids,
    valid=np.ones((rows, width), bool),
    begin=np.zeros((rows,), bool),
    keys=np.zeros((rows, 2), np.uint32),
    limits=np.zeros((rows,), np.int32),
  )


def _timed(fn) -> float:
  start = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - start


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--preset", default="qwen3-tiny")
  parser.add_argument("--rows", type=int, default=16, help="S, the session's rows")
  parser.add_argument("--prefill-rows", type=_ints, default=[1, 2, 4, 8])
  parser.add_argument("--widths", type=_ints, default=[16, 32, 64])
  parser.add_argument("--context", type=int, default=100, help="tokens each row holds")
  parser.add_argument("--steps", type=int, default=8, help="decode steps per decode call")
  parser.add_argument("--page-size", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--json", default=None, help="also write the result to this file")
  args = parser.parse_args(argv)
  if min(args.prefill_rows + [args.rows, args.context, args.steps, args.repeats]) < 1:
    parser.error("--prefill-rows, --rows, --context, --steps and --repeats must be >= 1")
  allowed = sampling.prefill_widths(max(args.widths))
  if any(w not in allowed for w in args.widths):
    parser.error(f"--widths: {args.widths}; allowed: values of {allowed}")

  model_config = config_lib.get_preset(args.preset)
  params = jax.jit(qwen.init_params, static_argnums=0)(model_config, jax.random.key(0))
  sessions = {r: prepared_session(model_config, params, args, r) for r in args.prefill_rows}
  calls = {
    (r, w): prefill_call(r, args.rows, w, model_config.vocab_size)
    for r in args.prefill_rows
    for w in args.widths
  }
  best = {key: float("inf") for key in calls}
  best_decode = float("inf")
  for _ in range(args.repeats + 1):  # the first round compiles
    for (r, w), call in calls.items():
      session, rows, table = sessions[r]
      fresh = jax.block_until_ready(jax.tree.map(lambda x: x.copy(), rows))  # donated below
      best[r, w] = min(
        best[r, w], _timed(lambda: session.prefill_program(params, fresh, table, call))
      )
    session, rows, table = sessions[args.prefill_rows[0]]
    fresh = jax.block_until_ready(jax.tree.map(lambda x: x.copy(), rows))
    start = time.perf_counter()
    _, steps = jax.block_until_ready(session.decode_program(params, fresh, table))
    best_decode = min(best_decode, time.perf_counter() - start)
    if int(steps) != args.steps:
      raise RuntimeError(f"the decode call ran {int(steps)} steps, not {args.steps}")
  step_ms = 1000 * best_decode / args.steps
  smallest = min(args.prefill_rows)
  entries = []
  for (r, w), seconds in best.items():
    ms = 1000 * seconds
    entries.append(
      dict(
        prefill_rows=r,
        width=w,
        call_ms=ms,
        us_per_token=1000 * ms / (r * w),
        decode_steps=ms / step_ms,
        # One row's W tokens: a call of R rows costs the whole call even when only that row
        # has new tokens, relative to a call of the smallest R.
        one_row_vs_smallest=seconds / best[smallest, w],
      )
    )
  result = dict(
    preset=args.preset,
    rows=args.rows,
    context=args.context,
    decode_step_ms=step_ms,
    calls=entries,
  )
  print(
    f"{args.preset}: S = {args.rows} rows holding {args.context} tokens each; "
    f"a decode step of all {args.rows}: {step_ms:.3f} ms\n"
  )
  print(
    "| R | W | ms per call | us per token (full call) | call / decode step "
    f"| one row's call / at R = {smallest} |"
  )
  print("|---|---|---|---|---|---|")
  for e in entries:
    print(
      f"| {e['prefill_rows']} | {e['width']} | {e['call_ms']:.3f} | {e['us_per_token']:.1f} | "
      f"{e['decode_steps']:.2f} | {e['one_row_vs_smallest']:.2f}x |"
    )
  print(json.dumps(result))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)
  return result


if __name__ == "__main__":
  main()
