"""Every dependency a crate declares is used by its code (an unused one is build time and supply
chain for nothing; docs/ or the crate's README says why each is there)."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CRATES = sorted(p.parent for p in (REPO / "crates").glob("*/Cargo.toml"))


def sections(manifest: str) -> dict[str, list[str]]:
    """The dependency names of each `[section]` of a Cargo.toml (`name = ...`, `name.workspace = ...`;
    Python 3.10 has no tomllib)."""
    out, section = {}, None
    for line in manifest.splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("["):
            section = line.strip("[]").strip()
            out.setdefault(section, [])
        elif section and (m := re.match(r"([A-Za-z0-9_-]+)(\.workspace)?\s*=", line)):
            out[section].append(m.group(1))
    return out


def used(ident: str, dirs: list[Path]) -> bool:
    pattern = re.compile(rf"(?<![A-Za-z0-9_]){ident}::")
    return any(pattern.search(f.read_text()) for d in dirs if d.exists() for f in d.rglob("*.rs"))


@pytest.mark.parametrize("crate", CRATES, ids=lambda p: p.name)
def test_every_declared_dependency_is_used(crate):
    manifest = sections((crate / "Cargo.toml").read_text())
    code = [crate / "src", crate / "build.rs"]
    unused = [name for name in manifest.get("dependencies", {})
              if not used(name.replace("-", "_"), [crate / "src"])]
    unused += [name for name in manifest.get("dev-dependencies", {})
               if not used(name.replace("-", "_"), code + [crate / "tests", crate / "benches"])]
    assert unused == [], f"{crate.name} declares dependencies its code never names: {unused}"
