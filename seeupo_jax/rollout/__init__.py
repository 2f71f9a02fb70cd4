"""Rollouts: batches of episodes played by the policy against environments.

    policy = rollout.make_policy(chat, model_config, sampling_config, session_config)
    roller = rollout.Roller(spec, chat, config=rollout.RolloutConfig(max_turns=3), policy=policy)
    result = roller.run(params, task_ids, samples_per_task=8, rng=key)
    batch = rollout.collate(result.trajectories, num_turns=3, max_len=1024)

Modules, one role each:
  trajectory.py  the `Trajectory` record and `collate` (pure NumPy);
  workers.py     the env workers: every environment call, with time limits, in threads or
                 worker processes;
  policy.py      the policy the engine drives, which owns its rows and reports its counters:
                 the sampler (a `sampling.SamplerSession`, which owns the paged KV cache) or a
                 text policy;
  keys.py        the PRNG key of each reply of each episode;
  truncation.py  observations cut to a token budget;
  metrics.py     a call's metrics over processes, and the failed-group limit;
  roller.py      the engine: the scheduler (admit, env results, prefill, decode, hand off)
                 driving the policy it is given, the episodes' limits and retries.
"""

from seeupo_jax.rollout.policy import (
  Policy,
  PolicyReply,
  PolicyStats,
  SamplerPolicy,
  TextPolicy,
  make_policy,
)
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
  "PolicyStats",
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
  "make_policy",
  "make_workers",
  "trajectory_keys",
  "truncate_observation",
]
