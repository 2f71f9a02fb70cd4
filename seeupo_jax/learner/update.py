"""The learner's update: one jitted call per training iteration.

`make_update(logprob_fn, optimizer, config)` binds everything static and
returns `update(state, batch, key) -> (state, metrics)`. What differs between
algorithms is read from the config's record (`config.spec`, `algorithms.py`).
The update reads like the paper's algorithm box (SeeUPO, `spec.sequential`):

    A   <- GRAE advantages of the trajectories               (_ADVANTAGE_ESTIMATORS)
    M   <- 1 for every trajectory                            (objectives.Correction.start)
    for t in update_order(T):                                 (lax.scan: _update_turn)
      first pass: logp <- log pi at the current params       (_optimise_from_start)
      correct M:  M <- clip(M * clip(s_prev, 1 -+ c), 1 -+ c) (objectives.turn_inputs:
                  s_prev = the previous updated turn's ratio,  Correction.corrected)
                  after / before its update, from logp
      A * M                                                   (objectives.weigh_advantages)
      optimise:   epochs x mini-batches of optax steps on     (_optimise -> _epoch -> _minibatch_step)
        sequence_clip_loss(turn t, A * M, old = logp) + kl_coef * KL(turn t)

With one epoch of one mini-batch the turn's first forward pass is its only
optimizer step's own (`_optimise_from_start`), so SeeUPO costs T optimizer
steps plus the reference pass.

With `config.tis` on, each token's policy loss is weighted by the truncated
importance weight min(pi_old / pi_sampler, C) (`objectives.sampler_weights`):
the baselines take pi_old from their first pass, SeeUPO from one forward pass at
the starting params before the turn loop.

The baselines (grpo, gspo, reinforce, rloo, ppo) run the same `_optimise` once
on all turns. Everything is indexed by trajectory row: M, advantages and
log-probs never move between rows, and a mini-batch is a gather of whole rows.

Each turn computes only what it needs (`config.turn_buckets` = K, `shapes.py`): its passes
run on the rows that have the turn and on the prefix that ends with it, in one of K static
shapes chosen inside the jitted update (`shapes.TurnShape`); the first pass also covers the
pending turn's tokens, from which M is corrected. Rows and positions left out hold no token of
the loss, so the update is the same to float rounding.

A turn that no trajectory has is skipped by `lax.cond`: params and optimizer
state stay bit-identical. A mini-batch without tokens of the turn, or whose
loss or gradient is not finite, takes no optimizer step (the latter is counted
in `skipped_updates`).
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from seeupo_jax import losses
from seeupo_jax.learner import algorithms
from seeupo_jax.learner import batch as batch_lib
from seeupo_jax.learner import dapo
from seeupo_jax.learner import metrics as metrics_lib
from seeupo_jax.learner import objectives
from seeupo_jax.learner import precision
from seeupo_jax.learner import shapes as shape_lib
from seeupo_jax.learner import sharded_jit
from seeupo_jax.learner import state as state_lib
from seeupo_jax.learner.batch import Batch
from seeupo_jax.learner.config import LearnerConfig
from seeupo_jax.learner.optimizer import default_optimizer  # noqa: F401
from seeupo_jax.learner.shapes import LogprobFn, TurnShape, TurnShapes  # noqa: F401
from seeupo_jax.learner.state import TrainState

Array = jax.Array
Params = Any
ValueFn = Callable[[Params, Batch], Array]
"""value_fn(critic_params, batch) -> float32[N, L]: the critic's value of the state before token j."""


class UpdateFns(NamedTuple):
  """What `make_update` binds: the model functions, the optimizers and the config (static)."""

  logprob_fn: LogprobFn
  optimizer: optax.GradientTransformation
  config: LearnerConfig
  value_fn: Optional[ValueFn] = None
  critic_optimizer: Optional[optax.GradientTransformation] = None
  fuse_forward: bool = True


class StepStats(collections.namedtuple("StepStats", metrics_lib.STEP + ("ran", "skipped"))):
  """Per optimizer step statistics, each float32 [...] over (epochs, mini-batches).

  Fields: `metrics.STEP` (that step's values, 0 where the mini-batch had no tokens),
  then `ran` (1 where the step was applied) and `skipped` (1 where it was not because
  the loss or gradient was not finite).
  """

  __slots__ = ()

  @classmethod
  def zeros(cls, shape) -> "StepStats":
    return cls(*[jnp.zeros(shape, jnp.float32) for _ in cls._fields])

  def mean_over_applied(self) -> dict[str, Array]:
    """Each of `metrics.STEP`'s mean over the steps that were applied (0 if none), and the
    `metrics.COUNTS`."""
    weight = self.ran
    count = jnp.maximum(jnp.sum(weight), 1.0)
    out = {name: jnp.sum(getattr(self, name) * weight) / count for name in metrics_lib.STEP}
    out["optimizer_steps"] = jnp.sum(self.ran)
    out["skipped_updates"] = jnp.sum(self.skipped)
    return out


