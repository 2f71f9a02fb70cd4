"""Model configuration for the Qwen2/Qwen2.5/Qwen3 dense causal LM family.

One frozen dataclass, validated on construction, convertible to and from a
Hugging Face `config.json` dict, and a registry of presets by name (tiny test
sizes and the real 0.5B-14B sizes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from seeupo_jax import fields

DTYPES = ("float32", "bfloat16")
LORA_LAYER_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_TARGETS = LORA_LAYER_TARGETS + ("lm_head",)
"""What an adapter can go on: the decoder layers' projections (the default, PEFT's "all-linear"),
and the output projection `lm_head` (its logits then reach any scale: the frozen final norm and
head bound every logit of the base, which a from-scratch model cannot learn past)."""
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
QUANTIZE_FORMATS = ("none", "int8", "nf4")  # a frozen base's projections (models/quant.py)
_POSITIVE = fields.int_at_least(1)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture and numerics of one Qwen-family causal LM.

  Attributes:
      vocab_size: V, rows of the token embedding.
      hidden_size: D, residual stream width.
      intermediate_size: F, SwiGLU hidden width.
      num_layers: number of decoder blocks.
      num_heads: H, query heads.
      num_kv_heads: K, key/value heads (GQA); H must be a multiple of K.
      head_dim: per-head width (Qwen3 sets it explicitly; Qwen2 uses D / H).
      rope_theta: RoPE base frequency from the checkpoint.
      rms_norm_eps: epsilon inside every RMSNorm.
      tie_word_embeddings: the output projection is the embedding transposed.
      attention_bias: the attention projections carry a bias. Qwen2/2.5
          (qk_norm=False): always True, q/k/v only. Qwen3 (qk_norm=True): the
          checkpoint's `attention_bias` (False in the released models); True
          biases q/k/v AND o_proj, as transformers' Qwen3Attention does (see
          `o_proj_bias`).
      qk_norm: RMSNorm over head_dim on q and k before RoPE (Qwen3: True).
      max_position_embeddings: longest context the checkpoint was trained for.
      dtype: compute dtype of activations, "float32" or "bfloat16". Softmax,
          RMSNorm statistics, RoPE and logits are always float32.
      param_dtype: storage dtype of the parameters.
      remat: named rematerialisation policy of each decoder block: "none",
          "full" (save only block inputs), "dots" (save matmul outputs),
          "dots_no_batch" (save matmul outputs without batch dims).
      scan_layers: run the decoder blocks under `lax.scan` (compile time does
          not grow with depth) instead of unrolling them.
      attn_block_size: query block length of the causal attention
          (`layers.causal_attend`); 32 is fastest on the 2-core benchmark CPU.
      lora_rank: r of the LoRA adapters (`models/lora.py`) the params hold; 0: none.
      lora_alpha: the adapters' alpha; their output is scaled by alpha / r (`lora_scale`).
      lora_targets: the projections that get an adapter (of `LORA_TARGETS`); "lm_head" needs
          an untied head (tie_word_embeddings False).
      quantize: "none", or the format the decoder layers' projection kernels are held in,
          "int8" or "nf4" (`models/quant.py`; a frozen base: QLoRA).
  """

  vocab_size: int = fields.field(_POSITIVE)
  hidden_size: int = fields.field(_POSITIVE)
  intermediate_size: int = fields.field(_POSITIVE)
  num_layers: int = fields.field(_POSITIVE)
  num_heads: int = fields.field(_POSITIVE)
  num_kv_heads: int = fields.field(_POSITIVE)
  head_dim: int = fields.field(_POSITIVE)
  rope_theta: float = fields.field(fields.number_above(0))
  rms_norm_eps: float = fields.field(fields.number_above(0))
  tie_word_embeddings: bool = fields.field(fields.BOOL)
  attention_bias: bool = fields.field(fields.BOOL)
  qk_norm: bool = fields.field(fields.BOOL)
  max_position_embeddings: int = fields.field(_POSITIVE)
  dtype: str = fields.field(fields.one_of(DTYPES), "float32")
  param_dtype: str = fields.field(fields.one_of(DTYPES), "float32")
  remat: str = fields.field(fields.one_of(REMAT_POLICIES), "none")
  scan_layers: bool = fields.field(fields.BOOL, True)
  attn_block_size: int = fields.field(_POSITIVE, 128)
  lora_rank: int = fields.field(fields.described(fields.int_at_least(0), "0: no adapters"), 0)
  lora_alpha: float = fields.field(fields.number_above(0), 16.0)
  lora_targets: tuple = fields.field(
    fields.described(fields.tuple_of(fields.one_of(LORA_TARGETS)), "at least one"),
    LORA_LAYER_TARGETS,
  )
  quantize: str = fields.field(fields.one_of(QUANTIZE_FORMATS), "none")

  def __post_init__(self):
    fields.check(self)
    if self.num_heads % self.num_kv_heads:
      raise fields.FieldError.of(
        "ModelConfig",
        "num_heads",
        self.num_heads,
        f"a multiple of ModelConfig.num_kv_heads = {self.num_kv_heads}",
      )
    if self.lora_rank and not self.lora_targets:
      raise fields.FieldError.of(
        "ModelConfig", "lora_targets", self.lora_targets, f"some of {list(LORA_TARGETS)}"
      )
    if self.lora_rank and "lm_head" in self.lora_targets and self.tie_word_embeddings:
      raise fields.FieldError.of(
        "ModelConfig",
        "lora_targets",
        self.lora_targets,
        "no 'lm_head' with tie_word_embeddings=True (the head is the embedding; an adapter on it "
        "would untie them in the merged export)",
      )
    if self.head_dim % 2:
      raise fields.FieldError.of("ModelConfig", "head_dim", self.head_dim, "an even int (RoPE)")

  @property
  def family(self) -> str:
    """HF model_type this config maps to: "qwen3" (q/k norm) or "qwen2"."""
    return "qwen3" if self.qk_norm else "qwen2"

  @property
  def o_proj_bias(self) -> bool:
    """o_proj carries a bias [D]: Qwen3 with attention_bias (Qwen2 never biases o_proj)."""
    return self.qk_norm and self.attention_bias

  @property
  def lora_scale(self) -> float:
    """alpha / r, the factor of the adapters' output (1.0 without adapters)."""
    return self.lora_alpha / self.lora_rank if self.lora_rank else 1.0

  def replace(self, **changes: Any) -> "ModelConfig":
    """Returns a copy with `changes` applied (validated again)."""
    return dataclasses.replace(self, **changes)

  @classmethod
  def from_hf_dict(cls, d: dict, **overrides: Any) -> "ModelConfig":
    """Builds a config from a HF `config.json` dict of a Qwen2 or Qwen3 model.

    Args:
        d: the parsed `config.json`. `model_type` must be "qwen2" or "qwen3";
            RoPE scaling and sliding-window attention are rejected (not
            implemented). `rope_theta` is read from the top level (transformers 4)
            or from `rope_parameters` (transformers 5).
        **overrides: numerics fields (dtype, param_dtype, remat, scan_layers).
    """
    model_type = d.get("model_type")
    if model_type not in ("qwen2", "qwen3"):
      raise ValueError(
        f"config.json model_type must be one of ('qwen2', 'qwen3'), got {model_type!r}"
      )
    rope = d.get("rope_parameters") or {}
    rope_scaling = d.get("rope_scaling") or {}
    rope_type = rope.get(
      "rope_type", rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    )
    if rope_type != "default":
      raise ValueError(
        f"config.json rope_type must be 'default' (RoPE scaling is not implemented), got {rope_type!r}"
      )
    if d.get("use_sliding_window", False):
      raise ValueError("config.json use_sliding_window=True is not supported; allowed: false")
    if d.get("hidden_act", "silu") != "silu":
      raise ValueError(f"config.json hidden_act must be 'silu', got {d.get('hidden_act')!r}")
    theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
    heads = d["num_attention_heads"]
    fields = dict(
      vocab_size=d["vocab_size"],
      hidden_size=d["hidden_size"],
      intermediate_size=d["intermediate_size"],
      num_layers=d["num_hidden_layers"],
      num_heads=heads,
      num_kv_heads=d.get("num_key_value_heads") or heads,
      head_dim=d.get("head_dim") or d["hidden_size"] // heads,
      rope_theta=float(theta),
      rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
      tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
      attention_bias=(True if model_type == "qwen2" else bool(d.get("attention_bias", False))),
      qk_norm=model_type == "qwen3",
      max_position_embeddings=d.get("max_position_embeddings", 32768),
    )
    fields.update(overrides)
    return cls(**fields)

  def to_hf_dict(self) -> dict:
    """The HF `config.json` dict (transformers 4 and 5 both read it).

    Raises:
        ValueError: qk_norm=False with attention_bias=False has no Qwen class.
    """
    if not self.qk_norm and not self.attention_bias:
      raise ValueError(
        "ModelConfig with qk_norm=False and attention_bias=False has no HF Qwen "
        "class (qwen2 always has q/k/v bias); allowed: qk_norm=True or attention_bias=True"
      )
    d = {
      "architectures": ["Qwen3ForCausalLM" if self.qk_norm else "Qwen2ForCausalLM"],
      "model_type": self.family,
      "vocab_size": self.vocab_size,
      "hidden_size": self.hidden_size,
      "intermediate_size": self.intermediate_size,
      "num_hidden_layers": self.num_layers,
      "num_attention_heads": self.num_heads,
      "num_key_value_heads": self.num_kv_heads,
      "head_dim": self.head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": self.max_position_embeddings,
      "rms_norm_eps": self.rms_norm_eps,
      "rope_theta": self.rope_theta,
      "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
      "tie_word_embeddings": self.tie_word_embeddings,
      "use_sliding_window": False,
      "sliding_window": None,
      "attention_dropout": 0.0,
      "use_cache": True,
      "torch_dtype": self.param_dtype,
      "dtype": self.param_dtype,
    }
    if self.qk_norm:
      d["attention_bias"] = self.attention_bias
    return d


