"""Benchmark of pk.decompose on a captured model: every path's term (a source and the heads it
passes, built from the bottom up) and its residual ratio; and a uniform sample of GPT-2 small's
2.7·10^13 paths, each term built alone.

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

from pathkernels.app.benchmarks import bench_main, seconds_per_call

MODEL_COLUMNS = ATTRIBUTION_COLUMNS[:6]

# (layers, heads, d_model, tokens, max_length or None for every path, uniform samples or None)
CASES = [
    (6, 8, 64, 16, None, None),
    (12, 12, 768, 16, 1, None),
    (12, 12, 768, 16, 2, None),
    (12, 12, 768, 16, None, 2000),
]
COLUMNS = [
    *MODEL_COLUMNS,  # L, H, d, n, max len, paths: bench_attribution.py's cases
    ("evaluated", "evaluated", ","),
    ("s", "seconds", ".3f"),
    ("evaluated/s", "paths_per_s", ".3g"),
]


def bench_case(layers: int, heads: int, width: int, tokens: int, max_length: int | None, samples: int | None) -> dict:
    import pathkernels as pk
    from pathkernels.core.paths import count_attribution_paths

    torch.manual_seed(0)
    model = gpt2_model(layers, heads, width, tokens)
    stack, _ = pk.adapters.capture_huggingface_residual(model, input_ids=torch.randint(0, 100, (1, tokens)))

    def run():
        return pk.decompose(
            stack, max_length=max_length, num_samples=samples, generator=torch.Generator().manual_seed(0)
        )

    evaluated = len(run().paths)
    seconds = seconds_per_call(run, "cpu", min_runs=3, min_seconds=0, statistic="min")
    paths = count_attribution_paths(layers, heads, layers if max_length is None else max_length)
    return {
        **case_columns(layers, heads, width, tokens, max_length, paths),
        "evaluated": evaluated,
        "seconds": seconds,
        "paths_per_s": evaluated / seconds,
    }


def main(argv=None) -> int:
    title = "decompose of a captured model (path terms, bottom up)"
    return bench_main(argv, "pk.decompose on captured GPT-2-shaped models", title, bench_case, COLUMNS, CASES)


if __name__ == "__main__":
    sys.exit(main())
