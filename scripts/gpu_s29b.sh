#!/usr/bin/env bash
# Session 29, the second command of the first call (≤ 380 s; on the card gpu_current.sh just used,
# whose /dev/shm checkpoint it reuses): wgpu through Vulkan.
#   1. s28wrows's A/B (`rows_deep`, merged off at 975e667): its kernel test beside the synth, then
#      `bench --device wgpu --prefill 512 --decode-ctx 4K,32K --decode-tokens 64` OFF / ON twice;
#   2. served wgpu at 4K (issue 29: within 5 % of the bench): scripts/serve_bench.py --device wgpu,
#      a 4,096-token prompt, 256 greedy tokens, twice, as it ships (rows_deep off);
#   3. LILY_PROFILE=1 at 4K OFF / ON: in_proj, q/k/v, lm_head must move; dn.out and attn.o must not.
# Staged by scripts/stage_gpu.sh + this script beside the binaries:
#   bash .carry/NAME/gpu_s29b.sh   (carry: .carry/NAME .carry/tokenizer .gl; timeout_s 420)
set -u
AB_TOKENIZER=1
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-330}"
AB_HARD=${HARD:-390}
OFF=LILY_WGPU_ROWS_DEEP=0
ON=LILY_WGPU_ROWS_DEEP=1
K="linear_q4_rows deep rounds (on|off)|in rounds of 8[^)]*"
P='lin.dn.in_proj|lin.attn.qkv|lin.lm_head|lin.dn.out|lin.attn.o'
wgpu_setup
env -u LILY_WGPU_ROWS_DEEP timeout "$(cap 80)" "$B/wgpu_model" --test-threads=1 --nocapture rows_deep_kernel \
  > "$OUT/wtests.log" 2>&1
say "wgpu rows_deep tests rc=$? at $(el)s"
grep -hE "^test .*(ok|FAILED)$|^test result|panicked" "$OUT/wtests.log" | cut -c1-250 | head -8 | tee -a "$S"
wait "$SYN"; say "synth full rc=$? at $(el)s"
export PREFILL=512
# shellcheck disable=SC2086
BENCH_S=35 wgpu_bench off-1 4K,32K "$K" $OFF
# shellcheck disable=SC2086
BENCH_S=35 wgpu_bench on-1 4K,32K "$K" $ON
# shellcheck disable=SC2086
BENCH_S=35 wgpu_bench off-2 4K,32K "$K" $OFF
# shellcheck disable=SC2086
BENCH_S=35 wgpu_bench on-2 4K,32K "$K" $ON
if left && ! skipped served; then
  export PYTHONUNBUFFERED=1 LILY_ENGINE_BIN="$B/lily-engine"
  timeout "$(cap 100)" python3 "$HERE/serve_bench.py" --model "$M" --device wgpu --prompt-tokens 4096 \
    --max-tokens 256 --repeat 2 > "$OUT/served-wgpu.log" 2>&1
  say "served wgpu 4K rc=$? at $(el)s:"
  grep -vE "XDG|INFO" "$OUT/served-wgpu.log" | tail -8 | cut -c1-300 | tee -a "$S"
fi
# shellcheck disable=SC2086
BENCH_S=25 wgpu_bench_rows prof-off 4K "$K" "$P" LILY_PROFILE=1 $OFF
# shellcheck disable=SC2086
BENCH_S=25 wgpu_bench_rows prof-on 4K "$K" "$P" LILY_PROFILE=1 $ON
say "done at $(el)s"
