"""Chooses the engine's defaults on this card: the entries of pathkernels/core/engine_defaults.json.

For each n of CASES and fast off and on (float32): ``path_residuals`` of a complete tree with every
leaf-kernel candidate, with the CUDA graphs off and on (PATHKERNELS_CUDA_GRAPHS), each the best of
three calls after a warm-up, and each one's largest relative error of the residuals against the
float64 engine on the same tree. The rule (:func:`choose`): a candidate replaces "fused" only when
it is accurate enough (float32: within 1e-6 relative of float64; fast: within twice the error of
"fused" with fast) and at least ``MIN_SPEEDUP`` times faster; graphs are kept where they make the
chosen kernel that much faster too. Then ``path_statistics`` with the chosen kernel, the torch
fold against the Triton fold (PATHKERNELS_STATISTICS_FOLD; the counts must agree), and the engine's
internal levels per head against all heads at once (PATHKERNELS_ENGINE_LEVELS), each kept where it
is that much faster. Each case is written to --out as soon as it is measured.

    python bench/bench_engine_choices.py [--quick] --out bench/results/<card>-<date>/engine_defaults.json
    python bench/bench_engine_choices.py --device cpu --out /tmp/choices.json   # a dry run (tiny trees)

Then copy the entries of this card family over those in pathkernels/core/engine_defaults.json and
commit them with the results folder they name.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path
from unittest import mock

import torch

import pathkernels as pk
from pathkernels.app.benchmarks import seconds_per_call
from pathkernels.testing import random_attention

# (layers, heads, n): about 10^6 leaves at n ≤ 64, 10^5 at n = 128 (no skip).
CASES = [(6, 10, 32), (6, 10, 64), (5, 10, 128)]
QUICK_CASES = [(5, 10, 32), (5, 10, 64), (4, 10, 128)]
DRY_RUN_CASES = [(3, 3, 8), (3, 3, 16)]
FLOAT32_ACCURATE = 1e-6
FAST_ERROR_FACTOR = 2.0
MIN_SPEEDUP = 1.2


def candidates() -> list[str]:
    """The leaf kernels to time: every name path_residuals takes but "auto" (Triton's where installed)."""
    names = ["fused", "tensor", "gemm", "heads", "heads_128"]
    if importlib.util.find_spec("triton") is not None:
        names.append("triton")
    return names


def with_environment(**variables):
    """A context in which the environment has ``variables`` (the engine's switches)."""
    return mock.patch.dict(os.environ, variables)


def largest_relative_error(result, truth) -> float:
    return ((result.residual.double() - truth.residual) / truth.residual).abs().max().item()


def measure(attn, tree, leaf_kernel: str, fast: bool, graphs: bool, truth, device: str) -> dict:
    """One candidate: ``{"seconds", "error"}``, or ``{"error_message"}`` where it refuses or fails."""
    call = lambda: pk.path_residuals(attn, tree, leaf_kernel=leaf_kernel, fast=fast)  # noqa: E731
    try:
        with with_environment(PATHKERNELS_CUDA_GRAPHS="1" if graphs else "0"):
            result = call()  # warm-up: autotuning, graph capture, cuBLAS handles
            seconds = seconds_per_call(call, device, min_runs=3, min_seconds=0.0, statistic="min")
    except (RuntimeError, ValueError) as error:
        return {"error_message": f"{type(error).__name__}: {error}"[:300]}
    return {"seconds": seconds, "error": largest_relative_error(result, truth)}


def choose(measurements: dict, fast: bool) -> dict:
    """The rule, on ``measurements[f"{kernel}|graphs={0|1}"] = {"seconds", "error"}``: the fastest
    accurate candidate if it beats "fused" (graphs off) by ``MIN_SPEEDUP``, else "fused"; then the
    graphs if they make that choice ``MIN_SPEEDUP`` times faster. Returns ``{"leaf_kernel",
    "graphs", "speedup", "bound"}``."""
    baseline = measurements["fused|graphs=0"]
    if "seconds" not in baseline:  # the SIMT kernel itself failed: nothing to compare against
        return {"leaf_kernel": "fused", "graphs": False, "speedup": 1.0, "bound": FLOAT32_ACCURATE}
    bound = FAST_ERROR_FACTOR * baseline["error"] if fast else FLOAT32_ACCURATE
    accurate = {
        key: value
        for key, value in measurements.items()
        if "seconds" in value and value["error"] <= bound and key.endswith("graphs=0")
    }
    best = min(accurate, key=lambda key: accurate[key]["seconds"], default="fused|graphs=0")
    if baseline["seconds"] < MIN_SPEEDUP * accurate.get(best, baseline)["seconds"]:
        best = "fused|graphs=0"
    kernel = best.split("|")[0]
    with_graphs = measurements.get(f"{kernel}|graphs=1", {})
    graphs = (
        "seconds" in with_graphs
        and with_graphs["error"] <= bound
        and measurements[best]["seconds"] >= MIN_SPEEDUP * with_graphs["seconds"]
    )
    chosen = with_graphs if graphs else measurements[best]
    return {
        "leaf_kernel": kernel,
        "graphs": bool(graphs),
        "speedup": baseline["seconds"] / chosen["seconds"],
        "bound": bound,
    }


def fold_and_levels(attn, tree, leaf_kernel: str, truth, bound: float, device: str) -> dict:
    """path_statistics with each fold (their counts compared) and path_residuals with each level
    mode (their errors against ``truth`` within ``bound``), for the chosen kernel: ``{"statistics_fold",
    "fold_seconds", "folds_agree", "engine_levels", "levels_seconds", "levels_errors"}``."""
    fold_seconds, counts = {}, {}
    folds = ["torch", "triton"] if importlib.util.find_spec("triton") is not None and device == "cuda" else ["torch"]
    for fold in folds:
        with with_environment(PATHKERNELS_STATISTICS_FOLD=fold):
            try:
                counts[fold] = pk.path_statistics(attn, tree, leaf_kernel=leaf_kernel).counts
                fold_seconds[fold] = seconds_per_call(
                    lambda: pk.path_statistics(attn, tree, leaf_kernel=leaf_kernel),
                    device,
                    min_runs=2,
                    min_seconds=0.0,
                    statistic="min",
                )
            except (RuntimeError, ValueError) as error:
                fold_seconds[fold] = f"{type(error).__name__}: {error}"[:300]
    timed = {fold: s for fold, s in fold_seconds.items() if isinstance(s, float)}
    agree = all(torch.equal(counts[fold].cpu(), counts["torch"].cpu()) for fold in counts)
    fold = "torch"
    if agree and "triton" in timed and "torch" in timed and timed["torch"] >= MIN_SPEEDUP * timed["triton"]:
        fold = "triton"
    levels_seconds, levels_errors = {}, {}
    for levels in ("per_head", "all_heads"):
        with with_environment(PATHKERNELS_ENGINE_LEVELS=levels, PATHKERNELS_CUDA_GRAPHS="0"):
            call = lambda: pk.path_residuals(attn, tree, leaf_kernel=leaf_kernel)  # noqa: E731
            levels_errors[levels] = largest_relative_error(call(), truth)
            levels_seconds[levels] = seconds_per_call(call, device, min_runs=3, min_seconds=0.0, statistic="min")
    all_heads = (
        levels_errors["all_heads"] <= bound and levels_seconds["per_head"] >= MIN_SPEEDUP * levels_seconds["all_heads"]
    )
    return {
        "statistics_fold": fold,
        "fold_seconds": fold_seconds,
        "folds_agree": agree,
        "engine_levels": "all_heads" if all_heads else "per_head",
        "levels_seconds": levels_seconds,
        "levels_errors": levels_errors,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="trees of about 10^5 leaves")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a dry run on tiny trees")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.device == "cuda":
        assert torch.cuda.is_available() and pk.build_info()["cuda"], "needs a GPU and pathkernels built with CUDA"
        card, capability = torch.cuda.get_device_name(), torch.cuda.get_device_capability()[0]
    else:
        card, capability = "CPU (dry run)", 0
    cases = DRY_RUN_CASES if args.device == "cpu" else QUICK_CASES if args.quick else CASES
    try:
        source = str(args.out.resolve().parent.relative_to(Path(__file__).resolve().parents[1]))
    except ValueError:
        source = str(args.out.resolve().parent)
    report = {"card": card, "torch": torch.__version__, "rule": choose.__doc__, "entries": [], "measurements": []}
    for layers, heads, n in cases:
        attn = random_attention(1, layers, heads, n, n, device=args.device, generator=torch.Generator().manual_seed(n))
        tree = pk.PathTree.complete(layers, heads)
        truth = pk.path_residuals(attn.double() / attn.double().sum(-1, keepdim=True), tree)
        for fast in (False, True):
            if fast and args.device == "cpu":
                continue  # fast is CUDA's
            measurements = {
                f"{kernel}|graphs={int(graphs)}": measure(attn, tree, kernel, fast, graphs, truth, args.device)
                for kernel in candidates()
                for graphs in (False, True)
            }
            chosen = choose(measurements, fast)
            extra = {}
            if not fast:  # the fold and the levels for float32 accuracy (the table reads them there)
                extra = fold_and_levels(attn, tree, chosen["leaf_kernel"], truth, chosen["bound"], args.device)
            report["measurements"].append(
                {"layers": layers, "heads": heads, "n": n, "fast": fast, "candidates": measurements, **chosen, **extra}
            )
            report["entries"].append(
                {
                    "capability": capability,
                    "dtype": "float32",
                    "fast": fast,
                    "n_max": n,
                    "leaf_kernel": chosen["leaf_kernel"],
                    "graphs": chosen["graphs"],
                    "statistics_fold": extra.get("statistics_fold", "torch"),
                    "engine_levels": extra.get("engine_levels", "per_head"),
                    "card": card,
                    "source": source,
                    "why": f"L = {layers}, H = {heads}, n = {n}: {chosen['speedup']:.2f} times 'fused' at error "
                    f"bound {chosen['bound']:.1e} (bench/bench_engine_choices.py)",
                }
            )
            print(
                f"n = {n}, fast = {fast}: {chosen['leaf_kernel']}, graphs {chosen['graphs']}, "
                f"{chosen['speedup']:.2f}x fused" + (f", fold {extra['statistics_fold']}" if extra else ""),
                flush=True,
            )
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
