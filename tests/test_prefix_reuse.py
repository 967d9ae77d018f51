"""Prefix reuse over HTTP (issue 14): agent traces with tool round trips, driven through the chat
template, the tokenizer and the engine's snapshots by the scripted backend (which writes the
reasoning and tool calls a random-weight model never does), and the real CPU backend.

`measure_template_effects` is also how docs/prefix-reuse.md's table was made:
    LILY_TEST_PRINT=1 python3 -m pytest tests/test_prefix_reuse.py -q -s -k template
"""

import json
import os

import pytest

from conftest import Server
from reference import count_tokens, render

READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
RUN_TESTS = {"type": "function", "function": {
    "name": "run_tests", "description": "Run the test suite",
    "parameters": {"type": "object", "properties": {"filter": {"type": "string"}}}}}
TOOLS = [READ_FILE, RUN_TESTS]

#: An agent session: each entry is the step's trigger; a request whose last message carries it gets
#: that reply. "call" steps answer with a tool call, "final" ones with text; "user" starts a new
#: user turn (the previous tool loop is then history, and the template rewrites it).
STEPS = [("user", "call"), ("tool", "call"), ("tool", "call"), ("tool", "final"),
         ("user", "call"), ("tool", "call"), ("tool", "final"),
         ("user", "call"), ("tool", "call"), ("tool", "call"), ("tool", "call"), ("tool", "final")]


def reply(step: int, kind: str, thinking: bool) -> str:
    reasoning = (f"Step {step}: the test output points at the parser; I should look at the next file "
                 f"before changing anything.\n</think>\n\n") if thinking else ""
    if kind == "final":
        return reasoning + f"Done with part {step}: the parser now accepts empty arrays."
    return (reasoning + f"Reading the next file.\n\n<tool_call>\n<function=read_file>\n<parameter=path>\n"
            f"src/parse/step{step}.rs\n</parameter>\n</function>\n</tool_call>")


def script_file(tmp_path_factory, text_dir) -> str:
    replies = []
    for thinking in (True, False):
        for i, (_, kind) in enumerate(STEPS):
            replies.append({"when": trigger(i, thinking), "text": reply(i, kind, thinking)})
    path = tmp_path_factory.mktemp("agent") / "script.json"
    path.write_text(json.dumps({"tokenizer": str(text_dir), "replies": replies, "default": "?"}))
    return f"scripted:{path}"


def trigger(step: int, thinking: bool) -> str:
    return f"[{'think' if thinking else 'plain'}-step-{step:02d}]"


def file_text(step: int, lines: int = 12) -> str:
    lines = [f"fn parse_item_{step}_{i}(input: &str) -> Result<Item, Error> {{ todo!(\"{i}\") }}" for i in range(lines)]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory, small_model):
    server = Server(script_file(tmp_path_factory, small_model), "--ctx-size", "16384",
                    "--snapshot-every", "0").wait_ready()
    yield server
    server.stop()


