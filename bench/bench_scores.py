"""Benchmark of the score side: where heads look (pathkernels.analysis.scores).

GPT-2-shaped models built from configs in float64 (``bench_attribution.gpt2_model``: random weights,
biases and norm parameters, or Hugging Face's initialisation with ``init="hf"``), one sequence.
Reported per case: the capture with its queries and keys (``query_key=True``: one forward pass, the
value side's self-check and the rebuild of every query and key), every head of the top layer split
by (source, heads) groups at the last token against every key (``pk.score_decompositions``), one
head alone, the groups per side, the largest relative difference of the sums from the model's own
scores, one head's query side as a readout (``pk.score_attribution``, paths up to ``max_length``
heads), and that head's top 20 pairs of paths at key 3, certified (``pk.top_score_pairs``; its time
and whether it certified within two minutes).

    python bench/bench_scores.py                 # the grid, a few minutes on 2 cores
    python bench/bench_scores.py --quick
    python bench/bench_scores.py --out bench/results/scores-cpu-epyc.json
"""

from __future__ import annotations

import sys
import time

import torch
from bench_attribution import gpt2_model

from pathkernels.app.benchmarks import bench_main, seconds_per_call

# (layers, heads, d_model, tokens, init, max_length of the one-sided walk)
GRID = [
    (4, 8, 64, 16, "sharp", 4),
    (12, 12, 768, 16, "hf", 2),
    (12, 12, 768, 16, "sharp", 2),
]
QUICK = [(4, 8, 64, 16, "sharp", 4)]
COLUMNS = [
    ("L", "layers", ""),
    ("H", "heads", ""),
    ("d", "d_model", ""),
    ("n", "tokens", ""),
    ("init", "init", ""),
    ("capture s", "capture_s", ".3f"),
    ("all heads s", "all_heads_s", ".3f"),
    ("one head s", "one_head_s", ".3f"),
    ("groups", "groups", ""),
    ("|sum-model|", "relative_error", ".1e"),
    ("max len", "max_length", ""),
    ("query side s", "query_side_s", ".3f"),
    ("top 20 pairs s", "top_pairs_s", ".2f"),
    ("certified", "certified", ""),
]


def bench_case(layers: int, heads: int, width: int, tokens: int, init: str, max_length: int) -> dict:
    import transformers

    import pathkernels as pk

    torch.manual_seed(0)
    if init == "hf":
        config = transformers.GPT2Config(n_layer=layers, n_head=heads, n_embd=width, vocab_size=100, n_positions=tokens)
        model = transformers.GPT2LMHeadModel(config).double().eval()
    else:
        model = gpt2_model(layers, heads, width, tokens).eval()
    ids = torch.randint(0, 100, (1, tokens))
    start = time.perf_counter()
    stack, _ = pk.adapters.capture_huggingface_residual(model, input_ids=ids, query_key=True)
    capture_s = time.perf_counter() - start
    top = layers - 1
    time_it = lambda call: seconds_per_call(call, "cpu", min_runs=3, min_seconds=1.0, statistic="min")  # noqa: E731
    results = pk.score_decompositions(stack, top)
    found = pk.top_score_pairs(stack, top, 0, 20, key=3, time_limit=120)
    error = max(float((r.scores - r.model_scores).abs().max() / r.model_scores.abs().max()) for r in results)
    return {
        "layers": layers,
        "heads": heads,
        "d_model": width,
        "tokens": tokens,
        "init": init,
        "capture_s": capture_s,
        "all_heads_s": time_it(lambda: pk.score_decompositions(stack, top)),
        "one_head_s": time_it(lambda: pk.score_decomposition(stack, top, 0)),
        "groups": len(results[0].groups),
        "relative_error": error,
        "max_length": max_length,
        "query_side_s": time_it(lambda: pk.score_attribution(stack, top, 0, key=0, max_length=max_length)),
        "top_pairs_s": found.seconds,
        "certified": found.certified,
    }


def main(argv=None) -> int:
    description = "where heads look: scores as sums of path pairs"
    return bench_main(argv, description, "attention scores by pairs of paths", bench_case, COLUMNS, GRID, QUICK)


if __name__ == "__main__":
    sys.exit(main())
