"""The benchmark scripts run end to end on a tiny preset (so they do not rot between sessions)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

import processes

REPO = pathlib.Path(__file__).resolve().parents[2]


def _run(script, *args):
  env = processes.env()  # one CPU device, not the 8 simulated ones
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
def test_device_check_runs_small_on_the_cpu_with_a_consistent_learner_report(tmp_path):
  """benchmarks/device_check.sh (the prepared GPU check) runs end to end on a tiny preset; its
  learner step's report (bench_learner.py, T = 4) is consistent."""
  env = processes.env(cpu=False)
  env.update(
    OUT=str(tmp_path),
    PY=sys.executable,
    PRESETS="qwen3-tiny",
    SEQ="64",
    BATCH="2",
    NEW="8",
    BLOCKS="256",  # one MFU step (bench_model's own test covers the script in depth)
    ROUNDS="1",
    # SeeUPO on the whole batch at full length: one length program to compile instead of 4 (the
    # bucketed update equals it: tests/learner/test_learner_turn_buckets.py).
    TURN_BUCKETS="1",
    TRAIN_ARGS="--algorithms seeupo --tasks 2 --samples 2 --num-dials 2 --rounds 1",
    SKIP_TESTS="1",
    # The GPU's limits are for a GPU: on a 2-core CPU beside other tests, the learner step's
    # compilations alone took more than its 300 s (2026-12-01).
    LIMIT_SCALE="3",
  )
  done = subprocess.run(
    ["bash", str(REPO / "benchmarks" / "device_check.sh")],
    cwd=REPO,
    capture_output=True,
    text=True,
    env=env,
    timeout=1800,
  )
  log = (tmp_path / "device_check.log").read_text()
  assert done.returncode == 0, log[-3000:]
  assert "FAILED" not in log
  assert log.count('"mfu"') == 1 and '"jax_tok_per_s"' in log
  assert '"seeupo_mfu"' in log  # the learner step ran and reported its MFU
  learner_report = log[log.index("=== learner update") :]
  result = json.loads(learner_report[learner_report.index("{") : learner_report.index("\n}\n") + 2])
  assert result["turn_buckets"] == 1
  row = result["turns"]["4"]
  assert set(row["rounds"]) == {"seeupo", "seeupo_separate", "gspo", "forward", "optimizer_step"}
  assert all(len(times) == 2 for times in row["rounds"].values())
  assert row["seeupo_over_gspo"] == pytest.approx(row["seeupo_s"] / row["gspo_s"], rel=0.01)
  floor = 4 * row["optimizer_step_s"] + row["forward_s"]
  assert row["seeupo_over_floor"] == pytest.approx(row["seeupo_s"] / floor, rel=0.01)
  # The synthetic iteration ran, and the table holds every step's figures.
  table = (tmp_path / "device_check.md").read_text().splitlines()
  steps = [line.split(" | ")[0].lstrip("| ") for line in table[2:]]
  assert steps == [
    "mfu qwen3-tiny attn block 256",
    "sampler decode",
    "synthetic iteration",
    "learner update",
  ]
  assert "no report" not in "\n".join(table)
  assert "MFU" in table[2] and "tokens/s decoding" in table[3] and "SeeUPO MFU" in table[5]
  assert table[4].startswith("| synthetic iteration | seeupo: ") and " s an iteration" in table[4]
  mfu_out = (tmp_path / "mfu_qwen3-tiny_attn_block_256.out").read_text()
  mfu = json.loads([line for line in mfu_out.splitlines() if line.startswith("{")][-1])["mfu"]
  assert f"MFU {mfu:.3f}," in table[2]


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


