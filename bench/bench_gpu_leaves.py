"""GPU benchmark of the leaf kernels and the engine on CUDA, float32.

1. The fused leaf kernels alone (``_fused_leaf_norms``: C(A) · right_k for a block of leaves,
   reduced on chip): "simt" (CUDA cores), "tf32x3" (tensor cores, float32 accuracy) and "tf32"
   (one TF32 pass), against the same-run cuBLAS rate of the very same product (``C(A) @ right`` as
   one [n, n] × [n, c·m] GEMM, materialised and not reduced) in float32 and in TF32, with each
   kernel's largest relative error against float64 on the first leaves; and the SIMT kernel in
   float64 against cuBLAS float64 (FP64 tensor cores on the H100/H200). The target at
   n = 64: tf32x3 at least 1.5× cuBLAS float32.
2. A whole leaf level: every head's leaves of c parents, ``C(A_h) R'_k`` and the column
   means ``μ_k + R'_kᵀ a_h``, reduced to both norms. Candidates, timed in the same run: cuBLAS
   (the H heads and their a_h stacked into one [H(n + 1), n] × [n, c·m] GEMM: float32, TF32, and
   float32 followed by the torch reduction, the baseline that computes the same norms), the CUDA
   kernels head by head as the engine launches them (a GEMV for μ, then ``_fused_leaf_norms``), and
   the Triton kernel of pathkernels.core.triton_leaf ("triton-ieee", "triton-tf32", "triton-tf32x3",
   "triton-tf32x3-triton": one launch for every head): TFLOP/s, × cuBLAS float32 (the bare GEMM),
   the largest relative error against float64 on the first parents, and the autotuner's choice and
   time. ``--only triton`` runs this section alone; ``--device cpu`` (with TRITON_INTERPRET=1, set
   by the script) runs it on tiny cases in Triton's interpreter: a dry run of the script.
3. The engine on complete trees with each leaf kernel ("fused" = simt, "tensor", "tensor" with
   fast=True, "gemm" = cuBLAS + the reduction kernels) and the level-wise pure-PyTorch baseline
   (stacked GEMMs per level, materialised, then the norms), eager and (without --quick) under
   torch.compile: seconds, the fraction of the 4096² cuBLAS float32 rate, peak device memory.
4. A complete tree of 10^9 leaves (L = 9, H = 10, n = 64) within the default memory budget, with
   the fastest float32-accurate leaf kernel and in fast mode. Skipped (with the estimate) when
   case 3 predicts more than --limit s.

A kernel that fails (Triton included) is recorded with its error and the rest goes on. The JSON is
written after every case, so that a run cut short keeps what it measured ("complete": false).

    python bench/bench_gpu_leaves.py [--quick] [--only triton] --out bench/results/<folder>/gpu_leaves.json
    python bench/bench_gpu_leaves.py --device cpu --only triton --out /tmp/dry.json   # dry run, no GPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

import pathkernels as pk
from pathkernels.app.benchmarks import gemm_rate, head_node_flops, seconds_per_call
from pathkernels.core.engine import _tf32_matmuls
from pathkernels.reference import composite_norm_ref, levelwise_ref, triton_leaf_norms_ref
from pathkernels.testing import random_attention

# (n, leaves, dtype); m = n. float64 has the SIMT kernel only (its cuBLAS uses FP64 tensor cores).
KERNEL_CASES = [(32, 16384, torch.float32), (64, 8192, torch.float32), (128, 2048, torch.float32)]
KERNEL_CASES += [(64, 8192, torch.float64)]
LEAF_KERNELS = ("simt", "tf32x3", "tf32")
ENGINE_CASES = [(6, 10, 64, False), (5, 12, 64, False), (4, 8, 128, False), (5, 6, 64, True)]
QUICK_ENGINE_CASES = ENGINE_CASES[:1] + ENGINE_CASES[2:3]
# path_residuals arguments of each engine variant.
ENGINE_VARIANTS = {
    "simt": {},
    "tensor": {"leaf_kernel": "tensor"},
    "tensor_fast": {"leaf_kernel": "tensor", "fast": True},
    "gemm": {"leaf_kernel": "gemm"},
}
BILLION = (9, 10, 64)
CHECKED_LEAVES = 64  # leaves compared with float64 per kernel case
# A whole leaf level (section 2): (n, H, parents), m = n, c·H leaves per call: 13 to 69 GFLOP, about a
# millisecond a call, so that the Triton op's Python (checks, dispatch, the autotuner's lookup, some
# 0.1 ms) and the launches weigh little. Memory: the cuBLAS baseline's product and its reduction's
# temporaries, about 5 GB at (64, 8, 8192).
HEAD_CASES = [(32, 12, 16384), (64, 8, 8192), (64, 12, 4096), (128, 8, 2048)]
QUICK_HEAD_CASES = [(64, 8, 8192), (128, 8, 2048)]
TINY_HEAD_CASES = [(8, 2, 3), (20, 3, 4)]  # --device cpu: a dry run in Triton's interpreter
HEAD_KERNELS = ("simt", "tf32x3", "tf32")  # the CUDA kernels, launched head by head as the engine does
TRITON_PRECISIONS = ("ieee", "tf32", "tf32x3", "tf32x3-triton")
CHECKED_PARENTS = 16  # parents (all their heads) compared with float64 per case


def attempt(row: dict, name: str, fn) -> float | None:
    """fn()'s result, or None with the error recorded in row[name + "_error"]: out of memory, a
    kernel's failure, a torch.compile error, whatever it is, the other variants still run."""
    try:
        return fn()
    except Exception as error:  # noqa: BLE001 (a benchmark records every failure and goes on)
        row[f"{name}_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        torch.cuda.empty_cache()
        return None


def kernel_case(n: int, leaves: int, dtype: torch.dtype) -> dict:
    attn = random_attention(1, 1, n, n, device="cuda", dtype=dtype)[0, 0]
    centred = attn - attn.mean(0, keepdim=True)
    right = torch.randn(n, leaves, n, device="cuda", dtype=dtype)
    mean = torch.randn(leaves, n, device="cuda", dtype=dtype)
    flops = 2 * n * n * n * leaves
    checked = torch.einsum("ik,kcj->cij", centred.double(), right[:, :CHECKED_LEAVES].double())
    truth = composite_norm_ref(checked), composite_norm_ref(checked + mean[:CHECKED_LEAVES, None].double())
    row = {"n": n, "leaves": leaves, "dtype": str(dtype).removeprefix("torch.")}
    flat = right.view(n, leaves * n)
    gemm = seconds_per_call(lambda: centred @ flat, "cuda", min_seconds=0.5, statistic="min")
    row.update(cublas_ms=gemm * 1e3, cublas_tflops=flops / gemm / 1e12)
    if dtype == torch.float32:
        with _tf32_matmuls():
            gemm_tf32 = seconds_per_call(lambda: centred @ flat, "cuda", min_seconds=0.5, statistic="min")
        row["cublas_tf32_tflops"] = flops / gemm_tf32 / 1e12
    for kernel in LEAF_KERNELS if dtype == torch.float32 else ("simt",):

        def call(kernel=kernel):
            return torch.ops.pathkernels._fused_leaf_norms(centred, right, mean, None, kernel)

        def timed(call=call):
            return seconds_per_call(call, "cuda", min_seconds=0.5, statistic="min")

        seconds = attempt(row, kernel, timed)
        if seconds is None:
            continue
        residual, norm = call()
        error = max(
            ((got[:CHECKED_LEAVES].cpu() - want.cpu()).abs() / want.cpu()).max().item()
            for got, want in zip((residual, norm), truth)
        )
        row.update(
            {
                f"{kernel}_ms": seconds * 1e3,
                f"{kernel}_tflops": flops / seconds / 1e12,
                f"{kernel}_vs_cublas": gemm / seconds,
                f"{kernel}_max_relative_error": error,
            }
        )
    return row


def relative_error(got, truth) -> float:
    """The largest relative error of (residual, norm) against the float64 truth."""
    return max(((g.double().cpu() - t).abs() / t).max().item() for g, t in zip(got, truth))


def torch_leaf_norms(stacked, flat, parent_means, heads: int, n: int, count: int, m: int):
    """The baseline: one cuBLAS GEMM of every head's C(A_h), with the a_h stacked below as H more
    rows, by the parents side by side ([H(n + 1), n] × [n, c·m]), then torch reduces the leaves and
    1μᵀ + R in float32: (residual, norm), each [c, H]."""
    product = stacked @ flat
    leaves = product[: heads * n].view(heads, n, count, m)
    means = parent_means + product[heads * n :].view(heads, count, m)

    def composite(x):  # [H, n, c, m] -> [c, H]
        magnitude = x.abs()
        return (magnitude.sum(1).amax(-1) * magnitude.sum(-1).amax(1)).sqrt().t()

    return composite(leaves), composite(leaves + means[:, None])


def heads_case(n: int, heads: int, count: int, device: str, triton_leaf, timing: dict) -> dict:
    """Section 2: every candidate on the leaves of `count` parents through `heads` heads (m = n)."""
    generator = torch.Generator().manual_seed(1000 * n + heads)
    attn = random_attention(heads, n, n, dtype=torch.float64, generator=generator)
    attn_mean = attn.mean(1)
    centred = (attn - attn_mean[:, None, :]).float().to(device)
    attn_mean = attn_mean.float().to(device)
    m = n
    parents = torch.randn(n, count, m, generator=generator).to(device)
    parent_means = torch.randn(count, m, generator=generator).to(device)
    flops = 2 * n * n * m * count * heads
    checked = min(CHECKED_PARENTS, count)
    truth = triton_leaf_norms_ref(centred, attn_mean, parents[:, :checked], parent_means[:checked])
    row = {"n": n, "m": m, "heads": heads, "parents": count, "leaves": count * heads, "flops": flops}
    flat = parents.view(n, count * m)
    stacked = torch.cat([centred.reshape(heads * n, n), attn_mean])

    def timed(name, fn):
        return attempt(row, name, lambda: seconds_per_call(fn, device, **timing))

    def record(name, seconds, result=None):
        row[f"{name}_ms"] = seconds * 1e3
        row[f"{name}_tflops"] = flops / seconds / 1e12
        if "cublas_ms" in row:
            row[f"{name}_vs_cublas"] = row["cublas_ms"] / row[f"{name}_ms"]
        if result is not None:
            row[f"{name}_max_relative_error"] = relative_error([r[:checked] for r in result], truth)

    seconds = timed("cublas", lambda: stacked @ flat)
    if seconds is not None:
        record("cublas", seconds)
    if device == "cuda":
        with _tf32_matmuls():
            seconds = timed("cublas_tf32", lambda: stacked @ flat)
        if seconds is not None:
            record("cublas_tf32", seconds)

    def baseline():
        return torch_leaf_norms(stacked, flat, parent_means, heads, n, count, m)

    seconds = timed("cublas_reduce", baseline)
    if seconds is not None:
        record("cublas_reduce", seconds, baseline())

    for kernel in HEAD_KERNELS:

        def per_head(kernel=kernel):
            # The engine's leaf level: per head, μ = μ_k + a_hᵀ R'_k (one GEMV), then the fused kernel.
            results = []
            for h in range(heads):
                mean = torch.addmm(parent_means.view(1, count * m), attn_mean[h : h + 1], flat).view(count, m)
                results.append(torch.ops.pathkernels._fused_leaf_norms(centred[h], parents, mean, None, kernel))
            return torch.stack([r[0] for r in results], 1), torch.stack([r[1] for r in results], 1)

        seconds = timed(kernel, per_head)
        if seconds is not None:
            record(kernel, seconds, per_head())

    if triton_leaf is None:
        return row
    for precision in TRITON_PRECISIONS:
        name = f"triton-{precision}"

        def call(precision=precision):
            return triton_leaf.triton_leaf_norms(centred, attn_mean, parents, parent_means, None, precision)

        start = time.perf_counter()
        first = attempt(row, name, call)  # the autotuner compiles and times its configs here
        if first is None:
            continue
        if device == "cuda":
            torch.cuda.synchronize()
        row[f"{name}_first_call_s"] = time.perf_counter() - start
        chosen = triton_leaf.chosen_config()
        row[f"{name}_config"] = chosen or {"config": triton_leaf.DEFAULT_CONFIG._asdict(), "interpreted": True}
        seconds = timed(name, call)
        if seconds is not None:
            record(name, seconds, first)
    return row


def print_heads_case(r: dict) -> None:
    print(
        f"\nn = {r['n']}, H = {r['heads']}, {r['parents']} parents ({r['leaves']} leaves): TFLOP/s, × cuBLAS "
        "float32 (the bare GEMM), max relative error vs float64",
        flush=True,
    )
    names = ["cublas", "cublas_tf32", "cublas_reduce", *HEAD_KERNELS, *(f"triton-{p}" for p in TRITON_PRECISIONS)]
    labels = {"cublas_tf32": "cublas (TF32)", "cublas_reduce": "cublas + torch reduction"}
    labels.update({k: f"{k} (head by head)" for k in HEAD_KERNELS})
    for name in names:
        label = labels.get(name, name)
        if f"{name}_error" in r:
            print(f"  {label:<26} fail: {r[f'{name}_error']}", flush=True)
        elif f"{name}_tflops" in r:
            ratio = f"{r[f'{name}_vs_cublas']:5.2f}×" if f"{name}_vs_cublas" in r else ""
            error = f"{r[f'{name}_max_relative_error']:8.1e}" if f"{name}_max_relative_error" in r else ""
            config = r.get(f"{name}_config", {}).get("config")
            chosen = " " + " ".join(f"{k}={v}" for k, v in config.items()) if config else ""
            print(f"  {label:<26} {r[f'{name}_tflops']:8.2f} {ratio:>7} {error:>8}{chosen}", flush=True)


def import_triton_leaf(device: str, results: dict):
    """pathkernels.core.triton_leaf, or None with the error recorded: the other candidates still run. On
    the CPU under TRITON_INTERPRET=1 (set here, before the module is imported)."""
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton

        import pathkernels.core.triton_leaf as triton_leaf

        triton_leaf.require_triton()
        results["triton"] = triton.__version__
        return triton_leaf
    except Exception as error:  # noqa: BLE001 (a benchmark records every failure and goes on)
        results["triton_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        print(f"triton: {results['triton_error']}", flush=True)
        return None


def peak_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def engine_case(layers: int, heads: int, n: int, skip: bool, floor: float, compiled: bool) -> dict:
    attn = random_attention(layers, heads, n, n, device="cuda", generator=torch.Generator().manual_seed(0))
    tree = pk.PathTree.complete(layers, heads, skip=skip)
    paths = tree.num_paths
    flops = head_node_flops(layers, heads, n, skip)
    row = {"layers": layers, "heads": heads, "n": n, "skip": skip, "paths": paths}
    variants = {name: (lambda kw=kw: pk.path_residuals(attn, tree, **kw)) for name, kw in ENGINE_VARIANTS.items()}
    variants["levelwise"] = lambda: levelwise_ref(attn, skip)
    if compiled:
        compiled_levelwise = torch.compile(levelwise_ref, dynamic=False)
        variants["levelwise_compiled"] = lambda: compiled_levelwise(attn, skip)
    for name, fn in variants.items():
        if attempt(row, name, lambda fn=fn: fn()) is None:  # warm-up (and compilation), or its error
            continue
        seconds = attempt(
            row, name, lambda fn=fn: seconds_per_call(fn, "cuda", min_runs=2, min_seconds=0.3, statistic="min")
        )
        if seconds is not None:
            row.update(
                {
                    f"{name}_s": seconds,
                    f"{name}_paths_per_s": paths / seconds,
                    f"{name}_fraction_of_floor": flops / seconds / floor,
                    f"{name}_peak_mib": peak_mib(fn),
                }
            )
    baselines = [row[f"{name}_s"] for name in ("levelwise", "levelwise_compiled") if row.get(f"{name}_s")]
    for name in ENGINE_VARIANTS:
        if row.get(f"{name}_s") and baselines:
            row[f"{name}_vs_best_levelwise"] = min(baselines) / row[f"{name}_s"]
    return row


def best_exact(row: dict) -> str:
    """The faster of the float32-accurate engine variants that ran ("simt" or "tensor")."""
    timed = [name for name in ("simt", "tensor") if row.get(f"{name}_s")]
    return min(timed, key=lambda name: row[f"{name}_s"])


def seconds_cell(row: dict, name: str, width: int = 8) -> str:
    value = row.get(f"{name}_s")
    return f"{value:>{width}.4f}" if value else f"{'fail' if f'{name}_error' in row else '—':>{width}}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quick", action="store_true", help="fewer cases, no torch.compile baseline")
    parser.add_argument("--limit", type=float, default=240, help="skip the 10^9 tree if predicted slower (s)")
    parser.add_argument("--only", choices=["triton"], help="run section 2 alone (the whole leaf level)")
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a dry run of section 2 in Triton's interpreter"
    )
    parser.add_argument(
        "--triton-configs",
        choices=["full", "quick", "default"],
        help="the Triton autotuner's space (default: quick with --quick, else full)",
    )
    args = parser.parse_args(argv)
    device = args.device
    if device == "cuda":
        assert torch.cuda.is_available() and pk.build_info()["cuda"], "needs a GPU and pathkernels built with CUDA"
        torch.backends.cuda.matmul.allow_tf32 = False
        card = torch.cuda.get_device_name()
    else:
        args.only = "triton"  # the other sections need the GPU
        card = "cpu (Triton interpreter)"
    os.environ["PATHKERNELS_TRITON_CONFIGS"] = args.triton_configs or ("quick" if args.quick else "full")
    results = {"card": card, "torch": torch.__version__, "build": pk.build_info(), "complete": False}

    def save() -> None:
        """Writes what has been measured so far (after every case)."""
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=2) + "\n")

    floor = None
    if device == "cuda":
        floor = gemm_rate(torch.float32, "cuda")
        results["cublas_floor_tflops"] = floor / 1e12
        print(f"{card}, torch {torch.__version__}; cuBLAS float32 4096² GEMM: {floor / 1e12:.1f} TFLOP/s", flush=True)
    save()

    if args.only is None:
        kernels = results["kernel"] = []
        print("\nleaf kernels, TFLOP/s (× cuBLAS float32 on the same product; max relative error vs float64)")
        print(
            f"{'n':>4} {'leaves':>7} {'dtype':<8} {'cuBLAS':>7} {'c-TF32':>7} "
            + " ".join(f"{k:>24}" for k in LEAF_KERNELS)
        )
        for n, leaves, dtype in KERNEL_CASES:
            r = kernel_case(n, leaves, dtype)
            kernels.append(r)
            save()
            cells = [
                f"{r[f'{k}_tflops']:>6.1f} ({r[f'{k}_vs_cublas']:.2f}×, {r[f'{k}_max_relative_error']:.0e})"
                if f"{k}_tflops" in r
                else ("fail" if f"{k}_error" in r else "—")
                for k in LEAF_KERNELS
            ]
            tf32 = f"{r['cublas_tf32_tflops']:>7.1f}" if "cublas_tf32_tflops" in r else f"{'—':>7}"
            print(
                f"{n:>4} {leaves:>7} {r['dtype']:<8} {r['cublas_tflops']:>7.1f} {tf32} "
                + " ".join(f"{c:>24}" for c in cells),
                flush=True,
            )

    print("\nwhole leaf level: every head's leaves of a block of parents", flush=True)
    triton_leaf = import_triton_leaf(device, results)
    results["triton_configs"] = os.environ["PATHKERNELS_TRITON_CONFIGS"]
    levels = results["leaf_level"] = []
    cases = TINY_HEAD_CASES if device == "cpu" else QUICK_HEAD_CASES if args.quick else HEAD_CASES
    timing = {"min_seconds": 0.3 if args.quick else 0.5, "statistic": "min"}
    if device == "cpu":
        timing = {"min_runs": 1, "min_seconds": 0.0}
    for n, heads, count in cases:
        r = heads_case(n, heads, count, device, triton_leaf, timing)
        levels.append(r)
        save()
        print_heads_case(r)

    if args.only is None:
        engine_and_billion(args, results, floor, save)
    results["complete"] = True
    save()
    if args.out:
        print(f"wrote {args.out}")
    return 0


