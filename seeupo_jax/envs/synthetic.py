"""`synthetic`: a combination lock opened over several turns, for checking that training works.

The lock has D dials (default 3). Turn t shows dial t's clue, a digit, after
a decoy ("noise") digit:

    Dial 2: noise 7, clue 3.

A clue from 0 to 4 means the dial must turn left, from 5 to 9 right (digits
are single tokens in every Qwen tokenizer, so the clue is one token). The agent's reply sets the dial: a reply whose first
non-blank character is a letter from a to m (either case) turns it left, any
other reply turns it right; every reply is readable, so there are no malformed
actions. The lock opens (success) only if every dial is right. The reward,
given once at the end, is

    reward = opened                                   (partial_credit = 0)
    reward = (1 - c) * opened + c * dials_right / D   (partial_credit = c)

so it depends on the action of every turn, and no turn is told whether it was
right: which turns earned the reward is the learner's to work out. For the turn-level
algorithms the environment also reports, beside what the model sees, each turn's own reward
(`Step.reward`: 1 if the dial was set right, else 0; MT-GRPO's) and its state (`Reset.state`,
`Step.state`: the dials set so far, e.g. "left,right"; GiGPO's anchor states). Some
partial credit (default 0.5) gives a model trained from scratch a signal
before it can open whole locks; 0 is the sparse version.

Chance level: each dial's direction is a fair coin drawn from the task's seed,
so any policy that does not read the clues opens the lock with probability
exactly 2**-D (1/8 for 3 dials); a randomly initialised model starts close to
it. A policy that reads each clue (an attention lookup of a few tokens back,
past the decoy) opens every lock.

Tasks are numbered per split ("train/17", "eval/3") and drawn from a seed made
of the config's seed and the task id, so train and eval tasks are different
draws (held-out instances of the same distribution).
"""

from __future__ import annotations

import dataclasses
import functools
import time
import zlib

import numpy as np

from seeupo_jax import fields
from seeupo_jax.envs import base

LEFT_CLUES = ("0", "1", "2", "3", "4")
RIGHT_CLUES = ("5", "6", "7", "8", "9")
SPLITS = ("train", "eval")


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
  """The lock's settings.

  num_dials: D, the number of turns (>= 1).
  partial_credit: c, the share of the reward paid per right dial (see the module docstring).
  decoys: whether each observation also shows a noise digit (before the clue).
  shuffle_decoys: put the noise digit after the clue in half of the observations (harder:
    the clue is no longer at a fixed distance from the reply).
  labels: name the dial and the digits ("Dial 2: noise 7, clue 3."); False shows the bare
    digits ("7 3": the clue last, unless shuffle_decoys), a shorter context in which the only
    digits are the noises and clues.
  instructions: open with a system message stating the rules (for a pretrained model;
    a model trained from scratch cannot read them, and they triple the prompt's length).
  num_train_tasks, num_eval_tasks: sizes of the splits.
  seed: mixed into every task's draw.
  latency_ms, latency_p99_ms: a tool's latency, simulated: each step sleeps latency_ms (0: not
    at all), or with latency_p99_ms > latency_ms a log-normal time of median latency_ms and
    99th percentile latency_p99_ms, drawn from (seed, task, turn) so every run of a task waits
    the same (`step_latency_s`). For measuring what overlaps environment time
    (`benchmarks/bench_async.py`); the lock is the same.
  """

  num_dials: int = fields.field(fields.int_at_least(1), 3)
  decoys: bool = fields.field(fields.BOOL, True)
  instructions: bool = fields.field(fields.BOOL, True)
  partial_credit: float = fields.field(fields.number_in(0, 1), 0.5)
  shuffle_decoys: bool = fields.field(fields.BOOL, False)
  labels: bool = fields.field(fields.BOOL, True)
  num_train_tasks: int = fields.field(fields.int_at_least(1), 100_000)
  num_eval_tasks: int = fields.field(fields.int_at_least(1), 128)
  seed: int = fields.field(fields.INT, 0)
  latency_ms: float = fields.field(fields.number_at_least(0.0), 0.0)
  latency_p99_ms: float = fields.field(fields.number_at_least(0.0), 0.0)

  def __post_init__(self):
    fields.check(self, "synthetic")
    if self.latency_p99_ms and self.latency_p99_ms < self.latency_ms:
      raise ValueError(
        f"synthetic.latency_p99_ms={self.latency_p99_ms:g} is below latency_ms="
        f"{self.latency_ms:g}; allowed: 0 (a fixed latency) or at least latency_ms"
      )


_Z99 = 2.3263478740408408  # the standard normal's 99th percentile


def step_latency_s(config: SyntheticConfig, task_id: str, turn: int) -> float:
  """The simulated latency of step `turn` (1-based) of task `task_id`, in seconds: latency_ms,
  or median x exp(sigma Z) with sigma = log(p99 / median) / z_0.99 and Z ~ N(0, 1) seeded by
  (seed, task, turn)."""
  median = config.latency_ms / 1000.0
  if median <= 0 or config.latency_p99_ms <= config.latency_ms:
    return median
  sigma = np.log(config.latency_p99_ms / config.latency_ms) / _Z99
  rng = np.random.default_rng(zlib.crc32(f"{config.seed}/{task_id}/{turn}".encode()))
  return float(median * np.exp(sigma * rng.standard_normal()))


