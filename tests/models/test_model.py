"""Qwen2/Qwen3 model: config, forward against a NumPy float64 reference, KV cache, log-probs."""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from seeupo_jax.models import config as config_lib
from seeupo_jax.models import layers
from seeupo_jax.models import qwen
import tiny

# ----------------------------------------------------------------------------- helpers


def random_params(config, seed=0):
  """init_params, then every leaf redrawn so norms and biases matter too."""
  params = qwen.init_params(config, jax.random.key(seed))
  rng = np.random.default_rng(seed)

  def redraw(path, leaf):
    name = jax.tree_util.keystr(path)
    if "scale" in name:
      value = 1.0 + 0.2 * rng.standard_normal(leaf.shape)
    elif "bias" in name:
      value = 0.1 * rng.standard_normal(leaf.shape)
    else:
      value = 0.05 * rng.standard_normal(leaf.shape)
    return jnp.asarray(value, leaf.dtype)

  return jax.tree_util.tree_map_with_path(redraw, params)


def _np_rms(x, scale, eps):
  return scale * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _np_rope(x, positions, theta):
  hd = x.shape[-1]
  inv_freq = theta ** (-np.arange(0, hd, 2) / hd)
  angles = positions[..., None] * inv_freq
  angles = np.concatenate([angles, angles], -1)[:, :, None, :]
  rotated = np.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
  return x * np.cos(angles) + rotated * np.sin(angles)


