#!/usr/bin/env bash
# Session 23's wgpu prefill call (branch s23wpre, ≤ 6 minutes, Vulkan on the device's GPU): prefill's
# DeltaNet recurrence on the full-size checkpoint, `bench --device wgpu --prefill 512,4K
# --decode-ctx 4K --decode-tokens 16 --repeat 1` under OFF (dn_recur with two barriers a token,
# today's), ON (`recur_lanes`: dn_recur_lanes.wgsl, no barrier a token) and ONE (`recur_one_sync`:
# dn_recur with one barrier a token), OFF / ON / ONE / OFF / ON, then the prefill chunk
# (`LILY_WGPU_CHUNK=4096`: a 4K prompt in one chunk, ≈ 128 items an expert) under ON, then one
# LILY_PROFILE=1 prefill of 4K under ON (its [prefill] table into the summary), then ONE's second
# round if time is left. First, beside the synth, lily-wgpu's model test of the three forms (the
# staged bin/wgpu_model) on the GPU. Logs in $OUT, a short summary.txt.
# Staged by scripts/stage_gpu.sh with gpu_ab_common.sh (copy this script beside it); carry
# .carry/NAME .gl.
set -u
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-320}"
AB_HARD=${HARD:-350}
OFF=${OFF:-LILY_WGPU_RECUR_ONE_SYNC=0 LILY_WGPU_RECUR_LANES=0}
ON=${ON:-LILY_WGPU_RECUR_LANES=1}
ONE=${ONE:-LILY_WGPU_RECUR_ONE_SYNC=1 LILY_WGPU_RECUR_LANES=0}
CHUNK=${CHUNK:-LILY_WGPU_CHUNK=4096}
WTESTS=${WTESTS:-dn_recur_forms_match_the_host}
wgpu_setup
timeout "$(cap 120)" "$B/wgpu_model" --test-threads=1 --nocapture "$WTESTS" > "$OUT/wtests.log" 2>&1
say "wgpu tests ($WTESTS) rc=$? at $(el)s"
grep -hE "^one_sync .*128 × 128, 37|last logits|^test .*(ok|FAILED)$|^test result|panicked" "$OUT/wtests.log" \
  | cut -c1-200 | head -12 | tee -a "$S"
wait "$SYN"; say "synth full rc=$? at $(el)s"

# sweep NAME ENV...: the bench under ENV; its rows and the plan's recurrence and chunk into the
# summary.
sweep() {
  local name=$1; shift
  if ! left; then say "skip $name: past the deadline at $(el)s"; return; fi
  env "$@" timeout "$(cap 75)" "$B/lily-engine" bench --model "$M" --device wgpu --prefill 512,4K \
    --decode-ctx 4K --decode-tokens 16 --repeat 1 > "$OUT/full-$name.log" 2>&1
  local rc=$?
  say "$name rc=$rc at $(el)s: $(grep -E '^ +[0-9]+[KM]? +[0-9.]+ +[0-9.]+' "$OUT/full-$name.log" | tr -s ' ' | tr '\n' '|')"
  grep -h -m1 "prefill chunk" "$OUT/full-$name.log" \
    | grep -oE "dn_recur one barrier a token [a-z]+|dn_recur on subgroup lanes [a-z]+|prefill chunk [0-9]+|dn_recur_lanes: [^;]*" \
    | tr '\n' ' ' >> "$S"; echo >> "$S"
}
# shellcheck disable=SC2086
sweep off-1 $OFF
# shellcheck disable=SC2086
sweep on-1 $ON
# shellcheck disable=SC2086
sweep one-1 $ONE
# shellcheck disable=SC2086
sweep off-2 $OFF
# shellcheck disable=SC2086
sweep on-2 $ON
# shellcheck disable=SC2086
sweep chunk-on $ON $CHUNK
if left; then
  # shellcheck disable=SC2086
  env LILY_PROFILE=1 $ON timeout "$(cap 60)" "$B/lily-engine" bench --model "$M" --device wgpu --prefill 4K \
    --decode-ctx 4K --decode-tokens 16 --repeat 1 > "$OUT/prof-on.log" 2>&1
  say "wgpu profile on rc=$? at $(el)s:"
  grep -A24 -E '^\[prefill\]' "$OUT/prof-on.log" | tr -s ' ' | tee -a "$S" > /dev/null
fi
# shellcheck disable=SC2086
sweep one-2 $ONE
say "done at $(el)s"
