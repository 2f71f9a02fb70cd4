"""Behavioural tests of the learner (`seeupo_jax.learner`).

Each test checks one behaviour of the update end to end, on small "table of
logits" policies whose log-probs are cheap and easy to recompute in NumPy:

  shared table  params {"table": f32[L, V]}:    logp[i, j] = log_softmax(table[j])[tokens[i, j]]
                (rows share the table by position, so rows and turns interact);
  per-row table params {"table": f32[R, L, V]}: logp[i, j] = log_softmax(table[r_i, j])[tokens[i, j]]
                with r_i = tokens[i, 0], the row's own id (the learner gathers rows into
                mini-batches, so the row's identity travels in its tokens): each row's
                gradient touches only its own slice, and each token only table[r_i, j].

Expected values come from NumPy recomputations or from invariances (permutations,
absent turns, padding rows), never from the code under test.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from seeupo_jax import learner
from seeupo_jax import sampling
from seeupo_jax.models import qwen
import tiny

# ----------------------------------------------------------------------------------------------
# Table-of-logits policies and batches.


def _predicted(batch) -> jax.Array:
  """bool[N, L]: positions whose token is predicted by the previous one (j > 0, both valid)."""
  valid = batch.token_valid
  return valid & jnp.pad(valid[:, :-1], ((0, 0), (1, 0)))


def shared_logprob_fn(params, batch):
  """logp[i, j] = log_softmax(table[j])[tokens[i, j]], table f32[L, V]; 0 where nothing is predicted."""
  logp_all = jax.nn.log_softmax(params["table"], axis=-1)  # [L, V]
  length = batch.tokens.shape[1]
  logp = logp_all[jnp.arange(length)[None, :], batch.tokens]
  return jnp.where(_predicted(batch), logp, 0.0)


def per_row_logprob_fn(params, batch):
  """logp[i, j] = log_softmax(table[tokens[i, 0], j])[tokens[i, j]], table f32[R, L, V]."""
  logp_all = jax.nn.log_softmax(params["table"][batch.tokens[:, 0]], axis=-1)  # [N, L, V]
  logp = jnp.take_along_axis(logp_all, batch.tokens[..., None], axis=-1)[..., 0]
  return jnp.where(_predicted(batch), logp, 0.0)


def np_log_softmax(x):
  x = np.asarray(x, np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def np_per_row_logp(table, tokens):
  """NumPy twin of `per_row_logprob_fn` (float64; unmasked)."""
  logp_all = np_log_softmax(np.asarray(table)[tokens[:, 0]])  # [N, L, V]
  return np.take_along_axis(logp_all, tokens[..., None], axis=-1)[..., 0]


def build_batch(
  turns,
  *,
  length,
  vocab,
  seed=0,
  rewards=None,
  group_ids=None,
  row_valid=None,
  row_id_token=False,
):
  """A right-padded `Batch` of trajectories: prompt, then per turn a generated segment
  followed (except after the last) by environment tokens.

  Args:
    turns: per row, an int k (turns 0..k-1) or a list of turn ids, in order.
    length: L.
    vocab: V (token ids drawn in [0, V)).
    row_id_token: put the row index in tokens[i, 0] (for `per_row_logprob_fn`).

  Returns:
    a `learner.Batch` of NumPy arrays.
  """
  rng = np.random.default_rng(seed)
  n = len(turns)
  tokens = np.zeros((n, length), np.int32)
  valid = np.zeros((n, length), bool)
  turn_ids = np.full((n, length), -1, np.int32)
  for i, row_turns in enumerate(turns):
    if isinstance(row_turns, int):
      row_turns = list(range(row_turns))
    segments = [(-1, int(rng.integers(2, 5)))]
    for k, t in enumerate(row_turns):
      segments.append((t, int(rng.integers(2, 6))))
      if k < len(row_turns) - 1:
        segments.append((-1, int(rng.integers(1, 4))))
    pos = 0
    for t, size in segments:
      turn_ids[i, pos : pos + size] = t
      pos += size
    assert pos <= length, (pos, length)
    valid[i, :pos] = True
    tokens[i, :pos] = rng.integers(0, vocab, pos)
    if row_id_token:
      tokens[i, 0] = i
  if rewards is None:
    rewards = rng.normal(size=n)
  if group_ids is None:
    group_ids = (np.arange(n) // 2) * 2
  if row_valid is None:
    row_valid = np.ones(n, bool)
  return learner.Batch(
    tokens=tokens,
    token_valid=valid,
    turn_ids=turn_ids,
    sample_logp=np.zeros((n, length), np.float32),
    rewards=np.asarray(rewards, np.float32),
    group_ids=np.asarray(group_ids, np.int32),
    row_valid=np.asarray(row_valid, bool),
  )


def take_rows(batch, rows):
  """The rows `rows` of every field of a NumPy batch (group ids travel with their rows)."""
  return jax.tree.map(lambda x: np.asarray(x)[np.asarray(rows)], batch)


def table_params(shape, seed=0, scale=0.5):
  return {"table": scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32)}


def copy_tree(tree):
  return jax.tree.map(jnp.copy, tree)


def run_update(step, optimizer, params, batch, key=0, ref=True):
  """One call of `step` on a fresh state; returns (state, metrics) as NumPy trees.

  `params` is copied first (the step donates its state).
  """
  params = copy_tree(params)
  state = learner.init_state(params, optimizer, ref_params=params if ref else None)
  batch = jax.tree.map(jnp.asarray, batch)
  state, metrics = step(state, batch, jax.random.key(key))
  return jax.tree.map(np.asarray, state), jax.tree.map(np.asarray, metrics)


def assert_trees_equal(a, b):
  """Bit-for-bit equality of every leaf."""
  leaves_a, tree_a = jax.tree.flatten(a)
  leaves_b, tree_b = jax.tree.flatten(b)
  assert tree_a == tree_b
  for x, y in zip(leaves_a, leaves_b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


ADAMW = learner.default_optimizer(learning_rate=1e-2)


@functools.lru_cache(maxsize=None)
def cached_update(logprob_fn, optimizer, config):
  """One jitted update per (logprob_fn, optimizer, config): equal shapes compile once."""
  return learner.make_update(logprob_fn, optimizer, config)


# ----------------------------------------------------------------------------------------------
# 1. The turn loop is a lax.scan: the program (lowered and compiled) does not grow with num_turns.


@pytest.mark.fresh_compiles
def test_compile_does_not_grow_with_num_turns():
  n, length, vocab = 8, 40, 7
  batch = jax.tree.map(
    jnp.asarray, build_batch([2, 1, 2, 2, 1, 2, 2, 1], length=length, vocab=vocab)
  )
  params = table_params((length, vocab))

  def lower(num_turns):
    # A new closure each time, so no tracing or compilation cache is shared between tries.
    def logprob_fn(p, b):
      return shared_logprob_fn(p, b)

    config = learner.LearnerConfig(algorithm="seeupo", num_turns=num_turns, epochs=2)
    step = learner.make_update(logprob_fn, ADAMW, config, jit=False)
    state = learner.init_state(copy_tree(params), ADAMW, ref_params=params)
    return jax.jit(step).lower(state, batch, jax.random.key(0))

  lowered = {t: lower(t) for t in (2, 16)}
  size = {t: len(lowered[t].as_text()) for t in (2, 16)}
  assert size[16] / size[2] < 1.2, size
  # XLA keeps the loop (no unrolling): the optimized programs are as large, with as many
  # loops. (Compile seconds by T: benchmarks/bench_learner_memory.py --turns.)
  compiled = {t: lowered[t].compile().as_text() for t in (2, 16)}
  assert len(compiled[16]) / len(compiled[2]) < 1.2, {t: len(c) for t, c in compiled.items()}
  assert compiled[16].count(" while(") == compiled[2].count(" while(") > 0


# ----------------------------------------------------------------------------------------------
# 2. Everything is indexed by trajectory: permuting the rows permutes nothing else.


@pytest.mark.parametrize("epochs", [2, 1])  # separate passes; fused (M folded inside the step)
def test_row_permutation_changes_no_parameter(epochs):
  length, vocab = 40, 7
  # Rows with 1..4 turns at different positions: the shared table couples rows and turns,
  # and after the first turn the correction M differs from 1 and from row to row.
  batch = build_batch(
    [4, 1, 3, 2, 4, 2, 3, 1],
    length=length,
    vocab=vocab,
    seed=1,
    rewards=[1.0, 0.0, 0.5, 0.2, 0.9, 0.1, 0.0, 0.7],
    group_ids=[0, 0, 2, 2, 0, 2, 6, 6],
  )
  params = table_params((length, vocab), seed=1)
  config = learner.LearnerConfig(algorithm="seeupo", num_turns=4, epochs=epochs, minibatches=1)
  step = cached_update(shared_logprob_fn, ADAMW, config)
  permutation = np.array([5, 2, 7, 0, 3, 6, 1, 4])

  base, base_metrics = run_update(step, ADAMW, params, batch)
  permuted, _ = run_update(step, ADAMW, params, take_rows(batch, permutation))
  # Only the rewards moved to other trajectories: a different update (the test can fail).
  moved = batch.replace(rewards=batch.rewards[permutation])
  moved_rewards, _ = run_update(step, ADAMW, params, moved)
  # The correction matters here: without it the update is different.
  no_correction = cached_update(shared_logprob_fn, ADAMW, config.replace(correction=False))
  uncorrected, _ = run_update(no_correction, ADAMW, params, batch)

  assert base_metrics["M_max"] > 1.0 + 1e-3 or base_metrics["M_min"] < 1.0 - 1e-3
  np.testing.assert_allclose(permuted.params["table"], base.params["table"], rtol=0, atol=1e-6)
  assert np.max(np.abs(moved_rewards.params["table"] - base.params["table"])) > 1e-3
  assert np.max(np.abs(uncorrected.params["table"] - base.params["table"])) > 1e-5


# ----------------------------------------------------------------------------------------------
# 3. Absent turns and absent rows change nothing.


@pytest.mark.parametrize("epochs, minibatches", [(2, 2), (1, 1)])  # separate passes; fused
def test_turn_that_no_row_has_changes_nothing(epochs, minibatches):
  length, vocab = 40, 7
  batch = build_batch([4, 2, 3, 4, 1, 4, 3, 2], length=length, vocab=vocab, seed=2)
  assert np.asarray(batch.turn_ids).max() == 3
  params = table_params((length, vocab), seed=2)
  results = []
  for num_turns in (4, 5):
    config = learner.LearnerConfig(
      algorithm="seeupo",
      num_turns=num_turns,
      epochs=epochs,
      minibatches=minibatches,
      kl_coef=0.05,
    )
    step = cached_update(shared_logprob_fn, ADAMW, config)
    state, metrics = run_update(step, ADAMW, params, batch, key=3)
    results.append((state, metrics))
  (four, four_metrics), (five, five_metrics) = results
  assert_trees_equal(five.params, four.params)
  assert_trees_equal(five.opt_state, four.opt_state)  # AdamW's moments and count too
  assert int(five.optimizer_steps) == int(four.optimizer_steps) == 4 * epochs * minibatches
  assert five_metrics["turns_updated"] == 4
  assert five_metrics["turn/optimizer_steps"][4] == 0
  np.testing.assert_array_equal(five_metrics["turn/trajectories"], [8, 7, 5, 3, 0])


def test_padding_row_changes_nothing():
  length, vocab = 40, 7
  rows = build_batch([3, 2, 1, 3, 2, 3, 1], length=length, vocab=vocab, seed=4)
  rows = rows.replace(group_ids=np.array([0, 0, 0, 3, 3, 5, 5], np.int32))
  params = table_params((length, vocab), seed=4)

  def with_padding_row(seed, reward):
    """`rows` plus an 8th row with row_valid=False and arbitrary content (all four turns)."""
    extra = build_batch([4], length=length, vocab=vocab, seed=seed, rewards=[reward])
    extra = extra.replace(group_ids=np.array([seed % 8], np.int32), row_valid=np.array([False]))
    return jax.tree.map(lambda a, b: np.concatenate([a, b]), rows, extra)

  config = learner.LearnerConfig(algorithm="seeupo", num_turns=4, epochs=2)
  step = cached_update(shared_logprob_fn, ADAMW, config)
  alone, _ = run_update(step, ADAMW, params, rows)
  padded_a, metrics = run_update(step, ADAMW, params, with_padding_row(10, 1e6))
  padded_b, _ = run_update(step, ADAMW, params, with_padding_row(11, -3.0))
  # A padding row's content is never read: bit-identical updates.
  assert_trees_equal(padded_a.params, padded_b.params)
  assert_trees_equal(padded_a.opt_state, padded_b.opt_state)
  # And the update equals the one without the row (up to summation order: N differs).
  np.testing.assert_allclose(padded_a.params["table"], alone.params["table"], rtol=0, atol=1e-6)
  # Only the padding row has a turn 3: that turn is not counted, let alone updated.
  assert metrics["turn/trajectories"][3] == 0 and metrics["turns_updated"] == 3


def test_rows_without_a_turn_add_nothing_to_it():
  """Rows lacking turn 3 neither train on it nor count in its loss's denominator.

  Per-row tables, SGD, kl off and normalisation "none": four rows have only turn 3;
  four added rows (singleton groups, so A = 0 and their own gradient is 0) have
  turns 0..2. The first four rows' update must not see them.
  """
  length, vocab = 32, 8
  base_turns = [[3], [3], [3], [3]]
  added_turns = [3, 2, 3, 1]
  rewards = [1.0, 0.0, 0.3, 0.9, 0.5, -2.0, 4.0, 0.7]
  groups = [0, 0, 1, 1, 4, 5, 6, 7]
  sgd = optax.sgd(1.0)
  config = learner.LearnerConfig(
    algorithm="seeupo", num_turns=4, epochs=2, kl_coef=0.0, normalisation="none"
  )
  step = cached_update(per_row_logprob_fn, sgd, config)
  params = table_params((8, length, vocab), seed=5)

  def batch_of(turns, n):
    return build_batch(
      turns,
      length=length,
      vocab=vocab,
      seed=6,
      rewards=rewards[:n],
      group_ids=groups[:n],
      row_id_token=True,
    )

  alone, _ = run_update(step, sgd, params, batch_of(base_turns, 4), ref=False)
  added, _ = run_update(step, sgd, params, batch_of(base_turns + added_turns, 8), ref=False)
  # Control: the added rows WITH a turn 3 enter turn 3's denominator (4 -> 8 rows).
  with_turn_3 = [[0, 1, 2, 3]] * 4
  control, _ = run_update(step, sgd, params, batch_of(base_turns + with_turn_3, 8), ref=False)

  start, moved = np.asarray(params["table"]), alone.params["table"]
  assert np.max(np.abs(moved[:4] - start[:4])) > 1e-2  # the first rows did learn
  np.testing.assert_array_equal(moved[4:], start[4:])
  np.testing.assert_allclose(added.params["table"][:4], moved[:4], rtol=0, atol=1e-6)
  np.testing.assert_array_equal(added.params["table"][4:], start[4:])  # A = 0: no step
  assert np.max(np.abs(control.params["table"][:4] - moved[:4])) > 1e-3


# ----------------------------------------------------------------------------------------------
# 4. Clipping acts once the policy has moved (epochs x mini-batches > 1).


@pytest.mark.parametrize("algorithm", ["gspo", "grpo"])
def test_clipped_rows_get_no_gradient_in_later_epochs(algorithm):
  """Epoch 1 starts at ratio 1 (nothing clipped); epoch 2 sees the moved policy.

  Per-row tables and SGD: the change of table[i] (gspo) or table[i, j] (grpo, token j)
  in epoch 2 is exactly 0 where the sequence (token) ratio after epoch 1, recomputed
  in NumPy, is clipped on the advantage's side, and non-zero elsewhere.
  """
  n, length, vocab = 8, 24, 8
  rewards = np.array([0.0, 1.0, 0.2, 0.9, 0.5, 0.1, 0.7, 0.45])
  batch = build_batch(
    [1, 2, 1, 2, 2, 1, 2, 1],
    length=length,
    vocab=vocab,
    seed=7,
    rewards=rewards,
    group_ids=[0] * n,
    row_id_token=True,
  )
  params = table_params((n, length, vocab), seed=7)
  sgd = optax.sgd(20.0)
  config = learner.LearnerConfig(algorithm=algorithm, num_turns=2, kl_coef=0.0)
  one = cached_update(per_row_logprob_fn, sgd, config)
  two = cached_update(per_row_logprob_fn, sgd, config.replace(epochs=2))
  after_one, metrics_one = run_update(one, sgd, params, batch, key=1, ref=False)
  after_two, metrics_two = run_update(two, sgd, params, batch, key=1, ref=False)
  assert metrics_one["clip_fraction"] == 0.0  # one epoch, one mini-batch: the ratio is 1
  assert metrics_two["clip_fraction"] > 0.0

  # Group-normalised advantages (one group), computed here.
  adv = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)
  mask = (batch.turn_ids >= 0) & batch.token_valid
  log_ratio = np_per_row_logp(after_one.params["table"], batch.tokens) - np_per_row_logp(
    params["table"], batch.tokens
  )
  epoch_two_change = after_two.params["table"] - after_one.params["table"]  # [N, L, V]
  if algorithm == "gspo":
    ratio = np.exp((log_ratio * mask).sum(1) / mask.sum(1))  # [N]
    margin = np.minimum(np.abs(ratio - 0.8), np.abs(ratio - 1.2))
    clipped = ((adv > 0) & (ratio > 1.2)) | ((adv < 0) & (ratio < 0.8))
    assert margin.min() > 1e-3 and 0 < clipped.sum() < n, (ratio, adv)
    for i in range(n):
      if clipped[i]:
        np.testing.assert_array_equal(epoch_two_change[i], 0.0)
      else:
        assert np.any(epoch_two_change[i] != 0.0), i
  else:
    ratio = np.exp(log_ratio)  # [N, L] token ratios
    clipped = (((adv[:, None] > 0) & (ratio > 1.2)) | ((adv[:, None] < 0) & (ratio < 0.8))) & mask
    clear = np.minimum(np.abs(ratio - 0.8), np.abs(ratio - 1.2)) > 1e-3
    assert np.all(clear[mask]), ratio[mask & ~clear]
    assert clipped.sum() >= 5 and (mask & ~clipped).sum() >= 5
    for i, j in zip(*np.nonzero(mask)):
      if clipped[i, j]:
        np.testing.assert_array_equal(epoch_two_change[i, j], 0.0)
      else:
        assert np.any(epoch_two_change[i, j] != 0.0), (i, j)


# ----------------------------------------------------------------------------------------------
# 5. A non-finite loss or gradient skips that optimizer step and counts it.

# Non-finite values are made without exp(NaN): on XLA:CPU a fused exp of a NaN log-ratio
# has been seen to return finite garbage under value_and_grad (jax 0.10.2), which would
# test the compiler rather than the learner.


def poisoned_logprob_fn(params, batch):
  """`shared_logprob_fn` + 0 * sqrt(poison[tokens[i, 0]]): the values are finite, but a
  row whose poison entry is 0 gives a NaN gradient (0 * inf) to every step it is in."""
  poison = params["poison"][batch.tokens[:, 0]]  # [N]
  return shared_logprob_fn(params, batch) + 0.0 * jnp.sqrt(poison)[:, None]


def test_non_finite_loss_skips_the_step():
  """An infinite reward makes its group's advantages NaN: the (only) step is skipped."""
  length, vocab = 24, 7
  params = table_params((length, vocab), seed=8)
  rewards = [0.0, 1.0, 0.5, np.inf, 0.2, 0.3, 1.0, 0.0]
  batch = build_batch([2] * 8, length=length, vocab=vocab, seed=8, rewards=rewards)
  config = learner.LearnerConfig(algorithm="gspo", num_turns=2, kl_coef=0.0)
  step = cached_update(shared_logprob_fn, ADAMW, config)
  start = jax.tree.map(np.asarray, learner.init_state(copy_tree(params), ADAMW))
  state, metrics = run_update(step, ADAMW, params, batch, ref=False)
  assert_trees_equal(state.params, start.params)
  assert_trees_equal(state.opt_state, start.opt_state)
  assert int(state.skipped_updates) == 1 and int(state.optimizer_steps) == 0
  assert int(state.step) == 1
  assert metrics["skipped_updates"] == 1 and metrics["optimizer_steps"] == 0


