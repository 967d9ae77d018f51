#!/usr/bin/env bash
# One device call (≤ 4 minutes) for the last open question of the batched step (issue 32): does
# the pipelined batched step (`pipelined_batch`, off) win served? Session 16's bench said neutral
# (+0.2–0.5 %) and its served run without it lost its log. On the 8-layer full-width checkpoint:
#   1. (unless SKIP_TESTS=1) the batched step's GPU tests with TEST_S (200) seconds (session 16 gave them 60: two of four
#      ran);
#   2. served 4 and 8 clients (concurrent_bench.py, 1,024-token prompt, 256 greedy tokens,
#      `--max-batch 8`), LILY_PIPELINED_BATCH 0 / 1 / 0 / 1 alternated, batched decode on (the
#      default since session 16; set here too for binaries staged before).
# Staged as gpu_served_batch.sh is (stage_gpu.sh, `gzip -9` the binaries, concurrent_bench.py
# beside). There: bash .carry/NAME/gpu_pipelined_batch_ab.sh (carry .carry/NAME .carry/tokenizer)
set -u
AB_LAYERS=${LAYERS:-8}
. "$(dirname "$0")/gpu_ab_common.sh" 220
E=$B/lily-engine
at() { echo "$(el)s"; }
if [ "${SKIP_TESTS:-0}" != 1 ]; then
timeout "${TEST_S:-200}" "$HERE/bin/gpu" --ignored --test-threads=1 --nocapture \
  ${TESTS:-decode_batched_device_samplers_kept decode_batched_rows_keep_their_own_sampling decode_batched_steps_match_each_sequence_alone_on_tiny pipelined} \
  > "$OUT/tests.log" 2>&1
say "tests rc=$? at $(at)"
grep -E "^test .*(ok|FAILED)$|^test result|panicked" "$OUT/tests.log" | cut -c1-200 | head -30 | tee -a "$S"
fi
wait $SYN; say "synth ${LAYERS:-8} layers rc=$? at $(at)"
export LILY_BATCHED_DECODE=1 PYTHONUNBUFFERED=1
served() {  # served NAME CLIENTS [ENV=VALUE ...]
  local name=$1 clients=$2; shift 2
  if ! left; then say "served $name: skipped (deadline) at $(at)"; return; fi
  env "$@" LILY_ENGINE_BIN="$E" timeout 60 python3 "$HERE/concurrent_bench.py" --model "$M" \
    --device cuda --prompt-tokens 1024 --max-tokens "${MAX_TOKENS:-256}" --clients "$clients" \
    --serve-arg=--max-batch=8 > "$OUT/concurrent-$name.log" 2>&1
  say "served $name ($*) rc=$? at $(at):"
  grep -E "clients:" "$OUT/concurrent-$name.log" | cut -c1-160 | tee -a "$S"
}
served off1 4,8 LILY_PIPELINED_BATCH=0
served on1 4,8 LILY_PIPELINED_BATCH=1
served off2 4,8 LILY_PIPELINED_BATCH=0
served on2 4,8 LILY_PIPELINED_BATCH=1
say "done at $(at)"
