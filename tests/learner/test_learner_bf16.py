"""bf16 params: float32 master weights make AdamW's small steps count (`learner.precision`).

bfloat16 keeps 8 significant bits, so w + u rounds back to w when |u| < |w| / 512 (up to
|w| / 256). AdamW moves a weight by about its learning rate per step: at the authors' lr 1e-6 a
bf16 weight of size 0.02 cannot move. These tests check that with master weights (the default
of `init_state` for bf16 params) a bf16 run moves its weights as a float32 run does, that without
them it does not (so the comparison can fail), and that masters survive checkpoints.
"""

import functools
import logging

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from seeupo_jax import learner
from seeupo_jax import sharding
from seeupo_jax.learner import precision
from seeupo_jax.models import checkpoint as hf_checkpoint
from seeupo_jax.models import qwen
from seeupo_jax.training import checkpoints
import tiny

BF16 = np.dtype(ml_dtypes.bfloat16)
LR = 1e-6


def _flat(tree) -> np.ndarray:
  return np.concatenate([np.asarray(x, np.float32).ravel() for x in jax.tree.leaves(tree)])


def _compare(change: np.ndarray, reference: np.ndarray) -> dict[str, float]:
  """How `change` follows `reference` (both float32[P]) on the entries the reference moved."""
  moved = reference != 0
  return {
    "changed": float(np.mean(change != 0)),
    "sign_agreement": float(np.mean(np.sign(change[moved]) == np.sign(reference[moved]))),
    "norm_ratio": float(np.linalg.norm(change) / np.linalg.norm(reference)),
  }


# ----------------------------------------------------------------------------------------------
# The wrapper alone, on a toy tree.


def _toy(seed=0):
  rng = np.random.default_rng(seed)
  w = jnp.asarray(0.02 * rng.standard_normal((32, 48)), jnp.bfloat16)
  b = jnp.asarray(rng.standard_normal(48), jnp.float32)
  grads = [
    {"w": jnp.asarray(rng.standard_normal((32, 48)), jnp.float32), "b": jnp.asarray(g)}
    for g in rng.standard_normal((6, 48)).astype(np.float32)
  ]
  return {"w": w, "b": b}, grads


def _run(optimizer, params, grads, wrap):
  state = optimizer.init(params)
  update = wrap(optimizer.update)
  for g in grads:
    # As the learner does: to the dtype of what the optimizer steps (the masters where kept).
    g = jax.tree.map(lambda x, p: x.astype(p.dtype), g, precision.stepped_params(params, state))
    updates, state = update(g, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


@pytest.mark.parametrize("wrap", [jax.jit, lambda f: f], ids=["jit", "nojit"])
def test_masters_step_exactly_as_a_float32_run(wrap):
  params, grads = _toy()
  inner = learner.default_optimizer(learning_rate=LR)
  optimizer = learner.with_master_weights(inner)
  out, state = _run(optimizer, params, grads, wrap)
  # The float32 run from the same (bf16-representable) start, same gradients.
  f32_start = jax.tree.map(lambda x: x.astype(jnp.float32), params)
  reference, reference_state = _run(inner, f32_start, grads, wrap)

  assert isinstance(state, learner.MasterWeightsState)
  assert state.params["b"] is None  # float32 leaves keep no copy
  assert state.params["w"].dtype == jnp.float32
  adam = state.inner_state[1][0]
  assert adam.mu["w"].dtype == jnp.float32 and adam.nu["w"].dtype == jnp.float32
  # The masters are the float32 run's params (to float32 rounding: XLA fuses the two programs
  # differently), and so are the float32 leaf and Adam's moments.
  close = functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=0)
  close(np.asarray(state.params["w"]), np.asarray(reference["w"]))
  close(np.asarray(out["b"]), np.asarray(reference["b"]))
  jax.tree.map(close, adam, reference_state[1][0])
  # The working copy is the masters rounded, and stays bf16.
  assert out["w"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(out["w"]), np.asarray(state.params["w"]).astype(BF16))
  # It moved: 6 steps of at most ~1e-6 each (random gradients partly cancel).
  moved = np.asarray(state.params["w"]) - np.asarray(params["w"], np.float32)
  assert np.mean(moved != 0) > 0.99 and 1e-6 < np.median(np.abs(moved)) < 6e-6

  # Counter-case: the same optimizer on the bf16 params, unwrapped, moves almost nothing.
  unwrapped, _ = _run(inner, params, grads, wrap)
  assert np.mean(np.asarray(unwrapped["w"]) != np.asarray(params["w"])) < 0.05


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_rounded_away_share_by_hand():
  # bf16 spacing at 1.0 is 2^-7: a step of 2^-10 is below half of it and rounds away; at 2^-12
  # the spacing is 2^-19, so the same step moves it.
  params = {"a": jnp.asarray([1.0, 2.0**-12], jnp.bfloat16), "n": jnp.asarray([3], jnp.int32)}
  assert learner.rounded_away_share(params, 2.0**-10) == 0.5
  weights = 0.02 * jax.random.normal(jax.random.key(0), (256, 256))
  assert learner.rounded_away_share({"w": weights.astype(jnp.bfloat16)}, LR) > 0.95
  assert learner.rounded_away_share({"w": weights}, LR) < 1e-3  # float32 resolves 1e-6


