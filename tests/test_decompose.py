"""pk.decompose and PathDecomposition: exact, uniform and stratified decompositions, tables, plots."""

import math
import sys

import pytest
import torch

import pathkernels as pk
from pathkernels import reference
from pathkernels.testing import random_attention

pd = pytest.importorskip("pandas")


def attention(batch=2, layers=4, heads=3, n=6):
    return random_attention(batch, layers, heads, n, n, dtype=torch.float64)


def test_exact_decomposition_table_matches_the_per_path_results():
    attn = attention()
    dec = pk.decompose(attn)
    assert dec.method == "exact" and len(dec.paths) == 4**4
    assert torch.equal(dec.weights, torch.ones(4**4, dtype=torch.float64))
    table = dec.by_length()
    assert table["length"].tolist() == [0, 1, 2, 3, 4]
    assert table["path_count"].tolist() == [math.comb(4, k) * 3**k for k in range(5)]
    assert table["evaluated"].tolist() == table["path_count"].tolist()
    ratio = dec.results.ratio.mean(0)
    for _, row in table.iterrows():
        pooled = dec.results.ratio[:, dec.lengths == row["length"]].flatten()  # every (element, path) pair
        assert row["mean"] == pytest.approx(pooled.mean().item(), rel=1e-12)
        assert row["median"] == pytest.approx(pooled.median().item(), rel=1e-12)
        assert row["min"] == pooled.min().item() and row["max"] == pooled.max().item()
        assert row["log10_mean"] == pytest.approx(pooled.log10().mean().item(), rel=1e-12)
        assert row["zeros"] == 0 and row["stderr"] == 0.0
    # Length 0 is the identity, whose residual ratio is ‖I − J/n‖/‖I‖ = 2(n−1)/n.
    assert table.loc[0, "mean"] == pytest.approx(2 * 5 / 6, rel=1e-12)
    mean, stderr = dec.mean_ratio()
    assert mean == pytest.approx(ratio.mean().item(), rel=1e-12) and stderr == 0.0


def test_per_path_frame_uses_head_labels():
    attn = attention(layers=3, heads=2)
    dec = pk.decompose(
        attn, tree=pk.PathTree.from_paths(torch.tensor([[-1, -1, -1], [1, -1, 0], [0, 1, 1]]), num_heads=2)
    )
    frame = dec.to_frame()
    assert frame["path"].tolist() == ["skip", "L0H1 L2H0", "L0H0 L1H1 L2H1"]
    assert frame["length"].tolist() == [0, 2, 3]
    products = reference.path_products_ref(attn, dec.paths)  # [B, M, n, n]
    expected = reference.residual_norm_ref(products) / reference.composite_norm_ref(products)
    assert frame["ratio"].tolist() == pytest.approx(expected.mean(0).tolist(), rel=1e-12)
    assert frame["residual"].tolist() == pytest.approx(reference.residual_norm_ref(products).mean(0).tolist())


def test_max_length_and_explicit_tree():
    attn = attention()
    dec = pk.decompose(attn, max_length=2)
    assert dec.by_length()["length"].tolist() == [0, 1, 2]
    assert int(dec.lengths.max()) == 2
    tree = pk.PathTree.from_paths(torch.tensor([[0, -1, 1, 2], [1, 1, 1, 1]]), num_heads=3)
    dec = pk.decompose(attn, tree=tree)
    assert dec.by_length()["path_count"].tolist() == [1, 1]


def test_uniform_sampling_estimates_the_exact_per_length_means():
    # A network with very different residual ratios by length: uniform samples must recover the
    # exact per-length means within a few standard errors, and the weights the path counts.
    attn = attention(batch=1, layers=5, heads=3, n=5)
    exact = pk.decompose(attn).by_length().set_index("length")
    dec = pk.decompose(attn, num_samples=600, generator=torch.Generator().manual_seed(1))  # of 4^5 = 1024
    assert dec.method == "uniform"
    assert torch.unique(dec.paths, dim=0).shape[0] == 600  # drawn without replacement
    sampled = dec.by_length().set_index("length")
    for k, row in sampled.iterrows():
        if row["evaluated"] >= 30:
            assert abs(row["mean"] - exact.loc[k, "mean"]) <= 5 * row["stderr"] + 1e-12, k
    # Σ weights estimates the total number of paths per length, exactly so by construction.
    for k in range(6):
        mask = dec.lengths == k
        if bool(mask.any()):
            assert dec.weights[mask].sum().item() == pytest.approx(pk.count_by_length(5, 3, skip=True)[k])
    mean, stderr = dec.mean_ratio()
    exact_mean = pk.decompose(attn).mean_ratio()[0]
    assert abs(mean - exact_mean) <= 5 * stderr


