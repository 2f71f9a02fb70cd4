r"""Wall time of one (algorithm, family) bandit setting over many seeds.

  python benchmarks/bench_bandit.py --num_seeds=1000 --algorithms=seeupo,grpo

Everything (instances, rollouts, updates, exact J after every iteration) is
one jitted, vmapped call (`sweep.make_setting_fn`, with its compiler options);
compile time is measured apart from run time. Prints one markdown row per
algorithm.

With `--baseline=FILE` (an older `seeupo_jax/theory/algorithms.py`, e.g.
`git show REV:seeupo_jax/theory/algorithms.py > /tmp/old_algorithms.py`), the
same settings also run through that file's `make_train_fn`, jitted as the
sweep jitted it then (no compiler options; `--baseline_options` gives it the
current ones), interleaved with the current code in this one process; each
run time is the minimum over `--repeats` runs.
"""

import importlib.util
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments.configs import bandit as bandit_config  # noqa: E402
from seeupo_jax.theory import algorithms  # noqa: E402
from seeupo_jax.theory import bandit as bandit_lib  # noqa: E402
from seeupo_jax.theory import policies  # noqa: E402
from seeupo_jax.theory import sweep  # noqa: E402

_SEEDS = flags.DEFINE_integer("num_seeds", 1000, "Runs (seeds).")
_ALGOS = flags.DEFINE_string("algorithms", "seeupo,grpo", "Comma-separated.")
_FAMILY = flags.DEFINE_string("family", "random", "Instance family.")
_LR = flags.DEFINE_float("lr", 3.0, "Learning rate.")
_TURNS = flags.DEFINE_integer("num_turns", 4, "T.")
_BASELINE = flags.DEFINE_string(
  "baseline", "", "Path of an older algorithms.py to time against (interleaved)."
)
_BASELINE_OPTIONS = flags.DEFINE_bool(
  "baseline_options", False, "Jit the baseline with the current compiler options too."
)
_REPEATS = flags.DEFINE_integer("repeats", 1, "Timed runs per setting (the minimum is shown).")


def _baseline_setting_fn(path: str, config, name: str):
  """The setting function of `sweep.make_setting_fn`, built from the module at `path`."""
  spec = importlib.util.spec_from_file_location("baseline_algorithms", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  enum = bandit_lib.enumerate_bandit(
    int(config.num_contexts), int(config.num_actions), int(config.num_turns)
  )
  policy = policies.get_policy(config.policy, enum)
  train = module.make_train_fn(config, enum, policy, module.get_algorithm(name))

  def one_run(bandit, key, lr):
    return train(key, bandit, lr).returns / bandit_lib.optimal_return(bandit)

  options = algorithms.compiler_options() if _BASELINE_OPTIONS.value else {}
  over_runs = jax.vmap(one_run, in_axes=(0, 0, None))
  return jax.jit(jax.vmap(over_runs, in_axes=(None, None, 0)), compiler_options=options)


def main(_):
  config = bandit_config.get_config()
  config.update(num_seeds=_SEEDS.value, num_turns=_TURNS.value, learning_rates=str(_LR.value))
  bandits = sweep.make_instances(config, _FAMILY.value)
  _, keys = sweep._seed_keys(config)  # pylint: disable=protected-access
  lrs = jnp.array([_LR.value])
  print(f"{jax.devices()[0].platform}, {os.cpu_count()} CPUs; {sweep.describe(config)}")
  print(f"compiler options: {algorithms.compiler_options()}")
  print("| algorithm | code | family | seeds | compile s | run s | reach>=0.99J* |")
  print("|---|---|---|---|---|---|---|")
  for name in _ALGOS.value.split(","):
    fns = {"current": sweep.make_setting_fn(config, name)}
    if _BASELINE.value:
      fns["baseline"] = _baseline_setting_fn(_BASELINE.value, config, name)
    compiled, compile_s, run_s, reach = {}, {}, {}, {}
    for code, fn in fns.items():
      start = time.perf_counter()
      compiled[code] = fn.lower(bandits, keys, lrs).compile()
      compile_s[code] = time.perf_counter() - start
      run_s[code] = []
    for repeat in range(_REPEATS.value):
      for code in list(fns)[:: 1 if repeat % 2 == 0 else -1]:  # alternate who goes first
        start = time.perf_counter()
        curves = np.asarray(compiled[code](bandits, keys, lrs))
        run_s[code].append(time.perf_counter() - start)
        reach[code] = np.mean(curves[0, :, -1] >= 0.99)
    for code in fns:
      print(
        f"| {name} | {code} | {_FAMILY.value} | {_SEEDS.value} | {compile_s[code]:.1f} "
        f"| {min(run_s[code]):.1f} | {reach[code]:.1%} |"
      )
    if _BASELINE.value:
      ratio = min(run_s["current"]) / min(run_s["baseline"])
      print(f"| {name} | current / baseline run time: {ratio:.2f}x | | | | | |")


if __name__ == "__main__":
  app.run(main)
