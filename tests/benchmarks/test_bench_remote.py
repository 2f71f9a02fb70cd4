"""`benchmarks/bench_remote.py`: a tiny run of both modes reports a stall per save after the
first and leaves every checkpoint complete in the fake bucket (the script checks that itself,
byte for byte, and fails otherwise)."""

import json
import pathlib
import statistics
import subprocess
import sys

import pytest

import processes

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_bench_remote_times_both_modes_and_leaves_every_checkpoint_in_the_bucket(tmp_path):
  proc = subprocess.run(
    [
      sys.executable,
      str(REPO / "benchmarks" / "bench_remote.py"),
      "--preset=qwen3-tiny",
      "--saves=3",
      "--rounds=1",
      "--iteration_s=0.05",
      "--object_ms=1",
      "--bucket_mb_per_s=1000",
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
  for mode in ("inline", "background"):
    row = report[mode]
    (stalls,) = row["stalls"]
    assert len(stalls) == 3 and all(s > 0 for s in stalls)
    assert row["stall_s"] == pytest.approx(statistics.median(stalls[1:]), abs=1e-4)  # rounded
    assert row["end_s"] > 0
  assert report["inline"]["pushes"] == [3]  # one copy per save, in the training thread
  assert 1 <= report["background"]["pushes"][0] <= 4  # requests during a copy make one more
  ratio = report["background"]["stall_s"] / report["inline"]["stall_s"]
  assert report["stall_background_over_inline"] == ratio
  for mode in ("inline", "background"):  # each run's local directory and bucket
    assert (tmp_path / f"{mode}_0" / "bucket" / "gs" / "bench" / "run" / "checkpoints").is_dir()
