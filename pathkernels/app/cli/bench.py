"""``pathkernels bench``: quick timings of the fused norms and the path engine against pure PyTorch."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import torch

from pathkernels.app.benchmarks import (
    QUICK_NORM_CASES,
    QUICK_PATH_CASES,
    busy_note,
    format_norm_table,
    format_path_table,
    machine_description,
    norm_benchmark,
    path_benchmark,
)
from pathkernels.app.cli.common import resolve_device, save


def bench_tables(
    *, device: str = "cpu", quick: bool = False, out_file: Path | None = None, out_dir: Path | None = None
) -> tuple[object, object]:
    """``pathkernels bench``: both benchmark tables; ``out_file`` is written as JSON (or CSV by
    its suffix), ``out_dir`` gets two CSV files (the demo's)."""
    import pandas as pd

    device = resolve_device(device, "bench")
    min_run_time = 0.2 if quick else 1.0
    machine = machine_description(device)
    print(
        "Quick timings: each kernel, its pure-PyTorch counterpart and a copy of the same bytes take turns\n"
        "in 8 rounds, each reported at its fastest round; the copy's rounds say whether the machine was busy.\n"
        "bench/ times with more repetitions, each case in a process of its own, and records its results.\n"
    )
    print(f"Fused norms against pure PyTorch on {machine} (float32)")
    norm_rows = [
        row for shape in QUICK_NORM_CASES for row in norm_benchmark(shape, torch.float32, device, min_run_time)
    ]
    print(format_norm_table(norm_rows))
    _say_if_busy(norm_rows)
    print()
    print("Path engine (complete trees with skip) against the level-wise PyTorch baseline and the per-path loop")
    path_rows = [path_benchmark(*case, device=device, min_run_time=min_run_time) for case in QUICK_PATH_CASES]
    print(format_path_table(path_rows))
    _say_if_busy(path_rows)
    norms, paths = pd.DataFrame(norm_rows), pd.DataFrame(path_rows)
    if out_dir is not None:
        save(out_dir, "speed_norms", norms)
        save(out_dir, "speed_paths", paths)
    if out_file is not None:
        out_file.parent.mkdir(parents=True, exist_ok=True)
        if out_file.suffix == ".csv":
            pd.concat([norms.assign(table="norms"), paths.assign(table="paths")]).to_csv(out_file, index=False)
        else:
            payload = {"machine": machine, "torch": torch.__version__, "norms": norm_rows, "paths": path_rows}
            out_file.write_text(json.dumps(payload, indent=1, default=str))
        print(f"  wrote {out_file}")
    return norms, paths


def _say_if_busy(rows: list[dict]) -> None:
    note = busy_note(rows)
    if note is not None:
        print(textwrap.fill(note, 100))
