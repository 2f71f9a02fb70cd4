"""The training run's figures and closing summary: `curves.png`, `diagnostics.png` and `outputs`.

`plot` draws both figures from the workdir's metrics.jsonl (the loop's figure writer calls it at
every evaluation); `outputs` is the block printed when a run ends.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from seeupo_jax import envs
from seeupo_jax.training import config as config_lib
from seeupo_jax.training import metrics_log

CURVES_FILE = "curves.png"
DIAGNOSTICS_FILE = "diagnostics.png"
SMOOTH = 10
"""The trailing mean (in iterations) drawn over the raw training points of `curves.png`."""


def curve_panels(k: int, chance: Optional[float]) -> tuple[metrics_log.Panel, ...]:
  """`curves.png`: the learning curves, with the environment's chance level where it has one.

  Args:
    k: the samples per task of the evaluation (1 with eval.greedy).
    chance: the environment's `EnvSpec.chance` (a success rate), or None.
  """
  pass_chance = None if chance is None else 1.0 - (1.0 - chance) ** k
  return (
    metrics_log.Panel("train reward", ("reward",), smooth=SMOOTH),
    metrics_log.Panel(
      "train success",
      ("success",),
      smooth=SMOOTH,
      chance=chance,
      chance_label=_chance_label(chance),
      unit_range=True,
    ),
    metrics_log.Panel(
      f"held-out avg@{k} (success of all samples)",
      (f"eval/avg@{k}",),
      chance=chance,
      chance_label=_chance_label(chance),
      unit_range=True,
    ),
    metrics_log.Panel(
      f"held-out pass@{k} (tasks solved in {k} samples)",
      (f"eval/pass@{k}",),
      chance=pass_chance,
      chance_label=_chance_label(pass_chance, k),
      unit_range=True,
    ),
  )


def _chance_label(chance: Optional[float], k: int = 1) -> str:
  if chance is None:
    return ""
  return f"chance ({chance:.3g})" if k == 1 else f"chance in {k} samples ({chance:.3g})"


DIAGNOSTIC_PANELS = (
  metrics_log.Panel("trajectory length (tokens)", ("length",)),
  metrics_log.Panel("turns per trajectory", ("turns",)),
  metrics_log.Panel("tokens per reply", ("reply_tokens",)),
  metrics_log.Panel("loss", ("loss",)),
  metrics_log.Panel("gradient norm (before clipping)", ("grad_norm",)),
  metrics_log.Panel(
    "|sampler - learner| log-prob", ("sample_logp_gap_mean", "sample_logp_gap_max")
  ),
  metrics_log.Panel(
    "how trajectories ended (share)",
    ("finish/done", "finish/max_turns", "finish/context", "finish/env_error"),
    unit_range=True,
  ),
  metrics_log.Panel(
    "seconds (log scale)",
    ("time/iteration", "time/rollout", "time/update", "time/eval"),
    log_y=True,
  ),
  metrics_log.Panel(
    "waiting for environments (share of the time)",
    ("time/env_wait_share",),
    unit_range=True,
  ),
)
"""`diagnostics.png`: what explains the curves (lengths, turns, the learner, the times)."""


def plot(config: config_lib.TrainConfig, workdir: str, spec: envs.EnvSpec) -> dict[str, Any]:
  """Writes `curves.png` (the learning curves) and `diagnostics.png` (the rest) from the
  workdir's metrics.jsonl; returns {file name: matplotlib Figure}."""
  records = metrics_log.read_metrics(os.path.join(workdir, metrics_log.METRICS_FILE))
  k = 1 if config.eval.greedy else config.eval.k
  title = f"{config.env.name}, {config.learner.algorithm}: {workdir}"
  return {
    CURVES_FILE: metrics_log.plot_panels(
      records, os.path.join(workdir, CURVES_FILE), curve_panels(k, spec.chance), title=title
    ),
    DIAGNOSTICS_FILE: metrics_log.plot_panels(
      records, os.path.join(workdir, DIAGNOSTICS_FILE), DIAGNOSTIC_PANELS, title=title, columns=3
    ),
  }


def outputs(workdir: str) -> str:
  """The short block printed when a run ends: where its outputs are, and what they are."""
  names = sorted(os.listdir(workdir)) if os.path.isdir(workdir) else []
  shown = [n + "/" if os.path.isdir(os.path.join(workdir, n)) else n for n in names]
  lines = [f"outputs in {workdir}:", "  " + "  ".join(n for n in shown if not n.startswith("."))]
  hints = {
    CURVES_FILE: "the learning curves",
    metrics_log.METRICS_FILE: "one JSON line per iteration",
    metrics_log.TENSORBOARD_DIR + "/": f"tensorboard --logdir {workdir}/tensorboard",
  }
  lines += [f"  {name}: {hint}" for name, hint in hints.items() if name in shown]
  return "\n".join(lines)
