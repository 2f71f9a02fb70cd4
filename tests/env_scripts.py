"""Environments for the env-worker tests, importable in worker processes (module-level, picklable).

`Scripted` is a tiny deterministic environment whose replies say what it does:

    "sleep:S"   sleeps S seconds, then answers like any reply
    "spin"      holds the CPU (and, in one process, the GIL) for ever
    "alloc:MB"  allocates MB megabytes
    "die"       kills its own process with SIGKILL
    "die-once:PATH"  the same, once: only the episode that creates PATH (O_EXCL)
    "raise"     raises ConnectionError("server down") (the environment's fault)
    anything else: "step <k>: <reply>" where k counts the replies that ran

Its state is the replies that ran; `score()` = their number. With
`nondeterministic=True` every answer carries a random number (so an episode
cannot be rebuilt by replay). `task_id` "slow-reset:S" sleeps S s in reset,
"slow-score:S" in score.
"""

from __future__ import annotations

import os
import random
import signal
import time

from seeupo_jax.envs import base


class Scripted:
  def __init__(self, nondeterministic: bool = False):
    self.nondeterministic = nondeterministic
    self.replies: list[str] = []
    self.task_id = ""

  def reset(self, task_id: str) -> base.Reset:
    self.task_id, self.replies = task_id, []
    if task_id.startswith("slow-reset:"):
      time.sleep(float(task_id.split(":")[1]))
    return base.Reset([{"role": "user", "content": f"task {task_id}"}])

  def step(self, text: str) -> base.Step:
    if text.startswith("sleep:"):
      time.sleep(float(text.split(":")[1]))
    elif text == "spin":
      while True:
        pass
    elif text.startswith("alloc:"):
      block = bytearray(int(text.split(":")[1]) << 20)
      del block
    elif text == "die":
      os.kill(os.getpid(), signal.SIGKILL)
    elif text.startswith("die-once:"):
      try:  # atomic: of episodes racing here in several workers, exactly one dies
        os.close(os.open(text.split(":", 1)[1], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
      except FileExistsError:
        pass
      else:
        os.kill(os.getpid(), signal.SIGKILL)
    elif text == "raise":
      raise ConnectionError("server down")
    self.replies.append(text)
    content = f"step {len(self.replies)}: {text}"
    if self.nondeterministic:
      content += f" ({random.random()})"
    return base.Step([{"role": "tool", "content": content}], done=False, info={})

  def score(self) -> base.Score:
    if self.task_id.startswith("slow-score:"):
      time.sleep(float(self.task_id.split(":")[1]))
    return base.Score(float(len(self.replies)), True, {"replies": list(self.replies)})

  def close(self) -> None:
    pass
