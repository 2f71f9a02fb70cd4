"""The benchmark scripts run end to end on a tiny preset (so they do not rot between sessions)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def _run(script, *args):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # no 8 simulated devices
  done = subprocess.run(
    [sys.executable, str(REPO / "benchmarks" / script), *args],
    capture_output=True,
    text=True,
    env=env,
    timeout=600,
    check=True,
  )
  start = done.stdout.index("{")
  return json.loads(done.stdout[start:])


@pytest.mark.slow
@pytest.mark.parity
def test_bench_model_runs_against_torch_on_two_cpu_devices():
  result = _run(
    "bench_model.py",
    "--preset",
    "qwen3-tiny",
    "--batch",
    "2",
    "--seq",
    "16",
    "--rounds",
    "2",
    "--steps",
    "1",
    "--cpu-devices",
    "2",
  )
  assert result["jax_devices"] == 2
  assert result["jax_step_s"] > 0 and result["torch_step_s"] > 0
  assert result["ratio_jax_over_torch"] == pytest.approx(
    result["torch_step_s"] / result["jax_step_s"], rel=0.01
  )
  # One ratio per round (torch's time / ours within the round), and the win count agrees with them.
  assert len(result["round_ratios"]) == 2
  wins = sum(r >= 1.0 for r in result["round_ratios"])
  assert result["rounds_jax_faster"] == f"{wins}/2"


@pytest.mark.slow
@pytest.mark.parity
def test_bench_sampler_decodes_the_same_ids_as_torch():
  result = _run(
    "bench_sampler.py", "--preset", "qwen3-tiny", "--rounds", "1", "--new", "8", "--one-core"
  )
  assert result["cpu_cores"] == 1
  assert result["ids_agree"] == 1.0  # greedy decoding, same weights: identical tokens
  assert result["jax_tok_per_s"] > 0


@pytest.mark.slow
def test_device_check_script_runs_small_on_the_cpu(tmp_path):
  """benchmarks/device_check.sh (the prepared GPU check) runs end to end on a tiny preset."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env.update(
    OUT=str(tmp_path),
    PY=sys.executable,
    PRESET="qwen3-tiny",
    SEQ="64",
    BATCH="2",
    NEW="8",
    SKIP_TESTS="1",
  )
  done = subprocess.run(
    ["bash", str(REPO / "benchmarks" / "device_check.sh")],
    cwd=REPO,
    capture_output=True,
    text=True,
    env=env,
    timeout=600,
  )
  log = (tmp_path / "device_check.log").read_text()
  assert done.returncode == 0, log[-3000:]
  assert "FAILED" not in log
  assert log.count('"mfu"') == 2 and '"jax_tok_per_s"' in log
  assert '"seeupo_mfu"' in log  # the learner step ran and reported its MFU


@pytest.mark.parity
def test_bench_attention_matches_torch_gradients():
  result = _run(
    "bench_attention.py",
    "--batch",
    "2",
    "--seq",
    "32",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--head-dim",
    "8",
    "--block",
    "8",
    "--rounds",
    "2",
    "--steps",
    "1",
  )
  assert result["max_grad_diff"] < 1e-4  # same attention and gradient as torch SDPA
  assert result["jax_ms"] > 0 and result["torch_ms"] > 0
  assert result["ratio_torch_over_jax"] == pytest.approx(
    result["torch_ms"] / result["jax_ms"], rel=0.02
  )


@pytest.mark.slow
def test_bench_learner_reports_seeupo_against_gspo():
  result = _run(
    "bench_learner.py", "--preset", "qwen3-tiny", "--batch", "4", "--seq", "32", "--turns", "2"
  )
  row = result["turns"]["2"]
  assert set(row["rounds"]) == {"seeupo", "seeupo_separate", "gspo", "forward", "optimizer_step"}
  assert all(len(times) == 3 for times in row["rounds"].values())
  assert row["seeupo_over_gspo"] == pytest.approx(row["seeupo_s"] / row["gspo_s"], rel=0.01)
  floor = 2 * row["optimizer_step_s"] + row["forward_s"]
  assert row["seeupo_over_floor"] == pytest.approx(row["seeupo_s"] / floor, rel=0.01)
