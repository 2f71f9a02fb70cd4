"""The HF export of the trained policy: `<workdir>/hf_policy`, a safetensors checkpoint and its
tokenizer (`save_hf=True`)."""

from __future__ import annotations

import os

from absl import logging

from seeupo_jax import distributed
from seeupo_jax import learner
from seeupo_jax.models import lora
from seeupo_jax.models import checkpoint as hf_checkpoint

HF_POLICY_DIR = "hf_policy"


def save_hf(workdir: str, program, state) -> None:
  """The HF export of the final policy (`save_hf=True`): `<workdir>/hf_policy`.

  Args:
    workdir: the run's directory.
    program: the built `program.Program` (its model config, tokenizer and processes).
    state: the learner's `TrainState`; its policy is exported (with LoRA, the adapters merged
      into the base's kernels).
  """
  params = learner.policy_params(state)
  if program.model_config.lora_rank:  # the adapters merged: W + alpha / r * A B
    params = lora.merge(params, program.model_config.lora_scale)
  if program.processes.count > 1:  # every process takes part; process 0 writes
    params = distributed.fetch(params)
  if program.processes.is_main:
    out = os.path.join(workdir, HF_POLICY_DIR)
    hf_checkpoint.save(params, program.model_config, out)
    program.tokenizer.save_pretrained(out)
    logging.info("saved the final policy as a HF checkpoint in %s", out)
