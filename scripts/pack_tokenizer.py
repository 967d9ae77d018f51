#!/usr/bin/env python3
"""Copy the real Qwen3.6 tokenizer from ../shared into lilycli/tokenizer/, tokenizer.json xz-compressed.

Why: `lily serve --model synthetic:small` must work for people who installed the wheel and have no
../shared. tokenizer.json is 20 MB of text; xz brings it to ~2.5 MB, small enough to commit and to
ship as package data. lilycli/bundled_tokenizer.py unpacks it on first use and checks SHA256SUMS.
Run again whenever ../shared/qwen3.6-tokenizer changes (tests/cli/test_bundled_tokenizer.py notices).
"""

import hashlib
import lzma
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT.parent / "shared" / "qwen3.6-tokenizer"
TARGET = ROOT / "lilycli" / "tokenizer"
# What `lily-engine synth --tokenizer DIR` copies into a model directory, plus the provenance note.
# config.json is left out on purpose: a synthetic model writes its own.
PLAIN = ["tokenizer_config.json", "chat_template.jinja", "generation_config.json", "PROVENANCE.md"]
COMPRESSED = ["tokenizer.json"]


def main() -> int:
    source = Path(sys.argv[1]) if len(sys.argv) > 1 else SOURCE
    if not (source / "tokenizer.json").is_file():
        print(f"error: {source}/tokenizer.json not found", file=sys.stderr)
        return 1
    TARGET.mkdir(parents=True, exist_ok=True)
    sums = []
    for name in PLAIN + COMPRESSED:
        data = (source / name).read_bytes()
        sums.append(f"{hashlib.sha256(data).hexdigest()}  {name}\n")
    for name in PLAIN:
        shutil.copyfile(source / name, TARGET / name)
    for name in COMPRESSED:
        data = (source / name).read_bytes()
        packed = lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)
        (TARGET / f"{name}.xz").write_bytes(packed)
        print(f"{name}: {len(data):,} B -> {len(packed):,} B")
    # SHA256SUMS lists the unpacked files, so a corrupted or stale bundle is caught on unpack.
    (TARGET / "SHA256SUMS").write_text("".join(sums))
    return 0


if __name__ == "__main__":
    sys.exit(main())
