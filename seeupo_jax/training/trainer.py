"""The training program: rollouts -> learner update, with evaluation, logs and checkpoints.

    from seeupo_jax.training import trainer
    trainer.main(config, workdir)       # config: experiments/configs/<name>.py

`main` dispatches on the config: `policy="oracle"` plays every task with the
environment's oracle (no model; `oracle.check`), `eval_only=True` evaluates
the workdir's latest checkpoint (or the initial weights), and otherwise
`train` trains.

One iteration:

    tasks  = the next B training tasks (TaskStream, resumable)
    result = roller.run(params, tasks, n, key_rollout)      # N = B x n trajectories
    (dynamic sampling: refill_informative_groups, more tasks for groups without signal)
    batch  = collate(result.trajectories)                   # tokens exactly as sampled
    state  = update(state, batch, key_update)               # SeeUPO or a baseline

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
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from typing import Any, Optional

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from seeupo_jax import chat_tokens
from seeupo_jax import decode_layout
from seeupo_jax import distributed
from seeupo_jax import envs
from seeupo_jax import learner
from seeupo_jax.learner import dapo
from seeupo_jax import rollout
from seeupo_jax import sampling
from seeupo_jax import sharding as sharding_lib
from seeupo_jax import tokenizer as tokenizer_lib
from seeupo_jax.models import checkpoint as hf_checkpoint
from seeupo_jax.models import config as model_config_lib
from seeupo_jax.models import qwen
from seeupo_jax.training import checkpoints
from seeupo_jax.training import config as config_lib
from seeupo_jax.training import evaluation
from seeupo_jax.training import metrics_log
from seeupo_jax.training import oracle
from seeupo_jax.training import workdir as workdir_lib
from seeupo_jax.training.tasks import TaskStream

POLICIES = config_lib.POLICIES
# Config keys that may change when a workdir is resumed or evaluated.
ALLOWED_TO_DIFFER = checkpoints.DEFAULT_ALLOWED_TO_DIFFER + ("eval_only", "policy")

CURVES_FILE = "curves.png"
DIAGNOSTICS_FILE = "diagnostics.png"
SMOOTH = 10
"""The trailing mean (in iterations) drawn over the raw training points of `curves.png`."""


def curve_panels(k: int, chance: Optional[float]) -> tuple[metrics_log.Panel, ...]:
  """`curves.png`: the learning curves, with the environment's chance level where it has one.

  Args:
    k: the samples per task of the evaluation (1 with eval.greedy).
    chance: the environment's `EnvSpec.chance` (a success rate), or None.
  """
  pass_chance = None if chance is None else 1.0 - (1.0 - chance) ** k
  return (
    metrics_log.Panel("train reward", ("reward",), smooth=SMOOTH),
    metrics_log.Panel(
      "train success",
      ("success",),
      smooth=SMOOTH,
      chance=chance,
      chance_label=_chance_label(chance),
      unit_range=True,
    ),
    metrics_log.Panel(
      f"held-out avg@{k} (success of all samples)",
      (f"eval/avg@{k}",),
      chance=chance,
      chance_label=_chance_label(chance),
      unit_range=True,
    ),
    metrics_log.Panel(
      f"held-out pass@{k} (tasks solved in {k} samples)",
      (f"eval/pass@{k}",),
      chance=pass_chance,
      chance_label=_chance_label(pass_chance, k),
      unit_range=True,
    ),
  )


def _chance_label(chance: Optional[float], k: int = 1) -> str:
  if chance is None:
    return ""
  return f"chance ({chance:.3g})" if k == 1 else f"chance in {k} samples ({chance:.3g})"


DIAGNOSTIC_PANELS = (
  metrics_log.Panel("trajectory length (tokens)", ("length",)),
  metrics_log.Panel("turns per trajectory", ("turns",)),
  metrics_log.Panel("tokens per reply", ("reply_tokens",)),
  metrics_log.Panel("loss", ("loss",)),
  metrics_log.Panel("gradient norm (before clipping)", ("grad_norm",)),
  metrics_log.Panel(
    "|sampler - learner| log-prob", ("sample_logp_gap_mean", "sample_logp_gap_max")
  ),
  metrics_log.Panel(
    "how trajectories ended (share)",
    ("finish/done", "finish/max_turns", "finish/context", "finish/env_error"),
    unit_range=True,
  ),
  metrics_log.Panel(
    "seconds (log scale)",
    ("time/iteration", "time/rollout", "time/update", "time/eval"),
    log_y=True,
  ),
  metrics_log.Panel(
    "waiting for environments (share of the time)",
    ("time/env_wait_share",),
    unit_range=True,
  ),
)
"""`diagnostics.png`: what explains the curves (lengths, turns, the learner, the times)."""


ConfigError = config_lib.ConfigError
TrainConfig = config_lib.TrainConfig
WorkdirError = workdir_lib.WorkdirError


@contextlib.contextmanager
def _config_values(section: str):
  """Turns the ValueError or TypeError that a config dataclass (or the mesh, the environment's
  options, ...) raises for a bad value of config section `section` into a ConfigError.

  Only around the calls that validate the config: elsewhere such an error is a bug and keeps
  its traceback.
  """
  try:
    yield
  except (ConfigError, envs.EnvironmentUnavailable):
    raise
  except (ValueError, TypeError) as e:
    raise ConfigError(f"{section}: {e}") from e


@dataclasses.dataclass
class Program:
  """Everything `train` builds from the config (exposed for tests and notebooks)."""

  model_config: model_config_lib.ModelConfig
  tokenizer: Any
  chat: chat_tokens.ChatTokens
  spec: envs.EnvSpec
  mesh: jax.sharding.Mesh
  learner_config: learner.LearnerConfig
  roller: rollout.Roller
  eval_roller: rollout.Roller
  decode: decode_layout.DecodeLayout  # the rollers' params: tensor-parallel, compute dtype
  env_workers: rollout.EnvWorkers  # shared by both rollers; `close` shuts them down
  update: Any
  init_state: Any  # () -> TrainState
  processes: distributed.Processes = distributed.Processes()  # who plays what, who writes

  def close(self) -> None:
    """Stops the rollers' threads and the env workers (worker processes)."""
    self.roller.close()
    self.eval_roller.close()
    self.env_workers.shutdown()


