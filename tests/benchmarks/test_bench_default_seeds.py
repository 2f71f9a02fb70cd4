"""`benchmarks/bench_default_seeds.py`: its figures, from hand-made records and from a tiny run."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

import processes

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_default_seeds as bench  # noqa: E402


def _record(iteration, success, seconds, avg=None, pass_=None, eval_seconds=0.0):
  r = {"iteration": iteration, "success": success, "time/iteration": seconds}
  if avg is not None:
    r.update({"eval/avg@4": avg, "eval/pass@4": pass_, "time/eval": eval_seconds})
  return r


def test_seed_summary_reads_the_first_evaluation_at_the_target_and_its_time():
  records = [
    _record(1, 0.1, 10.0),
    _record(2, 0.95, 2.0, avg=0.5, pass_=0.7, eval_seconds=1.0),  # train success hits here
    _record(3, 0.9, 2.0),
    _record(4, 1.0, 2.0, avg=0.92, pass_=1.0, eval_seconds=1.0),  # the held-out one here
    _record(5, 1.0, 2.0, avg=0.88, pass_=0.9, eval_seconds=1.0),
  ]
  s = bench.seed_summary(records, 0.9)
  assert s["first_eval_iteration"] == 4
  assert s["first_eval_seconds"] == pytest.approx(10 + 3 + 2 + 3)  # iterations + evaluations
  assert s["first_train_iteration"] == 2
  assert s["final_avg"] == 0.88 and s["final_pass"] == 0.9  # the last evaluation, not the best
  assert s["total_seconds"] == pytest.approx(21.0)
  assert s["iterations"] == 5


def test_report_counts_seeds_and_ranks_a_seed_that_never_reached_the_target_last():
  def summary(first_s, final):
    return {
      "iterations": 10,
      "first_eval_iteration": None if first_s is None else 5,
      "first_eval_seconds": first_s,
      "first_train_iteration": None,
      "final_avg": final,
      "final_pass": final,
      "total_seconds": 100.0,
    }

  text = bench.report({0: summary(60.0, 0.95), 1: summary(None, 0.2), 2: summary(180.0, 0.9)}, 0.9)
  assert "seeds ending at held-out avg@4 >= 0.9: 2 / 3" in text
  # Times 60 s, 180 s, never: the median is 180 s (3.0 min), the worst never reached.
  assert "median 3.0 min, worst not reached" in text
  text = bench.report({0: summary(60.0, 0.95), 1: summary(120.0, 0.91)}, 0.9)
  assert "median 1.5 min, worst 2.0 min" in text
  assert "2 / 2" in text


def test_bad_flags_are_one_line_errors():
  with pytest.raises(SystemExit):
    bench._parse(["--workdir=/tmp/x", "--seeds=a,b"])
  with pytest.raises(SystemExit):
    bench._parse(["--workdir=/tmp/x", "--nope=1"])
  args = bench._parse(["--workdir=/tmp/x", "--seeds=3,4", "--config.num_iterations=2"])
  assert args.seeds == [3, 4] and args.overrides == ["--config.num_iterations=2"]


@pytest.mark.slow
def test_the_command_runs_each_seed_and_reports_from_its_metrics(tmp_path):
  tiny = [
    "--config.num_iterations=2",
    "--config.rollout.tasks_per_iteration=2",
    "--config.rollout.samples_per_task=2",
    "--config.eval.every=1",
    "--config.eval.num_tasks=2",
    "--config.log.plot=False",
    "--config.log.tensorboard=False",
  ]
  env = processes.env()
  done = subprocess.run(
    [sys.executable, str(REPO / "benchmarks" / "bench_default_seeds.py")]
    + [f"--workdir={tmp_path}", "--seeds=0,1", "--target=0.0", *tiny],
    capture_output=True,
    text=True,
    env=env,
    timeout=600,
  )
  assert done.returncode == 0, done.stderr[-2000:]
  for seed in (0, 1):
    lines = (tmp_path / f"seed{seed}" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["iteration"] for r in records] == [1, 2]
    # Target 0: every seed reaches it at its first evaluation (iteration 1).
    assert f"seed {seed}: first held-out avg@4 >= 0.0 at iteration 1" in done.stdout
    final = records[-1]["eval/avg@4"]
    assert f"| {seed} | 1 |" in done.stdout and f"{final:.3f}" in done.stdout
  assert "seeds ending at held-out avg@4 >= 0.0: 2 / 2" in done.stdout
  assert (tmp_path / "seeds.md").read_text().strip() in done.stdout
