"""Which files of a checkpoint the engine reads, and whether a directory holds all of them.

The check is deliberately shallow (names, not contents): the engine validates tensors and shapes
when it loads. Its job is to tell "downloaded" from "half-downloaded" without the network.
"""

import fnmatch
import json
from pathlib import Path

from lilycli.errors import LilyError

# Repos Lily knows (docs/MODEL.md §3). Others are allowed with a warning: the engine only
# runs the Qwen3.6-35B-A3B architecture, whoever converted it.
DEFAULT_REPO = "mlx-community/Qwen3.6-35B-A3B-4bit"
KNOWN_REPOS = {
    DEFAULT_REPO: "MLX affine 4-bit, about 20 GB",
    "Qwen/Qwen3.6-35B-A3B": "original bf16, about 72 GB, quantised to 4-bit when loaded",
}

# What the engine reads. Everything else in those repos (README, vocab.json/merges.txt which
# tokenizer.json supersedes, image/video preprocessor configs) is skipped.
NEEDED_PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "model.safetensors.index.json",
    "*.safetensors",
]


def is_needed(filename: str) -> bool:
    return any(fnmatch.fnmatch(filename, pattern) for pattern in NEEDED_PATTERNS)


def missing_files(directory: Path) -> list[str]:
    """The files the engine needs that `directory` lacks; [] means complete."""
    missing = [name for name in ("config.json", "tokenizer.json") if not (directory / name).is_file()]
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise LilyError(f"{index} is not a safetensors index (no readable weight_map): {e}") from e
        missing += [shard for shard in shards if not (directory / shard).is_file()]
    elif not any(directory.glob("*.safetensors")):
        missing.append("*.safetensors")
    return missing
