"""The shared shape of every training config; per-program files change only what differs.

Every key and its default come from `seeupo_jax.training.config.defaults()`, which reads them from
the dataclasses that declare them (one declaration per value: `LearnerConfig.kl_coef`,
`RolloutConfig.env_workers`, `sampling.SessionConfig.prefill_rows`, ...). The files here set only
what their program changes, each with the reason.
"""

import ml_collections

from seeupo_jax.training import config as config_lib


def options(**kwargs) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(kwargs)


def training_config() -> ml_collections.ConfigDict:
  """Every key of `program = "train"` with its declared default; the task's keys
  (`env.name`, `rollout.max_turns`, the lengths) unset, for a config file to set."""
  return config_lib.defaults()


def agent_config(env_name: str, *, max_turns: int, max_context_tokens: int, max_env_tokens: int):
  """A benchmark config: the paper's Qwen3-14B setting on environment `env_name` (B = 32 tasks x
  n = 8 samples, the optimizer and KL coefficient are the declared defaults, the paper's)."""
  c = training_config()
  c.env.name = env_name
  c.rollout.max_turns = max_turns
  c.rollout.max_context_tokens = max_context_tokens
  c.rollout.max_reply_tokens = 2048
  c.rollout.max_env_tokens = max_env_tokens
  c.rollout.temperature = 0.9
  return c
