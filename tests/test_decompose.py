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
        # Interpolated, as q10, q90 and the plot's band are (torch's median() is the lower one).
        assert row["median"] == pytest.approx(pooled.quantile(0.5).item(), rel=1e-12)
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
    # Horvitz–Thompson: each of the 600 distinct paths drawn from 1024 stands for 1024 / 600.
    assert torch.equal(dec.weights, torch.full((600,), 1024 / 600, dtype=torch.float64))
    mean, stderr = dec.mean_ratio()
    exact_mean = pk.decompose(attn).mean_ratio()[0]
    assert abs(mean - exact_mean) <= 5 * stderr


def _z_of_mean(estimates: list[float], exact: float) -> float:
    """How many standard errors the mean of independent estimates lies from the exact value."""
    values = torch.tensor(estimates, dtype=torch.float64)
    return float((values.mean() - exact) / (values.std() / math.sqrt(values.numel())))


@pytest.mark.parametrize("sampling", [{"num_samples": 5}, {"samples_per_length": 1}, {"samples_per_length": {2: 3}}])
def test_sampled_estimates_are_unbiased_over_many_seeds(sampling):
    """A 27-path tree (L = 3, H = 2, with skips), a handful of samples, 1,500 seeds: the mean of the
    estimates of Σ ratio lies within 5 standard errors of the exact sum (|z| > 5 has probability
    6e-7 for an unbiased estimator), and so does that of ``mean_ratio`` of the exact mean. The
    per-length weights after uniform draws averaged 10.34 ± 0.06 against 13.30 here (z = −53): a
    length not drawn was left out."""
    attn = attention(batch=1, layers=3, heads=2, n=4)
    every = pk.decompose(attn)
    in_set = every.lengths == 2 if isinstance(sampling.get("samples_per_length"), dict) else every.lengths >= 0
    exact = float(every.path_ratio()[in_set].sum())  # over the decomposed set: the strata asked for
    samples = [pk.decompose(attn, generator=torch.Generator().manual_seed(seed), **sampling) for seed in range(1500)]
    assert abs(_z_of_mean([sample.estimate() for sample in samples], exact)) < 5
    # mean_ratio's estimate of the mean ratio over the set, uniform or stratified, is unbiased too.
    exact_mean = float(every.path_ratio()[in_set].mean())
    assert abs(_z_of_mean([sample.mean_ratio()[0] for sample in samples], exact_mean)) < 5


def test_sample_paths_draws_each_path_with_its_stated_chance():
    """``sample_paths`` with replacement, over all paths and over one length: the mean of
    ``count · f(path)`` over 200,000 draws (f a random table per layer and choice, summed along the
    path) lies within 5 standard errors of the exact ``Σ_p f(p)``, by enumeration."""
    layers, heads = 4, 3
    table = torch.randn(layers, heads + 1, dtype=torch.float64)

    def f(paths):
        return table[torch.arange(layers), paths + 1].sum(-1)

    every = pk.PathTree.complete(layers, heads, skip=True).paths()
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for length in (None, 2):
        chosen = every if length is None else every[(every >= 0).sum(-1) == length]
        drawn = pk.sample_paths(layers, heads, 200_000, skip=True, length=length, generator=generator)
        estimates = (chosen.shape[0] * f(drawn)).tolist()
        assert abs(_z_of_mean(estimates, float(f(chosen).sum()))) < 5, length


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
    # The title says which network it shows: the method and shape by default, or the caller's.
    assert pk.decompose(attention()).plot().axes[0].get_title() == "exact decomposition: L = 4, H = 3"
    titled = pk.decompose(attention()).plot(title="a +skip network at initialisation (L = 4, H = 3)")
    assert titled.axes[0].get_title() == "a +skip network at initialisation (L = 4, H = 3)"


