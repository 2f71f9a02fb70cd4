"""benchmarks/fit_table.py: the activation fit recovers known coefficients, and a cell's M is the
fewest micro-batches whose state + temporaries fit, by the formula computed here by hand.

fit_table.py simulates 32 CPU devices when it is imported, so the checks run in a subprocess.
"""

import json
import pathlib
import subprocess
import sys

import processes

REPO = pathlib.Path(__file__).resolve().parents[2]

_CHECK = r"""
import json, sys
sys.path.insert(0, "benchmarks")
import fit_table
from seeupo_jax.devtools import aot
from seeupo_jax.models import config as config_lib

out = {}
g, a = 10.0, 3.0  # bytes per parameter per chip; bytes per layer x hidden x token
paths = []
for i, (model, chips, rows, length, m) in enumerate(
    [("qwen3-0.6b", 4, 16, 4096, 1), ("qwen3-14b", 8, 8, 2048, 1), ("qwen3-4b", 8, 8, 8192, 2)]
):
  c = config_lib.get_preset(model)
  p = aot.params_count(c)
  tokens = rows * length / chips / m
  temp = g * p / chips + a * c.num_layers * c.hidden_size * tokens
  facts = dict(params=p, devices=chips, rows=rows, length=length, microbatches=m,
               remat="full", device_kind="TPU v5")
  path = f"{sys.argv[1]}/r{i}.json"
  with open(path, "w") as f:
    json.dump(dict(facts=facts, programs=dict(update=dict(temp_GiB=temp / aot.GIB))), f)
  paths.append(path)
fg, fa, points = fit_table.calibrate(paths)
out["g"], out["a"], out["points"] = fg, fa, len(points)
shape = fit_table.SHAPES["appworld"]
row = fit_table.fit("qwen3-0.6b", "v5p-8", shape, True, g, a)
c = config_lib.get_preset("qwen3-0.6b")
out["row"] = row
out["lora_row"] = fit_table.fit("qwen3-0.6b", "v5p-8", shape, False, g, a, (16, "int8"))
out["lora_trained"] = fit_table.trained_params("qwen3-0.6b", (16, "int8"))
out["lora_b_row"] = fit_table.fit("qwen3-0.6b", "v5p-8", shape, False, g, a, (16, "int8"), 2.0)
out["params"] = aot.params_count(c)
out["layers_hidden"] = c.num_layers * c.hidden_size
print(json.dumps(out))
"""


def test_the_fit_recovers_known_coefficients_and_m_is_the_fewest_that_fits(tmp_path):
  done = subprocess.run(
    [sys.executable, "-c", _CHECK, str(tmp_path)],
    capture_output=True,
    text=True,
    cwd=REPO,
    env=processes.env(),
    timeout=600,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  out = json.loads(done.stdout.strip().splitlines()[-1])
  assert out["points"] == 3
  assert abs(out["g"] - 10.0) < 1e-6 and abs(out["a"] - 3.0) < 1e-6

  row, p, lh = out["row"], out["params"], out["layers_hidden"]
  gib = 2.0**30
  chips, hbm = 4, 95e9  # v5p-8: 4 chips of 95 GB
  assert row["chips"] == chips
  # bf16 params and reference + float32 masters and two moments: 16 bytes a parameter, split
  # over the 4 chips (small leaves replicated: so at least a quarter, at most all of it).
  state = row["state_GiB"] * gib
  assert 16 * p / chips <= state <= 16 * p
  rows, length = 256, 13312 + 3072

  def total(m):
    return state + 10.0 * p / chips + 3.0 * lh * rows * length / chips / m

  m = row["microbatches"]
  assert total(m) <= 0.9 * hbm
  assert m == 1 or total(m // 2) > 0.9 * hbm
  assert abs(row["act_GiB"] * gib - (total(m) - state)) < 1e-3 * gib

  # LoRA rank 16 on every projection of Qwen3-0.6B (28 layers, D 1024, q 2048, k/v 1024, F
  # 3072): r (in + out) per projection, by hand.
  per_layer = 16 * sum(
    i + o
    for i, o in [(1024, 2048), (1024, 1024), (1024, 1024), (2048, 1024)]
    + [(1024, 3072), (1024, 3072), (3072, 1024)]
  )
  assert out["lora_trained"] == 28 * per_layer
  lora = out["lora_row"]
  assert (lora["lora_rank"], lora["quantize"]) == (16, "int8")
  # The int8 base is about 1 byte a parameter where full fine-tuning's state is 16.
  assert lora["state_GiB"] < state / gib / 4
  m = lora["microbatches"]
  act = 10.0 * out["lora_trained"] / chips + 3.0 * lh * rows * length / chips / m
  assert abs(lora["act_GiB"] * gib - act) < 1e-3 * gib
  # The frozen base's term: b = 2 bytes per base parameter and chip, added at the cell's M.
  lora_b = out["lora_b_row"]
  m = lora_b["microbatches"]
  act = 10.0 * out["lora_trained"] / chips + 2.0 * p / chips
  act += 3.0 * lh * rows * length / chips / m
  assert abs(lora_b["act_GiB"] * gib - act) < 1e-3 * gib
