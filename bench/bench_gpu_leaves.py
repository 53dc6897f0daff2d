"""GPU benchmark of issue 4's targets: the fused leaf kernel and the engine on CUDA, float32, TF32 off.

1. The fused leaf kernel alone (``_fused_leaf_norms``: C(A) · right_k for a block of leaves,
   reduced on chip) against the same-run cuBLAS float32 rate of the very same product
   (``C(A) @ right`` as one [n, n] × [n, c·m] GEMM, materialised and not reduced). Target at n = 64:
   at least 50 % of that rate.
2. The engine on complete trees with the fused kernel, with cuBLAS + the reduction kernels
   (``leaf_kernel="gemm"``), and the level-wise pure-PyTorch baseline (stacked GEMMs per level,
   materialised, then the norms): paths/s, the fraction of the 4096² cuBLAS float32 rate, peak
   device memory. Target: at least 10× the baseline.
3. A complete tree of 10^9 leaves (L = 9, H = 10, n = 64) within the default memory budget.
   Target: under a minute. Skipped (with the estimate) when case 2 predicts more than --limit s.

    python bench/bench_gpu_leaves.py --out bench/results/<folder>/gpu_leaves.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import pathkernels as pk
from pathkernels.benchmarks import gemm_rate, head_node_flops, seconds_per_call
from pathkernels.reference import levelwise_ref
from pathkernels.testing import random_attention

KERNEL_CASES = [(32, 16384), (64, 8192), (128, 2048)]  # (n, leaves); m = n
ENGINE_CASES = [(6, 10, 64, False), (5, 12, 64, False), (4, 8, 128, False), (5, 6, 64, True)]
BILLION = (9, 10, 64)


def kernel_case(n: int, leaves: int) -> dict:
    attn = random_attention(1, 1, n, n, device="cuda")[0, 0]
    centred = attn - attn.mean(0, keepdim=True)
    right = torch.randn(n, leaves, n, device="cuda")
    mean = torch.randn(leaves, n, device="cuda")
    flops = 2 * n * n * n * leaves
    fused = seconds_per_call(
        lambda: torch.ops.pathkernels._fused_leaf_norms(centred, right, mean), "cuda", min_seconds=0.5, statistic="min"
    )
    flat = right.view(n, leaves * n)
    gemm = seconds_per_call(lambda: centred @ flat, "cuda", min_seconds=0.5, statistic="min")
    return {
        "n": n,
        "leaves": leaves,
        "fused_ms": fused * 1e3,
        "cublas_same_product_ms": gemm * 1e3,
        "fused_tflops": flops / fused / 1e12,
        "cublas_tflops": flops / gemm / 1e12,
        "fraction_of_cublas": gemm / fused,
    }


def peak_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def engine_case(layers: int, heads: int, n: int, skip: bool, floor: float) -> dict:
    attn = random_attention(layers, heads, n, n, device="cuda", generator=torch.Generator().manual_seed(0))
    tree = pk.PathTree.complete(layers, heads, skip=skip)
    paths = tree.num_paths
    flops = head_node_flops(layers, heads, n, skip)
    pk.path_residuals(attn[:1], pk.PathTree.complete(1, heads, skip=skip))  # warm-up

    def unfused():
        return pk.path_residuals(attn, tree, leaf_kernel="gemm")

    row = {"layers": layers, "heads": heads, "n": n, "skip": skip, "paths": paths}
    for name, fn in [
        ("fused", lambda: pk.path_residuals(attn, tree)),
        ("unfused", unfused),
        ("levelwise", lambda: levelwise_ref(attn, skip)),
    ]:
        try:
            seconds = seconds_per_call(fn, "cuda", min_runs=2, min_seconds=0.3, statistic="min")
            row.update(
                {
                    f"{name}_s": seconds,
                    f"{name}_paths_per_s": paths / seconds,
                    f"{name}_fraction_of_floor": flops / seconds / floor,
                    f"{name}_peak_mib": peak_mib(fn),
                }
            )
        except torch.OutOfMemoryError:
            row[f"{name}_s"] = None
            torch.cuda.empty_cache()
    if row.get("levelwise_s"):
        row["speedup_vs_levelwise"] = row["levelwise_s"] / row["fused_s"]
    row["speedup_vs_unfused"] = row["unfused_s"] / row["fused_s"]
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--limit", type=float, default=240, help="skip the 10^9 tree if predicted slower (s)")
    args = parser.parse_args(argv)
    assert torch.cuda.is_available() and pk.build_info()["cuda"], "needs a GPU and pathkernels built with CUDA"
    torch.backends.cuda.matmul.allow_tf32 = False
    floor = gemm_rate(torch.float32, "cuda")
    card = torch.cuda.get_device_name()
    print(f"{card}, torch {torch.__version__}; cuBLAS float32 4096² GEMM: {floor / 1e12:.1f} TFLOP/s", flush=True)

    kernels = []
    print(
        f"{'n':>4} {'leaves':>7} {'fused ms':>9} {'cuBLAS ms':>9} {'fused TF/s':>10} {'cuBLAS TF/s':>11} "
        f"{'of cuBLAS':>9}"
    )
    for n, leaves in KERNEL_CASES:
        r = kernel_case(n, leaves)
        kernels.append(r)
        print(
            f"{n:>4} {leaves:>7} {r['fused_ms']:>9.3f} {r['cublas_same_product_ms']:>9.3f} "
            f"{r['fused_tflops']:>10.1f} {r['cublas_tflops']:>11.1f} {r['fraction_of_cublas']:>9.0%}",
            flush=True,
        )

    engines = []
    print(
        f"\n{'L':>2} {'H':>3} {'n':>4} {'skip':<5} {'paths':>11} {'fused s':>8} {'paths/s':>9} {'of floor':>8} "
        f"{'unfused s':>9} {'level s':>8} {'vs level':>8} {'peak MiB':>8} {'level MiB':>9}"
    )
    for case in ENGINE_CASES:
        r = engine_case(*case, floor)
        engines.append(r)
        if r.get("levelwise_s"):
            level = f"{r['levelwise_s']:>8.3f} {r['speedup_vs_levelwise']:>7.1f}x"
        else:
            level = f"{'OOM':>8} {'—':>8}"
        print(
            f"{r['layers']:>2} {r['heads']:>3} {r['n']:>4} {r['skip']!s:<5} {r['paths']:>11,} {r['fused_s']:>8.3f} "
            f"{r['fused_paths_per_s']:>9.3g} {r['fused_fraction_of_floor']:>8.0%} {r['unfused_s']:>9.3f} {level} "
            f"{r['fused_peak_mib']:>8.0f} {r.get('levelwise_peak_mib', float('nan')):>9.0f}",
            flush=True,
        )

    layers, heads, n = BILLION
    rate = engines[0]["fused_paths_per_s"]  # (6, 10, 64): the same n and H
    predicted = heads**layers / rate
    billion = {"layers": layers, "heads": heads, "n": n, "paths": heads**layers, "predicted_s": predicted}
    if predicted <= args.limit:
        attn = random_attention(layers, heads, n, n, device="cuda", generator=torch.Generator().manual_seed(0))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        result = pk.path_residuals(attn, pk.PathTree.complete(layers, heads), progress=True)
        torch.cuda.synchronize()
        # residual and norm are stored; ratio is computed lazily from them.
        results_gib = 2 * result.residual.numel() * result.residual.element_size() / 2**30
        billion.update(
            seconds=time.perf_counter() - start,
            peak_gib=torch.cuda.max_memory_allocated() / 2**30,
            results_gib=results_gib,
            finite=bool(torch.isfinite(result.ratio).all()),
        )
        print(
            f"\n10^9 leaves (L = {layers}, H = {heads}, n = {n}): {billion['seconds']:.1f} s, peak "
            f"{billion['peak_gib']:.1f} GiB (of which results {billion['results_gib']:.1f} GiB)"
        )
    else:
        print(
            f"\n10^9 leaves: predicted {predicted:.0f} s from {rate:.3g} paths/s, above --limit "
            f"{args.limit:.0f} s; not run"
        )

    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "card": card,
                    "torch": torch.__version__,
                    "build": pk.build_info(),
                    "cublas_floor_tflops": floor / 1e12,
                    "kernel": kernels,
                    "engine": engines,
                    "billion": billion,
                },
                indent=2,
            )
            + "\n"
        )
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
