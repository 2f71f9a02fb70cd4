"""Tests of seeupo_jax.sampling: token filtering, the KV-cache sampler, its bookkeeping."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sampling_reference

from seeupo_jax import sampling
from seeupo_jax import sharding
from seeupo_jax.models import qwen
import tiny

N_NEW = 12


# ---------------------------------------------------------------------------------------------
# NumPy references, written independently of the code under test.


def np_filtered_probs(logits, temperature, top_k, top_p):
  """Exact distribution of temperature -> top-k -> top-p (nucleus) sampling, in NumPy."""
  x = np.asarray(logits, np.float64) / temperature
  order = np.argsort(-x, kind="stable")
  keep = np.zeros(x.shape, bool)
  k = len(x) if top_k == 0 else min(top_k, len(x))
  cand = order[:k]
  p = np.exp(x[cand] - x[cand].max())
  p /= p.sum()
  mass = 0.0
  for token, prob in zip(cand, p):
    if mass < top_p:  # the smallest prefix whose mass reaches top_p
      keep[token] = True
    mass += prob
  out = np.where(keep, np.exp(x - x.max()), 0.0)
  return out / out.sum()


def np_log_softmax(x):
  x = np.asarray(x, np.float64)
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


# ---------------------------------------------------------------------------------------------
# Filtering and token selection.


@pytest.mark.parametrize(
  "top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.6), (7, 0.8), (1, 1.0), (0, 0.01), (100, 0.95)]
)
def test_filter_logits_matches_numpy(top_k, top_p):
  rng = np.random.default_rng(top_k * 100 + int(top_p * 100))
  for _ in range(5):
    logits = rng.normal(scale=2.0, size=20).astype(np.float32)
    got = sampling.filter_logits(jnp.asarray(logits), top_k=top_k, top_p=top_p)
    got_probs = np.asarray(jax.nn.softmax(got), np.float64)
    want = np_filtered_probs(logits, 1.0, top_k, top_p)
    np.testing.assert_array_equal(got_probs > 0, want > 0)
    np.testing.assert_allclose(got_probs, want, atol=1e-6)


def test_select_token_frequencies_match_exact_distribution():
  logits = np.array([2.0, 1.5, 1.2, 0.3, -0.5, 0.9, -2.0, 1.0], np.float32)
  temperature, top_k, top_p = 0.7, 5, 0.8
  n = 40_000
  keys = jax.random.split(jax.random.key(7), n)
  choose = jax.jit(
    jax.vmap(
      functools.partial(
        sampling.select_token, temperature=temperature, top_k=top_k, top_p=top_p, greedy=False
      ),
      in_axes=(0, None),
    )
  )
  tokens, logps = choose(keys, jnp.asarray(logits))
  freq = np.bincount(np.asarray(tokens), minlength=len(logits)) / n
  want = np_filtered_probs(logits, temperature, top_k, top_p)
  assert (want > 0).sum() == 3  # the case cuts both ways: top-k and top-p both bind
  # Binomial std <= 0.0025 here; 0.012 is ~5 std.
  np.testing.assert_allclose(freq, want, atol=0.012)
  assert np.all(freq[want == 0] == 0)
  # Reported log-prob: that of the filtered distribution drawn from (exact enumeration),
  # log p_full - log(kept mass), not the full tempered one.
  with np.errstate(divide="ignore"):
    sampled = np.log(want)
  np.testing.assert_allclose(np.asarray(logps), sampled[np.asarray(tokens)], atol=1e-6)
  full = np_log_softmax(logits / temperature)
  assert np.all(np.asarray(logps) > full[np.asarray(tokens)] + 0.1)


def test_select_token_greedy():
  logits = jnp.array([0.1, 3.0, -1.0, 2.9])
  token, logp = sampling.select_token(
    jax.random.key(0), logits, temperature=1.0, top_k=0, top_p=1.0, greedy=True
  )
  assert int(token) == 1
  np.testing.assert_allclose(float(logp), np_log_softmax(np.asarray(logits))[1], atol=1e-6)


def test_prompt_positions():
  valid = jnp.array(
    [[False, False, True, True], [True, True, True, True], [True, False, True, False]]
  )
  np.testing.assert_array_equal(
    sampling.prompt_positions(valid), [[0, 0, 0, 1], [0, 1, 2, 3], [0, 1, 1, 2]]
  )


def test_config_validation_names_the_key():
  for kwargs, key in [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=4, temperature=0.0), "temperature"),
    (dict(max_new_tokens=4, top_k=-1), "top_k"),
    (dict(max_new_tokens=4, top_p=0.0), "top_p"),
    (dict(max_new_tokens=4, top_p=1.5), "top_p"),
    (dict(max_new_tokens=4, stop_token_ids=(-3,)), "stop_token_ids"),
    (dict(max_new_tokens=4, prefill_chunk_size=0), "prefill_chunk_size"),
    (dict(max_new_tokens=4, scan_layers="no"), "scan_layers"),
  ]:
    with pytest.raises(ValueError, match=f"SamplingConfig.{key}"):
      sampling.SamplingConfig(**kwargs)


# ---------------------------------------------------------------------------------------------
# The sampler on a tiny random Qwen3 model. Every sampler call below uses the same
# argument shapes where it can, so each (config, shape) compiles once.


@pytest.fixture(scope="module")
def model():
  cfg = tiny.model_config()
  params = jax.jit(qwen.init_params, static_argnums=0)(cfg, jax.random.key(0))
  # Sharper than the 0.02 init so that sampled sequences are far from uniform noise.
  params = jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, params)
  return cfg, params


@functools.lru_cache(maxsize=None)
def _sampler(cfg, sc):
  return sampling.make_sampler(cfg, sc)


def _left_pad(prompts, length=None):
  length = length or max(len(p) for p in prompts)
  ids = np.zeros((len(prompts), length), np.int32)
  valid = np.zeros((len(prompts), length), bool)
  for b, p in enumerate(prompts):
    ids[b, length - len(p) :] = p
    valid[b, length - len(p) :] = True
  return jnp.asarray(ids), jnp.asarray(valid)


PROMPTS = [[5, 17, 300, 42, 9, 77, 101], [8, 8, 9], [250, 251, 252, 253, 12], [3, 1, 4, 1, 5, 9]]
WIDTH = 9  # every row is left-padded, by 2 to 6 slots
SAMPLE_CFG = sampling.SamplingConfig(max_new_tokens=N_NEW, temperature=0.7, top_k=40, top_p=0.9)
GREEDY_CFG = sampling.SamplingConfig(max_new_tokens=N_NEW, greedy=True)
NO_STOPS = jnp.full((len(PROMPTS), 2), -1, jnp.int32)
NO_LIMITS = jnp.full((len(PROMPTS),), N_NEW, jnp.int32)


def _run(model, sc, keys, stops=NO_STOPS, limits=NO_LIMITS, prompts=PROMPTS, width=WIDTH):
  cfg, params = model
  ids, valid = _left_pad(prompts, width)
  return ids, valid, _sampler(cfg, sc)(params, ids, valid, keys, stops, limits)


def _keys(seed, n=len(PROMPTS)):
  return jax.random.split(jax.random.key(seed), n)


@functools.partial(jax.jit, static_argnames=("cfg", "temperature"))
def _teacher_forced(params, ids, valid, tokens, mask, *, cfg, temperature):
  """token_logprobs of prompt + generated tokens, at the generated positions: f32[B, N]."""
  seq = jnp.concatenate([ids, tokens], axis=1)
  seq_valid = jnp.concatenate([valid, mask], axis=1)
  positions = sampling.prompt_positions(seq_valid)
  logp = qwen.token_logprobs(
    params,
    seq[:, :-1],
    seq[:, 1:],
    positions[:, :-1],
    seq_valid[:, :-1],
    config=cfg,
    temperature=temperature,
  )
  return logp[:, ids.shape[1] - 1 :]


@functools.partial(jax.jit, static_argnames=("cfg",))
def _teacher_forced_logits(params, ids, valid, tokens, mask, *, cfg):
  """The logits before each generated token, from one full forward pass: f32[B, N, V]."""
  seq = jnp.concatenate([ids, tokens], axis=1)
  seq_valid = jnp.concatenate([valid, mask], axis=1)
  positions = sampling.prompt_positions(seq_valid)
  logits, _ = qwen.forward(params, seq[:, :-1], positions[:, :-1], seq_valid[:, :-1], config=cfg)
  return logits[:, ids.shape[1] - 1 :]


def _teacher_forced_sampled(params, ids, valid, tokens, mask, *, cfg, sc):
  """The log-prob the sampler must record, by teacher forcing: the generated tokens' log-probs
  under softmax(filter(logits / T)) (the float64 reference `sampling_reference.sampled_logprobs`,
  the full distribution when greedy): f64[B, N]."""
  logits = _teacher_forced_logits(params, ids, valid, tokens, mask, cfg=cfg)
  top_k, top_p = (0, 1.0) if sc.greedy else (sc.top_k, sc.top_p)
  return sampling_reference.sampled_logprobs(
    np.asarray(logits), np.asarray(tokens), temperature=sc.temperature, top_k=top_k, top_p=top_p
  )


@pytest.mark.parametrize("sc", [SAMPLE_CFG, GREEDY_CFG], ids=["sample", "greedy"])
def test_logprobs_equal_teacher_forced(model, sc):
  cfg, params = model
  ids, valid, out = _run(model, sc, _keys(3))
  assert np.all(np.asarray(out.lengths) == N_NEW)
  want = _teacher_forced_sampled(params, ids, valid, out.tokens, out.mask, cfg=cfg, sc=sc)
  np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(want), atol=2e-5)
  full = _teacher_forced(
    params, ids, valid, out.tokens, out.mask, cfg=cfg, temperature=sc.temperature
  )
  if sc.greedy:  # the full tempered distribution: the learner's log-probs
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(full), atol=2e-5)
  else:  # top-k/top-p on: log p_full - log(kept mass) >= log p_full, strictly somewhere
    assert np.all(np.asarray(out.logprobs) >= np.asarray(full) - 2e-5)
    assert np.mean(np.asarray(out.logprobs) > np.asarray(full) + 1e-3) > 0.5
  # Not a degenerate model: sampled tokens vary and log-probs are far from uniform.
  assert len(np.unique(np.asarray(out.tokens))) > 10
  assert np.asarray(out.logprobs).max() > np.log(1 / cfg.vocab_size) + 1.0


def test_deterministic_for_a_key(model):
  _, _, a = _run(model, SAMPLE_CFG, _keys(11))
  _, _, b = _run(model, SAMPLE_CFG, _keys(11))
  _, _, c = _run(model, SAMPLE_CFG, _keys(12))
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.logprobs, b.logprobs)
  assert not np.array_equal(a.tokens, c.tokens)


def test_row_keys():
  key = jax.random.key(4)
  np.testing.assert_array_equal(
    jax.random.key_data(sampling._row_keys(key, 3)), jax.random.key_data(jax.random.split(key, 3))
  )
  # A raw uint32[2] key is the same key as its typed form; [B] keys pass through.
  np.testing.assert_array_equal(
    jax.random.key_data(sampling._row_keys(jax.random.key_data(key), 3)),
    jax.random.key_data(jax.random.split(key, 3)),
  )
  keys = jax.random.split(key, 3)
  np.testing.assert_array_equal(
    jax.random.key_data(sampling._row_keys(keys, 3)), jax.random.key_data(keys)
  )
  with pytest.raises(ValueError, match="one per row"):
    sampling._row_keys(jax.random.split(key, 2), 3)


def test_mixed_lengths_equal_one_at_a_time(model):
  keys = _keys(5)
  _, _, batch = _run(model, SAMPLE_CFG, keys)
  for b in (0, 1):  # the longest and the shortest prompt, alone and unpadded
    prompt = PROMPTS[b]
    _, _, one = _run(
      model,
      SAMPLE_CFG,
      keys[b : b + 1],
      NO_STOPS[:1],
      NO_LIMITS[:1],
      prompts=[prompt],
      width=len(prompt),
    )
    np.testing.assert_array_equal(batch.tokens[b], one.tokens[0])
    np.testing.assert_allclose(batch.logprobs[b], one.logprobs[0], atol=2e-5)


def test_per_row_stops_and_max_new_tokens(model):
  _, _, ref = _run(model, GREEDY_CFG, _keys(0))  # no stops: N tokens per row
  ref_tokens = np.asarray(ref.tokens)
  assert np.all(np.asarray(ref.lengths) == N_NEW)

  # Row 0 stops at the first occurrence of its 4th token; row 1 has max 5 new tokens;
  # row 2 has max 0; row 3 has a stop id that it never samples plus a stop that is its
  # 7th token, but a limit of 3 comes first.
  stop0 = ref_tokens[0, 3]
  never = next(t for t in range(512) if t not in ref_tokens)
  stops = np.full((4, 2), -1, np.int32)
  stops[0, 0] = stop0
  stops[1, 0] = never
  stops[3] = [never, ref_tokens[3, 6]]
  limits = np.array([N_NEW, 5, 0, 3], np.int32)
  _, _, out = _run(model, GREEDY_CFG, _keys(0), jnp.asarray(stops), jnp.asarray(limits))

  first_stop = int(np.argmax(ref_tokens[0] == stop0)) + 1
  want_len = np.array([first_stop, 5, 0, 3])
  want_reason = [
    sampling.FinishReason.STOP,
    sampling.FinishReason.LENGTH,
    sampling.FinishReason.LENGTH,
    sampling.FinishReason.LENGTH,
  ]
  np.testing.assert_array_equal(out.lengths, want_len)
  np.testing.assert_array_equal(out.finish_reason, want_reason)
  mask = np.arange(N_NEW)[None, :] < want_len[:, None]
  np.testing.assert_array_equal(out.mask, mask)
  np.testing.assert_array_equal(out.tokens, np.where(mask, ref_tokens, GREEDY_CFG.pad_id))
  np.testing.assert_allclose(out.logprobs, np.where(mask, ref.logprobs, 0.0), atol=2e-5)


def test_chunked_prefill_unrolled_layers_and_shared_stops(model):
  """Prefill in chunks of 4 (width 9 -> 3 chunks, the last one padded), decoder layers
  unrolled instead of scanned, and a stop id in the config: each row equals the one-shot,
  scanned reference up to the first occurrence of that id."""
  _, _, ref = _run(model, GREEDY_CFG, _keys(0))
  ref_tokens = np.asarray(ref.tokens)
  stop = int(ref_tokens[2, 4])
  sc = dataclasses.replace(
    GREEDY_CFG, prefill_chunk_size=4, stop_token_ids=(stop,), pad_id=-1, scan_layers=False
  )
  assert model[0].scan_layers
  _, _, out = _run(model, sc, _keys(0))
  for b in range(len(PROMPTS)):
    hits = np.flatnonzero(ref_tokens[b] == stop)
    n = hits[0] + 1 if len(hits) else N_NEW
    assert int(out.lengths[b]) == n
    reason = sampling.FinishReason.STOP if len(hits) else sampling.FinishReason.LENGTH
    assert int(out.finish_reason[b]) == reason
    np.testing.assert_array_equal(out.tokens[b, :n], ref_tokens[b, :n])
    np.testing.assert_array_equal(out.tokens[b, n:], -1)
    np.testing.assert_allclose(out.logprobs[b, :n], ref.logprobs[b, :n], atol=2e-5)


def test_sharded_equals_unsharded(model):
  cfg, params = model
  assert jax.device_count() == 8, "conftest provides 8 simulated CPU devices"
  keys = _keys(9)
  ids, valid, want = _run(model, SAMPLE_CFG, keys)

  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  sharded_params = jax.device_put(params, sharding.param_shardings(params, mesh))
  batch = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(sharding.BATCH))
  ids_s, valid_s, keys_s = (jax.device_put(x, batch) for x in (ids, valid, keys))
  sample = sampling.make_sampler(
    cfg, SAMPLE_CFG, cache_sharding=functools.partial(sharding.cache_shardings, mesh=mesh)
  )
  with jax.set_mesh(mesh):
    got = sample(sharded_params, ids_s, valid_s, keys_s, NO_STOPS, NO_LIMITS)
  assert len(sharded_params["embed"]["embedding"].sharding.device_set) == 8
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=2e-5)
