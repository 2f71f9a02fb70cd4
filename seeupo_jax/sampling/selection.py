"""Token selection: one row's next token and its log-prob, after temperature, top-k and top-p.

The sampler vmaps `select_token` over its rows (`steps.emit`).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp


def filter_logits(logits: jax.Array, *, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
  """Sets the logits outside the top-k / top-p (nucleus) set to -inf.

  With the tokens sorted by logit, most likely first, and p_i the softmax of
  the top-k survivors: token i is kept iff i < k and sum_{j<i} p_j < top_p (so
  the most likely token is always kept). Ties are broken towards lower ids.

  Args:
      logits: float32[V] (already divided by the temperature).
      top_k: int >= 0, 0 = no top-k cut.
      top_p: float in (0, 1], 1 = no nucleus cut.

  Returns:
      float32[V], the kept logits unchanged and -inf elsewhere.
  """
  chex.assert_rank(logits, 1)
  vocab = logits.shape[0]
  if top_k == 0 and top_p >= 1.0:
    return logits
  k = vocab if top_k == 0 else min(top_k, vocab)
  values, indices = jax.lax.top_k(logits, k)  # descending
  if top_p < 1.0:
    probs = jax.nn.softmax(values)
    mass_before = jnp.cumsum(probs) - probs
    values = jnp.where(mass_before < top_p, values, -jnp.inf)
  return jnp.full_like(logits, -jnp.inf).at[indices].set(values)


def select_token(
  key: jax.Array, logits: jax.Array, *, temperature: float, top_k: int, top_p: float, greedy: bool
) -> tuple[jax.Array, jax.Array]:
  """Picks the next token of one row and its log-prob under the distribution drawn from.

  z = logits / T
  sampled: token ~ softmax(filter(z)),  logp = log softmax(filter(z))[token]
           (= log softmax(z)[token] with top-k/top-p off)
  greedy:  token = argmax(z),           logp = log softmax(z)[token]

  Args:
      key: PRNG key of this row and step (unused when greedy).
      logits: float32[V] next-token logits.
      temperature, top_k, top_p, greedy: see `SamplingConfig`.

  Returns:
      (token int32 scalar, logp float32 scalar).
  """
  chex.assert_rank(logits, 1)
  scaled = logits.astype(jnp.float32) / temperature
  if greedy:
    token = jnp.argmax(scaled)
    logp = jax.nn.log_softmax(scaled)[token]
  else:
    filtered = filter_logits(scaled, top_k=top_k, top_p=top_p)
    token = jax.random.categorical(key, filtered)
    logp = jax.nn.log_softmax(filtered)[token]
  return token.astype(jnp.int32), logp


def sampled_logprob(
  logits: jax.Array, token: jax.Array, *, temperature: float, top_k: int, top_p: float
) -> jax.Array:
  """log pi_sampler(token): a given token's log-prob under the distribution `select_token`
  draws from (the filtered, renormalised tempered one), e.g. to score a reply by teacher forcing.

    z = logits / T;  K = the kept set of `filter_logits(z, top_k, top_p)`
    log pi_sampler(y) = z_y - log sum_{v in K} exp(z_v)   if y in K,   -inf otherwise

  With top_k = 0 and top_p = 1 it is bit for bit `jax.nn.log_softmax(z)[token]`. One row;
  `jax.vmap` it over rows. (`tests/sampling_reference.py` computes the same in float64 NumPy
  from the definition, without this module.)

  Args:
    logits: float[V] next-token logits (computed in float32, as the sampler).
    token: int32 scalar.
    temperature: T > 0.
    top_k: int >= 0, 0 = no top-k cut (static).
    top_p: float in (0, 1], 1 = no nucleus cut (static).

  Returns:
    float32 scalar.
  """
  chex.assert_rank(logits, 1)
  chex.assert_rank(token, 0)
  scaled = logits.astype(jnp.float32) / temperature
  return jax.nn.log_softmax(filter_logits(scaled, top_k=top_k, top_p=top_p))[token]
