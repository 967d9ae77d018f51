#!/usr/bin/env bash
# Session 30 (≤ 200 s by its own clock), branch s30kv: `kv_cache int8` (issue 30) — the KV cache
# as int8 rows with one f32 scale a (position, KV head) row (MODEL.md §2.4): one-token decode's
# attn_split_mma family reading int8 tiles (half the bytes), prefill reading them dequantised
# (kv_int8_dequant). Staged by scripts/stage_gpu.sh with gpu_ab_common.sh beside (copy this script
# into the staged folder too):
#   bash .carry/s30kv/gpu_s30kv_ab.sh      (carry: .carry/s30kv; timeout_s 240)
# 1. beside the synth: the GPU tests model_with_int8_kv_cache_matches_cpu_on_tiny (prefill,
#    32 greedy one-token steps, teacher-forced chunks of 3 and 8, fork and rewind, against the CPU
#    reading int8 rows) and decode_batched_steps_int8_kv_cache_match_each_sequence_alone (the
#    batched step's int8 rows kernel against each sequence alone); WITH_SMALL=1 adds
#    model_with_int8_kv_cache_matches_cpu_on_small;
# 2. `bench --prefill 512 --decode-ctx 4K,32K,128K --decode-tokens 64`, LILY_KV_CACHE=bf16 /
#    int8 alternated twice; each run's rows and the plan line's `KV cache` into the summary.
# The agreement bar (any default change) is scripts/gpu_agreement.sh with LILY_KV_CACHE=int8:
# docs/perf-notes.md, session 30, branch s30kv.
set -u
R=${OUT:-$PWD/gpu-logs}; mkdir -p "$R"
L=/tmp/s30kv-logs; mkdir -p "$L"; OUT=$L
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-175}"
AB_HARD=${HARD:-200}
S=$R/summary.txt
TESTS="model::model_with_int8_kv_cache_matches_cpu_on_tiny batch::decode_batched_steps_int8_kv_cache_match_each_sequence_alone"
[ -n "${WITH_SMALL:-}" ] && TESTS="$TESTS model::model_with_int8_kv_cache_matches_cpu_on_small"
for t in $TESTS; do
  if ! left; then say "gpu test $t: skipped (deadline) at $(el)s"; continue; fi
  timeout "$(cap "${TEST_S:-40}")" "$B/gpu" --ignored --test-threads=1 --nocapture --exact "$t" > "$L/test-$t.log" 2>&1
  say "gpu test $t rc=$? at $(el)s: $(grep -E '^test |test result|panicked|^MODEL' "$L/test-$t.log" | tr '\n' '|' | cut -c1-700)"
done
wait "$SYN"; say "synth full rc=$? at $(el)s"
bench() {  # bench NAME FORMAT
  if ! left; then say "bench $1: skipped (deadline) at $(el)s"; return; fi
  LILY_KV_CACHE=$2 timeout "$(cap "${BENCH_S:-34}")" "$B/lily-engine" bench --model "$M" --device cuda \
    --prefill 512 --decode-ctx 4K,32K,128K --decode-tokens 64 --repeat 1 > "$L/bench-$1.log" 2>&1
  say "bench $1 (LILY_KV_CACHE=$2) rc=$? at $(el)s: $(grep -E '^ +[0-9]+ +[0-9.]+ +[0-9.]+' "$L/bench-$1.log" | tr -s ' ' | tr '\n' '|') $(grep -h -m1 -oE "KV cache (bf16|int8)" "$L/bench-$1.log")"
  grep -h -m1 -E "refused|out of memory|Error|panicked" "$L/bench-$1.log" >> "$S"
}
bench bf16-1 bf16; bench int8-1 int8; bench bf16-2 bf16; bench int8-2 int8
cp "$L"/test-*.log "$L"/bench-*.log "$R"/ 2>/dev/null
say "done at $(el)s"
