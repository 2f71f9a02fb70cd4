"""The environment of the processes a test session runs: its own (the xdist workers), and those
its tests start (`experiments/run.py`, the benchmark scripts, worker processes).

Every one of them compiles with `COMPILE_FLAGS`: XLA's CPU backend at LLVM optimization level 1
instead of its default 2. The HLO passes (fusion, layout, sharding) are the same, so the programs
compute the same things; the machine code is optimised less, which is what the tests' tiny shapes
need. Measured on this repository's 2-core CPU (2026-12-03), one core each, no compilation
cache: `pytest tests/learner/test_learner.py` took 431 s at level 2, 322 s at level 1 and 270 s
at level 0; the learning test's run.py config (2 dials, 8 x 8, 40 iterations) compiled its first
iteration in 48.7 s at level 2 and 35.8 s at level 1, and ran the next ones in 0.28 s and 0.23 s
(level 0: 28.1 s, then 0.92 s each, which is why it is not level 0). Benchmarks run outside the
tests keep XLA's default.

The test processes themselves (the xdist workers, and what inherits their environment: the
notebooks' kernels) compile at level 0 instead (`SESSION_FLAGS`): their programs are many,
tiny and run a few times each, and their long loops are the bandits' scans, which level 0 still
runs faster than level 1 compiles them. Measured on the same CPU (2026-12-07), one core, no
compilation cache: `pytest tests/learner/test_learner_tis.py tests/theory/test_theory_algorithms.py
tests/rollout/test_rollout.py` (126 tests) took 387 s at level 1 and 313 s at level 0. No test
compares a number from its own process with one from a process it starts bit for bit.
"""

import os
from typing import Optional

COMPILE_FLAGS = "--xla_backend_optimization_level=1"
SESSION_FLAGS = "--xla_backend_optimization_level=0"


def session_xla_flags(devices: int) -> str:
  """XLA_FLAGS of the test processes themselves (`SESSION_FLAGS`, `devices` simulated devices)."""
  return f"{SESSION_FLAGS} --xla_force_host_platform_device_count={devices}"


def xla_flags(devices: Optional[int] = None) -> str:
  """XLA_FLAGS for a test process: `COMPILE_FLAGS`, and `devices` simulated CPU devices if set."""
  if devices is None:
    return COMPILE_FLAGS
  return f"{COMPILE_FLAGS} --xla_force_host_platform_device_count={devices}"


def env(devices: Optional[int] = None, *, cpu: bool = True, **extra: str) -> dict[str, str]:
  """The environment of a process a test starts: this one's, with `xla_flags(devices)` (one CPU
  device unless `devices` says otherwise), JAX_PLATFORMS=cpu (left out with `cpu=False`), and
  `extra` on top."""
  out = dict(os.environ, XLA_FLAGS=xla_flags(devices))
  if cpu:
    out["JAX_PLATFORMS"] = "cpu"
  else:
    out.pop("JAX_PLATFORMS", None)
  out.update(extra)
  return out
