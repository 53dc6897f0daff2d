"""Timing helpers shared by bench/ scripts and the command line.

The norm benchmarks compare a fused op with its pure-PyTorch reference (pathkernels.reference) on
the same inputs, and relate the achieved bandwidth to the copy bandwidth measured in the same run.
The path benchmarks compare the engine with (b) the best pure-PyTorch level-wise implementation
and (a) the per-path loop (docs/DESIGN.md §5), both in :mod:`pathkernels.reference`. One timer
(:func:`seconds_per_call`) and one table formatter (:func:`format_table`) serve every script.
"""

from __future__ import annotations

import functools
import platform
import statistics
import time
from collections.abc import Callable

import torch

from pathkernels import reference
from pathkernels.core import ops
from pathkernels.testing import random_matrices

NORM_CASES = [(4096, 64, 64), (256, 512, 512), (64, 128, 768), (256, 128, 768)]
QUICK_NORM_CASES = [(1024, 64, 64), (32, 256, 256)]


def seconds_per_call(
    fn: Callable[[], object],
    device: str = "cpu",
    *,
    min_runs: int = 3,
    min_seconds: float = 1.0,
    statistic: str = "median",
) -> float:
    """Wall time of one call of ``fn()``: the median (or the best, ``statistic="min"``) over at
    least ``min_runs`` calls and ``min_seconds`` of calls, each waited for on the device.

    The one timer of the benchmarks. It runs with torch's current number of threads. A call that
    alone takes longer than ``min_seconds`` ends the timing once ``min_runs`` calls are done.
    """
    if statistic not in ("median", "min"):
        raise ValueError(f"seconds_per_call: expected statistic 'median' or 'min', got {statistic!r}")
    wait = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    times: list[float] = []
    wait()
    start = time.perf_counter()
    while len(times) < min_runs or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        wait()
        times.append(time.perf_counter() - t0)
        if len(times) >= min_runs and times[-1] > min_seconds:
            break
    if statistic == "min":
        return min(times)
    return statistics.median(times)


def gemm_rate(dtype: torch.dtype, device: str = "cpu", size: int = 4096) -> float:
    """FLOP/s of a ``size²`` matmul in this run: the floor the engine's GEMM work is compared with."""
    a = torch.randn(size, size, dtype=dtype, device=device)
    return 2 * size**3 / seconds_per_call(lambda: a @ a, device, min_runs=5, statistic="min")


def own_gemm_rate(dtype: torch.dtype, size: int = 512) -> float:
    """FLOP/s of the engine's own CPU GEMM (``csrc/paths/gemm_cpu.h``, the op ``_engine_mm``: one
    thread) on a ``size²`` product in cache, times torch's threads: what its micro-kernels could
    give the engine with every thread busy and nothing else to do. Beside :func:`gemm_rate` because
    that floor is the BLAS's: MKL takes its AVX2 kernels on AMD CPUs, so on a Zen 5, whose AVX-512
    units are as wide as their registers, the engine's own kernels run about twice its rate."""
    a = torch.randn(size, size, dtype=dtype)
    seconds = seconds_per_call(lambda: torch.ops.pathkernels._engine_mm(a, a), min_runs=5, statistic="min")
    return 2 * size**3 / seconds * torch.get_num_threads()


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak_rss() -> int:
    """Reset the kernel's peak-RSS mark (Linux) and return the current resident set in bytes."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    return _status_kib("VmRSS") * 1024


def peak_rss() -> int:
    """The process's peak resident set since the last :func:`reset_peak_rss`, in bytes (Linux)."""
    return _status_kib("VmHWM") * 1024


def format_table(rows: list[dict], columns: list[tuple]) -> str:
    """A fixed-width text table: ``columns`` are ``(header, key, format spec[, suffix])``; the
    spec is applied to ``row[key]`` (then the suffix, e.g. ``"x"``), and a row without the key
    shows a dash. Columns whose spec starts with ``<`` are flush left. The one formatter of the
    benchmarks' tables."""
    columns = [(*column, "")[:4] for column in columns]

    def cell(value, spec: str, suffix: str) -> str:
        return (str(value) if isinstance(value, (bool, str)) else format(value, spec)) + suffix

    cells = [[column[0] for column in columns]]
    for row in rows:
        cells.append([cell(row[key], spec, suffix) if key in row else "—" for _, key, spec, suffix in columns])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    left = [spec.startswith("<") for _, _, spec, _ in columns]

    def line(values):
        return " ".join(v.ljust(w) if flush_left else v.rjust(w) for v, w, flush_left in zip(values, widths, left))

    header = line(cells[0])
    return "\n".join([header, "-" * len(header)] + [line(values) for values in cells[1:]])


