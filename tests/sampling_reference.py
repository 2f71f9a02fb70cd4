"""Reference of the sampler's filtered distribution in float64 NumPy, written from the definition.

The sampler draws each token from softmax(filter(logits / T)), with filter = top-k, then top-p
on the renormalised top-k distribution, and records that distribution's log-prob of the token
(the behaviour policy of an importance weight, `LearnerConfig.tis`). With top-k or top-p on it
differs from the learner's full tempered log-prob by the log of the kept mass. This module
computes it again from the definition, without the sampler's code, so that the teacher-forcing
tests compare the sampler with something it did not compute:

    z = logits / T                                   (float64)
    order = tokens by z, most likely first; ties: the lower id first
    candidates = the first k of order (k = 0: all)
    p_i = softmax over the candidates, in order
    K = the candidates i with sum_{j<i} p_j < top_p  (the mass before a token; the most likely
        token is always kept)
    log pi_sampler(y) = z_y - log sum_{v in K} exp(z_v)   if y in K,   -inf otherwise
"""

from __future__ import annotations

import math

import numpy as np


def filtered_logprobs(
  logits: np.ndarray, *, temperature: float, top_k: int, top_p: float
) -> tuple[np.ndarray, float]:
  """log pi_sampler(y) for every token y of one row, and the nucleus decision's margin.

  Args:
    logits: float[V], one row's next-token logits (any float dtype; read as float64).
    temperature: T > 0.
    top_k: int >= 0, 0 = no top-k cut.
    top_p: float in (0, 1], 1 = no nucleus cut.

  Returns:
    (float64[V] log-probs, -inf outside the kept set; the smallest |mass before - top_p| over
    the candidates the nucleus looked at, up to the first one it dropped: inf when top_p = 1).
  """
  z = np.asarray(logits, np.float64) / temperature
  assert z.ndim == 1, z.shape
  vocab = z.shape[0]
  order = sorted(range(vocab), key=lambda v: (-z[v], v))
  if top_k:
    order = order[:top_k]
  top = z[order[0]]
  weights = [math.exp(z[v] - top) for v in order]
  total = math.fsum(weights)
  kept, before, margin = [], 0.0, math.inf
  for v, w in zip(order, weights):
    if top_p < 1.0:
      margin = min(margin, abs(before - top_p))
      if not before < top_p:
        break
    kept.append(v)
    before += w / total
  log_mass = top + math.log(math.fsum(math.exp(z[v] - top) for v in kept))
  out = np.full(vocab, -np.inf)
  for v in kept:
    out[v] = z[v] - log_mass
  return out, margin


def sampled_logprobs(
  logits: np.ndarray, tokens: np.ndarray, *, temperature: float, top_k: int, top_p: float
) -> np.ndarray:
  """log pi_sampler(token) of every row: `filtered_logprobs` of each row at its token.

  Args:
    logits: float[..., V], next-token logits.
    tokens: int[...], the token of each row.
    temperature, top_k, top_p: as `filtered_logprobs`.

  Returns:
    float64[...].
  """
  logits = np.asarray(logits)
  tokens = np.asarray(tokens)
  assert logits.shape[:-1] == tokens.shape, (logits.shape, tokens.shape)
  rows = logits.reshape(-1, logits.shape[-1])
  out = np.empty(rows.shape[0], np.float64)
  for i, (row, token) in enumerate(zip(rows, tokens.reshape(-1))):
    logp, _ = filtered_logprobs(row, temperature=temperature, top_k=top_k, top_p=top_p)
    out[i] = logp[int(token)]
  return out.reshape(tokens.shape)
