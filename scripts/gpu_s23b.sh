#!/usr/bin/env bash
# Session 23, call 3 (≤ 9.5 minutes): the three branches' switches in one call on one card, every
# switch off by default on main. Staged by scripts/stage_gpu.sh with this script beside it:
#   bash .carry/s23b/gpu_s23b.sh     (carry: .carry/s23b .gl; timeout_s 590)
#   1. beside the synth, at once: CUDA's new decode tests (branch s23dec: gemv4w_sm_grid,
#      down_96_regs) and wgpu's (branch s23wdec: in_rows; branch s23wpre: recur_lanes /
#      recur_one_sync);
#   2. CUDA `bench --prefill 256 --decode-ctx 256,4K,32K --decode-tokens 128` C_OFF / C_ON twice;
#   3. wgpu `bench --prefill 512,4K --decode-ctx 4K,32K --decode-tokens 64` W_OFF / W_DEC (in_rows)
#      / W_PRE (recur_lanes) alternated twice (a run gives prefill and decode: each switch acts
#      on one of them);
#   4. profiles under the ON sides (CUDA decode at 4K; wgpu prefill and decode at 4K), then
#      wgpu's selftest with both wgpu switches on, if the clock allows.
set -u
R=${OUT:-$PWD/gpu-logs}; mkdir -p "$R"
L=/tmp/s23b-logs; mkdir -p "$L"; OUT=$L
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-480}"
AB_HARD=${HARD:-570}
S=$R/summary.txt
E=$B/lily-engine
C_OFF=${C_OFF:-LILY_GEMV4W_SM_GRID=0 LILY_DOWN_96_REGS=0}
C_ON=${C_ON:-LILY_GEMV4W_SM_GRID=1 LILY_DOWN_96_REGS=1}
W_OFF=${W_OFF:-LILY_WGPU_IN_ROWS=0 LILY_WGPU_RECUR_LANES=0}
W_DEC=${W_DEC:-LILY_WGPU_IN_ROWS=8 LILY_WGPU_RECUR_LANES=0}
W_PRE=${W_PRE:-LILY_WGPU_IN_ROWS=0 LILY_WGPU_RECUR_LANES=1}
W_BOTH=${W_BOTH:-LILY_WGPU_IN_ROWS=8 LILY_WGPU_RECUR_LANES=1}
wgpu_setup > /dev/null 2>&1
wgpu_synth4
timeout "$(cap "${C_TEST_S:-130}")" "$B/gpu" --ignored --test-threads=1 --nocapture \
  ${C_TESTS:-decode::gemv_int8_matches_cpu decode::moe_int8_matches_cpu \
  decode_with_session_23_switches_gives_the_same_tokens_and_logprobs} > "$L/ctests.log" 2>&1 &
CT=$!
env -u LILY_WGPU_IN_ROWS timeout "$(cap "${W_TEST_S:-120}")" "$B/wgpu_model" --test-threads=1 --nocapture \
  ${W_TESTS:-in_rows_kernels_match_the_host out_rows_kernels_match_the_host dn_recur_forms_match_the_host} \
  > "$L/wtests.log" 2>&1
say "wgpu tests rc=$? at $(el)s"
grep -hE "^test .*(ok|FAILED)$|^test result|panicked|refused|last logits" "$L/wtests.log" | cut -c1-220 | head -14 | tee -a "$S"
wait "$CT"; say "cuda tests rc=$? at $(el)s"
grep -hE "^test .*(ok|FAILED)$|^test result|panicked" "$L/ctests.log" | cut -c1-220 | head -10 | tee -a "$S"
cp "$S" "$R/summary.txt" 2>/dev/null
wait "$SYN"; say "synth full rc=$? at $(el)s"
cbench() {  # cbench NAME ENV...
  local name=$1; shift
  if ! left; then say "cuda $name: skipped (deadline) at $(el)s"; return; fi
  env "$@" timeout "$(cap 60)" "$E" bench --model "$M" --device cuda --prefill 256 \
    --decode-ctx 256,4K,32K --decode-tokens 128 --repeat 1 > "$L/c-$name.log" 2>&1
  say "cuda $name rc=$? at $(el)s: $(grep -E '^ +[0-9]+[KM]? +[0-9.]+ +[0-9.]+' "$L/c-$name.log" | tr -s ' ' | tr '\n' '|')"
}
wbench() {  # wbench NAME ENV...
  local name=$1; shift
  if ! left; then say "wgpu $name: skipped (deadline) at $(el)s"; return; fi
  env "$@" timeout "$(cap 75)" "$E" bench --model "$M" --device wgpu --prefill 512,4K \
    --decode-ctx 4K,32K --decode-tokens 64 --repeat 1 > "$L/w-$name.log" 2>&1
  say "wgpu $name rc=$? at $(el)s: $(grep -E '^ +[0-9]+[KM]? +[0-9.]+ +[0-9.]+' "$L/w-$name.log" | tr -s ' ' | tr '\n' '|')"
  grep -h -m1 "wgpu: " "$L/w-$name.log" | grep -oE "in rows [0-9]+|dn_recur on subgroup lanes [a-z]+|dn_recur_lanes: [^;]*" | tr '\n' ' ' >> "$S"; echo >> "$S"
}
for r in 1 2; do
  # shellcheck disable=SC2086
  cbench "off-$r" $C_OFF; cbench "on-$r" $C_ON
done
cp "$S" "$R/summary.txt" 2>/dev/null
for r in 1 2; do
  # shellcheck disable=SC2086
  wbench "off-$r" $W_OFF; wbench "dec-$r" $W_DEC; wbench "pre-$r" $W_PRE
  cp "$S" "$R/summary.txt" 2>/dev/null
done
if left; then
  # shellcheck disable=SC2086
  env LILY_PROFILE=1 $C_ON timeout "$(cap 45)" "$E" bench --model "$M" --device cuda --prefill 256 \
    --decode-ctx 4K --decode-tokens 32 --repeat 1 > "$L/c-prof.log" 2>&1
  say "cuda profile (C_ON) 4K rc=$? at $(el)s"
  grep -E "dec_gemv4w|dec_down_combine|dec_glu4|dec_gemv4_x8x2|dec_gemv8|dec_dn_step" "$L/c-prof.log" | head -12 | tr -s ' ' | tee -a "$S"
fi
if left; then
  # shellcheck disable=SC2086
  env LILY_PROFILE=1 $W_BOTH timeout "$(cap 60)" "$E" bench --model "$M" --device wgpu --prefill 4K \
    --decode-ctx 4K --decode-tokens 16 --repeat 1 > "$L/w-prof.log" 2>&1
  say "wgpu profile (W_BOTH) rc=$? at $(el)s"
  grep -v -E "XDG|INFO" "$L/w-prof.log" | tail -60 > "$R/w-prof.txt"
fi
if left; then
  # shellcheck disable=SC2086
  wgpu_selftest selftest-both $W_BOTH
fi
say "done at $(el)s"
cp "$S" "$R/summary.txt" 2>/dev/null
cp "$L/ctests.log" "$L/wtests.log" "$R/" 2>/dev/null
exit 0
