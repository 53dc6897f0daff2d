"""Streamed statistics against per-path results: pk.path_statistics vs pk.path_residuals.

The CPU target: the exact statistics of a 10^8-path tree (L = 8, H = 10, n = 32, float32,
no skip) with peak memory growth under 100 MiB, in no more than 5 % more time than
path_residuals takes for the same tree. Both run on the same tree and machine, alternating for
--rounds rounds (this VM's timings vary by ±30 %). Reported: each call's best time, the median of
the per-round ratios, and, less noisy, the time each call spends outside the engine op
(``path_chunk_norms``, which both run on the same chunks): what the statistics add is their
outside time minus path_residuals', as a fraction of path_residuals' time. Memory is the growth
of the peak resident set during the call (Linux), which for path_residuals includes its per-path
results.

    python bench/bench_statistics.py                   # the target: 10^8 paths (several minutes)
    python bench/bench_statistics.py --layers 6        # 10^6 paths
    python bench/bench_statistics.py --out bench/results/statistics-cpu-dev.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import pathkernels as pk
from pathkernels.app.benchmarks import format_table, peak_rss, reset_peak_rss
from pathkernels.core import ops
from pathkernels.testing import random_attention


class EngineTimer:
    """Wraps ops.path_chunk_norms (the engine op both calls run, chunk by chunk) to add up its time."""

    def __init__(self):
        self.seconds = 0.0
        self._op = ops.path_chunk_norms

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._op(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def measure(fn) -> tuple[float, int, float]:
    """Seconds, peak-RSS growth (bytes) and seconds inside the engine op of one call; the result is
    dropped before returning."""
    timer = EngineTimer()
    ops.path_chunk_norms = timer
    try:
        base = reset_peak_rss()
        start = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - start
        growth = peak_rss() - base
    finally:
        ops.path_chunk_norms = timer._op
    del result
    return seconds, growth, timer.seconds


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
            seconds, growth, engine = runs[name][-1]
            print(
                f"{name}: {seconds:.2f} s ({seconds - engine:.2f} s outside the engine op), +{growth / 2**20:.0f} MiB",
                flush=True,
            )
    rows = []
    for name, measured in runs.items():
        seconds = min(s for s, _, _ in measured)
        rows.append(
            {
                "call": name,
                "seconds": seconds,
                "paths_per_s": tree.num_paths / seconds,
                "outside_engine_s": statistics.median(s - e for s, _, e in measured),
                "peak_growth_mib": max(g for _, g, _ in measured) / 2**20,
                "times": [s for s, _, _ in measured],
                "engine_times": [e for _, _, e in measured],
            }
        )
    ratio = rows[1]["seconds"] / rows[0]["seconds"]
    round_ratios = [s[0] / r[0] for r, s in zip(runs["path_residuals"], runs["path_statistics"])]
    added = (rows[1]["outside_engine_s"] - rows[0]["outside_engine_s"]) / rows[0]["seconds"]
    print()
    print(
        f"L = {args.layers}, H = {args.heads}, n = {args.n}, float32, {tree.num_paths:,} paths, "
        f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}"
    )
    columns = [("call", "call", "<16"), ("best s", "seconds", ".2f"), ("paths/s", "paths_per_s", ".3g")]
    columns += [("outside engine s (median)", "outside_engine_s", ".2f")]
    print(format_table(rows, [*columns, ("peak growth MiB", "peak_growth_mib", ".0f")]))
    print(
        f"statistics / residuals: {ratio:.3f} best against best, {statistics.median(round_ratios):.3f} median of the "
        f"rounds ({', '.join(f'{r:.3f}' for r in round_ratios)}); target <= 1.05"
    )
    print(
        f"time the statistics add outside the engine op: {added:+.1%} of path_residuals' time; statistics' peak "
        "growth target < 100 MiB"
    )
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
                    "round_ratios": round_ratios,
                    "median_round_ratio": statistics.median(round_ratios),
                    "added_outside_engine_fraction": added,
                },
                out,
                indent=1,
            )


if __name__ == "__main__":
    main()
