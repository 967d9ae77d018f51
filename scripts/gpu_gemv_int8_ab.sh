#!/usr/bin/env bash
# The device call of branch int8x2 (issue 30; ≤ 9 minutes): `gemv_int8` (LILY_GEMV_INT8; off by
# default, `--gemv-int8`) — one-token decode's 4-bit projections (DeltaNet's in_proj and
# out_proj, attention's q/k/v and o_proj, lm_head) with their staged input rounded to int8 pairs
# per 64-column group and dp4a products (dec_gemv4_x8x2, dec_gemv4w_x8x2) — against the f32
# products (dec_gemv4, dec_gemv4w), both with the shipping `moe_int8` on, on the full-size
# checkpoint (synthesised into /dev/shm/full-mlx) and a 4-layer one of the full widths
# (/dev/shm/l4, with the tokenizer of .carry/tokenizer; the agreement check):
#   1. GPU tests: the new kernels against the CPU (gemv_int8_matches_cpu: tiny's and small's
#      projections and the full widths, both modes; moe_int8_matches_cpu: the MoE's int8 and
#      int8-pair kernels), the f32 GEMVs and fused blocks as before (wide_decode_gemvs_match_cpu,
#      fused_decode_blocks_match_cpu), then the shipping configuration end to end with both pair
#      forms on (shipping_configuration_*: greedy decode against the CPU on tiny and small),
#      within TEST_S (100) seconds;
#   2. full size, one-token decode at 256 / 4K / 32K (`bench --prefill 256 --decode-ctx
#      256,4K,32K`), off, on;
#   3. agreement, off / on (and both pair forms on: gemv_int8 + moe_int8_pairs, the MoE's
#      stand-in should single int8 fall below the bar): teacher-forced logits (`score --piece 1`:
#      one-token steps, LEN 128 positions) of CUDA bf16 against CUDA fp32 on the full size, then
#      against the CPU and CUDA fp32 on the 4-layer model (scripts/agreement_table.py: rel. L2,
#      top-1), as gpu_moe_int8_ab.sh measured moe_int8 (0.183 → 0.239 at full size; HF bf16
#      0.246);
#   4. the sweep of 2. again (off, on: alternated twice in all), while the deadline allows;
#   5. a one-token profile on and off (LILY_PROFILE=1, graphs off): the projections' lines.
# Summary on stdout and in $OUT/summary.txt (logs beside it). No step starts past DEADLINE
# seconds (440), none runs past HARD (520): each step's timeout is cut to what is left.
# Here: `CARGO_TARGET_DIR=/work/wt-int8x2/target bash scripts/stage_gpu.sh
# /work/main/.carry/int8x2`, `gzip -9 /work/main/.carry/int8x2/bin/*`, this script beside them.
# There:
#   bash .carry/int8x2/gpu_gemv_int8_ab.sh   (carry: .carry/int8x2 .carry/tokenizer; timeout_s 540)
# Knobs: SKIP_TESTS=1, TEST_S (100), SKIP_AGREE=1, LEN (128), ROUNDS (2: sweep rounds),
# SKIP_PROFILES=1, STEPS (64), DEADLINE (440), HARD (520), DRY=1 (print the commands instead of
# running them, into $OUT/dry.log). What the deadline cuts is said in the summary; a second call
# `SKIP_TESTS=1 SKIP_AGREE=1 ROUNDS=3 bash ...` runs more sweeps.
set -u
AB_LAYERS=4
. "$(dirname "$0")/gpu_rows_ab_common.sh" 440 520
OFF=LILY_GEMV_INT8=0
ON=LILY_GEMV_INT8=1
PAIRS="LILY_GEMV_INT8=1 LILY_MOE_INT8_PAIRS=1"  # the MoE's int8 on pairs too (moe_int8_pairs)

tests() {
  [ "${SKIP_TESTS:-0}" = 1 ] && return
  local test_s=${TEST_S:-100}
  run timeout "$(tmo $(( test_s * 3 / 4 )))" "$B/gpu" --ignored --test-threads=1 --nocapture \
    gemv_int8_matches_cpu wide_decode_gemvs_match_cpu fused_decode_blocks_match_cpu moe_int8_matches_cpu \
    > "$OUT/tests-kernels.log" 2>&1
  say "tests (the int8-pair kernels, the f32 GEMVs, the fused blocks, the int8 MoE kernels) rc=$? at $(el)s"
  local rest=$(( test_s - $(el) )); [ "$rest" -lt 10 ] && rest=10
  run env $PAIRS timeout "$(tmo "$rest")" "$B/gpu" --ignored --test-threads=1 --nocapture \
    shipping_configuration > "$OUT/tests-model.log" 2>&1
  say "tests (shipping_configuration_* with $PAIRS) rc=$? at $(el)s"
  grep -hE "^test .*(ok|FAILED)$|^test result|panicked|KERNEL dec_gemv4_x8x2 .*(lm_head|wide)|Int8Pairs, Small, 8|int8-pair|MODEL shipping" \
    "$OUT/tests-kernels.log" "$OUT/tests-model.log" | cut -c1-220 | head -50 | tee -a "$S"
}
tests
wait "$SYNF"; say "synth full rc=$? at $(el)s"

