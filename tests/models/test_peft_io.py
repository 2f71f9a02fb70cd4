"""LoRA adapters <-> PEFT (`models/peft_io.py`): torch's `peft` loads our export onto the HF base
and computes our logits; our loader reads what `peft` saves and computes its logits."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seeupo_jax.models import checkpoint as hf_checkpoint
from seeupo_jax.models import lora
from seeupo_jax.models import peft_io
from seeupo_jax.models import qwen
import tiny

TARGETS = ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj", "lm_head")


def _ids():
  return np.asarray(jax.random.randint(jax.random.key(1), (2, 9), 0, 512))


def _logits(params, config, ids):
  pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
  return np.asarray(qwen.forward(params, jnp.asarray(ids), pos, config=config)[0])


def _moved_adapters(config, seed):
  """Adapters with B != 0 (a fresh adapter is the base: it would test nothing)."""
  adapters = lora.init_adapters(config, jax.random.key(seed))
  keys = iter(jax.random.split(jax.random.key(seed + 1), 32))
  return jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape), adapters)


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
  pytest.importorskip("peft")
  import hf_fixtures

  directory = str(tmp_path_factory.mktemp("base"))
  hf_fixtures.save_hf_model(hf_fixtures.build_hf_model("qwen3"), directory)
  config, base = hf_checkpoint.load(directory, dtype="float32", param_dtype="float32")
  return directory, config.replace(lora_rank=4, lora_alpha=8.0, lora_targets=TARGETS), base


def test_peft_loads_our_adapter_onto_the_hf_base_and_computes_our_logits(hf_base, tmp_path):
  import peft
  import torch
  import transformers

  directory, config, base = hf_base
  adapters = _moved_adapters(config, 0)
  out = str(tmp_path / "adapter")
  peft_io.save(adapters, config, out, base_model_name_or_path=directory)
  with open(os.path.join(out, peft_io.CONFIG_FILE)) as f:
    assert json.load(f)["base_model_name_or_path"] == directory

  ids = _ids()
  ours = _logits(lora.combine(base, adapters), config, ids)
  assert np.abs(ours - _logits(base, config, ids)).max() > 1e-2  # the adapters matter
  model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
  model = peft.PeftModel.from_pretrained(model, out).eval()
  with torch.no_grad():
    theirs = model(torch.tensor(ids)).logits.numpy()
  np.testing.assert_allclose(theirs, ours, atol=2e-4, rtol=0)
  # PEFT's merge equals ours.
  merged = model.merge_and_unload()
  with torch.no_grad():
    theirs_merged = merged(torch.tensor(ids)).logits.numpy()
  np.testing.assert_allclose(
    theirs_merged,
    _logits(lora.merge(lora.combine(base, adapters), config.lora_scale), config, ids),
    atol=2e-4,
    rtol=0,
  )


def test_we_load_what_peft_saves_and_compute_its_logits(hf_base, tmp_path):
  import peft
  import torch
  import transformers

  directory, config, base = hf_base
  model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
  peft_config = peft.LoraConfig(
    r=4, lora_alpha=8, target_modules=list(TARGETS), lora_dropout=0.0, task_type="CAUSAL_LM"
  )
  model = peft.get_peft_model(model, peft_config)
  generator = torch.Generator().manual_seed(0)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "lora_" in name:
        p.copy_(0.1 * torch.randn(p.shape, generator=generator))
  model.eval()
  out = str(tmp_path / "peft_saved")
  model.save_pretrained(out)

  adapters = peft_io.load(out, config)
  assert sorted(adapters["layers"]["attn"]) == ["o_proj", "q_proj", "v_proj"]
  assert adapters["layers"]["mlp"]["down_proj"]["lora_a"].shape == (2, 128, 4)
  ids = _ids()
  with torch.no_grad():
    theirs = model(torch.tensor(ids)).logits.numpy()
  np.testing.assert_allclose(_logits(lora.combine(base, adapters), config, ids), theirs, atol=2e-4)
  # And back: our export of what we loaded is the same tensors PEFT wrote.
  again = str(tmp_path / "again")
  peft_io.save(adapters, config, again)
  reread = peft_io.load(again, config)
  jax.tree.map(np.testing.assert_array_equal, reread, adapters)


def _small():
  return tiny.model_config().replace(lora_rank=2, lora_targets=("q_proj",))


def _write_config(directory, **changes):
  os.makedirs(directory, exist_ok=True)
  cfg = peft_io.adapter_config(_small())
  cfg.update(changes)
  with open(os.path.join(directory, peft_io.CONFIG_FILE), "w") as f:
    json.dump(cfg, f)


@pytest.mark.parametrize(
  "key, value",
  [
    ("use_rslora", True),
    ("use_dora", True),
    ("bias", "all"),
    ("rank_pattern", {"q_proj": 8}),
    ("target_modules", "q_proj|v_proj"),
    ("target_modules", ["q_proj", "embed_tokens"]),
    ("peft_type", "IA3"),
  ],
)
def test_an_adapter_we_cannot_express_is_refused_by_its_key(tmp_path, key, value):
  _write_config(str(tmp_path), **{key: value})
  with pytest.raises(ValueError, match=key):
    peft_io.read_config(str(tmp_path))


def test_an_adapter_of_another_rank_is_refused(tmp_path):
  _write_config(str(tmp_path), r=8)
  config = _small()
  with pytest.raises(ValueError, match="rank is 8 but the model's lora_rank is 2"):
    peft_io.load(str(tmp_path), config)
