"""Many processes, one program: who plays which tasks, who writes, and the small exchanges.

A multi-process run (a TPU pod slice, nodes of a GPU cluster, or several processes on one
machine) runs the same program in every process after `initialize`:

    distributed.initialize(mode="auto")          # jax.distributed.initialize when multi-process
    processes = distributed.Processes.current()   # index, count, local index on this host
    groups = processes.block(B)                   # this process's contiguous share of B groups
    everyone = processes.allgather(small_object)  # [object of process 0, 1, ...]

`jax.process_index()` decides only which tasks a process plays and who writes files
(`Processes.is_main`); arrays that span processes are never fetched to one host. `allgather`
moves small host objects (metrics, the groups DAPO keeps, log lines) between processes with one
device all-gather of their pickled bytes; a single-process `Processes` answers without JAX.

`local_view` gives a process its own devices' part of a global array as an array on a
process-local mesh, without a copy (the sampler's params: `sampling.layout.DecodeLayout`).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import socket
from typing import Any, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

MODES = ("auto", "yes", "no")


class DistributedError(RuntimeError):
  """A multi-process run that cannot start (bad flags, or a layout that cannot work)."""


def _cluster_processes() -> Optional[int]:
  """The process count a cluster manager announces in the environment, or None.

  SLURM inside `srun` (SLURM_NTASKS, with SLURM_STEP_NODELIST), a TPU pod slice
  (TPU_WORKER_HOSTNAMES: one host name per worker) and Open MPI (OMPI_COMM_WORLD_SIZE).
  """
  env = os.environ
  if "SLURM_STEP_NODELIST" in env and "SLURM_NTASKS" in env and "SLURM_PROCID" in env:
    return int(env["SLURM_NTASKS"])
  hosts = env.get("TPU_WORKER_HOSTNAMES", "")
  if hosts:
    return len([h for h in hosts.split(",") if h.strip()])
  if "OMPI_COMM_WORLD_SIZE" in env:
    return int(env["OMPI_COMM_WORLD_SIZE"])
  return None


def initialize(
  mode: str = "auto",
  *,
  coordinator_address: Optional[str] = None,
  num_processes: Optional[int] = None,
  process_id: Optional[int] = None,
  initialization_timeout_s: int = 300,
) -> bool:
  """Starts JAX's multi-process runtime when the run is multi-process; returns whether it did.

  Call it before anything touches a device.

  Args:
    mode: "auto": initialize when `num_processes` > 1 is given, or a cluster manager announces
      more than one process (SLURM's srun, a TPU pod slice's TPU_WORKER_HOSTNAMES, Open MPI);
      "yes": always (`jax.distributed.initialize` finds the cluster itself, e.g. on a Cloud
      TPU VM pod slice whose environment names no workers); "no": never (one process).
    coordinator_address, num_processes, process_id: explicit settings (host:port of process
      0, the number of processes, this one's index); None: JAX detects them from the cluster.
    initialization_timeout_s: how long to wait for every process to join.

  Raises:
    DistributedError: a bad mode, or an explicit setting without the others.
  """
  if mode not in MODES:
    raise DistributedError(f"--distributed={mode!r}; allowed: {list(MODES)}")
  explicit = (coordinator_address, num_processes, process_id)
  if any(x is not None for x in explicit) and not all(x is not None for x in explicit):
    raise DistributedError(
      "--coordinator_address, --num_processes and --process_id go together (got "
      f"{coordinator_address!r}, {num_processes!r}, {process_id!r})"
    )
  if mode == "no":
    return False
  if num_processes is not None:
    if not 0 <= process_id < num_processes:
      raise DistributedError(f"--process_id={process_id} must be in [0, {num_processes})")
    if num_processes == 1 and mode == "auto":
      return False
  elif mode == "auto" and (_cluster_processes() or 1) <= 1:
    return False
  # CPU devices of different processes talk over gloo (XLA's default CPU collectives are
  # in-process only); accelerators keep their own (NCCL, ICI).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=coordinator_address,
    num_processes=num_processes,
    process_id=process_id,
    initialization_timeout=initialization_timeout_s,
  )
  return True


def _bucket(n: int) -> int:
  """The smallest power of two >= max(n, 1024): all-gathers of a few shapes, a few compiles."""
  size = 1024
  while size < n:
    size *= 2
  return size


@dataclasses.dataclass(frozen=True)
class Processes:
  """The processes of the run, as this process sees them.

  index: this process (`jax.process_index()`); count: the processes (`jax.process_count()`);
  local_index: its rank among the processes on the same host (0 with one process per host:
  per-host environment servers take ports by it).
  """

  index: int = 0
  count: int = 1
  local_index: int = 0

  def __post_init__(self):
    if not 0 <= self.index < self.count or not 0 <= self.local_index <= self.index:
      raise ValueError(f"bad Processes {self}")

  @classmethod
  def current(cls) -> "Processes":
    """The processes of JAX's runtime (one process unless `initialize` started several)."""
    if jax.process_count() == 1:
      return cls()
    index, count = jax.process_index(), jax.process_count()
    hosts = cls(index, count).allgather(socket.gethostname())
    return cls(index, count, sum(1 for h in hosts[:index] if h == hosts[index]))

  @property
  def is_main(self) -> bool:
    """Process 0: the one that writes the logs, curves and exports."""
    return self.index == 0

  def block(self, n: int) -> range:
    """This process's share of n items: a contiguous block, in process order.

    Blocks differ by at most one item (the first n % count processes take one more), so the
    concatenation of the blocks of processes 0, 1, ... is range(n).
    """
    q, r = divmod(n, self.count)
    start = self.index * q + min(self.index, r)
    return range(start, start + q + (self.index < r))

  def allgather(self, obj: Any) -> list:
    """[obj of process 0, obj of process 1, ...]: every process gets every process's object.

    A collective: every process must call it, in the same order. `obj` is pickled; keep it
    small (metrics, a few records). One process: [obj], without JAX.
    """
    if self.count == 1:
      return [obj]
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([data.size], np.int32)))
    padded = np.zeros((_bucket(int(sizes.max())),), np.uint8)
    padded[: data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded))
    return [pickle.loads(rows[p, : int(sizes[p, 0])].tobytes()) for p in range(self.count)]

  def concat(self, items: Sequence[Any]) -> list:
    """The concatenation, in process order, of every process's list `items`."""
    return [x for part in self.allgather(list(items)) for x in part]


