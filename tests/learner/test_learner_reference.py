"""The configured loss is the loss that runs: one learner call per algorithm against the
independent float64 NumPy reference in `learner_reference.py` (SGD, table-of-logits policy,
epochs x mini-batches of 1 x 1 and 2 x 1)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import learner_reference as ref
from seeupo_jax import learner

N, L, V, T = 8, 12, 5, 3
LR = 8.0  # large enough that the second epoch's ratios leave the clip range
CRITIC_LR = 6.0
# Dr. GRPO's loss is smaller (no std division, row sums over L = 12 instead of row means) and DAPO's
# clip wider (0.28 above): larger steps take their second epoch into the clip as well.
# GiGPO at 8 puts one second-epoch ratio within 3e-4 of the clip: at 10 none is within 9e-3.
LR_OF = {"dr_grpo": 6 * LR, "dapo": 2 * LR, "gigpo": 1.25 * LR}
KL_COEF = 0.1
RTOL, ATOL = 2e-5, 2e-5
CLIPPED = ("seeupo", "grpo", "gspo", "ppo", "dr_grpo", "gspo_token", "dapo", "gigpo", "mt_grpo")
PPO_EXTRA = dict(gamma=0.9, gae_lambda=0.95)

_rng = np.random.default_rng(0)
TABLE0 = _rng.normal(0.0, 0.5, (L, V)).astype(np.float32)
VALUES0 = _rng.normal(0.0, 0.3, (L,)).astype(np.float32)


def make_batch(ragged: bool) -> learner.Batch:
  """8 rows, 2 groups of 4: a prompt token, then turns separated by one environment token,
  right padding. ragged: row 2 stops after 2 turns, row 5 after 1, row 7 is a padding row
  (row_valid False, though it has tokens of every turn)."""
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, V, (N, L)).astype(np.int32)
  token_valid = np.zeros((N, L), bool)
  turn_ids = np.full((N, L), -1, np.int32)
  turn_lengths = [
    [2, 2, 3],
    [1, 3, 2],
    [3, 1, 3],
    [2, 3, 1],
    [1, 1, 1],
    [3, 2, 2],
    [2, 1, 2],
    [3, 3, 3],
  ]
  if ragged:
    turn_lengths[2] = turn_lengths[2][:2]
    turn_lengths[5] = turn_lengths[5][:1]
  for i, lengths in enumerate(turn_lengths):
    col = 1  # column 0: the prompt
    for t, k in enumerate(lengths):
      turn_ids[i, col : col + k] = t
      col += k + (1 if t < len(lengths) - 1 else 0)  # one environment token between turns
    token_valid[i, :col] = True
  row_valid = np.ones(N, bool)
  if ragged:
    row_valid[7] = False
  rewards = np.array([1.0, 0.0, 0.5, 0.2, 0.9, 0.1, 0.4, 0.0], np.float32)
  sample_logp = np.zeros((N, L), np.float32)
  group_ids = np.array([0, 0, 0, 0, 1, 1, 1, 1], np.int32)
  # Per-turn inputs of the turn-level algorithms: states recur within a group (GiGPO's anchors;
  # -1 unknown), turn rewards vary (MT-GRPO's).
  turn_states = np.array(
    [[5, 1, 2], [5, 1, 3], [5, 2, -1], [5, 1, 2], [9, 4, 4], [9, 4, 6], [9, 7, 6], [9, 4, 6]],
    np.int32,
  )
  turn_rewards = (rng.integers(0, 3, (N, T)) * 0.5).astype(np.float32)
  return learner.Batch(
    tokens,
    token_valid,
    turn_ids,
    sample_logp,
    rewards,
    group_ids,
    row_valid,
    turn_rewards,
    turn_states,
  )


BATCHES = {"full": make_batch(False), "ragged": make_batch(True)}


def _equal_group(batch):
  """Group 1 (rows 4-7) with equal rewards: dynamic sampling drops it."""
  rewards = np.array(batch.rewards)
  rewards[4:] = 0.5
  return batch.replace(rewards=rewards)


# Batches outside the all-algorithms cases.
EXTRA_BATCHES = {f"{name}_equal_group": _equal_group(b) for name, b in BATCHES.items()}
ALL_BATCHES = {**BATCHES, **EXTRA_BATCHES}


def logprob_fn(params, batch):
  log_probs = jax.nn.log_softmax(params["table"], axis=-1)  # [L, V]
  cols = jnp.arange(batch.tokens.shape[1])[None, :]
  logp = log_probs[cols, batch.tokens]
  return jnp.where(batch.token_valid & (cols > 0), logp, 0.0)


def value_fn(params, batch):
  return jnp.where(batch.token_valid, params["v"][None, :], 0.0)


@functools.cache
def _step(config: learner.LearnerConfig):
  """The jitted update, built once per config (the batches share shapes: one compile)."""
  if config.algorithm == "ppo":
    return learner.make_update(
      logprob_fn, optax.sgd(LR), config, value_fn=value_fn, critic_optimizer=optax.sgd(CRITIC_LR)
    )
  return learner.make_update(logprob_fn, optax.sgd(_lr(config)), config)


def _lr(config):
  return LR_OF.get(config.algorithm, LR)


def config_for(algorithm, epochs, **changes):
  extra = PPO_EXTRA if algorithm == "ppo" else {}
  return learner.LearnerConfig(
    algorithm=algorithm, num_turns=T, epochs=epochs, kl_coef=KL_COEF, **{**extra, **changes}
  )


@functools.cache
def run_learner(config: learner.LearnerConfig, batch_name: str):
  """(table, critic values or None, metrics) after one call, as NumPy."""
  critic = {}
  if config.algorithm == "ppo":
    critic = dict(critic_params={"v": jnp.asarray(VALUES0)}, critic_optimizer=optax.sgd(CRITIC_LR))
  state = learner.init_state(
    {"table": jnp.asarray(TABLE0)},
    optax.sgd(_lr(config)),
    ref_params={"table": jnp.asarray(TABLE0)},
    **critic,
  )
  batch = jax.tree.map(jnp.asarray, ALL_BATCHES[batch_name])
  state, metrics = _step(config)(state, batch, jax.random.key(0))
  critic_out = None if state.critic_params is None else np.asarray(state.critic_params["v"])
  return np.asarray(state.params["table"]), critic_out, jax.tree.map(np.asarray, metrics)


@functools.cache
def run_reference(config: learner.LearnerConfig, batch_name: str):
  fields = (
    "epochs",
    "order",
    "correction",
    "clip_low",
    "clip_high",
    "correction_clip_low",
    "correction_clip_high",
    "advantage_clip",
    "kl_coef",
    "gamma",
    "gae_lambda",
    "value_clip",
    "agg",
    "norm_length",
    "dynamic_sampling",
    "overlong_max_tokens",
    "overlong_cache_tokens",
    "normalisation",
    "step_weight",
    "outcome_weight",
  )
  assert config.minibatches == 1
  return ref.reference_update(
    config.algorithm,
    TABLE0,
    ALL_BATCHES[batch_name],
    num_turns=config.num_turns,
    lr=_lr(config),
    critic=VALUES0 if config.algorithm == "ppo" else None,
    critic_lr=CRITIC_LR,
    **{name: getattr(config, name) for name in fields},
  )


def assert_matches_reference(
  config, batch_name, metric_names=("loss", "pg_loss", "kl", "clip_fraction")
):
  table, critic, metrics = run_learner(config, batch_name)
  want = run_reference(config, batch_name)
  # Clip decisions are discontinuous: no ratio may sit within float32 noise of a boundary.
  assert want["clip_margin"] > 1e-3
  assert not np.allclose(table, TABLE0, atol=1e-3)  # the update moved the params
  np.testing.assert_allclose(table, want["table"], rtol=RTOL, atol=ATOL)
  if config.algorithm == "ppo":
    np.testing.assert_allclose(critic, want["critic"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(
      metrics["value_loss"], want["metrics"]["value_loss"], rtol=1e-4, atol=1e-5
    )
  else:
    assert critic is None
  assert int(metrics["optimizer_steps"]) == want["metrics"]["optimizer_steps"]
  assert int(metrics["skipped_updates"]) == 0
  for name in metric_names:
    np.testing.assert_allclose(
      metrics[name], want["metrics"][name], rtol=1e-4, atol=1e-6, err_msg=name
    )
  if config.algorithm == "seeupo":
    np.testing.assert_allclose(metrics["turn/M_mean"], want["turn_M_mean"], rtol=1e-5, atol=1e-6)
  return table, want


CASES = [
  (algorithm, epochs, batch_name)
  for algorithm in learner.ALGORITHMS
  for epochs in (1, 2)
  if not (epochs == 2 and algorithm in ("reinforce", "rloo"))
  for batch_name in BATCHES
]


@pytest.mark.parametrize("algorithm,epochs,batch_name", CASES)
def test_update_matches_reference(algorithm, epochs, batch_name):
  """One call, SGD, epochs x 1 mini-batch: params (and PPO's critic) and metrics as defined."""
  assert_matches_reference(config_for(algorithm, epochs), batch_name)


@pytest.mark.parametrize("batch_name", BATCHES)
@pytest.mark.parametrize("algorithm", CLIPPED)
def test_second_epoch_exercises_the_clip(algorithm, batch_name):
  """With 2 epochs the clipped branch is taken somewhere (so the match above covers it); for PPO
  the critic's value clip too."""
  config = config_for(algorithm, 2)
  want = run_reference(config, batch_name)
  assert want["metrics"]["clip_fraction_max"] > 0
  assert float(run_learner(config, batch_name)[2]["clip_fraction"]) > 0
  if algorithm == "ppo":
    assert want["metrics"]["value_clip_fraction"] > 0


@pytest.mark.parametrize("algorithm", ("reinforce", "rloo"))
def test_on_policy_algorithms_reject_two_epochs(algorithm):
  with pytest.raises(ValueError, match="on-policy"):
    config_for(algorithm, 2)


@pytest.mark.parametrize(
  "changes", [dict(order="forward"), dict(correction=False), dict(gamma=0.5)], ids=str
)
@pytest.mark.parametrize("batch_name", BATCHES)
def test_seeupo_ablations_match_reference(changes, batch_name):
  """The ablations run what they say: each matches its reference and differs from SeeUPO's."""
  config = config_for("seeupo", 2, **changes)
  table, _ = assert_matches_reference(config, batch_name)
  default, _, _ = run_learner(config_for("seeupo", 2), batch_name)
  assert np.max(np.abs(table - default)) > 1e-3


@pytest.mark.parametrize("algorithm", ("grpo", "rloo"))
def test_critic_free_turn_discount_matches_reference(algorithm):
  """gamma < 1 for the baselines: A * gamma^(T_i - 1 - t) per turn (rows of 1, 2 and 3 turns)."""
  assert_matches_reference(config_for(algorithm, 1, gamma=0.5), "ragged")


# ----------------------------------------------------------------------------------------------
# The baselines of today's papers: Dr. GRPO, GSPO-token, DAPO (their all-algorithms cases above).


@pytest.mark.parametrize("batch_name", EXTRA_BATCHES)
def test_dapo_dynamic_sampling_and_overlong_shaping_match_reference(batch_name):
  """DAPO with a group of equal rewards (dropped: it counts nowhere) and the overlong penalty
  (L_max 7, L_cache 2: rows of 6 and 7 generated tokens get -0.5 and -1, rows of 9 get -1)."""
  config = config_for("dapo", 2, overlong_max_tokens=7, overlong_cache_tokens=2)
  table, want = assert_matches_reference(config, batch_name)
  metrics = run_learner(config, batch_name)[2]
  assert want["groups_dropped"] == 1 and float(metrics["groups_dropped"]) == 1.0
  assert float(metrics["rows_dropped"]) == (4.0 if batch_name.startswith("full") else 3.0)
  assert float(metrics["overlong_penalty_mean"]) < 0.0
  # Without dynamic sampling the equal group stays in the denominators: another update.
  kept, _, _ = run_learner(config.replace(dynamic_sampling=False), batch_name)
  assert np.max(np.abs(kept - table)) > 1e-4


@pytest.mark.parametrize("batch_name", BATCHES)
@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("epochs", [1, 2])
def test_dr_grpo_with_norm_length_matches_reference(epochs, microbatches, batch_name):
  """Dr. GRPO dividing row sums by the constant C = norm_length = 16 (not L = 12), in the policy
  loss and the KL term, micro-batches of 8 and of 4 rows: the reference's w_it = m_it / (C |R|).
  The update is not the one that divides by L (so the constant is really used). With 2
  micro-batches clip_fraction is left out: the micro-batches' token-mean diagnostics are
  combined by their share of rows (the loss's denominator), so that metric is not the
  mini-batch's token mean; the step and the loss are."""
  config = config_for("dr_grpo", epochs, microbatches=microbatches, norm_length=16)
  names = ("loss", "pg_loss", "kl") + (("clip_fraction",) if microbatches == 1 else ())
  table, _ = assert_matches_reference(config, batch_name, names)
  by_l, _, _ = run_learner(config_for("dr_grpo", epochs, microbatches=microbatches), batch_name)
  assert np.max(np.abs(table - by_l)) > 1e-3
  if epochs == 2:
    assert run_reference(config, batch_name)["metrics"]["clip_fraction_max"] > 0


def test_training_program_sets_norm_length_to_the_generation_budget():
  """`training.config.typed`: Dr. GRPO's constant defaults to min(max_context_tokens,
  max_turns x max_reply_tokens), the same every iteration; a value set in the config stays;
  other aggregations keep None."""
  import os
  import sys

  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
  from experiments import configs  # pylint: disable=g-import-not-at-top
  from seeupo_jax.training import config as config_lib  # pylint: disable=g-import-not-at-top

  c = configs.get_config("synthetic")
  assert c.learner.norm_length is None
  c.rollout.max_turns, c.rollout.max_reply_tokens, c.rollout.max_context_tokens = 3, 40, 160
  assert config_lib.typed(c).learner.norm_length is None  # SeeUPO
  c.learner.algorithm = "dr_grpo"
  assert config_lib.typed(c).learner.norm_length == 120  # 3 x 40
  c.rollout.max_reply_tokens = 100
  assert config_lib.typed(c).learner.norm_length == 160  # the context
  c.learner.norm_length = 64
  assert config_lib.typed(c).learner.norm_length == 64
  c.learner.algorithm = "seeupo"
  with pytest.raises(
    config_lib.ConfigError,
    match=r"^learner.norm_length=64; allowed: None unless agg='seq-mean-token-sum-norm'",
  ):
    config_lib.typed(c)


def test_dapo_and_dr_grpo_defaults_are_their_papers():
  dapo = learner.LearnerConfig(algorithm="dapo")
  assert (dapo.clip_low, dapo.clip_high, dapo.agg) == (0.2, 0.28, "token-mean")
  assert dapo.dynamic_sampling and dapo.advantage_normalisation == "group"
  dr = learner.LearnerConfig(algorithm="dr_grpo")
  assert dr.agg == "seq-mean-token-sum-norm" and dr.advantage_normalisation == "none"
  # A field left to the algorithm follows a change of algorithm; one set explicitly stays.
  assert dapo.replace(algorithm="grpo").clip_high == 0.2
  assert dapo.replace(algorithm="grpo").dynamic_sampling is False
  assert (
    learner.LearnerConfig(algorithm="dapo", clip_high=0.3).replace(kl_coef=0.0).clip_high == 0.3
  )
  with pytest.raises(ValueError, match="dynamic_sampling"):
    learner.LearnerConfig(algorithm="ppo", dynamic_sampling=True)


@pytest.mark.parametrize("gamma", [1.0, 0.5])
def test_gspo_token_runs_gspo_s_loss(gamma):
  """GSPO-token's value and gradient equal GSPO's (the GSPO paper, section 4.3): our sequence clip
  loss is written in the token form, so the two names run the same update, with the turn
  discounts (gamma < 1) as the per-token advantages."""
  a, _, _ = run_learner(config_for("gspo_token", 2, gamma=gamma), "ragged")
  b, _, _ = run_learner(config_for("gspo", 2, gamma=gamma), "ragged")
  np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("algorithm", learner.ALGORITHMS)
def test_metrics_are_the_listed_names(algorithm):
  """The update returns exactly the names of `learner.metrics` (one list), per algorithm."""
  config = config_for(algorithm, 1)
  assert sorted(run_learner(config, "full")[2]) == sorted(learner.metrics.names(config))


def test_every_algorithm_is_documented():
  import pathlib

  doc = (pathlib.Path(__file__).parents[2] / "docs" / "learner.md").read_text()
  for name in learner.ALGORITHMS:
    assert f"| `{name}` |" in doc, name


def test_overlong_penalty_and_informative_groups_by_hand():
  lengths = jnp.array([3.0, 5.0, 6.0, 7.0, 8.0])
  np.testing.assert_allclose(
    learner.objectives.overlong_penalty(lengths, 7, 2), [0.0, 0.0, -0.5, -1.0, -1.0]
  )
  np.testing.assert_allclose(learner.objectives.overlong_penalty(lengths, 7, 0), [0, 0, 0, 0, -1])
  rewards = jnp.array([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
  groups = jnp.array([0, 0, 1, 1, 2, 2])
  valid = jnp.array([True, True, True, True, True, False])
  keep, dropped = learner.objectives.informative_groups(rewards, groups, valid)
  # Group 0 all equal, group 1 differs, group 2 has one valid row (equal to itself): 2 dropped.
  assert keep.tolist() == [False, False, True, True, False, False] and float(dropped) == 2.0


def test_the_refill_and_the_update_filter_agree_on_informative_groups():
  """One rule on both sides: the groups the host's refill finds informative
  (`dapo.informative_group_ids`, on trajectories) are those whose rows the update keeps
  (`dapo.informative_rows`, on the batch's arrays)."""
  import types

  from seeupo_jax.learner import dapo

  rng = np.random.default_rng(0)
  for _ in range(20):
    n = 12
    groups = rng.integers(0, 4, n)
    rewards = rng.choice([0.0, 0.5, 1.0, 1.0 + 1e-9], n)  # 1 + 1e-9 is 1 in float32
    dropped = rng.random(n) < 0.2
    empty = rng.random(n) < 0.1
    trajectories = [
      types.SimpleNamespace(
        group=int(g), reward=float(r), dropped=bool(d), tokens=[] if e else [1, 2]
      )
      for g, r, d, e in zip(groups, rewards, dropped, empty)
    ]
    valid = ~dropped & ~empty
    keep, _ = dapo.informative_rows(
      jnp.asarray(rewards, jnp.float32), jnp.asarray(groups, jnp.int32), jnp.asarray(valid)
    )
    kept_groups = sorted({int(g) for g, k in zip(groups, np.asarray(keep)) if k})
    assert dapo.informative_group_ids(trajectories) == kept_groups
