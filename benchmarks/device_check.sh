#!/usr/bin/env bash
# The GPU checks of the model as one prepared script, for a machine with one GPU whose image has
# jax/jaxlib with CUDA, flax, chex, optax, torch, transformers, safetensors and pytest (nothing
# to install). From the repo root there:
#
#   bash benchmarks/device_check.sh          # a few minutes on one H200 (estimated); log in $OUT
#
# 1. MFU of forward+backward for the qwen3-0.6b preset in bf16 (8 x 2048 tokens), two attention
#    block sizes; the peak is the H100/H200 SXM bf16 dense figure (989 TFLOP/s, datasheet).
# 2. Decode tokens/s of the sampler on the GPU (our side only).
# 3. One SeeUPO update against one GSPO update (the learner; T = 4, bf16), with SeeUPO's MFU.
# 4. The transformers parity tests on the GPU (float32 logits within 1e-4 of torch's, greedy
#    generation token for token), which also catch TF32 matmuls sneaking into float32.
#
# On a CPU, `PRESET=qwen3-tiny SEQ=64 BATCH=2 NEW=8 BLOCKS=256 ROUNDS=1 TURN_BUCKETS=1
# SKIP_TESTS=1 bash benchmarks/device_check.sh` runs the benchmark steps small
# (tests/benchmarks/test_benchmarks.py does so), so the script keeps working without a GPU; TEST_PLATFORM=cpu
# instead of SKIP_TESTS=1 runs the tests on the CPU.
set -uo pipefail
OUT=${OUT:-/tmp/device_check}
PY=${PY:-python3}
PRESET=${PRESET:-qwen3-0.6b}
SEQ=${SEQ:-2048}
BATCH=${BATCH:-8}
NEW=${NEW:-128}
BLOCKS=${BLOCKS:-256 512}  # attention block sizes of the MFU step
ROUNDS=${ROUNDS:-3}
TURN_BUCKETS=${TURN_BUCKETS:-0}  # SeeUPO's turn_buckets in the learner step (0: the learner's)
LIMIT_SCALE=${LIMIT_SCALE:-1}  # multiplies every step's time limit (a loaded CPU compiles slowly)
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
step() {  # step NAME TIMEOUT_S COMMAND...: run, log, remember a failure, go on
  local name=$1 limit=$2
  shift 2
  echo "=== $name: $*"
  timeout "$((limit * LIMIT_SCALE))" "$@" || { echo "=== $name FAILED (exit $?)"; status=1; }
}
{
  date -u
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
  step devices 60 "$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
  for block in $BLOCKS; do
    step "mfu attn_block=$block" 240 "$PY" benchmarks/bench_model.py --preset "$PRESET" \
      --dtype bfloat16 --remat dots --batch "$BATCH" --seq "$SEQ" --attn-block "$block" \
      --no-torch --mfu --rounds "$ROUNDS" --steps 3
  done
  step "sampler decode" 180 "$PY" benchmarks/bench_sampler.py --preset "$PRESET" \
    --batch "$BATCH" --new "$NEW" --rounds "$ROUNDS" --no-torch
  step "learner update" 300 "$PY" benchmarks/bench_learner.py --preset "$PRESET" \
    --dtype bfloat16 --batch "$BATCH" --seq "$SEQ" --turns 4 --rounds 2 --attn-block 256 \
    --turn-buckets "$TURN_BUCKETS" --peak-tflops 989
  if [ -z "${SKIP_TESTS:-}" ]; then  # tests/conftest.py defaults JAX_PLATFORMS to cpu
    step "parity tests" 240 env JAX_PLATFORMS="${TEST_PLATFORM:-cuda}" "$PY" -m pytest -q \
      -p no:cacheprovider -m parity tests/models/test_checkpoint.py tests/sampling/test_sampling_parity.py
  fi
  echo "=== exit status $status"
  exit "$status"
} 2>&1 | tee "$OUT/device_check.log"
exit "${PIPESTATUS[0]}"