def test_non_finite_gradient_skips_the_step():
  """Finite loss, NaN gradient: SeeUPO's step on each of the two turns is skipped."""
  length, vocab = 24, 7
  params = dict(table_params((length, vocab), seed=9), poison=jnp.zeros((vocab,), jnp.float32))
  batch = build_batch([2, 1, 2, 2, 1, 2, 2, 1], length=length, vocab=vocab, seed=9)
  config = learner.LearnerConfig(algorithm="seeupo", num_turns=2, kl_coef=0.0)
  step = cached_update(poisoned_logprob_fn, ADAMW, config)
  start = jax.tree.map(np.asarray, learner.init_state(copy_tree(params), ADAMW))
  state, metrics = run_update(step, ADAMW, params, batch, ref=False)
  assert_trees_equal(state.params, start.params)
  assert_trees_equal(state.opt_state, start.opt_state)
  assert int(state.skipped_updates) == 2 and int(state.optimizer_steps) == 0
  assert metrics["skipped_updates"] == 2 and metrics["optimizer_steps"] == 0
  np.testing.assert_array_equal(metrics["turn/skipped_updates"], [1, 1])


def test_only_the_non_finite_mini_batch_is_skipped():
  """SeeUPO, 2 turns x 2 epochs x 2 mini-batches; one poisoned row (both turns) spoils
  the mini-batch it lands in: 4 of the 8 steps are skipped, the other 4 applied."""
  length, vocab = 24, 8
  batch = build_batch([2] * 8, length=length, vocab=vocab, seed=10, row_id_token=True)
  poison = np.ones(vocab, np.float32)
  poison[5] = 0.0  # row 5
  params = dict(table_params((length, vocab), seed=10), poison=jnp.asarray(poison))
  config = learner.LearnerConfig(
    algorithm="seeupo", num_turns=2, epochs=2, minibatches=2, kl_coef=0.0
  )
  step = cached_update(poisoned_logprob_fn, ADAMW, config)
  state, metrics = run_update(step, ADAMW, params, batch, ref=False)
  assert int(state.skipped_updates) == 4 and int(state.optimizer_steps) == 4
  assert metrics["skipped_updates"] == 4 and metrics["optimizer_steps"] == 4
  assert np.all(np.isfinite(state.params["table"]))
  assert np.any(state.params["table"] != np.asarray(params["table"]))
  # The counters carry over to the next call.
  state = jax.tree.map(jnp.asarray, state)
  state, _ = step(state, jax.tree.map(jnp.asarray, batch), jax.random.key(1))
  assert int(state.skipped_updates) == 8 and int(state.optimizer_steps) == 8
  assert int(state.step) == 2


