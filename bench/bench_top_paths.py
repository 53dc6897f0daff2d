"""Benchmark of pk.top_paths, the certified best-first search for the top paths.

GPT-2-shaped models built from configs in float64 (12 heads, d = 768, 16 tokens, a logit
difference at the last token; biases N(0, 0.02²), LayerNorm γ from U(0.5, 1.5), the attention
weights N(0, σ²) with σ the case's "attn std", or as Hugging Face initialises them: N(0, 0.02²),
the output projection's scaled down by √(2L)). Each model with each bound (``chain``, the default;
``first_head``; ``plain``: docs/DESIGN.md, "The top paths, certified"). Per case: the search's
time, whether it certified the top 20, the paths it visited and their share of the tree, and the
bound still open against the 20th value. Cases of at most 10^7 paths also run the full
enumeration (pk.path_attribution) and check that both lists are identical.

    python bench/bench_top_paths.py            # about three minutes on 2 cores
    python bench/bench_top_paths.py --out bench/results/top-paths-cpu-dev.json
"""

from __future__ import annotations

import sys
import time

import torch

from pathkernels.app.benchmarks import bench_main

# (layers, attention weight std or None for Hugging Face's initialisation, time limit in seconds, bound)
MODELS = [(6, None, 600), (12, None, 600), (6, 0.02, 120), (12, 0.02, 120), (12, 0.1, 120)]
CASES = [(*model, bound) for model in MODELS for bound in ("chain", "first_head", "plain")]
ENUMERABLE = 10**7
COLUMNS = [
    ("L", "layers", ""),
    ("attn std", "attn_std", ""),
    ("bound", "bound_kind", "<"),
    ("paths", "paths", ".3g"),
    ("visited", "visited", ","),
    ("share", "share_visited", ".2e"),
    ("s", "seconds", ".1f"),
    ("certified", "certified", "<"),
    ("stopped", "stopped", "<"),
    ("open bound", "bound", ".3g"),
    ("20th", "kth_value", ".3g"),
    ("= enum.", "same_as_enumeration", "<"),
]


def gpt2_shaped(layers: int, attn_std: float | None):
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=layers, n_head=12, n_embd=768, vocab_size=1000, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config).double()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.02)
            elif "ln_" in name and name.endswith("weight"):
                parameter.uniform_(0.5, 1.5)
            elif attn_std is not None and "attn" in name and name.endswith("weight"):
                parameter.normal_(0, attn_std)
    return model


def bench_case(layers: int, attn_std: float | None, time_limit: float, bound: str, k: int = 20) -> dict:
    import pathkernels as pk

    model = gpt2_shaped(layers, attn_std)
    stack, _ = pk.adapters.capture_huggingface_residual(model, input_ids=torch.randint(0, 1000, (1, 16)))
    readout = pk.logit_diff(model, 1, 2)
    found = pk.top_paths(stack, readout, k, time_limit=time_limit, batch_nodes=8192, bound=bound)
    row = {
        "layers": layers,
        "attn_std": "HF init" if attn_std is None else attn_std,
        "bound_kind": bound,
        "paths": found.total,
        "visited": found.visited,
        "share_visited": found.visited / found.total,
        "seconds": found.seconds,
        "certified": found.certified,
        "stopped": found.stopped,
        "bound": found.bound,
        "kth_value": float(found.values[-1]),
        "gap": found.gap,
        "top": found.table(),
        "same_as_enumeration": "-",
    }
    if found.total <= ENUMERABLE:
        start = time.monotonic()
        every = pk.path_attribution(stack, readout, top_k=k, memory_budget=1 << 26)
        row["enumeration_seconds"] = time.monotonic() - start
        same = torch.equal(every.top_paths[:, 0, 0], found.paths) and torch.equal(
            every.top_sources[:, 0, 0], found.sources
        )
        same = same and torch.allclose(every.top_values[:, 0, 0], found.values, rtol=1e-12, atol=0)
        # A certified list must be enumeration's (NO would be a defect); an uncertified one need not.
        row["same_as_enumeration"] = "yes" if same else ("NO" if found.certified else "no (uncertified)")
    return row


def main(argv=None) -> int:
    return bench_main(
        argv, "pk.top_paths on GPT-2-shaped models", "top_paths (best-first, certified)", bench_case, COLUMNS, CASES
    )


if __name__ == "__main__":
    sys.exit(main())
