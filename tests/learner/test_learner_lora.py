"""LoRA through the learner: adapters trained beside a frozen base (`init_state(..., base=)`).

The adapters' gradients (on every target: each layer's seven projections and the lm_head) are
checked against the whole model's, for every algorithm of the
registry and on quantized bases (W the dequantized kernel): with W' = W + s A B the loss
depends on A and B only through W', so dL/dA = s G B^T and dL/dB = s A^T G, G = dL/dW' (the
chain rule). One plain-SGD step of the full-parameter update at the merged weights W' gives
G = (W' - W'_new) / lr; NumPy (float64) predicts the adapters' SGD step from it, and the
adapter update must take that step.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from seeupo_jax import learner
from seeupo_jax.models import config as config_lib
from seeupo_jax.models import lora
from seeupo_jax.models import quant
from seeupo_jax.models import qwen
import tiny

LR = 0.5
RANK, ALPHA = 4, 8.0


def _config():
  """Adapters on every target: the seven projections of each layer and the lm_head."""
  return tiny.model_config().replace(
    lora_rank=RANK, lora_alpha=ALPHA, lora_targets=config_lib.LORA_TARGETS
  )


def _adapted_kernels(adapters, params):
  """(name, adapter {"lora_a", "lora_b"}, its kernel in `params`), with a leading layer axis
  (the head's adapter and kernel get one of size 1)."""
  out = []
  for module, projections in adapters["layers"].items():
    for name, ab in projections.items():
      out.append((name, ab, params["layers"][module][name]["kernel"]))
  head = adapters[lora.HEAD]
  out.append((lora.HEAD, jax.tree.map(lambda x: x[None], head), params[lora.HEAD]["kernel"][None]))
  return out


def _rollout(config, params):
  """N = 4 one-turn rows: prompt 5, then 6 tokens sampled from the adapted model."""
  from seeupo_jax import sampling  # noqa: PLC0415

  n, prompt_len, new = 4, 5, 6
  sample = sampling.make_sampler(config, sampling.SamplingConfig(max_new_tokens=new))
  rng = np.random.default_rng(3)
  prompt = jnp.asarray(rng.integers(1, config.vocab_size, (n, prompt_len)), jnp.int32)
  out = sample(params, prompt, jnp.ones(prompt.shape, bool), jax.random.key(1))
  assert np.all(np.asarray(out.lengths) == new)
  tokens = np.asarray(jnp.concatenate([prompt, out.tokens], axis=1))
  turn_ids = np.full(tokens.shape, -1, np.int32)
  turn_ids[:, prompt_len:] = 0
  sample_logp = np.zeros(tokens.shape, np.float32)
  sample_logp[:, prompt_len:] = np.asarray(out.logprobs)
  return learner.Batch(
    tokens=tokens,
    token_valid=np.ones(tokens.shape, bool),
    turn_ids=turn_ids,
    sample_logp=sample_logp,
    rewards=np.array([1.0, 0.0, 0.5, 0.2], np.float32),
    group_ids=np.zeros(n, np.int32),
    row_valid=np.ones(n, bool),
  )


@pytest.fixture(scope="module")
def adapted():
  """(config, params with non-zero adapters (B too, so both gradients are non-zero), batch)."""
  config = _config()
  params = qwen.init_params(config, jax.random.key(0))
  adapters, base = lora.split(params)
  base = jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, base)  # sharper samples
  keys = iter(jax.random.split(jax.random.key(7), 64))
  adapters = jax.tree.map(
    lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape, x.dtype), adapters
  )
  params = lora.combine(base, adapters)
  return config, params, _rollout(config, params)


def _update(config, algorithm):
  """One SGD step of `algorithm` (PPO with a critic of its own: the same one in both runs)."""
  value_fn = learner.qwen_value_fn(config) if algorithm == "ppo" else None
  return learner.make_update(
    learner.qwen_logprob_fn(config),
    optax.sgd(LR),
    learner.LearnerConfig(algorithm=algorithm, num_turns=1, kl_coef=0.0),
    value_fn=value_fn,
    critic_optimizer=optax.sgd(LR) if value_fn else None,
  )


def _state(config, algorithm, params, base=None):
  critic = {}
  if algorithm == "ppo":
    critic = dict(
      critic_params=learner.init_qwen_critic(config.replace(lora_rank=0), jax.random.key(7)),
      critic_optimizer=optax.sgd(LR),
    )
  base = None if base is None else jax.tree.map(jnp.copy, base)  # the update donates the state
  return learner.init_state(jax.tree.map(jnp.copy, params), optax.sgd(LR), base=base, **critic)


# A token-level (GRPO) and a critic's (PPO) objective on a float32 base, a sequence-level one
# (GSPO) on an int8 base and SeeUPO on an NF4 one. The other algorithms of the registry
# differ from these only in their loss of the same log-probs; all of them pass with
# CASES = [(name, "none") for name in learner.ALGORITHMS] (about 5 CPU-minutes).
CASES = [("grpo", "none"), ("ppo", "none"), ("gspo", "int8"), ("seeupo", "nf4")]