def np_forward(params, input_ids, positions, token_valid, config):
  """Float64 NumPy forward written from the HF Qwen2/Qwen3 modelling code (no cache)."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  c = config
  b, s = input_ids.shape
  x = p["embed"]["embedding"][input_ids]
  allowed = np.tril(np.ones((s, s), bool))[None, None] & token_valid[:, None, None, :]
  group = c.num_heads // c.num_kv_heads
  for i in range(c.num_layers):
    lp = jax.tree.map(lambda a: a[i], p["layers"])
    at = lp["attn"]
    h = _np_rms(x, lp["input_norm"]["scale"], c.rms_norm_eps)
    q, k, v = (
      h @ at[n]["kernel"] + (at[n]["bias"] if c.attention_bias else 0)
      for n in ("q_proj", "k_proj", "v_proj")
    )
    q = q.reshape(b, s, c.num_heads, c.head_dim)
    k = k.reshape(b, s, c.num_kv_heads, c.head_dim)
    v = v.reshape(b, s, c.num_kv_heads, c.head_dim)
    if c.qk_norm:
      q = _np_rms(q, at["q_norm"]["scale"], c.rms_norm_eps)
      k = _np_rms(k, at["k_norm"]["scale"], c.rms_norm_eps)
    q, k = _np_rope(q, positions, c.rope_theta), _np_rope(k, positions, c.rope_theta)
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scores = np.einsum("bshd,bthd->bhst", q, k) / np.sqrt(c.head_dim)
    scores = np.where(allowed, scores, -1e300)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    o = np.einsum("bhst,bthd->bshd", probs, v).reshape(b, s, -1)
    x = x + o @ at["o_proj"]["kernel"]
    h = _np_rms(x, lp["post_attn_norm"]["scale"], c.rms_norm_eps)
    mlp = lp["mlp"]
    gate = h @ mlp["gate_proj"]["kernel"]
    hidden = gate / (1 + np.exp(-gate)) * (h @ mlp["up_proj"]["kernel"])
    x = x + hidden @ mlp["down_proj"]["kernel"]
  x = _np_rms(x, p["final_norm"]["scale"], c.rms_norm_eps)
  w = p["embed"]["embedding"].T if c.tie_word_embeddings else p["lm_head"]["kernel"]
  return x @ w


def np_log_softmax(logits):
  logits = np.asarray(logits, np.float64)
  m = logits.max(-1, keepdims=True)
  return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))


def left_padded_batch(rng, lengths, total, vocab):
  """ids int32[B, total], positions int32[B, total], valid bool[B, total]; row b has
  lengths[b] real tokens at the right end, positions counting from 0 at its first one."""
  b = len(lengths)
  ids = rng.integers(0, vocab, (b, total)).astype(np.int32)
  valid = np.arange(total)[None, :] >= (total - np.asarray(lengths))[:, None]
  positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0).astype(np.int32)
  return ids, positions, valid


# ----------------------------------------------------------------------------- config


class ConfigTest(parameterized.TestCase):
  @parameterized.parameters(*sorted(config_lib.PRESETS))
  def test_hf_dict_round_trip(self, name):
    config = config_lib.get_preset(name)
    self.assertEqual(config_lib.ModelConfig.from_hf_dict(config.to_hf_dict()), config)

  # Published totals (model cards: "Number of Parameters", and non-embedding where given).
  @parameterized.parameters(
    ("qwen2.5-0.5b", 0.49e9, 0.36e9),
    ("qwen2.5-1.5b", 1.54e9, 1.31e9),
    ("qwen2.5-7b", 7.61e9, 6.53e9),
    ("qwen2.5-14b", 14.7e9, 13.1e9),
    ("qwen3-0.6b", 0.6e9, 0.44e9),
    ("qwen3-14b", 14.8e9, 13.2e9),
    ("qwen3-32b", 32.8e9, 31.2e9),
  )
  def test_preset_parameter_counts_match_model_cards(self, name, total, non_embedding):
    config = config_lib.get_preset(name)
    shapes = qwen.params_shape(config)
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    embed = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    self.assertAlmostEqual(count / total, 1.0, delta=0.02)
    self.assertAlmostEqual((count - embed) / non_embedding, 1.0, delta=0.03)

  def test_unknown_preset_lists_allowed_names(self):
    with self.assertRaisesRegex(ValueError, "qwen3-0.6b"):
      config_lib.get_preset("qwen4-1b")

  @parameterized.parameters(
    (dict(dtype="float16"), "dtype"),
    (dict(remat="some"), "remat"),
    (dict(num_kv_heads=3), "num_kv_heads"),
    (dict(head_dim=15), "head_dim"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(attn_block_size=-1), "attn_block_size"),
  )
  def test_bad_values_name_the_key(self, change, key):
    with self.assertRaisesRegex(ValueError, key):
      tiny.model_config(**change)

  def test_hf_dict_rejects_unsupported(self):
    d = tiny.model_config().to_hf_dict()
    with self.assertRaisesRegex(ValueError, "model_type"):
      config_lib.ModelConfig.from_hf_dict(dict(d, model_type="llama"))
    with self.assertRaisesRegex(ValueError, "rope_type"):
      config_lib.ModelConfig.from_hf_dict(
        dict(d, rope_parameters={"rope_type": "yarn", "rope_theta": 1e6})
      )
    with self.assertRaisesRegex(ValueError, "sliding"):
      config_lib.ModelConfig.from_hf_dict(dict(d, use_sliding_window=True))


# ----------------------------------------------------------------------------- forward


class ForwardTest(parameterized.TestCase):
  @parameterized.parameters("qwen3-tiny", "qwen3-tiny-tied", "qwen2-tiny", "qwen2-tiny-tied")
  def test_matches_numpy_reference_with_left_padding(self, name):
    config = config_lib.get_preset(name, attn_block_size=4)  # several blocks, last one short
    params = random_params(config, seed=1)
    rng = np.random.default_rng(0)
    ids, positions, valid = left_padded_batch(rng, [11, 7, 1], 11, config.vocab_size)
    logits, cache = jax.jit(functools.partial(qwen.forward, config=config))(
      params, ids, positions, valid
    )
    self.assertIsNone(cache)
    self.assertEqual(logits.dtype, jnp.float32)
    expected = np_forward(params, ids, positions, valid, config)
    np.testing.assert_allclose(np.asarray(logits)[valid], expected[valid], atol=1e-4, rtol=0)

  @parameterized.parameters(3, 5, 16)
  def test_causal_attend_equals_masked_attend(self, block_size):
    rng = np.random.default_rng(block_size)
    q = jnp.asarray(rng.standard_normal((2, 13, 6, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 13, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, 13, 2, 8)), jnp.float32)
    valid = jnp.asarray(rng.random((2, 13)) > 0.3)
    allowed = jnp.tril(jnp.ones((13, 13), bool))[None] & valid[:, None, :]
    causal = jax.jit(layers.causal_attend, static_argnums=4)
    np.testing.assert_allclose(
      causal(q, k, v, valid, block_size),
      jax.jit(layers.attend)(q, k, v, allowed),
      atol=1e-6,
    )

  @parameterized.parameters(3, 5, 16)
  def test_causal_attend_gradient_equals_blockwise_autodiff(self, block_size):
    """The hand-written backward pass equals autodiff of the same blockwise attention.

    The reference differentiates `layers.attend` (masked softmax, plain autodiff) on each
    query block over the keys up to the block's end. Row 1 has its first 4 keys invalid, so
    its first queries have no allowed key (uniform average, no gradient to q or k).
    """
    rng = np.random.default_rng(10 + block_size)
    b, s, h, kv, hd = 2, 13, 6, 2, 8
    q = jnp.asarray(rng.standard_normal((b, s, h, hd)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, s, kv, hd)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, s, kv, hd)), jnp.float32)
    valid = jnp.asarray(rng.random((b, s)) > 0.3).at[0, 0].set(True).at[1, :4].set(False)
    cotangent = jnp.asarray(rng.standard_normal((b, s, h * hd)), jnp.float32)

    def blockwise(q, k, v):
      outs = []
      for start in range(0, s, block_size):
        stop = min(start + block_size, s)
        causal = jnp.arange(stop)[None, :] <= jnp.arange(start, stop)[:, None]
        allowed = causal[None] & valid[:, None, :stop]
        outs.append(layers.attend(q[:, start:stop], k[:, :stop], v[:, :stop], allowed))
      return jnp.concatenate(outs, axis=1)

    def loss(fn):
      return lambda q, k, v: jnp.sum(fn(q, k, v) * cotangent)

    ours = jax.jit(
      jax.value_and_grad(
        loss(lambda q, k, v: layers.causal_attend(q, k, v, valid, block_size)), argnums=(0, 1, 2)
      )
    )(q, k, v)
    ref = jax.jit(jax.value_and_grad(loss(blockwise), argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(ours[0], ref[0], rtol=1e-5)
    for got, want, name in zip(ours[1], ref[1], "qkv"):
      np.testing.assert_allclose(got, want, atol=2e-5, err_msg=f"d{name}")
    # Queries with no allowed key pass no gradient to q.
    np.testing.assert_array_equal(np.asarray(ours[1][0])[1, :4], 0.0)

  def test_remat_dots_does_not_recompute_attention(self):
    """remat="dots" keeps the attention's saved values: no dot is recomputed under grad."""
    base = tiny.model_config(attn_block_size=4)
    params = qwen.init_params(base, jax.random.key(0))
    ids = jnp.zeros((2, 9), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))

    def count_dots(remat):
      config = base.replace(remat=remat)
      fn = lambda p: qwen.token_logprobs(p, ids, ids, positions, config=config).sum()
      return str(jax.make_jaxpr(jax.grad(fn))(params)).count("dot_general")

    none, dots, full = count_dots("none"), count_dots("dots"), count_dots("full")
    self.assertEqual(dots, none)
    self.assertGreater(full, none)

  @parameterized.named_parameters(("jit", jax.jit), ("nojit", lambda f: f))
  def test_cached_attend_equals_attend_over_past_and_new_keys(self, variant):
    """The head-major cache and the new keys, scored apart, give `attend` over both."""
    rng = np.random.default_rng(1)
    b, s, t, h, kv, hd = 2, 3, 7, 6, 2, 8
    q = jnp.asarray(rng.standard_normal((b, s, h, hd)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, s, kv, hd)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, s, kv, hd)), jnp.float32)
    past_k = jnp.asarray(rng.standard_normal((b, kv, t, hd)), jnp.float32)
    past_v = jnp.asarray(rng.standard_normal((b, kv, t, hd)), jnp.float32)
    allowed = jnp.asarray(rng.random((b, s, t + s)) > 0.4)
    all_k = jnp.concatenate([past_k.transpose(0, 2, 1, 3), k], axis=1)  # [B, T + S, K, hd]
    all_v = jnp.concatenate([past_v.transpose(0, 2, 1, 3), v], axis=1)
    np.testing.assert_allclose(
      variant(layers.cached_attend)(q, k, v, past_k, past_v, allowed),
      layers.attend(q, all_k, all_v, allowed),
      atol=1e-6,
    )

  @pytest.mark.slow
  def test_scan_unrolled_and_remat_give_same_logits_and_grads(self):
    base = tiny.model_config()
    params = random_params(base, seed=2)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 512, (2, 9)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))

    def loss_and_grad(config):
      fn = lambda p: qwen.token_logprobs(p, ids, ids, positions, config=config).sum()
      return jax.jit(jax.value_and_grad(fn))(params)

    ref_loss, ref_grad = loss_and_grad(base)
    for change in (dict(scan_layers=False, remat="full"), dict(remat="dots")):
      loss, grad = loss_and_grad(base.replace(**change))
      np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=str(change))
      jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, err_msg=str(change)),
        grad,
        ref_grad,
      )

  def test_bfloat16_is_close_to_float32(self):
    f32 = config_lib.get_preset("qwen2-tiny")
    bf16 = f32.replace(dtype="bfloat16", param_dtype="bfloat16")
    params = random_params(f32, seed=3)
    ids = jnp.asarray(np.random.default_rng(3).integers(0, 512, (2, 8)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))
    ref, _ = jax.jit(functools.partial(qwen.forward, config=f32))(params, ids, positions)
    params16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    out, _ = jax.jit(functools.partial(qwen.forward, config=bf16))(params16, ids, positions)
    self.assertEqual(out.dtype, jnp.float32)
    # bf16 has 8 mantissa bits: logits of size ~1 agree to a few 1e-2.
    np.testing.assert_allclose(out, ref, atol=0.1)
    self.assertGreater(np.corrcoef(np.ravel(out), np.ravel(ref))[0, 1], 0.999)


