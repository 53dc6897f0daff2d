"""Benchmark of pk.decompose on a captured model: every path's term (a source and the heads it
passes, built from the bottom up) and its residual ratio.

GPT-2-shaped models built from configs in float64 (the models of bench_attribution.py), one
sequence of 16 tokens. Per case: the paths, the time (best of three calls) and paths per second.

    python bench/bench_model_paths.py            # about half a minute on 2 cores
    python bench/bench_model_paths.py --out bench/results/model-paths-cpu-dev.json
"""

from __future__ import annotations

import sys

import torch
from bench_attribution import COLUMNS as ATTRIBUTION_COLUMNS
from bench_attribution import case_columns, gpt2_model

from pathkernels.benchmarks import bench_main, seconds_per_call

MODEL_COLUMNS = ATTRIBUTION_COLUMNS[:6]

# (layers, heads, d_model, tokens, max_length or None for every path)
CASES = [(6, 8, 64, 16, None), (12, 12, 768, 16, 1), (12, 12, 768, 16, 2)]
COLUMNS = [
    *MODEL_COLUMNS,  # L, H, d, n, max len, paths: bench_attribution.py's cases
    ("s", "seconds", ".3f"),
    ("paths/s", "paths_per_s", ".3g"),
]


def bench_case(layers: int, heads: int, width: int, tokens: int, max_length: int | None) -> dict:
    import pathkernels as pk

    torch.manual_seed(0)
    model = gpt2_model(layers, heads, width, tokens)
    stack, _ = pk.adapters.capture_huggingface_residual(model, input_ids=torch.randint(0, 100, (1, tokens)))
    paths = len(pk.decompose(stack, max_length=max_length).paths)
    seconds = seconds_per_call(
        lambda: pk.decompose(stack, max_length=max_length), "cpu", min_runs=3, min_seconds=0, statistic="min"
    )
    return {
        **case_columns(layers, heads, width, tokens, max_length, paths),
        "seconds": seconds,
        "paths_per_s": paths / seconds,
    }


def main(argv=None) -> int:
    title = "decompose of a captured model (path terms, bottom up)"
    return bench_main(argv, "pk.decompose on captured GPT-2-shaped models", title, bench_case, COLUMNS, CASES)


if __name__ == "__main__":
    sys.exit(main())
