"""The rollout engine: continuous scheduling against the turn-synchronous barrier, in one run.

    python benchmarks/bench_rollout.py                       # both scenarios, 64 episodes x 6 turns
    python benchmarks/bench_rollout.py --scenarios=heavy_tail --median_ms=20 --p99_ms=400
    python benchmarks/bench_rollout.py --prefill_rows=1,2,4,8       # R side by side

A tiny model (`qwen3-tiny`, random weights) plays `--episodes` episodes of `--turns` turns
against an environment whose every step sleeps a log-normal latency (median and p99 as flags;
the latency of each (episode, turn) is drawn from a seed of its own, so both schedulers see
the same latencies). Reply lengths spread: `--stop_tokens` ids of the vocabulary end a reply,
so with near-uniform next-token probabilities a reply's length is geometric with mean
about vocab / stop_tokens, cut at `--max_new` (1 to 64 tokens by default).

Scenarios (each runs `rollout.scheduler=continuous` and `=turns` on the same decode slots, at
each `--prefill_rows` R, after `--warmups` untimed calls of each (compiles), all of them in
alternation `--repeats` times; the ratio is of the medians, at the same R):
  heavy_tail  environment latency with p99 >= 10x its median;
  instant     no environment latency: only the reply lengths spread.

R, the rows of every prefill call (`rollout.prefill_rows`), is a fixed shape (a row's bits
depend on it), so a call with fewer rows with new tokens still computes R. On a CPU a prefill
call's cost grows with its R x width tokens; the continuous engine's calls carry a few rows
each (rows come back one by one), the barrier's many; the default compares R = 2 (the CPU's
choice) and R = 8 (`rollout.prefill_rows`'s default, for accelerators).

Prints one JSON line per measurement and a Markdown table (generated tokens per second,
continuous / turns, the env wait share and slot occupancy of the continuous run).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
import zlib

import jax

from seeupo_jax import rollout, sampling
from seeupo_jax.text import chat_tokens, tokenizer as tokenizer_lib
from seeupo_jax.envs import base
from seeupo_jax.models import config as model_config_lib
from seeupo_jax.models import qwen


class LatencyEnv:
  """Done after `turns` replies; each step sleeps median x exp(sigma Z), Z ~ N(0, 1) seeded by
  (task, turn); the observation is a short tool message."""

  def __init__(self, turns: int, median_s: float, sigma: float):
    self.turns, self.median_s, self.sigma = turns, median_s, sigma

  def reset(self, task_id):
    self.task_id, self.replies = task_id, 0
    return base.Reset([{"role": "user", "content": f"episode {task_id}: answer each tool"}])

  def step(self, text):
    self.replies += 1
    if self.median_s > 0:
      rng = random.Random(zlib.crc32(f"{self.task_id}/{self.replies}".encode()))
      time.sleep(self.median_s * math.exp(self.sigma * rng.gauss(0.0, 1.0)))
    done = self.replies >= self.turns
    obs = [] if done else [{"role": "tool", "content": f"result {self.replies} ok"}]
    return base.Step(obs, done, {})

  def score(self):
    return base.Score(0.0, False, {})

  def close(self):
    pass


def _roller(
  args, chat, tok, scheduler: str, prefill_rows: int, median_s: float, sigma: float
) -> rollout.Roller:
  vocab = qwen_config().vocab_size
  stops = tuple(range(vocab - args.stop_tokens, vocab)) + tuple(tokenizer_lib.stop_token_ids(tok))
  sc = sampling.SamplingConfig(
    max_new_tokens=args.max_new, stop_token_ids=stops, pad_id=tok.pad_token_id
  )
  spec = base.EnvSpec(
    make=lambda: LatencyEnv(args.turns, median_s, sigma),
    task_ids=lambda split: [],
    max_turns=args.turns,
  )
  config = rollout.RolloutConfig(
    max_turns=args.turns,
    max_context_tokens=args.max_context,
    env_workers=args.env_workers,
    scheduler=scheduler,
  )
  session = config.session_config(
    rows=args.slots, decode_steps_per_sync=args.steps_per_sync, prefill_rows=prefill_rows
  )
  return rollout.Roller(spec, chat, qwen_config(), sc, config, session_config=session)


def qwen_config():
  return model_config_lib.get_preset("qwen3-tiny")


def run_scenario(args, name: str, median_s: float, p99_s: float, params, chat, tok) -> list[dict]:
  """One summary per R of `args.prefill_rows` (every roller run in alternation)."""
  sigma = math.log(p99_s / median_s) / 2.326 if median_s > 0 else 0.0
  rollers = {
    (r, s): _roller(args, chat, tok, s, r, median_s, sigma)
    for r in args.prefill_rows
    for s in rollout.SCHEDULERS
  }
  tasks = [f"e{i}" for i in range(args.episodes)]
  measured = {key: [] for key in rollers}
  try:
    for roller in rollers.values():  # warm-up: compile the programs each will use
      for seed in range(args.warmups):
        roller.run(params, tasks, 1, jax.random.key(100 + seed))
    for repeat in range(args.repeats):
      for (r, s), roller in rollers.items():
        result = roller.run(params, tasks, 1, jax.random.key(1 + repeat))
        m = result.metrics
        row = {
          "scenario": name,
          "prefill_rows": r,
          "scheduler": s,
          "repeat": repeat,
          "wall_s": m["rollout/time"],
          "generated_tokens": m["rollout/generated_tokens"],
          "tokens_per_s": m["rollout/tokens_per_s"],
          "env_wait_share": m["rollout/env_wait_share"],
          "slot_occupancy": m["rollout/slot_occupancy"],
          "decode_steps": m["rollout/decode_steps"],
          "prefill_calls": m["rollout/prefill_calls"],
          "reply_tokens_mean": m["reply_tokens"],
        }
        print(json.dumps(row), flush=True)
        measured[r, s].append(row)
  finally:
    for roller in rollers.values():
      roller.close()
  return [summary(name, r, median_s, p99_s, measured) for r in args.prefill_rows]


def summary(name, prefill_rows, median_s, p99_s, measured) -> dict:
  """The medians over repeats of one scenario at one R, and their ratio."""
  cont = measured[prefill_rows, "continuous"]
  turns = measured[prefill_rows, "turns"]
  median = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
  return {
    "scenario": name,
    "prefill_rows": prefill_rows,
    "median_ms": median_s * 1e3,
    "p99_ms": p99_s * 1e3,
    "continuous_tokens_per_s": median(cont, "tokens_per_s"),
    "turns_tokens_per_s": median(turns, "tokens_per_s"),
    "ratio": median(cont, "tokens_per_s") / median(turns, "tokens_per_s"),
    "continuous_env_wait_share": median(cont, "env_wait_share"),
    "turns_env_wait_share": median(turns, "env_wait_share"),
    "continuous_slot_occupancy": median(cont, "slot_occupancy"),
    "turns_slot_occupancy": median(turns, "slot_occupancy"),
    "reply_tokens_mean": median(cont, "reply_tokens_mean"),
  }


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--scenarios", default="heavy_tail,instant")
  parser.add_argument("--episodes", type=int, default=64)
  parser.add_argument("--turns", type=int, default=6)
  parser.add_argument("--slots", type=int, default=16)
  parser.add_argument("--max_new", type=int, default=64)
  parser.add_argument("--stop_tokens", type=int, default=24)
  parser.add_argument("--max_context", type=int, default=1024)
  parser.add_argument("--median_ms", type=float, default=20.0)
  parser.add_argument("--p99_ms", type=float, default=400.0)
  parser.add_argument("--env_workers", type=int, default=16)
  parser.add_argument("--steps_per_sync", type=int, default=8)
  parser.add_argument(
    "--prefill_rows",
    type=lambda text: [int(r) for r in text.split(",")],
    default=[2, 8],
    help="comma-separated values of rollout.prefill_rows, each run side by side",
  )
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--warmups", type=int, default=2, help="untimed calls first (compiles)")
  args = parser.parse_args(argv)
  if min(args.prefill_rows) < 1:
    parser.error(f"--prefill_rows: {args.prefill_rows}; allowed: ints >= 1")
  tok = tokenizer_lib.build_default_tokenizer()
  chat = chat_tokens.ChatTokens(tok)
  params = qwen.init_params(qwen_config(), jax.random.key(0))
  latencies = {"heavy_tail": (args.median_ms / 1e3, args.p99_ms / 1e3), "instant": (0.0, 0.0)}
  summaries = []
  for name in args.scenarios.split(","):
    if name not in latencies:
      parser.error(f"--scenarios: {name!r}; allowed: {sorted(latencies)}")
    summaries.extend(run_scenario(args, name, *latencies[name], params, chat, tok))
  print(
    f"\n{args.episodes} episodes x {args.turns} turns, {args.slots} decode slots, replies of "
    f"1-{args.max_new} tokens, k = {args.steps_per_sync}\n"
  )
  print(
    "| scenario | prefill rows | env median / p99 (ms) | reply tokens (mean) | continuous tok/s "
    "| turns tok/s | continuous / turns | env wait share (cont. / turns) "
    "| slot occupancy (cont. / turns) |"
  )
  print("|---|---|---|---|---|---|---|---|---|")
  for s in summaries:
    print(
      f"| {s['scenario']} | {s['prefill_rows']} | {s['median_ms']:.0f} / {s['p99_ms']:.0f} | "
      f"{s['reply_tokens_mean']:.1f} | {s['continuous_tokens_per_s']:.0f} | "
      f"{s['turns_tokens_per_s']:.0f} | **{s['ratio']:.2f}x** | "
      f"{s['continuous_env_wait_share']:.1%} / {s['turns_env_wait_share']:.1%} | "
      f"{s['continuous_slot_occupancy']:.2f} / {s['turns_slot_occupancy']:.2f} |"
    )
  print(json.dumps({"summaries": summaries}))
  return summaries


if __name__ == "__main__":
  main()
