"""Mesh helper, partition rules, and sharded == unsharded model computations (8 CPU devices)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from jax.sharding import NamedSharding, PartitionSpec as P

from seeupo_jax import sharding
from seeupo_jax.models import config as config_lib
from seeupo_jax.models import qwen
import tiny


class MeshTest(parameterized.TestCase):
  def test_make_mesh_fills_minus_one(self):
    self.assertLen(jax.devices(), 8)
    mesh = sharding.make_mesh(data=2, fsdp=-1, tensor=2)
    self.assertEqual(dict(mesh.shape), {"data": 2, "fsdp": 2, "tensor": 2})

  @parameterized.parameters(
    (dict(data=3, fsdp=1, tensor=1),),
    (dict(data=-1, fsdp=-1),),
    (dict(data=3, fsdp=-1),),
    (dict(tensor=0),),
  )
  def test_make_mesh_rejects_bad_sizes(self, sizes):
    with self.assertRaisesRegex(ValueError, "mesh sizes|devices"):
      sharding.make_mesh(**sizes)

  def test_fit_spec_drops_axes_that_do_not_divide(self):
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    self.assertEqual(
      sharding.fit_spec(P(None, "fsdp", "tensor"), (3, 8, 6), mesh), P(None, "fsdp", "tensor")
    )
    self.assertEqual(
      sharding.fit_spec(P(None, "fsdp", "tensor"), (3, 7, 6), mesh), P(None, None, "tensor")
    )
    self.assertEqual(sharding.fit_spec(P(("data", "fsdp"), None), (6, 4), mesh), P(None, None))
    self.assertEqual(
      sharding.fit_spec(P(("data", "fsdp"), None), (8, 4), mesh), P(("data", "fsdp"), None)
    )

  def test_param_rules(self):
    mesh = sharding.make_mesh(data=1, fsdp=4, tensor=2)
    shapes = qwen.params_shape(config_lib.get_preset("qwen2-tiny"))
    specs = jax.tree.map(lambda s: s.spec, sharding.param_shardings(shapes, mesh))
    self.assertEqual(specs["layers"]["attn"]["q_proj"]["kernel"], P(None, "fsdp", "tensor"))
    self.assertEqual(specs["layers"]["attn"]["k_proj"]["bias"], P(None, "tensor"))
    self.assertEqual(specs["layers"]["attn"]["o_proj"]["kernel"], P(None, "tensor", "fsdp"))
    self.assertEqual(specs["layers"]["mlp"]["down_proj"]["kernel"], P(None, "tensor", "fsdp"))
    self.assertEqual(specs["lm_head"]["kernel"], P("fsdp", "tensor"))
    self.assertEqual(specs["final_norm"]["scale"], P(None))


class ShardedModelTest(parameterized.TestCase):
  @pytest.mark.slow
  def test_sharded_forward_decode_and_grad_equal_unsharded(self):
    config = tiny.model_config()
    params = qwen.init_params(config, jax.random.key(0))
    rng = np.random.default_rng(0)
    b, s = 4, 12
    ids = jnp.asarray(rng.integers(0, config.vocab_size, (b, s)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    valid = jnp.asarray(np.arange(s)[None, :] >= np.array([0, 3, 5, 0])[:, None])

    def run(params, ids, positions, valid, cache):
      logits, _ = qwen.forward(params, ids, positions, valid, config=config)
      prefill, cache = qwen.forward(
        params, ids[:, :-1], positions[:, :-1], valid[:, :-1], cache, config=config
      )
      step, cache = qwen.forward(
        params, ids[:, -1:], positions[:, -1:], valid[:, -1:], cache, config=config
      )
      loss = lambda p: jnp.sum(
        jnp.where(valid, qwen.token_logprobs(p, ids, ids, positions, valid, config=config), 0)
      )
      return logits, jnp.concatenate([prefill, step], axis=1), jax.grad(loss)(params)

    cache = qwen.init_cache(config, b, 16)
    expected = jax.jit(run)(params, ids, positions, valid, cache)

    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    batch = NamedSharding(mesh, sharding.TOKENS)
    sharded_params = jax.device_put(params, sharding.param_shardings(params, mesh))
    sharded_cache = jax.device_put(cache, sharding.cache_shardings(cache, mesh))
    self.assertEqual(
      sharded_cache.keys.sharding.spec, P(None, ("data", "fsdp"), "tensor", None, None)
    )
    inputs = [jax.device_put(x, batch) for x in (ids, positions, valid)]
    with jax.set_mesh(mesh):
      got = jax.jit(run)(sharded_params, *inputs, sharded_cache)
    logits, decoded, grads = got
    self.assertEqual(logits.sharding.spec, sharding.LOGITS)
    m = np.asarray(valid)
    np.testing.assert_allclose(np.asarray(logits)[m], np.asarray(expected[0])[m], atol=1e-5)
    np.testing.assert_allclose(np.asarray(decoded)[m], np.asarray(expected[1])[m], atol=1e-5)
    np.testing.assert_allclose(np.asarray(decoded)[m], np.asarray(expected[0])[m], atol=1e-5)
    jax.tree.map(lambda a, e: np.testing.assert_allclose(a, e, atol=1e-5), grads, expected[2])
