#!/usr/bin/env bash
# Session 25 (≤ 240 s): CUDA's prefill chunk (`LILY_PREFILL_CHUNK`, 4,096 by default since
# session 2's 4-layer sweep of 1,024 / 2,048 / 4,096; larger chunks never measured) at 32K and
# 128K prompts on the full-size checkpoint, and whether a larger chunk changes the greedy tokens.
# Staged by scripts/stage_gpu.sh with gpu_ab_common.sh beside:
#   bash .carry/NAME/gpu_s25chunk.sh      (carry: .carry/NAME; timeout_s 300)
# 1. `bench --prefill 512,4K,32K,128K --decode-ctx 1 --decode-tokens 1 --repeat REPEAT (1)` with the chunk 4,096 /
#    8,191 alternated twice (each run's plan line's chunk into the summary);
# 2. `generate` from one 10,000-token prompt (ids from awk's seeded rand) for 16 greedy tokens at
#    each chunk: the three token lists into the summary (equal, or where they part).
set -u
R=${OUT:-$PWD/gpu-logs}; mkdir -p "$R"
L=/tmp/s25chunk-logs; mkdir -p "$L"; OUT=$L
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-220}"
AB_HARD=${HARD:-240}
S=$R/summary.txt
wait "$SYN"; say "synth full rc=$? at $(el)s"
bench() {  # bench NAME CHUNK
  if ! left; then say "bench $1: skipped (deadline) at $(el)s"; return; fi
  LILY_PREFILL_CHUNK=$2 timeout "$(cap 70)" "$B/lily-engine" bench --model "$M" --device cuda \
    --prefill 512,4K,32K,128K --decode-ctx 1 --decode-tokens 1 --repeat "${REPEAT:-1}" > "$L/bench-$1.log" 2>&1
  say "bench $1 rc=$? at $(el)s: $(grep -E '^ +[0-9]+[KM]? +[0-9.]+ +[0-9.]+' "$L/bench-$1.log" | tr -s ' ' | tr '\n' '|')"
  grep -h -m1 -oE "prefill chunk [0-9]+" "$L/bench-$1.log" >> "$S"
}
bench c4096-1 4096; bench c8191-1 8191; bench c4096-2 4096; bench c8191-2 8191

ids=$(awk 'BEGIN{srand(3); for(i=0;i<10000;i++) printf "%s%d", (i?",":""), 1000+int(rand()*200000)}')
for c in 4096 8191; do
  if ! left; then say "generate $c: skipped (deadline)"; continue; fi
  LILY_PREFILL_CHUNK=$c timeout "$(cap 40)" "$B/lily-engine" generate --model "$M" --device cuda \
    --prompt-ids "$ids" --max-tokens 16 > "$L/gen-$c.log" 2>&1
  say "generate chunk $c rc=$?: $(grep -vE 'INFO|WARN|^\s*$' "$L/gen-$c.log" | tail -2 | tr '\n' ' ' | cut -c1-300)"
done
cp "$L"/bench-c8191-1.log "$L"/gen-8191.log "$R"/ 2>/dev/null
say "done at $(el)s"
