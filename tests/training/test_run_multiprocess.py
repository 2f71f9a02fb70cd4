"""`experiments/run.py` as 2 processes (JAX's multi-process runtime, gloo over loopback, 2 CPU
devices each) against 1 process of 4 devices, and a kill -9 of one process then a rerun.

The 2-process run must play the 1-process run's trajectories and end with its params (the
learner is the same SPMD program on the same 4 devices; the sampler runs per process), with one
metrics file that holds each iteration once, written by process 0 alone. Every run samples one
batch ahead of its update (`pipeline.lag=1`; the synchronous program is the same loop without
the batches in flight: tests/training/test_pipeline.py). With `pipeline.rollout_devices`, 2
processes of 4 devices (the learner on 2 of each, each sampler on the other 2) must equal the
time-shared 2-process run.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import processes
import shared_runs

from seeupo_jax.devtools import logp_gap
from seeupo_jax.training import metrics_log
from seeupo_jax.training import pipeline

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_RUN = os.path.join(_ROOT, "experiments", "run.py")
_STEP_BY_STEP = os.path.join(_ROOT, "tests", "run_step_by_step.py")  # run.py, overlap=False
sys.path.insert(0, _ROOT)
from experiments import configs  # noqa: E402

ITERATIONS = 2  # a kill after the first checkpoint leaves the second iteration to the rerun
SMALL = (
  # Every run here samples each batch an iteration ahead (`pipeline.lag`): checkpoint 1 holds
  # B_2, each process's part of it, which the rerun after the kill trains.
  "--config.pipeline.lag=1",
  "--config.env.num_dials=2",
  "--config.rollout.max_turns=2",
  "--config.rollout.tasks_per_iteration=2",
  "--config.rollout.samples_per_task=2",
  "--config.rollout.max_context_tokens=128",
  # The sampler 2-way tensor-parallel in both runs: the same per-device programs (with 4-way in
  # the 1-process run its log-probs round differently and the params differ by ~3e-6).
  "--config.rollout.decode_tensor_parallel=2",
  f"--config.num_iterations={ITERATIONS}",
  "--config.checkpoint.every=1",
  "--config.eval.num_tasks=3",  # not divisible by 2: process 0 plays 2 tasks, process 1 one
  "--config.eval.k=2",
  "--config.log.progress_bar=False",
  "--config.log.plot=False",
  "--config.save_hf=True",
  "--config.learner.turn_buckets=1",  # one length program of the update (tests/training/test_train.py)
)
PARAMS_TOL = dict(atol=1e-5, rtol=1e-5)
# Timings, and numbers of the engine's schedule (per-process sessions), not of the trajectories.
NOT_COMPARED = (
  "rollout/time",
  "rollout/sample_time",
  "rollout/env_wait_time",
  "rollout/host_time",
  "rollout/env_wait_share",
  "rollout/tokens_per_s",
  "rollout/decode_steps",
  "rollout/decode_calls",
  "rollout/prefill_calls",
  "rollout/slot_occupancy",
  "rollout/decode_steps_per_token",
  "rollout/cache_slots",
  "rollout/cache_slots_per_live_token",
)


LEARNING_RATE = configs.get_config("synthetic").optimizer.learning_rate  # both runs' config
FEW = 1e-3  # the share of a tensor's elements allowed past PARAMS_TOL


def _assert_same_adam_params(got, want, name):
  """`got` equals `want` within PARAMS_TOL but for at most a share FEW of the elements, and
  those within Adam's step.

  Adam moves an element by lr * m / (sqrt(v) + eps): where its gradient is near zero, the
  order in which the gradient is summed (across two processes, or on one) can move that step by
  up to lr, one element in thousands (1 of 16384 seen: 1.2e-5 off). A real difference between
  the runs (a gradient counted twice, a shard left out) moves most elements.
  """
  off = np.abs(got - want) > PARAMS_TOL["atol"] + PARAMS_TOL["rtol"] * np.abs(want)
  assert off.mean() <= FEW, f"{name}: {int(off.sum())} of {off.size} elements differ"
  np.testing.assert_allclose(got, want, atol=ITERATIONS * LEARNING_RATE, rtol=0, err_msg=name)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start(
  workdir, num_processes: int, devices: int, logs, cache=None, extra=(), script=_RUN
) -> list[subprocess.Popen]:
  """Starts run.py (or `script`, which takes its flags) as `num_processes` processes of
  `devices` CPU devices each (`extra` flags after `SMALL`)."""
  env = processes.env(devices)
  if cache is not None:  # JAX's persistent compilation cache: each program compiles once
    env.update(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  flags = []
  if num_processes > 1:
    flags = [f"--num_processes={num_processes}", f"--coordinator_address=127.0.0.1:{_free_port()}"]
  procs = []
  for i in range(num_processes):
    ident = [f"--process_id={i}"] if num_processes > 1 else []
    with open(logs / f"process{i}.log", "w") as out:
      procs.append(
        subprocess.Popen(
          [sys.executable, script, f"--workdir={workdir}", *SMALL, *extra, *flags, *ident],
          cwd=_ROOT,
          env=env,
          stdout=out,
          stderr=subprocess.STDOUT,
        )
      )
  return procs


def _run(
  workdir, num_processes: int, devices: int, cache=None, timeout=900, extra=(), script=_RUN
) -> list[str]:
  """Runs to the end (`extra` flags after `SMALL`; `script`: see `_start`); returns each
  process's output (also in <workdir>_logs<k>/)."""
  k = 0
  while (workdir.parent / f"{workdir.name}_logs{k}").exists():
    k += 1
  logs = workdir.parent / f"{workdir.name}_logs{k}"
  logs.mkdir()
  procs = _start(workdir, num_processes, devices, logs, cache, extra, script)
  deadline = time.time() + timeout
  try:
    for proc in procs:
      proc.wait(timeout=max(1.0, deadline - time.time()))
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  outputs = [(logs / f"process{i}.log").read_text() for i in range(num_processes)]
  for i, (proc, out) in enumerate(zip(procs, outputs)):
    assert proc.returncode == 0, f"process {i} exited with {proc.returncode}:\n{out[-4000:]}"
  return outputs


