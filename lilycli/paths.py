"""Where Lily keeps what it generates: unpacked tokenizer, synthetic models, logs."""

import os
from pathlib import Path


def cache_dir() -> Path:
    """$LILY_CACHE_DIR, else $XDG_CACHE_HOME/lily, else ~/.cache/lily."""
    explicit = os.environ.get("LILY_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "lily"
