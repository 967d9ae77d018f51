#!/usr/bin/env bash
# One device call (≤ 6 minutes) for `nib_floats` (issue 29; docs/perf-notes.md, session 17): the
# decode products' 4-bit nibbles made floats by their bits instead of converted. wgpu through
# Vulkan on the full-size synthetic checkpoint (with the bundled tokenizer, for `serve`):
#   def, on        `bench --prefill 512,4K --decode-ctx 4K,32K --decode-tokens 64`, the defaults
#                  (LILY_WGPU_NIB_FLOATS=0) and the switch on (=1)
#   proff, prof    LILY_PROFILE=1 at 4K, defaults and on: the decode table's first 12 kernels
#   st             selftest with it on (a 4-layer full-width model: agreement and greedy tokens
#                  vs the CPU)
#   served         the defaults served: `lily-engine serve --device wgpu` + serve_bench.py, a
#                  4,096-token prompt, one client, 256 greedy tokens ×3 (as gpu_session.sh runs CUDA)
#   def2, on2      the second pair, while time is left.
# Predicted (perf-notes, session 17): the products' arithmetic ≈ halved, 4K 176 → 181–195 tok/s,
# 32K 149 → 152–163, prefill unchanged; in the profile in_proj / qkv / glu −1…3.4 µs a call,
# out / o −0.4…1.1, moe_down −0.6…1.7, lm_head −50…120 µs. It goes on where `on` beats `def` at
# 4K and 32K in both pairs and selftest passes. No run starts past DEADLINE (default 310 s) and
# none runs past AB_HARD (default 355 s): the second pair is the first thing the clock drops.
#
# Here: the `lily-engine` binary (`--features scripted`) gzipped as DIR/bin/lily-engine.gz, this
# script, gpu_ab_common.sh and serve_bench.py beside it, the bundled tokenizer in
# .carry/tokenizer (tokenizer.json.gz and its files), the Vulkan loader debs in .gl. There:
#   bash .carry/wgpu/wgpu_q4_ab.sh     (carry: .carry/wgpu .carry/tokenizer .gl; timeout_s 420)
# Knobs: DEADLINE, AB_HARD, BENCH_S (a run's timeout, 100), SKIP (runs left out).
set -u
export AB_TOKENIZER=1 AB_HARD=${AB_HARD:-355}
. "$(dirname "$0")/gpu_ab_common.sh" 310
OFF=LILY_WGPU_NIB_FLOATS=0
ON=LILY_WGPU_NIB_FLOATS=1
wgpu_setup
wgpu_synth4
wait $SYN; say "synth rc=$? at $(el)s"; tail -2 "$OUT/synth.log" >> "$S"
KEYS="4-bit nibbles as float bits [a-z]+"
bench() {  # bench NAME CTX ENV...
  local name=$1 ctx=$2; shift 2
  wgpu_bench "$name" "$ctx" "$KEYS" "$@"
}
prof() {  # prof NAME ENV...: the decode table's header and first 12 kernels
  local name=$1; shift
  PREFILL=512 wgpu_bench "$name" 4K "$KEYS" "$@" LILY_PROFILE=1 || return
  sed -n '/^\[decode\]/,$p' "$OUT/bench-$name.log" | sed -n '1p;3,14p' | tr -s ' ' | cut -c1-240 >> "$S"
}
served() {
  if skipped served; then say "skip served"; return; fi
  if ! left; then say "skip served: past the deadline at $(el)s"; return; fi
  LILY_ENGINE_BIN="$B/lily-engine" timeout "$(cap 150)" python3 "$HERE/serve_bench.py" --model "$M" \
    --device wgpu --prompt-tokens 4096 --max-tokens 256 --repeat 3 > "$OUT/served.log" 2>&1
  say "served rc=$? at $(el)s: $(grep -E '^(completions|engine|served)' "$OUT/served.log" | tail -3 | tr -s ' ' | tr '\n' '|' | cut -c1-600)"
}
export PREFILL=512,4K
bench def 4K,32K $OFF
bench on 4K,32K $ON
prof proff $OFF
prof prof $ON
wgpu_selftest st $ON
served
bench def2 4K,32K $OFF
bench on2 4K,32K $ON
say "done at $(el)s"
