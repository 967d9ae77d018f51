#!/usr/bin/env bash
# Session 27, the one long call (≤ 9.3 minutes; device starts failed most of the session, so
# everything that decides a default is in one call, in order of what matters):
# 1. beside the synth: model_prefill_chunks_past_8191_tokens_give_the_same_logits (issue 31: why
#    chunk 8,192's log-probabilities differed from 4,096's), then shipping_configuration_*;
# 2. CUDA's sweep at LILY_PREFILL_CHUNK=CHUNK (8192): `bench --prefill 512,4K,32K,128K
#    --decode-ctx 256,4K,32K,128K --decode-tokens 128` (issue 31's must-reach row);
# 3. served first tokens at 4K and 128K at that chunk (serve_bench.py --ttft-only);
# 4. branch s27wdec's A/B (wgpu, both lean-dequant switches): `bench --device wgpu --prefill 512
#    --decode-ctx 4K,32K --decode-tokens 64` off / on / off / on while the clock allows, then its
#    GPU tests (bit for bit) if time is left.
#   bash .carry/s27b/gpu_s27d.sh      (carry: .carry/s27b .carry/tokenizer .gl; timeout_s 580)
set -u
AB_TOKENIZER=1
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-520}"
AB_HARD=${HARD:-560}
E=$B/lily-engine
timeout "$(cap "${TEST_S:-150}")" "$B/gpu" --ignored --test-threads=1 --nocapture \
  model_prefill_chunks_past_8191_tokens > "$OUT/tests-chunk.log" 2>&1
say "chunk test rc=$? at $(el)s"
grep -E '^MODEL|^test .*(ok|FAILED)$|panicked|differs|rel. L2' "$OUT/tests-chunk.log" | cut -c1-300 | head -24 | tee -a "$S"
timeout "$(cap "${SHIP_S:-90}")" "$B/gpu" --ignored --test-threads=1 --nocapture shipping_configuration \
  > "$OUT/tests-ship.log" 2>&1
say "shipping_configuration tests rc=$? at $(el)s"
grep -hE "^test .*(ok|FAILED)$|^test result|panicked|^MODEL" "$OUT/tests-ship.log" | cut -c1-300 | head -12 | tee -a "$S"
wait "$SYN"; say "synth full rc=$? at $(el)s"
export LILY_PREFILL_CHUNK=${CHUNK:-8192}
if left; then
  timeout "$(cap 170)" "$E" bench --model "$M" --device cuda --prefill 512,4K,32K,128K \
    --decode-ctx 256,4K,32K,128K --decode-tokens 128 --repeat 1 > "$OUT/sweep.log" 2>&1
  say "cuda sweep rc=$? at $(el)s: $(grep -h -m1 -oE 'prefill chunk [0-9]+' "$OUT/sweep.log")"
  grep -E "^ +[0-9]|tok/s|error|Error" "$OUT/sweep.log" | grep -v INFO | tee -a "$S"
fi
export PYTHONUNBUFFERED=1 LILY_ENGINE_BIN="$E"
if left; then
  timeout "$(cap 110)" python3 "$HERE/serve_bench.py" --model "$M" --device cuda --prompt-tokens 4096 \
    --ctx-size 0 --ttft-only --ttft-tokens 4096,131072 --ttft-repeat 2 > "$OUT/ttft.log" 2>&1
  say "served first tokens rc=$? at $(el)s:"
  grep -vE 'INFO|^$' "$OUT/ttft.log" | tail -8 | cut -c1-300 | tee -a "$S"
fi
unset LILY_PREFILL_CHUNK
wgpu_setup
OFF="LILY_WGPU_MOE_LEAN_DEQUANT=0 LILY_WGPU_ROWS_LEAN_DEQUANT=0"
ON="LILY_WGPU_MOE_LEAN_DEQUANT=1 LILY_WGPU_ROWS_LEAN_DEQUANT=1"
K="(decode MoE|linear_q4_rows) lean dequantisation (on|off)"
export PREFILL=512
# shellcheck disable=SC2086
for r in off-1 on-1 off-2 on-2; do
  case $r in off*) v=$OFF ;; *) v=$ON ;; esac
  BENCH_S=35 wgpu_bench "$r" 4K,32K "$K" $v || break
done
if left; then
  timeout "$(cap 60)" "$B/wgpu_model" --test-threads=1 --nocapture lean_dequant_kernels_give_the_same_bits \
    > "$OUT/wtests.log" 2>&1
  say "wgpu lean-dequant tests rc=$? at $(el)s"
  grep -hE "^test .*(ok|FAILED)$|^test result|panicked" "$OUT/wtests.log" | cut -c1-250 | head -6 | tee -a "$S"
fi
say "done at $(el)s"
