#!/usr/bin/env python3
"""Renders the chat-template golden fixtures with HF transformers (the peer), not with Lily.

Writes crates/lily-core/tests/fixtures/chat/goldens.json: for each case the request as the server
receives it (OpenAI wire format: tool-call arguments are JSON *strings*), the template kwargs, and
what `tokenizer.apply_chat_template(..., tokenize=False)` renders from it with Jinja2, plus the
token ids of that text (`tokenizer.encode(text, add_special_tokens=False)`). Error cases record the
exception message the template raises.

The one step done here before calling transformers is the one the OpenAI API needs and transformers
does not do: `tool_calls[*].function.arguments` given as a JSON string is parsed with json.loads
(the template iterates it with `|items`). Lily's chat.rs must do the same.

Usage (CI does not run this; the output is committed):
    python3 -m venv .venv && .venv/bin/pip install transformers tokenizers jinja2
    .venv/bin/python scripts/render_chat_goldens.py [--tokenizer-dir DIR]
The tokenizer and template default to the repository's bundled copy (lilycli/tokenizer/, unpacked
by lilycli.bundled_tokenizer), the one the Rust tests read.
"""

import argparse
import copy
import hashlib
import json
import os
import sys

CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression & return the result (use for <math>, not 'guessing').",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "e.g. \"2 * (3 + 4)\""},
                "precision": {"type": "integer", "minimum": 0, "maximum": 12, "default": 6},
            },
            "required": ["expression"],
        },
    },
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city. Température in °C; 天气.",
        "parameters": {
            "type": "object",
            "required": ["city"],
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer"},
                "threshold": {"type": "number", "minimum": 0.5, "maximum": 1e16, "default": 1e-05},
                "detailed": {"type": "boolean"},
            },
        },
    },
}

WRITE_FILE = {
    "type": "function",
    "function": {
        "name": "write_file",
        "description": "Write text to a file.",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "content": {"type": "string"},
                "mode": {"type": ["string", "null"]},
                "tags": {"type": "array", "items": {"type": "string"}},
                "options": {
                    "type": "object",
                    "properties": {"overwrite": {"type": "boolean"}, "ratio": {"type": "number"}},
                },
            },
            "required": ["path", "content"],
        },
    },
}


def call(name, args, as_string=True, call_id=None, wrapped=True):
    """An assistant tool call, OpenAI-style (arguments as a JSON string) unless as_string=False."""
    arguments = json.dumps(args, ensure_ascii=False) if as_string else args
    fn = {"name": name, "arguments": arguments}
    if not wrapped:
        return fn
    return {"id": call_id or f"call_{name}", "type": "function", "function": fn}


def user(text):
    return {"role": "user", "content": text}


def system(text):
    return {"role": "system", "content": text}


def assistant(text, **extra):
    return {"role": "assistant", "content": text, **extra}


def tool(text, call_id="call_x"):
    return {"role": "tool", "tool_call_id": call_id, "content": text}


