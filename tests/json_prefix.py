"""Whether a text is JSON or a prefix of JSON that some continuation completes: what a grammar-
constrained answer cut by max_tokens must be. Our own small recursive-descent reader (the standard
library parses only whole documents)."""

import json


class Cut(Exception):
    """The text ended inside a value: a valid prefix so far."""


class Invalid(ValueError):
    pass


_WS = " \t\n\r"


class _Reader:
    def __init__(self, text):
        self.s, self.i = text, 0

    def peek(self):
        while self.i < len(self.s) and self.s[self.i] in _WS:
            self.i += 1
        if self.i >= len(self.s):
            raise Cut
        return self.s[self.i]

    def expect(self, word):
        for ch in word:
            if self.i >= len(self.s):
                raise Cut
            if self.s[self.i] != ch:
                raise Invalid(f"expected {word!r} at {self.i}")
            self.i += 1

    def value(self):
        c = self.peek()
        if c == "{":
            self.i += 1
            if self.peek() == "}":
                self.i += 1
                return
            while True:
                if self.peek() != '"':
                    raise Invalid(f"expected a key at {self.i}")
                self.string()
                if self.peek() != ":":
                    raise Invalid(f"expected ':' at {self.i}")
                self.i += 1
                self.value()
                c = self.peek()
                self.i += 1
                if c == "}":
                    return
                if c != ",":
                    raise Invalid(f"expected ',' or '}}' at {self.i - 1}")
        if c == "[":
            self.i += 1
            if self.peek() == "]":
                self.i += 1
                return
            while True:
                self.value()
                c = self.peek()
                self.i += 1
                if c == "]":
                    return
                if c != ",":
                    raise Invalid(f"expected ',' or ']' at {self.i - 1}")
        if c == '"':
            return self.string()
        for word in ("true", "false", "null"):
            if c == word[0]:
                return self.expect(word)
        if c == "-" or c.isdigit():
            return self.number()
        raise Invalid(f"unexpected {c!r} at {self.i}")

    def string(self):
        self.i += 1
        while True:
            if self.i >= len(self.s):
                raise Cut
            c = self.s[self.i]
            self.i += 1
            if c == '"':
                return
            if c == "\\":
                if self.i >= len(self.s):
                    raise Cut
                e = self.s[self.i]
                self.i += 1
                if e == "u":
                    digits = self.s[self.i:self.i + 4]
                    if not all(d in "0123456789abcdefABCDEF" for d in digits):
                        raise Invalid(f"bad \\u escape at {self.i}")
                    if len(digits) < 4:
                        raise Cut
                    self.i += 4
                elif e not in '"\\/bfnrt':
                    raise Invalid(f"bad escape at {self.i - 1}")
            elif ord(c) < 0x20:
                raise Invalid(f"control character in a string at {self.i - 1}")

    def number(self):
        start = self.i
        while self.i < len(self.s) and self.s[self.i] in "+-0123456789.eE":
            self.i += 1
        text = self.s[start:self.i]
        if self.i >= len(self.s):
            # Possibly unfinished: valid if some digits complete it.
            for tail in ("", "0", "1", "e1"):
                try:
                    json.loads(text + tail)
                    raise Cut
                except ValueError:
                    pass
            raise Invalid(f"bad number {text!r}")
        try:
            json.loads(text)
        except ValueError:
            raise Invalid(f"bad number {text!r} at {start}") from None


def check(text, *, complete):
    """Raises `Invalid` unless `text` is one JSON value (complete=True) or a prefix of one."""
    r = _Reader(text)
    try:
        r.value()
    except Cut:
        if complete:
            raise Invalid("the JSON ends early")
        return
    rest = r.s[r.i:].strip(_WS)
    if rest:
        raise Invalid(f"text after the JSON value: {rest[:20]!r}")
