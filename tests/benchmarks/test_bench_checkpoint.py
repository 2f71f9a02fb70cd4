"""`benchmarks/bench_checkpoint.py`: the report of a tiny run is consistent with the state it
saved (12 bytes per parameter: the params and AdamW's two moments, float32)."""

import json
import pathlib
import subprocess
import sys

import jax
import numpy as np

import processes

from seeupo_jax.models import config as config_lib

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_bench_checkpoint_times_sync_and_async_saves_of_the_whole_state(tmp_path):
  proc = subprocess.run(
    [
      sys.executable,
      str(REPO / "benchmarks" / "bench_checkpoint.py"),
      "--preset=qwen3-tiny",
      "--rounds=2",
      f"--workdir={tmp_path}",
      "--json",
    ],
    capture_output=True,
    text=True,
    env=processes.env(),
    cwd=REPO,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(proc.stdout)
  from seeupo_jax.models import qwen  # noqa: PLC0415

  shapes = jax.eval_shape(
    lambda: qwen.init_params(config_lib.PRESETS["qwen3-tiny"], jax.random.key(0))
  )
  params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
  assert report["state_bytes"] == 12 * params + 4  # + AdamW's step count (int32)
  for kind in ("sync", "async"):
    row = report[kind]
    assert len(row["rounds"]) == 2
    assert all(0 < stall <= whole for stall, whole in row["rounds"])
    assert row["write_gb_per_s"] == report["state_bytes"] / row["whole_s"] / 1e9
  assert report["stall_async_over_sync"] == report["async"]["stall_s"] / report["sync"]["stall_s"]
  # Every save is a whole checkpoint on disk (4 directories: 2 rounds x sync, async).
  saved = sorted(p.name for p in tmp_path.iterdir())
  assert saved == ["async_0", "async_1", "sync_0", "sync_1"]
  assert all((tmp_path / name / str(int(name[-1]) + 1)).is_dir() for name in saved)
