"""The training loop: rollouts -> (dynamic sampling) -> collate -> update, each iteration's
metrics handed to a `progress_fn(iteration, metrics)`, checkpoints saved as it goes.

One iteration:

    tasks  = the next B training tasks (TaskStream, resumable)
    result = roller.run(params, tasks, n, key_rollout)      # N = B x n trajectories
    (dynamic sampling: refill_informative_groups, more tasks for groups without signal)
    batch  = collate(result.trajectories)                   # tokens exactly as sampled
    state  = update(state, batch, key_update)               # SeeUPO or a baseline
    progress_fn(iteration, metrics)                          # the writers (`writers.py`)
    save when due (every `checkpoint.every` iterations or `checkpoint.every_minutes`,
      `save_timer.py`); on SIGTERM/SIGINT: save now and raise Preempted (`preemption.py`)

With `pipeline.lag` k > 0 the batch trained at iteration i was sampled k iterations earlier:
B_{i+k} is sampled with the params the update of B_i starts from. With the sampler on devices of
its own (`pipeline.rollout_devices`) the update is dispatched first and both run at once; on the
learner's devices it is dispatched at the rollout's first wait for the environments
(`Roller.run(on_env_wait=)`: after a decode round, every live episode waiting on a tool call), so
its device time runs in the environments' time, and after the rollout if that never waits; with
many processes, first (the schedule, the prologue and what a checkpoint holds: `pipeline.py`).
With `pipeline.partial_rollouts` the decode copy of the update's params is begun beside the
update (`DecodeLayout.stage`; with many processes their collective, at the same point on each)
and the sampler of B_{i+k} swaps to it once it is ready (`newer_params`, `Roller.run(refresh=)`,
`DecodeLayout.install`: this process's part alone).

The loop writes no file itself: the writers are the caller's (`trainer.train`).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from seeupo_jax import learner
from seeupo_jax import rollout
from seeupo_jax.training import checkpoints
from seeupo_jax.training import config as config_lib
from seeupo_jax.training import evaluation
from seeupo_jax.training import metrics_log
from seeupo_jax.training import pipeline
from seeupo_jax.training import preemption as preemption_lib
from seeupo_jax.training import save_timer
from seeupo_jax.training.dynamic_sampling import refill_informative_groups
from seeupo_jax.training.program import Program
from seeupo_jax.training.tasks import TaskStream
from seeupo_jax.training.writers import ProgressFn, say


def run(
  config: config_lib.TrainConfig,
  program: Program,
  state,
  rng: jax.Array,
  stream: TaskStream,
  iteration: int,
  *,
  checkpointer: checkpoints.Checkpointer,
  progress_fn: ProgressFn,
  trajectories_fn: Callable[[int, Any], None],
  watch: preemption_lib.Watch | None = None,
  pending: list[pipeline.Sampled] | None = None,
  overlap: bool = True,
) -> tuple[Any, dict[str, float]]:
  """Trains from `iteration` to `config.num_iterations`; returns (state, the last metrics).

  Args:
    config: the typed training config.
    program: the built program (`program.build`).
    state: the learner's `TrainState` at `iteration`.
    rng: the training key at `iteration` (checkpointed with the state).
    stream: the training tasks, at the position of `iteration`.
    iteration: the iterations done so far.
    checkpointer: saves the state, the key and the stream's position (`should_save`, when
      `config.checkpoint.every_minutes` have passed since the last save, and always after the
      last iteration).
    progress_fn: called with (iteration, metrics) after each iteration's update and evaluation.
    trajectories_fn: called with (iteration, this process's trajectories), on every process.
    watch: the signal watch (`preemption.Watch`); after every iteration the processes agree
      whether any got a signal, and if one did, that iteration is saved and `Preempted` raised.
    pending: with `pipeline.lag` k > 0, the k batches sampled and not yet trained at
      `iteration` (a checkpoint's, `pipeline.from_progress`); None: a fresh run samples them.
    overlap: False waits for each update before sampling the next batch: the same schedule,
      one step after the other (the reference the overlapped run equals; with partial
      rollouts every batch after the prologue is then sampled with the update's params).

  Raises:
    preemption.Preempted: after saving the iteration a signal stopped the run at.
  """
  k = config.eval.k
  lag = config.pipeline.lag
  eval_ids = list(program.spec.task_ids("eval"))[: config.eval.num_tasks]
  last: dict[str, float] = {}
  dynamic_sampling = program.learner_config.dynamic_sampling
  # With dynamic sampling the batch keeps B x n rows, padded where informative groups ran short
  # (each process its block of them).
  num_rows = config.rollout.tasks_per_iteration * config.rollout.samples_per_task
  global_rows = num_rows
  num_rows = num_rows // program.processes.count if dynamic_sampling else None
  timer = save_timer.SaveTimer(config.checkpoint.every_minutes)

  def sample(params, key, version, on_env_wait=None, refresh=None) -> rollout.RolloutResult:
    """The next B tasks of the stream, n samples each, with `params` (the learner's) of
    `version`; `on_env_wait`, `refresh`: see `Roller.run`."""
    tasks = stream.take(config.rollout.tasks_per_iteration)
    with jax.set_mesh(program.decode.mesh):  # the sampler on the decode layout
      # The key comes from the learner's (checkpointed, on the learner's mesh): replicated
      # on the decode mesh like every other input of the sampler.
      key = _key_on(key, program.decode.mesh)
      result = program.roller.run(
        params,
        tasks,
        config.rollout.samples_per_task,
        key,
        on_env_wait=on_env_wait,
        version=version,
        refresh=refresh,
      )
      if dynamic_sampling:  # DAPO: more tasks until the batch holds B informative groups
        result = refill_informative_groups(
          program.roller,
          stream,
          params,
          key,
          result,
          tasks_per_iteration=config.rollout.tasks_per_iteration,
          samples_per_task=config.rollout.samples_per_task,
          max_refills=program.learner_config.dapo_max_refills,
        )
    return result

  def decode_params(params):
    with jax.set_mesh(program.decode.mesh):
      return program.decode(params)

  partial = config.pipeline.partial_rollouts

  def newer_params(staged: list, version: int):
    """Partial rollouts: `Roller.run`'s refresh. Once the decode copy in `staged`, begun beside
    the update, is ready (the update has finished: no wait), that copy, of `version`; before
    that and after the one swap, None."""
    swapped = []

    def refresh():
      if swapped or not staged or not staged[0].ready():
        return None
      swapped.append(version)
      with jax.set_mesh(program.decode.mesh):
        return program.decode.install(staged[0]), version

    return refresh

  if lag and pending is None:  # a fresh run: B_1 .. B_k from theta_0 (`pipeline` docstring)
    first = decode_params(learner.policy_params(state))
    pending = [
      pipeline.Sampled(sample(first, pipeline.prologue_key(config.seed, j), 0), 0)
      for j in range(1, lag + 1)
    ]
  pending = list(pending or [])
  with jax.set_mesh(program.mesh):
    while iteration < config.num_iterations:
      t0 = time.perf_counter()
      rng, k_rollout, k_update = jax.random.split(rng, 3)
      rollout_time = 0.0
      params = decode_params(
        learner.policy_params(state)
      )  # theta_{i-1}: before the update donates it
      if not lag:
        this = pipeline.Sampled(sample(params, k_rollout, iteration), iteration)
        rollout_time = time.perf_counter() - t0
      else:
        this = pending.pop(0)
      t1 = time.perf_counter()
      result = this.result
      # This process's rows of the batch; their length is the whole batch's.
      longest = max((len(t.tokens) for t in result.trajectories), default=1)
      batch = rollout.collate(
        result.trajectories,
        num_turns=program.learner_config.num_turns,
        max_len=config.rollout.max_context_tokens,
        num_rows=num_rows,
        longest=max(program.processes.allgather(longest)),
      )
      learner.validate(batch, program.learner_config.num_turns, num_rows=global_rows)
      sharded = learner.shard_batch(batch, program.mesh)
      updated, staged = [], []
      # Partial rollouts: the sampling of B_{i+k} swaps to theta_i once the update is done.
      refresh = newer_params(staged, iteration + 1) if partial else None

      def dispatch_update(state=state, sharded=sharded, k_update=k_update):
        # Returns at once (JAX's asynchronous dispatch); the first call only.
        if not updated:
          with jax.set_mesh(program.mesh):  # called inside the sampler's (decode) mesh
            updated.append(program.update(state, sharded, k_update))
          if partial:  # theta_i's decode copy begun: with many processes, here on each
            staged.append(program.decode.stage(learner.policy_params(updated[0][0])))

      if not lag:
        dispatch_update()
      elif not overlap:  # the reference: the update, then B_{i+k}, one after the other
        dispatch_update()
        jax.block_until_ready(updated[0])
        t_sample = time.perf_counter()
        pending.append(
          pipeline.Sampled(sample(params, k_rollout, iteration, None, refresh), iteration)
        )
        rollout_time = time.perf_counter() - t_sample
      else:  # B_{i+k} with theta_{i-1}, while the update runs
        if program.decode.separate or program.processes.count > 1:
          # The update at once: beside a sampler on devices of its own; with many processes at
          # the same point on each (it is a collective of theirs, and a rollout that never waits
          # for its environments would dispatch it after the processes' next exchange of
          # groups or metrics, which waits for the devices the update holds).
          dispatch_update()
        # Else the update is dispatched at the rollout's first wait for the environments.
        t_sample = time.perf_counter()
        pending.append(
          pipeline.Sampled(
            sample(params, k_rollout, iteration, dispatch_update, refresh), iteration
          )
        )
        rollout_time = time.perf_counter() - t_sample
        dispatch_update()  # a rollout that never waited: after it
      if partial:
        # Swapped or not, every process ends the rollout holding theta_i's copy: with many
        # processes each swaps at its own point, or not at all, and the next call for these
        # params (evaluation, the next rollout) must then be no collective on any of them.
        with jax.set_mesh(program.decode.mesh):
          program.decode.install(staged[0])
      state, learner_metrics = updated[0]
      learner_metrics = jax.device_get(learner_metrics)
      t2 = time.perf_counter()
      iteration += 1
      metrics = dict(result.metrics)
      metrics.update(_scalars(learner_metrics))
      metrics["time/rollout"] = rollout_time
      metrics["time/update"] = t2 - t1  # with lag, the sampling that overlaps it included
      metrics["time/iteration"] = t2 - t0
      metrics["time/env_wait_share"] = result.metrics["rollout/env_wait_time"] / (t2 - t0)
      if lag:
        metrics["pipeline/lag"] = pipeline.version_lag(iteration, this.version)
        metrics.update(
          pipeline.token_lag_metrics(
            result.trajectories, iteration, this.version, program.processes
          )
        )
      if _due(iteration, config.eval.every, config.num_iterations):
        metrics.update(_evaluate(program, state, eval_ids, config, iteration, k))
      progress_fn(iteration, metrics)
      trajectories_fn(iteration, result.trajectories)
      last = metrics
      final = iteration == config.num_iterations
      stop = None if watch is None else watch.agreed(program.processes)
      timed = timer.due(program.processes)
      if checkpointer.should_save(iteration) or timed or final or stop:
        progress = {"iteration": iteration, "task_position": stream.position}
        if lag:
          progress[pipeline.PROGRESS_KEY] = pipeline.to_progress(pending, program.processes)
        checkpointer.save(
          iteration,
          state,  # the Checkpointer leaves the frozen base (LoRA) out
          rng,
          progress,
          force=final or timed or bool(stop),
        )
        timer.restart()
      if stop is not None and not final:
        raise preemption_lib.Preempted(iteration, stop, checkpointer.directory)
  return state, last


def _scalars(metrics: dict, prefix: str = "") -> dict[str, float]:
  """Flattens learner metrics: scalars as they are, per-turn arrays as <name>/t<k>.

  Per-turn values exist only for the turns some trajectory reached (`turn/trajectories` > 0):
  the learner's arrays hold placeholders for the others (0, or +-inf for M_min and M_max), which
  are left out, as are the M statistics when no turn was updated (`turns_updated` 0).
  """
  present = metrics.get("turn/trajectories")
  present = None if present is None else np.asarray(present) > 0
  none_updated = "turns_updated" in metrics and float(np.asarray(metrics["turns_updated"])) == 0
  out = {}
  for name, value in metrics.items():
    value = np.asarray(value)
    if value.ndim == 0:
      if none_updated and name in learner.metrics.CORRECTION:
        continue
      out[prefix + name] = float(value)
    elif value.ndim == 1:
      for k, v in enumerate(value):
        if present is not None and not present[k]:
          continue
        out[f"{prefix}{name}/t{k}"] = float(v)
  return out


def _replicated_key(seed: int, mesh: jax.sharding.Mesh) -> jax.Array:
  """The PRNG key of `seed`, replicated on `mesh` (with many processes a global array, as the
  learner state it is checkpointed and used with)."""
  return jax.jit(lambda: jax.random.key(seed), out_shardings=NamedSharding(mesh, P()))()


def _key_on(key: jax.Array, mesh: jax.sharding.Mesh) -> jax.Array:
  """A replicated PRNG key (of the learner's mesh) replicated on `mesh` (the sampler's, this
  process's devices): through its key data on the host, a few bytes."""
  data = np.asarray(jax.random.key_data(key))
  return jax.device_put(
    jax.random.wrap_key_data(data, impl=jax.random.key_impl(key)), NamedSharding(mesh, P())
  )


def _due(iteration: int, every: int, total: int) -> bool:
  """Whether iteration `iteration` (1-based) of `total` is evaluated: every `every`, and the last."""
  return (every > 0 and iteration % every == 0) or iteration == total


def _evaluate(program: Program, state, eval_ids, config, iteration: int, k: int) -> dict:
  """avg@k / pass@k of the state's policy on `eval_ids` (under "eval/"), and "time/eval"; the
  table printed."""
  k_eval = 1 if config.eval.greedy else k
  t0 = time.perf_counter()
  with jax.set_mesh(program.decode.mesh):  # the sampler on the decode layout
    scores = evaluation.evaluate(
      program.eval_roller,
      program.decode(learner.policy_params(state)),
      eval_ids,
      k_eval,
      _eval_key(config.seed, iteration),
      config.eval.tasks_per_call,
    )
  out = {f"eval/{name}": value for name, value in scores.items()}
  out["time/eval"] = time.perf_counter() - t0
  row = {"iteration": iteration, **{n: v for n, v in scores.items()}}
  say(metrics_log.format_table([row], list(row)), program)
  return out


def _eval_key(seed: int, iteration: int) -> jax.Array:
  return jax.random.fold_in(jax.random.key(seed + 1_000_003), iteration)