class MicroResult(NamedTuple):
  """One micro-batch's share of a mini-batch step (`_micro_grads`)."""

  grads: Any  # (policy grads, critic grads or None)
  loss: Array  # float32 scalar, weighted by the micro-batch's share
  metrics: dict  # `metrics.LOSS` + "nonfinite_logp", each weighted likewise
  logp: Array  # float32[R, L], the forward pass's log-probs (at the params before the step)
  correction: Array  # float32[R], the M the loss weighed the advantages with


class StepResult(NamedTuple):
  """One mini-batch step (`_minibatch_step`)."""

  state: TrainState
  stats: StepStats  # of this step (scalars)
  logp: Array  # float32[chunks, R, L], the forward passes' log-probs, before the step
  correction: Array  # float32[chunks, R], the M applied
  rows: Array  # int32[chunks, R], the rows of `logp` and `correction`, in their order


class OptimiseResult(NamedTuple):
  """A whole optimisation from a starting state (`_optimise_from_start`)."""

  state: TrainState
  stats: StepStats  # [epochs, minibatches]
  first_logp: Array  # float32[N, L], the log-probs at the starting params (the first pass)
  correction: Array  # float32[N], the M applied to the advantages (ones when not sequential)


# ----------------------------------------------------------------------------------------------
# Forward-only passes, in row chunks of the micro-batch size.


def _micro_rows(config: LearnerConfig, num_rows: int) -> int:
  parts = config.minibatches * config.microbatches
  if num_rows % parts:
    raise ValueError(
      f"the batch has {num_rows} rows, which LearnerConfig.minibatches x .microbatches = "
      f"{config.minibatches} x {config.microbatches} does not divide"
    )
  return num_rows // parts


def _in_row_chunks(fn: Callable[[Batch], Array], batch: Batch, chunk_rows: int) -> Array:
  """fn over the batch in chunks of `chunk_rows` rows ([N, L] out), chunk c = rows c, c + C, ...

  Strided chunks keep every chunk spread over the devices that hold the rows.
  """
  n = batch.num_rows
  if chunk_rows >= n:
    return fn(batch)
  num_chunks = n // chunk_rows
  by_chunk = jax.tree.map(
    lambda x: x.reshape((chunk_rows, num_chunks) + x.shape[1:]).swapaxes(0, 1), batch
  )
  out = jax.lax.map(fn, by_chunk)  # [C, R, L]
  return out.swapaxes(0, 1).reshape((n,) + out.shape[2:])


