"""The training program's config: one frozen, typed tree, made and checked once at the boundary.

    config = training.config.typed(config_dict)  # ConfigError: "rollout.max_turns=0; allowed: ..."
    config.rollout.max_turns                     # 3, one name for the value everywhere
    config.learner                               # a LearnerConfig (num_turns = rollout.max_turns)

`experiments/run.py` reads `--config` (a file of `experiments/configs` and `--config.a.b=value`
overrides, through `ml_collections.config_flags`) and turns the ConfigDict into a `TrainConfig`
here, before anything is built or started; every part of the program receives the tree. Each
field says what it allows with `seeupo_jax.fields` (the same declarations as the dataclasses the
trainer builds from it: `RolloutConfig`, `SamplingConfig`, `LearnerConfig`, `WorkerConfig`), and
`typed` refuses a config with one `ConfigError` that names every bad key and what it allows, a
missing key, or a key nothing reads. A value has one name: `rollout.max_turns` is the learner's
`num_turns` too (there is no `learner.num_turns` key), `rollout.max_reply_tokens` the sampler's
`max_new_tokens`.

The environment's options (`env.*` but `name`) are checked here too, against the family's own
options dataclass (`envs.options_class`: `SyntheticConfig`, `BfclConfig`, `AppWorldConfig`), and
named as config keys (`env.num_dials=0; allowed: an int >= 1`). Not checked here: what needs
files, servers or devices (the environment's data, the model checkpoint's files, the mesh
against the devices present), which `program.build` checks before any work starts.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import types
from typing import Any, Mapping

import ml_collections
from ml_collections import config_dict

from seeupo_jax import envs
from seeupo_jax import fields
from seeupo_jax import learner
from seeupo_jax import rollout
from seeupo_jax import sampling
from seeupo_jax.models import config as model_config_lib

PROGRAMS = ("train",)
POLICIES = ("model", "oracle")
TURN_LIMIT_OPTIONS = {"appworld": "max_turns"}
"""Environments with an option that limits an episode's replies: the training program sets it to
`rollout.max_turns` (`TrainConfig.env_options`); the `env` section has no key for it."""
MOVED_KEYS = {"env.max_turns": "rollout.max_turns"}
"""Keys that older configs had, and the key that holds the value now: a checkpoint written with
`env.max_turns` (AppWorld configs before commit 6308e64) resumes while the values agree
(`checkpoints.check_config`)."""


class ConfigError(ValueError):
  """A bad config value; the message names the key and the allowed values."""


_POSITIVE = fields.int_at_least(1)


_INHERIT = object()


def _like(
  cls,
  name: str,
  note: str | None = None,
  *,
  description: str | None = None,
  default: Any = _INHERIT,
) -> Any:
  """A field that allows what field `name` of dataclass `cls` allows, and has its default (one
  declaration of both): in `cls`'s words, with a `note` after them, or in the config's own
  `description`. `default=dataclasses.MISSING`: no default here (each config file sets it)."""
  allowed = fields.allowed_of(cls, name)
  if description is not None:
    allowed = fields.Allowed(allowed.ok, description)
  if default is _INHERIT:
    default = fields.default_of(cls, name)
  return fields.field(fields.described(allowed, note) if note else allowed, default)


def _optimizer_default(name: str) -> Any:
  """The default of `learner.default_optimizer`'s argument `name` (the authors' settings)."""
  return inspect.signature(learner.default_optimizer).parameters[name].default


def _lora_targets_ok(value) -> bool:
  names = value.split(",") if isinstance(value, str) else []
  return bool(names) and all(n in model_config_lib.LORA_TARGETS for n in names)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraSection:
  """`model.lora`: LoRA adapters (`models/lora.py`). rank > 0 trains adapters of that rank on
  the `targets` projections beside the frozen base (default: every decoder projection; add
  `lm_head` for the output projection); 0 trains every weight. `quantize` holds
  the base's projections in int8 or NF4 (QLoRA)."""

  rank: int = _like(model_config_lib.ModelConfig, "lora_rank")
  alpha: float = _like(model_config_lib.ModelConfig, "lora_alpha")
  targets: str = fields.field(
    fields.Allowed(
      _lora_targets_ok,
      f"comma-separated names of {list(model_config_lib.LORA_TARGETS)} (at least one)",
    ),
    ",".join(model_config_lib.LORA_LAYER_TARGETS),
  )
  # QLoRA: the frozen base's projections held in int8 or NF4 (`models/quant.py`); needs rank > 0.
  quantize: str = _like(model_config_lib.ModelConfig, "quantize")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSection:
  """`model`: which model, in which dtypes (`program.build_model_config`), with which adapters."""

  preset: str = fields.field(fields.STRING, "")  # used when path is empty ("": none)
  path: str = fields.field(fields.STRING, "")  # a local HF checkpoint directory
  dtype: str = _like(model_config_lib.ModelConfig, "dtype")
  param_dtype: str = _like(model_config_lib.ModelConfig, "param_dtype")
  remat: str = _like(model_config_lib.ModelConfig, "remat")
  scan_layers: bool = _like(model_config_lib.ModelConfig, "scan_layers")
  lora: LoraSection = fields.field(
    fields.Allowed(lambda v: isinstance(v, LoraSection), "the section model.lora"),
    default_factory=LoraSection,
  )


