#!/usr/bin/env bash
# Session 26 (≤ 200 s), branch s26grid: CUDA prefill chunks above 8,191 tokens (issue 31).
# linear_gather loops over its items past grid.y's 65,535 and the backend's bound is now
# kernels::max_chunk (65,535 tokens on the full model: dn_conv's tokens in grid.y), so
# LILY_PREFILL_CHUNK=8192 / 16384 run. Staged by scripts/stage_gpu.sh with gpu_ab_common.sh beside:
#   bash .carry/s26grid/gpu_s26grid_ab.sh      (carry: .carry/s26grid; timeout_s 240)
# 1. beside the synth: the GPU tests linear_gather_past_the_grid_y_limit_* (72,000 items against
#    the CPU and, bit for bit, two one-pass launches) and model_prefill_chunks_past_8191_tokens_*
#    (a 9,000-token prompt on a full-width 4-layer model, chunks 4,096 / 8,192 / 9,000, experts
#    grouped and gathered: the same greedy tokens, log-probabilities within 2e-2);
# 2. `bench --prefill 32K,128K --decode-ctx 1 --decode-tokens 1 --repeat 1` at LILY_PREFILL_CHUNK
#    4,096 / 8,192 alternated twice, then 16,384 once (scratch ≈ 1.5 / 3.0 / 6.1 GiB), each run's
#    plan line's chunk into the summary;
# 3. time left: one LILY_PROFILE=1 128K prefill at 4,096 and at 8,192 (profile-CHUNK.txt).
set -u
R=${OUT:-$PWD/gpu-logs}; mkdir -p "$R"
L=/tmp/s26grid-logs; mkdir -p "$L"; OUT=$L
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-180}"
AB_HARD=${HARD:-200}
S=$R/summary.txt
timeout "$(cap "${TEST_S:-80}")" "$B/gpu" --ignored --test-threads=1 --nocapture \
  linear_gather_past_the_grid_y_limit model_prefill_chunks_past_8191_tokens > "$L/tests.log" 2>&1
say "gpu tests rc=$? at $(el)s: $(grep -E '^test |test result|MODEL chunk|panicked' "$L/tests.log" | tr '\n' '|' | cut -c1-900)"
wait "$SYN"; say "synth full rc=$? at $(el)s"
bench() {  # bench NAME CHUNK
  if ! left; then say "bench $1: skipped (deadline) at $(el)s"; return; fi
  LILY_PREFILL_CHUNK=$2 timeout "$(cap 45)" "$B/lily-engine" bench --model "$M" --device cuda \
    --prefill 32K,128K --decode-ctx 1 --decode-tokens 1 --repeat 1 > "$L/bench-$1.log" 2>&1
  say "bench $1 rc=$? at $(el)s: $(grep -E '^ +[0-9]+[KM]? +[0-9.]+ +[0-9.]+' "$L/bench-$1.log" | tr -s ' ' | tr '\n' '|') $(grep -h -m1 -oE 'prefill chunk [0-9]+' "$L/bench-$1.log")"
  grep -h -m1 -E "refused|must be in|out of memory|Error" "$L/bench-$1.log" >> "$S"
}
bench c4096-1 4096; bench c8192-1 8192; bench c4096-2 4096; bench c8192-2 8192; bench c16384-1 16384
for c in 4096 8192; do
  if ! left; then say "profile $c: skipped (deadline)"; continue; fi
  LILY_PROFILE=1 LILY_PREFILL_CHUNK=$c timeout "$(cap 40)" "$B/lily-engine" bench --model "$M" --device cuda \
    --prefill 128K --decode-ctx 1 --decode-tokens 1 --repeat 1 > "$L/profile-$c.log" 2>&1
  say "profile chunk $c rc=$? at $(el)s (its table: profile-$c.txt)"
  grep -v INFO "$L/profile-$c.log" | tail -60 > "$R/profile-$c.txt"
done
cp "$L"/tests.log "$L"/bench-c8192-1.log "$L"/bench-c16384-1.log "$R"/ 2>/dev/null
say "done at $(el)s"
