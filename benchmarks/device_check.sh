#!/usr/bin/env bash
# The GPU checks as one prepared script: the first thing to run on a GPU machine. It needs an image
# with jax/jaxlib with CUDA, flax, chex, optax, torch, transformers, safetensors and pytest
# (nothing to install). From the repo root there:
#
#   bash benchmarks/device_check.sh          # 8 minutes on one H200 (2026-12-04)
#
# 1. MFU of forward+backward for the qwen3-0.6b and qwen3-1.7b presets in bf16 (8 x 2048
#    tokens); the peak is the H100/H200 SXM bf16 dense figure
#    (989 TFLOP/s, datasheet).
# 2. Decode tokens/s of the sampler on the GPU (our side only).
# 3. Whole SeeUPO iterations of the synthetic task (rollout + update, `bench_train.py`).
# 4. One SeeUPO update against one GSPO update (the learner; T = 4, bf16), with SeeUPO's MFU.
# 5. The transformers parity tests on the GPU (float32 logits within 1e-4 of torch's, greedy
#    generation token for token), with float32 matmuls at full precision.
# Each step's output goes to $OUT/<step>.out, the whole log to $OUT/device_check.log, and a table
# of the figures to $OUT/device_check.md (`benchmarks/device_table.py`).
#
# On a CPU, `PRESETS=qwen3-tiny SEQ=64 BATCH=2 NEW=8 BLOCKS=256 ROUNDS=1 TURN_BUCKETS=1
# TRAIN_ARGS="--algorithms seeupo --tasks 2 --samples 2 --num-dials 2 --rounds 1" SKIP_TESTS=1
# bash benchmarks/device_check.sh` runs every step small (tests/benchmarks/test_benchmarks.py
# does so), so the script keeps working without a GPU; TEST_PLATFORM=cpu instead of SKIP_TESTS=1
# runs the tests on the CPU.
set -uo pipefail
OUT=${OUT:-/tmp/device_check}
PY=${PY:-python3}
PRESETS=${PRESETS:-qwen3-0.6b qwen3-1.7b}  # the MFU step's models; the others use the first
SEQ=${SEQ:-2048}
BATCH=${BATCH:-8}
NEW=${NEW:-128}
BLOCKS=${BLOCKS:-512}  # attention block sizes of the MFU step (e.g. BLOCKS="256 512")
ROUNDS=${ROUNDS:-3}
TURN_BUCKETS=${TURN_BUCKETS:-0}  # SeeUPO's turn_buckets in the learner step (0: the learner's)
TRAIN_ARGS=${TRAIN_ARGS:---rounds 2}  # bench_train.py's flags (default: the synthetic config)
LIMIT_SCALE=${LIMIT_SCALE:-1}  # multiplies every step's time limit (a loaded CPU compiles slowly)
PRESET=${PRESETS%% *}
mkdir -p "$OUT"
rm -f "$OUT"/*.out
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
step() {  # step NAME TIMEOUT_S COMMAND...: run, log, keep its output, remember a failure, go on
  local name=$1 limit=$2
  shift 2
  echo "=== $name: $*"
  timeout "$((limit * LIMIT_SCALE))" "$@" | tee "$OUT/${name// /_}.out"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || { echo "=== $name FAILED (exit $rc)"; status=1; }
}
{
  date -u
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
  step devices 60 "$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
  for preset in $PRESETS; do
    for block in $BLOCKS; do
      step "mfu $preset attn block $block" 240 "$PY" benchmarks/bench_model.py --preset "$preset" \
        --dtype bfloat16 --remat dots --batch "$BATCH" --seq "$SEQ" --attn-block "$block" \
        --no-torch --mfu --rounds "$ROUNDS" --steps 3
    done
  done
  step "sampler decode" 180 "$PY" benchmarks/bench_sampler.py --preset "$PRESET" \
    --batch "$BATCH" --new "$NEW" --rounds "$ROUNDS" --no-torch
  # shellcheck disable=SC2086  # TRAIN_ARGS is a list of flags
  step "synthetic iteration" 300 "$PY" benchmarks/bench_train.py $TRAIN_ARGS
  step "learner update" 300 "$PY" benchmarks/bench_learner.py --preset "$PRESET" \
    --dtype bfloat16 --batch "$BATCH" --seq "$SEQ" --turns 4 --rounds 2 --attn-block 256 \
    --turn-buckets "$TURN_BUCKETS" --peak-tflops 989
  if [ -z "${SKIP_TESTS:-}" ]; then  # tests/conftest.py defaults JAX_PLATFORMS to cpu
    # float32 at full precision: jax's default lets the GPU multiply float32 in TF32, 5e-4 off
    # torch's logprobs on an H200 (docs/accelerators.md), over the tests' 1e-4.
    step "parity tests" 240 env JAX_PLATFORMS="${TEST_PLATFORM:-cuda}" \
      JAX_DEFAULT_MATMUL_PRECISION=highest "$PY" -m pytest -q \
      -p no:cacheprovider -m parity tests/models/test_checkpoint.py tests/sampling/test_sampling_parity.py
  fi
  step table 30 "$PY" benchmarks/device_table.py "$OUT"
  echo "=== exit status $status"
  exit "$status"
} 2>&1 | tee "$OUT/device_check.log"
exit "${PIPESTATUS[0]}"
