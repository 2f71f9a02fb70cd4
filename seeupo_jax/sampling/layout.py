"""The decode layout: the sampler's copy of the learner's params, tensor-parallel in compute dtype.

The learner keeps its params FSDP-sharded (`sharding.make_mesh(fsdp=-1)` by default) and, with
`master_weights`, in float32. Decoding with them as they are makes every generated token
all-gather every layer's weights inside the sampler's layer scan: the whole model crosses the
interconnect per decode step. A `DecodeLayout` instead gives the sampler, once per set of
params, a copy on a mesh of the same devices laid out for decoding:

    mesh        learner: ("data", "fsdp", "tensor") = (d, f, t)
    decode mesh          ("data", "fsdp", "tensor") = (d', 1, n / d'), by default d' = d
    params      Megatron tensor parallelism over "tensor" (`sharding.PARAM_RULES` with fsdp = 1:
                q/k/v/gate/up split on their output features, o/down on their input features,
                embedding and lm_head on the vocabulary), replicated over "data"; the attention
                weights stay replicated when "tensor" does not divide the kv heads
    dtype       the model's compute dtype (`ModelConfig.dtype`)
    KV cache    rows over "data", kv heads over "tensor" (`sharding.cache_shardings` on the
                decode mesh; heads replicated when they do not divide)

Each decode step then moves only activations between devices (two all-reduces of [B, D] per
layer, the embedding lookup's and the logits'), and each device reads 1 / tensor of the weights.

    layout = DecodeLayout(model_config, mesh)                      # builds the jitted reshard
    session = sampling.SamplerSession(layout.model_config, sampling_config, session_config,
                                      cache_sharding=layout.cache_sharding)
    with jax.set_mesh(layout.mesh):                                # the model's activation specs
      session.prefill(layout(state.params)); replies = session.decode(layout(state.params))

Many processes (`seeupo_jax.distributed`): each process samples on its own devices, so its
tensor-parallel groups lie inside it. The reshard runs SPMD over the decode mesh of all the
processes' devices (`reshard_mesh`, "data" = processes x data slices within one), where the copy
is replicated over "data": every process's devices receive the whole model (1 / tensor of it
each), over the interconnect, once per set of params; then `layout(params)` hands this process
the copy's shards as arrays on its own decode mesh (`mesh`, `distributed.process_mesh`), without
a copy. The sampler then never touches another process's devices. One process: the two meshes
are one.

Devices of its own (`devices=`): the decode mesh is made of other devices than the learner's
(`pipeline.rollout_devices`), so the sampler and the update run at the same time. One process:
the copy is cast to the compute dtype on the learner's devices (in the learner's layout) and then
`jax.device_put` into the decode layout on the sampler's devices. Many processes (each process's
sampler devices its own, the learner's mesh spanning every process's others): `device_put` cannot
move a global array between device sets of several processes, so the copy goes through a hop,
the decode layout of the learner's devices above (a collective of the processes' learner
devices: each process's learner devices then hold the whole model in the compute dtype, 1 / their
number each, once per set of params), whose local part this process `device_put`s onto its own
sampler devices, device to device within the host; the hop is deleted once the copy has landed.
Either way the previous copy is deleted first, so the sampler's devices hold one copy.

A copy begun ahead of its use (`layout.stage(params)`, then `layout.install(staged)`): with many
processes `stage` dispatches the part that is their collective (a reshard into new buffers, or
the hop), without waiting, at the same point on every process, and `install` does this
process's part alone, whenever it reaches it: partial rollouts swap each process's sampler to
the update's params at its own point (`training/loop.py`).

`layout(params)` runs one jitted function with fixed `out_shardings`. From the second call on it
donates the previous call's output, so XLA writes the new copy into the old copy's buffers (the
compiled reshard aliases every output to a donated input: no second copy is ever allocated);
the previous output is deleted then. Called again with the very same params (the same array
objects, e.g. evaluation after an update and the next iteration's rollout) it returns the copy
it made, without a reshard. The learner's params are never modified.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import weakref
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from seeupo_jax import distributed
from seeupo_jax import sharding
from seeupo_jax.models import qwen
from seeupo_jax.models.config import ModelConfig

Params = Any


@dataclasses.dataclass
class Staged:
  """A decode copy begun ahead of its use (`DecodeLayout.stage`), finished by
  `DecodeLayout.install`.

  Attributes:
    source: the learner's params it is a copy of.
    copy: the copy so far: `source` itself (one process: nothing begun), the reshard's output
      on `reshard_mesh` (many processes sampling on the learner's devices), or this process's
      part of the hop on the learner's devices (many processes, samplers on devices of their
      own).
  """

  source: Params
  copy: Params

  def ready(self) -> bool:
    """Whether what `copy` waits for (the update that makes `source`, the collective part) is
    done: `install` then only does this process's part."""
    return all(x.is_ready() for x in jax.tree.leaves(self.copy))


