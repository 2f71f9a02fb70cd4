"""The sampler's recorded log-probs against the learner's, token by token, by the params version
that sampled each token: the batches a checkpoint of a lagged run holds (`pipeline.lag`).

    python -m seeupo_jax.devtools.logp_gap --workdir=W              # the newest checkpoint
    python -m seeupo_jax.devtools.logp_gap --workdir=W --iteration=100

Checkpoint i of a run with `pipeline.lag` k holds B_{i+1} .. B_{i+k}, sampled and not yet
trained. B_{i+1}'s update starts from checkpoint i's params theta_i (the proximal policy); its
tokens were sampled with older params (version i - k for B_{i+1}, or, with
`pipeline.partial_rollouts`, that one and then theta_i itself once the update that made it had
finished). For each pending batch this prints, per version, the tokens and

    |log pi_sampler(y_t) - log pi_{theta_i}(y_t | y_<t)|

(mean, max, how many tokens are more than 1 nat apart), the learner's log-probs teacher-forced
on the batch with theta_i. Tokens of version i are on-policy: the gap is the sampler's numerics
(its KV cache keeps what the older params wrote for the context, its dtype); tokens of older
versions add what the updates between moved (the learner's TIS weights and the
`sample_logp_gap_*` metrics see the same gap, summed over versions). Everything is rebuilt from
the checkpoint's own config (its manifest), on this machine's devices; the environment is not
started. It runs as one process, also on a checkpoint of a run of many (every process's
trajectories of a batch together).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Callable, Sequence

from absl import logging
import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from seeupo_jax import learner
from seeupo_jax import rollout
from seeupo_jax.training import checkpoints
from seeupo_jax.training import config as config_lib
from seeupo_jax.training import pipeline
from seeupo_jax.training import program as program_lib

Params = Any


@dataclasses.dataclass(frozen=True)
class VersionGap:
  """The gap over the reply tokens one params version sampled.

  Attributes:
    version: the params version (`Trajectory.versions`).
    tokens: how many reply tokens it sampled.
    mean, max: of |recorded - learner| log-prob over them (nats).
    over_one: how many are more than 1 nat apart.
  """

  version: int
  tokens: int
  mean: float
  max: float
  over_one: int


def gaps_by_version(
  logprob_fn: Callable[[Params, Any], Any],
  params: Params,
  trajectories: Sequence[Any],
  *,
  num_turns: int,
  max_len: int,
) -> list[VersionGap]:
  """Per version, the gap between `trajectories`' recorded log-probs and `logprob_fn`'s.

  Args:
    logprob_fn: (params, learner.Batch) -> float32[N, L] log-probs of each token given the ones
      before it (`learner.qwen_logprob_fn`, at the run's sampling temperature).
    params: the learner's params (the proximal policy).
    trajectories: `rollout.Trajectory`s with `versions` (a pending batch).
    num_turns, max_len: `rollout.collate`'s.

  Returns:
    One `VersionGap` per version that sampled a reply token, in version order.
  """

  batch = rollout.collate(trajectories, num_turns=num_turns, max_len=max_len)
  logp = np.asarray(jax.jit(logprob_fn)(params, jax.tree.map(jax.numpy.asarray, batch)))
  generated = np.asarray(batch.turn_ids) >= 0
  gap = np.abs(np.asarray(batch.sample_logp, np.float32) - logp)
  versions = np.full(logp.shape, -1, np.int64)
  for i, t in enumerate(trajectories):  # collate's rows: the tokens left-aligned
    versions[i, : len(t.versions)] = t.versions
  out = []
  for v in sorted(set(versions[generated].tolist())):
    g = gap[generated & (versions == v)]
    out.append(VersionGap(int(v), int(g.size), float(g.mean()), float(g.max()), int((g > 1).sum())))
  return out


def checkpoint_gaps(workdir: str, iteration: int | None = None) -> tuple[int, list]:
  """(the checkpoint's iteration, [(a pending batch's version, its `VersionGap`s), ...]) of
  checkpoint `iteration` (None: the newest) of `workdir`, its params restored onto one device.

  Raises:
    ValueError: no checkpoint; one without pending batches (a synchronous run's); a LoRA run's
      (its checkpoints leave the frozen base out).
  """
  directory = os.path.join(workdir, "checkpoints")
  reader = checkpoints.Checkpointer(directory, read_only=True)
  try:
    iteration = reader.latest_iteration() if iteration is None else iteration
    if iteration is None:
      raise ValueError(f"no checkpoint in {directory}")
    saved = reader.saved_config(iteration)
  finally:
    reader.close()
  config = config_lib.typed(ml_collections.ConfigDict(saved))
  if config.model.lora.rank:
    raise ValueError(
      f"checkpoint {iteration} is a LoRA run's (model.lora.rank={config.model.lora.rank}): it "
      "holds the adapters without the frozen base"
    )
  where = os.path.join(directory, str(iteration))
  with open(os.path.join(where, "progress", "metadata")) as f:
    progress = json.load(f)
  if pipeline.PROGRESS_KEY not in progress:
    raise ValueError(f"checkpoint {iteration} holds no pending batch (pipeline.lag=0)")
  pending = [
    (int(entry["version"]), pipeline.batch_trajectories(entry))
    for entry in progress[pipeline.PROGRESS_KEY]
  ]
  checkpointer = ocp.StandardCheckpointer()
  path = os.path.join(where, "train_state")
  metadata = checkpointer.metadata(path)
  metadata = getattr(metadata, "item_metadata", metadata)
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), metadata)
  params = checkpointer.restore(path, target)["params"]
  model_config = program_lib.build_model_config(config)
  logprob_fn = learner.qwen_logprob_fn(model_config, temperature=config.rollout.temperature)
  out = []
  for version, trajectories in pending:
    gaps = gaps_by_version(
      logprob_fn,
      params,
      trajectories,
      num_turns=config.learner.num_turns,
      max_len=config.rollout.max_context_tokens,
    )
    out.append((version, gaps))
  return iteration, out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdir", required=True, help="a run's workdir (local)")
  parser.add_argument("--iteration", type=int, default=None, help="default: the newest checkpoint")
  args = parser.parse_args(argv)
  logging.set_verbosity(logging.ERROR)  # orbax's notes on the checkpoint's files
  try:
    iteration, batches = checkpoint_gaps(args.workdir, args.iteration)
  except (OSError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"checkpoint {iteration}: the learner's log-probs with its params")
  print("batch | sampled from version | version | tokens | mean gap | max gap | > 1 nat")
  for j, (version, gaps) in enumerate(batches, start=1):
    for g in gaps:
      print(
        f"B_{iteration + j} | {version} | {g.version} | {g.tokens} | {g.mean:.4f} | "
        f"{g.max:.3f} | {g.over_one}"
      )
  return 0


if __name__ == "__main__":
  sys.exit(main())