def _logprobs(
  fns: UpdateFns, params: Params, batch: Batch, shape: Optional[shape_lib.TurnShape] = None
) -> Array:
  """float32[N, L] log-probs at `params`, no gradient; with a `shape`, only its rows and
  prefix are computed (0 elsewhere)."""
  config = fns.config
  chunk = _micro_rows(config, batch.num_rows)
  if shape is None:
    logp = _in_row_chunks(lambda b: fns.logprob_fn(params, b), batch, chunk)
    return jax.lax.stop_gradient(logp.astype(jnp.float32))
  n, length = batch.tokens.shape
  by_chunk = jnp.arange(n, dtype=jnp.int32).reshape(chunk, n // chunk).T  # strided, as above
  rows, active = shape_lib.compact_rows(by_chunk, shape.rows, shape_lib.row_parts(config, chunk))

  def forward(xs):
    chunk_rows, run = xs
    sub = batch_lib.take_rows(batch, chunk_rows)

    def at(prefix):
      return shape_lib.prefix_logprobs(fns.logprob_fn, params, sub, prefix).astype(jnp.float32)

    return jax.lax.cond(
      run,
      lambda: shape_lib.at_length(shape, length, at),
      lambda: jnp.zeros((chunk_rows.shape[0], length), jnp.float32),
    )

  logp = shape_lib.scatter_rows(rows, jax.lax.map(forward, (rows, active)), n)
  return jax.lax.stop_gradient(logp)


def _values(fns: UpdateFns, critic_params: Params, batch: Batch) -> Array:
  """float32[N, L] critic values at `critic_params`, no gradient."""
  chunk = _micro_rows(fns.config, batch.num_rows)
  values = _in_row_chunks(lambda b: fns.value_fn(critic_params, b), batch, chunk)
  return jax.lax.stop_gradient(values.astype(jnp.float32))


_MICRO_METRICS = ("nonfinite_logp",) + metrics_lib.LOSS

# ----------------------------------------------------------------------------------------------
# The optimisation ladder: _optimise -> _epoch -> _minibatch_step -> _micro_grads.


def _take(inputs: objectives.LossInputs, rows: Array) -> objectives.LossInputs:
  return jax.tree.map(lambda x: x[rows], inputs)


def _micro_grads(
  fns: UpdateFns,
  state: TrainState,
  batch: Batch,
  inputs,
  correction,
  denominators,
  rows,
  shape: Optional[shape_lib.TurnShape] = None,
) -> MicroResult:
  """Gradient of one micro-batch's share of the mini-batch loss.

  Each micro-batch's loss is weighted by its share of the mini-batch's
  aggregation denominator, so the micro-batch gradients add up to the
  mini-batch gradient exactly (seq-mean-token-sum-norm's constant, `norm_length` or
  the full width L, is the same in every micro-batch: `objectives.aggregation_denominator`).
  With a `correction` (SeeUPO, fused: this forward pass is the turn's first) M is corrected
  from this pass's log-probs and the advantages weighed by it before the loss is formed
  (`objectives.turn_inputs`). With a `shape` the model runs on its prefix only (`shape_lib.at_length`:
  one forward and backward program per length bucket, the loss on the log-probs padded back
  to L).
  """
  config = fns.config
  sub_batch = batch_lib.take_rows(batch, rows)
  sub = _take(inputs, rows)
  sub_correction = None if correction is None else correction.take(rows)
  policy_denominator, token_denominator = denominators
  weight = objectives.aggregation_denominator(sub.mask, config.agg) / jnp.maximum(
    policy_denominator, 1.0
  )
  token_weight = jnp.sum(sub.mask) / jnp.maximum(token_denominator, 1.0)

  def loss_fn(params, critic_params, prefix):
    policy = state_lib.policy_params(state.replace(params=params))  # with a frozen base (LoRA)
    logp = shape_lib.prefix_logprobs(fns.logprob_fn, policy, sub_batch, prefix)
    seen = jax.lax.stop_gradient(logp)
    loss_inputs, applied = objectives.turn_inputs(seen, sub, sub_correction, config)
    loss, metrics = objectives.policy_loss(logp, loss_inputs, config)
    metrics = {name: weight * value for name, value in metrics.items()}
    total = weight * loss
    if critic_params is not None:
      values = fns.value_fn(critic_params, sub_batch)
      value_loss, value_metrics = objectives.critic_loss(values, sub, config)
      total = total + token_weight * value_loss
      metrics["value_loss"] = token_weight * value_loss
      metrics["value_error"] = token_weight * value_metrics["value_error"]
    else:
      metrics["value_loss"] = metrics["value_error"] = jnp.zeros((), jnp.float32)
    metrics["loss"] = weight * loss
    # Counted here, not inferred from the loss: XLA may fold logp - stop_gradient(logp) to 0
    # even where logp is NaN, so a non-finite log-prob need not make the loss non-finite.
    metrics["nonfinite_logp"] = jnp.sum(~jnp.isfinite(jnp.where(sub.mask > 0, logp, 0.0)))
    return total, (metrics, seen.astype(jnp.float32), applied)

  def grads_at(prefix):
    return jax.value_and_grad(
      functools.partial(loss_fn, prefix=prefix), argnums=(0, 1), has_aux=True
    )(state.params, state.critic_params)

  (total, (metrics, logp, applied)), grads = shape_lib.at_length(
    shape, sub_batch.tokens.shape[1], grads_at
  )
  return MicroResult(grads, total, metrics, logp, applied)


def _apply_gradients(fns: UpdateFns, state: TrainState, grads) -> TrainState:
  """One optimizer step of the policy (and of the critic, for PPO).

  The optimizer follows the state: with float32 master weights in it (`init_state` with bf16
  params) the step runs on the masters and the params become the masters rounded.
  """
  policy_grads, critic_grads = grads
  optimizer = precision.for_state(fns.optimizer, state.opt_state)
  updates, opt_state = optimizer.update(policy_grads, state.opt_state, state.params)
  state = state.replace(
    params=optax.apply_updates(state.params, updates),
    opt_state=opt_state,
    optimizer_steps=state.optimizer_steps + 1,
  )
  if state.critic_params is not None:
    critic_optimizer = precision.for_state(fns.critic_optimizer, state.critic_opt_state)
    updates, critic_opt_state = critic_optimizer.update(
      critic_grads, state.critic_opt_state, state.critic_params
    )
    state = state.replace(
      critic_params=optax.apply_updates(state.critic_params, updates),
      critic_opt_state=critic_opt_state,
    )
  return state


def _minibatch_step(
  fns: UpdateFns,
  batch: Batch,
  inputs,
  state: TrainState,
  rows: Array,
  correction=None,
  shape: Optional[shape_lib.TurnShape] = None,
) -> StepResult:
  """One optimizer step on the rows `rows` (int32[microbatches, R]).

  The step is taken only if the mini-batch has tokens to train on and its loss
  and gradient are finite; otherwise the state is returned unchanged (a
  non-finite step is counted in `skipped_updates`). `correction`: see `_micro_grads`.
  With a `shape` the rows it needs go first, in chunks of R / parts rows
  (`shape_lib.compact_rows`); a chunk without them is skipped (zero gradient, its log-probs 0,
  its M unchanged), and each chunk runs on the shape's prefix.
  """
  config = fns.config
  if shape is None:
    active = jnp.ones(rows.shape[:1], bool)
  else:
    rows, active = shape_lib.compact_rows(
      rows, shape.rows, shape_lib.row_parts(config, rows.shape[1])
    )
  masks = inputs.mask[rows]  # [chunks, R, L]
  denominators = (
    jnp.sum(jax.vmap(lambda m: objectives.aggregation_denominator(m, config.agg))(masks)),
    jnp.sum(masks),
  )

  def accumulate(carry, xs):
    grads_sum, loss_sum, metrics_sum = carry
    micro_rows, run = xs
    micro_fn = functools.partial(
      _micro_grads, fns, state, batch, inputs, correction, denominators, micro_rows
    )
    if shape is None:
      micro = micro_fn()
    else:

      def skip():
        empty = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(micro_fn))
        # No token of the turn or the pending turn in these rows: their M stays as it is.
        kept = jnp.ones_like(empty.correction) if correction is None else correction.factor
        return empty._replace(correction=kept if correction is None else kept[micro_rows])

      micro = jax.lax.cond(run, functools.partial(micro_fn, shape=shape), skip)
    grads_sum = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads_sum, micro.grads)
    metrics_sum = {name: metrics_sum[name] + micro.metrics[name] for name in _MICRO_METRICS}
    return (grads_sum, loss_sum + micro.loss, metrics_sum), (micro.logp, micro.correction)

  grads_zero = jax.tree.map(
    lambda p: jnp.zeros(p.shape, jnp.float32), (state.params, state.critic_params)
  )
  metrics_zero = {name: jnp.zeros((), jnp.float32) for name in _MICRO_METRICS}
  (grads, total, metrics), (logp, applied) = jax.lax.scan(
    accumulate, (grads_zero, jnp.zeros((), jnp.float32), metrics_zero), (rows, active)
  )
  grad_norm = optax.global_norm(grads)  # float32, from the float32 sums
  # To the dtype of what the optimizer steps: the float32 masters where kept, else the params.
  stepped = (
    precision.stepped_params(state.params, state.opt_state),
    precision.stepped_params(state.critic_params, state.critic_opt_state),
  )
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, stepped)
  has_tokens = denominators[0] > 0
  finite = jnp.isfinite(total) & jnp.isfinite(grad_norm) & (metrics["nonfinite_logp"] == 0)
  apply = has_tokens & finite
  state = jax.lax.cond(
    apply, functools.partial(_apply_gradients, fns), lambda s, g: s, state, grads
  )
  skipped = has_tokens & ~finite
  state = state.replace(skipped_updates=state.skipped_updates + skipped.astype(jnp.int32))
  stats = StepStats(
    grad_norm=grad_norm,
    ran=apply,
    skipped=skipped,
    **{name: metrics[name] for name in StepStats._fields if name in metrics},
  )
  stats = StepStats(*[jnp.asarray(x, jnp.float32) for x in stats])
  return StepResult(state, stats, logp, applied, rows)


