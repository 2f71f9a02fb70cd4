"""`pipeline.lag`: the batch trained at iteration i was sampled with the params of iteration
max(0, i - 1 - k), sampled while the update before it runs; the schedule does not depend on the
overlap, and a resumed run trains the batches the checkpoint holds.

One process, in-process, with one built program (its sampler and update compile once), lag 2.
Two processes with a lag: tests/training/test_run_multiprocess.py.
"""

import dataclasses
import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from seeupo_jax import learner
from seeupo_jax import rollout
from seeupo_jax.devtools import logp_gap
from seeupo_jax.training import checkpoints, config as config_lib, loop, metrics_log, trainer

import processes
import test_preemption_phases as phases

ITERATIONS = 4
LAG = 2  # two batches in flight: the prologue samples B_1 and B_2 with theta_0


def small_config(lag, num_iterations=ITERATIONS):
  """test_preemption_phases.py's small run (1 dial, 4 tasks x 2 samples), with `lag`, a
  checkpoint of every iteration and an evaluation every 2."""
  c = phases.small_config()
  c.num_iterations = num_iterations
  c.eval.every = 2  # the stopped run of the resume test ends at 2, with an evaluation
  c.checkpoint.every = 1  # every iteration's params, to check which of them sampled what
  c.checkpoint.asynchronous = False
  c.save_hf = False
  c.pipeline.lag = lag
  return c


@pytest.fixture(scope="module")
def program():
  program = trainer.build(small_config(LAG))
  yield program
  program.close()


@pytest.fixture(scope="module")
def whole(program, tmp_path_factory):
  """The uninterrupted run."""
  workdir = tmp_path_factory.mktemp("whole")
  trainer._train(small_config(LAG), str(workdir), program)
  return workdir


def _timing(key):
  """A clock reading or the engine's schedule (`rollout/`: when the environments answered)."""
  return key == "time" or key.startswith(("time/", "rollout/"))


def _timeless(workdir):
  records = metrics_log.read_metrics(str(workdir / "metrics.jsonl"))
  return [{k: v for k, v in r.items() if not _timing(k)} for r in records]


def _trajectories(workdir):
  return [json.loads(line) for line in (workdir / "trajectories.jsonl").read_text().splitlines()]


def _restore(program, workdir, iteration):
  """Checkpoint `iteration` of `workdir`: (params, progress)."""
  state = program.init_state()
  rng = jax.random.key(0)
  checkpointer = checkpoints.Checkpointer(str(workdir / "checkpoints"), read_only=True)
  try:
    _, restored, _, progress = checkpointer._restore(
      iteration, checkpoints.abstract_of(state), checkpoints.abstract_of(rng)
    )
  finally:
    checkpointer.close()
  return restored.params, progress


def _teacher_forced(program, params, trajectories):
  """The learner's log-probs of the trajectories' generated tokens under `params`, in the
  trajectories' token order (float32, as the sampler records them)."""
  batch = rollout.collate(trajectories, num_turns=1, max_len=128)
  logprob_fn = learner.qwen_logprob_fn(program.model_config, temperature=1.0)
  logp = np.asarray(jax.jit(logprob_fn)(params, jax.tree.map(jax.numpy.asarray, batch)))
  generated = np.asarray(batch.turn_ids) >= 0
  sampled = np.asarray(batch.sample_logp)
  return logp[generated], sampled[generated]


def _assert_same_run(program, workdir, whole):
  """The metrics (but timings), trajectories and final params of `whole`."""
  assert _timeless(workdir) == _timeless(whole)
  assert _trajectories(workdir) == _trajectories(whole)
  a, _ = _restore(program, workdir, ITERATIONS)
  b, _ = _restore(program, whole, ITERATIONS)
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