# ----------------------------------------------------------------------------------------------
# 6. Gradient accumulation over micro-batches is the same step.


@pytest.mark.parametrize("algorithm", ["seeupo", "gspo"])
def test_microbatches_give_the_same_update(algorithm):
  length, vocab = 40, 7
  batch = build_batch([4, 1, 3, 2, 4, 2, 3, 1], length=length, vocab=vocab, seed=11)
  params = table_params((length, vocab), seed=11)
  config = learner.LearnerConfig(algorithm=algorithm, num_turns=4, epochs=2, minibatches=2)
  whole = cached_update(shared_logprob_fn, ADAMW, config)
  split = cached_update(shared_logprob_fn, ADAMW, config.replace(microbatches=2))
  a, metrics_a = run_update(whole, ADAMW, params, batch, key=5)
  b, metrics_b = run_update(split, ADAMW, params, batch, key=5)
  np.testing.assert_allclose(b.params["table"], a.params["table"], rtol=0, atol=1e-6)
  assert np.max(np.abs(a.params["table"] - np.asarray(params["table"]))) > 1e-3
  for name in ("loss", "pg_loss", "kl", "grad_norm"):
    np.testing.assert_allclose(metrics_b[name], metrics_a[name], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("algorithm", ["seeupo", "grpo", "gspo", "rloo"])
@pytest.mark.parametrize("microbatches", [1, 2])
def test_fused_forward_gives_the_separate_passes_update(algorithm, microbatches):
  """One epoch of one mini-batch: the step's own forward pass serves as the old-log-prob pass
  (and, for SeeUPO, as the previous turn's "after" pass). Two routes, one update."""
  length, vocab = 40, 7
  batch = build_batch([4, 1, 3, 2, 4, 2, 3, 1], length=length, vocab=vocab, seed=12)
  params = table_params((length, vocab), seed=12)
  config = learner.LearnerConfig(algorithm=algorithm, num_turns=4, microbatches=microbatches)
  fused = learner.make_update(shared_logprob_fn, ADAMW, config)
  separate = learner.make_update(shared_logprob_fn, ADAMW, config, fuse_forward=False)
  a, metrics_a = run_update(fused, ADAMW, params, batch, key=3)
  b, metrics_b = run_update(separate, ADAMW, params, batch, key=3)
  np.testing.assert_allclose(a.params["table"], b.params["table"], rtol=0, atol=1e-6)
  assert np.max(np.abs(a.params["table"] - np.asarray(params["table"]))) > 1e-3
  for name in ("loss", "kl", "grad_norm", "optimizer_steps"):
    np.testing.assert_allclose(metrics_a[name], metrics_b[name], rtol=1e-5, atol=1e-7)
  if algorithm == "seeupo":
    for name in ("turn/M_mean", "turn/M_min", "turn/M_max"):
      np.testing.assert_allclose(metrics_a[name], metrics_b[name], rtol=0, atol=1e-6)
    assert np.any(np.abs(metrics_a["turn/M_mean"] - 1.0) > 1e-4)  # M really moved


def test_rows_must_divide_into_micro_batches():
  length, vocab = 24, 7
  batch = jax.tree.map(jnp.asarray, build_batch([2] * 8, length=length, vocab=vocab))
  params = table_params((length, vocab))
  config = learner.LearnerConfig(algorithm="gspo", num_turns=2, minibatches=3, kl_coef=0.0)
  step = learner.make_update(shared_logprob_fn, ADAMW, config)
  state = learner.init_state(copy_tree(params), ADAMW)
  with pytest.raises(ValueError, match=r"minibatches.*microbatches"):
    step(state, batch, jax.random.key(0))


# ----------------------------------------------------------------------------------------------
# 7. Bad configurations and bad batches are refused with a message that names them.


@pytest.mark.parametrize(
  "changes, field, allowed",
  [
    (dict(algorithm="ppo2"), "algorithm", "seeupo"),
    (dict(order="sideways"), "order", "reverse"),
    (dict(normalisation="x"), "normalisation", "group"),
    (dict(epochs=0), "epochs", ">= 1"),
    (dict(minibatches=0), "minibatches", ">= 1"),
    (dict(num_turns=3, order="custom", custom_order=(0, 0, 2)), "custom_order", "permutation"),
    (dict(algorithm="grpo", order="forward"), "order", "reverse"),
    (dict(algorithm="grpo", correction=False), "correction", "seeupo"),
    (dict(algorithm="reinforce", epochs=2), "epochs", "1"),
    (dict(algorithm="rloo", minibatches=2), "minibatches", "1"),
    (dict(clip_low=1.5), "clip_low", "[0, 1)"),
    (dict(kl_kind="k9"), "kl_kind", "low_var_kl"),
    (dict(agg="sum"), "agg", "token-mean"),
    (dict(algorithm="dr_grpo", norm_length=0), "norm_length", "an int >= 1"),
    (dict(algorithm="dr_grpo", norm_length=64.0), "norm_length", "an int >= 1"),
    (dict(algorithm="dr_grpo", norm_length=True), "norm_length", "an int >= 1"),
    (dict(norm_length=64), "norm_length", "None unless agg='seq-mean-token-sum-norm'"),
    (dict(algorithm="dr_grpo", agg="token-mean", norm_length=64), "norm_length", "None unless"),
  ],
)
def test_bad_config_is_refused(changes, field, allowed):
  with pytest.raises(ValueError) as error:
    learner.LearnerConfig(**changes)
  message = str(error.value)
  assert field in message and allowed in message, message


def test_ppo_needs_a_critic_and_kl_needs_a_reference():
  ppo = learner.LearnerConfig(algorithm="ppo", num_turns=2)
  with pytest.raises(ValueError, match="value_fn"):
    learner.make_update(shared_logprob_fn, ADAMW, ppo)
  with pytest.raises(ValueError, match="value_fn"):  # and the reverse: a critic for GSPO
    learner.make_update(
      shared_logprob_fn,
      ADAMW,
      learner.LearnerConfig(algorithm="gspo", num_turns=2),
      value_fn=shared_logprob_fn,
      critic_optimizer=ADAMW,
    )
  length, vocab = 24, 7
  step = learner.make_update(
    shared_logprob_fn, ADAMW, learner.LearnerConfig(algorithm="gspo", num_turns=2, kl_coef=0.01)
  )
  state = learner.init_state(table_params((length, vocab)), ADAMW, ref_params=None)
  batch = jax.tree.map(jnp.asarray, build_batch([2] * 8, length=length, vocab=vocab))
  with pytest.raises(ValueError, match="ref_params"):
    step(state, batch, jax.random.key(0))


def _corrupt(batch, **fields):
  out = {}
  for name, edit in fields.items():
    value = np.array(getattr(batch, name))
    edit(value)
    out[name] = value
  return batch.replace(**out)


def test_validate_refuses_bad_batches():
  batch = build_batch([3, 1, 2, 3], length=32, vocab=7, seed=12)
  learner.validate(batch, num_turns=3)  # a good batch passes
  last_valid = int(np.asarray(batch.token_valid)[1].sum()) - 1
  assert batch.turn_ids[1, 1] == -1  # prompts have >= 2 tokens

  def set_at(index, value):
    def edit(array):
      array[index] = value

    return edit

  cases = {
    "num_turns": (batch, 2),  # turn id 2 >= num_turns
    "padding": (_corrupt(batch, turn_ids=set_at((1, last_valid + 2), 0)), 3),
    "contiguous": (_corrupt(batch, token_valid=set_at((1, 1), False)), 3),  # a prompt token
    "group_ids": (_corrupt(batch, group_ids=set_at(2, 4)), 3),
    "finite": (_corrupt(batch, rewards=set_at(0, np.nan)), 3),
  }
  for expected, (bad, num_turns) in cases.items():
    with pytest.raises(ValueError, match=expected):
      learner.validate(bad, num_turns=num_turns)
  # A padding row may hold anything, even a non-finite reward.
  learner.validate(_corrupt(batch, rewards=set_at(0, np.nan), row_valid=set_at(0, False)), 3)


# ----------------------------------------------------------------------------------------------
# 8-9. The Qwen model functions: the learner's log-probs are the sampler's, and a SeeUPO / PPO
# update runs end to end on a tiny model.

TEMPERATURE = 0.9


@pytest.fixture(scope="module")
def tiny_qwen():
  config = tiny.model_config()
  params = jax.jit(qwen.init_params, static_argnums=0)(config, jax.random.key(0))
  # Sharper than the 0.02 init, so that the samples are far from uniform.
  params = jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, params)
  return config, params


