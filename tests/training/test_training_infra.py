"""Training infrastructure: orbax checkpoints (round trips, keep-last-K, resharding, mismatch
errors, interrupted saves, config checks) and the metrics log (JSON lines, TensorBoard, curves,
tables)."""

import asyncio
import dataclasses
import functools
import glob
import json
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import processes
from jax.sharding import NamedSharding, PartitionSpec as P

from seeupo_jax import learner, sharding
from seeupo_jax.models import config as config_lib
from seeupo_jax.models import lora
from seeupo_jax.models import qwen
from seeupo_jax.training import checkpoint_manifest, checkpoints
from seeupo_jax.training import metrics_log
import tiny

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax 0.12.8: "<step>.orbax-checkpoint-tmp"


def _assert_trees_identical(actual, expected):
  """Same structure, dtypes and bits (typed keys through their key data)."""
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    if jax.dtypes.issubdtype(e.dtype, jax.dtypes.prng_key):
      assert a.dtype == e.dtype
      a, e = jax.random.key_data(a), jax.random.key_data(e)
    assert a.dtype == e.dtype and a.shape == e.shape
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def _with_moments(state, optimizer, seed):
  """`state` after one optimizer step on random gradients: Adam's moments and count nonzero."""
  rng = np.random.default_rng(seed)
  grads = jax.tree.map(
    lambda x: jax.device_put(rng.standard_normal(x.shape).astype(x.dtype), x.sharding), state.params
  )
  _, opt_state = jax.jit(optimizer.update)(grads, state.opt_state, state.params)
  return state.replace(opt_state=opt_state, step=state.step + 3, optimizer_steps=state.step + 1)


@pytest.fixture(scope="module")
def model():
  config = tiny.model_config()
  return config, jax.jit(functools.partial(qwen.init_params, config))(jax.random.key(0))


@pytest.fixture(scope="module")
def sharded_state(model):
  """A learner TrainState of qwen3-tiny on a data=2 x fsdp=2 x tensor=2 mesh."""
  _, params = model
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  optimizer = learner.default_optimizer()
  params = learner.shard_params(params, mesh)
  state = learner.init_state(params, optimizer, ref_params=params)
  return mesh, optimizer, _with_moments(state, optimizer, seed=1)


def _small_tree(value):
  return {"w": jnp.full((3, 4), value, jnp.float32), "n": (jnp.int32(value), None)}


# ----------------------------------------------------------------------------------------------
# Checkpointer.


def test_train_state_round_trip_is_bit_identical(model, tmp_path):
  _, params = model
  optimizer = learner.default_optimizer()
  state = _with_moments(learner.init_state(params, optimizer, ref_params=params), optimizer, 2)
  rng = jax.random.split(jax.random.key(7))[1]
  progress = {"next_task": 12, "epoch": 1, "history": 4, "config_hash": "abc", "best": None}
  with checkpoints.Checkpointer(str(tmp_path), keep=2, every=5) as ckpt:
    assert ckpt.latest_iteration() is None
    assert ckpt.restore_latest(checkpoints.abstract_of(state), rng) is None
    assert ckpt.save(5, state, rng, dict(progress, next_task=np.int64(12)))  # NumPy ints too
  with checkpoints.Checkpointer(str(tmp_path), keep=2, every=5) as ckpt:
    iteration, restored, restored_rng, restored_progress = ckpt.restore_latest(
      checkpoints.abstract_of(state), jax.eval_shape(lambda: rng)
    )
  assert iteration == 5
  assert isinstance(restored, learner.TrainState)
  assert restored.critic_params is None and restored.critic_opt_state is None
  _assert_trees_identical(restored, state)
  assert int(restored.opt_state[1][0].count) == 1  # the moments are not zeros: a real check
  assert restored_rng.dtype == rng.dtype
  _assert_trees_identical(restored_rng, rng)
  # The restored key draws what the saved one draws.
  np.testing.assert_array_equal(
    jax.random.uniform(restored_rng, (4,)), jax.random.uniform(rng, (4,))
  )
  assert restored_progress == progress


