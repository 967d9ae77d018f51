"""`--model synthetic:PRESET[:FORMAT]`: a synthetic model made by `lily-engine synth`, with the real tokenizer.

So the whole product (serve, chat, bench) can be tried offline without the 20 GB checkpoint. The
directory is cached under <cache>/synthetic/, keyed by the engine build, and written atomically.
`small` has the real 248,320-token vocabulary; `tiny` has 1,024 ids, enough for bench but not for
chatting through the real tokenizer.
"""

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from lilycli.bundled_tokenizer import tokenizer_dir
from lilycli.engine import engine_version
from lilycli.errors import LilyError
from lilycli.paths import cache_dir

PREFIX = "synthetic:"
PRESETS = ("tiny", "small", "qwen3.6-35b-a3b")
FORMATS = ("mlx", "hf")
SEED = 0


def is_synthetic(spec: str) -> bool:
    return spec.startswith(PREFIX)


def parse(spec: str) -> tuple[str, str]:
    """`synthetic:small` -> ("small", "mlx"); `synthetic:tiny:hf` -> ("tiny", "hf")."""
    parts = spec[len(PREFIX) :].split(":")
    preset = parts[0] or "small"
    fmt = parts[1] if len(parts) > 1 else "mlx"
    if preset not in PRESETS or fmt not in FORMATS or len(parts) > 2:
        raise LilyError(
            f"unknown synthetic model {spec!r}: use synthetic:PRESET[:FORMAT] with PRESET one of "
            f"{', '.join(PRESETS)} and FORMAT one of {', '.join(FORMATS)}",
            exit_code=2,
        )
    return preset, fmt


def _build_key(binary: Path) -> str:
    # The version alone does not change between development builds, so the binary's size and
    # time stamp join it: a rebuilt engine regenerates its synthetic models.
    stat = binary.stat()
    text = f"{engine_version(binary)}|{stat.st_size}|{stat.st_mtime_ns}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def synthetic_model(spec: str, binary: Path, log=print) -> Path:
    """The directory of the synthetic model `spec`, generated now if not cached for this engine."""
    preset, fmt = parse(spec)
    root = cache_dir() / "synthetic"
    name = f"{preset}-{fmt}-seed{SEED}"
    target = root / f"{name}-{_build_key(binary)}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    for old in root.glob(f"{name}-*"):  # models made by an older engine build
        shutil.rmtree(old, ignore_errors=True)
    tokenizer = tokenizer_dir()
    log(f"generating synthetic model {preset} ({fmt}) in {target} ...")
    staging = Path(tempfile.mkdtemp(prefix=".synth-", dir=root))
    out = staging / name
    command = [str(binary), "synth", "--preset", preset, "--format", fmt, "--seed", str(SEED),
               "--out", str(out), "--tokenizer", str(tokenizer)]  # fmt: skip
    try:
        result = subprocess.run(command, check=False, capture_output=True, text=True, errors="replace")
        if result.returncode != 0:
            lines = (result.stdout + result.stderr).strip().splitlines()[-20:]
            raise LilyError(
                f"`lily-engine synth` failed (exit code {result.returncode}):", details=lines or ["(no output)"]
            )
        if not (out / "config.json").is_file():
            raise LilyError(f"`lily-engine synth` wrote no config.json into {out}")
        os.rename(out, target)
    except OSError as e:
        raise LilyError(f"cannot generate the synthetic model in {target}: {e}") from e
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
