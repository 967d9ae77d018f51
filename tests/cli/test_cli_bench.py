"""`lily bench`: runs the engine's sweep, prints one table, writes JSON and a PNG, compares two runs."""

import json

import pytest
from typer.testing import CliRunner

from lilycli.bench import parse_lengths
from lilycli.cli import app

runner = CliRunner()

RUN_A = {
    "engine": "lily", "version": "0.1.0", "gpu": "NVIDIA H200", "model": "Qwen3.6-35B-A3B", "format": "mlx",
    "prefill": [{"len": 256, "tok_s": 3000.0, "ms": 85.3}, {"len": 4096, "tok_s": 9000.0, "ms": 455.1}],
    "decode": [{"ctx": 256, "tok_s": 200.0, "ms_per_tok": 5.0}, {"ctx": 4096, "tok_s": 150.0, "ms_per_tok": 6.67}],
}  # fmt: skip
RUN_B = {
    "engine": "peer", "version": "9", "gpu": "NVIDIA H200", "model": "Qwen3.6-35B-A3B", "format": "mlx",
    "prefill": [{"len": 256, "tok_s": 1500.0, "ms": 170.6}, {"len": 1024, "tok_s": 2000.0, "ms": 512.0}],
    "decode": [{"ctx": 256, "tok_s": 250.0, "ms_per_tok": 4.0}, {"ctx": 4096, "tok_s": 100.0, "ms_per_tok": 10.0}],
}  # fmt: skip


@pytest.fixture
def runs(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(RUN_A))
    b.write_text(json.dumps(RUN_B))
    return a, b


def test_lengths_accept_k_suffixes():
    assert parse_lengths("256, 1K,4k,128K") == [256, 1024, 4096, 131072]


def test_a_bad_length_is_refused():
    result = runner.invoke(app, ["bench", "--model", "synthetic:tiny", "--lengths", "256,lots"])
    assert result.exit_code == 2
    assert "'lots' is not a positive length" in result.stderr


def test_a_loaded_run_prints_one_row_per_length(runs):
    result = runner.invoke(app, ["bench", "--load", str(runs[0])])
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "lily · 0.1.0 · NVIDIA H200 · Qwen3.6-35B-A3B · mlx"
    assert lines[2].split() == ["256", "3,000.0", "85.3", "200.0", "5.00"]
    assert lines[3].split() == ["4K", "9,000.0", "455.1", "150.0", "6.67"]


def test_compare_prints_throughput_ratios_per_length(runs):
    result = runner.invoke(app, ["bench", "--load", str(runs[0]), "--compare", str(runs[1])])
    assert result.exit_code == 0, result.stderr
    rows = {line.split()[0]: line.split()[1:] for line in result.stdout.split("A/B")[-1].strip().splitlines()}
    assert rows["256"] == ["2.00x", "0.80x"]  # 3000/1500 prefill, 200/250 decode
    assert rows["1K"] == ["—", "—"]  # only one run measured it
    assert rows["4K"] == ["—", "1.50x"]


def test_a_malformed_run_names_the_file_and_field(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"prefill": [{"len": 256, "tok_s": "fast", "ms": 1}], "decode": []}))
    result = runner.invoke(app, ["bench", "--load", str(bad)])
    assert result.exit_code == 1
    assert f"{bad}: prefill[0].tok_s is missing or not a number" in result.stderr


def test_a_missing_compare_file_fails_before_running(tmp_path, fake_engine):
    result = runner.invoke(app, ["bench", "--model", str(tmp_path), "--compare", str(tmp_path / "none.json")])
    assert result.exit_code == 1
    assert "cannot read" in result.stderr and "none.json" in result.stderr


def test_bench_runs_the_engine_sweep_and_writes_json(fake_engine, tmp_path):
    out = tmp_path / "run.json"
    result = runner.invoke(
        app, ["bench", "--model", str(tmp_path), "--lengths", "256,1K", "--json", str(out), "--repeat", "1"]
    )
    assert result.exit_code == 0, result.stderr
    run = json.loads(out.read_text())
    assert [p["len"] for p in run["prefill"]] == [256, 1024]  # the lengths reached the engine
    assert [d["ctx"] for d in run["decode"]] == [256, 1024]
    assert "1K" in result.stdout and "bench done" in result.stderr


def test_plot_draws_a_png(runs, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "sweep.png"
    result = runner.invoke(app, ["bench", "--load", str(runs[0]), "--compare", str(runs[1]), "--plot", str(png)])
    assert result.exit_code == 0, result.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
