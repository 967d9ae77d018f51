#!/usr/bin/env bash
# The whole test suite: Rust unit + integration tests, then the Python end-to-end tests, which
# drive the release `lily-engine` binary (target/release, or $CARGO_TARGET_DIR/release).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace --release -j2
cargo build --release -p lily-server -j2
python3 -m pytest tests -q
