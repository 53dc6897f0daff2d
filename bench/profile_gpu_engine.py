"""Where the CUDA engine spends its time: torch.profiler over one call of each.

For ``path_residuals`` on a complete tree (L = 6, H = 10, n = 64, float32) with each leaf kernel
(the all-heads candidates "heads", "heads_128" and the Triton one, "triton", too, and the internal
levels all heads at once, PATHKERNELS_ENGINE_LEVELS=all_heads, and the repeated subtrees replayed
from CUDA graphs, PATHKERNELS_CUDA_GRAPHS=1; each call's residuals against the SIMT kernel's, the
largest relative difference), and ``path_statistics``
on the same tree (its chunks folded by torch ops or by the Triton fold,
PATHKERNELS_STATISTICS_FOLD=triton), each also with its chunks settled one at a time (as before
the chunk pipeline, ``PATHKERNELS_SYNC_CHUNKS=1``): the wall time, the number of kernel launches,
and the top kernels by total GPU time (name, calls, total and mean microseconds, share of GPU
time).

    python bench/profile_gpu_engine.py [--top 12] --out bench/results/<folder>/gpu_profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile

import pathkernels as pk
from pathkernels.core import engine
from pathkernels.testing import random_attention

LAYERS, HEADS, N = 6, 10, 64


def with_environment(call, **variables):
    """``call`` with the environment ``variables`` set while it runs: PATHKERNELS_STATISTICS_FOLD=triton
    (path_statistics folds its chunks in the Triton kernels instead of torch ops),
    PATHKERNELS_ENGINE_LEVELS=all_heads (the engine's internal levels all heads at once: one batched
    product, one GEMM of the means and one scales pass a level, instead of each per head),
    PATHKERNELS_CUDA_GRAPHS=1 (each chunk's subtree below its prefix replayed from a CUDA graph)."""

    def run(a, t):
        with mock.patch.dict(os.environ, variables):
            return call(a, t)

    return run


def synced(call):
    """``call`` with each chunk settled before the next is queued (PATHKERNELS_SYNC_CHUNKS=1)."""

    def run(a, t):
        engine._SYNC_CHUNKS = True
        try:
            return call(a, t)
        finally:
            engine._SYNC_CHUNKS = False

    return run


CALLS = {
    "path_residuals[simt]": lambda a, t: pk.path_residuals(a, t),
    "path_residuals[simt, synced chunks]": synced(lambda a, t: pk.path_residuals(a, t)),
    "path_residuals[tensor]": lambda a, t: pk.path_residuals(a, t, leaf_kernel="tensor"),
    "path_residuals[gemm]": lambda a, t: pk.path_residuals(a, t, leaf_kernel="gemm"),
    # The all-heads candidates: each leaf level in one launch over every parent and head.
    "path_residuals[heads]": lambda a, t: pk.path_residuals(a, t, leaf_kernel="heads"),
    "path_residuals[heads_128]": lambda a, t: pk.path_residuals(a, t, leaf_kernel="heads_128"),
    "path_residuals[tensor, fast]": lambda a, t: pk.path_residuals(a, t, leaf_kernel="tensor", fast=True),
    "path_residuals[heads, fast]": lambda a, t: pk.path_residuals(a, t, leaf_kernel="heads", fast=True),
    # The Triton candidate of the all-heads kernel, called by the engine through the dispatcher.
    "path_residuals[triton]": lambda a, t: pk.path_residuals(a, t, leaf_kernel="triton"),
    "path_residuals[triton, fast]": lambda a, t: pk.path_residuals(a, t, leaf_kernel="triton", fast=True),
    # Fewer launches above the leaves: every head's children of a level at once.
    "path_residuals[simt, all-heads levels]": with_environment(
        lambda a, t: pk.path_residuals(a, t), PATHKERNELS_ENGINE_LEVELS="all_heads"
    ),
    "path_residuals[heads, all-heads levels]": with_environment(
        lambda a, t: pk.path_residuals(a, t, leaf_kernel="heads"), PATHKERNELS_ENGINE_LEVELS="all_heads"
    ),
    # The subtree below each chunk's prefix from a CUDA graph: one graph launch a chunk.
    "path_residuals[simt, graphs]": with_environment(lambda a, t: pk.path_residuals(a, t), PATHKERNELS_CUDA_GRAPHS="1"),
    "path_residuals[heads, all-heads levels, graphs]": with_environment(
        lambda a, t: pk.path_residuals(a, t, leaf_kernel="heads"),
        PATHKERNELS_ENGINE_LEVELS="all_heads",
        PATHKERNELS_CUDA_GRAPHS="1",
    ),
    "path_residuals[triton, all-heads levels, graphs]": with_environment(
        lambda a, t: pk.path_residuals(a, t, leaf_kernel="triton"),
        PATHKERNELS_ENGINE_LEVELS="all_heads",
        PATHKERNELS_CUDA_GRAPHS="1",
    ),
    "path_statistics[simt]": lambda a, t: pk.path_statistics(a, t),
    "path_statistics[simt, synced chunks]": synced(lambda a, t: pk.path_statistics(a, t)),
    "path_statistics[tensor]": lambda a, t: pk.path_statistics(a, t, leaf_kernel="tensor"),
    "path_statistics[heads]": lambda a, t: pk.path_statistics(a, t, leaf_kernel="heads"),
    # The Triton fold (two launches a chunk) in place of torch ops (about 40).
    "path_statistics[simt, triton fold]": with_environment(
        lambda a, t: pk.path_statistics(a, t), PATHKERNELS_STATISTICS_FOLD="triton"
    ),
    "path_statistics[heads, triton fold]": with_environment(
        lambda a, t: pk.path_statistics(a, t, leaf_kernel="heads"), PATHKERNELS_STATISTICS_FOLD="triton"
    ),
    "path_statistics[heads, all-heads levels, triton fold, graphs]": with_environment(
        lambda a, t: pk.path_statistics(a, t, leaf_kernel="heads"),
        PATHKERNELS_STATISTICS_FOLD="triton",
        PATHKERNELS_ENGINE_LEVELS="all_heads",
        PATHKERNELS_CUDA_GRAPHS="1",
    ),
}


def kernel_table(prof, top: int) -> tuple[int, float, list[dict]]:
    """(launches, total GPU µs, the top kernels) from a profile's device events (kernels, copies, sets)."""
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(event.name, []).append(event.time_range.elapsed_us())
    total = sum(sum(times) for times in kernels.values())
    rows = sorted(kernels.items(), key=lambda item: -sum(item[1]))[:top]
    table = [
        {
            "kernel": name[:120],
            "calls": len(times),
            "total_us": sum(times),
            "mean_us": sum(times) / len(times),
            "share": sum(times) / total if total else 0.0,
        }
        for name, times in rows
    ]
    return sum(len(t) for t in kernels.values()), total, table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    assert torch.cuda.is_available() and pk.build_info()["cuda"], "needs a GPU and pathkernels built with CUDA"
    attn = random_attention(1, LAYERS, HEADS, N, N, device="cuda", generator=torch.Generator().manual_seed(0))
    tree = pk.PathTree.complete(LAYERS, HEADS)
    result = {"card": torch.cuda.get_device_name(), "tree": [LAYERS, HEADS, N], "paths": tree.num_paths, "calls": {}}
    reference = None  # path_residuals[simt]'s residuals: every other residual call is compared with them
    for name, call in CALLS.items():
        try:
            call(attn, tree)  # warm-up
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                start = time.perf_counter()
                outcome = call(attn, tree)
                torch.cuda.synchronize()
                wall = time.perf_counter() - start
        except Exception as error:  # one failing variant does not stop the others
            result["calls"][name] = {"error": f"{type(error).__name__}: {error}"}
            print(f"{name}: {result['calls'][name]['error']}", flush=True)
            continue
        launches, gpu_us, table = kernel_table(prof, args.top)
        result["calls"][name] = {"wall_s": wall, "launches": launches, "gpu_s": gpu_us / 1e6, "top": table}
        agreement = ""
        if isinstance(outcome, pk.PathResiduals):
            residual = outcome.residual.double()
            if reference is None:
                reference = residual
            else:
                largest = ((residual - reference).abs() / reference).max().item()
                result["calls"][name]["max_relative_vs_simt"] = largest
                agreement = f", residuals within {largest:.2e} of simt's"
        print(
            f"\n{name}: {wall:.3f} s wall, {gpu_us / 1e6:.3f} s on the GPU, {launches} kernel launches{agreement}",
            flush=True,
        )
        for row in table:
            print(f"  {row['share']:>6.1%} {row['calls']:>7} × {row['mean_us']:>9.1f} µs  {row['kernel'][:90]}")
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