def _epoch(fns: UpdateFns, batch: Batch, inputs, shape, state: TrainState, epoch_key: Array):
  """One pass over the rows in a fresh random order, one optimizer step per mini-batch
  (with a `shape_lib.TurnShape`, on its rows and prefix: `_minibatch_step`)."""
  config = fns.config
  n = batch.num_rows
  micro = _micro_rows(config, n)
  permutation = jax.random.permutation(epoch_key, n).astype(jnp.int32)
  rows = permutation.reshape(config.minibatches, config.microbatches, micro)

  def minibatch_update(state, minibatch_rows):
    step = _minibatch_step(fns, batch, inputs, state, minibatch_rows, shape=shape)
    return step.state, step.stats

  return jax.lax.scan(minibatch_update, state, rows)


def _optimise(fns: UpdateFns, state: TrainState, batch: Batch, inputs, key: Array, shape=None):
  """`epochs` x `minibatches` optimizer steps on `inputs` (a `LossInputs` over all N rows;
  with a `shape_lib.TurnShape`, each step runs on its rows and prefix).

  Returns:
    (state, StepStats of shape [epochs, minibatches]).
  """
  epoch_keys = jax.random.split(key, fns.config.epochs)
  return jax.lax.scan(functools.partial(_epoch, fns, batch, inputs, shape), state, epoch_keys)