def test_plot_of_a_large_decomposition_draws_a_subset(monkeypatch):
    pytest.importorskip("matplotlib")
    module = sys.modules["pathkernels.core.decompose"]  # the module, not the function pk.decompose
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
    path_statistics (stubbed here: the real run takes days on 2 cores), in its own name and with
    its max_paths; above the default max_paths it is refused before any work."""
    module = sys.modules["pathkernels.core.decompose"]
    calls = []
    monkeypatch.setattr(
        module,
        "stream_statistics",
        lambda attn, tree, where, **kwargs: calls.append((tree, where, kwargs)) or "streamed",
    )
    big = random_attention(1, 12, 12, 3, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^pathkernels\.decompose: the call would evaluate 23,298,085,122,481 paths"):
        pk.decompose(big)
    assert not calls
    assert pk.decompose(big, max_paths=13**12) == "streamed"
    tree, where, kwargs = calls[0]
    assert tree.num_paths == 13**12 and tree.is_complete
    assert where == "pathkernels.decompose" and kwargs["max_paths"] == 13**12


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


def test_paths_apart_of_the_wrong_kind_are_refused_by_name():
    pytest.importorskip("pandas")
    dec = pk.decompose(attention())
    count = dec.lengths.shape[0]
    for apart in (torch.zeros(3, dtype=torch.bool), torch.zeros(count), [False] * count):
        for call, name in ((dec.quantiles_by_length, "quantiles_by_length"), (lambda a: dec.plot(apart=a), "plot")):
            with pytest.raises(
                ValueError, match=rf"^pathkernels\.PathDecomposition\.{name}: expected apart to be a bool tensor \[M\]"
            ):
                call(apart)


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


def pruned(batch=2, layers=4, heads=3, n=5, d=4):
    """Path outputs of a network whose head 0 of layer 1 is pruned (W_O = 0): every path through it
    is a zero path (its term is the zero matrix: ratio 0/0). With batch > 1, element 1 has x = 0,
    so each of its paths is one."""
    generator = torch.Generator().manual_seed(5)
    attn = random_attention(batch, layers, heads, n, n, dtype=torch.float64, generator=generator)
    x = torch.randn(batch, n, d, dtype=torch.float64, generator=generator)
    w_v = torch.randn(layers, heads, d, 2, dtype=torch.float64, generator=generator)
    w_o = torch.randn(layers, heads, 2, d, dtype=torch.float64, generator=generator)
    w_o[1, 0] = 0
    if batch > 1:
        x[1] = 0
    return attn, {"x": x, "w_v": w_v, "w_o": w_o}


RATIO_COLUMNS = ["mean", "stderr", "median", "q10", "q90", "min", "max"]


def test_zero_paths_are_left_out_of_the_ratio_statistics_and_counted():
    """A zero path has no ratio (0/0 = NaN per path): the in-memory and streamed tables leave its
    pairs out of every ratio column and count them in zero_norm, so no column turns NaN (mean and
    median were NaN while min and max skipped them); a length whose every pair is a zero path (the
    element with x = 0) reads 0. The estimators leave them out too."""
    attn, outputs = pruned()
    dec = pk.decompose(attn, **outputs)
    streamed = pk.decompose(attn, max_result_bytes=1, **outputs)
    through = (dec.paths[:, 1] == 0).unsqueeze(0) | torch.tensor([[False], [True]])  # [B, M]: zero paths
    assert bool((dec.results.norm[through] == 0).all()) and bool((dec.results.norm[~through] > 0).all())
    assert bool(dec.results.ratio[through].isnan().all())  # the per-path value: no ratio
    for table in (dec.by_length(), streamed.by_length()):
        for _, row in table.iterrows():
            chosen = (dec.lengths == row["length"]).expand_as(through)
            values = dec.results.ratio[chosen & ~through]
            assert row["zero_norm"] == int((chosen & through).sum())
            assert row["mean"] == pytest.approx(values.mean().item(), rel=1e-12)
            assert row["min"] == values.min().item() and row["max"] == values.max().item()
            assert not any(math.isnan(row[column]) for column in RATIO_COLUMNS), row
    assert dec.by_length()["median"].tolist() == [
        dec.results.ratio[(dec.lengths == k).expand_as(through) & ~through].quantile(0.5).item() for k in range(5)
    ]
    mean, stderr = dec.mean_ratio()
    alive = dec.results.ratio[0, ~through[0]]  # element 1 has none: the path means are element 0's
    assert (mean, stderr) == (pytest.approx(alive.mean().item(), rel=1e-12), 0.0)
    assert streamed.mean_ratio()[0] == pytest.approx(dec.results.ratio[~through].mean().item(), rel=1e-12)
    assert bool(dec.path_ratio()[through[0]].isnan().all()) and not bool(dec.path_ratio()[~through[0]].isnan().any())
    frame = dec.to_frame()
    assert frame["ratio"].isna().tolist() == through[0].tolist()
    # Element 1 alone: every pair a zero path, so every ratio column reads 0.
    alone = pk.decompose(attn[1:], **{**outputs, "x": outputs["x"][1:]}).by_length()
    assert (alone["zero_norm"] == alone["path_count"]).all()
    assert (alone[RATIO_COLUMNS] == 0).all().all()


def test_sampled_estimators_leave_zero_paths_out():
    """Uniform and stratified samples of a network with a pruned head estimate the exact mean over
    the paths that are not zero paths, within a few standard errors, which stay finite."""
    attn, outputs = pruned(batch=1, layers=5)
    exact = pk.decompose(attn, **outputs)
    truth = exact.mean_ratio()[0]
    assert truth == pytest.approx(exact.results.ratio[exact.results.norm != 0].mean().item(), rel=1e-12)
    uniform = pk.decompose(attn, num_samples=500, generator=torch.Generator().manual_seed(1), **outputs)
    stratified = pk.decompose(attn, samples_per_length=60, generator=torch.Generator().manual_seed(2), **outputs)
    for dec in (uniform, stratified):
        mean, stderr = dec.mean_ratio()
        assert math.isfinite(stderr) and 0 < stderr and abs(mean - truth) <= 5 * stderr, dec.method
        table = dec.by_length()
        table = table[table["evaluated"] > 0]  # a length no draw reached has no estimate (NaN)
        assert not table[RATIO_COLUMNS].isna().any().any() and table["zero_norm"].sum() > 0
        sampled = table.set_index("length")
        for k, row in pk.decompose(attn, **outputs).by_length().set_index("length").iterrows():
            if k in sampled.index and not sampled.loc[k, "exact"]:
                assert abs(sampled.loc[k, "mean"] - row["mean"]) <= 5 * sampled.loc[k, "stderr"], (dec.method, k)
    # The stratified estimator, by hand: each length weighs count_k · n'_k / n_k, its estimated
    # number of paths that are not zero paths (n'_k of its n_k drawn paths are not).
    ratio, weights, means, alive_shares = stratified.path_ratio(), [], [], set()
    for k, count in enumerate(stratified.path_counts):
        drawn = ratio[stratified.lengths == k]
        alive = drawn[~drawn.isnan()]
        if count and alive.numel():
            weights.append(count * alive.numel() / drawn.numel())
            means.append(alive.mean().item())
            alive_shares.add(alive.numel() / drawn.numel())
    assert len(alive_shares) > 1  # lengths differ in their share of zero paths
    expected = sum(w * m for w, m in zip(weights, means)) / sum(weights)
    assert stratified.mean_ratio()[0] == pytest.approx(expected, rel=1e-12)


def test_a_captured_model_at_zero_biases_has_no_nan_in_its_table():
    """docs/USAGE.md's example: GPT-2 at initialisation has zero attention biases, so each layer's
    constant-row paths are zero paths, and its by_length() table printed NaN means and medians."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=50)
    gpt2 = transformers.GPT2LMHeadModel(config).double().eval()
    stack, _ = pk.adapters.capture_huggingface_residual(gpt2, input_ids=torch.randint(0, 50, (1, 6)))
    dec = pk.decompose(stack, max_length=2)
    table = dec.by_length()
    assert table["zero_norm"].sum() > 0  # the layers' constant rows
    assert not table[RATIO_COLUMNS].isna().any().any(), table
    assert math.isfinite(dec.mean_ratio()[0])


