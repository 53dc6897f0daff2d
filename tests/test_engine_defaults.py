"""The measured defaults table (core/engine_defaults.py): its entries, the lookup by card family,
dtype, fast and n, and where the engine reads it (leaf_kernel="auto", the CUDA graphs' switch
unset, PATHKERNELS_STATISTICS_FOLD=auto)."""

import dataclasses
from pathlib import Path

import pytest
import torch

import pathkernels as pk
from pathkernels.core import chunk_graphs, engine, engine_defaults, ops, statistics
from pathkernels.core.engine_defaults import BUILT_IN, CPU_CHOICE, EngineChoice, engine_choice, engine_settings
from pathkernels.testing import random_attention

REPOSITORY = Path(__file__).resolve().parents[1]


def test_every_entry_names_known_choices_and_the_measurements_behind_it():
    entries = engine_defaults.table_entries()
    assert entries
    for entry in entries:
        assert entry["leaf_kernel"] in engine.LEAF_KERNELS and entry["leaf_kernel"] != "auto"
        assert entry["statistics_fold"] in ("torch", "triton")
        assert entry["engine_levels"] in ("per_head", "all_heads")
        assert isinstance(entry["graphs"], bool) and isinstance(entry["fast"], bool)
        assert entry["dtype"] in ("float32", "float64") and entry["n_max"] >= 1
        assert isinstance(entry["capability"], int) and entry["card"] and entry["why"]
        assert (REPOSITORY / entry["source"]).is_dir(), entry["source"]  # the results folder is committed
    keys = [(e["capability"], e["dtype"], e["fast"], e["n_max"]) for e in entries]
    assert len(keys) == len(set(keys)), "two entries for one configuration"