# ----------------------------------------------------------------------------------------------
# init_state: the default, the opt-out and its warning, shardings.


def _tiny_params(param_dtype="bfloat16"):
  config = tiny.model_config(dtype="bfloat16", param_dtype=param_dtype)
  return config, jax.jit(qwen.init_params, static_argnums=0)(config, jax.random.key(0))


@pytest.fixture
def absl_warnings(caplog, monkeypatch):
  monkeypatch.setattr(precision, "_warned", False)
  caplog.set_level(logging.WARNING, logger="absl")
  return caplog


def test_init_state_keeps_masters_for_bf16_params_and_warns_without(absl_warnings):
  _, params = _tiny_params()
  optimizer = learner.default_optimizer(learning_rate=LR)
  state = learner.init_state(params, optimizer, ref_params=params)
  assert isinstance(state.opt_state, learner.MasterWeightsState)
  masters = state.opt_state.params
  assert {x.dtype for x in jax.tree.leaves(masters)} == {np.dtype(np.float32)}
  assert_trees_equal(masters, jax.tree.map(lambda x: x.astype(jnp.float32), params))
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {BF16}
  assert not absl_warnings.records

  # float32 params: no wrapper (the state is what it always was).
  _, params32 = _tiny_params("float32")
  assert not isinstance(
    learner.init_state(params32, optimizer).opt_state, learner.MasterWeightsState
  )

  # Opting out: no masters, one warning with the share of weights a step cannot move.
  for _ in range(2):
    opted_out = learner.init_state(params, optimizer, master_weights=False)
  assert not isinstance(opted_out.opt_state, learner.MasterWeightsState)
  (record,) = absl_warnings.records
  message = record.getMessage()
  assert "no float32 master weights" in message and "at 1e-06" in message
  share = float(message.split("cannot move: ")[1].split("%")[0]) / 100
  assert share == pytest.approx(learner.rounded_away_share(params, 1e-6), abs=1e-3)
  assert share > 0.9


def test_masters_and_moments_live_on_the_params_shardings():
  _, params = _tiny_params()
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  params = learner.shard_params(params, mesh)
  state = learner.init_state(params, learner.default_optimizer(), ref_params=params)
  adam = state.opt_state.inner_state[1][0]
  for tree in (state.opt_state.params, adam.mu, adam.nu):
    for x, p in zip(jax.tree.leaves(tree), jax.tree.leaves(params)):
      assert x.sharding == p.sharding and x.dtype == jnp.float32
  kernel = state.opt_state.params["layers"]["mlp"]["gate_proj"]["kernel"]
  assert kernel.sharding.spec == P(None, "fsdp", "tensor")
  # What opt_state_shardings says (restore targets) is what init_state built.
  expected = learner.opt_state_shardings(learner.default_optimizer(), params)
  assert jax.tree.leaves(expected) == [x.sharding for x in jax.tree.leaves(state.opt_state)]


# ----------------------------------------------------------------------------------------------
# The check: qwen3-tiny, GSPO, 8 x 64 tokens, 5 AdamW steps at lr 1e-6.


def _gspo_batch(vocab, rows=8, length=64, prompt=16):
  rng = np.random.default_rng(0)
  turn_ids = np.full((rows, length), -1, np.int32)
  turn_ids[:, prompt:] = 0
  batch = learner.Batch(
    tokens=rng.integers(1, vocab, (rows, length)).astype(np.int32),
    token_valid=np.ones((rows, length), bool),
    turn_ids=turn_ids,
    sample_logp=np.zeros((rows, length), np.float32),
    rewards=rng.normal(size=rows).astype(np.float32),
    group_ids=(np.arange(rows) // 4 * 4).astype(np.int32),
    row_valid=np.ones(rows, bool),
  )
  learner.validate(batch, num_turns=1)
  return jax.tree.map(jnp.asarray, batch)


@pytest.fixture(scope="module")
def five_steps():
  """The start and, per run, (params, masters, params' dtypes) after 5 AdamW steps at lr 1e-6,
  flattened to float32[P].

  Runs, all from the same bf16-representable start:
    f32:           float32 params, float32 compute
    f32_bf16:      float32 params, bf16 compute (the textbook mixed-precision recipe)
    masters:       bf16 params + float32 masters (init_state's default), bf16 compute
    no_masters:    bf16 params, no masters (master_weights=False), bf16 compute
  """
  base = tiny.model_config()
  start = qwen.init_params(base, jax.random.key(0))
  start = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), start)
  batch = _gspo_batch(base.vocab_size)
  config = learner.LearnerConfig(algorithm="gspo", num_turns=1, epochs=5, kl_coef=0.0)
  optimizer = learner.default_optimizer(learning_rate=LR)

  def run(dtype, param_dtype, master_weights=True):
    model_config = base.replace(dtype=dtype, param_dtype=param_dtype)
    params = jax.tree.map(lambda x: jnp.array(x, dtype=param_dtype, copy=True), start)
    step = learner.make_update(learner.qwen_logprob_fn(model_config), optimizer, config)
    state = learner.init_state(params, optimizer, master_weights=master_weights)
    state, metrics = step(state, batch, jax.random.key(1))
    assert int(metrics["optimizer_steps"]) == 5 and int(metrics["skipped_updates"]) == 0
    assert 0.3 < float(metrics["grad_norm"]) < 3.0
    dtypes = {x.dtype for x in jax.tree.leaves(state.params)}
    return _flat(state.params), _flat(learner.master_params(state)), dtypes

  runs = {
    "f32": run("float32", "float32"),
    "f32_bf16": run("bfloat16", "float32"),
    "masters": run("bfloat16", "bfloat16"),
    "no_masters": run("bfloat16", "bfloat16", master_weights=False),
  }
  return _flat(start), runs