def test_a_train_state_with_a_base_is_saved_without_it_and_restored_beside_the_targets(
  model, tmp_path
):
  """LoRA: the checkpoint holds the adapters' `SavedState` (no `base` entry, no base arrays);
  restoring into a `TrainState` gives back the saved fields and the target's own base."""
  config, _ = model
  adapters, base = lora.split(qwen.init_params(config.replace(lora_rank=2), jax.random.key(1)))
  optimizer = learner.default_optimizer()
  state = _with_moments(learner.init_state(adapters, optimizer, base=base), optimizer, 3)
  rng = jax.random.key(5)
  with checkpoints.Checkpointer(str(tmp_path), every=1) as ckpt:
    assert ckpt.save(1, state, rng, {"next_task": 1})
  metadata = json.loads((tmp_path / "1" / "manifest" / "metadata").read_text())
  paths = [leaf["path"] for leaf in metadata["train_state"]]
  assert paths and not [p for p in paths if p.startswith("base")]
  assert sorted(p for p in paths if p.startswith("params/")) == sorted(
    "params/" + leaf["path"] for leaf in checkpoint_manifest.tree_manifest(adapters)
  )
  with checkpoints.Checkpointer(str(tmp_path), every=1) as ckpt:
    _, restored, _, _ = ckpt.restore_latest(checkpoints.abstract_of(state), rng)
  assert isinstance(restored, learner.TrainState)
  assert restored.base is state.base  # the target's, never read from the checkpoint
  _assert_trees_identical(learner.without_base(restored), learner.without_base(state))


def test_sharded_state_restores_onto_the_requested_shardings(model, sharded_state, tmp_path):
  _, params = model
  mesh, optimizer, state = sharded_state
  rng = jax.device_put(jax.random.split(jax.random.key(3), 8), NamedSharding(mesh, P("data")))
  with checkpoints.Checkpointer(str(tmp_path)) as ckpt:
    assert ckpt.save(0, state, rng, {"next_task": 0})

    # The same shardings.
    _, same, same_rng, _ = ckpt.restore_latest(checkpoints.abstract_of(state), rng)
    _assert_trees_identical(same, state)
    for a, e in zip(jax.tree.leaves(same), jax.tree.leaves(state)):
      assert a.sharding == e.sharding
    assert same_rng.sharding == rng.sharding

    # Another mesh, targets from jax.eval_shape plus shardings (nothing materialised).
    mesh2 = sharding.make_mesh(data=1, fsdp=8, tensor=1)
    abstract_params = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      jax.eval_shape(lambda: params),
      sharding.param_shardings(params, mesh2),
    )
    replicated = NamedSharding(mesh2, P())
    target_shardings = learner.TrainState(
      params=jax.tree.map(lambda x: x.sharding, abstract_params),
      opt_state=learner.opt_state_shardings(optimizer, abstract_params),
      ref_params=jax.tree.map(lambda x: x.sharding, abstract_params),
      critic_params=None,
      critic_opt_state=None,
      step=replicated,
      optimizer_steps=replicated,
      skipped_updates=replicated,
    )
    abstract_state = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      jax.eval_shape(lambda p: learner.init_state(p, optimizer, ref_params=p), abstract_params),
      target_shardings,
    )
    abstract_rng = jax.ShapeDtypeStruct(
      rng.shape, rng.dtype, sharding=NamedSharding(mesh2, P("fsdp"))
    )
    _, moved, moved_rng, _ = ckpt.restore_latest(abstract_state, abstract_rng)
  _assert_trees_identical(moved, state)
  _assert_trees_identical(moved_rng, rng)
  for a, s in zip(jax.tree.leaves(moved), jax.tree.leaves(target_shardings)):
    assert a.sharding == s
  assert moved_rng.sharding == abstract_rng.sharding
  # The embedding really moved: fsdp x tensor = 2 x 2 shards before, 8 fsdp shards now.
  embedding = moved.params["embed"]["embedding"]
  assert embedding.sharding.spec == P(("fsdp", "tensor"), None)
  assert len({str(s.index) for s in embedding.addressable_shards}) == 8
  assert len({str(s.index) for s in state.params["embed"]["embedding"].addressable_shards}) == 4