def dial_of_reply(text: str) -> str:
  """ "left" if the first non-blank character is a letter a-m (any case), else "right"."""
  stripped = text.lstrip()
  first = stripped[:1].lower()
  return "left" if "a" <= first <= "m" and first.isascii() and first.isalpha() else "right"


def system_prompt(num_dials: int) -> str:
  return (
    f"Open a lock of {num_dials} dials, one per turn. A clue from 0 to 4 means left, from 5 to 9 "
    "right; ignore the noise. Reply with one word: a word starting with a to m turns the dial "
    "left, any other reply turns it right."
  )


SHORT_SYSTEM = "Open the lock."
"""The system message without instructions (shorter than a chat template's default one)."""


@dataclasses.dataclass(frozen=True)
class Lock:
  """One task: the direction of each dial and the digits shown."""

  directions: tuple[str, ...]  # "left" / "right" per dial
  clues: tuple[str, ...]
  noises: tuple[str, ...]
  noise_first: tuple[bool, ...]


def draw_lock(config: SyntheticConfig, task_id: str) -> Lock:
  """The lock of `task_id` ("train/<i>" or "eval/<i>"); the same id always gives the same lock."""
  split, _, index = task_id.partition("/")
  limit = config.num_train_tasks if split == "train" else config.num_eval_tasks
  if split not in SPLITS or not index.isdigit() or int(index) >= limit:
    raise ValueError(
      f"unknown synthetic task {task_id!r}: expected 'train/<i>' (i < {config.num_train_tasks}) "
      f"or 'eval/<i>' (i < {config.num_eval_tasks})"
    )
  rng = np.random.default_rng([config.seed, zlib.crc32(task_id.encode())])
  d = config.num_dials
  left = rng.random(d) < 0.5
  directions = tuple("left" if x else "right" for x in left)
  clues = tuple(str(rng.choice(LEFT_CLUES if x else RIGHT_CLUES)) for x in left)
  noises = tuple(str(rng.choice(LEFT_CLUES + RIGHT_CLUES)) for _ in range(d))
  noise_first = tuple(bool(x) for x in rng.random(d) < 0.5)
  return Lock(directions, clues, noises, noise_first)


class SyntheticEnv:
  """The lock environment (see the module docstring); one episode at a time."""

  def __init__(self, config: SyntheticConfig):
    self.config = config
    self._lock: Lock | None = None
    self._set: list[str] = []

  def _dial_message(self, t: int) -> base.Message:
    lock = self._lock
    labels = self.config.labels
    parts = [f"noise {lock.noises[t]}" if labels else lock.noises[t]]
    parts.append(f"clue {lock.clues[t]}" if labels else lock.clues[t])
    if not self.config.decoys:
      parts = parts[1:]
    elif not lock.noise_first[t] and self.config.shuffle_decoys:
      parts.reverse()
    if not labels:
      return {"role": "user", "content": " ".join(parts)}
    return {"role": "user", "content": f"Dial {t + 1}: " + ", ".join(parts) + "."}

  def reset(self, task_id: str) -> base.Reset:
    self._lock = draw_lock(self.config, task_id)
    self._task_id = task_id
    self._set = []
    rules = system_prompt(self.config.num_dials) if self.config.instructions else SHORT_SYSTEM
    messages = [{"role": "system", "content": rules}, self._dial_message(0)]
    return base.Reset(messages=messages, tools=None, state="")

  def step(self, assistant_text: str) -> base.Step:
    if self._lock is None:
      raise RuntimeError("SyntheticEnv.step called before reset")
    if len(self._set) >= self.config.num_dials:
      raise RuntimeError("SyntheticEnv.step called after the episode ended")
    dial = dial_of_reply(assistant_text)
    self._set.append(dial)
    t = len(self._set)
    if self.config.latency_ms > 0:
      time.sleep(step_latency_s(self.config, self._task_id, t))
    info = {"dial": dial}
    turn = dict(state=",".join(self._set), reward=float(dial == self._lock.directions[t - 1]))
    if t == self.config.num_dials:
      return base.Step(observation=[], done=True, info=info, **turn)
    return base.Step(observation=[self._dial_message(t)], done=False, info=info, **turn)

  def score(self) -> base.Score:
    if self._lock is None:
      raise RuntimeError("SyntheticEnv.score called before reset")
    correct = [a == b for a, b in zip(self._set, self._lock.directions)]
    opened = len(self._set) == self.config.num_dials and all(correct)
    right = int(sum(correct))
    c = self.config.partial_credit
    reward = (1 - c) * float(opened) + c * right / self.config.num_dials
    details = {"dials_set": len(self._set), "dials_right": right}
    return base.Score(reward=reward, success=opened, details=details)

  def close(self) -> None:
    self._lock = None


def spec(config: SyntheticConfig) -> base.EnvSpec:
  """The registry entry for `config`."""

  def task_ids(split: str) -> list[str]:
    if split not in SPLITS:
      raise ValueError(f"unknown split {split!r}; allowed: {list(SPLITS)}")
    count = config.num_train_tasks if split == "train" else config.num_eval_tasks
    return [f"{split}/{i}" for i in range(count)]

  return base.EnvSpec(
    make=functools.partial(SyntheticEnv, config),
    task_ids=task_ids,
    max_turns=config.num_dials,
    chance=2.0**-config.num_dials,  # each dial's direction is a fair coin, whatever is replied
    turn_states=True,
    turn_rewards=True,
  )