def test_bench_multiturn_continue_and_reprefill_sample_the_same():
  result = _run(
    "bench_multiturn.py",
    "--preset",
    "qwen3-tiny",
    "--batch",
    "2",
    "--turns",
    "2",
    "--env-tokens",
    "4",
    "--reply-tokens",
    "4",
    "--repeats",
    "1",
  )
  assert result["tokens_agree"] == 1.0  # same keys, same conversation: the same samples
  assert [row["turn"] for row in result["turns"]] == [1, 2]
  assert all(row["continue_ms"] > 0 and row["reprefill_ms"] > 0 for row in result["turns"])
  assert result["total_ratio"] == pytest.approx(
    result["reprefill_total_ms"] / result["continue_total_ms"], rel=0.01
  )
  # Turn 2's attention work (causal pairs over real tokens): continue feeds positions 7..14
  # (the pending token, 4 new, 3 sampled), re-prefill 0..14; turn 1 feeds 0..6 for both.
  turn2 = result["turns"][1]
  assert turn2["continue_attention_growth"] == pytest.approx(sum(range(8, 16)) / 28, abs=1e-3)
  assert turn2["reprefill_attention_growth"] == pytest.approx(sum(range(1, 16)) / 28, abs=1e-3)


def test_bench_rollout_compares_the_schedulers_at_each_prefill_rows():
  """Tiny: 4 episodes x 2 turns on 2 slots, R = 1 and 2 side by side; the summaries are the
  medians of the measurement lines and their ratio, per R."""
  env = processes.env()
  args = "--scenarios instant --episodes 4 --turns 2 --slots 2 --max_new 8 --env_workers 2"
  args += " --repeats 3 --warmups 1 --prefill_rows 1,2 --max_context 128"
  done = subprocess.run(
    [sys.executable, str(REPO / "benchmarks" / "bench_rollout.py"), *args.split()],
    capture_output=True,
    text=True,
    env=env,
    timeout=600,
    check=True,
  )
  lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
  rows, summaries = lines[:-1], lines[-1]["summaries"]
  assert len(rows) == 3 * 2 * 2  # repeats x R values x schedulers
  assert [s["prefill_rows"] for s in summaries] == [1, 2]
  for s in summaries:
    mine = {
      sched: sorted(
        r["tokens_per_s"]
        for r in rows
        if r["prefill_rows"] == s["prefill_rows"] and r["scheduler"] == sched
      )[1]  # the median of 3
      for sched in ("continuous", "turns")
    }
    assert s["continuous_tokens_per_s"] == mine["continuous"]
    assert s["turns_tokens_per_s"] == mine["turns"]
    assert s["ratio"] == pytest.approx(mine["continuous"] / mine["turns"])
  # The same episodes and keys at every R and schedule: the same tokens generated.
  assert len({r["generated_tokens"] for r in rows if r["repeat"] == 0}) == 1
  assert "| instant | 2 | 0 / 0 |" in done.stdout


def test_bench_prefill_times_each_rows_and_width_beside_a_decode_step():
  result = _run(
    "bench_prefill.py",
    *"--rows 3 --prefill-rows 1,2 --widths 8,16 --context 8 --steps 2 --repeats 1".split(),
  )
  assert result["decode_step_ms"] > 0
  calls = {(e["prefill_rows"], e["width"]): e for e in result["calls"]}
  assert sorted(calls) == [(1, 8), (1, 16), (2, 8), (2, 16)]
  for (r, w), e in calls.items():
    assert e["us_per_token"] == pytest.approx(1000 * e["call_ms"] / (r * w))
    assert e["decode_steps"] == pytest.approx(e["call_ms"] / result["decode_step_ms"])
    assert e["one_row_vs_smallest"] == pytest.approx(e["call_ms"] / calls[1, w]["call_ms"])


def test_bench_decode_step_times_each_pool_size():
  result = _run(
    "bench_decode_step.py",
    *("--preset", "qwen3-tiny", "--batch", "2", "--context", "4", "--steps", "3"),
    *("--page-size", "4", "--pool-pages", "5", "40", "--repeats", "1"),
  )
  assert set(result["step_ms"]) == {"5", "40"} and all(v > 0 for v in result["step_ms"].values())
  assert result["largest_over_smallest"] == pytest.approx(
    result["step_ms"]["40"] / result["step_ms"]["5"], rel=0.01
  )


