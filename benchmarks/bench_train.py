"""One training iteration on the synthetic task, end to end: SeeUPO against GSPO, side by side.

Both programs come from `trainer.build(experiments.configs.synthetic.get_config())`
with only `learner.algorithm` changed (and the sizes the flags set), so each
iteration is exactly what `trainer.train` runs:

    result = program.roller.run(state.params, tasks, n, key_rollout)   # B x n trajectories
    batch  = rollout.collate(...); learner.validate(batch, T)
    state  = program.update(state, learner.shard_batch(batch, mesh), key_update)

all under `jax.set_mesh(program.mesh)` (the config's mesh: every device JAX sees).
Each round gives every algorithm the same tasks and the same keys; rounds
alternate the order (A B C, then C B A, ...) so machine noise hits all of them.
`--warmup` iterations per algorithm compile everything first (their time is
reported as "warm-up").

Per algorithm the report gives the median iteration time and where it goes,
as shares of the summed iteration times (they add up to 100%):
  sampling      `rollout/sample_time`: the sampler session's jitted prefill/decode calls, to the host copy of their output;
  envs          `rollout/env_wait_time`: reset, step and score in the worker threads;
  rollout host  `rollout/host_time`: building each turn's inputs, decoding replies;
  rollout other the rest of the rollout call (setup, dropping failed groups, its metrics);
  collate       `rollout.collate` + `learner.validate` (NumPy);
  update        `learner.shard_batch` + the jitted update, to its finished result.
and the ratio of each algorithm's median iteration (and update) time to the
last one listed (default: SeeUPO / GSPO), with the per-round ratios.

The bridge's cost. The rollout's own sampler time is the fair baseline:
  bridge overhead = (rollout wall - sampling) / rollout wall,
the share of the rollout that the environments, tokenization and host
bookkeeping add on top of the jitted sampler (the target: < 10%).
For reference the report also times the plain single-turn sampler
(`sampling.make_sampler`, same model, params and decoding settings, no stop
tokens) on the real first-turn prompts of the B x n rows (left-padded),
forcing max_new_tokens = the reply limit R, D calls a round (as many as the
rollout's sampler calls): plain tokens/s = rows x R / median seconds per call.
The rollout's tokens/s = generated tokens / rollout wall, and its sampler's =
generated tokens / sampling (both summed over the timed iterations; replies
can stop early at the end-of-turn token, so fewer than rows x R x D tokens).
The two sampler rates differ by more than the bridge: the plain sampler's
cache has prompt + R slots, while the rollout's sampler session keeps each
conversation in a paged KV cache across the D turns (pages of `rollout.page_size`
slots, `Roller.cache_slots` = the peak number of slots in use), and every decode step
attends over its row's pages; the table gives both cache sizes. The overhead share above is the bridge's measure.

  .venv/bin/python benchmarks/bench_train.py                    # the config's B = 16, n = 8, D = 3
  .venv/bin/python benchmarks/bench_train.py --rounds 5 --iterations-per-round 2
  .venv/bin/python benchmarks/bench_train.py --tasks 2 --samples 2 --num-dials 2 --rounds 2 --json out.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments.configs import synthetic as synthetic_config  # noqa: E402
from seeupo_jax import learner, rollout, sampling  # noqa: E402
from seeupo_jax import sharding as sharding_lib  # noqa: E402
from seeupo_jax.training import trainer  # noqa: E402
from seeupo_jax.training.tasks import TaskStream  # noqa: E402

PLAIN = "plain_sampler"
PARTS = ("sampling", "envs", "rollout_host", "rollout_other", "collate", "update")


def make_config(algorithm: str, tasks: int, samples: int, num_dials: int):
  """The synthetic training config with the benchmark's algorithm and sizes."""
  config = synthetic_config.get_config()
  config.learner.algorithm = algorithm
  config.rollout.tasks_per_iteration = tasks
  config.rollout.samples_per_task = samples
  config.env.num_dials = num_dials
  config.rollout.max_turns = num_dials  # one turn per dial: the learner's T
  # The task BENCHMARKS.md's figures were measured on: labelled dials with decoys, no KL term.
  config.env.decoys = config.env.labels = True
  config.learner.kl_coef = 0.0
  return config


