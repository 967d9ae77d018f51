#!/usr/bin/env bash
# Session 26's one device call (≤ 590 s), most important first, every step skipped past DEADLINE
# (560) and no run's timeout past HARD (585):
#   1. beside the synth (TEST_S 100): the GPU tests of the shipping configuration
#      (shipping_configuration_*), of the chunk above 8,191 (CHUNK_TESTS) and of the two new
#      switches (decode::glu_down_prefetch_gives_the_bulk_kernels_bits; wgpu's
#      router_lean_kernel_matches_the_host);
#   2. CUDA's one sweep as it ships: `bench --prefill 512,4K,32K,128K --decode-ctx 256,4K,32K,128K
#      --decode-tokens 128 --repeat 1`;
#   3. the prefill chunk: `bench --prefill 32K,128K` at LILY_PREFILL_CHUNK 8192 / 4096 / 8192
#      (the sweep is the first 4,096 round);
#   4. served first token at 4K and 128K (serve_bench.py --ttft-only --ttft-tokens 4096,131072
#      --ttft-repeat 2 --ctx-size 0);
#   5. `moe_down_prefetch` (issue 30): `bench --prefill 512 --decode-ctx 4K,32K --decode-tokens 64`
#      with LILY_MOE_DOWN_PREFETCH 0 / 1 alternated twice;
#   6. wgpu's `router_lean` (issue 29): `bench --device wgpu --prefill 512 --decode-ctx 4K,32K
#      --decode-tokens 64` with LILY_WGPU_ROUTER_LEAN 0 / 1 alternated twice, then a LILY_PROFILE=1
#      run at 4K each way (lin.router, lin.experts.glu);
#   7. served decode at 4K (a 4,096-token prompt, 256 greedy tokens, twice).
# Staged: stage_gpu.sh into .carry/NAME, this script and serve_bench.py beside, `gzip -9 bin/*`;
# the tokenizer in .carry/tokenizer (tokenizer.json gzipped), the Vulkan loader debs in .gl. There:
#   bash .carry/NAME/gpu_s26b.sh   (carry: .carry/NAME .carry/tokenizer .gl; timeout_s 595)
set -u
AB_TOKENIZER=1
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-560}"
AB_HARD=${HARD:-585}
E=$B/lily-engine
step() { if skipped "$1"; then say "$1: skipped (SKIP)"; return 1; fi
  if ! left; then say "$1: skipped (deadline) at $(el)s"; return 1; fi; }