def test_keep_last_k_and_the_save_interval(tmp_path):
  rng = jax.random.PRNGKey(5)  # a raw uint32[2] key
  with checkpoints.Checkpointer(str(tmp_path), keep=2, every=2) as ckpt:
    saved = [i for i in range(7) if ckpt.save(i, _small_tree(i), rng + i, {"at": i})]
    assert saved == [0, 2, 4, 6]
    with pytest.raises(ValueError, match="progress must be JSON-serialisable"):
      ckpt.save(8, _small_tree(8), rng, {"bad": object()})
    assert [ckpt.should_save(i) for i in range(4)] == [True, False, True, False]
    assert ckpt.all_iterations() == [4, 6]
    assert ckpt.save(7, _small_tree(7), rng + 7, {"at": 7}, force=True)
    assert not ckpt.save(7, _small_tree(70), rng, {"at": 70}, force=True)  # already saved
    with pytest.raises(ValueError, match="newer iteration 7"):
      ckpt.save(6, _small_tree(6), rng, {"at": 6}, force=True)
    assert ckpt.all_iterations() == [6, 7]
  assert sorted(os.listdir(tmp_path)) == ["6", "7"]
  with checkpoints.Checkpointer(str(tmp_path), keep=2, every=2) as ckpt:
    iteration, tree, restored_rng, progress = ckpt.restore_latest(
      checkpoints.abstract_of(_small_tree(0)), checkpoints.abstract_of(rng)
    )
  assert (iteration, progress) == (7, {"at": 7})
  np.testing.assert_array_equal(tree["w"], np.full((3, 4), 7, np.float32))
  assert tree["n"][1] is None and int(tree["n"][0]) == 7
  assert restored_rng.dtype == np.uint32
  np.testing.assert_array_equal(restored_rng, np.asarray(rng) + 7)


@pytest.fixture(scope="module")
def tiny_checkpoint(model, tmp_path_factory):
  """A checkpoint of an unsharded qwen3-tiny TrainState at iteration 3."""
  _, params = model
  optimizer = learner.default_optimizer()
  state = learner.init_state(params, optimizer, ref_params=params)
  directory = str(tmp_path_factory.mktemp("tiny_checkpoint"))
  with checkpoints.Checkpointer(directory, every=1) as ckpt:
    ckpt.save(3, state, jax.random.key(0), {})
  return directory, optimizer


def _abstract_state(config, optimizer):
  return jax.eval_shape(
    lambda: learner.init_state(
      p := qwen.init_params(config, jax.random.key(0)), optimizer, ref_params=p
    )
  )


def test_a_different_model_is_refused_naming_the_first_differing_leaf(tiny_checkpoint):
  directory, optimizer = tiny_checkpoint
  base = tiny.model_config()
  key = jax.eval_shape(lambda: jax.random.key(0))
  with checkpoints.Checkpointer(directory, every=1) as ckpt:
    # A wider MLP: [layers, intermediate, hidden] = [2, 128, 64] saved, [2, 96, 64] wanted.
    wider = _abstract_state(base.replace(intermediate_size=96), optimizer)
    with pytest.raises(ValueError) as error:
      ckpt.restore_latest(wider, key)
    message = str(error.value)
    assert "first difference at 'params/layers/mlp/down_proj/kernel'" in message
    assert "checkpoint has float32[2, 128, 64], the target has float32[2, 96, 64]" in message
    assert os.path.join(directory, "3") in message

    # A tied model has no lm_head: the checkpoint's extra leaf is named.
    tied = _abstract_state(config_lib.get_preset("qwen3-tiny-tied"), optimizer)
    with pytest.raises(
      ValueError,
      match=r"'params/lm_head/kernel': the checkpoint has "
      r"float32\[64, 512\], the target has nothing",
    ):
      ckpt.restore_latest(tied, key)

    # A raw key where a typed key was saved.
    with pytest.raises(ValueError, match=r"PRNG key key<fry>\[\].*target is uint32\[2\]"):
      ckpt.restore_latest(_abstract_state(base, optimizer), jax.random.PRNGKey(0))

    # The right target restores.
    assert ckpt.restore_latest(_abstract_state(base, optimizer), key)[0] == 3