def test_stratified_sampling_by_length():
    attn = attention(batch=1, layers=6, heads=4, n=5)
    dec = pk.decompose(attn, samples_per_length={1: 50, 3: 80}, generator=torch.Generator().manual_seed(2))
    table = dec.by_length()
    assert table["length"].tolist() == [1, 3]
    # Length 1 has 24 paths, fewer than the 50 asked for: all of them, once each, exactly.
    assert table["evaluated"].tolist() == [24, 80]
    assert table["path_count"].tolist() == [6 * 4, 20 * 64]
    assert table["exact"].tolist() == [True, False]
    assert table["stderr"].tolist()[0] == 0.0 and table["stderr"].tolist()[1] > 0
    assert torch.unique(dec.paths, dim=0).shape[0] == len(dec.paths)  # no duplicates
    exact_one = pk.decompose(attn, max_length=1).by_length().set_index("length")
    assert table.set_index("length").loc[1, "mean"] == pytest.approx(exact_one.loc[1, "mean"], rel=1e-12)
    # 60 draws per length keep the 5σ check robust (t with 59 degrees of freedom); lengths 0 and 1
    # have 1 and 24 paths, evaluated whole.
    every = pk.decompose(attn, samples_per_length=60, max_length=2, generator=torch.Generator().manual_seed(3))
    assert every.by_length()["evaluated"].tolist() == [1, 24, 60]
    assert every.by_length()["exact"].tolist() == [True, True, False]
    exact = pk.decompose(attn, max_length=2).mean_ratio()[0]
    mean, stderr = every.mean_ratio()
    assert abs(mean - exact) <= 5 * stderr + 1e-12


def test_samples_that_cover_the_whole_set_give_the_exact_decomposition():
    attn = attention(batch=1, layers=3, heads=2, n=4)
    exact = pk.decompose(attn)
    dec = pk.decompose(attn, num_samples=10_000)  # 27 paths in all
    assert dec.method == "exact" and dec.mean_ratio() == exact.mean_ratio()
    table = pk.decompose(attn, samples_per_length=50).by_length()
    assert table["evaluated"].tolist() == [1, 6, 12, 8] and table["exact"].all() and (table["stderr"] == 0).all()
    assert pk.decompose(attn, samples_per_length=50).mean_ratio()[1] == 0.0


def test_sampled_standard_errors_carry_the_finite_population_correction():
    attn = attention(batch=1, layers=4, heads=3, n=4)
    dec = pk.decompose(attn, samples_per_length={2: 30}, generator=torch.Generator().manual_seed(4))
    values = dec.path_ratio()
    expected = values.std().item() / 30**0.5 * (1 - 30 / 54) ** 0.5  # C(4, 2) 3^2 = 54 paths of length 2
    assert dec.by_length()["stderr"].tolist() == [pytest.approx(expected, rel=1e-12)]
    assert dec.mean_ratio() == (pytest.approx(values.mean().item()), pytest.approx(expected, rel=1e-12))


