# The preamble of the batched-step A/B scripts (gpu_batch_small_ab.sh and gpu_mma_rows_ab.sh
# used it until their A/Bs decided, sessions 16 and 17; git history keeps them),
# sourced from their staged folder with AB_LAYERS set: `. gpu_rows_ab_common.sh DEADLINE HARD`.
# With DRY=1 (no GPU) gpu_ab_common.sh's parts are stubbed and every engine / test command is
# echoed into $OUT/dry.log instead of run; else gpu_ab_common.sh runs (binaries, B, M, OUT, `say`,
# `el`, `left` with DEADLINE). Then: `run CMD...` (runs it, or echoes it dry), `tmo N` (N seconds,
# or what is left before HARD — env HARD overrides — if less), the full-size checkpoint's synth
# started into FULL (/dev/shm/full-mlx; its pid SYNF), and `bench NAME MODEL TIMEOUT ENV...`:
# `bench --batch 1,4,8` at a 1K context (STEPS steps, 64) under ENV, its rows into the summary;
# `rows_tests` (below).
if [ "${DRY:-0}" = 1 ]; then
  HERE="$(cd "$(dirname "${BASH_SOURCE[1]}")" && pwd)"; B=$HERE/bin; M=/dev/shm/l$AB_LAYERS
  OUT=${OUT:-$(mktemp -d)}; mkdir -p "$OUT"; S=$OUT/summary.txt; say() { echo "$*" | tee -a "$S"; }
  t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }; AB_DEADLINE=${DEADLINE:-$1}
  left() { [ "$(el)" -lt "$AB_DEADLINE" ]; }
  run() { echo "RUN $*" >> "$OUT/dry.log"; }
  SYN=; sleep 0 & SYN=$!
else
  . "$(dirname "${BASH_SOURCE[0]}")/gpu_ab_common.sh" "$1"
  run() { "$@"; }
fi
HARD=${HARD:-$2}
tmo() {  # tmo N: N seconds, or what is left before HARD if less (at least 1)
  local rest=$(( HARD - $(el) ))
  [ "$rest" -lt "$1" ] && { [ "$rest" -lt 1 ] && echo 1 || echo "$rest"; } || echo "$1"
}
FULL=/dev/shm/full-mlx
if [ "${DRY:-0}" = 1 ]; then
  run "$B/lily-engine" synth --preset qwen3.6-35b-a3b --format mlx --seed 7 --out "$FULL"; SYNF=$SYN
else
  ab_synth "$FULL" "" "$AB_TOK" "$OUT/synth-full.log"; SYNF=$AB_PID
fi
bench() {  # bench NAME MODEL TIMEOUT ENV...: bench --batch 1,4,8 at 1K, its rows into the summary
  local name=$1 model=$2 t=$3; shift 3
  if ! left; then say "bench $name: skipped (deadline) at $(el)s"; return; fi
  run env "$@" timeout "$(tmo "$t")" "$B/lily-engine" bench --model "$model" --device cuda --prefill 1K \
    --decode-ctx 1K --decode-tokens "${STEPS:-64}" --repeat 1 --batch 1,4,8 > "$OUT/bench-$name.log" 2>&1
  say "bench $name ($*) rc=$? at $(el)s: $(grep -E '^ +[0-9]|error|Error' "$OUT/bench-$name.log" \
    | tr -s ' ' | tr '\n' '|' | cut -c1-400)"
}
# rows_tests WHAT TEST_S EXTRA FILTER...: unless SKIP_TESTS=1, the GPU tests FILTER... first
# (KERNEL_S, 60 s: a slow model test cannot crowd the new kernels' out), then every other batched
# one (batched_decode_*, decode_batched_*) until TEST_S seconds (env TEST_S overrides); their
# results and the lines matching the extended regex EXTRA into the summary.
rows_tests() {
  [ "${SKIP_TESTS:-0}" = 1 ] && return
  local what=$1 test_s=${TEST_S:-$2} extra=$3 skips=() f; shift 3
  for f in "$@"; do skips+=(--skip "$f"); done
  run timeout "$(tmo "${KERNEL_S:-60}")" "$B/gpu" --ignored --test-threads=1 --nocapture "$@" \
    > "$OUT/tests-kernels.log" 2>&1
  say "tests ($what) rc=$? at $(el)s"
  run timeout "$(tmo $(( test_s - $(el) )))" "$B/gpu" --ignored --test-threads=1 --nocapture \
    batched_decode_ decode_batched_ "${skips[@]}" > "$OUT/tests.log" 2>&1
  say "tests (batched_decode_*, decode_batched_*) rc=$? at $(el)s"
  grep -hE "^test .*(ok|FAILED)$|^test result|panicked|$extra" \
    "$OUT/tests-kernels.log" "$OUT/tests.log" | cut -c1-220 | head -40 | tee -a "$S"
}
