#!/usr/bin/env bash
# One GPU session: correctness of our kernels on the device, then every kernel and end-to-end
# benchmark, then a short table. Budget: under 8 minutes on one H200.
#   device run:  bash benchmarks/gpu_suite.sh            (results under $OUT, or benchmarks/out)
# The training step needs the KJV corpus (python scripts/fetch_kjv.py here; carry data/kjv to the device).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
PY="${PYTHON:-python3}"
status=0

step() {  # step NAME TIMEOUT CMD...: run, log to $OUT/NAME.log, remember failures
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T))"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { echo "!!! $name failed (rc=$rc)"; status=1; }
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import sys, jax; print('python', sys.version.split()[0], 'jax', jax.__version__, jax.devices())"

# 1. Correctness: the kernel tests compiled for the GPU (not interpreted).
step kernel_tests 75 $PY -m pytest -q -x -p no:cacheprovider tests/kernels
# 2. Kernel benchmarks.
step attention 80 $PY -m benchmarks.attention --out "$OUT"
step paged_attention 85 $PY -m benchmarks.paged_attention --out "$OUT"
step quant_matmul 40 $PY -m benchmarks.quant_matmul --budget 30 --out "$OUT"
step grouped_matmul 40 $PY -m benchmarks.grouped_matmul --out "$OUT"
step collectives 15 $PY -m benchmarks.collectives --max-bytes 268435456 --out "$OUT"
# 3. Training throughput (Llama-3.2-1B shape, seq 4096, one GPU).
step train_throughput 50 $PY -m benchmarks.train_throughput --model llama-3.2-1b --seq-len 4096 --batch 4 --out "$OUT"
# 4. The training loop end to end (tiny recipe, Pallas flash attention in the model, checkpoints, eval).
step train_recipe 30 $PY -m jaxinfra train --config configs/train/tiny-cpu.yaml attn_impl=pallas \
    out_dir="$OUT/train_tiny" export_hf=false --no-progress
# 5. End to end: our server on a Llama-3.2-1B-shaped random-weight model, streaming load.
step serving_online 55 $PY -m benchmarks.serving_online --local llama-3.2-1b --num-requests 256 \
    --arrival burst --input-len 256 --output-len 128 --max-model-len 2048 --out "$OUT"

echo
echo "================ summary ================"
for f in "$OUT"/kernel_tests.log; do tail -n 1 "$f"; done
sed -n '/measured matmul peak/,$p' "$OUT/attention.log"
sed -n '/measured copy bandwidth/,$p' "$OUT/paged_attention.log"
sed -n '/quantized matmul speedup/,$p' "$OUT/quant_matmul.log"
sed -n '/collectives over/,$p' "$OUT/collectives.log"
grep '^M' "$OUT/grouped_matmul.log"
grep '^train step' "$OUT/train_throughput.log"
grep '^trained' "$OUT/train_recipe.log"
grep -A5 '^\[rate' "$OUT/serving_online.log"
exit $status