# ----------------------------------------------------------------------------- KV cache


class CacheTest(parameterized.TestCase):
  @parameterized.parameters("qwen3-tiny", "qwen2-tiny-tied")
  def test_prefill_then_decode_equals_full_forward(self, name):
    """Left-padded prompts of different lengths, then one token at a time."""
    config = config_lib.get_preset(name)
    params = random_params(config, seed=4)
    rng = np.random.default_rng(4)
    prompt, new = 6, 4
    ids, positions, valid = left_padded_batch(rng, [6, 3, 1], prompt + new, config.vocab_size)
    valid[:, prompt:] = True
    positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0).astype(np.int32)
    full = np_forward(params, ids, positions, valid, config)

    step = jax.jit(functools.partial(qwen.forward, config=config))
    cache = qwen.init_cache(config, 3, 16)
    logits, cache = step(params, ids[:, :prompt], positions[:, :prompt], valid[:, :prompt], cache)
    outs = [np.asarray(logits)]
    for t in range(prompt, prompt + new):
      logits, cache = step(
        params, ids[:, t : t + 1], positions[:, t : t + 1], valid[:, t : t + 1], cache
      )
      outs.append(np.asarray(logits))
    got = np.concatenate(outs, axis=1)
    np.testing.assert_allclose(got[valid], full[valid], atol=1e-4)
    self.assertEqual(int(cache.index), prompt + new)
    np.testing.assert_array_equal(cache.valid[:, : prompt + new], valid)
    self.assertFalse(np.any(cache.valid[:, prompt + new :]))

  def test_init_cache_shapes_and_dtype(self):
    config = tiny.model_config(dtype="bfloat16")
    cache = qwen.init_cache(config, 2, 7)
    self.assertEqual(cache.keys.shape, (2, 2, 2, 7, 16))  # [L, B, K, T, hd]
    self.assertEqual(cache.values.dtype, jnp.bfloat16)
    self.assertEqual(cache.valid.shape, (2, 7))
    self.assertEqual(int(cache.index), 0)


