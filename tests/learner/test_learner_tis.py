"""Sampler-mismatch correction (`LearnerConfig.tis`): truncated importance sampling between the
sampler's recorded log-probs and the learner's old policy, against an independent float64 NumPy
reference (hand arrays, the table-of-logits policy of `learner_reference.py`, plain SGD)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import learner_reference as ref
import losses_reference as lref
from seeupo_jax import learner
from seeupo_jax.learner import objectives
from test_learner_reference import (
  BATCHES,
  KL_COEF,
  LR,
  LR_OF,
  N,
  PPO_EXTRA,
  TABLE0,
  VALUES0,
  T,
  logprob_fn,
  value_fn,
)

CAP = 1.5


# ----------------------------------------------------------------------------------------------
# The float64 reference of the weights, written from the definition.


def reference_weights(old, sample, mask, level, cap, segments=None):
  """(w float64[N, L] (1 off the mask), mean w over decisions, share truncated).

  token: one decision per masked token, w = min(pi_old / pi_sampler, C); sequence: one per
  (row, segment), w = min(exp(mean of the segment's log-ratios), C) on each of its tokens."""
  old, sample, mask = (np.asarray(x, np.float64) for x in (old, sample, mask))
  w = np.ones(mask.shape)
  decisions = []
  for i in range(mask.shape[0]):
    cells = [j for j in range(mask.shape[1]) if mask[i, j] > 0]
    if level == "token":
      parts = [[j] for j in cells]
    else:
      keys = [0 if segments is None else int(segments[i, j]) for j in cells]
      parts = [[j for j, k in zip(cells, keys) if k == key] for key in sorted(set(keys))]
    for part in parts:
      ratio = math.exp(np.mean([old[i, j] - sample[i, j] for j in part]))
      for j in part:
        w[i, j] = min(ratio, cap)
      decisions.append((min(ratio, cap), ratio > cap))
  mean = float(np.mean([d[0] for d in decisions])) if decisions else 0.0
  share = float(np.mean([d[1] for d in decisions])) if decisions else 0.0
  return w, mean, share


def _config(level, cap=CAP, algorithm="grpo", **changes):
  return learner.LearnerConfig(algorithm=algorithm, num_turns=3, tis=level, tis_cap=cap, **changes)


# ----------------------------------------------------------------------------------------------
# The weights on hand arrays.

OLD = np.array([[0.0, -1.0, -2.0, -0.5, -0.3], [0.0, -0.2, -0.4, -3.0, 0.0]], np.float32)
SAMPLE = np.array([[0.0, -1.5, -2.0, -0.5, -1.5], [0.0, -0.2, -1.4, -2.0, 0.0]], np.float32)
MASK = np.array([[0, 1, 1, 1, 1], [0, 1, 1, 1, 0]], np.float32)
TURNS = np.array([[-1, 0, 0, 1, 1], [-1, 0, 1, 1, -1]], np.int32)


@pytest.mark.parametrize("jit", [False, True], ids=["nojit", "jit"])
def test_token_weights_by_hand(jit):
  """log-ratios 0.5, 0, 0, 1.2 | 0, 1, -1 with C = 1.5: exp(0.5) = 1.6487 and exp(1.2), exp(1)
  are cut to 1.5 (3 of 7 tokens); the others are 1, 1, 1 and exp(-1) = 0.3679."""
  config = _config("token")
  fn = functools.partial(objectives.sampler_weights, config=config)
  fn = jax.jit(fn) if jit else fn
  weights = fn(jnp.asarray(OLD), jnp.asarray(SAMPLE), jnp.asarray(MASK))
  e = math.exp(-1.0)
  want = [[1.0, 1.5, 1.0, 1.0, 1.5], [1.0, 1.0, 1.5, e, 1.0]]
  np.testing.assert_allclose(weights.weight, want, rtol=1e-6)
  assert weights.truncated.tolist() == [[0, 1, 0, 0, 1], [0, 0, 1, 0, 0]]
  stats = objectives.sampler_weight_stats(weights)
  np.testing.assert_allclose(stats["tis_weight_mean"], (3 * 1.5 + 3.0 + e) / 7, rtol=1e-6)
  np.testing.assert_allclose(stats["tis_truncated_share"], 3 / 7, rtol=1e-6)
  # A cap above every ratio: nothing truncated, w = the ratio itself.
  wide = objectives.sampler_weights(OLD, SAMPLE, MASK, _config("token", cap=10.0))
  np.testing.assert_allclose(wide.weight[0, 4], math.exp(1.2), rtol=1e-6)
  assert float(jnp.sum(wide.truncated)) == 0.0


def test_sequence_weights_by_hand():
  """Per row (all masked tokens): means 0.425 and 0 -> exp(0.425) = 1.53 cut to 1.5, and 1.
  Per (row, turn) segment (SeeUPO): row 0 turns (0.5, 0) -> exp(0.25), (0, 1.2) -> exp(0.6)
  cut; row 1 turns (0) -> 1, (1, -1) -> 1."""
  rows = objectives.sampler_weights(OLD, SAMPLE, MASK, _config("sequence"))
  np.testing.assert_allclose(rows.weight, [[1, 1.5, 1.5, 1.5, 1.5], [1, 1, 1, 1, 1]], rtol=1e-6)
  stats = objectives.sampler_weight_stats(rows)
  np.testing.assert_allclose(stats["tis_weight_mean"], 1.25, rtol=1e-6)
  np.testing.assert_allclose(stats["tis_truncated_share"], 0.5, rtol=1e-6)
  turns = objectives.sampler_weights(OLD, SAMPLE, MASK, _config("sequence"), segments=TURNS)
  q = math.exp(0.25)
  np.testing.assert_allclose(turns.weight, [[1, q, q, 1.5, 1.5], [1, 1, 1, 1, 1]], rtol=1e-6)
  stats = objectives.sampler_weight_stats(turns)
  np.testing.assert_allclose(stats["tis_weight_mean"], (q + 1.5 + 1 + 1) / 4, rtol=1e-6)
  np.testing.assert_allclose(stats["tis_truncated_share"], 0.25, rtol=1e-6)
  # vmap over a leading axis gives the same as one call per element.
  stacked = jax.vmap(
    lambda o, s: objectives.sampler_weights(o, s, MASK, _config("sequence"), TURNS).weight
  )(jnp.stack([OLD, SAMPLE]), jnp.stack([SAMPLE, SAMPLE]))
  np.testing.assert_allclose(stacked[0], turns.weight, rtol=1e-6)
  np.testing.assert_array_equal(stacked[1], np.ones_like(MASK))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_weights_match_reference_on_random_arrays(level):
  rng = np.random.default_rng(3)
  old = rng.normal(-1.0, 0.5, (6, 9)).astype(np.float32)
  sample = (old + rng.normal(0.0, 0.6, old.shape)).astype(np.float32)
  mask = (rng.random(old.shape) < 0.7).astype(np.float32)
  mask[2] = 0.0  # a row without tokens
  segments = rng.integers(0, 3, old.shape).astype(np.int32)
  for seg in (None, segments):
    got = objectives.sampler_weights(old, sample, mask, _config(level), segments=seg)
    w, mean, share = reference_weights(old, sample, mask, level, CAP, seg)
    np.testing.assert_allclose(got.weight, w, rtol=1e-5)
    stats = objectives.sampler_weight_stats(got)
    np.testing.assert_allclose(stats["tis_weight_mean"], mean, rtol=1e-5)
    np.testing.assert_allclose(stats["tis_truncated_share"], share, rtol=1e-5, atol=1e-7)
    assert 0 < share < 1


# ----------------------------------------------------------------------------------------------
# The weighted loss and its gradient, per loss kind, against the reference's hand gradient.


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize(
  "algorithm,kind", [("grpo", "token"), ("gspo", "sequence"), ("rloo", "reinforce")]
)
def test_weighted_loss_and_gradient_match_reference(algorithm, kind, level):
  """loss(A * w) and d loss / d logp, w = min(pi_old / pi_sampler, C) from the first pass, with
  the KL term unweighted: the reference's per-token loss with advantages A_i w_it."""
  rng = np.random.default_rng(5)
  n, length = 4, 7
  old = rng.normal(-1.2, 0.4, (n, length))
  logp = old + rng.normal(0.0, 0.1, (n, length))
  sample = old + rng.normal(0.0, 0.5, (n, length))
  ref_logp = old + rng.normal(0.0, 0.2, (n, length))
  mask = (rng.random((n, length)) < 0.8).astype(np.float64)
  adv = np.array([1.0, -0.5, 0.7, -1.2])
  f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  config = _config(level, algorithm=algorithm, kl_coef=KL_COEF)
  inputs = objectives.LossInputs(
    old_logp=None if kind == "reinforce" else f32(old),
    ref_logp=f32(ref_logp),
    advantages=f32(adv),
    mask=f32(mask),
    sample_logp=f32(sample),
  )
  first = f32(logp if kind == "reinforce" else old)  # on-policy: the pass is at the params

  def loss(lp):
    weighted, _ = objectives.turn_inputs(first, inputs, None, config)
    assert weighted.sample_logp is None
    return objectives.policy_loss(lp, weighted, config)[0]

  value, grad = jax.value_and_grad(loss)(f32(logp))
  w, _, _ = reference_weights(logp if kind == "reinforce" else old, sample, mask, level, CAP)
  hp = dict(clip_low=0.2, clip_high=config.clip_high, kl_coef=KL_COEF, agg=config.agg)
  metrics, g = ref.policy_loss_and_grad(
    kind, logp, old, ref_logp, adv[:, None] * w, mask, hp, ref._Margin()
  )
  np.testing.assert_allclose(value, metrics["loss"], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(grad, g, rtol=1e-5, atol=1e-7)
  # The weight matters here: without it the loss is another.
  unweighted = objectives.policy_loss(f32(logp), inputs._replace(sample_logp=None), config)[0]
  assert abs(float(unweighted) - metrics["loss"]) > 1e-3


# ----------------------------------------------------------------------------------------------
# Whole learner calls (SGD) against a reference of the weighted update.


def _sample_logp(batch):
  """The learner's log-probs at TABLE0, moved by noise and a per-row shift (some ratios above the
  cap, some far below), 0 off the generated tokens."""
  rng = np.random.default_rng(7)
  logp = ref.table_logp(TABLE0, np.asarray(batch.tokens), np.asarray(batch.token_valid))
  shift = np.linspace(-0.6, 0.6, N)[:, None]
  noisy = logp + rng.normal(0.0, 0.35, logp.shape) + shift
  return np.where(np.asarray(batch.turn_ids) >= 0, noisy, 0.0).astype(np.float32)


TIS_BATCHES = {name: b.replace(sample_logp=_sample_logp(b)) for name, b in BATCHES.items()}


def reference_tis_update(config, batch, lr, start_table=TABLE0):
  """One call of a critic-free algorithm with TIS, SGD, one mini-batch, from the definitions:
  w from the starting table's log-probs and the batch's sample_logp (SeeUPO: per (row, turn) at
  the sequence level), the policy loss on advantages A * w (SeeUPO: A * M * w), KL unweighted
  (against TABLE0, the reference policy)."""
  tokens, valid = np.asarray(batch.tokens), np.asarray(batch.token_valid, bool)
  turn_ids, row_valid = np.asarray(batch.turn_ids), np.asarray(batch.row_valid, bool)
  generated = ((turn_ids >= 0) & valid & row_valid[:, None]).astype(np.float64)
  table = np.array(start_table, np.float64)

  def logp_at(params):
    return ref.table_logp(params, tokens, valid)

  start = logp_at(table)
  sequential = learner.REGISTRY[config.algorithm].sequential
  w, w_mean, w_share = reference_weights(
    start,
    batch.sample_logp,
    generated,
    config.tis,
    config.tis_cap,
    turn_ids if sequential else None,
  )
  adv_rows = ref.critic_free_advantages(
    config.algorithm,
    np.asarray(batch.rewards, np.float64),
    np.asarray(batch.group_ids),
    row_valid,
    config.advantage_clip,
  )
  kind = (
    "token"
    if config.algorithm in ref.TOKEN_CLIP
    else ("sequence" if config.algorithm in ref.SEQUENCE_CLIP else "reinforce")
  )
  hp = dict(
    clip_low=config.clip_low, clip_high=config.clip_high, kl_coef=config.kl_coef, agg=config.agg
  )
  margin = ref._Margin()
  ref_logp = logp_at(np.array(TABLE0, np.float64))

  def steps(params, old, adv, mask):
    for _ in range(config.epochs):
      _, g = ref.policy_loss_and_grad(kind, logp_at(params), old, ref_logp, adv, mask, hp, margin)
      params = params - lr * ref.table_grad(params, tokens, g)
    return params

  if sequential:
    m = np.ones(N)
    for t in reversed(range(T)):
      mask = generated * (turn_ids == t)
      if not mask.any():
        continue
      old = logp_at(table)
      table = steps(table, old, (adv_rows * m)[:, None] * w, mask)
      m = lref.correction(m, logp_at(table), old, mask, 0.2, 0.2)
  else:
    table = steps(table, start, adv_rows[:, None] * w, generated)
  return table, w_mean, w_share, margin.value


def _lr(algorithm):
  return LR_OF.get(algorithm, LR)


@functools.cache
def _update(config):
  if config.spec.critic:
    return learner.make_update(
      logprob_fn, optax.sgd(LR), config, value_fn=value_fn, critic_optimizer=optax.sgd(LR)
    )
  return learner.make_update(logprob_fn, optax.sgd(_lr(config.algorithm)), config)


def run(config, batch, start_table=TABLE0):
  critic = {}
  if config.spec.critic:
    critic = dict(critic_params={"v": jnp.asarray(VALUES0)}, critic_optimizer=optax.sgd(LR))
  state = learner.init_state(
    {"table": jnp.asarray(start_table)},
    optax.sgd(_lr(config.algorithm)),
    ref_params={"table": jnp.asarray(TABLE0)},
    **critic,
  )
  state, metrics = _update(config)(state, jax.tree.map(jnp.asarray, batch), jax.random.key(0))
  return np.asarray(state.params["table"]), jax.tree.map(np.asarray, metrics)


def tis_config(algorithm, epochs, level, **changes):
  extra = PPO_EXTRA if algorithm == "ppo" else {}
  return learner.LearnerConfig(
    algorithm=algorithm,
    num_turns=T,
    epochs=epochs,
    kl_coef=KL_COEF,
    tis=level,
    tis_cap=CAP,
    **{**extra, **changes},
  )


SGD_CASES = [
  (algorithm, epochs, level, batch_name)
  for algorithm in ("seeupo", "grpo", "gspo", "dapo", "rloo")
  for epochs in (1, 2)
  if not (epochs == 2 and algorithm == "rloo")
  for level in ("token", "sequence")
  for batch_name in TIS_BATCHES
]


@pytest.mark.parametrize("algorithm,epochs,level,batch_name", SGD_CASES)
def test_sgd_update_with_tis_matches_reference(algorithm, epochs, level, batch_name):
  batch = TIS_BATCHES[batch_name]
  config = tis_config(algorithm, epochs, level)
  table, metrics = run(config, batch)
  want, w_mean, w_share, margin = reference_tis_update(config, batch, _lr(algorithm))
  assert margin > 1e-4  # no ratio within float32 noise (~1e-6) of a clip boundary
  np.testing.assert_allclose(table, want, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(metrics["tis_weight_mean"], w_mean, rtol=1e-5)
  np.testing.assert_allclose(metrics["tis_truncated_share"], w_share, rtol=1e-5)
  assert 0.0 < w_share < 1.0  # the cap acted, and not everywhere
  # TIS changed the update: off, the table is another.
  off, _ = run(config.replace(tis="off"), batch)
  assert np.max(np.abs(off - table)) > 1e-3


OWN_CASES = [(a, level, 1) for a in learner.ALGORITHMS for level in ("token", "sequence")] + [
  (a, level, 2) for a in ("seeupo", "grpo", "ppo") for level in ("token", "sequence")
]


@pytest.mark.parametrize("algorithm,level,epochs", OWN_CASES)
def test_tis_with_the_learners_own_logprobs_is_tis_off(algorithm, level, epochs):
  """sample_logp = the learner's log-probs at the starting params: w = 1, the same update bit for
  bit as TIS off (fused first pass with 1 epoch, separate pass with 2), and the same metrics (to
  an ulp: the two programs compile to different fusions, seen on advantage_abs_mean). The mean
  weight is 1 to an ulp too: `own` comes from another program than the learner's pass, and on
  some CPUs (AMD EPYC) a token's two log-probs differ in the last bit, so a sequence
  weight exp(mean log-ratio) is 1 + 2^-23."""
  batch = BATCHES["ragged"]
  own = jax.jit(logprob_fn)({"table": jnp.asarray(TABLE0)}, jax.tree.map(jnp.asarray, batch))
  batch = batch.replace(sample_logp=np.where(np.asarray(batch.turn_ids) >= 0, own, 0.0))
  config = tis_config(algorithm, epochs, level)
  table, metrics = run(config, batch)
  table_off, metrics_off = run(config.replace(tis="off"), batch)
  np.testing.assert_array_equal(table, table_off)
  assert abs(float(metrics["tis_weight_mean"]) - 1.0) <= 2.0**-22  # two ulps of float32 at 1
  assert float(metrics["tis_truncated_share"]) == 0.0
  assert sorted(metrics) == sorted(learner.metrics.names(config))
  for name, value in metrics_off.items():
    np.testing.assert_allclose(metrics[name], value, rtol=1e-6, atol=1e-7, err_msg=name)


# ----------------------------------------------------------------------------------------------
# Rollouts of older params (`pipeline.lag` k): the behaviour policy is the params k updates back.


@functools.cache
def _tables():
  """theta_0 .. theta_2: TABLE0, then the learner's own SeeUPO updates (TIS off) on the full and
  the ragged batch, as a run's iterations would make them."""
  config = tis_config("seeupo", 1, "off")
  state = learner.init_state(
    {"table": jnp.asarray(TABLE0)}, optax.sgd(LR), ref_params={"table": jnp.asarray(TABLE0)}
  )
  tables = [np.asarray(TABLE0)]
  for name in ("full", "ragged"):
    state, _ = _update(config)(state, jax.tree.map(jnp.asarray, BATCHES[name]), jax.random.key(0))
    tables.append(np.asarray(state.params["table"]))
  return tables


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("lag", [1, 2])
def test_a_batch_sampled_lag_updates_ago_is_corrected_as_the_reference(lag, level):
  """The update at theta_2 of a batch sampled with theta_{2-k}: pi_old is the proximal policy
  (theta_2's own log-probs), the weights min(pi_prox / pi_behaviour, C) come from the recorded
  log-probs of theta_{2-k}. SeeUPO's whole update equals the float64 reference of that objective;
  the weights are not 1 (the lag matters) and without them the update is another."""
  tables = _tables()
  proximal, behaviour = tables[2], tables[2 - lag]
  assert np.max(np.abs(proximal - behaviour)) > 0.1  # the updates moved the policy
  batch = BATCHES["ragged"]
  sample_logp = ref.table_logp(behaviour, np.asarray(batch.tokens), np.asarray(batch.token_valid))
  batch = batch.replace(
    sample_logp=np.where(np.asarray(batch.turn_ids) >= 0, sample_logp, 0.0).astype(np.float32)
  )
  config = tis_config("seeupo", 1, level)
  table, metrics = run(config, batch, start_table=proximal)
  want, w_mean, w_share, margin = reference_tis_update(config, batch, LR, start_table=proximal)
  assert margin > 1e-4
  np.testing.assert_allclose(table, want, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(metrics["tis_weight_mean"], w_mean, rtol=1e-5)
  np.testing.assert_allclose(metrics["tis_truncated_share"], w_share, rtol=1e-5)
  assert abs(w_mean - 1.0) > 1e-2
  uncorrected, _ = run(config.replace(tis="off"), batch, start_table=proximal)
  assert np.max(np.abs(uncorrected - table)) > 1e-3


def test_tis_is_off_by_default_and_validated():
  config = learner.LearnerConfig()
  assert (config.tis, config.tis_cap) == ("off", 2.0)
  assert "tis_weight_mean" not in learner.metrics.names(config)
  with pytest.raises(
    ValueError,
    match=r"LearnerConfig.tis='geometric'; allowed: one of \['off', 'token', 'sequence'\]",
  ):
    learner.LearnerConfig(tis="geometric")
  for cap in (0.9, float("inf"), "2"):
    with pytest.raises(
      ValueError, match="LearnerConfig.tis_cap=.*; allowed: a finite number >= 1 "
    ):
      learner.LearnerConfig(tis="token", tis_cap=cap)
  with pytest.raises(ValueError, match="LearnerConfig.dapo_max_refills=-1; allowed: an int >= 0"):
    learner.LearnerConfig(dapo_max_refills=-1)


def test_training_config_has_the_tis_keys():
  import os
  import sys

  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
  from experiments.configs import base  # pylint: disable=g-import-not-at-top

  section = base.training_config().learner
  assert (section.tis, section.tis_cap, section.dapo_max_refills) == ("off", 2.0, 3)
