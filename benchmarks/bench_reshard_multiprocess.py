"""The sampler's params in a multi-process run: the per-iteration reshard, timed on CPU.

Each iteration `DecodeLayout(model_config, mesh)(state.params)` turns the learner's FSDP shards
(all processes' devices) into the sampler's copy: compute dtype, tensor-parallel within each
process, replicated across processes, then handed to each process as arrays on its own decode
mesh (`distributed.local_view`, no copy). This script times that call for 2 processes x 2
simulated CPU devices (JAX's multi-process runtime, gloo over loopback) and, as the baseline,
for 1 process x 4 devices, on the same learner mesh (data=1, fsdp=4) and decode
tensor-parallel size 2; and, with samplers on devices of their own (`pipeline.rollout_devices`),
for 2 processes x 4 devices, the learner on the first 2 of each (the same 4-device learner mesh)
and each process's sampler on its last 2: the reshard onto the learner's devices (the hop), then
each process's copy onto its own sampler devices (`DecodeLayout(devices=)`):

  .venv/bin/python benchmarks/bench_reshard_multiprocess.py                  # qwen3-tiny, qwen3-bench
  .venv/bin/python benchmarks/bench_reshard_multiprocess.py --presets qwen3-bench --repeats 20

It reports per preset: the params, the bytes of one decode copy (compute dtype), the bytes each
process must receive from the others ((P - 1) / P of the copy: its devices hold 1 / P of the
learner's shards), the link bytes per device of the collectives XLA compiled for the reshard
(`hlo_collectives`), and the median reshard time (ms) of each run. The JSON report goes to
stdout, a table to stderr. The estimates for Qwen3-14B on a v5p-32 and on 2 x 8 H100 are in
docs/training.md ("Many processes").
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def worker(args) -> None:
  """One process: build the learner params, time `repeats` reshards, print JSON (process 0)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  sys.path.insert(0, _ROOT)
  from seeupo_jax.sampling import layout as decode_layout  # pylint: disable=g-import-not-at-top
  from seeupo_jax import distributed
  from seeupo_jax.devtools import hlo_collectives
  from seeupo_jax import learner
  from seeupo_jax import sharding
  from seeupo_jax.models import config as config_lib
  from seeupo_jax.models import qwen

  if args.num_processes > 1:
    distributed.initialize(
      coordinator_address=args.coordinator,
      num_processes=args.num_processes,
      process_id=args.process_id,
    )
  own = None
  learner_devices = jax.devices()
  if args.own:  # each process's last `own` devices are its sampler's (`program.split_devices`)
    learner_devices, apart = distributed.split_last_of_each(jax.devices(), args.own)
    own = apart[jax.process_index()]
  mesh = sharding.make_mesh(data=1, fsdp=-1, tensor=1, devices=learner_devices)
  report = {}
  for preset in args.presets.split(","):
    config = config_lib.get_preset(preset, dtype=args.dtype)
    params = learner.shard_params(qwen.init_params(config, jax.random.key(0)), mesh)
    layout = decode_layout.DecodeLayout(config, mesh, tensor=args.tensor, devices=own)
    bump = jax.jit(lambda p: jax.tree.map(lambda x: x * 1.0, p))  # new arrays: a real reshard
    times = []
    for i in range(args.repeats + 1):  # the first call compiles and allocates
      params = jax.block_until_ready(bump(params))
      t0 = time.perf_counter()
      out = jax.block_until_ready(layout(params))
      if i:
        times.append(time.perf_counter() - t0)
    # The collectives XLA compiled for the (donating) reshard: bytes over links per device.
    if own is None:
      hlo = layout.reshard_into.lower(params, layout._params).compile().as_text()
    else:  # the hop's (it allocates each time: its copy is deleted once the sampler has its)
      hlo = layout._hop.reshard.lower(params).compile().as_text()
    moved = hlo_collectives.summarize(hlo_collectives.collectives(hlo))["total"]
    local = sum(x.nbytes for x in jax.tree.leaves(out))  # this process's copy (all its devices)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    copy = n_params * np.dtype(config.dtype).itemsize
    p = jax.process_count()
    report[preset] = {
      "params": n_params,
      "decode_copy_bytes": copy,
      "process_copy_bytes": local,
      "received_per_process_bytes": copy * (p - 1) // p,
      "hlo_link_bytes_per_device": moved["link_bytes"],
      "hlo_collective_ops": moved["ops"],
      "reshard_ms_median": 1e3 * statistics.median(times),
      "reshard_ms_min": 1e3 * min(times),
      "processes": p,
      "devices_per_process": jax.local_device_count(),
      "decode_mesh": dict(layout.mesh.shape),
      "sampler_devices_of_their_own": len(own or ()),
    }
  if jax.process_index() == 0:
    print(json.dumps(report))
  if args.num_processes > 1:
    jax.distributed.shutdown()


def _launch(num_processes: int, devices: int, args, own: int = 0) -> dict:
  env = dict(
    os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}"
  )
  common = [
    sys.executable,
    __file__,
    "--worker",
    f"--num_processes={num_processes}",
    f"--coordinator=127.0.0.1:{_free_port()}",
    f"--presets={args.presets}",
    f"--repeats={args.repeats}",
    f"--tensor={args.tensor}",
    f"--dtype={args.dtype}",
    f"--own={own}",
  ]
  procs = [
    subprocess.Popen(
      common + [f"--process_id={i}"],
      env=env,
      cwd=_ROOT,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(num_processes)
  ]
  outs = [p.communicate(timeout=1800)[0] for p in procs]
  for p, out in zip(procs, outs):
    if p.returncode:
      raise RuntimeError(f"a worker exited with {p.returncode}: {out[-2000:]}")
  return json.loads(outs[0].strip().splitlines()[-1])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--presets", default="qwen3-tiny,qwen3-bench")
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--tensor", type=int, default=2)
  parser.add_argument("--dtype", default="bfloat16", help="the compute dtype of the copy")
  parser.add_argument("--own", type=int, default=0, help="(worker) sampler devices per process")
  parser.add_argument("--worker", action="store_true")
  parser.add_argument("--num_processes", type=int, default=1)
  parser.add_argument("--process_id", type=int, default=0)
  parser.add_argument("--coordinator", default="")
  args = parser.parse_args()
  if args.worker:
    worker(args)
    return
  report = {
    "2x2": _launch(2, 2, args),
    "1x4": _launch(1, 4, args),
    "2x(2+2)": _launch(2, 4, args, own=args.tensor),
  }
  print(json.dumps(report, indent=1))
  print(
    "preset       | params | copy MB | received/process MB | link MB/device 2x2 (1x4) | "
    "2x2 ms | 1x4 ms | 2x(2+2) own ms",
    file=sys.stderr,
  )
  for preset, two in report["2x2"].items():
    one, own = report["1x4"][preset], report["2x(2+2)"][preset]
    print(
      f"{preset:12} | {two['params'] / 1e6:6.2f}M | {two['decode_copy_bytes'] / 1e6:7.2f} | "
      f"{two['received_per_process_bytes'] / 1e6:19.2f} | "
      f"{two['hlo_link_bytes_per_device'] / 1e6:10.2f} ({one['hlo_link_bytes_per_device'] / 1e6:.2f})"
      f"{'':13} | {two['reshard_ms_median']:6.1f} | {one['reshard_ms_median']:6.1f} | "
      f"{own['reshard_ms_median']:14.1f}",
      file=sys.stderr,
    )


if __name__ == "__main__":
  main()
