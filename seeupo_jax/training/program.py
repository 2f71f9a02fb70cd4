"""Building the training program from its typed config: model, tokenizer, learner update, rollers.

`build(config)` makes every part `train` runs (a `Program`) and checks what the config alone
cannot (the processes, the devices, the environment), raising ConfigError for a bad value. The
config comes typed (`config.typed`, at the program boundary: `trainer`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
from typing import Any, Optional

from absl import logging
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from seeupo_jax.text import chat_tokens
from seeupo_jax.sampling import layout as decode_layout
from seeupo_jax import distributed
from seeupo_jax import envs
from seeupo_jax import learner
from seeupo_jax.learner import algorithms
from seeupo_jax import rollout
from seeupo_jax import sampling
from seeupo_jax import sharding as sharding_lib
from seeupo_jax.text import tokenizer as tokenizer_lib
from seeupo_jax.models import checkpoint as hf_checkpoint
from seeupo_jax.models import config as model_config_lib
from seeupo_jax.models import lora
from seeupo_jax.models import quant
from seeupo_jax.models import qwen
from seeupo_jax.training import config as config_lib

ConfigError = config_lib.ConfigError
TrainConfig = config_lib.TrainConfig


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


def _model_overrides(m: config_lib.ModelSection) -> dict[str, Any]:
  return dict(
    dtype=m.dtype,
    param_dtype=m.param_dtype,
    remat=m.remat,
    scan_layers=m.scan_layers,
    lora_rank=m.lora.rank,
    lora_alpha=m.lora.alpha,
    lora_targets=tuple(m.lora.targets.split(",")),
    quantize=m.lora.quantize,
  )


def build_model_config(config: TrainConfig) -> model_config_lib.ModelConfig:
  """The `ModelConfig` of `config.model` alone: a checkpoint's config.json, or the preset's;
  no weights, no tokenizer (what an ahead-of-time compile needs)."""
  m = config.model
  if m.path:
    try:
      return hf_checkpoint.load_config(m.path, **_model_overrides(m))
    except (OSError, ValueError) as e:
      raise ConfigError(f"model.path={m.path!r}: {e}") from e
  if not m.preset:
    raise ConfigError(
      f"no model: pass --config.model.path=/path/to/a/local/Qwen3-checkpoint (the paper trains "
      f"Qwen3-14B on {config.env.name}); --config.model.preset=qwen3-tiny builds a tiny model "
      "from scratch, only to check the pipeline"
    )
  try:
    return model_config_lib.get_preset(m.preset, **_model_overrides(m))
  except ValueError as e:
    raise ConfigError(f"model.preset: {e}") from None


def build_model(config: TrainConfig):
  """(ModelConfig, tokenizer, params loader) from `config.model`."""
  m = config.model
  overrides = _model_overrides(m)
  if m.path:
    if not os.path.isdir(m.path):
      raise ConfigError(f"model.path={m.path!r} is not a local checkpoint directory")
    try:  # the headers of every safetensors file too: a truncated file fails here, not later
      model_config = hf_checkpoint.load_config(m.path, **overrides)
      hf_checkpoint.check_files(m.path)
      tokenizer = tokenizer_lib.load_tokenizer(m.path)
    except (OSError, ValueError) as e:
      raise ConfigError(f"model.path={m.path!r}: {e}") from e

    def load(mesh, key):  # the checkpoint's weights, and fresh adapters with LoRA
      params = hf_checkpoint.load(m.path, mesh, **overrides)[1]
      adapters = lora.init_adapters(model_config, jax.random.fold_in(key, 1))
      return lora.combine(params, learner.shard_params(adapters, mesh))

  else:
    model_config = build_model_config(config)
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


def build_sampling_config(
  config: TrainConfig, stop_token_ids: tuple[int, ...], pad_id: int
) -> sampling.SamplingConfig:
  """The rollouts' `SamplingConfig` from `config.rollout` and the tokenizer's stops and pad."""
  r = config.rollout
  return sampling.SamplingConfig(
    max_new_tokens=r.max_reply_tokens,
    temperature=r.temperature,
    top_k=r.top_k,
    top_p=r.top_p,
    stop_token_ids=stop_token_ids,
    pad_id=pad_id,
  )


@dataclasses.dataclass(frozen=True)
class LearnerParts:
  """The learner's update and the optimizers it steps (`build_learner`)."""

  update: Any  # learner.make_update's jitted update (its `.lower` compiles ahead of time)
  optimizer: optax.GradientTransformation
  critic_optimizer: Optional[optax.GradientTransformation]  # PPO only