def run_trace(server, session: str, thinking: bool, preserve: bool, return_reasoning: bool):
    """Plays STEPS as an agent client would; one row per request."""
    kwargs = {"enable_thinking": thinking, "preserve_thinking": preserve}
    messages = [{"role": "system", "content": f"You are a coding agent ({session})."}]
    rows, last = [], None
    for i, (role, _) in enumerate(STEPS):
        if role == "user":
            messages.append({"role": "user", "content": f"Part {i} of the task. {trigger(i, thinking)}"})
        else:
            call = last.tool_calls[0]
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": file_text(i) + "\n" + trigger(i, thinking)})
        r = server.client().chat.completions.create(
            model="any", messages=messages, tools=TOOLS, temperature=0, max_tokens=200,
            extra_body={"chat_template_kwargs": kwargs})
        last = r.choices[0].message
        sent = {"role": "assistant", "content": last.content}
        if last.tool_calls:
            sent["tool_calls"] = [{"id": c.id, "type": "function",
                                   "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                  for c in last.tool_calls]
        reasoning = getattr(last, "reasoning_content", None)
        if return_reasoning and reasoning:
            sent["reasoning_content"] = reasoning
        rows.append({"role": role, "prompt": r.usage.prompt_tokens,
                     "cached": r.usage.prompt_tokens_details.cached_tokens,
                     "completion": r.usage.completion_tokens})
        assert r.usage.prompt_tokens == count_tokens(render(as_template_sees(messages), tools=TOOLS, **kwargs))
        messages.append(sent)
    return rows


def as_template_sees(messages):
    """Tool-call arguments as objects, as the server hands them to the template."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


VARIANTS = [
    # (name, thinking, preserve_thinking, the client sends reasoning_content back)
    ("thinking, reasoning sent back", True, False, True),
    ("thinking, reasoning not sent back", True, False, False),
    ("thinking, preserve_thinking", True, True, True),
    ("no thinking", False, False, False),
    ("no thinking, preserve_thinking", False, True, False),
]


def measure_template_effects(server):
    table = {}
    for n, (name, thinking, preserve, back) in enumerate(VARIANTS):
        table[name] = run_trace(server, f"variant {n}", thinking, preserve, back)
    return table


def summary(rows):
    """(prompt tokens, cached, prefilled, new tokens, requests that reused less than the whole
    previous prompt and answer)."""
    prompt = sum(r["prompt"] for r in rows)
    cached = sum(r["cached"] for r in rows)
    # New tokens: what the request added to the previous prompt and answer.
    new = rows[0]["prompt"] + sum(r["prompt"] - p["prompt"] - p["completion"] for p, r in zip(rows, rows[1:]))
    short = sum(1 for p, r in zip(rows, rows[1:]) if r["cached"] < p["prompt"] + p["completion"])
    return prompt, cached, prompt - cached, new, short


def test_template_effects_on_reuse_in_agent_traces(agent_server):
    table = measure_template_effects(agent_server)
    if os.environ.get("LILY_TEST_PRINT"):
        print("\n| client | requests | prompt tokens | cached | prefilled | new tokens | requests short of the whole history |")
        print("|---|---|---|---|---|---|---|")
        for name, rows in table.items():
            prompt, cached, prefilled, new, short = summary(rows)
            print(f"| {name} | {len(rows)} | {prompt} | {cached} ({100 * cached / prompt:.0f} %) | {prefilled} | {new} | {short} |")
        for name, rows in table.items():
            print(name, [(r["role"], r["prompt"], r["cached"]) for r in rows])
    for name, (_, thinking, preserve, back) in zip(table, VARIANTS):
        rows = table[name]
        assert rows[0]["cached"] == 0, name
        for i, (p, r) in enumerate(zip(rows, rows[1:]), start=1):
            # Every answer ends with <|im_end|>, which is sampled but not fed (nor counted).
            whole = p["prompt"] + p["completion"]
            appended = r["role"] == "tool"  # the agent loop: a tool result appended to the last exchange
            if appended and (back or not thinking):
                # The template reproduces the answer token for token: resume after it.
                assert r["cached"] == whole, (name, i, r, p)
            elif appended:
                # The answer's reasoning is gone from the history: resume at the end of the last
                # conversation, before its generation prompt.
                assert p["prompt"] - 8 < r["cached"] < p["prompt"], (name, i, r, p)
            elif preserve and (back or not thinking):
                assert r["cached"] == whole, (name, i, r, p)
            else:
                # A new user turn: past reasoning (or the empty think block) is dropped from every
                # answer of the finished tool loop, so the request resumes where that loop began.
                assert 0 < r["cached"] < p["prompt"], (name, i, r, p)
                loop_start = max(j for j in range(i) if rows[j]["role"] == "user")
                assert r["cached"] >= rows[loop_start]["prompt"] - 8, (name, i, r, rows[loop_start])
    m = agent_server.metrics()
    assert m["lily_prefix_cache_hits_total"] == sum(len(rows) - 1 for rows in table.values())
    assert m["lily_prefix_cache_misses_total"] == len(table)
    assert m["lily_prefix_cache_bytes"] > 0 and m["lily_prefix_cache_snapshots"] > 0
    assert m["lily_prefix_cache_evictions_total"] == 0


def test_a_tool_round_trip_on_the_cpu_model_prefills_only_new_tokens_and_matches_no_reuse(small_model):
    """Six requests of one conversation on the real CPU backend, with and without reuse: the same
    greedy answers, and with reuse each request prefills only what it added."""
    on = Server(str(small_model), "--ctx-size", "2048", "--device", "cpu").wait_ready()
    off = Server(str(small_model), "--ctx-size", "2048", "--device", "cpu", "--prefix-cache-mib", "0").wait_ready()
    try:
        kw = {"enable_thinking": False}
        messages = [{"role": "system", "content": "You are a coding agent."},
                    {"role": "user", "content": "What is in src/main.rs?"}]
        previous = None
        for turn in range(6):
            answers = [s.client().chat.completions.create(
                model="small", messages=messages, tools=TOOLS, temperature=0, max_tokens=4,
                extra_body={"chat_template_kwargs": kw}) for s in (on, off)]
            assert answers[0].choices[0].message.content == answers[1].choices[0].message.content, turn
            u = answers[0].usage
            assert answers[1].usage.prompt_tokens_details.cached_tokens == 0
            if previous is None:
                assert u.prompt_tokens_details.cached_tokens == 0
            else:
                # The whole previous exchange was reused (its prompt and answer up to the last
                # token, which is never fed); only the appended turn is prefilled.
                assert u.prompt_tokens_details.cached_tokens >= previous.prompt_tokens, turn
            content = answers[0].choices[0].message.content
            # The client plays the tool round trip: the answer becomes a call, its result comes back.
            call_id = f"call_{turn}"
            messages.append({"role": "assistant", "content": content, "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/{turn}.rs"})}}]})
            messages.append({"role": "tool", "tool_call_id": call_id, "content": file_text(turn, 2)})
            previous = u
        m = on.metrics()
        assert m["lily_prefix_cache_hits_total"] == 5 and m["lily_prefix_cache_misses_total"] == 1
        assert m["lily_prefix_cache_budget_bytes"] == 8192 * 2**20
        assert off.metrics()["lily_prefix_cache_budget_bytes"] == 0
    finally:
        on.stop()
        off.stop()


def test_the_agent_trace_script_runs_against_a_server(agent_server, tmp_path):
    """scripts/agent_trace.py (the H200 measurement's driver) on a short trace."""
    import subprocess
    import sys

    from conftest import REPO

    out = tmp_path / "trace.json"
    subprocess.run([sys.executable, str(REPO / "scripts" / "agent_trace.py"), "--url", agent_server.url,
                    "--context", "1500", "--turns", "3", "--answer-tokens", "8", "--json", str(out)],
                   check=True, capture_output=True, timeout=300)
    rows = json.loads(out.read_text())["runs"]["on"]
    assert [r["turn"] for r in rows] == [1, 2, 3]
    assert rows[0]["cached"] == 0
    for p, r in zip(rows, rows[1:]):
        assert r["cached"] >= p["prompt"] and r["prefilled"] == r["prompt"] - r["cached"]
    assert 1200 < rows[-1]["prompt"] < 1800