def build_model(config: TrainConfig):
  """(ModelConfig, tokenizer, params loader) from `config.model`."""
  m = config.model
  overrides = dict(
    dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat, scan_layers=m.scan_layers
  )
  if m.path:
    if not os.path.isdir(m.path):
      raise ConfigError(f"model.path={m.path!r} is not a local checkpoint directory")
    try:  # the headers of every safetensors file too: a truncated file fails here, not later
      model_config = hf_checkpoint.load_config(m.path, **overrides)
      hf_checkpoint.check_files(m.path)
      tokenizer = tokenizer_lib.load_tokenizer(m.path)
    except (OSError, ValueError) as e:
      raise ConfigError(f"model.path={m.path!r}: {e}") from e

    def load(mesh, key):
      del key
      return hf_checkpoint.load(m.path, mesh, **overrides)[1]

  else:
    if not m.preset:
      raise ConfigError(
        f"no model: pass --config.model.path=/path/to/a/local/Qwen3-checkpoint (the paper trains "
        f"Qwen3-14B on {config.env.name}); --config.model.preset=qwen3-tiny builds a tiny model "
        "from scratch, only to check the pipeline"
      )
    try:
      model_config = model_config_lib.get_preset(m.preset, **overrides)
    except ValueError as e:
      raise ConfigError(f"model.preset: {e}") from None
    tokenizer = tokenizer_lib.build_default_tokenizer(model_config.vocab_size)

    def load(mesh, key):
      params = qwen.init_params(model_config, key)
      return learner.shard_params(params, mesh)

  if len(tokenizer) > model_config.vocab_size:
    raise ConfigError(
      f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
      f"{model_config.vocab_size}"
    )
  return model_config, tokenizer, load


