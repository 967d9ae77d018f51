"""`lily selftest`: a tiny synthetic model on every device against the CPU, and a short bench.

The engine does the work (`lily-engine selftest`: agreement with the CPU reference, tok/s, what was
skipped and why); this module makes the model in a temporary directory, runs it, and puts the CLI's
version above the engine's report so the whole text can be pasted into a bug report.
"""

import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from lilycli import __version__
from lilycli.errors import LilyError


def run(binary: Path, allow_software: bool, steps: int | None, echo) -> int:
    """Print the report through `echo`; return the engine's exit status (1: a device disagrees)."""
    if steps is not None and steps < 1:
        raise LilyError("--steps must be at least 1", exit_code=2)
    with tempfile.TemporaryDirectory(prefix="lily-selftest-") as tmp:
        model = Path(tmp) / "tiny"
        made = subprocess.run(
            [str(binary), "synth", "--preset", "tiny", "--out", str(model)],
            check=False, capture_output=True, text=True, errors="replace",
        )  # fmt: skip
        if made.returncode != 0:
            lines = (made.stdout + made.stderr).strip().splitlines()[-20:]
            raise LilyError(f"`lily-engine synth --preset tiny` failed (exit code {made.returncode}):", details=lines)
        command = [str(binary), "selftest", "--model", str(model)]
        if allow_software:
            command.append("--allow-software")
        if steps is not None:
            command += ["--steps", str(steps)]
        echo(f"lily {__version__} (Python {platform.python_version()}, {platform.platform()})")
        try:
            result = subprocess.run(command, check=False, capture_output=True, text=True, errors="replace")
        except OSError as e:
            raise LilyError(f"cannot run {binary}: {e}") from e
        echo(result.stdout.rstrip("\n"))
        if result.returncode not in (0, 1):
            lines = result.stderr.strip().splitlines()[-20:]
            raise LilyError(f"`lily-engine selftest` failed (exit code {result.returncode}):", details=lines)
        if result.returncode == 1 and not result.stdout.strip():
            sys.stderr.write(result.stderr)
        return result.returncode
