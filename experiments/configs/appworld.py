"""`--config=appworld`: SeeUPO on AppWorld, played over HTTP against AppWorld's own servers.

    APPWORLD_PYTHON=~/appworld-venv/bin/python bash experiments/appworld_servers.sh 256 8000 &
    python experiments/run.py --config=appworld --config.model.path=/ckpt/Qwen3-14B \
        --config.env.datasets_dir=$APPWORLD_ROOT/data/datasets

Every `AppWorldConfig` field but `max_turns` is a key of `env` (--config.env.urls=...); the
episode's reply limit is `rollout.max_turns` (--config.rollout.max_turns=20), one name for the
value, which the training program passes on. See docs/appworld.md. Each running episode holds one server from reset to close: with
tasks_per_iteration x samples_per_task servers (32 x 8 = 256, the default of env.num_servers) a
whole iteration runs at once; with fewer, the rollout loop plays the episodes in waves of as many
as there are healthy servers (slower, same result).
"""

import dataclasses

from experiments.configs import base
from seeupo_jax.envs import appworld


def get_config():
  config = base.agent_config(
    "appworld", max_turns=30, max_context_tokens=32768, max_env_tokens=4096
  )
  # Every AppWorldConfig field, so each can be overridden (--config.env.api_docs=none).
  defaults = {f.name: f.default for f in dataclasses.fields(appworld.AppWorldConfig)}
  del defaults["max_turns"]  # rollout.max_turns (`seeupo_jax.training.config.TURN_LIMIT_OPTIONS`)
  config.env.update(defaults)
  # One server per episode that runs at once (a flag overrides it).
  config.env.num_servers = config.rollout.get_ref("tasks_per_iteration") * config.rollout.get_ref(
    "samples_per_task"
  )
  config.rollout.env_workers = 32  # environment calls are HTTP waits: many threads are cheap
  return config