def build_optimizer(o: config_lib.OptimizerSection) -> optax.GradientTransformation:
  """`learner.default_optimizer` with the values of the config's `optimizer` section."""
  return learner.default_optimizer(
    o.learning_rate,
    weight_decay=o.weight_decay,
    max_grad_norm=o.max_grad_norm,
    warmup_steps=o.warmup_steps,
  )


def build(config: TrainConfig | ml_collections.ConfigDict) -> Program:
  """Builds the program's parts from a training config (a ConfigDict is made typed first).

  Only the config's checks raise ConfigError (`config_lib.typed`, then what needs the processes,
  the devices or the environment); any other exception is a bug and propagates as it is.

  Raises:
    ConfigError: a bad value (the message names the key and what is allowed).
    envs.EnvironmentUnavailable: the config's environment cannot run here.
  """
  config = config_lib.typed(config)
  processes = distributed.Processes.current()
  env_name = config.env.name
  r = config.rollout
  if processes.count > 1 and r.tasks_per_iteration % processes.count:
    raise ConfigError(
      f"rollout.tasks_per_iteration={r.tasks_per_iteration} must be divisible by the "
      f"{processes.count} processes (each plays tasks_per_iteration / processes groups)"
    )
  with _config_values("env"):
    spec = envs.make_spec(
      env_name,
      envs.process_options(
        env_name, config.env_options(), processes.index, processes.count, processes.local_index
      ),
    )
  model_config, tokenizer, load_params = build_model(config)
  with _config_values("chat_template_kwargs"):
    chat = chat_tokens.ChatTokens(tokenizer, dict(config.chat_template_kwargs))
  with _config_values("mesh"):
    mesh = sharding_lib.make_mesh(**dataclasses.asdict(config.mesh))
  if processes.count > 1:
    _check_row_blocks(mesh, r.tasks_per_iteration * r.samples_per_task, processes)

  stops = tuple(sorted(set(tokenizer_lib.stop_token_ids(tokenizer)) | {chat.end_of_turn_id}))
  pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
  if processes.count > 1 and r.decode_slots % processes.count:
    raise ConfigError(
      f"rollout.decode_slots={r.decode_slots} must be divisible by the {processes.count} "
      "processes (each samples on decode_slots / processes rows)"
    )
  sampling_config = sampling.SamplingConfig(
    max_new_tokens=r.max_reply_tokens,
    temperature=r.temperature,
    top_k=r.top_k,
    top_p=r.top_p,
    stop_token_ids=stops,
    pad_id=pad_id,
  )
  rollout_config = r.rollout_config(processes.count)
  eval_sampling = dataclasses.replace(sampling_config, greedy=config.eval.greedy)
  learner_config = config.learner
  optimizer = build_optimizer(config.optimizer)
  logprob_fn = learner.qwen_logprob_fn(model_config, temperature=r.temperature)
  ppo = learner_config.spec.critic
  critic_optimizer = build_optimizer(config.optimizer) if ppo else None
  update = learner.make_update(
    logprob_fn,
    optimizer,
    learner_config,
    value_fn=learner.qwen_value_fn(model_config) if ppo else None,
    critic_optimizer=critic_optimizer,
  )

  # Worker processes start last, once everything else in the config has checked out.
  # The sampler decodes with its own copy of the params (tensor-parallel, compute dtype).
  with _config_values("rollout.decode_tensor_parallel"):
    decode = decode_layout.DecodeLayout(
      model_config, mesh, tensor=config.rollout.decode_tensor_parallel or None
    )
  cache_sharding = decode.cache_sharding
  env_workers = rollout.make_workers(spec, rollout_config.worker_config(spec.isolation))
  try:
    roller, eval_roller = (
      rollout.Roller(
        spec,
        chat,
        decode.model_config,
        sampler_config,
        rollout_config,
        cache_sharding=cache_sharding,
        workers=env_workers,
        processes=processes,
      )
      for sampler_config in (sampling_config, eval_sampling)
    )
  except BaseException:
    env_workers.shutdown()
    raise

  def init_state():
    key = jax.random.key(config.seed)
    k_params, k_critic = jax.random.split(key)
    params = load_params(mesh, k_params)
    critic = None
    if ppo:
      # The critic's trunk starts as a copy of the policy (its own buffers: the update donates both).
      trunk = jax.tree.map(jnp.copy, params)
      critic = learner.shard_params(learner.init_qwen_critic(model_config, k_critic, trunk), mesh)
    ref = params if learner_config.kl_coef > 0 else None
    return learner.init_state(
      params,
      optimizer,
      ref_params=ref,
      critic_params=critic,
      critic_optimizer=critic_optimizer,
      master_weights=config.optimizer.master_weights,
    )

  return Program(
    model_config=model_config,
    tokenizer=tokenizer,
    chat=chat,
    spec=spec,
    mesh=mesh,
    learner_config=learner_config,
    roller=roller,
    eval_roller=eval_roller,
    decode=decode,
    env_workers=env_workers,
    update=update,
    init_state=init_state,
    processes=processes,
  )