@pytest.fixture
def slow_orbax_cleanup(monkeypatch):
  """Orbax's deletion of leftover temporary directories (a coroutine it runs in a background
  thread), 0.5 s late: without the wait in `Checkpointer`'s constructor, the directory is
  still there when the test looks (what CI once saw, by chance)."""
  from orbax.checkpoint._src.path import temporary_paths  # orbax 0.12's module

  original = temporary_paths.cleanup_temporary_paths

  async def late(*args, **kwargs):
    await asyncio.sleep(0.5)
    return await original(*args, **kwargs)

  monkeypatch.setattr(temporary_paths, "cleanup_temporary_paths", late)


def test_a_leftover_temporary_directory_is_ignored_and_removed(tmp_path, slow_orbax_cleanup):
  with checkpoints.Checkpointer(str(tmp_path), every=1) as ckpt:
    ckpt.save(1, _small_tree(1), jax.random.key(1), {"at": 1})
  # What an interrupted save of iteration 2 leaves: a copy of a checkpoint under a tmp name,
  # without being renamed.
  leftover = tmp_path / f"2{TMP_SUFFIX}"
  shutil.copytree(tmp_path / "1", leftover)
  with checkpoints.Checkpointer(str(tmp_path), every=1) as ckpt:
    assert ckpt.latest_iteration() == 1
    iteration, tree, _, progress = ckpt.restore_latest(
      checkpoints.abstract_of(_small_tree(0)), jax.eval_shape(lambda: jax.random.key(0))
    )
  assert (iteration, progress) == (1, {"at": 1})
  assert not leftover.exists()


_SAVER = r"""
import sys
import jax.numpy as jnp
import numpy as np
from seeupo_jax.training import checkpoints


def state(seed):  # 8 x 8 MiB of incompressible float32
  rng = np.random.default_rng(seed)
  return {f"w{i}": jnp.asarray(rng.random(2**21, dtype=np.float32)) for i in range(8)}


ckpt = checkpoints.Checkpointer(sys.argv[1], every=1)
ckpt.save(1, state(1), jnp.arange(2, dtype=jnp.uint32), {"at": 1})
print("saved 1", flush=True)
big = state(2)
print("saving 2", flush=True)
ckpt.save(2, big, jnp.arange(2, dtype=jnp.uint32), {"at": 2})
print("saved 2", flush=True)
"""


