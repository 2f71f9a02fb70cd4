"""`sampling_probs.sampled_logprob` against an exact float64 NumPy enumeration of the filtered,
renormalised tempered distribution (every token of the vocabulary, kept or not)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seeupo_jax import sampling
from seeupo_jax.sampling_probs import sampled_logprob

V = 11


def reference_logprobs(logits, temperature, top_k, top_p):
  """float64[V]: log pi_sampler(y) for every y, from the definition, and the smallest distance of
  a mass-before from top_p (the nucleus decision's margin).

  Sort most likely first (ties: lower id first), keep the first k (k = 0: all), renormalise over
  them, keep a token while the mass before it is < top_p, renormalise over the kept set K."""
  z = np.asarray(logits, np.float64) / temperature
  order = sorted(range(len(z)), key=lambda v: (-z[v], v))
  if top_k:
    order = order[:top_k]
  top = max(z[v] for v in order)
  probs = [math.exp(z[v] - top) for v in order]
  total = sum(probs)
  kept, before, margin = [], 0.0, math.inf
  for v, p in zip(order, probs):
    if top_p < 1.0:
      margin = min(margin, abs(before - top_p))
      if not before < top_p:
        break
    kept.append(v)
    before += p / total
  log_mass = top + math.log(sum(math.exp(z[v] - top) for v in kept))
  out = np.full(len(z), -np.inf)
  for v in kept:
    out[v] = z[v] - log_mass
  return out, margin


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
  fn = jax.jit(sampled_logprob, static_argnames=("temperature", "top_k", "top_p"))
  fn = fn if jit else sampled_logprob
  rng = np.random.default_rng(0)
  for _ in range(5):
    logits = rng.normal(0.0, 2.0, V).astype(np.float32)
    want, margin = reference_logprobs(logits, **setting)
    assert margin > 1e-4  # no nucleus decision within float32 noise of top_p
    got = np.asarray(_all_tokens(fn, jnp.asarray(logits), **setting))
    kept = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), kept)  # the same kept set
    np.testing.assert_allclose(got[kept], want[kept], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.exp(got[kept]).sum(), 1.0, rtol=1e-6)  # a distribution
    if setting["top_k"]:
      assert kept.sum() <= setting["top_k"]


def test_unfiltered_is_the_full_tempered_logprob_bit_for_bit():
  """top_k = 0, top_p = 1: the full tempered log-prob, exactly (the learner's)."""
  logits = jnp.asarray(np.random.default_rng(1).normal(0.0, 3.0, V), jnp.float32)
  for token in range(V):
    got = sampled_logprob(logits, jnp.int32(token), temperature=0.9, top_k=0, top_p=1.0)
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
  got = jax.vmap(lambda y: sampled_logprob(logits, y, temperature=1.0, top_k=0, top_p=0.8))(
    jnp.arange(6)
  )
  np.testing.assert_allclose(got[:3], np.asarray(full[:3]) - math.log(probs[:3].sum()), rtol=1e-6)
  assert np.all(np.isneginf(np.asarray(got[3:])))


def test_ties_keep_the_lower_ids_like_the_sampler():
  """Three tokens tie for the top logit and top_k = 2 keeps two of them: ids 1 and 3, the lower
  ones, each with probability 1/2 (as `sampling.filter_logits` keeps them)."""
  logits = jnp.asarray([0.0, 5.0, -1.0, 5.0, 5.0], jnp.float32)
  got = jax.vmap(lambda y: sampled_logprob(logits, y, temperature=1.0, top_k=2, top_p=1.0))(
    jnp.arange(5)
  )
  np.testing.assert_allclose(np.asarray(got)[[1, 3]], [math.log(0.5)] * 2, rtol=1e-6)
  assert np.all(np.isneginf(np.asarray(got)[[0, 2, 4]]))
  kept = np.isfinite(np.asarray(sampling.filter_logits(logits, top_k=2, top_p=1.0)))
  np.testing.assert_array_equal(kept, np.isfinite(np.asarray(got)))


def test_batched_under_vmap_and_in_bfloat16_logits():
  """Rows under vmap equal one call per row; bf16 logits are upcast to float32 first."""
  rng = np.random.default_rng(2)
  logits = jnp.asarray(rng.normal(0.0, 2.0, (4, V)), jnp.bfloat16)
  tokens = jnp.asarray([0, 3, 7, 10], jnp.int32)
  kw = dict(temperature=0.8, top_k=5, top_p=0.9)
  rows = jax.vmap(lambda x, y: sampled_logprob(x, y, **kw))(logits, tokens)
  for b in range(4):
    one = sampled_logprob(logits[b], tokens[b], **kw)
    assert rows.dtype == jnp.float32
    np.testing.assert_array_equal(rows[b], one)
    want, _ = reference_logprobs(np.asarray(logits[b], np.float32), **kw)
    if np.isfinite(want[int(tokens[b])]):
      np.testing.assert_allclose(rows[b], want[int(tokens[b])], rtol=1e-6, atol=1e-6)
    else:
      assert np.isneginf(float(rows[b]))
