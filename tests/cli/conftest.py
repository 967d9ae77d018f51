"""Shared set-up for the `lily` CLI tests: no network, a private cache, the fake and the real engine.

The real engine is `$LILY_ENGINE`, else `$CARGO_TARGET_DIR or target`/release/lily-engine (scripts/test.sh
builds it before pytest runs). Tests that need it skip with the reason when it is absent.
"""

import os
import stat
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # test the checkout's lilycli, installed or not
# tests/cli is a package (so this conftest never shadows tests/conftest.py as module `conftest`);
# its helper module is imported by its plain name.
sys.path.insert(0, str(Path(__file__).resolve().parent))
FAKE_ENGINE = Path(__file__).resolve().parent / "fake_engine.py"


def _real_engine() -> Path | None:
    # LILY_ENGINE is what `lily` itself honours; LILY_ENGINE_BIN is what tests/conftest.py reads.
    explicit = os.environ.get("LILY_ENGINE") or os.environ.get("LILY_ENGINE_BIN")
    if explicit:
        return Path(explicit) if Path(explicit).is_file() else None
    target = Path(os.environ.get("CARGO_TARGET_DIR") or REPO / "target")
    binary = target / "release" / "lily-engine"
    return binary if binary.is_file() else None


REAL_ENGINE = _real_engine()
NO_REAL_ENGINE = "the real lily-engine binary is not built (scripts/test.sh builds it; or set LILY_ENGINE)"

# Before anything imports huggingface_hub (it reads these once): never the network, never ~/.cache.
_SESSION_HOME = Path(tempfile.mkdtemp(prefix="lily-cli-tests-"))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HOME"] = str(_SESSION_HOME / "hf")
os.environ["HF_HUB_CACHE"] = str(_SESSION_HOME / "hf" / "hub")
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ.pop("LILY_URL", None)
os.environ.pop("LILY_API_KEY", None)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Each test gets its own Lily cache and a neutral engine lookup."""
    monkeypatch.setenv("LILY_CACHE_DIR", str(tmp_path / "lily-cache"))
    monkeypatch.delenv("LILY_ENGINE", raising=False)
    return tmp_path / "lily-cache"


@pytest.fixture
def fake_engine(tmp_path, monkeypatch) -> Path:
    """An executable `lily-engine` stand-in (tests/cli/fake_engine.py), installed as $LILY_ENGINE."""
    wrapper = tmp_path / "bin" / "lily-engine"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_ENGINE}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("LILY_ENGINE", str(wrapper))
    return wrapper


@pytest.fixture
def real_engine(monkeypatch) -> Path:
    if REAL_ENGINE is None:
        pytest.skip(NO_REAL_ENGINE)
    monkeypatch.setenv("LILY_ENGINE", str(REAL_ENGINE))
    return REAL_ENGINE