CASES = [
    ("single_user", [user("What is the capital of France?")], None, {}, True),
    ("system_and_user", [system("You are a terse assistant."), user("Say hi.")], None, {}, True),
    ("thinking_off", [system("You are a terse assistant."), user("Say hi.")], None, {"enable_thinking": False}, True),
    ("thinking_on_explicit", [user("Count to three.")], None, {"enable_thinking": True}, True),
    ("no_generation_prompt_ending_with_assistant",
     [user("Hello"), assistant("Hi! How can I help?")], None, {}, False),
    ("multi_turn",
     [system("Be kind."), user("Hi"), assistant("Hello!"), user("How are you?"), assistant("Fine, thanks."),
      user("Tell me a joke.")], None, {}, True),
    ("reasoning_before_last_user_dropped",
     [user("2+2?"), assistant("4", reasoning_content="Add two and two.\n"), user("And 3+3?")], None, {}, True),
    ("reasoning_before_last_user_preserved",
     [user("2+2?"), assistant("4", reasoning_content="Add two and two.\n"), user("And 3+3?")], None,
     {"preserve_thinking": True}, True),
    ("inline_think_in_content_split",
     [user("2+2?"), assistant("<think>\nAdd them.\n</think>\n\n4"), user("Thanks")], None, {}, True),
    ("inline_think_preserved",
     [user("2+2?"), assistant("<think>\nAdd them.\n</think>\n\n4"), user("Thanks")], None,
     {"preserve_thinking": True}, True),
    ("reasoning_after_last_user_kept",
     [user("Weather in Paris?"),
      assistant("", reasoning_content="I should call the tool.", tool_calls=[call("get_weather", {"city": "Paris"})]),
      tool('{"temp": 21, "sky": "clear"}', "call_get_weather")], [WEATHER], {}, True),
    ("empty_reasoning_after_last_user",
     [user("Hi"), assistant("Hello there.")], None, {}, False),
    ("reasoning_alias_field",
     [user("Q1"), assistant("A1", reasoning="thought one"), user("Q2"), assistant("A2", reasoning="thought two")],
     None, {"preserve_thinking": True}, False),
    ("thinking_off_with_history_reasoning",
     [user("Q1"), assistant("A1", reasoning_content="r1"), user("Q2")], None, {"enable_thinking": False}, True),
    ("preserve_and_thinking_off",
     [user("Q1"), assistant("A1", reasoning_content="r1"), user("Q2")], None,
     {"enable_thinking": False, "preserve_thinking": True}, True),
    ("tools_no_system", [user("What's 17*23?")], [CALC], {}, True),
    ("tools_with_system", [system("Use tools when helpful."), user("Weather in Oslo?")], [CALC, WEATHER], {}, True),
    ("tools_with_empty_system", [system("   "), user("Weather in Oslo?")], [WEATHER], {}, True),
    ("tool_call_string_args",
     [user("Compute 2*(3+4)"),
      assistant(None, tool_calls=[call("calculator", {"expression": "2*(3+4)"})]),
      tool("14", "call_calculator"),
      assistant("It is 14."), user("Thanks!")], [CALC], {}, True),
    ("tool_call_non_string_args",
     [user("Weather for 3 days in Zürich, detailed, threshold 0.5"),
      assistant("Let me check.", tool_calls=[call("get_weather", {
          "city": "Zürich", "days": 3, "detailed": True, "threshold": 0.5, "unit": None})]),
      tool('{"forecast": ["sun", "rain", "snow"]}', "call_get_weather")], [WEATHER], {}, True),
    ("tool_call_nested_args_multiline_string",
     [user("Save the script"),
      assistant("", tool_calls=[call("write_file", {
          "path": "/tmp/a.py",
          "content": "def f(x):\n    return x * 2  # <double>\n\nprint(f(21))\n",
          "tags": ["py", "demo", "ünïcode"],
          "options": {"overwrite": False, "ratio": 1e-07, "big": 1e16, "one": 1.0},
          "mode": None})]),
      tool("ok", "call_write_file"), user("Now read it back")], [WRITE_FILE], {}, True),
    ("several_tool_calls_and_results",
     [user("Weather in Paris and Rome, and 3*7"),
      assistant("I'll call three tools.", reasoning_content="Three independent lookups.", tool_calls=[
          call("get_weather", {"city": "Paris"}, call_id="c1"),
          call("get_weather", {"city": "Rome", "unit": "celsius"}, call_id="c2"),
          call("calculator", {"expression": "3*7", "precision": 0}, call_id="c3")]),
      tool("Paris: 18C", "c1"), tool("Rome: 25C", "c2"), tool("21", "c3")], [WEATHER, CALC], {}, True),
    ("tool_results_then_answer_then_user",
     [user("Weather in Paris and Rome?"),
      assistant(None, tool_calls=[call("get_weather", {"city": "Paris"}, call_id="c1"),
                                  call("get_weather", {"city": "Rome"}, call_id="c2")]),
      tool("Paris: 18C", "c1"), tool("Rome: 25C", "c2"),
      assistant("Paris 18C, Rome 25C."), user("Which is warmer?")], [WEATHER], {}, True),
    ("agent_loop_two_rounds_reasoning",
     [system("You are an agent."), user("Find the weather in Tokyo then compute F."),
      assistant("", reasoning_content="First the weather.", tool_calls=[call("get_weather", {"city": "Tokyo"})]),
      tool("22 C", "call_get_weather"),
      assistant("", reasoning_content="Now convert 22C.", tool_calls=[call("calculator", {"expression": "22*9/5+32"})]),
      tool("71.6", "call_calculator")], [WEATHER, CALC], {}, True),
    ("agent_loop_preserve_thinking",
     [user("Find the weather in Tokyo."),
      assistant("", reasoning_content="Call the tool.", tool_calls=[call("get_weather", {"city": "Tokyo"})]),
      tool("22 C", "call_get_weather"), assistant("22 °C in Tokyo.", reasoning_content="Report it."),
      user("And Kyoto?")], [WEATHER], {"preserve_thinking": True}, True),
    ("tool_call_dict_arguments_unwrapped",
     [user("Compute 1+1"),
      assistant("", tool_calls=[call("calculator", {"expression": "1+1", "precision": 2}, as_string=False,
                                     wrapped=False)]),
      tool("2")], [CALC], {}, True),
    ("user_tool_response_literal_is_not_a_query",
     [user("Start"), assistant("ok", reasoning_content="r-before"),
      user("<tool_response>\nfake\n</tool_response>")], None, {}, True),
    ("unicode_everywhere",
     [system("Réponds en français. 日本語もOK。"),
      user("Emoji test 👩‍👩‍👧‍👦 🇫🇷 — CJK 人工智能 — Arabic مرحبا — combining e\u0301 — tab\tend"),
      assistant("Voilà ✅ 你好", reasoning_content="思考中… 🤔"),
      user("Ещё раз, пожалуйста")], None, {"preserve_thinking": True}, True),
    ("whitespace_trimming_python_semantics",
     [system("\n\n  padded system \u3000"), user("\x1f\x1c  hello \u2003\n"), assistant("\t answer \n")],
     None, {}, False),
    ("content_as_text_parts",
     [system([{"type": "text", "text": "Part A. "}, {"type": "text", "text": "Part B."}]),
      user([{"type": "text", "text": "Hello "}, {"type": "text", "text": "world"}])], None, {}, True),
    ("tool_schema_floats_and_html",
     [user("<b>bold</b> & 'quotes' \"double\"")], [WEATHER, WRITE_FILE], {}, True),
    ("empty_tools_list", [system("No tools today."), user("Hi")], [], {}, True),
    ("agent_loop_thinking_off",
     [user("Weather in Lima?"),
      assistant("", tool_calls=[call("get_weather", {"city": "Lima", "days": 1})]),
      tool("19 C, cloudy", "call_get_weather")], [WEATHER], {"enable_thinking": False}, True),
    ("string_argument_that_looks_like_json",
     [user("Evaluate the list literal"),
      assistant("", tool_calls=[call("calculator", {"expression": "[1, 2] + {\"a\": true}", "precision": 3})]),
      tool("error: unsupported", "call_calculator"), user("ok, never mind")], [CALC], {}, True),
    ("error_no_user_query", [system("Only a system prompt.")], None, {}, True),
    ("error_system_not_first", [user("Hi"), system("Late system.")], None, {}, True),
    ("error_unknown_role", [user("Hi"), {"role": "developer", "content": "x"}], None, {}, True),
    ("error_no_messages", [], None, {}, True),
]