def _check_row_blocks(mesh: jax.sharding.Mesh, rows: int, processes) -> None:
  """Each process's devices must hold one contiguous block of the batch's rows, its own.

  The global batch is built from each process's rows (`learner.shard_batch`): process p's
  B x n / P rows are rows [p x B x n / P, (p + 1) x B x n / P) of the batch.
  """
  spec = sharding_lib.fit_spec(P(sharding_lib.BATCH), (rows,), mesh)
  held = NamedSharding(mesh, spec).addressable_devices_indices_map((rows,)).values()
  starts = {index[0].start or 0 for index in held}
  stops = {rows if index[0].stop is None else index[0].stop for index in held}
  block = processes.block(rows)
  if spec == P(None) or min(starts) != block.start or max(stops) != block.stop:
    raise ConfigError(
      f"mesh {dict(mesh.shape)}: the batch's {rows} rows (tasks_per_iteration x "
      f"samples_per_task) are not split into one block per process over the mesh's "
      f"(data, fsdp) axes (process {processes.index} holds rows {sorted(starts)} .. "
      f"{sorted(stops)}, its block is {block.start} .. {block.stop}); make data x fsdp a "
      "multiple of the processes that divides the rows"
    )


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


REFILL_STREAM = 0x0DA905
"""Folded into the iteration's rollout key before the refill index: refill r plays with
fold_in(fold_in(k_rollout, REFILL_STREAM), r), a key no pass of the first rollout uses."""


informative_groups = dapo.informative_group_ids
"""The rollout's informative groups (`learner.dapo.informative_group_ids`)."""


