"""The learner's model functions for the Qwen policy: log-probs and PPO's critic."""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from seeupo_jax.learner.batch import Batch
from seeupo_jax.models import qwen
from seeupo_jax.models.config import ModelConfig

Params = Any


def _positions(token_valid: jax.Array) -> jax.Array:
  """RoPE positions: the number of valid tokens before each slot."""
  valid = token_valid.astype(jnp.int32)
  return jnp.cumsum(valid, axis=1) - valid


def _shift_right(values: jax.Array, token_valid: jax.Array) -> jax.Array:
  """out[:, j] = values[:, j - 1] where tokens j - 1 and j are valid, else 0."""
  shifted = jnp.pad(values[:, :-1], ((0, 0), (1, 0)))
  predicted = token_valid & jnp.pad(token_valid[:, :-1], ((0, 0), (1, 0)))
  return jnp.where(predicted, shifted, 0.0)


def qwen_logprob_fn(model_config: ModelConfig, *, temperature: float = 1.0, chunk_size: int = 256):
  """The learner's `logprob_fn` for a Qwen2/Qwen3 policy.

  logprob_fn(params, batch)[i, j] = log softmax(logits(tokens[i, :j]) / temperature)[tokens[i, j]],
  0 at j = 0 and on padding: `qwen.token_logprobs`, the teacher-forced twin of the
  sampler's log-probs, so with the rollout temperature the learner's log-probs of
  the sampled tokens equal the sampler's (in float32).

  Args:
    model_config: the policy's `ModelConfig` (remat and scan_layers apply here).
    temperature: the rollout temperature.
    chunk_size: positions per logits chunk of the vocabulary head.

  Returns:
    logprob_fn(params, Batch) -> float32[N, L].
  """
  if not temperature > 0:
    raise ValueError(f"temperature must be > 0, got {temperature!r}")

  def logprob_fn(params: Params, batch: Batch) -> jax.Array:
    tokens, valid = batch.tokens, batch.token_valid
    targets = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))
    logp = qwen.token_logprobs(
      params,
      tokens,
      targets,
      _positions(valid),
      valid,
      config=model_config,
      temperature=temperature,
      chunk_size=chunk_size,
    )
    return _shift_right(logp, valid)

  return logprob_fn


def init_qwen_critic(
  model_config: ModelConfig, key: jax.Array, trunk_params: Optional[Params] = None
) -> Params:
  """PPO critic params: a Qwen trunk and a scalar value head (zero-initialised).

  Args:
    model_config: the critic's `ModelConfig` (its own size: it need not be the policy's).
    key: PRNG key for a fresh trunk.
    trunk_params: start from these params (e.g. a copy of the policy checkpoint, as
      verl does); None initialises the trunk from `key`.
  """
  trunk = qwen.init_params(model_config, key) if trunk_params is None else trunk_params
  # The critic reads hidden states only: no vocabulary head ([D, V], 0.78B values at 14B).
  trunk = {name: value for name, value in trunk.items() if name != "lm_head"}
  dtype = jnp.dtype(model_config.param_dtype)
  return {
    "trunk": trunk,
    "value_head": {
      "kernel": jnp.zeros((model_config.hidden_size,), dtype),
      "bias": jnp.zeros((), dtype),
    },
  }


def qwen_value_fn(model_config: ModelConfig):
  """PPO's critic: V(state before token j) = w . h[j - 1] + b, on a separate Qwen trunk.

  A separate model rather than a value head on the policy's trunk: the learner stays
  model-agnostic, the policy's update is not changed by value-loss gradients (the
  baseline is compared on the same policy objective), and it is what the paper's PPO
  runs used (verl's critic is its own model; their PPO runs took 16 GPUs against 8).

  Returns:
    value_fn(critic_params, Batch) -> float32[N, L], 0 at j = 0 and on padding.
  """

  def value_fn(critic_params: Params, batch: Batch) -> jax.Array:
    valid = batch.token_valid
    h, _ = qwen.hidden_states(
      critic_params["trunk"], batch.tokens, _positions(valid), valid, config=model_config
    )
    head = critic_params["value_head"]
    values = jnp.einsum("bsd,d->bs", h.astype(jnp.float32), head["kernel"].astype(jnp.float32))
    return _shift_right(values + head["bias"].astype(jnp.float32), valid)

  return value_fn
