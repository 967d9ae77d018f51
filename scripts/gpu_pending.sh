#!/usr/bin/env bash
# The first device call after session 6, whose device loans were paused after its first call:
# every kernel and path that session wrote without a GPU, checked and then measured, in one call
# (≈ 8–9 minutes). Each of them is off by default (or, for the wgpu variants, checked at load)
# until this has run; docs/perf-notes.md, the "(session 6)" sections, has each one's prediction.
#
# Here: scripts/stage_gpu.sh (copies this script too); carry .carry/cuda, .carry/tokenizer, .gl.
# There: OUT=$OUT/p bash .carry/cuda/gpu_pending.sh   (ONLY="tests bench wgpu ncu" picks parts)
set -u
HERE="$(cd "$(dirname "$0")" && pwd)"
OUT="${OUT:-$PWD/gpu-logs}"
mkdir -p "$OUT"
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
say() { echo "$* (at $(el) s)" | tee -a "$OUT/pending.txt"; }
want() { [[ " ${ONLY:-tests bench prefill wgpu ncu} " == *" $1 "* ]]; }
export SKIP_CHECK=1 SKIP_PROFILE=1 SKIP_PARITY=1

# 1. The new GPU tests (beside the synthetic checkpoint's synth), then the model and decode
#    tests on the shipping defaults: fused attention prep (split_kv_decode_attention's fused
#    mode), the wgmma GEMMs, the chunked DeltaNet scan, the pipelined decode.
if want tests; then
  ( timeout 420 "$HERE/bin/gpu" --ignored --test-threads=1 --nocapture split_kv_decode_attention \
      wgmma_linears chunked_deltanet pipelined_ pinned_host model_ decode_ \
      --skip model_matches_cpu_on_checkpoint_from_env > "$OUT/tests.log" 2>&1
    say "tests rc=$?" ) &
  TESTS=$!
fi
mkdir -p "$OUT/run"
OUT=$OUT/run VARIANTS="" bash "$HERE/gpu_session.sh" > $OUT/run/synth.out 2>&1
say "synth: $(grep synth $OUT/run/session.txt | tail -1)"
if want tests; then
  wait $TESTS
  grep -E "^(KERNEL|MODEL)|^test |test result|panicked" "$OUT/tests.log" | tail -80 >> "$OUT/pending.txt"
fi

# 2. The A/B benches, one binary, variants alternated: decode (pipelined and fused prep, each
#    alone and together) and prefill (wgmma GEMMs, chunked scan, both).
if want bench; then
  OUT=$OUT/run VARIANTS="new new-pipe new-pipeprep" ROUNDS=2 PREFILL=512 DECODE=256,4K,128K REPEAT=1 \
    LILY_STEP_TIMING=1 bash "$HERE/gpu_session.sh" > $OUT/run/bench1.out 2>&1
  OUT=$OUT/run VARIANTS="new-sampled new-sampled-pipe new-prep" PREFILL=512 DECODE=4K REPEAT=1 \
    LILY_STEP_TIMING=1 bash "$HERE/gpu_session.sh" > $OUT/run/bench1b.out 2>&1
  say "decode A/B done"
fi
if want prefill; then
  OUT=$OUT/run VARIANTS="new new-wgmma new-chunked new-prefill" ROUNDS=1 PREFILL=512,4K,32K DECODE=256 \
    REPEAT=1 bash "$HERE/gpu_session.sh" > $OUT/run/bench2.out 2>&1
  say "prefill A/B done"
fi
if want bench || want prefill; then
  grep -v "^KERNEL" $OUT/run/bench.log | grep -E "=====|tok/s|^ +[0-9]|step timing" > "$OUT/bench.log"
fi

# 3. wgpu through Vulkan: the load-time cooperative-matrix check with the new variants (the
#    probe's lines), and the 4K prefill profile.
# Then the same bench with fp32 products at chunk 2048 and the tiled prefill attention, and that
# with the 32-item product kernel (branch issue13g's plan, docs/perf-notes.md).
if want wgpu; then
  OUT=$OUT/run WGPU="4K 4K" WGPU_PROFILE=1 WGPU_TIMEOUT=150 LILY_WGPU_COOP_DIAG=1 VARIANTS="" \
    WGPU_ENV2="LILY_WGPU_COOP=0 LILY_WGPU_ATTN_TILE=1 LILY_WGPU_CHUNK=2048" \
    WGPU_ENV3="LILY_WGPU_COOP=0 LILY_WGPU_ATTN_TILE=1 LILY_WGPU_CHUNK=2048 LILY_WGPU_MM_T32=1" \
    bash "$HERE/gpu_session.sh" > $OUT/run/wgpu.out 2>&1
  for f in wgpu.log wgpu2.log wgpu3.log; do cp "$OUT/run/$f" "$OUT/" 2>/dev/null; done
  say "wgpu done"
fi

# 4. Nsight Compute's full set on the 128K decode attention (why 3.3 TB/s, issue 11).
if want ncu && [ "$(el)" -lt 480 ]; then
  OUT=$OUT/run NCU_FULL="attn_split_mma" NCU_FULL_CTX=131072 NCU_FULL_SKIP=5 NCU_FULL_COUNT=1 \
    NCU_FULL_TIMEOUT=100 VARIANTS="" bash "$HERE/gpu_session.sh" > $OUT/run/ncu.out 2>&1
  cp $OUT/run/ncu-full.txt "$OUT/" 2>/dev/null
  say "ncu done"
fi