def parse_arguments(messages):
    """OpenAI sends tool-call arguments as JSON strings; the template needs a mapping."""
    out = copy.deepcopy(messages)
    for m in out:
        for tc in m.get("tool_calls") or []:
            fn = tc.get("function", tc)
            if isinstance(fn.get("arguments"), str):
                fn["arguments"] = json.loads(fn["arguments"])
    return out


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(here)
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer-dir", help="default: the bundled copy, lilycli/tokenizer/")
    ap.add_argument("--out", default=os.path.join(repo, "crates/lily-core/tests/fixtures/chat/goldens.json"))
    args = ap.parse_args()
    template_name = os.path.join(args.tokenizer_dir, "chat_template.jinja") if args.tokenizer_dir else None
    if not args.tokenizer_dir:
        sys.path.insert(0, repo)
        from lilycli.bundled_tokenizer import tokenizer_dir

        args.tokenizer_dir = str(tokenizer_dir())
        template_name = "lilycli/tokenizer/chat_template.jinja"

    import jinja2
    import tokenizers
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    template_path = os.path.join(args.tokenizer_dir, "chat_template.jinja")
    with open(template_path, "rb") as f:
        template_sha = hashlib.sha256(f.read()).hexdigest()

    cases = []
    names = set()
    for name, messages, tools, kwargs, add_gen in CASES:
        assert name not in names, name
        names.add(name)
        case = {"name": name, "messages": messages, "tools": tools, "kwargs": kwargs,
                "add_generation_prompt": add_gen}
        try:
            text = tok.apply_chat_template(parse_arguments(messages), tools=tools, tokenize=False,
                                           add_generation_prompt=add_gen, **kwargs)
            case["expected"] = text
            case["expected_ids"] = tok.encode(text, add_special_tokens=False)
        except jinja2.exceptions.TemplateError as e:
            case["error"] = str(e)
            case["error_from"] = "template"
        except ValueError as e:
            # transformers refuses some inputs before the template runs (an empty conversation).
            case["error"] = str(e)
            case["error_from"] = "transformers"
        cases.append(case)

    doc = {
        "generator": "scripts/render_chat_goldens.py: transformers AutoTokenizer.apply_chat_template(tokenize=False)",
        "command": ".venv/bin/python scripts/render_chat_goldens.py",
        "versions": {"python": sys.version.split()[0], "transformers": transformers.__version__,
                     "jinja2": jinja2.__version__, "tokenizers": tokenizers.__version__},
        "template": template_name,
        "template_sha256": template_sha,
        "cases": cases,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {len(cases)} cases to {args.out}")


if __name__ == "__main__":
    main()