@pytest.mark.slow
def test_each_batch_is_sampled_with_the_params_lag_iterations_before_its_update(program, whole):
  """Checkpoint i holds B_{i+1} .. B_{i+k}; B_j's recorded log-probs are those of the params of
  iteration max(0, j - 1 - k) (teacher-forced from that checkpoint), not the newer ones'."""
  lag = LAG
  assert small_config(lag).rollout.temperature == 1.0  # the teacher-forced log-probs' temperature
  workdir = whole
  params = {0: program.init_state().params}
  pending = {}
  for i in range(1, ITERATIONS + 1):
    params[i], progress = _restore(program, workdir, i)
    entries = progress["pending"]
    assert len(entries) == lag
    for offset, entry in enumerate(entries, start=1):
      pending[i + offset] = entry
  records = metrics_log.read_metrics(str(workdir / "metrics.jsonl"))
  assert [r["pipeline/lag"] for r in records] == [min(i - 1, lag) for i in range(1, ITERATIONS + 1)]
  for j, entry in sorted(pending.items()):
    version = max(0, j - 1 - lag)
    assert entry["version"] == version, (j, entry["version"])
    (part,) = entry["processes"]
    trajectories = [rollout.Trajectory(**t) for t in part["trajectories"]]
    learner_logp, sampled = _teacher_forced(program, params[version], trajectories)
    np.testing.assert_allclose(learner_logp, sampled, atol=2e-5)
    newer, _ = _teacher_forced(program, params[version + 1], trajectories)
    assert np.max(np.abs(newer - sampled)) > 1e-3  # the check tells the versions apart


@pytest.mark.slow
def test_logp_gap_reports_each_pending_batch_against_the_checkpoints_params(program, whole):
  """`python -m seeupo_jax.devtools.logp_gap`: checkpoint 3 holds B_4 (sampled with theta_1)
  and B_5 (theta_2); per batch and version, the tokens and |recorded - learner| log-prob gaps
  under theta_3 are the ones teacher-forced here; under the sampling params the gap is the
  float32 rounding."""
  iteration, batches = logp_gap.checkpoint_gaps(str(whole), 3)
  assert iteration == 3 and [version for version, _ in batches] == [1, 2]
  params3, progress = _restore(program, whole, 3)
  for (version, gaps), entry in zip(batches, progress["pending"]):
    (part,) = entry["processes"]
    trajectories = [rollout.Trajectory(**t) for t in part["trajectories"]]
    learner_logp, sampled = _teacher_forced(program, params3, trajectories)
    gap = np.abs(learner_logp - sampled)
    (g,) = gaps  # no partial rollouts: one version a batch
    assert (g.version, g.tokens, g.over_one) == (version, gap.size, int((gap > 1).sum()))
    np.testing.assert_allclose([g.mean, g.max], [gap.mean(), gap.max()], rtol=1e-5)
    assert g.max > 1e-3  # the updates since (two for B_4, one for B_5) moved them
    own, _ = _restore(program, whole, version)
    (same,) = logp_gap.gaps_by_version(
      learner.qwen_logprob_fn(program.model_config, temperature=1.0),
      own,
      trajectories,
      num_turns=1,
      max_len=128,
    )
    assert same.version == version and same.max < 2e-5
  out = subprocess.run(
    [sys.executable, "-m", "seeupo_jax.devtools.logp_gap", f"--workdir={whole}", "--iteration=3"],
    capture_output=True,
    text=True,
    env=processes.env(),
    timeout=300,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  rows = [line.split(" | ") for line in out.stdout.splitlines() if line.startswith("B_")]
  assert [row[:3] for row in rows] == [["B_4", "1", "1"], ["B_5", "2", "2"]]
  assert [int(row[3]) for row in rows] == [gaps[0].tokens for _, gaps in batches]


def test_logp_gap_of_a_workdir_without_pending_batches_is_one_line(tmp_path):
  out = subprocess.run(
    [sys.executable, "-m", "seeupo_jax.devtools.logp_gap", f"--workdir={tmp_path}"],
    capture_output=True,
    text=True,
    env=processes.env(),
    timeout=300,
  )
  assert out.returncode == 2
  assert out.stderr.strip().splitlines() == [f"error: no checkpoint in {tmp_path}/checkpoints"]


@pytest.mark.slow
def test_the_overlapped_run_equals_its_schedule_run_step_by_step(
  program, whole, tmp_path, monkeypatch
):
  """Sampling B_{i+1} while the update of B_i runs changes nothing: the run that waits for each
  update first has the same trajectories, metrics and params."""
  lag = LAG
  workdir = tmp_path / "step_by_step"
  run = loop.run
  monkeypatch.setattr(loop, "run", lambda *a, **kw: run(*a, **kw, overlap=False))
  trainer._train(small_config(lag), str(workdir), program)
  _assert_same_run(program, workdir, whole)


@pytest.mark.slow
def test_a_resumed_run_trains_the_batches_its_checkpoint_holds(program, whole, tmp_path):
  """Stopped after iteration 2 (its checkpoint holds B_3 and B_4), then resumed to 4: the
  metrics, trajectories and params of the run that never stopped. A lag of 0 on that workdir is
  refused: another schedule."""
  lag = LAG
  workdir = tmp_path / "resumed"
  trainer._train(small_config(lag, num_iterations=2), str(workdir), program)
  trainer._train(small_config(lag), str(workdir), program)
  _assert_same_run(program, workdir, whole)
  with pytest.raises(config_lib.ConfigError, match="pipeline.lag"):
    trainer.train(small_config(0, num_iterations=6), str(workdir))


@pytest.mark.slow
def test_a_sampler_on_devices_of_its_own_runs_the_same_schedule_beside_the_update(
  tmp_path, monkeypatch
):
  """`pipeline.rollout_devices=4` of the 8: the learner's state on devices 0-3, the sampler's
  params and KV cache on 4-7, the update dispatched before the sampling it runs beside; the run
  equals the same schedule run one step after the other."""
  config = small_config(1, num_iterations=3)
  config.pipeline.rollout_devices = 4
  program = trainer.build(config)
  try:
    assert {d.id for d in program.mesh.devices.flat} == {0, 1, 2, 3}
    assert {d.id for d in program.decode.mesh.devices.flat} == {4, 5, 6, 7}
    assert program.decode.separate
    beside = tmp_path / "beside"
    trainer._train(config, str(beside), program)
    sampler_params = program.decode._params
    assert {d.id for x in jax.tree.leaves(sampler_params) for d in x.devices()} == {4, 5, 6, 7}
    step_by_step = tmp_path / "step_by_step"
    run = loop.run
    monkeypatch.setattr(loop, "run", lambda *a, **kw: run(*a, **kw, overlap=False))
    trainer._train(config, str(step_by_step), program)
    assert _timeless(beside) == _timeless(step_by_step)
    assert _trajectories(beside) == _trajectories(step_by_step)
    a, _ = _restore(program, beside, 3)
    b, _ = _restore(program, step_by_step, 3)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)
    assert {d.id for x in jax.tree.leaves(a) for d in x.devices()} == {0, 1, 2, 3}
  finally:
    program.close()


