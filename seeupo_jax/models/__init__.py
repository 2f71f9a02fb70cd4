"""Qwen2/Qwen2.5/Qwen3 causal LM: config, functional model, HF checkpoints."""

from seeupo_jax.models.config import PRESETS, ModelConfig, get_preset
from seeupo_jax.models.qwen import (
  KVCache,
  PagedKVCache,
  forward,
  hidden_states,
  init_cache,
  init_paged_cache,
  init_params,
  logprobs_from_hidden,
  output_kernel,
  paged_hidden_states,
  params_shape,
  token_logprobs,
)