@pytest.mark.slow  # two updates compiled per case
@pytest.mark.parametrize("algorithm, fmt", CASES)
def test_adapter_step_is_the_chain_rule_of_the_full_models(adapted, algorithm, fmt):
  config, params, batch = adapted
  batch = jax.tree.map(jnp.asarray, batch)
  adapters, base = lora.split(params)
  if fmt != "none":  # a quantized base: W is its dequantization
    base = quant.quantize_params(base, fmt)
    params = lora.combine(base, adapters)
  merged = lora.merge(params, config.lora_scale)
  full_config = config.replace(lora_rank=0)

  # The whole model at W' = W + s A B, one SGD step: G = (W' - W'_new) / lr.
  full_state = _state(full_config, algorithm, merged)
  full_state, full_metrics = _update(full_config, algorithm)(full_state, batch, jax.random.key(0))
  assert full_metrics["optimizer_steps"] == 1

  state = _state(config.replace(quantize=fmt), algorithm, adapters, base=base)
  state, metrics = _update(config.replace(quantize=fmt), algorithm)(state, batch, jax.random.key(0))
  assert metrics["optimizer_steps"] == 1
  np.testing.assert_allclose(metrics["loss"], full_metrics["loss"], rtol=1e-4, atol=2e-6)

  s = config.lora_scale
  before = _adapted_kernels(adapters, merged)
  after = _adapted_kernels(state.params, full_state.params)
  assert sorted(n for n, _, _ in before) == sorted(config_lib.LORA_TARGETS)  # every target
  for (name, ab, w_old), (_, got, w_new) in zip(before, after):
    g = (np.asarray(w_old, np.float64) - np.asarray(w_new, np.float64)) / LR  # [L, in, out]
    a = np.asarray(ab["lora_a"], np.float64)
    b = np.asarray(ab["lora_b"], np.float64)
    want_a = a - LR * s * np.einsum("lio,lro->lir", g, b)
    want_b = b - LR * s * np.einsum("lir,lio->lro", a, g)
    moved = np.abs(want_b - b).max()
    assert moved > 1e-4, (name, moved)  # the check can fail
    for got_x, want, old in ((got["lora_a"], want_a, a), (got["lora_b"], want_b, b)):
      step_err = np.abs(np.asarray(got_x, np.float64) - want).max()
      step_size = np.abs(want - old).max()
      assert step_err <= 2e-3 * step_size + 1e-6, (name, step_err, step_size)
  # The base is frozen: the very values it had (its codes, when quantized).
  for x, y in zip(jax.tree.leaves(state.base), jax.tree.leaves(base)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow  # SeeUPO's update compiled with LoRA
def test_seeupo_trains_adapters_with_the_base_as_kl_reference(adapted):
  config, params, batch = adapted
  batch = jax.tree.map(jnp.asarray, batch)
  adapters, base = lora.split(params)
  zero_b = jax.tree_util.tree_map_with_path(
    lambda p, x: jnp.zeros_like(x) if str(p[-1].key) == "lora_b" else x, adapters
  )
  optimizer = learner.default_optimizer(learning_rate=1e-2)
  step = learner.make_update(
    learner.qwen_logprob_fn(config),
    optimizer,
    learner.LearnerConfig(algorithm="seeupo", num_turns=1, kl_coef=0.1),
  )
  # B = 0: the adapted policy is the base, so the KL to the reference (the base) is 0.
  state = learner.init_state(
    jax.tree.map(jnp.copy, zero_b), optimizer, base=jax.tree.map(jnp.copy, base)
  )
  assert learner.reference_params(state) is state.base
  opt_leaves = [x for x in jax.tree.leaves(state.opt_state) if getattr(x, "ndim", 0) >= 2]
  assert sum(x.size for x in opt_leaves) == 2 * sum(x.size for x in jax.tree.leaves(zero_b))
  state, metrics = step(state, batch, jax.random.key(0))
  assert abs(float(metrics["kl"])) < 1e-6
  assert metrics["optimizer_steps"] == 1
  moved = [
    float(jnp.max(jnp.abs(x - y)))
    for x, y in zip(jax.tree.leaves(state.params), jax.tree.leaves(zero_b))
  ]
  assert max(moved) > 1e-4
  for x, y in zip(jax.tree.leaves(state.base), jax.tree.leaves(base)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # With the adapters moved the policy differs from the reference: the next KL is not 0.
  _, metrics = step(state, batch, jax.random.key(1))
  assert float(metrics["kl"]) > 1e-8


def test_kl_needs_a_reference_or_a_base(adapted):
  config, params, batch = adapted
  adapters, _ = lora.split(params)
  step = learner.make_update(
    learner.qwen_logprob_fn(config),
    optax.sgd(LR),
    learner.LearnerConfig(algorithm="seeupo", num_turns=1, kl_coef=0.1),
    jit=False,
  )
  with pytest.raises(ValueError, match="frozen base"):
    step(learner.init_state(adapters, optax.sgd(LR)), jax.tree.map(jnp.asarray, batch), None)