def _size(path):
  """The size of a file that the saver may be renaming away (0 then)."""
  try:
    return os.path.getsize(path) if os.path.isfile(path) else 0
  except OSError:
    return 0


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
  """A real kill -9 while orbax writes iteration 2: iteration 1 (whose save had returned) is
  intact and restores; the half-written directory is never taken for a checkpoint."""
  directory = str(tmp_path / "ckpt")
  # The killed process must not write to the session's compilation cache (tests/conftest.py).
  env = processes.env(PYTHONPATH=REPO, JAX_ENABLE_COMPILATION_CACHE="false")
  with open(tmp_path / "stderr.txt", "w") as stderr:
    proc = subprocess.Popen(
      [sys.executable, "-c", _SAVER, directory],
      cwd=REPO,
      env=env,
      stdout=subprocess.PIPE,
      stderr=stderr,
      text=True,
    )
  try:
    assert proc.stdout.readline().strip() == "saved 1", (tmp_path / "stderr.txt").read_text()
    assert proc.stdout.readline().strip() == "saving 2"
    deadline, written = time.monotonic() + 60, 0
    while time.monotonic() < deadline and proc.poll() is None:
      temporary = glob.glob(os.path.join(directory, f"2{TMP_SUFFIX}*"))
      files = [f for t in temporary for f in glob.glob(os.path.join(t, "**"), recursive=True)]
      written = sum(_size(f) for f in files)
      if written > 2**20:  # array data is being written
        break
      time.sleep(0.001)
    if proc.poll() is None:
      os.kill(proc.pid, signal.SIGKILL)
  finally:
    proc.kill()
    proc.wait()
  assert proc.returncode == -signal.SIGKILL
  assert written > 2**20, "the save finished before it could be killed"
  assert not os.path.exists(os.path.join(directory, "2"))
  assert glob.glob(os.path.join(directory, f"2{TMP_SUFFIX}*"))

  expected = np.random.default_rng(1)
  expected = {f"w{i}": expected.random(2**21, dtype=np.float32) for i in range(8)}
  abstract = {name: jax.ShapeDtypeStruct(x.shape, x.dtype) for name, x in expected.items()}
  with checkpoints.Checkpointer(directory, every=1) as ckpt:
    iteration, tree, rng, progress = ckpt.restore_latest(
      abstract, jax.ShapeDtypeStruct((2,), jnp.uint32)
    )
  assert (iteration, progress) == (1, {"at": 1})
  _assert_trees_identical(tree, expected)
  np.testing.assert_array_equal(rng, [0, 1])
  assert not glob.glob(os.path.join(directory, f"2{TMP_SUFFIX}*"))  # cleaned up on open


def test_check_config():
  saved = {
    "model": {"preset": "qwen3-tiny", "dtype": "float32"},
    "learner": {"kl_coef": 0.0, "clip": [0.2, 0.28]},
    "num_iterations": 100,
    "eval": {"every": 10},
    "checkpoint": {"keep": 3},
  }
  same = json.loads(json.dumps(saved))
  same["learner"]["clip"] = (0.2, 0.28)  # a tuple equals the list it was saved as
  same["num_iterations"] = 200
  same["eval"] = {"every": 5, "splits": ["dev"]}
  same["checkpoint"]["keep"] = 1
  same["log"] = {"tensorboard": False}
  checkpoints.check_config(saved, same)

  changed = json.loads(json.dumps(saved))
  changed["model"]["preset"] = "qwen3-bench"
  changed["learner"]["kl_coef"] = 0.1
  changed["learner"]["epochs"] = 2
  del changed["model"]["dtype"]
  with pytest.raises(ValueError) as error:
    checkpoints.check_config(saved, changed)
  message = str(error.value)
  assert "4 key(s)" in message
  for line in (
    "learner.epochs: (absent) in the checkpoint, 2 now",
    "learner.kl_coef: 0.0 in the checkpoint, 0.1 now",
    'model.dtype: "float32" in the checkpoint, (absent) now',
    'model.preset: "qwen3-tiny" in the checkpoint, "qwen3-bench" now',
  ):
    assert line in message
  assert "num_iterations" not in message.split("keys allowed")[0]
  checkpoints.check_config(saved, changed, allowed_to_differ=("model", "learner"))


