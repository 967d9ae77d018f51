#!/usr/bin/env bash
# One device call for every wgpu decode switch waiting for its A/B (issue 29 deliverable 4), when
# there is no time for the three per-branch calls (wgpu_decode_ab.sh, wgpu_moe_ab.sh,
# wgpu_dn_ab.sh, each ≈ 8 minutes): wgpu through Vulkan on the full-size synthetic checkpoint,
# `bench --prefill 512 --decode-ctx 4K,32K --decode-tokens 64`, the switches by the group of the
# branch that added them, the groups and everything off / on alternated so that drift shows:
#   off    every switch below off (the defaults)
#   all    every switch below on (dn_early has nothing to act on once dn_split replaces
#          dn_recur_norm, so it rides along)
#   st     selftest with all on (a 4-layer full-width model: agreement and greedy tokens vs the CPU)
#   prof   all, LILY_PROFILE=1, 4K only   (per-kernel table of every switched kernel)
#   proff  off, LILY_PROFILE=1, 4K only   (the same table before)
#   reads  session 13 (wgpu-decode): ATTN_FLAT ATTN_SPLIT ROWS_FLAT LM_ROWS=64
#   moe    session 14 (wgpu-moe): ROWS_EARLY GLU_EARLY DOWN_EARLY
#   dn     session 14 (wgpu-dn): ROWS_DEEP DN_EARLY DN_SPLIT
#   off2, all2  the second pair of the alternation, while time is left.
# Reading it: a group that beats `off` at 4K and 32K goes on switch by switch where the profile
# rows (prof against proff) show each of its kernels faster; a group that loses is split by the
# per-branch script of the next call. ≤ 9 minutes: no bench starts past DEADLINE (default 430).
#
# Here: stage with `bash scripts/stage_gpu.sh /work/main/.carry/wgpu-all` (only bin/lily-engine
# is needed: `rm` the test binaries), gzip -9 it, copy this script beside it. There:
#   bash .carry/wgpu-all/wgpu_all_ab.sh      (carry: .carry/wgpu-all .gl; timeout_s 600)
# Knobs: DEADLINE (430), BENCH_S (a run's timeout, 100), SKIP (names of runs left out).
set -u
. "$(dirname "$0")/gpu_ab_common.sh" 430
wgpu_setup
wgpu_synth4
wait $SYN; say "synth rc=$? at $(el)s"; tail -2 "$OUT/synth.log" >> "$S"
KEYS="attend_gqa flat reads [a-z]+|decode attention split [a-z]+|lm_head rows [0-9]+|linear_q4_rows [a-z]+ reads [a-z]+|linear_q4_glu_rows early routing [a-z]+|moe_down_rows early reads [a-z]+|dn_recur_norm early reads [a-z]+|DeltaNet recurrence split [a-z]+"
ROWS="attend_gqa|attend_merge|lin\.router|lin\.experts\.glu|moe_down|lin\.dn\.in_proj|dn_recur_norm|dn_recur_cols|lin\.dn\.out|lin\.attn\.qkv|lin\.attn\.o|lin\.lm_head"
bench() {  # bench NAME CTX ENV...
  local name=$1 ctx=$2; shift 2
  wgpu_bench_rows "$name" "$ctx" "$KEYS" "$ROWS" "$@"
}
READS="LILY_WGPU_ATTN_FLAT=1 LILY_WGPU_ATTN_SPLIT=1 LILY_WGPU_ROWS_FLAT=1 LILY_WGPU_LM_ROWS=64"
MOE="LILY_WGPU_ROWS_EARLY=1 LILY_WGPU_GLU_EARLY=1 LILY_WGPU_DOWN_EARLY=1"
DN="LILY_WGPU_ROWS_DEEP=1 LILY_WGPU_DN_EARLY=1 LILY_WGPU_DN_SPLIT=1"
OFF="LILY_WGPU_ATTN_FLAT=0 LILY_WGPU_ATTN_SPLIT=0 LILY_WGPU_ROWS_FLAT=0 LILY_WGPU_LM_ROWS=0 LILY_WGPU_ROWS_EARLY=0 LILY_WGPU_GLU_EARLY=0 LILY_WGPU_DOWN_EARLY=0 LILY_WGPU_ROWS_DEEP=0 LILY_WGPU_DN_EARLY=0 LILY_WGPU_DN_SPLIT=0"
bench off 4K,32K $OFF
bench all 4K,32K $OFF $READS $MOE $DN
wgpu_selftest st $OFF $READS $MOE $DN
bench prof 4K $OFF $READS $MOE $DN LILY_PROFILE=1
bench proff 4K $OFF LILY_PROFILE=1
bench reads 4K,32K $OFF $READS
bench moe 4K,32K $OFF $MOE
bench dn 4K,32K $OFF $DN
bench off2 4K,32K $OFF
bench all2 4K,32K $OFF $READS $MOE $DN
grep -h -m1 "wgpu: " "$OUT/full-all.log" 2>/dev/null | cut -c1-1500 >> "$S"
say "done at $(el)s"