def _records(workdir):
  return metrics_log.read_metrics(str(workdir / "metrics.jsonl"))


def _trajectories(workdir):
  return [json.loads(line) for line in (workdir / "trajectories.jsonl").read_text().splitlines()]


def _final_params(workdir, iteration=ITERATIONS) -> dict:
  """Checkpoint `iteration`'s params, restored onto one device: {path: np.ndarray}."""
  path = workdir / "checkpoints" / str(iteration) / "train_state"
  checkpointer = ocp.StandardCheckpointer()
  metadata = checkpointer.metadata(str(path))
  metadata = getattr(metadata, "item_metadata", metadata)
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), metadata)
  state = checkpointer.restore(str(path), target)
  return {
    jax.tree_util.keystr(p): np.asarray(x)
    for p, x in jax.tree_util.tree_leaves_with_path(state["params"])
  }


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
  """The uninterrupted 2-process run (its workdir, and the compilation cache it filled), made
  once per session, whichever worker asks first (`shared_runs.once`)."""

  def make(root):
    t0 = time.perf_counter()
    outputs = _run(root / "two", 2, 2, root / "jax_cache")
    print(f"2-process run: {time.perf_counter() - t0:.0f} s")
    return str(root / "two"), str(root / "jax_cache"), outputs

  workdir, cache, outputs = shared_runs.once(tmp_path_factory, "two_processes", make)
  return pathlib.Path(workdir), pathlib.Path(cache), outputs


@pytest.mark.slow
def test_two_processes_play_and_learn_as_one_process_of_four_devices(two_processes, tmp_path):
  two, cache, outputs = two_processes
  one = tmp_path / "one"
  _run(one, 1, 4, cache)

  # One metrics file, each iteration once; the same numbers (the learner's, the trajectories'
  # and the evaluation's, which is split 2 + 1 tasks between the processes).
  got, want = _records(two), _records(one)
  assert [r["iteration"] for r in got] == list(range(1, ITERATIONS + 1))
  assert [r["iteration"] for r in want] == list(range(1, ITERATIONS + 1))
  for g, w in zip(got, want):
    keys = {k for k in w if k != "time" and not k.startswith("time/") and k not in NOT_COMPARED}
    assert set(g) - {"time"} - set(NOT_COMPARED) == keys | {k for k in g if k.startswith("time/")}
    for key in sorted(keys):
      np.testing.assert_allclose(g[key], w[key], err_msg=key, **PARAMS_TOL)
  assert {"reward", "loss", "grad_norm", "eval/avg@2", "eval/pass@2"} <= set(got[-1])
  assert got[-1]["rollout/trajectories"] == 4.0 and got[-1]["eval/tasks"] == 3.0

  # The same trajectories, token for token (the log holds the first 2 of each iteration).
  assert len(_trajectories(one)) == 2 * ITERATIONS
  assert _trajectories(two) == _trajectories(one)

  # The same params after the last update.
  expected = _final_params(one)
  for name, value in _final_params(two).items():
    _assert_same_adam_params(value, expected[name], name)

  # Process 0 alone wrote the logs: one TensorBoard writer, no error log; process 1 printed
  # no evaluation table.
  events = [p for p in (two / "tensorboard").iterdir() if p.name.startswith("events.out")]
  assert len(events) == 1, events
  assert not list(two.glob("error*.log"))
  assert "avg@2" in outputs[0] and "avg@2" not in outputs[1]
  assert (two / "hf_policy" / "model.safetensors").exists()


