#!/usr/bin/env bash
# Session 26, branch s26wdec (≤ 200 s by its own clock, Vulkan on the device's GPU):
# `router_lean`, decode's MoE router (with the shared expert's gate: 257 rows, 8-bit) on
# linear_q4_rows' 1-row kernel with `LEAN` (257 workgroups reading 2 16-byte words a lane, not
# 129 reading 4; the row's partials and the folded norm's Σx² in one two-value workgroup sum: one
# subgroupAdd and one barrier where `rms_scale` + `row_total` take five barriers and 32 serial
# adds). Predicted: lin.router 14.9 → 12.5–13.5 µs a call (40 a token), decode +1…+2 % at 4K.
# Modelled on gpu_s25wdec_ab.sh (kept at c086b49) and gpu_s25chunk.sh; staged by
# scripts/stage_gpu.sh with gpu_ab_common.sh (bin/lily-engine, bin/wgpu_model):
#   CARGO_TARGET_DIR=/work/wt-s26wdec/target bash scripts/stage_gpu.sh /work/main/.carry/s26wdec
#   cp scripts/gpu_s26wdec_ab.sh /work/main/.carry/s26wdec/
#   device: bash .carry/s26wdec/gpu_s26wdec_ab.sh      (carry: .carry/s26wdec .gl; timeout_s 240)
# 1. beside the synth: lily-wgpu's `router_lean_kernel_matches_the_host` (the 1-row LEAN kernel
#    among every row-product probe, 4-bit 2,048 / 4,096 and 8-bit 2,048 columns, the norm folded
#    and not, both reduction forms, f32 and f16 activations, against the host's f64; the plan's
#    rows a workgroup); it sets the switch in its cases: run without LILY_WGPU_ROUTER_LEAN;
# 2. `bench --device wgpu --prefill 512 --decode-ctx 4K,32K --decode-tokens 64 --repeat 1`,
#    OFF / ON twice;
# 3. if the clock allows: LILY_PROFILE=1 at 4K OFF / ON (lin.router, the row that should move;
#    lin.experts.glu and lin.dn.out beside it as rows that must not) into the summary.
# Logs in /tmp/s26wdec-logs (outside $OUT); $OUT gets summary.txt and the profiles' tails.
set -u
R=${OUT:-$PWD/gpu-logs}; mkdir -p "$R"
L=/tmp/s26wdec-logs; mkdir -p "$L"; rm -f "$L/summary.txt"
export OUT=$L
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-185}"
S=$R/summary.txt; cat "$L/summary.txt" >> "$S"
AB_HARD=${HARD:-198}
OFF=${OFF:-LILY_WGPU_ROUTER_LEAN=0}
ON=${ON:-LILY_WGPU_ROUTER_LEAN=1}
K="linear_q4_rows lean 1-row router (on|off)|the products of < 1,024 rows on its lean 1-row kernel"
P='lin.router|lin.experts.glu|lin.dn.out'
wgpu_setup
env -u LILY_WGPU_ROUTER_LEAN timeout "$(cap 60)" "$B/wgpu_model" --test-threads=1 --nocapture \
  router_lean_kernel_matches_the_host > "$OUT/wtests.log" 2>&1
say "wgpu tests rc=$? at $(el)s"
grep -hE "^test .*(ok|FAILED)$|^test result|panicked|lean 1-row kernel among" "$OUT/wtests.log" | cut -c1-250 | head -10 | tee -a "$S"
wait "$SYN"; say "synth full rc=$? at $(el)s"
export PREFILL=512
# shellcheck disable=SC2086
BENCH_S=35 wgpu_bench off-1 4K,32K "$K" $OFF
# shellcheck disable=SC2086
BENCH_S=35 wgpu_bench on-1 4K,32K "$K" $ON
# shellcheck disable=SC2086
BENCH_S=35 wgpu_bench off-2 4K,32K "$K" $OFF
# shellcheck disable=SC2086
BENCH_S=35 wgpu_bench on-2 4K,32K "$K" $ON
# The profiles last (the deadline may cut them; the two rounds decide, the rows say why).
# shellcheck disable=SC2086
BENCH_S=25 wgpu_bench_rows prof-off 4K "$K" "$P" LILY_PROFILE=1 $OFF
# shellcheck disable=SC2086
BENCH_S=25 wgpu_bench_rows prof-on 4K "$K" "$P" LILY_PROFILE=1 $ON
cp "$L"/bench-prof-*.log "$L/wtests.log" "$R"/ 2>/dev/null
say "done at $(el)s"
