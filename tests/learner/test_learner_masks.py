"""One mask per turn: only the tokens the policy generated are trained (reference defect 5).

The authors' code took the advantage over the loss mask but the ratio and the
KL over the attention mask (which includes chat-template headers). Here every
term uses the tokens generated in the turn, so a table of logits indexed by
position gets exactly zero gradient at every prompt, environment, header or
padding position, from the policy loss and from the KL term alike.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from seeupo_jax import learner

N, L, V, T = 8, 16, 6, 3


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  turn_ids = np.full((N, L), -1, np.int32)
  # [prompt 0-1][turn 0: 2-4][header 5][env 6][turn 1: 7-9][env 10-11][turn 2: 12-13][pad 14-15]
  turn_ids[:, 2:5] = 0
  turn_ids[:, 7:10] = 1
  turn_ids[: N // 2, 12:14] = 2  # half the rows stop after turn 1
  token_valid = np.ones((N, L), bool)
  token_valid[:, 14:] = False
  token_valid[N // 2 :, 12:] = False
  return learner.Batch(
    tokens=rng.integers(0, V, (N, L)).astype(np.int32),
    token_valid=token_valid,
    turn_ids=turn_ids,
    sample_logp=np.zeros((N, L), np.float32),
    rewards=rng.normal(size=N).astype(np.float32),
    group_ids=(np.arange(N) // 4).astype(np.int32),
    row_valid=np.ones(N, bool),
  )


def _table_logprob_fn(params, batch):
  """logp[i, j] = log_softmax(table[j])[tokens[i, j]] (rows share the table by position)."""
  logp = jax.nn.log_softmax(params["table"], axis=-1)
  rows = jnp.broadcast_to(logp, batch.tokens.shape + (V,))
  out = jnp.take_along_axis(rows, batch.tokens[..., None], axis=-1)[..., 0]
  return jnp.where(batch.token_valid, out, 0.0).at[:, 0].set(0.0)


@pytest.mark.parametrize("algorithm", ["seeupo", "grpo", "gspo", "reinforce", "rloo"])
def test_only_generated_positions_move(algorithm):
  batch = _batch()
  learner.validate(batch, T)
  on_policy = algorithm in ("reinforce", "rloo")
  config = learner.LearnerConfig(
    algorithm=algorithm,
    num_turns=T,
    epochs=1 if on_policy else 2,
    minibatches=1 if on_policy else 2,
    kl_coef=0.5,  # large, so a KL term on any non-generated token would show
  )
  table = jnp.asarray(np.random.default_rng(1).normal(size=(L, V)).astype(np.float32))
  optimizer = optax.sgd(0.5)
  step = learner.make_update(_table_logprob_fn, optimizer, config)
  state = learner.init_state({"table": table.copy()}, optimizer, ref_params={"table": table})
  state, metrics = step(state, batch, jax.random.key(0))
  moved = np.any(np.asarray(state.params["table"]) != np.asarray(table), axis=1)  # [L]
  generated = np.any(batch.turn_ids >= 0, axis=0)
  np.testing.assert_array_equal(moved, generated)
  assert float(metrics["optimizer_steps"]) >= 1
