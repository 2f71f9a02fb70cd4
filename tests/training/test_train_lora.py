"""QLoRA through `run.py`: adapters trained beside a frozen NF4 base, checkpointed alone, resumed
bit for bit, exported merged and in PEFT's format."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import processes
from seeupo_jax.models import checkpoint as hf_checkpoint
from seeupo_jax.training import metrics_log

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_RUN = os.path.join(_ROOT, "experiments", "run.py")

TARGETS = (("attn", "q_proj"), ("attn", "v_proj"), ("mlp", "down_proj"))  # (module, projection)
TARGET_NAMES = tuple(name for _, name in TARGETS)
ARGS = (
  "--config.env.num_dials=2",
  "--config.rollout.max_turns=2",
  "--config.rollout.tasks_per_iteration=4",
  "--config.rollout.samples_per_task=4",
  "--config.rollout.max_context_tokens=128",
  "--config.eval.every=0",
  "--config.log.progress_bar=False",
  "--config.log.plot=False",
  "--config.checkpoint.every=1",
  "--config.save_hf=True",
  "--config.model.lora.rank=4",
  "--config.model.lora.targets=q_proj,v_proj,down_proj",
  "--config.model.lora.quantize=nf4",
  "--config.learner.kl_coef=0.05",  # the reference is the base
  "--config.learner.turn_buckets=1",  # one length program of the update (tests/training/test_train.py)
)


def _run(workdir, iterations, env):
  proc = subprocess.run(
    [
      sys.executable,
      _RUN,
      f"--workdir={workdir}",
      *ARGS,
      f"--config.num_iterations={iterations}",
    ],
    capture_output=True,
    text=True,
    env=env,
    cwd=_ROOT,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def _strip_times(records):
  return [
    {
      k: v
      for k, v in r.items()
      if k != "time" and not k.startswith(("time/", "rollout/", "eval/"))  # the final evaluation
    }
    for r in records
  ]


@pytest.mark.slow  # three short runs of run.py
def test_qlora_run_checkpoints_the_adapters_resumes_bit_for_bit_and_exports_both_ways(tmp_path):
  """LoRA on an NF4 base (the unquantized base is the same program without the quantization:
  tests/models/test_quant.py holds the two equal)."""
  env = processes.env(JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"))
  whole, resumed = tmp_path / "whole", tmp_path / "resumed"
  _run(whole, 2, env)
  _run(resumed, 1, env)  # stops at iteration 1; the rerun extends it to 2
  proc = _run(resumed, 2, env)
  assert "resuming" in proc.stdout + proc.stderr

  # The checkpoint holds the adapters of the three targets (and their optimizer state), not
  # the base.
  manifest = json.loads((whole / "checkpoints" / "2" / "manifest" / "metadata").read_text())
  paths = [leaf["path"] for leaf in manifest["train_state"]]
  params = sorted(p for p in paths if p.startswith("params/"))
  assert params == sorted(f"params/layers/{m}/{n}/lora_{x}" for m, n in TARGETS for x in "ab")
  assert not [p for p in paths if p.startswith("base") or "embed" in p or "kernel" in p]

  # Resumed: the same exports, metrics and trajectories as the run that never stopped.
  for export in ("hf_policy/model.safetensors", "hf_adapter/adapter_model.safetensors"):
    assert (whole / export).read_bytes() == (resumed / export).read_bytes()
  whole_log = metrics_log.read_metrics(str(whole / "metrics.jsonl"))
  resumed_log = metrics_log.read_metrics(str(resumed / "metrics.jsonl"))
  assert [r["iteration"] for r in resumed_log] == [1, 2]
  assert _strip_times(resumed_log) == _strip_times(whole_log)
  assert all(r["kl"] >= 0 for r in whole_log) and whole_log[-1]["kl"] > 0

  # The policy the run sampled and trained: the fresh model's projections in NF4 (the preset's
  # initialisation at seed 0), adapters beside them. hf_policy is every projection
  # dequantized, the targets' with the PEFT export's adapters merged; the rest is the fresh
  # model's.
  from seeupo_jax.models import lora, peft_io, quant, qwen  # noqa: PLC0415
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  config, exported = hf_checkpoint.load(str(whole / "hf_policy"))
  k_params = jax.random.split(jax.random.key(0))[0]  # the run's (seed 0, `program.init_state`)
  run_config = config.replace(
    lora_rank=4, lora_alpha=16.0, lora_targets=TARGET_NAMES, quantize="nf4"
  )
  base = lora.split(qwen.init_params(run_config, k_params))[1]
  assert base["layers"]["attn"]["k_proj"]["kernel_nf4"].dtype == jnp.uint8
  dense = quant.dequantize_params(base, jnp.float32)
  adapters = peft_io.load(str(whole / "hf_adapter"), run_config)
  merged = lora.merge(lora.combine(base, adapters), run_config.lora_scale)
  layers = exported["layers"]
  for module, names in quant.PROJECTIONS.items():
    for name in names:
      got = np.asarray(layers[module][name]["kernel"], np.float32)
      want = merged["layers"][module][name]["kernel"].astype(config.param_dtype)
      np.testing.assert_array_equal(got, np.asarray(want, np.float32))
      plain = np.asarray(dense["layers"][module][name]["kernel"].astype(config.param_dtype))
      if name in TARGET_NAMES:
        assert np.abs(got - plain).max() > 0  # trained
      else:
        np.testing.assert_array_equal(got, plain)
  fresh = qwen.init_params(config, k_params)
  np.testing.assert_array_equal(exported["embed"]["embedding"], fresh["embed"]["embedding"])
  peft_config = json.loads((whole / "hf_adapter" / "adapter_config.json").read_text())
  assert (peft_config["r"], peft_config["lora_alpha"]) == (4, 16.0)
