"""Which slice each Qwen size needs for SeeUPO training at the paper's shapes, with which settings.

    python benchmarks/fit_table.py                    # Markdown table on stdout
    python benchmarks/fit_table.py --json fit.json --calibration /tmp/aot/*.json
    python benchmarks/fit_table.py --coefficients 17.5 4.0 --models qwen3-14b,qwen3-32b \
        --lora 16:none,16:int8,16:nf4 --base-coefficient 1.06    # LoRA and QLoRA rows

Per model, slice and precision (float32 master weights or not) it gives, per chip:

  state      the learner's train state, exact: bf16 params, the KL reference copy (bf16), and
             either float32 masters + float32 Adam moments (`learner.with_master_weights`) or
             bf16 moments; each leaf's shard on the slice's (data=1, fsdp=chips) mesh, from the
             same sharding rules as training (`aot.abstract_state`, no compile).
  decode     the sampler's bf16 copy, tensor-parallel over the chips (the decode layout).
  act(M)     the update's temporaries, estimated from two terms, each what XLA allocates per
             chip for it: the gradients and optimizer step, in proportion to the parameters per
             chip (g x P / chips, bytes), and remat "full"'s bf16 residual per layer and token
             of a micro-batch (a x L x h x tokens, tokens = rows x length / chips / M); g and a
             are fitted to compiled updates (`--calibration`: aot_compile.py's JSON reports),
             and the report says how far each compiled point is from the fit.
  LoRA       (`--lora rank:base`) the state is the float32 adapters and their moments beside
             the frozen base (bf16, int8 or nf4; it is the KL reference: no copy); the
             gradients' term of act counts the adapters' parameters, the residual term is
             full fine-tuning's (the backward still runs through every layer), and
             `--base-coefficient` bytes per base parameter and chip are added (fitted by hand
             to a compiled LoRA update: docs/accelerators.md).
  fits at M  the fewest micro-batches M (a power of two dividing the rows per chip) with
             state + act(M) within 90% of the chip's HBM, or "no" (the state alone is too big,
             or no M helps).

The cheapest slice per model is the one with the fewest chips (then the cheapest chip) where it
fits. These are estimates from exact state sizes and a fitted activation term; aot_compile.py
compiles any row of the table for the named slice and says what the TPU compiler says.
"""

from __future__ import annotations

import os
import sys

_MAX_CHIPS = 32
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_MAX_CHIPS}"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from seeupo_jax import learner, sharding  # noqa: E402
from seeupo_jax.devtools import aot  # noqa: E402
from seeupo_jax.models import config as config_lib  # noqa: E402
from seeupo_jax.models import lora as lora_lib  # noqa: E402
from seeupo_jax.models import qwen  # noqa: E402

MODELS = ("qwen3-0.6b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen2.5-14b", "qwen3-32b")
SHAPES = {  # the paper's: 32 tasks x 8 samples, 10 turns, prompt + response tokens
  "bfcl": dict(rows=256, length=14336 + 4096, turns=10),
  "appworld": dict(rows=256, length=13312 + 3072, turns=10),
}
HEADROOM = 0.9  # of HBM: what XLA's runtime, fragmentation and the sampler's buffers leave


def chips_of(slice_name: str) -> int:
  topology = aot.SLICES[slice_name][1].split(":")[1]
  return int(np.prod([int(d) for d in topology.split("x")]))


def _config(model: str, lora: tuple = (0, "none")):
  rank, quantize = lora
  return config_lib.get_preset(
    model, dtype="bfloat16", param_dtype="bfloat16", lora_rank=rank, quantize=quantize
  )


def state_per_chip(
  model: str, chips: int, master_weights: bool, lora: tuple = (0, "none")
) -> dict[str, int]:
  """Exact bytes per chip of the train state (bf16 params, bf16 KL reference) on fsdp=chips;
  with `lora` = (rank, base format), float32 adapters and moments beside the frozen base
  (bf16, int8 or nf4), the base the KL reference."""
  model_config = _config(model, lora)
  mesh = sharding.make_mesh(data=1, fsdp=chips, tensor=1, devices=jax.devices()[:chips])
  state = aot.abstract_state(
    model_config, learner.default_optimizer(), mesh, master_weights=master_weights, ref=True
  )
  return aot.state_bytes(state)


