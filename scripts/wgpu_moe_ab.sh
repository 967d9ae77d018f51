#!/usr/bin/env bash
# One device call for session 14's decode-MoE switches (issue 29 deliverable 4; docs/perf-notes.md
# "session 14, branch wgpu-moe"): wgpu through Vulkan on the full-size synthetic checkpoint,
# `bench --prefill 512 --decode-ctx 4K,32K --decode-tokens 64` with the switches off and on,
# alternated so that drift shows, the per-kernel profiles of a 4K decode with all off and all on,
# and `selftest` (wgpu on the H200 against the CPU) on a 4-layer full-width model, where decode
# takes these kernels (the small presets' widths do not):
#   off    the defaults (all off)
#   all    LILY_WGPU_ROWS_EARLY=1 LILY_WGPU_GLU_EARLY=1 LILY_WGPU_DOWN_EARLY=1
#   st     selftest with all on (the 4-layer model: agreement and greedy tokens against the CPU)
#   prof   all, LILY_PROFILE=1, 4K only   (per-kernel table: lin.router, lin.experts.glu, moe_down)
#   proff  off, LILY_PROFILE=1, 4K only   (the same table before)
#   rows   LILY_WGPU_ROWS_EARLY=1  (linear_q4_rows' reads first: the router, and every row product)
#   glu    LILY_WGPU_GLU_EARLY=1   (the GLU's routing rounds on keys, one barrier each, only those needed)
#   down   LILY_WGPU_DOWN_EARLY=1  (moe_down_rows' items a slot read together)
# then, while time is left, off and all again (the second pair of the alternation). ≤ 9 minutes:
# no run starts past DEADLINE seconds (default 440) that could not end by 540.
#
# Here: the binary as DIR/bin/lily-engine(.gz) (built with `--features scripted`), this script and
# gpu_ab_common.sh (the preamble it sources) beside it, the Vulkan loader debs in .gl
# (../.library/device/README.md). There, from the repo root:
#   bash .carry/wgpu-moe/wgpu_moe_ab.sh        (carry: .carry/wgpu-moe .gl; timeout_s 600)
# Logs: $OUT/summary.txt (every run's rows and plan line), $OUT/bench-NAME.log (the last lines of
# each run; prof's and proff's hold the per-kernel tables), $OUT/selftest.log.
# Knobs: DEADLINE (440), BENCH_S (a run's timeout, 100), SKIP (names of runs left out).
set -u
. "$(dirname "$0")/gpu_ab_common.sh" 440
wgpu_setup
wgpu_synth4
wait $SYN; say "synth rc=$? at $(el)s"; tail -2 "$OUT/synth.log" >> "$S"
# bench NAME CTX ENV...: one sweep (decode at CTX) under the environment ENV; a profile's rows
# of the switches' kernels and the other row products into the summary.
bench() {
  local name=$1 ctx=$2; shift 2
  wgpu_bench_rows "$name" "$ctx" "linear_q4_rows early reads [a-z]+|linear_q4_glu_rows early routing [a-z]+|moe_down_rows early reads [a-z]+" \
    "lin\.router|lin\.experts\.glu|moe_down|lin\.dn\.out|lin\.attn\.o|lin\.dn\.in_proj|lin\.attn\.qkv|lin\.lm_head" "$@"
}
ON="LILY_WGPU_ROWS_EARLY=1 LILY_WGPU_GLU_EARLY=1 LILY_WGPU_DOWN_EARLY=1"
OFF="LILY_WGPU_ROWS_EARLY=0 LILY_WGPU_GLU_EARLY=0 LILY_WGPU_DOWN_EARLY=0"
bench off 4K,32K $OFF
bench all 4K,32K $ON
wgpu_selftest st $ON
bench prof 4K $ON LILY_PROFILE=1
bench proff 4K $OFF LILY_PROFILE=1
bench rows 4K,32K $OFF LILY_WGPU_ROWS_EARLY=1
bench glu 4K,32K $OFF LILY_WGPU_GLU_EARLY=1
bench down 4K,32K $OFF LILY_WGPU_DOWN_EARLY=1
bench off2 4K,32K $OFF
bench all2 4K,32K $ON
grep -h -m1 "wgpu: " "$OUT/full-off.log" 2>/dev/null | cut -c1-1500 >> "$S"
say "done at $(el)s"
