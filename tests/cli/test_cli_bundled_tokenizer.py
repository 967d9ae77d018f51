"""The tokenizer shipped in the package is byte-identical to the project's real tokenizer (../shared)."""

import pytest
from lily_harness import SHARED_TOKENIZER

from lilycli.bundled_tokenizer import tokenizer_dir

FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"]


@pytest.mark.skipif(not SHARED_TOKENIZER.is_dir(), reason="../shared/qwen3.6-tokenizer is not beside the checkout")
def test_unpacked_tokenizer_matches_shared_byte_for_byte():
    unpacked = tokenizer_dir()
    for name in FILES:
        assert (unpacked / name).read_bytes() == (SHARED_TOKENIZER / name).read_bytes(), (
            f"{name} differs from ../shared: run scripts/pack_tokenizer.py"
        )


def test_a_damaged_unpacked_copy_is_replaced():
    unpacked = tokenizer_dir()
    (unpacked / "tokenizer.json").write_text("{}")
    again = tokenizer_dir()
    assert again == unpacked
    assert (again / "tokenizer.json").stat().st_size > 10_000_000
