#!/usr/bin/env python3
"""Does this Python already have every package a requirements file asks for? Exit 0 if so; else list
what is missing or too old on stderr and exit 1. Never installs, never touches the network.

scripts/test.sh asks this of python3, then of .venv-test/bin/python, before running pip, so a
machine that has the test dependencies runs the tests offline.

Usage: python3 scripts/check_requirements.py FILE   (`-r OTHER` lines are followed)
"""

import re
import sys
from importlib import metadata
from pathlib import Path

try:  # pip's copy is there whenever pip is; without either, only presence is checked
    from packaging.requirements import Requirement
except ImportError:
    try:
        from pip._vendor.packaging.requirements import Requirement
    except ImportError:
        Requirement = None


def requirements(path: Path) -> list[str]:
    out = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith(("-r ", "--requirement ")):
            out += requirements(path.parent / line.split(maxsplit=1)[1])
        elif line:
            out.append(line)
    return out


def problem(line: str) -> str | None:
    """Why `line` is not satisfied, or None."""
    if Requirement is None:
        name, spec = re.split(r"[\s<>=!~;\[]", line, maxsplit=1)[0], None
    else:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate():
            return None
        name, spec = req.name, req.specifier
    try:
        version = metadata.version(name)
    except metadata.PackageNotFoundError:
        return f"{name}: not installed"
    if spec is not None and not spec.contains(version, prereleases=True):
        return f"{name}: {version} installed, {spec} wanted"
    return None


def main() -> int:
    problems = [p for p in map(problem, requirements(Path(sys.argv[1]))) if p]
    for p in problems:
        print(f"  {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
