"""Chat-template token handling for multi-turn rollouts: append only, never re-tokenize a reply.

A trajectory's tokens are built in one direction:

    prompt_ids(opening messages)                                  turn_ids -1
    + the reply tokens the sampler produced, as they are            turn_ids t
    + observation_ids(messages that follow the reply)             turn_ids -1
    + the next reply ...

The reply is never decoded and encoded again (a text round trip can change the
tokens: a different BPE split, a normalised character), so the learner trains
on exactly the tokens the policy sampled. Earlier turns are never re-rendered.

`observation_ids` renders the new messages IN CONTEXT: it renders a fixed
stand-in conversation whose last assistant message is a marker, with and
without the new messages, and keeps the text after the marker. That text is
what the template puts after a reply (e.g. "<|im_end|>\\n") followed by the new
messages and the generation prompt. When the model ended its reply with the
template's end-of-turn token, that token is the first of the observation's
tokens and is dropped (the model already sampled it); when the reply was cut
(length limit), the environment side closes the turn with it.

Templates that are not append-only. Qwen3's template re-renders history: it
drops the `<think>` block of assistant turns before the last user message. A
full re-render of the conversation then differs from what the model saw while
sampling. We train on what the model saw: its own tokens, thinking included,
with each turn's observation appended. This is the on-policy choice (the
log-probs of the learner and the sampler are of the same context); the price
is that later turns' contexts are longer than a re-rendered conversation.
"""

from __future__ import annotations

import functools
import json
from typing import Optional, Sequence

import transformers

from seeupo_jax.text.messages import Message

_MARKER = "SEEUPOREPLYMARKER"
_STAND_IN: list[Message] = [
  {"role": "system", "content": "S"},
  {"role": "user", "content": "U"},
  {"role": "assistant", "content": _MARKER},
]


class ChatTokens:
  """Token ids of prompts and observations under one tokenizer's chat template.

  Args:
    tokenizer: a transformers tokenizer with a chat template.
    template_kwargs: extra keyword arguments of `apply_chat_template`
      (e.g. {"enable_thinking": False} for Qwen3).
  """

  def __init__(
    self,
    tokenizer: transformers.PreTrainedTokenizerBase,
    template_kwargs: Optional[dict] = None,
  ):
    if not getattr(tokenizer, "chat_template", None):
      raise ValueError("the tokenizer has no chat template; multi-turn rollouts need one")
    self.tokenizer = tokenizer
    self.template_kwargs = dict(template_kwargs or {})
    # The n samples of a task share its prompt, and observations repeat: render each once.
    self._prompt_cached = functools.lru_cache(maxsize=4096)(self._prompt_from_key)
    self._after_cached = functools.lru_cache(maxsize=4096)(self._after_from_key)
    after = self._after_marker([], tools=None, generation_prompt=False)
    after_ids = self.encode(after)
    if not after_ids:
      raise ValueError(
        "the chat template puts nothing after an assistant reply; cannot tell where a turn ends"
      )
    self.end_of_turn_id = after_ids[0]
    """The token the template closes an assistant turn with (e.g. `<|im_end|>`)."""

  def render(
    self, messages: Sequence[Message], tools: Optional[list], generation_prompt: bool
  ) -> str:
    return self.tokenizer.apply_chat_template(
      list(messages),
      tools=tools,
      tokenize=False,
      add_generation_prompt=generation_prompt,
      **self.template_kwargs,
    )

  def encode(self, text: str) -> list[int]:
    return list(self.tokenizer.encode(text, add_special_tokens=False))

  def _after_marker(self, messages, tools, generation_prompt: bool) -> str:
    text = self.render(_STAND_IN + list(messages), tools, generation_prompt)
    at = text.rfind(_MARKER)
    if at < 0:
      raise ValueError("the chat template dropped the assistant message's content")
    return text[at + len(_MARKER) :]

  def prompt_ids(self, messages: Sequence[Message], tools: Optional[list] = None) -> list[int]:
    """The opening messages rendered with the generation prompt, as token ids."""
    return list(self._prompt_cached(_key(messages, tools)))

  def _prompt_from_key(self, key: str) -> tuple[int, ...]:
    messages, tools = json.loads(key)
    return tuple(self.encode(self.render(messages, tools, generation_prompt=True)))

  def _after_from_key(self, key: str, generation_prompt: bool) -> tuple[int, ...]:
    messages, tools = json.loads(key)
    return tuple(self.encode(self._after_marker(messages, tools, generation_prompt)))

  def observation_ids(
    self,
    messages: Sequence[Message],
    tools: Optional[list] = None,
    *,
    reply_closed: bool,
    generation_prompt: bool = True,
  ) -> list[int]:
    """Token ids to append after a reply: the template's turn end, `messages`, the next prompt.

    Args:
      messages: the environment's messages after the reply (may be empty, e.g.
        to close the trajectory's last turn).
      tools: the episode's tools (some templates render tool messages by them).
      reply_closed: the reply's last sampled token was `end_of_turn_id`; it is
        then not repeated here.
      generation_prompt: end with the template's generation prompt (the
        assistant speaks next).
    """
    ids = list(self._after_cached(_key(messages, tools), generation_prompt))
    if reply_closed:
      if not ids or ids[0] != self.end_of_turn_id:
        raise ValueError(
          "the chat template does not open the text after a reply with its end-of-turn token"
        )
      ids = ids[1:]
    return ids


def _key(messages: Sequence[Message], tools: Optional[list]) -> str:
  """A cache key of messages and tools (canonical JSON; not JSON-able values are stringified)."""
  return json.dumps([list(messages), tools], sort_keys=True, default=str)