def refill_informative_groups(
  roller,
  stream: TaskStream,
  params,
  key: jax.Array,
  first: rollout.RolloutResult,
  *,
  tasks_per_iteration: int,
  samples_per_task: int,
  max_refills: int,
) -> rollout.RolloutResult:
  """DAPO's dynamic sampling on the host: informative groups only, refilled with more tasks.

  The groups of `first` whose rewards are all equal (no signal), or that failed, are discarded.
  While fewer than `tasks_per_iteration` (B) informative groups are held and fewer than
  `max_refills` refills ran, refill r = 1, 2, ... plays the next B tasks of `stream` with the key
  fold_in(fold_in(key, REFILL_STREAM), r) (same shapes as the first rollout: no recompilation;
  the stream's position is checkpointed, so a resumed run draws the same). The first B
  informative groups in the order drawn are kept, renumbered 0..k-1; informative groups beyond
  B are discarded with the others. k < B when the refills run out: `collate(num_rows=B x n)`
  pads the batch with invalid rows.

  Many processes (`roller.processes`): which groups are informative is decided on all of them
  (their group numbers gathered); kept group j becomes rows [j x n, (j + 1) x n) of the batch,
  which belong to the process whose block of B holds j, so the kept groups that another process
  played move there (one all-gather of those trajectories). Each process returns its block.

  Returns:
    The kept trajectories (this process's block of them), with `first`'s metrics (the policy's
    reward and rollout statistics on B fresh tasks, as without dynamic sampling) and
    "dapo/refill_rollouts" (refills run), "dapo/informative_groups" (k, the groups in the
    batch), "dapo/discarded_groups" (every group rolled out this iteration and not in the batch).
  """
  processes = getattr(roller, "processes", None) or distributed.Processes()
  kept: dict[int, list] = {}  # batch position -> the group's trajectories (played here)
  count, refills, result = 0, 0, first
  while True:
    informative = processes.concat(dapo.informative_group_ids(result.trajectories))
    for group in sorted(informative):
      if count < tasks_per_iteration:
        members = [t for t in result.trajectories if t.group == group]
        if members:
          kept[count] = members
        count += 1
    if count == tasks_per_iteration or refills == max_refills:
      break
    refills += 1
    refill_key = jax.random.fold_in(jax.random.fold_in(key, REFILL_STREAM), refills)
    result = roller.run(params, stream.take(tasks_per_iteration), samples_per_task, refill_key)
  if processes.count > 1:  # the groups move to the process whose rows they are
    mine = processes.block(tasks_per_iteration)
    moving = {j: members for j, members in kept.items() if j not in mine}
    arrived = {j: g for part in processes.allgather(moving) for j, g in part.items() if j in mine}
    kept = {j: kept.get(j) or arrived[j] for j in mine if j < count}
  trajectories = [dataclasses.replace(t, group=j) for j in sorted(kept) for t in kept[j]]
  metrics = dict(first.metrics)
  metrics["dapo/refill_rollouts"] = float(refills)
  metrics["dapo/informative_groups"] = float(count)
  metrics["dapo/discarded_groups"] = float((refills + 1) * tasks_per_iteration - count)
  return rollout.RolloutResult(trajectories=trajectories, metrics=metrics)


def _eval_key(seed: int, iteration: int) -> jax.Array:
  return jax.random.fold_in(jax.random.key(seed + 1_000_003), iteration)


def main(config: TrainConfig | ml_collections.ConfigDict, workdir: str, defaults=None) -> dict:
  """Runs what the config asks: the oracle check, an evaluation, or training.

  Args:
    config: the training config (a ConfigDict, overrides applied, is made typed first:
      `config_lib.typed`).
    workdir: the run's directory.
    defaults: the config before overrides (the config file's `get_config()`): a key that a
      resumed checkpoint lacks (added since) may be at its default (`checkpoints.check_config`).

  Raises:
    ConfigError: a bad config value, before anything is built.
    WorkdirError: the workdir is a file, locked by a live run, or holds only unreadable
      checkpoints.
  """
  config = config_lib.typed(config)
  if config.policy == "oracle":
    return check_oracle(config, workdir)
  if config.eval_only:
    return evaluate_only(config, workdir, defaults)
  return train(config, workdir, defaults)


