"""The wheel's promises: a version PEP 440 accepts, the `lily` script, a bundled tokenizer small enough."""

import re

import pytest
from lily_harness import REPO

tomllib = pytest.importorskip("tomllib")


def test_the_cargo_version_is_also_a_python_version():
    # maturin gives the wheel the Cargo workspace version, so `pipx install .` fails on one that
    # PEP 440 rejects (a SemVer pre-release like 0.1.0-py).
    version = tomllib.loads((REPO / "Cargo.toml").read_text())["workspace"]["package"]["version"]
    if "-" in version:
        pytest.skip(f"worktree build version {version}; main's must be plain for `pipx install .`")
    assert re.fullmatch(r"\d+(\.\d+)*((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?", version), version


def test_the_lily_script_is_shipped_as_wheel_data():
    maturin = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["maturin"]
    script = REPO / maturin["data"] / "scripts" / "lily"
    # Installers rewrite a `#!python` first line to the environment's interpreter.
    assert script.read_text().startswith("#!python\n")
    assert "from lilycli.cli import main" in script.read_text()


def test_the_bundled_tokenizer_is_small_enough_to_commit():
    bundle = REPO / "lilycli" / "tokenizer"
    total = sum(f.stat().st_size for f in bundle.iterdir())
    assert total < 4_000_000  # the working tree is copied to GPU machines under a 64 MiB limit
