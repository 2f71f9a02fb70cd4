"""One process of a multi-host learner update (JAX's multi-process runtime on CPU, loopback).

`tests/learner/test_learner_sharding.py` launches NUM_PROCESSES copies of this script:

    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \
      python tests/learner_multihost_worker.py --process_id=I --num_processes=2 \
      --coordinator=127.0.0.1:PORT --batch=batch.npz --out=params.npz

Each process builds the same tiny Qwen3 params (same key) on the global mesh
make_mesh(data=2, fsdp=2, tensor=1) that spans both processes' devices, feeds
its own rows of the batch to `learner.shard_batch`, runs one SeeUPO update and
gathers the new params; process 0 writes them (and the scalar metrics) to --out.

The problem (model, learner config, optimizer, batch) is defined here once, so the
test's one-process reference computes exactly the same update.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

if __name__ == "__main__":
  # Before jax is imported: 2 CPU devices per process, CPU only.
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from seeupo_jax import learner  # noqa: E402
from seeupo_jax import sharding as sharding_lib  # noqa: E402
from seeupo_jax.models import qwen  # noqa: E402
import tiny  # noqa: E402

PARAMS_SEED = 0
UPDATE_SEED = 1
NUM_TURNS = 2
NUM_ROWS = 8
LENGTH = 32


def model_config(**overrides):
  """The tiny Qwen3 (float32); `overrides` of numerics only (e.g. remat="full")."""
  return tiny.model_config(**overrides)


def learner_config(**changes) -> learner.LearnerConfig:
  """SeeUPO, 2 turns, 1 epoch x 2 mini-batches, KL 0.002 to the reference params."""
  return learner.LearnerConfig(
    algorithm="seeupo", num_turns=NUM_TURNS, epochs=1, minibatches=2, kl_coef=0.002
  ).replace(**changes)


def optimizer():
  return learner.default_optimizer(learning_rate=1e-3)


def make_batch(num_rows: int = NUM_ROWS, length: int = LENGTH, seed: int = 0) -> learner.Batch:
  """A NumPy `Batch` of multi-turn trajectories: a 4-token prompt, then per turn 3-6
  generated tokens and 2 environment tokens, right padding; 1 or 2 turns a row.

  Groups of 2 rows half a batch apart (rows i and i + N/2): with 2 processes each
  GRAE group has one row on each process."""
  rng = np.random.default_rng(seed)
  vocab = model_config().vocab_size
  tokens = rng.integers(0, vocab, (num_rows, length)).astype(np.int32)
  lengths = rng.integers(length // 2, length + 1, num_rows)
  token_valid = np.arange(length)[None, :] < lengths[:, None]
  turn_ids = np.full((num_rows, length), -1, np.int32)
  for i in range(num_rows):
    start = 4
    for turn in range(int(rng.integers(1, NUM_TURNS + 1))):
      end = min(start + int(rng.integers(3, 7)), int(lengths[i]))
      turn_ids[i, start:end] = turn
      start = end + 2
      if start >= lengths[i]:
        break
  sample_logp = np.where(turn_ids >= 0, -rng.uniform(0.0, 5.0, (num_rows, length)), 0.0)
  batch = learner.Batch(
    tokens=tokens,
    token_valid=token_valid,
    turn_ids=turn_ids,
    sample_logp=sample_logp.astype(np.float32),
    rewards=rng.normal(size=num_rows).astype(np.float32),
    group_ids=(np.arange(num_rows) % (num_rows // 2)).astype(np.int32),
    row_valid=np.ones(num_rows, bool),
  )
  learner.validate(batch, NUM_TURNS)
  return batch


def init_params():
  """The tiny Qwen3 params (float32, on the default device), the same in every process.

  Jitted: one compilation instead of one per eager op (slow in a multi-process runtime)."""
  return _jitted_init()(jax.random.key(PARAMS_SEED))


@functools.lru_cache(maxsize=None)
def _jitted_init():
  return jax.jit(functools.partial(qwen.init_params, model_config()))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--process_id", type=int, required=True)
  parser.add_argument("--num_processes", type=int, required=True)
  parser.add_argument("--coordinator", required=True, help="host:port of process 0")
  parser.add_argument("--batch", required=True, help=".npz of the global NumPy batch")
  parser.add_argument("--out", required=True, help=".npz process 0 writes")
  args = parser.parse_args()
  start = time.time()

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
  assert jax.process_count() == args.num_processes, jax.process_count()
  assert jax.process_index() == args.process_id
  print(f"process {jax.process_index()}: initialized at {time.time() - start:.1f} s", flush=True)

  mesh = sharding_lib.make_mesh(data=args.num_processes, fsdp=jax.local_device_count(), tensor=1)

  # Params: every process computed the same values; each places the shards its devices hold.
  host_params = jax.tree.map(np.asarray, init_params())
  params = jax.tree.map(
    lambda x, s: jax.make_array_from_callback(x.shape, s, lambda index: x[index]),
    host_params,
    sharding_lib.param_shardings(host_params, mesh),
  )

  # The batch: this process's rows only (process p holds global rows [p * n, (p + 1) * n)).
  with np.load(args.batch) as data:
    global_batch = learner.Batch(**{name: data[name] for name in data.files})
  rows_per_process = global_batch.num_rows // jax.process_count()
  first = jax.process_index() * rows_per_process
  local_batch = jax.tree.map(lambda x: x[first : first + rows_per_process], global_batch)
  batch = learner.shard_batch(local_batch, mesh)
  assert batch.tokens.shape == global_batch.tokens.shape, batch.tokens.shape
  held = {
    index[0].start or 0
    for index in batch.tokens.sharding.addressable_devices_indices_map(batch.tokens.shape).values()
  }
  assert min(held) == first and max(held) < first + rows_per_process, (held, first)

  step = learner.make_update(learner.qwen_logprob_fn(model_config()), optimizer(), learner_config())
  state = learner.init_state(params, optimizer(), ref_params=params)
  before = jax.tree.leaves(learner.state_shardings(state))
  with jax.set_mesh(mesh):
    state, metrics = step(state, batch, jax.random.key(UPDATE_SEED))

  # The new state is on the input state's shardings, the params on the rules'.
  assert [x.sharding for x in jax.tree.leaves(state)] == before
  kernel = state.params["layers"]["mlp"]["gate_proj"]["kernel"]
  rule = sharding_lib.param_shardings(host_params, mesh)["layers"]["mlp"]["gate_proj"]["kernel"]
  assert kernel.sharding.is_equivalent_to(rule, kernel.ndim), kernel.sharding
  print(f"process {jax.process_index()}: update done at {time.time() - start:.1f} s", flush=True)
  new_params = multihost_utils.process_allgather(state.params, tiled=True)
  scalars = {
    name: np.asarray(value.addressable_data(0))
    for name, value in metrics.items()
    if value.ndim == 0
  }
  if jax.process_index() == 0:
    flat = {
      sharding_lib.path_name(path): np.asarray(leaf)
      for path, leaf in jax.tree_util.tree_leaves_with_path(new_params)
    }
    flat.update({f"metric/{name}": value for name, value in scalars.items()})
    np.savez(args.out, **flat)
  jax.distributed.shutdown()
  print(f"process {args.process_id}: done at {time.time() - start:.1f} s", flush=True)


if __name__ == "__main__":
  main()