def test_the_checkpointer_refuses_a_changed_config(tmp_path):
  config = {"model": {"preset": "qwen3-tiny"}, "num_iterations": 10}
  with checkpoints.Checkpointer(str(tmp_path), every=1, config=config) as ckpt:
    ckpt.save(1, _small_tree(1), jax.random.key(0), {})
    assert ckpt.saved_config() == config
  target = (checkpoints.abstract_of(_small_tree(0)), jax.eval_shape(lambda: jax.random.key(0)))
  longer = dict(config, num_iterations=20)
  with checkpoints.Checkpointer(str(tmp_path), every=1, config=longer) as ckpt:
    assert ckpt.restore_latest(*target)[0] == 1
  other = {"model": {"preset": "qwen3-bench"}, "num_iterations": 10}
  with checkpoints.Checkpointer(str(tmp_path), every=1, config=other) as ckpt:
    with pytest.raises(ValueError, match="model.preset"):
      ckpt.restore_latest(*target)


# ----------------------------------------------------------------------------------------------
# MetricsLog.


def _strict_json(line):
  def refuse(token):
    raise AssertionError(f"invalid JSON token {token} in {line!r}")

  return json.loads(line, parse_constant=refuse)


def _tensorboard_events(logdir):
  """[(file, event)] of every event in the TFRecord files of `logdir`, file by file in order.

  TFRecord: uint64 length, uint32 length crc, payload, uint32 payload crc.
  """
  from tensorboardX.proto import event_pb2

  out = []
  for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
    data = open(path, "rb").read()
    position = 0
    while position < len(data):
      (length,) = struct.unpack("<Q", data[position : position + 8])
      event = event_pb2.Event()
      event.ParseFromString(data[position + 12 : position + 12 + length])
      out.append((path, event))
      position += 12 + length + 4
  return out


def _scalars(events):
  return [
    (value.tag, event.step, value.simple_value)
    for _, event in events
    for value in event.summary.value
  ]


def test_metrics_log_writes_valid_json_lines_and_tensorboard(tmp_path):
  workdir = str(tmp_path)
  with metrics_log.MetricsLog(workdir) as log:
    for i in range(5):
      log.write(
        i,
        {
          "loss": jnp.float32(0.5 * i),
          "reward": np.array(i, np.int32),
          "kl": float("nan") if i == 2 else 0.25,
          "grad_norm": math.inf if i == 3 else 1.0,
          "per_turn": np.ones(3),  # not a scalar: skipped
          "name": "run",  # not a number: skipped
        },
      )
    with pytest.raises(ValueError, match="reserved"):
      log.write(5, {"iteration": 1.0})
  lines = open(os.path.join(workdir, "metrics.jsonl")).read().splitlines()
  records = [_strict_json(line) for line in lines]
  assert [r["iteration"] for r in records] == [0, 1, 2, 3, 4]
  assert set(records[0]) == {"iteration", "time", "loss", "reward", "kl", "grad_norm"}
  assert records[2]["kl"] is None and records[3]["grad_norm"] is None
  assert [r["loss"] for r in records] == [0.0, 0.5, 1.0, 1.5, 2.0]
  assert [r["reward"] for r in records] == [0.0, 1.0, 2.0, 3.0, 4.0]
  assert abs(records[0]["time"] - time.time()) < 600
  assert metrics_log.read_metrics(os.path.join(workdir, "metrics.jsonl")) == records

  scalars = _scalars(_tensorboard_events(os.path.join(workdir, "tensorboard")))
  loss = sorted((step, value) for tag, step, value in scalars if tag == "loss")
  assert loss == [(i, 0.5 * i) for i in range(5)]
  kl = {step: value for tag, step, value in scalars if tag == "kl"}
  assert math.isnan(kl[2]) and kl[1] == 0.25
  assert not any(tag in ("per_turn", "name") for tag, _, _ in scalars)


