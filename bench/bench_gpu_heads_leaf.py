"""GPU benchmark of the heads leaf kernel (``_heads_leaf_norms``: the leaves of c parents under all H
heads in one launch, reduced on chip, their means from the centring identity), float32.

Per case (n, H, c, m = n), every variant of the op against, on the same inputs:

- cuBLAS: the same products C(A_h) R'_k as one batched GEMM [H, n, n] × [n, c·m], float32 and TF32,
  materialised and not reduced ("gemm"), and the same followed by a torch reduction to the same two
  norms, the means by the centring identity ("gemm+reduce");
- the per-head kernels of today (``_fused_leaf_norms`` "simt", "tf32x3", "tf32"): per head one GEMV
  for the leaves' means, then one fused launch, as the engine runs its leaves.

Reported per timed variant: ms, TFLOP/s of the useful products (2·n²·m·H·c), the ratio to the
cuBLAS float32 GEMM, and (except for the bare GEMMs) the largest relative error of both norms
against float64 on the first parents. The JSON file is rewritten after every case.

    python bench/bench_gpu_heads_leaf.py [--quick] --out bench/results/<folder>/gpu_heads_leaf.json
    python bench/bench_gpu_heads_leaf.py --device cpu   # tiny cases through the CPU harness (a dry run)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import pathkernels as pk
from pathkernels.app.benchmarks import seconds_per_call
from pathkernels.core.engine import _tf32_matmuls
from pathkernels.testing import random_attention

HEADS_KERNELS = ("tf32x3", "tf32x3_128", "tf32", "tf32_128")
PER_HEAD_KERNELS = ("simt", "tf32x3", "tf32")
# (n, H, c): about 26 GFLOP each; --quick takes a quarter of the parents.
CUDA_CASES = [(32, 12, 16384), (64, 12, 4096), (128, 12, 1024)]
CPU_CASES = [(8, 2, 3), (32, 2, 2)]
CHECKED_PARENTS = 32


def attempt(row: dict, name: str, fn):
    """fn()'s result, or None with the error recorded in row[name + "_error"]: a variant that fails
    (out of memory, a launch error, too little shared memory) does not stop the others."""
    try:
        return fn()
    except Exception as error:  # noqa: BLE001 (a benchmark records every failure and goes on)
        row[f"{name}_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None


def reference(attn, attn_mean, right, mean) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 norms [c, H] of the first parents: R = C(A_h) R'_k, μ = μ_k + R'_kᵀ a_h."""
    attn, attn_mean, right, mean = (t.double().cpu() for t in (attn, attn_mean, right, mean))
    leaves = torch.einsum("hik,kcj->chij", attn, right)
    means = mean[:, None, :] + torch.einsum("hk,kcj->chj", attn_mean, right)

    def composite(x):
        return (x.abs().sum(-2).amax(-1) * x.abs().sum(-1).amax(-1)).sqrt()

    return composite(leaves), composite(leaves + means[:, :, None, :])


def gemm_and_reduce(centred, attn_mean, flat, mean, shape):
    """cuBLAS's products, then torch's reduction: the leaves [H, n, c, m] are stored, then summed."""
    heads, n, count, m = shape
    leaves = torch.matmul(centred, flat).view(heads, n, count, m)
    means = mean + (attn_mean @ flat).view(heads, count, m)
    magnitude = leaves.abs()
    residual = (magnitude.sum(1).amax(-1) * magnitude.sum(3).amax(1)).sqrt()
    magnitude = (leaves + means[:, None]).abs()
    norm = (magnitude.sum(1).amax(-1) * magnitude.sum(3).amax(1)).sqrt()
    return residual.t(), norm.t()


def per_head(centred, attn_mean, right, flat, mean, kernel):
    """Today's leaf launches: per head a GEMV for the means, then the per-head fused kernel."""
    residual, norm = [], []
    for h in range(centred.shape[0]):
        mean_h = torch.addmm(mean.view(1, -1), attn_mean[h : h + 1], flat).view_as(mean)
        r, p = torch.ops.pathkernels._fused_leaf_norms(centred[h], right, mean_h, None, kernel)
        residual.append(r)
        norm.append(p)
    return torch.stack(residual, 1), torch.stack(norm, 1)


