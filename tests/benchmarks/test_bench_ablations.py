"""benchmarks/bench_ablations.py: its statistics on hand-made records, and its variant table."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_ablations.py")
_SPEC = importlib.util.spec_from_file_location("bench_ablations", _PATH)
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)


def _records(success, evals=None):
  """Metrics lines of one run: iterations 1..N, with eval/avg@4 at the given {iteration: value}."""
  evals = evals or {}
  out = []
  for i, s in enumerate(success, start=1):
    r = {"iteration": i, "success": s, "time/iteration": 1.0}
    if i in evals:
      r.update({"eval/avg@4": evals[i], "eval/pass@4": 1.0, "time/eval": 0.5})
    out.append(r)
  return out


def test_t_quantiles_are_the_tables():
  assert bench.t_quantile(4) == pytest.approx(2.776, abs=5e-4)
  assert bench.t_quantile(1) == pytest.approx(12.706, abs=5e-4)
  assert bench.t_quantile(2) == pytest.approx(4.303, abs=5e-4)
  assert bench.t_quantile(30) == pytest.approx(2.042, abs=5e-4)


def test_mean_interval_of_three_curves():
  # Per point: values (0, 1, 2) and (1, 2, 6): means 1 and 3, sample stds 1 and sqrt(7).
  mean, half = bench.mean_interval([[0.0, 1.0], [1.0, 2.0], [2.0, 6.0]])
  np.testing.assert_allclose(mean, [1.0, 3.0])
  np.testing.assert_allclose(half, [4.3027 / math.sqrt(3), 4.3027 * math.sqrt(7 / 3)], rtol=1e-4)


def test_mean_interval_of_one_seed_is_nan():
  mean, half = bench.mean_interval([[0.5, 0.7]])
  np.testing.assert_allclose(mean, [0.5, 0.7])
  assert np.isnan(half).all()


def test_paired_p_by_hand():
  # Differences (1, 2, 3): mean 2, sd 1, t = 2 sqrt(3) on df = 2, where
  # P(|T| > t) = 1 - t / sqrt(t^2 + 2) = 1 - sqrt(12 / 14).
  assert bench.paired_p([1.0, 2.0, 3.0], [0.0, 0.0, 0.0]) == pytest.approx(1 - math.sqrt(6 / 7))
  # The pairing counts: the same samples in another order are a different test.
  assert bench.paired_p([1.0, 2.0, 3.0], [0.5, 1.5, 2.5]) < 1e-6
  assert bench.paired_p([1.0, 2.0, 3.0], [2.5, 1.5, 0.5]) > 0.5
  assert math.isnan(bench.paired_p([1.0, 2.0], [1.0, 2.0]))


def test_first_reach_is_the_first_raw_success_at_the_target():
  assert bench.first_reach(_records([0.5, 0.95, 0.85, 0.92]), 0.9) == 2
  assert bench.first_reach(_records([0.5, 0.9]), 0.9) == 2  # >= target
  assert bench.first_reach(_records([0.5, 0.89, 0.6]), 0.9) is None


def test_reach_stats_rank_seeds_that_never_reached_last():
  s = bench.reach_stats([30, None, 10, 20, None])
  assert s == {"median": 30, "min": 10, "max": math.inf, "reached": 3, "seeds": 5}
  s = bench.reach_stats([40, None, None, 20, None])
  assert s["median"] == math.inf and s["min"] == 20 and s["reached"] == 2
  assert bench.reach_stats([10, 20, 30, 50])["median"] == 25
  assert bench.reach_stats([10, 20, 30, None])["median"] == 25
  assert bench.reach_stats([10, 20, None, None])["median"] == math.inf


def test_summarise_variant_and_its_table_line():
  # Seed 0 reaches 0.9 at iteration 3, seed 1 never; held-out avg@4 last 0.75 and 0.25.
  runs = [
    _records([0.2, 0.6, 1.0, 1.0], {2: 0.1, 4: 0.75}),
    _records([0.2, 0.2, 0.4, 0.6], {2: 0.1, 4: 0.25}),
  ]
  s = bench.summarise_variant(runs, 0.9)
  np.testing.assert_array_equal(s["iterations"], [1, 2, 3, 4])
  # 5-iteration trailing means: seed 0 (0.2, 0.4, 0.6, 0.7), seed 1 (0.2, 0.2, 0.8/3, 0.35).
  np.testing.assert_allclose(s["curve"], [0.2, 0.3, (0.6 + 0.8 / 3) / 2, 0.525])
  # Two seeds: t_1 * |a - b| / sqrt(2) * ... = 12.706 * (|a - b| / sqrt(2)) / sqrt(2).
  np.testing.assert_allclose(s["curve_ci"][-1], 12.7062 * 0.35 / 2, rtol=1e-4)
  assert s["reach"]["reached"] == 1 and s["reach"]["median"] == math.inf
  assert s["final_avg@4"][0] == pytest.approx(0.5)
  assert s["final_avg@4"][1] == pytest.approx(12.7062 * 0.5 / 2, rel=1e-4)
  # Last 10 iterations = all 4: means 0.7 and 0.35.
  assert s["final_success"][0] == pytest.approx(0.525)
  table = bench.format_table({"nocorr": s}, 0.9)
  assert (
    "| nocorr | correction=False | 1/2 | >4 | 3 to >4 | 0.525 ± 2.224 | 0.500 ± 3.177 |" in table
  )


def test_runs_of_different_lengths_are_cut_to_the_shortest():
  s = bench.summarise_variant([_records([0.1, 0.95, 0.95]), _records([0.1, 0.2])], 0.9)
  np.testing.assert_array_equal(s["iterations"], [1, 2])
  assert s["reach"]["reached"] == 1  # seed 0's 0.95 at iteration 2 is kept
  assert np.isnan(s["final_avg@4"][0])  # no evaluation in these runs


def test_each_variant_runs_run_py_with_one_learner_setting_changed(monkeypatch):
  commands = []
  monkeypatch.setattr(subprocess, "run", lambda command, check: commands.append(command))
  for variant in bench.VARIANTS:
    bench.run_one(f"/w/{variant}/seed3", variant, 3, 150, ["--config.env.num_dials=3"])
  default = [
    "--config.learner.order=reverse",
    "--config.learner.normalisation=batch",
    "--config.learner.correction=True",
  ]
  changed = {
    "reverse": default,
    "forward": ["--config.learner.order=forward", *default[1:]],
    "random": ["--config.learner.order=random", *default[1:]],
    "group": [default[0], "--config.learner.normalisation=group", default[2]],
    "none": [default[0], "--config.learner.normalisation=none", default[2]],
    "nocorr": [*default[:2], "--config.learner.correction=False"],
  }
  for variant, command in zip(bench.VARIANTS, commands):
    assert command[1].endswith(os.path.join("experiments", "run.py"))
    flags = command[2:]
    assert flags[:5] == [
      "--config=synthetic",
      f"--workdir=/w/{variant}/seed3",
      "--config.learner.algorithm=seeupo",
      "--config.num_iterations=150",
      "--config.log.progress_bar=False",
    ]
    before_task = flags[: -len(bench.TASK) - 1]  # the task pins learner.kl_coef itself
    assert [f for f in before_task if f.startswith("--config.learner.")][1:] == changed[variant]
    assert "--config.seed=3" in flags
    # The task first, the extra override last, so that it wins.
    assert flags[-len(bench.TASK) - 1 : -1] == list(bench.TASK)
    assert flags[-1] == "--config.env.num_dials=3"


def test_every_variant_is_a_valid_learner_config():
  from seeupo_jax.learner import LearnerConfig  # pylint: disable=g-import-not-at-top

  for variant in bench.VARIANTS:
    settings = {**bench.DEFAULT, **bench.VARIANTS[variant]}
    config = LearnerConfig(num_turns=2, algorithm=bench.ALGORITHM, **settings)
    assert config.advantage_normalisation == settings["normalisation"]
    assert (config.order, config.correction) == (settings["order"], settings["correction"])


def test_plot_only_writes_the_table_and_the_plot_from_metrics_files(tmp_path, monkeypatch, capsys):
  # 2 variants x 2 seeds of 3 iterations; no run.py.
  success = {"reverse": ([0.5, 0.95, 1.0], [0.5, 0.85, 1.0]), "nocorr": ([0.2, 0.3, 0.4],) * 2}
  for variant, curves in success.items():
    for seed, curve in enumerate(curves):
      d = tmp_path / variant / f"seed{seed}"
      d.mkdir(parents=True)
      lines = [json.dumps(r) for r in _records(curve, {3: 0.5 + 0.25 * seed})]
      (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
  argv = [_PATH, f"--workdir={tmp_path}", "--plot-only", "--seeds=2", "--variants=reverse,nocorr"]
  monkeypatch.setattr(sys, "argv", argv)
  bench.main()
  table = (tmp_path / "table.md").read_text()
  assert table in capsys.readouterr().out
  # reverse: first reach at 2 and 3; last-iterations means 2.45 / 3 and 2.35 / 3: 0.800, half
  # width 12.706 * (0.1 / 3) / 2 = 0.212; avg@4 0.5 and 0.75: 0.625, 12.706 * 0.25 / 2 = 1.588.
  # nocorr against reverse, paired: success differences -0.5 -+ 0.1 / 6, t = 0.5 / (0.1 / 6) = 30
  # on 1 df, p = 1 - 2 / pi * atan(30) = 0.021; avg@4 differences all 0: no test ("-").
  assert table.splitlines()[2:] == [
    "| reverse | (default) | 2/2 | 2.5 | 2 to 3 | 0.800 ± 0.212 | 0.625 ± 1.588 |  |",
    "| nocorr | correction=False | 0/2 | >3 | >3 to >3 | 0.300 ± 0.000 | 0.625 ± 1.588 "
    "| 0.02 / - |",
  ]
  assert (tmp_path / "curves.png").stat().st_size > 10_000


@pytest.mark.parametrize(
  "flag, message", [("--variants=reverse,backward", "backward"), ("--unknown=1", "--unknown=1")]
)
def test_unknown_variants_and_flags_are_errors(tmp_path, monkeypatch, capsys, flag, message):
  monkeypatch.setattr(sys, "argv", [_PATH, f"--workdir={tmp_path}", "--plot-only", flag])
  with pytest.raises(SystemExit) as exit_info:
    bench.main()
  assert exit_info.value.code != 0
  assert message in str(exit_info.value.code) + capsys.readouterr().err
