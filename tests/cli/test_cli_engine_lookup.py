"""Where `lily` finds `lily-engine`: $LILY_ENGINE, the installed wheel's copy, a development build, PATH."""

import stat
import sys
import sysconfig

import pytest

from lilycli import engine
from lilycli.engine import find_engine
from lilycli.errors import LilyError


def executable(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def places(tmp_path, monkeypatch):
    """Point every place the lookup searches into tmp_path."""
    scripts = tmp_path / "venv" / "bin"
    scripts.mkdir(parents=True)
    monkeypatch.setattr(sysconfig, "get_path", lambda name, scheme=None: str(scripts))
    monkeypatch.setattr(sys, "executable", str(scripts / "python"))
    monkeypatch.setenv("CARGO_TARGET_DIR", str(tmp_path / "target"))
    monkeypatch.setenv("PATH", str(tmp_path / "path"))
    monkeypatch.setattr(engine, "CHECKOUT", tmp_path)  # a checkout: it has a Cargo.toml
    (tmp_path / "Cargo.toml").write_text("[workspace]\n")
    return tmp_path


def test_the_installed_copy_wins_over_a_development_build(places):
    installed = executable(places / "venv" / "bin" / "lily-engine")
    executable(places / "target" / "release" / "lily-engine")
    assert find_engine() == installed


def test_a_release_build_wins_over_a_debug_build(places):
    executable(places / "target" / "debug" / "lily-engine")
    release = executable(places / "target" / "release" / "lily-engine")
    assert find_engine() == release


def test_path_is_the_last_resort(places):
    on_path = executable(places / "path" / "lily-engine")
    assert find_engine() == on_path


def test_lily_engine_overrides_everything_and_must_exist(places, monkeypatch):
    executable(places / "venv" / "bin" / "lily-engine")
    chosen = executable(places / "elsewhere" / "my-engine")
    monkeypatch.setenv("LILY_ENGINE", str(chosen))
    assert find_engine() == chosen
    monkeypatch.setenv("LILY_ENGINE", str(places / "missing"))
    with pytest.raises(LilyError, match="missing is not an executable file"):
        find_engine()


def test_nothing_found_lists_the_places_and_how_to_build(places):
    with pytest.raises(LilyError) as error:
        find_engine()
    assert str(places / "target" / "release" / "lily-engine") in error.value.message
    assert "pipx install ." in error.value.message and "cargo build --release" in error.value.message