def test_budget_errors_and_warnings_name_decompose():
    """decompose's memory-budget errors named pathkernels.path_residuals (or path_statistics when it
    streamed), and its small-budget warning too."""
    attn = random_attention(1, 3, 2, 6, 6, dtype=torch.float64)
    for streamed in (False, True):
        extra = {"max_result_bytes": 1} if streamed else {}
        with pytest.raises(ValueError, match=r"^pathkernels\.decompose: memory_budget=10 bytes is too small"):
            pk.decompose(attn, memory_budget=10, **extra)
        with pytest.raises(ValueError, match=r"^pathkernels\.decompose: expected memory_budget to be a positive int"):
            pk.decompose(attn, memory_budget="1 GiB", **extra)
        with pytest.warns(RuntimeWarning, match=r"^pathkernels\.decompose: memory_budget=3,000 bytes allows chunks"):
            pk.decompose(attn, memory_budget=3000, **extra)
    with pytest.raises(ValueError, match=r"^pathkernels\.path_residuals: memory_budget=10 bytes is too small"):
        pk.path_residuals(attn, pk.PathTree.complete(3, 2, skip=True), memory_budget=10)
    with pytest.raises(ValueError, match=r"^pathkernels\.path_statistics: memory_budget=10 bytes is too small"):
        pk.path_statistics(attn, pk.PathTree.complete(3, 2, skip=True), memory_budget=10)


