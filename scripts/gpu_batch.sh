#!/usr/bin/env bash
# One device call for the batched CUDA decode step (issue 32): the GPU tests (the batched step's
# `decode_batched_*` and `batched_decode_*` with every decode_ / model_ / pipelined test), then on
# the full-size synthetic checkpoint, the batched step switched on (LILY_BATCHED_DECODE=1):
# concurrent clients 1,4,8 with --max-batch 8, first with the first version's kernels
# (LILY_FUSED_BATCH=0: linear.cu over the rows, the experts grouped, one DeltaNet scan at a
# time), then with the fused batched kernels (dec_gemv_rows, dec_dn_*_rows, dec_glu4_rows,
# dec_down_combine_rows); with SKIP_NOGRAPH=0 the same at 4,8 with graphs off; and the 4K bench
# (batch 1, unchanged). Summary: $OUT/summary.txt. The timeouts (tests 250 s, each concurrent
# run 120 s, bench 90 s) keep the call under the device
# tool's 600 s; run it with timeout_s 600.
#
# Here: `CARGO_TARGET_DIR=$PWD/target bash scripts/stage_gpu.sh /work/main/.carry/NAME`, then
# `gzip -9 /work/main/.carry/NAME/bin/*` and copy this script, concurrent_bench.py and
# serve_bench.py into that folder (the bundled tokenizer in .carry/tokenizer). There:
#   bash .carry/NAME/gpu_batch.sh      (carry: .carry/NAME .carry/tokenizer; ≤ 10 min)
# Knobs: SKIP_TESTS=1, TESTS (test filters), TEST_S, CLIENTS, CONC_S, SKIP_FIRST=1, SKIP_NOGRAPH=1.
set -u
HERE="$(cd "$(dirname "$0")" && pwd)"
cd "$HERE/../.."
for f in "$HERE"/bin/*.gz "$HERE"/../tokenizer/*.gz; do [ -f "$f" ] && gunzip -kf "$f"; done
chmod +x "$HERE"/bin/*
B=$HERE/bin; M=/dev/shm/full-mlx; export LILY_CACHE_DIR=/tmp/lily-cache
S=$OUT/summary.txt; say() { echo "$*" | tee -a "$S"; }
t0=$(date +%s); at() { echo "$(( $(date +%s) - t0 ))s"; }
say "== $(date -u) $(nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader)"
"$B/lily-engine" synth --preset qwen3.6-35b-a3b --format mlx --seed 7 --out "$M" --tokenizer "$HERE/../tokenizer" > /tmp/synth.log 2>&1 &
SYN=$!
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_S:-250}" "$B/gpu" --ignored --test-threads=1 --nocapture ${TESTS:-batch decode_ model_ pipelined} --skip model_matches_cpu_on_checkpoint_from_env > $OUT/tests.log 2>&1
  say "tests rc=$? at $(at)"
  grep -E "^test .*(ok|FAILED)$|^test result|panicked|MODEL batched" $OUT/tests.log | grep -v " ok$" | head -40 | tee -a "$S"
  grep -c " ok$" $OUT/tests.log | sed 's/^/tests ok: /' | tee -a "$S"
fi
wait $SYN; say "synth rc=$? at $(at)"; tail -2 /tmp/synth.log >> "$S"
export LILY_ENGINE_BIN=$B/lily-engine PYTHONUNBUFFERED=1 LILY_BATCHED_DECODE=1
conc() {  # conc NAME CLIENTS SECONDS [ENV=VALUE ...]: one concurrent_bench run
  local name=$1 clients=$2 secs=$3; shift 3
  env "$@" timeout "$secs" python3 "$HERE/concurrent_bench.py" --model $M --device cuda --prompt-tokens 1024 --max-tokens 256 \
    --clients "$clients" --check --serve-arg=--max-batch=8 > "$OUT/concurrent-$name.log" 2>&1
  say "concurrent $name ($*) rc=$? at $(at):"; tail -5 "$OUT/concurrent-$name.log" | tee -a "$S"
}
if [ "${SKIP_FIRST:-0}" != 1 ]; then
  conc first "${CLIENTS:-1,4,8}" "${CONC_S:-120}" LILY_FUSED_BATCH=0
fi
conc fused "${CLIENTS:-1,4,8}" "${CONC_S:-120}" LILY_FUSED_BATCH=1
if [ "${SKIP_NOGRAPH:-1}" != 1 ]; then
  conc fused-nograph 4,8 90 LILY_FUSED_BATCH=1 LILY_CUDA_GRAPH=0
fi
timeout 90 "$B/lily-engine" bench --model $M --device cuda --prefill 4K --decode-ctx 4K --decode-tokens 128 --repeat 1 > $OUT/bench.log 2>&1
say "bench rc=$? at $(at)"; grep -v INFO $OUT/bench.log | tail -8 | tee -a "$S"
say "done at $(at)"