def build_learner(config: TrainConfig, model_config: model_config_lib.ModelConfig) -> LearnerParts:
  """The SeeUPO (or baseline) update of `config.learner` for the model, with its optimizers."""
  optimizer = build_optimizer(config.optimizer)
  ppo = config.learner.spec.critic
  critic_optimizer = build_optimizer(config.optimizer) if ppo else None
  update = learner.make_update(
    learner.qwen_logprob_fn(model_config, temperature=config.rollout.temperature),
    optimizer,
    config.learner,
    value_fn=learner.qwen_value_fn(model_config) if ppo else None,
    critic_optimizer=critic_optimizer,
  )
  return LearnerParts(update, optimizer, critic_optimizer)


def build_decode_layout(
  config: TrainConfig,
  model_config: model_config_lib.ModelConfig,
  mesh: jax.sharding.Mesh,
  devices=None,
) -> decode_layout.DecodeLayout:
  """The sampler's copy of the params: tensor-parallel (`rollout.decode_tensor_parallel`),
  in the compute dtype, and the reshard that makes it from the learner's; on `devices` when
  given (`pipeline.rollout_devices`), else on the learner's."""
  section = "rollout.decode_tensor_parallel"
  if devices:
    section += ", pipeline.rollout_devices"
  with _config_values(section):
    return decode_layout.DecodeLayout(
      model_config, mesh, tensor=config.rollout.decode_tensor_parallel or None, devices=devices
    )


def split_devices(config: TrainConfig, processes) -> tuple[list, list | None]:
  """(the learner's devices, this process's sampler devices or None): with
  `pipeline.rollout_devices` r > 0, the last r devices of each process are that process's
  sampler's, and the others, every process's, the learner's (one process: the last r devices).

  Raises:
    ConfigError: r leaving the learner no device of a process.
  """
  devices = list(jax.devices())
  r = config.pipeline.rollout_devices
  if not r:
    return devices, None
  fewest = min(collections.Counter(d.process_index for d in devices).values())
  if r >= fewest:
    where = f"the {fewest}" if processes.count == 1 else f"the {fewest} of each process"
    raise ConfigError(
      f"pipeline.rollout_devices={r} leaves the learner no device of {where}; "
      f"allowed: 0 to {fewest - 1}"
    )
  learner_devices, sampler = distributed.split_last_of_each(devices, r)
  return learner_devices, sampler[jax.process_index()]


def check_partial_rollouts(config: TrainConfig, dynamic_sampling: bool) -> None:
  """`pipeline.partial_rollouts` needs a lag (a newer version to swap to while sampling) and no
  dynamic sampling (its refills would sample with params the swap replaced).

  Raises:
    ConfigError: naming the key and what it needs.
  """
  p = config.pipeline
  if not p.partial_rollouts:
    return
  if not p.lag:
    raise ConfigError(
      "pipeline.partial_rollouts=True needs pipeline.lag >= 1 (with lag 0 every batch is "
      "sampled with the newest params already); allowed with lag 0: False"
    )
  if dynamic_sampling:
    raise ConfigError(
      "pipeline.partial_rollouts=True with learner.dynamic_sampling: the refills would sample "
      "with params the swap replaced; allowed together: partial_rollouts=False"
    )


