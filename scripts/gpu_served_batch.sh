#!/usr/bin/env bash
# One device call (≤ 4 minutes) for the served batched step (issue 32, branch served-batch): does
# `lily-engine serve` now step N clients as fast as `bench --batch` steps N sequences? On a
# full-width synthetic checkpoint of LAYERS (8) layers (synthesised in seconds), with the batched
# step on (LILY_BATCHED_DECODE=1) and the one-launch MoE off (the morning's faster setting):
#   1. GPU tests of the batched step (kept device samplers against one row at a time, each row's
#      own sampling, the batched steps against each sequence alone with the pipelined step's
#      stopping row), while the checkpoint is synthesised;
#   2. `bench --batch 1,4,8`, plain greedy (the morning's figures) and with --presence-penalty 1.5
#      (what a served request naming only temperature 0 samples with: the device sampler);
#   3. served, this branch: concurrent_bench.py with 1, 4 and 8 clients (a 1,024-token prompt,
#      MAX_TOKENS (256) greedy tokens each, `--max-batch 8`, --check: each answer against the
#      same prompt alone), the pipelined batched step on (LILY_PIPELINED_BATCH=1, off by default
#      until measured); then 4 and 8 clients with it off (the kept samplers alone);
#   4. served, the base (121fc36's lily-engine, bin/lily-engine-base): 4 and 8 clients, --check;
#   5. at the end `bench` greedy profiled (LILY_PROFILE=1, graphs off: dec_gemv_rows' device time
#      a launch), the GPU test batched_decode_gemv_rows_match_cpu with the others.
# Summary: $OUT/summary.txt (logs beside it); no step starts past DEADLINE seconds (200).
# Here: `CARGO_TARGET_DIR=$PWD/target bash scripts/stage_gpu.sh /work/main/.carry/served-batch`,
# `gzip -9` the binaries, add the base's lily-engine.gz as bin/lily-engine-base.gz, copy this
# script, concurrent_bench.py and serve_bench.py beside them (stage_gpu.sh copies gpu_ab_common.sh,
# the preamble it sources).
# There:
#   bash .carry/served-batch/gpu_served_batch.sh   (carry: .carry/served-batch .carry/tokenizer; timeout_s 300)
# Knobs: LAYERS (8), STEPS (64 bench steps), MAX_TOKENS (256), SKIP_TESTS=1, TESTS, TEST_S (60),
# DEADLINE (200).
set -u
AB_LAYERS=${LAYERS:-8}
. "$(dirname "$0")/gpu_ab_common.sh" 200
E=$B/lily-engine; BASE=$B/lily-engine-base
at() { echo "$(el)s"; }
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_S:-60}" "$HERE/bin/gpu" --ignored --test-threads=1 --nocapture \
    ${TESTS:-decode_batched_device_samplers_kept decode_batched_rows_keep_their_own_sampling decode_batched_steps_match_each_sequence_alone_on_tiny batched_decode_gemv_rows_match_cpu} \
    > "$OUT/tests.log" 2>&1
  say "tests rc=$? at $(at)"
  grep -E "^test .*(ok|FAILED)$|^test result|panicked|^MODEL" "$OUT/tests.log" \
    | cut -c1-300 | head -40 | tee -a "$S"
fi
wait $SYN; say "synth ${LAYERS:-8} layers rc=$? at $(at)"
export LILY_BATCHED_DECODE=1
bench() {  # bench NAME [ARG ...]
  local name=$1; shift
  if ! left; then say "bench $name: skipped (deadline) at $(at)"; return; fi
  timeout 40 "$E" bench --model "$M" --device cuda --prefill 1K --decode-ctx 1K \
    --decode-tokens "${STEPS:-64}" --repeat 1 --batch 1,4,8 "$@" > "$OUT/bench-$name.log" 2>&1
  say "bench $name ($*) rc=$? at $(at):"
  grep -E "^ +[0-9]|tok/s|error|Error" "$OUT/bench-$name.log" | cut -c1-300 | tee -a "$S"
}
bench greedy
bench presence --presence-penalty 1.5
LILY_PIPELINED_BATCH=1 bench presence-pipe --presence-penalty 1.5
export PYTHONUNBUFFERED=1
served() {  # served NAME BINARY CLIENTS [ENV=VALUE ...]
  local name=$1 bin=$2 clients=$3; shift 3
  if ! left; then say "served $name: skipped (deadline) at $(at)"; return; fi
  env "$@" LILY_ENGINE_BIN="$bin" timeout 60 python3 "$HERE/concurrent_bench.py" --model "$M" \
    --device cuda --prompt-tokens 1024 --max-tokens "${MAX_TOKENS:-256}" --clients "$clients" \
    --serve-arg=--max-batch=8 --check > "$OUT/concurrent-$name.log" 2>&1
  say "served $name (clients $clients, $*) rc=$? at $(at):"; tail -12 "$OUT/concurrent-$name.log" | tee -a "$S"
}
served branch "$E" 1,4,8 LILY_PIPELINED_BATCH=1
served nopipe "$E" 4,8 LILY_PIPELINED_BATCH=0
served base "$BASE" 4,8
# Per-kernel device time of the batched projections (graphs off).
LILY_PROFILE=1 bench profile
grep -hE "dec_gemv_rows" "$OUT/bench-profile.log" 2>/dev/null | cut -c1-200 | tee -a "$S"
say "done at $(at)"