sweep() {  # sweep NAME ENV...: one-token decode at 256 / 4K / 32K
  local name=$1; shift
  if ! left; then say "sweep $name: skipped (deadline) at $(el)s"; return; fi
  run env "$@" timeout "$(tmo 80)" "$B/lily-engine" bench --model "$FULL" --device cuda --prefill 256 \
    --decode-ctx 256,4K,32K --decode-tokens "${STEPS:-64}" --repeat 1 > "$OUT/sweep-$name.log" 2>&1
  say "sweep $name ($*) rc=$? at $(el)s: $(grep -E '^ +[0-9]|error|Error' "$OUT/sweep-$name.log" \
    | tr -s ' ' | tr '\n' '|' | cut -c1-400)"
}
sweep off-1 $OFF
sweep on-1 $ON

# agree: as gpu_moe_int8_ab.sh's (teacher-forced logits of LEN positions, one a call), the full
# size first (the bar: HF bf16's 0.246 against fp32), with a third point: both pair forms on
# (gemv_int8 and moe_int8_pairs: what would stand in for moe_int8's single int8).
agree() {
  if [ "${SKIP_AGREE:-0}" = 1 ]; then return; fi
  if ! left; then say "agreement: skipped (deadline) at $(el)s"; return; fi
  local W=/tmp/agree len=${LEN:-128}
  mkdir -p "$W"
  wait "$SYN" 2>/dev/null
  run timeout "$(tmo 90)" nice -n 10 "$B/lily-engine" score --model "$M" --len "$len" --device cpu \
    --out "$W/l4-cpu" > "$OUT/agree-l4-cpu.log" 2>&1 &
  local cpu=$!
  local P=(--len "$len" --piece 1 --device cuda) mode e
  for mode in fp32 off on pairs; do
    case $mode in fp32) e=LILY_CUDA_FP32=1 ;; off) e=$OFF ;; on) e=$ON ;; pairs) e=$PAIRS ;; esac
    left || break
    run env $e timeout "$(tmo 60)" "$B/lily-engine" score --model "$FULL" "${P[@]}" --out "$W/full-$mode" \
      > "$OUT/agree-full-$mode.log" 2>&1
  done
  run timeout "$(tmo 60)" python3 scripts/agreement_table.py --ref "$W/full-fp32" --other "$W/full-off" \
    --other "$W/full-on" --other "$W/full-pairs" --out "$OUT/agreement-full.md" > "$OUT/agree-table.log" 2>&1
  say "agreement, full size vs CUDA fp32 ($len positions, one a step; other 1 = off, 2 = on, 3 = both pair forms) at $(el)s:"
  grep -vE '^\s*$' "$OUT/agreement-full.md" 2>/dev/null | head -20 | tee -a "$S"
  for mode in fp32 off on; do
    case $mode in fp32) e=LILY_CUDA_FP32=1 ;; off) e=$OFF ;; on) e=$ON ;; esac
    left || break
    run env $e timeout "$(tmo 40)" "$B/lily-engine" score --model "$M" "${P[@]}" --out "$W/l4-$mode" \
      > "$OUT/agree-l4-$mode.log" 2>&1
  done
  wait "$cpu"
  run timeout "$(tmo 60)" python3 scripts/agreement_table.py --ref "$W/l4-cpu" --ref "$W/l4-fp32" \
    --other "$W/l4-off" --other "$W/l4-on" --out "$OUT/agreement-l4.md" >> "$OUT/agree-table.log" 2>&1
  say "agreement, 4 layers vs the CPU and CUDA fp32 (other 1 = off, 2 = on) at $(el)s:"
  grep -vE '^\s*$' "$OUT/agreement-l4.md" 2>/dev/null | head -20 | tee -a "$S"
}
agree

for r in $(seq 2 "${ROUNDS:-2}"); do
  sweep "off-$r" $OFF
  sweep "on-$r" $ON
done

profile() {  # profile NAME ENV...: the projections' lines of a one-token profile (graphs off)
  local name=$1; shift
  if [ "${SKIP_PROFILES:-0}" = 1 ]; then return; fi
  if ! left; then say "profile $name: skipped (deadline) at $(el)s"; return; fi
  run env "$@" LILY_PROFILE=1 timeout "$(tmo 45)" "$B/lily-engine" bench --model "$FULL" --device cuda \
    --prefill 256 --decode-ctx 4K --decode-tokens 32 --repeat 1 > "$OUT/profile-$name.log" 2>&1
  say "profile (full size, one token at 4K, $name) rc=$? at $(el)s:"
  grep -E "kernel profile|dec_gemv|in all" "$OUT/profile-$name.log" | cut -c1-160 | head -12 | tee -a "$S"
}
profile on $ON
profile off $OFF
say "done at $(el)s"
