"""Peer reference for prompt token counts: the chat template rendered by Jinja2 the way HF
transformers configures it, tokenized by HF `tokenizers` — independent of the engine's code."""

import json
from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from conftest import TOKENIZER_DIR


@lru_cache(maxsize=1)
def _tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))


@lru_cache(maxsize=1)
def _template():
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, **_: json.dumps(x, ensure_ascii=False)
    env.globals["raise_exception"] = raise_exception
    return env.from_string((TOKENIZER_DIR / "chat_template.jinja").read_text())


def render(messages, add_generation_prompt=True, **kwargs) -> str:
    return _template().render(messages=messages, add_generation_prompt=add_generation_prompt, **kwargs)


def count_tokens(text: str) -> int:
    return len(_tokenizer().encode(text, add_special_tokens=False).ids)


def encode(text: str) -> list[int]:
    return _tokenizer().encode(text, add_special_tokens=False).ids