def _qwen2(vocab, hidden, inter, layers, heads, kv, tied, eps=1e-6, max_pos=32768):
  return ModelConfig(
    vocab_size=vocab,
    hidden_size=hidden,
    intermediate_size=inter,
    num_layers=layers,
    num_heads=heads,
    num_kv_heads=kv,
    head_dim=hidden // heads,
    rope_theta=1e6,
    rms_norm_eps=eps,
    tie_word_embeddings=tied,
    attention_bias=True,
    qk_norm=False,
    max_position_embeddings=max_pos,
  )


def _qwen3(vocab, hidden, inter, layers, heads, kv, tied, head_dim=128, theta=1e6, max_pos=40960):
  return ModelConfig(
    vocab_size=vocab,
    hidden_size=hidden,
    intermediate_size=inter,
    num_layers=layers,
    num_heads=heads,
    num_kv_heads=kv,
    head_dim=head_dim,
    rope_theta=theta,
    rms_norm_eps=1e-6,
    tie_word_embeddings=tied,
    attention_bias=False,
    qk_norm=True,
    max_position_embeddings=max_pos,
  )


# Real sizes follow the published config.json files of each checkpoint.
PRESETS: dict[str, ModelConfig] = {
  # Tiny sizes for tests (vocab 512, hidden 64, 2 layers).
  "qwen3-tiny": _qwen3(512, 64, 128, 2, 4, 2, tied=False, head_dim=16, theta=10000.0, max_pos=2048),
  "qwen3-tiny-tied": _qwen3(
    512, 64, 128, 2, 4, 2, tied=True, head_dim=16, theta=10000.0, max_pos=2048
  ),
  "qwen2-tiny": _qwen2(512, 64, 128, 2, 4, 2, tied=False, max_pos=2048).replace(rope_theta=10000.0),
  "qwen2-tiny-tied": _qwen2(512, 64, 128, 2, 4, 2, tied=True, max_pos=2048).replace(
    rope_theta=10000.0
  ),
  # Benchmark size: hidden 256, 4 layers.
  "qwen3-bench": _qwen3(8192, 256, 768, 4, 8, 4, tied=False, head_dim=32, theta=1e6, max_pos=4096),
  # Qwen2.5 family.
  "qwen2.5-0.5b": _qwen2(151936, 896, 4864, 24, 14, 2, tied=True),
  "qwen2.5-1.5b": _qwen2(151936, 1536, 8960, 28, 12, 2, tied=True),
  "qwen2.5-3b": _qwen2(151936, 2048, 11008, 36, 16, 2, tied=True),
  "qwen2.5-7b": _qwen2(152064, 3584, 18944, 28, 28, 4, tied=False),
  "qwen2.5-14b": _qwen2(152064, 5120, 13824, 48, 40, 8, tied=False, eps=1e-5),
  # Qwen3 dense family.
  "qwen3-0.6b": _qwen3(151936, 1024, 3072, 28, 16, 8, tied=True),
  "qwen3-1.7b": _qwen3(151936, 2048, 6144, 28, 16, 8, tied=True),
  "qwen3-4b": _qwen3(151936, 2560, 9728, 36, 32, 8, tied=True),
  "qwen3-8b": _qwen3(151936, 4096, 12288, 36, 32, 8, tied=False),
  "qwen3-14b": _qwen3(151936, 5120, 17408, 40, 40, 8, tied=False),
  "qwen3-32b": _qwen3(151936, 5120, 25600, 64, 64, 8, tied=False),
}


def get_preset(name: str, **overrides: Any) -> ModelConfig:
  """Returns the preset `name`, with numerics `overrides` (dtype, remat, ...).

  Raises:
      ValueError: unknown name; the message lists the allowed names.
  """
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; allowed: {sorted(PRESETS)}")
  return PRESETS[name].replace(**overrides)