# A run is called busy when the copy of the same bytes, timed in every round beside the kernels,
# took more than this many times its fastest round in half the rounds or more (its median over its
# minimum), or ran below BUSY_COPY_GBS: a quiet machine repeats a copy to within a few per cent, and
# no machine's memory copies that slowly.
BUSY_SPREAD = 1.5
BUSY_COPY_GBS = 1.0


def interleaved_rounds(
    candidates: dict[str, Callable[[], object]], device: str, min_run_time: float, rounds: int = 8
) -> dict[str, list[float]]:
    """Each candidate's seconds per call in each of ``rounds`` rounds, the candidates taking turns
    within every round (``min_run_time`` in all, shared evenly), so that a neighbour's load or a
    drift of the clock touches all of them alike. A round's time is the fastest call in it."""
    per_call = min_run_time / (rounds * len(candidates))
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            times[name].append(seconds_per_call(fn, device, min_runs=1, min_seconds=per_call, statistic="min"))
    return times


def steadiness(copy_times: list[float], copied_bytes: int) -> dict:
    """How steady the machine was while a table was timed, from the rounds of a copy of
    ``copied_bytes`` bytes (one read and one write each) timed among the kernels:
    ``copy_spread`` (median over minimum), ``copy_gbs`` (at the fastest round) and ``busy``."""
    fastest = min(copy_times)
    spread = statistics.median(copy_times) / fastest
    gbs = 2 * copied_bytes / fastest / 1e9
    return {"copy_spread": spread, "copy_gbs": gbs, "busy": spread > BUSY_SPREAD or gbs < BUSY_COPY_GBS}


def busy_note(rows: list[dict]) -> str | None:
    """A plain statement when any row was timed on a busy machine (:func:`steadiness`), else None."""
    busy = [row for row in rows if row.get("busy")]
    if not busy:
        return None
    worst = max(busy, key=lambda row: row["copy_spread"])
    return (
        f"The machine was busy while {len(busy)} of these {len(rows)} rows were timed (marked *): a copy of the "
        f"same bytes, timed between them, varied up to {worst['copy_spread']:.1f}x from round to round "
        f"(slowest {min(row['copy_gbs'] for row in busy):.1f} GB/s). Their times say more about the machine than "
        "about the kernels; time again on a quiet machine (bench/ repeats and records)."
    )


