"""`--config=bfcl`: BFCL v4 multi-turn (the environment arrives with its own issue)."""

from experiments.configs import base


def get_config():
  return base.agent_config("bfcl", max_turns=10, max_context_tokens=16384, max_env_tokens=2048)
