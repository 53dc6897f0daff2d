"""Timing helpers shared by bench/ scripts and the command line.

The norm benchmarks compare a fused op with its pure-PyTorch reference (pathkernels.reference) on
the same inputs, and relate the achieved bandwidth to the copy bandwidth measured in the same run.
The path benchmarks compare the engine with (b) the best pure-PyTorch level-wise implementation
and (a) the per-path loop (docs/DESIGN.md §5).
"""
from __future__ import annotations

import platform
from collections.abc import Callable

import torch
from torch.utils.benchmark import Timer

from pathkernels import ops, reference
from pathkernels.testing import random_matrices

NORM_CASES = [(4096, 64, 64), (256, 512, 512), (64, 128, 768), (256, 128, 768)]
QUICK_NORM_CASES = [(1024, 64, 64), (32, 256, 256)]


def median_seconds(fn: Callable[[], object], device: str, min_run_time: float) -> float:
    """Median wall time of one call of fn(), waiting for the device to finish each call, with
    torch's current number of threads (``Timer`` alone would time on one thread)."""
    wait = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def call():
        fn()
        wait()

    timer = Timer(stmt="call()", globals={"call": call}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median


def interleaved_seconds(
    fn: Callable[[], object], baseline: Callable[[], object], device: str, min_run_time: float, rounds: int = 8
) -> tuple[float, float, float]:
    """Time fn and baseline in alternation, ``rounds`` times each for ``min_run_time / rounds``.

    Returns the median over rounds of fn's seconds, of baseline's seconds, and of the per-round
    ratio ``baseline_s / fn_s``. On a shared machine whose speed drifts (a neighbour's load), a
    ratio taken within a round is steadier than a ratio of two medians taken seconds apart.
    """
    per_round = min_run_time / rounds
    fn_s, baseline_s = [], []
    for _ in range(rounds):
        baseline_s.append(median_seconds(baseline, device, per_round))
        fn_s.append(median_seconds(fn, device, per_round))
    ratios = [b / f for b, f in zip(baseline_s, fn_s)]
    return tuple(float(torch.tensor(v, dtype=torch.float64).median()) for v in (fn_s, baseline_s, ratios))


def machine_description(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def norm_benchmark(shape, dtype=torch.float32, device="cpu", min_run_time=1.0) -> list[dict]:
    """Time residual_norm (alone, and with the plain norm: ``return_norm=True``) and composite_norm
    on x = randn(shape), each against its pure-PyTorch reference.

    Bandwidth counts one read of x, the floor for these ops; ``fraction_of_copy`` divides it by
    the bandwidth of ``out.copy_(x)`` (one read and one write), timed in alternation with the op
    (the median over rounds of the per-round fraction).
    """
    x = random_matrices(*shape, dtype=dtype, device=device)
    out = torch.empty_like(x)
    bytes_read = x.numel() * x.element_size()

    def copy():
        out.copy_(x)

    cases = [
        ("residual_norm", lambda: ops.residual_norm(x), lambda: reference.residual_norm_ref(x)),
        (
            "residual+norm",
            lambda: ops.residual_norm(x, return_norm=True),
            lambda: (reference.residual_norm_ref(x), reference.composite_norm_ref(x)),
        ),
        ("composite_norm", lambda: ops.composite_norm(x), lambda: reference.composite_norm_ref(x)),
    ]
    rows = []
    for name, fused, ref in cases:
        fused_s, copy_s, copy_over_fused = interleaved_seconds(fused, copy, device, 2 * min_run_time)
        ref_s = median_seconds(ref, device, min_run_time)
        bandwidth = bytes_read / fused_s
        copy_bandwidth = 2 * bytes_read / copy_s
        rows.append(
            {
                "op": name,
                "shape": list(shape),
                "dtype": str(dtype).removeprefix("torch."),
                "device": device,
                "fused_ms": fused_s * 1e3,
                "reference_ms": ref_s * 1e3,
                "speedup": ref_s / fused_s,
                "bandwidth_gbs": bandwidth / 1e9,
                "copy_bandwidth_gbs": copy_bandwidth / 1e9,
                # copy moves 2 bytes per byte of x: copy_s / (2 fused_s), per round.
                "fraction_of_copy": copy_over_fused / 2,
            }
        )
    return rows


def format_norm_table(rows: list[dict]) -> str:
    header = (
        f"{'op':<15} {'shape':<14} {'dtype':<8} {'fused ms':>9} {'torch ms':>9} {'speed-up':>8} "
        f"{'GB/s':>6} {'of copy':>7}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        lines.append(
            f"{r['op']:<15} {shape:<14} {r['dtype']:<8} {r['fused_ms']:>9.3f} {r['reference_ms']:>9.3f} "
            f"{r['speedup']:>7.1f}x {r['bandwidth_gbs']:>6.1f} {r['fraction_of_copy']:>7.0%}"
        )
    return "\n".join(lines)


# --- the path engine against pure PyTorch -------------------------------------------------------

def head_node_flops(layers: int, heads: int, n: int, skip: bool) -> int:
    """2·n³ per node that takes a head; level l has (H + skip)^(l-1) parents, each with H such children."""
    choices = heads + int(skip)
    return sum(2 * n**3 * choices ** (level - 1) * heads for level in range(1, layers + 1))


def composite(m: torch.Tensor) -> torch.Tensor:
    """``sqrt(max column abs sum · max row abs sum)`` in plain PyTorch."""
    a = m.abs()
    return torch.sqrt(a.sum(-2).amax(-1) * a.sum(-1).amax(-1))


def levelwise_baseline(attn: torch.Tensor, skip: bool):
    """(b): every level as stacked GEMMs, materialised, then the norms, per top-level branch."""
    layers, heads, n = attn.shape[0], attn.shape[1], attn.shape[-1]
    eye = torch.eye(n, dtype=attn.dtype, device=attn.device)
    residuals, norms = [], []
    for first in ([None] if skip else []) + list(range(heads)):
        level = (eye if first is None else attn[0, first]).unsqueeze(0)
        for layer in range(1, layers):
            stacked = torch.matmul(attn[layer].unsqueeze(1), level.unsqueeze(0)).flatten(0, 1)
            level = torch.cat([level, stacked]) if skip else stacked
        residuals.append(composite(level - level.mean(-2, keepdim=True)))
        norms.append(composite(level))
    return torch.cat(residuals), torch.cat(norms)


def per_path_loop(attn: torch.Tensor, paths: torch.Tensor):
    """(a): one product per path, then its norms."""
    n = attn.shape[-1]
    out = []
    for path in paths.tolist():
        m = torch.eye(n, dtype=attn.dtype, device=attn.device)
        for layer, head in enumerate(path):
            if head >= 0:
                m = attn[layer, head] @ m
        out.append((composite(m - m.mean(-2, keepdim=True)), composite(m)))
    return out


QUICK_PATH_CASES = [(4, 6, 32), (3, 12, 64)]


def path_benchmark(layers: int, heads: int, n: int, *, dtype=torch.float32, skip: bool = True, device: str = "cpu",
                   min_run_time: float = 0.5, loop_sample: int = 64) -> dict:
    """Engine against (b) the level-wise baseline and (a) the per-path loop, on one complete tree.

    In-process and without memory accounting (``bench/bench_paths.py`` isolates each case in its
    own process and measures peak memory). The loop is timed on ``loop_sample`` sampled paths and
    extrapolated to the whole tree.
    """
    from pathkernels.engine import path_residuals
    from pathkernels.paths import PathTree, count_paths, sample_paths
    from pathkernels.testing import random_attention

    attn = random_attention(layers, heads, n, n, dtype=dtype, device=device, generator=torch.Generator().manual_seed(0))
    tree = PathTree.complete(layers, heads, skip=skip)
    paths = count_paths(layers, heads, skip=skip)
    engine_s = median_seconds(lambda: path_residuals(attn, tree), device, min_run_time)
    levelwise_s = median_seconds(lambda: levelwise_baseline(attn, skip), device, min_run_time)
    sample = sample_paths(layers, heads, min(loop_sample, paths), skip=skip)
    loop_s = median_seconds(lambda: per_path_loop(attn, sample), device, min_run_time) / sample.shape[0] * paths
    return {"layers": layers, "heads": heads, "n": n, "dtype": str(dtype).removeprefix("torch."), "skip": skip,
            "device": device, "paths": paths, "engine_ms": engine_s * 1e3, "levelwise_ms": levelwise_s * 1e3,
            "loop_ms_estimated": loop_s * 1e3, "speedup_vs_levelwise": levelwise_s / engine_s,
            "speedup_vs_loop": loop_s / engine_s, "gflops": head_node_flops(layers, heads, n, skip) / engine_s / 1e9}


def format_path_table(rows: list[dict]) -> str:
    header = (f"{'L':>2} {'H':>3} {'n':>4} {'skip':<5} {'paths':>9} {'engine ms':>10} {'level ms':>9} "
              f"{'loop ms':>9} {'vs level':>8} {'vs loop':>8} {'GFLOP/s':>8}")
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['layers']:>2} {r['heads']:>3} {r['n']:>4} {r['skip']!s:<5} {r['paths']:>9,} {r['engine_ms']:>10.2f} "
            f"{r['levelwise_ms']:>9.2f} {r['loop_ms_estimated']:>9.1f} {r['speedup_vs_levelwise']:>7.1f}x "
            f"{r['speedup_vs_loop']:>7.0f}x {r['gflops']:>8.1f}"
        )
    return "\n".join(lines)
