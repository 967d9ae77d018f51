#!/usr/bin/env bash
# The one-launch decode DeltaNet layer's device call (issue 30, session 15; ≤ 9 minutes) on the
# full-size synthetic checkpoint:
#   1. GPU tests: dec_dn_layer's (against the four launches and the CPU, 25 graph replays; the
#      model with --fused-dn on vs off), and the four launches' own (fused_decode_blocks_match_cpu;
#      the batched scans, whose step code dec_dn_layer now shares);
#   2. `bench` decode at 256 / 4K / 32K (prefill 512), graphs on, in two configurations
#      alternated ROUNDS (2) times: off (LILY_FUSED_DN=0), dn (LILY_FUSED_DN=1);
#   3. one LILY_PROFILE=1 decode at 4K of each (graphs off);
#   4. teacher-forced `score` over LEN (1,024) positions one token a call (every DeltaNet layer
#      on the decode kernels) against fp32: off, dn, in one table.
# Summary: $OUT/summary.txt. No step starts past DEADLINE seconds (450), and none runs past HARD
# (530): each step's timeout is cut to what is left.
# Here: the binaries of a CUDA staging (scripts/stage_gpu.sh, gzip -9), this script,
# gpu_ab_common.sh and agreement_table.py beside them. There:
#   bash .carry/dn-layer/gpu_dn_layer_ab.sh     (carry: .carry/dn-layer; timeout_s 600)
# Knobs: SKIP_TESTS=1, TEST_S (230), ROUNDS (2), LEN (1024), DEADLINE (450), HARD (530).
set -u
. "$(dirname "$0")/gpu_ab_common.sh" 450
HARD=${HARD:-530}
tmo() {  # tmo N: N seconds, or what is left before HARD if less (at least 1)
  local left=$(( HARD - $(el) ))
  [ "$left" -lt "$1" ] && { [ "$left" -lt 1 ] && echo 1 || echo "$left"; } || echo "$1"
}
CONFIGS=("off LILY_FUSED_DN=0" "dn LILY_FUSED_DN=1")
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "$(tmo "${TEST_S:-230}")" "$B/gpu" --ignored --test-threads=1 --nocapture one_launch_deltanet \
    model_decode_with_the_one_launch fused_decode_blocks_match_cpu \
    batched_decode_deltanet_scans > "$OUT/tests.log" 2>&1
  say "tests (dec_dn_layer, the four launches) rc=$? at $(el)s"
  grep -E "^test .*(ok|FAILED)$|^test result|panicked|bit for bit|graph replays|^MODEL|vs CPU, .*residual" \
    "$OUT/tests.log" | cut -c1-300 | head -70 | tee -a "$S"
fi
wait $SYN; say "synth rc=$? at $(el)s"; tail -2 "$OUT/synth.log" >> "$S"
bench() {  # bench NAME ENV...
  local name=$1; shift
  if ! left; then say "bench $name: skipped (deadline) at $(el)s"; return; fi
  env "$@" timeout "$(tmo 100)" "$B/lily-engine" bench --model $M --device cuda \
    --prefill 512 --decode-ctx 256,4K,32K --decode-tokens 128 --repeat 1 > "$OUT/bench-$name.log" 2>&1
  say "bench $name ($*) rc=$? at $(el)s:"; grep -v INFO "$OUT/bench-$name.log" | tail -8 | tee -a "$S"
}
for r in $(seq 1 "${ROUNDS:-2}"); do
  for c in "${CONFIGS[@]}"; do set -- $c; name=$1; shift; bench "$name-$r" "$@"; done
done
for c in "${CONFIGS[@]}"; do
  set -- $c; name=$1; shift
  if ! left; then say "profile $name: skipped (deadline) at $(el)s"; continue; fi
  env "$@" LILY_PROFILE=1 timeout "$(tmo 90)" "$B/lily-engine" bench --model $M --device cuda --prefill 512 \
    --decode-ctx 4K --decode-tokens 36 --repeat 1 > "$OUT/profile-$name.log" 2>&1
  say "profile (decode 4K, $name: $*) rc=$? at $(el)s:"
  grep -E "kernel profile|decode deltanet|decode moe|dec_dn_layer|dec_gemv4|dec_dn_|dec_glu4|dec_down|dec_gemv8|in all" \
    "$OUT/profile-$name.log" | head -16 | tee -a "$S"
done
W=/tmp/dn-layer-score; mkdir -p "$W"
score() {  # score NAME ENV...
  local name=$1; shift
  if ! left; then say "score $name: skipped (deadline) at $(el)s"; return; fi
  env "$@" timeout "$(tmo 75)" "$B/lily-engine" score --model $M --len "${LEN:-1024}" --piece 1 --device cuda \
    --out "$W/$name" > "$W/$name.log" 2>&1
  say "score $name (piece 1, $*) rc=$? at $(el)s: $(tail -1 "$W/$name.log" | cut -c1-160)"
}
score fp32 LILY_CUDA_FP32=1
for c in "${CONFIGS[@]}"; do set -- $c; score "$@"; done
others=(); for c in "${CONFIGS[@]}"; do set -- $c; others+=(--other "$W/$1"); done
timeout 30 python3 "$HERE/agreement_table.py" --ref "$W/fp32" "${others[@]}" --out "$OUT/agreement-decode.md" \
  --json "$OUT/agreement-decode.json" > "$W/table.log" 2>&1
say "table agreement-decode rc=$? at $(el)s"; grep -E "^\| " "$OUT/agreement-decode.md" | cut -c1-400 | head -8 | tee -a "$S"
say "done at $(el)s"