# Instruction sets named in a CPU's description, widest first (their /proc/cpuinfo flags).
_ISA_FLAGS = (("amx_tile", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2"), ("fma", "FMA"))


def cpu_description() -> str:
    """The CPU's model, family and vector instruction sets, as ``/proc/cpuinfo`` names them
    (``"AMD EPYC (family 26 model 2; AVX-512, AVX2, FMA)"``), or ``platform``'s word for it where
    there is no such file. The family tells apart CPUs whose model name is masked, as cloud VMs'
    often is: AMD's family 25 is Zen 3 and Zen 4 (with AVX-512), 26 is Zen 5, whose AVX-512
    units are twice as wide."""
    fields, flags = {}, set()
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "flags" and not flags:
                    flags = set(value.split())
                elif key in ("model name", "cpu family", "model") and key not in fields:
                    fields[key] = value.strip()
    except OSError:
        pass
    model = fields.get("model name") or platform.processor() or platform.machine()
    known = {"cpu family", "model"} <= fields.keys()
    family = f"family {fields['cpu family']} model {fields['model']}" if known else ""
    isa = ", ".join(name for flag, name in _ISA_FLAGS if flag in flags)
    details = "; ".join(part for part in (family, isa) if part)
    return f"{model} ({details})" if details else model


def machine_description(device: str) -> str:
    """The GPU's name, or the CPU's model, instruction sets and the threads torch uses."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{cpu_description()}, {torch.get_num_threads()} threads"


def bare_product_rates(n: int, dtype: torch.dtype, *, cached_bytes: int = 1 << 20, streamed_bytes: int = 256 << 20):
    """FLOP/s of the bare products the path engine's GEMM work is made of, ``[n, n]`` matrices in
    batches: ``torch.bmm`` of two batches, and ``torch.matmul`` of one shared left factor with a
    batch (a level's ``C(A_h)`` times its parents), each on operands that fit in cache
    (``cached_bytes`` per operand batch) and on operands streamed from memory (``streamed_bytes``).
    Returns ``{"bmm_cached", "bmm_streamed", "shared_cached", "shared_streamed"}`` in FLOP/s, each
    the best of its timed calls."""
    size = torch.finfo(dtype).bits // 8 * n * n
    rates = {}
    for where, budget in (("cached", cached_bytes), ("streamed", streamed_bytes)):
        batch = max(1, budget // size)
        left = torch.randn(batch, n, n, dtype=dtype)
        right = torch.randn(batch, n, n, dtype=dtype)
        shared = left[0]
        out = torch.empty(batch, n, n, dtype=dtype)
        flops = 2 * batch * n**3
        calls = {
            "bmm": functools.partial(torch.bmm, left, right, out=out),
            "shared": functools.partial(torch.matmul, shared, right, out=out),
        }
        for name, call in calls.items():
            rates[f"{name}_{where}"] = flops / seconds_per_call(call, min_runs=5, min_seconds=0.3, statistic="min")
    return rates


def norm_benchmark(shape, dtype=torch.float32, device="cpu", min_run_time=1.0) -> list[dict]:
    """Time residual_norm (alone, and with the plain norm: ``return_norm=True``) and composite_norm
    on x = randn(shape), each against its pure-PyTorch reference.

    The op, its reference and ``out.copy_(x)`` take turns in 8 rounds (:func:`interleaved_rounds`);
    each is reported at its fastest round, the one the machine disturbed least. Bandwidth counts
    one read of x, the floor for these ops; ``fraction_of_copy`` divides it by the copy's (one read
    and one write). The copy's rounds also say whether the machine was busy (:func:`steadiness`).
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
        times = interleaved_rounds({"fused": fused, "reference": ref, "copy": copy}, device, 3 * min_run_time)
        fused_s, ref_s, copy_s = (min(times[key]) for key in ("fused", "reference", "copy"))
        rows.append(
            {
                "op": name,
                "shape": list(shape),
                "dtype": str(dtype).removeprefix("torch."),
                "device": device,
                "fused_ms": fused_s * 1e3,
                "reference_ms": ref_s * 1e3,
                "speedup": ref_s / fused_s,
                "bandwidth_gbs": bytes_read / fused_s / 1e9,
                "copy_bandwidth_gbs": 2 * bytes_read / copy_s / 1e9,
                # copy moves 2 bytes per byte of x: copy_s / (2 fused_s).
                "fraction_of_copy": copy_s / (2 * fused_s),
                **steadiness(times["copy"], bytes_read),
            }
        )
    return rows


NORM_COLUMNS = [
    ("op", "op", "<"),
    ("shape", "shape_text", "<"),
    ("dtype", "dtype", "<"),
    ("fused ms", "fused_ms", ".3f"),
    ("torch ms", "reference_ms", ".3f"),
    ("speed-up", "speedup", ".1f", "x"),
    ("GB/s", "bandwidth_gbs", ".1f"),
    ("of copy", "fraction_of_copy", ".0%"),
]


def _marked(row: dict, key: str) -> dict:
    """``row`` with ``key``'s text marked * where the row was timed on a busy machine."""
    return {**row, key: f"{row[key]}*" if row.get("busy") else row[key]}


def format_norm_table(rows: list[dict]) -> str:
    return format_table(
        [_marked({**row, "shape_text": "x".join(map(str, row["shape"]))}, "op") for row in rows], NORM_COLUMNS
    )


# --- the path engine against pure PyTorch -------------------------------------------------------


def head_node_flops(layers: int, heads: int, n: int, skip: bool) -> int:
    """2·n³ per node that takes a head; level l has (H + skip)^(l-1) parents, each with H such children."""
    choices = heads + int(skip)
    return sum(2 * n**3 * choices ** (level - 1) * heads for level in range(1, layers + 1))


QUICK_PATH_CASES = [(4, 6, 32), (3, 12, 64)]


def path_benchmark(
    layers: int,
    heads: int,
    n: int,
    *,
    dtype=torch.float32,
    skip: bool = True,
    device: str = "cpu",
    min_run_time: float = 0.5,
    loop_sample: int = 64,
) -> dict:
    """Engine against (b) the level-wise baseline and (a) the per-path loop, on one complete tree.
    The engine, the baseline and a copy of the attention take turns (:func:`interleaved_rounds`),
    each reported at its fastest round; the copy says whether the machine was busy.

    In-process and without memory accounting (``bench/bench_paths.py`` isolates each case in its
    own process and measures peak memory). The loop is timed on ``loop_sample`` sampled paths and
    extrapolated to the whole tree.
    """
    from pathkernels.core.engine import path_residuals
    from pathkernels.core.paths import PathTree, count_paths, sample_paths
    from pathkernels.testing import random_attention

    attn = random_attention(layers, heads, n, n, dtype=dtype, device=device, generator=torch.Generator().manual_seed(0))
    tree = PathTree.complete(layers, heads, skip=skip)
    paths = count_paths(layers, heads, skip=skip)
    out = torch.empty_like(attn)
    times = interleaved_rounds(
        {
            "engine": lambda: path_residuals(attn, tree),
            "levelwise": lambda: reference.levelwise_ref(attn, skip),
            "copy": lambda: out.copy_(attn),
        },
        device,
        3 * min_run_time,
    )
    engine_s, levelwise_s = min(times["engine"]), min(times["levelwise"])
    sample = sample_paths(layers, heads, min(loop_sample, paths), skip=skip)
    loop_s = (
        seconds_per_call(lambda: reference.per_path_loop_ref(attn, sample), device, min_seconds=min_run_time)
        / sample.shape[0]
        * paths
    )
    return {
        "layers": layers,
        "heads": heads,
        "n": n,
        "dtype": str(dtype).removeprefix("torch."),
        "skip": skip,
        "device": device,
        "paths": paths,
        "engine_ms": engine_s * 1e3,
        "levelwise_ms": levelwise_s * 1e3,
        "loop_ms_estimated": loop_s * 1e3,
        "speedup_vs_levelwise": levelwise_s / engine_s,
        "speedup_vs_loop": loop_s / engine_s,
        "gflops": head_node_flops(layers, heads, n, skip) / engine_s / 1e9,
        **steadiness(times["copy"], attn.numel() * attn.element_size()),
    }


QUICK_PATH_COLUMNS = [
    ("L", "layers", ""),
    ("H", "heads", ""),
    ("n", "n", ""),
    ("skip", "skip_text", "<"),
    ("paths", "paths", ","),
    ("engine ms", "engine_ms", ".2f"),
    ("level ms", "levelwise_ms", ".2f"),
    ("loop ms", "loop_ms_estimated", ".1f"),
    ("vs level", "speedup_vs_levelwise", ".1f", "x"),
    ("vs loop", "speedup_vs_loop", ".0f", "x"),
    ("GFLOP/s", "gflops", ".1f"),
]


def format_path_table(rows: list[dict]) -> str:
    return format_table(
        [_marked({**row, "skip_text": str(row["skip"])}, "skip_text") for row in rows], QUICK_PATH_COLUMNS
    )


def run_cases(cases, bench_case, columns: list[tuple], title: str, out=None) -> list[dict]:
    """Run ``bench_case(*case)`` for each case, printing each row as it comes, then the whole table
    under ``title`` (with pathkernels' version, the threads and torch's); with ``out`` (a Path)
    also write the rows as JSON there."""
    import json

    from pathkernels import __version__

    rows = []
    for case in cases:
        rows.append(bench_case(*case))
        print(format_table(rows[-1:], columns).splitlines()[-1], flush=True)
    machine = f"CPU {torch.get_num_threads()} threads"
    print(f"pathkernels {__version__} {title}, {machine}, torch {torch.__version__}")
    print(format_table(rows, columns))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"machine": machine, "torch": torch.__version__, "threads": torch.get_num_threads(), "results": rows}
        out.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {out}")
    return rows


def bench_main(argv, description: str, title: str, bench_case, columns: list[tuple], cases, quick_cases=None) -> int:
    """A benchmark script's command line: ``--out FILE`` (JSON rows) and, with ``quick_cases``,
    ``--quick``; runs the cases through :func:`run_cases`."""
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(description=description)
    if quick_cases is not None:
        parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    run_cases(quick_cases if getattr(args, "quick", False) else cases, bench_case, columns, title, args.out)
    return 0
