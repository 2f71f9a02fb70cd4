"""Multi-turn rollouts: continuing in a sampler session vs re-prefilling the whole context.

One episode = `--turns` turns; each turn appends `--env-tokens` E environment
tokens to every row (the first turn's E tokens are the prompt) and samples
exactly `--reply-tokens` R tokens (no stop tokens, so every row runs to R).

  (a) continue: a `sampling.SamplerSession` of B rows kept across the turns
      (each row's paged KV cache holds its conversation; max_context_tokens
      turns x (E + R), a page pool sized for the whole episode, so it never
      grows); each turn gives every row its E new tokens (`give`; the row's
      pending last token goes in front), then `prefill` (one call: prefill
      chunk >= E + 1) and `decode` calls (R - 1 steps, `--steps-per-sync` per
      call and host read) until every row's `Reply` is back.
  (b) re-prefill: `sampling.make_sampler` on the whole conversation so far
      (prompt, earlier replies, new tokens: t E + (t - 1) R tokens at turn t).

Both use the same row keys (the session's reply key of row b = the sampler's
key of row b), so they sample the same tokens (the share that agrees is
reported). Each jitted shape is compiled by one warm-up episode of each route
(a fresh session per episode: the same page-table widths each time); then
episodes alternate A B A B ... (`--repeats` of each) and every turn is timed
from its first `give` to its last reply (host arrays), resp. to
`block_until_ready` of the sampler's call. The report gives the median time
of each turn for both routes, their ratio, the totals, and the growth with the
turn index: measured (time of turn t / time of turn 1) against the growth of
the attention work alone (query-key pairs over the tokens a route feeds the
model, causal, counted over real tokens only).

  .venv/bin/python benchmarks/bench_multiturn.py              # qwen3-bench, batch 8, 6 turns
  .venv/bin/python benchmarks/bench_multiturn.py --batch 4 --env-tokens 32 --reply-tokens 32
  .venv/bin/python benchmarks/bench_multiturn.py --preset qwen3-tiny --turns 2 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from seeupo_jax import sampling
from seeupo_jax.models import config as config_lib
from seeupo_jax.models import qwen


def causal_pairs(first: int, stop: int) -> int:
  """Query-key pairs of causal attention for the queries at positions [first, stop).

  The query at position p attends to the p + 1 keys at positions 0..p.
  """
  return sum(p + 1 for p in range(first, stop))


def attention_pairs(turn: int, env: int, reply: int) -> dict:
  """Attention work of turn `turn` (1-based) for both routes, over real tokens only.

  Before the turn the conversation has c = (turn - 1)(E + R) tokens. Continue
  feeds the pending token (position c - 1, from turn 2 on), the E new tokens
  and R - 1 sampled tokens; re-prefill feeds the whole conversation (positions
  0..c + E - 1) and the same R - 1 sampled tokens.
  """
  before = (turn - 1) * (env + reply)
  end = before + env + reply - 1
  return dict(
    continue_pairs=causal_pairs(before - (turn > 1), end),
    reprefill_pairs=causal_pairs(0, end),
  )


def env_tokens(turns: int, batch: int, env: int, vocab: int, seed: int = 0) -> list:
  """int32[B, E] environment tokens of each turn (the same for both routes)."""
  rng = np.random.default_rng(seed)
  return [rng.integers(0, vocab, (batch, env)).astype(np.int32) for _ in range(turns)]


def turn_keys(turns: int, batch: int) -> list:
  """[B] row keys of each turn (the same for both routes)."""
  return [jax.random.split(jax.random.key(1000 + t), batch) for t in range(turns)]


def session_config(args) -> sampling.SessionConfig:
  """The continue route's session: B rows, room for the whole episode, one prefill a turn."""
  context = args.turns * (args.env_tokens + args.reply_tokens)
  page = args.page_size
  return sampling.SessionConfig(
    rows=args.batch,
    max_context_tokens=context,
    page_size=page,
    prefill_chunk=max(256, args.env_tokens + 1),  # the pending token + E new ones in one call
    decode_steps_per_sync=args.steps_per_sync,
    initial_pages=1 + args.batch * -(-(context + args.steps_per_sync + 1) // page),
  )


def run_continue(make_session, params, inputs, keys) -> tuple:
  """One episode in a fresh session: (per-turn seconds, per-turn sampled tokens, stats)."""
  session = make_session()
  batch = inputs[0].shape[0]
  times, tokens = [], []
  for new_ids, turn_key in zip(inputs, keys):
    key_data = np.asarray(jax.random.key_data(turn_key))
    reply = session.sampling_config.max_new_tokens
    out = np.zeros((batch, reply), np.int32)
    start = time.perf_counter()
    for b in range(batch):
      session.give(b, new_ids[b], key_data[b], reply)
    while session.busy:
      session.prefill(params)
      for r in session.decode(params):  # host arrays: the work is done
        out[r.row, : len(r.tokens)] = r.tokens
    times.append(time.perf_counter() - start)
    tokens.append(out)
  return times, tokens, session.stats


def run_reprefill(sample, params, inputs, keys) -> tuple:
  """One episode re-prefilling the whole conversation each turn: (seconds, tokens) per turn."""
  conversation = np.zeros((inputs[0].shape[0], 0), np.int32)
  times, tokens = [], []
  for new_ids, turn_key in zip(inputs, keys):
    conversation = np.concatenate([conversation, new_ids], axis=1)
    ids = jnp.asarray(conversation)
    valid = jnp.ones(ids.shape, bool)
    start = time.perf_counter()
    out = jax.block_until_ready(sample(params, ids, valid, turn_key))
    times.append(time.perf_counter() - start)
    reply = np.asarray(out.tokens)
    tokens.append(reply)
    conversation = np.concatenate([conversation, reply], axis=1)
  return times, tokens


def markdown_table(result: dict) -> str:
  """The per-turn table: times, ratio, and measured vs attention-only growth."""
  lines = [
    "| turn | context before | continue ms | re-prefill ms | re-prefill / continue "
    "| continue growth: measured (attention only) | re-prefill growth: measured (attention only) |",
    "|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for row in result["turns"]:
    lines.append(
      f"| {row['turn']} | {row['context_before']} | {row['continue_ms']:.1f} "
      f"| {row['reprefill_ms']:.1f} | {row['ratio']:.2f} "
      f"| {row['continue_growth']:.2f} ({row['continue_attention_growth']:.2f}) "
      f"| {row['reprefill_growth']:.2f} ({row['reprefill_attention_growth']:.2f}) |"
    )
  lines.append(
    f"| total | | {result['continue_total_ms']:.1f} | {result['reprefill_total_ms']:.1f} "
    f"| {result['total_ratio']:.2f} | | |"
  )
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--preset", default="qwen3-bench")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--turns", type=int, default=6)
  parser.add_argument("--env-tokens", type=int, default=32, help="E new tokens per row per turn")
  parser.add_argument("--reply-tokens", type=int, default=32, help="R sampled tokens per turn")
  parser.add_argument("--repeats", type=int, default=3, help="timed episodes of each route")
  parser.add_argument("--page-size", type=int, default=32, help="the session's KV page size")
  parser.add_argument(
    "--steps-per-sync", type=int, default=8, help="the session's decode steps per host read"
  )
  parser.add_argument("--json", default=None, help="also write the result to this file")
  args = parser.parse_args()
  if (
    min(
      args.batch,
      args.turns,
      args.env_tokens,
      args.reply_tokens,
      args.repeats,
      args.page_size,
      args.steps_per_sync,
    )
    < 1
  ):
    parser.error(
      "--batch, --turns, --env-tokens, --reply-tokens, --repeats, --page-size and "
      "--steps-per-sync must be >= 1"
    )

  config = config_lib.get_preset(args.preset)
  params = jax.jit(qwen.init_params, static_argnums=0)(config, jax.random.key(0))
  env, reply = args.env_tokens, args.reply_tokens
  sampling_config = sampling.SamplingConfig(max_new_tokens=reply, temperature=1.0)
  session_cfg = session_config(args)

  def make_session():
    return sampling.SamplerSession(config, sampling_config, session_cfg)

  sample = sampling.make_sampler(config, sampling_config)
  inputs = env_tokens(args.turns, args.batch, env, config.vocab_size)
  keys = turn_keys(args.turns, args.batch)

  start = time.perf_counter()
  _, warm_a, stats = run_continue(make_session, params, inputs, keys)
  compile_continue = time.perf_counter() - start
  start = time.perf_counter()
  _, warm_b = run_reprefill(sample, params, inputs, keys)
  compile_reprefill = time.perf_counter() - start
  agree = float(np.mean([np.mean(a == b) for a, b in zip(warm_a, warm_b)]))

  times_a, times_b = [], []
  for _ in range(args.repeats):  # A B A B ...
    times_a.append(run_continue(make_session, params, inputs, keys)[0])
    times_b.append(run_reprefill(sample, params, inputs, keys)[0])

  first = attention_pairs(1, env, reply)
  rows = []
  for t in range(args.turns):
    a = 1000 * statistics.median(r[t] for r in times_a)
    b = 1000 * statistics.median(r[t] for r in times_b)
    pairs = attention_pairs(t + 1, env, reply)
    rows.append(
      dict(
        turn=t + 1,
        context_before=t * (env + reply),
        continue_ms=round(a, 2),
        reprefill_ms=round(b, 2),
        ratio=round(b / a, 3),
        continue_attention_growth=round(pairs["continue_pairs"] / first["continue_pairs"], 3),
        reprefill_attention_growth=round(pairs["reprefill_pairs"] / first["reprefill_pairs"], 3),
      )
    )
  for row in rows:
    row["continue_growth"] = round(row["continue_ms"] / rows[0]["continue_ms"], 3)
    row["reprefill_growth"] = round(row["reprefill_ms"] / rows[0]["reprefill_ms"], 3)
  total_a = sum(r["continue_ms"] for r in rows)
  total_b = sum(r["reprefill_ms"] for r in rows)
  result = dict(
    preset=args.preset,
    batch=args.batch,
    n_turns=args.turns,
    env_tokens=env,
    reply_tokens=reply,
    repeats=args.repeats,
    capacity=session_cfg.max_context_tokens,
    page_size=session_cfg.page_size,
    steps_per_sync=session_cfg.decode_steps_per_sync,
    pool_pages=stats.pool_pages,
    session_prefill_calls=stats.prefill_calls,
    session_decode_calls=stats.decode_calls,
    backend=jax.default_backend(),
    cpu_cores=len(os.sched_getaffinity(0)),
    warmup_continue_s=round(compile_continue, 2),
    warmup_reprefill_s=round(compile_reprefill, 2),
    tokens_agree=round(agree, 4),
    continue_total_ms=round(total_a, 2),
    reprefill_total_ms=round(total_b, 2),
    total_ratio=round(total_b / total_a, 3),
    turns=rows,
  )
  print(markdown_table(result))
  print(json.dumps(result, indent=1))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
