"""`--config.policy=oracle`: play every task with the environment's oracle, no model.

Checks an install end to end (data, backends, executor, checker, reward) and
measures the environment alone: each task's episode is played by the rollout
engine (`rollout.Roller`) with a text policy that gives the oracle's scripted
replies, through the same env workers and `reset`/`step`/`score`/`close` calls
as training (threads or worker processes, as `rollout.env_isolation` says),
`rollout.env_workers` episodes at a time. A task whose replies run out before
the environment says done gets empty replies up to its turn limit (and fails).

Reports, per split: the oracle's success rate (1.0 on a sound install), its
mean reward, the assistant turns it needs, the share of tasks it can finish
within `rollout.max_turns`, and the environment's time per episode. Any
failed oracle episode is an error (`OracleFailure`) listing the first ones.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Callable, Optional, Sequence

import numpy as np

from seeupo_jax.text import chat_tokens
from seeupo_jax import sampling
from seeupo_jax.text import tokenizer as tokenizer_lib
from seeupo_jax.envs import base
from seeupo_jax.rollout import roller as roller_lib
from seeupo_jax.rollout import workers as workers_lib


class OracleFailure(RuntimeError):
  """The oracle did not solve every task: the install (data, backends, checker) is broken."""


@dataclasses.dataclass(frozen=True)
class OracleEpisode:
  task_id: str
  success: bool
  reward: float
  turns: int  # assistant replies the oracle needed
  seconds: float  # reset + steps + score + close, without the oracle's own reply building
  details: dict


def play(
  env_workers: workers_lib.EnvWorkers, task_id: str, replies: Sequence[str]
) -> OracleEpisode:
  """One episode of `replies` (stops when the environment says done)."""
  t0 = time.perf_counter()
  turns = 0
  episode, _ = env_workers.reset(task_id)
  try:
    for reply in replies:
      turns += 1
      if env_workers.step(episode, reply).done:
        break
    score = env_workers.score(episode)
  finally:
    env_workers.close(episode)
  seconds = time.perf_counter() - t0
  return OracleEpisode(task_id, score.success, score.reward, turns, seconds, score.details)


def run_oracle(
  spec: base.EnvSpec,
  task_ids: Sequence[str],
  workers: int,
  env_workers: Optional[workers_lib.EnvWorkers] = None,
  chat: Optional[chat_tokens.ChatTokens] = None,
) -> list[OracleEpisode]:
  """The oracle's episodes of `task_ids`, in order, `workers` at a time, through the engine.

  env_workers: where the environments run; None: in this process (`ThreadWorkers`).
  chat: the chat template that renders prompts and observations (None: the default
    tokenizer's; the oracle's replies and rewards do not depend on it).
  """
  if spec.oracle is None:
    raise ValueError("this environment has no oracle policy")
  oracle: Callable[[str], list[str]] = spec.oracle
  replies = {task_id: list(oracle(task_id)) for task_id in dict.fromkeys(task_ids)}
  if not replies:
    return []
  if chat is None:
    chat = chat_tokens.ChatTokens(tokenizer_lib.build_default_tokenizer())
  if env_workers is None:
    env_workers = workers_lib.ThreadWorkers(spec.make)
  unlimited = 2**30  # no context, reply or observation limit: the oracle's own episode

  def reply_text(trajectory) -> str:
    script = replies[trajectory.task_id]
    return script[trajectory.num_turns] if trajectory.num_turns < len(script) else ""

  config = roller_lib.RolloutConfig(
    max_turns=max(1, max(len(r) for r in replies.values())),
    max_context_tokens=unlimited,
    max_env_tokens=unlimited,
    env_workers=workers,
    reset_retries=0,
    episode_retries=0,
    max_failed_group_fraction=1.0,
  )
  engine = roller_lib.Roller(
    spec,
    chat,
    None,
    sampling.SamplingConfig(max_new_tokens=unlimited),
    config,
    session_config=config.session_config(rows=workers),
    workers=env_workers,
    text_policy=reply_text,
  )
  try:
    result = engine.run(None, list(task_ids), 1, np.zeros((2,), np.uint32))
  finally:
    engine.close()
  return [
    OracleEpisode(
      t.task_id,
      t.error is None and t.success,
      t.reward,
      t.num_turns,
      t.env_seconds,
      t.score_details if t.error is None else {"error": t.error},
    )
    for t in result.trajectories
  ]


def summarize(episodes: Sequence[OracleEpisode], max_turns: int) -> dict[str, float | int]:
  """The split's report: counts ("tasks", "turns_max") as ints, the rest floats."""
  seconds = np.asarray([e.seconds for e in episodes]) * 1e3
  turns = np.asarray([e.turns for e in episodes])
  return {
    "tasks": len(episodes),
    "success": float(np.mean([e.success for e in episodes])),
    "reward": float(np.mean([e.reward for e in episodes])),
    "turns_mean": float(turns.mean()),
    "turns_max": int(turns.max()),
    "within_max_turns": float(np.mean(turns <= max_turns)),
    "episode_ms_median": float(np.median(seconds)),
    "episode_ms_p99": float(np.percentile(seconds, 99)),
  }


def check(
  spec: base.EnvSpec,
  max_turns: int,
  workers: int,
  workdir: str,
  env_workers: Optional[workers_lib.EnvWorkers] = None,
) -> dict[str, dict]:
  """Runs the oracle on the train and eval splits; writes oracle.json; raises on any failure."""
  report, failures = {}, []
  for split in ("train", "eval"):
    episodes = run_oracle(spec, list(spec.task_ids(split)), workers, env_workers)
    report[split] = summarize(episodes, max_turns)
    failures += [e for e in episodes if not e.success]
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "oracle.json"), "w", encoding="utf-8") as f:
    json.dump(report, f, indent=1)
  if failures:
    first = "\n".join(f"  {e.task_id}: {e.details}" for e in failures[:5])
    raise OracleFailure(f"the oracle failed {len(failures)} tasks; first:\n{first}")
  return report
