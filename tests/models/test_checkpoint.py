"""HF checkpoints: safetensors I/O, save/load round trips, sharded loading, torch parity."""

import functools
import json
import os
import re
import shutil
import tempfile

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from absl.testing import parameterized

from seeupo_jax import sharding
from seeupo_jax.models import checkpoint
from seeupo_jax.models import config as config_lib
from seeupo_jax.models import qwen
from seeupo_jax.models import safetensors_io
import tiny


def _random_params(config, seed):
  params = qwen.init_params(config, jax.random.key(seed))
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  leaves = [0.1 * jax.random.normal(k, x.shape, x.dtype) + 1.0 for k, x in zip(keys, leaves)]
  return jax.tree.unflatten(treedef, leaves)


def _tmp_dir(test):
  """A fresh directory removed when `test` ends (absl's create_tempdir needs parsed flags)."""
  tmp = tempfile.TemporaryDirectory()
  test.addCleanup(tmp.cleanup)
  return tmp.name


def _assert_trees_equal(a, b):
  jax.tree.map(np.testing.assert_array_equal, a, b)
  assert jax.tree.structure(a) == jax.tree.structure(b)


class SafetensorsIOTest(parameterized.TestCase):
  def test_our_writer_is_read_by_the_safetensors_library(self):
    path = os.path.join(_tmp_dir(self), "f.safetensors")
    rng = np.random.default_rng(0)
    tensors = {
      "a.weight": rng.standard_normal((3, 5)).astype(np.float32),
      "b": rng.standard_normal((7,)).astype(np.float16),
      "c": rng.integers(-9, 9, (2, 2, 2)).astype(np.int32),
    }
    entries = [(k, v.shape, v.dtype) for k, v in tensors.items()]
    safetensors_io.write_file(path, entries, tensors.__getitem__, {"format": "pt"})
    loaded = safetensors.numpy.load_file(path)
    self.assertEqual(set(loaded), set(tensors))
    for k, v in tensors.items():
      np.testing.assert_array_equal(loaded[k], v)
      self.assertEqual(loaded[k].dtype, v.dtype)

  def test_our_reader_reads_the_safetensors_library(self):
    path = os.path.join(_tmp_dir(self), "f.safetensors")
    rng = np.random.default_rng(1)
    tensors = {
      "x": rng.standard_normal((4, 3)).astype(np.float32),
      "y": np.arange(5, dtype=np.int64),
    }
    safetensors.numpy.save_file(tensors, path)
    reader = safetensors_io.SafetensorsReader(path)
    self.assertEqual(sorted(reader.keys()), ["x", "y"])
    for k, v in tensors.items():
      np.testing.assert_array_equal(reader.tensor(k), v)

  def test_bfloat16_bytes_round_trip(self):
    path = os.path.join(_tmp_dir(self), "f.safetensors")
    x = np.linspace(-3, 3, 12, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(3, 4)
    safetensors_io.write_file(path, [("x", x.shape, x.dtype)], lambda _: x)
    with open(path, "rb") as f:
      header = json.loads(f.read(8 + int.from_bytes(open(path, "rb").read(8), "little"))[8:])
    self.assertEqual(header["x"]["dtype"], "BF16")
    np.testing.assert_array_equal(safetensors_io.SafetensorsReader(path).tensor("x"), x)

  def test_shard_entries_respects_threshold(self):
    entries = [(str(i), (n,), np.dtype(np.float32)) for i, n in enumerate([10, 10, 30, 5, 5])]
    groups = safetensors_io.shard_entries(entries, max_shard_bytes=80)
    self.assertEqual([[e[0] for e in g] for g in groups], [["0", "1"], ["2"], ["3", "4"]])


class SaveLoadTest(parameterized.TestCase):
  @parameterized.parameters(
    ("qwen3-tiny", 10**9, {}),
    ("qwen2-tiny-tied", 20_000, {}),
    ("qwen3-tiny", 20_000, {"attention_bias": True}),
  )
  def test_round_trip_is_exact(self, name, max_shard_bytes, changes):
    config = config_lib.get_preset(name).replace(**changes)
    params = _random_params(config, seed=0)
    directory = _tmp_dir(self)
    files = checkpoint.save(params, config, directory, max_shard_bytes=max_shard_bytes)
    index_path = os.path.join(directory, checkpoint.INDEX_FILE)
    if max_shard_bytes < 10**6:
      self.assertGreater(len(files), 1)
      with open(index_path) as f:
        index = json.load(f)
      # Per layer: 2 norms, 4 attention and 3 MLP kernels, 3 q/k/v biases (qwen2) or
      # 2 q/k norms (qwen3); plus embedding, final norm and the untied lm_head.
      # Qwen3 with attention_bias also has an o_proj bias.
      per_layer = 9 + (3 if config.attention_bias else 0) + (2 if config.qk_norm else 0)
      per_layer += int(config.o_proj_bias)
      n_tensors = 3 + per_layer * config.num_layers - int(config.tie_word_embeddings)
      self.assertLen(index["weight_map"], n_tensors)
      self.assertEqual(sorted(set(index["weight_map"].values())), sorted(files))
      sizes = sum(os.path.getsize(os.path.join(directory, f)) for f in files)
      self.assertLess(index["metadata"]["total_size"], sizes)  # payload < files (headers)
    else:
      self.assertEqual(files, ["model.safetensors"])
      self.assertFalse(os.path.exists(index_path))
    loaded_config, loaded = checkpoint.load(directory)
    self.assertEqual(loaded_config, config)
    _assert_trees_equal(loaded, params)

  def test_bfloat16_save(self):
    config = tiny.model_config()
    params = _random_params(config, seed=1)
    directory = _tmp_dir(self)
    checkpoint.save(params, config, directory, dtype="bfloat16")
    with open(os.path.join(directory, "config.json")) as f:
      self.assertEqual(json.load(f)["torch_dtype"], "bfloat16")
    loaded = checkpoint.load_params(directory, config)
    expected = jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32), params)
    _assert_trees_equal(loaded, expected)

  def test_load_straight_onto_a_mesh(self):
    config = tiny.model_config()
    params = _random_params(config, seed=2)
    directory = _tmp_dir(self)
    checkpoint.save(params, config, directory, max_shard_bytes=30_000)
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    loaded = checkpoint.load_params(directory, config, mesh)
    q = loaded["layers"]["attn"]["q_proj"]["kernel"]
    self.assertEqual(q.sharding.spec, jax.sharding.PartitionSpec(None, "fsdp", "tensor"))
    self.assertEqual(q.addressable_shards[0].data.shape, (2, 32, 32))
    self.assertEqual(
      loaded["embed"]["embedding"].sharding.spec,
      jax.sharding.PartitionSpec(("fsdp", "tensor"), None),
    )
    _assert_trees_equal(jax.device_get(loaded), jax.device_get(params))

  def test_missing_and_mismatched_tensors(self):
    config = tiny.model_config()
    params = _random_params(config, seed=3)
    directory = _tmp_dir(self)
    checkpoint.save(params, config, directory)
    with self.assertRaisesRegex(KeyError, "lm_head.weight"):
      checkpoint.load_params(directory_without(directory, "lm_head.weight", self), config)
    with self.assertRaisesRegex(ValueError, "intermediate|mlp"):
      checkpoint.load_params(directory, config.replace(intermediate_size=96))

  def test_qwen3_attention_bias_has_o_proj_bias(self):
    """Qwen3 attention_bias=True: q/k/v AND o_proj biases (as transformers); Qwen2: q/k/v only."""
    config = tiny.model_config().replace(attention_bias=True)
    self.assertTrue(config.o_proj_bias)
    self.assertFalse(config_lib.get_preset("qwen2-tiny").o_proj_bias)
    self.assertFalse(tiny.model_config().o_proj_bias)
    self.assertEqual(config_lib.ModelConfig.from_hf_dict(config.to_hf_dict()), config)
    shapes = qwen.params_shape(config)
    self.assertEqual(shapes["layers"]["attn"]["o_proj"]["bias"].shape, (2, config.hidden_size))
    self.assertNotIn(
      "bias", qwen.params_shape(config_lib.get_preset("qwen2-tiny"))["layers"]["attn"]["o_proj"]
    )
    directory = _tmp_dir(self)
    checkpoint.save(_random_params(config, seed=4), config, directory)
    reader = safetensors_io.SafetensorsReader(os.path.join(directory, "model.safetensors"))
    self.assertIn("model.layers.1.self_attn.o_proj.bias", list(reader.keys()))
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    loaded = checkpoint.load_params(directory, config, mesh)
    self.assertEqual(
      loaded["layers"]["attn"]["o_proj"]["bias"].sharding.spec,
      jax.sharding.PartitionSpec(None, None),
    )

  @parameterized.named_parameters(
    ("made_up_tensor", "qwen2-tiny", "model.extra.weight", lambda t: t["model.norm.weight"]),
    (
      "o_proj_bias_in_qwen2",
      "qwen2-tiny",
      "model.layers.0.self_attn.o_proj.bias",
      lambda t: t["model.norm.weight"],
    ),
    (
      "tied_lm_head_differs",
      "qwen2-tiny-tied",
      "lm_head.weight",
      lambda t: t["model.embed_tokens.weight"] + 1.0,
    ),
  )
  def test_unused_tensor_is_rejected(self, name, extra_name, make_extra):
    config = config_lib.get_preset(name)
    directory = _tmp_dir(self)
    checkpoint.save(_random_params(config, seed=5), config, directory)
    out = directory_with(directory, {extra_name: make_extra}, self)
    with self.assertRaisesRegex(ValueError, re.escape(extra_name)):
      checkpoint.load(out)

  def test_many_unused_tensors_are_listed_and_counted(self):
    config = tiny.model_config()
    directory = _tmp_dir(self)
    checkpoint.save(_random_params(config, seed=6), config, directory)
    extra = {f"model.extra_{i:02d}.weight": lambda t: t["model.norm.weight"] for i in range(13)}
    out = directory_with(directory, extra, self)
    with self.assertRaisesRegex(ValueError, r"13 tensors.*model\.extra_00\.weight") as ctx:
      checkpoint.load_params(out, config)
    self.assertNotIn("model.extra_12.weight", str(ctx.exception))

  def test_tolerated_extra_tensors(self):
    """inv_freq buffers (derived) and a tied lm_head.weight equal to the embedding load."""
    config = config_lib.get_preset("qwen2-tiny-tied")
    params = _random_params(config, seed=7)
    directory = _tmp_dir(self)
    checkpoint.save(params, config, directory)
    head_dim = config.head_dim
    extra = {
      "lm_head.weight": lambda t: t["model.embed_tokens.weight"].copy(),
      **{
        f"model.layers.{i}.self_attn.rotary_emb.inv_freq": (
          lambda t: np.ones((head_dim // 2,), np.float32)
        )
        for i in range(config.num_layers)
      },
    }
    out = directory_with(directory, extra, self)
    _assert_trees_equal(checkpoint.load_params(out, config), params)

  def test_bad_save_dtype(self):
    config = tiny.model_config()
    with self.assertRaisesRegex(ValueError, "dtype"):
      checkpoint.save({}, config, _tmp_dir(self), dtype="float16")


def directory_without(directory, tensor_name, test):
  """A copy of the single-file checkpoint in `directory` lacking one tensor."""
  reader = safetensors_io.SafetensorsReader(os.path.join(directory, "model.safetensors"))
  out = _tmp_dir(test)
  entries = [
    (k, reader.shape(k), reader.tensor(k).dtype) for k in reader.keys() if k != tensor_name
  ]
  safetensors_io.write_file(os.path.join(out, "model.safetensors"), entries, reader.tensor)
  return out


def directory_with(directory, extra, test):
  """A copy of the checkpoint in `directory` (config.json and one model.safetensors) with extra tensors.

  Args:
    extra: {name: fn(tensors) -> np.ndarray}, tensors the {name: array} dict of the original file.
  """
  tensors = safetensors.numpy.load_file(os.path.join(directory, "model.safetensors"))
  tensors.update({name: make(tensors) for name, make in extra.items()})
  out = _tmp_dir(test)
  safetensors.numpy.save_file(tensors, os.path.join(out, "model.safetensors"))
  shutil.copy(os.path.join(directory, "config.json"), out)
  return out


# ----------------------------------------------------------------------------- torch parity


@pytest.mark.parity
class TorchParityTest(parameterized.TestCase):
  @parameterized.named_parameters(
    ("qwen3_untied_single", "qwen3", False, None),
    ("qwen3_tied_sharded", "qwen3", True, "40KB"),
    ("qwen2_untied_sharded", "qwen2", False, "40KB"),
    ("qwen2_tied_single", "qwen2", True, None),
    # transformers' Qwen3 with attention_bias=True biases q/k/v and o_proj.
    ("qwen3_attention_bias", "qwen3", False, "40KB", {"attention_bias": True}),
  )
  def test_load_forward_save_matches_transformers(
    self, family, tied, max_shard_size, overrides=None
  ):
    torch = pytest.importorskip("torch")
    import transformers

    import hf_fixtures

    directory = _tmp_dir(self)
    _, model = hf_fixtures.make_hf_checkpoint(
      directory,
      family,
      tie_word_embeddings=tied,
      max_shard_size=max_shard_size,
      seed=7,
      **(overrides or {}),
    )
    if max_shard_size:
      self.assertTrue(os.path.exists(os.path.join(directory, checkpoint.INDEX_FILE)))
    config, params = checkpoint.load(directory)
    self.assertEqual(config.qk_norm, family == "qwen3")
    self.assertEqual(config.tie_word_embeddings, tied)

    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 20))
    with torch.no_grad():
      expected = model(torch.tensor(ids)).logits.numpy()
    positions = np.broadcast_to(np.arange(20, dtype=np.int32), (2, 20))
    logits, _ = jax.jit(functools.partial(qwen.forward, config=config))(
      params, jnp.asarray(ids, jnp.int32), positions
    )
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=0)

    # Save back: transformers loads it and gives the same logits.
    out = _tmp_dir(self)
    checkpoint.save(params, config, out, max_shard_bytes=60_000)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    self.assertEqual(type(reloaded), type(model))
    with torch.no_grad():
      again = reloaded(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(again, expected, atol=1e-6, rtol=0)

  @parameterized.named_parameters(
    ("qwen3_untied", "qwen3", False),
    ("qwen2_tied", "qwen2", True),
    ("qwen3_attention_bias", "qwen3", False, {"attention_bias": True}),
  )
  def test_gradient_matches_transformers(self, family, tied, overrides=None):
    """Mean next-token NLL and its gradient for every parameter equal transformers' autograd.

    Covers the hand-written backward passes (block-causal attention in several query blocks,
    the chunked log-prob head with its kept last chunk) and the fused q/k/v and gate/up
    projections. torch's gradients are mapped onto our tree by saving them as a checkpoint
    and loading it.
    """
    torch = pytest.importorskip("torch")

    import hf_fixtures

    directory = _tmp_dir(self)
    _, model = hf_fixtures.make_hf_checkpoint(
      directory, family, tie_word_embeddings=tied, seed=3, **(overrides or {})
    )
    config, params = checkpoint.load(directory, attn_block_size=4, remat="dots")
    b, s = 4, 19
    ids = np.random.default_rng(1).integers(0, config.vocab_size, (b, s))

    model.train()
    loss = model(input_ids=torch.tensor(ids), labels=torch.tensor(ids)).loss
    loss.backward()
    with torch.no_grad():
      for p in model.parameters():
        p.copy_(p.grad)
    grad_dir = _tmp_dir(self)
    model.save_pretrained(grad_dir)
    _, expected = checkpoint.load(grad_dir)

    ids_j = jnp.asarray(ids, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    targets = jnp.concatenate([ids_j[:, 1:], ids_j[:, :1]], axis=1)

    def mean_nll(params):
      logp = qwen.token_logprobs(params, ids_j, targets, positions, config=config, chunk_size=8)
      return -jnp.mean(logp[:, :-1])

    value, grads = jax.jit(jax.value_and_grad(mean_nll))(params)
    np.testing.assert_allclose(value, loss.item(), rtol=1e-6)
    self.assertEqual(jax.tree.structure(grads), jax.tree.structure(expected))
    for (path, got), want in zip(
      jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(expected)
    ):
      scale = float(np.max(np.abs(want)))
      self.assertGreater(scale, 0.0, msg=jax.tree_util.keystr(path))
      np.testing.assert_allclose(
        got, want, atol=1e-5 * scale, rtol=0, err_msg=jax.tree_util.keystr(path)
      )
