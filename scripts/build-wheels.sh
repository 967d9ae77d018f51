#!/usr/bin/env bash
# A manylinux2014 (glibc >= 2.17) wheel of Lily in dist/: the lily-engine binary + the lilycli package.
# zig (the `ziglang` wheel from PyPI) is the C compiler and linker, targeting the old glibc without
# a manylinux Docker image. Extra arguments go to maturin (e.g. --target aarch64-unknown-linux-gnu,
# after `rustup target add` for it).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "maturin>=1.5,<2" "ziglang>=0.13"
maturin build --release --zig --compatibility manylinux2014 --out dist "$@"
ls -l dist/*.whl
