"""Tests of seeupo_jax.text.tokenizer: the offline BPE tokenizer, its chat template, loading."""

import json
import os
import subprocess
import sys
import unicodedata

import hypothesis
import hypothesis.strategies as st
import pytest
import transformers

from seeupo_jax.text import tokenizer as tokenizer_lib


def _fingerprint(tok):
  """Vocab and merges of the backend tokenizer, as plain JSON."""
  model = json.loads(tok.backend_tokenizer.to_str())["model"]
  return json.dumps(
    {
      "vocab": model["vocab"],
      "merges": model["merges"],
      "added": sorted(tok.get_added_vocab().items()),
    },
    sort_keys=True,
  )


def test_build_is_deterministic_across_processes(tok):
  again = tokenizer_lib.build_default_tokenizer()
  assert _fingerprint(again) == _fingerprint(tok)
  # A fresh interpreter with a different hash seed (hash maps iterate differently).
  code = (
    "import json; from seeupo_jax.text import tokenizer as t; tok = t.build_default_tokenizer();"
    "m = json.loads(tok.backend_tokenizer.to_str())['model'];"
    "print(json.dumps({'vocab': m['vocab'], 'merges': m['merges'],"
    "'added': sorted(tok.get_added_vocab().items())}, sort_keys=True))"
  )
  env = dict(os.environ, PYTHONHASHSEED="12345", RAYON_NUM_THREADS="2")
  out = subprocess.run(
    [sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True
  ).stdout.strip()
  assert out == _fingerprint(tok)


def test_vocabulary_layout(tok):
  assert len(tok) == 512
  # 256 byte symbols first, merges next, the added tokens last in a fixed order.
  added = list(tokenizer_lib.SPECIAL_TOKENS + tokenizer_lib.TOOL_TOKENS)
  assert [tok.convert_tokens_to_ids(t) for t in added] == list(range(512 - len(added), 512))
  assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
  assert tok.bos_token is None
  merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
  assert len(merges) == 512 - 256 - len(added)


def test_vocab_size_is_configurable_and_validated():
  assert len(tokenizer_lib.build_default_tokenizer(300)) == 300
  with pytest.raises(ValueError, match="vocab_size"):
    tokenizer_lib.build_default_tokenizer(100)
  with pytest.raises(ValueError, match="corpus supports"):
    tokenizer_lib.build_default_tokenizer(1 << 20)


def test_added_tokens_are_single_ids(tok):
  for t in tokenizer_lib.SPECIAL_TOKENS + tokenizer_lib.TOOL_TOKENS:
    ids = tok(f"a{t}b", add_special_tokens=False)["input_ids"]
    assert tok.convert_tokens_to_ids(t) in ids
    assert tok.decode(ids) == f"a{t}b"
  text = "<|im_start|>assistant\n<tool_call>\n{}\n</tool_call><|im_end|>"
  ids = tok(text)["input_ids"]
  # Control tokens are dropped by skip_special_tokens, tool markup is kept (as in Qwen).
  assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<tool_call>\n{}\n</tool_call>"


@hypothesis.given(st.text(max_size=200))
def test_encode_decode_round_trip(text):
  tok = _cached_tok()
  hypothesis.assume(
    not any(t in text for t in tokenizer_lib.SPECIAL_TOKENS + tokenizer_lib.TOOL_TOKENS)
  )
  ids = tok(text, add_special_tokens=False)["input_ids"]
  assert all(0 <= i < 505 for i in ids)
  # Byte-level BPE is lossless up to the NFC normaliser.
  assert tok.decode(ids) == unicodedata.normalize("NFC", text)


_TOK = []


def _cached_tok():
  if not _TOK:
    _TOK.append(tokenizer_lib.build_default_tokenizer())
  return _TOK[0]


def test_bpe_merges_compress_corpus_text(tok):
  text = "The agent reads the task and calls the tool."
  ids = tok(text)["input_ids"]
  assert len(ids) < len(text.encode()) / 2


TOOLS = [
  {
    "type": "function",
    "function": {
      "name": "get_weather",
      "description": "Weather now.",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
  }
]

CONVERSATION = [
  {"role": "system", "content": "Be brief."},
  {"role": "user", "content": "Weather in Paris and Rome?"},
  {
    "role": "assistant",
    "content": "Checking.",
    "tool_calls": [
      {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
      {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
    ],
  },
  {"role": "tool", "content": '{"t": 18}'},
  {"role": "tool", "content": '{"t": 25}'},
  {"role": "assistant", "content": "18 C and 25 C."},
]

EXPECTED = (
  "<|im_start|>system\nBe brief.\n\n# Tools\n\n"
  "You may call one or more functions to assist with the user query.\n\n"
  "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
  '{"type": "function", "function": {"name": "get_weather", "description": "Weather now.", '
  '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}\n'
  "</tools>\n\nFor each function call, return a json object with function name and arguments "
  "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
  '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
  "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
  "<|im_start|>assistant\nChecking.\n"
  '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
  '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
  '<|im_start|>user\n<tool_response>\n{"t": 18}\n</tool_response>\n'
  '<tool_response>\n{"t": 25}\n</tool_response><|im_end|>\n'
  "<|im_start|>assistant\n18 C and 25 C.<|im_end|>\n"
)


def test_chat_template_with_tools(tok):
  text = tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
  assert text == EXPECTED
  text = tok.apply_chat_template(
    CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True
  )
  assert text == EXPECTED + "<|im_start|>assistant\n"


def test_chat_template_default_system_and_no_tools(tok):
  msgs = [{"role": "user", "content": "Hi"}]
  text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
  assert text == (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
  )
  ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)["input_ids"]
  assert ids == tok(text, add_special_tokens=False)["input_ids"]
  assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_chat_template_rejects_unknown_role(tok):
  with pytest.raises(Exception, match="unknown chat role"):
    tok.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)


def test_save_and_reload(tok, tmp_path):
  tok.save_pretrained(tmp_path)
  for loaded in (
    transformers.AutoTokenizer.from_pretrained(tmp_path, local_files_only=True),
    tokenizer_lib.load_tokenizer(tmp_path),
  ):
    assert len(loaded) == len(tok)
    assert loaded.eos_token_id == tok.eos_token_id
    assert loaded.pad_token_id == tok.pad_token_id
    text = tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    assert loaded.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False) == text
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert tokenizer_lib.stop_token_ids(loaded) == tokenizer_lib.stop_token_ids(tok)


def test_load_tokenizer_errors(tok, tmp_path):
  with pytest.raises(FileNotFoundError, match="not a local directory"):
    tokenizer_lib.load_tokenizer(tmp_path / "missing")
  plain = transformers.PreTrainedTokenizerFast(
    tokenizer_object=tokenizer_lib.build_bpe(), eos_token="<|im_end|>"
  )
  plain.save_pretrained(tmp_path)
  with pytest.raises(ValueError, match="no chat template"):
    tokenizer_lib.load_tokenizer(tmp_path)
  assert tokenizer_lib.load_tokenizer(tmp_path, require_chat_template=False) is not None


def test_stop_token_ids(tok):
  assert tokenizer_lib.stop_token_ids(tok) == sorted(
    [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
  )