def split_last_of_each(devices: Sequence[jax.Device], last: int) -> tuple[list, dict[int, list]]:
  """Each process's last `last` devices set apart from the others.

  Args:
    devices: every process's devices, in their order (`jax.devices()`).
    last: how many of each process's devices to set apart (fewer than each process has).

  Returns:
    (the other devices, every process's, in `devices`' order; {process index: its last `last`
    devices, in order}).
  """
  by_process: dict[int, list] = {}
  for d in devices:
    by_process.setdefault(d.process_index, []).append(d)
  apart = {p: own[len(own) - last :] for p, own in by_process.items()}
  taken = {d.id for own in apart.values() for d in own}
  return [d for d in devices if d.id not in taken], apart


def process_mesh(mesh: Mesh, process_index: Optional[int] = None) -> Mesh:
  """The sub-mesh of `mesh` that holds one process's devices (default: this process's).

  The process's devices must fill whole slices of the first axis of `mesh` (one
  contiguous block of it: a mesh built over `jax.devices()` in their order, with the
  first axis a multiple of the processes, has this layout).

  Raises:
    DistributedError: the process's devices are not such a block.
  """
  process_index = jax.process_index() if process_index is None else process_index
  devices = np.asarray(mesh.devices)
  mine = np.vectorize(lambda d: d.process_index == process_index)(devices)
  rows = np.flatnonzero(mine.reshape(devices.shape[0], -1).any(axis=1))
  block = devices[rows[0] : rows[-1] + 1] if rows.size else devices[:0]
  if not rows.size or not mine[rows[0] : rows[-1] + 1].all() or mine.sum() != block.size:
    raise DistributedError(
      f"process {process_index}'s devices are not a block of whole slices of the mesh's first "
      f"axis {mesh.axis_names[0]!r} (shape {dict(mesh.shape)}); every process needs its own "
      "slices of it"
    )
  return Mesh(block, mesh.axis_names, axis_types=mesh.axis_types)


def local_view(x: jax.Array, local_mesh: Mesh) -> jax.Array:
  """This process's devices' part of `x`, as an array on `local_mesh` (no copy).

  `x` has a `NamedSharding` whose spec leaves the mesh's first axis unused (each process's
  devices hold the whole array, e.g. replicated over "data"); `local_mesh` is this process's
  sub-mesh (`process_mesh`). The result shares `x`'s buffers (deleting or donating `x` ends it).
  """
  sharding = x.sharding
  if not isinstance(sharding, NamedSharding):
    raise TypeError(f"local_view needs a NamedSharding, got {sharding}")
  target = NamedSharding(local_mesh, sharding.spec, memory_kind=sharding.memory_kind)
  if sharding.mesh.devices.size == local_mesh.devices.size:
    return x
  shards = {s.device: s for s in x.addressable_shards}
  wanted = target.addressable_devices_indices_map(x.shape)
  arrays = []
  for device, index in wanted.items():
    shard = shards.get(device)
    if shard is None or shard.index != index:
      raise DistributedError(
        f"local_view: {sharding} does not give device {device} the part {index} that "
        f"{target} asks (the spec must leave the first mesh axis unused)"
      )
    arrays.append(shard.data)
  return jax.make_array_from_single_device_arrays(x.shape, target, arrays)


def fetch(tree: Any) -> Any:
  """Every leaf of `tree` (global arrays) as a NumPy array, in every process, one leaf at a time.

  A collective (every process calls it). Each leaf is gathered whole onto each device and then
  to the host before the next one starts, so the transient device memory is one leaf's; the
  result holds the whole tree in host memory (e.g. for the HF export, which process 0 writes).
  """
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), tree)
