"""pk.experiments and the command line: tables, plots, and the demo end to end."""
import copy
import math
import subprocess
import sys

import pytest
import torch

pd = pytest.importorskip("pandas")
pytest.importorskip("matplotlib")

from pathkernels import experiments
from pathkernels.cli import main


def test_collapse_table_and_plot():
    table = experiments.collapse_vs_depth(num_layers=3, d_model=16, num_heads=2, n=6, batch=2, seeds=1)
    assert list(table.columns) == ["variant", "depth", "mean", "median", "q10", "q90"]
    assert list(table["variant"].unique()) == list(experiments.VARIANTS) and len(table) == 4 * 4
    depth0 = table[table["depth"] == 0]["median"]
    assert depth0.nunique() == 1  # every variant starts from the same inputs
    fig = experiments.plot_collapse(table)
    ax = fig.axes[0]
    assert ax.get_yscale() == "log" and ax.get_xlabel() and ax.get_ylabel() and ax.get_legend()


def test_path_length_distribution_is_binomial():
    table = experiments.path_length_distribution({"tiny": (2, 2), "BERT": (12, 12)})
    tiny = table[table["architecture"] == "tiny"]
    assert list(tiny["path_count"]) == [1, 4, 4]
    assert tiny["share"].tolist() == pytest.approx([1 / 9, 4 / 9, 4 / 9])
    bert = table[table["architecture"] == "BERT"]
    assert bert["share"].sum() == pytest.approx(1)
    assert bert["path_count"].iloc[3] == math.comb(12, 3) * 12**3
    assert experiments.plot_path_lengths(table).axes[0].get_yscale() == "log"


def test_path_effectiveness_small():
    result = experiments.path_effectiveness(vocab=6, n=4, d_model=16, num_heads=2, num_layers=2, steps=30,
                                            batch=32, test_size=64)
    table = result.table
    assert list(table["max_length"]) == [0, 1, 2] and list(table["path_count"]) == [1, 5, 9]
    assert ((table["token_accuracy"] >= 0) & (table["token_accuracy"] <= 1)).all()
    # k = L keeps every path: the last row is the model's own accuracy, on any batch.
    tokens, target = experiments.sorting_batch(64, 4, 6, torch.Generator().manual_seed(1))
    fresh = experiments.truncation_accuracy(result.model, tokens, target)
    with torch.no_grad():
        predicted = copy.deepcopy(result.model).double()(tokens)[0].argmax(-1)
    assert fresh["token_accuracy"].iloc[-1] == pytest.approx((predicted == target).double().mean().item())
    assert experiments.plot_effectiveness(table).axes[0].get_xlabel().startswith("longest path kept")


def test_cli_subcommands_write_tables_and_plots(tmp_path, capsys):
    assert main(["collapse", "--layers", "3", "--width", "16", "--heads", "2", "--tokens", "6", "--batch", "2",
                 "--seeds", "1", "--out", str(tmp_path)]) == 0
    assert main(["paths", "--layers", "3", "--heads", "2", "--width", "16", "--tokens", "6",
                 "--out", str(tmp_path)]) == 0
    assert main(["paths", "--layers", "3", "--heads", "2", "--width", "16", "--tokens", "6",
                 "--samples-per-length", "3"]) == 0
    out = capsys.readouterr().out
    assert "Median residual ratio" in out and "all 27 paths, exactly" in out and "3 paths drawn per length" in out
    for name in ("collapse.csv", "collapse.png", "ratio_by_length.csv", "ratio_by_length.png"):
        assert (tmp_path / name).stat().st_size > 0
    table = pd.read_csv(tmp_path / "ratio_by_length.csv")
    assert table["path_count"].tolist() == [1, 6, 12, 8]


def test_cli_reads_huggingface_directories_and_configs(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=30, n_positions=16)
    transformers.GPT2Model(config).save_pretrained(tmp_path / "weights")
    config.save_pretrained(tmp_path / "config_only")
    assert main(["collapse", "--model", str(tmp_path / "weights"), "--tokens", "6", "--batch", "2"]) == 0
    assert main(["paths", "--model", str(tmp_path / "config_only" / "config.json"), "--tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "weights" in out and "all 9 paths, exactly" in out
    with pytest.raises(SystemExit, match="no such file or directory"):
        main(["paths", "--model", str(tmp_path / "missing")])


def test_demo_runs_end_to_end(tmp_path):
    """The README's main job, in its quick form, in a fresh process."""
    run = subprocess.run([sys.executable, "-m", "pathkernels", "demo", "--quick", "--out", str(tmp_path)],
                         check=False, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    for section in ("1. The norm", "2. Rank collapse", "3. Residual ratio", "4. How the paths", "5. Path effectiveness",
                    "6. Speed"):
        assert section in run.stdout
    figures = ("collapse", "ratio_by_length", "path_lengths", "path_effectiveness")
    expected = [f"{name}.{ext}" for name in figures for ext in ("csv", "png")] + ["speed_norms.csv", "speed_paths.csv"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(expected)