def trained_params(model: str, lora: tuple = (0, "none")) -> int:
  """The parameters the update trains: all, or the adapters' (rank lora[0], every projection)."""
  if not lora[0]:
    return aot.params_count(config_lib.get_preset(model))
  shapes = qwen.params_shape(_config(model, lora))
  return sum(x.size for x in jax.tree.leaves(lora_lib.split(shapes)[0]))


def calibrate(paths: list[str]):
  """(g, a, points): the least-squares fit of temp = g x P / chips + a x L x h x tokens per
  micro-batch over the compiled updates (remat "full") of the aot_compile.py JSON reports in
  `paths`, and each point."""
  points = []
  for path in paths:
    with open(path, encoding="utf-8") as f:
      report = json.load(f)
    update = report.get("programs", {}).get("update")
    if not update or "temp_GiB" not in update or report["facts"].get("remat") != "full":
      continue
    facts = report["facts"]
    model_config = _model_of(facts)
    tokens = facts["rows"] * facts["length"] / facts["devices"] / facts["microbatches"]
    x = (
      facts["params"] / facts["devices"],
      model_config.num_layers * model_config.hidden_size * tokens,
    )
    points.append(dict(path=path, x=x, temp=update["temp_GiB"] * aot.GIB, facts=facts))
  if len(points) < 2:
    return None
  xs = np.array([p["x"] for p in points])
  ys = np.array([p["temp"] for p in points])
  (g, a), *_ = np.linalg.lstsq(xs, ys, rcond=None)
  return float(g), float(a), points


def _model_of(facts):
  for name in MODELS:
    if aot.params_count(config_lib.get_preset(name)) == facts["params"]:
      return config_lib.get_preset(name)
  raise ValueError(f"no preset has {facts['params']} params")


def decode_bytes(model: str, lora: tuple = (0, "none")) -> int:
  """Bytes of the sampler's copy of the policy: bf16, a quantized base's codes as they are."""
  total = 0
  for x in jax.tree.leaves(qwen.params_shape(_config(model, lora))):
    itemsize = 2 if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x.dtype.itemsize
    total += x.size * itemsize
  return total


def act_bytes(
  g: float, a: float, model_config, chips: int, tokens: float, params: int, frozen: float = 0.0
) -> float:
  """The estimated temporaries per chip of an update with `tokens` tokens per chip and
  micro-batch that trains `params` parameters; `frozen` bytes per chip more (LoRA: the frozen
  base's share, `--base-coefficient` x base parameters / chips)."""
  return (
    g * params / chips + a * model_config.num_layers * model_config.hidden_size * tokens + frozen
  )


