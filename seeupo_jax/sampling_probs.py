"""The log-prob of a sampled token under the distribution it was actually drawn from.

The sampler draws from softmax(filter(logits / T)) (`sampling.filter_logits`: top-k, then
top-p on the renormalised top-k distribution) and records this log-prob
(`sampling.select_token`), while the learner's `qwen_logprob_fn` computes log softmax(logits / T)
of the full tempered distribution. With top-k or top-p on, the two differ by the log of the
kept mass; the behaviour policy of an importance weight (the learner's `LearnerConfig.tis`) is
the filtered one. This is its reference: one row, independent of the sampler's loop.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from seeupo_jax.sampling import filter_logits


def sampled_logprob(
  logits: jax.Array, token: jax.Array, *, temperature: float, top_k: int, top_p: float
) -> jax.Array:
  """log pi_sampler(token): its log-prob under the filtered, renormalised tempered distribution.

    z = logits / T;  K = the kept set of `sampling.filter_logits(z, top_k, top_p)`
    (the k most likely, then the most-likely-first prefix whose mass before a token is < top_p)
    log pi_sampler(y) = z_y - log sum_{v in K} exp(z_v)   if y in K,   -inf otherwise
                      = log softmax(z)_y - log sum_{v in K} softmax(z)_v
  With top_k = 0 and top_p = 1 nothing is filtered and the result is bit for bit
  `jax.nn.log_softmax(z)[token]`. A token outside K
  (it cannot have been drawn; greedy's argmax is always in K) gets -inf.

  One row; `jax.vmap` it over rows (as `sampling.emit` does with `select_token`).

  Args:
    logits: float[V] next-token logits (any float dtype; computed in float32, as the sampler).
    token: int32 scalar, the token drawn.
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