# ----------------------------------------------------------------------------- log-probs


class TokenLogprobsTest(parameterized.TestCase):
  @parameterized.parameters((1.0, 3), (0.7, 4), (1.3, 64))
  def test_equals_log_softmax_of_forward(self, temperature, chunk_size):
    config = config_lib.get_preset("qwen3-tiny-tied")
    params = random_params(config, seed=5)
    rng = np.random.default_rng(5)
    ids, positions, valid = left_padded_batch(rng, [10, 4], 10, config.vocab_size)
    targets = rng.integers(0, config.vocab_size, ids.shape).astype(np.int32)
    logp = qwen.token_logprobs(
      params,
      ids,
      targets,
      positions,
      valid,
      config=config,
      temperature=temperature,
      chunk_size=chunk_size,
    )
    logits = np_forward(params, ids, positions, valid, config)
    expected = np.take_along_axis(np_log_softmax(logits / temperature), targets[..., None], -1)[
      ..., 0
    ]
    np.testing.assert_allclose(np.asarray(logp)[valid], expected[valid], atol=1e-4)

  @parameterized.parameters(
    # 3 chunks (last padded), 1 chunk, 4 chunks, 2 chunks (a scan of one recomputed chunk).
    ("qwen2-tiny", 1.0, 4),
    ("qwen2-tiny", 0.7, 64),
    ("qwen3-tiny-tied", 1.3, 3),
    ("qwen3-tiny", 1.0, 6),
  )
  def test_chunked_gradient_equals_full_logits_gradient(self, preset, temperature, chunk):
    """The hand-written log-prob gradient equals autodiff of log_softmax of full logits."""
    config = config_lib.get_preset(preset)
    params = random_params(config, seed=6)
    ids = jnp.asarray(np.random.default_rng(6).integers(0, 512, (2, 11)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(11, dtype=jnp.int32), (2, 11))
    weights = jnp.linspace(-1.0, 1.0, 22).reshape(2, 11)

    def chunked(p):
      lp = qwen.token_logprobs(
        p, ids, ids, positions, config=config, chunk_size=chunk, temperature=temperature
      )
      return jnp.sum(weights * lp)

    def full(p):
      logits, _ = qwen.forward(p, ids, positions, config=config)
      lp = jax.nn.log_softmax(logits / temperature)
      lp = jnp.take_along_axis(lp, ids[..., None], -1)[..., 0]
      return jnp.sum(weights * lp)

    g_chunked = jax.jit(jax.grad(chunked))(params)
    g_full = jax.jit(jax.grad(full))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), g_chunked, g_full)

  def test_largest_logits_buffer_is_one_chunk(self):
    """Under jax.grad, no [B, S, V] float32 array appears in the jaxpr."""
    config = tiny.model_config()
    params = qwen.init_params(config, jax.random.key(0))
    b, s, chunk = 2, 32, 8
    ids = jnp.zeros((b, s), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    fn = lambda p: qwen.token_logprobs(
      p, ids, ids, positions, config=config, chunk_size=chunk
    ).sum()
    jaxpr = jax.make_jaxpr(jax.grad(fn))(params)
    sizes = []

    def collect(jpr):
      for eqn in jpr.eqns:
        for var in eqn.outvars:
          shape = getattr(var.aval, "shape", ())
          if len(shape) >= 3 and config.vocab_size in shape:  # logits, not w [D, V]
            sizes.append(int(np.prod(var.aval.shape)))
      for sub in jax.extend.core.subjaxprs(jpr):
        collect(sub)

    collect(jaxpr.jaxpr)
    self.assertNotEmpty(sizes)
    self.assertLessEqual(max(sizes), b * chunk * config.vocab_size)

  @pytest.mark.fresh_compiles
  def test_compiled_head_memory_does_not_grow_with_sequence_times_vocab(self):
    """XLA's buffer assignment for grad of the head: temporaries grow with S only by
    hidden-sized terms, never by [B, S, V] logits (4x the positions add 3 MiB of logits)."""
    b, d, v, chunk = 2, 16, 4096, 8
    chunk_logits_bytes = b * chunk * v * 4

    def temp_bytes(s):
      h = jax.ShapeDtypeStruct((b, s, d), jnp.float32)
      w = jax.ShapeDtypeStruct((d, v), jnp.float32)
      t = jax.ShapeDtypeStruct((b, s), jnp.int32)
      fn = lambda h, w, t: jnp.sum(qwen.logprobs_from_hidden(h, t, w, chunk_size=chunk))
      compiled = jax.jit(jax.grad(fn, argnums=(0, 1))).lower(h, w, t).compile()
      return compiled.memory_analysis().temp_size_in_bytes

    short, long = temp_bytes(32), temp_bytes(128)
    self.assertLessEqual(long - short, 32 * b * (128 - 32) * d)  # hidden-sized growth only
    self.assertLess(long - short, b * (128 - 32) * v * 4 / 8)
    self.assertLessEqual(long, 4 * chunk_logits_bytes + 32 * b * 128 * d)

  def test_bad_temperature(self):
    config = tiny.model_config()
    ids = jnp.zeros((1, 2), jnp.int32)
    with self.assertRaisesRegex(ValueError, "temperature"):
      qwen.token_logprobs({}, ids, ids, ids, config=config, temperature=0.0)
