#!/usr/bin/env bash
# One GPU session's check, the first thing run on a lent machine: the kernels tested on the device, every
# kernel benchmark, training throughput and our server end to end, in under 7 minutes on one H200 with
# every compile included. Each step has a budget in seconds that its Python program keeps by itself (it
# starts no new row past it); the outer `timeout` is only a safety net. Every row is written as measured.
#
#   bash benchmarks/gpu_check.sh                 all steps on the GPU (device tool: command "bash benchmarks/gpu_check.sh")
#   bash benchmarks/gpu_check.sh --only serving  one step;   --list  the steps and their budgets
#   bash benchmarks/gpu_check.sh --only serving_8b   an opt-in step: a Llama-3.1-8B-shaped server (200 s more)
#   bash benchmarks/gpu_check.sh --only serving_128k the other: one 128K-token prompt on it (240 s more)
#   bash benchmarks/gpu_check.sh --cpu-dry-run   every step on CPU at tiny shapes (3-4 minutes), so this cannot rot
#
# Results, 6 files under $OUT (default benchmarks/out/gpu_check): summary.md (rebuilt after each step),
# system.json, kernels.json, training.json, serving.json (rows per step) and logs.tar.gz (each step's log
# and the benchmarks' own JSON/PNG files). Missing Python packages (the device image lacks the serving
# and data ones) come from wheels in $WHEELS (default benchmarks/wheels, made here by `make gpu-wheels`,
# carried in the device call); steps that need packages still missing are skipped, with the reason.
set -uo pipefail
cd "$(dirname "$0")/.."

STEPS=(preflight kernel_tests attention paged_attention quant_matmul grouped_matmul collectives train_throughput serving leftovers)
OPT_IN=(serving_8b serving_128k)  # past the 7 minutes: only with --only
declare -A BUDGET=([serving_8b]=200 [serving_128k]=240 [preflight]=20 [kernel_tests]=55 [attention]=30 [paged_attention]=40 [quant_matmul]=25
  [grouped_matmul]=20 [collectives]=10 [train_throughput]=40 [serving]=110 [leftovers]=10)
declare -A AREA=([preflight]=system [kernel_tests]=kernels [attention]=kernels [paged_attention]=kernels
  [quant_matmul]=kernels [grouped_matmul]=kernels [collectives]=kernels [train_throughput]=training
  [serving]=serving [serving_8b]=serving [serving_128k]=serving [leftovers]=system)
# Distributions (as gpu_preflight names them) a step cannot import without.
SERVE_NEEDS="grain portpicker array-record fastapi starlette pydantic pydantic-core typing-inspection annotated-types \
opentelemetry-api importlib-metadata uvicorn msgspec llguidance typing-extensions"
declare -A NEEDS=([train_throughput]="grain portpicker array-record" [serving]=$SERVE_NEEDS [serving_8b]=$SERVE_NEEDS
  [serving_128k]=$SERVE_NEEDS)
SLACK=60  # the outer timeout's allowance past a step's budget (one row's compile can overrun it)

DRY=0
ONLY=""
while [ $# -gt 0 ]; do
  case $1 in
    --cpu-dry-run) DRY=1 ;;
    --only) ONLY=${2:?--only needs a step}; shift ;;
    --list)
      for s in "${STEPS[@]}"; do echo "$s ${BUDGET[$s]}s ${AREA[$s]}"; done
      for s in "${OPT_IN[@]}"; do echo "$s ${BUDGET[$s]}s ${AREA[$s]} (opt-in: --only $s)"; done
      exit 0 ;;
    -h | --help) sed -n '2,/^set -uo/{/^#/p}' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [ -n "$ONLY" ] && [ -z "${BUDGET[$ONLY]:-}" ]; then echo "no step $ONLY; steps: ${STEPS[*]}" >&2; exit 2; fi

