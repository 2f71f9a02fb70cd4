"""`--config=bfcl`: BFCL v4 multi-turn (the environment arrives with its own issue)."""

from experiments.configs import base


def get_config():
  config = base.training_config()
  config.env.name = "bfcl"
  config.rollout.max_turns = 10
  config.rollout.max_context_tokens = 16384
  config.rollout.max_reply_tokens = 2048
  config.rollout.max_env_tokens = 2048
  config.model.preset = "qwen3-14b"
  config.learner.kl_coef = 0.002
  config.optimizer.learning_rate = 1e-6
  config.optimizer.weight_decay = 0.01
  return config
