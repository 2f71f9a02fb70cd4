"""The environment protocol: what the rollout loop asks of every environment.

An environment is plain Python on the host, one instance per running
trajectory (the rollout loop creates them with the registry's factory and
drives them from a thread pool, so an instance is used by one thread at a
time):

    reset(task_id) -> Reset(messages, tools, state)     # the conversation's opening messages
    step(assistant_text) -> Step(observation, done, info, state, reward)
    score() -> Score(reward, success, details)   # callable at any point of the episode
    close()

`step` receives the decoded text of the model's reply and answers with the
messages that follow it (tool results, a user turn, an error message when the
reply could not be parsed: malformed model output is the agent's problem to
see, never an exception). An environment raises only when IT is broken (a
server down, a task that does not exist): the rollout loop then retries and
finally drops the whole task group (see `seeupo_jax/rollout/roller.py`), and a run
where too many groups fail stops with that error.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Protocol, Sequence

from seeupo_jax.text.messages import Message  # noqa: F401  (re-exported: `envs.base.Message`)


@dataclasses.dataclass(frozen=True)
class Reset:
  """The opening of an episode.

  messages: the chat messages before the first assistant turn (system, user, ...).
  tools: JSON-schema tool definitions passed to the chat template, or None.
  state: a key of the environment's state before the first turn (equal keys = the same state:
    GiGPO's anchor states, `losses.gigpo_advantages`), or None where the family has none.
  """

  messages: list[Message]
  tools: Optional[list[dict]] = None
  state: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Step:
  """The environment's answer to one assistant reply.

  observation: the messages that follow the reply (may be empty when done).
  done: the episode is over (the agent finished, failed for good, or ran out of turns the
    environment allows).
  info: anything worth logging about this turn (JSON-able).
  state: a key of the environment's state after the reply (before the next turn), or None.
  reward: the reply's own reward (MT-GRPO's turn reward, `losses.mt_grpo_advantages`), or None
    where the family gives none; the learner's outcome reward stays `Score.reward`.
  """

  observation: list[Message]
  done: bool
  info: dict = dataclasses.field(default_factory=dict)
  state: Optional[str] = None
  reward: Optional[float] = None


@dataclasses.dataclass(frozen=True)
class Score:
  """The outcome of an episode (also of one cut short by a limit).

  reward: the scalar the learner trains on.
  success: whether the task counts as solved (for success rates and pass@k).
  details: JSON-able breakdown (checks passed, the answer, ...) kept in the trajectory's metadata.
  """

  reward: float
  success: bool
  details: dict = dataclasses.field(default_factory=dict)


class Environment(Protocol):
  """One episode at a time; see the module docstring."""

  def reset(self, task_id: str) -> Reset: ...

  def step(self, assistant_text: str) -> Step: ...

  def score(self) -> Score: ...

  def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class EnvSpec:
  """A registered environment family.

  make: () -> Environment, a fresh instance (bound to its config by the registry).
  task_ids: split name -> the task ids of that split ("train", "eval").
  max_turns: the most assistant turns an episode can take (sizes the learner's turn scan).
  oracle: task id -> the replies of a policy that solves it (to check an install without a
    model: `--config.policy=oracle`), or None when the family has none.
  capacity: () -> how many episodes can run at once now (e.g. the healthy servers of a pool,
    each holding one episode from reset to close), or None when unlimited. The rollout loop
    plays a call's episodes in waves of at most this many.
  isolation: where the rollout runs this family's environments unless `rollout.env_isolation`
    says otherwise (`seeupo_jax/rollout/workers.py`): "thread" (this process) or "process"
    (worker processes with time limits: for in-process backends that a model's arguments can
    hang, such as BFCL's). With "process", `make` must be picklable (a module-level function
    or a `functools.partial` of one) and each call's result too.
  chance: the success rate of a policy that ignores the observations (what a model starts at
    before it learns the task), when the family knows it exactly; None otherwise. The training
    program draws it as a line on the learning curves.
  turn_states: the family's `Reset.state` and `Step.state` are set (GiGPO can train on it).
  turn_rewards: the family's `Step.reward` is set (MT-GRPO can train on it).
  turn_signals_option: the family's `env` config key that turns `turn_states` and
    `turn_rewards` on, where it reports them only when asked (BFCL: "turn_signals"); None
    otherwise. A turn-level algorithm refused at config time names it.
  """

  make: Callable[[], Environment]
  task_ids: Callable[[str], Sequence[str]]
  max_turns: int
  oracle: Optional[Callable[[str], list[str]]] = None
  capacity: Optional[Callable[[], int]] = None
  isolation: str = "thread"
  chance: Optional[float] = None
  turn_states: bool = False
  turn_rewards: bool = False
  turn_signals_option: Optional[str] = None


class EnvironmentUnavailable(RuntimeError):
  """An environment that cannot run here (not built yet, or its server/data is missing)."""