@pytest.mark.slow  # ~60-120 s on 2 cores: four compiles of the qwen3-tiny update
def test_bf16_with_masters_moves_its_weights_like_float32(five_steps):
  start, runs = five_steps
  reference = runs["f32"][1] - start
  masters = _compare(runs["masters"][1] - start, reference)
  # Measured: f32 changes 91.1% of the entries; the masters 91.1%, same sign on 99.8% of them,
  # norm ratio 0.998.
  assert _compare(reference, reference)["changed"] > 0.8
  assert masters["changed"] > 0.8
  assert masters["sign_agreement"] > 0.95
  assert 0.8 < masters["norm_ratio"] < 1.25
  # The working copy is the masters rounded to bf16, and stays bf16.
  params, flat_masters, dtypes = runs["masters"]
  assert dtypes == {BF16}
  np.testing.assert_array_equal(params, flat_masters.astype(BF16).astype(np.float32))

  # Counter-case: without masters (the behaviour before) most updates round away, and the same
  # comparison fails. Measured: 1.8% changed, same sign as f32 on 2.0% of f32's moved entries.
  lost = _compare(runs["no_masters"][0] - start, reference)
  assert lost["changed"] < 0.1
  assert lost["sign_agreement"] < 0.5


@pytest.mark.slow
def test_bf16_masters_equal_float32_params_with_bf16_compute(five_steps):
  """Two routes to the same training: float32 params that the model casts at each use, and
  bf16 params with float32 masters. They differ only in where gradients are rounded (a bf16
  embedding scatter-add and head gradient), so the weights agree to a fraction of a step."""
  start, runs = five_steps
  masters, twin = runs["masters"][1], runs["f32_bf16"][1]
  step = np.abs(twin - start)
  assert np.max(np.abs(masters - twin)) < 0.25 * np.max(step)  # measured 3.1e-7; steps 5.1e-6
  assert _compare(masters - start, twin - start)["sign_agreement"] > 0.999


# ----------------------------------------------------------------------------------------------
# Checkpoints and the HF export.


def test_masters_survive_a_checkpoint_and_the_export_is_bf16(tmp_path):
  config, params = _tiny_params()
  optimizer = learner.default_optimizer(learning_rate=1e-3)
  state = learner.init_state(params, optimizer, ref_params=params)
  rng = np.random.default_rng(1)
  grads = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), params)
  wrapped = precision.for_state(optimizer, state.opt_state)
  updates, opt_state = jax.jit(wrapped.update)(grads, state.opt_state, state.params)
  state = state.replace(params=optax.apply_updates(state.params, updates), opt_state=opt_state)
  masters = state.opt_state.params
  # A real check: the masters hold what the bf16 params cannot.
  assert np.any(_flat(masters) != _flat(state.params))

  with checkpoints.Checkpointer(str(tmp_path / "ckpt")) as ckpt:
    assert ckpt.save(1, state, jax.random.key(0), {"next_task": 0}, force=True)
  fresh = learner.init_state(params, optimizer, ref_params=params)
  with checkpoints.Checkpointer(str(tmp_path / "ckpt")) as ckpt:
    _, restored, _, _ = ckpt.restore_latest(
      checkpoints.abstract_of(fresh), checkpoints.abstract_of(jax.random.key(0))
    )
  assert isinstance(restored.opt_state, learner.MasterWeightsState)
  assert_trees_equal(restored, state)

  # save_hf writes the configured dtype: the bf16 working copy.
  hf_checkpoint.save(restored.params, config, str(tmp_path / "hf"))
  _, loaded = hf_checkpoint.load(str(tmp_path / "hf"), dtype="bfloat16", param_dtype="bfloat16")
  assert {x.dtype for x in jax.tree.leaves(loaded)} == {BF16}
  np.testing.assert_array_equal(_flat(loaded), _flat(restored.params))
