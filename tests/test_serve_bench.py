"""scripts/serve_bench.py's time-to-first-token mode against the scripted backend: a 131,072-token
prompt is accepted by a server started with its default context, and each request's client time
comes with the engine's timing line (issue 12: the served time to first token beside the bench)."""

import json
import os
import re
import subprocess
import sys

from conftest import REPO, engine_binary


def run_bench(tmp_path, text_dir, *args, script=None):
    # The scripted model reads the vocabulary and the context length from `text_dir`'s config.json.
    model = tmp_path / "script.json"
    model.write_text(json.dumps({"tokenizer": str(text_dir), "cheap": True, "default": "one two three",
                                 **(script or {})}))
    env = {**os.environ, "LILY_ENGINE_BIN": str(engine_binary())}
    env.pop("LILY_TEST_LOGS", None)
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "serve_bench.py"), "--model", f"scripted:{model}",
                           *args], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_a_128k_prompt_is_timed_with_the_default_context_and_the_servers_phases(tmp_path, small_model):
    # The scripted backend answers 262,144 as its default context, as the CUDA backend does on a
    # GPU that holds the model's whole KV cache; `--ctx-size 0` passes no --ctx-size to serve.
    out = run_bench(tmp_path, small_model, "--ctx-size", "0", "--ttft-tokens", "4096,131072", "--ttft-only",
                    "--ttft-repeat", "2", script={"default_context": 262144})
    assert "ready (context 262144 tokens)" in out, out
    runs = [l for l in out.splitlines() if l.startswith("ttft run ")]
    assert len(runs) == 4, out
    # 512-token prefill calls (the scripted backend's chunk), a snapshot every 8,192 tokens
    # (serve's default), a new sequence and nothing cached (the prompts share no prefix, also not
    # the 128K ones with the 4K ones).
    for line, calls, snapshots in zip(runs, [8, 8, 256, 256], [1, 1, 16, 16]):
        assert f"in {calls} call(s)" in line, line
        assert re.search(rf"snapshots [\d.]+ \({snapshots}\)", line), line
        assert "(new)" in line and "cached" not in line, line
        client = float(re.search(r"client ([\d.]+) ms", line).group(1))
        server = float(re.search(r"arrival to first token ([\d.]+)", line).group(1))
        assert 0 < server <= client, line
    summary = [l for l in out.splitlines() if l.startswith("ttft: ")]
    assert [l.split(",")[0] for l in summary] == ["ttft: 4096 prompt tokens", "ttft: 131072 prompt tokens"], out
    assert all(" median of 2: " in l for l in summary), out


def test_the_decode_run_still_reports_and_the_default_ctx_size_is_16384(tmp_path, small_model):
    out = run_bench(tmp_path, small_model, "--prompt-tokens", "600", "--max-tokens", "3", "--repeat", "2", "--ttft-repeat", "1")
    assert "ready (context 16384 tokens)" in out, out
    assert re.search(r"^completions: client [\d.]+ tok/s", out, re.M), out
    (run,) = [l for l in out.splitlines() if l.startswith("ttft run ")]
    assert "in 2 call(s)" in run and re.search(r"snapshots [\d.]+ \(1\)", run), run
