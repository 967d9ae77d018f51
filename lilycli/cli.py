"""The `lily` command: fetch, serve, chat, bench, selftest. Each command is a few lines calling one module."""

import functools
import sys
from pathlib import Path
from typing import Annotated

import httpx
import typer

from lilycli import __version__
from lilycli.checkpoint import DEFAULT_REPO
from lilycli.errors import LilyError

app = typer.Typer(
    help="Lily: a local inference engine for Qwen3.6-35B-A3B. "
    "Try it offline with `lily serve --model synthetic:small`.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

DEFAULT_URL = "http://127.0.0.1:8000"
ENGINE_PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


def log(message: str) -> None:
    typer.echo(message, err=True)


def reports_errors(command):
    """Turn a LilyError into `error: ...` (+ detail lines) on stderr and its exit code, never a traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except LilyError as e:
            typer.secho(f"error: {e.message}", fg=typer.colors.RED, err=True)
            for line in e.details:
                typer.echo(f"  | {line}", err=True)
            raise typer.Exit(e.exit_code) from None

    return wrapper


def _version(value: bool) -> None:
    if value:
        typer.echo(f"lily {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version.")
    ] = False,
) -> None:
    pass


ModelOption = Annotated[
    str,
    typer.Option("--model", "-m", help="A model directory, a Hugging Face repo (ORG/NAME) or synthetic:small[:hf]."),
]
DeviceOption = Annotated[str | None, typer.Option(help="Engine device: auto, cpu, cuda or wgpu.")]


@app.command()
@reports_errors
def fetch(
    repo: Annotated[
        str, typer.Argument(help="Hugging Face repo id (or a local checkpoint directory to check).")
    ] = DEFAULT_REPO,
    revision: Annotated[str | None, typer.Option(help="Branch, tag or commit.")] = None,
    dir: Annotated[
        Path | None, typer.Option("--dir", help="Download into this directory instead of the Hugging Face cache.")
    ] = None,
) -> None:
    """Download the checkpoint files the engine needs (progress, resume, disk-space check)."""
    from lilycli.fetch import fetch as download

    path = download(repo, revision=revision, directory=dir, log=log)
    typer.echo(str(path))
    log(f"ready: lily serve --model {path}")


@app.command(context_settings=ENGINE_PASSTHROUGH)
@reports_errors
def serve(
    ctx: typer.Context,
    model: ModelOption = DEFAULT_REPO,
    host: Annotated[str, typer.Option(help="Address to bind (127.0.0.1 keeps it local).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    api_key: Annotated[str | None, typer.Option(envvar="LILY_API_KEY", help="Require this bearer token.")] = None,
    ctx_size: Annotated[int | None, typer.Option(help="Maximum context length per sequence.")] = None,
    max_queue: Annotated[int | None, typer.Option(help="Requests allowed to wait before 429.")] = None,
    device: DeviceOption = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the model to load.")] = 1800.0,
) -> None:
    """Serve a model on an OpenAI-compatible API. Extra options are passed to `lily-engine serve`."""
    from lilycli.serve import ServeOptions, Terminated, running_engine, terminate_raises

    opts = ServeOptions(
        model, host=host, port=port, api_key=api_key, ctx_size=ctx_size, max_queue=max_queue,
        device=device, timeout=timeout, extra=list(ctx.args),
    )  # fmt: skip
    with terminate_raises():
        try:
            with running_engine(opts, log=log) as (engine, url):
                typer.echo(f"Lily is serving {model} at {url}/v1 (Ctrl-C to stop)")
                if "--no-webui" not in opts.extra:
                    typer.echo(f"Chat in your browser: {url}/")
                engine.echo = True  # from now on the engine's own log lines show
                engine.wait()
                raise engine.died("stopped unexpectedly")
        except (KeyboardInterrupt, Terminated):
            log("stopped")


@app.command()
@reports_errors
def chat(
    prompt: Annotated[
        str | None, typer.Argument(help="Ask once and print the answer; '-' reads stdin; none: a conversation.")
    ] = None,
    system: Annotated[str | None, typer.Option(help="System prompt.")] = None,
    no_think: Annotated[bool, typer.Option("--no-think", help="Answer without thinking first.")] = False,
    hide_reasoning: Annotated[bool, typer.Option("--hide-reasoning", help="Do not show the model's thinking.")] = False,
    max_tokens: Annotated[int | None, typer.Option(help="Stop the answer after this many tokens.")] = None,
    temperature: Annotated[
        float | None, typer.Option(help="Sampling temperature (the model card's default otherwise).")
    ] = None,
    url: Annotated[
        str | None, typer.Option(envvar="LILY_URL", help=f"A running server (default: {DEFAULT_URL} if up).")
    ] = None,
    model: Annotated[
        str | None, typer.Option("--model", "-m", help="Start a server for this model for the call.")
    ] = None,
    api_key: Annotated[str | None, typer.Option(envvar="LILY_API_KEY", help="Bearer token for the server.")] = None,
    device: DeviceOption = None,
) -> None:
    """Chat with a model: one prompt, or a conversation. Uses a running server or starts one."""
    from lilycli import chat as chatting
    from lilycli.engine import free_port
    from lilycli.health import LoadingLine, wait_for_server
    from lilycli.serve import ServeOptions, Terminated, running_engine, terminate_raises

    options = chatting.ChatOptions(
        system=system, think=not no_think, max_tokens=max_tokens, temperature=temperature,
        hide_reasoning=hide_reasoning, api_key=api_key,
    )  # fmt: skip
    if prompt == "-":
        prompt = sys.stdin.read()

    def talk(server_url: str) -> None:
        client = chatting.Client(server_url, api_key)
        try:
            wait_for_server(client.url, api_key, timeout=1800.0, on_progress=LoadingLine())
            if prompt is not None:
                chatting.one_shot(client, prompt, options)
            else:
                chatting.repl(client, options)
        finally:
            client.close()

    if url is None and model is None:
        if not _listening(DEFAULT_URL):
            raise LilyError(
                f"no Lily server answers at {DEFAULT_URL}: start one with `lily serve`, "
                "or give --model to start one for this chat, or --url for another server"
            )
        url = DEFAULT_URL
    if url is not None:
        if model is not None:
            raise LilyError("give --url (a running server) or --model (start one), not both", exit_code=2)
        talk(url)
        return
    assert model is not None
    opts = ServeOptions(model, port=free_port(), api_key=api_key, device=device)
    with terminate_raises():
        try:
            with running_engine(opts, log=log) as (_, server_url):
                talk(server_url)
        except KeyboardInterrupt:
            raise typer.Exit(130) from None
        except Terminated:
            raise typer.Exit(143) from None


def _listening(url: str) -> bool:
    """Whether a server answers /health at `url` at all (ready or still loading)."""
    try:
        httpx.get(f"{url}/health", timeout=2.0)
    except httpx.HTTPError:
        return False
    return True


@app.command(context_settings=ENGINE_PASSTHROUGH)
@reports_errors
def bench(
    ctx: typer.Context,
    model: ModelOption = DEFAULT_REPO,
    lengths: Annotated[
        str | None, typer.Option(help="Prompt/context lengths, e.g. 256,1K,4K (default: the engine's sweep).")
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the run's JSON here.")] = None,
    plot_out: Annotated[
        Path | None, typer.Option("--plot", help="Draw throughput against length into this PNG (needs matplotlib).")
    ] = None,
    compare: Annotated[
        Path | None, typer.Option(help="Another run's JSON: print per-length throughput ratios.")
    ] = None,
    load: Annotated[
        Path | None, typer.Option(help="Report this existing run's JSON instead of running the engine.")
    ] = None,
    decode_tokens: Annotated[int | None, typer.Option(help="Decode steps timed per length.")] = None,
    repeat: Annotated[int | None, typer.Option(help="Runs per point (the median is kept).")] = None,
    device: DeviceOption = None,
) -> None:
    """Run the engine's prefill/decode sweep; print a table, write JSON and a plot, compare with another run.

    Extra options (e.g. --quantize for a bf16 checkpoint) are passed to `lily-engine bench`."""
    from lilycli import bench as benching
    from lilycli import plot

    # Check what the user typed (and that a plot can be drawn) before a long run, not after.
    other = benching.load(compare) if compare is not None else None
    sweep = benching.parse_lengths(lengths) if lengths else None
    if plot_out is not None:
        plot.require_matplotlib()
    if load is not None:
        run = benching.load(load)
    else:
        from lilycli.engine import find_engine
        from lilycli.models import resolve_model

        binary = find_engine()
        model_dir = resolve_model(model, binary, log=log)
        extra = list(ctx.args)
        for flag, value in (("--decode-tokens", decode_tokens), ("--repeat", repeat), ("--device", device)):
            if value is not None:
                extra += [flag, str(value)]
        run = benching.run_sweep(binary, model_dir, sweep, extra)
    typer.echo(benching.table(run))
    if json_out is not None:
        benching.save(run, json_out)
        log(f"wrote {json_out}")
    if other is not None:
        typer.echo("")
        typer.echo(benching.compare(run, other))
    if plot_out is not None:
        plot.plot([run] + ([other] if other is not None else []), plot_out)
        log(f"wrote {plot_out}")


@app.command()
@reports_errors
def selftest(
    allow_software: Annotated[
        bool,
        typer.Option("--allow-software", help="Also test wgpu on a software Vulkan adapter (lavapipe)."),
    ] = False,
    steps: Annotated[int | None, typer.Option(help="Greedy steps that must match the CPU's.")] = None,
) -> None:
    """Check every device (CPU, CUDA, wgpu) against the CPU on a tiny synthetic model, with a short bench.

    Prints a plain-text report for bug reports; exits 1 when a device disagrees with the CPU."""
    from lilycli import selftest as checking
    from lilycli.engine import find_engine

    code = checking.run(find_engine(), allow_software, steps, typer.echo)
    if code != 0:
        raise typer.Exit(code)


def main() -> None:
    app()
