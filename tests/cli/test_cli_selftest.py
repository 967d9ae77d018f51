"""`lily selftest` against the real engine: the report's sections, each device's agreement with the
CPU, and a failing exit status when a device disagrees (a fault injected with $LILY_SELFTEST_FAULT).

With CI=true (lavapipe is installed by scripts/test.sh) the wgpu backend must be tested too, on the
software adapter through --allow-software; elsewhere that part skips without a Vulkan driver.
"""

import glob
import os
import re
import subprocess
import sys

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CI = os.environ.get("CI") in ("true", "1")
HAS_VULKAN = bool(glob.glob("/usr/share/vulkan/icd.d/*.json"))


def selftest(engine, *args, fault=None):
    env = dict(os.environ, LILY_ENGINE=str(engine))
    env.pop("LILY_SELFTEST_FAULT", None)
    if fault:
        env["LILY_SELFTEST_FAULT"] = fault
    return subprocess.run(
        [sys.executable, "-m", "lilycli", "selftest", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def device_block(report: str, name: str) -> str:
    match = re.search(rf"^device: {name}\n((?:  .*\n)+)", report, re.M)
    assert match, f"no block for device {name} in:\n{report}"
    return match.group(1)


def test_cpu_report_has_every_section_and_agrees(real_engine):
    r = selftest(real_engine, "--steps", "8")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert re.search(r"^lily \S+ \(Python ", out, re.M), out
    assert re.search(r"^lily-engine \d+\.\d+\.\d+$", out, re.M), out
    assert re.search(r"^os: \S+ \S+ ", out, re.M), out
    for section in ("== Lily self-test ==", "== devices ==", "== skipped ==", "== result =="):
        assert section in out, out
    cpu = device_block(out, "cpu")
    assert "backend: cpu" in cpu
    assert re.search(r"greedy tokens 8/8 identical: ok", cpu), cpu
    assert re.search(r"speed: prefill [\d.]+ tok/s .*decode [\d.]+ tok/s", cpu), cpu
    # Without --allow-software a software-only wgpu is skipped with the reason, never run.
    skipped = out.split("== skipped ==")[1]
    assert re.search(r"^cuda: ", skipped, re.M), skipped
    if "device: wgpu" not in out:
        assert re.search(r"^wgpu: .+", skipped, re.M), skipped
    assert "PASS" in out.split("== result ==")[1]


@pytest.mark.skipif(not (CI or HAS_VULKAN), reason="no Vulkan driver (CI installs lavapipe)")
def test_wgpu_on_lavapipe_agrees_with_the_cpu(real_engine):
    r = selftest(real_engine, "--allow-software", "--steps", "8")
    assert r.returncode == 0, r.stdout + r.stderr
    wgpu = device_block(r.stdout, "wgpu")
    assert "backend: wgpu" in wgpu, wgpu
    # The kernels' check in fp32 (every f16 option off), as CUDA's fp32 mode.
    fp32 = re.search(r"agreement \(fp32 configuration, bound 1e-3\): logits rel\. L2 (\S+);(.*)", wgpu)
    assert fp32, wgpu
    assert float(fp32.group(1)) <= 1e-3, wgpu
    assert "greedy tokens 8/8 identical: ok" in fp32.group(2), wgpu
    # The configuration that ships on lavapipe (not an Apple GPU) is the fp32 one, and says why.
    assert "shipping configuration: the fp32 one (f16 activations: off (not yet measured" in wgpu, wgpu


def test_a_device_that_disagrees_fails_the_run(real_engine):
    r = selftest(real_engine, "--steps", "4", fault="cpu")
    assert r.returncode == 1, r.stdout + r.stderr
    cpu = device_block(r.stdout, "cpu")
    assert "DISAGREES with the CPU" in cpu, cpu
    assert "FAIL: cpu" in r.stdout.split("== result ==")[1]


@pytest.mark.skipif(not (CI or HAS_VULKAN), reason="no Vulkan driver (CI installs lavapipe)")
def test_a_disagreeing_wgpu_fails_the_run(real_engine):
    r = selftest(real_engine, "--allow-software", "--steps", "4", fault="wgpu")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "DISAGREES" in device_block(r.stdout, "wgpu")
    assert "ok" in device_block(r.stdout, "cpu")


def test_bad_steps_is_a_usage_error(real_engine):
    r = selftest(real_engine, "--steps", "0")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--steps" in r.stderr
