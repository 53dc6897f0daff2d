"""Benchmark of pk.top_paths, the certified best-first search for the top paths.

Two kinds of models, in float64, the top 20 of a logit difference:

- GPT-2-shaped models built from configs (12 heads, d = 768, 16 tokens, at the last token; biases
  N(0, 0.02²), LayerNorm γ from U(0.5, 1.5), the attention weights N(0, σ²) with σ the case's
  "attn std", or as Hugging Face initialises them: N(0, 0.02²), the output projection's scaled down
  by √(2L)). At std 0.1 the heads attend sharply (logits of std about 8).
- The trained fixtures (``pathkernels.fixtures``: attn_only_2l, gpt2_4l, llama_2l), at a repeated
  position of their example sequence, the logit of the token induction predicts against the
  runner-up.

Each model with each bound (``node``, the default; ``chain``; ``first_head``; ``plain``:
docs/DESIGN.md, "The top paths, certified"). Per case: the search's time, whether it certified the
top 20, the paths it visited and their share of the tree, the nodes it expanded, and the bound still
open against the 20th value; with the machine's load average (1 min) before and after the case.
Cases of at most 10^7 paths also run the full enumeration (pk.path_attribution) and check that both
lists are identical.

    python bench/bench_top_paths.py                           # every case, about ten minutes on 2 cores
    python bench/bench_top_paths.py --deeper                  # sharper and deeper models instead
    python bench/bench_top_paths.py --only "L12 std 0.1"      # the cases whose name contains this
    python bench/bench_top_paths.py --threads 1 --out bench/results/top-paths-cpu-dev.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from pathkernels.app.benchmarks import run_cases

BOUNDS = ("node", "chain", "first_head", "plain")
# (name, model, time limit in seconds): ("gpt2", layers, attention weight std or None for Hugging Face's
# initialisation) or ("fixture", name)
MODELS = [
    ("attn_only_2l", ("fixture", "attn_only_2l"), 60),
    ("gpt2_4l", ("fixture", "gpt2_4l"), 60),
    ("llama_2l", ("fixture", "llama_2l"), 60),
    ("L6 HF init", ("gpt2", 6, None), 300),
    ("L12 HF init", ("gpt2", 12, None), 300),
    ("L6 std 0.02", ("gpt2", 6, 0.02), 120),
    ("L12 std 0.02", ("gpt2", 12, 0.02), 120),
    ("L6 std 0.1", ("gpt2", 6, 0.1), 120),
    ("L12 std 0.1", ("gpt2", 12, 0.1), 300),
]
# Sharper and deeper (--deeper), with the bound per node and the chain bound only
DEEPER = [("L12 std 0.5", ("gpt2", 12, 0.5), 300), ("L24 std 0.1", ("gpt2", 24, 0.1), 300)]
CASES = [(name, model, limit, bound) for name, model, limit in MODELS for bound in BOUNDS]
DEEPER_CASES = [(name, model, limit, bound) for name, model, limit in DEEPER for bound in ("node", "chain")]
ENUMERABLE = 10**7
COLUMNS = [
    ("model", "model", "<"),
    ("bound", "bound_kind", "<"),
    ("paths", "paths", ".3g"),
    ("visited", "visited", ","),
    ("share", "share_visited", ".2e"),
    ("expanded", "expanded", ","),
    ("s", "seconds", ".1f"),
    ("certified", "certified", "<"),
    ("stopped", "stopped", "<"),
    ("open bound", "bound", ".3g"),
    ("20th", "kth_value", ".3g"),
    ("= enum.", "same_as_enumeration", "<"),
    ("load", "load", "<"),
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


def captured(model_spec):
    """``(stack, readout, position)`` of a case's model."""
    import pathkernels as pk

    if model_spec[0] == "gpt2":
        model = gpt2_shaped(*model_spec[1:])
        stack, _ = pk.adapters.capture_huggingface_residual(model, input_ids=torch.randint(0, 1000, (1, 16)))
        return stack, pk.logit_diff(model, 1, 2), None
    from pathkernels.fixtures import load_fixture, repeated_positions

    model, inputs = load_fixture(model_spec[1])
    ids = inputs["input_ids"]
    stack, _ = pk.adapters.capture_huggingface_residual(model, input_ids=ids)
    positions = torch.nonzero(repeated_positions(ids)[0]).flatten()
    position = int(positions[len(positions) // 2])
    target = int(ids[0, position + 1])
    logits = model(input_ids=ids).logits[0, position].detach()
    runner_up = int(logits.topk(2).indices[1]) if int(logits.argmax()) == target else int(logits.argmax())
    return stack, pk.logit_diff(model, target, runner_up), position


def bench_case(name: str, model_spec, time_limit: float, bound: str, k: int = 20) -> dict:
    import pathkernels as pk

    torch.manual_seed(0)
    stack, readout, position = captured(model_spec)
    load_before = os.getloadavg()[0]
    found = pk.top_paths(stack, readout, k, position=position, time_limit=time_limit, batch_nodes=8192, bound=bound)
    row = {
        "model": name,
        "layers": stack.num_layers,
        "heads": stack.num_heads,
        "d_model": stack.d_model,
        "attn_std": ("HF init" if model_spec[2] is None else model_spec[2]) if model_spec[0] == "gpt2" else "trained",
        "bound_kind": bound,
        "paths": found.total,
        "visited": found.visited,
        "share_visited": found.visited / found.total,
        "expanded": found.expanded,
        "seconds": found.seconds,
        "certified": found.certified,
        "stopped": found.stopped,
        "bound": found.bound,
        "kth_value": float(found.values[-1]),
        "gap": found.gap,
        "top": found.table(),
        "same_as_enumeration": "-",
        "load": f"{load_before:.1f}/{os.getloadavg()[0]:.1f}",
        "threads": torch.get_num_threads(),
    }
    if found.total <= ENUMERABLE:
        start = time.monotonic()
        every = pk.path_attribution(stack, readout, positions=position, top_k=k, memory_budget=1 << 26)
        row["enumeration_seconds"] = time.monotonic() - start
        same = torch.equal(every.top_paths[:, 0, 0], found.paths) and torch.equal(
            every.top_sources[:, 0, 0], found.sources
        )
        same = same and torch.allclose(every.top_values[:, 0, 0], found.values, rtol=1e-12, atol=0)
        # A certified list must be enumeration's (NO would be a defect); an uncertified one need not.
        row["same_as_enumeration"] = "yes" if same else ("NO" if found.certified else "no (uncertified)")
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="pk.top_paths on GPT-2-shaped models and the trained fixtures")
    parser.add_argument("--only", action="append", help="run the cases whose model or bound contains this (repeatable)")
    parser.add_argument("--deeper", action="store_true", help="the sharper and deeper models instead")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cases = [
        c
        for c in (DEEPER_CASES if args.deeper else CASES)
        if not args.only or any(o in f"{c[0]} {c[3]}" for o in args.only)
    ]
    run_cases(cases, bench_case, COLUMNS, "top_paths (best-first, certified)", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
