"""What a new user of `experiments/run.py` meets first: a quiet start, readable tables, figures
that read at a glance, one `error:` line for every mistake, no empty workdir left by a refused
start, and where the outputs are at the end."""

import json
import os
import pathlib
import re
import stat
import subprocess
import sys

import numpy as np
import pytest

import processes
import shared_runs

from seeupo_jax import envs
from seeupo_jax.training import config as config_lib
from seeupo_jax.training import evaluation
from seeupo_jax.training import metrics_log
from seeupo_jax.training import trainer
from seeupo_jax.rollout import Trajectory

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_RUN = os.path.join(_ROOT, "experiments", "run.py")
sys.path.insert(0, _ROOT)
from experiments import configs  # noqa: E402


def _python(code: str, *args, timeout=300):
  env = processes.env()
  return subprocess.run(
    [sys.executable, "-c", code, *args],
    capture_output=True,
    text=True,
    env=env,
    cwd=_ROOT,
    timeout=timeout,
  )


def _run(*args, timeout=300):
  env = processes.env()
  return subprocess.run(
    [sys.executable, _RUN, *args],
    capture_output=True,
    text=True,
    env=env,
    cwd=_ROOT,
    timeout=timeout,
  )


def _one_error_line(proc, status=2) -> str:
  """The run's only stderr line, `error: ...`, after checking the status."""
  assert proc.returncode == status, proc.stderr[-3000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
  return lines[0]


# ----------------------------------------------------------------------------------------------
# A quiet start.

_HIDE_TORCH = "import sys; sys.modules['torch'] = None  # import torch fails, find_spec is None\n"


def test_transformers_without_torch_says_nothing_about_pytorch():
  # Without seeupo_jax, transformers advises that PyTorch is missing (so the hiding works) ...
  plain = _python(_HIDE_TORCH + "import transformers\n")
  assert plain.returncode == 0, plain.stderr[-2000:]
  assert "PyTorch was not found" in plain.stdout + plain.stderr
  # ... and through seeupo_jax, which takes only tokenizers and chat templates from it, not.
  ours = _python(
    _HIDE_TORCH
    + "from seeupo_jax.text import chat_tokens, tokenizer\n"
    + "from transformers.utils import import_utils\n"
    + "tok = tokenizer.build_default_tokenizer()\n"
    + "chat_tokens.ChatTokens(tok)\n"
    + "print('torch available:', import_utils.is_torch_available())\n"
  )
  assert ours.returncode == 0, ours.stderr[-2000:]
  assert "torch available: False" in ours.stdout
  assert "PyTorch" not in ours.stdout + ours.stderr, ours.stdout + ours.stderr


# ----------------------------------------------------------------------------------------------
# Per-turn metrics of turns that no trajectory reached.


def test_per_turn_metrics_are_logged_for_the_turns_some_trajectory_reached():
  learner_metrics = {
    "turn/trajectories": np.array([4.0, 4.0, 0.0], np.float32),
    "turn/M_min": np.array([0.9, 1.0, np.inf], np.float32),  # the learner's placeholders
    "turn/M_max": np.array([1.1, 1.0, -np.inf], np.float32),
    "turn/loss": np.array([0.5, 0.25, 0.0], np.float32),
    "loss": np.float32(0.375),
    "M_min": np.float32(0.9),
    "turns_updated": np.float32(2),
  }
  out = trainer._scalars(learner_metrics)
  assert out == {
    "turn/trajectories/t0": 4.0,
    "turn/trajectories/t1": 4.0,
    "turn/M_min/t0": pytest.approx(0.9),
    "turn/M_min/t1": 1.0,
    "turn/M_max/t0": pytest.approx(1.1),
    "turn/M_max/t1": 1.0,
    "turn/loss/t0": 0.5,
    "turn/loss/t1": 0.25,
    "loss": 0.375,
    "M_min": pytest.approx(0.9),
    "turns_updated": 2.0,
  }
  assert all(np.isfinite(v) for v in out.values())
  # No turn updated (every row invalid): the M statistics are the placeholders +-inf.
  none = {
    "turn/trajectories": np.zeros(2, np.float32),
    "turn/M_min": np.full(2, np.inf, np.float32),
    "M_min": np.float32(np.inf),
    "M_max": np.float32(-np.inf),
    "loss": np.float32(0.0),
    "turns_updated": np.float32(0),
  }
  assert trainer._scalars(none) == {"loss": 0.0, "turns_updated": 0.0}


# ----------------------------------------------------------------------------------------------
# Counts print as counts, learning rates as written.


def test_evaluation_counts_are_ints_and_print_as_ints():
  trajectories = [
    Trajectory("a", 0, 0, reward=1.0, success=True),
    Trajectory("a", 0, 1, reward=0.0, success=False),
    Trajectory("b", 1, 0, reward=0.0, success=False, dropped=True),
    Trajectory("b", 1, 1, reward=0.0, success=False, dropped=True),
  ]
  scores = evaluation.pass_at_k(trajectories, 2)
  assert scores == {"avg@2": 0.5, "pass@2": 1.0, "reward": 0.5, "tasks": 1, "failed_tasks": 1}
  assert type(scores["tasks"]) is int and type(scores["failed_tasks"]) is int
  table = metrics_log.format_table([{"iteration": 3, **scores}], ["iteration", *scores])
  assert table.splitlines()[-1].split() == ["3", "0.500", "1.000", "0.500", "1", "1"]


def test_the_bandit_program_prints_its_learning_rates_as_written():
  from experiments.configs import bandit as bandit_config
  from seeupo_jax.theory import sweep

  config = bandit_config.get_config()
  config.update(
    num_seeds=2, num_iterations=2, algorithms="seeupo", families="random", learning_rates="0.3,1,3"
  )
  assert "learning-rate grid [0.3, 1, 3], best per row" in sweep.describe(config)
  lines = []
  sweep.run_sweep(config, log=lines.append)
  (line,) = lines
  assert re.search(r"lr grid \[0\.3, 1, 3\], best (0\.3|1|3)\)$", line), line


# ----------------------------------------------------------------------------------------------
# A short run: its table, its figures (at every evaluation), its per-turn metrics, its last words.

_SHORT = (
  "--config.env.num_dials=2",
  "--config.rollout.max_turns=3",  # one turn more than the lock has: no trajectory reaches it
  "--config.rollout.tasks_per_iteration=2",
  "--config.rollout.samples_per_task=2",
  "--config.rollout.max_context_tokens=128",
  "--config.num_iterations=3",
  "--config.eval.num_tasks=2",
  "--config.eval.k=2",
  "--config.eval.every=2",
  "--config.checkpoint.every=100",
  "--config.log.progress_bar=False",
)

# run.py, with the trainer's `plot` wrapped to say after each call which iteration the figures
# hold and when each file was last written.
_SPY = """
import os, runpy, sys
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(sys.argv[0]))))
from seeupo_jax.training import metrics_log, trainer
real = trainer.plot
def plot(config, workdir, spec):
  figures = real(config, workdir, spec)
  last = metrics_log.read_metrics(os.path.join(workdir, "metrics.jsonl"))[-1]["iteration"]
  times = [os.stat(os.path.join(workdir, name)).st_mtime_ns for name in sorted(figures)]
  print("PLOTTED", last, *times, flush=True)
  return figures
trainer.plot = plot
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
  """The short run's workdir and what it printed, made once per session, whichever xdist worker
  asks first (`shared_runs.once`)."""

  def make(root):
    proc = _python(_SPY, _RUN, f"--workdir={root / 'run'}", *_SHORT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(root / "run"), proc.stdout, proc.stderr

  workdir, stdout, stderr = shared_runs.once(tmp_path_factory, "first_contact_short_run", make)
  return pathlib.Path(workdir), subprocess.CompletedProcess([], 0, stdout, stderr)


def _typed(*overrides):
  config = configs.get_config("synthetic")
  config.update_from_flattened_dict(
    {
      arg.split("=")[0].removeprefix("--config."): json.loads(arg.split("=")[1].lower())
      for arg in overrides
    }
  )
  return config_lib.typed(config)


@pytest.mark.slow
def test_a_short_run_writes_both_figures_at_every_evaluation(short_run):
  workdir, proc = short_run
  plotted = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("PLOTTED")]
  assert [int(p[0]) for p in plotted] == [2, 3]  # eval.every=2, and the last iteration
  for column in (1, 2):  # curves.png, diagnostics.png: rewritten each time
    assert int(plotted[0][column]) < int(plotted[1][column])
  import matplotlib.image

  assert matplotlib.image.imread(workdir / "curves.png").shape[:2] == (750, 1200)
  assert matplotlib.image.imread(workdir / "diagnostics.png").shape[:2] == (1100, 1500)


@pytest.mark.slow
def test_the_curves_are_the_learning_curves_with_the_chance_line(short_run):
  workdir, _ = short_run
  config = _typed(*_SHORT)
  spec = envs.make_spec("synthetic", config.env_options())
  figures = trainer.plot(config, str(workdir), spec)
  curves, diagnostics = figures["curves.png"], figures["diagnostics.png"]
  titles = [ax.get_title() for ax in curves.axes]
  assert titles == [
    "train reward",
    "train success",
    "held-out avg@2 (success of all samples)",
    "held-out pass@2 (tasks solved in 2 samples)",
  ]

  def chance_lines(ax):
    return [line for line in ax.get_lines() if line.get_label().startswith("chance")]

  # 2 dials: a policy that ignores the clues opens 1/4 of the locks; in 2 samples 1 - (3/4)^2.
  assert spec.chance == 0.25
  assert chance_lines(curves.axes[0]) == []
  for ax, level in zip(curves.axes[1:], (0.25, 0.25, 1 - 0.75**2)):
    (line,) = chance_lines(ax)
    assert np.allclose(line.get_ydata(), level)
  assert curves.get_size_inches() * curves.dpi == pytest.approx((1200, 750))
  assert "turns per trajectory" in [ax.get_title() for ax in diagnostics.axes if ax.get_visible()]
  for ax in curves.axes + diagnostics.axes:  # tick labels are the values, never an offset
    formatter = ax.yaxis.get_major_formatter()
    assert not getattr(formatter, "get_useOffset", lambda: False)()
  # The diagnostics: the length's axis reads in tokens, e.g. "78" and not "+7.8e1".
  ax = next(ax for ax in diagnostics.axes if ax.get_title() == "trajectory length (tokens)")
  diagnostics.canvas.draw()
  assert ax.yaxis.get_offset_text().get_text() == ""


def test_an_environment_without_a_chance_level_gets_no_chance_line(tmp_path):
  records = [{"iteration": i, "success": 0.5, "eval/avg@4": 0.5} for i in range(1, 4)]
  figure = metrics_log.plot_panels(
    records, str(tmp_path / "c.png"), trainer.curve_panels(4, None), title="t"
  )
  # The panels with no data (reward, pass@4) are left out.
  assert [ax.get_title() for ax in figure.axes] == [
    "train success",
    "held-out avg@4 (success of all samples)",
  ]
  assert not any(line.get_label().startswith("chance") for ax in figure.axes for line in ax.lines)
  # A smoothed panel: the raw points and their trailing mean.
  raw, mean = figure.axes[0].get_lines()
  assert list(raw.get_ydata()) == [0.5] * 3 and list(mean.get_ydata()) == [0.5] * 3


def test_the_trailing_mean_skips_gaps():
  values = np.array([1.0, np.nan, 3.0, 5.0, np.nan, np.nan, np.nan])
  np.testing.assert_allclose(
    metrics_log.trailing_mean(values, 2), [1.0, 1.0, 3.0, 4.0, 5.0, np.nan, np.nan]
  )


@pytest.mark.slow
def test_a_short_run_logs_no_value_for_a_turn_no_trajectory_reached(short_run):
  workdir, proc = short_run
  assert "NaN or Inf" not in proc.stderr  # tensorboardX's complaint about an inf it was given
  records = metrics_log.read_metrics(str(workdir / "metrics.jsonl"))
  assert [r["iteration"] for r in records] == [1, 2, 3]
  for record in records:
    turn_keys = [key for key in record if key.startswith("turn/")]
    assert {key.rsplit("/", 1)[1] for key in turn_keys} == {"t0", "t1"}  # the lock's 2 dials
    assert None not in record.values(), [k for k, v in record.items() if v is None]


@pytest.mark.slow
def test_a_short_run_prints_counts_as_ints_and_ends_saying_where_its_outputs_are(short_run):
  workdir, proc = short_run
  lines = proc.stdout.splitlines()
  headers = [i for i, line in enumerate(lines) if line.split()[:1] == ["iteration"]]
  assert len(headers) == 2  # one table per evaluation
  for i in headers:
    row = dict(zip(lines[i].split(), lines[i + 2].split()))
    assert row["tasks"] == "2" and row["failed_tasks"] == "0", lines[i : i + 3]
  start = lines.index(f"outputs in {workdir}:")
  listing = lines[start + 1].split()
  for name in (
    "checkpoints/",
    "curves.png",
    "diagnostics.png",
    "metrics.jsonl",
    "tensorboard/",
    "trajectories.jsonl",
  ):
    assert name in listing, listing
  assert "lock" not in listing  # released before
  assert len(lines) - start <= 6  # one short block, the last lines of the run


# ----------------------------------------------------------------------------------------------
# The workdir: ignored by git, its log's mode kept, none left behind by a refused start.


def test_runs_is_ignored_by_git():
  proc = subprocess.run(
    ["git", "check-ignore", "-q", "runs/synthetic/metrics.jsonl"], cwd=_ROOT, check=False
  )
  assert proc.returncode == 0


@pytest.mark.parametrize("mode", [0o644, 0o640])
def test_metrics_jsonl_keeps_its_mode_when_a_resume_rewrites_it(tmp_path, mode):
  path = tmp_path / "metrics.jsonl"
  with metrics_log.MetricsLog(str(tmp_path), tensorboard=False) as log:
    for i in range(1, 5):
      log.write(i, {"loss": float(i)})
  os.chmod(path, mode)
  with metrics_log.MetricsLog(str(tmp_path), tensorboard=False, resume_from=3):
    pass
  assert [r["iteration"] for r in metrics_log.read_metrics(str(path))] == [1, 2]  # rewritten
  assert stat.S_IMODE(os.stat(path).st_mode) == mode
  assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary file left


def _refused_config():
  config = configs.get_config("synthetic")
  config.env.num_dials = 0  # checked by the environment's own config, when the run builds it
  return config


def test_a_run_refused_at_start_up_leaves_no_workdir_behind(tmp_path):
  workdir = tmp_path / "runs" / "new"
  with pytest.raises(config_lib.ConfigError, match="num_dials=0"):
    trainer.main(_refused_config(), str(workdir))
  assert not (tmp_path / "runs").exists()  # nor the parent it made
  # A workdir that was there before is kept, empty as it was.
  workdir.mkdir(parents=True)
  with pytest.raises(config_lib.ConfigError, match="num_dials=0"):
    trainer.main(_refused_config(), str(workdir))
  assert workdir.is_dir() and not any(workdir.iterdir())


def test_the_bandit_program_refuses_a_bad_config_with_one_line_and_no_workdir(tmp_path):
  workdir = tmp_path / "bandit"
  proc = _run("--config=bandit", f"--workdir={workdir}", "--config.families=nope")
  line = _one_error_line(proc)
  assert "unknown instance family 'nope'" in line and "allowed: [" in line
  assert not workdir.exists()


# ----------------------------------------------------------------------------------------------
# Every mistake: one `error:` line, status 2.


@pytest.mark.parametrize(
  "flag, message",
  [
    ("--config.rollout.max_turns=three", "rollout.max_turns='three'; expected an int"),
    ("--config.log.plot=maybe", "log.plot='maybe'; expected True or False"),
    ("--config.optimizer.learning_rate=fast", "optimizer.learning_rate='fast'; expected a number"),
  ],
)
def test_a_wrongly_typed_override_is_one_error_line_naming_key_value_and_type(
  tmp_path, flag, message
):
  proc = _run(f"--workdir={tmp_path / 'w'}", flag)
  line = _one_error_line(proc)
  assert line == f"error: bad config for --config=synthetic: {message}"
  assert not (tmp_path / "w").exists()


def test_a_positional_argument_is_one_error_line(tmp_path):
  proc = _run(f"--workdir={tmp_path / 'w'}", "synthetic")
  assert "unexpected arguments ['synthetic']" in _one_error_line(proc)


def test_the_temperature_message_names_keys_that_exist():
  config = configs.get_config("synthetic")
  config.rollout.temperature = 0.0
  with pytest.raises(config_lib.ConfigError) as info:
    config_lib.typed(config)
  message = str(info.value)
  assert message.startswith("rollout.temperature=0.0; allowed: a finite number > 0")
  assert "eval.greedy=True" in message and "use greedy=True" not in message
  assert config.eval.greedy is False  # eval.greedy is a key of the config; rollout.greedy is not
  assert "greedy" not in config.rollout


def test_no_appworld_server_names_the_first_and_the_count(tmp_path):
  with pytest.raises(envs.EnvironmentUnavailable) as info:
    envs.make_spec(
      "appworld",
      {"host": "127.0.0.1", "base_port": 1, "num_servers": 256, "datasets_dir": str(tmp_path)},
    )
  message = str(info.value)
  assert "\n" not in message and len(message) < 600, message
  assert "256 tried, http://127.0.0.1:1 .. http://127.0.0.1:256; the first: " in message
  assert "http://127.0.0.1:2/" not in message and "http://127.0.0.1:2 " not in message
  assert "appworld_servers.sh 256 1" in message
