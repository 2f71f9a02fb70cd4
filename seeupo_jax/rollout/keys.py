"""Key derivation: the PRNG key of each reply of each episode, from the call's key alone.

The reply of turn t of (group g, sample i, attempt a) samples from
fold_in(fold_in(fold_in(fold_in(rng, g), i), a), t), so an episode's keys, and so its tokens,
do not depend on the order episodes run in, the process that plays them, or the slot they sit in.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np


def _fold_keys(rng, groups, samples, attempts, turns: int) -> np.ndarray:
  def one(g, i, a):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(rng, g), i), a)
    return jax.vmap(lambda t: jax.random.key_data(jax.random.fold_in(key, t)))(
      np.arange(turns, dtype=np.uint32)
    )

  return jax.vmap(one)(groups, samples, attempts)


_fold_keys_jit = jax.jit(_fold_keys, static_argnums=4)


def trajectory_keys(
  rng: jax.Array, groups: Sequence[int], samples: Sequence[int], attempts: Sequence[int], turns: int
) -> np.ndarray:
  """uint32[E, turns, 2]: the raw reply key of each turn of each episode (see the docstring).

  Args:
    rng: the call's PRNG key (typed or raw).
    groups, samples, attempts: [E] the episodes' group, sample index and attempt.
    turns: the most turns of an episode.
  """
  if not jax.numpy.issubdtype(rng.dtype, jax.dtypes.prng_key):
    rng = jax.random.wrap_key_data(rng)
  as_u32 = lambda x: np.asarray(x, np.uint32)  # noqa: E731
  return np.asarray(_fold_keys_jit(rng, as_u32(groups), as_u32(samples), as_u32(attempts), turns))
