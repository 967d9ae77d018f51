#!/usr/bin/env bash
# One device call (≈ 7–8 minutes; timeout_s 480): prefill's tile products on cooperative matrices (`coop`,
# linear_q4_coop.wgsl: 16 × 16 f16 × f16 → f32 on the H100's tensor cores through Vulkan) against
# the defaults (linear_q4_mm.wgsl, f32 tiles) and linear_q4_mm's f16 tiles, wgpu through Vulkan on
# the full-size synthetic checkpoint (issue 29 deliverable 5; docs/perf-notes.md, session 17
# wgpu-coop, holds the prediction). The runs:
#   gpu    the lily-wgpu GPU tests: coop_products_and_logits_match_cpu (the kernel against the
#          host at every tile size, tiny's logits against the CPU) and the f16 tiles' test
#   off    the defaults                     (bench --prefill 512,4K --decode-ctx 4K)
#   on     LILY_WGPU_COOP=1
#   f16    LILY_WGPU_F16_TILES=1 (linear_q4_mm's f16 tiles: the same operands' rounding)
#   proff, prof   off / on with LILY_PROFILE=1, 4K only (the lin.* rows: the products' share)
#   st-on, st-off selftest on a 4-layer full-width model, coop on and off (agreement with the CPU:
#          on, at the f16 tiles' level — the operands' f16 rounding, which selftest's 1e-3 bound
#          may flag —; off, fp32's)
#   off2, on2     the second pair of the alternation, while time is left.
# Reading it: the plan line must say "linear_q4_coop on 16×16 cooperative matrices" and
# "linear_q4_coop checked at load" (else the adapter lacks the feature or the check refused it:
# the line says why); coop goes on where `on` beats `off` at 512 and 4K in both pairs, and its
# selftest agrees as the f16 tiles' does. No run starts past DEADLINE seconds (default 360; a
# bench's timeout is BENCH_S, so the call ends by ≈ 460 s).
#
# Here: bin/lily-engine.gz (built with `--features scripted`) and bin/wgpu_model.gz (lily-wgpu's
# tests/model.rs binary), this script and gpu_ab_common.sh beside them, the Vulkan loader debs in
# .gl (../.library/device/README.md). There, from the repo root:
#   bash .carry/coop/wgpu_coop_ab.sh          (carry: .carry/coop .gl; timeout_s 480)
# Knobs: DEADLINE (360), BENCH_S (a run's timeout, 100), SKIP (runs left out, e.g. "gpu f16").
set -u
. "$(dirname "$0")/gpu_ab_common.sh" 360
wgpu_setup
wgpu_synth4
if skipped gpu; then say "skip gpu"; else
  timeout "$(cap 90)" "$B/wgpu_model" --test-threads 1 --nocapture coop_products_and_logits_match_cpu \
    prefill_tiles_in_f16_and_f32_match_cpu > "$OUT/gpu-tests.log" 2>&1
  say "gpu tests rc=$? at $(el)s: $(grep -E '^(linear_q4_coop|coop|f16 tiles|SKIPPED|test result|thread)|refused|^[0-9]+ rows' "$OUT/gpu-tests.log" | head -16 | cut -c1-300 | tr -s ' ' | tr '\n' '|')"
fi
wait $SYN; say "synth rc=$? at $(el)s"; tail -2 "$OUT/synth.log" >> "$S"
KEYS="cooperative matrices [a-z]+|f16 tiles [a-z]+|prefill products [^(]+\([^)]+\)|linear_q4_coop (checked|refused)[^;]*"
ROWS="lin\.experts\.gate|lin\.experts\.up|lin\.experts\.down|lin\.dn\.in_proj|lin\.dn\.out|lin\.attn\.qkv|lin\.attn\.o|lin\.router|moe_group|swiglu"
bench() {  # bench NAME PREFILL ENV...
  local name=$1; PREFILL=$2; shift 2
  wgpu_bench_rows "$name" 4K "$KEYS" "$ROWS" "$@"
}
# Most telling first: the deadline cuts from the end.
bench off 512,4K LILY_WGPU_COOP=0
bench on 512,4K LILY_WGPU_COOP=1
bench prof 4K LILY_WGPU_COOP=1 LILY_PROFILE=1
wgpu_selftest st-on LILY_WGPU_COOP=1
wgpu_selftest st-off LILY_WGPU_COOP=0
bench f16 512,4K LILY_WGPU_COOP=0 LILY_WGPU_F16_TILES=1
bench proff 4K LILY_WGPU_COOP=0 LILY_PROFILE=1
bench off2 512,4K LILY_WGPU_COOP=0
bench on2 512,4K LILY_WGPU_COOP=1
grep -h -m1 "wgpu: " "$OUT/full-on.log" 2>/dev/null | cut -c1-1500 >> "$S"
say "done at $(el)s"
