"""SeeUPO's turns run on the rows that have them and on the prefix that ends with them.

`LearnerConfig.turn_buckets` = K: each turn's passes run on the rows with a token they need
(compacted, in chunks of 1/K of a micro-batch) and on the shortest of K static prefix
lengths that holds those tokens. These tests check, on a hand-built ragged batch, that the
update is the full-batch update (`turn_buckets=1`) to float rounding, on both routes (fused,
separate passes), and that the restriction happens: a logprob_fn that reports the shape it
runs on at run time (`jax.debug.callback`) sees exactly the rows and prefixes of the plan.
"""

import collections
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from seeupo_jax import learner

N, L, V = 8, 32, 5
SGD = optax.sgd(0.5)  # plain SGD: Adam would turn rounding-level gradients into full steps

# Turn t's generated tokens (start, stop); prompt [0, 4), environment between the turns.
SEGMENTS = ((4, 8), (10, 14), (16, 22), (24, 30))
# Turns of each row (rows 0..7): turns end at different rows and lengths.
ROW_TURNS = (4, 2, 3, 4, 2, 4, 3, 4)


def ragged_batch(seed=0) -> learner.Batch:
  """Rows with 2, 3 or 4 turns (ending at positions 14, 22, 30), right-padded to L = 32."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, V, (N, L)).astype(np.int32)
  valid = np.zeros((N, L), bool)
  turn_ids = np.full((N, L), -1, np.int32)
  for i, turns in enumerate(ROW_TURNS):
    for t in range(turns):
      turn_ids[i, slice(*SEGMENTS[t])] = t
    valid[i, : SEGMENTS[turns - 1][1]] = True
  tokens = np.where(valid, tokens, 0)
  return learner.Batch(
    tokens=tokens,
    token_valid=valid,
    turn_ids=turn_ids,
    sample_logp=np.zeros((N, L), np.float32),
    rewards=rng.normal(size=N).astype(np.float32),
    group_ids=(np.arange(N) // 4 * 4).astype(np.int32),
    row_valid=np.ones(N, bool),
  )


def logprob_fn(params, batch):
  """logp[i, j] = log_softmax(table[j])[tokens[i, j]] (rows share the table by position; any
  prefix length), 0 where nothing is predicted."""
  length = batch.tokens.shape[1]
  logp_all = jax.nn.log_softmax(params["table"][:length], axis=-1)
  logp = logp_all[jnp.arange(length)[None, :], batch.tokens]
  valid = batch.token_valid
  predicted = valid & jnp.pad(valid[:, :-1], ((0, 0), (1, 0)))
  return jnp.where(predicted, logp, 0.0)


def run(config, fn=logprob_fn, seed=0):
  table = 0.5 * jax.random.normal(jax.random.key(seed), (L, V), jnp.float32)
  params = {"table": table}
  state = learner.init_state(jax.tree.map(jnp.copy, params), SGD, ref_params=params)
  step = learner.make_update(fn, SGD, config)
  state, metrics = step(state, jax.tree.map(jnp.asarray, ragged_batch(seed)), jax.random.key(3))
  return jax.tree.map(np.asarray, state), jax.tree.map(np.asarray, metrics)


def assert_same_update(a, b):
  (state_a, metrics_a), (state_b, metrics_b) = a, b
  for x, y in zip(jax.tree.leaves(state_a), jax.tree.leaves(state_b)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
  # The sampler gap covers only the tokens the first pass computed (docs/learner.md).
  names = set(metrics_a) - {"sample_logp_gap_mean", "sample_logp_gap_max"}
  assert names == set(metrics_b) - {"sample_logp_gap_mean", "sample_logp_gap_max"}
  for name in names:
    np.testing.assert_allclose(metrics_a[name], metrics_b[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize(
  "changes",
  [
    {},  # fused: the step's own forward pass is the first pass
    {"epochs": 2, "minibatches": 2, "microbatches": 2},  # separate passes, chunks per micro-batch
    {"agg": "seq-mean-token-sum-norm"},  # divides by L: the loss must see the full width
    # Dr. GRPO's constant C instead of L, on both routes: every chunk divides by the same C.
    {"agg": "seq-mean-token-sum-norm", "norm_length": 48},
    dict(agg="seq-mean-token-sum-norm", norm_length=20, epochs=2, minibatches=2, microbatches=2),
  ],
  ids=["fused", "separate", "sum_norm_by_L", "sum_norm_by_C", "sum_norm_by_C_separate"],
)
def test_bucketed_update_is_the_full_batch_update(changes):
  full = learner.LearnerConfig(algorithm="seeupo", num_turns=4, turn_buckets=1, **changes)
  assert_same_update(run(full.replace(turn_buckets=4)), run(full))


def test_norm_length_is_the_constant_of_every_turn():
  """SeeUPO with agg="seq-mean-token-sum-norm", K = 4: C = L = 32 is the update without a
  constant, bit for bit (each turn's prefix passes still divide by the full width), and
  C = 64 halves the first turn's loss (reverse order: turn 3; its passes are the first)."""
  config = learner.LearnerConfig(algorithm="seeupo", num_turns=4, agg="seq-mean-token-sum-norm")
  by_l = run(config)
  by_32 = run(config.replace(norm_length=L))
  for x, y in zip(jax.tree.leaves(by_l), jax.tree.leaves(by_32)):
    np.testing.assert_array_equal(x, y)
  _, metrics_64 = run(config.replace(norm_length=2 * L))
  np.testing.assert_allclose(
    metrics_64["turn/pg_loss"][3], by_l[1]["turn/pg_loss"][3] / 2, rtol=1e-6
  )
  assert abs(by_l[1]["turn/pg_loss"][3]) > 1e-4


def recording_logprob_fn():
  """(logprob_fn, shapes): every run of logprob_fn appends its batch's (rows, length)."""
  shapes = []

  def record(tokens):
    shapes.append(tuple(tokens.shape))

  def fn(params, batch):
    jax.debug.callback(record, batch.tokens)
    return logprob_fn(params, batch)

  return fn, shapes


def test_turns_run_on_their_rows_and_prefixes():
  """The plan, by hand (reverse order; fused; K = 4: chunks of 8 / 4 = 2 rows, prefixes of
  8, 16, 24 or 32 positions; the first pass also needs the pending (later) turn's tokens):
    turn 3: rows with turn 3 (0, 3, 5, 7), last token 29            -> 2 chunks x 32
    turn 2: rows with turn 2 or 3 (0, 2, 3, 5, 6, 7), last token 29 -> 3 chunks x 32
    turn 1: every row, last token 21 (turn 2, pending)              -> 4 chunks x 24
    turn 0: every row, last token 13 (turn 1, pending)              -> 4 chunks x 16
  plus the reference pass over the whole batch (8 x 32)."""
  fn, shapes = recording_logprob_fn()
  state, _ = run(learner.LearnerConfig(algorithm="seeupo", num_turns=4), fn)
  jax.effects_barrier()
  expected = {(2, 32): 5, (2, 24): 4, (2, 16): 4, (8, 32): 1}
  assert collections.Counter(shapes) == expected
  processed = sum(rows * length for rows, length in shapes) - N * L  # without the reference
  assert processed == 640  # 5 x 2 x 32 + 4 x 2 x 24 + 4 x 2 x 16, of 4 x 8 x 32 = 1024

  fn, shapes = recording_logprob_fn()
  run(learner.LearnerConfig(algorithm="seeupo", num_turns=4, turn_buckets=1), fn)
  jax.effects_barrier()
  assert collections.Counter(shapes) == {(8, 32): 5}


def test_a_logprob_fn_that_needs_the_full_length_still_gets_the_update():
  """A logprob_fn that only runs at the batch's full length: a warning, the rows are still
  left out, and the update is unchanged."""

  def full_length_only(params, batch):
    if batch.tokens.shape[1] != L:  # as a table broadcast to [N, L, V] would
      raise ValueError(f"needs L = {L} positions, got {batch.tokens.shape}")
    return logprob_fn(params, batch)

  full = learner.LearnerConfig(algorithm="seeupo", num_turns=4, turn_buckets=1)
  with pytest.warns(UserWarning, match="full length"):
    bucketed = run(full.replace(turn_buckets=4), full_length_only)
  with warnings.catch_warnings():
    warnings.filterwarnings("error", message=".*full length", category=UserWarning)
    reference = run(full, full_length_only)
  assert_same_update(bucketed, reference)


def test_turn_buckets_is_validated():
  with pytest.raises(ValueError, match="turn_buckets"):
    learner.LearnerConfig(turn_buckets=0)
