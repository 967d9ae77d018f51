#!/usr/bin/env bash
# One short device call (≈ 2.5 min, ≈ 5.5 with the GPU tests; session 13): why the batched
# decode step is slow served (issue 32: 4 clients 440 tok/s together where one alone makes 495),
# and whether the
# tensor-core DeltaNet scan (`tc_scan`, issue 31) keeps the model as faithful as the recurrent
# one. On a full-width synthetic checkpoint of LAYERS (8) layers, so that it synthesises in
# seconds:
#   1. `bench --batch 1,4,8` with the batched step on (LILY_BATCHED_DECODE=1), graphs on, then
#      4 and 8 with LILY_STEP_TIMING=1 (device time a step, events around the picks and the
#      forward pass, beside the wall time a step: the host's share with graphs on), then
#      graphs off (LILY_CUDA_GRAPH=0), then per-kernel device time of batch 4 (LILY_PROFILE=1;
#      graphs off there too): wall time a step beside device time a step says host or device;
#   2. served: concurrent_bench.py with 1 and 4 clients (the server's warnings and graph
#      captures printed after it);
#   3. teacher-forced `score` over LEN (1,024) positions: fp32 (the reference), bf16 with the
#      recurrent scan, bf16 with tc_scan; scripts/agreement_table.py against fp32.
# Here: `CARGO_TARGET_DIR=$PWD/target bash scripts/stage_gpu.sh /work/main/.carry/NAME`, gzip
# the binaries, copy this script, concurrent_bench.py and serve_bench.py beside them. There:
#   bash .carry/NAME/gpu_batch_diag.sh   (carry: .carry/NAME .carry/tokenizer; timeout_s 600)
# Knobs: LAYERS (8), LEN (1,024 scored positions), STEPS (64 timed steps), SKIP_TESTS=1, TESTS,
# TEST_S (200).
set -u
HERE="$(cd "$(dirname "$0")" && pwd)"
cd "$HERE/../.."
for f in "$HERE"/bin/lily-engine.gz "$HERE"/../tokenizer/*.gz; do [ -f "$f" ] && gunzip -kf "$f"; done
chmod +x "$HERE"/bin/*
E=$HERE/bin/lily-engine; M=/dev/shm/l${LAYERS:-8}; export LILY_CACHE_DIR=/tmp/lily-cache
OUT=${OUT:-$PWD/gpu-logs}; mkdir -p "$OUT"; W=/tmp/diag; mkdir -p "$W"
S=$OUT/summary.txt; say() { echo "$*" | tee -a "$S"; }
t0=$(date +%s); at() { echo "$(( $(date +%s) - t0 ))s"; }
LEN=${LEN:-1024}
say "== $(date -u) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
timeout 90 "$E" synth --preset qwen3.6-35b-a3b --format mlx --seed 7 --layers "${LAYERS:-8}" \
  --out "$M" --tokenizer "$HERE/../tokenizer" > "$OUT/synth.log" 2>&1 &
SYN=$!
# 0. Where the GPU test binary is staged beside lily-engine (bin/gpu.gz, scripts/stage_gpu.sh):
#    the GPU tests of TESTS (default: the tensor-core scan's and the shipping configuration's,
#    with the GEMM and MoE kernels'), while the checkpoint is synthesised.
if [ -f "$HERE/bin/gpu.gz" ] && [ "${SKIP_TESTS:-0}" != 1 ]; then
  gunzip -kf "$HERE/bin/gpu.gz"; chmod +x "$HERE/bin/gpu"
  timeout "${TEST_S:-200}" "$HERE/bin/gpu" --ignored --test-threads=1 --nocapture \
    ${TESTS:-deltanet:: model_prefill_through_the_tensor_core_scan model_in_the_shipping_configuration gemm:: moe::} \
    > "$OUT/tests.log" 2>&1
  say "tests rc=$? at $(at)"
  grep -E "^test .*FAILED|^test result|panicked|^MODEL" "$OUT/tests.log" | cut -c1-300 | head -40 | tee -a "$S"
fi
wait $SYN; say "synth ${LAYERS:-8} layers rc=$? at $(at)"
export LILY_BATCHED_DECODE=1
bench() {  # bench NAME SECONDS BATCHES [ENV=VALUE ...]
  local name=$1 secs=$2 batches=$3; shift 3
  env "$@" timeout "$secs" "$E" bench --model "$M" --device cuda --prefill 1K --decode-ctx 1K \
    --decode-tokens "${STEPS:-64}" --repeat 1 --batch "$batches" > "$OUT/bench-$name.log" 2>&1
  say "bench $name ($*) rc=$? at $(at):"
  grep -vE "INFO|^\s+(prefill|decode|batch|deltanet|attention|moe|head)?.*launches" "$OUT/bench-$name.log" \
    | grep -E "^ +[0-9]|tok/s|error|Error" | tee -a "$S"
}
bench graphs 60 1,4,8
bench timing 60 4,8 LILY_STEP_TIMING=1
grep -h "step timing" "$OUT/bench-timing.log" | cut -c1-300 | tee -a "$S"
bench nograph 60 4 LILY_CUDA_GRAPH=0
bench profile 60 4 LILY_PROFILE=1
grep -E "kernel profile|^  " "$OUT/bench-profile.log" | head -40 >> "$S"
export LILY_ENGINE_BIN=$E PYTHONUNBUFFERED=1
timeout 75 python3 "$HERE/concurrent_bench.py" --model "$M" --device cuda --prompt-tokens 1024 \
  --max-tokens 128 --clients 1,4 --serve-arg=--max-batch=8 > "$OUT/concurrent.log" 2>&1
say "concurrent rc=$? at $(at):"; tail -12 "$OUT/concurrent.log" | tee -a "$S"
unset LILY_BATCHED_DECODE
score() {  # score NAME ENV...
  local name=$1; shift
  env "$@" timeout 45 "$E" score --model "$M" --len "$LEN" --piece 256 --device cuda \
    --out "$W/$name" > "$W/$name.log" 2>&1
  say "score $name rc=$? at $(at): $(tail -1 "$W/$name.log" | cut -c1-160)"
}
score fp32 LILY_CUDA_FP32=1
score bf16-recurrent LILY_TC_SCAN=0
score bf16-tc-scan LILY_TC_SCAN=1
timeout 30 python3 scripts/agreement_table.py --ref "$W/fp32" --other "$W/bf16-recurrent" \
  --other "$W/bf16-tc-scan" --out "$OUT/agreement.md" --json "$OUT/agreement.json" > "$W/table.log" 2>&1
say "table rc=$? at $(at)"; grep -E "^\| (bf16|path)" "$OUT/agreement.md" | cut -c1-400 | tee -a "$S"
say "done at $(at)"
