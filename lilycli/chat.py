"""`lily chat`: stream a chat completion from the engine's OpenAI-compatible API.

The answer goes to stdout; the model's reasoning (`reasoning_content` deltas) goes to stderr,
dimmed on a terminal. So `lily chat "..." > answer.txt` keeps only the answer while a person at a
terminal sees both, and `--hide-reasoning` drops the reasoning altogether.
"""

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

import httpx

from lilycli.errors import LilyError

DIM, RESET = "\x1b[2m", "\x1b[0m"


@dataclass
class ChatOptions:
    system: str | None = None
    think: bool = True
    max_tokens: int | None = None
    temperature: float | None = None
    hide_reasoning: bool = False
    api_key: str | None = None


@dataclass
class Reply:
    content: str = ""
    reasoning: str = ""
    finish_reason: str | None = None
    usage: dict = field(default_factory=dict)


class Client:
    """A minimal streaming client for /v1/chat/completions (httpx; the tests use the `openai` package)."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0):
        self.url = url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout, connect=5.0))
        self._model: str | None = None

    def close(self) -> None:
        self.http.close()

    def model(self) -> str:
        """The id the server lists first under /v1/models (one process serves one model)."""
        if self._model is None:
            self._model = "lily"
            try:
                response = self.http.get(f"{self.url}/v1/models")
                if response.status_code == 200:
                    data = response.json().get("data") or []
                    if data and isinstance(data[0], dict) and data[0].get("id"):
                        self._model = str(data[0]["id"])
            except (httpx.HTTPError, ValueError, AttributeError):
                pass  # the request itself will report an unreachable server clearly
        return self._model

    def stream(self, messages: list[dict], options: ChatOptions) -> Iterator[tuple[str, Any]]:
        """Yield ("reasoning"|"content", text) pieces, then ("finish", reason) and ("usage", dict)."""
        body: dict = {"model": self.model(), "messages": messages, "stream": True,
                      "stream_options": {"include_usage": True}}  # fmt: skip
        if options.max_tokens is not None:
            body["max_tokens"] = options.max_tokens
        if options.temperature is not None:
            body["temperature"] = options.temperature
        if not options.think:
            body["chat_template_kwargs"] = {"enable_thinking": False}
        try:
            with self.http.stream("POST", f"{self.url}/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise LilyError(f"the server refused the request: {_error_message(response)}")
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        return
                    yield from _pieces(data)
        except httpx.ConnectError as e:
            raise LilyError(f"cannot reach a server at {self.url} ({e}); is `lily serve` running?") from e
        except httpx.TransportError as e:
            raise LilyError(f"lost the connection to {self.url}: {type(e).__name__}: {e}") from e


def _error_message(response: httpx.Response) -> str:
    try:
        error = response.json().get("error", {})
        message = error.get("message") if isinstance(error, dict) else str(error)
    except (ValueError, AttributeError):
        message = response.text[:500]
    return f"HTTP {response.status_code}: {message or response.reason_phrase}"


def _pieces(data: str) -> Iterator[tuple[str, Any]]:
    try:
        chunk = json.loads(data)
    except ValueError as e:
        raise LilyError(f"the server sent a stream chunk that is not JSON: {data[:200]!r}") from e
    if not isinstance(chunk, dict):
        raise LilyError(f"the server sent a stream chunk that is not an object: {data[:200]!r}")
    if "error" in chunk:
        error = chunk["error"]
        raise LilyError(
            f"the server stopped with an error: {error.get('message') if isinstance(error, dict) else error}"
        )
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if reasoning:
            yield "reasoning", reasoning
        if delta.get("content"):
            yield "content", delta["content"]
        if choice.get("finish_reason"):
            yield "finish", choice["finish_reason"]
    if isinstance(chunk.get("usage"), dict):
        yield "usage", chunk["usage"]


class Printer:
    """Writes a streaming reply: reasoning dimmed on stderr, answer on stdout."""

    def __init__(self, options: ChatOptions, out: TextIO | None = None, err: TextIO | None = None):
        self.options = options
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.dim = self.err.isatty()
        self.in_reasoning = False
        self.reasoning_ended_line = True

    def reasoning(self, text: str) -> None:
        if self.options.hide_reasoning:
            return
        if not self.in_reasoning and self.dim:
            self.err.write(DIM)
        self.in_reasoning = True
        self.err.write(text)
        self.reasoning_ended_line = text.endswith("\n")
        self.err.flush()

    def content(self, text: str) -> None:
        self._close_reasoning()
        self.out.write(text)
        self.out.flush()

    def _close_reasoning(self) -> None:
        if self.in_reasoning:
            if self.dim:
                self.err.write(RESET)
            if not self.reasoning_ended_line:
                self.err.write("\n")
            self.err.flush()
            self.in_reasoning = False

    def finish(self, reply: Reply) -> None:
        self._close_reasoning()
        if not reply.content.endswith("\n"):
            self.out.write("\n")
        if reply.finish_reason == "length":
            self.err.write("[stopped: max tokens reached]\n")
        self.out.flush()
        self.err.flush()


def ask(client: Client, messages: list[dict], options: ChatOptions, printer: Printer) -> Reply:
    """Send one turn, print it as it streams, and return the whole reply."""
    reply = Reply()
    for kind, value in client.stream(messages, options):
        if kind == "reasoning":
            reply.reasoning += value
            printer.reasoning(value)
        elif kind == "content":
            reply.content += value
            printer.content(value)
        elif kind == "finish":
            reply.finish_reason = value
        elif kind == "usage":
            reply.usage = value
    printer.finish(reply)
    return reply


def first_messages(options: ChatOptions) -> list[dict]:
    return [{"role": "system", "content": options.system}] if options.system else []


def one_shot(client: Client, prompt: str, options: ChatOptions) -> Reply:
    messages = first_messages(options) + [{"role": "user", "content": prompt}]
    return ask(client, messages, options, Printer(options))


def repl(client: Client, options: ChatOptions, read_line=input) -> None:
    """A conversation kept across turns. /reset starts over, /exit or Ctrl-D leaves, Ctrl-C stops a reply."""
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    messages = first_messages(options)
    print("Chatting with the model at " + client.url + " (/reset to start over, /exit or Ctrl-D to leave)",
          file=sys.stderr)  # fmt: skip
    while True:
        try:
            line = read_line(">>> ")
        except EOFError:
            print(file=sys.stderr)
            return
        except KeyboardInterrupt:
            print(file=sys.stderr)
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return
        if text == "/reset":
            messages = first_messages(options)
            print("(conversation cleared)", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        try:
            reply = ask(client, messages, options, Printer(options))
        except KeyboardInterrupt:
            print("\n[interrupted]", file=sys.stderr)
            messages.pop()  # the turn never completed: forget it
            continue
        except LilyError as e:
            print(f"error: {e.message}", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": reply.content})