def test_a_tree_with_max_length_or_a_contradicting_skip_is_refused():
    """decompose(tree=…, max_length=1) evaluated the whole tree, and decompose(skip=False,
    tree=skip_tree) the paths through skips of a network said to have none: one of the two was
    silently ignored. Both are refused, naming both; a tree without skips fits either skip."""
    attn = attention(layers=2, heads=2, n=3)
    skip_tree, bare_tree = pk.PathTree.complete(2, 2, skip=True), pk.PathTree.complete(2, 2)
    with pytest.raises(ValueError, match=r"^pathkernels\.decompose: pass tree or max_length, not both.*max_length=1"):
        pk.decompose(attn, tree=skip_tree, max_length=1)
    with pytest.raises(ValueError, match=r"^pathkernels\.decompose: skip=False .* a tree whose paths skip layers"):
        pk.decompose(attn, skip=False, tree=skip_tree)
    for skip in (True, False):
        assert len(pk.decompose(attn, skip=skip, tree=bare_tree).paths) == 4
    assert len(pk.decompose(attn, tree=skip_tree).paths) == 9


def test_decomposes_refusals_name_decompose():
    """Its errors named pathkernels.PathTree.complete (skip=False with max_length < L) or
    pathkernels.sample_paths (a sample beyond memory), and an empty set of strata reached
    torch.cat() ("expected a non-empty list")."""
    attn = attention(layers=3, heads=2, n=3)
    for extra in ({}, {"samples_per_length": 2}):
        with pytest.raises(ValueError, match=r"^pathkernels\.decompose: without skip every path takes a head at each"):
            pk.decompose(attn, skip=False, max_length=1, **extra)
    with pytest.raises(ValueError, match=r"^pathkernels\.decompose: expected samples_per_length to ask for at least"):
        pk.decompose(attn, samples_per_length={})
    big = random_attention(1, 12, 12, 3, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^pathkernels\.decompose: num_samples=1,000,000,000,000 paths of 12 layers"):
        pk.decompose(big, num_samples=10**12, max_paths=10**13)
    assert pk.decompose(attn, skip=False, samples_per_length=2).method == "stratified"  # length L only


def test_the_stratified_standard_error_is_its_formula_written_by_hand():
    """``mean_ratio``'s stratified estimate and standard error against ``Σ_k w_k mean_k / Σ w`` and
    ``sqrt(Σ_k (w_k / Σ w)² s_k² / n_k · (1 − n_k / count_k))`` computed here from the paths'
    ratios (the squared weights and the correction each matter); a stratum of 0 paths is refused."""
    attn = attention(batch=1, layers=5, heads=3, n=5)
    dec = pk.decompose(attn, samples_per_length={1: 6, 3: 40, 4: 25}, generator=torch.Generator().manual_seed(3))
    ratio, lengths = dec.path_ratio(), dec.lengths
    weights, means, terms = [], [], []
    for k, count in ((1, 15), (3, 270), (4, 405)):
        values = ratio[lengths == k]
        n = values.numel()
        weights.append(count)
        means.append(float(values.mean()))
        terms.append(0.0 if n >= count else float(values.var(correction=1)) / n * (1 - n / count))
    total = sum(weights)
    mean = sum(w / total * m for w, m in zip(weights, means))
    stderr = math.sqrt(sum((w / total) ** 2 * t for w, t in zip(weights, terms)))
    got_mean, got_stderr = dec.mean_ratio()
    assert got_mean == pytest.approx(mean, rel=1e-12) and got_stderr == pytest.approx(stderr, rel=1e-12)
    assert got_stderr > 0
    with pytest.raises(ValueError, match=r"^pathkernels\.decompose: expected samples_per_length\[1\] >= 1"):
        pk.decompose(attn, samples_per_length={1: 0})
