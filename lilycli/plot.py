"""`lily bench --plot`: prefill and decode throughput against length, one line per run (matplotlib, optional)."""

from pathlib import Path

from lilycli.bench import length_label
from lilycli.errors import LilyError


def require_matplotlib():
    try:
        import matplotlib
    except ImportError as e:
        raise LilyError(
            "--plot needs matplotlib: `pipx inject lily matplotlib` (pipx) or `pip install 'lily[plot]'`"
        ) from e
    return matplotlib


def _pyplot():
    matplotlib = require_matplotlib()
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def _label(run: dict) -> str:
    """Short enough for a legend: engine, version, device, model directory name."""
    model = Path(str(run.get("model", ""))).name
    parts = [f"{run.get('engine', '?')} {run.get('version', '')}".strip(), str(run.get("gpu", "")), model]
    return " · ".join(p for p in parts if p)


def plot(runs: list[dict], out: Path) -> None:
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter

    figure, (prefill, decode) = plt.subplots(1, 2, figsize=(11, 4.5), constrained_layout=True)
    for run in runs:
        label = _label(run)
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
        axes.xaxis.set_major_formatter(FuncFormatter(lambda x, _: length_label(int(x)) if x >= 1 else ""))
        axes.set_title(title)
        axes.set_xlabel(xlabel)
        axes.set_ylabel("tokens / s")
        axes.grid(True, which="both", alpha=0.3)
        top = max((y for line in axes.lines for y in line.get_ydata()), default=1.0)
        axes.set_ylim(0, top * 1.1)
    if prefill.lines or decode.lines:
        handles, labels = (prefill if prefill.lines else decode).get_legend_handles_labels()
        figure.legend(handles, labels, loc="outside lower center", fontsize="small")
    try:
        figure.savefig(out, dpi=120)
    except OSError as e:
        raise LilyError(f"cannot write the plot to {out}: {e.strerror or e}") from e
    finally:
        plt.close(figure)
