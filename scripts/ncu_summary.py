#!/usr/bin/env python3
"""Per-kernel summary of an Nsight Compute raw CSV (gpu_session.sh NCU=CTX): launches, mean
duration, DRAM bytes and achieved DRAM bandwidth per kernel name, and the sum per decode step."""
import csv
import sys
from collections import defaultdict


def num(s: str) -> float:
    return float(s.replace(",", "")) if s else 0.0


def main(path: str, steps: float) -> None:
    rows = []
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    reader = csv.DictReader(lines)
    for r in reader:
        if not r.get("ID", "").isdigit():
            continue  # the units row
        rows.append(r)
    agg = defaultdict(lambda: [0, 0.0, 0.0, 0.0, ""])
    for r in rows:
        name = r["Kernel Name"].split("(")[0]
        a = agg[name]
        a[0] += 1
        a[1] += num(r["gpu__time_duration.sum"])
        a[2] += num(r["dram__bytes_read.sum"]) + num(r["dram__bytes_write.sum"])
        a[3] += num(r["dram__throughput.avg.pct_of_peak_sustained_elapsed"])
        a[4] = f'grid {r["launch__grid_size"]} regs {r["launch__registers_per_thread"]}'
    total = 0.0
    print(f"{'kernel':<22}{'launches':>9}{'us each':>9}{'MB each':>9}{'TB/s':>7}{'dram%':>7}{'us/step':>9}  launch")
    for name, (n, t, b, pct, geo) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        # ncu reports durations in ns (gpu__time_duration.sum is nsecond), bytes in bytes
        per_step = t / steps / 1e3
        total += per_step
        print(f"{name:<22}{n:>9}{t / n / 1e3:>9.2f}{b / n / 1e6:>9.2f}{b / t / 1e3:>7.2f}{pct / n:>7.1f}{per_step:>9.1f}  {geo}")
    print(f"sum of kernel durations per step: {total:.1f} us")


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 1.0)
