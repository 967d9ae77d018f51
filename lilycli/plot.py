"""`lily bench --plot`: prefill and decode throughput against length, one line per run (matplotlib, optional)."""

from pathlib import Path

from lilycli.bench import describe
from lilycli.errors import LilyError


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise LilyError(
            "--plot needs matplotlib: `pipx inject lily matplotlib` (pipx) or `pip install 'lily[plot]'`"
        ) from e
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def plot(runs: list[dict], out: Path) -> None:
    plt = _pyplot()
    figure, (prefill, decode) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for run in runs:
        label = describe(run)
        points = sorted((r["len"], r["tok_s"]) for r in run["prefill"])
        if points:
            prefill.plot(*zip(*points), marker="o", label=label)
        points = sorted((r["ctx"], r["tok_s"]) for r in run["decode"])
        if points:
            decode.plot(*zip(*points), marker="o", label=label)
    for axes, title, xlabel in (
        (prefill, "Prefill", "prompt length (tokens)"),
        (decode, "Decode", "context length (tokens)"),
    ):
        axes.set_xscale("log", base=2)
        axes.set_title(title)
        axes.set_xlabel(xlabel)
        axes.set_ylabel("tokens / s")
        axes.grid(True, which="both", alpha=0.3)
        axes.set_ylim(bottom=0)
        if axes.lines:
            axes.legend(fontsize="small")
    try:
        figure.savefig(out, dpi=120)
    except OSError as e:
        raise LilyError(f"cannot write the plot to {out}: {e.strerror or e}") from e
    finally:
        plt.close(figure)
