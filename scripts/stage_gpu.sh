#!/usr/bin/env bash
# Builds the GPU test binaries here (release) and stages them, with gpu_check.sh, into
# /work/main/.carry/cuda/ (or $1) for the device tool, which ships the main checkout + `.carry`.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${1:-/work/main/.carry/cuda}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/work/main/target}"
mkdir -p "$DEST/bin"
# exe_of TARGET: the executable of test target TARGET in cargo's JSON messages on stdin.
exe_of() {
  python3 -c "
import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get('reason')=='compiler-artifact' and m['target']['name']=='$1' and m.get('executable'):
        print(m['executable'])" | tail -1
}
out=$(cargo test --release --no-run -j2 -p lily-cuda --message-format=json 2>/dev/null)
for t in gpu kernels_compile; do
  exe=$(echo "$out" | exe_of "$t")
  [ -n "$exe" ] || { echo "no executable for test target $t" >&2; exit 1; }
  cp "$exe" "$DEST/bin/$t"
done
# lily-wgpu's model tests as `wgpu_model` (on the device they take its Vulkan GPU: e.g. the
# cooperative-matrix kernels' checks, which lavapipe cannot run).
exe=$(cargo test --release --no-run -j2 -p lily-wgpu --test model --message-format=json 2>/dev/null | exe_of model)
[ -n "$exe" ] || { echo "no executable for lily-wgpu's test target model" >&2; exit 1; }
cp "$exe" "$DEST/bin/wgpu_model"
cargo build --release -j2 -p lily-server --features scripted
cp "$CARGO_TARGET_DIR/release/lily-engine" "$DEST/bin/lily-engine"
cp scripts/gpu_check.sh scripts/gpu_profile.sh scripts/gpu_session.sh scripts/gpu_pending.sh \
  scripts/gpu_ab_common.sh scripts/gpu_current.sh scripts/gpu_next.sh scripts/gpu_wgpu_ab3.sh scripts/concurrent_bench.py \
  scripts/serve_bench.py scripts/agreement_table.py "$DEST/"
strip --strip-debug "$DEST/bin/"* 2>/dev/null || true
du -sh "$DEST"
