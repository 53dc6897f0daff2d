"""Benchmark of the fused norm ops against the pure-PyTorch reference.

For each case it reports the time of pk.residual_norm(x, return_norm=True) and pk.composite_norm(x),
the speed-up over pathkernels.reference, and the achieved bandwidth (one read of x, the floor) as a
fraction of the copy bandwidth measured in the same run (x.copy_: one read and one write).

    python bench/bench_norms.py                 # CPU, the default cases
    python bench/bench_norms.py --device cuda   # on a GPU
    python bench/bench_norms.py --quick         # small cases, for the demo
Results go to bench/results/ as JSON (--out) and to stdout as a table.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch
from torch.utils.benchmark import Timer

import pathkernels as pk
from pathkernels import reference
from pathkernels.testing import random_matrices

DEFAULT_CASES = [(4096, 64, 64), (256, 512, 512), (64, 128, 768)]
QUICK_CASES = [(1024, 64, 64), (32, 256, 256)]


def timed(fn, min_run_time: float) -> float:
    """Median seconds per call of fn()."""
    return Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median


def reference_residual_and_norm(x):
    return reference.residual_norm_ref(x), reference.composite_norm_ref(x)


def sync(device: str):
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def run_case(shape, dtype, device, min_run_time):
    x = random_matrices(*shape, dtype=dtype, device=device)
    out = torch.empty_like(x)
    wait = sync(device)

    def run(fn):
        def call():
            fn()
            wait()
        return timed(call, min_run_time)

    bytes_read = x.numel() * x.element_size()
    copy_s = run(lambda: out.copy_(x))
    copy_bandwidth = 2 * bytes_read / copy_s
    rows = []
    for name, fused, ref in [
        ("residual_norm", lambda: pk.residual_norm(x, return_norm=True), lambda: reference_residual_and_norm(x)),
        ("composite_norm", lambda: pk.composite_norm(x), lambda: reference.composite_norm_ref(x)),
    ]:
        fused_s = run(fused)
        ref_s = run(ref)
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


def machine_description(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def format_table(rows) -> str:
    header = f"{'op':<15} {'shape':<18} {'dtype':<8} {'fused ms':>9} {'ref ms':>9} {'speed-up':>8} {'GB/s':>7} {'of copy':>7}"
    lines = [header, "-" * len(header)]
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        lines.append(
            f"{r['op']:<15} {shape:<18} {r['dtype']:<8} {r['fused_ms']:>9.3f} {r['reference_ms']:>9.3f} "
            f"{r['speedup']:>7.1f}x {r['bandwidth_gbs']:>7.1f} {r['fraction_of_copy']:>7.0%}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "float16", "bfloat16"])
    parser.add_argument("--quick", action="store_true", help="small cases and short timing (the demo)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not (torch.cuda.is_available() and pk.build_info()["cuda"]):
        parser.error("--device cuda needs a GPU and pathkernels built with CUDA")

    dtype = getattr(torch, args.dtype)
    cases = QUICK_CASES if args.quick else DEFAULT_CASES
    min_run_time = 0.2 if args.quick else 1.0
    rows = [row for shape in cases for row in run_case(shape, dtype, args.device, min_run_time)]
    machine = machine_description(args.device)
    print(f"pathkernels {pk.__version__} fused norms vs pure PyTorch on {machine} (torch {torch.__version__})")
    print(format_table(rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = dict(machine=machine, torch=torch.__version__, build=pk.build_info(), results=rows)
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
