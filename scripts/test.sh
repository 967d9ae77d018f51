#!/usr/bin/env bash
# The whole test suite: Rust unit + integration tests, then the Python end-to-end tests, which
# drive the release `lily-engine` binary (target/release, or $CARGO_TARGET_DIR/release).
#
# Needs only the Rust toolchain and Python >= 3.10. The Python test packages
# (scripts/requirements-pytest.txt) are taken from python3 when it has them all; otherwise they are
# installed once into .venv-test/ in the checkout (git-ignored), and later runs work offline.
# With CI=true (.ci/run sets it) NVRTC is installed too (scripts/requirements-test.txt) and the
# NVRTC kernel-compilation test, ignored elsewhere, runs and must pass; and Mesa's lavapipe (CPU
# Vulkan: Debian's mesa-vulkan-drivers + libvulkan1) is installed with apt when missing (as root),
# so the wgpu backend's tests run on it and must pass. Elsewhere they skip without a Vulkan driver.
# Likewise headless Chromium (Debian's chromium + chromium-driver) for the chat page's browser tests.
set -euo pipefail
cd "$(dirname "$0")/.."

ci=false
[[ "${CI:-}" == "true" || "${CI:-}" == "1" ]] && ci=true
requirements=scripts/requirements-pytest.txt
$ci && requirements=scripts/requirements-test.txt

# 1. A Python with the test packages: python3 itself, or .venv-test put first on PATH (so the Rust
#    tests, which run python3 to unpack the bundled tokenizer and to find NVRTC's wheel, use it too).
if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
  echo "scripts/test.sh: Python >= 3.10 is needed as python3 (found: $(python3 --version 2>&1))" >&2
  exit 1
fi
if ! python3 scripts/check_requirements.py "$requirements" 2>/dev/null; then
  venv=.venv-test
  if ! { [ -x "$venv/bin/python" ] && "$venv/bin/python" scripts/check_requirements.py "$requirements" 2>/dev/null; }; then
    if [ ! -x "$venv/bin/python" ] && ! python3 -m venv "$venv"; then
      rm -rf "$venv"
      echo "scripts/test.sh: cannot create $venv (on Debian/Ubuntu: apt install python3-venv)," \
        "or install the test packages into python3 yourself: pip install -r $requirements" >&2
      exit 1
    fi
    echo "scripts/test.sh: installing the Python test packages into $venv ($requirements)"
    "$venv/bin/python" -m pip install --disable-pip-version-check -q -r "$requirements"
  fi
  export PATH="$PWD/$venv/bin:$PATH"
fi

# 2. A Vulkan driver for the wgpu backend's tests: lavapipe, installed in CI when missing.
vulkan_present() {
  { ldconfig -p 2>/dev/null | grep 'libvulkan\.so\.1' >/dev/null; } &&
    compgen -G '/usr/share/vulkan/icd.d/*.json' >/dev/null
}
if $ci && ! vulkan_present; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "scripts/test.sh: installing lavapipe (mesa-vulkan-drivers, libvulkan1) for the wgpu tests"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      mesa-vulkan-drivers libvulkan1 >/dev/null
  else
    echo "scripts/test.sh: CI runs the wgpu tests on lavapipe; install it first (as root):" \
      "apt-get install mesa-vulkan-drivers libvulkan1" >&2
    exit 1
  fi
elif ! $ci && ! vulkan_present; then
  echo "scripts/test.sh: no Vulkan driver here, so the wgpu backend's tests skip" \
    "(apt-get install mesa-vulkan-drivers libvulkan1 runs them on lavapipe, as CI does)"
fi

# 3. A browser for the chat page's tests (tests/test_webui.py): Debian's chromium and its driver,
#    installed in CI when missing (as root), as lavapipe is; elsewhere those tests skip without them.
browser_present() {
  command -v chromium >/dev/null && command -v chromedriver >/dev/null
}
if $ci && ! browser_present; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "scripts/test.sh: installing chromium and chromium-driver for the chat page's browser tests"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      chromium chromium-driver >/dev/null
  else
    echo "scripts/test.sh: CI runs the chat page's tests in headless Chromium; install it first" \
      "(as root): apt-get install chromium chromium-driver" >&2
    exit 1
  fi
elif ! $ci && ! browser_present; then
  echo "scripts/test.sh: no chromium / chromedriver here, so the chat page's browser tests skip" \
    "(apt-get install chromium chromium-driver runs them, as CI does)"
fi

# 4. Rust.
cargo test --workspace --release -j2
if $ci; then
  cargo test --workspace --release -j2 --test kernels_compile -- --include-ignored
else
  echo "scripts/test.sh: kernels_compile (every CUDA kernel through NVRTC) is ignored outside CI;" \
    "CI=true bash scripts/test.sh runs it as CI does"
fi

# 4b. The CUDA kernels written while no GPU was lent, on the CPU: each one's own source compiled as
#     C++ against an emulation of the CUDA features it uses (scripts/cuda_emu: a block's threads
#     with real barriers, warp-collective mma.sync / wgmma / shuffles over the PTX fragment
#     layouts, cp.async landing only at its wait, NaN-filled shared memory), held to f64 references
#     and to the one-sequence kernels. In CI (≈ 3.5 minutes on 2 cores; g++ installed when missing, as root);
#     elsewhere `bash scripts/cuda_emu/run.sh` and `run_batch.sh` run them.
if $ci; then
  if ! command -v g++ >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "scripts/test.sh: installing g++ for the CUDA kernels' CPU emulation (scripts/cuda_emu)"
      apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++ >/dev/null
    else
      echo "scripts/test.sh: CI runs scripts/cuda_emu with g++ (C++20); install it first (as root):" \
        "apt-get install g++" >&2
      exit 1
    fi
  fi
  for emu in scripts/cuda_emu/run*.sh; do
    echo "scripts/test.sh: $emu"
    bash "$emu"
  done
fi

# 5. Python end to end, against the release binary.
cargo build --release -p lily-server -j2 --features scripted
python3 -m pytest tests -q
