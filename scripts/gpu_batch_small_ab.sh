#!/usr/bin/env bash
# The device call of branch batch-small (issue 32; ≤ 8 minutes): the batched step's two
# small-launch fixes, each behind its switch (off by default), against the shipping step (off):
#   fold   `--batch-norm-fold` (LILY_BATCH_NORM_FOLD): the block RMSNorms folded into the batched
#          projections' staging (2 rms_norm launches a layer + 1 fewer);
#   split  `--router-rows-split` (LILY_ROUTER_ROWS_SPLIT): the router's launch in
#          dec_gemv_rows_split (a warp a weight row) instead of dec_gemv_rows;
#   both.
# On an 8-layer full-width checkpoint (AB_LAYERS, with the tokenizer) and the full-size one
# (synthesised beside it into /dev/shm/full-mlx):
#   1. GPU tests: the new forms' kernel tests first (batched_decode_gemv_rows_split,
#      batched_decode_norm_fold; KERNEL_S, 60 s), then every other batched test
#      (decode_batched_*, batched_decode_*: the model's batched steps against each sequence
#      alone, the new switches' cases among them) until TEST_S (120) seconds;
#   2. 8 layers, `bench --batch 1,4,8` (1K prompt, 1K context, STEPS steps), off / fold / split /
#      both, alternated ROUNDS (2) times;
#   3. a 4-row profile (LILY_PROFILE=1, graphs off) of each on 8 layers: the top lines;
#   4. full size, the same bench, off / both / fold / split, alternated ROUNDS times while
#      the deadline allows (the first round's order puts off and both first; on an H100 a
#      full-size bench takes about a minute, so the second round is likely cut: a second call
#      with SKIP_TESTS=1 LAYERS_ROUNDS=0 runs the full size alone).
# Summary on stdout and in $OUT/summary.txt (logs beside it). No step starts past DEADLINE
# seconds (420), none runs past HARD (470): each step's timeout is cut to what is left.
# Here: `CARGO_TARGET_DIR=$PWD/target bash scripts/stage_gpu.sh /work/main/.carry/batch-small`,
# `gzip -9` the binaries, this script beside them (stage_gpu.sh copies gpu_rows_ab_common.sh and
# gpu_ab_common.sh, the preambles it sources). There:
#   bash .carry/batch-small/gpu_batch_small_ab.sh   (carry: .carry/batch-small .carry/tokenizer;
#   timeout_s 540)
# Knobs: SKIP_TESTS=1, KERNEL_S (60), TEST_S (120), ROUNDS (2), LAYERS_ROUNDS (ROUNDS: the
# 8-layer rounds; 0 skips them), SKIP_PROFILES=1, STEPS (64), DEADLINE (420),
# HARD (470), DRY=1 (print the commands instead of running them: the script's logic without a
# GPU, into $OUT/dry.log).
set -u
AB_LAYERS=${LAYERS:-8}
. "$(dirname "$0")/gpu_rows_ab_common.sh" 420 470
export LILY_BATCHED_DECODE=1
OFF="LILY_BATCH_NORM_FOLD=0 LILY_ROUTER_ROWS_SPLIT=0"
CONFIGS=("off $OFF" "fold LILY_BATCH_NORM_FOLD=1 LILY_ROUTER_ROWS_SPLIT=0"
         "split LILY_BATCH_NORM_FOLD=0 LILY_ROUTER_ROWS_SPLIT=1"
         "both LILY_BATCH_NORM_FOLD=1 LILY_ROUTER_ROWS_SPLIT=1")
# Full size: off and both first (the A/B that matters most if the deadline cuts the round).
FULL_CONFIGS=("${CONFIGS[0]}" "${CONFIGS[3]}" "${CONFIGS[1]}" "${CONFIGS[2]}")

rows_tests "dec_gemv_rows_split, the folded norm" 120 "^MODEL .*norm fold true" \
  batched_decode_gemv_rows_split batched_decode_norm_fold
wait "$SYN"; say "synth $AB_LAYERS layers rc=$? at $(el)s"

for r in $(seq 1 "${LAYERS_ROUNDS:-${ROUNDS:-2}}"); do
  for c in "${CONFIGS[@]}"; do set -- $c; name=$1; shift; bench "l$AB_LAYERS-$name-$r" "$M" 40 "$@"; done
done

for c in "${CONFIGS[@]}"; do  # 4-row profiles, graphs off
  [ "${SKIP_PROFILES:-0}" = 1 ] && break
  set -- $c; name=$1; shift
  if ! left; then say "profile $name: skipped (deadline) at $(el)s"; continue; fi
  run env "$@" LILY_PROFILE=1 timeout "$(tmo 40)" "$B/lily-engine" bench --model "$M" --device cuda \
    --prefill 1K --decode-ctx 1K --decode-tokens 32 --repeat 1 --batch 4 > "$OUT/profile-$name.log" 2>&1
  say "profile (8 layers, 4 rows, $name) rc=$? at $(el)s:"
  grep -E "kernel profile|rms_norm|dec_gemv_rows|dec_mma_rows|dec_glu4_rows|dec_down_combine_rows|in all" \
    "$OUT/profile-$name.log" | cut -c1-160 | head -9 | tee -a "$S"
done

wait "$SYNF"; say "synth full rc=$? at $(el)s"
for r in $(seq 1 "${ROUNDS:-2}"); do
  for c in "${FULL_CONFIGS[@]}"; do set -- $c; name=$1; shift; bench "full-$name-$r" "$FULL" 75 "$@"; done
done
say "done at $(el)s"
