"""Benchmark of paths through transcoder features at the GPT-2-small shape.

A GPT-2 of 12 layers × 12 heads, d = 768, built from its config (Hugging Face's initialisation,
float32, as users hold it), on 64 random tokens, with a random JumpReLU transcoder of 24,576
features per layer of which about 64 are active per token (``pk.adapters.random_transcoders(...,
density=64 / 24576)``). Each step is timed with the machine's load before it and the process's peak
memory after it:

- the capture with the set (``capture_huggingface_residual(..., transcoders=)``), and the model's own
  forward beside it;
- the top 20 paths of the top logit at the last token, through heads and features (``pk.top_paths``,
  the chain bound; a time limit of 60 s: certified, or the gap stated);
- the attribution graph (``pk.attribution_graph``) of the ``--max-feature-nodes`` features of most
  influence, pruned, and written as Neuronpedia's JSON with the ``--linked`` largest links split into
  their top 3 chains of heads (the certified search per link).

    python bench/bench_transcoders.py --out bench/results/transcoders-cpu-dev.json
    python bench/bench_transcoders.py --features 4096 --tokens 16   # a quicker shape
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import tempfile
import time
from pathlib import Path

import torch


def peak_gb() -> float:
    """The process's peak resident memory so far, in GB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def load() -> float:
    return os.getloadavg()[0]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--features", type=int, default=24576)
    parser.add_argument("--active", type=float, default=64, help="features active per token, on average")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--time-limit", type=float, default=60.0, help="the top paths' search")
    parser.add_argument("--max-feature-nodes", type=int, default=2048)
    parser.add_argument("--linked", type=int, default=20, help="links written with their top 3 chains of heads")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    import pathkernels as pk

    record = {
        "machine": {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__},
        "shape": {"layers": args.layers, "heads": 12, "d_model": 768, "tokens": args.tokens,
                  "features": args.features, "active_per_token": args.active},
        "steps": {},
    }  # fmt: skip

    def step(name: str, started: float, **values) -> None:
        record["steps"][name] = {"seconds": round(time.monotonic() - started, 2), "peak_gb": round(peak_gb(), 2),
                                 "load_before": round(values.pop("load_before"), 2), **values}  # fmt: skip
        print(name, json.dumps(record["steps"][name]), flush=True)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(record, indent=2))

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=args.layers, n_head=12, n_embd=768, vocab_size=50257, n_positions=1024)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 50257, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    generator = torch.Generator().manual_seed(2)
    transcoders = pk.adapters.random_transcoders(
        args.layers, 768, args.features, density=args.active / args.features, dtype=torch.float32, generator=generator
    )

    before, started = load(), time.monotonic()
    with torch.no_grad():
        logits = model(ids).logits
    step("forward", started, load_before=before)

    before, started = load(), time.monotonic()
    stack, capture = pk.adapters.capture_huggingface_residual(model, input_ids=ids, transcoders=transcoders)
    active = {layer: int(r.features.numel()) for layer, r in capture.transcoders.layers.items()}
    per_token = sum(float(r.gates.sum()) for r in capture.transcoders.layers.values()) / (args.layers * args.tokens)
    step("capture", started, load_before=before, active_features=active, mean_active_per_token=round(per_token, 1))

    target = int(logits[0, -1].argmax())
    before, started = load(), time.monotonic()
    top = pk.top_paths(stack, pk.logit(model, target), top_k=20, time_limit=args.time_limit)
    step("top_paths", started, load_before=before, certified=top.certified, gap=top.gap, visited=top.visited,
         total=top.total, bound=top.bound, found=int(top.values.numel()),
         kth=float(top.values[-1]) if top.values.numel() else None, stopped=top.stopped,
         best=top.table()[0]["path"] if top.values.numel() else None)  # fmt: skip

    before, started = load(), time.monotonic()
    graph = pk.attribution_graph(stack, max_feature_nodes=args.max_feature_nodes, memory_budget=8 << 30)
    exact = float((graph.adjacency.sum(1) + graph.constant - graph.values).abs().max())
    step("graph", started, load_before=before, nodes=graph.num_nodes, active_features=graph.active_features,
         nonzero_edges=int((graph.adjacency != 0).sum()), rows_exact_to=exact)  # fmt: skip

    before, started = load(), time.monotonic()
    with tempfile.TemporaryDirectory() as folder:
        path = graph.save_neuronpedia(folder, "bench", paths_per_link=3, linked=args.linked)
        document = json.loads(Path(path).read_text())
    chained = [link for link in document["links"] if "pathkernels_paths" in link]
    step("neuronpedia_with_chains", started, load_before=before, links=len(document["links"]),
         links_with_chains=len(chained), certified=sum(link["pathkernels_certified"] for link in chained))  # fmt: skip


if __name__ == "__main__":
    main()
