"""A quantized base (`models/quant.py`): int8 and NF4 codes against NumPy, the model on them
against the model on their dequantized kernels, the adapters' gradient through them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seeupo_jax import sharding
from seeupo_jax.models import lora
from seeupo_jax.models import quant
from seeupo_jax.models import qwen
import tiny


def _weights(shape, seed=0):
  return np.asarray(jax.random.normal(jax.random.key(seed), shape, jnp.float32)) * 0.02


def test_int8_codes_and_scales_are_numpys_and_within_half_a_step():
  w = _weights((3, 128, 40))
  w[1, :, 5] = 0.0  # an all-zero column: scale 1, codes 0
  q = quant.quantize_int8(jnp.asarray(w))
  scale = np.abs(w).max(axis=-2, keepdims=True) / 127.0
  scale[scale == 0] = 1.0
  codes = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
  np.testing.assert_array_equal(np.asarray(q["kernel_int8"]), codes)
  np.testing.assert_allclose(np.asarray(q["kernel_scale"]), scale, rtol=1e-6)
  back = np.asarray(quant.dequantize(q, jnp.float32), np.float64)
  # |code * scale' - w| <= scale / 2 + |code| |scale' - scale|, |code| <= 127, and scale' (the
  # program's float32 scale) within the rtol above of NumPy's.
  assert np.all(np.abs(back - w) <= scale * (0.5 + 127 * 1e-6))
  assert np.all(back[1, :, 5] == 0)


def test_nf4_codes_are_the_nearest_table_value_per_block_of_64():
  w = _weights((2, 256, 24), seed=1)
  q = quant.quantize_nf4(jnp.asarray(w))
  assert q["kernel_nf4"].dtype == jnp.uint8 and q["kernel_nf4"].shape == (2, 128, 24)
  assert q["kernel_scale"].shape == (2, 4, 24)
  # NumPy: per block of 64 rows, the nearest of the 16 values to w / absmax.
  blocks = w.reshape(2, 4, 64, 24)
  absmax = np.abs(blocks).max(axis=2, keepdims=True)
  normed = (blocks / absmax).reshape(2, 256, 24)
  codes = np.argmin(np.abs(normed[..., None] - quant.NF4), axis=-1)
  unpacked = np.stack(
    [np.asarray(q["kernel_nf4"]) & 15, np.asarray(q["kernel_nf4"]) >> 4], axis=-2
  ).reshape(2, 256, 24)
  np.testing.assert_array_equal(unpacked, codes)
  np.testing.assert_allclose(np.asarray(q["kernel_scale"]), absmax[:, :, 0], rtol=1e-7)
  expected = (quant.NF4[codes].reshape(2, 4, 64, 24) * absmax).reshape(2, 256, 24)
  np.testing.assert_allclose(np.asarray(quant.dequantize(q, jnp.float32)), expected, rtol=1e-6)
  # Within half the widest gap of the table (0.3038 of the block's absmax) of the weight.
  gap = np.max(np.diff(quant.NF4)) / 2
  err = np.abs(expected - w).reshape(2, 4, 64, 24)
  assert np.all(err <= gap * absmax * (1 + 1e-6))


def test_nf4_refuses_input_features_not_a_multiple_of_64():
  with pytest.raises(ValueError, match="blocks of 64 input features; this kernel has 96"):
    quant.quantize_nf4(jnp.zeros((96, 8)))


@pytest.mark.slow  # the model's forward and gradient on three kinds of base, eagerly
@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_the_model_on_a_quantized_base_is_the_model_on_its_dequantized_kernels(fmt):
  config = tiny.model_config().replace(lora_rank=4, lora_targets=("q_proj", "o_proj", "up_proj"))
  quantized_config = config.replace(quantize=fmt)
  params = qwen.init_params(quantized_config, jax.random.key(0))
  # init_params quantizes the same draw the float model gets.
  plain = qwen.init_params(config, jax.random.key(0))
  attn = params["layers"]["attn"]["q_proj"]
  assert "kernel" not in attn and quant.is_quantized(attn)
  np.testing.assert_array_equal(
    quant.dequantize(attn, jnp.float32),
    quant.dequantize(quant.quantize_params(plain, fmt)["layers"]["attn"]["q_proj"], jnp.float32),
  )
  assert params["embed"]["embedding"].dtype == jnp.float32  # only the projections
  # Adapters moved off zero, so the adapted path is exercised too.
  keys = iter(jax.random.split(jax.random.key(5), 16))
  adapters, base = lora.split(params)
  adapters = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape), adapters)
  dense_base = quant.dequantize_params(base, jnp.float32)
  assert "kernel" in dense_base["layers"]["mlp"]["down_proj"]

  ids = jax.random.randint(jax.random.key(1), (2, 7), 0, config.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(7), (2, 7))

  def logits(p, c):
    return qwen.forward(p, ids, pos, config=c)[0]

  ours = logits(lora.combine(base, adapters), quantized_config)
  reference = logits(lora.combine(dense_base, adapters), config)
  np.testing.assert_allclose(ours, reference, atol=1e-5)
  # The base's error is the quantization's: logits move off the float model's.
  assert float(jnp.abs(logits(plain, config) - logits(params, quantized_config)).max()) > 1e-4

  # The adapters' gradient through the quantized base is the gradient through its
  # dequantized kernels (the codes have none).
  def loss(a, b, c):
    return jnp.sum(jax.nn.log_softmax(logits(lora.combine(b, a), c))[..., 3])

  g_ours = jax.grad(loss)(adapters, base, quantized_config)
  g_ref = jax.grad(loss)(adapters, dense_base, config)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-5), g_ours, g_ref)

  # The export merges onto the dequantized base.
  merged = lora.merge(lora.combine(base, adapters), config.lora_scale)
  np.testing.assert_allclose(logits(merged, config.replace(lora_rank=0)), reference, atol=2e-5)


def test_quantized_leaves_follow_their_kernels_partition_rules():
  assert sharding.param_spec("layers/attn/q_proj/kernel_int8") == sharding.P(None, "fsdp", "tensor")
  assert sharding.param_spec("layers/mlp/down_proj/kernel_nf4") == sharding.P(
    None, "tensor", "fsdp"
  )
  assert sharding.param_spec("layers/attn/o_proj/kernel_scale") == sharding.P(
    None, "tensor", "fsdp"
  )


def test_a_checkpoint_loads_quantized_kernel_by_kernel_onto_the_rules(tmp_path):
  from seeupo_jax.models import checkpoint as hf_checkpoint  # noqa: PLC0415

  config = tiny.model_config()
  params = qwen.init_params(config, jax.random.key(0))
  hf_checkpoint.save(params, config, str(tmp_path))
  mesh = sharding.make_mesh(fsdp=-1)
  for fmt in ("int8", "nf4"):
    loaded = hf_checkpoint.load_params(str(tmp_path), config.replace(quantize=fmt), mesh)
    want = quant.quantize_params(params, fmt)
    assert jax.tree.structure(loaded) == jax.tree.structure(want)
    jax.tree.map(
      lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), loaded, want
    )
    shardings = sharding.param_shardings(loaded, mesh)
    for got, s in zip(jax.tree.leaves(loaded), jax.tree.leaves(shardings)):
      assert got.sharding.is_equivalent_to(s, got.ndim)
