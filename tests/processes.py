"""The environment of the processes a test session runs: its own (the xdist workers), and those
its tests start (`experiments/run.py`, the benchmark scripts, worker processes).

They compile with XLA's CPU backend at LLVM optimization level 0 instead of its default 2
(`xla_flags`). The HLO passes (fusion, layout, sharding) are the same, so the programs compute
the same things up to the rounding of the machine code; the machine code is optimised less,
which is what the tests' tiny shapes need: their programs are many and run a few times each.
Every process of a session compiles alike, so a number a test recomputes in its own process
(a run's initialisation, an export) is the bits its `run.py` wrote. A process that runs many
iterations asks for level 1 (`env(level=1)`: the learning test's 250 iterations, and the TPU
programs compiled ahead of time, which keep the level they were checked at).

Measured on this repository's 2-core CPU, one core each, no compilation cache: `pytest
tests/learner/test_learner.py` took 431 s at level 2, 322 s at level 1 and 270 s at level 0
(2026-12-03); `pytest tests/learner/test_learner_tis.py tests/theory/test_theory_algorithms.py
tests/rollout/test_rollout.py` (126 tests) 387 s at level 1 and 313 s at level 0 (2026-12-07);
the learning test's run.py config (2 dials, 8 x 8) compiled its first iteration in 48.7 s at level
2, 35.8 s at level 1 and 28.1 s at level 0, and ran the next ones in 0.28 s, 0.23 s and 0.92 s
(2026-12-03). Benchmarks run outside the tests keep XLA's default.
"""

import os
from typing import Optional


def xla_flags(devices: Optional[int] = None, level: int = 0) -> str:
  """XLA_FLAGS for a test process: the CPU backend at optimization `level`, and `devices`
  simulated CPU devices if set."""
  flags = f"--xla_backend_optimization_level={level}"
  if devices is None:
    return flags
  return f"{flags} --xla_force_host_platform_device_count={devices}"


def env(
  devices: Optional[int] = None, *, cpu: bool = True, level: int = 0, **extra: str
) -> dict[str, str]:
  """The environment of a process a test starts: this one's, with `xla_flags(devices, level)`
  (one CPU device unless `devices` says otherwise), JAX_PLATFORMS=cpu (left out with
  `cpu=False`), and `extra` on top."""
  out = dict(os.environ, XLA_FLAGS=xla_flags(devices, level))
  if cpu:
    out["JAX_PLATFORMS"] = "cpu"
  else:
    out.pop("JAX_PLATFORMS", None)
  out.update(extra)
  return out
