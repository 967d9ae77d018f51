#!/usr/bin/env bash
# Session 25, branch s25wdec (≤ 240 s by its own clock, Vulkan on the device's GPU):
# `attn_v_early`, attend_gqa's values of a block requested as soon as its key products are formed
# (held in registers through the scores' barriers and the softmax) instead of read after the
# softmax in rounds of 8: one DRAM trip a block where there were four (the full model's blocks of
# 32 keys; 1 block a split at 4K, 4 at 32K).
# Modelled on gpu_s24win2_ab.sh; staged by scripts/stage_gpu.sh with gpu_ab_common.sh
# (bin/lily-engine, bin/wgpu_model):
#   bash scripts/stage_gpu.sh /work/main/.carry/s25wdec && cp scripts/gpu_s25wdec_ab.sh /work/main/.carry/s25wdec/
#   rm /work/main/.carry/s25wdec/bin/{gpu,kernels_compile}; gzip -9 /work/main/.carry/s25wdec/bin/*
#   device: bash .carry/s25wdec/gpu_s25wdec_ab.sh      (carry: .carry/s25wdec .gl; timeout_s 300)
# 1. beside the synth: lily-wgpu's `attention_kernels_match_the_host` (attend_gqa at the full
#    model's shapes, 8 query heads a KV head, head dim 256: conditional, flat, and flat with
#    VEARLY, bit for bit, against the host's f64) and `attention_early_values_decode_the_same_bits`
#    (tiny decoded token by token with the switch off / on: the logits bit for bit); they set the
#    switch in their cases: run without LILY_WGPU_ATTN_V_EARLY, which would override them;
# 2. `bench --device wgpu --prefill 512 --decode-ctx 4K,32K --decode-tokens 64 --repeat 1`,
#    OFF / ON twice, then LILY_PROFILE=1 at 32K OFF / ON (decode's rows of attend_gqa and
#    attend_merge, and lin.attn.o beside them as a row that must not move, into the summary);
# 3. if the clock allows: selftest under ON on a 4-layer full-width model (wgpu_synth4's).
# Logs in /tmp/s25wdec-logs (outside $OUT); $OUT gets summary.txt and the profiles' tails.
set -u
R=${OUT:-$PWD/gpu-logs}; mkdir -p "$R"
L=/tmp/s25wdec-logs; mkdir -p "$L"; rm -f "$L/summary.txt"
export OUT=$L
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-225}"
S=$R/summary.txt; cat "$L/summary.txt" >> "$S"
AB_HARD=${HARD:-240}
OFF=${OFF:-LILY_WGPU_ATTN_V_EARLY=0}
ON=${ON:-LILY_WGPU_ATTN_V_EARLY=1}
K="attend_gqa early values (on|off)|a block's values requested after its key products|attn_v_early without attn_flat|keys split for ≈ [0-9]+ workgroups"
P='attend_gqa|attend_merge|lin.attn.o'
wgpu_setup
wgpu_synth4
env -u LILY_WGPU_ATTN_V_EARLY timeout "$(cap 70)" "$B/wgpu_model" --test-threads=1 --nocapture \
  attention_kernels_match_the_host attention_early_values_decode_the_same_bits > "$OUT/wtests.log" 2>&1
say "wgpu tests rc=$? at $(el)s"
grep -hE "^test .*(ok|FAILED)$|^test result|panicked|attention vs|attn_v_early" "$OUT/wtests.log" | cut -c1-250 | head -10 | tee -a "$S"
wait "$SYN"; say "synth full rc=$? at $(el)s"
export PREFILL=512
# shellcheck disable=SC2086
BENCH_S=45 wgpu_bench off-1 4K,32K "$K" $OFF
# shellcheck disable=SC2086
BENCH_S=45 wgpu_bench on-1 4K,32K "$K" $ON
# shellcheck disable=SC2086
BENCH_S=45 wgpu_bench off-2 4K,32K "$K" $OFF
# shellcheck disable=SC2086
BENCH_S=45 wgpu_bench on-2 4K,32K "$K" $ON
# The profiles last (the deadline may cut them; the two rounds decide, the rows say why).
# shellcheck disable=SC2086
BENCH_S=40 wgpu_bench_rows prof-off 32K "$K" "$P" LILY_PROFILE=1 $OFF
# shellcheck disable=SC2086
BENCH_S=40 wgpu_bench_rows prof-on 32K "$K" "$P" LILY_PROFILE=1 $ON
# Last, if the clock allows: selftest on the 4-layer full-width model under ON (8 query heads a
# KV head with the prep inside attend_gqa, on the GPU, against the CPU).
# shellcheck disable=SC2086
wgpu_selftest selftest-on $ON LILY_WGPU_CHUNK=64
cp "$L"/bench-prof-*.log "$R"/ 2>/dev/null
say "done at $(el)s"
