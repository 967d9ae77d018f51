"""`lily bench`: run the engine's prefill/decode sweep (docs/PERFORMANCE.md §1) and report it.

The engine measures and writes the JSON
  {"engine","version","gpu","model","format","prefill":[{"len","tok_s","ms"}],"decode":[{"ctx","tok_s","ms_per_tok"}],
   "decode_batch":[{"batch","ctx","tok_s","ms_per_step","vs_one"}] (with --batch)};
this module only runs it, reads that file back, prints it as one table and compares two runs.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from lilycli.errors import LilyError


def parse_lengths(text: str) -> list[int]:
    """ "256,1K,4k,128K" -> [256, 1024, 4096, 131072] (K = 1024, as in PERFORMANCE.md)."""
    lengths = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        scale = 1024 if item[-1] in "kK" else 1
        number = item[:-1] if scale == 1024 else item
        if not number.isdigit() or int(number) == 0:
            raise LilyError(f"--lengths: {item!r} is not a positive length (like 512, 4K)", exit_code=2)
        lengths.append(int(number) * scale)
    if not lengths:
        raise LilyError("--lengths: no length given", exit_code=2)
    return lengths


def run_sweep(binary: Path, model: Path, lengths: list[int] | None, extra: list[str]) -> dict:
    """Run `lily-engine bench` (its own output goes to our stderr) and return its JSON result."""
    with tempfile.TemporaryDirectory(prefix="lily-bench-") as tmp:
        out = Path(tmp) / "bench.json"
        command = [str(binary), "bench", "--model", str(model), "--json", str(out), *extra]
        if lengths:
            joined = ",".join(str(n) for n in lengths)
            command += ["--prefill", joined, "--decode-ctx", joined]
        try:
            engine = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
            )
        except OSError as e:
            raise LilyError(f"cannot run {binary}: {e}") from e
        try:
            assert engine.stdout is not None
            for line in engine.stdout:  # the engine's progress and table, passed on as they come
                sys.stderr.write(line)
                sys.stderr.flush()
            code = engine.wait()
        except KeyboardInterrupt:
            engine.kill()
            engine.wait()
            raise LilyError("benchmark interrupted", exit_code=130) from None
        if code != 0:
            raise LilyError(f"`lily-engine bench` failed (exit code {code}); its output is above")
        return load(out)


def load(path: Path) -> dict:
    """Read and check a bench JSON file; errors name the file and the field."""
    try:
        run = json.loads(Path(path).read_text())
    except OSError as e:
        raise LilyError(f"cannot read {path}: {e.strerror or e}") from e
    except ValueError as e:
        raise LilyError(f"{path} is not JSON: {e}") from e
    if not isinstance(run, dict):
        raise LilyError(f'{path}: expected a JSON object with "prefill" and "decode" lists')
    for key, x, fields in (("prefill", "len", ("tok_s", "ms")), ("decode", "ctx", ("tok_s", "ms_per_tok"))):
        rows = run.setdefault(key, [])
        if not isinstance(rows, list):
            raise LilyError(f'{path}: "{key}" must be a list')
        for i, row in enumerate(rows):
            for name in (x, *fields):
                value = row.get(name) if isinstance(row, dict) else None
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    raise LilyError(f"{path}: {key}[{i}].{name} is missing or not a number")
    return run


def save(run: dict, path: Path) -> None:
    """Write the run's JSON whole or not at all (a temporary file renamed into place)."""
    partial = path.with_name(path.name + ".partial")
    try:
        partial.write_text(json.dumps(run, indent=2) + "\n")
        os.replace(partial, path)
    except OSError as e:
        partial.unlink(missing_ok=True)
        raise LilyError(f"cannot write {path}: {e.strerror or e}") from e


def _by_length(run: dict) -> dict[int, dict]:
    table: dict[int, dict] = {}
    for row in run["prefill"]:
        table.setdefault(int(row["len"]), {})["prefill"] = row
    for row in run["decode"]:
        table.setdefault(int(row["ctx"]), {})["decode"] = row
    return dict(sorted(table.items()))


def length_label(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _cell(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def describe(run: dict) -> str:
    fields = [str(run.get(k)) for k in ("engine", "version", "gpu", "model", "format") if run.get(k)]
    return " · ".join(fields) or "(no run description)"


def table(run: dict) -> str:
    """Prefill and decode side by side, one row per length."""
    lines = [
        describe(run),
        f"{'length':>8}  {'prefill tok/s':>14}  {'prefill ms':>11}  {'decode tok/s':>13}  {'ms/tok':>8}",
    ]
    for n, row in _by_length(run).items():
        p, d = row.get("prefill"), row.get("decode")
        lines.append(
            f"{length_label(n):>8}  {_cell(p and p['tok_s'], ',.1f'):>14}  {_cell(p and p['ms'], ',.1f'):>11}  "
            f"{_cell(d and d['tok_s'], ',.1f'):>13}  {_cell(d and d['ms_per_tok'], '.2f'):>8}"
        )
    batched = [r for r in run.get("decode_batch") or [] if isinstance(r, dict)]
    if batched:
        # `lily-engine bench --batch N`: N sequences decoding together, N tokens a step.
        lines.append(f"{'batch':>8}  {'context':>8}  {'decode tok/s':>13}  {'ms/step':>8}  {'x one':>6}")
        for r in batched:
            lines.append(
                f"{r.get('batch', '?'):>8}  {length_label(int(r.get('ctx', 0))):>8}  "
                f"{_cell(r.get('tok_s'), ',.1f'):>13}  {_cell(r.get('ms_per_step'), '.2f'):>8}  "
                f"{_cell(r.get('vs_one'), '.2f'):>6}"
            )
    return "\n".join(lines)


def _ratio(a: dict | None, b: dict | None) -> str:
    if not a or not b or not b["tok_s"]:
        return "—"
    return f"{a['tok_s'] / b['tok_s']:.2f}x"


def compare(run: dict, other: dict) -> str:
    """Throughput of `run` divided by `other`'s, per length (>1 means `run` is faster)."""
    mine, theirs = _by_length(run), _by_length(other)
    lines = [
        f"A: {describe(run)}",
        f"B: {describe(other)}",
        f"{'length':>8}  {'prefill A/B':>11}  {'decode A/B':>10}",
    ]
    for n in sorted(set(mine) | set(theirs)):
        a, b = mine.get(n, {}), theirs.get(n, {})
        lines.append(
            f"{length_label(n):>8}  {_ratio(a.get('prefill'), b.get('prefill')):>11}  "
            f"{_ratio(a.get('decode'), b.get('decode')):>10}"
        )
    return "\n".join(lines)
