r"""Wall time of one (algorithm, family) bandit setting over many seeds.

  python benchmarks/bench_bandit.py --num_seeds=1000 --algorithms=seeupo,grpo

Everything (instances, rollouts, updates, exact J after every iteration) is
one jitted, vmapped call; compile time is measured apart from run time.
Prints one markdown row per algorithm.
"""

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
from seeupo_jax.theory import sweep  # noqa: E402

_SEEDS = flags.DEFINE_integer("num_seeds", 1000, "Runs (seeds).")
_ALGOS = flags.DEFINE_string("algorithms", "seeupo,grpo", "Comma-separated.")
_FAMILY = flags.DEFINE_string("family", "random", "Instance family.")
_LR = flags.DEFINE_float("lr", 3.0, "Learning rate.")
_TURNS = flags.DEFINE_integer("num_turns", 4, "T.")


def main(_):
  config = bandit_config.get_config()
  config.update(num_seeds=_SEEDS.value, num_turns=_TURNS.value, learning_rates=str(_LR.value))
  bandits = sweep.make_instances(config, _FAMILY.value)
  _, keys = sweep._seed_keys(config)  # pylint: disable=protected-access
  lrs = jnp.array([_LR.value])
  print(f"{jax.devices()[0].platform}, {os.cpu_count()} CPUs; {sweep.describe(config)}")
  print("| algorithm | family | seeds | compile s | run s | reach>=0.99J* |")
  print("|---|---|---|---|---|---|")
  for name in _ALGOS.value.split(","):
    fn = sweep.make_setting_fn(config, name)
    start = time.perf_counter()
    compiled = fn.lower(bandits, keys, lrs).compile()
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    curves = np.asarray(compiled(bandits, keys, lrs))
    run_s = time.perf_counter() - start
    reach = np.mean(curves[0, :, -1] >= 0.99)
    print(
      f"| {name} | {_FAMILY.value} | {_SEEDS.value} | {compile_s:.1f} | {run_s:.1f} | {reach:.1%} |"
    )


if __name__ == "__main__":
  app.run(main)
