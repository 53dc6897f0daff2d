"""Benchmark of building path trees: ``pk.PathTree.complete`` with and without ``max_length``.

A short-path tree (``max_length`` below the depth) keeps each path's heads alone, one entry per
head taken, and writes rows of its ``[M, L]`` table only when asked (the target: under
0.1 s for every case below, which took 16 s to hanging when the table was grown layer by layer).
Per case: the paths, the best of five builds, and the time to write the first 1,000 rows.

    python bench/bench_trees.py            # a few seconds
    python bench/bench_trees.py --out bench/results/trees-cpu-dev.json
"""

from __future__ import annotations

import sys
import time

from pathkernels.app.benchmarks import bench_main

# (layers, heads, max_length): the four cases, then wider and longer short trees.
CASES = [(1000, 1, 1), (2000, 1, 1), (96, 96, 1), (20_000, 1, 1), (12, 12, 3), (200, 2, 2), (1000, 4, 2)]
COLUMNS = [
    ("L", "layers", ""),
    ("H", "heads", ""),
    ("max len", "max_length", ""),
    ("paths", "paths", ","),
    ("build ms", "build_ms", ".2f"),
    ("1k rows ms", "rows_ms", ".2f"),
]


def bench_case(layers: int, heads: int, max_length: int, repeats: int = 5) -> dict:
    import pathkernels as pk

    builds = []
    for _ in range(repeats):
        start = time.perf_counter()
        tree = pk.PathTree.complete(layers, heads, skip=True, max_length=max_length)
        builds.append(time.perf_counter() - start)
    start = time.perf_counter()
    tree.path_range(0, min(1000, len(tree)))
    rows = time.perf_counter() - start
    return {
        "layers": layers,
        "heads": heads,
        "max_length": max_length,
        "paths": len(tree),
        "build_ms": 1e3 * min(builds),
        "rows_ms": 1e3 * rows,
    }


def main(argv=None) -> int:
    title = "PathTree.complete(skip=True, max_length=k)"
    return bench_main(argv, "Building short-path trees", title, bench_case, COLUMNS, CASES)


if __name__ == "__main__":
    sys.exit(main())
