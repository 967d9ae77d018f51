#!/usr/bin/env bash
# The device call of branch moe (issues 30 and 32; ≤ 8 minutes): `moe_int8` (`--moe-int8`,
# LILY_MOE_INT8; off by default) — the fused MoE's kernels with their input rows rounded to int8
# per 64-column group and dp4a products (dec_glu4_q8, dec_down_combine_q8 and their _rows forms)
# — against the shipping f32 products (whose kernels lost instructions too, bit for bit),
# on the full-size checkpoint (synthesised into /dev/shm/full-mlx) and a 4-layer one of the full
# widths (AB_LAYERS: /dev/shm/l4, with the tokenizer of .carry/tokenizer; the agreement check):
#   1. GPU tests: the int8 kernels against the CPU (moe_int8_matches_cpu: 1..8 rows),
#      the batched MoE against one token at a time (f32 and int8), the fused one-token blocks
#      against the CPU (dec_glu4's bookkeeping changed, bit for bit in the emulation), then the
#      batched model tests (with `--moe-int8` cases) until TEST_S (90) seconds;
#   2. full size, `bench --prefill 1K --decode-ctx 1K --decode-tokens 64 --batch 1,4,8`, off / on;
#   3. agreement with the CPU, off / on: `selftest` on the 4-layer model (CUDA bf16 against the
#      CPU's fp32: logits rel. L2, top-1, greedy tokens);
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
# SKIP_SWEEP=1, SKIP_PROFILES=1, SKIP_AGREE=1, STEPS (64), DEADLINE (420), HARD (470), DRY=1
# (print the commands instead of running them, into $OUT/dry.log).
set -u
AB_LAYERS=4
. "$(dirname "$0")/gpu_rows_ab_common.sh" 420 470
OFF=LILY_MOE_INT8=0
ON=LILY_MOE_INT8=1

rows_tests "the int8 MoE kernels, the MoE rows, the fused blocks" 90 "^KERNEL dec_glu4_q8|moe int8 true" \
  moe_int8_matches_cpu batched_decode_moe_rows_match_one_token_at_a_time fused_decode_blocks_match_cpu
wait "$SYNF"; say "synth full rc=$? at $(el)s"

bench full-off-1 "$FULL" 75 $OFF
bench full-on-1 "$FULL" 75 $ON

agree() {  # agree NAME ENV...: selftest on the 4-layer model under ENV
  local name=$1; shift
  if [ "${SKIP_AGREE:-0}" = 1 ]; then return; fi
  if ! left; then say "$name: skipped (deadline) at $(el)s"; return; fi
  wait "$SYN" 2>/dev/null
  run env "$@" timeout "$(tmo 100)" "$B/lily-engine" selftest --model "$M" --prompt-len 32 --steps 16 \
    --bench-prefill 32 --bench-decode 8 > "$OUT/$name.log" 2>&1
  say "$name ($*) rc=$? at $(el)s: $(grep -iE '^device:|agreement|greedy|FAIL|error' "$OUT/$name.log" \
    | grep -v XDG | head -12 | tr -s ' ' | tr '\n' '|' | cut -c1-900)"
}
agree agree-off $OFF
agree agree-on $ON

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
