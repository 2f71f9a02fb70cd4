"""The sampler's token selection (`sampling.filter_logits`, `sampling.select_token`,
`sampling.sampled_logprob`) against an
exact float64 NumPy enumeration of the filtered, renormalised tempered distribution (every token
of the vocabulary, kept or not; `sampling_reference.py`, written without the sampler's code)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sampling_reference as ref

from seeupo_jax import sampling

V = 11


def _all_tokens(fn, logits, **kw):
  return jax.vmap(lambda y: fn(logits, y, **kw))(jnp.arange(V, dtype=jnp.int32))


SETTINGS = [
  dict(temperature=1.0, top_k=0, top_p=1.0),
  dict(temperature=0.7, top_k=4, top_p=1.0),
  dict(temperature=1.3, top_k=0, top_p=0.6),
  dict(temperature=0.9, top_k=6, top_p=0.8),
  dict(temperature=1.0, top_k=1, top_p=1.0),
  dict(temperature=1.0, top_k=0, top_p=0.01),  # only the most likely token
]


@pytest.mark.parametrize("jit", [False, True], ids=["nojit", "jit"])
@pytest.mark.parametrize("setting", SETTINGS, ids=str)
def test_matches_exact_enumeration(setting, jit):
  fn = jax.jit(sampling.sampled_logprob, static_argnames=("temperature", "top_k", "top_p"))
  fn = fn if jit else sampling.sampled_logprob
  rng = np.random.default_rng(0)
  for _ in range(5):
    logits = rng.normal(0.0, 2.0, V).astype(np.float32)
    want, margin = ref.filtered_logprobs(logits, **setting)
    assert margin > 1e-4  # no nucleus decision within float32 noise of top_p
    np.testing.assert_allclose(np.exp(want[np.isfinite(want)]).sum(), 1.0, rtol=1e-12)
    got = np.asarray(_all_tokens(fn, jnp.asarray(logits), **setting))
    kept = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), kept)  # the same kept set
    np.testing.assert_allclose(got[kept], want[kept], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.exp(got[kept]).sum(), 1.0, rtol=1e-6)  # a distribution
    if setting["top_k"]:
      assert kept.sum() <= setting["top_k"]


@pytest.mark.parametrize("setting", SETTINGS[1:4], ids=str)
def test_select_token_draws_from_the_reference_and_records_its_logprob(setting):
  """Every draw of `select_token` is in the reference's kept set, and the log-prob it records is
  the reference's log-prob of that token."""
  logits = np.random.default_rng(3).normal(0.0, 0.5, V).astype(np.float32)  # flat: draws vary
  want, _ = ref.filtered_logprobs(logits, **setting)
  choose = jax.jit(
    jax.vmap(functools.partial(sampling.select_token, greedy=False, **setting), in_axes=(0, None))
  )
  tokens, logps = choose(jax.random.split(jax.random.key(0), 64), jnp.asarray(logits))
  tokens, logps = np.asarray(tokens), np.asarray(logps)
  assert np.all(np.isfinite(want[tokens]))
  np.testing.assert_allclose(logps, want[tokens], rtol=1e-6, atol=1e-6)
  assert len(np.unique(tokens)) > 1  # the draws vary


def test_greedy_takes_the_argmax_with_its_full_tempered_logprob():
  logits = np.random.default_rng(4).normal(0.0, 2.0, V).astype(np.float32)
  want, _ = ref.filtered_logprobs(logits, temperature=0.8, top_k=0, top_p=1.0)
  token, logp = sampling.select_token(
    jax.random.key(0), jnp.asarray(logits), temperature=0.8, top_k=3, top_p=0.5, greedy=True
  )
  assert int(token) == int(np.argmax(logits))
  np.testing.assert_allclose(float(logp), want[int(token)], rtol=1e-6, atol=1e-6)


def test_unfiltered_is_the_full_tempered_logprob_bit_for_bit():
  """top_k = 0, top_p = 1: the full tempered log-prob, exactly (the learner's)."""
  logits = jnp.asarray(np.random.default_rng(1).normal(0.0, 3.0, V), jnp.float32)
  for token in range(V):
    got = sampling.sampled_logprob(logits, jnp.int32(token), temperature=0.9, top_k=0, top_p=1.0)
    full = jax.nn.log_softmax(logits / 0.9)[token]
    assert float(got) == float(full)


def test_filtered_logprob_is_the_full_one_minus_the_log_kept_mass():
  """log pi_sampler(y) = log pi(y) - log pi(K) on the kept set: the learner's tempered log-prob
  exceeds the sampler's by the log of the kept mass, and only there."""
  logits = jnp.asarray([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], jnp.float32)
  full = jax.nn.log_softmax(logits)
  probs = np.exp(np.asarray(full, np.float64))
  # top_p = 0.8: kept while the mass before is < 0.8: tokens 0, 1, 2 (mass before 2: 0.79).
  assert probs[:2].sum() < 0.8 <= probs[:3].sum()
  got = jax.vmap(
    lambda y: sampling.sampled_logprob(logits, y, temperature=1.0, top_k=0, top_p=0.8)
  )(jnp.arange(6))
  np.testing.assert_allclose(got[:3], np.asarray(full[:3]) - math.log(probs[:3].sum()), rtol=1e-6)
  assert np.all(np.isneginf(np.asarray(got[3:])))
  want, _ = ref.filtered_logprobs(np.asarray(logits), temperature=1.0, top_k=0, top_p=0.8)
  np.testing.assert_allclose(want[:3], np.asarray(got[:3]), rtol=1e-6)
  assert np.all(np.isneginf(want[3:]))


def test_ties_keep_the_lower_ids_like_the_reference():
  """Three tokens tie for the top logit and top_k = 2 keeps two of them: ids 1 and 3, the lower
  ones, each with probability 1/2 (as the reference's order keeps them)."""
  logits = jnp.asarray([0.0, 5.0, -1.0, 5.0, 5.0], jnp.float32)
  got = jax.vmap(
    lambda y: sampling.sampled_logprob(logits, y, temperature=1.0, top_k=2, top_p=1.0)
  )(jnp.arange(5))
  np.testing.assert_allclose(np.asarray(got)[[1, 3]], [math.log(0.5)] * 2, rtol=1e-6)
  assert np.all(np.isneginf(np.asarray(got)[[0, 2, 4]]))
  want, _ = ref.filtered_logprobs(np.asarray(logits), temperature=1.0, top_k=2, top_p=1.0)
  np.testing.assert_array_equal(np.isfinite(want), np.isfinite(np.asarray(got)))


def test_batched_under_vmap_and_in_bfloat16_logits():
  """Rows under vmap equal one call per row; bf16 logits are upcast to float32 first."""
  rng = np.random.default_rng(2)
  logits = jnp.asarray(rng.normal(0.0, 2.0, (4, V)), jnp.bfloat16)
  tokens = jnp.asarray([0, 3, 7, 10], jnp.int32)
  kw = dict(temperature=0.8, top_k=5, top_p=0.9)
  rows = jax.vmap(lambda x, y: sampling.sampled_logprob(x, y, **kw))(logits, tokens)
  want = ref.sampled_logprobs(np.asarray(logits, np.float32), np.asarray(tokens), **kw)
  for b in range(4):
    one = sampling.sampled_logprob(logits[b], tokens[b], **kw)
    assert rows.dtype == jnp.float32
    np.testing.assert_array_equal(rows[b], one)
    if np.isfinite(want[b]):
      np.testing.assert_allclose(rows[b], want[b], rtol=1e-6, atol=1e-6)
    else:
      assert np.isneginf(float(rows[b]))