def test_plot_returns_a_log_scale_figure(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    fig = pk.decompose(attention()).plot()
    ax = fig.axes[0]
    assert ax.get_yscale() == "log" and ax.get_xlabel().startswith("path length")
    assert not list(tmp_path.iterdir())  # nothing written without a path
    saved = pk.decompose(attention()).plot(path=tmp_path / "ratio.png")
    assert (tmp_path / "ratio.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and saved.axes[0].get_yscale() == "log"
    streamed = pk.decompose(attention(), max_result_bytes=1)
    streamed.plot(path=tmp_path / "streamed.pdf")
    assert (tmp_path / "streamed.pdf").read_bytes()[:5] == b"%PDF-"


def test_plot_of_a_large_decomposition_draws_a_subset(monkeypatch):
    pytest.importorskip("matplotlib")
    module = sys.modules["pathkernels.decompose"]  # the module, not the function pk.decompose
    monkeypatch.setattr(module, "_MAX_SCATTER", 100)
    dec = pk.decompose(attention())  # 256 paths
    ax = dec.plot().axes[0]
    points = ax.collections[0].get_offsets()
    assert len(points) == 100
    assert ax.get_legend().get_texts()[0].get_text() == "100 of 512 (batch element, path) pairs"


def test_bad_arguments():
    attn = attention()
    with pytest.raises(ValueError, match="pass at most one of tree, num_samples and samples_per_length"):
        pk.decompose(attn, num_samples=5, samples_per_length=2)
    with pytest.raises(ValueError, match="no paths of length 7"):
        pk.decompose(attn, samples_per_length={7: 3})
    big = random_attention(1, 12, 12, 3, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"the exact tree has 14,381,984,674,225 paths; pass a smaller max_length"):
        pk.decompose(big, max_length=11)  # short paths are listed, and these are too many to list


def test_decompose_of_a_huge_tree_streams_its_statistics(monkeypatch):
    """13^12 paths: too many to keep one result each, so decompose hands the complete tree to
    path_statistics (stubbed here: the real run takes hours on 2 cores)."""
    module = sys.modules["pathkernels.decompose"]
    calls = []
    monkeypatch.setattr(module, "path_statistics", lambda attn, tree, **kwargs: calls.append(tree) or "streamed")
    big = random_attention(1, 12, 12, 3, 3, dtype=torch.float64)
    assert pk.decompose(big) == "streamed"
    assert calls[0].num_paths == 13**12 and calls[0].is_complete


@pytest.mark.parametrize("with_x", [False, True])
def test_the_in_memory_and_streamed_tables_mean_the_same(with_x):
    """One definition in both modes: statistics over every (batch element, path) pair, pooled. The
    issue's case: a batch of 3 whose elements differ, so per-path batch means would differ."""
    attn = torch.softmax(torch.randn(3, 4, 3, 6, 6, dtype=torch.float64) * 2, -1)
    extra = {}
    if with_x:
        extra = {
            "x": torch.randn(3, 6, 5, dtype=torch.float64),
            "w_v": torch.randn(4, 3, 5, 2, dtype=torch.float64),
            "w_o": torch.randn(4, 3, 2, 5, dtype=torch.float64),
        }
    in_memory = pk.decompose(attn, **extra)
    streamed = pk.decompose(attn, max_result_bytes=1, **extra)
    assert isinstance(in_memory, pk.PathDecomposition) and isinstance(streamed, pk.PathStatistics)
    table, other = in_memory.by_length(), streamed.by_length()
    shared = ["length", "path_count", "evaluated", "exact", "mean", "stderr", "median", "q10", "q90", "min", "max"]
    assert set(shared + ["zeros", "log10_mean"]) <= set(table.columns) & set(other.columns)
    for column in ("length", "path_count", "evaluated", "exact", "stderr", "zeros"):
        assert table[column].tolist() == other[column].tolist(), column
    for column in ("mean", "min", "max", "log10_mean"):
        assert other[column].tolist() == pytest.approx(table[column].tolist(), rel=1e-12, abs=1e-300), column
    bin_factor = 10 ** (1 / streamed.bins_per_decade)
    for k, row in other.iterrows():
        pooled = in_memory.results.ratio[:, in_memory.lengths == k].flatten().sort().values
        count = pooled.numel()
        for column, level in (("median", 0.5), ("q10", 0.1), ("q90", 0.9)):
            # The histogram's quantile: within a bin of the order statistics around rank level·count.
            low = pooled[max(0, math.floor(level * count) - 1)].item() / bin_factor
            high = pooled[min(count - 1, math.ceil(level * count))].item() * bin_factor
            assert low <= row[column] <= high, (k, column)
            assert pooled[0].item() <= table.loc[k, column] <= pooled[-1].item()


def test_exact_zeros_are_counted_apart():
    """Paths through a head whose rows are all equal have a residual of exactly 0: the tables count
    them in ``zeros`` and leave them out of log10_mean, and the plots leave them out and say so."""
    pytest.importorskip("matplotlib")
    attn = random_attention(2, 3, 2, 4, 4, dtype=torch.float64)
    attn[:, 1, 0] = torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64)  # equal rows, exact mean
    in_memory = pk.decompose(attn)
    streamed = pk.decompose(attn, max_result_bytes=1)
    through = (in_memory.paths[:, 1] == 0) & (in_memory.lengths > 0)
    assert bool((in_memory.results.ratio[:, through] == 0).all())
    assert bool((in_memory.results.ratio[:, ~through] > 0).all())
    for table in (in_memory.by_length(), streamed.by_length()):
        for _, row in table.iterrows():
            chosen = in_memory.lengths == row["length"]
            assert row["zeros"] == 2 * int((through & chosen).sum())  # two batch elements each
            others = in_memory.results.ratio[:, chosen & ~through].flatten()
            expected = others.log10().mean().item() if others.numel() else math.nan
            assert row["log10_mean"] == pytest.approx(expected, rel=1e-12, nan_ok=True)
            assert row["min"] == (0.0 if row["zeros"] else others.min().item())
    figure = in_memory.plot()
    points = figure.axes[0].collections[0].get_offsets()
    assert len(points) == int((in_memory.results.ratio > 0).sum()) and bool((points[:, 1] > 0).all())
    zeros = int((in_memory.results.ratio == 0).sum())
    assert f"{zeros:,} exact zeros not shown" in figure.axes[0].get_legend().get_texts()[0].get_text()
    legend = " ".join(text.get_text() for text in streamed.plot().axes[0].get_legend().get_texts())
    assert f"{zeros:,} exact zeros not shown" in legend
