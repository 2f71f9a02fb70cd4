"""Greedy decoding of our sampler vs transformers' PyTorch `generate`, token for token.

Tiny random Qwen2 / Qwen3 checkpoints are written with `save_pretrained` and read
back through `seeupo_jax.models.checkpoint.load`; prompts come from the default
tokenizer's chat template, left-padded to one batch.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

torch = pytest.importorskip("torch")

import hf_fixtures  # noqa: E402  (needs torch)
from seeupo_jax import sampling  # noqa: E402
from seeupo_jax.models import checkpoint  # noqa: E402
import tiny  # noqa: E402

pytestmark = pytest.mark.parity
N_NEW = 32
QUESTIONS = ["What is the weather in Paris?", "Hi", "List the files in my documents folder."]


def _prompts():
  tok = tiny.tokenizer()
  rows = [
    tok.apply_chat_template(
      [{"role": "user", "content": q}], tokenize=True, add_generation_prompt=True
    )["input_ids"]
    for q in QUESTIONS
  ]
  width = max(len(r) for r in rows)
  ids = np.full((len(rows), width), tok.pad_token_id, np.int64)
  valid = np.zeros((len(rows), width), bool)
  for b, r in enumerate(rows):
    ids[b, width - len(r) :] = r
    valid[b, width - len(r) :] = True
  assert len({len(r) for r in rows}) == len(rows)  # mixed lengths
  return ids, valid, tok.pad_token_id


# Tied tiny random models greedily repeat one token (the embedding row of the last token
# scores highest), so only the untied ones are asked to produce varied text; the tied case
# still checks the ids and the log-prob of every step.
@pytest.mark.parametrize("family,tied", [("qwen3", False), ("qwen2", False), ("qwen2", True)])
def test_greedy_matches_transformers_generate(tmp_path, family, tied):
  directory, hf_model = hf_fixtures.make_hf_checkpoint(
    str(tmp_path / family), family, tie_word_embeddings=tied, seed=1
  )
  ids, valid, pad_id = _prompts()

  gen = hf_model.generate(
    input_ids=torch.from_numpy(ids),
    attention_mask=torch.from_numpy(valid.astype(np.int64)),
    generation_config=transformers.GenerationConfig(
      max_new_tokens=N_NEW,
      min_new_tokens=N_NEW,
      do_sample=False,
      pad_token_id=pad_id,
      eos_token_id=None,
      bos_token_id=None,
      return_dict_in_generate=True,
      output_logits=True,
    ),
  )
  want_tokens = gen.sequences[:, ids.shape[1] :].numpy()
  step_logits = torch.stack(gen.logits, dim=1).double()  # [B, N, V]
  want_logp = (
    torch.log_softmax(step_logits, dim=-1)
    .gather(-1, torch.from_numpy(want_tokens)[..., None])[..., 0]
    .numpy()
  )
  assert want_tokens.shape == (len(QUESTIONS), N_NEW)

  config, params = checkpoint.load(directory)
  assert config.tie_word_embeddings == tied and config.family == family
  sample = sampling.make_sampler(
    config, sampling.SamplingConfig(max_new_tokens=N_NEW, greedy=True, pad_id=pad_id)
  )
  out = sample(params, jnp.asarray(ids, jnp.int32), jnp.asarray(valid), jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(out.tokens), want_tokens)
  np.testing.assert_array_equal(np.asarray(out.lengths), N_NEW)
  np.testing.assert_allclose(np.asarray(out.logprobs), want_logp, atol=1e-4)
  # The random model does not just repeat one token.
  if not tied:
    assert all(len(set(row)) > 3 for row in want_tokens.tolist())
