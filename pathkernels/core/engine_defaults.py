"""The engine's defaults on a GPU, chosen by measurement: which leaf kernel ``leaf_kernel="auto"``
takes, whether the chunks replay from CUDA graphs, whether internal levels go all heads at once,
and how ``path_statistics`` folds its chunks, per card family (compute capability's major
version), dtype, ``fast`` and n.

The table is ``engine_defaults.json`` beside this file, written by ``bench/bench_engine_choices.py``
on a card (``bench/gpu_check.sh --quick`` runs it) and committed with the measurements behind each
entry. A configuration no entry covers (another card family, float64, the CPU) takes the built-in
choice: the SIMT leaf kernel, no graphs, levels head by head, the torch fold on a GPU (the C++
fold on the CPU). An environment switch that is set wins over the table: :func:`engine_settings`
reads them all, once per call of the engine.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

TABLE = Path(__file__).with_name("engine_defaults.json")


@dataclass(frozen=True)
class EngineChoice:
    """What the engine runs: ``leaf_kernel`` (one of path_residuals' names), ``graphs``
    (PATHKERNELS_CUDA_GRAPHS), ``statistics_fold`` (PATHKERNELS_STATISTICS_FOLD), ``engine_levels``
    (PATHKERNELS_ENGINE_LEVELS: "per_head" or "all_heads"), and ``source``: the measurement that
    chose it (a results folder), or None for the built-in choice."""

    leaf_kernel: str = "fused"
    graphs: bool = False
    statistics_fold: str = "torch"
    engine_levels: str = "per_head"
    source: str | None = None


BUILT_IN = EngineChoice()
CPU_CHOICE = EngineChoice(statistics_fold="native")  # the C++ fold: one pass, no launches to save

# The environment switches, each over one field of the choice where it is set: the field, the
# variable, and what each of its values sets ("auto": the table's choice, as if unset).
SWITCHES = (
    ("graphs", "PATHKERNELS_CUDA_GRAPHS", {"auto": None, "0": False, "1": True}),
    ("engine_levels", "PATHKERNELS_ENGINE_LEVELS", {"auto": None, "per_head": "per_head", "all_heads": "all_heads"}),
    (
        "statistics_fold",
        "PATHKERNELS_STATISTICS_FOLD",
        {"auto": None, "native": "native", "torch": "torch", "triton": "triton"},
    ),
)


@functools.lru_cache(maxsize=1)
def table_entries() -> tuple[dict, ...]:
    """The table's entries, each ``{"capability", "dtype", "fast", "n_max", "leaf_kernel", "graphs",
    "statistics_fold", "engine_levels", "card", "source", ...}`` (the measurements ride along)."""
    return tuple(json.loads(TABLE.read_text())["entries"])


def engine_choice(device, dtype: torch.dtype, n: int, fast: bool = False) -> EngineChoice:
    """The table's choice for ``n × n`` attention of ``dtype`` on ``device``: the entry of the
    device's card family, dtype and ``fast`` with the smallest ``n_max ≥ n``; :data:`BUILT_IN`
    where none applies (float64, another family, n beyond every entry), :data:`CPU_CHOICE` on the CPU."""
    device = torch.device(device)
    if device.type == "cpu":
        return CPU_CHOICE
    if device.type != "cuda" or not torch.cuda.is_available():  # e.g. asked about "cuda" on a CPU-only torch
        return BUILT_IN
    family = torch.cuda.get_device_capability(device)[0]
    dtype_name = str(dtype).removeprefix("torch.")
    fitting = [
        entry
        for entry in table_entries()
        if (entry["capability"], entry["dtype"], entry["fast"]) == (family, dtype_name, fast) and n <= entry["n_max"]
    ]
    if not fitting:
        return BUILT_IN
    entry = min(fitting, key=lambda entry: entry["n_max"])
    return EngineChoice(
        entry["leaf_kernel"], entry["graphs"], entry["statistics_fold"], entry["engine_levels"], entry["source"]
    )


def engine_settings(
    device, dtype: torch.dtype, n: int, fast: bool = False, *, where: str = "pathkernels.path_residuals"
) -> EngineChoice:
    """:func:`engine_choice` with each environment switch of :data:`SWITCHES` that is set put over
    its field. Read at each call of the engine, so that one process can time the choices against
    each other; a value the switch does not know is refused, naming ``where``'s function."""
    overrides = {}
    for field, variable, values in SWITCHES:
        value = os.environ.get(variable, "").strip().lower()
        if value == "":
            continue
        if value not in values:
            raise ValueError(f"{where}: expected {variable} in {list(values)} or unset, got {value!r}")
        if values[value] is not None:
            overrides[field] = values[value]
    return dataclasses.replace(engine_choice(device, dtype, n, fast), **overrides)
