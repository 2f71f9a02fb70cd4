"""The SeeUPO learner: one jitted, sharded update per training iteration.

    from seeupo_jax import learner
    step = learner.make_update(logprob_fn, optimizer, learner.LearnerConfig(algorithm="seeupo"))
    state = learner.init_state(params, optimizer, ref_params=params)
    state, metrics = step(state, batch, key)

See docs/learner.md.
"""

from seeupo_jax.learner import algorithms, metrics, objectives
from seeupo_jax.learner.algorithms import REGISTRY, Algorithm
from seeupo_jax.learner.batch import (
  PROMPT_OR_ENV,
  Batch,
  batch_shardings,
  generated_mask,
  shard_batch,
  turn_mask,
  validate,
)
from seeupo_jax.learner.config import (
  ALGORITHMS,
  DEFAULT_NORMALISATION,
  NORMALISATIONS,
  LearnerConfig,
)
from seeupo_jax.learner.precision import (
  MasterWeightsState,
  master_params,
  rounded_away_share,
  with_master_weights,
)
from seeupo_jax.learner.qwen_fns import init_qwen_critic, qwen_logprob_fn, qwen_value_fn
from seeupo_jax.learner.state import (
  TrainState,
  init_state,
  opt_state_shardings,
  policy_params,
  reference_params,
  shard_params,
  state_shardings,
  with_base,
  without_base,
)
from seeupo_jax.learner.optimizer import default_optimizer
from seeupo_jax.learner.update import StepStats, make_update
