"""`seeupo_jax.losses` against independent NumPy references, gradients, and invariances."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import losses_reference as ref
from seeupo_jax import losses

AGGS = losses.AGGREGATION_MODES
RTOL, ATOL = 1e-5, 1e-5

# A few fixed shapes keep compilation cached across hypothesis examples.
SHAPES = [(1, 1), (3, 4), (8, 5)]


@st.composite
def token_batch(draw, extreme=False):
  """(logp, old_logp, advantages[B], mask) with some rows without tokens."""
  b, l = draw(st.sampled_from(SHAPES))
  seed = draw(st.integers(0, 2**31 - 1))
  rng = np.random.default_rng(seed)
  old_logp = -rng.exponential(1.0, size=(b, l))
  scale = 30.0 if extreme else draw(st.sampled_from([0.05, 0.3, 1.0]))
  logp = old_logp + rng.normal(0.0, scale, size=(b, l))
  mask = (rng.random((b, l)) < draw(st.sampled_from([0.3, 0.7, 1.0]))).astype(np.float32)
  if b > 1 and draw(st.booleans()):
    mask[rng.integers(b)] = 0.0  # a row without tokens
  advantages = rng.normal(0.0, 1.5, size=(b,))
  return (logp.astype(np.float32), old_logp.astype(np.float32), advantages.astype(np.float32), mask)


@st.composite
def reward_batch(draw):
  b = draw(st.sampled_from([1, 4, 9, 16]))
  num_groups = 4
  seed = draw(st.integers(0, 2**31 - 1))
  rng = np.random.default_rng(seed)
  kind = draw(st.sampled_from(["continuous", "binary", "all_equal"]))
  if kind == "continuous":
    rewards = rng.normal(size=b)
  elif kind == "binary":
    rewards = rng.integers(0, 2, size=b).astype(float)
  else:
    rewards = np.full(b, 0.7)
  group_ids = rng.integers(0, num_groups, size=b)  # groups of one happen
  valid = rng.random(b) < 0.85 if draw(st.booleans()) else None
  return rewards.astype(np.float32), group_ids.astype(np.int32), num_groups, valid


# ---------------------------------------------------------------------------
# Against the NumPy references.
# ---------------------------------------------------------------------------


@given(token_batch(), st.sampled_from(AGGS))
def test_aggregate_matches_reference(batch, mode):
  logp, _, _, mask = batch
  got = losses.aggregate(logp, mask, mode)
  np.testing.assert_allclose(got, ref.aggregate(logp, mask, mode), rtol=RTOL, atol=ATOL)


def test_aggregate_hand_case():
  values = jnp.array([[1.0, 3.0, 100.0], [2.0, 0.0, 0.0], [7.0, 7.0, 7.0]])
  mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
  assert float(losses.aggregate(values, mask, "token-mean")) == pytest.approx(6.0 / 3)
  assert float(losses.aggregate(values, mask, "seq-mean-token-mean")) == pytest.approx(
    (2.0 + 2.0) / 2
  )
  assert float(losses.aggregate(values, mask, "seq-mean-token-sum")) == pytest.approx(
    (4.0 + 2.0) / 2
  )
  # Dr. GRPO: row sums over the padded length L = 3, not over each row's token count.
  assert float(losses.aggregate(values, mask, "seq-mean-token-sum-norm")) == pytest.approx(
    (4.0 / 3 + 2.0 / 3) / 2
  )
  for mode in AGGS:
    assert float(losses.aggregate(values, jnp.zeros_like(mask), mode)) == 0.0


@pytest.mark.parametrize("jit", [False, True], ids=["nojit", "jit"])
def test_aggregate_with_norm_length_hand_case(jit):
  """Dr. GRPO with its constant C: row sums over C, whatever the padded length L."""
  values = np.array([[1.0, 3.0, 100.0], [2.0, 0.0, 0.0], [7.0, 7.0, 7.0]], np.float32)
  mask = np.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], np.float32)

  def agg(v, m, norm_length):
    fn = functools.partial(
      losses.aggregate, mode="seq-mean-token-sum-norm", norm_length=norm_length
    )
    return float((jax.jit(fn) if jit else fn)(jnp.asarray(v), jnp.asarray(m)))

  # C = 5: rows 0 and 1 have tokens (sums 4 and 2), row 2 none: (4/5 + 2/5) / 2.
  assert agg(values, mask, 5) == pytest.approx((4.0 / 5 + 2.0 / 5) / 2, rel=1e-7)
  assert agg(values, mask, 1) == pytest.approx((4.0 + 2.0) / 2, rel=1e-7)  # seq-mean-token-sum
  assert agg(values, mask, 3) == agg(values, mask, None)  # C = L: today's value, bit for bit
  # Six padding columns (values anywhere, mask 0): with C the value stays, with L it halves.
  wide_values = np.concatenate([values, np.full((3, 3), 9.0, np.float32)], axis=1)
  wide_mask = np.concatenate([mask, np.zeros((3, 3), np.float32)], axis=1)
  assert agg(wide_values, wide_mask, 5) == agg(values, mask, 5)
  assert agg(wide_values, wide_mask, None) == pytest.approx(agg(values, mask, None) / 2, rel=1e-7)
  assert agg(values, np.zeros_like(mask), 5) == 0.0


@given(token_batch(), st.sampled_from([1, 4, 64]))
def test_aggregate_with_norm_length_matches_reference(batch, norm_length):
  logp, _, _, mask = batch
  mode = "seq-mean-token-sum-norm"
  got = losses.aggregate(logp, mask, mode, norm_length=norm_length)
  want = ref.aggregate(logp, mask, mode, norm_length)
  np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_every_loss_divides_by_norm_length():
  """Each loss that aggregates passes `norm_length` on: with seq-mean-token-sum-norm the loss
  and its gradient scale by L / C (the token clip loss also against the float64 reference)."""
  rng = np.random.default_rng(3)
  b, length, c = 5, 6, 40
  old_logp = -rng.exponential(1.0, (b, length)).astype(np.float32)
  logp = (old_logp + rng.normal(0.0, 0.3, (b, length))).astype(np.float32)
  mask = (rng.random((b, length)) < 0.7).astype(np.float32)
  mask[2] = 0.0
  adv = rng.normal(0.0, 1.0, (b,)).astype(np.float32)
  norm = dict(agg="seq-mean-token-sum-norm")
  value_args = (old_logp, -logp, mask)  # values = logp: old values, returns, mask
  loss_fns = {
    "token_clip": lambda lp, **kw: losses.token_clip_loss(lp, old_logp, adv, mask, **kw)[0],
    "sequence_clip": lambda lp, **kw: losses.sequence_clip_loss(lp, old_logp, adv, mask, **kw)[0],
    "reinforce": lambda lp, **kw: losses.reinforce_loss(lp, adv, mask, **kw)[0],
    "value": lambda lp, **kw: losses.value_loss(lp, *value_args, clip=0.2, **kw)[0],
  }
  for name, fn in loss_fns.items():
    with_c, grad_c = jax.value_and_grad(functools.partial(fn, norm_length=c, **norm))(logp)
    with_l, grad_l = jax.value_and_grad(functools.partial(fn, **norm))(logp)
    assert abs(float(with_l)) > 1e-3, name
    np.testing.assert_allclose(with_c * c, with_l * length, rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(grad_c * c, grad_l * length, rtol=1e-5, atol=1e-7, err_msg=name)
  want = ref.token_clip_loss(logp, old_logp, adv, mask, 0.2, 0.2, None, norm["agg"], c)
  got = losses.token_clip_loss(logp, old_logp, adv, mask, norm_length=c, **norm)[0]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@given(reward_batch(), st.booleans(), st.booleans(), st.sampled_from([None, 3.0, 0.5]))
def test_grae_matches_reference(batch, group_std, batch_norm, clip):
  rewards, group_ids, num_groups, valid = batch
  got = losses.grae_advantages(
    rewards,
    group_ids,
    num_groups,
    group_std=group_std,
    batch_norm=batch_norm,
    clip=clip,
    valid=valid,
  )
  want = ref.grae(
    rewards, group_ids, group_std=group_std, batch_norm=batch_norm, clip=clip, valid=valid
  )
  assert np.all(np.isfinite(got))
  # group_std divides by (std + 1e-6): a near-tie amplifies float32 rounding.
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_grae_hand_case_and_degenerate_groups():
  rewards = jnp.array([1.0, 0.0, 1.0, 1.0, 0.3])
  groups = jnp.array([0, 0, 1, 1, 2])
  # Group means 0.5, 1.0, and a group of one: [0.5, -0.5, 0, 0, 0].
  raw = losses.grae_advantages(rewards, groups, 3, batch_norm=False, clip=None)
  np.testing.assert_allclose(raw, [0.5, -0.5, 0.0, 0.0, 0.0], atol=1e-7)
  # Batch norm: mean 0, unbiased std sqrt(0.5/4) -> [sqrt 2, -sqrt 2, 0, 0, 0].
  normed = losses.grae_advantages(rewards, groups, 3, clip=None)
  np.testing.assert_allclose(normed, [2**0.5, -(2**0.5), 0, 0, 0], rtol=1e-6)
  # All-equal rewards: every advantage is exactly 0, no NaN, with any option.
  for group_std in (False, True):
    adv = losses.grae_advantages(
      jnp.full(6, 0.4), jnp.array([0, 0, 0, 1, 1, 1]), 2, group_std=group_std
    )
    np.testing.assert_array_equal(adv, np.zeros(6))
  # Padding rows get 0 and do not move any statistic.
  padded = losses.grae_advantages(
    jnp.array([1.0, 0.0, 1.0, 1.0, 0.3, 50.0]),
    jnp.array([0, 0, 1, 1, 2, 0]),
    3,
    clip=None,
    valid=jnp.array([True] * 5 + [False]),
  )
  np.testing.assert_allclose(padded, list(np.asarray(normed)) + [0.0], rtol=1e-6)


@given(reward_batch())
def test_rloo_matches_reference(batch):
  rewards, group_ids, num_groups, valid = batch
  got = losses.rloo_advantages(rewards, group_ids, num_groups, valid=valid)
  np.testing.assert_allclose(got, ref.rloo(rewards, group_ids, valid), rtol=1e-5, atol=1e-5)


@given(token_batch(), st.sampled_from([1.0, 0.9]), st.sampled_from([1.0, 0.95, 0.0]))
def test_gae_matches_reference(batch, gamma, lam):
  logp, old_logp, _, mask = batch
  rewards, values = np.abs(old_logp), -logp / 10
  adv, ret = losses.gae_advantages(rewards, values, mask, gamma=gamma, lam=lam)
  want_adv, want_ret = ref.gae(rewards, values, mask, gamma, lam)
  np.testing.assert_allclose(adv, want_adv, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(ret, want_ret, rtol=1e-4, atol=1e-4)


def test_gae_skips_environment_tokens():
  # Turn 1 tokens at 0-1, environment tokens 2-3 (mask 0), turn 2 tokens 4-5.
  rewards = jnp.array([[0, 0, 9, 9, 0, 1.0]])
  values = jnp.array([[0.1, 0.2, 5.0, 5.0, 0.4, 0.5]])
  mask = jnp.array([[1, 1, 0, 0, 1, 1.0]])
  adv, ret = losses.gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
  # gamma = lam = 1: A_t = (sum of later policy-token rewards) - V_t = 1 - V_t.
  np.testing.assert_allclose(adv, [[0.9, 0.8, 0, 0, 0.6, 0.5]], atol=1e-6)
  np.testing.assert_allclose(ret, [[1, 1, 0, 0, 1, 1]], atol=1e-6)


@given(token_batch())
def test_sequence_log_ratio_matches_reference(batch):
  logp, old_logp, _, mask = batch
  got = losses.sequence_log_ratio(logp, old_logp, mask)
  np.testing.assert_allclose(got, ref.seq_log_ratio(logp, old_logp, mask), rtol=1e-5, atol=1e-4)


@given(
  token_batch(),
  st.sampled_from(AGGS),
  st.sampled_from([None, 3.0]),
  st.sampled_from([(0.2, 0.2), (0.2, 0.28)]),
  st.booleans(),
)
def test_token_clip_loss_matches_reference(batch, agg, dual_clip, clips, token_adv):
  logp, old_logp, adv, mask = batch
  if token_adv:
    adv = adv[:, None] * np.linspace(0.5, 1.5, logp.shape[1])[None, :].astype(np.float32)
  loss, metrics = losses.token_clip_loss(
    logp, old_logp, adv, mask, clip_low=clips[0], clip_high=clips[1], dual_clip=dual_clip, agg=agg
  )
  want = ref.token_clip_loss(logp, old_logp, adv, mask, *clips, dual_clip, agg)
  np.testing.assert_allclose(loss, want, rtol=1e-4, atol=1e-4)
  ratio = np.exp(np.clip(logp.astype(np.float64) - old_logp, -20, 20))
  adv_tok = np.broadcast_to(adv[:, None], logp.shape) if adv.ndim == 1 else adv
  outside = ((adv_tok > 0) & (ratio > 1 + clips[1])) | ((adv_tok < 0) & (ratio < 1 - clips[0]))
  if dual_clip is not None:
    outside |= (adv_tok < 0) & (ratio > dual_clip)
  want_frac = (outside * mask).sum() / max(mask.sum(), 1)
  np.testing.assert_allclose(metrics["clip_fraction"], want_frac, atol=1e-6)
  np.testing.assert_allclose(
    metrics["ratio_mean"], (ratio * mask).sum() / max(mask.sum(), 1), rtol=1e-4
  )


@given(token_batch(), st.sampled_from([None, 3.0]), st.sampled_from([(0.2, 0.2), (0.0003, 0.0004)]))
def test_sequence_clip_loss_matches_gspo_reference(batch, dual_clip, clips):
  logp, old_logp, adv, mask = batch
  loss, metrics = losses.sequence_clip_loss(
    logp, old_logp, adv, mask, clip_low=clips[0], clip_high=clips[1], dual_clip=dual_clip
  )
  want = ref.sequence_clip_loss(logp, old_logp, adv, mask, *clips, dual_clip)
  np.testing.assert_allclose(loss, want, rtol=1e-4, atol=1e-4)
  s = np.exp(np.clip(ref.seq_log_ratio(logp, old_logp, mask), -20, 20))
  rows = mask.sum(1) > 0
  np.testing.assert_allclose(
    metrics["ratio_mean"], s[rows].mean() if rows.any() else 0.0, rtol=1e-4
  )


@given(token_batch(), st.sampled_from(AGGS))
def test_reinforce_loss_matches_reference(batch, agg):
  logp, _, adv, mask = batch
  loss, metrics = losses.reinforce_loss(logp, adv, mask, agg=agg)
  want = ref.aggregate(-adv[:, None] * logp.astype(np.float64), mask, agg)
  np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-5)
  assert float(metrics["clip_fraction"]) == 0.0


@given(token_batch(), st.sampled_from([None, 0.2]))
def test_value_loss_matches_reference(batch, clip):
  values, old_values, returns, mask = batch[0], batch[1], batch[1] * 0.5, batch[3]
  loss, _ = losses.value_loss(values, old_values, returns, mask, clip=clip)
  np.testing.assert_allclose(
    loss, ref.value_loss(values, old_values, returns, mask, clip), rtol=1e-4, atol=1e-5
  )


@given(token_batch(extreme=True), st.sampled_from(losses.KL_KINDS))
def test_kl_penalty_matches_reference(batch, kind):
  logp, ref_logp, _, _ = batch
  got = losses.kl_penalty(logp, ref_logp, kind)
  want = ref.kl(logp, ref_logp, "k3" if kind == "low_var_kl" else kind)
  assert np.all(np.isfinite(got))
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


@given(token_batch(), st.booleans())
def test_seeupo_correction_matches_reference(batch, start_from_ones):
  new_logp, old_logp, _, mask = batch
  b = mask.shape[0]
  start = (
    np.ones(b, np.float32) if start_from_ones else np.linspace(0.85, 1.15, b).astype(np.float32)
  )
  got = losses.seeupo_correction(None if start_from_ones else start, new_logp, old_logp, mask)
  want = ref.correction(start, new_logp, old_logp, mask)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  empty = mask.sum(1) == 0
  np.testing.assert_array_equal(np.asarray(got)[empty], start[empty])


def test_seeupo_correction_has_no_gradient():
  new_logp = jnp.array([[-1.0, -2.0], [-0.5, -0.1]])
  mask = jnp.ones((2, 2))
  grad = jax.grad(lambda lp: losses.seeupo_correction(None, lp, lp - 0.05, mask).sum())(new_logp)
  np.testing.assert_array_equal(grad, np.zeros((2, 2)))


def test_update_order():
  np.testing.assert_array_equal(losses.update_order(4, "reverse"), [3, 2, 1, 0])
  np.testing.assert_array_equal(losses.update_order(4, "forward"), [0, 1, 2, 3])
  random_order = losses.update_order(6, "random", key=jax.random.key(3))
  assert sorted(np.asarray(random_order).tolist()) == list(range(6))
  orders = {
    tuple(np.asarray(losses.update_order(4, "random", key=jax.random.key(s))).tolist())
    for s in range(20)
  }
  assert len(orders) > 5  # actually random, not a fixed order
  np.testing.assert_array_equal(losses.update_order(3, "custom", custom=[1, 2, 0]), [1, 2, 0])
  with pytest.raises(ValueError, match="not a permutation"):
    losses.update_order(3, "custom", custom=[0, 0, 1])
  with pytest.raises(ValueError, match="needs a PRNG"):
    losses.update_order(3, "random")
  with pytest.raises(ValueError, match="'reverse', 'forward', 'random', 'custom'"):
    losses.update_order(3, "backward")


def test_bad_options_name_the_allowed_values():
  x = jnp.zeros((2, 3))
  with pytest.raises(ValueError, match="agg='mean'.*'token-mean'"):
    losses.aggregate(x, x, "mean")
  with pytest.raises(ValueError, match="kind='k4'.*'low_var_kl'"):
    losses.kl_penalty(x, x, "k4")
  for bad in (0, -3, 2.0, True):
    with pytest.raises(ValueError, match="norm_length must be None or an int >= 1"):
      losses.aggregate(x, x, "seq-mean-token-sum-norm", norm_length=bad)
  with pytest.raises(ValueError, match="applies to agg='seq-mean-token-sum-norm' only"):
    losses.aggregate(x, x, "token-mean", norm_length=4)
  with pytest.raises(ValueError, match="applies to agg='seq-mean-token-sum-norm' only"):
    losses.token_clip_loss(x, x, jnp.zeros(2), x, norm_length=4)  # agg: seq-mean-token-mean
  with pytest.raises(AssertionError):
    losses.token_clip_loss(x, x, jnp.zeros(3), x)  # advantages of the wrong length


# ---------------------------------------------------------------------------
# Gradients.
# ---------------------------------------------------------------------------


def _seq_mean_token_mean_weights(mask):
  """d aggregate / d value_it for seq-mean-token-mean: m_it / (n_i |R|)."""
  mask = np.asarray(mask, np.float64)
  n = mask.sum(1, keepdims=True)
  rows = (n[:, 0] > 0).sum()
  return np.where(n > 0, mask / np.maximum(n, 1) / max(rows, 1), 0.0)


@given(token_batch())
def test_token_clip_loss_gradient_is_analytic(batch):
  logp, old_logp, adv, mask = batch
  grad = jax.grad(lambda lp: losses.token_clip_loss(lp, old_logp, adv, mask)[0])(logp)
  ratio = np.exp(logp.astype(np.float64) - old_logp)
  a = np.broadcast_to(adv[:, None], logp.shape)
  clipped = ((a > 0) & (ratio > 1.2)) | ((a < 0) & (ratio < 0.8))
  want = np.where(clipped, 0.0, -a * ratio) * _seq_mean_token_mean_weights(mask)
  np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-6)
  # The clipped side has exactly zero gradient.
  assert np.all(np.asarray(grad)[clipped & (mask > 0)] == 0.0)


@given(token_batch())
def test_sequence_clip_loss_gradient_is_gspo(batch):
  logp, old_logp, adv, mask = batch
  grad = np.asarray(
    jax.grad(lambda lp: losses.sequence_clip_loss(lp, old_logp, adv, mask)[0])(logp)
  )
  s = np.exp(ref.seq_log_ratio(logp, old_logp, mask))
  clipped = ((adv > 0) & (s > 1.2)) | ((adv < 0) & (s < 0.8))
  n = mask.sum(1)
  rows = max((n > 0).sum(), 1)
  # d/dlogp_it of -(1/|R|) Σ_i s_i A_i = -A_i s_i m_it / (n_i |R|); zero for clipped rows.
  want = np.where(
    clipped[:, None], 0.0, -(adv * s)[:, None] * mask / np.maximum(n, 1)[:, None] / rows
  )
  np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-6)
  assert np.all(grad[clipped] == 0.0)


def test_sequence_clip_loss_gradient_matches_finite_differences():
  rng = np.random.default_rng(0)
  old_logp = -rng.exponential(size=(4, 6))
  logp = old_logp + rng.normal(0, 0.1, size=(4, 6))
  mask = (rng.random((4, 6)) < 0.8).astype(np.float64)
  adv = np.array([1.0, -0.5, 2.0, -1.5])
  grad = np.asarray(
    jax.grad(lambda lp: losses.sequence_clip_loss(lp, old_logp.astype(np.float32), adv, mask)[0])(
      logp.astype(np.float32)
    )
  )
  eps = 1e-6
  numeric = np.zeros_like(logp)
  for idx in np.ndindex(*logp.shape):
    up, down = logp.copy(), logp.copy()
    up[idx] += eps
    down[idx] -= eps
    numeric[idx] = (
      ref.sequence_clip_loss(up, old_logp, adv, mask)
      - ref.sequence_clip_loss(down, old_logp, adv, mask)
    ) / (2 * eps)
  np.testing.assert_allclose(grad, numeric, rtol=1e-3, atol=1e-5)


def test_gspo_is_not_token_ppo():
  """The configured loss is the loss that runs (reference defect 1)."""
  logp = jnp.log(jnp.array([[0.5, 0.5], [0.2, 0.9]]))
  old_logp = jnp.log(jnp.array([[0.25, 0.5], [0.2, 0.6]]))
  mask, adv = jnp.ones((2, 2)), jnp.array([1.0, -1.0])
  seq, _ = losses.sequence_clip_loss(logp, old_logp, adv, mask)
  tok, _ = losses.token_clip_loss(logp, old_logp, adv, mask)
  # Row 0: s = exp(ln 2 / 2) = sqrt 2 -> clipped at 1.2 -> -1.2. Row 1: s = sqrt 1.5 ≈ 1.2247,
  # A < 0 -> max(1.2247, 1.2) = 1.2247. Token PPO row 0: ratios (2, 1) -> mean(-1.2, -1) = -1.1.
  assert float(seq) == pytest.approx((-1.2 + 1.5**0.5) / 2, rel=1e-5)
  assert float(tok) == pytest.approx((-1.1 + (1.0 + 1.5) / 2) / 2, rel=1e-5)


@given(token_batch(extreme=True))
def test_extreme_log_ratios_stay_finite(batch):
  logp, old_logp, adv, mask = batch
  for fn in (losses.token_clip_loss, losses.sequence_clip_loss):
    loss, metrics = fn(logp, old_logp, adv, mask, dual_clip=3.0)
    grad = jax.grad(lambda lp: fn(lp, old_logp, adv, mask)[0])(logp)
    assert np.isfinite(loss) and np.all(np.isfinite(grad))
    assert all(np.isfinite(v) for v in metrics.values())
  assert np.all(np.isfinite(losses.seeupo_correction(None, logp, old_logp, mask)))


def test_bfloat16_inputs_compute_in_float32():
  rng = np.random.default_rng(1)
  old_logp = jnp.asarray(-rng.exponential(size=(5, 7)), jnp.bfloat16)
  logp = (old_logp + jnp.asarray(rng.normal(0, 0.1, (5, 7)), jnp.bfloat16)).astype(jnp.bfloat16)
  mask = jnp.asarray(rng.random((5, 7)) < 0.7, jnp.bfloat16)
  adv = jnp.asarray(rng.normal(size=5), jnp.bfloat16)
  for fn in (losses.token_clip_loss, losses.sequence_clip_loss):
    got, metrics = fn(logp, old_logp, adv, mask)
    want, _ = fn(*(x.astype(jnp.float32) for x in (logp, old_logp, adv, mask)))
    assert got.dtype == jnp.float32 and metrics["approx_kl"].dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-6)
  adv_bf16 = losses.grae_advantages(adv, jnp.array([0, 0, 1, 1, 1]), 2)
  assert adv_bf16.dtype == jnp.float32
  assert losses.kl_penalty(logp, old_logp, "k3").dtype == jnp.float32


# ---------------------------------------------------------------------------
# Invariances: permutation, jit, vmap.
# ---------------------------------------------------------------------------


@given(token_batch(), reward_batch(), st.integers(0, 1000))
def test_permuting_rows_permutes_outputs(tokens, rewards_batch, seed):
  logp, old_logp, adv, mask = tokens
  perm = np.random.default_rng(seed).permutation(logp.shape[0])
  for fn in (losses.token_clip_loss, losses.sequence_clip_loss):
    for agg in AGGS:
      a, _ = fn(logp, old_logp, adv, mask, agg=agg)
      b, _ = fn(logp[perm], old_logp[perm], adv[perm], mask[perm], agg=agg)
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  m = np.linspace(0.8, 1.2, logp.shape[0]).astype(np.float32)
  np.testing.assert_allclose(
    np.asarray(losses.seeupo_correction(m, logp, old_logp, mask))[perm],
    losses.seeupo_correction(m[perm], logp[perm], old_logp[perm], mask[perm]),
    rtol=1e-6,
  )
  np.testing.assert_allclose(
    np.asarray(losses.sequence_log_ratio(logp, old_logp, mask))[perm],
    losses.sequence_log_ratio(logp[perm], old_logp[perm], mask[perm]),
    rtol=1e-6,
    atol=1e-7,
  )
  rewards, group_ids, num_groups, valid = rewards_batch
  perm = np.random.default_rng(seed).permutation(len(rewards))
  valid_p = None if valid is None else valid[perm]
  for fn in (
    functools.partial(losses.grae_advantages, group_std=True),
    losses.grae_advantages,
    losses.rloo_advantages,
  ):
    np.testing.assert_allclose(
      np.asarray(fn(rewards, group_ids, num_groups, valid=valid))[perm],
      fn(rewards[perm], group_ids[perm], num_groups, valid=valid_p),
      rtol=1e-5,
      atol=1e-5,
    )


def test_everything_runs_under_jit_and_vmap():
  seeds, b, l = 3, 6, 5
  rng = np.random.default_rng(7)
  old_logp = jnp.asarray(-rng.exponential(size=(seeds, b, l)), jnp.float32)
  logp = old_logp + jnp.asarray(rng.normal(0, 0.2, (seeds, b, l)), jnp.float32)
  mask = jnp.asarray(rng.random((seeds, b, l)) < 0.7, jnp.float32)
  rewards = jnp.asarray(rng.random((seeds, b)), jnp.float32)
  groups = jnp.tile(jnp.array([0, 0, 0, 1, 1, 1]), (seeds, 1))

  def one_seed(logp, old_logp, mask, rewards, groups):
    adv = losses.grae_advantages(rewards, groups, 2)
    seq, seq_metrics = losses.sequence_clip_loss(logp, old_logp, adv, mask)
    tok, _ = losses.token_clip_loss(logp, old_logp, adv, mask, dual_clip=3.0)
    rf, _ = losses.reinforce_loss(logp, adv, mask)
    kl = losses.aggregate(losses.kl_penalty(logp, old_logp, "low_var_kl"), mask, "token-mean")
    gae_adv, _ = losses.gae_advantages(mask, logp, mask, gamma=0.9, lam=0.95)
    vl, _ = losses.value_loss(logp, old_logp, gae_adv, mask, clip=0.2)
    m = losses.seeupo_correction(None, logp, old_logp, mask)
    rloo = losses.rloo_advantages(rewards, groups, 2)
    return seq, tok, rf, kl, vl, m, rloo, seq_metrics["clip_fraction"]

  args = (logp, old_logp, mask, rewards, groups)
  eager = [one_seed(*(a[s] for a in args)) for s in range(seeds)]
  for batched in (jax.vmap(one_seed)(*args), jax.jit(jax.vmap(one_seed))(*args)):
    for s in range(seeds):
      chex.assert_trees_all_close(
        jax.tree.map(lambda x: x[s], batched), eager[s], rtol=1e-5, atol=1e-6
      )
  # grad under jit and vmap too.
  grad_fn = jax.jit(
    jax.vmap(jax.grad(lambda lp, olp, a, m: losses.sequence_clip_loss(lp, olp, a, m)[0]))
  )
  grads = grad_fn(logp, old_logp, rewards, mask)
  assert grads.shape == logp.shape and np.all(np.isfinite(grads))
  order = jax.jit(lambda k: losses.update_order(4, "random", key=k))(jax.random.key(0))
  assert sorted(np.asarray(order).tolist()) == [0, 1, 2, 3]
