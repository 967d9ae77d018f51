#!/usr/bin/env bash
# A manylinux2014 (glibc >= 2.17) wheel of Lily in dist/: the lily-engine binary + the lilycli package.
# zig (the `ziglang` wheel from PyPI) is the C compiler and linker, targeting the old glibc without
# a manylinux Docker image. Extra arguments go to maturin (e.g. --target aarch64-unknown-linux-gnu,
# after `rustup target add` for it).
#
# macOS arm64 (Apple Silicon): this script does not build it, and no macOS wheel has been built
# or run anywhere yet (no Apple machine here; linking for macOS needs Apple's SDK, which is not
# available on Linux, so the aarch64-apple-darwin target was not built here either). The wheel is
# meant to be built natively on a Mac with Apple Silicon, with no zig and no manylinux tag:
#   xcode-select --install                  # Apple's linker and SDK (Metal and QuartzCore frameworks)
#   curl https://sh.rustup.rs -sSf | sh     # stable Rust, which targets aarch64-apple-darwin natively
#   python3 -m pip install "maturin>=1.5,<2"
#   MACOSX_DEPLOYMENT_TARGET=11.0 maturin build --release --out dist   # -> dist/lily-*-macosx_11_0_arm64.whl
# (11.0 is the first macOS on Apple Silicon.) The binary runs the model through wgpu's Metal backend
# (`--device auto` picks it) or on the CPU; CUDA is absent on a Mac and `--device auto` says so.
# Then, on that Mac: `pipx install dist/lily-*.whl && lily selftest` checks the Metal path against
# the CPU and prints a report to paste into a bug report.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "maturin>=1.5,<2" "ziglang>=0.13"
maturin build --release --zig --compatibility manylinux2014 --out dist "$@"
ls -l dist/*.whl