def _fused(fns: UpdateFns) -> bool:
  """One epoch of one mini-batch: the step's own forward pass gives the old log-probs."""
  config = fns.config
  return fns.fuse_forward and config.epochs == 1 and config.minibatches == 1


def _optimise_from_start(
  fns: UpdateFns,
  state: TrainState,
  batch: Batch,
  inputs,
  key: Array,
  correction: Optional[objectives.Correction] = None,
  shapes: Optional[shape_lib.TurnShapes] = None,
) -> OptimiseResult:
  """First pass -> (SeeUPO: correct M -> A * M) -> `_optimise`.

  The first pass gives the log-probs at the starting params: the old log-probs,
  and, with a `correction`, the pending turn's "after" log-probs from which M is
  corrected and the advantages weighed (`objectives.turn_inputs`). With one epoch
  of one mini-batch (the authors' setting) nothing has moved the params before
  the only step, so its own forward pass IS the first pass: `inputs.old_logp` is
  None, the loss takes stop_gradient of its own log-probs, and M is corrected
  from the same pass. Otherwise a separate forward pass runs first.

  With `shapes` (SeeUPO) the first pass runs on `shapes.first` and the optimizer steps
  on `shapes.steps`; `first_logp` is 0 outside the first pass's rows and prefix.
  """
  n = batch.num_rows
  first_shape, steps_shape = shapes if shapes is not None else (None, None)
  if _fused(fns):
    micro = _micro_rows(fns.config, n)
    rows = jnp.arange(n, dtype=jnp.int32).reshape(micro, fns.config.microbatches).T
    step = _minibatch_step(fns, batch, inputs, state, rows, correction, first_shape)
    first_logp = shape_lib.scatter_rows(step.rows, step.logp, n)  # back to row order
    applied = shape_lib.scatter_rows(step.rows, step.correction, n)
    stats = jax.tree.map(lambda x: x[None, None], step.stats)
    return OptimiseResult(step.state, stats, first_logp, applied)
  first_logp = _logprobs(fns, state_lib.policy_params(state), batch, first_shape)
  loss_inputs, applied = objectives.turn_inputs(first_logp, inputs, correction, fns.config)
  loss_inputs = loss_inputs._replace(old_logp=first_logp)
  state, stats = _optimise(fns, state, batch, loss_inputs, key, steps_shape)
  return OptimiseResult(state, stats, first_logp, applied)


# ----------------------------------------------------------------------------------------------
# SeeUPO's turn loop.


class TurnCarry(NamedTuple):
  """Carry of the turn scan: the `TrainState` and the `objectives.Correction` (M, with the
  last updated turn's factor pending until the next turn's first pass)."""

  state: TrainState
  correction: objectives.Correction


class SequentialResult(NamedTuple):
  """SeeUPO's turn scan (`_sequential_update`)."""

  state: TrainState
  per_turn: dict  # {name: float32[T]} indexed by turn id (`metrics.TURN`)
  has_turn: Array  # bool[T], turns some row has
  gap: dict  # `metrics.GAP` at the starting params


def _correction_stats(correction: Array, rows: Array, config: LearnerConfig) -> dict[str, Array]:
  """M statistics over the rows that have the turn (rows: bool[N])."""
  weight = rows.astype(jnp.float32)
  count = jnp.maximum(jnp.sum(weight), 1.0)
  low, high = 1.0 - config.correction_clip_low, 1.0 + config.correction_clip_high
  at_bound = (jnp.abs(correction - low) < 1e-6) | (jnp.abs(correction - high) < 1e-6)
  return {
    "M_mean": jnp.sum(correction * weight) / count,
    "M_min": jnp.min(jnp.where(rows, correction, jnp.inf)),
    "M_max": jnp.max(jnp.where(rows, correction, -jnp.inf)),
    "M_clipped": jnp.sum(at_bound * weight) / count,
  }


