"""The policy the rollout engine drives: something that owes rows replies.

The scheduler (`roller.py`) does not know whether replies come from a model. It gives a row
its new tokens and the reply's key and limit (`give`), lets the policy work (`prefill`,
`decode`), and takes the replies that are ready (`decode` returns them). Two policies:

  SamplerPolicy  the jitted sampler: a `sampling.SamplerSession` (paged KV cache, S rows);
                 replies are the sampled ids with the sampler's log-probs.
  TextPolicy     a function from the trajectory so far to the reply text (the oracle, tests
                 that script replies): the text is tokenized and closed with the end of turn,
                 log-probs 0, ready at once.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Protocol, Sequence

import numpy as np

from seeupo_jax import sampling
from seeupo_jax.text.chat_tokens import ChatTokens
from seeupo_jax.rollout.trajectory import Trajectory


@dataclasses.dataclass(frozen=True)
class PolicyReply:
  """A row's finished reply: token ids, their log-probs (None: no model sampled them), and
  whether it was cut at its limit."""

  row: int
  ids: list[int]
  logprobs: Optional[list[float]]
  cut: bool


class Policy(Protocol):
  """What the rollout engine drives (see the module docstring)."""

  def begin(self, params) -> None:
    """Starts a rollout call with these params (used by every reply until `begin` again)."""

  def give(
    self, row: int, trajectory: Trajectory, new_ids: Sequence[int], key_data: np.ndarray, limit: int
  ) -> None:
    """The row's new tokens (already appended to `trajectory`); it owes a reply of at most
    `limit` tokens drawn from `key_data` (raw uint32[2])."""

  def prefill(self) -> None:
    """Work on the tokens given so far (one bounded step)."""

  def decode(self) -> list[PolicyReply]:
    """Work on the owed replies (one bounded step); the replies that are ready."""

  def release(self, row: int) -> None:
    """The row's episode is over: forget its context."""

  @property
  def busy(self) -> bool:
    """Some row has work in progress (tokens to write or a reply to finish)."""


class SamplerPolicy:
  """The jitted sampler as a policy: a `SamplerSession` of `rows` decode slots."""

  def __init__(self, session: sampling.SamplerSession):
    self.session = session
    self._params = None

  def begin(self, params) -> None:
    self._params = params

  def give(self, row, trajectory, new_ids, key_data, limit) -> None:
    self.session.give(row, new_ids, key_data, limit)

  def prefill(self) -> None:
    self.session.prefill(self._params)

  def decode(self) -> list[PolicyReply]:
    cut = sampling.FinishReason.LENGTH
    return [
      PolicyReply(r.row, r.tokens.tolist(), r.logprobs.tolist(), r.finish_reason == cut)
      for r in self.session.decode(self._params)
    ]

  def release(self, row: int) -> None:
    self.session.release(row)

  @property
  def busy(self) -> bool:
    return self.session.busy


class TextPolicy:
  """Replies from `reply_text(trajectory) -> str`, tokenized and closed with the end of turn
  (cut, without it, at the limit); log-probs None (0 in the trajectory)."""

  def __init__(self, reply_text: Callable[[Trajectory], str], chat: ChatTokens):
    self.reply_text = reply_text
    self.chat = chat
    self._ready: list[PolicyReply] = []

  def begin(self, params) -> None:
    del params

  def give(self, row, trajectory, new_ids, key_data, limit) -> None:
    ids = self.chat.encode(self.reply_text(trajectory)) + [self.chat.end_of_turn_id]
    self._ready.append(PolicyReply(row, ids[:limit], None, len(ids) > limit))

  def prefill(self) -> None:
    pass

  def decode(self) -> list[PolicyReply]:
    ready, self._ready = self._ready, []
    return ready

  def release(self, row: int) -> None:
    self._ready = [r for r in self._ready if r.row != row]

  @property
  def busy(self) -> bool:
    return bool(self._ready)
