#!/usr/bin/env bash
# Session 20's measuring call (≤ 9 minutes on an H100 / H200), in order of what matters when time
# runs short:
#   1. beside the full-size synth: the GPU tests named in TESTS (the new kernels' and the batched
#      step's), TEST_S (150) seconds;
#   2. the CUDA batched step A/B: `bench --prefill 1K --decode-ctx 1K --decode-tokens 64 --repeat 1
#      --batch 1,4,8`, off / on / off / on, where "on" is the environment CUDA_ON (e.g.
#      LILY_MOE_GROUPED_ROWS=1) and "off" CUDA_OFF;
#   3. agreement over LEN (1,024) teacher-forced positions against CUDA fp32 (`score --piece 64`):
#      the one-token path (`score --piece 1`, with ONE=1), the batched step with 8 rows as it ships (`score
#      --rows 8`) and with CUDA_ON; scripts/agreement_table.py;
#   4. served clients at once with CUDA_ON (scripts/concurrent_bench.py, 1K prompts, 256 tokens,
#      1 / 4 / 8 clients);
#   5. the wgpu A/B through Vulkan: `bench --prefill 512 --decode-ctx 4K,32K --decode-tokens 64`,
#      off / on / off / on, "on" the environment WGPU_ON, with a LILY_PROFILE=1 run of each;
#   6. CUDA per-kernel profiles of prefill at 512 and 4K.
# Two calls back to back fit a warm machine (the second reuses the checkpoint): SKIP="wgpu prefill"
# then SKIP="tests cuda agree served".
# Summary on stdout and in $OUT/summary.txt, logs beside. No step starts past DEADLINE (470 s).
# Here: `CARGO_TARGET_DIR=/work/main/target bash scripts/stage_gpu.sh /work/main/.carry/next`,
# (it copies this script and agreement_table.py), `gzip -9 .carry/next/bin/*`,
# the tokenizer into .carry/tokenizer/ and the Vulkan debs into .gl. There:
#   CUDA_ON=LILY_X=1 CUDA_OFF=LILY_X=0 WGPU_ON=LILY_Y=1 WGPU_OFF=LILY_Y=0 TESTS="a b" \
#     bash .carry/next/gpu_next.sh   (carry: .carry/next .carry/tokenizer .gl; timeout_s 590)
# Knobs: SKIP (tests cuda agree served wgpu prefill), TEST_S, LEN, ONE, DEADLINE, HARD.
set -u
AB_TOKENIZER=1
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-470}"
AB_HARD=${HARD:-570}
E=$B/lily-engine
LEN=${LEN:-1024}
CUDA_ON=${CUDA_ON:-LILY_NOTHING=1}; CUDA_OFF=${CUDA_OFF:-LILY_NOTHING=0}
WGPU_ON=${WGPU_ON:-LILY_NOTHING=1}; WGPU_OFF=${WGPU_OFF:-LILY_NOTHING=0}
step() {
  if skipped "$1"; then say "$1: skipped (SKIP)"; return 1; fi
  if ! left; then say "$1: skipped (deadline) at $(el)s"; return 1; fi
}

# 1. GPU tests, beside the synth.
if step tests && [ -n "${TESTS:-}" ]; then
  # shellcheck disable=SC2086
  timeout "$(cap "${TEST_S:-150}")" "$B/gpu" --ignored --test-threads=1 --nocapture $TESTS > "$OUT/tests.log" 2>&1
  say "tests ($TESTS) rc=$? at $(el)s"
  grep -hE "^test .*(ok|FAILED)$|^test result|panicked" "$OUT/tests.log" | cut -c1-300 | head -20 | tee -a "$S"
fi
wait "$SYN"; say "synth full rc=$? at $(el)s"

# 2. The batched step, off / on twice.
if step cuda; then
  for v in off on off on; do
    left || break
    if [ $v = on ]; then envs=$CUDA_ON; else envs=$CUDA_OFF; fi
    # shellcheck disable=SC2086
    env $envs timeout "$(cap 90)" "$E" bench --model "$M" --device cuda --prefill 1K --decode-ctx 1K \
      --decode-tokens 64 --repeat 1 --batch 1,4,8 > "$OUT/batch-$v.log" 2>&1
    say "batch $v ($envs) rc=$? at $(el)s: $(grep -E '^ +[0-9]+[K]? +[0-9]+ +[0-9.]+' "$OUT/batch-$v.log" | tr -s ' ' | tr '\n' '|')"
  done
