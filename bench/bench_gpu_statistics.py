"""GPU benchmark of exact path statistics at scale, float32, one GPU.

1. ``path_statistics`` on complete trees of H = 10 heads, n = 64, with each leaf kernel
   ("fused" = SIMT, "tensor" = tf32x3, "heads" = the all-heads kernel, "triton" its Triton
   candidate) and each GPU fold of the chunks (torch ops, or the Triton fold:
   PATHKERNELS_STATISTICS_FOLD): paths per second at 10^7 paths (L = 7; 10^8 with --full), the
   Triton fold's statistics against the torch fold's of the same leaf kernel (equal but for the
   sums' order), and the time the best rate predicts for 10^10 (L = 10); with
   --full, 10^9 paths (L = 9) with the fastest pair, then the 10^10 tree itself when its prediction
   is within --limit seconds.
2. The checkpoint: a child process streams a 10^8-path tree with a checkpoint every second and is
   killed halfway; a fresh process resumes from the folder. The resumed statistics must equal an
   uninterrupted run's exactly (counts, sums, extremes, histograms).

    python bench/bench_gpu_statistics.py [--full] [--limit S] --out bench/results/<folder>/gpu_statistics.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

import pathkernels as pk
from pathkernels.testing import random_attention, statistics_difference

HEADS, N = 10, 64
KERNELS = ("fused", "tensor", "heads", "triton")
FOLDS = ("torch", "triton")


def fold(name: str):
    """path_statistics' GPU fold set to ``name`` (PATHKERNELS_STATISTICS_FOLD) within the block."""
    return mock.patch.dict(os.environ, {"PATHKERNELS_STATISTICS_FOLD": name})


def network(layers: int):
    return random_attention(1, layers, HEADS, N, N, device="cuda", generator=torch.Generator().manual_seed(layers))


def timed_statistics(layers: int, **options) -> tuple[float, pk.PathStatistics]:
    attn = network(layers)
    tree = pk.PathTree.complete(layers, HEADS)
    torch.cuda.synchronize()
    start = time.perf_counter()
    stats = pk.path_statistics(attn, tree, **options)
    torch.cuda.synchronize()
    return time.perf_counter() - start, stats


def same_statistics(a: pk.PathStatistics, b: pk.PathStatistics) -> bool:
    """Bitwise equality of everything the two results save (their :meth:`~pk.PathStatistics.state`)."""

    def same(x, y) -> bool:
        if isinstance(x, torch.Tensor):
            return torch.equal(x, y)
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(same(x[key], y[key]) for key in x)
        return x == y

    first, second = a.state(), b.state()
    return first.keys() == second.keys() and all(same(first[name], second[name]) for name in first)


