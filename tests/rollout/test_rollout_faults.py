"""The rollout with faulty environments in worker processes: hanging BFCL calls, killed workers.

The replies come from text policies (scripts: what a model could say), so that the
environments, the env workers and the rollout's handling are what is tested.
"""

import dataclasses
import functools
import time

import jax
import pytest

import env_scripts
from seeupo_jax import rollout, sampling
from seeupo_jax.text import tokenizer as tokenizer_lib
from seeupo_jax.envs import base
from seeupo_jax.learner.batch import PROMPT_OR_ENV
from seeupo_jax.rollout import workers as workers_lib
import tiny

MODEL = tiny.model_config()


def _roller(chat, tok, spec, policy, *, max_turns, **kw):
  sc = sampling.SamplingConfig(
    max_new_tokens=256,
    stop_token_ids=tuple(tokenizer_lib.stop_token_ids(tok)),
    pad_id=tok.pad_token_id,
  )
  config = rollout.RolloutConfig(max_turns=max_turns, **kw)
  return rollout.Roller(spec, chat, MODEL, sc, config, text_policy=policy)


def _env_text(tok, trajectory) -> str:
  """The trajectory's prompt and observation text (what the environment said)."""
  ids = [x for x, t in zip(trajectory.tokens, trajectory.turn_ids) if t == PROMPT_OR_ENV]
  return tok.decode(ids)


def _call(name, **arguments):
  from seeupo_jax.envs import bfcl_calls  # noqa: PLC0415

  return bfcl_calls.format_tool_call(name, arguments)


# What the "model" says on BFCL entry multi_turn_base_15 (a file system and MathAPI): the
# known hanging calls in the second reply, then a reply whose answer shows the state.
TOUCH = _call("touch", file_name="DataSet1.csv")
LS = _call("ls")
SCRIPTS = {
  "power": [TOUCH, _call("power", base=10, exponent=1000000000), LS, "Done."],
  "sqrt": [TOUCH, _call("square_root", number=2, precision=100000000), LS, "Done."],
  "plain": [TOUCH, _call("add", a=1, b=2), LS, "Done."],
}


def _bfcl_run(chat, tok, groups, limit):
  bfcl = pytest.importorskip("seeupo_jax.envs.bfcl", reason="needs the bfcl-eval package")
  spec = dataclasses.replace(
    bfcl.spec(bfcl.BfclConfig(describe_functions=False)), isolation="process"
  )
  policy = lambda t: SCRIPTS[groups[t.group]][t.num_turns]  # noqa: E731
  roller = _roller(
    chat,
    tok,
    spec,
    policy,
    max_turns=4,
    max_context_tokens=4096,
    max_env_tokens=128,
    env_workers=2,
    env_call_timeout_s=limit,
  )
  try:
    t0 = time.perf_counter()
    result = roller.run(None, ["multi_turn_base_15"] * len(groups), 1, jax.random.key(0))
    return result, time.perf_counter() - t0, roller.workers.started_pids
  finally:
    roller.close()


def test_hanging_bfcl_calls_cost_one_call_and_nothing_else(chat, tok):
  limit = 2.0
  names = ["power", "plain", "sqrt", "plain"]
  calm, t_calm, _ = _bfcl_run(chat, tok, ["plain"] * 4, limit)
  result, t_hanging, pids = _bfcl_run(chat, tok, names, limit)
  # Both hanging calls ran on different workers at once: the iteration took one limit more.
  assert t_hanging < t_calm + limit + 5.0, (t_hanging, t_calm)
  assert result.metrics["rollout/env_stopped_calls"] == 2
  assert result.metrics["rollout/failed_groups"] == 0
  assert result.metrics["rollout/retried_episodes"] == 0
  for t, name in zip(result.trajectories, names):
    assert t.error is None and not t.dropped
    assert t.num_turns == 4 and t.finish_reason == "max_turns"  # every reply was answered
    text = _env_text(tok, t)
    if name == "plain":
      assert t.env_stopped_calls == 0 and "took longer" not in text
    else:
      assert t.env_stopped_calls == 1
      # The error observation, then `ls` in a fresh worker: the file of reply 1 is still there.
      error = text.index(f"Error: the call took longer than {limit:g} s and was stopped")
      assert text.index("DataSet1.csv", error) > error
  # The other episodes saw exactly what they see in an iteration without hanging calls.
  for k in (1, 3):
    t, calm_t = result.trajectories[k], calm.trajectories[k]
    assert t.tokens == calm_t.tokens
    assert (t.reward, t.success, t.score_details) == (
      calm_t.reward,
      calm_t.success,
      calm_t.score_details,
    )
  # The killed workers' episodes were rebuilt by replay; no worker process is left.
  assert result.metrics["rollout/env_worker_restarts"] == 2
  assert result.metrics["rollout/env_restores"] >= 2
  assert workers_lib.wait_gone(pids) == []


def test_a_worker_killed_mid_episode_is_a_retried_episode(chat, tok, tmp_path):
  marker = tmp_path / "died"
  scripts = {"calm": ["a", "b", "c"], "dies": ["a", f"die-once:{marker}", "c"]}
  spec = base.EnvSpec(
    make=functools.partial(env_scripts.Scripted, False),
    task_ids=lambda split: [],
    max_turns=3,
    isolation="process",
  )
  policy = lambda t: scripts[t.task_id][t.num_turns]  # noqa: E731
  roller = _roller(chat, tok, spec, policy, max_turns=3, env_workers=2)
  try:
    result = roller.run(None, ["calm", "dies", "calm"], 2, jax.random.key(0))
  finally:
    roller.close()
  assert marker.exists()
  assert result.metrics["rollout/retried_episodes"] == 1
  assert result.metrics["rollout/failed_groups"] == 0
  retried = [t for t in result.trajectories if t.retried_errors]
  assert len(retried) == 1 and retried[0].task_id == "dies"
  assert "died (killed by SIGKILL)" in retried[0].retried_errors[0]
  for t in result.trajectories:  # every episode, the retried one too, ran to its end
    assert t.error is None and not t.dropped and t.num_turns == 3 and t.reward == 3.0
  # The killed worker's other episodes were rebuilt in its replacement, not failed.
  assert result.metrics["rollout/env_restores"] >= 1
  assert workers_lib.wait_gone(roller.workers.started_pids) == []