@pytest.mark.slow
def test_bench_decode_layout_compiles_the_session_decode_program_per_layout():
  result = _run(
    "bench_decode_layout.py",
    *("--preset", "qwen3-tiny", "--heads", "0", "--kv-heads", "0", "--big-preset", "none"),
    *("--batch", "8", "--prompt", "8", "--new", "4", "--capacity", "32", "--page-size", "8"),
    *("--reshard-repeats", "1"),
  )
  assert result["devices"] == 8
  layouts = result["small"]["layouts"]
  assert set(layouts) == {"learner", "tensor=8", "tensor=4,data=2"}
  for name, agree in result["small"]["vs_learner"].items():
    assert agree["tokens_equal"], name  # every layout samples the same tokens
  step = {name: e["decode_step"]["total"]["link_bytes"] for name, e in layouts.items()}
  # The learner layout gathers the layers' weights every decode step; the decode layouts do not.
  assert max(step["tensor=8"], step["tensor=4,data=2"]) < step["learner"] / 4
  for e in layouts.values():
    assert e["call"]["total"]["link_bytes"] >= e["decode_step"]["total"]["link_bytes"]
    assert e["prefill_call"]["total"]["ops"] > 0 and e["cache_bytes_per_device"] > 0
  assert "reshard" in layouts["tensor=8"] and "reshard" not in layouts["learner"]


@pytest.mark.slow
def test_bench_train_times_seeupo_and_gspo_iterations(tmp_path):
  # Both programs compile the same rollout sampler: the second reads the first's executable from
  # the session's compilation cache (tests/conftest.py; the timed rounds come after the warm-up).
  out = tmp_path / "bench_train.json"
  result = _run(
    "bench_train.py",
    *("--tasks", "2", "--samples", "2", "--num-dials", "2", "--rounds", "2", "--json", str(out)),
  )
  assert json.loads(out.read_text()) == result
  assert result["device_count"] == 1 and result["trajectories"] == 4
  seeupo, gspo = result["algorithms"]["seeupo"], result["algorithms"]["gspo"]
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
  from experiments.configs import synthetic  # pylint: disable=g-import-not-at-top

  reply = synthetic.get_config().rollout.max_reply_tokens
  for row in (seeupo, gspo):
    assert len(row["iterations_s"]) == 2  # 2 rounds of 1 iteration
    # The parts partition the iteration (rollout other = the rollout's unattributed rest).
    assert sum(row["share"].values()) == pytest.approx(1.0, abs=1e-3)
    assert all(share >= 0 for share in row["share"].values())
    # At most 4 rows x 2 turns x R reply tokens are generated (R: the synthetic config's).
    assert 0 < row["generated_tokens_per_iteration"] <= 4 * 2 * reply
    # overhead = (wall - sampling) / wall = 1 - (tokens / wall) / (tokens / sampling).
    assert row["bridge_overhead"] == pytest.approx(
      1 - row["rollout_tokens_per_s"] / row["sampler_tokens_per_s_in_rollout"], abs=2e-3
    )
  ratio = result["ratios"]["seeupo_over_gspo"]
  assert ratio["iteration"] == pytest.approx(seeupo["iteration_s"] / gspo["iteration_s"], rel=0.01)
  assert len(ratio["per_round"]) == 2
  plain = result["plain_sampler"]
  assert plain["rows"] == 4 and plain["new_tokens"] == reply and plain["calls"] == 2 * 2
  assert plain["tokens_per_s"] == pytest.approx(4 * reply / plain["call_s"], rel=0.01)