def _update_turn(
  fns, batch, generated, advantages, ref_logp, sizes, turn_key, carry: TurnCarry, xs
):
  """Updates one turn (virtual agent) if any trajectory has it: the paper's box.

    first pass   logp <- log pi at the current params (after the previous updated turn's update)
    correct M    M <- clip(M * clip(s_prev, 1 -+ c), 1 -+ c), s_prev from logp (that turn's
                 after / before)
    A * M        the turn's advantages
    optimise     epochs x mini-batches of steps on the turn's tokens, old log-probs = logp
  (`_optimise_from_start`; fused, the first pass is the only step's own forward pass). No
  pass runs after the last turn: its factor would weigh no later turn. Every pass runs on
  the rows and the prefix its tokens need (`shape_lib.TurnShapes`; module doc).
  """
  config = fns.config
  turn = xs
  mask = batch_lib.turn_mask(batch, turn)
  rows = jnp.any(mask > 0, axis=1)
  has_turn = jnp.any(rows)
  first_shape = shape_lib.turn_shape(config, sizes, mask + carry.correction.pending_mask)
  shapes = (
    None
    if first_shape is None
    else shape_lib.TurnShapes(first_shape, shape_lib.turn_shape(config, sizes, mask))
  )

  def run(carry: TurnCarry):
    inputs = objectives.LossInputs(
      old_logp=None, ref_logp=ref_logp, advantages=advantages, mask=mask
    )
    key = jax.random.fold_in(turn_key, turn)
    result = _optimise_from_start(fns, carry.state, batch, inputs, key, carry.correction, shapes)
    # This turn's factor is pending: its "after" log-probs come with the next turn's first pass.
    correction = objectives.Correction(result.correction, result.first_logp, mask)
    return TurnCarry(result.state, correction), (result.stats, result.correction, result.first_logp)

  def skip(carry: TurnCarry):
    stats = StepStats.zeros((config.epochs, config.minibatches))
    pending = carry.correction
    return carry, (stats, pending.factor, pending.pending_old_logp)

  new_carry, (stats, applied_correction, logp) = jax.lax.cond(has_turn, run, skip, carry)
  metrics = stats.mean_over_applied()
  metrics.update(_correction_stats(applied_correction, rows, config))
  metrics["trajectories"] = jnp.sum(rows.astype(jnp.float32))
  # Over the generated tokens the first pass computed (at the first turn updated: the rows
  # with that turn, up to its end).
  covered = shape_lib.covered(first_shape, batch.tokens.shape[1])
  metrics.update(_sample_gap(batch, logp, generated * covered))
  return new_carry, metrics


def _sequential_update(fns, state, batch, generated, advantages, ref_logp, key) -> SequentialResult:
  """SeeUPO: M <- 1, then `_update_turn` for each turn in the update order (a `lax.scan`)."""
  config = fns.config
  order_key, turn_key = jax.random.split(key)
  order = losses.update_order(
    config.num_turns,
    config.order,
    key=order_key if config.order == "random" else None,
    custom=config.custom_order or None,
  )
  has_turn = batch_lib.turns_present(batch, config.num_turns)  # bool[T] by turn id
  sizes = shape_lib.prefix_lengths(config, fns.logprob_fn, state_lib.policy_params(state), batch)
  body = functools.partial(
    _update_turn, fns, batch, generated, advantages, ref_logp, sizes, turn_key
  )
  carry = TurnCarry(state, objectives.Correction.start(batch.tokens.shape))
  carry, per_position = jax.lax.scan(body, carry, order)
  # The gap at the start of the update: that of the first turn updated.
  positions = jnp.arange(config.num_turns)
  first = jnp.min(jnp.where(has_turn[order], positions, config.num_turns - 1))
  gap = {name: per_position.pop(name)[first] for name in metrics_lib.GAP}
  # Scan outputs are in update order; index them by turn id.
  per_turn = jax.tree.map(lambda v: jnp.zeros_like(v).at[order].set(v), per_position)
  return SequentialResult(carry.state, per_turn, has_turn, gap)


# ----------------------------------------------------------------------------------------------
# The update.


def _sample_gap(batch: Batch, logp: Array, mask: Array) -> dict[str, Array]:
  """|sampler log-prob - learner log-prob| over generated tokens (0 in f32; bf16/sharding drift)."""
  gap = jnp.abs(batch.sample_logp.astype(jnp.float32) - logp) * mask
  return {
    "sample_logp_gap_mean": jnp.sum(gap) / jnp.maximum(jnp.sum(mask), 1.0),
    "sample_logp_gap_max": jnp.max(gap),
  }


class Advantages(NamedTuple):
  """What an advantage estimator gives the losses (`_ADVANTAGE_ESTIMATORS`)."""

  advantages: Array  # float32[N] (one per trajectory) or [N, L] (per token)
  old_values: Optional[Array] = None  # float32[N, L], the critic's values (GAE only)
  returns: Optional[Array] = None  # float32[N, L], the critic's targets (GAE only)


def _gae_advantages(fns: UpdateFns, state: TrainState, batch: Batch, mask: Array) -> Advantages:
  """GAE from the critic's values at the starting critic params (`objectives.ppo_advantages`)."""
  old_values = _values(fns, state.critic_params, batch)
  advantages, returns = objectives.ppo_advantages(batch.rewards, old_values, mask, fns.config)
  return Advantages(advantages, old_values, returns)


