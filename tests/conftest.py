"""Test-wide setup: 8 simulated CPU devices, one compilation cache, hypothesis profiles, and the
fixtures many files share (`tok`, `chat`: the tiny tokenizer of `tests/tiny.py` and its
`ChatTokens`).

The test files sit in folders that mirror the package (`tests/sampling/`, `tests/rollout/`, ...);
the modules they share (`tiny.py`, the NumPy references, the fake servers and scripted
environments) sit here, at the top of `tests/`, which this file puts on `sys.path` first thing, so
every folder imports them by their plain names (and processes spawned from a test inherit it).

XLA_FLAGS must be set before jax is imported anywhere, so it is set here, at
the top of the first module pytest imports: 8 simulated devices, and the compile flags of
`tests/processes.py` (XLA's CPU backend at optimization level 0: less compilation, the same
programs), which every process the tests start gets too (`processes.env`).

The compilation cache: every process a test session starts (`experiments/run.py`, the
benchmark scripts, the notebooks' kernels) shares one persistent JAX compilation cache, a
temporary directory made by the session's first pytest process (the xdist controller; its
workers and their children inherit it) and removed when that process ends. A program that
several tests' subprocesses compile (the same config, shapes and devices) compiles once: most
of a short `run.py` is compilation on 2 cores (69 s cold, 25 s from the cache, 2026-12-02). The
test processes (the xdist workers) use it too: tests that build the same tiny programs afresh
(a new closure each, so jit's in-memory cache misses) compile them once (the learner's TIS and
mask tests: 103 s without it, 74.5 s with it, 2026-12-02). Only programs that took at least
`CACHE_MIN_COMPILE_SECS` to compile are cached (below). A test that times compilation or
reads a compiled executable's HLO is marked `fresh_compiles`: it runs with the cache off. A
size limit turns on JAX's file lock around every read and write of the cache (and evicts the
least recently used entries beyond it). A process a test kills with SIGKILL must not write to
it (a torn entry): such tests turn it off for it (`JAX_ENABLE_COMPILATION_CACHE=false`) or hand
it a cache of its own that an earlier run of the same programs filled, in the same directory (the
keys of JAX's entries depend on the cache's path: a copy elsewhere is never read), with every
program cached (`JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0`: a program's compile time varies,
and one cached by neither run would be written by the killed one).

The notebooks, in a run that also collects tests/ (`pytest --nbmake tests notebooks`), run with
SEEUPO_NOTEBOOK_QUICK=1: every cell on fewer seeds and iterations (each notebook says which), so
the test checks that they run, not their numbers (`pytest --nbmake notebooks` runs them in full).
"""

import gc
import os
import shutil
import sys
import tempfile

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
  sys.path.insert(0, _TESTS)

import processes  # noqa: E402  (tests/processes.py)

os.environ.setdefault("XLA_FLAGS", processes.xla_flags(devices=8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("SEEUPO_NOTEBOOK_QUICK", "1")  # the notebooks' kernels inherit it

CACHE_MIN_COMPILE_SECS = "1"
"""Programs that compiled in less time than this are not written to the cache (every compile
still looks the cache up first):
the many tiny programs of eager op-by-op dispatch and small unit tests cost more to write, lock
and read than to compile again. Measured on the 2-core CPU, 2026-12-05, one pytest process each:
tests/learner/test_losses.py 65.4 s with every program cached (0 s), 47.2 s at 1 s, 45.4 s with
no cache; test_learner_tis.py and test_theory_bandit.py 124.4 s at 0 s, 110.0 s at 1 s."""

_CACHE_VAR = "SEEUPO_TEST_COMPILATION_CACHE"
_OWN_CACHE = None
if _CACHE_VAR not in os.environ:  # the session's first pytest process
  _OWN_CACHE = os.environ[_CACHE_VAR] = tempfile.mkdtemp(prefix="seeupo_jax_test_cache_")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ[_CACHE_VAR])
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", CACHE_MIN_COMPILE_SECS)
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))

import hypothesis  # noqa: E402
import jax  # noqa: E402
from jax.experimental.compilation_cache import compilation_cache  # noqa: E402
import pytest  # noqa: E402

hypothesis.settings.register_profile("default", deadline=None, max_examples=40, print_blob=True)
hypothesis.settings.register_profile("thorough", deadline=None, max_examples=400)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(autouse=True)
def _fresh_compiles(request):
  """Tests marked `fresh_compiles` compile with the persistent cache off (see the docstring)."""
  if request.node.get_closest_marker("fresh_compiles") is None:
    yield
    return
  # The setting to restore: False under JAX_ENABLE_COMPILATION_CACHE=false.
  was_enabled = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()  # the cache's use is decided once, at the first compile
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", was_enabled)
    compilation_cache.reset_cache()


@pytest.fixture(scope="session")
def tok():
  """The offline default tokenizer (512 ids), one per test process: tests only read it."""
  import tiny  # noqa: PLC0415  (imports seeupo_jax and transformers on first use only)

  return tiny.tokenizer()


@pytest.fixture(scope="session")
def chat(tok):
  """`ChatTokens` of the `tok` fixture (the default chat template)."""
  from seeupo_jax.text import chat_tokens  # noqa: PLC0415

  return chat_tokens.ChatTokens(tok)


def pytest_collection_modifyitems(config, items):
  """The notebooks, then the tests marked `slow`, then the rest, each group in collection order.
  pytest-xdist (`-n 2`) hands tests out in this order, in chunks of consecutive tests: the long
  tests start early and the short ones fill the gaps at the end, where a long test handed out
  last would leave the other worker idle (a suite run with the slow tests' files first, in file
  order, ended with one worker idle for 285 s while the other ran the learning test and the two
  notebooks, 2026-12-06)."""

  def group(item):
    if item.path.suffix == ".ipynb":
      return 0
    return 1 if item.get_closest_marker("slow") is not None else 2

  items.sort(key=group)


def pytest_unconfigure(config):
  if _OWN_CACHE is not None:
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)


MAX_MEMORY_MAPS = 40_000
"""A test process's memory maps beyond which it drops JAX's compiled programs after a test.

XLA's CPU backend maps each kernel of a compiled program into memory on its own (a code, a data
and a read-only page: an update's program holds thousands), and keeps them for as long as the
program lives, which for a jitted function of a module or a fixture is the test process's life.
Linux refuses a process more than `vm.max_map_count` maps (65530 by default), and XLA then
crashes the process (a segfault or an abort in a compile or in the serialization of a program
for the persistent cache). Measured in a suite run on the 2-core CPU without this limit
(2026-12-06): an xdist worker held 16,000 maps after 4 minutes and 64,773 after 19, then
segfaulted in `compilation_cache.put_executable_and_time`. `jax.clear_caches()` drops the
programs (a later call compiles again, from the persistent cache when it is there)."""


def _memory_maps() -> int:
  try:
    with open("/proc/self/maps", "rb") as f:
      return sum(1 for _ in f)
  except OSError:  # not Linux
    return 0


def pytest_runtest_teardown(item, nextitem):
  if _memory_maps() > MAX_MEMORY_MAPS:
    jax.clear_caches()
    gc.collect()
