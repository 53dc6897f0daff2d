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

from pathkernels.benchmarks import bench_main, seconds_per_call

# (layers, heads, d_model, tokens, max_length or None for every path)
CASES = [(6, 8, 64, 16, None), (12, 12, 768, 16, 1), (12, 12, 768, 16, 2)]
COLUMNS = [
    ("L", "layers", ""),
    ("H", "heads", ""),
    ("d", "d_model", ""),
    ("n", "tokens", ""),
    ("max len", "max_length", ""),
    ("paths", "paths", ","),
    ("s", "seconds", ".3f"),
    ("paths/s", "paths_per_s", ".3g"),
]


def bench_case(layers: int, heads: int, width: int, tokens: int, max_length: int | None) -> dict:
    from bench_attribution import gpt2_model

    import pathkernels as pk

    torch.manual_seed(0)
    model = gpt2_model(layers, heads, width, tokens)
    stack, _ = pk.adapters.capture_huggingface_residual(model, input_ids=torch.randint(0, 100, (1, tokens)))
    paths = len(pk.decompose(stack, max_length=max_length).paths)
    seconds = seconds_per_call(
        lambda: pk.decompose(stack, max_length=max_length), "cpu", min_runs=3, min_seconds=0, statistic="min"
    )
    return {
        "layers": layers,
        "heads": heads,
        "d_model": width,
        "tokens": tokens,
        "max_length": "all" if max_length is None else max_length,
        "paths": paths,
        "seconds": seconds,
        "paths_per_s": paths / seconds,
    }


def main(argv=None) -> int:
    title = "decompose of a captured model (path terms, bottom up)"
    return bench_main(argv, "pk.decompose on captured GPT-2-shaped models", title, bench_case, COLUMNS, CASES)


if __name__ == "__main__":
    sys.exit(main())