def fit(
  model: str,
  slice_name: str,
  shape: dict,
  master_weights: bool,
  g: float,
  a: float,
  lora: tuple = (0, "none"),
  base_coefficient: float = 0.0,
):
  chip = aot.CHIPS[aot.SLICES[slice_name][0]]
  chips = chips_of(slice_name)
  model_config = config_lib.get_preset(model)
  state = sum(state_per_chip(model, chips, master_weights, lora).values())
  trained = trained_params(model, lora)
  frozen = base_coefficient * aot.params_count(model_config) / chips if lora[0] else 0.0
  rows_per_chip = max(1, shape["rows"] // chips)
  found = None
  m = 1
  while m <= rows_per_chip:
    tokens = shape["rows"] * shape["length"] / chips / m
    act = act_bytes(g, a, model_config, chips, tokens, trained, frozen)
    if state + act <= HEADROOM * chip.hbm_bytes:
      found = (m, act)
      break
    m *= 2
  return dict(
    model=model,
    slice=slice_name,
    chips=chips,
    masters=master_weights,
    lora_rank=lora[0],
    quantize=lora[1],
    state_GiB=state / aot.GIB,
    decode_GiB=decode_bytes(model, lora) / chips / aot.GIB,
    hbm_GiB=chip.hbm_bytes / aot.GIB,
    microbatches=found[0] if found else None,
    act_GiB=found[1] / aot.GIB if found else None,
  )


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shape", default="appworld", choices=sorted(SHAPES))
  parser.add_argument("--calibration", nargs="*", default=[], help="aot_compile.py JSON reports")
  parser.add_argument(
    "--coefficients",
    nargs=2,
    type=float,
    default=None,
    metavar=("G", "A"),
    help="g and a of the temporaries' fit, instead of --calibration",
  )
  parser.add_argument(
    "--base-coefficient",
    type=float,
    default=0.0,
    help="LoRA rows: temporaries per frozen base parameter and chip, bytes (docs/accelerators.md)",
  )
  parser.add_argument("--models", default=",".join(MODELS))
  parser.add_argument(
    "--lora",
    default="",
    help="LoRA variants, rank:base (none, int8, nf4), e.g. 16:none,16:int8,16:nf4",
  )
  parser.add_argument("--json", default="")
  args = parser.parse_args()
  paths = [p for pattern in args.calibration for p in sorted(glob.glob(pattern))]
  if args.coefficients:
    (g, a), points = args.coefficients, []
  else:
    fitted = calibrate(paths)
    if fitted is None:
      parser.error(
        "--calibration names fewer than 2 compiled updates with remat=full (or give "
        "--coefficients G A)"
      )
    g, a, points = fitted
  models = args.models.split(",")
  variants = [(0, "none")]
  if args.lora:
    variants = [(int(r), q) for r, q in (v.split(":") for v in args.lora.split(","))]
  shape = SHAPES[args.shape]
  print(
    f"{args.shape}: {shape['rows']} rows x {shape['length']} tokens, {shape['turns']} turns; "
    f"act = {g:.3g} x P / chips + {a:.3g} x L x h x tokens per micro-batch (bytes; P the "
    f"trained parameters), "
    + (f"fitted to {len(points)} compiled updates:" if points else "the given coefficients")
  )
  for p in points:
    f = p["facts"]
    predicted = g * p["x"][0] + a * p["x"][1]
    print(
      f"  {f['params'] / 1e9:.1f}B on {f['devices']} x {f['device_kind']}, {f['rows']} x "
      f"{f['length']}, M={f['microbatches']}: compiled {p['temp'] / aot.GIB:.1f} GiB, "
      f"fit {predicted / aot.GIB:.1f} GiB"
    )
  rows = []
  print(
    "\n| model | LoRA | slice | chips | f32 masters | state GiB/chip | decode copy GiB/chip | "
    "fits at M | act GiB/chip | HBM GiB/chip |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|")
  for model in models:
    for lora in variants:
      for slice_name in aot.SLICES:
        if slice_name == "v5e-4":
          continue
        # LoRA's adapters are float32: masters would change nothing.
        for masters in (True, False) if not lora[0] else (False,):
          row = fit(model, slice_name, shape, masters, g, a, lora, args.base_coefficient)
          rows.append(row)
          m = row["microbatches"]
          act = f"{row['act_GiB']:.1f}" if m else "-"
          kind = f"r{lora[0]} {lora[1] if lora[1] != 'none' else 'bf16'}" if lora[0] else "-"
          print(
            f"| {model} | {kind} | {slice_name} | {row['chips']} | "
            f"{'yes' if masters else 'no'} | {row['state_GiB']:.1f} | "
            f"{row['decode_GiB']:.1f} | {m or 'no'} | {act} | {row['hbm_GiB']:.1f} |"
          )
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(
        dict(shape=shape, g=g, a=a, points=points, rows=rows),
        f,
        indent=1,
      )


if __name__ == "__main__":
  main()
