#!/usr/bin/env python3
"""Token-id fixtures from the Python `tokenizers` package (the peer), not from Lily.

Writes crates/lily-core/tests/fixtures/tokenizer/goldens.json: for each text, the ids of
`Tokenizer.encode(text, add_special_tokens=False)` and the texts of `decode(ids)` with and without
`skip_special_tokens`. Lily's tokenizer test compares encode, decode and its streaming detokeniser
against these.

Usage (CI does not run this; the output is committed):
    .venv/bin/python scripts/render_tokenizer_goldens.py [--tokenizer-dir DIR]
The tokenizer defaults to the repository's bundled copy (lilycli/tokenizer/), the one the Rust tests read.
"""

import argparse
import os
import sys

TEXTS = [
    ("ascii", "Hello, world! The quick brown fox jumps over the lazy dog."),
    ("contractions_case", "I'M sure you'll see THEY'RE right, isn't it? We'd've known."),
    ("digits_split", "Pi is 3.14159265, year 2026, id 007, 1,000,000."),
    ("whitespace_runs", "a  b   c\t\td\n\n\ne   \n  f    "),
    ("crlf", "line one\r\nline two\r\n\r\nend"),
    ("code_python", "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n"),
    ("code_rust", "fn main() {\n\tlet v: Vec<u32> = (0..10).map(|x| x * x).collect();\n\tprintln!(\"{v:?}\");\n}"),
    ("json", '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "ok": true}}'),
    ("cjk_chinese", "人工智能正在改变世界。新加坡和毛泽东、俱乐部。"),
    ("cjk_japanese", "こんにちは、世界！カタカナとひらがなと漢字。"),
    ("korean", "안녕하세요, 세계! 한국어 텍스트입니다."),
    ("thai", "สวัสดีครับ ภาษาไทยไม่มีช่องว่าง"),
    ("arabic_rtl", "مرحبا بالعالم، هذا نص عربي."),
    ("hindi_marks", "नमस्ते दुनिया, यह हिन्दी है।"),
    ("cyrillic", "Съешь же ещё этих мягких французских булок, да выпей чаю."),
    ("emoji", "Emoji: 😀😃😄 👍🏽 ❤️ 🇫🇷🇯🇵 👩‍👩‍👧‍👦 🧑🏿‍🚀"),
    ("combining_nfc", "e\u0301 vs \u00e9, A\u030a vs \u00c5, n\u0303"),
    ("rare_symbols", "∑∫√∞ ≠ ≤ ≥ ⊂ ⊃ ∀∃ ℝ ℕ — “quotes” ‘single’ … ©®™ ¥€£ \u00a0nbsp"),
    ("special_tokens_chat", "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"),
    ("tool_tokens", "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>"),
    ("think_tokens", "<think>\nreasoning\n</think>\n\nanswer<|endoftext|>"),
    ("special_like_text", "<|im_start <|not_a_token|> < think > </ think>"),
    ("vision_tokens", "<|vision_start|><|image_pad|><|vision_end|>describe"),
    ("single_space", " "),
    ("empty", ""),
    ("long_word", "Pneumonoultramicroscopicsilicovolcanoconiosis antidisestablishmentarianism"),
    ("mixed_scripts", "Lily 模型 🌸 uses Rust🦀 + CUDA; ü ß ø æ ñ ç"),
    ("control_chars", "bell\x07 tab\t null-ish\x01 esc\x1b[0m"),
]


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(here)
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer-dir", help="default: the bundled copy, lilycli/tokenizer/")
    ap.add_argument("--out", default=os.path.join(repo, "crates/lily-core/tests/fixtures/tokenizer/goldens.json"))
    args = ap.parse_args()
    if not args.tokenizer_dir:
        sys.path.insert(0, repo)
        from lilycli.bundled_tokenizer import tokenizer_dir

        args.tokenizer_dir = str(tokenizer_dir())

    import json

    import tokenizers

    tok = tokenizers.Tokenizer.from_file(os.path.join(args.tokenizer_dir, "tokenizer.json"))
    cases = []
    for name, text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False).ids
        cases.append({
            "name": name,
            "text": text,
            "ids": ids,
            "decoded": tok.decode(ids, skip_special_tokens=False),
            "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
        })
    doc = {
        "generator": "scripts/render_tokenizer_goldens.py: tokenizers.Tokenizer.from_file(tokenizer.json)",
        "command": ".venv/bin/python scripts/render_tokenizer_goldens.py",
        "versions": {"python": sys.version.split()[0], "tokenizers": tokenizers.__version__},
        "vocab_size_with_added": tok.get_vocab_size(with_added_tokens=True),
        "cases": cases,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {len(cases)} cases to {args.out}")


if __name__ == "__main__":
    main()
