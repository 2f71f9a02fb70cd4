"""The training program: rollouts -> learner update, with evaluation, logs and checkpoints.

    from seeupo_jax.training import trainer
    trainer.main(config, workdir)       # config: experiments/configs/<name>.py

`main` dispatches on the config: `policy="oracle"` plays every task with the
environment's oracle (no model; `oracle.check`), `eval_only=True` evaluates
the workdir's latest checkpoint (or the initial weights), and otherwise
`train` trains.

The entry points type the config once (`config.typed`) and hand the typed config down to the
parts, each its own module:

    program.py           build: model, tokenizer, optimizer, learner update, env workers, rollers
    loop.py              the iterations: rollout -> collate -> update -> progress_fn(iteration,
                         metrics), checkpoints as it goes (iteration layout in its docstring)
    dynamic_sampling.py  DAPO's refill: more tasks for groups without signal
    writers.py           what progress_fn feeds: metrics.jsonl and TensorBoard, the figures
                         (plots.py), the progress bar; and trajectories.jsonl
    export.py            the HF export of the final policy

Everything random comes from one key carried in the checkpoint with the
learner state and the task position, so a run resumed from a checkpoint makes
the same iterations as one that never stopped. Evaluation draws its keys from
(seed, iteration) and never touches the training key.

Many processes (`seeupo_jax.distributed`; docs/training.md "Many processes"): every process
runs this program. Each draws the same B tasks, plays its block of B / P groups on its own
devices (global group numbers: the trajectories of a one-process run), collates its rows, and
the global batch is built from every process's rows for the one SPMD update. Process 0 alone
writes metrics, TensorBoard, trajectories, curves and the HF export; checkpoints are orbax's,
written by every process.

A remote workdir (`gs://`, `s3://`; `remote.py`): the run writes a local directory as it would a
local workdir, and process 0 copies it to the remote in a background thread after each completed
checkpoint, and at the end (`remote.Mirror`, `remote.Uploader`), having pulled the remote's newer
checkpoints first.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Iterator

from absl import logging
import jax
import ml_collections

from seeupo_jax import distributed
from seeupo_jax import envs
from seeupo_jax import learner
from seeupo_jax import rollout
from seeupo_jax.learner import dapo
from seeupo_jax.training import checkpoints
from seeupo_jax.training import config as config_lib
from seeupo_jax.training import export
from seeupo_jax.training import loop
from seeupo_jax.training import metrics_log
from seeupo_jax.training import oracle
from seeupo_jax.training import pipeline
from seeupo_jax.training import preemption
from seeupo_jax.training import program as program_lib
from seeupo_jax.training import remote
from seeupo_jax.training import workdir as workdir_lib
from seeupo_jax.training import writers
from seeupo_jax.training.dynamic_sampling import REFILL_STREAM, refill_informative_groups  # noqa: F401
from seeupo_jax.training.loop import (  # noqa: F401
  _due,
  _eval_key,
  _evaluate,
  _key_on,
  _replicated_key,
  _scalars,
)
from seeupo_jax.training.plots import (  # noqa: F401
  CURVES_FILE,
  DIAGNOSTIC_PANELS,
  DIAGNOSTICS_FILE,
  SMOOTH,
  curve_panels,
  outputs,
  plot,
)
from seeupo_jax.training.program import (  # noqa: F401
  Program,
  _check_row_blocks,
  _config_values,
  build_model,
  build_optimizer,
)
from seeupo_jax.training.tasks import TaskStream

POLICIES = config_lib.POLICIES
# Config keys that may change when a workdir is resumed or evaluated.
ALLOWED_TO_DIFFER = checkpoints.DEFAULT_ALLOWED_TO_DIFFER + ("eval_only", "policy")

ConfigError = config_lib.ConfigError
TrainConfig = config_lib.TrainConfig
WorkdirError = workdir_lib.WorkdirError
Preempted = preemption.Preempted

_print = writers.say
informative_groups = dapo.informative_group_ids
_save_hf = export.save_hf

AnyConfig = TrainConfig | ml_collections.ConfigDict
"""What the entry points take: a ConfigDict (overrides applied) is typed once, on entry."""


def main(
  config: AnyConfig,
  workdir: str,
  defaults=None,
  *,
  local_dir: str | None = None,
  take_remote_lock: bool = False,
) -> dict:
  """Runs what the config asks: the oracle check, an evaluation, or training.

  Args:
    config: the training config (a ConfigDict, overrides applied, is made typed first:
      `config_lib.typed`).
    workdir: the run's directory, local or remote (`gs://...`, `s3://...`: `remote.py`).
    defaults: the config before overrides (the config file's `get_config()`): a key that a
      resumed checkpoint lacks (added since) may be at its default (`checkpoints.check_config`).
    local_dir: with a remote workdir, the local directory the run writes (default
      `remote.local_dir_for(workdir)`; with many processes it must be given: one directory every
      process sees). Ignored for a local workdir.
    take_remote_lock: take a remote workdir's lock object even if another run's is there.

  Raises:
    ConfigError: a bad config value, before anything is built.
    WorkdirError: the workdir is a file, locked by a live run, or holds only unreadable
      checkpoints; a remote workdir cannot be reached, is locked, or a copy to it failed
      (`remote.RemoteError`).
  """
  config = config_lib.typed(config)
  mirror = _mirror(workdir, local_dir)
  if config.policy == "oracle":
    return check_oracle(config, workdir, mirror)
  if config.eval_only:
    return _evaluate_only_typed(config, workdir, defaults, mirror)
  return _train_typed(config, workdir, defaults, mirror, take_remote_lock)


def _mirror(workdir: str, local_dir: str | None) -> remote.Mirror | None:
  """The mirror of a remote workdir (None for a local one), its remote checked in process 0."""
  if not remote.is_remote(workdir):
    return None
  if not local_dir and jax.process_count() > 1:
    raise WorkdirError(
      f"the remote workdir {workdir} with {jax.process_count()} processes needs --local_dir: "
      "one directory that every process sees (each writes its shards of the checkpoints there)"
    )
  mirror = remote.Mirror(workdir, remote.local_dir_for(workdir, local_dir))
  if jax.process_index() == 0:
    mirror.check()
  return mirror


def _local(workdir: str, mirror: remote.Mirror | None) -> str:
  """The directory the run writes: the workdir, or a remote workdir's local directory."""
  return workdir if mirror is None else mirror.local


@contextlib.contextmanager
def _remote_workdir(mirror: remote.Mirror | None, take_lock: bool) -> Iterator[None]:
  """For the block: a remote workdir's lock object held and its newer files pulled (process 0),
  every process waiting for the pull; nothing for a local workdir."""
  if mirror is None:
    yield
    return
  processes = distributed.Processes.current()
  with mirror.lock(take_lock) if processes.is_main else contextlib.nullcontext():
    _pull(mirror, processes)
    yield


def _pull(mirror: remote.Mirror, processes: distributed.Processes) -> None:
  """Process 0 pulls the remote's newer files (`Mirror.pull`); every process waits for it."""
  if processes.is_main:
    pulled = mirror.pull()
    _print(
      f"workdir {mirror.remote}: writing to {mirror.local}, copied there after each checkpoint"
      + (f"; pulled {', '.join(pulled)}" if pulled else "")
    )
  processes.allgather(None)  # the others restore only what process 0 has pulled


def build(config: AnyConfig) -> Program:
  """Builds the program's parts from a training config (a ConfigDict is made typed first).

  Only the config's checks raise ConfigError (`config_lib.typed`, then what needs the processes,
  the devices or the environment: `program.build`); any other exception is a bug and propagates
  as it is.

  Raises:
    ConfigError: a bad value (the message names the key and what is allowed).
    envs.EnvironmentUnavailable: the config's environment cannot run here.
  """
  return program_lib.build(config_lib.typed(config))


def check_oracle(config: TrainConfig, workdir: str, mirror: remote.Mirror | None = None) -> dict:
  """Plays every train and eval task with the environment's oracle; prints and returns the report
  (oracle.json, also copied to a remote workdir by `mirror`).

  Raises:
    ConfigError: the environment has no oracle (or bad env options).
    oracle.OracleFailure: an oracle episode failed (a broken install).
  """
  try:
    spec = envs.make_spec(config.env.name, config.env_options())
  except ValueError as e:
    raise ConfigError(str(e)) from e
  if spec.oracle is None:
    raise ConfigError(f"policy='oracle': the {config.env.name!r} environment has no oracle")
  if jax.process_count() > 1:
    raise ConfigError("policy='oracle' plays no model: run it as one process")
  r = config.rollout
  worker_config = r.rollout_config().worker_config(spec.isolation)
  local = _local(workdir, mirror)
  with workdir_lib.prepared(local):
    env_workers = rollout.make_workers(spec, worker_config)
    try:
      report = oracle.check(spec, r.max_turns, r.env_workers, local, env_workers)
    finally:
      env_workers.shutdown()
  rows = [{"split": split, **values} for split, values in report.items()]
  _print(metrics_log.format_table(rows, list(rows[0])))
  if mirror is not None:
    mirror.push(["oracle.json"])
  _print(f"the oracle solved every task; report in {os.path.join(workdir, 'oracle.json')}")
  return report


def _checkpointer(
  config: AnyConfig, workdir: str, defaults=None, *, read_only: bool = False
) -> checkpoints.Checkpointer:
  """The workdir's checkpoints, checked against `config` (keys in ALLOWED_TO_DIFFER may change;
  keys the checkpoint lacks may be at their `defaults`). A ConfigDict is made typed first."""
  return _checkpoints(config_lib.typed(config), workdir, defaults, read_only=read_only)


def _checkpoints(
  config: TrainConfig,
  workdir: str,
  defaults=None,
  *,
  read_only: bool = False,
  on_saved=None,
) -> checkpoints.Checkpointer:
  """`_checkpointer` of a typed config (`on_saved`: `checkpoints.Checkpointer`'s)."""
  return checkpoints.Checkpointer(
    os.path.join(workdir, "checkpoints"),
    keep=config.checkpoint.keep,
    every=config.checkpoint.every,
    config=dict(config.source),
    allowed_to_differ=ALLOWED_TO_DIFFER,
    defaults=None if defaults is None else json.loads(defaults.to_json_best_effort()),
    moved=config_lib.MOVED_KEYS,
    read_only=read_only,
    asynchronous=config.checkpoint.asynchronous,
    on_saved=on_saved,
  )


def _restore(checkpointer: checkpoints.Checkpointer, workdir: str, what: str, state, rng):
  """`checkpointer.restore_latest`, its refusals as ConfigError (a changed config or model)
  or WorkdirError (no checkpoint can be read)."""
  try:
    # With LoRA the checkpoint holds the adapters; the frozen base comes back as `state`'s.
    return checkpointer.restore_latest(checkpoints.abstract_of(state), checkpoints.abstract_of(rng))
  except ValueError as e:  # a changed config or model: say so instead of training something else
    raise ConfigError(f"cannot {what} {workdir}: {e}") from e
  except checkpoints.CheckpointsUnreadable as e:  # never a silent restart from iteration 0
    raise WorkdirError(
      f"cannot {what} {workdir}: {e}. Nothing was changed; to start from iteration 0 instead, "
      f"move {checkpointer.directory} away"
    ) from e


def evaluate_only(config: AnyConfig, workdir: str, defaults=None) -> dict:
  """Evaluates the workdir's latest checkpoint (or, without one, the initial weights).

  avg@k / pass@k on `eval.num_tasks` eval tasks (k samples, or 1 greedy), printed and written to
  `eval_<iteration>.json` in the workdir. Takes no lock and changes no checkpoint, so it can run
  beside the workdir's trainer.
  """
  return _evaluate_only_typed(config_lib.typed(config), workdir, defaults)


def _evaluate_only_typed(
  config: TrainConfig, workdir: str, defaults=None, mirror: remote.Mirror | None = None
) -> dict:
  local = _local(workdir, mirror)
  with workdir_lib.prepared(local):
    if mirror is not None:  # the remote's newer checkpoints (its lock is not taken)
      _pull(mirror, distributed.Processes.current())
    program = program_lib.build(config)
  try:
    scores = _evaluate_only(config, local, program, defaults, mirror)
  finally:
    program.close()
  if program.processes.is_main:
    _print(outputs(local))
  return scores


def _evaluate_only(
  config: TrainConfig,
  workdir: str,
  program: Program,
  defaults=None,
  mirror: remote.Mirror | None = None,
) -> dict[str, float]:
  state = program.init_state()
  checkpointer = _checkpoints(config, workdir, defaults, read_only=True)
  iteration = 0
  try:
    restored = _restore(checkpointer, workdir, "evaluate", state, _replicated_key(0, program.mesh))
  finally:
    checkpointer.close()
  if restored is not None:
    iteration, state, _, _ = restored
    _print(f"evaluating {workdir} at iteration {iteration}", program)
  else:
    source = config.model.path or f"a fresh {config.model.preset}"
    _print(f"no checkpoint in {workdir}: evaluating the initial weights ({source})", program)
  eval_ids = list(program.spec.task_ids("eval"))[: config.eval.num_tasks]
  with jax.set_mesh(program.mesh):
    scores = _evaluate(program, state, eval_ids, config, iteration, config.eval.k)
  scores = {name.removeprefix("eval/"): value for name, value in scores.items()}
  if program.processes.is_main:
    with open(os.path.join(workdir, f"eval_{iteration}.json"), "w", encoding="utf-8") as f:
      json.dump({"iteration": iteration, **scores}, f, indent=1)
    if mirror is not None:
      mirror.push([f"eval_{iteration}.json"])
  return scores


def train(config: AnyConfig, workdir: str, defaults=None) -> dict[str, float]:
  """Trains (or resumes) as `config` says, writing logs and checkpoints to `workdir`.

  The workdir is locked for the run (`workdir.lock`, by process 0): a second trainer on it is
  refused before it builds anything. Returns the last iteration's metrics and the final
  evaluation. A remote workdir: `main`.
  """
  return _train_typed(config_lib.typed(config), workdir, defaults, _mirror(workdir, None))


def _train_typed(
  config: TrainConfig,
  workdir: str,
  defaults=None,
  mirror: remote.Mirror | None = None,
  take_remote_lock: bool = False,
) -> dict[str, float]:
  local = _local(workdir, mirror)
  held = workdir_lib.lock(local) if jax.process_index() == 0 else contextlib.nullcontext()
  # A run refused at start-up leaves no empty workdir; a remote one's lock object goes last.
  with workdir_lib.prepared(local), held, _remote_workdir(mirror, take_remote_lock):
    program = program_lib.build(config)
    uploader = None
    if mirror is not None and program.processes.is_main:
      uploader = remote.Uploader(mirror)  # copies in the background after each save
    try:
      last = _training(config, local, program, defaults, uploader)
    except BaseException as e:
      program.close()
      if uploader is not None:
        _close_uploader_after(e, uploader)
      raise
    program.close()
    if uploader is not None:
      uploader.close()  # the last copy, waited for: the logs and figures of the end, hf_policy/
  if program.processes.is_main:
    _print(outputs(local))
    if mirror is not None:
      _print(f"copied to {mirror.remote}")
  return last


def _close_uploader_after(error: BaseException, uploader: remote.Uploader) -> None:
  """Closes `uploader` on the way out of a run that raised `error`. After a stop on a signal
  (`Preempted`, its checkpoint saved) the last copy is made and waited for, and a copy that
  fails is what the run reports (a preempted machine's disk may not outlive it); after a
  failure, the copies requested so far finish and a copy that fails is a warning beside it."""
  if isinstance(error, Preempted):
    uploader.close()
    return
  try:
    uploader.close(push=False)
  except remote.RemoteError as e:
    logging.warning("%s", e)


def _train(config: AnyConfig, workdir: str, program: Program, defaults=None) -> dict[str, float]:
  """`train` with a built program, which stays open (a ConfigDict is made typed first)."""
  return _training(config_lib.typed(config), workdir, program, defaults)


def _training(
  config: TrainConfig,
  workdir: str,
  program: Program,
  defaults=None,
  uploader: remote.Uploader | None = None,
) -> dict[str, float]:
  """Restores the workdir's latest checkpoint (if any), runs `loop.run` with the writers of
  process 0, and exports the policy (`save_hf`). `uploader` copies the workdir to its remote in
  the background after each completed checkpoint (process 0)."""
  train_ids = program.spec.task_ids("train")
  on_saved = None if uploader is None else uploader.request
  checkpointer = _checkpoints(config, workdir, defaults, on_saved=on_saved)
  state = program.init_state()
  rng = _replicated_key(config.seed, program.mesh)
  iteration, position, pending = 0, 0, None
  try:
    restored = _restore(checkpointer, workdir, "resume", state, rng)
  except BaseException:
    checkpointer.close()
    raise
  if restored is not None:
    iteration, state, rng, progress = restored
    position = int(progress["task_position"])
    try:
      pending = pipeline.from_progress(progress, program.processes, config.pipeline.lag)
    except ValueError as e:
      checkpointer.close()
      raise ConfigError(f"cannot resume {workdir}: {e}") from e
    logging.info("resumed from iteration %d (task position %d)", iteration, position)
    _print(f"resuming {workdir} from iteration {iteration}", program)
  if config.pipeline.lag and config.learner.tis == "off":
    _print(
      f"pipeline.lag={config.pipeline.lag} without learner.tis: the update weighs rollouts of "
      "older params as its own (learner.tis=sequence corrects them: docs/learner.md)",
      program,
    )
  stream = TaskStream(train_ids, config.seed, position)
  # Process 0 alone writes the logs. Lines of iterations after the checkpoint (a crash between
  # logging and saving) are dropped, and torn lines wherever they are.
  log, bar, progress_writers = None, None, []
  if program.processes.is_main:
    metrics_log.drop_records_from(os.path.join(workdir, "trajectories.jsonl"), iteration + 1)
    log = metrics_log.MetricsLog(
      workdir, tensorboard=config.log.tensorboard, resume_from=iteration + 1
    )
    progress_writers.append(log.write)
    if config.log.plot:  # the figures so far, at every evaluation
      progress_writers.append(_figure_writer(config, workdir, program.spec))
    if config.log.progress_bar:
      bar = writers.ProgressBar(config.num_iterations, iteration)
      progress_writers.append(bar)
  try:
    with preemption.Watch() as watch:  # SIGTERM/SIGINT: save after the iteration in flight
      state, last = loop.run(
        config,
        program,
        state,
        rng,
        stream,
        iteration,
        checkpointer=checkpointer,
        progress_fn=writers.fan_out(progress_writers),
        trajectories_fn=writers.trajectory_log(workdir, program, config.log.trajectories),
        watch=watch,
        pending=pending,
      )
  finally:
    if bar is not None:
      bar.close()
    if log is not None:
      log.close()
    checkpointer.close()
  if config.save_hf:
    _save_hf(workdir, program, state, base_model_path=config.model.path)
  return last


def _figure_writer(config: TrainConfig, workdir: str, spec: envs.EnvSpec) -> writers.ProgressFn:
  """The writer that redraws `curves.png` and `diagnostics.png` at every evaluation (through this
  module's `plot`, which a caller may wrap)."""
  return writers.every_evaluation(
    lambda: plot(config, workdir, spec),
    lambda iteration: _due(iteration, config.eval.every, config.num_iterations),
  )