@pytest.fixture(scope="module")
def two_turn_rollout(tiny_qwen):
  """N = 4 two-turn trajectories sampled from the tiny model.

  Row = prompt (6) + turn 0 (8 generated) + environment (3) + turn 1 (8 generated); each
  turn is sampled with the whole row so far as its prompt (equal lengths, no padding).
  Returns (Batch, the first turn's SampleOutput, the prompt length).
  """
  config, params = tiny_qwen
  n, prompt_len, env_len, new = 4, 6, 3, 8
  sample = sampling.make_sampler(
    config, sampling.SamplingConfig(max_new_tokens=new, temperature=TEMPERATURE)
  )
  rng = np.random.default_rng(13)
  prompt = jnp.asarray(rng.integers(1, config.vocab_size, (n, prompt_len)), jnp.int32)
  first = sample(params, prompt, jnp.ones(prompt.shape, bool), jax.random.key(1))
  assert np.all(np.asarray(first.lengths) == new)
  env = jnp.asarray(rng.integers(1, config.vocab_size, (n, env_len)), jnp.int32)
  context = jnp.concatenate([prompt, first.tokens, env], axis=1)
  second = sample(params, context, jnp.ones(context.shape, bool), jax.random.key(2))
  assert np.all(np.asarray(second.lengths) == new)
  tokens = np.asarray(jnp.concatenate([context, second.tokens], axis=1))
  length = tokens.shape[1]
  turn_ids = np.full((n, length), -1, np.int32)
  turn_ids[:, prompt_len : prompt_len + new] = 0
  turn_ids[:, length - new :] = 1
  sample_logp = np.zeros((n, length), np.float32)
  sample_logp[:, prompt_len : prompt_len + new] = np.asarray(first.logprobs)
  sample_logp[:, length - new :] = np.asarray(second.logprobs)
  batch = learner.Batch(
    tokens=tokens,
    token_valid=np.ones((n, length), bool),
    turn_ids=turn_ids,
    sample_logp=sample_logp,
    rewards=np.array([1.0, 0.0, 0.5, 0.2], np.float32),
    group_ids=np.zeros(n, np.int32),
    row_valid=np.ones(n, bool),
  )
  learner.validate(batch, num_turns=2)
  return batch, first, prompt_len


