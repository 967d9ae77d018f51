"""The `lily` commands driving the real `lily-engine` on a synthetic model with the real tokenizer.

The model is random-weight (`synthetic:small`, the real vocabulary; `tiny` has only 1,024 ids and
suits only bench), so its text is noise: these tests check the plumbing
(synth, launch, /health, streaming through the official `openai` client, shutdown, failures), not words.
"""

import json
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
from lily_harness import LilyProcess, free_port, process_alive
from openai import OpenAI
from typer.testing import CliRunner

from lilycli.bench import table as bench_table
from lilycli.cli import app

runner = CliRunner()


def _has_subcommand(binary: Path, name: str) -> bool:
    out = subprocess.run([str(binary), "--help"], check=False, capture_output=True, text=True)
    return any(line.split()[:1] == [name] for line in out.stdout.splitlines())


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("lily-cache")


@pytest.fixture(autouse=True)
def shared_cache(private_cache, model_cache, monkeypatch):
    """One cache for this module: synthetic:small (~90 MB, a few seconds) is generated once."""
    monkeypatch.setenv("LILY_CACHE_DIR", str(model_cache))


@pytest.fixture
def serving_engine(real_engine):
    if not _has_subcommand(real_engine, "serve"):
        pytest.skip(f"{real_engine} has no `serve` subcommand yet")
    return real_engine


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def test_bench_runs_the_real_sweep_on_a_synthetic_model(real_engine, tmp_path):
    out = tmp_path / "run.json"
    args = ["bench", "--model", "synthetic:tiny", "--lengths", "16,32", "--repeat", "1", "--decode-tokens", "4"]
    result = runner.invoke(app, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.stderr
    run = json.loads(out.read_text())
    assert [p["len"] for p in run["prefill"]] == [16, 32]
    assert [d["ctx"] for d in run["decode"]] == [16, 32]
    assert all(p["tok_s"] > 0 for p in run["prefill"] + run["decode"])
    assert run["engine"] == "lily"


def test_bench_measures_sequences_decoding_together(real_engine, tmp_path):
    """`lily-engine bench --batch`: N sequences step together through the batched decode step
    (the CPU backend batches too); each row counts N tokens a step."""
    model = tmp_path / "tiny"
    subprocess.run([str(real_engine), "synth", "--preset", "tiny", "--format", "mlx", "--seed", "5",
                    "--out", str(model)], check=True, capture_output=True)
    out = tmp_path / "batch.json"
    args = [str(real_engine), "bench", "--model", str(model), "--device", "cpu", "--prefill", "16",
            "--decode-ctx", "8,20", "--decode-tokens", "3", "--repeat", "1"]
    run = subprocess.run([*args, "--batch", "1,2,3", "--json", str(out)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())["decode_batch"]
    assert [(r["batch"], r["ctx"]) for r in rows] == [(2, 8), (2, 20), (3, 8), (3, 20)]
    assert all(r["tok_s"] > 0 and r["ms_per_step"] > 0 for r in rows)
    # The table's rows: batch, context, tok/s, ms a step, the ratio to one sequence.
    assert any(line.split()[:2] == ["3", "20"] for line in run.stdout.splitlines())
    # `lily bench` passes --batch on and prints the rows under its table.
    printed = bench_table(json.loads(out.read_text()))
    assert [line.split()[:2] for line in printed.splitlines()[-4:]] == [["2", "8"], ["2", "20"], ["3", "8"], ["3", "20"]]
    bad = subprocess.run([*args, "--batch", "0"], capture_output=True, text=True)
    assert bad.returncode != 0 and "--batch" in bad.stderr
    # With a served request's presence penalty (the device sampler's path on a GPU) the rows step
    # as well; a penalty outside the API's range is refused by name, before the model loads.
    penalised = subprocess.run([*args, "--batch", "2", "--presence-penalty", "1.5"], capture_output=True, text=True)
    assert penalised.returncode == 0, penalised.stderr
    assert any(line.split()[:2] == ["2", "20"] for line in penalised.stdout.splitlines())
    bad = subprocess.run([*args, "--presence-penalty", "5"], capture_output=True, text=True)
    assert bad.returncode != 0 and "--presence-penalty must be between -2 and 2" in bad.stderr, bad.stderr


def test_serve_streams_to_the_openai_client_and_stops_on_ctrl_c(serving_engine):
    lily = LilyProcess("serve", "--model", "synthetic:small", "--port", str(free_port()))
    try:
        url = lily.wait_for_url(timeout=120)
        [engine_pid] = children(lily.process.pid)
        # The chat page the printed line points at is there.
        page = httpx.get(f"{url}/")
        assert page.status_code == 200 and "<title>Lily</title>" in page.text
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Say something."}],
            max_tokens=6,
            stream=True,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        lily.process.send_signal(signal.SIGINT)
        assert lily.wait(timeout=60) == 0
        assert not process_alive(engine_pid)
    finally:
        lily.kill()


def test_chat_starts_the_real_engine_for_one_prompt(serving_engine):
    result = runner.invoke(app, ["chat", "Hello!", "--model", "synthetic:small", "--no-think", "--max-tokens", "6"])
    assert result.exit_code == 0, result.stderr
    assert len(result.stdout) > 1  # some text, then the closing newline


def test_chat_shows_the_real_engine_reasoning_on_stderr(serving_engine):
    # Thinking on: a random model never closes </think>, so everything it says is reasoning.
    result = runner.invoke(app, ["chat", "Hello!", "--model", "synthetic:small", "--max-tokens", "6"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "\n"
    assert "[stopped: max tokens reached]" in result.stderr


def test_serve_reports_the_real_engine_refusing_a_broken_model(serving_engine, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "qwen3_5_moe", "text_config": {"hidden_size": "wide"}}')
    result = runner.invoke(app, ["serve", "--model", str(broken), "--port", str(free_port())])
    assert result.exit_code == 1
    assert "lily-engine exited while loading (exit code 1)" in result.stderr
    assert "config.json" in result.stderr  # the engine's own message names the file
