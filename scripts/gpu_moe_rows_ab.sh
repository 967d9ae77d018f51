#!/usr/bin/env bash
# One device call (≤ 9 minutes) for the batched step's MoE in one launch (issue 32,
# `fused_moe_rows`: decode.cu's dec_moe_rows), on a full-width synthetic checkpoint of LAYERS (8)
# layers (it synthesises in seconds):
#   1. its GPU tests (the kernel against rms_norm + dec_gemv_rows + dec_glu4_rows +
#      dec_down_combine_rows and the CPU for 2..8 and 11 rows, graph replays; the batched model
#      steps with the switch on against each sequence alone) and the three kernels' own test,
#      while the checkpoint is synthesised;
#   2. `bench --batch 1,4,8` with the batched step on (LILY_BATCHED_DECODE=1), graphs on, the
#      switch off and on alternated ROUNDS (2) times;
#   3. with the switch on: LILY_STEP_TIMING=1 at 4 and 8 rows (device time a step beside wall
#      time), then a LILY_PROFILE=1 4-row step (graphs off: every launch between events;
#      dec_moe_rows' µs a layer beside the attention and DeltaNet kernels');
#   4. served: concurrent_bench.py with 1, 4 and 8 clients (a 1,024-token prompt, MAX_TOKENS (256)
#      greedy tokens each, `--max-batch 8`), the switch on; then 4 clients with it off.
# Summary: $OUT/summary.txt (logs beside it); no step starts past DEADLINE seconds (480).
# Here: `CARGO_TARGET_DIR=$PWD/target bash scripts/stage_gpu.sh /work/main/.carry/moe-rows`,
# `gzip -9` the binaries, copy this script, concurrent_bench.py and serve_bench.py beside them.
# There:
#   bash .carry/moe-rows/gpu_moe_rows_ab.sh   (carry: .carry/moe-rows .carry/tokenizer; timeout_s 600)
# Knobs: LAYERS (8), STEPS (64 timed steps), ROUNDS (2), MAX_TOKENS (256), SKIP_TESTS=1, TESTS,
# TEST_S (230), DEADLINE (480).
set -u
HERE="$(cd "$(dirname "$0")" && pwd)"
cd "$HERE/../.."
for f in "$HERE"/bin/*.gz "$HERE"/../tokenizer/*.gz; do [ -f "$f" ] && gunzip -kf "$f"; done
chmod +x "$HERE"/bin/*
E=$HERE/bin/lily-engine; M=/dev/shm/l${LAYERS:-8}; export LILY_CACHE_DIR=/tmp/lily-cache
OUT=${OUT:-$PWD/gpu-logs}; mkdir -p "$OUT"
S=$OUT/summary.txt; say() { echo "$*" | tee -a "$S"; }
t0=$(date +%s); at() { echo "$(( $(date +%s) - t0 ))s"; }
left() { [ $(( $(date +%s) - t0 )) -lt "${DEADLINE:-480}" ]; }
say "== $(date -u) $(nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader)"
timeout 90 "$E" synth --preset qwen3.6-35b-a3b --format mlx --seed 7 --layers "${LAYERS:-8}" \
  --out "$M" --tokenizer "$HERE/../tokenizer" > "$OUT/synth.log" 2>&1 &
SYN=$!
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_S:-230}" "$HERE/bin/gpu" --ignored --test-threads=1 --nocapture \
    ${TESTS:-one_launch_batched_moe decode_batched_steps_with_the_one_launch_moe batched_decode_moe_rows} \
    > "$OUT/tests.log" 2>&1
  say "tests rc=$? at $(at)"
  grep -E "^test .*(ok|FAILED)$|^test result|panicked|bit for bit|graph replays|^MODEL" "$OUT/tests.log" \
    | cut -c1-300 | head -60 | tee -a "$S"
fi
wait $SYN; say "synth ${LAYERS:-8} layers rc=$? at $(at)"
export LILY_BATCHED_DECODE=1
bench() {  # bench NAME SECONDS BATCHES [ENV=VALUE ...]
  local name=$1 secs=$2 batches=$3; shift 3
  if ! left; then say "bench $name: skipped (deadline) at $(at)"; return; fi
  env "$@" timeout "$secs" "$E" bench --model "$M" --device cuda --prefill 1K --decode-ctx 1K \
    --decode-tokens "${STEPS:-64}" --repeat 1 --batch "$batches" > "$OUT/bench-$name.log" 2>&1
  say "bench $name ($*) rc=$? at $(at):"
  grep -vE "INFO|^\s+(prefill|decode|batch|deltanet|attention|moe|head)?.*launches" "$OUT/bench-$name.log" \
    | grep -E "^ +[0-9]|tok/s|one-launch batched MoE|error|Error" | cut -c1-300 | tee -a "$S"
}
for r in $(seq 1 "${ROUNDS:-2}"); do
  bench "off-$r" 45 1,4,8 LILY_FUSED_MOE_ROWS=0
  bench "on-$r" 45 1,4,8 LILY_FUSED_MOE_ROWS=1
done
bench timing 45 4,8 LILY_FUSED_MOE_ROWS=1 LILY_STEP_TIMING=1
grep -h "step timing" "$OUT/bench-timing.log" | cut -c1-300 | tee -a "$S"
bench profile 45 4 LILY_FUSED_MOE_ROWS=1 LILY_PROFILE=1
grep -E "kernel profile|^  " "$OUT/bench-profile.log" | head -40 >> "$S"
export LILY_ENGINE_BIN=$E PYTHONUNBUFFERED=1
served() {  # served NAME CLIENTS SWITCH
  if ! left; then say "served $1: skipped (deadline) at $(at)"; return; fi
  LILY_FUSED_MOE_ROWS=$3 timeout 100 python3 "$HERE/concurrent_bench.py" --model "$M" --device cuda \
    --prompt-tokens 1024 --max-tokens "${MAX_TOKENS:-256}" --clients "$2" --serve-arg=--max-batch=8 \
    > "$OUT/concurrent-$1.log" 2>&1
  say "served $1 (clients $2, LILY_FUSED_MOE_ROWS=$3) rc=$? at $(at):"; tail -14 "$OUT/concurrent-$1.log" | tee -a "$S"
}
served on 1,4,8 1
served off 4 0
say "done at $(at)"
