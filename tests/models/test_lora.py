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


def test_adapters_follow_their_kernels_partition_rules():
  assert sharding.param_spec("layers/attn/q_proj/lora_b") == sharding.P(None, None, "tensor")
  assert sharding.param_spec("layers/attn/o_proj/lora_a") == sharding.P(None, "tensor", None)
  assert sharding.param_spec("layers/mlp/up_proj/lora_a") == sharding.P(None, "fsdp", None)
  assert sharding.param_spec("layers/mlp/down_proj/lora_b") == sharding.P(None, None, "fsdp")


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