@pytest.mark.slow
def test_samplers_on_devices_of_their_own_play_and_learn_as_the_time_shared_run(
  two_processes, tmp_path
):
  """2 processes of 4 devices, `pipeline.rollout_devices=2`: the learner's mesh is the first 2
  devices of each process (4 devices, as in the time-shared run), each process samples on its
  last 2 (2-way tensor-parallel, as there), with the update running beside it.
  Each new set of params reaches the samplers through the hop on the learner's devices
  (`DecodeLayout`): the trajectories, metrics and exported params are the time-shared run's,
  bit for bit."""
  shared, cache, _ = two_processes
  own = tmp_path / "own"
  placement = ("--verbosity=0", "--alsologtostderr")  # the INFO line that names the devices
  outputs = _run(own, 2, 4, cache, extra=("--config.pipeline.rollout_devices=2", *placement))
  for out in outputs:  # each process's own devices, in its jax.local_devices() order
    assert "this process's devices [2, 3] sample, [0, 1] learn (of 4 learning)" in out
  strip = lambda records: [  # noqa: E731
    {
      k: v
      for k, v in r.items()
      if k != "time" and not k.startswith("time/") and k not in NOT_COMPARED
    }
    for r in records
  ]
  assert [r["iteration"] for r in _records(own)] == list(range(1, ITERATIONS + 1))
  assert strip(_records(own)) == strip(_records(shared))
  assert _trajectories(own) == _trajectories(shared)
  a = (shared / "hf_policy" / "model.safetensors").read_bytes()
  assert (own / "hf_policy" / "model.safetensors").read_bytes() == a


def _pending(workdir, iteration):
  """Checkpoint `iteration`'s pending batch (lag 1: one): its version and every process's
  trajectories."""
  metadata = workdir / "checkpoints" / str(iteration) / "progress" / "metadata"
  (entry,) = json.loads(metadata.read_text())[pipeline.PROGRESS_KEY]
  return entry["version"], pipeline.batch_trajectories(entry)


def _reply_versions(trajectory):
  return np.asarray(trajectory.versions)[np.asarray(trajectory.turn_ids) >= 0]


@pytest.mark.slow
def test_partial_rollouts_swap_on_each_process_to_the_copy_begun_beside_the_update(
  two_processes, tmp_path
):
  """`pipeline.partial_rollouts` with 2 processes on the shared devices: the decode copy of each
  update's params is begun beside the update on both (the reshard, their collective, into new
  buffers), and each process installs its part, no collective, when its sampler sees it ready,
  or after its rollout if it never did.

  Run step by step (tests/run_step_by_step.py: each update done before the sampling beside
  it), with process 1 never seeing the copy ready: process 0 swaps at its first round, so its
  tokens of B_{i+1} are all of version i, with the log-probs of checkpoint i's params theta_i;
  process 1's are all of version i - 1 (theta_{i-1}, one update off under theta_i). The run
  goes on past the processes' different swap points: process 1 installs the copy after its
  rollout, so the next iteration's `layout(params)` is no collective on either (without that
  install process 1 starts a reshard the other never joins, and the run fails). Iteration 2's
  token-lag metrics count both processes' tokens of B_2. (With samplers of their own,
  `layout(params)` is the hop's stage then install in every run: the test above.)"""
  _, cache, _ = two_processes
  own = tmp_path / "own"
  with pytest.MonkeyPatch.context() as m:
    m.setenv("NEVER_READY_PROCESS", "1")
    _run(
      own,
      2,
      2,
      cache,
      timeout=600,
      extra=("--config.pipeline.partial_rollouts=True",),
      script=_STEP_BY_STEP,
    )
  records = _records(own)
  assert [r["iteration"] for r in records] == list(range(1, ITERATIONS + 1))
  for i in range(1, ITERATIONS + 1):
    version, trajectories = _pending(own, i)
    assert version == i - 1
    first, second = sorted({t.group for t in trajectories})  # process 0's group, process 1's
    for t in trajectories:
      assert set(_reply_versions(t)) == {i if t.group == first else i - 1}, t.group
    counts = [
      sum(len(_reply_versions(t)) for t in trajectories if t.group == g) for g in (first, second)
    ]
    _, [(_, gaps)] = logp_gap.checkpoint_gaps(str(own), i)
    assert [(g.version, g.tokens) for g in gaps] == [(i - 1, counts[1]), (i, counts[0])]
    assert gaps[1].max < 2e-5 and gaps[0].max > 1e-3  # theta_i's own; one update off
  _, trained = _pending(own, 1)  # B_2, trained at iteration 2
  lags = 1 - np.concatenate([_reply_versions(t) for t in trained])
  assert 0 < np.mean(lags < 1) < 1
  assert records[1]["pipeline/token_lag_mean"] == pytest.approx(lags.mean())
  assert records[1]["pipeline/swapped_token_share"] == pytest.approx(np.mean(lags < 1))


