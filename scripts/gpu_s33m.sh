#!/usr/bin/env bash
# Session 33 (≤ 230 s by its own clock): `mma_stage_rounds` (issue 32) — the batched step's
# tensor-core projections with their input rows staged four items a thread a round
# (dec_mma_rows_deep_rounds), on an 8-layer checkpoint (its synth is quick; the A/B is relative):
#   1. beside the synth: the GPU test mma_stage_rounds_gives_the_deep_kernels_bits (the rounds
#      kernel gives dec_mma_rows_deep's bits on the device);
#   2. `bench --prefill 1K --decode-ctx 1K --decode-tokens 64 --repeat 1 --batch 1,4,8`,
#      LILY_MMA_STAGE_ROUNDS=0 / 1 twice;
#   3. the 8-row profile (LILY_PROFILE=1) off / on: the dec_mma_rows_deep(_rounds) rows.
#   bash .carry/NAME/gpu_s33m.sh   (carry: .carry/NAME .carry/tokenizer; timeout_s 240)
set -u
AB_LAYERS=${AB_LAYERS:-8}
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-200}"
AB_HARD=${HARD:-230}
E=$B/lily-engine
timeout "$(cap 150)" "$B/gpu" --ignored --test-threads=1 --nocapture mma_stage_rounds_gives_the_deep_kernels_bits \
  > "$OUT/tests.log" 2>&1 & T=$!
wait "$SYN"; say "synth ${AB_LAYERS} layers rc=$? at $(el)s"
ab() {  # ab NAME VALUE
  left || { say "$1: skipped (deadline) at $(el)s"; return; }
  LILY_MMA_STAGE_ROUNDS=$2 timeout "$(cap 40)" "$E" bench --model "$M" --device cuda --prefill 1K \
    --decode-ctx 1K --decode-tokens 64 --repeat 1 --batch 1,4,8 > "$OUT/ab-$1.log" 2>&1
  say "$1 (mma_stage_rounds $2) rc=$? at $(el)s: $(grep -E '^ +[0-9]+ +[0-9]+[K]? +[0-9.]+ +[0-9.]+' "$OUT/ab-$1.log" | tr -s ' ' | tr '\n' '|')"
}
ab off-1 0; ab on-1 1; ab off-2 0; ab on-2 1
for v in 0 1; do
  left || break
  LILY_MMA_STAGE_ROUNDS=$v LILY_PROFILE=1 timeout "$(cap 30)" "$E" bench --model "$M" --device cuda --prefill 1K \
    --decode-ctx 1K --decode-tokens 16 --repeat 1 --batch 8 > "$OUT/prof-$v.log" 2>&1
  say "profile mma_stage_rounds $v rc=$?: $(grep -E 'dec_mma_rows_deep|rms_norm_rows|split_async' "$OUT/prof-$v.log" | tr -s ' ' | cut -c1-90 | tr '\n' '|')"
done
wait "$T"; say "test rc=$? at $(el)s: $(grep -E 'test result|panicked|KERNEL' "$OUT/tests.log" | tr '\n' '|' | cut -c1-400)"
say "done at $(el)s"
