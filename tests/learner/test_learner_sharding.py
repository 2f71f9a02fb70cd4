"""The learner on a device mesh (8 simulated CPU devices) and multi-host (2 processes).

One SeeUPO update of a tiny Qwen3 (2 turns, 8 rows of 32 tokens, 2 mini-batches,
AdamW lr 1e-3, KL 0.002 to the reference params) on a mesh must equal the same
update on one device, and keep every parameter and optimizer moment on its
partition rule's sharding. The problem is defined once in
`learner_multihost_worker.py`, which is also the multi-host worker script.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import socket
import subprocess
import sys
import warnings

import jax
import numpy as np
import pytest

import processes
from absl.testing import parameterized
from jax.sharding import PartitionSpec as P

import learner_multihost_worker as problem
from seeupo_jax import learner
from seeupo_jax import sharding as sharding_lib

WORKER = pathlib.Path(__file__).parents[1] / "learner_multihost_worker.py"
REPO = WORKER.parent.parent

# Adam divides by sqrt(nu): an entry whose gradient is ~eps at some step turns float
# reduction-order noise (different on every mesh) into a visible difference of the
# params. Measured max |sharded - one device| after the 4 steps of lr 1e-3 (params
# move by up to 4e-3): params 3.2e-6 (2x2x2), 4e-8 (data=8), 6.5e-6 (2x4, micro-batches),
# 4.2e-6 (2x4, remat), 2.4e-6 (multi-host); Adam mu <= 2e-8 (of up to 1e-2), nu <= 1.5e-11.
PARAMS_TOL = dict(atol=1e-5, rtol=1e-5)
MOMENT_TOL = dict(atol=1e-8, rtol=1e-4)
METRIC_TOL = dict(atol=1e-6, rtol=1e-5)
METRICS = ("loss", "pg_loss", "kl", "grad_norm", "ratio_mean", "optimizer_steps")


def _adam(opt_state):
  """The ScaleByAdamState of `learner.default_optimizer` (chain(clip, adamw))."""
  return opt_state[1][0]


def _numpy(tree):
  return jax.tree.map(np.asarray, tree)


@functools.lru_cache(maxsize=None)
def _reference():
  """The update on jax.devices()[0], no mesh: (params, adam mu, adam nu, scalar metrics), NumPy."""
  device = jax.devices()[0]
  params = jax.device_put(problem.init_params(), device)
  step = learner.make_update(
    learner.qwen_logprob_fn(problem.model_config()), problem.optimizer(), problem.learner_config()
  )
  state = learner.init_state(params, problem.optimizer(), ref_params=params)
  batch = jax.device_put(problem.make_batch(), device)
  state, metrics = step(state, batch, jax.random.key(problem.UPDATE_SEED))
  adam = _adam(state.opt_state)
  scalars = {name: float(metrics[name]) for name in METRICS}
  return _numpy(state.params), _numpy(adam.mu), _numpy(adam.nu), scalars


def _assert_trees_close(actual, expected, **tol):
  for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)):
    np.testing.assert_allclose(np.asarray(a), e, err_msg=sharding_lib.path_name(path), **tol)


@pytest.mark.slow
class LearnerMeshTest(parameterized.TestCase):
  @parameterized.named_parameters(
    ("data2_fsdp2_tensor2", dict(data=2, fsdp=2, tensor=2), 1, "none"),
    ("data8", dict(data=8, fsdp=1, tensor=1), 1, "none"),
    ("data2_tensor4_microbatches2", dict(data=2, fsdp=1, tensor=4), 2, "none"),
    ("data2_fsdp4_remat_full", dict(data=2, fsdp=4, tensor=1), 1, "full"),
  )
  def test_sharded_update_equals_one_device_and_keeps_shardings(
    self, mesh_sizes, microbatches, remat
  ):
    expected_params, expected_mu, expected_nu, expected_metrics = _reference()
    initial = _numpy(problem.init_params())

    mesh = sharding_lib.make_mesh(**mesh_sizes)
    params = learner.shard_params(problem.init_params(), mesh)
    rules = sharding_lib.param_shardings(params, mesh)
    batch = learner.shard_batch(problem.make_batch(), mesh)
    rows = P(("data", "fsdp"))
    self.assertEqual(batch.tokens.sharding.spec, P(("data", "fsdp"), None))
    self.assertEqual(batch.rewards.sharding.spec, rows)
    shard_rows = problem.NUM_ROWS // (mesh.shape["data"] * mesh.shape["fsdp"])
    for shard in batch.tokens.addressable_shards:
      self.assertEqual(shard.data.shape, (shard_rows, problem.LENGTH))

    optimizer = problem.optimizer()
    step = learner.make_update(
      learner.qwen_logprob_fn(problem.model_config(remat=remat)),
      optimizer,
      problem.learner_config(microbatches=microbatches),
    )
    state = learner.init_state(params, optimizer, ref_params=params)
    before = jax.tree.leaves(learner.state_shardings(state))
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      with jax.set_mesh(mesh):
        state, metrics = step(state, batch, jax.random.key(problem.UPDATE_SEED))
      jax.block_until_ready(state)
    # No donated buffer of the state is left unused.
    self.assertEmpty([str(w.message) for w in caught if "donated" in str(w.message)])

    # Every leaf of the state (counters included) comes back on its input sharding, so the
    # next call reuses this compilation.
    for (path, leaf), sharding in zip(jax.tree_util.tree_leaves_with_path(state), before):
      self.assertEqual(leaf.sharding, sharding, sharding_lib.path_name(path))
    # Shardings: params, both Adam moments and the reference params stay on the rules.
    adam = _adam(state.opt_state)
    for tree in (state.params, adam.mu, adam.nu, state.ref_params):
      for (path, leaf), rule in zip(
        jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(rules)
      ):
        self.assertTrue(
          leaf.sharding.is_equivalent_to(rule, leaf.ndim),
          f"{sharding_lib.path_name(path)}: {leaf.sharding.spec} is not {rule.spec}",
        )
    gate = state.params["layers"]["mlp"]["gate_proj"]["kernel"]
    self.assertTrue(
      gate.sharding.is_equivalent_to(adam.mu["layers"]["mlp"]["gate_proj"]["kernel"].sharding, 3)
    )
    if mesh_sizes == dict(data=2, fsdp=2, tensor=2):
      self.assertEqual(gate.sharding.spec, P(None, "fsdp", "tensor"))
      self.assertEqual(
        adam.mu["layers"]["mlp"]["gate_proj"]["kernel"].sharding.spec, gate.sharding.spec
      )
      self.assertEqual(
        state.params["layers"]["mlp"]["down_proj"]["kernel"].sharding.spec,
        P(None, "tensor", "fsdp"),
      )
      # Each device holds a quarter of gate_proj's [layers, D, F] (D over fsdp, F over tensor).
      self.assertEqual(gate.addressable_shards[0].data.shape, (2, 32, 64))

    # Values: equal to the one-device update, which moved the params by ~lr x steps.
    change = max(
      float(np.max(np.abs(e - i)))
      for e, i in zip(jax.tree.leaves(expected_params), jax.tree.leaves(initial))
    )
    self.assertGreater(change, 1e-3)
    _assert_trees_close(state.params, expected_params, **PARAMS_TOL)
    _assert_trees_close(adam.mu, expected_mu, **MOMENT_TOL)
    _assert_trees_close(adam.nu, expected_nu, **MOMENT_TOL)
    for name in METRICS:
      np.testing.assert_allclose(
        float(metrics[name]), expected_metrics[name], err_msg=name, **METRIC_TOL
      )
    self.assertEqual(float(metrics["optimizer_steps"]), 4.0)  # 2 turns x 2 mini-batches


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_multihost_update_equals_one_process(tmp_path):
  """2 processes x 2 CPU devices (gloo collectives over loopback), mesh data=2 x fsdp=2,
  each process feeding its 4 rows, give the one-process update of all 8 rows."""
  batch = problem.make_batch()
  batch_path, out_path = tmp_path / "batch.npz", tmp_path / "params.npz"
  fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
  np.savez(batch_path, **{name: x for name, x in fields.items() if x is not None})
  env = processes.env(devices=2)
  port = _free_port()
  workers = [
    subprocess.Popen(
      [
        sys.executable,
        str(WORKER),
        f"--process_id={i}",
        "--num_processes=2",
        f"--coordinator=127.0.0.1:{port}",
        f"--batch={batch_path}",
        f"--out={out_path}",
      ],
      cwd=REPO,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  logs = []
  try:
    for worker in workers:
      logs.append(worker.communicate(timeout=300)[0])
  finally:
    for worker in workers:
      if worker.poll() is None:
        worker.kill()
        worker.communicate()
  for i, (worker, log) in enumerate(zip(workers, logs)):
    assert worker.returncode == 0, f"worker {i} exited with {worker.returncode}:\n{log[-5000:]}"

  expected_params, _, _, expected_metrics = _reference()
  with np.load(out_path) as got:
    for path, leaf in jax.tree_util.tree_leaves_with_path(expected_params):
      name = sharding_lib.path_name(path)
      np.testing.assert_allclose(got[name], leaf, err_msg=name, **PARAMS_TOL)
    for name in ("loss", "kl", "grad_norm", "optimizer_steps"):
      np.testing.assert_allclose(
        got[f"metric/{name}"], expected_metrics[name], err_msg=name, **METRIC_TOL
      )
