"""Timing helpers shared by bench/ scripts and the command line's demo.

Every benchmark compares a fused op with its pure-PyTorch reference (pathkernels.reference) on the
same inputs, and relates the achieved bandwidth to the copy bandwidth measured in the same run.
"""
from __future__ import annotations

import platform
from typing import Callable

import torch
from torch.utils.benchmark import Timer

from pathkernels import ops, reference
from pathkernels.testing import random_matrices

NORM_CASES = [(4096, 64, 64), (256, 512, 512), (64, 128, 768)]
QUICK_NORM_CASES = [(1024, 64, 64), (32, 256, 256)]


def median_seconds(fn: Callable[[], object], device: str, min_run_time: float) -> float:
    """Median wall time of one call of fn(), waiting for the device to finish each call."""
    wait = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def call():
        fn()
        wait()

    return Timer(stmt="call()", globals={"call": call}).blocked_autorange(min_run_time=min_run_time).median


def machine_description(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def norm_benchmark(shape, dtype=torch.float32, device="cpu", min_run_time=1.0) -> list[dict]:
    """Time residual_norm (with the plain norm) and composite_norm on x = randn(shape).

    Bandwidth counts one read of x, the floor for these ops; ``fraction_of_copy`` divides it by
    the bandwidth of ``out.copy_(x)`` (one read and one write) in the same run.
    """
    x = random_matrices(*shape, dtype=dtype, device=device)
    out = torch.empty_like(x)
    bytes_read = x.numel() * x.element_size()
    copy_bandwidth = 2 * bytes_read / median_seconds(lambda: out.copy_(x), device, min_run_time)
    cases = [
        (
            "residual_norm",
            lambda: ops.residual_norm(x, return_norm=True),
            lambda: (reference.residual_norm_ref(x), reference.composite_norm_ref(x)),
        ),
        ("composite_norm", lambda: ops.composite_norm(x), lambda: reference.composite_norm_ref(x)),
    ]
    rows = []
    for name, fused, ref in cases:
        fused_s = median_seconds(fused, device, min_run_time)
        ref_s = median_seconds(ref, device, min_run_time)
        bandwidth = bytes_read / fused_s
        rows.append(
            dict(
                op=name,
                shape=list(shape),
                dtype=str(dtype).removeprefix("torch."),
                device=device,
                fused_ms=fused_s * 1e3,
                reference_ms=ref_s * 1e3,
                speedup=ref_s / fused_s,
                bandwidth_gbs=bandwidth / 1e9,
                copy_bandwidth_gbs=copy_bandwidth / 1e9,
                fraction_of_copy=bandwidth / copy_bandwidth,
            )
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
