#!/usr/bin/env bash
# One device call (≤ 9 minutes): the wgpu defaults against one switch (issue 29; docs/perf-notes.md,
# sessions 13–16), wgpu through Vulkan on the full-size synthetic checkpoint, `bench --prefill 512
# --decode-ctx 4K,32K --decode-tokens 64`, the two alternated so that drift shows. The switch is
# given as its environment settings in the arguments (`LILY_WGPU_<NAME>=1`; its row in
# crates/lily-wgpu/src/options.rs), the defaults as the same variables at `0`. Measured so far:
# attn_flat, attn_split, rows_early and glu_early won and are on by default; rows_flat, lm_rows,
# down_early, rows_deep, dn_split (session 15) and dn_early (session 16) lost or were neutral and
# left main. The runs:
#   def    the defaults
#   on     the switch on
#   st     selftest with it on (a 4-layer full-width model: agreement and greedy tokens vs the CPU)
#   prof   on, LILY_PROFILE=1, 4K only   (the per-kernel table)
#   proff  def, LILY_PROFILE=1, 4K only  (the same table before)
#   def2, on2  the second pair of the alternation, while time is left.
# Reading it: the switch goes on where `on` beats `def` at 4K and 32K in both pairs and the
# profile shows its kernel faster. No bench starts past DEADLINE seconds (default 430).
#
# Here: the `lily-engine` binary (built with `--features scripted`) gzipped as DIR/bin/
# lily-engine.gz, this script and gpu_ab_common.sh (the preamble it sources) beside it, the
# Vulkan loader debs in .gl (../.library/device/README.md). There, from the repo root:
#   bash .carry/DIR/wgpu_all_ab.sh LILY_WGPU_<NAME>=1     (carry: .carry/DIR .gl; timeout_s 600)
# Knobs: DEADLINE (430), BENCH_S (a run's timeout, 100), SKIP (runs left out).
set -u
if [ $# -eq 0 ]; then
  echo "usage: wgpu_all_ab.sh LILY_WGPU_<NAME>=1 ... (the switch to measure against the defaults)" >&2
  exit 2
fi
ON=("$@")
OFF=("${@/%=1/=0}")
. "$(dirname "$0")/gpu_ab_common.sh" 430
wgpu_setup
wgpu_synth4
wait $SYN; say "synth rc=$? at $(el)s"; tail -2 "$OUT/synth.log" >> "$S"
say "switch: ${ON[*]}"
KEYS="attend_gqa flat reads [a-z]+|decode attention split [a-z]+|linear_q4_rows early reads [a-z]+|linear_q4_glu_rows early routing [a-z]+"
ROWS="attend_gqa|attend_merge|lin\.router|lin\.experts\.glu|moe_down|lin\.dn\.in_proj|dn_recur_norm|lin\.dn\.out|lin\.attn\.qkv|lin\.attn\.o|lin\.lm_head"
bench() {  # bench NAME CTX ENV...
  local name=$1 ctx=$2; shift 2
  wgpu_bench_rows "$name" "$ctx" "$KEYS" "$ROWS" "$@"
}
bench def 4K,32K "${OFF[@]}"
bench on 4K,32K "${ON[@]}"
wgpu_selftest st "${ON[@]}"
bench prof 4K "${ON[@]}" LILY_PROFILE=1
bench proff 4K "${OFF[@]}" LILY_PROFILE=1
bench def2 4K,32K "${OFF[@]}"
bench on2 4K,32K "${ON[@]}"
grep -h -m1 "wgpu: " "$OUT/full-on.log" 2>/dev/null | cut -c1-1500 >> "$S"
say "done at $(el)s"
