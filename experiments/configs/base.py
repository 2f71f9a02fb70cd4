"""The shared shape of every training config; per-program files change only what differs."""

import dataclasses

import ml_collections
from ml_collections import config_dict

from seeupo_jax.learner import LearnerConfig
from seeupo_jax.rollout import RolloutConfig
from seeupo_jax.sampling import SessionConfig


def options(**kwargs) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(kwargs)


def default(cls, name: str):
  """The default of field `name` of dataclass `cls` (declared there, once)."""
  return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def learner_section(**overrides) -> ml_collections.ConfigDict:
  """Every `LearnerConfig` field with its default (None defaults typed, so they can be set)."""
  section = ml_collections.ConfigDict()
  for field in dataclasses.fields(LearnerConfig):
    if field.name == "num_turns":  # set from rollout.max_turns
      continue
    value = overrides.pop(field.name, field.default)
    if value is None:
      kind = str(field.type)  # "Optional[str]", "Optional[float]", ... (postponed annotations)
      value = config_dict.placeholder(
        next((t for t in (str, bool, int) if t.__name__ in kind), float)
      )
    section[field.name] = value
  if overrides:
    raise ValueError(f"unknown LearnerConfig fields: {sorted(overrides)}")
  return section


def training_config() -> ml_collections.ConfigDict:
  """Defaults of `program = "train"`: a tiny model from scratch, sized for a 2-core CPU."""
  c = ml_collections.ConfigDict()
  c.program = "train"
  c.seed = 0
  c.num_iterations = 300
  c.save_hf = False
  c.policy = "model"  # "oracle": play every task with the environment's oracle (no model)
  c.eval_only = False  # evaluate the workdir's latest checkpoint, no training

  c.model = options(
    preset="qwen3-tiny",  # used when path is empty: initialised from scratch
    path="",  # a local HF Qwen2/Qwen2.5/Qwen3 checkpoint directory (its tokenizer too)
    dtype="float32",  # activations: float32 or bfloat16
    param_dtype="float32",
    remat="none",
    scan_layers=True,
  )
  c.chat_template_kwargs = ml_collections.ConfigDict()  # e.g. enable_thinking=False (Qwen3)

  c.env = options(name="synthetic")

  c.rollout = options(
    tasks_per_iteration=16,  # B
    samples_per_task=8,  # n (the GRAE group size)
    max_turns=3,
    max_context_tokens=160,
    max_reply_tokens=1,  # the synthetic task reads the first character; raise for real agents
    max_env_tokens=64,
    # environment calls in flight (threads; worker processes with "process")
    env_workers=default(RolloutConfig, "env_workers"),
    # "thread", "process" (time limits), "auto": the environment's choice
    env_isolation=default(RolloutConfig, "env_isolation"),
    # per call in worker processes; a reply's call past it -> an error
    env_call_timeout_s=default(RolloutConfig, "env_call_timeout_s"),
    # each worker process's address-space limit (0: none)
    env_memory_limit_mb=default(RolloutConfig, "env_memory_limit_mb"),
    reset_retries=default(RolloutConfig, "reset_retries"),  # a failing reset, tried again
    # an episode whose environment failed, played again from the start
    episode_retries=default(RolloutConfig, "episode_retries"),
    # above this share of failed groups the run stops
    max_failed_group_fraction=default(RolloutConfig, "max_failed_group_fraction"),
    # "turns": the turn-synchronous baseline (a barrier per turn)
    scheduler=default(RolloutConfig, "scheduler"),
    # The sampler session's geometry (`sampling.SessionConfig`):
    decode_slots=default(SessionConfig, "rows"),  # the sampler's rows: most episodes live at once
    # decode steps between host reads of finished replies
    decode_steps_per_sync=default(SessionConfig, "decode_steps_per_sync"),
    page_size=default(SessionConfig, "page_size"),  # KV-cache slots per page
    # the widest prefill call (also C/8, C/4, C/2; longer: several)
    prefill_chunk=default(SessionConfig, "prefill_chunk"),
    # the rows of every prefill call (more rows with new tokens: several)
    prefill_rows=default(SessionConfig, "prefill_rows"),
    decode_tensor_parallel=0,  # the sampler's tensor-parallel size (0: one data slice's devices)
    temperature=1.0,
    top_k=0,
    top_p=1.0,
  )

  c.learner = learner_section(kl_coef=0.0)  # from scratch: no reference model to stay near
  c.learner.algorithm = "seeupo"

  c.optimizer = options(
    learning_rate=1e-3,
    weight_decay=0.0,
    max_grad_norm=1.0,
    warmup_steps=0,
    master_weights=True,  # bf16 params: float32 masters + moments (False: updates round away)
  )

  c.eval = options(every=25, num_tasks=64, k=4, greedy=False, tasks_per_call=64)
  c.checkpoint = options(every=25, keep=3)
  c.log = options(tensorboard=True, progress_bar=True, plot=True, trajectories=2)
  c.mesh = options(data=1, fsdp=-1, tensor=1)
  return c


def agent_config(env_name: str, *, max_turns: int, max_context_tokens: int, max_env_tokens: int):
  """A benchmark config: the paper's Qwen3-14B setting on environment `env_name`."""
  c = training_config()
  c.env.name = env_name
  c.rollout.max_turns = max_turns
  c.rollout.max_context_tokens = max_context_tokens
  c.rollout.max_reply_tokens = 2048
  c.rollout.max_env_tokens = max_env_tokens
  c.rollout.tasks_per_iteration = 32
  c.rollout.samples_per_task = 8
  c.rollout.temperature = 0.9
  c.model.preset = ""  # no model until --config.model.path names a checkpoint
  c.learner.kl_coef = 0.002
  c.optimizer.learning_rate = 1e-6
  c.optimizer.weight_decay = 0.01
  return c
