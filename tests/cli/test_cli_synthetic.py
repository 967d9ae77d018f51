"""`--model synthetic:PRESET[:FORMAT]`: generated once by `lily-engine synth` with the bundled tokenizer, then cached."""

import json

import pytest
from typer.testing import CliRunner

from lilycli.bundled_tokenizer import tokenizer_dir
from lilycli.cli import app
from lilycli.synthetic import parse, synthetic_model

runner = CliRunner()


def test_spec_parsing():
    assert parse("synthetic:small") == ("small", "mlx")
    assert parse("synthetic:tiny:hf") == ("tiny", "hf")
    assert parse("synthetic:") == ("small", "mlx")


@pytest.mark.parametrize("spec", ["synthetic:big", "synthetic:small:gguf", "synthetic:small:hf:x"])
def test_bad_specs_are_refused(spec):
    with pytest.raises(Exception, match="unknown synthetic model"):
        parse(spec)


def test_generated_with_the_real_tokenizer_and_cached(fake_engine, monkeypatch):
    model = synthetic_model("synthetic:tiny:hf", fake_engine, log=lambda _: None)
    assert json.loads((model / "config.json").read_text()) == {"preset": "tiny", "format": "hf", "seed": 0}
    assert (model / "tokenizer.json").read_bytes() == (tokenizer_dir() / "tokenizer.json").read_bytes()
    # A second use takes the cached directory: a failing synth would show otherwise.
    monkeypatch.setenv("FAKE_SYNTH_FAIL", "1")
    assert synthetic_model("synthetic:tiny:hf", fake_engine, log=lambda _: None) == model


def test_a_failing_synth_shows_its_output_and_leaves_nothing(fake_engine, monkeypatch, private_cache):
    monkeypatch.setenv("FAKE_SYNTH_FAIL", "1")
    result = runner.invoke(app, ["chat", "hi", "--model", "synthetic:tiny"])
    assert result.exit_code == 1
    assert "`lily-engine synth` failed (exit code 5)" in result.stderr
    assert "synth failed on purpose" in result.stderr
    assert list((private_cache / "synthetic").iterdir()) == []  # no half-written model left to reuse


def test_chat_on_a_synthetic_model_end_to_end(fake_engine):
    result = runner.invoke(app, ["chat", "hi", "--model", "synthetic:small"])
    assert result.exit_code == 0, result.stderr
    assert "generating synthetic model small (mlx)" in result.stderr
    assert result.stdout.startswith("You said: hi")