@pytest.fixture
def hopper_table(monkeypatch):
    """A GPU of compute capability 9.0 and a hand-made table: n ≤ 32 → heads, n ≤ 128 → tensor."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    entry = {
        "capability": 9,
        "dtype": "float32",
        "fast": False,
        "graphs": True,
        "statistics_fold": "triton",
        "engine_levels": "all_heads",
    }
    table = (
        {**entry, "n_max": 128, "leaf_kernel": "tensor", "source": "wide"},
        {**entry, "n_max": 32, "leaf_kernel": "heads", "source": "narrow"},
    )
    monkeypatch.setattr(engine_defaults, "table_entries", lambda: table)


def test_the_lookup_takes_the_narrowest_entry_that_fits(hopper_table):
    cuda = torch.device("cuda")
    assert engine_choice(cuda, torch.float32, 16) == EngineChoice("heads", True, "triton", "all_heads", "narrow")
    assert engine_choice(cuda, torch.float32, 32).leaf_kernel == "heads"
    assert engine_choice(cuda, torch.float32, 33) == EngineChoice("tensor", True, "triton", "all_heads", "wide")
    assert engine_choice(cuda, torch.float32, 129) is BUILT_IN  # beyond every entry
    assert engine_choice(cuda, torch.float64, 16) is BUILT_IN
    assert engine_choice(cuda, torch.float32, 16, fast=True) is BUILT_IN
    assert engine_choice("cpu", torch.float32, 16) is CPU_CHOICE


def test_another_card_family_takes_the_built_in_choice(hopper_table, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert engine_choice(torch.device("cuda"), torch.float32, 16) is BUILT_IN
    assert BUILT_IN == EngineChoice("fused", False, "torch", "per_head", None)


def test_auto_leaf_kernel_graphs_levels_and_fold_read_the_table(monkeypatch):
    """The engine asks the table where the user left the choice to it, and only there: once for the
    leaf kernel and once for the rest, per call."""
    chosen = EngineChoice("gemm", True, "triton", "all_heads", "test")
    asked = []

    def ask(*args):
        asked.append(args)
        return chosen

    monkeypatch.setattr(engine, "engine_choice", ask)
    monkeypatch.setattr(engine_defaults, "engine_choice", ask)
    attn = random_attention(3, 2, 5, 5)
    monkeypatch.setattr(engine, "_check_fast", lambda attn, where: None)  # fast is CUDA's: asked all the same
    assert engine.op_leaf_kernel("auto", True, attn, "test") == "gemm" and asked == [(attn.device, attn.dtype, 5, True)]
    assert engine.op_leaf_kernel("fused", False, attn, "test") == "simt"
    assert engine.op_leaf_kernel("auto", False, [1, 2], "test") == "simt"  # no tensor: refused later
    made, levels = [], []
    monkeypatch.setattr(chunk_graphs.ChunkGraphs, "__init__", _recording(made))
    real_op = ops.path_chunk_norms
    monkeypatch.setattr(ops, "path_chunk_norms", lambda *args: levels.append(args[-1]) or real_op(*args))
    for variable in ("PATHKERNELS_CUDA_GRAPHS", "PATHKERNELS_ENGINE_LEVELS", "PATHKERNELS_STATISTICS_FOLD"):
        monkeypatch.delenv(variable, raising=False)
    tree = pk.PathTree.complete(3, 2)
    asked.clear()
    pk.path_residuals(attn, tree, leaf_kernel="auto")
    assert made and levels and all(levels)  # unset: the table's graphs and levels
    assert asked == [(attn.device, attn.dtype, 5, False)] * 2  # for this n, once each
    made.clear(), levels.clear()
    monkeypatch.setenv("PATHKERNELS_CUDA_GRAPHS", "0")
    monkeypatch.setenv("PATHKERNELS_ENGINE_LEVELS", "per_head")
    pk.path_residuals(attn, tree)
    assert not made and levels and not any(levels)  # set: the switches win
    cuda = torch.device("cuda")
    asked.clear()
    assert statistics.statistics_fold(cuda, torch.float64) == "triton" and asked == [(cuda, torch.float64, 1, False)]
    monkeypatch.setenv("PATHKERNELS_STATISTICS_FOLD", "torch")
    assert statistics.statistics_fold(cuda) == "torch"


def test_each_switch_that_is_set_wins_over_the_table_and_others_are_refused(hopper_table, monkeypatch):
    cuda = torch.device("cuda")
    table = engine_choice(cuda, torch.float32, 16)
    for field, variable, values in engine_defaults.SWITCHES:
        monkeypatch.delenv(variable, raising=False)
        assert engine_settings(cuda, torch.float32, 16) == table
        for value, setting in values.items():
            monkeypatch.setenv(variable, f" {value.upper()} ")
            expected = table if setting is None else dataclasses.replace(table, **{field: setting})
            assert engine_settings(cuda, torch.float32, 16) == expected, (variable, value)
        monkeypatch.setenv(variable, "2")
        with pytest.raises(ValueError, match=rf"^where: expected {variable} in \[.*\] or unset, got '2'$"):
            engine_settings(cuda, torch.float32, 16, where="where")
        monkeypatch.delenv(variable)
    monkeypatch.setenv("PATHKERNELS_CUDA_GRAPHS", "0")
    monkeypatch.setenv("PATHKERNELS_STATISTICS_FOLD", "torch")
    assert engine_settings(cuda, torch.float32, 64, fast=False) == EngineChoice(
        "tensor", False, "torch", "all_heads", "wide"
    )


def _recording(made):
    real = chunk_graphs.ChunkGraphs.__init__

    def init(self, *args, **kwargs):
        made.append(self)
        real(self, *args, **kwargs)

    return init


def test_a_cuda_device_without_cuda_takes_the_built_in_choice(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert engine_choice(torch.device("cuda"), torch.float32, 16) is BUILT_IN
    assert statistics.statistics_fold(torch.device("cuda")) == "torch"


def test_auto_is_the_fused_kernel_on_the_cpu():
    attn = random_attention(2, 3, 8, 8)
    assert engine.op_leaf_kernel("auto", False, attn, "test") == "simt"
    assert engine_choice(attn.device, attn.dtype, 8) is CPU_CHOICE
    assert CPU_CHOICE == EngineChoice("fused", False, "native", "per_head", None)