def test_metrics_log_resume_drops_the_iterations_written_again(tmp_path):
  workdir = str(tmp_path)
  path = os.path.join(workdir, "metrics.jsonl")
  with metrics_log.MetricsLog(workdir) as log:
    for i in range(6):
      log.write(i, {"loss": float(i)})
  with open(path, "a") as f:
    f.write('{"iteration": 6, "lo')  # a write cut short by a crash
  # The checkpoint was at iteration 3: iterations 4.. are written again.
  with metrics_log.MetricsLog(workdir, resume_from=4) as log:
    assert [r["iteration"] for r in metrics_log.read_metrics(path)] == [0, 1, 2, 3]
    for i in range(4, 8):
      log.write(i, {"loss": 10.0 + i})
  records = [_strict_json(line) for line in open(path).read().splitlines()]
  assert [r["iteration"] for r in records] == list(range(8))
  assert [r["loss"] for r in records] == [0.0, 1.0, 2.0, 3.0, 14.0, 15.0, 16.0, 17.0]
  assert not [f for f in os.listdir(workdir) if f.endswith(".tmp")]

  # The resumed TensorBoard file starts with a purge at step 4 (TensorBoard then hides the old
  # file's steps >= 4) and holds the new values.
  events = _tensorboard_events(os.path.join(workdir, "tensorboard"))
  files = sorted({path for path, _ in events})
  assert len(files) == 2
  second = [event for path, event in events if path == files[1]]
  purges = [e.step for e in second if e.HasField("session_log")]
  assert purges == [4]
  assert sorted((s, v) for t, s, v in _scalars([(files[1], e) for e in second])) == [
    (i, 10.0 + i) for i in range(4, 8)
  ]

  # Without resume_from, the lines are kept and new ones appended.
  with metrics_log.MetricsLog(workdir, tensorboard=False) as log:
    log.write(8, {"loss": 1.0})
  assert [r["iteration"] for r in metrics_log.read_metrics(path)] == list(range(9))


def test_read_metrics_skips_a_corrupt_middle_line(tmp_path, caplog):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"iteration": 0}\nnot json\n{"iteration": 1}\n')
  with caplog.at_level("WARNING"):
    assert metrics_log.read_metrics(str(path)) == [{"iteration": 0}, {"iteration": 1}]
  assert "metrics.jsonl: skipped 1 line(s)" in caplog.text and "line 2" in caplog.text


def test_plot_panels_writes_a_png_with_one_panel_per_present_panel(tmp_path):
  import matplotlib.image

  records = [
    {"iteration": i, "loss": 1.0 / (i + 1), "reward": None if i == 3 else i} for i in range(10)
  ]
  loss, reward = metrics_log.Panel("loss", ("loss",)), metrics_log.Panel("reward", ("reward",))
  missing = metrics_log.Panel("missing", ("missing",))
  two = str(tmp_path / "two.png")
  figure = metrics_log.plot_panels(records, two, [loss, reward], title="run", columns=1)
  assert [ax.get_title() for ax in figure.axes] == ["loss", "reward"]
  assert figure.get_suptitle() == "run"
  y = figure.axes[1].get_lines()[0].get_ydata()
  assert np.isnan(y[3]) and list(np.delete(y, 3)) == [0, 1, 2, 4, 5, 6, 7, 8, 9]  # None: a gap
  with_absent = str(tmp_path / "plots" / "absent.png")
  metrics_log.plot_panels(records, with_absent, [loss, missing, reward], columns=1)
  one = str(tmp_path / "one.png")
  metrics_log.plot_panels(records, one, [loss], columns=1)
  for path in (two, with_absent, one):
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
  heights = [matplotlib.image.imread(p).shape[0] for p in (two, with_absent, one)]
  assert heights[0] == heights[1] > heights[2]  # the absent panel was left out
  # Two columns: the two panels side by side, twice as wide and less tall.
  side = metrics_log.plot_panels(records, str(tmp_path / "side.png"), [loss, reward])
  assert side.get_size_inches()[0] == 2 * figure.get_size_inches()[0]
  assert side.get_size_inches()[1] < figure.get_size_inches()[1]
  empty = str(tmp_path / "empty.png")
  metrics_log.plot_panels([], empty, [loss])
  assert os.path.getsize(empty) > 0
  assert sorted(os.listdir(tmp_path)) == [
    "empty.png",
    "one.png",
    "plots",
    "side.png",
    "two.png",
  ]  # no temporary file left