def test_qwen_logprobs_are_the_samplers(tiny_qwen, two_turn_rollout):
  config, params = tiny_qwen
  batch, first, prompt_len = two_turn_rollout
  logprob_fn = jax.jit(learner.qwen_logprob_fn(config, temperature=TEMPERATURE))
  logp = np.asarray(logprob_fn(params, jax.tree.map(jnp.asarray, batch)))
  new = first.tokens.shape[1]
  # Turn 0 against the sampler's own output, then every generated token of both turns. float32
  # rounding between the sampler's paged decode and one full forward: relative as well as
  # absolute (1.05e-5 at a log-prob of about -4.6 was seen; tests/sampling/test_sampling_multiturn.py).
  np.testing.assert_allclose(
    logp[:, prompt_len : prompt_len + new], np.asarray(first.logprobs), rtol=1e-5, atol=1e-5
  )
  generated = batch.turn_ids >= 0
  np.testing.assert_allclose(logp[generated], batch.sample_logp[generated], rtol=1e-5, atol=1e-5)
  assert np.all(logp[:, 0] == 0.0)
  # A different temperature gives different log-probs (the comparison can fail).
  other = learner.qwen_logprob_fn(config, temperature=1.0)(params, jax.tree.map(jnp.asarray, batch))
  assert np.max(np.abs(np.asarray(other)[generated] - logp[generated])) > 1e-3


