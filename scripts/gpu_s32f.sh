#!/usr/bin/env bash
# Session 32's fallback call (≤ 270 s by its own clock) when the device budget allows no A/B: the
# GPU tests with the int8 KV cache as the default and the two helper switches' kernel tests, four
# processes at once (kernel-cache writes are atomic): `gpu model::` (without the
# checkpoint-from-env test), `gpu batch::`, `gpu pipeline:: sample:: attention::
# router_async_stage_gives_the_lean_routers_bits`, wgpu's `rows_tail_early_kernel`. The full
# checkpoint is not synthesised (a 2-layer one is, which nothing reads).
#   AB_LAYERS=2 bash .carry/NAME/gpu_s32f.sh   (carry: .carry/NAME .carry/tokenizer .gl)
set -u
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-250}"
AB_HARD=${HARD:-270}
T=${TEST_S:-250}
wgpu_setup
g() { timeout "$(cap $T)" "$B/gpu" --ignored --test-threads=1 --nocapture "$@"; }
g model:: --skip model_matches_cpu_on_checkpoint_from_env > "$OUT/tests-model.log" 2>&1 & P1=$!
g batch:: > "$OUT/tests-batch.log" 2>&1 & P2=$!
g pipeline:: sample:: attention:: router_async_stage_gives_the_lean_routers_bits > "$OUT/tests-rest.log" 2>&1 & P3=$!
env -u LILY_WGPU_ROWS_TAIL_EARLY timeout "$(cap 120)" "$B/wgpu_model" --test-threads=1 --nocapture \
  rows_tail_early_kernel > "$OUT/tests-wgpu.log" 2>&1
say "wgpu test rc=$? at $(el)s: $(grep -hE '^test result|panicked|same bits' "$OUT/tests-wgpu.log" | tr '\n' '|' | cut -c1-300)"
for p in "$P1:model" "$P2:batch" "$P3:rest"; do
  wait "${p%%:*}"; rc=$?
  f="$OUT/tests-${p##*:}.log"
  say "tests ${p##*:} rc=$rc at $(el)s: $(grep -cE '(\.\.\. |^)ok$' "$f") ok; $(grep -E 'test result|FAILED|panicked' "$f" | tr '\n' '|' | cut -c1-700)"
  grep -E '^test [a-z_:]+ \.\.\. ' "$f" | sed -E 's/^test ([a-z_:0-9]+) .*/\1/' | tr '\n' ' ' >> "$S"; echo >> "$S"
done
say "done at $(el)s"
