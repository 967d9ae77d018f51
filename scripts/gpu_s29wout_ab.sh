#!/usr/bin/env bash
# Session 29, branch s29wout (≤ 200 s by its own clock, Vulkan on the device's GPU): decode's
# output projections (DeltaNet's out_proj and attention's o, 2,048 rows of 4,096 columns, added
# into the residual stream) on linear_q4_rows' lean 1-row kernel with the norm's code compiled
# out (switch `out_lean`, LILY_WGPU_OUT_LEAN; its `LEAN` 1, `NORM` 0): 2,048 workgroups reading 2
# 16-byte words a lane and one workgroup sum a row, against today's 2-row kernel (`out_rows` 2:
# 1,024 workgroups of 4 words a lane, `row_total`'s 3 barriers and 32 serial adds). 56 registers
# on a CUDA transcription (scripts/rows_out_regs.cu; 96 with the norm's code): one wave.
# Predicted (H100, 4K, µs a call): lin.dn.out 17.6 → 14–16.5, lin.attn.o 17.9 → 14–16.5;
# −45…−150 µs a token of ≈ 3.95 ms: decode +1…+4 % at 4K and 32K. lin.dn.in_proj, lin.attn.qkv,
# lin.router, lin.lm_head must not move.
# Modelled on gpu_s28wrows_ab.sh; staged by scripts/stage_gpu.sh with gpu_ab_common.sh
# (bin/lily-engine, bin/wgpu_model):
#   CARGO_TARGET_DIR=/work/wt-s29wout/target bash scripts/stage_gpu.sh /work/main/.carry/s29wout
#   cp scripts/gpu_s29wout_ab.sh /work/main/.carry/s29wout/
#   device: bash .carry/s29wout/gpu_s29wout_ab.sh      (carry: .carry/s29wout .gl; timeout_s 240)
# 1. beside the synth: lily-wgpu's `out_lean_kernel_matches_the_host_and_todays` (the kernel
#    added into a random residual at the full out_proj shape and on 37 rows, against the host's
#    f64, the 2-row kernel, and bit for bit the router's lean kernel; both reduction forms, f16
#    activations; every product probe; a tiny decode against the CPU); it sets the switch
#    itself: run without the variable;
# 2. `bench --device wgpu --prefill 512 --decode-ctx 4K,32K --decode-tokens 64 --repeat 1`,
#    OFF / ON twice;
# 3. if the clock allows: LILY_PROFILE=1 at 4K OFF / ON, the rows lin.dn.out, lin.attn.o (must
#    move) and lin.dn.in_proj, lin.attn.qkv, lin.router, lin.lm_head (must not) into the summary.
# Logs in /tmp/s29wout-logs (outside $OUT); $OUT gets summary.txt and the profiles' tails.
set -u
R=${OUT:-$PWD/gpu-logs}; mkdir -p "$R"
L=/tmp/s29wout-logs; mkdir -p "$L"; rm -f "$L/summary.txt"
export OUT=$L
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-185}"
S=$R/summary.txt; cat "$L/summary.txt" >> "$S"
AB_HARD=${HARD:-198}
OFF=${OFF:-LILY_WGPU_OUT_LEAN=0}
ON=${ON:-LILY_WGPU_OUT_LEAN=1}
K="linear_q4_rows lean 1-row output projections (on|off)|products on its (lean 1-row|2-row) kernel"
P='lin.dn.out|lin.attn.o|lin.dn.in_proj|lin.attn.qkv|lin.router|lin.lm_head'
wgpu_setup
env -u LILY_WGPU_OUT_LEAN timeout "$(cap 80)" \
  "$B/wgpu_model" --test-threads=1 --nocapture out_lean_kernel \
  > "$OUT/wtests.log" 2>&1
say "wgpu tests rc=$? at $(el)s"
grep -hE "^test .*(ok|FAILED)$|^test result|panicked|out_lean's kernel [0-9]" "$OUT/wtests.log" | cut -c1-250 | head -12 | tee -a "$S"
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