def test_bench_bfcl_times_our_environment_against_the_bare_official_path():
  result = _run(
    "bench_bfcl.py",
    "--splits",
    "multi_turn_base,multi_turn_miss_func",
    "--entries",
    "8",
    "--repeats",
    "1",
    "--max-turns",
    "6",
    "--throughput-workers",
    "2",
  )
  rows = result["rows"]
  assert [r["split"] for r in rows] == ["multi_turn_base", "multi_turn_miss_func"]
  for r in rows:
    assert r["entries"] == 8 and r["oracle_success"] == 1.0  # all three routes solve every entry
    assert r["ratio_median"] == pytest.approx(r["ours_ms_median"] / r["bare_ms_median"])
    assert r["process_over_ours"] == pytest.approx(r["process_ms_median"] / r["ours_ms_median"])
    assert r["signals_over_ours"] == pytest.approx(r["signals_ms_median"] / r["ours_ms_median"])
    assert 0 < r["ours_ms_median"] <= r["ours_ms_p99"]
    assert 0 < r["process_ms_median"] <= r["process_ms_p99"]
  t = result["throughput"]
  assert (t["episodes"], t["processes"], t["threads"]) == (8, 2, 8)
  assert t["process_over_thread"] == pytest.approx(
    t["process_episodes_per_s"] / t["thread_episodes_per_s"]
  )
  # The oracle needs 2 replies per user turn with calls (the calls, then one to end the turn)
  # and 1 per turn without: entries 0-7 of base need 8, 8, 10, 4, 6, 8, 10, 6.
  from seeupo_jax.envs import bfcl

  data = bfcl.load_data()
  needed = [
    sum(2 if calls else 1 for calls in data.entry(f"multi_turn_base_{k}").ground_truth)
    for k in range(8)
  ]
  assert needed == [8, 8, 10, 4, 6, 8, 10, 6]
  assert rows[0]["within_max_turns"] == 3 / 8  # 4, 6 and 6 fit in --max-turns 6


@pytest.mark.slow
def test_bench_async_times_each_lag_side_by_side(tmp_path):
  """bench_async.py trains lag 0 and 1 on one built program, and lag 1 with the sampler on a
  device of its own on another (2 devices); the report's ratios are per round, over lag 0, and
  lag 1's runs sample one batch ahead (their metrics say so). With --partial_rollouts each lag
  1 run also runs with them: every reply token of a lag-1 batch is one update old (token lag
  1.0) or, swapped, of the update's own params (0): the mean lag is 1 - the swapped share, which
  is 0 without partial rollouts."""
  out = tmp_path / "async.json"
  env = processes.env(devices=2)
  done = subprocess.run(
    [sys.executable, str(REPO / "benchmarks" / "bench_async.py")]
    + ["--scenarios=tools", "--lags=0,1", "--tasks=2", "--samples=2", "--num-dials=1"]
    + ["--iterations=2", "--warmup=1", "--rounds=2", "--rollout_devices=1", f"--json={out}"]
    + ["--partial_rollouts"],
    capture_output=True,
    text=True,
    env=env,
    timeout=600,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  (result,) = json.loads(out.read_text())
  own = "1, sampler on 1 of 2 devices"
  partial = ["1, partial rollouts", own + ", partial rollouts"]
  assert result["scenario"] == "tools" and list(result["lags"]) == ["0", "1", own] + partial
  for name in ["1", own]:
    x = result["lags"][name]
    assert (x["token_lag_mean"], x["swapped_token_share"]) == (1.0, 0.0)
  for name in partial:
    x = result["lags"][name]
    assert x["lag_trained"] == 1 and 0.0 <= x["swapped_token_share"] <= 1.0
    assert x["token_lag_mean"] == pytest.approx(1.0 - x["swapped_token_share"])
  base, ahead, beside = (result["lags"][k] for k in ("0", "1", own))
  assert base["speedup_per_round"] == [1.0, 1.0]
  for x in (ahead, beside):
    assert len(x["speedup_per_round"]) == 2 and x["speedup"] > 0
  assert (base["lag_trained"], ahead["lag_trained"], beside["lag_trained"]) == (0, 1, 1)
  for x in (base, ahead, beside):
    assert x["iterations_per_hour"] > 0 and x["rollout_s"] > 0.0  # the tools' latency included
  assert "| tools | 1 |" in done.stdout and f"| tools | {own} |" in done.stdout