def test_qwen_seeupo_update_runs(tiny_qwen, two_turn_rollout):
  config, params = tiny_qwen
  batch, _, _ = two_turn_rollout
  optimizer = learner.default_optimizer(learning_rate=1e-3)
  step = learner.make_update(
    learner.qwen_logprob_fn(config, temperature=TEMPERATURE),
    optimizer,
    learner.LearnerConfig(algorithm="seeupo", num_turns=2, epochs=2, minibatches=2),
  )
  state, metrics = run_update(step, optimizer, params, batch)
  assert np.isfinite(metrics["loss"]) and metrics["loss"] != 0.0
  assert metrics["optimizer_steps"] == 2 * 2 * 2 and metrics["skipped_updates"] == 0
  assert metrics["turns_updated"] == 2
  assert metrics["sample_logp_gap_max"] < 1e-4
  moved = jax.tree.map(lambda a, b: np.max(np.abs(a - np.asarray(b))), state.params, params)
  assert max(jax.tree.leaves(moved)) > 1e-4
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state.params))


@pytest.mark.parametrize("epochs, minibatches", [(1, 1), (2, 2)])  # fused; separate passes
def test_qwen_bfloat16_update_shows_the_drift_and_keeps_dtypes(
  tiny_qwen, two_turn_rollout, epochs, minibatches
):
  """A bf16 learner (params and compute) against float32 samples: the gap metric shows the
  drift, the update runs on both routes and params stay bf16."""
  config, params = tiny_qwen
  batch, _, _ = two_turn_rollout
  bf16 = config.replace(dtype="bfloat16", param_dtype="bfloat16")
  params16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  optimizer = learner.default_optimizer(learning_rate=1e-3)
  step = learner.make_update(
    learner.qwen_logprob_fn(bf16, temperature=TEMPERATURE),
    optimizer,
    learner.LearnerConfig(algorithm="seeupo", num_turns=2, epochs=epochs, minibatches=minibatches),
  )
  state, metrics = run_update(step, optimizer, params16, batch)
  # Independently: the bf16 model's log-probs of the same tokens, against the f32 sampler's.
  logp16 = learner.qwen_logprob_fn(bf16, temperature=TEMPERATURE)(
    params16, jax.tree.map(jnp.asarray, batch)
  )
  generated = batch.turn_ids >= 0
  gap = np.abs(np.asarray(logp16)[generated] - batch.sample_logp[generated])
  assert gap.max() > 1e-4  # bf16 drift is there, and the metric reports it
  np.testing.assert_allclose(metrics["sample_logp_gap_max"], gap.max(), rtol=1e-3)
  np.testing.assert_allclose(metrics["sample_logp_gap_mean"], gap.mean(), rtol=1e-3)
  assert metrics["optimizer_steps"] == 2 * epochs * minibatches
  assert metrics["skipped_updates"] == 0 and np.isfinite(metrics["loss"])
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {np.dtype(jnp.bfloat16)}
  moved = jax.tree.map(
    lambda a, b: np.max(np.abs(a.astype(np.float32) - np.asarray(b, np.float32))),
    state.params,
    params16,
  )
  assert max(jax.tree.leaves(moved)) > 0


