"""The HF export of the trained policy (`save_hf=True`): `<workdir>/hf_policy`, a safetensors
checkpoint and its tokenizer; with LoRA, the adapters merged there and, in PEFT's format,
`<workdir>/hf_adapter`."""

from __future__ import annotations

import os

from absl import logging

from seeupo_jax import distributed
from seeupo_jax import learner
from seeupo_jax.models import lora
from seeupo_jax.models import checkpoint as hf_checkpoint
from seeupo_jax.models import peft_io

HF_POLICY_DIR = "hf_policy"
HF_ADAPTER_DIR = "hf_adapter"


def save_hf(workdir: str, program, state, base_model_path: str = "") -> None:
  """The HF export of the final policy (`save_hf=True`): `<workdir>/hf_policy`, and with LoRA
  the adapters alone in PEFT's format, `<workdir>/hf_adapter` (`peft.PeftModel.from_pretrained`
  on the base checkpoint `model.path`).

  Args:
    workdir: the run's directory.
    program: the built `program.Program` (its model config, tokenizer and processes).
    state: the learner's `TrainState`; its policy is exported (with LoRA, the adapters merged
      into the base's kernels).
    base_model_path: the HF base checkpoint (`model.path`), recorded in the PEFT adapter.
  """
  config = program.model_config
  params = learner.policy_params(state)
  adapters = None
  if config.lora_rank:  # the adapters merged: W + alpha / r * A B
    adapters = lora.split(params)[0]
    params = lora.merge(params, config.lora_scale)
  if program.processes.count > 1:  # every process takes part; process 0 writes
    params = distributed.fetch(params)
    adapters = None if adapters is None else distributed.fetch(adapters)
  if program.processes.is_main:
    out = os.path.join(workdir, HF_POLICY_DIR)
    hf_checkpoint.save(params, config, out)
    program.tokenizer.save_pretrained(out)
    logging.info("saved the final policy as a HF checkpoint in %s", out)
    if adapters is not None:
      out = os.path.join(workdir, HF_ADAPTER_DIR)
      peft_io.save(adapters, config, out, base_model_name_or_path=base_model_path)
      logging.info("saved the LoRA adapters in PEFT's format in %s", out)
