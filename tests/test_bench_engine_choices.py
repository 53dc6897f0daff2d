"""bench/bench_engine_choices.py: the rule that picks the engine's defaults on a card, by hand-made
measurements, and a dry run on the CPU whose entries the defaults table can take as they are."""

import importlib.util
import json
from pathlib import Path

import pytest

from pathkernels.core import engine

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "bench_engine_choices.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_engine_choices", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measured(**candidates):
    """``kernel_graphs=(seconds, error)`` → the script's measurements dict."""
    out = {}
    for name, (seconds, error) in candidates.items():
        kernel, graphs = name.rsplit("_", 1)
        out[f"{kernel}|graphs={graphs}"] = {"seconds": seconds, "error": error}
    return out


def test_a_faster_accurate_candidate_replaces_fused(bench):
    chosen = bench.choose(measured(fused_0=(1.0, 4e-8), tensor_0=(0.5, 5e-7), heads_0=(0.4, 3e-6)), fast=False)
    assert chosen["leaf_kernel"] == "tensor"  # heads is faster but beyond float32 accuracy
    assert chosen["speedup"] == 2.0 and not chosen["graphs"] and chosen["bound"] == 1e-6


def test_fused_stays_unless_the_gain_reaches_the_threshold(bench):
    chosen = bench.choose(measured(fused_0=(1.0, 4e-8), tensor_0=(0.87, 5e-7)), fast=False)  # 1.15×
    assert chosen["leaf_kernel"] == "fused" and chosen["speedup"] == 1.0
    chosen = bench.choose(measured(fused_0=(1.2, 4e-8), tensor_0=(1.0, 5e-7)), fast=False)  # exactly 1.2×
    assert chosen["leaf_kernel"] == "tensor"


def test_graphs_are_kept_only_where_they_pay(bench):
    chosen = bench.choose(measured(fused_0=(1.0, 4e-8), fused_1=(0.5, 4e-8)), fast=False)
    assert chosen == {"leaf_kernel": "fused", "graphs": True, "speedup": 2.0, "bound": 1e-6}
    chosen = bench.choose(measured(fused_0=(1.0, 4e-8), fused_1=(0.9, 4e-8)), fast=False)
    assert not chosen["graphs"] and chosen["speedup"] == 1.0
    chosen = bench.choose(measured(fused_0=(1.0, 4e-8), fused_1=(0.5, 2e-6)), fast=False)  # not accurate
    assert not chosen["graphs"]


def test_fast_candidates_are_bounded_by_fused_with_fast(bench):
    chosen = bench.choose(measured(fused_0=(1.0, 2e-4), triton_0=(0.5, 3e-4), heads_0=(0.3, 5e-4)), fast=True)
    assert chosen["leaf_kernel"] == "triton" and chosen["bound"] == 4e-4


def test_failed_candidates_are_left_out(bench):
    measurements = measured(fused_0=(1.0, 4e-8))
    measurements["heads|graphs=0"] = {"error_message": "RuntimeError: no tensor cores"}
    assert bench.choose(measurements, fast=False)["leaf_kernel"] == "fused"


def test_a_dry_run_writes_entries_the_table_takes(bench, tmp_path):
    out = tmp_path / "choices.json"
    assert bench.main(["--device", "cpu", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [entry["n_max"] for entry in report["entries"]] == [n for _, _, n in bench.DRY_RUN_CASES]
    for entry, measurement in zip(report["entries"], report["measurements"]):
        assert entry["leaf_kernel"] in engine.LEAF_KERNELS and entry["statistics_fold"] in ("torch", "triton")
        assert set(entry) >= {"capability", "dtype", "fast", "n_max", "graphs", "card", "source", "why"}
        assert measurement["folds_agree"] and set(measurement["levels_seconds"]) == {"per_head", "all_heads"}
        assert entry["engine_levels"] in ("per_head", "all_heads") and max(measurement["levels_errors"].values()) < 1e-6
        assert all(value["error"] < 1e-6 for value in measurement["candidates"].values())  # the CPU runs one kernel
