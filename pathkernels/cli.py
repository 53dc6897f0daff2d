"""The ``pathkernels`` command line (also ``python -m pathkernels``)."""
from __future__ import annotations

import argparse
import math

import torch

import pathkernels as pk
from pathkernels.benchmarks import QUICK_NORM_CASES, format_norm_table, machine_description, norm_benchmark
from pathkernels.testing import random_attention


def worked_example() -> str:
    """The 2×2 example of the README, then the collapse of a product of attention matrices."""
    x = torch.tensor([[1.0, -2.0], [3.0, 4.0]], dtype=torch.float64)
    plain = pk.matrix_norms(x)
    res = pk.matrix_norms(x, residual=True)
    lines = [
        "Worked example: x = [[1, -2], [3, 4]], column mean μ = (2, 1), res(x) = x − 1μᵀ = [[-1, -3], [1, 3]]",
        f"  ‖x‖_1 = {plain.l1.item():g} (max column abs sum)   ‖x‖_∞ = {plain.linf.item():g} (max row abs sum)"
        f"   ‖x‖_1,∞ = √42 = {plain.composite.item():.6f}",
        f"  ‖res‖_1 = {res.l1.item():g}   ‖res‖_∞ = {res.linf.item():g}   ‖res‖_1,∞ = √24 = {res.composite.item():.6f}"
        f"   (check: {math.sqrt(24):.6f})",
        "",
        "Pure attention collapses to rank 1: P = A_L ⋯ A_1 for random softmax attention (n = 32, float64)",
        f"  {'depth L':>7} {'‖res(P)‖_1,∞':>14} {'‖P‖_1,∞':>10} {'ratio':>10}",
    ]
    attn = random_attention(12, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    product = torch.eye(32, dtype=torch.float64)
    for depth in range(1, 13):
        product = attn[depth - 1] @ product
        if depth in (1, 2, 3, 4, 6, 8, 12):
            residual, norm = pk.residual_norm(product, return_norm=True)
            lines.append(f"  {depth:>7} {residual.item():>14.3e} {norm.item():>10.4f} {(residual / norm).item():>10.3e}")
    return "\n".join(lines)


def path_example() -> str:
    """An exact decomposition of a random attention-only network into all its paths, by length."""
    import time

    layers, heads, n = 6, 4, 32
    attn = random_attention(1, layers, heads, n, n, generator=torch.Generator().manual_seed(1))
    start = time.perf_counter()
    dec = pk.decompose(attn, skip=True)
    seconds = time.perf_counter() - start
    table = dec.by_length()[["length", "path_count", "mean", "median", "q10", "q90"]]
    return (
        f"Residual ratio of the attention products P_p by path length: every one of the (H+1)^L = "
        f"{len(dec.paths):,} paths of a random L = {layers}, H = {heads}, n = {n} network ({seconds:.2f} s)\n"
        + table.to_string(index=False, float_format=lambda v: f"{v:.3e}")
    )


def demo(args: argparse.Namespace) -> int:
    print(f"pathkernels {pk.__version__}  build: {pk.build_info()}")
    print()
    print(worked_example())
    print()
    print(path_example())
    print()
    device = "cuda" if torch.cuda.is_available() and pk.build_info()["cuda"] else "cpu"
    print(f"Fused norms vs pure PyTorch on {machine_description(device)} (float32, quick sizes; bench/ has the full suite)")
    rows = [row for shape in QUICK_NORM_CASES for row in norm_benchmark(shape, torch.float32, device, 0.2)]
    print(format_norm_table(rows))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pathkernels", description="Path decompositions of attention networks")
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser("demo", help="worked example and a short speed comparison")
    demo_parser.set_defaults(run=demo)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)
