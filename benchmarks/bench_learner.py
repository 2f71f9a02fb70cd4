"""One SeeUPO update against one GSPO update, same model and batch, side by side.

SeeUPO updates the T turns one after another, so its floor is T optimizer
steps (forward + backward over the batch, the turn's tokens masked) plus the
reference log-probs of the KL term (one forward pass). With one epoch of one
mini-batch (the authors' setting) the learner reaches that floor: each turn's
step takes its old log-probs, and the previous turn's "after" log-probs for
the correction M, from its own forward pass (`fuse_forward`). With separate
passes (`fuse_forward=False`, what more epochs or mini-batches need) SeeUPO
adds T forward passes. GSPO takes one reference forward and one optimizer
step. An update above T x GSPO's would be a defect.

Each round times, interleaved in one process (ABBA order): SeeUPO (fused),
SeeUPO with separate passes, GSPO, one forward-only log-prob pass over the
batch and one optimizer step (forward + backward + AdamW) over the batch.
Medians over rounds; the report gives the ratios, SeeUPO's ratio to its floor
(T steps + 1 forward) and the share of the separate passes' time spent in
forward passes.

Two batch profiles. `uniform` (the default): every row has all T turns, equal
lengths. `bfcl` (BFCL-shaped, T = 10): a prompt of 1400 tokens, then turns of
150-200 tokens each (half the model's reply, half the tool output), the rows'
trajectories ending at turns spread evenly from 3 to 10, right-padded: here
SeeUPO's turns run on the rows that have them and on the prefix that ends with
them (`LearnerConfig.turn_buckets`), where GSPO's one step runs on the whole
batch. `--extra-buckets 1,8` adds SeeUPO with turn_buckets = 1 (every turn on
the whole batch at full length, as before) and 8, timed in the same rounds.

  .venv/bin/python benchmarks/bench_learner.py                       # qwen3-bench, 16 x 512, T = 4 and 8
  .venv/bin/python benchmarks/bench_learner.py --profile bfcl --batch 8 --attn-block 512 \
      --extra-buckets 1 --rounds 1                                   # BFCL-shaped, T = 10 (~35 min CPU)
  .venv/bin/python benchmarks/bench_learner.py --preset qwen3-0.6b --dtype bfloat16 \
      --peak-tflops 989                                              # GPU: adds MFU
"""

from __future__ import annotations

import argparse
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from seeupo_jax import learner, sharding  # noqa: E402
from seeupo_jax.models import config as config_lib  # noqa: E402
from seeupo_jax.models import qwen  # noqa: E402


