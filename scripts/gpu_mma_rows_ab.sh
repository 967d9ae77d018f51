#!/usr/bin/env bash
# The device call of branch mma-rows (issue 32; ≤ 8 minutes): `dec_mma_rows`, the batched decode
# step's 4-bit projections on the tensor cores (`--mma-rows`, LILY_MMA_ROWS), against
# `dec_gemv_rows` (off). On an 8-layer full-width checkpoint (AB_LAYERS, with the tokenizer, for
# `serve`) and the full-size one (synthesised beside it into /dev/shm/full-mlx):
#   1. GPU tests: the new form's (batched_decode_mma_rows_match_cpu) and dec_gemv_rows' first
#      (KERNEL_S, 60 s), then every other batched one (decode_batched_*, batched_decode_*: the
#      model's batched steps against each sequence alone, with --mma-rows among them), until
#      TEST_S (180) seconds;
#   2. 8 layers, `bench --batch 1,4,8` (1K prompt, 1K context, 64 steps), off / mma alternated
#      ROUNDS (2) times;
#   3. full size, the same bench at a 1K context, off / mma;
#   4. a 4-row profile (LILY_PROFILE=1, graphs off) of each on 8 layers: the top kernels;
#   5. served, mma on: 4 clients (scripts/concurrent_bench.py as gpu_served_batch.sh runs it,
#      --check) on 8 layers.
# Summary on stdout and in $OUT/summary.txt (logs beside it). No step starts past DEADLINE
# seconds (400), none runs past HARD (465): each step's timeout is cut to what is left.
# Here: `CARGO_TARGET_DIR=$PWD/target bash scripts/stage_gpu.sh /work/main/.carry/mma`, `gzip -9`
# the binaries, this script, concurrent_bench.py and serve_bench.py beside them (stage_gpu.sh
# copies gpu_rows_ab_common.sh and gpu_ab_common.sh, the preambles it sources). There:
#   bash .carry/mma/gpu_mma_rows_ab.sh   (carry: .carry/mma .carry/tokenizer; timeout_s 540)
# Knobs: SKIP_TESTS=1, KERNEL_S (60), TEST_S (180), ROUNDS (2), STEPS (64), DEADLINE (400), HARD (465),
# DRY=1 (print the commands instead of running the engine: the script's logic without a GPU).
set -u
AB_LAYERS=${LAYERS:-8}
. "$(dirname "$0")/gpu_rows_ab_common.sh" 400 465
export LILY_BATCHED_DECODE=1
CONFIGS=("off LILY_MMA_ROWS=0" "mma LILY_MMA_ROWS=1")

rows_tests "dec_mma_rows, dec_gemv_rows vs CPU" 180 \
  "KERNEL .*Mma 2048 cols, 8 rows.*output 0|^MODEL .*mma rows true" batched_decode_mma_rows batched_decode_gemv_rows
wait "$SYN"; say "synth $AB_LAYERS layers rc=$? at $(el)s"

for r in $(seq 1 "${ROUNDS:-2}"); do
  for c in "${CONFIGS[@]}"; do set -- $c; name=$1; shift; bench "l$AB_LAYERS-$name-$r" "$M" 40 "$@"; done
done
wait "$SYNF"; say "synth full rc=$? at $(el)s"
for c in "${CONFIGS[@]}"; do set -- $c; name=$1; shift; bench "full-$name" "$FULL" 75 "$@"; done

for c in "${CONFIGS[@]}"; do  # 4-row profiles, graphs off
  set -- $c; name=$1; shift
  if ! left; then say "profile $name: skipped (deadline) at $(el)s"; continue; fi
  run env "$@" LILY_PROFILE=1 timeout "$(tmo 40)" "$B/lily-engine" bench --model "$M" --device cuda \
    --prefill 1K --decode-ctx 1K --decode-tokens 32 --repeat 1 --batch 4 > "$OUT/profile-$name.log" 2>&1
  say "profile (8 layers, 4 rows, $name: $*) rc=$? at $(el)s:"
  grep -E "kernel profile|dec_mma_rows|dec_gemv_rows|dec_glu4_rows|dec_down_combine_rows|attn_split|dec_dn_|in all" \
    "$OUT/profile-$name.log" | cut -c1-160 | head -12 | tee -a "$S"
done

if left; then  # served, mma on, 4 clients
  export PYTHONUNBUFFERED=1
  run env LILY_MMA_ROWS=1 LILY_ENGINE_BIN="$B/lily-engine" timeout "$(tmo 60)" python3 "$HERE/concurrent_bench.py" \
    --model "$M" --device cuda --prompt-tokens 1024 --max-tokens 256 --clients 4 \
    --serve-arg=--max-batch=8 --check > "$OUT/concurrent-mma.log" 2>&1
  say "served mma (4 clients) rc=$? at $(el)s:"; tail -8 "$OUT/concurrent-mma.log" | cut -c1-200 | tee -a "$S"
else
  say "served mma: skipped (deadline) at $(el)s"
fi
say "done at $(el)s"