def test_rollout_devices_that_leave_the_learner_none_name_the_key():
  config = small_config(1)
  config.pipeline.rollout_devices = 8
  with pytest.raises(
    config_lib.ConfigError,
    match=r"pipeline\.rollout_devices=8 leaves the learner no device of the 8; allowed: 0 to 7",
  ):
    trainer.build(config)


def test_a_lag_outside_its_range_names_the_key():
  with pytest.raises(
    config_lib.ConfigError, match=r"pipeline\.lag=-1; allowed: an int in \[0, 8\]"
  ):
    config_lib.typed(small_config(-1))


def _pending_batches(program, workdir, iterations):
  """{j: (version, trajectories)} of the batches the checkpoints 1 .. `iterations` hold."""
  out = {}
  for i in range(1, iterations + 1):
    _, progress = _restore(program, workdir, i)
    for offset, entry in enumerate(progress["pending"], start=1):
      (part,) = entry["processes"]
      out[i + offset] = (entry["version"], [rollout.Trajectory(**t) for t in part["trajectories"]])
  return out


def _reply_versions(trajectories):
  return np.concatenate([np.asarray(t.versions)[np.asarray(t.turn_ids) >= 0] for t in trajectories])


@pytest.mark.slow
def test_partial_rollouts_swap_to_the_updates_params_and_tag_each_token(
  program, tmp_path, monkeypatch
):
  """`pipeline.partial_rollouts` with lag 1. Run step by step (each update done before the
  sampling beside it starts), every batch after the prologue is sampled with the params of the
  update it was sampled beside (version v + 1, teacher-forced from that checkpoint). Overlapped,
  each batch's tokens are of version v or v + 1, each trajectory's v-tokens first, with v's
  log-probs; the token-lag metrics of each iteration are those of the batch it trained, and a
  resumed run trains the batch its checkpoint holds, versions and all."""
  iterations = 3
  config = small_config(1, num_iterations=iterations)
  config.pipeline.partial_rollouts = True
  params = {0: program.init_state().params}

  step_by_step = tmp_path / "step_by_step"
  run = loop.run
  with monkeypatch.context() as m:
    m.setattr(loop, "run", lambda *a, **kw: run(*a, **kw, overlap=False))
    trainer._train(config, str(step_by_step), program)
  for i in range(1, iterations + 1):
    params[i], _ = _restore(program, step_by_step, i)
  for j, (version, trajectories) in _pending_batches(program, step_by_step, iterations).items():
    assert version == j - 2
    assert set(_reply_versions(trajectories)) == {version + 1}
    learner_logp, sampled = _teacher_forced(program, params[version + 1], trajectories)
    np.testing.assert_allclose(learner_logp, sampled, atol=2e-5)
  records = metrics_log.read_metrics(str(step_by_step / "metrics.jsonl"))
  assert [r["pipeline/swapped_token_share"] for r in records] == [0.0, 1.0, 1.0]
  assert [r["pipeline/token_lag_mean"] for r in records] == [0.0, 0.0, 0.0]

  overlapped = tmp_path / "overlapped"
  trainer._train(config, str(overlapped), program)
  records = metrics_log.read_metrics(str(overlapped / "metrics.jsonl"))
  pending = _pending_batches(program, overlapped, iterations)
  for j, (version, trajectories) in pending.items():
    for t in trajectories:
      versions = np.asarray(t.versions)[np.asarray(t.turn_ids) >= 0]
      assert set(versions) <= {version, version + 1} and np.all(np.diff(versions) >= 0)
    if j <= iterations:  # trained at iteration j: its metrics are this batch's
      lags = (j - 1) - _reply_versions(trajectories)
      record = records[j - 1]
      assert record["pipeline/token_lag_mean"] == pytest.approx(lags.mean())
      assert record["pipeline/swapped_token_share"] == pytest.approx(np.mean(lags < 1))
  # The tokens of version v, each trajectory's first ones, are v's samples.
  _, trajectories = pending[3]
  prefix = [
    dataclasses.replace(t, turn_ids=[k if v == 1 else -1 for k, v in zip(t.turn_ids, t.versions)])
    for t in trajectories
  ]
  learner_logp, sampled = _teacher_forced(program, params[1], prefix)
  np.testing.assert_allclose(learner_logp, sampled, atol=2e-5)

  resumed = tmp_path / "resumed"
  trainer._train(small_config_partial(num_iterations=2), str(resumed), program)
  _, held = _pending_batches(program, resumed, 2)[3]
  trainer._train(config, str(resumed), program)
  record = metrics_log.read_metrics(str(resumed / "metrics.jsonl"))[2]
  lags = 2 - _reply_versions(held)
  assert record["pipeline/token_lag_mean"] == pytest.approx(lags.mean())
  assert record["pipeline/swapped_token_share"] == pytest.approx(np.mean(lags < 1))


def small_config_partial(num_iterations):
  config = small_config(1, num_iterations=num_iterations)
  config.pipeline.partial_rollouts = True
  return config


@pytest.mark.parametrize(
  "lag, dynamic, match",
  [
    (0, False, r"pipeline\.partial_rollouts=True needs pipeline\.lag >= 1"),
    (1, True, r"pipeline\.partial_rollouts=True with learner\.dynamic_sampling"),
  ],
)
def test_partial_rollouts_without_a_lag_or_with_dynamic_sampling_name_the_keys(lag, dynamic, match):
  config = small_config(lag)
  config.pipeline.partial_rollouts = True
  if dynamic:
    config.learner.algorithm = "dapo"
  with pytest.raises(config_lib.ConfigError, match=match):
    trainer.build(config)