OUT="${OUT:-benchmarks/out/gpu_check}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
rm -f "$OUT"/{summary.md,system.json,kernels.json,training.json,serving.json,logs.tar.gz}
WORK=$(mktemp -d -t gpu-check.XXXXXX)
mkdir -p "$WORK/logs" "$WORK/art"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 GPU_CHECK_RUN="$$-$RANDOM"
if [ "$DRY" = 1 ]; then
  export JAX_PLATFORMS=cpu
  QUICK=--quick
  # Quick steps end long before their budgets on an idle CPU; on a loaded 2-core CPU (the test suite
  # beside it) they ran 2-4.5x slower than idle, and 3x budgets cut the paged step's prefill row.
  BUDGET_SCALE=5
else
  BUDGET_SCALE=1
  export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
  QUICK=
fi

archive() {  # logs and the benchmarks' own files into one archive; summary.md from the area JSONs
  tar -czf "$OUT/logs.tar.gz" -C "$WORK" logs art 2>/dev/null
  $PY -m benchmarks.gpu_report summary --out "$OUT" >/dev/null 2>&1
}
trap 'archive; rm -rf "$WORK"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

WHEELS="${WHEELS:-benchmarks/wheels}"
if compgen -G "$WHEELS/*.whl" >/dev/null; then  # offline install into a folder of this run, first on the path
  $PY -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$WHEELS"/*.whl \
    && export PYTHONPATH="$PWD:$WORK/site${PYTHONPATH#"$PWD"}"
fi
if [ "$DRY" = 0 ] && [ -z "$ONLY" ]; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; fi

# run_step NAME CMD...: the step's budget and area JSON appended, its output teed to its log, its status recorded.
run_step() {
  local name=$1 area=${AREA[$1]} budget=$((BUDGET[$1] * BUDGET_SCALE)) missing="" pkg rc t0
  shift
  for pkg in ${NEEDS[$name]:-}; do grep -qx "$pkg" "$WORK/missing.txt" 2>/dev/null && missing+="$pkg "; done
  echo "=== $name (budget ${budget} s, $(date +%T))"
  if [ -n "$missing" ]; then
    echo "skipped: needs ${missing}(make gpu-wheels here, carry $WHEELS)"
    $PY -m benchmarks.gpu_report status --out "$OUT" --area "$area" --step "$name" --budget "$budget" \
      --skipped "needs ${missing}(make gpu-wheels here, carry $WHEELS)"
    return
  fi
  t0=$(date +%s.%N)
  GPU_CHECK_STEP_START=$t0 timeout -k 10 $((budget + SLACK)) "$@" --budget "$budget" --rows "$OUT/$area.json" \
    --step "$name" 2>&1 | tee "$WORK/logs/$name.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { echo "!!! $name failed (rc=$rc)"; STATUS=1; }
  $PY -m benchmarks.gpu_report status --out "$OUT" --area "$area" --step "$name" --rc "$rc" --budget "$budget" \
    --started "$t0"
  archive
}

step_preflight() { run_step preflight $PY -m benchmarks.gpu_preflight --missing "$WORK/missing.txt"; }
step_kernel_tests() {
  if [ "$DRY" = 1 ]; then  # interpret mode: a few tests stand for the suite (make test runs all of it)
    run_step kernel_tests $PY -m benchmarks.kernel_tests tests/kernels/test_attention_reference.py -k "cache or masked"
  else
    run_step kernel_tests $PY -m benchmarks.kernel_tests tests/kernels
  fi
}
step_attention() { run_step attention $PY -m benchmarks.attention $QUICK --out "$WORK/art"; }
step_paged_attention() { run_step paged_attention $PY -m benchmarks.paged_attention $QUICK --out "$WORK/art"; }
step_quant_matmul() { run_step quant_matmul $PY -m benchmarks.quant_matmul $QUICK --out "$WORK/art"; }
step_grouped_matmul() { run_step grouped_matmul $PY -m benchmarks.grouped_matmul $QUICK --out "$WORK/art"; }
step_collectives() { run_step collectives $PY -m benchmarks.collectives $QUICK --max-bytes 268435456 --out "$WORK/art"; }
step_train_throughput() {
  run_step train_throughput $PY -m benchmarks.train_throughput $QUICK --model llama-3.2-1b --seq-len 4096 --batch 4 \
    --out "$WORK/art"
}
step_serving() {
  if [ "$DRY" = 1 ]; then  # the embedded model on CPU, as `make run` serves it
    run_step serving $PY -m benchmarks.serving_check --model default --dtype float32 --input-len 16 --output-len 8 \
      --vocab 200 --concurrency 1,2,4 --prompts-per-level 1 --min-prompts 2 --bandwidth-from "$OUT/kernels.json" \
      --logs "$WORK/logs/serving" \
      --server-flags "--config configs/serve/cpu.yaml --max-model-len 64 --max-num-seqs 4 --max-num-batched-tokens 32 --num-scheduler-steps 1"
  else
    run_step serving $PY -m benchmarks.serving_check --model llama-3.2-1b --dtype bfloat16 --input-len 512 \
      --output-len 128 --concurrency 1,64,256 --bandwidth-from "$OUT/kernels.json" --logs "$WORK/logs/serving" \
      --server-flags "--max-model-len 1024 --max-num-seqs 256 --max-num-batched-tokens 2048"
  fi
}
step_serving_8b() {  # a Llama-3.1-8B-shaped bf16 model: about 16 GB of weights read per decode step
  if [ "$DRY" = 1 ]; then
    run_step serving_8b $PY -m benchmarks.serving_check --model tiny-llama --dtype float32 --input-len 16 \
      --output-len 8 --vocab 200 --concurrency 1,2 --prompts-per-level 1 --min-prompts 2 --logs "$WORK/logs/serving_8b" \
      --server-flags "--max-model-len 64 --max-num-seqs 4 --max-num-batched-tokens 32 --num-scheduler-steps 1"
  else
    run_step serving_8b $PY -m benchmarks.serving_check --model llama-3.1-8b --dtype bfloat16 --input-len 512 \
      --output-len 128 --concurrency 1,64 --bandwidth-from "$OUT/kernels.json" --logs "$WORK/logs/serving_8b" \
      --server-flags "--max-model-len 1024 --max-num-seqs 64 --max-num-batched-tokens 2048"
  fi
}
step_serving_128k() {  # one 128K-token prompt on a Llama-3.1-8B-shaped bf16 model: prefill rate and decode roofline
  if [ "$DRY" = 1 ]; then
    run_step serving_128k $PY -m benchmarks.long_context_check --model tiny-llama --dtype float32 --context 448 \
      --output-len 8 --vocab 200 --logs "$WORK/logs/serving_128k" \
      --server-flags "--max-model-len 512 --max-num-seqs 2 --max-num-batched-tokens 128 --num-scheduler-steps 1"
  else
    run_step serving_128k $PY -m benchmarks.long_context_check --model llama-3.1-8b --dtype bfloat16 --context 130944 \
      --output-len 64 --bandwidth-from "$OUT/kernels.json" --peak-from "$OUT/training.json" \
      --logs "$WORK/logs/serving_128k" \
      --server-flags "--max-model-len 131072 --max-num-seqs 4 --max-num-batched-tokens 8192"
  fi
}
step_leftovers() { run_step leftovers $PY -m benchmarks.gpu_report leftovers --out "$OUT"; }

STATUS=0
if [ -n "$ONLY" ]; then
  [ "$ONLY" = preflight ] || $PY -m benchmarks.gpu_preflight --missing "$WORK/missing.txt" >/dev/null 2>&1
  "step_$ONLY"
else
  for s in "${STEPS[@]}"; do "step_$s"; done
fi
archive
echo
cat "$OUT/summary.md"
exit $STATUS