# Parameters split over attention heads: replicated when "tensor" does not divide the kv heads.
_ATTENTION = re.compile(r"attn/(q_proj|k_proj|v_proj|o_proj)/")


def decode_mesh(mesh: Mesh, tensor: Optional[int] = None) -> Mesh:
  """The sampler's ("data", "fsdp", "tensor") mesh over the devices of `mesh`, with fsdp = 1.

  Args:
    mesh: the learner's mesh (`sharding.make_mesh`).
    tensor: the tensor-parallel size; None = every device of one `mesh` data slice
      (fsdp x tensor of `mesh`), so data keeps its size, but at most one process's devices
      of `mesh` (their greatest common divisor: a tensor-parallel group never spans
      processes). Must divide the number of devices; data becomes devices / tensor.

  Returns:
    A `Mesh` of the same devices in the same order, shape (devices / tensor, 1, tensor).
  """
  devices = np.asarray(mesh.devices)
  n = devices.size
  if tensor is None:
    tensor = n // mesh.shape["data"]
    if jax.process_count() > 1:
      mine = sum(d.process_index == jax.process_index() for d in devices.flat)
      tensor = math.gcd(tensor, mine)
  if not isinstance(tensor, int) or tensor < 1 or n % tensor:
    raise ValueError(f"decode tensor size must be a positive divisor of {n} devices, got {tensor}")
  return sharding.make_mesh(data=n // tensor, fsdp=1, tensor=tensor, devices=list(devices.flat))


def param_shardings(params: Params, mesh: Mesh, model_config: ModelConfig) -> Params:
  """NamedSharding per leaf of `params` in the decode layout on the decode `mesh`.

  `sharding.param_shardings` on a mesh with fsdp = 1 (tensor parallelism, replicated over
  "data"), except that the attention projections are replicated when mesh "tensor" does not
  divide `model_config.num_kv_heads` (splitting inside a head would need collectives in the
  grouped q/k/v matmul).
  """
  if mesh.shape["fsdp"] != 1:
    raise ValueError(f"the decode mesh has fsdp = 1, got {dict(mesh.shape)}")
  heads_split = model_config.num_kv_heads % mesh.shape["tensor"] == 0

  def one(path, leaf):
    name = sharding.path_name(path)
    if not heads_split and _ATTENTION.search(name):
      return NamedSharding(mesh, P())
    return NamedSharding(
      mesh, sharding.fit_spec(_without_fsdp(sharding.param_spec(name)), leaf.shape, mesh)
    )

  return jax.tree_util.tree_map_with_path(one, params)


def _without_fsdp(spec: P) -> P:
  """`spec` with the "fsdp" axis left out (size 1 on the decode mesh; the specs read cleaner)."""

  def drop(axis):
    if isinstance(axis, tuple):
      kept = tuple(a for a in axis if a != "fsdp")
      return kept[0] if len(kept) == 1 else (kept or None)
    return None if axis == "fsdp" else axis

  return P(*(drop(axis) for axis in spec))


def _split_over_data(spec: P, shape, mesh: Mesh) -> P:
  """`spec` with its "tensor" entry split further over "data": ("tensor", "data").

  The decode layout replicates over "data"; resharding the learner's FSDP shards straight into
  it made XLA's SPMD partitioner give up ("involuntary full rematerialization": it gathered
  every whole tensor on every device). Going through this layout first, every device of a
  data x tensor group holds a distinct shard (an all-to-all from the FSDP shards), and the
  decode layout is one all-gather over "data" away.
  """
  if mesh.shape["data"] == 1:
    return spec
  entries = [("tensor", "data") if axis == "tensor" else axis for axis in spec]
  return sharding.fit_spec(P(*entries), shape, mesh)


def _cast_to(x, dtype):
  """The dtype a params leaf has in the decode copy: `dtype` for floats; a quantized kernel's
  integer codes (`models/quant.py`) keep theirs."""
  return jnp.dtype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype


def _move(x: jax.Array, source, hop, target, *, dtype) -> jax.Array:
  """One array: cast where it lies (`source`), then through `hop` to `target`.

  Pinning the cast to the input's layout makes XLA convert each shard before it moves it, so
  the collectives carry the compute dtype (without the pin the all-to-alls carried float32).
  """
  x = jax.lax.with_sharding_constraint(x.astype(_cast_to(x, dtype)), source)
  x = jax.lax.with_sharding_constraint(x, hop)
  return jax.lax.with_sharding_constraint(x, target)


def _move_in_order(xs, sources, hops, targets, *, dtype, after=None) -> list[jax.Array]:
  """`_move` of each array of the lists, each one after the previous one's result.

  XLA:CPU runs independent collectives concurrently on a shared thread pool; on 8 simulated
  devices, all-to-alls of independent leaves taken in different orders by different devices
  deadlocked (a rendezvous timeout: "only 5 of 8 threads arrived"). Chaining the moves through
  `optimization_barrier` gives every device one order. (They are bandwidth-bound: on a GPU
  they would queue on one stream anyway.)

  Args:
    xs, sources, hops, targets: lists of arrays and their three shardings.
    dtype: the compute dtype.
    after: an array (or pytree) the first move waits for, or None.
  """
  out = []
  for x, s, h, t in zip(xs, sources, hops, targets):
    if after is not None:
      x, _ = jax.lax.optimization_barrier((x, after))
    after = _move(x, s, h, t, dtype=dtype)
    out.append(after)
  return out


def _reshard(
  params: Params, previous: Optional[Params], *, dtype, plan, unroll: bool = False
) -> Params:
  """The decode copy of `params`, written into `previous`'s buffers when given.

  The stacked layer params move one layer at a time (a `fori_loop` of dynamic slices and
  in-place updates of the output), so the reshard's transient buffers hold one layer, not the
  whole model; then the embedding, final norm and lm_head move whole. One array moves at a
  time (`_move_in_order`).

  Args:
    params: the learner's params (learner layout, any float dtype).
    previous: the previous decode copy (donated by the caller) or None (allocate).
    dtype: the compute dtype.
    plan: (source, hop, target) shardings, three params-shaped trees.
    unroll: the layer loop unrolled (a Python loop): every collective in the program's entry
      computation (see `DecodeLayout`'s `unroll`).
  """
  specs = plan
  if jax.tree.structure(params) != jax.tree.structure(specs[2]):
    raise ValueError(
      "params must have the tree of qwen.init_params(model_config): got "
      f"{jax.tree.structure(params)}, expected {jax.tree.structure(specs[2])}"
    )
  layers, layers_def = jax.tree.flatten(params["layers"])
  layer_specs = [jax.tree.leaves(tree["layers"]) for tree in specs]
  if previous is None:
    buffers = [
      jax.lax.with_sharding_constraint(jnp.zeros(x.shape, _cast_to(x, dtype)), t)
      for x, t in zip(layers, layer_specs[2])
    ]
  else:
    buffers = jax.tree.leaves(previous["layers"])

  def reshard_layer(i, buffers):
    """Moves layer i of every stacked leaf into its slot of the output."""
    slices = [jax.lax.dynamic_slice_in_dim(x, i, 1, axis=0) for x in layers]
    moved = _move_in_order(slices, *layer_specs, dtype=dtype)
    return [
      jax.lax.dynamic_update_slice_in_dim(buffer, layer, i, axis=0)
      for buffer, layer in zip(buffers, moved)
    ]

  num_layers = layers[0].shape[0]
  if unroll:
    for i in range(num_layers):
      buffers = reshard_layer(i, buffers)
  else:
    buffers = jax.lax.fori_loop(0, num_layers, reshard_layer, buffers)
  rest = {k: v for k, v in params.items() if k != "layers"}
  rest_leaves, rest_def = jax.tree.flatten(rest)
  rest_specs = [jax.tree.leaves({k: tree[k] for k in rest}) for tree in specs]
  moved = _move_in_order(rest_leaves, *rest_specs, dtype=dtype, after=buffers)
  out = jax.tree.unflatten(rest_def, moved)
  out["layers"] = jax.tree.unflatten(layers_def, buffers)
  return out


class DecodeLayout:
  """Builds, once, the reshard of the learner's params into the decode layout; then runs it.

  Args:
    model_config: the policy's `ModelConfig`; the copy is in `model_config.dtype`.
    mesh: the learner's mesh; the decode mesh has the same devices (`decode_mesh`) unless
      `devices` are given.
    tensor: the decode tensor-parallel size (None: fsdp x tensor of `mesh`; with `devices`,
      all of them).
    donate: write each new copy into the previous copy's buffers (True), or allocate a new one.
    unroll: move the layers in an unrolled loop instead of a `fori_loop` (a larger program).
      None: only with several processes on CPU, where XLA:CPU ran the collectives of the loop
      concurrently with the ones around it, in different orders on different devices, which
      gloo then matched wrongly ("collective mismatch", an abort). Accelerators issue a
      program's collectives in its order.
    devices: the sampler's own devices, none of them in `mesh`, all of them this process's:
      the decode mesh is made of them, and each copy is cast on the learner's devices and
      `device_put` there (with many processes through the hop of the module docstring).

  Attributes:
    mesh: the decode mesh of this process's devices: run the sampler under
      `jax.set_mesh(layout.mesh)`.
    separate: whether the decode mesh's devices are others than the learner's (`devices`).
    reshard_mesh: the decode mesh of every process's devices, where the reshard runs (`mesh`
      with one process).
    model_config: `model_config` with `param_dtype = dtype` (the copy's numerics; the sampler
      gives the same results with either config, the params are cast to dtype before use).
    shardings: the decode params' `NamedSharding`s on `reshard_mesh` (a params-shaped tree).

  Raises:
    ValueError: `tensor` does not divide the devices, or (many processes) a tensor-parallel
      group would span processes.
  """

  def __init__(
    self,
    model_config: ModelConfig,
    mesh: Mesh,
    *,
    tensor: Optional[int] = None,
    donate: bool = True,
    unroll: Optional[bool] = None,
    devices: Optional[Sequence[jax.Device]] = None,
  ):
    self._learner_mesh = mesh
    self.separate = devices is not None
    if self.separate:
      self._init_separate(model_config, mesh, tensor, list(devices))
      return
    self.reshard_mesh = decode_mesh(mesh, tensor)
    self.mesh = self.reshard_mesh
    if jax.process_count() > 1:
      try:
        self.mesh = distributed.process_mesh(self.reshard_mesh)
      except distributed.DistributedError as e:
        raise ValueError(
          f"the decode tensor-parallel size {self.reshard_mesh.shape['tensor']} must divide "
          f"the {jax.local_device_count()} devices of each process ({e})"
        ) from None
    self.model_config = model_config.replace(param_dtype=model_config.dtype)
    self.shardings = param_shardings(
      qwen.params_shape(self.model_config), self.reshard_mesh, self.model_config
    )
    # The learner's layout (`sharding.param_shardings` on `mesh`), where the cast happens.
    shapes = qwen.params_shape(model_config)
    source = sharding.param_shardings(shapes, mesh)
    hops = jax.tree.map(
      lambda x, s: NamedSharding(
        self.reshard_mesh, _split_over_data(s.spec, x.shape, self.reshard_mesh)
      ),
      shapes,
      self.shardings,
    )
    if unroll is None:
      unroll = jax.process_count() > 1 and self.mesh.devices.flat[0].platform == "cpu"
    self.unroll = unroll
    reshard = functools.partial(
      _reshard,
      dtype=jnp.dtype(model_config.dtype),
      plan=(source, hops, self.shardings),
      unroll=unroll,
    )
    self.reshard = jax.jit(functools.partial(reshard, previous=None), out_shardings=self.shardings)
    # keep_unused: jit would drop the donated leaves the function does not read (all but the
    # stacked layers'), and their donation with them.
    self.reshard_into = jax.jit(
      reshard, out_shardings=self.shardings, donate_argnums=1, keep_unused=True
    )
    self.donate = donate
    self._source: list[weakref.ref] = []
    self._params: Optional[Params] = None  # the copy on reshard_mesh (donated by the next)
    self._local: Optional[Params] = None  # its shards on this process's mesh

  def _init_separate(self, model_config, mesh, tensor, devices) -> None:
    """The decode layout on `devices`, none of them the learner's (see the module docstring)."""
    others = sorted(d.id for d in devices if d.process_index != jax.process_index())
    if others:
      raise ValueError(
        f"the sampler's devices must be this process's ({jax.process_index()}); "
        f"of another: {others}"
      )
    learner = {d.id for d in mesh.devices.flat}
    shared = sorted(d.id for d in devices if d.id in learner)
    if not devices or shared:
      raise ValueError(
        f"the sampler's devices must be others than the learner's; shared: {shared}"
        if shared
        else "the sampler's devices: none given"
      )
    tensor = len(devices) if tensor is None else tensor
    if not isinstance(tensor, int) or tensor < 1 or len(devices) % tensor:
      raise ValueError(
        f"decode tensor size must be a positive divisor of {len(devices)} devices, got {tensor}"
      )
    self.mesh = self.reshard_mesh = sharding.make_mesh(
      data=len(devices) // tensor, fsdp=1, tensor=tensor, devices=devices
    )
    self.model_config = model_config.replace(param_dtype=model_config.dtype)
    self.shardings = param_shardings(
      qwen.params_shape(self.model_config), self.mesh, self.model_config
    )
    dtype = jnp.dtype(model_config.dtype)
    source = sharding.param_shardings(qwen.params_shape(model_config), mesh)
    self._cast = jax.jit(
      lambda params: jax.tree.map(lambda x: x.astype(_cast_to(x, dtype)), params),
      out_shardings=source,
    )
    # Many processes: the hop, the decode layout of the learner's devices (module docstring).
    self._hop = None
    if jax.process_count() > 1:
      try:
        self._hop = DecodeLayout(model_config, mesh, donate=False)
      except ValueError as e:
        raise ValueError(f"the copy's hop on the learner's devices: {e}") from None
    self.unroll = False
    self.donate = False
    self._source: list[weakref.ref] = []
    self._params: Optional[Params] = None
    self._local: Optional[Params] = None

  def release(self) -> None:
    """Deletes the copy (the next call makes a new one)."""
    if self._params is not None:
      for x in jax.tree.leaves(self._params):
        x.delete()
    self._params = self._local = None
    self._source = []

  def cache_sharding(self, cache: qwen.KVCache) -> qwen.KVCache:
    """The KV cache's shardings on the decode mesh (for `sampling.SamplerSession`)."""
    return sharding.cache_shardings(cache, self.mesh)

  def _holds(self, leaves: list) -> bool:
    """Whether the copy in use is of exactly these learner params' leaves (the same arrays)."""
    return (
      self._params is not None
      and len(leaves) == len(self._source)
      and all(ref() is leaf for ref, leaf in zip(self._source, leaves))
    )

  def _keep(self, leaves: list, out: Params) -> Params:
    """Makes `out` (on `reshard_mesh`) the copy in use, of `leaves`; returns its part on `mesh`."""
    self._source = [weakref.ref(leaf) for leaf in leaves]
    self._params = out
    if self.mesh is self.reshard_mesh:
      self._local = out
    else:
      self._local = jax.tree.map(lambda x: distributed.local_view(x, self.mesh), out)
    return self._local

  def stage(self, params: Params) -> Staged:
    """Begins the copy of `params` for a later `install`; the copy in use stays as it is.

    With many processes every process calls it at the same point of its program (with its
    part of the same params), and the part that is their collective is dispatched now: the
    reshard into a new copy (not into the previous copy's buffers: the sampler may still be
    reading them), or with devices of its own the hop. `install` then does this process's part
    alone, at whatever point each process reaches it (partial rollouts: each swaps when it sees
    the copy ready). One process: nothing begins; `install` is `layout(params)`.
    """
    if jax.process_count() == 1:
      return Staged(params, params)
    if self.separate:
      return Staged(params, self._hop(params))
    with jax.set_mesh(self.reshard_mesh):
      return Staged(params, self.reshard(params))

  def install(self, staged: Staged) -> Params:
    """The staged copy on this process's decode mesh, made the copy in use: what
    `layout(staged.source)` returns from now on. This process's part only (no collective);
    blocks, with devices of its own, until the copy has landed on them. Installing the copy in
    use again returns it."""
    leaves = jax.tree.leaves(staged.source)
    if self._holds(leaves):
      return self._local
    if jax.process_count() == 1:
      return self(staged.source)
    if not self.separate:
      return self._keep(leaves, staged.copy)
    self.release()  # one copy on the sampler's devices
    out = jax.block_until_ready(jax.device_put(staged.copy, self.shardings))
    self._hop.release()
    return self._keep(leaves, out)

  def __call__(self, params: Params) -> Params:
    """The decode-layout copy of `params` (learner layout, any float dtype), on `mesh`.

    The copy returned by the previous call is deleted (its buffers hold the new copy) unless
    `params` are the same arrays as then, in which case that copy is returned again. With
    many processes, a collective: every process calls it with its part of the same params.
    """
    leaves = jax.tree.leaves(params)
    if self._holds(leaves):
      return self._local
    if self.separate:
      if self._hop is not None:
        return self.install(self.stage(params))
      self.release()  # one copy on the sampler's devices
      with jax.set_mesh(self._learner_mesh):
        cast = self._cast(params)
      return self._keep(leaves, jax.device_put(cast, self.shardings))
    with jax.set_mesh(self.reshard_mesh):  # over every process's devices
      if self.donate and self._params is not None:
        out = self.reshard_into(params, self._params)
      else:
        out = self.reshard(params)
    return self._keep(leaves, out)