def run_iteration(program: trainer.Program, state, tasks, samples: int, key, max_len: int):
  """One training iteration as `trainer.train` runs it; returns (state, timings, rollout metrics).

  Args:
    program: the built `trainer.Program` (its mesh must be the current one).
    state: the `TrainState` (donated; use the returned one).
    tasks: the B task ids.
    samples: n, trajectories per task.
    key: PRNG key of the iteration (split into the rollout's and the update's).
    max_len: collate's max_len (the config's rollout.max_context_tokens).

  Returns:
    (state, dict of seconds per part of `PARTS` plus "rollout" and "iteration", the
    rollout's metrics dict).
  """
  k_rollout, k_update = jax.random.split(key)
  t0 = time.perf_counter()
  result = program.roller.run(state.params, tasks, samples, k_rollout)
  t1 = time.perf_counter()
  batch = rollout.collate(
    result.trajectories, num_turns=program.learner_config.num_turns, max_len=max_len
  )
  learner.validate(batch, program.learner_config.num_turns)
  t2 = time.perf_counter()
  state, metrics = program.update(state, learner.shard_batch(batch, program.mesh), k_update)
  jax.block_until_ready((state, metrics))
  t3 = time.perf_counter()
  m = result.metrics
  sampled, envs, host = m["rollout/sample_time"], m["rollout/env_wait_time"], m["rollout/host_time"]
  times = dict(
    sampling=sampled,
    envs=envs,
    rollout_host=host,
    rollout_other=(t1 - t0) - sampled - envs - host,
    collate=t2 - t1,
    update=t3 - t2,
    rollout=t1 - t0,
    iteration=t3 - t0,
  )
  return state, times, m


def first_turn_prompts(program: trainer.Program, tasks, samples: int):
  """The rollout's first-turn prompts: int32[B n, P] ids, left-padded, and bool[B n, P] valid.

  Row g n + s is task g's prompt (the chat template's rendering of its reset
  messages), as the rollout's row of group g, sample s starts.
  """
  prompts = []
  for task in tasks:
    env = program.spec.make()
    reset = env.reset(task)
    env.close()
    prompts.extend([program.chat.prompt_ids(reset.messages, reset.tools)] * samples)
  width = max(len(p) for p in prompts)
  ids = np.zeros((len(prompts), width), np.int32)
  valid = np.zeros((len(prompts), width), bool)
  for row, prompt in enumerate(prompts):
    ids[row, width - len(prompt) :] = prompt
    valid[row, width - len(prompt) :] = True
  return ids, valid


def machine_facts() -> dict:
  devices = jax.devices()
  return dict(
    cpu_count=os.cpu_count(),
    cpu_affinity=len(os.sched_getaffinity(0)),
    backend=jax.default_backend(),
    device_count=len(devices),
    device_kind=devices[0].device_kind,
    load_average_start=[round(x, 2) for x in os.getloadavg()],
  )


def summarize(name: str, iterations: list, rollout_metrics: list) -> dict:
  """Medians, shares and rates of one algorithm's timed iterations (dicts from run_iteration)."""
  total = sum(t["iteration"] for t in iterations)
  med = {k: statistics.median(t[k] for t in iterations) for k in (*PARTS, "rollout", "iteration")}
  generated = sum(m["rollout/generated_tokens"] for m in rollout_metrics)
  rollout_total = sum(t["rollout"] for t in iterations)
  sampling_total = sum(t["sampling"] for t in iterations)
  return dict(
    algorithm=name,
    iteration_s=round(med["iteration"], 4),
    median_s={k: round(med[k], 4) for k in (*PARTS, "rollout")},
    share={k: round(sum(t[k] for t in iterations) / total, 4) for k in PARTS},
    generated_tokens_per_iteration=round(generated / len(iterations), 1),
    rollout_tokens_per_s=round(generated / rollout_total, 1),
    sampler_tokens_per_s_in_rollout=round(generated / sampling_total, 1),
    bridge_overhead=round((rollout_total - sampling_total) / rollout_total, 4),
    reward=round(statistics.mean(m.get("reward", float("nan")) for m in rollout_metrics), 4),
    iterations_s=[round(t["iteration"], 4) for t in iterations],
  )


def round_median(iterations: list, r: int) -> float:
  """Median iteration seconds of round r (dicts from run_iteration, tagged with their round)."""
  return statistics.median(t["iteration"] for t in iterations if t["round"] == r)