fi

# 3. Agreement: one-token, batched as it ships, batched with CUDA_ON, against CUDA fp32.
if step agree; then
  A=/dev/shm/agree; mkdir -p "$A"
  LILY_CUDA_FP32=1 timeout "$(cap 100)" "$E" score --model "$M" --len "$LEN" --piece 64 --device cuda \
    --out "$A/fp32" > "$OUT/score-fp32.log" 2>&1; say "score fp32 rc=$? at $(el)s"
  if [ -n "${ONE:-}" ]; then
    timeout "$(cap 60)" "$E" score --model "$M" --len "$LEN" --piece 1 --device cuda --out "$A/one" \
      > "$OUT/score-one.log" 2>&1; say "score one-token rc=$? at $(el)s"
  fi
  timeout "$(cap 60)" "$E" score --model "$M" --len "$LEN" --rows 8 --device cuda --out "$A/rows8" \
    > "$OUT/score-rows8.log" 2>&1; say "score 8 rows rc=$? at $(el)s"
  # shellcheck disable=SC2086
  env $CUDA_ON timeout "$(cap 60)" "$E" score --model "$M" --len "$LEN" --rows 8 --device cuda \
    --out "$A/rows8-on" > "$OUT/score-rows8-on.log" 2>&1; say "score 8 rows on rc=$? at $(el)s"
  timeout "$(cap 60)" python3 "$HERE/agreement_table.py" --ref "$A/fp32" --other "$A/one" --other "$A/rows8" \
    --other "$A/rows8-on" --out "$OUT/agreement.md" > "$OUT/agreement.log" 2>&1
  say "agreement rc=$? at $(el)s:"; grep -E '^\|' "$OUT/agreement.md" | head -8 | tee -a "$S"
fi

# 4. Served clients at once with CUDA_ON.
export PYTHONUNBUFFERED=1 LILY_ENGINE_BIN="$E"
if step served; then
  # shellcheck disable=SC2086
  env $CUDA_ON timeout "$(cap 120)" python3 "$HERE/concurrent_bench.py" --model "$M" --device cuda \
    --prompt-tokens 1024 --max-tokens 256 --clients 1,4,8 > "$OUT/concurrent.log" 2>&1
  say "served 1,4,8 clients ($CUDA_ON) rc=$? at $(el)s:"
  grep -E "clients:|rror" "$OUT/concurrent.log" | cut -c1-220 | head -5 | tee -a "$S"
fi

# 5. wgpu through Vulkan, off / on twice, then a profile of each.
if step wgpu; then
  wgpu_setup
  # shellcheck disable=SC2086
  for v in off on off on; do
    if [ $v = on ]; then envs=$WGPU_ON; else envs=$WGPU_OFF; fi
    BENCH_S=80 wgpu_bench "wgpu-$v-$(el)" 4K,32K "decode products [^;]*" $envs
  done
  for v in off on; do
    if [ $v = on ]; then envs=$WGPU_ON; else envs=$WGPU_OFF; fi
    left || break
    # shellcheck disable=SC2086
    env LILY_PROFILE=1 $envs timeout "$(cap 60)" "$E" bench --model "$M" --device wgpu --prefill 256 \
      --decode-ctx 4K --decode-tokens 16 --repeat 1 > "$OUT/wgpu-prof-$v.log" 2>&1
    say "wgpu profile $v rc=$? at $(el)s:"
    grep -A14 -E '^\[decode\]' "$OUT/wgpu-prof-$v.log" | tr -s ' ' | tee -a "$S"
  done
fi

# 6. CUDA prefill profiles at 512 and 4K (issue 31's next step).
if step prefill; then
  for n in 512 4K; do
    left || break
    LILY_PROFILE=1 timeout "$(cap 60)" "$E" bench --model "$M" --device cuda --prefill $n --decode-ctx 256 \
      --decode-tokens 4 --repeat 1 > "$OUT/prefill-prof-$n.log" 2>&1
    say "prefill profile $n rc=$? at $(el)s"
    grep -A24 -E "kernel profile" "$OUT/prefill-prof-$n.log" | grep -v INFO | cut -c1-150 | head -26 >> "$S"
  done
fi
say "done at $(el)s"
