#!/usr/bin/env bash
# One device call for session 13's wgpu decode switches (issue 29 deliverable 4; docs/perf-notes.md
# "session 13, branch wgpu-decode"): wgpu through Vulkan on the full-size synthetic checkpoint,
# `bench --prefill 512 --decode-ctx 4K,32K --decode-tokens 64` with the switches off and on,
# alternated so that drift shows:
#   off    the defaults (all off)
#   all    LILY_WGPU_ATTN_FLAT=1 LILY_WGPU_ATTN_SPLIT=1 LILY_WGPU_LM_ROWS=64 LILY_WGPU_ROWS_FLAT=1
#   prof   all, LILY_PROFILE=1     (per-kernel table: attend_gqa, attend_merge, lin.*)
#   flat   LILY_WGPU_ATTN_FLAT=1   (attend_gqa's reads 8 at a time, unconditional)
#   split  LILY_WGPU_ATTN_SPLIT=1  (decode attention's keys split by the plan: 258 workgroups at 4K)
#   rows   LILY_WGPU_ROWS_FLAT=1   (linear_q4_rows' input and norm-weight reads unconditional)
#   lm     LILY_WGPU_LM_ROWS=64    (lm_head 64 rows a workgroup: 3,880 workgroups, not 15,520)
# then, while time is left, off and all again (the second pair of the alternation). ≤ 9 minutes:
# no run starts past DEADLINE seconds (default 440) that could not end by 540.
#
# Here: the binary as DIR/bin/lily-engine(.gz) (built with `--features scripted`), this script and
# gpu_ab_common.sh (the preamble it sources) beside it, the Vulkan loader debs in .gl
# (../.library/device/README.md). There, from the repo root:
#   bash .carry/wgpu-decode/wgpu_decode_ab.sh        (carry: .carry/wgpu-decode .gl; timeout_s 600)
# Logs: $OUT/summary.txt (every run's rows and plan line), $OUT/bench-NAME.log (the last lines of
# each run; prof's holds the per-kernel table).
# Knobs: DEADLINE (440), BENCH_S (a run's timeout, 100), SKIP (names of runs left out).
set -u
. "$(dirname "$0")/gpu_ab_common.sh" 440
wgpu_setup
wait $SYN; say "synth rc=$? at $(el)s"; tail -2 "$OUT/synth.log" >> "$S"
# bench NAME ENV...: one sweep (decode at 4K and 32K) under the environment ENV.
bench() {
  local name=$1; shift
  wgpu_bench "$name" 4K,32K "attend_gqa flat reads [a-z]+|decode attention split [a-z]+|lm_head rows [0-9]+|linear_q4_rows flat reads [a-z]+|decode attention attend[^)]*\)" "$@"
}
ON="LILY_WGPU_ATTN_FLAT=1 LILY_WGPU_ATTN_SPLIT=1 LILY_WGPU_LM_ROWS=64 LILY_WGPU_ROWS_FLAT=1"
OFF="LILY_WGPU_ATTN_FLAT=0 LILY_WGPU_ATTN_SPLIT=0 LILY_WGPU_LM_ROWS=0 LILY_WGPU_ROWS_FLAT=0"
bench off $OFF
bench all $ON
bench prof $ON LILY_PROFILE=1
bench flat $OFF LILY_WGPU_ATTN_FLAT=1
bench split $OFF LILY_WGPU_ATTN_SPLIT=1
bench rows $OFF LILY_WGPU_ROWS_FLAT=1
bench lm $OFF LILY_WGPU_LM_ROWS=64
bench off2 $OFF
bench all2 $ON
grep -h -m1 "wgpu: " "$OUT/full-off.log" 2>/dev/null | cut -c1-1500 >> "$S"
say "done at $(el)s"
