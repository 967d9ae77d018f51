#!/usr/bin/env bash
# Session 27, branch s27wrec (≤ 200 s by its own clock, Vulkan on the device's GPU): decode's
# DeltaNet step (dn_recur_norm.wgsl, a workgroup of 512 a value head) with one exchange of the four
# slices' partials instead of two (o = α S₀ᵀq̂ + δ k̂ᵀq̂: the state's update and stores leave the
# chain to the output), v, z and the norm's weight read with the state, the head's Σ o² in 16
# partials: 3 barriers, not 10, one memory trip, not three (its `ONE_SYNC`; switch `dn_one_sync`,
# LILY_WGPU_DN_ONE_SYNC; the state bit for bit the same, the output within rounding).
# Predicted (H100, 4K): dn_recur_norm 14.9 → 12.5–13.5 µs a call (× 30: −40…−70 µs a token of
# ≈ 4.2 ms): decode +1…+1.7 % at 4K and 32K (the step does not grow with the context).
# Modelled on gpu_s27wdec_ab.sh; staged by scripts/stage_gpu.sh with gpu_ab_common.sh
# (bin/lily-engine, bin/wgpu_model):
#   CARGO_TARGET_DIR=/work/wt-s27wrec/target bash scripts/stage_gpu.sh /work/main/.carry/s27wrec
#   cp scripts/gpu_s27wrec_ab.sh /work/main/.carry/s27wrec/
#   device: bash .carry/s27wrec/gpu_s27wrec_ab.sh      (carry: .carry/s27wrec .gl; timeout_s 240)
# 1. beside the synth: lily-wgpu's `deltanet_step_one_sync_matches_the_old_kernel` (ONE_SYNC's
#    state bit for bit the old kernel's, its output within the kernel bound of the host's f64 and
#    of the old output; both reduction forms, f32 and f16 activations, dk/dv 128/128, 64/96,
#    32/32), `deltanet_step_matches_the_host` (the shipping kernel) and
#    `decode_with_dn_one_sync_matches_cpu` (tiny, 24 greedy steps against the CPU, both reduction
#    forms); they set the switch in their cases: run without the variable;
# 2. `bench --device wgpu --prefill 512 --decode-ctx 4K,32K --decode-tokens 64 --repeat 1`,
#    OFF / ON twice;
# 3. if the clock allows: LILY_PROFILE=1 at 4K OFF / ON (dn_recur_norm's row; lin.dn.in_proj and
#    lin.dn.out beside it as rows that must not move) into the summary.
# Logs in /tmp/s27wrec-logs (outside $OUT); $OUT gets summary.txt and the profiles' tails.
set -u
R=${OUT:-$PWD/gpu-logs}; mkdir -p "$R"
L=/tmp/s27wrec-logs; mkdir -p "$L"; rm -f "$L/summary.txt"
export OUT=$L
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-185}"
S=$R/summary.txt; cat "$L/summary.txt" >> "$S"
AB_HARD=${HARD:-198}
OFF=${OFF:-LILY_WGPU_DN_ONE_SYNC=0}
ON=${ON:-LILY_WGPU_DN_ONE_SYNC=1}
K="decode DeltaNet step one exchange (on|off)"
P='dn_recur_norm|lin.dn.in_proj|lin.dn.out'
wgpu_setup
env -u LILY_WGPU_DN_ONE_SYNC timeout "$(cap 85)" \
  "$B/wgpu_model" --test-threads=1 --nocapture deltanet_step decode_with_dn_one_sync \
  > "$OUT/wtests.log" 2>&1
say "wgpu tests rc=$? at $(el)s"
grep -hE "^test .*(ok|FAILED)$|^test result|panicked|ONE_SYNC y|dn_recur_norm [0-9]|identical tokens" "$OUT/wtests.log" | cut -c1-250 | head -16 | tee -a "$S"
wait "$SYN"; say "synth full rc=$? at $(el)s"
export PREFILL=${PREFILL:-512}
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