@pytest.mark.slow  # ~15-25 s on 2 cores: a policy and a critic model, compiled together
def test_qwen_ppo_update_trains_the_critic(tiny_qwen, two_turn_rollout):
  config, params = tiny_qwen
  batch, _, _ = two_turn_rollout
  critic = learner.init_qwen_critic(config, jax.random.key(7))
  optimizer = learner.default_optimizer(learning_rate=1e-3)
  critic_optimizer = optax.adam(1e-3)
  step = learner.make_update(
    learner.qwen_logprob_fn(config, temperature=TEMPERATURE),
    optimizer,
    learner.LearnerConfig(algorithm="ppo", num_turns=2, minibatches=2),
    value_fn=learner.qwen_value_fn(config),
    critic_optimizer=critic_optimizer,
  )
  state = learner.init_state(
    copy_tree(params),
    optimizer,
    ref_params=params,
    critic_params=copy_tree(critic),
    critic_optimizer=critic_optimizer,
  )
  state, metrics = step(state, jax.tree.map(jnp.asarray, batch), jax.random.key(0))
  metrics = jax.tree.map(np.asarray, metrics)
  assert np.isfinite(metrics["value_loss"]) and metrics["value_loss"] > 0.0
  assert np.isfinite(metrics["loss"]) and metrics["optimizer_steps"] == 2
  head = np.asarray(state.critic_params["value_head"]["kernel"])
  assert np.max(np.abs(head)) > 0.0  # the zero-initialised value head moved
  trunk_moved = jax.tree.map(
    lambda a, b: np.max(np.abs(np.asarray(a) - np.asarray(b))),
    state.critic_params["trunk"],
    critic["trunk"],
  )
  assert max(jax.tree.leaves(trunk_moved)) > 0.0
  policy_moved = jax.tree.map(
    lambda a, b: np.max(np.abs(np.asarray(a) - np.asarray(b))), state.params, params
  )
  assert max(jax.tree.leaves(policy_moved)) > 1e-5


