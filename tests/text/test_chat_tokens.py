"""Append-only chat-template tokens: prompts, observations, and what a re-render would give."""

import pytest

from seeupo_jax.text import chat_tokens
import tiny

# A Qwen3-style template: assistant turns before the last user message lose their <think> block,
# so a full re-render of the conversation is not what the model saw while sampling.
THINK_DROPPING_TEMPLATE = (
  "{%- set ns = namespace(last_user=-1) %}"
  "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}"
  "{%- endif %}{%- endfor %}"
  "{%- for m in messages %}"
  "{%- if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in m['content'] %}"
  "{{- '<|im_start|>assistant\\n' + m['content'].split('</think>')[-1].lstrip('\\n') + '<|im_end|>\\n' }}"
  "{%- else %}"
  "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
  "{%- endif %}"
  "{%- endfor %}"
  "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _conversation():
  return [
    {"role": "system", "content": "You open locks."},
    {"role": "user", "content": "Dial 1 of 3. clue: sun."},
    {"role": "assistant", "content": "apple"},
    {"role": "user", "content": "Dial 2 of 3. clue: moon."},
    {"role": "assistant", "content": "zebra"},
    {"role": "tool", "content": '{"result": 3}'},
    {"role": "tool", "content": "second tool result"},
    {"role": "assistant", "content": "done"},
  ]


def _appended(chat, messages):
  """The token stream the rollout builds: prompt, replies as sampled ids, observations."""
  ids = chat.prompt_ids(messages[:2])
  i = 2
  while i < len(messages):
    reply = chat.encode(messages[i]["content"]) + [chat.end_of_turn_id]  # the sampled ids
    ids += reply
    j = i + 1
    while j < len(messages) and messages[j]["role"] != "assistant":
      j += 1
    if j < len(messages):
      ids += chat.observation_ids(messages[i + 1 : j], reply_closed=True)
    i = j
  return ids


def test_append_only_template_equals_full_render(tok):
  """With our ChatML template, prompt + replies + observations == one render of everything."""
  chat = chat_tokens.ChatTokens(tok)
  messages = _conversation()
  full = chat.encode(tok.apply_chat_template(messages, tokenize=False))
  appended = _appended(chat, messages)
  # The full render ends the last reply with "<|im_end|>\n"; the rollout stops at <|im_end|>.
  assert appended == full[: len(appended)]
  assert tok.decode(full[len(appended) :]) == "\n"


def test_reply_cut_by_length_is_closed_by_the_environment_side(tok):
  chat = chat_tokens.ChatTokens(tok)
  closed = chat.observation_ids([{"role": "user", "content": "next"}], reply_closed=True)
  cut = chat.observation_ids([{"role": "user", "content": "next"}], reply_closed=False)
  assert cut == [chat.end_of_turn_id] + closed
  assert tok.decode(cut) == "<|im_end|>\n<|im_start|>user\nnext<|im_end|>\n<|im_start|>assistant\n"


def test_end_of_turn_is_im_end(tok):
  chat = chat_tokens.ChatTokens(tok)
  assert chat.end_of_turn_id == tok.convert_tokens_to_ids("<|im_end|>")


def test_no_generation_prompt_and_empty_observation(tok):
  chat = chat_tokens.ChatTokens(tok)
  assert tok.decode(chat.observation_ids([], reply_closed=False, generation_prompt=False)) == (
    "<|im_end|>\n"
  )


def test_think_dropping_template_trains_on_what_the_model_saw(tok):
  """Qwen3-style: a re-render drops the earlier <think> block; our tokens keep it (as sampled)."""
  tok = tiny.tokenizer()
  tok.chat_template = THINK_DROPPING_TEMPLATE
  chat = chat_tokens.ChatTokens(tok)
  messages = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "first"},
    {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nanswer"},
    {"role": "user", "content": "second"},
    {"role": "assistant", "content": "ok"},
  ]
  appended = tok.decode(_appended(chat, messages))
  rerender = tok.apply_chat_template(messages, tokenize=False)
  assert "<think>\nhmm\n</think>" in appended  # what the model saw when it sampled turn 2
  assert "<think>" not in rerender  # what a re-render would (wrongly) train on
  assert appended.endswith(
    "<|im_start|>user\nsecond<|im_end|>\n<|im_start|>assistant\nok<|im_end|>"
  )


def test_template_without_chat_template_is_refused(tok):
  tok = tiny.tokenizer()
  tok.chat_template = None
  with pytest.raises(ValueError, match="no chat template"):
    chat_tokens.ChatTokens(tok)
