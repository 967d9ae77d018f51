#!/usr/bin/env bash
# One device call for session 14's DeltaNet-chain switches (issue 29 deliverable 4; docs/perf-notes.md
# "session 14, branch wgpu-dn"): wgpu through Vulkan on the full-size synthetic checkpoint,
# `bench --prefill 512 --decode-ctx 4K,32K --decode-tokens 64` with the switches off and on,
# alternated so that drift shows, the per-kernel profiles of a 4K decode with both off and both on,
# and `selftest` (wgpu on the H200 against the CPU) on a 4-layer full-width model, where decode
# takes these kernels (the small presets' widths do not):
#   off    the defaults (all off)
#   all    LILY_WGPU_ROWS_DEEP=1 LILY_WGPU_DN_EARLY=1 LILY_WGPU_DN_SPLIT=1 (dn_early has nothing to
#          act on once the split replaces dn_recur_norm: all = rows_deep + dn_split)
#   st     selftest with all on (the 4-layer model: agreement and greedy tokens against the CPU)
#   prof   all, LILY_PROFILE=1, 4K only   (per-kernel table: lin.dn.in_proj, dn_recur_cols, lin.dn.out, ...)
#   proff  off, LILY_PROFILE=1, 4K only   (the same table before: dn_recur_norm)
#   deep   LILY_WGPU_ROWS_DEEP=1  (linear_q4_rows' rows a round ahead, the conv's and residual's reads first)
#   early  LILY_WGPU_DN_EARLY=1   (dn_recur_norm's v, z, norm weight first; Σ o² after one barrier)
#   split  LILY_WGPU_DN_SPLIT=1   (the recurrence over 32-column blocks, its norm and gate in out_proj)
# then, while time is left, off and all again (the second pair of the alternation). ≤ 8 minutes:
# no bench starts past DEADLINE seconds (default 380; each ends within BENCH_S, 100: by 480).
#
# Here: the binary as DIR/bin/lily-engine(.gz) (built with `--features scripted`), this script and
# gpu_ab_common.sh (the preamble it sources) beside it, the Vulkan loader debs in .gl
# (../.library/device/README.md). There, from the repo root:
#   bash .carry/wgpu-dn/wgpu_dn_ab.sh        (carry: .carry/wgpu-dn .gl; timeout_s 600)
# Logs: $OUT/summary.txt (every run's rows and plan line), $OUT/bench-NAME.log (the last lines of
# each run; prof's and proff's hold the per-kernel tables), $OUT/st.log.
# Knobs: DEADLINE (380), BENCH_S (a run's timeout, 100), SKIP (names of runs left out).
set -u
. "$(dirname "$0")/gpu_ab_common.sh" 380
wgpu_setup
wgpu_synth4
wait $SYN; say "synth rc=$? at $(el)s"; tail -2 "$OUT/synth.log" >> "$S"
# bench NAME CTX ENV...: one sweep (decode at CTX) under the environment ENV; a profile's rows
# of the switches' kernels and the other row products into the summary.
bench() {
  local name=$1 ctx=$2; shift 2
  wgpu_bench_rows "$name" "$ctx" "linear_q4_rows deep reads [a-z]+|dn_recur_norm early reads [a-z]+|DeltaNet recurrence split [a-z]+" \
    "lin\.dn\.in_proj|dn_recur_norm|dn_recur_cols|lin\.dn\.out|lin\.attn\.qkv|lin\.attn\.o|lin\.lm_head" "$@"
}
ON="LILY_WGPU_ROWS_DEEP=1 LILY_WGPU_DN_EARLY=1 LILY_WGPU_DN_SPLIT=1"
OFF="LILY_WGPU_ROWS_DEEP=0 LILY_WGPU_DN_EARLY=0 LILY_WGPU_DN_SPLIT=0"
bench off 4K,32K $OFF
bench all 4K,32K $ON
wgpu_selftest st $ON
bench prof 4K $ON LILY_PROFILE=1
bench proff 4K $OFF LILY_PROFILE=1
bench deep 4K,32K $OFF LILY_WGPU_ROWS_DEEP=1
bench early 4K,32K $OFF LILY_WGPU_DN_EARLY=1
bench split 4K,32K $OFF LILY_WGPU_DN_SPLIT=1
bench off2 4K,32K $OFF
bench all2 4K,32K $ON
grep -h -m1 "wgpu: " "$OUT/full-off.log" 2>/dev/null | cut -c1-1500 >> "$S"
say "done at $(el)s"
