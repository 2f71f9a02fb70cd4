"""The decode layout (tensor-parallel, compute-dtype params for the sampler) on 8 CPU devices.

Also the HLO reader that counts the collective bytes of a compiled program.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest, parameterized
from jax.sharding import NamedSharding, PartitionSpec as P

from seeupo_jax.sampling import layout as decode_layout
from seeupo_jax.devtools import hlo_collectives
from seeupo_jax import sampling
from seeupo_jax import sharding
from seeupo_jax.models import qwen
import tiny

# A loop of 3 known trips holding an all-gather and a tuple all-reduce, inside a loop with no
# known trip count (one decode step = one iteration); one op outside both.
_HLO = """HloModule jit_f, is_scheduled=true, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%add_promoted (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%layer_body (p: (s32[], f32[16,4])) -> (s32[], f32[16,4]) {
  %p = (s32[], f32[16,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %w = f32[16,4]{1,0} get-tuple-element(%p), index=1
  %w.shard = f32[2,4]{1,0} slice(%w), slice={[0:2], [0:4]}
  %all-gather.1 = f32[16,4]{1,0} all-gather(%w.shard), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}
  %h = bf16[4,8]{1,0} parameter(1)
  %all-reduce.1 = (f32[16,4]{1,0}, bf16[4,8]{1,0}) all-reduce(%all-gather.1, %h), channel_id=2, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, to_apply=%add
  ROOT %t = (s32[], f32[16,4]{1,0}) tuple(%i, %w)
}

%layer_cond (p: (s32[], f32[16,4])) -> pred[] {
  %p = (s32[], f32[16,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%step_body (q: (s32[], f32[16,4], bf16[8])) -> (s32[], f32[16,4], bf16[8]) {
  %q = (s32[], f32[16,4]{1,0}, bf16[8]{0}) parameter(0)
  %v = bf16[8]{0} get-tuple-element(%q), index=2
  %all-reduce.2 = f32[8]{0} all-reduce(%v), channel_id=3, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add_promoted
  %tuple.1 = (s32[], f32[16,4]{1,0}) tuple(%i, %w)
  %while.1 = (s32[], f32[16,4]{1,0}) while(%tuple.1), condition=%layer_cond, body=%layer_body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %r = (s32[], f32[16,4]{1,0}, bf16[8]{0}) tuple(%i, %w, %v)
}

%step_cond (q: (s32[], f32[16,4], bf16[8])) -> pred[] {
  %q = (s32[], f32[16,4]{1,0}, bf16[8]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[16,4], b: f32[4,4]) -> f32[16,4] {
  %a = f32[16,4]{1,0} parameter(0)
  %b = f32[4,4]{1,0} parameter(1)
  %collective-permute.1 = f32[4,4]{1,0} collective-permute(%b), channel_id=4, source_target_pairs={{0,1},{1,0}}
  %tuple.2 = (s32[], f32[16,4]{1,0}, bf16[8]{0}) tuple(%i, %a, %v)
  %while.2 = (s32[], f32[16,4]{1,0}, bf16[8]{0}) while(%tuple.2), condition=%step_cond, body=%step_body, backend_config={"known_induction_variable":{"tuple_index":"0"}}
  ROOT %out = f32[16,4]{1,0} get-tuple-element(%while.2), index=1
}
"""


# The same program with a loop without a known trip count inside each layer (as the paged
# attention's walk over page blocks, whose trip count follows the rows' lengths).
_BLOCKS = """
%blk_body (b: (s32[])) -> (s32[]) {
  %b = (s32[]) parameter(0)
  ROOT %bt = (s32[]) tuple(%b)
}

%blk_cond (b: (s32[])) -> pred[] {
  %b = (s32[]) parameter(0)
  %bi = s32[] get-tuple-element(%b), index=0
  ROOT %blt = pred[] compare(%bi, %bi), direction=LT
}
"""
_HLO_NESTED = _HLO.replace("%layer_body (p:", _BLOCKS.lstrip() + "\n%layer_body (p:").replace(
  "  ROOT %t = (s32[], f32[16,4]{1,0}) tuple(%i, %w)",
  "  %blk = (s32[]) tuple(%i)\n"
  "  %while.3 = (s32[]) while(%blk), condition=%blk_cond, body=%blk_body\n"
  "  ROOT %t = (s32[], f32[16,4]{1,0}) tuple(%i, %w)",
)


class HloCollectivesTest(parameterized.TestCase):
  def test_the_decode_loop_is_the_outermost_loop_without_a_trip_count(self):
    self.assertEqual(sorted(hlo_collectives.dynamic_loops(_HLO_NESTED)), ["blk_body", "step_body"])
    self.assertEqual(hlo_collectives.dynamic_loop(_HLO_NESTED), "step_body")
    ops = hlo_collectives.collectives(_HLO_NESTED, "step_body")
    self.assertEqual({op.name for op in ops}, {"all-gather.1", "all-reduce.1", "all-reduce.2"})
    two = _HLO.replace(
      "%while.2 = ",
      "%while.4 = (s32[], f32[16,4]{1,0}, bf16[8]{0}) while("
      "%tuple.2), condition=%step_cond, body=%step_body\n  %while.2 = ",
    )
    with self.assertRaisesRegex(ValueError, "found 2"):
      hlo_collectives.dynamic_loop(two)

  def test_one_decode_step_counts_the_layer_loop_trips(self):
    body = hlo_collectives.dynamic_loop(_HLO)
    self.assertEqual(body, "step_body")
    ops = {op.name: op for op in hlo_collectives.collectives(_HLO, body)}
    self.assertEqual(set(ops), {"all-gather.1", "all-reduce.1", "all-reduce.2"})
    gather, reduce_tuple, promoted = ops["all-gather.1"], ops["all-reduce.1"], ops["all-reduce.2"]
    # all-gather: a 2x4 f32 shard (32 bytes) over 8 devices, 3 trips; 7 shards arrive.
    self.assertEqual((gather.operand_bytes, gather.group_size, gather.count), (32, 8, 3))
    self.assertEqual(gather.link_bytes, 32 * 7)
    # The tuple all-reduce: f32[16,4] (256 bytes) + bf16[4,8] (64 bytes), groups of 4.
    self.assertEqual((reduce_tuple.operand_bytes, reduce_tuple.group_size), (320, 4))
    self.assertEqual(reduce_tuple.link_bytes, 2 * 320 * 3 / 4)
    self.assertFalse(reduce_tuple.promoted)
    # Explicit groups of 2; the `_promoted` reducer marks a widened bf16 reduction.
    self.assertEqual((promoted.operand_bytes, promoted.group_size, promoted.count), (16, 2, 1))
    self.assertTrue(promoted.promoted)
    totals = hlo_collectives.summarize(hlo_collectives.collectives(_HLO, body))
    self.assertEqual(totals["all-gather"]["ops"], 3)
    self.assertEqual(totals["total"]["link_bytes"], 3 * 224 + 3 * 480 + 16)
    self.assertEqual(totals["total"]["promoted_link_bytes"], 16)

  def test_whole_program_adds_the_ops_outside_the_loops(self):
    ops = hlo_collectives.collectives(_HLO)
    names = sorted(op.name for op in ops)
    self.assertEqual(
      names, ["all-gather.1", "all-reduce.1", "all-reduce.2", "collective-permute.1"]
    )
    permute = [op for op in ops if op.kind == "collective-permute"][0]
    self.assertEqual((permute.operand_bytes, permute.link_bytes), (64, 64))

  def test_shape_bytes(self):
    self.assertEqual(hlo_collectives.shape_bytes("f32[8,4]{1,0}"), 128)
    self.assertEqual(hlo_collectives.shape_bytes("(bf16[2,3]{1,0}, pred[], s32[4])"), 12 + 1 + 16)


def _tiny(dtype, **changes):
  return tiny.model_config(dtype=dtype, param_dtype="float32").replace(**changes)


def learner_shard(params, mesh):
  return jax.device_put(params, sharding.param_shardings(params, mesh))


def _learner_params(config, mesh):
  """Random float32 params (normal(0.05), norm scales 1 + normal(0.05)) in the learner layout.

  Drawn with NumPy: `qwen.init_params` runs eagerly, op by op, and costs seconds on a busy CPU.
  """
  rng = np.random.default_rng(0)

  def draw(path, leaf):
    x = rng.normal(0.0, 0.05, leaf.shape).astype(np.float32)
    return x + 1.0 if sharding.path_name(path).endswith("scale") else x

  shapes = qwen.params_shape(config)
  params = jax.tree_util.tree_map_with_path(draw, shapes)
  return jax.device_put(params, sharding.param_shardings(shapes, mesh))


class DecodeLayoutTest(parameterized.TestCase):
  def test_decode_mesh_keeps_the_devices_in_order(self):
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    self.assertEqual(
      dict(decode_layout.decode_mesh(mesh).shape), {"data": 2, "fsdp": 1, "tensor": 4}
    )
    mesh = sharding.make_mesh(fsdp=-1)
    dm = decode_layout.decode_mesh(mesh, tensor=4)
    self.assertEqual(dict(dm.shape), {"data": 2, "fsdp": 1, "tensor": 4})
    self.assertEqual(list(dm.devices.flat), list(mesh.devices.flat))
    with self.assertRaisesRegex(ValueError, "divisor of 8"):
      decode_layout.decode_mesh(mesh, tensor=3)

  @parameterized.named_parameters(("heads_divide", 2, "tensor"), ("heads_do_not", 8, None))
  def test_attention_over_tensor_only_when_the_kv_heads_divide(self, tensor, head_axis):
    config = _tiny("float32")  # 4 query heads, 2 kv heads
    layout = decode_layout.DecodeLayout(config, sharding.make_mesh(fsdp=-1), tensor=tensor)
    specs = jax.tree.map(lambda s: s.spec, layout.shardings)
    attn = specs["layers"]["attn"]
    expect = P(None, None, "tensor") if head_axis else P()
    self.assertEqual(attn["q_proj"]["kernel"], expect)
    self.assertEqual(attn["o_proj"]["kernel"], P(None, "tensor", None) if head_axis else P())
    self.assertEqual(specs["layers"]["mlp"]["up_proj"]["kernel"], P(None, None, "tensor"))
    self.assertEqual(specs["layers"]["mlp"]["down_proj"]["kernel"], P(None, "tensor", None))
    self.assertEqual(specs["lm_head"]["kernel"], P(None, "tensor"))
    cache = layout.cache_sharding(qwen.init_cache(config, 8, 16))
    self.assertEqual(cache.keys.spec[2], head_axis)
    # The sampler's paged pool [L, pages, K, page, hd]: kv heads over "tensor" only (every row
    # may own any page, so the pool is not split over the rows' axes).
    paged = layout.cache_sharding(qwen.init_paged_cache(config, 9, 8))
    for spec in (paged.keys.spec, paged.values.spec):
      self.assertEqual(tuple(spec) + (None,) * (5 - len(spec)), (None, None, head_axis, None, None))

  def test_reshard_casts_moves_and_reuses_the_previous_buffers(self):
    config = _tiny("bfloat16")
    mesh = sharding.make_mesh(fsdp=-1)
    params = _learner_params(config, mesh)
    layout = decode_layout.DecodeLayout(config, mesh, tensor=4)
    first = layout(params)
    for got, want, s in zip(
      jax.tree.leaves(first), jax.tree.leaves(params), jax.tree.leaves(layout.shardings)
    ):
      self.assertEqual(got.dtype, jnp.bfloat16)
      self.assertEqual(got.sharding, s)
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(jnp.bfloat16)))
    self.assertIs(layout(params), first)  # the same params: no reshard

    def pointers(tree):
      return [
        s.data.unsafe_buffer_pointer()
        for leaf in (tree["layers"]["mlp"]["up_proj"]["kernel"], tree["lm_head"]["kernel"])
        for s in leaf.addressable_shards
      ]

    before = pointers(first)
    updated = jax.tree.map(lambda x: x + 1.0, params)
    second = layout(updated)
    self.assertTrue(first["layers"]["mlp"]["up_proj"]["kernel"].is_deleted())  # donated
    self.assertEqual(pointers(second), before)  # written into the previous copy's buffers
    np.testing.assert_array_equal(
      np.asarray(second["embed"]["embedding"]),
      np.asarray(updated["embed"]["embedding"].astype(jnp.bfloat16)),
    )
    self.assertFalse(params["embed"]["embedding"].is_deleted())  # the learner's params stay

  @pytest.mark.slow  # two layouts compiled
  def test_a_quantized_base_keeps_its_codes_and_dequantizes_to_the_learners_kernel(self):
    """QLoRA's base through the reshard: the integer codes keep their dtype (a cast would hold
    them in bf16, twice an int8 base's bytes), the floats take the compute dtype, and the
    sampler's dequantized kernel is the learner's (a bf16 base: the scales already bf16)."""
    from seeupo_jax.models import quant  # noqa: PLC0415

    for fmt, codes, dtype in (("int8", "kernel_int8", jnp.int8), ("nf4", "kernel_nf4", jnp.uint8)):
      config = tiny.model_config(dtype="bfloat16", param_dtype="bfloat16", quantize=fmt)
      mesh = sharding.make_mesh(fsdp=-1)
      plain = _learner_params(config.replace(quantize="none"), mesh)
      plain = jax.tree.map(lambda x: x.astype(jnp.bfloat16), plain)
      params = learner_shard(quant.quantize_params(plain, fmt), mesh)
      layout = decode_layout.DecodeLayout(config, mesh, tensor=4)
      copy = layout(params)
      for got, s in zip(jax.tree.leaves(copy), jax.tree.leaves(layout.shardings)):
        self.assertEqual(got.sharding, s)
      leaves = copy["layers"]["mlp"]["down_proj"]
      self.assertEqual(leaves[codes].dtype, dtype)
      self.assertEqual(leaves["kernel_scale"].dtype, jnp.bfloat16)
      np.testing.assert_array_equal(
        np.asarray(quant.dequantize(leaves, jnp.bfloat16), np.float32),
        np.asarray(
          quant.dequantize(params["layers"]["mlp"]["down_proj"], jnp.bfloat16), np.float32
        ),
      )

  def test_a_layout_on_devices_of_its_own_holds_one_cast_copy_there(self):
    """`devices=`: the copy is the learner's params cast to the compute dtype, in the decode
    layout on those devices only; the next copy deletes the previous one first; the learner's
    params stay. Devices the learner also has are refused."""
    config = _tiny("bfloat16")
    devices = jax.devices()
    mesh = sharding.make_mesh(fsdp=-1, devices=devices[:4])
    params = _learner_params(config, mesh)
    layout = decode_layout.DecodeLayout(config, mesh, devices=devices[4:])
    self.assertTrue(layout.separate)
    self.assertEqual(dict(layout.mesh.shape), {"data": 1, "fsdp": 1, "tensor": 4})
    first = layout(params)
    for got, want, s in zip(
      jax.tree.leaves(first), jax.tree.leaves(params), jax.tree.leaves(layout.shardings)
    ):
      self.assertEqual(got.dtype, jnp.bfloat16)
      self.assertEqual(got.sharding, s)
      self.assertEqual({d.id for d in got.devices()} - {4, 5, 6, 7}, set())
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(jnp.bfloat16)))
    self.assertIs(layout(params), first)  # the same params: no copy
    updated = jax.tree.map(lambda x: x + 1.0, params)
    second = layout(updated)
    self.assertTrue(first["lm_head"]["kernel"].is_deleted())
    np.testing.assert_array_equal(
      np.asarray(second["lm_head"]["kernel"]),
      np.asarray(updated["lm_head"]["kernel"].astype(jnp.bfloat16)),
    )
    self.assertFalse(params["lm_head"]["kernel"].is_deleted())
    with self.assertRaisesRegex(ValueError, r"others than the learner's; shared: \[3\]"):
      decode_layout.DecodeLayout(config, mesh, devices=devices[3:])
    with self.assertRaisesRegex(ValueError, "divisor of 4 devices, got 3"):
      decode_layout.DecodeLayout(config, mesh, devices=devices[4:], tensor=3)


class DecodeSamplerTest(parameterized.TestCase):
  """The session's decode program on the decode layout: same tokens, and a decode step free of
  weight gathers."""

  # On the class: marks on a method that `named_parameters` expands are lost.
  pytestmark = [pytest.mark.slow, pytest.mark.fresh_compiles]
  B, S, N, PAGE = 8, 6, 6, 4

  def _compile(self, config, mesh, params):
    """Prefills B rows (`_prefill_jit`, as `SamplerSession.prefill` does), then compiles the
    session's decode program (`_decode_jit`, N steps: every reply to its end) and runs it.

    Returns (the decode program's HLO text, the rows after it)."""
    sc = sampling.SamplingConfig(max_new_tokens=self.N)
    cache_sharding = functools.partial(sharding.cache_shardings, mesh=mesh)
    statics = dict(model_config=config, sampling_config=sc, cache_sharding=cache_sharding)
    b, pages = self.B, -(-(self.S + self.N) // self.PAGE)  # pages per row
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, config.vocab_size, (b, self.S)), jnp.int32)
    valid = jnp.asarray(np.arange(self.S)[None, :] >= np.arange(b)[:, None] % 3)
    table = jnp.asarray(1 + np.arange(b * pages).reshape(b, pages), jnp.int32)  # page 0: scratch
    keys = jax.random.key_data(jax.random.split(jax.random.key(3), b))
    with jax.set_mesh(mesh):
      cache = qwen.init_paged_cache(config, 1 + b * pages, self.PAGE)
      cache = jax.device_put(cache, cache_sharding(cache))
      rows = sampling.init_rows(cache, b, 0, self.N, sc.pad_id)
      call = sampling.PrefillCall(
        row_ids=jnp.arange(b, dtype=jnp.int32),
        fresh=jnp.ones((b,), bool),
        ids=ids,
        valid=valid,
        begin=jnp.ones((b,), bool),  # every row begins its reply
        keys=keys,
        limits=jnp.full((b,), self.N, jnp.int32),
      )
      rows = sampling._prefill_jit(params, rows, table, *call, **statics)
      compiled = sampling._decode_jit.lower(params, rows, table, num_steps=self.N, **statics)
      compiled = compiled.compile()
      rows, _ = compiled(params, rows, table)
    return compiled.as_text(), jax.device_get(rows)

  def _learner_and_decode(self, config, tensor):
    mesh = sharding.make_mesh(fsdp=-1)
    params = _learner_params(config, mesh)
    layout = decode_layout.DecodeLayout(config, mesh, tensor=tensor)
    before = self._compile(config, mesh, params)
    after = self._compile(layout.model_config, layout.mesh, layout(params))
    return before, after

  @parameterized.named_parameters(
    ("f32_tensor8", "float32", 8, 8, 1e-5),
    ("bf16_tensor4_data2", "bfloat16", 4, 4, 2e-2),
  )
  def test_same_tokens_and_no_weight_gathers_per_step(self, dtype, tensor, kv_heads, logp_tol):
    config = _tiny(dtype, num_heads=8, num_kv_heads=kv_heads)
    (hlo_before, out_before), (hlo_after, out_after) = self._learner_and_decode(config, tensor)
    np.testing.assert_array_equal(out_after.tokens, out_before.tokens)
    np.testing.assert_array_equal(out_after.steps, out_before.steps)
    np.testing.assert_array_equal(out_after.steps, self.N)  # no stop tokens: every row ran N
    np.testing.assert_allclose(out_after.logprobs, out_before.logprobs, atol=logp_tol)

    def step(text):
      return hlo_collectives.collectives(text, hlo_collectives.dynamic_loop(text))

    before, after = step(hlo_before), step(hlo_after)
    layers = config.num_layers
    # Before: the layer scan all-gathers the layer's FSDP-sharded float32 weights, every layer.
    gathered = sum(
      op.count * op.operand_bytes * op.group_size for op in before if op.kind == "all-gather"
    )
    layer_weights = sum(
      x.size * 4 for x in jax.tree.leaves(qwen.params_shape(config)["layers"]) if x.ndim == 3
    )
    self.assertGreaterEqual(gathered, layer_weights)
    self.assertTrue(any(op.kind == "all-gather" and op.count == layers for op in before))
    # After: no weight gather. The all-gathers bigger than a row's sampling statistics are
    # the step's new keys and values, one each, over the data replicas only: the paged pool
    # is replicated over "data" (any row may own any page), so every replica writes every
    # row's new slot ([L, rows per replica, kv heads per device, hd], float32 at most).
    data = 8 // tensor
    rows = self.B // data  # per data replica
    kv_local = kv_heads // tensor if kv_heads % tensor == 0 else kv_heads
    new_kv = layers * rows * kv_local * config.head_dim * 4
    big = [op for op in after if op.kind == "all-gather" and op.operand_bytes > 8 * self.B]
    self.assertLen(big, 2 if data > 1 else 0)
    for op in big:
      self.assertEqual((op.group_size, op.count), (data, 1))
      self.assertLessEqual(op.operand_bytes, new_kv)
    hidden = rows * config.hidden_size * 4  # [rows, 1, D]; XLA:CPU reduces bf16 in float32
    per_layer = [op for op in after if op.operand_bytes == hidden and op.count == layers]
    self.assertLen(per_layer, 2 if tensor > 1 and kv_heads % tensor == 0 else 1)
    link_before = sum(op.count * op.link_bytes for op in before)
    link_after = sum(op.count * op.link_bytes for op in after)
    self.assertLess(link_after, link_before / 4)


if __name__ == "__main__":
  absltest.main()
