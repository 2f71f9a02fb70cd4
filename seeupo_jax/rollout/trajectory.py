"""The trajectory record and `collate`: episodes as the learner's arrays (pure NumPy).

A `Trajectory` is one episode token by token: the prompt's ids, each reply's
sampled ids with the sampler's log-probs (`turn_ids` = the turn), each
observation's ids (`turn_ids` -1), and the episode's outcome and metadata.
`collate` stacks a call's trajectories into the learner's `Batch`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Optional, Sequence

import numpy as np

from seeupo_jax.learner.batch import PROMPT_OR_ENV, Batch


def bucket(n: int, multiple: int) -> int:
  return max(multiple, -(-n // multiple) * multiple)


@dataclasses.dataclass
class Trajectory:
  """One episode, token by token, with its metadata.

  tokens, turn_ids, logprobs: parallel lists; turn_ids[j] = t on reply tokens of turn t
    (their logprobs are the sampler's), -1 on prompt/template/observation tokens (logprob 0).
  group: index of the task in the call (the GRAE group); sample: index within the group.
  turn_states: the environment's state key before each turn (`Reset.state`, then each
    `Step.state`; None where it gave none); turn_rewards: each turn's `Step.reward` (None: none).
  versions: parallel to tokens: the version of the params that sampled each reply token (the
    updates they had seen; `Roller.run(version=)`, and with partial rollouts the versions it
    swapped to mid-episode), -1 on prompt/template/observation tokens. Empty in records written
    before it existed.
  """

  task_id: str
  group: int
  sample: int
  tokens: list[int] = dataclasses.field(default_factory=list)
  turn_ids: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  replies: list[str] = dataclasses.field(default_factory=list)
  num_turns: int = 0
  finish_reason: str = ""
  reward: float = 0.0
  success: bool = False
  score_details: dict = dataclasses.field(default_factory=dict)
  truncated_replies: int = 0
  truncated_env_tokens: int = 0
  env_stopped_calls: int = 0  # replies whose call was stopped (time or memory limit)
  env_seconds: float = 0.0  # time in its environment calls (reset, steps, score)
  error: Optional[str] = None
  dropped: bool = False  # its group had a failure: not trained on
  retried_errors: list[str] = dataclasses.field(default_factory=list)  # earlier failed attempts
  turn_states: list[Optional[str]] = dataclasses.field(default_factory=list)
  turn_rewards: list[Optional[float]] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)

  def append(
    self,
    ids: Sequence[int],
    turn: int,
    logprobs: Optional[Sequence[float]] = None,
    versions: Optional[Sequence[int]] = None,
  ):
    """Appends `ids` of `turn` (-1: prompt/env) with their log-probs (None: 0) and the params
    versions that sampled them (None: -1)."""
    self.tokens.extend(int(i) for i in ids)
    self.turn_ids.extend([turn] * len(ids))
    if logprobs is None:
      self.logprobs.extend([0.0] * len(ids))
    else:
      self.logprobs.extend(float(x) for x in logprobs)
    if versions is None:
      self.versions.extend([-1] * len(ids))
    else:
      if len(versions) != len(ids):
        raise ValueError(f"{len(versions)} versions for {len(ids)} tokens")
      self.versions.extend(int(v) for v in versions)

  def turn_versions(self) -> list[list[int]]:
    """Per turn, the distinct params versions that sampled its reply tokens, ascending (two
    where a partial rollout swapped the params inside or before that turn's reply)."""
    out: list[set] = [set() for _ in range(self.num_turns)]
    for turn, version in zip(self.turn_ids, self.versions):
      if 0 <= turn < len(out):
        out[turn].add(version)
    return [sorted(v) for v in out]

  def metadata(self) -> dict:
    """JSON-able summary for logs."""
    return {
      "task_id": self.task_id,
      "group": self.group,
      "sample": self.sample,
      "num_turns": self.num_turns,
      "num_tokens": len(self.tokens),
      "finish_reason": self.finish_reason,
      "reward": self.reward,
      "success": self.success,
      "score_details": self.score_details,
      "truncated_replies": self.truncated_replies,
      "truncated_env_tokens": self.truncated_env_tokens,
      "env_stopped_calls": self.env_stopped_calls,
      "error": self.error,
      "dropped": self.dropped,
      "retried_errors": self.retried_errors,
      "turn_states": self.turn_states,
      "turn_rewards": self.turn_rewards,
      "turn_versions": self.turn_versions(),
    }


def collate(
  trajectories: Sequence[Trajectory],
  *,
  num_turns: int,
  max_len: int,
  length_bucket: int = 128,
  num_rows: Optional[int] = None,
  longest: Optional[int] = None,
) -> Batch:
  """The learner's `Batch` (NumPy arrays) of `trajectories`, right-padded.

  L = the longest trajectory rounded up to `length_bucket`, at most `max_len`
  (a longer trajectory is an error: the rollout's context limit prevents it).
  Rows keep the trajectories' order; group_ids are their `group`; dropped
  trajectories get row_valid False. `num_rows` pads with invalid rows.
  `longest` replaces the longest trajectory's length in L (many processes, each
  collating its rows of one batch, pass the longest of the whole batch).
  """
  n = len(trajectories) if num_rows is None else num_rows
  if n < len(trajectories):
    raise ValueError(f"num_rows={n} < {len(trajectories)} trajectories")
  own = max((len(t.tokens) for t in trajectories), default=1)
  if longest is None:
    longest = own
  elif longest < own:
    raise ValueError(f"longest={longest} < a trajectory's {own} tokens")
  if longest > max_len:
    raise ValueError(f"a trajectory has {longest} tokens, more than max_len={max_len}")
  length = min(max_len, bucket(longest, length_bucket))
  tokens = np.zeros((n, length), np.int32)
  token_valid = np.zeros((n, length), bool)
  turn_ids = np.full((n, length), PROMPT_OR_ENV, np.int32)
  sample_logp = np.zeros((n, length), np.float32)
  rewards = np.zeros((n,), np.float32)
  group_ids = np.zeros((n,), np.int32)
  row_valid = np.zeros((n,), bool)
  turn_rewards = np.zeros((n, num_turns), np.float32)
  turn_states = np.full((n, num_turns), -1, np.int32)
  for i, t in enumerate(trajectories):
    k = len(t.tokens)
    if not (len(t.turn_ids) == len(t.logprobs) == k):
      raise ValueError(f"trajectory {i}: tokens, turn_ids and logprobs differ in length")
    if any(x >= num_turns for x in t.turn_ids):
      raise ValueError(f"trajectory {i} has a turn id >= num_turns={num_turns}")
    tokens[i, :k] = t.tokens
    token_valid[i, :k] = True
    turn_ids[i, :k] = t.turn_ids
    sample_logp[i, :k] = t.logprobs
    rewards[i] = t.reward
    group_ids[i] = t.group
    row_valid[i] = k > 0 and not t.dropped
    for turn, value in enumerate(t.turn_rewards[:num_turns]):
      turn_rewards[i, turn] = 0.0 if value is None else value
    for turn, state in enumerate(t.turn_states[:num_turns]):
      turn_states[i, turn] = -1 if state is None else state_key(state)
  return Batch(
    tokens=tokens,
    token_valid=token_valid,
    turn_ids=turn_ids,
    sample_logp=sample_logp,
    rewards=rewards,
    group_ids=group_ids,
    row_valid=row_valid,
    turn_rewards=turn_rewards,
    turn_states=turn_states,
  )


def state_key(state: str) -> int:
  """A state's int32 key in [0, 2^31): the first 31 bits of its BLAKE2b digest. Keys are only
  compared within a group (one task's n samples, at most n * T states), where two different
  states share a key with probability about (n T)^2 / 2^32."""
  digest = hashlib.blake2b(state.encode(), digest_size=4).digest()
  return int.from_bytes(digest, "little") & 0x7FFFFFFF