@dataclasses.dataclass(frozen=True)
class EnvSection:
  """`env`: the environment's name and its options (every other key of the section)."""

  name: str
  options: Mapping[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutSection:
  """`rollout`: the batch, the limits, the sampler and the engine (`RolloutConfig`'s fields, each
  under its own name, allow what `RolloutConfig` allows; the sampler session's geometry allows
  what `sampling.SessionConfig` allows, `decode_slots` its `rows`). Defaults are theirs; the
  batch, the turn limit and the lengths depend on the task: each config file sets them."""

  tasks_per_iteration: int = fields.field(_POSITIVE, 32)  # B (the paper's)
  samples_per_task: int = fields.field(_POSITIVE, 8)  # n, the group size (the paper's)
  max_reply_tokens: int = _like(sampling.SamplingConfig, "max_new_tokens")
  temperature: float = _like(  # the sampler's words name its own `greedy`, not a config key
    sampling.SamplingConfig,
    "temperature",
    description="a finite number > 0 (rollouts and evaluation sample at this temperature; "
    "eval.greedy=True evaluates with argmax decoding)",
  )
  top_k: int = _like(sampling.SamplingConfig, "top_k")
  top_p: float = _like(sampling.SamplingConfig, "top_p")
  decode_tensor_parallel: int = fields.field(
    fields.described(fields.int_at_least(0), "0: one data slice's devices"), 0
  )
  max_turns: int = _like(rollout.RolloutConfig, "max_turns")
  max_context_tokens: int = _like(
    rollout.RolloutConfig, "max_context_tokens", default=dataclasses.MISSING
  )
  max_env_tokens: int = _like(rollout.RolloutConfig, "max_env_tokens", default=dataclasses.MISSING)
  env_workers: int = _like(rollout.RolloutConfig, "env_workers")
  env_isolation: str = _like(rollout.RolloutConfig, "env_isolation")
  env_call_timeout_s: float = _like(rollout.RolloutConfig, "env_call_timeout_s")
  env_memory_limit_mb: int = _like(rollout.RolloutConfig, "env_memory_limit_mb")
  reset_retries: int = _like(rollout.RolloutConfig, "reset_retries")
  episode_retries: int = _like(rollout.RolloutConfig, "episode_retries")
  max_failed_group_fraction: float = _like(rollout.RolloutConfig, "max_failed_group_fraction")
  scheduler: str = _like(rollout.RolloutConfig, "scheduler")
  decode_slots: int = _like(sampling.SessionConfig, "rows")
  decode_steps_per_sync: int = _like(sampling.SessionConfig, "decode_steps_per_sync")
  page_size: int = _like(sampling.SessionConfig, "page_size")
  prefill_chunk: int = _like(sampling.SessionConfig, "prefill_chunk")
  prefill_rows: int = _like(sampling.SessionConfig, "prefill_rows")

  def rollout_config(self) -> rollout.RolloutConfig:
    """The engine's `RolloutConfig`: every one of its fields under its own name."""
    values = {f.name: getattr(self, f.name) for f in dataclasses.fields(rollout.RolloutConfig)}
    return rollout.RolloutConfig(**values)

  def session_config(self, num_processes: int = 1) -> sampling.SessionConfig:
    """The sampler session's geometry, its rows this process's share (decode_slots /
    processes)."""
    return sampling.SessionConfig(
      rows=self.decode_slots // num_processes,
      max_context_tokens=self.max_context_tokens,
      page_size=self.page_size,
      prefill_chunk=self.prefill_chunk,
      prefill_rows=self.prefill_rows,
      decode_steps_per_sync=self.decode_steps_per_sync,
    )

  @property
  def generation_budget(self) -> int:
    """The most tokens a trajectory can generate: min(max_context_tokens, max_turns x
    max_reply_tokens) (the prompt and environment output only lower it)."""
    return min(self.max_context_tokens, self.max_turns * self.max_reply_tokens)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerSection:
  """`optimizer`: global-norm clip, then AdamW with an optional linear warm-up; the defaults are
  `learner.default_optimizer`'s (the authors')."""

  learning_rate: float = fields.field(fields.number_above(0), _optimizer_default("learning_rate"))
  weight_decay: float = fields.field(fields.number_at_least(0), _optimizer_default("weight_decay"))
  max_grad_norm: float = fields.field(fields.number_above(0), _optimizer_default("max_grad_norm"))
  warmup_steps: int = fields.field(fields.int_at_least(0), _optimizer_default("warmup_steps"))
  # bf16 params: float32 masters and moments (False: updates below bf16's spacing round away)
  master_weights: bool = fields.field(fields.BOOL, True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalSection:
  """`eval`: avg@k / pass@k on `num_tasks` eval tasks, every `every` iterations (0: at the end)."""

  every: int = fields.field(fields.int_at_least(0), 25)
  num_tasks: int = fields.field(_POSITIVE, 64)
  k: int = fields.field(_POSITIVE, 4)
  greedy: bool = fields.field(fields.BOOL, False)
  tasks_per_call: int = fields.field(_POSITIVE, 64)  # eval tasks played in one rollout call


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointSection:
  """`checkpoint`: save every `every` iterations and, when `every_minutes` > 0, whenever that
  many minutes have passed since the last save (`save_timer.py`); keep the newest `keep`;
  `asynchronous`: write the files while training goes on (`checkpoints.Checkpointer`)."""

  every: int = fields.field(_POSITIVE, 25)
  every_minutes: float = fields.field(fields.described(fields.number_at_least(0.0), "0: off"), 0.0)
  keep: int = fields.field(_POSITIVE, 3)
  asynchronous: bool = fields.field(fields.BOOL, True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogSection:
  """`log`: the writers (`writers.py`); `trajectories` of each iteration to trajectories.jsonl."""

  tensorboard: bool = fields.field(fields.BOOL, True)
  progress_bar: bool = fields.field(fields.BOOL, True)
  plot: bool = fields.field(fields.BOOL, True)
  trajectories: int = fields.field(fields.int_at_least(0), 2)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineSection:
  """`pipeline`: the rollout/update schedule (`training/pipeline.py`). `lag` k: the batch trained
  at iteration i was sampled with the params of iteration i - 1 - k, and is sampled while the
  update before it runs (0: sample, then update). `rollout_devices`: where the sampler runs.
  `partial_rollouts`: with a lag, the sampler swaps to the update's params as soon as they are
  ready, inside the episodes in progress (fresher tokens; the run then depends on timing)."""

  lag: int = fields.field(fields.int_in(0, 8), 0)
  partial_rollouts: bool = fields.field(fields.BOOL, False)
  # The sampler on devices of its own: the last `rollout_devices` devices of each process (the
  # learner's mesh is made of the others, every process's); 0: the learner's devices,
  # time-shared.
  rollout_devices: int = fields.field(
    fields.described(fields.int_at_least(0), "0: the learner's devices"), 0
  )


_MESH_AXIS = fields.Allowed(
  lambda v: fields.is_int(v) and (v >= 1 or v == -1), "an int >= 1, or -1 (the devices left)"
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshSection:
  """`mesh`: the learner's device mesh (-1: the devices the other axes leave)."""

  data: int = fields.field(_MESH_AXIS, 1)
  fsdp: int = fields.field(_MESH_AXIS, -1)
  tensor: int = fields.field(_MESH_AXIS, 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
  """The whole training config, typed and checked (`typed` makes it).

  source: the config as nested plain dicts (its JSON), what checkpoints record and compare.
  """

  program: str = fields.field(fields.one_of(PROGRAMS), "train")
  seed: int = fields.field(fields.int_at_least(0), 0)
  num_iterations: int = fields.field(_POSITIVE, 300)
  save_hf: bool = fields.field(fields.BOOL, False)  # also write an HF checkpoint at the end
  # "oracle": play every task with the environment's oracle (no model)
  policy: str = fields.field(fields.one_of(POLICIES), "model")
  eval_only: bool = fields.field(fields.BOOL, False)  # evaluate the latest checkpoint, no training
  model: ModelSection
  chat_template_kwargs: Mapping[str, Any]
  env: EnvSection
  rollout: RolloutSection
  learner: learner.LearnerConfig
  optimizer: OptimizerSection
  eval: EvalSection
  checkpoint: CheckpointSection
  log: LogSection
  mesh: MeshSection
  pipeline: PipelineSection
  source: Mapping[str, Any] = dataclasses.field(repr=False, compare=False)

  def env_options(self) -> dict[str, Any]:
    """The environment's options: the `env` section's, and its reply limit (if it has one,
    `TURN_LIMIT_OPTIONS`) from rollout.max_turns."""
    options = dict(self.env.options)
    if self.env.name in TURN_LIMIT_OPTIONS:
      options[TURN_LIMIT_OPTIONS[self.env.name]] = self.rollout.max_turns
    return options


_SECTIONS = {
  "model": ModelSection,
  "rollout": RolloutSection,
  "optimizer": OptimizerSection,
  "eval": EvalSection,
  "checkpoint": CheckpointSection,
  "log": LogSection,
  "mesh": MeshSection,
  "pipeline": PipelineSection,
}
_SCALARS = ("program", "seed", "num_iterations", "save_hf", "policy", "eval_only")
_KEYS = _SCALARS + tuple(_SECTIONS) + ("chat_template_kwargs", "env", "learner")
_LEARNER_KEYS = tuple(  # every LearnerConfig field but num_turns (= rollout.max_turns)
  f.name for f in dataclasses.fields(learner.LearnerConfig) if f.name != "num_turns"
)


def _placeholder(annotation: str) -> Any:
  """An unset value a flag can still set: `config_dict.placeholder` of the field's type (from its
  annotation's text, as postponed annotations leave it: "int", "Optional[float]", ...)."""
  kind = next((t for t in (bool, int, str) if t.__name__ in annotation), float)
  return config_dict.placeholder(kind)


def _section_defaults(cls, skip: tuple[str, ...] = ()) -> ml_collections.ConfigDict:
  """Every field of dataclass `cls` (but `skip`) with its default; a field without a default, or
  with None, as a typed placeholder (which `typed` refuses until a config file sets it)."""
  section = ml_collections.ConfigDict()
  for f in dataclasses.fields(cls):
    if f.name in skip:
      continue
    value = f.default
    if value is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
      value = f.default_factory()
    if dataclasses.is_dataclass(value):  # a section within the section (model.lora)
      section[f.name] = _section_defaults(type(value))
      continue
    if value is dataclasses.MISSING or value is None:
      value = _placeholder(str(f.type))
    section[f.name] = value
  return section


def defaults() -> ml_collections.ConfigDict:
  """Every key of the training config with its default, generated from the dataclasses above and
  the library's (`LearnerConfig`, `RolloutConfig`, `SessionConfig`, `SamplingConfig`,
  `ModelConfig`, `default_optimizer`): each default is declared once, in its dataclass.

  The keys that depend on the task have no default (`rollout.max_turns`, `max_reply_tokens`,
  `max_context_tokens`, `max_env_tokens`, `env.name`): they are placeholders that each config
  file of `experiments/configs` sets, and `typed` names any left unset.
  """
  c = ml_collections.ConfigDict()
  for name in _SCALARS:
    c[name] = fields.default_of(TrainConfig, name)
  for name, cls in _SECTIONS.items():
    c[name] = _section_defaults(cls)
  c.chat_template_kwargs = ml_collections.ConfigDict()  # e.g. enable_thinking=False (Qwen3)
  c.env = ml_collections.ConfigDict({"name": config_dict.placeholder(str)})
  c.learner = _section_defaults(learner.LearnerConfig, skip=("num_turns",))
  return c


def _keys_of(values: Mapping[str, Any], names, prefix: str, problems: list[str]) -> dict:
  """`values` restricted to `names`; a missing or unknown key is a problem."""
  missing = [n for n in names if n not in values]
  unknown = sorted(set(values) - set(names))
  problems += [f"{prefix}{n}: missing" for n in missing]
  problems += [f"{prefix}{n}: unknown key; known: {sorted(names)}" for n in unknown]
  return {n: values[n] for n in names if n in values}


def _section(cls, values: Any, name: str, problems: list[str]):
  """Section `name` as dataclass `cls`; its problems appended (None if it cannot be made)."""
  if not isinstance(values, Mapping):
    problems.append(f"{name}: a section of keys {[f.name for f in dataclasses.fields(cls)]}")
    return None
  names = [f.name for f in dataclasses.fields(cls)]
  values = _keys_of(values, names, f"{name}.", problems)
  for f in dataclasses.fields(cls):  # a section within the section (model.lora)
    if f.name in values and f.default_factory is not dataclasses.MISSING:
      inner = type(f.default_factory())
      if dataclasses.is_dataclass(inner):
        values[f.name] = _section(inner, values[f.name], f"{name}.{f.name}", problems)
        if values[f.name] is None:
          return None
  if len(values) < len(names):
    return None
  section = cls(**values)
  refused = fields.problems(section)
  if refused:
    problems.append(str(fields.FieldError(name, refused)))
  return section


def _env_problems(env: Mapping[str, Any], r: RolloutSection | None) -> list[str]:
  """The `env` section checked against its environment's options dataclass (`SyntheticConfig`,
  `BfclConfig`, `AppWorldConfig`), each refusal named as the config's key."""
  name = env["name"]
  if name not in envs.REGISTRY:
    return [f"env.name={name!r}; allowed: one of {sorted(envs.REGISTRY)}"]
  options = {k: v for k, v in env.items() if k != "name"}
  limit = TURN_LIMIT_OPTIONS.get(name)
  known = [f.name for f in dataclasses.fields(envs.options_class(name)) if f.name != limit]
  unknown = sorted(set(options) - set(known))
  if unknown:
    return [f"env.{k}: unknown key; known: {known}" for k in unknown]
  if limit is not None:
    if r is None or not fields.is_int(r.max_turns):
      return []  # refused as rollout.max_turns
    options[limit] = r.max_turns
  try:
    envs.check_options(name, options)
  except fields.FieldError as e:
    return [str(e.under("env"))]
  except ValueError as e:  # a check of several options, in the environment's words
    return [str(e).replace(f"{name}.", "env.", 1)]
  return []


def learner_config(section: Mapping[str, Any], r: RolloutSection) -> learner.LearnerConfig:
  """The `LearnerConfig` of the `learner` section (num_turns = rollout.max_turns).

  With agg="seq-mean-token-sum-norm" (Dr. GRPO) and `norm_length` left unset, norm_length is
  the run's `generation_budget`: the batch's padded length L, which the aggregation divides by
  otherwise, is the longest trajectory rounded up to a bucket (`rollout.collate`), so it would
  change between iterations and rescale the loss; the budget is the same every iteration and is
  the constant the Dr. GRPO paper divides by. `--config.learner.norm_length=N` overrides it.

  Raises:
    fields.FieldError: a bad value, named as LearnerConfig's field.
  """
  values = dict(section)
  values["custom_order"] = tuple(values.get("custom_order") or ())
  config = learner.LearnerConfig(num_turns=r.max_turns, **values)
  if config.agg == "seq-mean-token-sum-norm" and config.norm_length is None:
    config = config.replace(norm_length=r.generation_budget)
  return config


def _batch_split(r: RolloutSection, l: learner.LearnerConfig) -> list[str]:
  """The batch's B x n rows must split into learner.minibatches x learner.microbatches parts
  (else the first update fails, mid-run)."""
  rows, parts = r.tasks_per_iteration * r.samples_per_task, l.minibatches * l.microbatches
  if rows % parts == 0:
    return []
  return [
    f"rollout.tasks_per_iteration x rollout.samples_per_task = {r.tasks_per_iteration} x "
    f"{r.samples_per_task} rows per batch, which learner.minibatches x learner.microbatches = "
    f"{l.minibatches} x {l.microbatches} must divide"
  ]


def typed(config: ml_collections.ConfigDict | TrainConfig) -> TrainConfig:
  """The config as a checked `TrainConfig` (one already typed is returned as it is).

  Args:
    config: a training config (`defaults()`'s keys), overrides applied.

  Raises:
    ConfigError: naming every bad key and what it allows (a missing key, an unknown one, a
      value out of range, a learner setting the algorithm refuses, a batch the learner's
      mini- and micro-batches do not divide).
  """
  if isinstance(config, TrainConfig):
    return config
  source = json.loads(config.to_json_best_effort())
  problems: list[str] = []
  values = _keys_of(source, _KEYS, "", problems)
  scalars = {n: values[n] for n in _SCALARS if n in values}
  sections = {n: _section(cls, values.get(n, {}), n, problems) for n, cls in _SECTIONS.items()}
  env = values.get("env", {})
  if not isinstance(env, Mapping) or not isinstance(env.get("name"), str):
    problems.append("env.name: missing (a string naming the environment)")
  elif TURN_LIMIT_OPTIONS.get(env["name"]) in env:
    key = TURN_LIMIT_OPTIONS[env["name"]]
    problems.append(f"env.{key}: not a key; the reply limit is rollout.max_turns (one name)")
  else:
    problems += _env_problems(env, sections["rollout"])
  chat = values.get("chat_template_kwargs", {})
  if not isinstance(chat, Mapping):
    problems.append(f"chat_template_kwargs={chat!r}; allowed: a section of keyword arguments")
  learner_values = _keys_of(values.get("learner", {}), _LEARNER_KEYS, "learner.", problems)
  for name in _SCALARS:  # checked as TrainConfig's own fields
    allowed = fields.allowed_of(TrainConfig, name)
    if name in scalars and not allowed.ok(scalars[name]):
      problems.append(f"{name}={scalars[name]!r}; allowed: {allowed.description}")
  r = sections["rollout"]
  learner_cfg = None
  rollout_ok = r is not None and not fields.problems(r)
  if rollout_ok and len(learner_values) == len(_LEARNER_KEYS):
    try:
      learner_cfg = learner_config(learner_values, r)
    except fields.FieldError as e:
      problems.append(str(e.under("learner")))
  if learner_cfg is not None:
    problems += _batch_split(r, learner_cfg)
  m = sections["model"]
  quantized = m is not None and m.lora.quantize in model_config_lib.QUANTIZE_FORMATS[1:]
  if quantized and m.lora.rank == 0:
    problems.append(
      f"model.lora.quantize={m.lora.quantize!r} needs model.lora.rank > 0 (a quantized base is "
      "frozen: only adapters train beside it); allowed with rank 0: 'none'"
    )
  if problems:
    raise ConfigError("; ".join(problems))
  return TrainConfig(
    **scalars,
    **sections,
    chat_template_kwargs=types.MappingProxyType(dict(chat)),
    env=EnvSection(
      name=env["name"],
      options=types.MappingProxyType({k: v for k, v in env.items() if k != "name"}),
    ),
    learner=learner_cfg,
    source=types.MappingProxyType(source),
  )
