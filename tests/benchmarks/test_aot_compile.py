"""benchmarks/aot_compile.py compiles an iteration's programs for a TPU slice on this CPU host.

The TPU compiler comes from libtpu (the `tpu-compile` extra, which README's install line and CI
include); no TPU is needed. A change that breaks TPU compilation of the update or the decode step
fails here. The byte counts are checked against what the shapes imply, computed by hand.
"""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import processes

REPO = pathlib.Path(__file__).resolve().parents[2]
TINY = (  # the synthetic config at qwen3-tiny in bf16, 2 turns, a small batch
  "--config=synthetic",
  "--config.model.dtype=bfloat16",
  "--config.model.param_dtype=bfloat16",
  "--config.rollout.max_turns=2",
  "--config.rollout.tasks_per_iteration=4",
  "--config.rollout.samples_per_task=4",
  "--config.rollout.max_context_tokens=64",
  "--config.rollout.decode_slots=8",
)


def _compile(tmp_path, *args):
  out = tmp_path / "report.json"
  done = subprocess.run(
    [sys.executable, str(REPO / "benchmarks" / "aot_compile.py"), *args, f"--json={out}"],
    capture_output=True,
    text=True,
    # No persistent cache: a program read back from it may not report its memory.
    env=processes.env(level=1, JAX_ENABLE_COMPILATION_CACHE="false"),
    timeout=900,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(out.read_text()), done.stdout


def _tiny_shapes():
  """(param sizes, kv bytes per token) of qwen3-tiny, from its published shape (hand-written)."""
  vocab, hidden, inter, layers, heads, kv, hd = 512, 64, 128, 2, 4, 2, 16
  per_layer = [
    hidden * heads * hd,  # q
    hidden * kv * hd,  # k
    hidden * kv * hd,  # v
    heads * hd * hidden,  # o
    hidden * inter * 3,  # gate, up, down
    hidden * 2,  # the two RMSNorm scales
    hd * 2,  # q_norm, k_norm
  ]
  params = vocab * hidden * 2 + hidden + layers * sum(per_layer)  # embed, head, final norm
  kv_token = 2 * layers * kv * hd * 2  # K and V, bf16
  return params, kv_token


@pytest.mark.slow
@pytest.mark.fresh_compiles
def test_the_update_reshard_and_decode_compile_for_a_v5e_2x2_slice(tmp_path):
  pytest.importorskip(
    "libtpu", reason="the tpu-compile extra (README's install line) is not installed"
  )
  report, stdout = _compile(tmp_path, "--topology=v5e-4", *TINY)
  facts, programs = report["facts"], report["programs"]
  assert facts["devices"] == 4 and facts["platform"] == "tpu"
  assert facts["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
  assert (facts["rows"], facts["length"], facts["turns"]) == (16, 64, 2)
  assert set(programs) == {"update", "reshard", "decode"}
  assert all(p["fits"] for p in programs.values()), programs

  params, kv_token = _tiny_shapes()
  assert facts["params"] == params
  # The state per chip: bf16 params and reference, float32 masters and two Adam moments, each
  # split over the 4 chips (some small leaves are replicated: so between 1/4 and all of it).
  state = sum(facts["state_bytes"].values())
  whole = params * (2 + 2 + 4 + 4 + 4)
  assert whole / 4 <= state <= whole
  # The update's arguments are the state, the batch's rows (split over 4 chips) and the key;
  # the TPU lays small arrays out in whole (8, 128) tiles, so they take more than their bytes
  # (x 1.3 here), never less.
  batch = 16 * 64 * (4 + 1 + 4 + 4) + 16 * (4 + 4 + 1)
  update = programs["update"]
  assert state + batch / 4 <= update["argument_GiB"] * 2**30 <= 2 * (state + batch)
  # Donated: the new state is written over the old.
  assert update["alias_GiB"] * 2**30 >= 0.9 * state
  # FSDP over 4 chips: the update gathers the params and reduces the gradients.
  assert update["collectives"]["all-gather"]["ops"] > 0
  assert (
    update["collectives"]["all-reduce"]["ops"]
    + update["collectives"].get("reduce-scatter", {"ops": 0})["ops"]
    > 0
  )
  # The decode call's arguments hold the KV pool: 8 rows x ceil((64 + 8 + 1) / 32) = 3 pages
  # (rounded up to whole attention blocks of 128 / 32 = 4 pages) + the scratch page, 32 slots
  # each; the kv heads (2) split over the 4 decode chips' tensor axis where they divide.
  pages = 1 + 8 * 4
  kv_pool = pages * 32 * kv_token
  decode = programs["decode"]
  assert facts["kv_pages"] == pages
  assert decode["argument_GiB"] * 2**30 >= kv_pool / 4
  for name in ("update", "decode step", "reshard"):
    assert report["bounds"][name]["seconds"] > 0 or name == "reshard"
  assert "bound update" in stdout and "MFU ceiling" in stdout
  np.testing.assert_allclose(
    report["bounds"]["update"]["compute_s"],
    report["bounds"]["update"]["model_flops"] / 4 / 197e12,
    rtol=1e-9,
  )


@pytest.mark.fresh_compiles
def test_a_decode_pool_larger_than_the_chip_says_it_does_not_fit(tmp_path):
  pytest.importorskip(
    "libtpu", reason="the tpu-compile extra (README's install line) is not installed"
  )
  # 64 rows x 2^20 tokens of qwen3-tiny's 256-byte K/V per token: 16 GiB of pool, over 2 kv
  # heads on 4 chips (2 hold each head: 8 GiB each)... and more than v5e's 16 GB with the
  # page tables and replicas: the report must say no, with the pool in its arguments.
  _, kv_token = _tiny_shapes()
  report, stdout = _compile(
    tmp_path,
    "--topology=v5e-4",
    *TINY,
    "--programs=decode",
    "--config.rollout.decode_slots=64",
    "--decode_context=2097152",
  )
  decode = report["programs"]["decode"]
  pool = report["facts"]["kv_pages"] * 32 * kv_token
  if decode["fits"] is False and "error" in decode:  # refused by the compiler itself
    assert decode["needed_GiB"] > decode["available_GiB"] > 0
  else:
    assert decode["argument_GiB"] * 2**30 >= pool / 4
    assert decode["peak_GiB"] * 2**30 > 16e9
    assert " no " in stdout.split("decode")[1][:20]
