r"""Compiles one training iteration's programs for a TPU slice ahead of time, on this host.

    pip install -e ".[tpu-compile]"     # libtpu: the TPU compiler (no TPU needed)
    python benchmarks/aot_compile.py --topology=v5p-16 --config=appworld \
        --config.model.preset=qwen3-14b --config.model.dtype=bfloat16 \
        --config.model.param_dtype=bfloat16 --config.model.remat=full

From the training config (`--config=NAME` and `--config.a.b=value` overrides, as
`experiments/run.py` takes them) it builds what `run.py` builds, with the training program's own
builders (`seeupo_jax.training.program`: model config, learner update, decode layout, sampler
session) on a mesh of the slice's devices, and compiles, on abstract arrays (nothing is
allocated), the three programs of an iteration:

  update   the learner's update (`learner.make_update`'s jit, `.lower`): every turn, on
           tasks_per_iteration x samples_per_task rows of max_context_tokens tokens (--rows,
           --length override them); float32 masters as `optimizer.master_weights` says, the
           KL reference params when `learner.kl_coef > 0`.
  reshard  the learner's params into the sampler's layout (`DecodeLayout.reshard_into`).
  decode   one decode call of the engine (`SamplerSession.lower_decode`): decode_slots rows,
           decode_steps_per_sync steps, over a KV pool holding every row at max_context_tokens
           (--decode_context lowers the tokens per row).

For each it prints, per chip: argument, output, temporary and peak bytes against the chip's HBM,
XLA's flops and bytes, the collectives by kind and bytes, the compile time, and lower bounds of
its time (`seeupo_jax.devtools.aot.roofline`). A program the compiler refuses says by how much;
`--fit` then tries the update with `--fit_microbatches` micro-batches (remat "full"), in order,
and reports the first that fits. `--json=FILE` writes every figure.

`--topology` is a slice name (v5e-4/8/16/32, v5p-8/16/32, v6e-8/16) or a libtpu topology
("v5p:2x2x2"). Without libtpu, `--topology=cpu:N` compiles for N simulated CPU devices.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the host; the slice's devices come from libtpu
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # libtpu's host discovery: none
# No TPU is used, so several compiles may load libtpu at once (it takes a lock otherwise).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
if "--topology=cpu:" in " ".join(sys.argv):  # simulated CPU devices, before jax is imported
  _count = " ".join(sys.argv).split("--topology=cpu:")[1].split()[0]
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_count}"
  )
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from experiments import configs  # noqa: E402

_TOPOLOGY = flags.DEFINE_string(
  "topology",
  "v5e-4",
  "A slice (v5e-8, v5p-16, v6e-8, ...), a libtpu topology (v5p:2x2x2), or "
  "cpu:N (N simulated CPU devices).",
)
_PROGRAMS = flags.DEFINE_list("programs", ["update", "reshard", "decode"], "Which programs.")
_ROWS = flags.DEFINE_integer("rows", 0, "Learner rows (0: tasks_per_iteration x samples_per_task).")
_LENGTH = flags.DEFINE_integer("length", 0, "Learner tokens per row (0: max_context_tokens).")
_DECODE_CONTEXT = flags.DEFINE_integer(
  "decode_context", 0, "Tokens each decode row holds in the KV pool (0: max_context_tokens)."
)
_FIT = flags.DEFINE_bool("fit", False, "If the update does not fit, try --fit_microbatches.")
_FIT_MICRO = flags.DEFINE_list(
  "fit_microbatches", ["2", "4", "8", "16", "32", "64"], "Micro-batches to try."
)
_JSON = flags.DEFINE_string("json", "", "Write every figure to this JSON file.")


def _devices(topology: str):
  import jax  # pylint: disable=g-import-not-at-top

  from seeupo_jax.devtools import aot  # pylint: disable=g-import-not-at-top

  if topology.startswith("cpu:"):
    return jax.devices("cpu")[: int(topology.split(":")[1])], None
  chip = aot.SLICES[topology][0] if topology in aot.SLICES else topology.split(":")[0]
  chip = {"v5litepod": "v5e", "v6e": "v6e"}.get(chip, chip)
  return aot.topology_devices(topology), aot.CHIPS.get(chip)


def compile_iteration(config, devices, *, rows=0, length=0, decode_context=0, programs=None):
  """Compiles the iteration's programs of the typed `config` for `devices`; returns
  (ProgramCost per program name, facts: the shapes and the state's bytes per chip)."""
  import jax  # pylint: disable=g-import-not-at-top

  from seeupo_jax import sampling  # pylint: disable=g-import-not-at-top
  from seeupo_jax import sharding  # pylint: disable=g-import-not-at-top
  from seeupo_jax.devtools import aot  # pylint: disable=g-import-not-at-top
  from seeupo_jax.models import qwen  # pylint: disable=g-import-not-at-top
  from seeupo_jax.training import program  # pylint: disable=g-import-not-at-top

  programs = programs or ("update", "reshard", "decode")
  r = config.rollout
  model_config = program.build_model_config(config)
  mesh = sharding.make_mesh(**dataclasses.asdict(config.mesh), devices=devices)
  rows = rows or r.tasks_per_iteration * r.samples_per_task
  length = length or r.max_context_tokens
  facts = dict(
    devices=len(devices),
    platform=devices[0].platform,
    device_kind=devices[0].device_kind,
    mesh=dict(mesh.shape),
    rows=rows,
    length=length,
    turns=config.learner.num_turns,
    model_dtype=model_config.dtype,
    param_dtype=model_config.param_dtype,
    remat=model_config.remat,
    master_weights=config.optimizer.master_weights,
    microbatches=config.learner.microbatches,
    kl=config.learner.kl_coef > 0,
    params=aot.params_count(model_config),
  )
  costs = {}
  learner_params = aot.abstract_params(model_config, mesh)
  if "update" in programs:
    parts = program.build_learner(config, model_config)
    state = aot.abstract_state(
      model_config,
      parts.optimizer,
      mesh,
      master_weights=config.optimizer.master_weights,
      ref=config.learner.kl_coef > 0,
    )
    facts["state_bytes"] = aot.state_bytes(state)
    with jax.set_mesh(mesh):
      lowered = parts.update.lower(
        state, aot.abstract_batch(rows, length, mesh), aot.abstract_key(mesh)
      )
    costs["update"] = aot.compile_program("update", lowered)
  if "reshard" in programs or "decode" in programs:
    decode = program.build_decode_layout(config, model_config, mesh)
    decode_params = aot.abstract(qwen.params_shape(decode.model_config), decode.shardings)
    facts["decode_mesh"] = dict(decode.mesh.shape)
    facts["decode_params_bytes"] = aot.bytes_per_device(decode_params)
    if "reshard" in programs:
      with jax.set_mesh(decode.reshard_mesh):
        lowered = decode.reshard_into.lower(learner_params, decode_params)
      costs["reshard"] = aot.compile_program("reshard", lowered)
    if "decode" in programs:
      # Shapes only: the stops of a Qwen chat (end of turn, end of text); their ids do not matter.
      stops = (model_config.vocab_size - 1, model_config.vocab_size - 2)
      session_config = r.session_config()
      if decode_context:
        session_config = dataclasses.replace(session_config, max_context_tokens=decode_context)
      session = sampling.SamplerSession(
        decode.model_config,
        program.build_sampling_config(config, stops, 0),
        session_config,
        cache_sharding=decode.cache_sharding,
      )
      facts.update(
        decode_rows=session_config.rows,
        decode_context=session_config.max_context_tokens,
        decode_steps=session_config.decode_steps_per_sync,
        kv_pages=session.full_pool_pages(),
      )
      with jax.set_mesh(decode.mesh):
        lowered = session.lower_decode(decode_params)
      costs["decode"] = aot.compile_program("decode", lowered)
  return costs, facts


def bounds(costs, facts, model_config, chip):
  """Roofline lower bounds per program (seconds), from model flops, analytic HBM traffic
  and the compiled collectives (see docs/accelerators.md)."""
  from seeupo_jax.devtools import aot  # pylint: disable=g-import-not-at-top

  n = facts["devices"]
  out = {}
  if "update" in costs and costs["update"].error is None:
    flops = aot.update_flops(
      model_config,
      facts["rows"],
      facts["length"],
      facts["turns"],
      kl=facts["kl"],
      remat=facts["remat"],
    )
    s = facts["state_bytes"]
    # Per turn: the weights read by the forward, backward (and remat) passes; the optimizer
    # step reads and writes the masters, both moments and the trained params.
    passes = 3 if facts["remat"] == "full" else 2
    weights = s["params"] + s.get("base", 0)  # with LoRA the frozen base is read too
    per_turn = passes * weights + 2 * (s.get("masters", 0) + s["optimizer"] + s["params"])
    hbm = facts["turns"] * per_turn + s.get("ref_params", 0)
    out["update"] = (flops, aot.roofline(flops / n, hbm, costs["update"].link_bytes, chip))
  if "decode" in costs and costs["decode"].error is None:
    rows, context = facts["decode_rows"], facts["decode_context"]
    flops = aot.decode_step_flops(model_config, rows, context / 2)
    c = model_config
    kv_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 2  # bf16 K and V
    tensor = facts["decode_mesh"].get("tensor", 1)
    hbm = facts["decode_params_bytes"] + rows * context / 2 * kv_token / tensor
    link = costs["decode"].link_bytes  # one step: the decode loop's body once
    out["decode step"] = (flops, aot.roofline(flops / n, hbm, link, chip))
  if "reshard" in costs and costs["reshard"].error is None:
    out["reshard"] = (
      0.0,
      aot.roofline(0.0, 2 * facts["decode_params_bytes"], costs["reshard"].link_bytes, chip),
    )
  return out


def print_report(costs, facts, chip, roof) -> None:
  from seeupo_jax.devtools import aot  # pylint: disable=g-import-not-at-top

  hbm = chip.hbm_bytes / aot.GIB if chip else float("nan")
  print(
    f"{facts['devices']} x {facts['device_kind']} (mesh {facts['mesh']}), {facts['params'] / 1e9:.2f}B "
    f"params, update on {facts['rows']} rows x {facts['length']} tokens, {facts['turns']} turns, "
    f"remat={facts['remat']}, micro-batches {facts['microbatches']}, masters "
    f"{facts['master_weights']}, KL ref {facts['kl']}"
  )
  if "state_bytes" in facts:
    parts = ", ".join(f"{k} {v / aot.GIB:.2f}" for k, v in facts["state_bytes"].items())
    print(f"  train state per chip (GiB): {parts}")
  print(
    f"  {'program':8} {'fits':>5} {'args':>8} {'out':>8} {'temp':>8} {'peak':>8} "
    f"{'HBM':>7} {'XLA GFLOP':>10} {'link GB':>8} {'compile s':>9}"
  )
  for name, cost in costs.items():
    if cost.error is not None:
      print(
        f"  {name:8} {'no':>5} needs {cost.needed_bytes / aot.GIB:.1f} GiB of "
        f"{cost.available_bytes / aot.GIB:.1f} GiB: {cost.error[:160]}"
      )
      continue
    print(
      f"  {name:8} {'yes' if aot.fits(cost, chip.hbm_bytes if chip else None) else 'no':>5} "
      f"{cost.argument_bytes / aot.GIB:8.2f} {cost.output_bytes / aot.GIB:8.2f} "
      f"{cost.temp_bytes / aot.GIB:8.2f} {cost.peak_bytes / aot.GIB:8.2f} {hbm:7.1f} "
      f"{cost.flops / 1e9:10.1f} {cost.link_bytes / 1e9:8.2f} {cost.compile_s:9.1f}"
    )
    kinds = {k: v for k, v in cost.collectives.items() if k != "total"}
    if kinds:
      print(
        "           collectives: "
        + ", ".join(
          f"{k} {v['ops']:.0f} ops {v['operand_bytes'] / 1e9:.2f} GB" for k, v in kinds.items()
        )
      )
  for name, (flops, b) in roof.items():
    mfu = b.compute_s / b.seconds if b.seconds else 0.0
    print(
      f"  bound {name:11}: >= {b.seconds * 1e3:10.2f} ms ({b.bound}; compute "
      f"{b.compute_s * 1e3:.2f}, HBM {b.memory_s * 1e3:.2f}, link {b.link_s * 1e3:.2f} ms), "
      f"model {flops / 1e12:.1f} TFLOP, MFU ceiling {mfu:.2f}"
    )


def _main(argv, name: str) -> None:
  from seeupo_jax.devtools import aot  # pylint: disable=g-import-not-at-top
  from seeupo_jax.training import config as config_lib  # pylint: disable=g-import-not-at-top
  from seeupo_jax.training import program  # pylint: disable=g-import-not-at-top

  if len(argv) > 1:
    print(f"error: unexpected arguments {argv[1:]}", file=sys.stderr)
    sys.exit(2)
  try:
    config = config_lib.typed(flags.FLAGS.config)
    model_config = program.build_model_config(config)
    devices, chip = _devices(_TOPOLOGY.value)
  except (config_lib.ConfigError, KeyError, ValueError, RuntimeError) as e:
    print(f"error: --config={name} --topology={_TOPOLOGY.value}: {e}", file=sys.stderr)
    sys.exit(2)
  kwargs = dict(rows=_ROWS.value, length=_LENGTH.value, decode_context=_DECODE_CONTEXT.value)
  costs, facts = compile_iteration(config, devices, programs=_PROGRAMS.value, **kwargs)
  attempts = []
  if _FIT.value and "update" in costs and costs["update"].error is not None:
    for micro in [int(m) for m in _FIT_MICRO.value]:
      attempts.append(
        dict(facts=facts, update=aot.as_row(costs["update"], chip and chip.hbm_bytes))
      )
      trial = dataclasses.replace(
        config,
        learner=dataclasses.replace(config.learner, microbatches=micro),
        model=dataclasses.replace(config.model, remat="full"),
      )
      print(f"update refused; trying remat=full, micro-batches {micro}", flush=True)
      try:
        trial_costs, facts = compile_iteration(trial, devices, programs=("update",), **kwargs)
      except ValueError as e:  # micro-batches that do not divide the rows
        print(f"  skipped: {e}")
        continue
      costs["update"] = trial_costs["update"]
      if costs["update"].error is None:
        model_config = program.build_model_config(trial)
        break
  roof = bounds(costs, facts, model_config, chip) if chip else {}
  print_report(costs, facts, chip, roof)
  if _JSON.value:
    report = dict(
      topology=_TOPOLOGY.value,
      config=name,
      facts=facts,
      chip=dataclasses.asdict(chip) if chip else None,
      programs={k: aot.as_row(v, chip.hbm_bytes if chip else None) for k, v in costs.items()},
      bounds={
        k: dict(
          model_flops=f,
          compute_s=b.compute_s,
          memory_s=b.memory_s,
          link_s=b.link_s,
          seconds=b.seconds,
          bound=b.bound,
        )
        for k, (f, b) in roof.items()
      },
      refused_attempts=attempts,
    )
    with open(_JSON.value, "w", encoding="utf-8") as f:
      json.dump(report, f, indent=1, default=str)


def run(argv) -> None:
  from experiments.run import check_overrides, split_config_name  # pylint: disable=g-import-not-at-top

  try:
    name, argv = split_config_name(argv)
    config = configs.get_config(name)
    check_overrides(config, name, argv)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  config_flags.DEFINE_config_dict("config", config, lock_config=True, sys_argv=argv)
  app.run(functools.partial(_main, name=name), argv=argv)


if __name__ == "__main__":
  run(sys.argv)
