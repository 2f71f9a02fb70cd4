"""`experiments/run.py`, its schedule run one step after the other: each update done before the
sampling beside it starts (`loop.run(..., overlap=False)`). For the tests that need what a run
samples without its timing: with `pipeline.partial_rollouts` every process then swaps at its
first round, so each batch after the prologue is sampled with the update's params. Takes
run.py's flags.

NEVER_READY_PROCESS=p (an environment variable): the process of index p never sees a staged
decode copy ready (`DecodeLayout.stage`), so its sampler never swaps and it installs the copy
after its rollout, while the others swap at their first round: processes that swap at
different points, or not at all, as overlapped runs on accelerators do.
"""

import functools
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

import jax  # noqa: E402

from experiments import run  # noqa: E402
from seeupo_jax.sampling import layout  # noqa: E402
from seeupo_jax.training import loop  # noqa: E402

if __name__ == "__main__":
  loop.run = functools.partial(loop.run, overlap=False)
  never = os.environ.get("NEVER_READY_PROCESS")
  if never is not None:
    ready = layout.Staged.ready
    layout.Staged.ready = lambda staged: jax.process_index() != int(never) and ready(staged)
  run.run(sys.argv)
