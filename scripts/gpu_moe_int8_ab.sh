#!/usr/bin/env bash
# The device call of branch moe (issues 30 and 32; ≤ 8 minutes): `moe_int8` (LILY_MOE_INT8;
# on by default since this A/B, `--no-moe-int8`) — the fused MoE's kernels with their input rows
# rounded to int8 per 64-column group and dp4a products (dec_glu4_q8, dec_down_combine_q8 and their _rows forms)
# — against the shipping f32 products (whose kernels lost instructions too, bit for bit),
# on the full-size checkpoint (synthesised into /dev/shm/full-mlx) and a 4-layer one of the full
# widths (AB_LAYERS: /dev/shm/l4, with the tokenizer of .carry/tokenizer; the agreement check):
#   1. GPU tests: the int8 kernels against the CPU (moe_int8_matches_cpu: 1..8 rows),
#      the batched MoE against one token at a time (f32 and int8), the fused one-token blocks
#      against the CPU (dec_glu4's bookkeeping changed, bit for bit in the emulation), then the
#      batched model tests (with int8 MoE cases) until TEST_S (90) seconds;
#   2. full size, `bench --prefill 1K --decode-ctx 1K --decode-tokens 64 --batch 1,4,8`, off / on;
#   3. agreement, off / on: teacher-forced logits (`score --piece 1`: one-token steps, LEN 128
#      positions) of CUDA bf16 against the CPU and CUDA fp32 on the 4-layer model and against
#      CUDA fp32 on the full size (scripts/agreement_table.py: rel. L2, top-1);
#   4. full size, one-token decode at 256 / 4K / 32K, off / on;
#   5. full size, on: a 4-row and a 1-row profile (LILY_PROFILE=1, graphs off): the MoE lines;
#      then a 4-row profile off (the same machine's baseline);
#   6. the bench of 2. again (off / on), while the deadline allows.
# Summary on stdout and in $OUT/summary.txt (logs beside it). No step starts past DEADLINE
# seconds (420), none runs past HARD (470): each step's timeout is cut to what is left.
# Here: `CARGO_TARGET_DIR=/work/wt-moe/target bash scripts/stage_gpu.sh /work/main/.carry/moe`,
# `gzip -9 /work/main/.carry/moe/bin/*`, this script beside them. There:
#   bash .carry/moe/gpu_moe_int8_ab.sh   (carry: .carry/moe .carry/tokenizer; timeout_s 540)
# Knobs: SKIP_TESTS=1, KERNEL_S (60), TEST_S (90), ROUNDS (2: bench rounds, the second last),
# SKIP_BENCH=1 (the first bench round), SKIP_AGREE=1, LEN (128), SKIP_SWEEP=1, SKIP_PROFILES=1,
# STEPS (64), DEADLINE (420), HARD (470), DRY=1 (print the commands instead of running them, into
# $OUT/dry.log). Everything will not fit one call on an H100: what the deadline cuts is said in
# the summary; a second call `SKIP_TESTS=1 SKIP_BENCH=1 SKIP_AGREE=1 bash ...` runs the rest.
set -u
AB_LAYERS=4
. "$(dirname "$0")/gpu_rows_ab_common.sh" 420 470
OFF=LILY_MOE_INT8=0
ON=LILY_MOE_INT8=1

rows_tests "the int8 MoE kernels, the MoE rows, the fused blocks" 90 "^KERNEL dec_glu4_q8|moe int8 true" \
  moe_int8_matches_cpu batched_decode_moe_rows_match_one_token_at_a_time fused_decode_blocks_match_cpu
wait "$SYNF"; say "synth full rc=$? at $(el)s"

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  bench full-off-1 "$FULL" 75 $OFF
  bench full-on-1 "$FULL" 75 $ON
fi

