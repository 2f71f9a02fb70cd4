"""LoRA through `run.py`: adapters trained beside the frozen base, checkpointed alone, resumed
bit for bit, exported merged."""

import json
import os
import subprocess
import sys

import numpy as np

import processes
from seeupo_jax.models import checkpoint as hf_checkpoint
from seeupo_jax.training import metrics_log

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_RUN = os.path.join(_ROOT, "experiments", "run.py")

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
  "--config.learner.kl_coef=0.05",  # the reference is the base
)


def _run(workdir, iterations, env):
  proc = subprocess.run(
    [sys.executable, _RUN, f"--workdir={workdir}", *ARGS, f"--config.num_iterations={iterations}"],
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


def test_lora_run_checkpoints_the_adapters_and_resumes_bit_for_bit(tmp_path):
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
  assert params == sorted(
    f"params/layers/{m}/{n}/lora_{x}"
    for m, n in (("attn", "q_proj"), ("attn", "v_proj"), ("mlp", "down_proj"))
    for x in "ab"
  )
  assert not [p for p in paths if p.startswith("base") or "embed" in p or p.endswith("kernel")]

  # Resumed: the same merged export, metrics and trajectories as the run that never stopped.
  a = (whole / "hf_policy" / "model.safetensors").read_bytes()
  assert a == (resumed / "hf_policy" / "model.safetensors").read_bytes()
  whole_log = metrics_log.read_metrics(str(whole / "metrics.jsonl"))
  resumed_log = metrics_log.read_metrics(str(resumed / "metrics.jsonl"))
  assert [r["iteration"] for r in resumed_log] == [1, 2]
  assert _strip_times(resumed_log) == _strip_times(whole_log)
  assert all(r["kl"] >= 0 for r in whole_log) and whole_log[-1]["kl"] > 0

  # The export is the base with the adapters merged: the adapted kernels moved, the others
  # are the fresh model's (the preset's initialisation at seed 0).
  from seeupo_jax.models import lora, qwen  # noqa: PLC0415
  import jax  # noqa: PLC0415

  config, exported = hf_checkpoint.load(str(whole / "hf_policy"))
  k_params = jax.random.split(jax.random.key(0))[0]  # the run's (seed 0, `program.init_state`)
  fresh = lora.split(qwen.init_params(config, k_params))[1]
  layers = exported["layers"]
  for module, name in (("attn", "q_proj"), ("attn", "v_proj"), ("mlp", "down_proj")):
    assert (
      np.abs(layers[module][name]["kernel"] - fresh["layers"][module][name]["kernel"]).max() > 0
    )
  for module, name in (("attn", "k_proj"), ("attn", "o_proj"), ("mlp", "up_proj")):
    np.testing.assert_array_equal(
      layers[module][name]["kernel"], fresh["layers"][module][name]["kernel"]
    )
  np.testing.assert_array_equal(exported["embed"]["embedding"], fresh["embed"]["embedding"])
