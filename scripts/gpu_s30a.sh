#!/usr/bin/env bash
# Session 30's one call (286 s of device time left after a failed start, a cold start included: its own clock ≤ 160 s): session 29's three
# switches, merged off, decided on one staging of main.
#   1. beside the synth: the GPU tests of `dn_rows_loop` (CUDA) and of `out_lean` / `glu_split`
#      (wgpu; each kernel against the host and today's kernel);
#   2. wgpu `bench --prefill 512 --decode-ctx 4K --decode-tokens 64`, OFF (out_lean and
#      glu_split off) then ON (both on);
#   3. CUDA `bench --prefill 1K --decode-ctx 1K --decode-tokens 64 --batch 4,8`, dn_rows_loop
#      off / on;
#   4. time left: wgpu at 4K OFF / ON again, then LILY_PROFILE=1 at 4K ON / OFF (the rows
#      lin.experts.glu for glu_split, lin.dn.out / lin.attn.o for out_lean).
#   bash .carry/NAME/gpu_s30a.sh   (carry: .carry/NAME .gl; timeout_s 175)
set -u
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-130}"
AB_HARD=${HARD:-160}
wgpu_setup
timeout "$(cap 35)" "$B/gpu" --ignored --test-threads=1 --nocapture \
  batched_decode_deltanet_scans_match_one_sequence_at_a_time decode_batched_steps_dn_rows_loop \
  > "$OUT/tests-dn.log" 2>&1
say "cuda dn tests rc=$? at $(el)s: $(grep -E '^test |test result|panicked' "$OUT/tests-dn.log" | tr '\n' '|' | cut -c1-300)"
env -u LILY_WGPU_OUT_LEAN -u LILY_WGPU_GLU_SPLIT timeout "$(cap 50)" "$B/wgpu_model" --test-threads=1 \
  --nocapture out_lean_kernel glu_split_kernel > "$OUT/tests-wgpu.log" 2>&1
say "wgpu tests rc=$? at $(el)s: $(grep -E '^test |test result|panicked' "$OUT/tests-wgpu.log" | tr '\n' '|' | cut -c1-300)"
wait "$SYN"; say "synth full rc=$? at $(el)s"
K="lean 1-row output projections (on|off)|split items (on|off)|two workgroups a row"
OFF="LILY_WGPU_OUT_LEAN=0 LILY_WGPU_GLU_SPLIT=0"
ON="LILY_WGPU_OUT_LEAN=1 LILY_WGPU_GLU_SPLIT=1"
export PREFILL=512
# shellcheck disable=SC2086
BENCH_S=25 wgpu_bench off-1 4K "$K" $OFF
# shellcheck disable=SC2086
BENCH_S=25 wgpu_bench on-1 4K "$K" $ON
for v in 0 1; do
  left || { say "skip cuda dn_rows_loop=$v: past the deadline"; continue; }
  LILY_DN_ROWS_LOOP=$v timeout "$(cap 25)" "$B/lily-engine" bench --model "$M" --device cuda \
    --prefill 1K --decode-ctx 1K --decode-tokens 64 --repeat 1 --batch 4,8 > "$OUT/cuda-dn$v.log" 2>&1
  say "cuda dn_rows_loop=$v rc=$? at $(el)s: $(grep -E '^ +[0-9]+[K]? +[0-9]+ +[0-9.]+' "$OUT/cuda-dn$v.log" | tr -s ' ' | tr '\n' '|') $(grep -h -m1 -oE "batched DeltaNet step looping over sequences (on|off)" "$OUT/cuda-dn$v.log")"
done
# shellcheck disable=SC2086
BENCH_S=20 wgpu_bench off-2 4K "$K" $OFF
# shellcheck disable=SC2086
BENCH_S=20 wgpu_bench on-2 4K "$K" $ON
P='lin.experts.glu|moe_down|lin.dn.out|lin.attn.o|lin.router|lin.dn.in_proj'
# shellcheck disable=SC2086
BENCH_S=20 wgpu_bench_rows prof-on 4K "$K" "$P" LILY_PROFILE=1 $ON
# shellcheck disable=SC2086
BENCH_S=20 wgpu_bench_rows prof-off 4K "$K" "$P" LILY_PROFILE=1 $OFF
say "done at $(el)s"