def checkpoint_case(layers: int, kernel: str, fold_name: str) -> dict:
    """Kill a checkpointing child halfway, resume in this process, compare with an uninterrupted run."""
    with fold(fold_name):
        full_seconds, whole = timed_statistics(layers, leaf_kernel=kernel)
    row = {"layers": layers, "paths": HEADS**layers, "leaf_kernel": kernel, "fold": fold_name}
    row["uninterrupted_s"] = full_seconds
    with tempfile.TemporaryDirectory() as folder:
        child = [sys.executable, __file__, "--child", folder, "--layers", str(layers), "--kernel", kernel]
        process = subprocess.Popen(child + ["--fold", fold_name])
        time.sleep(max(8.0, 0.5 * full_seconds + 6.0))  # start-up, then about half the stream
        row["child_done_before_kill"] = process.poll() is not None  # then the resume resumed nothing
        process.kill()
        process.wait()
        row["files_at_kill"] = sorted(p.name for p in Path(folder).rglob("*") if p.is_file())
        with fold(fold_name):
            seconds, resumed = timed_statistics(layers, leaf_kernel=kernel, checkpoint=folder, checkpoint_every=1.0)
    row["resumed_s"] = seconds
    row["equal_to_uninterrupted"] = same_statistics(whole, resumed)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--full", action="store_true", help="also 10^9 paths, and 10^10 if predicted within --limit")
    parser.add_argument("--limit", type=float, default=180.0)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--kernel", default="fused", help=argparse.SUPPRESS)
    parser.add_argument("--fold", default="torch", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:  # the process that is killed halfway
        with fold(args.fold):
            timed_statistics(args.layers, leaf_kernel=args.kernel, checkpoint=args.child, checkpoint_every=1.0)
        return 0
    assert torch.cuda.is_available() and pk.build_info()["cuda"], "needs a GPU and pathkernels built with CUDA"
    card = torch.cuda.get_device_name()
    result = {"card": card, "torch": torch.__version__, "build": pk.build_info(), "heads": HEADS, "n": N}

    def save():
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")

    timed_statistics(3)  # warm-up: the build's first launches, cuBLAS handles
    rate_layers = 8 if args.full else 7  # --quick: the rates at 10^7 paths, each kernel with each fold
    rates = {}
    for kernel in KERNELS:
        by_fold = {}
        for fold_name in FOLDS:
            name = f"{kernel}, {fold_name} fold"
            try:
                with fold(fold_name):
                    seconds, by_fold[fold_name] = timed_statistics(rate_layers, leaf_kernel=kernel)
            except Exception as error:  # a kernel or fold that fails is recorded, the rest goes on
                result[f"{name}_error"] = f"{type(error).__name__}: {error}"
                print(f"10^{rate_layers}, {name}: {result[f'{name}_error']}", flush=True)
                continue
            rate = rates[kernel, fold_name] = HEADS**rate_layers / seconds
            result[f"rate_{kernel}_{fold_name}"] = {
                "paths": HEADS**rate_layers,
                "seconds": seconds,
                "paths_per_s": rate,
            }
            print(f"10^{rate_layers} paths, {name}: {seconds:.2f} s, {rate:.3g} paths/s", flush=True)
            save()
        if len(by_fold) == 2:  # the Triton fold against the torch fold, on the same leaves
            difference = statistics_difference(by_fold["triton"], by_fold["torch"])
            result[f"triton_fold_vs_torch_{kernel}"] = difference
            print(f"  {kernel}: Triton fold vs torch fold: {difference}", flush=True)
            if not difference["equal"] or difference["max_relative_sums"] > 1e-12:
                rates.pop((kernel, "triton"))  # a fold that disagrees is not chosen
        save()
    best_kernel, best_fold = max(rates, key=rates.get)
    result["best"] = {"leaf_kernel": best_kernel, "fold": best_fold}
    result["predicted_ten_billion_s"] = HEADS**10 / rates[best_kernel, best_fold]
    print(f"10^10 paths predicted from 10^{rate_layers}: {result['predicted_ten_billion_s']:.0f} s", flush=True)
    result["checkpoint"] = checkpoint_case(8, best_kernel, best_fold)
    print(f"checkpoint: {result['checkpoint']}", flush=True)
    save()
    if not args.full:
        return 0 if result["checkpoint"]["equal_to_uninterrupted"] else 1

    def best_run(layers: int) -> dict:
        """10^layers paths with the fastest leaf kernel and fold."""
        with fold(best_fold):
            seconds, _ = timed_statistics(layers, leaf_kernel=best_kernel, progress=True)
        return {
            "seconds": seconds,
            "leaf_kernel": best_kernel,
            "fold": best_fold,
            "paths_per_s": HEADS**layers / seconds,
        }

    torch.cuda.reset_peak_memory_stats()
    billion = result["billion"] = best_run(9)
    billion |= {
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "predicted_ten_billion_s": 10 * billion["seconds"],
    }
    print(
        f"10^9 paths, {best_kernel}, {best_fold} fold: {billion['seconds']:.1f} s; "
        f"10^10 predicted {billion['predicted_ten_billion_s']:.0f} s",
        flush=True,
    )
    save()
    if billion["predicted_ten_billion_s"] <= args.limit:
        result["ten_billion"] = best_run(10)
        print(f"10^10 paths, {best_kernel}, {best_fold} fold: {result['ten_billion']['seconds']:.1f} s", flush=True)
        save()
    return 0 if result["checkpoint"]["equal_to_uninterrupted"] else 1


if __name__ == "__main__":
    sys.exit(main())
