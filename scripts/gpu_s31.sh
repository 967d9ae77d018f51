#!/usr/bin/env bash
# Session 31's last device call (≤ 570 s): the shipping numbers, then one A/B for the int8 KV cache.
#   1. gpu_current.sh (tests, the CUDA sweep, served 4K, served 1 / 4 / 8 clients, wgpu) with
#      LILY_WGPU_DOWN_ITEM_LANES=1 (its default from session 31 on; the staged binary may predate
#      the flip), DEADLINE 380 / HARD 450 unless set;
#   2. `kv_cache int8` with the long split-KV kernel from fewer keys: `bench --prefill 512
#      --decode-ctx 4K,32K --decode-tokens 64`, LILY_KV_CACHE=int8 with LILY_SPLIT_LONG_KEYS=65536
#      (ships) / 16384 / 4096, alternated twice while the clock allows. Measured in session 31:
#      int8 wins at 128K (long kernel, +9.5 %) and loses at 32K (short kernel, −2.6 %).
#   bash .carry/NAME/gpu_s31.sh   (carry: .carry/NAME .carry/tokenizer .gl; timeout_s 580)
set -u
HERE="$(cd "$(dirname "$0")" && pwd)"
R=${OUT:-$PWD/gpu-logs}; mkdir -p "$R"
export LILY_WGPU_DOWN_ITEM_LANES=1
DEADLINE=${DEADLINE:-380} HARD=${HARD:-450} OUT=$R bash "$HERE/gpu_current.sh" > "$R/current.log" 2>&1
T0=$(date +%s); LIMIT=${AB_S:-110}
B=$HERE/bin; M=/dev/shm/full-mlx; export LILY_CACHE_DIR=/tmp/lily-cache
for round in 1 2; do
  for lk in 65536 16384 4096; do
    [ $(( $(date +%s) - T0 )) -lt "$LIMIT" ] || { echo "int8 long=$lk round $round: skipped (clock)" >> "$R/summary.txt"; continue; }
    LILY_KV_CACHE=int8 LILY_SPLIT_LONG_KEYS=$lk timeout 40 "$B/lily-engine" bench --model "$M" --device cuda \
      --prefill 512 --decode-ctx 4K,32K --decode-tokens 64 --repeat 1 > "$R/int8-long$lk-$round.log" 2>&1
    echo "int8 long=$lk round $round rc=$?: $(grep -E '^ +[0-9]+ +[0-9.]+ +[0-9.]+' "$R/int8-long$lk-$round.log" | tr -s ' ' | tr '\n' '|') $(grep -h -m1 -oE "KV cache (bf16|int8)|long decode attention past keys [0-9]+" "$R/int8-long$lk-$round.log" | tr '\n' ' ')" >> "$R/summary.txt"
  done
done
cat "$R/summary.txt"
