"""The update's jit: donation, and the output state pinned to the input state's shardings."""

from __future__ import annotations

import functools

import jax


def jit_keeping_state_shardings(step, donate_argnums):
  """jax.jit(step) whose output state keeps the input state's `NamedSharding`s.

  Left to XLA's sharding propagation, an output leaf may come back re-sharded
  (seen: on a data=2 x fsdp=4 mesh the replicated RMSNorm scales and their Adam
  moments came back sharded over "fsdp"), which moves params off their rules and
  recompiles the next call. So the state's output shardings are pinned to its
  input's (one jit per distinct sharding tree); leaves without a NamedSharding
  (single device, uncommitted) and the metrics are left to the compiler.
  """
  compiled = {}

  def sharding_of(x):
    concrete = isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
    if concrete or isinstance(x, jax.ShapeDtypeStruct):
      if isinstance(x.sharding, jax.sharding.NamedSharding):
        return x.sharding
    return None

  def jitted(state):
    leaves, treedef = jax.tree.flatten(state)
    shardings = tuple(sharding_of(x) for x in leaves)
    if (treedef, shardings) not in compiled:
      out_shardings = (jax.tree.unflatten(treedef, shardings), None)
      compiled[treedef, shardings] = jax.jit(
        step, donate_argnums=donate_argnums, out_shardings=out_shardings
      )
    return compiled[treedef, shardings]

  @functools.wraps(step)
  def run(state, batch, key):
    return jitted(state)(state, batch, key)

  def lower(state, batch, key):
    """The same program lowered ahead of time (`.compile()` it): the arguments may be
    `jax.ShapeDtypeStruct`s with their shardings, on any backend's devices (a TPU topology's
    on a CPU host), so nothing is allocated."""
    return jitted(state).lower(state, batch, key)

  run.lower = lower
  return run