def test_critic_trunk_follows_the_partition_rules():
  """PPO's critic ({"trunk": qwen params, "value_head": ...}) shards like the policy on a mesh."""
  from jax.sharding import PartitionSpec as P

  from seeupo_jax import sharding

  config = tiny.model_config()
  mesh = sharding.make_mesh(data=1, fsdp=4, tensor=2)
  shapes = jax.eval_shape(lambda: learner.init_qwen_critic(config, jax.random.key(0)))
  specs = jax.tree.map(lambda s: s.spec, sharding.param_shardings(shapes, mesh))
  assert specs["trunk"]["embed"]["embedding"] == P(("fsdp", "tensor"), None)
  assert "lm_head" not in specs["trunk"]  # the critic reads hidden states only
  assert specs["trunk"]["layers"]["mlp"]["gate_proj"]["kernel"] == P(None, "fsdp", "tensor")
  assert specs["value_head"]["kernel"] == P(None)


def test_custom_order_runs_the_order_it_names():
  """order="custom" with T-1..0 is SeeUPO's reverse order and with 0..T-1 the forward one,
  bit for bit; reverse and forward differ (the order matters, so the test can fail)."""
  length, vocab = 40, 7
  batch = build_batch([4, 1, 3, 2, 4, 2, 3, 1], length=length, vocab=vocab, seed=21)
  params = table_params((length, vocab), seed=21)
  base = learner.LearnerConfig(algorithm="seeupo", num_turns=4, epochs=2, minibatches=2)
  results = {}
  for name, changes in {
    "reverse": {},
    "forward": dict(order="forward"),
    "custom_reverse": dict(order="custom", custom_order=(3, 2, 1, 0)),
    "custom_forward": dict(order="custom", custom_order=(0, 1, 2, 3)),
  }.items():
    step = cached_update(shared_logprob_fn, ADAMW, base.replace(**changes))
    results[name], _ = run_update(step, ADAMW, params, batch, key=4)
  assert_trees_equal(results["custom_reverse"].params, results["reverse"].params)
  assert_trees_equal(results["custom_forward"].params, results["forward"].params)
  assert (
    np.max(np.abs(results["reverse"].params["table"] - results["forward"].params["table"])) > 1e-4
  )


# ----------------------------------------------------------------------------------------------
# 8. Dr. GRPO's constant (`norm_length`): the loss scale does not follow the batch's padding.


def pad_columns(batch, length):
  """The same trajectories right-padded to `length` columns (padding: token 0, invalid)."""
  extra = length - np.asarray(batch.tokens).shape[1]
  pad = lambda x, value: np.pad(np.asarray(x), ((0, 0), (0, extra)), constant_values=value)  # noqa: E731
  return batch.replace(
    tokens=pad(batch.tokens, 0),
    token_valid=pad(batch.token_valid, False),
    turn_ids=pad(batch.turn_ids, -1),
    sample_logp=pad(batch.sample_logp, 0.0),
  )


@pytest.mark.parametrize(
  "changes",
  [{}, dict(epochs=2, minibatches=2, microbatches=2)],
  ids=["fused", "2x2x2"],
)
def test_dr_grpo_norm_length_makes_the_update_independent_of_padding(changes):
  """The same 8 trajectories (at most 14 tokens) padded to L = 16 and to L = 32, SGD (Adam would
  hide a rescaled gradient): with norm_length = 20 the two updates are the same, with None
  (divide by L) they differ, the L = 32 step being half the L = 16 one where no clip acts;
  norm_length = 16 on the L = 16 batch is None's update bit for bit."""
  vocab = 7
  narrow = build_batch([2, 1, 2, 1, 2, 2, 1, 2], length=32, vocab=vocab, seed=24)
  assert not np.asarray(narrow.token_valid)[:, 16:].any()
  narrow = jax.tree.map(lambda x: x[:, :16] if np.ndim(x) == 2 else x, narrow)
  wide = pad_columns(narrow, 32)
  params = table_params((32, vocab), seed=24)  # the table covers both lengths
  sgd = optax.sgd(2.0)
  base = learner.LearnerConfig(algorithm="dr_grpo", num_turns=2, **changes)

  def table_after(config, batch):
    state, metrics = run_update(cached_update(shared_logprob_fn, sgd, config), sgd, params, batch)
    return state.params["table"], metrics

  fixed = base.replace(norm_length=20)
  a, metrics_a = table_after(fixed, narrow)
  b, metrics_b = table_after(fixed, wide)
  moved = np.max(np.abs(a - np.asarray(params["table"])))
  assert moved > 1e-3
  np.testing.assert_allclose(b, a, rtol=0, atol=1e-7)
  for name in ("loss", "pg_loss", "kl", "grad_norm"):
    np.testing.assert_allclose(metrics_b[name], metrics_a[name], rtol=1e-6, atol=1e-9)

  by_l_narrow, _ = table_after(base, narrow)
  by_l_wide, _ = table_after(base, wide)
  assert np.max(np.abs(by_l_wide - by_l_narrow)) > 0.1 * moved
  if not changes:  # one step, no clip: the step scales as 1 / L exactly (up to rounding)
    start = np.asarray(params["table"])
    np.testing.assert_allclose(by_l_wide - start, (by_l_narrow - start) / 2, atol=1e-6)
  assert_trees_equal(table_after(base.replace(norm_length=16), narrow)[0], by_l_narrow)
