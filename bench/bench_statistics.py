"""Streamed statistics against per-path results: pk.path_statistics vs pk.path_residuals.

Issue 17's CPU target: the exact statistics of a 10^8-path tree (L = 8, H = 10, n = 32, float32,
no skip) with peak memory growth under 100 MiB, in no more than 5 % more time than
path_residuals takes for the same tree. Both run on the same tree and machine, alternating for
--rounds rounds (this VM's timings vary by ±30 %); the best time of each counts. Memory is the
growth of the peak resident set during the call (Linux), which for path_residuals includes its
per-path results.

    python bench/bench_statistics.py                   # the target: 10^8 paths (several minutes)
    python bench/bench_statistics.py --layers 6        # 10^6 paths
    python bench/bench_statistics.py --out bench/results/statistics-cpu-dev.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

import pathkernels as pk
from pathkernels.benchmarks import format_table, peak_rss, reset_peak_rss
from pathkernels.testing import random_attention


def measure(fn) -> tuple[float, int]:
    """Seconds and peak-RSS growth (bytes) of one call; the result is dropped before returning."""
    base = reset_peak_rss()
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    growth = peak_rss() - base
    del result
    return seconds, growth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=10)
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()

    attn = random_attention(1, args.layers, args.heads, args.n, args.n, generator=torch.Generator().manual_seed(0))
    tree = pk.PathTree.complete(args.layers, args.heads)
    pk.path_statistics(attn[:, :3], pk.PathTree.complete(3, args.heads))  # warm-up
    runs = {"path_residuals": [], "path_statistics": []}
    calls = {
        "path_residuals": lambda: pk.path_residuals(attn, tree),
        "path_statistics": lambda: pk.path_statistics(attn, tree),
    }
    for _ in range(args.rounds):
        for name, call in calls.items():
            runs[name].append(measure(call))
            print(f"{name}: {runs[name][-1][0]:.2f} s, +{runs[name][-1][1] / 2**20:.0f} MiB", flush=True)
    rows = []
    for name, measured in runs.items():
        seconds = min(s for s, _ in measured)
        rows.append(
            {
                "call": name,
                "seconds": seconds,
                "paths_per_s": tree.num_paths / seconds,
                "peak_growth_mib": max(g for _, g in measured) / 2**20,
                "times": [s for s, _ in measured],
            }
        )
    ratio = rows[1]["seconds"] / rows[0]["seconds"]
    print()
    print(
        f"L = {args.layers}, H = {args.heads}, n = {args.n}, float32, {tree.num_paths:,} paths, "
        f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}"
    )
    columns = [("call", "call", "<16"), ("best s", "seconds", ".2f"), ("paths/s", "paths_per_s", ".3g")]
    print(format_table(rows, [*columns, ("peak growth MiB", "peak_growth_mib", ".0f")]))
    print(f"statistics / residuals: {ratio:.3f} (target <= 1.05); statistics' peak growth target < 100 MiB")
    if args.out:
        with open(args.out, "w") as out:
            json.dump(
                {
                    "layers": args.layers,
                    "heads": args.heads,
                    "n": args.n,
                    "paths": tree.num_paths,
                    "threads": torch.get_num_threads(),
                    "torch": torch.__version__,
                    "rows": rows,
                    "time_ratio": ratio,
                },
                out,
                indent=1,
            )


if __name__ == "__main__":
    main()
