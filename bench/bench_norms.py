"""Benchmark of the fused norm ops against the pure-PyTorch reference.

Reports, per case, the time of pk.residual_norm(x) alone, with return_norm=True (which also measures
x itself) and of pk.composite_norm(x), the speed-up over pathkernels.reference, and the achieved
bandwidth (one read of x, the floor) as a fraction of the copy bandwidth measured in the same run
(out.copy_(x): one read, one write).

    python bench/bench_norms.py                         # CPU, default cases, table only
    python bench/bench_norms.py --out bench/results/norms-cpu.json
    python bench/bench_norms.py --device cuda --out bench/results/norms-h100.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import pathkernels as pk
from pathkernels.benchmarks import (
    NORM_CASES,
    QUICK_NORM_CASES,
    format_norm_table,
    machine_description,
    norm_benchmark,
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Fused norms vs pure PyTorch")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "float16", "bfloat16"])
    parser.add_argument("--quick", action="store_true", help="small cases, short timing")
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not (torch.cuda.is_available() and pk.build_info()["cuda"]):
        parser.error("--device cuda needs a GPU and pathkernels built with CUDA")

    dtype = getattr(torch, args.dtype)
    cases = QUICK_NORM_CASES if args.quick else NORM_CASES
    min_run_time = 0.2 if args.quick else 1.0
    rows = [row for shape in cases for row in norm_benchmark(shape, dtype, args.device, min_run_time)]
    machine = machine_description(args.device)
    print(f"pathkernels {pk.__version__}: fused norms vs pure PyTorch on {machine}, torch {torch.__version__}")
    print(format_norm_table(rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"machine": machine, "torch": torch.__version__, "build": pk.build_info(), "results": rows}
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
