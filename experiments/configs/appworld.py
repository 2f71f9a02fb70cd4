"""`--config=appworld`: AppWorld over HTTP (the environment arrives with its own issue)."""

from experiments.configs import base


def get_config():
  return base.agent_config("appworld", max_turns=30, max_context_tokens=32768, max_env_tokens=4096)
