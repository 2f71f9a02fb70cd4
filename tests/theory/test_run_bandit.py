"""`experiments/run.py --config=bandit`: the command line, outputs and
reproducibility of the table."""

import os
import subprocess
import sys

import numpy as np

import processes

from experiments.configs import bandit as bandit_config
from seeupo_jax.theory import sweep

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_RUN = os.path.join(_ROOT, "experiments", "run.py")


def _run(*args):
  env = processes.env()
  return subprocess.run(
    [sys.executable, _RUN, *args], capture_output=True, text=True, env=env, cwd=_ROOT, timeout=300
  )


def test_run_prints_table_and_writes_plots(tmp_path):
  proc = _run(
    "--config=bandit",
    f"--workdir={tmp_path}",
    "--config.num_seeds=4",
    "--config.num_iterations=5",
    "--config.algorithms=seeupo,grpo",
    "--config.families=random",
    "--config.learning_rates=1,3",
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "| seeupo | random |" in proc.stdout
  assert "| grpo | random |" in proc.stdout
  assert "4 seeds" in proc.stdout
  assert (tmp_path / "curves_random.png").read_bytes()[:4] == b"\x89PNG"
  assert (tmp_path / "table.md").read_text().strip() in proc.stdout
  curves = np.load(tmp_path / "curves.npz")
  assert curves["seeupo__random"].shape == (2, 4, 6)


def test_unknown_config_name_lists_allowed(tmp_path):
  proc = _run("--config=nope", f"--workdir={tmp_path}")
  assert proc.returncode != 0
  assert "unknown config 'nope'" in proc.stderr
  assert "bandit" in proc.stderr


def test_unknown_override_names_the_key(tmp_path):
  proc = _run("--config=bandit", f"--workdir={tmp_path}", "--config.num_sedes=3")
  assert proc.returncode != 0
  assert "unknown config key 'num_sedes'" in proc.stderr


def test_table_is_reproducible_from_the_seed():
  config = bandit_config.get_config()
  config.update(
    num_seeds=6, num_iterations=8, algorithms="seeupo", families="trap", learning_rates="1,3"
  )
  quiet = lambda *_: None
  first = sweep.table(sweep.run_sweep(config, log=quiet))
  again = sweep.table(sweep.run_sweep(config, log=quiet))
  assert first == again
  config.seed = 1
  assert sweep.table(sweep.run_sweep(config, log=quiet)) != first