# agree: teacher-forced logits of LEN (128) positions, one position a call (`score --piece 1`:
# every position a one-token step, the path the int8 kernels serve), CUDA bf16 off and on against
# references: on the 4-layer model the CPU (fp32) and CUDA fp32; on the full size CUDA fp32 (the
# CPU's stand-in there: 2.7e-5 from it, crates/lily-cuda/README.md). scripts/agreement_table.py's
# tables (rel. L2 and top-1 against each reference) into the summary.
agree() {
  if [ "${SKIP_AGREE:-0}" = 1 ]; then return; fi
  if ! left; then say "agreement: skipped (deadline) at $(el)s"; return; fi
  local W=/tmp/agree len=${LEN:-128}
  mkdir -p "$W"
  wait "$SYN" 2>/dev/null
  run timeout "$(tmo 90)" nice -n 10 "$B/lily-engine" score --model "$M" --len "$len" --device cpu \
    --out "$W/l4-cpu" > "$OUT/agree-l4-cpu.log" 2>&1 &
  local cpu=$!
  local P=(--len "$len" --piece 1 --device cuda)
  run env LILY_CUDA_FP32=1 timeout "$(tmo 40)" "$B/lily-engine" score --model "$M" "${P[@]}" --out "$W/l4-fp32" \
    > "$OUT/agree-l4-fp32.log" 2>&1
  run env $OFF timeout "$(tmo 40)" "$B/lily-engine" score --model "$M" "${P[@]}" --out "$W/l4-off" \
    > "$OUT/agree-l4-off.log" 2>&1
  run env $ON timeout "$(tmo 40)" "$B/lily-engine" score --model "$M" "${P[@]}" --out "$W/l4-on" \
    > "$OUT/agree-l4-on.log" 2>&1
  for mode in fp32 off on; do
    local e=; [ $mode = fp32 ] && e=LILY_CUDA_FP32=1; [ $mode = off ] && e=$OFF; [ $mode = on ] && e=$ON
    left || break
    run env $e timeout "$(tmo 60)" "$B/lily-engine" score --model "$FULL" "${P[@]}" --out "$W/full-$mode" \
      > "$OUT/agree-full-$mode.log" 2>&1
  done
  wait "$cpu"
  run timeout "$(tmo 60)" python3 scripts/agreement_table.py --ref "$W/l4-cpu" --ref "$W/l4-fp32" \
    --other "$W/l4-off" --other "$W/l4-on" --out "$OUT/agreement-l4.md" > "$OUT/agree-table.log" 2>&1
  run timeout "$(tmo 60)" python3 scripts/agreement_table.py --ref "$W/full-fp32" \
    --other "$W/full-off" --other "$W/full-on" --out "$OUT/agreement-full.md" >> "$OUT/agree-table.log" 2>&1
  say "agreement ($len positions, one a step; 4 layers vs CPU and CUDA fp32, full size vs CUDA fp32) at $(el)s:"
  cat "$OUT/agreement-l4.md" "$OUT/agreement-full.md" 2>/dev/null | grep -vE '^\s*$' | head -40 | tee -a "$S"
}
agree

sweep() {  # sweep NAME ENV...: one-token decode at 256 / 4K / 32K
  local name=$1; shift
  if [ "${SKIP_SWEEP:-0}" = 1 ]; then return; fi
  if ! left; then say "sweep $name: skipped (deadline) at $(el)s"; return; fi
  run env "$@" timeout "$(tmo 90)" "$B/lily-engine" bench --model "$FULL" --device cuda --prefill 256 \
    --decode-ctx 256,4K,32K --decode-tokens "${STEPS:-64}" --repeat 1 > "$OUT/sweep-$name.log" 2>&1
  say "sweep $name ($*) rc=$? at $(el)s: $(grep -E '^ +[0-9]|error|Error' "$OUT/sweep-$name.log" \
    | tr -s ' ' | tr '\n' '|' | cut -c1-400)"
}
sweep off $OFF
sweep on $ON

profile() {  # profile NAME ROWS ENV...: the MoE kernels' lines of a ROWS-row profile (graphs off)
  local name=$1 rows=$2; shift 2
  if [ "${SKIP_PROFILES:-0}" = 1 ]; then return; fi
  if ! left; then say "profile $name: skipped (deadline) at $(el)s"; return; fi
  run env "$@" LILY_PROFILE=1 timeout "$(tmo 45)" "$B/lily-engine" bench --model "$FULL" --device cuda \
    --prefill 1K --decode-ctx 1K --decode-tokens 32 --repeat 1 --batch "$rows" > "$OUT/profile-$name.log" 2>&1
  say "profile (full size, $rows rows, $name) rc=$? at $(el)s:"
  grep -E "kernel profile|dec_glu4|dec_down_combine|moe|in all" "$OUT/profile-$name.log" | cut -c1-160 \
    | head -12 | tee -a "$S"
}
profile on-4 4 $ON
profile on-1 1 $ON
profile off-4 4 $OFF

for r in $(seq 2 "${ROUNDS:-2}"); do
  bench "full-off-$r" "$FULL" 75 $OFF
  bench "full-on-$r" "$FULL" 75 $ON
done
say "done at $(el)s"