def test_format_table_aligns_columns():
  rows = [
    {"split": "dev", "avg@4": 0.5, "pass@4": 0.75, "n": 128},
    {"split": "test-long", "avg@4": 0.123456, "n": 7},
  ]
  table = metrics_log.format_table(rows, ("split", "avg@4", "pass@4", "n"))
  assert table == "\n".join(
    [
      "split      avg@4  pass@4    n",
      "---------  -----  ------  ---",
      "dev        0.500   0.750  128",
      "test-long  0.123       -    7",
    ]
  )


@pytest.mark.parametrize("name", ["synthetic", "bfcl", "appworld"])
def test_every_rollout_config_field_is_a_config_key_passed_by_its_name(name):
  """`RolloutConfig`'s fields are keys of the training configs' `rollout` section, and the typed
  section's `rollout_config` passes each one on as it is; each allows what RolloutConfig's field
  allows (one declaration). The session geometry keys go to `session_config` (the slots: each
  process's share) and allow what `sampling.SessionConfig`'s fields allow."""
  sys.path.insert(0, REPO)
  from experiments import configs  # pylint: disable=g-import-not-at-top
  from seeupo_jax import fields as fields_lib  # pylint: disable=g-import-not-at-top
  from seeupo_jax import rollout  # pylint: disable=g-import-not-at-top
  from seeupo_jax import sampling  # pylint: disable=g-import-not-at-top
  from seeupo_jax.training import config as config_lib  # pylint: disable=g-import-not-at-top

  config = configs.get_config(name)
  fields = [f.name for f in dataclasses.fields(rollout.RolloutConfig)]
  assert [f for f in fields if f not in config.rollout] == []
  config.rollout.decode_slots = 8
  config.rollout.prefill_rows = 3  # not a default: the value must travel
  section = config_lib.typed(config).rollout
  built = section.rollout_config()
  assert {f: getattr(built, f) for f in fields} == {f: config.rollout[f] for f in fields}
  for f in fields:
    assert fields_lib.allowed_of(config_lib.RolloutSection, f) is fields_lib.allowed_of(
      rollout.RolloutConfig, f
    )
  geometry = {  # config key -> SessionConfig field
    "decode_slots": "rows",
    "max_context_tokens": "max_context_tokens",
    "page_size": "page_size",
    "prefill_chunk": "prefill_chunk",
    "prefill_rows": "prefill_rows",
    "decode_steps_per_sync": "decode_steps_per_sync",
  }
  session = section.session_config()
  assert {k: getattr(session, f) for k, f in geometry.items()} == {
    k: config.rollout[k] for k in geometry
  }
  assert session.prefill_rows == 3
  assert section.session_config(num_processes=2).rows == 4
  for key, f in geometry.items():
    if key != "max_context_tokens":  # declared by RolloutConfig (checked above)
      assert fields_lib.allowed_of(config_lib.RolloutSection, key) is fields_lib.allowed_of(
        sampling.SessionConfig, f
      )


def test_the_progress_fn_feeds_each_writer_in_order_and_redraws_at_evaluations():
  """`writers.fan_out` calls every writer with (iteration, metrics), in the order given (the
  figures read what the metrics log wrote); `every_evaluation` redraws only where `due` says."""
  from seeupo_jax.training import writers

  calls = []
  figures = writers.every_evaluation(
    lambda: calls.append("plot"), lambda iteration: iteration % 2 == 0
  )
  progress_fn = writers.fan_out(
    [lambda i, m: calls.append(("log", i, m["reward"])), figures, lambda i, m: calls.append(i)]
  )
  for iteration in (1, 2, 3):
    progress_fn(iteration, {"reward": iteration / 10})
  assert calls == [("log", 1, 0.1), 1, ("log", 2, 0.2), "plot", 2, ("log", 3, 0.3), 3]