def bench_case(n: int, heads: int, count: int, device: str, min_seconds: float) -> dict:
    m = n
    generator = torch.Generator().manual_seed(n)
    attn = random_attention(heads, n, n, dtype=torch.float64, generator=generator)
    attn_mean = attn.mean(-2)
    centred = (attn - attn_mean[:, None, :]).float().to(device)
    attn_mean = attn_mean.float().to(device)
    right = torch.randn(n, count, m, generator=generator).to(device)
    mean = torch.randn(count, m, generator=generator).to(device)
    flat = right.view(n, count * m)
    flops = 2 * n * n * m * heads * count
    checked = min(count, CHECKED_PARENTS)
    truth = reference(centred, attn_mean, right[:, :checked], mean[:checked])
    row = {"n": n, "heads": heads, "parents": count, "m": m, "leaves": heads * count, "gflop": flops / 1e9}

    def timed(name: str, fn, checked_outputs: bool = True) -> None:
        outputs = attempt(row, name, fn)  # warm-up, and the outputs checked below
        if outputs is None:
            return
        seconds = attempt(row, name, lambda: seconds_per_call(fn, device, min_seconds=min_seconds, statistic="min"))
        if seconds is None:
            return
        row[f"{name}_ms"] = seconds * 1e3
        row[f"{name}_tflops"] = flops / seconds / 1e12
        if checked_outputs:
            row[f"{name}_max_relative_error"] = max(
                ((got[:checked].double().cpu() - want).abs() / want).max().item() for got, want in zip(outputs, truth)
            )

    gemm_name = "cublas" if device.startswith("cuda") else "torch"
    shape = (heads, n, count, m)
    timed(f"{gemm_name}_fp32_gemm", lambda: torch.matmul(centred, flat), checked_outputs=False)
    timed(f"{gemm_name}_fp32_gemm+reduce", lambda: gemm_and_reduce(centred, attn_mean, flat, mean, shape))
    if device.startswith("cuda"):
        with _tf32_matmuls():
            timed("cublas_tf32_gemm", lambda: torch.matmul(centred, flat), checked_outputs=False)
            timed("cublas_tf32_gemm+reduce", lambda: gemm_and_reduce(centred, attn_mean, flat, mean, shape))
    for kernel in PER_HEAD_KERNELS:
        timed(f"per_head_{kernel}", lambda kernel=kernel: per_head(centred, attn_mean, right, flat, mean, kernel))
    for kernel in HEADS_KERNELS:
        timed(
            kernel,
            lambda kernel=kernel: torch.ops.pathkernels._heads_leaf_norms(
                centred, attn_mean, right, mean, None, kernel
            ),
        )
    baseline = row.get(f"{gemm_name}_fp32_gemm_ms")
    if baseline:
        for key in [k for k in row if k.endswith("_ms")]:
            row[f"{key[: -len('_ms')]}_vs_fp32_gemm"] = baseline / row[key]
    return row


def print_row(row: dict, names: list[str]) -> None:
    print(f"\nn = {row['n']}, H = {row['heads']}, c = {row['parents']}, m = {row['m']} ({row['gflop']:.1f} GFLOP)")
    for name in names:
        if f"{name}_ms" in row:
            error = row.get(f"{name}_max_relative_error")
            print(
                f"  {name:<26} {row[f'{name}_ms']:>9.3f} ms {row[f'{name}_tflops']:>7.2f} TFLOP/s "
                f"{row.get(f'{name}_vs_fp32_gemm', float('nan')):>6.2f}× fp32 GEMM"
                + (f"  max rel. error {error:.1e}" if error is not None else ""),
                flush=True,
            )
        elif f"{name}_error" in row:
            print(f"  {name:<26} failed: {row[f'{name}_error']}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="a quarter of the parents, shorter timings")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.device == "cuda":
        assert torch.cuda.is_available() and pk.build_info()["cuda"], "needs a GPU and pathkernels built with CUDA"
        # float32 GEMMs in IEEE float32 unless _tf32_matmuls says otherwise; the new API only (torch
        # refuses a mix of it and allow_tf32).
        if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
            torch.backends.cuda.matmul.fp32_precision = "ieee"
        card = torch.cuda.get_device_name()
        cases = [(n, heads, count // 4 if args.quick else count) for n, heads, count in CUDA_CASES]
    else:
        card = "cpu (harness dry run)"
        cases = CPU_CASES
    min_seconds = 0.05 if args.device == "cpu" else (0.2 if args.quick else 0.5)
    print(f"{card}, torch {torch.__version__}", flush=True)
    gemm_name = "cublas" if args.device == "cuda" else "torch"
    names = [f"{gemm_name}_fp32_gemm", f"{gemm_name}_fp32_gemm+reduce"]
    if args.device == "cuda":
        names += ["cublas_tf32_gemm", "cublas_tf32_gemm+reduce"]
    names += [f"per_head_{k}" for k in PER_HEAD_KERNELS] + list(HEADS_KERNELS)
    rows = []
    for n, heads, count in cases:
        row = bench_case(n, heads, count, args.device, min_seconds)
        rows.append(row)
        print_row(row, names)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            document = {"card": card, "torch": torch.__version__, "build": pk.build_info(), "cases": rows}
            args.out.write_text(json.dumps(document, indent=2) + "\n")
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
