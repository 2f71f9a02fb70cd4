"""Text truncation: an observation's messages cut to a token budget, each cut marked."""

from __future__ import annotations

from typing import Callable, Sequence

from seeupo_jax.envs import base as envs_base

TRUNCATION_MARKER = "\n[... observation truncated]"


def truncate_observation(
  messages: Sequence[envs_base.Message],
  budget: int,
  count_tokens: Callable[[str], list[int]],
  decode: Callable[[list[int]], str],
) -> tuple[list[envs_base.Message], int]:
  """Cuts the messages' text to `budget` tokens in all, marking each cut message.

  Returns (messages, number of tokens cut).
  """
  texts = [m.get("content") for m in messages if isinstance(m.get("content"), str)]
  if sum(len(t.encode("utf-8")) for t in texts) <= budget:  # byte-level BPE: tokens <= bytes
    return list(messages), 0
  out, cut = [], 0
  for message in messages:
    content = message.get("content")
    if not isinstance(content, str):
      out.append(message)
      continue
    ids = count_tokens(content)
    if len(ids) <= budget:
      budget -= len(ids)
      out.append(message)
      continue
    cut += len(ids) - budget
    out.append({**message, "content": decode(ids[:budget]) + TRUNCATION_MARKER})
    budget = 0
  return out, cut
