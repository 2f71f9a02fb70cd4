"""Tiny random transformers (PyTorch) Qwen2/Qwen3 checkpoints for parity tests.

Needs torch (the `parity` extra); import it only from tests that did
`pytest.importorskip("torch")`. Nothing is downloaded: the model is built from
a config and random weights, then `save_pretrained` to a directory.
"""

from __future__ import annotations

import os

TINY = dict(
  vocab_size=512,
  hidden_size=64,
  intermediate_size=128,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  max_position_embeddings=2048,
)


def build_hf_model(
  family: str = "qwen3",
  *,
  tie_word_embeddings: bool = False,
  seed: int = 0,
  rope_theta: float = 10000.0,
  **config_overrides,
):
  """A random transformers Qwen2ForCausalLM / Qwen3ForCausalLM in float32, eval mode.

  All weights, including norm scales and q/k/v biases, are drawn at random
  (norms around 1, biases around 0) so every parameter matters in parity tests.

  Args:
    family: "qwen2" or "qwen3".
    tie_word_embeddings: share the embedding and the output projection.
    seed: torch seed of the weights.
    rope_theta: RoPE base.
    **config_overrides: any other config field (e.g. num_hidden_layers).
  """
  import torch
  import transformers

  if family not in ("qwen2", "qwen3"):
    raise ValueError(f"family must be one of ('qwen2', 'qwen3'), got {family!r}")
  fields = dict(
    TINY,
    tie_word_embeddings=tie_word_embeddings,
    rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
  )
  if family == "qwen3":
    fields["head_dim"] = 16
  fields.update(config_overrides)
  if family == "qwen3":
    config = transformers.Qwen3Config(**fields)
    model_cls = transformers.Qwen3ForCausalLM
  else:
    config = transformers.Qwen2Config(**fields)
    model_cls = transformers.Qwen2ForCausalLM
  torch.manual_seed(seed)
  model = model_cls(config).to(torch.float32).eval()
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=generator))
      elif name.endswith("bias"):
        p.copy_(0.1 * torch.randn(p.shape, generator=generator))
      else:
        p.copy_(0.05 * torch.randn(p.shape, generator=generator))
  return model


def save_hf_model(model, directory: str, *, max_shard_size: str | int | None = None) -> str:
  """`model.save_pretrained(directory)` as safetensors; sharded with an index if max_shard_size."""
  os.makedirs(directory, exist_ok=True)
  kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
  model.save_pretrained(directory, **kwargs)
  return directory


def make_hf_checkpoint(
  directory: str,
  family: str = "qwen3",
  *,
  tie_word_embeddings: bool = False,
  max_shard_size: str | int | None = None,
  seed: int = 0,
  **config_overrides,
):
  """Builds a tiny random model and saves it to `directory`; returns (directory, torch model)."""
  model = build_hf_model(
    family, tie_word_embeddings=tie_word_embeddings, seed=seed, **config_overrides
  )
  save_hf_model(model, directory, max_shard_size=max_shard_size)
  return directory, model
