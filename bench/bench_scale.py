"""Benchmark at the shapes circuit research runs on: GPT-2 small and XL, Llama-3.2-1B, Gemma-2-2B.

Each model is built from its config (random weights, Hugging Face's initialisation, float32, eager
attention so that the patterns are the model's own) and fed random tokens. Each case runs in a
process of its own, so that its peak resident memory is its own; every step records its time, the
machine's 1-minute load before it, the process's peak memory after it and its result, and the
results file is rewritten after every step (a case that dies still leaves what it reached). A step
that raises records the error; the case goes on unless a later step needs its value.

Cases and their targets (docs/BENCHMARKS.md, "Scale"):

- ``gpt2-xl``: 48 layers × 25 heads, d = 1600, 16 tokens: the top 20 paths of the top logit at the
  last token certified in ≤ 60 s.
- ``gpt2-long``: GPT-2 small (12 × 12, d = 768), 1,024 tokens: top 20 certified in ≤ 15 s, peak
  ≤ 4 GB.
- ``llama``: Llama-3.2-1B (16 layers × 32 heads, 8 key-value heads, d = 2048), 1,024 tokens,
  ``query_key=True``: the capture ≤ 3× the model's forward and peak ≤ 12 GB; the top 20 paths and
  every head of the last layer's ``score_decompositions`` at the last query (against the 16 keys
  the layer attends most there) within the budget (certified, or the gap stated at a 300 s time
  limit).
- ``llama-recomputed``: ``llama`` captured with ``patterns="recomputed"`` (no ``L·H·n²`` patterns
  held: each layer's recomputed from the queries and keys when read), the same targets.
- ``gemma``: Gemma-2-2B (26 layers × 8 heads, 4 key-value heads, d = 2304, head 256), 4,096 tokens,
  ``query_key=True``, ``patterns="recomputed"`` (its float32 patterns alone would be 14 GB beside
  10.5 GB of weights): the capture and one head's ``score_decomposition`` at the last query
  (against the 64 keys the layer attends most) within 24 GB; time stated. The model is released
  after the capture, as a user short of memory would (the capture keeps its unembedding). The top
  layer's head, then layer 3's (whose frozen model below it fits).

    python bench/bench_scale.py --out bench/results/scale-cpu-dev.json            # every case
    python bench/bench_scale.py --case llama --tokens 256 --out /tmp/scale.json  # one, shorter
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

CASES = {
    "gpt2-xl": {"family": "gpt2", "tokens": 16, "search_limit": 60.0,
                "config": {"n_layer": 48, "n_head": 25, "n_embd": 1600, "n_positions": 1024, "vocab_size": 50257},
                "targets": {"top_paths": {"seconds": 60, "certified": True}}},
    "gpt2-long": {"family": "gpt2", "tokens": 1024, "search_limit": 60.0,
                  "config": {"n_layer": 12, "n_head": 12, "n_embd": 768, "n_positions": 1024, "vocab_size": 50257},
                  "targets": {"top_paths": {"seconds": 15, "certified": True, "peak_gb": 4}}},
    "llama": {"family": "llama", "tokens": 1024, "search_limit": 300.0, "query_key": True, "score_heads": "all",
              "score_keys": 16,
              "config": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                         "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
                         "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": True},
              "targets": {"capture": {"forward_ratio": 3, "peak_gb": 12}, "top_paths": {"seconds": 300},
                          "score_decompositions": {"peak_gb": 12}}},
    "gemma": {"family": "gemma2", "tokens": 4096, "query_key": True, "score_heads": [0], "score_keys": 64,
              "patterns": "recomputed", "release_model": True, "next_token_only": True, "score_layers": [25, 3],
              "config": {"hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                         "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 256000,
                         "max_position_embeddings": 8192, "sliding_window": 4096, "query_pre_attn_scalar": 256},
              "targets": {"capture": {"peak_gb": 24}, "score_decompositions": {"peak_gb": 24}}},
}  # fmt: skip
CASES["llama-recomputed"] = {**CASES["llama"], "patterns": "recomputed"}


def build(case: dict):
    """The case's model, from its config, in float32 with eager attention, in eval mode."""
    import transformers

    torch.manual_seed(0)
    family = case["family"]
    config_class, model_class = {
        "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    }[family]
    config = config_class(**case["config"])
    config._attn_implementation = "eager"
    return model_class(config).eval()


def run_case(name: str, tokens: int | None, out: Path | None) -> None:
    """Run case ``name`` in this process, merging its steps into ``out`` after each one."""
    import pathkernels as pk
    from pathkernels.app.benchmarks import machine_description, peak_rss, reset_peak_rss

    case = CASES[name]
    tokens = tokens or case["tokens"]
    record = {"machine": machine_description("cpu"), "torch": torch.__version__, "tokens": tokens,
              "config": case["config"], "targets": case["targets"], "steps": {}}  # fmt: skip

    def save() -> None:
        if out is None:
            return
        everything = json.loads(out.read_text()) if out.exists() else {}
        everything.setdefault("cases", {})[name] = record
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(everything, indent=2))

    def step(label: str, work, needed: bool = False):
        """Time ``work()``; record its result (a dict) or its error; return its value, or None (a
        ``needed`` step's error ends the case: the later steps need its value)."""
        before, started = os.getloadavg()[0], time.monotonic()
        try:
            value, result = work()
        except Exception as error:  # recorded, then the case ends: a step the bench must report
            value, result = None, {"error": f"{type(error).__name__}: {str(error)[:600]}"}
        entry = {"seconds": round(time.monotonic() - started, 2), "peak_gb": round(peak_rss() / 1e9, 2),
                 "load_before": round(before, 2), **result}  # fmt: skip
        record["steps"][label] = entry
        print(f"{name} {label}: {json.dumps(entry)}", flush=True)
        save()
        if "error" in result and needed:
            raise SystemExit(1)
        return value

    reset_peak_rss()
    model = step("build", lambda: (build(case), {}), needed=True)
    vocabulary = case["config"]["vocab_size"]
    ids = torch.randint(0, vocabulary, (1, tokens), generator=torch.Generator().manual_seed(1))

    # The model as users call it; where every token's logits would not fit beside the capture (Gemma's
    # 4.2 GB at 4,096 tokens, with copies for its soft cap), the next token's alone, as generation does.
    keep = {"logits_to_keep": 1} if case.get("next_token_only") else {}

    def forward():
        with torch.no_grad():
            logits = model(ids, **keep).logits[0, -1]
        return int(logits.argmax()), {}

    target = step("forward", forward, needed=True)
    query_key = case.get("query_key", False)

    patterns = case.get("patterns", "held")
    record["patterns"] = patterns

    def capture():
        stack, _ = pk.adapters.capture_huggingface_residual(
            model, input_ids=ids, query_key=query_key, patterns=patterns
        )
        return stack, {}

    stack = step("capture", capture, needed=True)
    seconds = {label: record["steps"][label]["seconds"] for label in ("forward", "capture")}
    record["steps"]["capture"]["forward_ratio"] = round(seconds["capture"] / max(seconds["forward"], 0.01), 2)
    save()
    readout = pk.logit(model, target) if "search_limit" in case else None
    if case.get("release_model"):
        del model

    if "search_limit" in case:

        def search():
            top = pk.top_paths(stack, readout, top_k=20, time_limit=case["search_limit"])
            best = top.table()[0]["path"] if top.values.numel() else None
            return top, {"certified": top.certified, "gap": top.gap, "visited": top.visited, "total": top.total,
                         "stopped": top.stopped, "bound": top.bound_kind, "best": best}  # fmt: skip

        step("top_paths", search)

    for layer in case.get("score_layers", [stack.num_layers - 1] if "score_heads" in case else []):
        heads = None if case["score_heads"] == "all" else case["score_heads"]
        label = "score_decompositions" + ("" if layer == stack.num_layers - 1 else f"_L{layer}")

        def scores(layer=layer, heads=heads):
            # The keys the layer's heads attend most at the last token, on average: every key's table of
            # every head would be (G+1)² K float64 per head, 17 GB at Llama-3.2-1B's shape and 1,024 keys.
            weights = stack.residual_capture.patterns(stack.attn, 0, layer=layer)[:, -1].mean(0)  # one layer's
            keys = torch.topk(weights, min(case["score_keys"], tokens)).indices.sort().values.tolist()
            found = pk.score_decompositions(stack, layer, heads, keys=keys, progress=True)
            worst = max(float((d.scores - d.model_scores).abs().max()) for d in found)
            return found, {"heads": len(found), "groups": len(found[0].groups), "keys": int(found[0].keys.numel()),
                           "largest_score_error": worst}  # fmt: skip

        step(label, scores)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(CASES), action="append", help="default: every case, each in a process")
    parser.add_argument("--tokens", type=int, default=None, help="override the case's prompt length")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.case or list(CASES)
    if args.in_process:
        run_case(names[0], args.tokens, args.out)
        return 0
    failed = 0
    for name in names:
        command = [sys.executable, __file__, "--case", name, "--in-process"]
        for flag, value in (("--tokens", args.tokens), ("--threads", args.threads), ("--out", args.out)):
            if value is not None:
                command += [flag, str(value)]
        failed += subprocess.call(command) != 0
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
