#!/usr/bin/env python3
"""Agreement table of teacher-forced logits (issues 11/12 deliverable 3, issue 13 deliverable 4).

Each input is a `lily-engine score` output prefix (PREFIX.f32: little-endian f32 rows of `vocab`
logits, one per position; PREFIX.json: the token ids, the backend's description, timings), or
scripts/hf_agreement.py's `--save` output in the same format. A run stopped early leaves its first
rows complete: each comparison covers the positions both files have in full, and says how many.

For every reference (`--ref`, in order) and every other output: logits' relative L2 error over all
compared positions, its median per position, top-1 (argmax) agreement. Writes a Markdown summary
(with the step timings of `--steps`, a TSV of step, exit status, seconds) and the numbers as JSON.
numpy only, in blocks of rows (1,024 positions × 248,320 logits is 1 GB a file).

    python3 scripts/agreement_table.py --ref /tmp/agree/ref-cpu --ref /tmp/agree/cuda-fp32 \\
        --other /tmp/agree/cuda-bf16 --other /tmp/agree/hf-bf16 --steps $OUT/steps.tsv \\
        --out $OUT/summary.md --json $OUT/agreement.json
"""

import argparse
import concurrent.futures
import json
import os

import numpy as np


def load(prefix, vocab_hint=None):
    """(meta, rows as a memmap [n, vocab]) or (meta or None, None) when absent / empty."""
    try:
        with open(prefix + ".json") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None, None
    vocab = meta.get("vocab") or vocab_hint
    path = prefix + ".f32"
    if not vocab or not os.path.exists(path):
        return meta, None
    n = min(os.path.getsize(path) // (4 * vocab), len(meta["ids"]))
    if n == 0:
        return meta, None
    return meta, np.memmap(path, dtype="<f4", mode="r", shape=(n, vocab))


def compare_files(job):
    """compare() on two prefixes (a process pool's job: the comparisons run in parallel)."""
    ours, ref, n, vocab = job
    return compare(np.memmap(ours + ".f32", dtype="<f4", mode="r", shape=(n, vocab)),
                   np.memmap(ref + ".f32", dtype="<f4", mode="r", shape=(n, vocab)), n)


def compare(ours, ref, n, block=64):
    err2 = ref2 = 0.0
    per_pos = []
    same = 0
    for a in range(0, n, block):
        e = min(a + block, n)
        o = np.asarray(ours[a:e], dtype=np.float64)
        r = np.asarray(ref[a:e], dtype=np.float64)
        d2 = ((o - r) ** 2).sum(1)
        r2 = (r ** 2).sum(1)
        err2 += float(d2.sum())
        ref2 += float(r2.sum())
        per_pos.extend(np.sqrt(d2 / r2).tolist())
        same += int((o.argmax(1) == r.argmax(1)).sum())
    pp = np.asarray(per_pos)
    worst = int(pp.argmax())
    over = np.flatnonzero(pp > 1e-3)
    return {
        "positions": n,
        "rel_l2": float(np.sqrt(err2 / ref2)),
        "rel_l2_median_position": float(np.median(pp)),
        # The per-position form of a "< 1e-4" criterion (docs/perf-notes.md, session 6): on a
        # random-weight MoE a correct fp32 path flips a near-tied expert at a few positions, which
        # dominate the whole-sequence figure; the 99th percentile says whether more than 1 % do.
        "rel_l2_p99_position": float(np.percentile(pp, 99)),
        # Where the error sits: one position far off (a routing flip on near-tied router logits
        # changes that row, and through attention and the recurrent state the rows after it) or
        # every position a little (summation order).
        "rel_l2_max_position": float(pp[worst]),
        "worst_position": worst,
        "positions_over_1e-3": int(over.size),
        "first_position_over_1e-3": int(over[0]) if over.size else None,
        # The implementation's own agreement: the worst position before the first one over 1e-3
        # (the first routing flip, on a correct fp32 path), or over all positions when none is.
        "rel_l2_max_before_first_over_1e-3": float(pp[:over[0]].max()) if over.size and over[0] > 0
        else (None if over.size else float(pp.max())),
        "top1_agreement": same / n,
        "top1_same": same,
    }


def name_of(prefix, meta):
    return os.path.basename(prefix) + (f" ({meta['backend']})" if meta and meta.get("backend") else "")


def verdict(comparisons, refs, inputs):
    """The issues' questions, answered from the comparisons: against the reference that covers the
    most positions (the first --ref on a tie), is each bf16 / wgpu path's top-1 agreement at least
    HF transformers bf16's, and is CUDA's fp32 mode within 1e-4 of the CPU."""
    by = {(c["reference"], c["path"]): c for c in comparisons}
    rows = {os.path.basename(r): (0 if inputs[r][1] is None else inputs[r][1].shape[0]) for r in refs}
    if not any(rows.values()):
        return ["", "## Verdict", "", "no reference rows"]
    best = max(rows, key=lambda r: rows[r])  # max keeps the first of equals
    out = ["", "## Verdict", ""]
    hf = by.get((best, "hf-bf16"))
    for path in ("cuda-bf16", "wgpu"):
        c = by.get((best, path))
        if c is None:
            out.append(f"- {path}: no comparison against {best}")
            continue
        line = (f"- {path} vs {best} over {c['positions']} positions: top-1 {100 * c['top1_agreement']:.1f} %, "
                f"rel. L2 {c['rel_l2']:.3g}")
        if hf is not None and hf["positions"] == c["positions"]:
            ok = c["top1_same"] >= hf["top1_same"]
            line += (f"; HF transformers bf16 on the same positions: top-1 {100 * hf['top1_agreement']:.1f} %, rel. L2 "
                     f"{hf['rel_l2']:.3g} → **{'at least HF' if ok else 'BELOW HF'}**")
        out.append(line)
    for ref in rows:
        c = by.get((ref, "cuda-fp32"))
        if c is not None:
            out.append(f"- cuda-fp32 vs {ref} over {c['positions']} positions: rel. L2 {c['rel_l2']:.3g} "
                       f"({'< 1e-4' if c['rel_l2'] < 1e-4 else 'NOT < 1e-4'}), top-1 {100 * c['top1_agreement']:.1f} %; "
                       f"per position median {c['rel_l2_median_position']:.3g}, p99 {c['rel_l2_p99_position']:.3g} "
                       f"({'< 1e-4' if c['rel_l2_p99_position'] < 1e-4 else 'NOT < 1e-4'}), "
                       f"{c['positions_over_1e-3']} positions > 1e-3"
                       + ("" if c["rel_l2_max_before_first_over_1e-3"] is None else
                          f", worst before the first of them {c['rel_l2_max_before_first_over_1e-3']:.3g}"))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", action="append", required=True, help="reference prefix (repeatable; first = primary)")
    ap.add_argument("--other", action="append", default=[], help="prefix to compare with each reference")
    ap.add_argument("--vocab", type=int, help="row width when a json lacks it")
    ap.add_argument("--steps", help="TSV: step, exit status, seconds[, note]")
    ap.add_argument("--out", required=True, help="Markdown summary")
    ap.add_argument("--json", help="the numbers as JSON")
    args = ap.parse_args()

    inputs = {}
    for p in dict.fromkeys(args.ref + args.other):
        inputs[p] = load(p, args.vocab)
    lines = ["# Teacher-forced agreement (scripts/agreement_table.py)", ""]
    lines += ["| output | backend | positions scored | load s | score s |", "|---|---|---:|---:|---:|"]
    for p, (meta, rows) in inputs.items():
        if meta is None:
            lines.append(f"| {os.path.basename(p)} | (missing) | 0 | | |")
            continue
        fmt = lambda v: "" if v is None else f"{v:.1f}"
        lines.append(f"| {os.path.basename(p)} | {meta.get('backend', '?')} | {0 if rows is None else rows.shape[0]}"
                     f"/{len(meta['ids'])} | {fmt(meta.get('load_seconds'))} | {fmt(meta.get('seconds'))} |")
    results = {"comparisons": [], "inputs": {}}
    for p, (meta, rows) in inputs.items():
        if meta is not None:
            results["inputs"][os.path.basename(p)] = {k: v for k, v in meta.items() if k != "ids"} | {
                "rows": 0 if rows is None else int(rows.shape[0])}
    # The comparisons to make, run in parallel (each reads two files of up to 1 GB).
    jobs = {}
    for ref in args.ref:
        rmeta, rrows = inputs[ref]
        for other in args.other:
            ometa, orows = inputs[other]
            if other == ref or rrows is None or orows is None:
                continue
            n = min(rrows.shape[0], orows.shape[0])
            if rrows.shape[1] == orows.shape[1] and rmeta["ids"][:n] == ometa["ids"][:n]:
                jobs[(ref, other)] = (other, ref, n, rrows.shape[1])
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        done = dict(zip(jobs, pool.map(compare_files, jobs.values())))
    for ref in args.ref:
        rmeta, rrows = inputs[ref]
        lines += ["", f"## Reference: {name_of(ref, rmeta)}", ""]
        if rrows is None:
            lines.append("(no rows)")
            continue
        lines += ["| path | positions | logits rel. L2 | median per position | p99 per position | worst position "
                  "| positions > 1e-3 (first) | top-1 agreement |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for other in args.other:
            if other == ref:
                continue
            ometa, orows = inputs[other]
            if orows is None:
                lines.append(f"| {os.path.basename(other)} | 0 | | | | | | (no output) |")
                continue
            c = done.get((ref, other))
            if c is None:
                lines.append(f"| {os.path.basename(other)} | | | | | | | (other tokens or vocabulary: not comparable) |")
                continue
            n = c["positions"]
            c.update(reference=os.path.basename(ref), path=os.path.basename(other), backend=ometa.get("backend"))
            results["comparisons"].append(c)
            first = c["first_position_over_1e-3"]
            lines.append(f"| {name_of(other, ometa)} | {n} | {c['rel_l2']:.3g} | {c['rel_l2_median_position']:.3g} "
                         f"| {c['rel_l2_p99_position']:.3g} | {c['rel_l2_max_position']:.3g} at {c['worst_position']} "
                         f"| {c['positions_over_1e-3']}{'' if first is None else f' (from {first})'} "
                         f"| {100 * c['top1_agreement']:.1f} % ({c['top1_same']}/{n}) |")
    lines += verdict(results["comparisons"], args.ref, inputs)
    if args.steps and os.path.exists(args.steps):
        lines += ["", "## Steps (wall time)", "", "| step | exit | seconds | note |", "|---|---:|---:|---|"]
        with open(args.steps) as f:
            for row in f:
                cols = row.rstrip("\n").split("\t") + ["", "", ""]
                lines.append(f"| {cols[0]} | {cols[1]} | {cols[2]} | {cols[3]} |")
    text = "\n".join(lines) + "\n"
    with open(args.out, "w") as f:
        f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(text)


if __name__ == "__main__":
    main()
