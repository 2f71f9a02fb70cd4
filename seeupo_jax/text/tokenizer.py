"""Tokenizers: a checkpoint's own (`load_tokenizer`) and a small offline default.

`load_tokenizer(path)` opens the tokenizer of a local Hugging Face checkpoint
directory (with its chat template) through `transformers.AutoTokenizer`, never
touching the network.

`build_default_tokenizer()` builds, with no download, a small byte-level BPE
tokenizer in the Qwen style: the Qwen pre-tokenizer regex + byte-level
alphabet, BPE merges trained on a corpus shipped in `seeupo_jax/assets/`, the
Qwen special tokens appended after the BPE vocabulary, and a Qwen-style
(ChatML + Hermes tool calls) chat template. The build is deterministic: the
same vocabulary and merges every time, in every process. Its total size
(`len(tokenizer)`) is `vocab_size`, 512 by default, which fits the tiny model
presets (vocab 512).
"""

from __future__ import annotations

import importlib.resources
import os

import tokenizers
import transformers
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

# The Qwen2/Qwen2.5/Qwen3 pre-tokenizer split pattern (same as tokenizer.json of those checkpoints).
PRETOKENIZE_REGEX = (
  r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
  r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Control tokens: special (dropped by `decode(..., skip_special_tokens=True)`).
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Tool-call markup: single added tokens, but kept by `skip_special_tokens` (as in Qwen), so the
# text of an assistant turn still shows its tool calls.
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

DEFAULT_VOCAB_SIZE = 512
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
CORPUS_FILE = "tokenizer_corpus.txt"

# Qwen-style chat template (ChatML turns, Hermes-style tools). Differences from Qwen2.5's:
# the default system prompt is neutral, and `tool_call.arguments` may be a JSON string (emitted
# as is) or a mapping (emitted with `tojson`), as Qwen3's template does.
CHAT_TEMPLATE = (
  "{%- set default_system = '" + DEFAULT_SYSTEM_PROMPT + "' %}"
  "{%- if messages and messages[0]['role'] == 'system' %}"
  "{%- set system_message = messages[0]['content'] %}"
  "{%- set loop_messages = messages[1:] %}"
  "{%- else %}"
  "{%- set system_message = default_system %}"
  "{%- set loop_messages = messages %}"
  "{%- endif %}"
  "{{- '<|im_start|>system\\n' + system_message }}"
  "{%- if tools %}"
  "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query."
  "\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
  "{%- for tool in tools %}"
  "{{- '\\n' }}{{- tool | tojson }}"
  "{%- endfor %}"
  "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
  "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
  '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>\' }}'
  "{%- endif %}"
  "{{- '<|im_end|>\\n' }}"
  "{%- for message in loop_messages %}"
  "{%- if message['role'] == 'user' or message['role'] == 'system' %}"
  "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
  "{%- elif message['role'] == 'assistant' %}"
  "{{- '<|im_start|>assistant' }}"
  "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
  "{%- for tool_call in message.get('tool_calls') or [] %}"
  "{%- if tool_call['function'] is defined %}{%- set tool_call = tool_call['function'] %}{%- endif %}"
  "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call['name'] + '\", \"arguments\": ' }}"
  "{%- if tool_call['arguments'] is string %}{{- tool_call['arguments'] }}"
  "{%- else %}{{- tool_call['arguments'] | tojson }}{%- endif %}"
  "{{- '}\\n</tool_call>' }}"
  "{%- endfor %}"
  "{{- '<|im_end|>\\n' }}"
  "{%- elif message['role'] == 'tool' %}"
  "{%- if loop.first or loop_messages[loop.index0 - 1]['role'] != 'tool' %}"
  "{{- '<|im_start|>user' }}"
  "{%- endif %}"
  "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
  "{%- if loop.last or loop_messages[loop.index0 + 1]['role'] != 'tool' %}"
  "{{- '<|im_end|>\\n' }}"
  "{%- endif %}"
  "{%- else %}"
  "{{- raise_exception('unknown chat role ' + message['role'] + '; allowed: system, user, assistant, tool') }}"
  "{%- endif %}"
  "{%- endfor %}"
  "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def read_corpus() -> str:
  """Returns the training text shipped in `seeupo_jax/assets/tokenizer_corpus.txt`."""
  return importlib.resources.files("seeupo_jax.assets").joinpath(CORPUS_FILE).read_text("utf-8")


def build_bpe(vocab_size: int = DEFAULT_VOCAB_SIZE) -> tokenizers.Tokenizer:
  """Trains the Qwen-style byte-level BPE `tokenizers.Tokenizer` on the shipped corpus.

  Ids 0..255 are the 256 byte symbols, then the merges in training order, then
  the special tokens (`SPECIAL_TOKENS` then `TOOL_TOKENS`), so the total size is
  exactly `vocab_size`. Training is single-pass and deterministic.

  Args:
      vocab_size: total number of ids, including the 7 added tokens; must be at
          least 256 + 7 and at most what the corpus supports (checked).

  Returns:
      The tokenizer (normalizer NFC, Qwen split regex, byte-level pre-tokenizer and decoder).
  """
  num_added = len(SPECIAL_TOKENS) + len(TOOL_TOKENS)
  min_size = 256 + num_added
  if not isinstance(vocab_size, int) or vocab_size < min_size:
    raise ValueError(f"vocab_size must be an int >= {min_size}, got {vocab_size!r}")
  tok = tokenizers.Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
  tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence(
    [
      pre_tokenizers.Split(tokenizers.Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
  )
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size - num_added,
    min_frequency=2,
    show_progress=False,
    special_tokens=[],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
  )
  tok.train_from_iterator(read_corpus().splitlines(keepends=True), trainer=trainer)
  if tok.get_vocab_size() != vocab_size - num_added:
    raise ValueError(
      f"vocab_size={vocab_size} is larger than the shipped corpus supports "
      f"(max {tok.get_vocab_size() + num_added})"
    )
  tok.add_special_tokens(
    [tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
  )
  tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
  return tok


def build_default_tokenizer(
  vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> transformers.PreTrainedTokenizerFast:
  """The offline default tokenizer: `build_bpe` wrapped for transformers.

  eos is `<|im_end|>` (the end of an assistant turn, as in Qwen chat
  checkpoints' generation config), pad is `<|endoftext|>`, no bos; the chat
  template is `CHAT_TEMPLATE`. `save_pretrained(dir)` writes files that
  `transformers.AutoTokenizer.from_pretrained(dir)` (or `load_tokenizer(dir)`)
  reloads to an identical tokenizer.

  Args:
      vocab_size: total vocabulary size (see `build_bpe`).
  """
  return transformers.PreTrainedTokenizerFast(
    tokenizer_object=build_bpe(vocab_size),
    eos_token=IM_END,
    pad_token=ENDOFTEXT,
    unk_token=None,
    bos_token=None,
    chat_template=CHAT_TEMPLATE,
    model_max_length=32768,
    clean_up_tokenization_spaces=False,
  )


def load_tokenizer(
  path: str | os.PathLike, *, require_chat_template: bool = True
) -> transformers.PreTrainedTokenizerBase:
  """Loads the tokenizer of a local HF checkpoint directory, offline.

  Args:
      path: directory holding `tokenizer.json` / `tokenizer_config.json` (and
          usually `chat_template.jinja` or a `chat_template` entry).
      require_chat_template: raise if the tokenizer has no chat template
          (agents render every prompt through it).

  Raises:
      FileNotFoundError: `path` is not a directory.
      ValueError: no chat template and `require_chat_template`.
  """
  path = os.fspath(path)
  if not os.path.isdir(path):
    raise FileNotFoundError(f"tokenizer path {path!r} is not a local directory")
  tok = transformers.AutoTokenizer.from_pretrained(
    path, local_files_only=True, trust_remote_code=False
  )
  if require_chat_template and not getattr(tok, "chat_template", None):
    raise ValueError(
      f"the tokenizer in {path!r} has no chat template; pass require_chat_template=False "
      "or add chat_template.jinja to the directory"
    )
  return tok


def stop_token_ids(tokenizer: transformers.PreTrainedTokenizerBase) -> list[int]:
  """Ids that end an assistant turn: `<|im_end|>`, `<|endoftext|>` and eos, when present.

  Returns a sorted list without duplicates, for the sampler's per-row stop sets.
  """
  ids = set()
  for token in (IM_END, ENDOFTEXT, tokenizer.eos_token):
    if token is None:
      continue
    tid = tokenizer.convert_tokens_to_ids(token)
    if tid is not None and tid != tokenizer.unk_token_id:
      ids.add(int(tid))
  return sorted(ids)
