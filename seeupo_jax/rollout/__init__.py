"""Rollouts: batches of episodes played by the policy against environments.

    roller = rollout.Roller(spec, chat, model_config, sampling_config, RolloutConfig(max_turns=3))
    result = roller.run(params, task_ids, samples_per_task=8, rng=key)
    batch = rollout.collate(result.trajectories, num_turns=3, max_len=1024)

Modules, one role each:
  trajectory.py  the `Trajectory` record and `collate` (pure NumPy);
  workers.py     the env workers: every environment call, with time limits, in threads or
                 worker processes;
  policy.py      the policy the engine drives: the sampler (a `sampling.SamplerSession`, which
                 owns the paged KV cache) or a text policy;
  roller.py      the engine: the continuous scheduler (admit, env results, prefill, decode,
                 hand off), limits, retries and group drops.
"""

from seeupo_jax.rollout.policy import Policy, PolicyReply, SamplerPolicy, TextPolicy
from seeupo_jax.rollout.roller import (
  FINISH_REASONS,
  SCHEDULERS,
  TRUNCATION_MARKER,
  EnvironmentFailure,
  Roller,
  RolloutConfig,
  RolloutResult,
  trajectory_keys,
  truncate_observation,
)
from seeupo_jax.rollout.trajectory import Trajectory, collate
from seeupo_jax.rollout.workers import (
  EnvCallFailed,
  EnvWorkers,
  WorkerConfig,
  make_workers,
)

__all__ = [
  "FINISH_REASONS",
  "SCHEDULERS",
  "Policy",
  "PolicyReply",
  "SamplerPolicy",
  "TextPolicy",
  "TRUNCATION_MARKER",
  "EnvCallFailed",
  "EnvWorkers",
  "EnvironmentFailure",
  "Roller",
  "RolloutConfig",
  "RolloutResult",
  "Trajectory",
  "WorkerConfig",
  "collate",
  "make_workers",
  "trajectory_keys",
  "truncate_observation",
]