def markdown_table(result: dict) -> str:
  """The per-algorithm table, the ratios and the plain sampler's reference rate."""
  lines = [
    "| algorithm | iteration s (median) | sampling | envs | rollout host | rollout other "
    "| collate | update | rollout tokens/s | sampler tokens/s in the rollout | bridge overhead |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for row in result["algorithms"].values():
    parts = " | ".join(f"{row['median_s'][k]:.3f} s ({100 * row['share'][k]:.1f}%)" for k in PARTS)
    lines.append(
      f"| {row['algorithm']} | {row['iteration_s']:.3f} | {parts} "
      f"| {row['rollout_tokens_per_s']:.0f} | {row['sampler_tokens_per_s_in_rollout']:.0f} "
      f"| {100 * row['bridge_overhead']:.1f}% |"
    )
  for name, ratio in result["ratios"].items():
    rounds = ", ".join(f"{r:.2f}" for r in ratio["per_round"])
    lines += [
      "",
      f"{name}: iteration {ratio['iteration']:.2f}x (per round: {rounds}), "
      f"update alone {ratio['update']:.2f}x",
    ]
  plain = result[PLAIN]
  d = result["num_dials"]
  lines += [
    "",
    "| route | rows | cache slots | tokens per iteration | s per iteration (median) | tokens/s |",
    "|---|---:|---:|---:|---:|---:|",
    f"| plain make_sampler, {d} calls (first-turn prompts of {plain['prompt_tokens']} tokens, "
    f"{plain['new_tokens']} new tokens forced) | {plain['rows']} | {plain['cache_slots']} "
    f"| {plain['rows'] * plain['new_tokens'] * d} | {d * plain['call_s']:.3f} "
    f"| {plain['tokens_per_s']:.0f} |",
  ]
  for row in result["algorithms"].values():
    common = f"| {result['trajectories']} | {result['rollout_cache_slots']} "
    common += f"| {row['generated_tokens_per_iteration']:.0f} "
    lines += [
      f"| rollout ({row['algorithm']}): its sampler calls {common}"
      f"| {row['median_s']['sampling']:.3f} | {row['sampler_tokens_per_s_in_rollout']:.0f} |",
      f"| rollout ({row['algorithm']}): wall {common}"
      f"| {row['median_s']['rollout']:.3f} | {row['rollout_tokens_per_s']:.0f} |",
    ]
  return "\n".join(lines)


def parse_args(argv=None):
  defaults = synthetic_config.get_config()
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument(
    "--algorithms", default="seeupo,gspo", help="comma-separated; ratios vs the last"
  )
  parser.add_argument("--tasks", type=int, default=defaults.rollout.tasks_per_iteration, help="B")
  parser.add_argument("--samples", type=int, default=defaults.rollout.samples_per_task, help="n")
  parser.add_argument("--num-dials", type=int, default=defaults.env.num_dials, help="D = turns = T")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--iterations-per-round", type=int, default=1)
  parser.add_argument("--warmup", type=int, default=1, help="untimed iterations per algorithm")
  parser.add_argument("--json", default=None, help="also write the result to this file")
  args = parser.parse_args(argv)
  args.algorithms = [a for a in args.algorithms.split(",") if a]
  if len(set(args.algorithms)) != len(args.algorithms) or not args.algorithms:
    parser.error("--algorithms must name at least one algorithm, each once")
  if min(args.tasks, args.samples, args.num_dials, args.rounds, args.iterations_per_round) < 1:
    parser.error("--tasks, --samples, --num-dials, --rounds, --iterations-per-round must be >= 1")
  if args.warmup < 1:
    parser.error("--warmup must be >= 1 (the first iteration compiles)")
  return args


def main(argv=None):
  args = parse_args(argv)
  facts = machine_facts()
  command = "python " + shlex.join([sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
  print(f"command: {command}")
  print(
    f"machine: {facts['cpu_count']} CPUs ({facts['cpu_affinity']} usable), jax "
    f"{jax.__version__} backend {facts['backend']}, {facts['device_count']} x "
    f"{facts['device_kind']}, load average (1/5/15 min) {facts['load_average_start']}"
  )
  sys.stdout.flush()

  configs = {a: make_config(a, args.tasks, args.samples, args.num_dials) for a in args.algorithms}
  programs = {a: trainer.build(c) for a, c in configs.items()}
  first = programs[args.algorithms[0]]
  config = configs[args.algorithms[0]]
  max_len = config.rollout.max_context_tokens
  train_ids = first.spec.task_ids("train")
  stream = TaskStream(train_ids, config.seed)
  slots = args.warmup + args.rounds * args.iterations_per_round
  task_lists = [stream.take(args.tasks) for _ in range(slots)]
  keys = list(jax.random.split(jax.random.key(config.seed), slots))
  plain_keys = list(jax.random.split(jax.random.key(config.seed + 1), args.rounds * args.num_dials))

  # The plain sampler: the rollout's decoding settings without stop tokens.
  reply = config.rollout.max_reply_tokens
  plain_config = sampling.SamplingConfig(
    max_new_tokens=reply,
    temperature=config.rollout.temperature,
    top_k=config.rollout.top_k,
    top_p=config.rollout.top_p,
  )
  plain_sample = sampling.make_sampler(
    first.model_config,
    plain_config,
    cache_sharding=functools.partial(sharding_lib.cache_shardings, mesh=first.mesh),
  )
  ids, valid = first_turn_prompts(first, task_lists[0], args.samples)

  states, warmup_s, first_iteration = {}, {}, {}
  times = {a: [] for a in args.algorithms}
  metrics = {a: [] for a in args.algorithms}
  plain_times = []
  try:
    for name in args.algorithms:
      with jax.set_mesh(programs[name].mesh):
        states[name] = programs[name].init_state()
    with jax.set_mesh(first.mesh):
      plain_params = jax.tree.map(jnp.copy, states[args.algorithms[0]].params)
    for name in args.algorithms:
      program = programs[name]
      with jax.set_mesh(program.mesh):
        start = time.perf_counter()
        for i in range(args.warmup):
          states[name], t, _ = run_iteration(
            program, states[name], task_lists[i], args.samples, keys[i], max_len
          )
          if i == 0:  # the compiling iteration: where its time went
            first_iteration[name] = {k: round(t[k], 2) for k in ("rollout", "update")}
        warmup_s[name] = round(time.perf_counter() - start, 2)
    with jax.set_mesh(first.mesh):
      ids_j, valid_j = jnp.asarray(ids), jnp.asarray(valid)
      start = time.perf_counter()
      jax.block_until_ready(plain_sample(plain_params, ids_j, valid_j, plain_keys[0]))
      warmup_s[PLAIN] = round(time.perf_counter() - start, 2)

    contestants = [*args.algorithms, PLAIN]
    for r in range(args.rounds):
      for name in contestants if r % 2 == 0 else contestants[::-1]:
        if name == PLAIN:
          with jax.set_mesh(first.mesh):
            for d in range(args.num_dials):  # as many calls as the rollout's sampler calls
              start = time.perf_counter()
              out = plain_sample(plain_params, ids_j, valid_j, plain_keys[r * args.num_dials + d])
              jax.device_get(out)
              plain_times.append(time.perf_counter() - start)
          continue
        program = programs[name]
        with jax.set_mesh(program.mesh):
          for i in range(args.iterations_per_round):
            slot = args.warmup + r * args.iterations_per_round + i
            states[name], t, m = run_iteration(
              program, states[name], task_lists[slot], args.samples, keys[slot], max_len
            )
            t["round"] = r
            times[name].append(t)
            metrics[name].append(m)
  finally:
    for program in programs.values():
      program.roller.close()
      program.eval_roller.close()

  algorithms = {a: summarize(a, times[a], metrics[a]) for a in args.algorithms}
  ratios = {}
  base = args.algorithms[-1]
  for name in args.algorithms[:-1]:
    ratios[f"{name}_over_{base}"] = dict(
      iteration=round(algorithms[name]["iteration_s"] / algorithms[base]["iteration_s"], 3),
      update=round(
        algorithms[name]["median_s"]["update"] / algorithms[base]["median_s"]["update"], 3
      ),
      per_round=[
        round(round_median(times[name], r) / round_median(times[base], r), 3)
        for r in range(args.rounds)
      ],
    )
  call_s = statistics.median(plain_times)
  rows, new = ids.shape[0], reply
  result = dict(
    command=command,
    **facts,
    load_average_end=[round(x, 2) for x in os.getloadavg()],
    jax_version=jax.__version__,
    preset=config.model.preset,
    tasks=args.tasks,
    samples=args.samples,
    trajectories=args.tasks * args.samples,
    num_dials=args.num_dials,
    max_reply_tokens=reply,
    max_context_tokens=max_len,
    rollout_cache_slots=first.roller.cache_slots,
    rounds=args.rounds,
    iterations_per_round=args.iterations_per_round,
    warmup_iterations=args.warmup,
    warmup_s=warmup_s,
    first_iteration_s=first_iteration,
    algorithms=algorithms,
    ratios=ratios,
  )
  result[PLAIN] = dict(
    rows=rows,
    prompt_tokens=int(ids.shape[1]),
    new_tokens=new,
    cache_slots=int(ids.shape[1]) + new,
    calls=len(plain_times),
    call_s=round(call_s, 5),
    tokens_per_s=round(rows * new / call_s, 1),
    rollout_over_plain_tokens_per_s={
      a: round(row["rollout_tokens_per_s"] / (rows * new / call_s), 3)
      for a, row in algorithms.items()
    },
  )
  print(markdown_table(result))
  warm = ", ".join(f"{name} {seconds} s" for name, seconds in warmup_s.items())
  print(f"\nwarm-up (compile + first iterations): {warm}")
  print(json.dumps(result, indent=1))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
