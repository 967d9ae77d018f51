#!/usr/bin/env bash
# One device call (≤ 9 minutes) for the wgpu decode switch still waiting for its A/B (issue 29;
# docs/perf-notes.md, sessions 13–15): wgpu through Vulkan on the full-size synthetic checkpoint,
# `bench --prefill 512 --decode-ctx 4K,32K --decode-tokens 64`, the defaults and the switch on
# alternated so that drift shows. Session 15 measured the rest: attn_flat, attn_split,
# rows_early and glu_early won and are on by default; rows_flat, lm_rows, down_early, rows_deep
# and dn_split lost or were neutral and left main. Left to measure:
#   DN_EARLY  dn_recur_norm's early reads (session 14, wgpu-dn; never active alone: session 15's
#             `dn` group ran it under dn_split, whose recurrence replaced dn_recur_norm)
# The runs:
#   def    the defaults (DN_EARLY=0)
#   dn     DN_EARLY=1
#   st     selftest with DN_EARLY=1 (a 4-layer full-width model: agreement and greedy tokens vs
#          the CPU)
#   prof   dn, LILY_PROFILE=1, 4K only   (the per-kernel table: dn_recur_norm's row)
#   proff  def, LILY_PROFILE=1, 4K only  (the same table before)
#   def2, dn2  the second pair of the alternation, while time is left.
# Reading it: dn_early goes on where `dn` beats `def` at 4K and 32K in both pairs and the profile
# shows dn_recur_norm faster (predicted 14.1 → 12–13 µs a call on the H200). No bench starts
# past DEADLINE seconds (default 430).
#
# Here: the `lily-engine` binary (built with `--features scripted`) gzipped as DIR/bin/
# lily-engine.gz, this script and gpu_ab_common.sh (the preamble it sources) beside it, the
# Vulkan loader debs in .gl (../.library/device/README.md). There, from the repo root:
#   bash .carry/wgpu-prune/wgpu_all_ab.sh      (carry: .carry/wgpu-prune .gl; timeout_s 600)
# Knobs: DEADLINE (430), BENCH_S (a run's timeout, 100), SKIP (runs left out).
set -u
. "$(dirname "$0")/gpu_ab_common.sh" 430
OFF=LILY_WGPU_DN_EARLY=0
ON=LILY_WGPU_DN_EARLY=1
wgpu_setup
wgpu_synth4
wait $SYN; say "synth rc=$? at $(el)s"; tail -2 "$OUT/synth.log" >> "$S"
KEYS="attend_gqa flat reads [a-z]+|decode attention split [a-z]+|linear_q4_rows early reads [a-z]+|linear_q4_glu_rows early routing [a-z]+|dn_recur_norm early reads [a-z]+"
ROWS="attend_gqa|attend_merge|lin\.router|lin\.experts\.glu|moe_down|lin\.dn\.in_proj|dn_recur_norm|lin\.dn\.out|lin\.attn\.qkv|lin\.attn\.o|lin\.lm_head"
bench() {  # bench NAME CTX ENV...
  local name=$1 ctx=$2; shift 2
  wgpu_bench_rows "$name" "$ctx" "$KEYS" "$ROWS" "$@"
}
bench def 4K,32K $OFF
bench dn 4K,32K $ON
wgpu_selftest st $ON
bench prof 4K $ON LILY_PROFILE=1
bench proff 4K $OFF LILY_PROFILE=1
bench def2 4K,32K $OFF
bench dn2 4K,32K $ON
grep -h -m1 "wgpu: " "$OUT/full-dn.log" 2>/dev/null | cut -c1-1500 >> "$S"
say "done at $(el)s"
