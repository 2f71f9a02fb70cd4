"""How long a checkpoint save stalls training: synchronous against asynchronous, side by side.

    python benchmarks/bench_checkpoint.py                       # qwen3-bench, 5 rounds
    python benchmarks/bench_checkpoint.py --preset qwen3-tiny --rounds 3 --json

Saves a training state of the preset (float32 params, float32 AdamW moments: what the learner
checkpoints, 12 bytes per parameter) with `training.checkpoints.Checkpointer`, alternating a
synchronous and an asynchronous checkpointer in each round, each to its own directory. For each
it times the stall (the `save` call: what the training loop waits for) and the whole save (until
`finish` returns: the files complete on disk), and prints the medians, the state's bytes and the
write throughput, from which the stall of a larger state follows (bytes / throughput).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import optax  # noqa: E402

from seeupo_jax.models import config as config_lib  # noqa: E402
from seeupo_jax.models import qwen  # noqa: E402
from seeupo_jax.training import checkpoints  # noqa: E402


def _state(preset: str):
  """{params, opt_state} of `preset`: float32 params and AdamW's two float32 moments."""
  config = config_lib.PRESETS[preset]
  params = qwen.init_params(config, jax.random.key(0))
  opt_state = optax.adamw(1e-3).init(params)
  return {"params": params, "opt_state": opt_state}


def _nbytes(tree) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


def _one_save(directory: str, state, asynchronous: bool, iteration: int) -> tuple[float, float]:
  """(stall, whole) seconds of one save of `state` as `iteration` into `directory`."""
  ckpt = checkpoints.Checkpointer(directory, every=1, keep=1, asynchronous=asynchronous)
  try:
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    ckpt.save(iteration, state, jax.random.key(iteration), {"iteration": iteration})
    stall = time.perf_counter() - t0
    ckpt.finish()
    whole = time.perf_counter() - t0
  finally:
    ckpt.close()
  return stall, whole


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--preset", default="qwen3-bench", choices=sorted(config_lib.PRESETS))
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--workdir", default="", help="where to write (default: a temporary dir)")
  parser.add_argument("--json", action="store_true", help="print the report as JSON")
  args = parser.parse_args(argv)
  if args.rounds < 1:
    parser.error("--rounds must be >= 1")
  state = _state(args.preset)
  nbytes = _nbytes(state)
  root = args.workdir or tempfile.mkdtemp(prefix="bench_checkpoint_")
  times = {"sync": [], "async": []}
  for r in range(args.rounds):
    for kind in ("sync", "async") if r % 2 == 0 else ("async", "sync"):
      directory = os.path.join(root, f"{kind}_{r}")
      times[kind].append(_one_save(directory, state, kind == "async", r + 1))
  report = {"preset": args.preset, "state_bytes": nbytes, "rounds": args.rounds}
  for kind, rows in times.items():
    stall = statistics.median(s for s, _ in rows)
    whole = statistics.median(w for _, w in rows)
    report[kind] = {
      "stall_s": stall,
      "whole_s": whole,
      "write_gb_per_s": nbytes / whole / 1e9,
      "rounds": [[round(s, 4), round(w, 4)] for s, w in rows],
    }
  report["stall_async_over_sync"] = report["async"]["stall_s"] / report["sync"]["stall_s"]
  if args.json:
    print(json.dumps(report, indent=1))
  else:
    print(f"{args.preset}: state {nbytes / 2**20:.1f} MiB, {args.rounds} rounds (medians)")
    for kind in ("sync", "async"):
      row = report[kind]
      print(
        f"  {kind:5s}  stall {row['stall_s']:.3f} s   whole save {row['whole_s']:.3f} s   "
        f"({row['write_gb_per_s']:.2f} GB/s)"
      )
    print(f"  async stall / sync stall: {report['stall_async_over_sync']:.3f}")
  return report


if __name__ == "__main__":
  main()
