"""The policy the rollout engine drives: an engine of S rows (slots) that owes rows replies.

The scheduler (`roller.py`) does not know whether replies come from a model, and holds none
of the policy's state. It takes a free row (`take`), gives it its new tokens and the reply's
key and limit (`give`), lets the policy work (`prefill`, `decode`), takes the replies that are
ready (`decode` returns them), and gives the row back when the episode ends (`release`). The
policy owns its rows (which are free, what each holds) and reports its counters (`stats`).
This is JetStream's engine shape (`prefill` / `insert` / `generate` over fixed slots) with the
slots' bookkeeping inside the engine. Two policies:

  SamplerPolicy  the jitted sampler: a `sampling.SamplerSession` (paged KV cache, S rows);
                 replies are the sampled ids with the sampler's log-probs.
  TextPolicy     a function from the trajectory so far to the reply text (the oracle, tests
                 that script replies): the text is tokenized and closed with the end of turn,
                 log-probs 0, ready at once.

`make_policy` builds one of them from configs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Protocol, Sequence

import numpy as np

from seeupo_jax import sampling
from seeupo_jax.text.chat_tokens import ChatTokens
from seeupo_jax.models.config import ModelConfig
from seeupo_jax.rollout.trajectory import Trajectory


@dataclasses.dataclass(frozen=True)
class PolicyReply:
  """A row's finished reply: token ids, their log-probs (None: no model sampled them), and
  whether it was cut at its limit."""

  row: int
  ids: list[int]
  logprobs: Optional[list[float]]
  cut: bool
  # The params version that sampled each token (`Policy.swap`); None: the current version.
  versions: Optional[list[int]] = None


@dataclasses.dataclass(frozen=True)
class PolicyStats:
  """A model policy's counters, cumulative over its life (`Policy.stats`).

  prefill_calls, decode_calls: the compiled programs run.
  decode_steps: batch decode steps (each computes every row).
  decode_row_steps: steps x rows that were decoding.
  peak_cache_slots: the most KV-cache slots the rows held at once.
  live_tokens_at_peak: the rows' tokens in the cache at that moment.
  """

  prefill_calls: int = 0
  decode_calls: int = 0
  decode_steps: int = 0
  decode_row_steps: int = 0
  peak_cache_slots: int = 0
  live_tokens_at_peak: int = 0

  PEAKS = ("peak_cache_slots", "live_tokens_at_peak")
  """The fields that are a high-water mark, not a count: `since` keeps them as they are."""

  @classmethod
  def of(cls, counters: Any) -> "PolicyStats":
    """These fields read from any object that has them (e.g. `SamplerSession.stats`)."""
    return cls(**{f.name: getattr(counters, f.name) for f in dataclasses.fields(cls)})

  def since(self, before: "PolicyStats") -> "PolicyStats":
    """The counts since `before` (this minus that), with this one's high-water marks."""
    return PolicyStats(
      **{
        f.name: getattr(self, f.name) - (0 if f.name in self.PEAKS else getattr(before, f.name))
        for f in dataclasses.fields(self)
      }
    )


class Policy(Protocol):
  """What the rollout engine drives (see the module docstring)."""

  @property
  def slots(self) -> int:
    """S, the policy's rows: the most episodes it holds at once."""

  @property
  def max_reply_tokens(self) -> int:
    """The most tokens of one reply (a `give`'s limit is at most this)."""

  def begin(self, params, version: int = 0) -> None:
    """Starts a rollout call with these params, of this version (used by every reply until
    `swap` or `begin` again); every row is free."""

  def swap(self, params, version: int) -> None:
    """From now on every token is sampled with these params, of this version, also inside the
    replies in progress (a partial rollout: the rows' cache keeps what the earlier params
    wrote; each reply's `versions` say which params sampled which of its tokens)."""

  @property
  def free(self) -> int:
    """The rows free now."""

  def take(self) -> int:
    """A free row, now the caller's until `release` (`free` must be > 0)."""

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
    """The row's episode is over: forget its context; the row is free again."""

  @property
  def busy(self) -> bool:
    """Some row has work in progress (tokens to write or a reply to finish)."""

  def stats(self) -> Optional[PolicyStats]:
    """The policy's counters now (None: a policy without a model has none)."""


class _Rows:
  """S rows that episodes take and give back: the one free list of a policy (the row given
  back last is taken first)."""

  def __init__(self, count: int):
    self.count = count
    self.reset()

  def reset(self) -> None:
    self._free = list(range(self.count - 1, -1, -1))  # row 0 is taken first

  @property
  def free(self) -> int:
    return len(self._free)

  def take(self) -> int:
    if not self._free:
      raise ValueError(f"all {self.count} rows are taken")
    return self._free.pop()

  def give_back(self, row: int) -> None:
    if not 0 <= row < self.count or row in self._free:
      raise ValueError(f"row {row} is not taken")
    self._free.append(row)


