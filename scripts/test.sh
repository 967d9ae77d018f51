#!/usr/bin/env bash
# The whole test suite: Rust unit + integration tests, then the Python end-to-end tests.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace --release -j2