def make_batch(rows: int, length: int, num_turns: int, vocab: int, seed: int = 0) -> learner.Batch:
  """Rows of a prompt, then turns of generated tokens separated by environment tokens.

  Every row has all T turns (the most work a T-turn update can have); the
  prompt takes 1/8 of the row, each turn's reply and observation share the
  rest equally.
  """
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, (rows, length)).astype(np.int32)
  turn_ids = np.full((rows, length), -1, np.int32)
  prompt = length // 8
  span = (length - prompt) // num_turns
  for t in range(num_turns):
    start = prompt + t * span
    turn_ids[:, start : start + span // 2] = t  # the reply; the observation follows
  return learner.Batch(
    tokens=tokens,
    token_valid=np.ones((rows, length), bool),
    turn_ids=turn_ids,
    sample_logp=np.zeros((rows, length), np.float32),
    rewards=rng.normal(size=rows).astype(np.float32),
    group_ids=(np.arange(rows) // 4).astype(np.int32),
    row_valid=np.ones(rows, bool),
  )


BFCL_TURNS = 10
BFCL_PROMPT = 1400
BFCL_TURN_TOKENS = (150, 200)


def make_bfcl_batch(rows: int, vocab: int, seed: int = 0) -> learner.Batch:
  """A BFCL-shaped batch: a 1400-token prompt, then turns of 150-200 tokens (the reply, then
  the tool output, half each); row i ends after turn 3 + (i mod 8), so the trajectories end
  at turns spread evenly from 3 to 10. L: the longest row, rounded up to a multiple of 128."""
  rng = np.random.default_rng(seed)
  ends = [3 + i % (BFCL_TURNS - 2) for i in range(rows)]
  spans = rng.integers(BFCL_TURN_TOKENS[0], BFCL_TURN_TOKENS[1] + 1, (rows, BFCL_TURNS))
  lengths = [BFCL_PROMPT + int(spans[i, : ends[i]].sum()) for i in range(rows)]
  length = -(-max(lengths) // 128) * 128
  tokens = rng.integers(0, vocab, (rows, length)).astype(np.int32)
  valid = np.zeros((rows, length), bool)
  turn_ids = np.full((rows, length), -1, np.int32)
  for i in range(rows):
    start = BFCL_PROMPT
    for t in range(ends[i]):
      turn_ids[i, start : start + spans[i, t] // 2] = t  # the reply; the tool output follows
      start += spans[i, t]
    valid[i, : lengths[i]] = True
  return learner.Batch(
    tokens=np.where(valid, tokens, 0),
    token_valid=valid,
    turn_ids=turn_ids,
    sample_logp=np.zeros((rows, length), np.float32),
    rewards=rng.normal(size=rows).astype(np.float32),
    group_ids=(np.arange(rows) // 4).astype(np.int32),
    row_valid=np.ones(rows, bool),
  )


def matmul_params(config) -> int:
  d, f, l = config.hidden_size, config.intermediate_size, config.num_layers
  attn = d * config.head_dim * (2 * config.num_heads + 2 * config.num_kv_heads)
  return l * (attn + 3 * d * f) + d * config.vocab_size


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="qwen3-bench", choices=sorted(config_lib.PRESETS))
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--seq", type=int, default=512)
  parser.add_argument("--turns", default="4,8", help="comma-separated T values (uniform)")
  parser.add_argument("--profile", default="uniform", choices=("uniform", "bfcl"))
  parser.add_argument(
    "--extra-buckets", default="", help="comma-separated turn_buckets of extra SeeUPO variants"
  )
  parser.add_argument(
    "--turn-buckets", type=int, default=0, help="SeeUPO's turn_buckets (0: LearnerConfig's)"
  )
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--dtype", default="float32", choices=config_lib.DTYPES)
  parser.add_argument("--remat", default="dots", choices=config_lib.REMAT_POLICIES)
  parser.add_argument("--attn-block", type=int, default=32)
  parser.add_argument("--cpu-devices", type=int, default=0, help="split the CPU into N XLA devices")
  parser.add_argument("--peak-tflops", type=float, default=0.0, help="accelerator peak, for MFU")
  args = parser.parse_args()

  config = config_lib.get_preset(
    args.preset,
    dtype=args.dtype,
    param_dtype=args.dtype,
    remat=args.remat,
    attn_block_size=args.attn_block,
  )
  mesh = sharding.make_mesh(data=-1, fsdp=1, tensor=1)
  logprob_fn = learner.qwen_logprob_fn(config)
  optimizer = learner.default_optimizer(learning_rate=1e-6)
  params = learner.shard_params(qwen.init_params(config, jax.random.key(0)), mesh)
  tokens = args.batch * args.seq
  flops_per_token = 2 * matmul_params(config)  # forward; backward is twice that

  def new_state():
    return learner.init_state(jax.tree.map(jnp.copy, params), optimizer, ref_params=params)

  # The two passes the updates are made of, over the whole batch.
  batch0 = learner.shard_batch(make_batch(args.batch, args.seq, 1, config.vocab_size), mesh)
  mask0 = learner.generated_mask(batch0, 1)

  @jax.jit
  def forward(p, b):
    return logprob_fn(p, b)

  @jax.jit
  def optimizer_step(p, opt_state, b):
    grads = jax.grad(lambda q: -jnp.sum(logprob_fn(q, b) * mask0))(p)
    updates, opt_state = optimizer.update(grads, opt_state, p)
    return jax.tree.map(jnp.add, p, updates), opt_state

  results = {
    "device": f"{jax.devices()[0].platform} x {len(jax.devices())}",
    "preset": args.preset,
    "dtype": args.dtype,
    "batch": [args.batch, args.seq],
    "profile": args.profile,
    "turn_buckets": args.turn_buckets or learner.LearnerConfig().turn_buckets,
    "turns": {},
  }
  extra = [int(k) for k in args.extra_buckets.split(",") if k]
  buckets = args.turn_buckets or None
  variants = {"seeupo": buckets}  # name -> turn_buckets (None: the default)
  if args.profile == "uniform":
    variants["seeupo_separate"] = buckets
  variants.update({f"seeupo_k{k}": k for k in extra})
  variants["gspo"] = None
  turn_counts = [int(t) for t in args.turns.split(",")]
  if args.profile == "bfcl":
    turn_counts = [BFCL_TURNS]
  with jax.set_mesh(mesh):
    step_params, step_opt = jax.tree.map(jnp.copy, params), optimizer.init(params)
    jax.block_until_ready(forward(params, batch0))
    jax.block_until_ready(optimizer_step(step_params, step_opt, batch0))
    for num_turns in turn_counts:
      if args.profile == "bfcl":
        host_batch = make_bfcl_batch(args.batch, config.vocab_size)
      else:
        host_batch = make_batch(args.batch, args.seq, num_turns, config.vocab_size)
      batch = learner.shard_batch(host_batch, mesh)
      updates, states, compile_s = {}, {}, {}
      for name, buckets in variants.items():
        cfg = learner.LearnerConfig(algorithm=name.split("_")[0], num_turns=num_turns)
        if buckets is not None:
          cfg = cfg.replace(turn_buckets=buckets)
        fuse = name != "seeupo_separate"
        updates[name] = learner.make_update(logprob_fn, optimizer, cfg, fuse_forward=fuse)
        states[name] = new_state()
        start = time.perf_counter()
        states[name], metrics = updates[name](states[name], batch, jax.random.key(1))
        jax.block_until_ready(metrics)
        compile_s[name] = time.perf_counter() - start  # compile + first run
      passes = ("forward", "optimizer_step") if args.profile == "uniform" else ()
      times = {name: [] for name in (*updates, *passes)}
      for r in range(args.rounds):
        order = list(times)
        for name in order if r % 2 == 0 else order[::-1]:
          start = time.perf_counter()
          if name in updates:
            states[name], metrics = updates[name](states[name], batch, jax.random.key(r))
            jax.block_until_ready(metrics)
          elif name == "forward":
            jax.block_until_ready(forward(params, batch0))
          else:
            step_params, step_opt = optimizer_step(step_params, step_opt, batch0)
            jax.block_until_ready(step_params)
          times[name].append(time.perf_counter() - start)
      med = {name: statistics.median(values) for name, values in times.items()}
      if args.profile == "bfcl":
        row = {
          "batch": list(host_batch.tokens.shape),
          "generated_tokens": int(np.sum(host_batch.turn_ids >= 0)),
          "valid_tokens": int(np.sum(host_batch.token_valid)),
          "gspo_s": round(med["gspo"], 4),
          "compile_and_first_s": {k: round(v, 1) for k, v in compile_s.items()},
          "rounds": {k: [round(v, 4) for v in vs] for k, vs in times.items()},
        }
        for name in variants:
          if name != "gspo":
            row[f"{name}_s"] = round(med[name], 4)
            row[f"{name}_over_T_gspo"] = round(med[name] / (num_turns * med["gspo"]), 3)
        results["turns"][str(num_turns)] = row
        print(
          f"bfcl T={num_turns}: gspo {med['gspo']:.3f} s; "
          + ", ".join(
            f"{name} {med[name]:.3f} s ({row[name + '_over_T_gspo']} T)"
            for name in variants
            if name != "gspo"
          ),
          file=sys.stderr,
        )
        continue
      floor = num_turns * med["optimizer_step"] + med["forward"]
      row = {
        "seeupo_s": round(med["seeupo"], 6),
        "seeupo_separate_passes_s": round(med["seeupo_separate"], 4),
        "gspo_s": round(med["gspo"], 6),
        "forward_s": round(med["forward"], 6),
        "optimizer_step_s": round(med["optimizer_step"], 6),
        "seeupo_over_gspo": round(med["seeupo"] / med["gspo"], 3),
        "seeupo_over_T_gspo": round(med["seeupo"] / (num_turns * med["gspo"]), 3),
        "seeupo_over_floor": round(med["seeupo"] / floor, 3),
        "separate_over_fused": round(med["seeupo_separate"] / med["seeupo"], 3),
        # initial old log-probs, T - 1 "after" passes and the reference pass
        "separate_forward_share": round(
          (num_turns + 1) * med["forward"] / med["seeupo_separate"], 3
        ),
        "seeupo_tokens_per_s": round(tokens / med["seeupo"], 1),
        "gspo_tokens_per_s": round(tokens / med["gspo"], 1),
        "compile_and_first_s": {k: round(v, 1) for k, v in compile_s.items()},
        "rounds": {k: [round(v, 4) for v in vs] for k, vs in times.items()},
      }
      for name in variants:
        if name.startswith("seeupo_k"):
          row[f"{name}_s"] = round(med[name], 4)
          row[f"{name}_over_T_gspo"] = round(med[name] / (num_turns * med["gspo"]), 3)
      if args.peak_tflops:
        # SeeUPO (fused): T steps (3x forward flops) + the reference forward.
        flops = tokens * flops_per_token * (3 * num_turns + 1)
        row["seeupo_mfu"] = round(flops / med["seeupo"] / (args.peak_tflops * 1e12), 4)
      results["turns"][str(num_turns)] = row
      print(
        f"T={num_turns}: seeupo {med['seeupo']:.3f} s, gspo {med['gspo']:.3f} s "
        f"({row['seeupo_over_gspo']}x, {row['seeupo_over_T_gspo']} of T x gspo), "
        f"floor ratio {row['seeupo_over_floor']}, separate passes {row['separate_over_fused']}x"
        + "".join(
          f", {name} {med[name]:.3f} s ({row[name + '_over_T_gspo']} T)"
          for name in variants
          if name.startswith("seeupo_k")
        ),
        file=sys.stderr,
      )
  print(json.dumps(results, indent=1))


if __name__ == "__main__":
  main()
