#!/usr/bin/env bash
# One device call (≤ 9 minutes) for the wgpu decode switches waiting for their A/B (issue 29
# deliverable 4; docs/perf-notes.md, sessions 13–14): wgpu through Vulkan on the full-size
# synthetic checkpoint, `bench --prefill 512 --decode-ctx 4K,32K --decode-tokens 64`, off and on
# alternated so that drift shows. The switches, by the branch that added them:
#   reads  (session 13, wgpu-decode) ATTN_FLAT ATTN_SPLIT ROWS_FLAT LM_ROWS=64
#   moe    (session 14, wgpu-moe)    ROWS_EARLY GLU_EARLY DOWN_EARLY
#   dn     (session 14, wgpu-dn)     ROWS_DEEP DN_EARLY DN_SPLIT   (dn_early has nothing to act on
#          once dn_split replaces dn_recur_norm)
# The runs:
#   off    every switch above off (the defaults)
#   all    every switch above on
#   st     selftest with all on (a 4-layer full-width model: agreement and greedy tokens vs the CPU)
#   prof   all, LILY_PROFILE=1, 4K only   (the per-kernel table of every switched kernel)
#   proff  off, LILY_PROFILE=1, 4K only   (the same table before)
#   then each group on alone (reads, moe, dn), or with SPLIT=GROUP each switch of that group on
#   alone (named after it, e.g. ATTN_SPLIT) instead;
#   off2, all2  the second pair of the alternation, while time is left.
# Reading it: a group that beats `off` at 4K and 32K goes on switch by switch where the profile
# rows (prof against proff) show its kernels faster; a group that loses is split (SPLIT=GROUP)
# in the next call. No bench starts past DEADLINE seconds (default 430).
#
# Here: the `lily-engine` binary (built with `--features scripted`) gzipped as DIR/bin/
# lily-engine.gz, this script and gpu_ab_common.sh (the preamble it sources) beside it, the
# Vulkan loader debs in .gl (../.library/device/README.md). There, from the repo root:
#   bash .carry/wgpu-all/wgpu_all_ab.sh      (carry: .carry/wgpu-all .gl; timeout_s 600)
# Knobs: SPLIT (a group), DEADLINE (430), BENCH_S (a run's timeout, 100), SKIP (runs left out).
set -u
. "$(dirname "$0")/gpu_ab_common.sh" 430
declare -A GROUP=(
  [reads]="ATTN_FLAT ATTN_SPLIT ROWS_FLAT LM_ROWS=64"
  [moe]="ROWS_EARLY GLU_EARLY DOWN_EARLY"
  [dn]="ROWS_DEEP DN_EARLY DN_SPLIT"
)
on() {  # on SWITCH...: the environment turning them on (LM_ROWS=64 as written, others =1)
  local s; for s in "$@"; do case $s in *=*) echo "LILY_WGPU_$s" ;; *) echo "LILY_WGPU_$s=1" ;; esac; done
}
ALL=$(on ${GROUP[reads]} ${GROUP[moe]} ${GROUP[dn]})
OFF=$(echo "$ALL" | sed -E 's/=[0-9]+$/=0/')
wgpu_setup
wgpu_synth4
wait $SYN; say "synth rc=$? at $(el)s"; tail -2 "$OUT/synth.log" >> "$S"
KEYS="attend_gqa flat reads [a-z]+|decode attention split [a-z]+|lm_head rows [0-9]+|linear_q4_rows [a-z]+ reads [a-z]+|linear_q4_glu_rows early routing [a-z]+|moe_down_rows early reads [a-z]+|dn_recur_norm early reads [a-z]+|DeltaNet recurrence split [a-z]+"
ROWS="attend_gqa|attend_merge|lin\.router|lin\.experts\.glu|moe_down|lin\.dn\.in_proj|dn_recur_norm|dn_recur_cols|lin\.dn\.out|lin\.attn\.qkv|lin\.attn\.o|lin\.lm_head"
bench() {  # bench NAME CTX ENV...
  local name=$1 ctx=$2; shift 2
  wgpu_bench_rows "$name" "$ctx" "$KEYS" "$ROWS" "$@"
}
bench off 4K,32K $OFF
bench all 4K,32K $OFF $ALL
wgpu_selftest st $OFF $ALL
bench prof 4K $OFF $ALL LILY_PROFILE=1
bench proff 4K $OFF LILY_PROFILE=1
if [ -n "${SPLIT:-}" ]; then
  [ -n "${GROUP[$SPLIT]:-}" ] || { say "SPLIT=$SPLIT: no such group (reads, moe, dn)"; exit 2; }
  for s in ${GROUP[$SPLIT]}; do bench "${s%%=*}" 4K,32K $OFF $(on "$s"); done
else
  for g in reads moe dn; do bench "$g" 4K,32K $OFF $(on ${GROUP[$g]}); done
fi
bench off2 4K,32K $OFF
bench all2 4K,32K $OFF $ALL
grep -h -m1 "wgpu: " "$OUT/full-all.log" 2>/dev/null | cut -c1-1500 >> "$S"
say "done at $(el)s"