def engine_and_billion(args, results: dict, floor: float, save) -> None:
    """Sections 3 and 4: the engine on complete trees, then the 10^9-leaf tree."""
    engines = results["engine"] = []
    columns = [*ENGINE_VARIANTS, "levelwise"] + ([] if args.quick else ["levelwise_compiled"])
    print(
        f"\nengine, seconds per call\n{'L':>2} {'H':>3} {'n':>4} {'skip':<5} {'paths':>11} "
        + " ".join(f"{c[:12]:>12}" for c in columns)
        + f" {'best vs level':>13} {'of floor':>8} {'peak MiB':>8}"
    )
    for case in QUICK_ENGINE_CASES if args.quick else ENGINE_CASES:
        r = engine_case(*case, floor, compiled=not args.quick)
        engines.append(r)
        save()
        best = best_exact(r)
        speedup = r.get(f"{best}_vs_best_levelwise")
        print(
            f"{r['layers']:>2} {r['heads']:>3} {r['n']:>4} {r['skip']!s:<5} {r['paths']:>11,} "
            + " ".join(seconds_cell(r, c, 12) for c in columns)
            + f" {(f'{speedup:.1f}x' if speedup else '—'):>13} {r[f'{best}_fraction_of_floor']:>8.0%} "
            f"{r[f'{best}_peak_mib']:>8.0f}",
            flush=True,
        )
    for r in engines:
        for key, value in r.items():
            if key.endswith("_error"):
                print(f"  ({r['layers']}, {r['heads']}, {r['n']}) {key}: {value}")

    layers, heads, n = BILLION
    billion = results["billion"] = {"layers": layers, "heads": heads, "n": n, "paths": heads**layers}
    attn = random_attention(layers, heads, n, n, device="cuda", generator=torch.Generator().manual_seed(0))
    for name in (best_exact(engines[0]), "tensor_fast"):
        rate = engines[0].get(f"{name}_paths_per_s")  # (6, 10, 64): the same n and H
        if not rate:
            continue
        predicted = heads**layers / rate
        billion[f"{name}_predicted_s"] = predicted
        if predicted > args.limit:
            print(f"\n10^9 leaves, {name}: predicted {predicted:.0f} s from {rate:.3g} paths/s, above --limit; not run")
            continue
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        result = pk.path_residuals(attn, pk.PathTree.complete(layers, heads), progress=True, **ENGINE_VARIANTS[name])
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        # residual and norm are stored; ratio is computed lazily from them.
        results_gib = 2 * result.residual.numel() * result.residual.element_size() / 2**30
        billion[name] = {
            "seconds": seconds,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            "results_gib": results_gib,
            "finite": bool(torch.isfinite(result.ratio).all()),
        }
        save()
        del result
        print(
            f"\n10^9 leaves (L = {layers}, H = {heads}, n = {n}), {name}: {seconds:.1f} s, peak "
            f"{billion[name]['peak_gib']:.1f} GiB (of which results {results_gib:.1f} GiB)",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
