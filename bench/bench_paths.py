"""Benchmark of the path-tree engine (pk.path_residuals on complete trees, attention products).

Each case runs in its own process, so that its peak memory is its own. Reported per case:
- time (best of several runs: this VM's timings vary by ±30 %), paths per second;
- GFLOP/s over the GEMM work of the head nodes (2·n³ each, docs/DESIGN.md §5) and its fraction of the
  GEMM floor, a 4096² float32/float64 matmul measured in the same run, and of the engine's own GEMM
  on a 512² product (one thread, times the threads: ``own_gemm_rate``), which on CPUs where the
  BLAS does not take its widest kernels (MKL on AMD's AVX-512) lies far above that floor;
- speed-up over (b) the best pure-PyTorch level-wise implementation (stacked GEMMs per level,
  materialised, then the norms; one top-level branch at a time to bound its memory) and over (a)
  the per-path loop (timed on a sample of paths, extrapolated to the tree);
- peak memory growth of the engine and of (b);
- on the CPU, the bare products the engine's work is made of, at each n and dtype, in the same run:
  ``torch.bmm`` of two batches and ``torch.matmul`` with a shared left factor, on operands in cache
  (1 MiB) and streamed from memory (256 MiB), with their fraction of the floor.
The machine is named by its CPU model and vector instruction sets (``/proc/cpuinfo``).

    python bench/bench_paths.py                       # the full grid, about 10 minutes on 2 cores
    python bench/bench_paths.py --quick               # three small cases
    python bench/bench_paths.py --out bench/results/paths-cpu-dev.json
    python bench/bench_paths.py --gemm-cost           # the engine's own GEMM against ATen's BLAS

--gemm-cost times path_residuals on GRID's trees with the engine's reproducible GEMM (gemm_cpu.h)
and with PATHKERNELS_ENGINE_GEMM=aten (the same engine on ATen's BLAS), each call in a fresh
process, alternating, best of --rounds rounds of three calls: a cost the engine must keep within 5 %.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import torch

from pathkernels.app.benchmarks import (
    bare_product_rates,
    format_table,
    gemm_rate,
    head_node_flops,
    machine_description,
    own_gemm_rate,
    peak_rss,
    reset_peak_rss,
    seconds_per_call,
)
from pathkernels.reference import levelwise_ref, per_path_loop_ref

GRID = [(6, 6, 64), (4, 12, 64), (8, 4, 32), (5, 8, 128)]
LARGE = (7, 10, 32)  # 10^7 leaves without skip
QUICK = [(4, 6, 32), (3, 12, 64), (5, 4, 64)]
LOOP_SAMPLE = 128
COLUMNS = [
    ("L", "layers", ""),
    ("H", "heads", ""),
    ("n", "n", ""),
    ("dtype", "dtype", "<"),
    ("skip", "skip", "<"),
    ("paths", "paths", ","),
    ("engine s", "engine_s", ".3f"),
    ("paths/s", "paths_per_s", ".3g"),
    ("GFLOP/s", "gflops", ".1f"),
    ("of floor", "fraction_of_gemm_floor", ".0%"),
    ("of own", "fraction_of_own_gemm", ".0%"),
    ("vs level", "speedup_vs_levelwise", ".1f", "x"),
    ("vs loop", "speedup_vs_loop", ".0f", "x"),
    ("peak MiB", "engine_peak_mib", ".1f"),
    ("results", "results_mib", ".1f"),
    ("level MiB", "levelwise_peak_mib", ".1f"),
]


def run_case(layers, heads, n, dtype_name, skip, what, device="cpu"):
    """In a fresh process: time `what` ('engine' or 'levelwise') and measure its peak memory growth
    (resident set on CPU, allocated device memory on CUDA)."""
    import pathkernels as pk
    from pathkernels.testing import random_attention

    dtype = getattr(torch, dtype_name)
    attn = random_attention(layers, heads, n, n, dtype=dtype, device=device, generator=torch.Generator().manual_seed(0))
    tree = pk.PathTree.complete(layers, heads, skip=skip)
    warm = pk.PathTree.complete(1, heads, skip=skip)
    pk.path_residuals(attn[:1], warm)
    levelwise_ref(attn[:2], skip)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = reset_peak_rss()
    if what == "engine":
        seconds = seconds_per_call(lambda: pk.path_residuals(attn, tree), device, statistic="min")
    else:
        seconds = seconds_per_call(
            lambda: levelwise_ref(attn, skip), device, min_runs=1, min_seconds=0, statistic="min"
        )
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else peak_rss()
    return seconds, peak - before


def isolated(*args):
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(run_case, args)


def bench_case(layers, heads, n, dtype_name, skip, gemm, with_levelwise=True, device="cpu"):
    import pathkernels as pk
    from pathkernels.testing import random_attention

    dtype = getattr(torch, dtype_name)
    paths = pk.count_paths(layers, heads, skip=skip)
    engine_s, engine_mem = isolated(layers, heads, n, dtype_name, skip, "engine", device)
    flops = head_node_flops(layers, heads, n, skip)
    row = {
        "device": device,
        "layers": layers,
        "heads": heads,
        "n": n,
        "dtype": dtype_name,
        "skip": skip,
        "paths": paths,
        "engine_s": engine_s,
        "paths_per_s": paths / engine_s,
        "gflops": flops / engine_s / 1e9,
        "fraction_of_gemm_floor": flops / engine_s / gemm[dtype_name],
        "engine_peak_mib": engine_mem / 2**20,
        "results_mib": 2 * paths * torch.finfo(dtype).bits / 8 / 2**20,  # residual and norm [1, M]
    }
    if with_levelwise:
        levelwise_s, levelwise_mem = isolated(layers, heads, n, dtype_name, skip, "levelwise", device)
        row.update(
            levelwise_s=levelwise_s,
            speedup_vs_levelwise=levelwise_s / engine_s,
            levelwise_peak_mib=levelwise_mem / 2**20,
        )
    attn = random_attention(layers, heads, n, n, dtype=dtype, device=device)
    sample = pk.sample_paths(layers, heads, min(LOOP_SAMPLE, paths), skip=skip)
    loop_s = (
        seconds_per_call(lambda: per_path_loop_ref(attn, sample), device, min_runs=1, min_seconds=0, statistic="min")
        / sample.shape[0]
        * paths
    )
    row.update(loop_s_estimated=loop_s, speedup_vs_loop=loop_s / engine_s)
    return row


BARE_COLUMNS = [
    ("n", "n", ""),
    ("dtype", "dtype", "<"),
    ("bmm cache", "bmm_cached", ".1f"),
    ("of floor", "bmm_cached_of_floor", ".0%"),
    ("bmm stream", "bmm_streamed", ".1f"),
    ("shared cache", "shared_cached", ".1f"),
    ("of floor", "shared_cached_of_floor", ".0%"),
    ("shared stream", "shared_streamed", ".1f"),
]


def engine_seconds(layers, heads, n, dtype_name, calls=3) -> float:
    """Best of ``calls`` timed ``path_residuals`` calls on a complete tree without skip (after a warm-up)."""
    import pathkernels as pk
    from pathkernels.testing import random_attention

    dtype = getattr(torch, dtype_name)
    attn = random_attention(layers, heads, n, n, dtype=dtype, generator=torch.Generator().manual_seed(0))
    tree = pk.PathTree.complete(layers, heads)
    pk.path_residuals(attn[:1], pk.PathTree.complete(1, heads))
    return seconds_per_call(
        lambda: pk.path_residuals(attn, tree), "cpu", min_runs=calls, min_seconds=0, statistic="min"
    )


def gemm_cost(rounds: int) -> list[dict]:
    """The engine's time with its own GEMM against ATen's, per GRID case and dtype (see the module
    docstring); each timing in a fresh process, the two alternating so that drift hits both."""
    rows = []
    for dtype_name in ("float32", "float64"):
        for layers, heads, n in GRID:
            times = {"own": [], "aten": []}
            for _ in range(rounds):
                for which in times:
                    env = {k: v for k, v in os.environ.items() if k != "PATHKERNELS_ENGINE_GEMM"}
                    if which == "aten":
                        env["PATHKERNELS_ENGINE_GEMM"] = "aten"
                    code = (
                        "import sys; sys.path.insert(0, 'bench'); from bench_paths import engine_seconds; "
                        f"print(engine_seconds({layers}, {heads}, {n}, {dtype_name!r}))"
                    )
                    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
                    if result.returncode != 0:
                        raise RuntimeError(result.stderr)
                    times[which].append(float(result.stdout.split()[-1]))
            own, aten = min(times["own"]), min(times["aten"])
            rows.append(
                {
                    "L": layers,
                    "H": heads,
                    "n": n,
                    "dtype": dtype_name,
                    "aten_s": aten,
                    "own_s": own,
                    "cost": own / aten - 1,
                }
            )
            print(
                f"L{layers} H{heads} n{n} {dtype_name}: ATen {aten:.3f} s, own {own:.3f} s, {rows[-1]['cost']:+.1%}",
                flush=True,
            )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Path-tree engine vs pure PyTorch")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--gemm-cost", action="store_true", help="the engine's own GEMM against ATen's BLAS")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of --gemm-cost")
    args = parser.parse_args(argv)
    if args.gemm_cost:
        rows = gemm_cost(args.rounds)
        if args.out:
            payload = {"threads": torch.get_num_threads(), "torch": torch.__version__, "gemm_cost": rows}
            args.out.write_text(json.dumps(payload, indent=2) + "\n")
        return 0

    import pathkernels as pk

    device = args.device
    gemm = {name: gemm_rate(getattr(torch, name), device) for name in ("float32", "float64")}
    rows = []
    cases = QUICK if args.quick else GRID
    dtypes = ("float32",) if args.quick else ("float32", "float64")
    for dtype_name in dtypes:
        for skip in (False, True):
            for layers, heads, n in cases:
                rows.append(bench_case(layers, heads, n, dtype_name, skip, gemm, device=device))
                print(format_table(rows[-1:], COLUMNS).splitlines()[-1], flush=True)
    if not args.quick:
        rows.append(bench_case(*LARGE, "float32", False, gemm, with_levelwise=False, device=device))
    # The floor is the best rate seen in the run.
    for name in gemm:
        gemm[name] = max(gemm[name], gemm_rate(getattr(torch, name), device))
    own = {name: own_gemm_rate(getattr(torch, name)) for name in gemm} if device == "cpu" else {}
    for r in rows:
        r["fraction_of_gemm_floor"] = r["gflops"] * 1e9 / gemm[r["dtype"]]
        if own:
            r["fraction_of_own_gemm"] = r["gflops"] * 1e9 / own[r["dtype"]]
    machine = machine_description(device)
    print(
        f"pathkernels {pk.__version__} path engine, {machine}, torch {torch.__version__}; "
        f"GEMM floor float32 {gemm['float32'] / 1e9:.1f} GFLOP/s, float64 {gemm['float64'] / 1e9:.1f} GFLOP/s"
        + (
            f"; the engine's own GEMM (512², one thread, × threads) {own['float32'] / 1e9:.1f} and "
            f"{own['float64'] / 1e9:.1f} GFLOP/s"
            if own
            else ""
        )
    )
    print(format_table(rows, COLUMNS))
    bare = []
    if device == "cpu":  # the bare products the engine's GEMM work is made of, in the same run
        for dtype_name in dtypes:
            for n in sorted({n for _, _, n in cases}):
                rates = bare_product_rates(n, getattr(torch, dtype_name))
                bare.append({"n": n, "dtype": dtype_name, **{k: v / 1e9 for k, v in rates.items()}})
                bare[-1] |= {f"{k}_of_floor": v / gemm[dtype_name] for k, v in rates.items()}
        print("Bare products, GFLOP/s (of the floor): bmm and a shared left factor, in cache and streamed")
        print(format_table(bare, BARE_COLUMNS))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "machine": machine,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "build": pk.build_info(),
            "gemm_gflops": {k: v / 1e9 for k, v in gemm.items()},
            "own_gemm_gflops": {k: v / 1e9 for k, v in own.items()},
            "bare_products_gflops": bare,
            "results": rows,
        }
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
