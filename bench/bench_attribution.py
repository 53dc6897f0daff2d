"""Benchmark of pk.path_attribution: the readout trie on the C++ readout engine, against the same
trie with its steps in plain PyTorch (einsums: pathkernels.reference.readout_values_ref and
readout_heads_ref) and against the plain way of computing the same attributions (each path's term
materialised, ``rᵀ (A D)⋯ K (C Γ W_V W_O)⋯ v``, one path at a time:
pathkernels.reference.pre_norm_path_attribution_ref).

GPT-2-shaped models built from configs in float64 (random weights, random biases and norm
parameters), one sequence, a logit difference read at the last token. Reported per case: the
paths, the engine's time (best of several calls) and paths per second, the PyTorch trie's time and
the engine's speed-up over it, the plain loop's time per path on a sample of paths, extrapolated to
the whole set, and the speed-up over that.

    python bench/bench_attribution.py                 # the grid, about two minutes on 2 cores
    python bench/bench_attribution.py --quick
    python bench/bench_attribution.py --out bench/results/attribution-cpu-dev.json
"""

from __future__ import annotations

import sys

import torch

from pathkernels.app.benchmarks import bench_main, seconds_per_call

# (layers, heads, d_model, tokens, max_length or None for every path)
GRID = [
    (4, 8, 64, 16, None),
    (6, 8, 64, 16, None),
    (7, 8, 64, 16, None),
    (6, 12, 768, 16, 2),
    (12, 12, 768, 16, 2),
    (12, 12, 768, 16, 3),
]
QUICK = [(4, 8, 64, 16, None)]
LOOP_SAMPLE = 64
COLUMNS = [
    ("L", "layers", ""),
    ("H", "heads", ""),
    ("d", "d_model", ""),
    ("n", "tokens", ""),
    ("max len", "max_length", ""),
    ("paths", "paths", ","),
    ("engine s", "trie_s", ".3f"),
    ("paths/s", "paths_per_s", ".3g"),
    ("torch trie s", "torch_trie_s", ".3f"),
    ("vs torch trie", "speedup_vs_torch_trie", ".1f", "x"),
    ("loop s (est.)", "loop_s_estimated", ".1f"),
    ("vs loop", "speedup_vs_loop", ".0f", "x"),
]


def gpt2_model(layers: int, heads: int, width: int, tokens: int):
    import transformers

    config = transformers.GPT2Config(
        n_layer=layers, n_head=heads, n_embd=width, vocab_size=100, n_positions=tokens, initializer_range=0.3
    )
    model = transformers.GPT2LMHeadModel(config).double()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.5)
            elif "ln_" in name and name.endswith("weight"):
                parameter.uniform_(0.5, 1.5)
    return model


def case_columns(layers: int, heads: int, width: int, tokens: int, max_length: int | None, paths: int) -> dict:
    """A case's first columns (:data:`COLUMNS`' first six), shared with bench_model_paths.py."""
    return {
        "layers": layers,
        "heads": heads,
        "d_model": width,
        "tokens": tokens,
        "max_length": "all" if max_length is None else max_length,
        "paths": paths,
    }


def plain_loop(stack, capture, result, sample: int) -> float:
    """Seconds per path of the plain way, timed on ``sample`` of the paths the trie kept (each term
    costs the same whatever its source, so the embedding stands for every source)."""
    from pathkernels.reference import pre_norm_path_attribution_ref

    attn = capture.patterns(stack.attn, 0)
    maps = (attn, capture.norm_scale[0, :, 0], capture.norm_weight[:, 0], stack.w_v.double(), stack.w_o.double())
    position = int(result.positions[0])
    r = torch.zeros(attn.shape[-1], dtype=torch.float64)
    r[position] = capture.final_scale[0, position]
    v = torch.randn(stack.d_model, dtype=torch.float64)
    picks = torch.randperm(result.paths.shape[0])[:sample].tolist()

    def run():
        for index in picks:
            pre_norm_path_attribution_ref(*maps, capture.embedding[0], result.paths[index].tolist(), r, v)

    return seconds_per_call(run, "cpu", min_runs=1, min_seconds=0, statistic="min") / len(picks)


def bench_case(layers: int, heads: int, width: int, tokens: int, max_length: int | None) -> dict:
    import pathkernels as pk
    from pathkernels.adapters.residual import capture_huggingface_residual
    from pathkernels.analysis.attribution import attribute, read_out
    from pathkernels.analysis.readout_trie import ReadoutSteps
    from pathkernels.core.paths import count_attribution_paths
    from pathkernels.core.planner import DEFAULT_MEMORY_BUDGET
    from pathkernels.reference import readout_expand_ref, readout_heads_ref, readout_values_ref

    torch.manual_seed(0)
    model = gpt2_model(layers, heads, width, tokens)
    stack, capture = capture_huggingface_residual(model, input_ids=torch.randint(0, 100, (1, tokens)))
    readout = pk.logit_diff(model, 1, 2)
    paths = count_attribution_paths(layers, heads, layers if max_length is None else max_length)
    trie_s = seconds_per_call(
        lambda: pk.path_attribution(stack, readout, max_length=max_length, top_k=20),
        "cpu",
        min_runs=3,
        min_seconds=1.0,
        statistic="min",
    )
    setup = read_out(stack, readout, None, 0, max_length, "bench")
    torch_steps = ReadoutSteps(readout_values_ref, readout_heads_ref, readout_expand_ref)
    torch_trie_s = seconds_per_call(
        lambda: attribute(setup, 20, DEFAULT_MEMORY_BUDGET, steps=torch_steps, low_rank=False),
        "cpu",
        min_runs=3,
        min_seconds=1.0,
        statistic="min",
    )
    # A run that keeps every path's label, for the loop's sample (a budget just large enough).
    budget = max(1 << 26, 5 * paths * 8 * (layers + 2))
    kept = pk.path_attribution(stack, readout, max_length=max_length, top_k=0, memory_budget=budget)
    loop_per_path = plain_loop(stack, capture, kept, LOOP_SAMPLE)
    return {
        **case_columns(layers, heads, width, tokens, max_length, paths),
        "trie_s": trie_s,
        "paths_per_s": paths / trie_s,
        "torch_trie_s": torch_trie_s,
        "speedup_vs_torch_trie": torch_trie_s / trie_s,
        "loop_s_per_path": loop_per_path,
        "loop_s_estimated": loop_per_path * paths,
        "speedup_vs_loop": loop_per_path * paths / trie_s,
    }


def main(argv=None) -> int:
    description = "pk.path_attribution against the plain per-path computation"
    return bench_main(argv, description, "path attribution (readout engine)", bench_case, COLUMNS, GRID, QUICK)


if __name__ == "__main__":
    sys.exit(main())
