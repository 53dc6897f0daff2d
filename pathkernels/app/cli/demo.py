"""``pathkernels demo``: every experiment in seven sections, with tables, CSV files and PNG plots."""

from __future__ import annotations

import importlib.util
import math
import time

import torch

from pathkernels import __version__
from pathkernels.app import experiments
from pathkernels.app.benchmarks import machine_description
from pathkernels.app.cli.bench import bench_tables
from pathkernels.app.cli.collapse import collapse_table
from pathkernels.app.cli.common import heading, resolve_device, save
from pathkernels.app.cli.paths import paths_table
from pathkernels.core._docs import doc_path
from pathkernels.core._extension import build_info
from pathkernels.core.ops import matrix_norms, residual_norm
from pathkernels.testing import random_attention


def worked_example() -> str:
    """The 2×2 example of docs/USAGE.md, then the collapse of a product of attention matrices."""
    x = torch.tensor([[1.0, -2.0], [3.0, 4.0]], dtype=torch.float64)
    plain = matrix_norms(x)
    res = matrix_norms(x, residual=True)
    lines = [
        "Worked example: x = [[1, -2], [3, 4]], column mean μ = (2, 1), res(x) = x − 1μᵀ = [[-1, -3], [1, 3]]",
        (
            f"  ‖x‖_1 = {plain.l1.item():g} (max column abs sum)   ‖x‖_∞ = {plain.linf.item():g} "
            f"(max row abs sum)   ‖x‖_1,∞ = √42 = {plain.composite.item():.6f}"
        ),
        (
            f"  ‖res‖_1 = {res.l1.item():g}   ‖res‖_∞ = {res.linf.item():g}   "
            f"‖res‖_1,∞ = √24 = {res.composite.item():.6f}   (check: {math.sqrt(24):.6f})"
        ),
        "",
        "Pure attention collapses to rank 1: P = A_L ⋯ A_1 for random softmax attention (n = 32, float64)",
        f"  {'depth L':>7} {'‖res(P)‖_1,∞':>14} {'‖P‖_1,∞':>10} {'ratio':>10}",
    ]
    attn = random_attention(12, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    product = torch.eye(32, dtype=torch.float64)
    for depth in range(1, 13):
        product = attn[depth - 1] @ product
        if depth in (1, 2, 3, 4, 6, 8, 12):
            residual, norm = residual_norm(product, return_norm=True)
            ratio = (residual / norm).item()
            lines.append(f"  {depth:>7} {residual.item():>14.3e} {norm.item():>10.4f} {ratio:>10.3e}")
    return "\n".join(lines)


def trained_section(out) -> None:
    """Section 6: the induction fixture's paths to its prediction, and the collapse of a trained
    fixture's path terms against its initialisation."""
    example = experiments.induction_example(top_k=8)
    result = example.attribution
    print(
        f"attn_only_2l (pathkernels.fixtures), a 2-layer, 4-head attention-only GPT-2 trained to continue repeated "
        f"tokens, on [BOS, A, A] at token {example.position} of the second copy: the logit of token "
        f"{example.target}, the one that followed it the first time (induction's prediction), is "
        f"{float(result.value[0, 0]):.4f} ({float(result.constant[0, 0]):+.4f} of it constant). Its largest paths:"
    )
    top = result.to_frame()[["rank", "path", "attribution", "share"]]
    print(top.to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    print("By number of heads (exact sums over all 37 paths; share of what the paths carry):")
    print(example.by_length.to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    print(
        "Every head of layer 1 is an induction head: the embedding of the token after the first occurrence,\n"
        "read by one of them and written straight to the logit, is the largest single path "
        f"({doc_path('FIXTURES.md')})."
    )
    save(out, "induction_paths", top, result.plot(8))
    collapse = experiments.trained_collapse("gpt2_4l")
    print()
    print("gpt2_4l (4 layers, 4 heads, MLPs) trained against the same architecture at initialisation: the median")
    print("residual ratio ‖T − 1μᵀ‖_1,∞ / ‖T‖_1,∞ of its path terms T, by heads on the path (exact, all 937 paths)")
    wide = collapse.pivot(index="length", columns="weights", values="median")[["trained", "initialisation"]]
    print(wide.to_string(float_format=lambda v: f"{v:.3f}"))
    print("At initialisation every head averages, and each head on a path takes its term further toward rank 1;")
    print("trained, its heads attend sharply (mostly to one token each) and the terms keep their rank.")
    save(out, "trained_collapse", collapse, experiments.plot_trained_collapse(collapse))


# What the sections import beyond torch: checked before any work, so that a missing one (section 6's
# transformers) is named at once rather than after minutes of the earlier sections.
DEMO_PACKAGES = ("pandas", "matplotlib", "transformers")


def check_demo_packages() -> None:
    """Raises ModuleNotFoundError (which the command line names, with its pip name) for the first of
    DEMO_PACKAGES that is not installed; imports none of them."""
    for package in DEMO_PACKAGES:
        if importlib.util.find_spec(package) is None:
            raise ModuleNotFoundError(f"No module named {package!r}", name=package)


def run_demo(args) -> int:
    start = time.perf_counter()
    check_demo_packages()
    quick = args.quick
    device = resolve_device(args.device, "demo")
    print(f"pathkernels {__version__}, torch {torch.__version__}, {machine_description(device)}; build: {build_info()}")
    heading("1. The norm")
    print(worked_example())

    heading("2. Rank collapse against depth at initialisation: pure attention, +MLP, +skip, transformer")
    collapse_table(
        layers=6 if quick else 12,
        width=32 if quick else 64,
        heads=4,
        tokens=16 if quick else 32,
        batch=4 if quick else 8,
        seeds=1 if quick else 3,
        out=args.out,
    )

    heading("3. Residual ratio of every path, by length (exact)")
    paths_table(
        layers=4 if quick else 6,
        heads=3 if quick else 4,
        width=32,
        tokens=16 if quick else 32,
        device=device,
        out=args.out,
    )

    heading("4. How the paths of common architectures spread over lengths: C(L, k) H^k of (H+1)^L")
    lengths = experiments.path_length_distribution()
    summary = []
    for name, rows in lengths.groupby("architecture", sort=False):
        layers, heads = int(rows["layers"].iloc[0]), int(rows["heads"].iloc[0])
        counts = rows["path_count"].tolist()  # exact ints: ties are ties, not rounding
        modes = [int(k) for k, count in zip(rows["length"], counts) if count == max(counts)]
        mode = (
            f"most common length {modes[0]}"
            if len(modes) == 1
            else f"most common lengths {' and '.join(map(str, modes))} (tied)"
        )
        short = rows[rows["length"] <= 3]["share"].sum()
        summary.append(
            f"  {name:<34} L = {layers:>2}, H = {heads:>2}: "
            f"(H+1)^L = 10^{layers * math.log10(heads + 1):.1f} paths, {mode}, share of length ≤ 3: "
            f"{short:.1e}"
        )
    print("\n".join(summary))
    save(args.out, "path_lengths", lengths, experiments.plot_path_lengths(lengths))

    heading("5. Path effectiveness: sorting with an attention-only model, keeping paths of length ≤ k")
    result = experiments.path_effectiveness(
        steps=200 if quick else 1000, test_size=512 if quick else 2048, progress=True
    )
    print(
        f"trained in {result.train_seconds:.0f} s (final loss {result.final_loss:.4f}); exact truncations by "
        "pk.length_sums; k = L is the model itself"
    )
    print(result.table.to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    save(args.out, "path_effectiveness", result.table, experiments.plot_effectiveness(result.table))

    heading("6. A trained model: which paths write a prediction, and how far its paths collapse")
    trained_section(args.out)

    heading("7. Speed against pure PyTorch (quick sizes; bench/ has the full suite)")
    bench_tables(device=device, quick=True, out_dir=args.out)
    print()
    print(f"demo finished in {time.perf_counter() - start:.0f} s" + (f"; outputs in {args.out}/" if args.out else ""))
    return 0