def _trajectory_advantages(
  fns: UpdateFns, state: TrainState, batch: Batch, mask: Array
) -> Advantages:
  """One advantage per trajectory (`objectives.trajectory_advantages`), discounted per turn
  ([N, L]) when gamma < 1."""
  del state
  config = fns.config
  advantages = objectives.trajectory_advantages(
    batch.rewards, batch.group_ids, batch.row_valid, config
  )
  if config.gamma != 1.0:
    # [N, L]: turn t of a row with T_i turns gets A * gamma^(T_i - 1 - t).
    turn_discounts = objectives.turn_discounts(batch.turn_ids, mask, config.gamma)
    advantages = advantages[:, None] * turn_discounts
  return Advantages(advantages)


def _turn_advantages(fns: UpdateFns, state: TrainState, batch: Batch, mask: Array) -> Advantages:
  """Per-turn advantages [N, T] (`objectives.turn_advantages`: GiGPO's or MT-GRPO's), each
  turn's on its tokens ([N, L])."""
  del state
  per_turn = objectives.turn_advantages(batch, fns.config)
  return Advantages(objectives.on_turn_tokens(per_turn, batch.turn_ids, mask))


_ADVANTAGE_ESTIMATORS = {
  "grae": _trajectory_advantages,
  "rloo": _trajectory_advantages,
  "gae": _gae_advantages,
  "gigpo": _turn_advantages,
  "mt_grpo": _turn_advantages,
}
"""`Algorithm.advantage` -> its estimator (fns, state, batch, mask) -> `Advantages`."""
assert set(_ADVANTAGE_ESTIMATORS) == set(algorithms.ADVANTAGES), algorithms.ADVANTAGES


def _sequential_metrics(result: SequentialResult) -> dict[str, Array]:
  """SeeUPO's metrics: per turn under "turn/<name>", and over the turns some row has."""
  per_turn, has_turn = result.per_turn, result.has_turn
  metrics = dict(result.gap)
  metrics.update({f"turn/{name}": value for name, value in per_turn.items()})
  turns = jnp.maximum(jnp.sum(has_turn), 1)
  for name, value in per_turn.items():
    if name in metrics_lib.COUNTS + ("trajectories",):
      metrics[name] = jnp.sum(value)
    elif name not in ("M_min", "M_max"):
      metrics[name] = jnp.sum(jnp.where(has_turn, value, 0.0)) / turns
  metrics["M_min"] = jnp.min(jnp.where(has_turn, per_turn["M_min"], jnp.inf))
  metrics["M_max"] = jnp.max(jnp.where(has_turn, per_turn["M_max"], -jnp.inf))
  metrics["turns_updated"] = jnp.sum(has_turn)
  return metrics


def _check_state(fns: UpdateFns, state: TrainState) -> None:
  config = fns.config
  if config.kl_coef > 0 and state_lib.reference_params(state) is None:
    raise ValueError(
      "LearnerConfig.kl_coef > 0 needs reference params: init_state(params, optimizer, "
      "ref_params=params) (or a frozen base: init_state(adapters, optimizer, base=base)), or "
      "set kl_coef=0"
    )
  if config.spec.critic != (state.critic_params is not None):
    raise ValueError(
      "algorithm='ppo' needs a critic (init_state(..., critic_params=..., critic_optimizer=...) "
      "and make_update(..., value_fn=..., critic_optimizer=...)); other algorithms take none"
    )


def update(fns: UpdateFns, state: TrainState, batch: Batch, key: Array):
  """One training iteration; see the module doc and `make_update`."""
  config = fns.config
  batch_lib.check_shapes(batch)
  _check_state(fns, state)
  batch, shaping_metrics = dapo.shape_rewards(config, batch)
  mask = batch_lib.generated_mask(batch, config.num_turns)
  ref_logp = None
  if config.kl_coef > 0:
    ref_logp = _logprobs(fns, state_lib.reference_params(state), batch)
  advantages, old_values, returns = _ADVANTAGE_ESTIMATORS[config.spec.advantage](
    fns, state, batch, mask
  )
  tis = config.tis != "off"

  if config.spec.sequential:
    policy_advantages, tis_metrics = advantages, {}
    if tis:
      # The turns start from params that move; TIS weighs the sampler against the params the
      # rollout was drawn with, once for all turns (one forward pass; M handles the rest).
      start_logp = _logprobs(fns, state_lib.policy_params(state), batch)
      weights = objectives.sampler_weights(
        start_logp, batch.sample_logp, mask, config, segments=batch.turn_ids
      )
      policy_advantages = objectives.sampler_weighted(advantages, weights.weight)
      tis_metrics = objectives.sampler_weight_stats(weights)
    result = _sequential_update(fns, state, batch, mask, policy_advantages, ref_logp, key)
    state, metrics = result.state, _sequential_metrics(result)
    metrics.update(tis_metrics)
  else:
    # With TIS the first pass (the old log-probs) weighs the advantages (objectives.turn_inputs).
    sample_logp = batch.sample_logp.astype(jnp.float32) if tis else None
    inputs = objectives.LossInputs(
      None, ref_logp, advantages, mask, old_values, returns, sample_logp
    )
    result = _optimise_from_start(fns, state, batch, inputs, key)
    state, metrics = result.state, result.stats.mean_over_applied()
    metrics.update(_sample_gap(batch, result.first_logp, mask))
    if tis:
      weights = objectives.sampler_weights(result.first_logp, batch.sample_logp, mask, config)
      metrics.update(objectives.sampler_weight_stats(weights))

  metrics.update(shaping_metrics)
  advantage_rows = (advantages[:, None] if advantages.ndim == 1 else advantages) * mask
  tokens = jnp.maximum(jnp.sum(mask), 1.0)
  metrics["advantage_abs_mean"] = jnp.sum(jnp.abs(advantage_rows) * mask) / tokens
  metrics["generated_tokens"] = jnp.sum(mask)
  return state.replace(step=state.step + 1), metrics


