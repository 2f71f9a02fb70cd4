"""LoRA adapters in the model (`models/lora.py`, `layers._lora_delta`) and their config key."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seeupo_jax import sharding
from seeupo_jax.models import lora
from seeupo_jax.models import qwen
from seeupo_jax.training import config as config_lib
import tiny


def _inputs(config):
  ids = jax.random.randint(jax.random.key(1), (2, 7), 0, config.vocab_size)
  return ids, jnp.broadcast_to(jnp.arange(7), (2, 7))


def test_adapters_start_as_the_base_and_merge_to_the_same_logits():
  config = tiny.model_config().replace(
    lora_rank=4, lora_alpha=8.0, lora_targets=("q_proj", "up_proj", "down_proj")
  )
  params = qwen.init_params(config, jax.random.key(0))
  adapters, base = lora.split(params)
  assert sorted(adapters["layers"]["attn"]) == ["q_proj"]
  assert sorted(adapters["layers"]["mlp"]) == ["down_proj", "up_proj"]
  assert adapters["layers"]["mlp"]["down_proj"]["lora_a"].shape == (2, 128, 4)
  assert adapters["layers"]["mlp"]["down_proj"]["lora_b"].shape == (2, 4, 64)
  ids, pos = _inputs(config)
  forward = jax.jit(lambda p: qwen.forward(p, ids, pos, config=config)[0])
  base_logits = forward(base)
  np.testing.assert_array_equal(forward(params), base_logits)  # B = 0: the base exactly

  keys = iter(jax.random.split(jax.random.key(3), 16))
  moved = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape), adapters)
  adapted = lora.combine(base, moved)
  logits = forward(adapted)
  assert float(jnp.abs(logits - base_logits).max()) > 1e-2  # the adapters change the policy
  # Merged by hand in NumPy: W + s A B.
  merged = jax.tree.map(lambda x: x, base)
  for module, projections in moved["layers"].items():
    for name, ab in projections.items():
      w = np.asarray(base["layers"][module][name]["kernel"], np.float64)
      a, b = np.asarray(ab["lora_a"], np.float64), np.asarray(ab["lora_b"], np.float64)
      merged["layers"][module][name]["kernel"] = jnp.asarray(
        w + config.lora_scale * np.einsum("lir,lro->lio", a, b), jnp.float32
      )
  np.testing.assert_allclose(forward(merged), logits, atol=2e-5)
  np.testing.assert_allclose(forward(lora.merge(adapted, config.lora_scale)), logits, atol=2e-5)


def test_an_adapter_on_the_lm_head_moves_the_logits_past_the_frozen_heads_bound():
  """The head's adapter: logits h (W + s A B), h the final norm's output; merged, the same."""
  config = tiny.model_config().replace(lora_rank=2, lora_alpha=4.0, lora_targets=("lm_head",))
  params = qwen.init_params(config, jax.random.key(0))
  adapters, base = lora.split(params)
  assert list(adapters) == ["lm_head"]
  assert adapters["lm_head"]["lora_a"].shape == (64, 2)
  assert adapters["lm_head"]["lora_b"].shape == (2, 512)
  ids, pos = _inputs(config)
  forward = jax.jit(lambda p: qwen.forward(p, ids, pos, config=config)[0])
  np.testing.assert_array_equal(forward(params), forward(base))  # B = 0: the base exactly
  moved = {"lm_head": dict(adapters["lm_head"], lora_b=jnp.full((2, 512), 3.0).at[:, 7].set(-3))}
  logits = forward(lora.combine(base, moved))
  # NumPy: the final hidden state h from the base (the head does not change it), times W + s A B.
  h = np.asarray(qwen.hidden_states(base, ids, pos, config=config)[0], np.float64)
  a, b = (np.asarray(moved["lm_head"][k], np.float64) for k in ("lora_a", "lora_b"))
  w = np.asarray(base["lm_head"]["kernel"], np.float64) + config.lora_scale * a @ b
  np.testing.assert_allclose(logits, h @ w, rtol=1e-4, atol=1e-4)
  base_bound = np.abs(forward(base)).max()
  assert np.abs(logits).max() > 10 * base_bound  # past anything the frozen head can give
  merged = lora.merge(lora.combine(base, moved), config.lora_scale)
  assert sorted(merged["lm_head"]) == ["kernel"]
  np.testing.assert_allclose(forward(merged), logits, rtol=1e-5, atol=1e-5)


def test_adapters_follow_their_kernels_partition_rules():
  assert sharding.param_spec("layers/attn/q_proj/lora_b") == sharding.P(None, None, "tensor")
  assert sharding.param_spec("layers/attn/o_proj/lora_a") == sharding.P(None, "tensor", None)
  assert sharding.param_spec("layers/mlp/up_proj/lora_a") == sharding.P(None, "fsdp", None)
  assert sharding.param_spec("layers/mlp/down_proj/lora_b") == sharding.P(None, None, "fsdp")
  assert sharding.param_spec("lm_head/lora_a") == sharding.P("fsdp", None)
  assert sharding.param_spec("lm_head/lora_b") == sharding.P(None, "tensor")


@pytest.mark.parametrize(
  "key, value, allowed",
  [
    ("rank", -1, "an int >= 0"),
    ("targets", "q_proj,attn", "comma-separated names"),
    ("quantize", "int4", "one of \\['none', 'int8', 'nf4'\\]$"),
  ],
)
def test_a_bad_lora_key_names_it(key, value, allowed):
  from experiments import configs  # noqa: PLC0415

  config = configs.get_config("synthetic")
  config.model.lora[key] = value
  with pytest.raises(config_lib.ConfigError, match=rf"model\.lora\.{key}=.*{allowed}"):
    config_lib.typed(config)


def test_a_quantized_base_without_adapters_is_refused_naming_both_keys():
  from experiments import configs  # noqa: PLC0415

  config = configs.get_config("synthetic")
  config.model.lora.quantize = "nf4"
  with pytest.raises(
    config_lib.ConfigError, match=r"model\.lora\.quantize='nf4' needs model\.lora\.rank > 0"
  ):
    config_lib.typed(config)


def test_an_adapter_on_a_tied_head_is_refused_naming_the_key():
  from seeupo_jax import fields  # noqa: PLC0415

  tied = tiny.model_config().replace(tie_word_embeddings=True)
  with pytest.raises(fields.FieldError, match="lora_targets=.*tie_word_embeddings=True"):
    tied.replace(lora_rank=2, lora_targets=("q_proj", "lm_head"))
  tied.replace(lora_rank=2, lora_targets=("q_proj",))  # the layers' projections are fine
