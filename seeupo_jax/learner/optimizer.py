"""The learner's optimizer: global-norm clip, then AdamW, with an optional linear warm-up."""

from __future__ import annotations

import optax


def default_optimizer(
  learning_rate: float = 1e-6,
  weight_decay: float = 0.01,
  max_grad_norm: float = 1.0,
  b1: float = 0.9,
  b2: float = 0.999,
  warmup_steps: int = 0,
) -> optax.GradientTransformation:
  """The authors' optimizer: global-norm clip, then AdamW (constant learning rate).

    chain(clip_by_global_norm(max_grad_norm), adamw(lr, b1, b2, weight_decay))
    lr = learning_rate, or linear 0 -> learning_rate over the first `warmup_steps` steps

  With bf16 params `init_state` wraps it in float32 master weights
  (`precision.with_master_weights`); at lr 1e-6 a bf16 weight could not move otherwise.

  Args:
    learning_rate: AdamW's learning rate (after the warm-up).
    weight_decay: AdamW's decoupled weight decay.
    max_grad_norm: the global gradient norm is clipped to this before AdamW.
    b1, b2: Adam's moment decays.
    warmup_steps: optimizer steps of linear warm-up from 0 (0: none, a constant rate).
  """
  lr = learning_rate
  if warmup_steps:
    lr = optax.linear_schedule(0.0, learning_rate, warmup_steps)
  return optax.chain(
    optax.clip_by_global_norm(max_grad_norm),
    optax.adamw(lr, b1=b1, b2=b2, weight_decay=weight_decay),
  )
