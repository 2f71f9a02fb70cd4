"""`--config=bandit`: theory checks on multi-turn contextual bandits.

See docs/theory.md. Every key can be overridden: `--config.num_seeds=100`,
`--config.algorithms=seeupo,grpo`, `--config.families=trap`.
"""

import ml_collections

from seeupo_jax.theory import sweep


def get_config() -> ml_collections.ConfigDict:
  """Every `seeupo_jax.theory.sweep.BanditConfig` field with its default (declared there)."""
  return sweep.default_config()
