"""`--config=synthetic` (the default): SeeUPO trains a tiny model from scratch on the lock task.

    python experiments/run.py                                   # this config, workdir runs/synthetic
    python experiments/run.py --config.learner.algorithm=gspo   # another learner
    python experiments/run.py --config.model.path=/ckpt/Qwen3-0.6B --config.model.dtype=bfloat16

Sections: model, env, rollout, learner (any `LearnerConfig` field), optimizer,
eval, checkpoint, log, mesh. See README "Training".
"""

import dataclasses

from experiments.configs import base
from seeupo_jax.envs import synthetic


def get_config():
  config = base.training_config()
  config.model.preset = "qwen3-tiny"  # initialised from scratch, sized for a 2-core CPU
  config.env.name = "synthetic"
  # Every SyntheticConfig field, so each can be overridden (--config.env.num_dials=4).
  defaults = {f.name: f.default for f in dataclasses.fields(synthetic.SyntheticConfig)}
  # A model trained from scratch cannot read the rules; they would only lengthen every prompt.
  defaults["instructions"] = False
  # The bare clue digits ("3", no decoy, no words): a short context in which the clue is the last
  # digit, so the randomly initialised model finds it sooner (docs/training.md, "Learning curves").
  defaults["decoys"] = False
  defaults["labels"] = False
  config.env.update(defaults)
  # One turn per dial; the reply is read from its first character.
  config.rollout.max_turns = 3
  config.rollout.max_reply_tokens = 1
  config.rollout.max_context_tokens = 160
  config.rollout.max_env_tokens = 64
  # 32 tasks x 8 samples (the declared default): less noise in the policy gradient while the
  # model sits at chance.
  # From scratch the paper's learning rate (1e-6, for a pretrained 14B model) would not move it.
  config.optimizer.learning_rate = 1e-3
  config.optimizer.weight_decay = 0.0
  # The KL to the initial (near-uniform) policy keeps every clue's other answer sampled: without
  # it a digit can lock onto the wrong answer for good (p = 1, no reward signal left).
  config.learner.kl_coef = 0.01
  config.num_iterations = 200
  return config