def check_oracle(config: TrainConfig, workdir: str) -> dict:
  """Plays every train and eval task with the environment's oracle; prints and returns the report.

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
  with workdir_lib.prepared(workdir):
    env_workers = rollout.make_workers(spec, worker_config)
    try:
      report = oracle.check(spec, r.max_turns, r.env_workers, workdir, env_workers)
    finally:
      env_workers.shutdown()
  rows = [{"split": split, **values} for split, values in report.items()]
  _print(metrics_log.format_table(rows, list(rows[0])))
  _print(f"the oracle solved every task; report in {os.path.join(workdir, 'oracle.json')}")
  return report


def _checkpointer(
  config: TrainConfig, workdir: str, defaults=None, *, read_only: bool = False
) -> checkpoints.Checkpointer:
  """The workdir's checkpoints, checked against `config` (keys in ALLOWED_TO_DIFFER may change;
  keys the checkpoint lacks may be at their `defaults`)."""
  config = config_lib.typed(config)
  return checkpoints.Checkpointer(
    os.path.join(workdir, "checkpoints"),
    keep=config.checkpoint.keep,
    every=config.checkpoint.every,
    config=dict(config.source),
    allowed_to_differ=ALLOWED_TO_DIFFER,
    defaults=None if defaults is None else json.loads(defaults.to_json_best_effort()),
    moved=config_lib.MOVED_KEYS,
    read_only=read_only,
  )


def _restore(checkpointer: checkpoints.Checkpointer, workdir: str, what: str, state, rng):
  """`checkpointer.restore_latest`, its refusals as ConfigError (a changed config or model)
  or WorkdirError (no checkpoint can be read)."""
  try:
    return checkpointer.restore_latest(checkpoints.abstract_of(state), checkpoints.abstract_of(rng))
  except ValueError as e:  # a changed config or model: say so instead of training something else
    raise ConfigError(f"cannot {what} {workdir}: {e}") from e
  except checkpoints.CheckpointsUnreadable as e:  # never a silent restart from iteration 0
    raise WorkdirError(
      f"cannot {what} {workdir}: {e}. Nothing was changed; to start from iteration 0 instead, "
      f"move {checkpointer.directory} away"
    ) from e


def evaluate_only(
  config: TrainConfig | ml_collections.ConfigDict, workdir: str, defaults=None
) -> dict:
  """Evaluates the workdir's latest checkpoint (or, without one, the initial weights).

  avg@k / pass@k on `eval.num_tasks` eval tasks (k samples, or 1 greedy), printed and written to
  `eval_<iteration>.json` in the workdir. Takes no lock and changes no checkpoint, so it can run
  beside the workdir's trainer.
  """
  config = config_lib.typed(config)
  with workdir_lib.prepared(workdir):
    program = build(config)
  try:
    scores = _evaluate_only(config, workdir, program, defaults)
  finally:
    program.close()
  if program.processes.is_main:
    _print(outputs(workdir))
  return scores


def _evaluate_only(config, workdir: str, program: Program, defaults=None) -> dict[str, float]:
  state = program.init_state()
  checkpointer = _checkpointer(config, workdir, defaults, read_only=True)
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
  return scores


def train(
  config: TrainConfig | ml_collections.ConfigDict, workdir: str, defaults=None
) -> dict[str, float]:
  """Trains (or resumes) as `config` says, writing logs and checkpoints to `workdir`.

  The workdir is locked for the run (`workdir.lock`, by process 0): a second trainer on it is
  refused before it builds anything. Returns the last iteration's metrics and the final
  evaluation.
  """
  config = config_lib.typed(config)
  held = workdir_lib.lock(workdir) if jax.process_index() == 0 else contextlib.nullcontext()
  with workdir_lib.prepared(workdir), held:  # a run refused at start-up leaves no empty workdir
    program = build(config)
    try:
      last = _train(config, workdir, program, defaults)
    finally:
      program.close()
  if program.processes.is_main:
    _print(outputs(workdir))
  return last


def _train(config, workdir: str, program: Program, defaults=None) -> dict[str, float]:
  k = config.eval.k
  train_ids = program.spec.task_ids("train")
  eval_ids = list(program.spec.task_ids("eval"))[: config.eval.num_tasks]

  checkpointer = _checkpointer(config, workdir, defaults)
  state = program.init_state()
  rng = _replicated_key(config.seed, program.mesh)
  iteration, position = 0, 0
  main = program.processes.is_main
  try:
    restored = _restore(checkpointer, workdir, "resume", state, rng)
  except BaseException:
    checkpointer.close()
    raise
  if restored is not None:
    iteration, state, rng, progress = restored
    position = int(progress["task_position"])
    logging.info("resumed from iteration %d (task position %d)", iteration, position)
    _print(f"resuming {workdir} from iteration {iteration}", program)
  stream = TaskStream(train_ids, config.seed, position)
  # Process 0 alone writes the logs. Lines of iterations after the checkpoint (a crash between
  # logging and saving) are dropped, and torn lines wherever they are.
  log, bar = None, None
  if main:
    metrics_log.drop_records_from(os.path.join(workdir, "trajectories.jsonl"), iteration + 1)
    log = metrics_log.MetricsLog(
      workdir, tensorboard=config.log.tensorboard, resume_from=iteration + 1
    )
    bar = _progress_bar(config, iteration)
  last: dict[str, float] = {}
  dynamic_sampling = program.learner_config.dynamic_sampling
  # With dynamic sampling the batch keeps B x n rows, padded where informative groups ran short
  # (each process its block of them).
  num_rows = config.rollout.tasks_per_iteration * config.rollout.samples_per_task
  global_rows = num_rows
  num_rows = num_rows // program.processes.count if dynamic_sampling else None
  try:
    with jax.set_mesh(program.mesh):
      while iteration < config.num_iterations:
        t0 = time.perf_counter()
        rng, k_rollout, k_update = jax.random.split(rng, 3)
        tasks = stream.take(config.rollout.tasks_per_iteration)
        with jax.set_mesh(program.decode.mesh):  # the sampler on the decode layout
          # The key comes from the learner's (checkpointed, on the learner's mesh): replicated
          # on the decode mesh like every other input of the sampler.
          k_rollout = _key_on(k_rollout, program.decode.mesh)
          decode_params = program.decode(state.params)
          result = program.roller.run(
            decode_params, tasks, config.rollout.samples_per_task, k_rollout
          )
          if dynamic_sampling:  # DAPO: more tasks until the batch holds B informative groups
            result = refill_informative_groups(
              program.roller,
              stream,
              decode_params,
              k_rollout,
              result,
              tasks_per_iteration=config.rollout.tasks_per_iteration,
              samples_per_task=config.rollout.samples_per_task,
              max_refills=program.learner_config.dapo_max_refills,
            )
        t1 = time.perf_counter()
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
        state, learner_metrics = program.update(
          state, learner.shard_batch(batch, program.mesh), k_update
        )
        learner_metrics = jax.device_get(learner_metrics)
        t2 = time.perf_counter()
        iteration += 1
        metrics = dict(result.metrics)
        metrics.update(_scalars(learner_metrics))
        metrics["time/rollout"] = t1 - t0
        metrics["time/update"] = t2 - t1
        metrics["time/iteration"] = t2 - t0
        metrics["time/env_wait_share"] = result.metrics["rollout/env_wait_time"] / (t2 - t0)
        evaluated = _due(iteration, config.eval.every, config.num_iterations)
        if evaluated:
          metrics.update(_evaluate(program, state, eval_ids, config, iteration, k))
        if log is not None:
          log.write(iteration, metrics)
          if evaluated and config.log.plot:  # the figures so far, at every evaluation
            plot(config, workdir, program.spec)
        _log_trajectories(workdir, iteration, result.trajectories, program, config.log.trajectories)
        last = metrics
        if bar is not None:
          bar.update(1)
          bar.set_postfix(
            reward=f"{metrics.get('reward', float('nan')):.3f}",
            success=f"{metrics.get('success', float('nan')):.3f}",
          )
        final = iteration == config.num_iterations
        if checkpointer.should_save(iteration) or final:
          progress = {"iteration": iteration, "task_position": stream.position}
          checkpointer.save(iteration, state, rng, progress, force=final)
  finally:
    if bar is not None:
      bar.close()
    if log is not None:
      log.close()
    checkpointer.close()
  if config.save_hf:
    _save_hf(workdir, program, state)
  return last


def _print(text: str, program: Optional[Program] = None) -> None:
  """Prints above the progress bar (tqdm.write), so the bar stays one line; in process 0 only."""
  import tqdm  # pylint: disable=g-import-not-at-top

  if program is None or program.processes.is_main:
    tqdm.tqdm.write(text)


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
  return (every > 0 and iteration % every == 0) or iteration == total


def _progress_bar(config, start: int):
  if not config.log.progress_bar:
    return None
  import tqdm  # pylint: disable=g-import-not-at-top

  return tqdm.tqdm(total=config.num_iterations, initial=start, desc="train", unit="it")


def _evaluate(program: Program, state, eval_ids, config, iteration: int, k: int) -> dict:
  k_eval = 1 if config.eval.greedy else k
  t0 = time.perf_counter()
  with jax.set_mesh(program.decode.mesh):  # the sampler on the decode layout
    scores = evaluation.evaluate(
      program.eval_roller,
      program.decode(state.params),
      eval_ids,
      k_eval,
      _eval_key(config.seed, iteration),
      config.eval.tasks_per_call,
    )
  out = {f"eval/{name}": value for name, value in scores.items()}
  out["time/eval"] = time.perf_counter() - t0
  row = {"iteration": iteration, **{n: v for n, v in scores.items()}}
  _print(metrics_log.format_table([row], list(row)), program)
  return out


def _log_trajectories(workdir, iteration, trajectories, program, count: int) -> None:
  """Appends the first `count` trajectories' text and metadata to trajectories.jsonl.

  Many processes: the first `count` of the batch (each process's first ones gathered, in
  process order), written by process 0.
  """
  if count <= 0:
    return
  records = []
  for t in trajectories[:count]:
    record = {"iteration": iteration, **t.metadata(), "replies": t.replies}
    record["text"] = program.tokenizer.decode(t.tokens)
    records.append(record)
  records = program.processes.concat(records)[:count]
  if not program.processes.is_main:
    return
  with open(os.path.join(workdir, "trajectories.jsonl"), "a", encoding="utf-8") as f:
    for record in records:
      f.write(json.dumps(record) + "\n")


def plot(config: TrainConfig, workdir: str, spec: envs.EnvSpec) -> dict[str, Any]:
  """Writes `curves.png` (the learning curves) and `diagnostics.png` (the rest) from the
  workdir's metrics.jsonl; returns {file name: matplotlib Figure}."""
  records = metrics_log.read_metrics(os.path.join(workdir, metrics_log.METRICS_FILE))
  k = 1 if config.eval.greedy else config.eval.k
  title = f"{config.env.name}, {config.learner.algorithm}: {workdir}"
  return {
    CURVES_FILE: metrics_log.plot_panels(
      records, os.path.join(workdir, CURVES_FILE), curve_panels(k, spec.chance), title=title
    ),
    DIAGNOSTICS_FILE: metrics_log.plot_panels(
      records, os.path.join(workdir, DIAGNOSTICS_FILE), DIAGNOSTIC_PANELS, title=title, columns=3
    ),
  }


