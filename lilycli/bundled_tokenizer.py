"""The real Qwen3.6 tokenizer shipped inside the package, unpacked once into the cache.

The wheel carries tokenizer.json xz-compressed (2.5 MB instead of 20 MB; scripts/pack_tokenizer.py
makes the bundle from ../shared/qwen3.6-tokenizer). The tests read the tokenizer from here too
(tests/conftest.py, crates/lily-core/tests/common/mod.rs), so a checkout needs nothing beside it. Synthetic models need a tokenizer directory on
disk (`lily-engine synth --tokenizer DIR` copies it), so we unpack into
<cache>/tokenizer/<hash>/ and check every file against SHA256SUMS before using it.
"""

import hashlib
import lzma
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

from lilycli.errors import LilyError
from lilycli.paths import cache_dir


def _bundle():
    return resources.files("lilycli").joinpath("tokenizer")


def _expected_sums() -> dict[str, str]:
    sums = {}
    for line in _bundle().joinpath("SHA256SUMS").read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        sums[name.strip()] = digest
    return sums


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _is_complete(directory: Path, sums: dict[str, str]) -> bool:
    return all((directory / name).is_file() and _sha256(directory / name) == d for name, d in sums.items())


def tokenizer_dir(cache: Path | None = None) -> Path:
    """A directory holding the bundled tokenizer files, unpacked and verified, under `cache`
    (default: Lily's cache directory). The test suites unpack into the build tree this way."""
    try:
        sums = _expected_sums()
    except (OSError, ValueError) as e:
        raise LilyError(f"the bundled tokenizer is missing from the lilycli package ({e}); reinstall lily") from e
    key = hashlib.sha256("".join(f"{n}{d}" for n, d in sorted(sums.items())).encode()).hexdigest()[:16]
    target = (cache or cache_dir()) / "tokenizer" / key
    if target.is_dir():
        if _is_complete(target, sums):
            return target
        shutil.rmtree(target, ignore_errors=True)  # half-written or tampered: unpack again
    target.parent.mkdir(parents=True, exist_ok=True)
    # Unpack beside the target and rename into place, so no reader ever sees a half-written copy.
    staging = Path(tempfile.mkdtemp(prefix=".unpack-", dir=target.parent))
    try:
        for name in sums:
            packed = _bundle().joinpath(f"{name}.xz")
            if packed.is_file():
                with lzma.open(packed.open("rb")) as src, open(staging / name, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
            else:
                with _bundle().joinpath(name).open("rb") as src, open(staging / name, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
        if not _is_complete(staging, sums):
            raise LilyError("the bundled tokenizer does not match its SHA256SUMS; reinstall lily")
        try:
            os.rename(staging, target)
        except OSError:
            if not (target.is_dir() and _is_complete(target, sums)):  # not a concurrent unpack: real error
                raise
    except (OSError, lzma.LZMAError) as e:
        raise LilyError(f"cannot unpack the bundled tokenizer into {target}: {e}") from e
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
