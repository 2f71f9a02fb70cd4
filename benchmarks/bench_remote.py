"""How long a save to a remote workdir stalls training: the copy to the bucket in the training
thread against the background `Uploader`, side by side.

    python benchmarks/bench_remote.py                            # qwen3-bench, 100 MB/s bucket
    python benchmarks/bench_remote.py --preset qwen3-tiny --saves 3 --json

A training loop as the trainer runs it with a remote workdir: the asynchronous `Checkpointer`
saves a training state of the preset (float32 params and AdamW's two moments) every iteration,
an iteration being `--iteration_s` seconds of host idle time (the devices' work), and a
`remote.Mirror` copies the local directory to a fake bucket (`tests/fake_bucket.py`) that takes
`--object_ms` per object and writes at `--bucket_mb_per_s` (time.sleep: a network copy leaves
the host's cores free). Two modes, alternating in each round, each with its own directories:

- `inline`: `on_saved` pushes in the training thread (each save waits for the previous
  checkpoint's copy: the asynchronous save finishes it at the next save);
- `background`: `on_saved` is `Uploader.request`; the copies run in the uploader's thread.

For each it times the stall per save (the `save` call, medians over the saves after the first),
the wait at the end (the last copy: `Uploader.close`, or the final push), and checks that the
bucket then holds every checkpoint complete (pulled into a fresh directory, byte for byte).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.join(_ROOT, "tests"))  # fake_bucket.py

import jax  # noqa: E402

import fake_bucket  # noqa: E402

from bench_checkpoint import _nbytes, _state  # noqa: E402
from seeupo_jax.models import config as config_lib  # noqa: E402
from seeupo_jax.training import checkpoints  # noqa: E402
from seeupo_jax.training import remote  # noqa: E402

REMOTE = "gs://bench/run"
MODES = ("inline", "background")


def _throttle(local: str, object_s: float, bytes_per_s: float):
  """The fake bucket's `on_write`: sleeps for one object's latency and its bytes' transfer."""
  prefix = REMOTE + "/"

  def on_write(path: str) -> None:
    size = 0
    if path.startswith(prefix):
      source = os.path.join(local, path[len(prefix) :])
      size = os.path.getsize(source) if os.path.isfile(source) else 0
    time.sleep(object_s + size / bytes_per_s)

  return on_write


def _files(root: str) -> dict[str, bytes]:
  out = {}
  for directory, _, files in os.walk(root):
    for name in files:
      path = os.path.join(directory, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, root)] = f.read()
  return out


def _one_run(root: str, mode: str, state, args) -> dict:
  """One training loop of `args.saves` saves in `mode`; its stalls and the end's wait."""
  local, bucket = os.path.join(root, "local"), os.path.join(root, "bucket")
  mirror = remote.Mirror(REMOTE, local)
  on_write = _throttle(local, args.object_ms / 1e3, args.bucket_mb_per_s * 1e6)
  with fake_bucket.install(bucket, on_write=on_write):
    uploader = remote.Uploader(mirror) if mode == "background" else None
    on_saved = uploader.request if uploader else (lambda iteration: mirror.push())
    ckpt = checkpoints.Checkpointer(
      os.path.join(local, "checkpoints"),
      every=1,
      keep=args.saves,
      asynchronous=True,
      on_saved=on_saved,
    )
    stalls = []
    jax.block_until_ready(state)
    for iteration in range(1, args.saves + 1):
      time.sleep(args.iteration_s)  # the iteration's device work
      t0 = time.perf_counter()
      ckpt.save(iteration, state, jax.random.key(iteration), {"iteration": iteration})
      stalls.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    ckpt.close()  # the last save's files, and its on_saved
    if uploader is not None:
      uploader.close()
    end = time.perf_counter() - t0
    copies = uploader.pushes if uploader else args.saves
    fresh = os.path.join(root, "fresh")
    pulled = remote.Mirror(REMOTE, fresh).pull()
  expected = [f"checkpoints/{i}/" for i in range(1, args.saves + 1)]
  if pulled != expected or _files(os.path.join(fresh, "checkpoints")) != _files(
    os.path.join(local, "checkpoints")
  ):
    raise AssertionError(f"{mode}: the bucket does not hold every checkpoint ({pulled})")
  return {"stalls": stalls, "end_s": end, "pushes": copies}


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--preset", default="qwen3-bench", choices=sorted(config_lib.PRESETS))
  parser.add_argument("--saves", type=int, default=6, help="saves per run (one per iteration)")
  parser.add_argument("--rounds", type=int, default=2, help="runs of each mode, alternating")
  parser.add_argument("--iteration_s", type=float, default=2.0)
  parser.add_argument("--bucket_mb_per_s", type=float, default=100.0)
  parser.add_argument("--object_ms", type=float, default=30.0)
  parser.add_argument("--workdir", default="", help="where to write (default: a temporary dir)")
  parser.add_argument("--json", action="store_true", help="print the report as JSON")
  args = parser.parse_args(argv)
  if args.saves < 2 or args.rounds < 1:
    parser.error("--saves must be >= 2 and --rounds >= 1")
  state = _state(args.preset)
  root = args.workdir or tempfile.mkdtemp(prefix="bench_remote_")
  runs = {mode: [] for mode in MODES}
  for r in range(args.rounds):
    for mode in MODES if r % 2 == 0 else MODES[::-1]:
      runs[mode].append(_one_run(os.path.join(root, f"{mode}_{r}"), mode, state, args))
  report = {
    "preset": args.preset,
    "state_bytes": _nbytes(state),
    "saves": args.saves,
    "rounds": args.rounds,
    "iteration_s": args.iteration_s,
    "bucket_mb_per_s": args.bucket_mb_per_s,
    "object_ms": args.object_ms,
  }
  for mode, rows in runs.items():
    later = [s for row in rows for s in row["stalls"][1:]]  # the first save has nothing to copy
    report[mode] = {
      "stall_s": statistics.median(later),
      "end_s": statistics.median(row["end_s"] for row in rows),
      "pushes": [row["pushes"] for row in rows],
      "stalls": [[round(s, 4) for s in row["stalls"]] for row in rows],
    }
  report["stall_background_over_inline"] = (
    report["background"]["stall_s"] / report["inline"]["stall_s"]
  )
  if args.json:
    print(json.dumps(report, indent=1))
  else:
    print(
      f"{args.preset}: state {report['state_bytes'] / 2**20:.1f} MiB, a save every "
      f"{args.iteration_s:g} s, bucket {args.bucket_mb_per_s:g} MB/s + {args.object_ms:g} ms per "
      f"object, {args.saves} saves x {args.rounds} rounds (medians)"
    )
    for mode in MODES:
      row = report[mode]
      print(
        f"  {mode:10s}  stall per save {row['stall_s']:.3f} s   wait at the end {row['end_s']:.3f} s"
      )
    print(f"  background stall / inline stall: {report['stall_background_over_inline']:.3f}")
  return report


if __name__ == "__main__":
  main()