rows() { grep -E '^ +[0-9]+[KM]? +[0-9.]+ +[0-9.]+' "$1" | tr -s ' ' | tr '\n' '|'; }
# cbench NAME S ARGS... (after ENV=... words): one CUDA bench, its rows and plan labels into the summary.
cbench() {
  local name=$1 s=$2; shift 2
  left || { say "bench $name: skipped (deadline) at $(el)s"; return; }
  local envs=(); while [ $# -gt 0 ] && [[ "$1" == *=* ]]; do envs+=("$1"); shift; done
  env "${envs[@]}" timeout "$(cap "$s")" "$E" bench --model "$M" --device cuda "$@" > "$OUT/b-$name.log" 2>&1
  say "bench $name rc=$? at $(el)s: $(rows "$OUT/b-$name.log") $(grep -h -m1 -oE 'prefill chunk [0-9]+|MoE down weights prefetched to L2 (on|off)' "$OUT/b-$name.log" | tr '\n' ' ')"
}

if step tests; then
  t=${TEST_S:-100}
  timeout "$(cap $(( t * 2 / 5 )))" "$B/gpu" --ignored --test-threads=1 --nocapture shipping_configuration \
    > "$OUT/tests.log" 2>&1
  say "tests (shipping_configuration_*) rc=$? at $(el)s"
  timeout "$(cap $(( t * 2 / 5 )))" "$B/gpu" --ignored --test-threads=1 --nocapture \
    glu_down_prefetch_gives_the_bulk_kernels_bits ${CHUNK_TESTS:-} >> "$OUT/tests.log" 2>&1
  say "tests (moe_down_prefetch${CHUNK_TESTS:+, $CHUNK_TESTS}) rc=$? at $(el)s"
  wgpu_setup
  timeout "$(cap $(( t / 5 + 10 )))" "$B/wgpu_model" --test-threads=1 --nocapture router_lean_kernel_matches_the_host \
    >> "$OUT/tests.log" 2>&1
  say "wgpu tests (router_lean) rc=$? at $(el)s"
  grep -hE "^test .*(ok|FAILED)$|^test result|panicked|rel_l2 [0-9]" "$OUT/tests.log" | grep -v "^MODEL" \
    | cut -c1-250 | head -24 | tee -a "$S"
else
  wgpu_setup
fi
wait "$SYN"; say "synth full rc=$? at $(el)s"

if step sweep; then
  timeout "$(cap 170)" "$E" bench --model "$M" --device cuda --prefill 512,4K,32K,128K \
    --decode-ctx 256,4K,32K,128K --decode-tokens 128 --repeat 1 > "$OUT/sweep.log" 2>&1
  say "cuda sweep rc=$? at $(el)s:"
  grep -E "^ +[0-9]|tok/s|error|Error|prefill chunk" "$OUT/sweep.log" | grep -v INFO | tee -a "$S"
fi

if step chunk; then
  for c in ${CHUNK_BIG:-8192} 4096 ${CHUNK_BIG:-8192}; do
    cbench "chunk-$c" 60 LILY_PREFILL_CHUNK="$c" --prefill 32K,128K --decode-ctx 1 --decode-tokens 1 --repeat 1
  done
fi

export PYTHONUNBUFFERED=1 LILY_ENGINE_BIN="$E"
if step ttft; then
  timeout "$(cap 120)" python3 "$HERE/serve_bench.py" --model "$M" --device cuda --prompt-tokens 4096 \
    --ctx-size 0 --ttft-only --ttft-tokens 4096,131072 --ttft-repeat 2 > "$OUT/ttft.log" 2>&1
  say "served ttft 4K,128K rc=$? at $(el)s:"
  grep -vE "^\s*$" "$OUT/ttft.log" | tail -12 | cut -c1-300 | tee -a "$S"
fi

if step dec; then
  for r in 1 2; do
    for v in 0 1; do
      cbench "dec$v-$r" 40 LILY_MOE_DOWN_PREFETCH=$v --prefill 512 --decode-ctx 4K,32K --decode-tokens 64 --repeat 1
    done
  done
fi

if step wdec; then
  K="linear_q4_rows lean 1-row router (on|off)|the products of < 1,024 rows on its lean 1-row kernel"
  for r in 1 2; do
    for v in 0 1; do BENCH_S=35 wgpu_bench "wdec$v-$r" 4K,32K "$K" LILY_WGPU_ROUTER_LEAN=$v; done
  done
  for v in 0 1; do
    BENCH_S=25 wgpu_bench_rows "wprof$v" 4K "$K" "lin.router|lin.experts.glu" LILY_PROFILE=1 LILY_WGPU_ROUTER_LEAN=$v
  done
fi

if step served; then
  timeout "$(cap 80)" python3 "$HERE/serve_bench.py" --model "$M" --device cuda --prompt-tokens 4096 \
    --max-tokens 256 --repeat 2 > "$OUT/served.log" 2>&1
  say "served 4K rc=$? at $(el)s: $(grep -E '^(completions|chat)|rror' "$OUT/served.log" | tail -2 | tr '\n' '|' | cut -c1-400)"
fi
# At most 8 files come back: the summary, the tests, the sweep, the first tokens, two profiles.
rm -f "$OUT"/full-*.log "$OUT"/b-*.log "$OUT"/synth.log "$OUT"/bench-wdec*.log 2>/dev/null
say "done at $(el)s"