class _OwnsRows:
  """What every policy here does with its rows: `slots`, `free` and `take` over `self._rows`."""

  _rows: _Rows

  @property
  def slots(self) -> int:
    return self._rows.count

  @property
  def free(self) -> int:
    return self._rows.free

  def take(self) -> int:
    return self._rows.take()


class SamplerPolicy(_OwnsRows):
  """The jitted sampler as a policy: a `SamplerSession`, its rows the policy's slots."""

  def __init__(self, session: sampling.SamplerSession):
    self.session = session
    self._rows = _Rows(session.config.rows)
    self._params = None
    self._version = 0
    # row -> [(j, v)]: the tokens of its reply from index j on are sampled with version v.
    self._marks: dict[int, list[tuple[int, int]]] = {}

  @property
  def max_reply_tokens(self) -> int:
    return self.session.sampling_config.max_new_tokens

  def begin(self, params, version: int = 0) -> None:
    self._params, self._version = params, version
    self._marks = {}
    self._rows.reset()

  def swap(self, params, version: int) -> None:
    sampled = self.session.reply_progress()  # rows with a reply begun: its tokens so far
    for row, marks in self._marks.items():
      marks.append((sampled.get(row, 0), version))
    self._params, self._version = params, version

  def give(self, row, trajectory, new_ids, key_data, limit) -> None:
    self.session.give(row, new_ids, key_data, limit)
    self._marks[row] = [(0, self._version)]

  def prefill(self) -> None:
    self.session.prefill(self._params)

  def decode(self) -> list[PolicyReply]:
    cut = sampling.FinishReason.LENGTH
    return [
      PolicyReply(
        r.row,
        r.tokens.tolist(),
        r.logprobs.tolist(),
        r.finish_reason == cut,
        _token_versions(self._marks.pop(r.row), len(r.tokens)),
      )
      for r in self.session.decode(self._params)
    ]

  def release(self, row: int) -> None:
    self.session.release(row)
    self._marks.pop(row, None)
    self._rows.give_back(row)

  @property
  def busy(self) -> bool:
    return self.session.busy

  def stats(self) -> PolicyStats:
    return PolicyStats.of(self.session.stats)


def _token_versions(marks: list[tuple[int, int]], n: int) -> list[int]:
  """The version of each of a reply's n tokens: token j's is that of the last mark (i, v)
  with i <= j (marks in the order they were made, their i non-decreasing)."""
  out = [marks[0][1]] * n
  for start, version in marks[1:]:
    out[start:] = [version] * max(0, n - start)
  return out


class TextPolicy(_OwnsRows):
  """Replies from `reply_text(trajectory) -> str`, tokenized and closed with the end of turn
  (cut, without it, at the limit); log-probs None (0 in the trajectory).

  Args:
    reply_text: the trajectory so far -> the reply's text.
    chat: the tokenizer's `ChatTokens`.
    slots: S, the most episodes held at once.
    max_reply_tokens: the most tokens of one reply.
  """

  def __init__(
    self,
    reply_text: Callable[[Trajectory], str],
    chat: ChatTokens,
    *,
    slots: int,
    max_reply_tokens: int,
  ):
    self.reply_text = reply_text
    self.chat = chat
    self._rows = _Rows(slots)
    self.max_reply_tokens = max_reply_tokens
    self._ready: list[PolicyReply] = []

  def begin(self, params, version: int = 0) -> None:
    del params, version
    self._rows.reset()

  def swap(self, params, version: int) -> None:
    del params, version  # replies come from the text function; ready ones keep no version

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
    self._rows.give_back(row)

  @property
  def busy(self) -> bool:
    return bool(self._ready)

  def stats(self) -> None:
    return None


def make_policy(
  chat: ChatTokens,
  model_config: Optional[ModelConfig],
  sampling_config: sampling.SamplingConfig,
  session_config: sampling.SessionConfig,
  *,
  cache_sharding: Optional[Callable[[Any], Any]] = None,
  text_policy: Optional[Callable[[Trajectory], str]] = None,
) -> Policy:
  """The sampler policy of these configs (a `SamplerSession`), or with `text_policy` a
  `TextPolicy` of the session's rows and the sampler's reply limit."""
  if text_policy is not None:
    return TextPolicy(
      text_policy,
      chat,
      slots=session_config.rows,
      max_reply_tokens=sampling_config.max_new_tokens,
    )
  session = sampling.SamplerSession(
    model_config, sampling_config, session_config, cache_sharding=cache_sharding
  )
  return SamplerPolicy(session)