@pytest.mark.slow
def test_kill_minus_9_of_one_process_then_rerun_ends_like_the_uninterrupted_run(
  two_processes, tmp_path
):
  whole, cache, _ = two_processes
  killed = tmp_path / "killed"
  logs = tmp_path / "killed_logs_before_the_kill"
  logs.mkdir()
  # The cache holds every program of this config already (the uninterrupted run's): the run
  # that gets killed only reads it, so the kill cannot leave half an entry behind.
  procs = _start(killed, 2, 2, logs, cache)
  try:
    deadline = time.time() + 600
    while not (killed / "checkpoints" / "1").exists():  # orbax renames a finished save in place
      assert all(p.poll() is None for p in procs), "a process ended before the kill"
      assert time.time() < deadline, "no checkpoint in time"
      time.sleep(0.05)
    procs[1].send_signal(signal.SIGKILL)
    procs[1].wait()
    # The survivor is stuck in (or fails at) its next collective with the dead process: it
    # must not finish the run. It is killed too, as a cluster manager would.
    t0 = time.perf_counter()
    try:
      procs[0].wait(timeout=5)
      print(f"the survivor exited with {procs[0].returncode} {time.perf_counter() - t0:.1f} s on")
    except subprocess.TimeoutExpired:
      print("the survivor was still running 5 s on: killed")
      procs[0].send_signal(signal.SIGKILL)
      procs[0].wait()
    assert procs[0].returncode != 0
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  assert not (killed / "hf_policy").exists()
  done = [int(d) for d in os.listdir(killed / "checkpoints") if d.isdigit()]
  assert 1 <= max(done) < ITERATIONS, done

  outputs = _run(killed, 2, 2, cache)
  assert f"resuming {killed} from iteration {max(done)}" in outputs[0]
  # Each iteration once in the one metrics file, the same numbers, trajectories and final
  # params (the HF export, bit for bit) as the run that never stopped.
  strip = lambda records: [  # noqa: E731
    {k: v for k, v in r.items() if k != "time" and not k.startswith(("time/", "rollout/"))}
    for r in records
  ]
  records = _records(killed)
  assert [r["iteration"] for r in records] == list(range(1, ITERATIONS + 1))
  assert strip(records) == strip(_records(whole))
  assert _trajectories(killed) == _trajectories(whole)
  a = (whole / "hf_policy" / "model.safetensors").read_bytes()
  b = (killed / "hf_policy" / "model.safetensors").read_bytes()
  assert a == b


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_after_the_same_iteration_saved(two_processes, tmp_path):
  """A preemption signal that reaches one process only: both finish the iteration in flight,
  agree on it, save it (each its shards) and exit with status 75; the checkpoint holds the
  uninterrupted run's params of that iteration, bit for bit."""
  whole, cache, _ = two_processes
  stopped = tmp_path / "stopped"
  logs = tmp_path / "stopped_logs"
  logs.mkdir()
  # More iterations than the uninterrupted run, so that the signal never meets the last one
  # (which would end the run normally); num_iterations may differ between runs of a workdir.
  procs = _start(stopped, 2, 2, logs, cache, extra=("--config.num_iterations=4",))
  try:
    metrics = stopped / "metrics.jsonl"
    deadline = time.time() + 600
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):  # iteration 1 logged
      assert all(p.poll() is None for p in procs), "a process ended before the signal"
      assert time.time() < deadline, "no iteration in time"
      time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)
    for proc in procs:
      proc.wait(timeout=300)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  outputs = [(logs / f"process{i}.log").read_text() for i in range(2)]
  assert [p.returncode for p in procs] == [75, 75], outputs[0][-3000:] + outputs[1][-3000:]
  reached = len(_records(stopped))
  assert reached in (1, 2), reached  # the signal came during iteration 1's logs or iteration 2
  assert sorted(os.listdir(stopped / "checkpoints")) == [
    str(i)
    for i in range(1, reached + 1)  # checkpoint.every=1: each iteration, then the stop
  ]
  assert "SIGTERM: saving after the iteration in flight" in outputs[1]
  line = f"stopped by SIGTERM after saving iteration {reached} in {stopped / 'checkpoints'}"
  assert line in outputs[0] and line in outputs[1]
  want = _final_params(whole, reached)
  for name, value in _final_params(stopped, reached).items():
    np.testing.assert_array_equal(value, want[name], err_msg=name)