def outputs(workdir: str) -> str:
  """The short block printed when a run ends: where its outputs are, and what they are."""
  names = sorted(os.listdir(workdir)) if os.path.isdir(workdir) else []
  shown = [n + "/" if os.path.isdir(os.path.join(workdir, n)) else n for n in names]
  lines = [f"outputs in {workdir}:", "  " + "  ".join(n for n in shown if not n.startswith("."))]
  hints = {
    CURVES_FILE: "the learning curves",
    metrics_log.METRICS_FILE: "one JSON line per iteration",
    metrics_log.TENSORBOARD_DIR + "/": f"tensorboard --logdir {workdir}/tensorboard",
  }
  lines += [f"  {name}: {hint}" for name, hint in hints.items() if name in shown]
  return "\n".join(lines)


def _save_hf(workdir: str, program: Program, state) -> None:
  """The HF export of the final policy (`save_hf=True`): `<workdir>/hf_policy`."""
  params = state.params
  if program.processes.count > 1:  # every process takes part; process 0 writes
    params = distributed.fetch(params)
  if program.processes.is_main:
    out = os.path.join(workdir, "hf_policy")
    hf_checkpoint.save(params, program.model_config, out)
    program.tokenizer.save_pretrained(out)
    logging.info("saved the final policy as a HF checkpoint in %s", out)
