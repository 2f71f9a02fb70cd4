"""The config registry: `--config=NAME` picks `CONFIGS[NAME].get_config()`.

A fixed dict, never an import of a user-supplied name. Each config sets
`config.program`, which `experiments/run.py` maps to the code that runs it.
"""

import ml_collections

from experiments.configs import appworld, bandit, bfcl, synthetic

CONFIGS = {
  "appworld": appworld,
  "bandit": bandit,
  "bfcl": bfcl,
  "synthetic": synthetic,
}


def get_config(name: str) -> ml_collections.ConfigDict:
  """The config registered as `name`; a bad name lists the allowed ones."""
  if name not in CONFIGS:
    raise ValueError(f"unknown config {name!r}; allowed: {sorted(CONFIGS)}")
  return CONFIGS[name].get_config()