def build(config: TrainConfig) -> Program:
  """Builds the program's parts from the typed training config (`config_lib.typed`).

  Only the config's checks raise ConfigError (what needs the processes, the devices or the
  environment); any other exception is a bug and propagates as it is.

  Raises:
    ConfigError: a bad value (the message names the key and what is allowed).
    envs.EnvironmentUnavailable: the config's environment cannot run here.
  """
  if not isinstance(config, TrainConfig):
    raise TypeError(f"build takes a TrainConfig (config_lib.typed), got {type(config).__name__}")
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
  _check_turn_inputs(config.learner, spec, env_name)
  model_config, tokenizer, load_params = build_model(config)
  with _config_values("chat_template_kwargs"):
    chat = chat_tokens.ChatTokens(tokenizer, dict(config.chat_template_kwargs))
  learner_devices, rollout_devices = split_devices(config, processes)
  if rollout_devices:
    local = {d.id: i for i, d in enumerate(jax.local_devices())}
    logging.info(
      "pipeline.rollout_devices: this process's devices %s sample, %s learn (of %d learning)",
      [local[d.id] for d in rollout_devices],
      [local[d.id] for d in learner_devices if d.id in local],
      len(learner_devices),
    )
  with _config_values("mesh"):
    mesh = sharding_lib.make_mesh(**dataclasses.asdict(config.mesh), devices=learner_devices)
  if processes.count > 1:
    _check_row_blocks(mesh, r.tasks_per_iteration * r.samples_per_task, processes)

  stops = tuple(sorted(set(tokenizer_lib.stop_token_ids(tokenizer)) | {chat.end_of_turn_id}))
  pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
  if processes.count > 1 and r.decode_slots % processes.count:
    raise ConfigError(
      f"rollout.decode_slots={r.decode_slots} must be divisible by the {processes.count} "
      "processes (each samples on decode_slots / processes rows)"
    )
  sampling_config = build_sampling_config(config, stops, pad_id)
  rollout_config = r.rollout_config()
  session_config = r.session_config(processes.count)
  eval_sampling = dataclasses.replace(sampling_config, greedy=config.eval.greedy)
  learner_config = config.learner
  check_partial_rollouts(config, bool(learner_config.dynamic_sampling))
  learner_parts = build_learner(config, model_config)
  optimizer, critic_optimizer = learner_parts.optimizer, learner_parts.critic_optimizer
  ppo = critic_optimizer is not None
  update = learner_parts.update

  # Worker processes start last, once everything else in the config has checked out.
  # The sampler decodes with its own copy of the params (tensor-parallel, compute dtype).
  decode = build_decode_layout(config, model_config, mesh, rollout_devices)
  cache_sharding = decode.cache_sharding
  env_workers = rollout.make_workers(spec, rollout_config.worker_config(spec.isolation))
  try:
    roller, eval_roller = (
      rollout.Roller(
        spec,
        chat,
        config=rollout_config,
        policy=rollout.SamplerPolicy(
          sampling.SamplerSession(
            decode.model_config, sampler_config, session_config, cache_sharding=cache_sharding
          )
        ),
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
    base = None
    if model_config.lora_rank:  # train the adapters; the base stays frozen (and is the reference)
      params, base = lora.split(params)
    critic = None
    if ppo:
      # The critic's trunk starts as a copy of the policy's weights (its own buffers: the update
      # donates both); with LoRA the base's, trained whole (a quantized base dequantized).
      source = params
      if base is not None:
        source = quant.dequantize_params(base, jnp.dtype(model_config.param_dtype))
      trunk = jax.tree.map(jnp.copy, source)
      critic = learner.shard_params(learner.init_qwen_critic(model_config, k_critic, trunk), mesh)
    ref = params if learner_config.kl_coef > 0 and base is None else None
    return learner.init_state(
      params,
      optimizer,
      ref_params=ref,
      critic_params=critic,
      critic_optimizer=critic_optimizer,
      master_weights=config.optimizer.master_weights,
      base=base,
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


def _check_turn_inputs(learner_config, spec: envs.EnvSpec, env_name: str) -> None:
  """The turn-level algorithms need what the environment reports per turn: refused at config
  time where the family gives none (GiGPO: a state key per turn; MT-GRPO: a reward per turn),
  naming the `env` key that turns them on where the family has one
  (`EnvSpec.turn_signals_option`)."""
  need = algorithms.TURN_INPUTS.get(learner_config.spec.advantage)
  if need is not None and not getattr(spec, need[0]):
    option = spec.turn_signals_option
    fix = f": set env.{option}=True" if option else ""
    raise ConfigError(
      f"learner.algorithm={learner_config.algorithm!r} needs an environment that reports "
      f"{need[1]} per turn; env.name={env_name!r} does not (EnvSpec.{need[0]} is False){fix}"
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
