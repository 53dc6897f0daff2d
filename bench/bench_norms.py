"""Benchmark of the fused norm ops against the pure-PyTorch reference, and of the Triton norm kernels.

1. (default) Per case, the time of pk.residual_norm(x) alone, with return_norm=True (which also
   measures x itself) and of pk.composite_norm(x), the speed-up over pathkernels.reference, and the
   achieved bandwidth (one read of x, the floor) as a fraction of the copy bandwidth measured in the
   same run (out.copy_(x): one read, one write).
2. (``--triton``, or ``--only triton`` for this section alone) The Triton kernels of
   pathkernels.core.triton_norms on batches of at least ``--mib`` MiB (256 by default)
   of [B, 64, 64], [B, 128, 128], [B, 256, 256] and [B, 32, 768] matrices, each op
   (residual_norm, residual+norm, composite_norm) against, in the same run and interleaved round by
   round: x.sum() (one read), a device copy (out.copy_(x): one read and one write), the existing
   kernel (pk's op: "cuda"; its CPU kernel in the dry run), torch.compile of the pure-PyTorch
   reference and the reference itself ("eager").
   Timed with CUDA events: the median over rounds of the mean time of a few back-to-back calls.
   Reports GB/s (bytes of x read once per call; twice for the copy), the fraction of the copy's
   bandwidth and of x.sum()'s, the speed-ups over the CUDA kernel, torch.compile and eager, the
   largest relative error against pk's op, and the autotuner's choice (with every config's time).
   Target: at least 80 % of the copy bandwidth and 3× torch.compile. The JSON is written
   after every case, so that a run cut short keeps what it measured ("complete": false); a
   candidate that fails is recorded with its error and the rest goes on.
   ``--device cpu --only triton`` is a dry run of this section: Triton's interpreter
   (TRITON_INTERPRET=1, set here), tiny batches, torch.compile with its "eager" backend.

    python bench/bench_norms.py                         # CPU, default cases, table only
    python bench/bench_norms.py --out bench/results/norms-cpu.json
    python bench/bench_norms.py --device cuda --out bench/results/norms-h100.json
    python bench/bench_norms.py --device cuda --only triton [--quick] --out bench/results/<dir>/norms_triton.json
    python bench/bench_norms.py --device cpu --only triton --out /tmp/dry.json   # dry run, no GPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import pathkernels as pk
from pathkernels import reference
from pathkernels.app.benchmarks import (
    NORM_CASES,
    QUICK_NORM_CASES,
    format_norm_table,
    machine_description,
    norm_benchmark,
)

# Section 2: matrix shapes (n, m); the batch is sized to --mib.
TRITON_SHAPES = [(64, 64), (128, 128), (256, 256), (32, 768)]
QUICK_TRITON_SHAPES = [(64, 64), (32, 768)]
DRY_RUN_MIB = 1 / 16  # --device cpu: 64 KiB batches in the interpreter
NORM_OPS = ("residual_norm", "residual+norm", "composite_norm")


def attempt(record: dict, name: str, fn):
    """fn()'s result, or None with the error recorded in record[name + "_error"]: out of memory, a
    kernel's failure, a torch.compile error, whatever it is, the other candidates still run."""
    try:
        return fn()
    except Exception as error:  # noqa: BLE001 (a benchmark records every failure and goes on)
        record[f"{name}_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None


def import_triton_norms(device: str, results: dict):
    """pathkernels.core.triton_norms, or None with the error recorded: the other candidates still run. On
    the CPU under TRITON_INTERPRET=1 (set here, before the module is imported)."""
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton

        import pathkernels.core.triton_norms as triton_norms

        triton_norms.require_triton()
        results["triton"] = triton.__version__
        return triton_norms
    except Exception as error:  # noqa: BLE001 (a benchmark records every failure and goes on)
        results["triton_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        print(f"triton: {results['triton_error']}", flush=True)
        return None


def seconds_per_call(fn, device: str, calls: int) -> float:
    """Mean seconds of `calls` back-to-back calls: CUDA events around them on the GPU (the device's
    own clock, after a synchronisation), perf_counter on the CPU."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - begin) / calls


def interleaved(candidates: dict, device: str, rounds: int, calls: dict, record: dict) -> dict:
    """Median over rounds of each candidate's seconds per call, the candidates timed in turn within
    every round (so that a drift of the clock or a neighbour's load touches all alike). A candidate
    that fails is dropped, its error recorded."""
    times = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            if f"{name}_error" not in record:
                seconds = attempt(record, name, lambda fn=fn, name=name: seconds_per_call(fn, device, calls[name]))
                if seconds is not None:
                    times[name].append(seconds)
    return {
        name: statistics.median(values) for name, values in times.items() if values and f"{name}_error" not in record
    }


def relative_error(got, want) -> float:
    """The largest relative error of got against want (float64, NaN-free inputs)."""
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).abs() / want.abs().clamp_min(torch.finfo(torch.float64).tiny)).max().item()


def triton_case(n: int, m: int, dtype: torch.dtype, device: str, mib: float, triton_norms, timing: dict) -> dict:
    """Section 2 for one matrix shape: every op's candidates and the sum and copy baselines, interleaved."""
    element = torch.tensor([], dtype=dtype).element_size()
    batch = max(1, math.ceil(mib * 2**20 / (n * m * element)))
    x = torch.randn(batch, n, m, device=device, dtype=dtype)
    out = torch.empty_like(x)
    nbytes = x.numel() * element
    row = {"n": n, "m": m, "batch": batch, "dtype": str(dtype).removeprefix("torch."), "mib": nbytes / 2**20}
    backend = "inductor" if device == "cuda" else "eager"  # the dry run checks the wrapping, not the codegen
    row["compile_backend"] = backend

    refs = {
        "residual_norm": reference.residual_norm_ref,
        "residual+norm": lambda v: (reference.residual_norm_ref(v), reference.composite_norm_ref(v)),
        "composite_norm": reference.composite_norm_ref,
    }
    fused = {
        "residual_norm": lambda: pk.residual_norm(x),
        "residual+norm": lambda: pk.residual_norm(x, return_norm=True),
        "composite_norm": lambda: pk.composite_norm(x),
    }
    candidates = {"sum": lambda: x.sum(), "copy": lambda: out.copy_(x)}
    calls = {"sum": timing["calls"], "copy": timing["calls"]}
    results = {}  # name: the first call's result, for the error against pk's op
    for op in NORM_OPS:
        ops = {f"{op}/cuda": fused[op], f"{op}/eager": lambda op=op: refs[op](x)}
        compiled = attempt(row, f"{op}/compiled", lambda op=op: torch.compile(refs[op], dynamic=False, backend=backend))
        if compiled is not None:
            ops[f"{op}/compiled"] = lambda compiled=compiled: compiled(x)
        if triton_norms is not None:
            if op == "composite_norm":
                ops[f"{op}/triton"] = lambda: triton_norms.triton_composite_norm(x)
            else:
                ops[f"{op}/triton"] = lambda with_norm=op == "residual+norm": triton_norms.triton_residual_norm(
                    x, return_norm=with_norm
                )
        for name, fn in ops.items():
            begin = time.perf_counter()
            result = attempt(row, name, fn)  # compilation, autotuning, the first call's result
            if device == "cuda":
                torch.cuda.synchronize()
            if result is None:
                continue
            row[f"{name}_first_call_s"] = time.perf_counter() - begin
            results[name] = result
            candidates[name] = fn
            calls[name] = timing["eager_calls"] if name.endswith("/eager") else timing["calls"]
            if name.endswith("/triton"):
                row[f"{name}_config"] = triton_norms.chosen_config() or {
                    "config": triton_norms.DEFAULT_CONFIG._asdict(),
                    "interpreted": triton_norms.INTERPRETED,
                }
    seconds = interleaved(candidates, device, timing["rounds"], calls, row)
    if "copy" not in seconds or "sum" not in seconds:
        return row
    copy_gbs = 2 * nbytes / seconds["copy"] / 1e9
    sum_gbs = nbytes / seconds["sum"] / 1e9
    row.update(copy_ms=seconds["copy"] * 1e3, copy_gbs=copy_gbs, sum_ms=seconds["sum"] * 1e3, sum_gbs=sum_gbs)
    for name, t in seconds.items():
        if "/" not in name:
            continue
        op, kind = name.split("/")
        gbs = nbytes / t / 1e9
        row.update({f"{name}_ms": t * 1e3, f"{name}_gbs": gbs, f"{name}_of_copy": gbs / copy_gbs})
        row[f"{name}_of_sum"] = gbs / sum_gbs
        if kind != "cuda" and f"{op}/cuda" in results:
            got, want = results[name], results[f"{op}/cuda"]
            pairs = zip(got, want) if isinstance(want, tuple) else [(got, want)]
            row[f"{name}_max_relative_error"] = max(relative_error(g, w) for g, w in pairs)
    for op in NORM_OPS:
        mine = seconds.get(f"{op}/triton")
        for kind in ("cuda", "compiled", "eager"):
            if mine is not None and f"{op}/{kind}" in seconds:
                row[f"{op}/triton_vs_{kind}"] = seconds[f"{op}/{kind}"] / mine
        if mine is not None:
            row[f"{op}/triton_meets_target"] = bool(
                row[f"{op}/triton_of_copy"] >= 0.8 and row.get(f"{op}/triton_vs_compiled", 0.0) >= 3.0
            )
    return row


def print_triton_case(r: dict) -> None:
    print(
        f"\n[{r['batch']}, {r['n']}, {r['m']}] {r['dtype']} ({r['mib']:.4g} MiB): "
        + (
            f"copy {r['copy_gbs']:.0f} GB/s, x.sum() {r['sum_gbs']:.0f} GB/s"
            if "copy_gbs" in r
            else f"baselines failed: {r.get('copy_error') or r.get('sum_error')}"
        ),
        flush=True,
    )
    print(f"  {'candidate':<24} {'ms':>9} {'GB/s':>7} {'of copy':>7} {'× cuda':>7} {'× compile':>9} {'rel err':>8}")
    for op in NORM_OPS:
        for kind in ("triton", "cuda", "compiled", "eager"):
            name = f"{op}/{kind}"
            if f"{name}_error" in r:
                print(f"  {name:<24} fail: {r[f'{name}_error']}", flush=True)
                continue
            if f"{name}_ms" not in r:
                continue
            vs_cuda = f"{r[f'{op}/triton_vs_cuda']:.2f}" if kind == "triton" and f"{op}/triton_vs_cuda" in r else ""
            vs_compiled = r.get(f"{op}/triton_vs_compiled") if kind == "triton" else None
            error = r.get(f"{name}_max_relative_error")
            config = (r.get(f"{name}_config") or {}).get("config") if kind == "triton" else None
            print(
                f"  {name:<24} {r[f'{name}_ms']:9.4f} {r[f'{name}_gbs']:7.0f} {r[f'{name}_of_copy']:7.0%} "
                f"{vs_cuda:>7} {f'{vs_compiled:.2f}' if vs_compiled else '':>9} "
                f"{f'{error:.1e}' if error is not None else '':>8}"
                + (" " + " ".join(f"{k}={v}" for k, v in config.items()) if config else ""),
                flush=True,
            )


def triton_section(args, results: dict, save) -> None:
    """Section 2: the Triton kernels against sum, copy, the CUDA kernel and torch.compile."""
    device = args.device
    os.environ["PATHKERNELS_TRITON_NORM_CONFIGS"] = args.triton_configs or ("quick" if args.quick else "full")
    section = results["triton_norms"] = {
        "configs": os.environ["PATHKERNELS_TRITON_NORM_CONFIGS"],
        "complete": False,
        "cases": [],
    }
    print("\nTriton norm kernels: target ≥ 80 % of copy bandwidth and ≥ 3× torch.compile", flush=True)
    triton_norms = import_triton_norms(device, section)
    if device == "cuda":
        # Shapes recompile (dynamic=False): more than dynamo's default of 8 per function in a full run.
        for limit in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, limit):
                setattr(torch._dynamo.config, limit, 64)
        mib = args.mib
        timing = {"rounds": 5 if args.quick else 9, "calls": 10, "eager_calls": 2}
    else:
        mib = DRY_RUN_MIB
        timing = {"rounds": 1, "calls": 1, "eager_calls": 1}
    shapes = QUICK_TRITON_SHAPES if args.quick else TRITON_SHAPES
    section.update(mib=mib, timing=timing)
    save()
    for n, m in shapes:
        row = attempt(
            section,
            f"{n}x{m}",
            lambda n=n, m=m: triton_case(n, m, getattr(torch, args.dtype), device, mib, triton_norms, timing),
        )
        if row is not None:
            section["cases"].append(row)
            print_triton_case(row)
        save()
    section["complete"] = True
    save()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Fused norms vs pure PyTorch, and the Triton norm kernels")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "float16", "bfloat16"])
    parser.add_argument("--quick", action="store_true", help="small cases, short timing")
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    parser.add_argument("--triton", action="store_true", help="also run section 2 (the Triton kernels)")
    parser.add_argument(
        "--only", choices=["triton"], help="run section 2 alone (with --device cpu: a dry run in the interpreter)"
    )
    parser.add_argument("--mib", type=float, default=256, help="section 2: batch size in MiB (default 256)")
    parser.add_argument(
        "--triton-configs",
        choices=["full", "quick", "default"],
        help="section 2: the Triton autotuner's space (default: quick with --quick, else full)",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a GPU")
    if args.device == "cuda" and args.only is None and not pk.build_info()["cuda"]:
        # Section 2 alone runs without: its "cuda" candidates then fail, recorded, and the rest goes on.
        parser.error("--device cuda needs pathkernels built with CUDA (or --only triton)")

    machine = machine_description(args.device)
    payload = {"machine": machine, "torch": torch.__version__, "build": pk.build_info(), "complete": False}

    def save() -> None:
        """Writes what has been measured so far."""
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(payload, indent=2) + "\n")

    if args.only is None:
        dtype = getattr(torch, args.dtype)
        cases = QUICK_NORM_CASES if args.quick else NORM_CASES
        min_run_time = 0.2 if args.quick else 1.0
        rows = [row for shape in cases for row in norm_benchmark(shape, dtype, args.device, min_run_time)]
        print(f"pathkernels {pk.__version__}: fused norms vs pure PyTorch on {machine}, torch {torch.__version__}")
        print(format_norm_table(rows))
        payload["results"] = rows
        save()
    if args.only == "triton" or args.triton:
        if args.only:
            print(f"pathkernels {pk.__version__} on {machine}, torch {torch.__version__}")
        triton_section(args, payload, save)
    payload["complete"] = True
    save()
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