def make_update(
  logprob_fn: LogprobFn,
  optimizer: optax.GradientTransformation,
  config: LearnerConfig,
  *,
  value_fn: Optional[ValueFn] = None,
  critic_optimizer: Optional[optax.GradientTransformation] = None,
  jit: bool = True,
  donate: bool = True,
  fuse_forward: bool = True,
):
  """Builds the learner's update for one model, one optimizer and one config.

  Args:
    logprob_fn: (params, Batch) -> float32[N, L], entry [i, j] = log pi(tokens[i, j] |
      tokens[i, :j]) (0 where j predicts nothing), differentiable in params. For Qwen
      models use `qwen_logprob_fn(model_config, temperature=...)`.
    optimizer: any optax transformation (e.g. `default_optimizer()`: AdamW lr 1e-6,
      weight decay 0.01, grad-norm clip 1.0), the one given to `init_state`. Where the state
      holds float32 master weights (`init_state` with bf16 params) it steps those.
    config: the `LearnerConfig`.
    value_fn: PPO only: (critic_params, Batch) -> float32[N, L] values.
    critic_optimizer: PPO only: the critic's optax transformation.
    jit: return the update under `jax.jit` (False: the raw function, e.g. to vmap it).
    donate: donate the state's buffers to the jitted call (the input state is
      invalid afterwards).
    fuse_forward: with one epoch of one mini-batch, take the old log-probs from the
      optimizer step's own forward pass instead of a separate one (same update to
      float rounding, one forward pass fewer per turn). False exists to measure
      and test that; it changes nothing with more epochs or mini-batches.

  Returns:
    update(state: TrainState, batch: Batch, key: PRNGKey) -> (TrainState, metrics), where
    metrics is a dict of float32 arrays: scalars for every algorithm ("loss", "pg_loss",
    "kl", "clip_fraction", "ratio_mean", "approx_kl", "grad_norm", "optimizer_steps",
    "skipped_updates", "sample_logp_gap_mean"/"_max", ...) and, for SeeUPO, per-turn
    float32[T] arrays under "turn/<name>" (indexed by turn id) including the M
    statistics "turn/M_mean", "turn/M_min", "turn/M_max", "turn/M_clipped" of the M
    each turn was weighted with. The jitted update also has `update.lower(state, batch, key)`:
    the same program lowered ahead of time, on arrays or on `jax.ShapeDtypeStruct`s with
    shardings, for any backend's devices (`benchmarks/aot_compile.py` compiles it for TPU slices).

  Sharding: place params/optimizer state on their shardings (`init_state` keeps
  those of the params it gets) and the batch with `shard_batch(batch, mesh)`; call
  the update under `jax.set_mesh(mesh)` so the model's activation constraints apply.
  """
  if not isinstance(config, LearnerConfig):
    raise TypeError(f"config must be a LearnerConfig, got {type(config).__name__}")
  if config.spec.critic != (value_fn is not None and critic_optimizer is not None):
    raise ValueError(
      "make_update: algorithm='ppo' needs value_fn and critic_optimizer (e.g. "
      "learner.qwen_value_fn(model_config) and an optax optimizer); other algorithms take neither"
    )
  fns = UpdateFns(logprob_fn, optimizer, config, value_fn, critic_optimizer, fuse_forward)
  step = functools.partial(update, fns)
  if not jit:
    return step
  return sharded_jit.jit_keeping_state_shardings(step, donate_argnums=(0,) if donate else ())
