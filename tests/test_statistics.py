"""pk.path_statistics: streamed per-length statistics against the per-path results they summarise."""

import math
import random
import re
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

import pathkernels as pk
from pathkernels.core._files import read_sealed
from pathkernels.core.statistics import QUANTILES, SMALLEST_POSITIVE, PathStatistics, histogram_edges
from pathkernels.testing import padded_network, random_attention


def exact(attn, tree, **outputs):
    """Per-path residual, norm and ratio [B, M], the paths [M, L] and lengths [M], from the engine."""
    result = pk.path_residuals(attn, tree, **outputs)
    return result, tree.paths(), tree.lengths()


def trees():
    sampled = pk.sample_paths(4, 3, 60, skip=True, generator=torch.Generator().manual_seed(0))
    return [
        pk.PathTree.complete(4, 3, skip=True),
        pk.PathTree.complete(4, 3),
        pk.PathTree.complete(4, 3, skip=True, max_length=2),
        pk.PathTree.from_paths(torch.unique(sampled, dim=0)),
        # Listed more than once, a path counts as often as listed, as in path_residuals and
        # count_by_length (the statistics counted it once).
        pk.PathTree.from_paths(torch.cat([sampled, sampled[:7], sampled[2:3]])),
    ]


@pytest.mark.parametrize("tree", trees(), ids=["complete", "no-skip", "max_length", "explicit", "repeats"])
@pytest.mark.parametrize("budget", [1 << 30, 1 << 14])
def test_statistics_equal_those_of_the_per_path_results(device, tree, budget):
    """Bit for bit on the CPU, whose engine computes each path alike at any budget; on CUDA cuBLAS
    picks its algorithm by shape, so a budget that changes the blocks may move the last bits."""
    exactly = {"rtol": 0, "atol": 0} if device == "cpu" else {"rtol": 1e-13, "atol": 0}
    attn = random_attention(2, 4, 3, 6, 6, dtype=torch.float64, temperature=0.5).to(device)
    x = torch.randn(2, 6, 5, dtype=torch.float64, device=device)
    w_v = torch.randn(4, 3, 5, 2, dtype=torch.float64, device=device) / 2
    w_o = torch.randn(4, 3, 2, 5, dtype=torch.float64, device=device) / 2
    for outputs in ({}, {"x": x, "w_v": w_v, "w_o": w_o}):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the small budget warns that it is slow
            stats = pk.path_statistics(attn, tree, top_k=4, memory_budget=budget, **outputs)
        result, paths, lengths = exact(attn, tree, **outputs)
        values = {"ratio": result.ratio, "residual": result.residual, "norm": result.norm}
        for k in range(5):
            chosen = lengths == k
            assert stats.counts[:, k].tolist() == [int(chosen.sum())] * 2
            if not chosen.any():
                assert bool((stats.argmin["ratio"][:, k] == -2).all())
                continue
            for name, value in values.items():
                v = value[:, chosen.to(value.device)].double()
                torch.testing.assert_close(stats.mean(name)[:, k], v.mean(1), rtol=1e-12, atol=0)
                if v.shape[1] > 1:
                    # The statistics' variance is (Σx² − (Σx)²/n)/(n − 1), from float64 sums: it
                    # cancels where the mean dwarfs the spread, by up to δ = 4 n ε Σx²/(n − 1), and
                    # |sqrt(s² + δ) − s| ≤ 2δ / (s + sqrt δ).
                    count = v.shape[1]
                    delta = 4 * count * 2.0**-52 * v.square().sum(1) / (count - 1)
                    bound = 2 * delta / (v.std(1) + delta.sqrt()) + 1e-15
                    bound = bound + 2 * exactly["rtol"] * v.abs().amax(1)  # values a few ulp apart
                    assert bool(((stats.std(name)[:, k] - v.std(1)).abs() <= bound).all()), (name, k)
                torch.testing.assert_close(stats.minima[name][:, k], v.min(1).values, **exactly)
                torch.testing.assert_close(stats.maxima[name][:, k], v.max(1).values, **exactly)
                # The path of the extreme is the first one (in leaf order) that reaches it.
                for b in range(2):
                    path = stats.argmin[name][b, k].cpu()
                    i = int((paths == path).all(1).nonzero()[0])
                    torch.testing.assert_close(float(value[b, i]), float(stats.minima[name][b, k]), **exactly)
            # The top ratios are the largest, and their paths carry them.
            for b in range(2):
                ratio = result.ratio[b, chosen.to(result.ratio.device)].double()
                top = stats.top(4, length=k, batch_element=b)
                expected = ratio.sort(descending=True).values[:4]
                got = torch.tensor([value for value, _ in top], dtype=torch.float64)
                torch.testing.assert_close(got, expected.cpu(), **exactly)
                for value, path in top:
                    i = int((paths == torch.tensor(path)).all(1).nonzero()[0])
                    torch.testing.assert_close(float(result.ratio[b, i]), value, **exactly)


def test_top_paths_skip_zero_products_and_break_ties_by_leaf_order():
    """A pruned head (W_O = 0) makes every path through it a zero product, ratio 0/0: such paths
    must not take places among the top ratios. And where paths tie exactly (two identical heads in
    every layer), the top holds the first of them in the tree's order."""
    layers, heads, n, d = 3, 2, 5, 4
    attn = random_attention(1, layers, 1, n, n, dtype=torch.float64).expand(-1, -1, heads, -1, -1)  # equal heads
    x = torch.randn(1, n, d, dtype=torch.float64)
    w_v = torch.randn(layers, 1, d, 2, dtype=torch.float64).expand(-1, heads, -1, -1).clone()
    w_o = torch.randn(layers, 1, 2, d, dtype=torch.float64).expand(-1, heads, -1, -1).clone()
    tree = pk.PathTree.complete(layers, heads, skip=True)
    paths, lengths = tree.paths(), tree.paths().ne(-1).sum(1)
    stats = pk.path_statistics(attn, tree, x=x, w_v=w_v, w_o=w_o, top_k=3)
    ratio = pk.path_residuals(attn, tree, x=x, w_v=w_v, w_o=w_o).ratio[0]
    for length in range(1, layers + 1):  # paths with the same skips tie exactly: 2^length of them each
        of_length = (lengths == length).nonzero().flatten()
        # Largest first, ties in the tree's order (a stable sort of the paths in that order).
        expected = of_length[ratio[of_length].sort(descending=True, stable=True).indices[:3]]
        assert len(set(ratio[of_length].tolist())) < len(of_length)  # ties do occur
        assert [path for _, path in stats.top(3, length=length)] == paths[expected].tolist()
    w_o[1, 0] = 0  # prune head 0 of layer 1
    stats = pk.path_statistics(attn, tree, x=x, w_v=w_v, w_o=w_o, top_k=3)
    result = pk.path_residuals(attn, tree, x=x, w_v=w_v, w_o=w_o)
    through_pruned = paths[:, 1] == 0
    assert bool(result.ratio[0, through_pruned].isnan().all())
    for length in range(1, layers + 1):
        alive = (lengths == length) & ~through_pruned
        top = stats.top(3, length=length)
        assert len(top) == min(3, int(alive.sum()))  # no place lost to a NaN
        assert all(path[1] != 0 for _, path in top)
        assert [value for value, _ in top] == result.ratio[0, alive].sort(descending=True).values[:3].tolist()


def test_histograms_count_every_path_in_its_bin():
    attn = random_attention(1, 5, 3, 5, 5, dtype=torch.float64, temperature=0.3)
    tree = pk.PathTree.complete(5, 3, skip=True)
    stats = pk.path_statistics(attn, tree, bins_per_decade=4)
    result, _, lengths = exact(attn, tree)
    edges = histogram_edges(4)
    assert edges[-1] == 10 and edges[0] == SMALLEST_POSITIVE == 2.0**-1074  # bin 0: exact zeros only
    for name, value in (("ratio", result.ratio[0]), ("residual", result.residual[0])):
        for k in range(6):
            v = value[lengths == k]
            # Independent binning: the number of edges at or below each value.
            expected = torch.zeros(edges.numel() + 1, dtype=torch.long)
            for item in v.tolist():
                expected[sum(1 for edge in edges.tolist() if edge <= item)] += 1
            assert torch.equal(stats.histograms[name][0, k], expected), (name, k)


def test_quantiles_from_the_histogram_are_within_one_bin():
    pytest.importorskip("pandas")  # the by_length() and to_frame() tables
    attn = random_attention(1, 6, 3, 6, 6, dtype=torch.float64, temperature=0.5)
    tree = pk.PathTree.complete(6, 3, skip=True)
    stats = pk.path_statistics(attn, tree, bins_per_decade=20)
    result, _, lengths = exact(attn, tree)
    quantiles, error = stats.quantiles("ratio")
    assert error == pytest.approx(10 ** (1 / 20) - 1)
    for k in range(2, 7):  # lengths with enough paths for quantiles to mean something
        v = result.ratio[0, lengths == k]
        for i, level in enumerate(QUANTILES):
            truth = float(v.quantile(level))
            # Within the bin that holds it, give or take the interpolation between neighbours.
            assert abs(math.log10(float(quantiles[0, k, i])) - math.log10(truth)) <= 2 / 20 + 1e-12, (k, level)
    table = stats.by_length()
    assert list(table["length"]) == list(range(7)) and bool(table["from_histogram"].all())
    assert table["path_count"].tolist() == pk.count_by_length(6, 3, skip=True)
    assert {"mean", "std", "min", "max", "q05", "median", "q95", "quantile_rel_error"} <= set(table.columns)
    assert table["quantile_rel_error"].tolist() == pytest.approx([10 ** (1 / 20) - 1] * 7)
    for k in range(2, 7):  # the table's quantiles are quantiles()'s
        row = table[table["length"] == k].iloc[0]
        assert [row["q05"], row["median"], row["q95"]] == pytest.approx(
            [float(quantiles[0, k, QUANTILES.index(level)]) for level in (0.05, 0.5, 0.95)]
        )
    decomposition = pk.decompose(attn, skip=True).by_length()
    torch.testing.assert_close(torch.tensor(table["mean"].tolist()), torch.tensor(decomposition["mean"].tolist()))


def test_quantiles_lie_between_the_extremes():
    """A bin is wider than the values in it, so a quantile read from the histogram is clamped to
    the smallest and largest values counted: length 0 is the identity in every batch element, whose
    ratio 2(n − 1)/n = 1.6 (n = 5) was read as a median of 1.78 and a 95th percentile of 1.97."""
    pytest.importorskip("pandas")  # the by_length() table
    attn = random_attention(3, 3, 2, 5, 5, dtype=torch.float64)
    stats = pk.path_statistics(attn, pk.PathTree.complete(3, 2, skip=True), bins_per_decade=4)
    quantiles, _ = stats.quantiles("residual")
    assert torch.equal(quantiles[:, 0], torch.full_like(quantiles[:, 0], float(stats.minima["residual"][0, 0])))
    quantiles, _ = stats.quantiles("ratio")
    assert bool((quantiles >= stats.minima["ratio"][..., None]).all())
    assert bool((quantiles <= stats.maxima["ratio"][..., None]).all())
    row = stats.by_length().iloc[0]
    assert row["median"] == row["q05"] == row["q95"] == row["min"] == pytest.approx(1.6, rel=1e-15)
    table = stats.by_length()
    assert bool((table["q95"] <= table["max"]).all()) and bool((table["q05"] >= table["min"]).all())


def test_merge_of_disjoint_trees_equals_the_whole(tmp_path):
    pytest.importorskip("pandas")  # the by_length() and to_frame() tables
    attn = random_attention(2, 4, 3, 5, 5, dtype=torch.float64)
    every = pk.PathTree.complete(4, 3, skip=True).paths()
    shuffled = every[torch.randperm(every.shape[0])]
    halves = [pk.PathTree.from_paths(part, num_heads=3) for part in (shuffled[:100], shuffled[100:])]
    whole = pk.path_statistics(attn, pk.PathTree.complete(4, 3, skip=True), top_k=3)
    merged = pk.path_statistics(attn, halves[0], top_k=3).merge(pk.path_statistics(attn, halves[1], top_k=3))
    assert torch.equal(merged.counts, whole.counts)
    for name in ("ratio", "residual", "norm"):
        torch.testing.assert_close(merged.sums[name], whole.sums[name], rtol=1e-13, atol=0)
        assert torch.equal(merged.minima[name], whole.minima[name]) and torch.equal(
            merged.maxima[name], whole.maxima[name]
        )
    for name in ("ratio", "residual"):
        assert torch.equal(merged.histograms[name], whole.histograms[name])
    assert torch.equal(merged.top_values, whole.top_values)
    # save / load round trip
    merged.save(tmp_path / "stats.pt")
    loaded = PathStatistics.load(tmp_path / "stats.pt")
    assert torch.equal(loaded.counts, merged.counts) and loaded.dtype == merged.dtype
    assert loaded.top(3) == merged.top(3)
    assert len(loaded.to_frame()) == 2 * 5
    with pytest.raises(ValueError, match="merge: bins_per_decade differs"):
        merged.merge(pk.path_statistics(attn, halves[0], top_k=3, bins_per_decade=5))


def test_statistics_of_a_tree_beyond_per_path_results():
    """A tree whose per-path results path_residuals would refuse (over 2^40 paths) streams in
    bounded memory; here a cut-down check of the same code path: no per-path result is kept."""
    attn = random_attention(1, 8, 4, 4, 4, dtype=torch.float32)
    tree = pk.PathTree.complete(8, 4, skip=True)  # 390,625 paths
    stats = pk.path_statistics(attn, tree, top_k=2)
    assert stats.counts.sum().item() == tree.num_paths
    assert stats.histograms["ratio"].sum().item() == tree.num_paths


def test_plot_draws_the_table_on_a_log_scale():
    pytest.importorskip("pandas")
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    attn = random_attention(1, 4, 2, 4, 4, dtype=torch.float64)
    figure = pk.path_statistics(attn, pk.PathTree.complete(4, 2, skip=True)).plot()
    assert figure.axes[0].get_yscale() == "log" and figure.axes[0].get_legend()


def test_bad_arguments():
    attn = random_attention(1, 2, 2, 3, 3, dtype=torch.float64)
    tree = pk.PathTree.complete(2, 2)
    with pytest.raises(ValueError, match="path_statistics: expected top_k >= 0, got -1"):
        pk.path_statistics(attn, tree, top_k=-1)
    with pytest.raises(ValueError, match=r"path_statistics: expected bins_per_decade in \[1, 1000\], got 0"):
        pk.path_statistics(attn, tree, bins_per_decade=0)
    with pytest.raises(ValueError, match="top: expected top_k in"):
        pk.path_statistics(attn, tree, top_k=1).top(2)
    with pytest.raises(
        ValueError,
        match=r"path_statistics: expected leaf_kernel in \('auto', 'fused', .*, 'triton'\), got 'simt'",
    ):
        pk.path_statistics(attn, tree, leaf_kernel="simt")
    with pytest.raises(ValueError, match="leaf_kernel='tensor' runs on TF32 tensor cores and takes float32 attn"):
        pk.path_statistics(attn, tree, leaf_kernel="tensor")


RESUMABLE_RUN = """
import sys, warnings
import torch
import pathkernels as pk
from pathkernels.testing import padded_network, random_attention

warnings.simplefilter("ignore")
torch.set_num_threads(1)
attn = random_attention(2, 7, 4, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
folder = None if sys.argv[1] == "-" else sys.argv[1]
stats = pk.path_statistics(attn, pk.PathTree.complete(7, 4, skip=True), top_k=3, memory_budget=1 << 16,
                           checkpoint=folder, checkpoint_every=0)
stats.save(sys.argv[2])
"""


def _run(script, *args, **kwargs):
    return subprocess.Popen([sys.executable, str(script), *map(str, args)], **kwargs)


def test_a_killed_run_resumes_to_exactly_the_uninterrupted_statistics(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(RESUMABLE_RUN)
    assert _run(script, "-", tmp_path / "whole.pt").wait(timeout=300) == 0
    folder = tmp_path / "checkpoint"
    killed = _run(script, folder, tmp_path / "never.pt")
    deadline = time.monotonic() + 120
    while not (folder / "rank0-of-1.pt").exists() and time.monotonic() < deadline and killed.poll() is None:
        time.sleep(0.01)
    time.sleep(random.uniform(0.0, 0.3))  # a random moment after the first checkpoint
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    assert killed.returncode == -signal.SIGKILL and not (tmp_path / "never.pt").exists()
    state = read_sealed(folder / "rank0-of-1.pt", "test", "the checkpoint", "")
    assert 0 < state["reached"] < 5**7  # stopped part-way: the rerun resumes
    assert _run(script, folder, tmp_path / "resumed.pt").wait(timeout=300) == 0
    whole, resumed = PathStatistics.load(tmp_path / "whole.pt"), PathStatistics.load(tmp_path / "resumed.pt")
    for name, value in whole.state().items():
        other = resumed.state()[name]
        if isinstance(value, dict):
            assert all(torch.equal(value[key], other[key]) for key in value), name  # bit for bit
        elif isinstance(value, torch.Tensor):
            assert torch.equal(value, other), name
        else:
            assert value == other, name


def test_a_checkpoint_refuses_other_inputs(tmp_path):
    attn = random_attention(1, 3, 2, 4, 4, dtype=torch.float64)
    tree = pk.PathTree.complete(3, 2, skip=True)
    first = pk.path_statistics(attn, tree, checkpoint=tmp_path)
    again = pk.path_statistics(attn, tree, checkpoint=tmp_path)  # finished: read back, nothing recomputed
    assert torch.equal(first.counts, again.counts) and torch.equal(first.sums["ratio"], again.sums["ratio"])
    other = random_attention(1, 3, 2, 4, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"was written for other inputs or settings \(attn, inputs_sha256 differ"):
        pk.path_statistics(other, tree, checkpoint=tmp_path)
    with pytest.raises(ValueError, match=r"\(bins_per_decade differ"):
        pk.path_statistics(attn, tree, checkpoint=tmp_path, bins_per_decade=5)


def test_damaged_truncated_or_foreign_checkpoints_are_refused(tmp_path):
    """Byte flips anywhere, a truncated file or someone else's file: one message that says what to
    do, never a resume from wrong statistics (11 of 12 random flips used to resume)."""
    attn = random_attention(1, 3, 2, 4, 4, dtype=torch.float64)
    tree = pk.PathTree.complete(3, 2, skip=True)
    pk.path_statistics(attn, tree, checkpoint=tmp_path, top_k=2)
    path = tmp_path / "rank0-of-1.pt"
    intact = path.read_bytes()
    message = r"the checkpoint .*rank0-of-1.pt cannot be used: .*Delete it, or pass another checkpoint folder"
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for position in torch.randint(0, len(intact), (12,), generator=generator).tolist():
        damaged = bytearray(intact)
        damaged[position] ^= 1 << int(torch.randint(0, 8, (), generator=generator))
        path.write_bytes(bytes(damaged))
        with pytest.raises(ValueError, match=message):
            pk.path_statistics(attn, tree, checkpoint=tmp_path, top_k=2)
    for broken in (intact[: len(intact) // 2], intact[:10], b"", b"not a checkpoint at all"):
        path.write_bytes(broken)
        with pytest.raises(ValueError, match=message):
            pk.path_statistics(attn, tree, checkpoint=tmp_path, top_k=2)
    torch.save({"identity": {}, "statistics": {}}, path)  # a torch file, but not a sealed one
    with pytest.raises(ValueError, match=r"cannot be used: it was not written by this version of pathkernels"):
        pk.path_statistics(attn, tree, checkpoint=tmp_path, top_k=2)
    path.write_bytes(intact)
    assert pk.path_statistics(attn, tree, checkpoint=tmp_path, top_k=2).top(2) is not None
    saved = tmp_path / "stats.pt"
    pk.path_statistics(attn, tree).save(saved)
    saved.write_bytes(saved.read_bytes()[:-7])
    with pytest.raises(ValueError, match=r"PathStatistics.load: the file .* damaged or truncated. Save the statistics"):
        PathStatistics.load(saved)


def test_a_checkpoint_tells_inputs_apart_by_their_bytes(tmp_path):
    """The old identity was a sum and a position-weighted sum mod 97: these two inputs share both,
    and the stale statistics came back."""
    attn = torch.full((1, 1, 1, 4, 4), 0.25, dtype=torch.float64)
    crafted = attn.clone()
    for (i, j), change in zip(((0, 0), (0, 1), (1, 0), (1, 1)), (0.125, -0.125, -0.125, 0.125)):
        crafted[0, 0, 0, i, j] += change
    from pathkernels.core.distributed import fingerprint

    tree = pk.PathTree.complete(1, 1)
    assert fingerprint({"attn": attn}, tree) == fingerprint({"attn": crafted}, tree)  # the weak checksums agree
    pk.path_statistics(attn, tree, checkpoint=tmp_path)
    with pytest.raises(ValueError, match=r"was written for other inputs or settings \(inputs_sha256 differ"):
        pk.path_statistics(crafted, tree, checkpoint=tmp_path)


def _nan_at(tensor, index):
    tensor[index] = math.nan


# (field named in the refusal, an edit of the checkpoint's contents): each re-sealed with the
# library's own seal, so that only the consistency of what it holds can refuse it.
EDITS = {
    "reached beyond the end": ("reached", lambda state: state.update(reached=10**6)),
    "reached negative": ("reached", lambda state: state.update(reached=-1)),
    "reached not an int": ("reached", lambda state: state.update(reached=27.0)),
    "doubled counts": ("counts", lambda state: state["statistics"]["counts"].mul_(2)),
    "a count moved to another length": (
        "counts",
        lambda state: state["statistics"]["counts"][:, 1:3].add_(torch.tensor([1, -1])),
    ),
    "negative counts": ("counts", lambda state: state["statistics"]["counts"][0].neg_()),
    "zero paths beyond the counts": ("zero_norms", lambda state: state["statistics"]["zero_norms"].fill_(99)),
    "NaN maxima": ("maxima['ratio']", lambda state: _nan_at(state["statistics"]["maxima"]["ratio"], (0, 1))),
    "minimum above the maximum": ("minima['norm']", lambda state: state["statistics"]["minima"]["norm"].mul_(1e3)),
    "sums edited": ("sums['residual']", lambda state: state["statistics"]["sums"]["residual"].mul_(10)),
    "sums of squares edited": (
        "sums_of_squares['ratio']",
        lambda state: state["statistics"]["sums_of_squares"]["ratio"].mul_(0.5),
    ),
    "a histogram that does not sum to the counts": (
        "histograms['ratio']",
        lambda state: state["statistics"]["histograms"]["ratio"][0, 2, 100].add_(1),
    ),
    "a histogram moved to another bin": (
        "histograms['residual']",
        lambda state: state["statistics"]["histograms"]["residual"][0, 2].copy_(
            state["statistics"]["histograms"]["residual"][0, 2].roll(5)
        ),
    ),
    "argmin out of range": ("argmin['norm']", lambda state: state["statistics"]["argmin"]["norm"][0, 1, 0].fill_(7)),
    "argmax of another length": (
        "argmax['ratio']",
        lambda state: state["statistics"]["argmax"]["ratio"][0, 2].fill_(-1),
    ),
    "a top ratio above the maximum": ("top_values", lambda state: state["statistics"]["top_values"][0, 1, 0].add_(1)),
    "top paths where there is none": (
        "top_paths",
        lambda state: state["statistics"]["top_paths"][0, 0, 1].fill_(0),
    ),
    "log sums of no path": ("log10_ratio_sums", lambda state: state["statistics"]["log10_ratio_sums"].fill_(math.inf)),
    "a state for another dtype": ("dtype", lambda state: state["statistics"].update(dtype="float32")),
    "a state for a half-precision dtype": ("dtype", lambda state: state["statistics"].update(dtype="float16")),
    "a state for another tree": ("num_heads", lambda state: state["statistics"].update(num_heads=3)),
    "a state without skip": ("skip", lambda state: state["statistics"].update(skip=False)),
    "a state for another batch": (
        "counts",
        lambda state: state["statistics"].update(counts=state["statistics"]["counts"].repeat(2, 1)),
    ),
    "a field missing": ("the fields", lambda state: state["statistics"].pop("sums")),
    "no layer": ("num_layers", lambda state: state["statistics"].update(num_layers=0)),
    "counts of no batch element": (
        "counts",
        lambda state: state["statistics"].update(counts=state["statistics"]["counts"][:0]),
    ),
    "a field of another dtype": (
        "sums['norm']",
        lambda state: state["statistics"]["sums"].update(norm=state["statistics"]["sums"]["norm"].float()),
    ),
    "statistics that are not a dict": ("the statistics", lambda state: state.update(statistics=[1, 2])),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_checkpoint_edited_and_sealed_again_is_refused(tmp_path, edit):
    """Contents that no run can produce, under a valid seal and identity: refused, naming the field
    (they used to resume: reached beyond the end returned the stored numbers as the statistics of
    every path; doubled counts halved every mean)."""
    from pathkernels.core._files import write_sealed

    attn = random_attention(1, 3, 2, 4, 4, dtype=torch.float64)
    tree = pk.PathTree.complete(3, 2, skip=True)
    intact = pk.path_statistics(attn, tree, checkpoint=tmp_path, top_k=2)
    path = tmp_path / "rank0-of-1.pt"
    state = read_sealed(path, "test", "the checkpoint", "")
    field, change = EDITS[edit]
    change(state)
    write_sealed(path, state)
    pattern = rf"^pathkernels\.path_statistics: the checkpoint .*rank0-of-1\.pt is not consistent: {re.escape(field)} "
    with pytest.raises(ValueError, match=pattern + r".*Delete it, or pass another checkpoint folder"):
        pk.path_statistics(attn, tree, checkpoint=tmp_path, top_k=2)
    path.unlink()  # a fresh run is then accepted and gives the intact statistics
    again = pk.path_statistics(attn, tree, checkpoint=tmp_path, top_k=2)
    assert torch.equal(again.counts, intact.counts) and torch.equal(again.maxima["ratio"], intact.maxima["ratio"])


def test_a_partial_checkpoint_is_checked_against_its_leaves(tmp_path):
    """A checkpoint written part-way (reached inside the tree): its counts must be those of the
    leaves it reached, per length; an intact one resumes to the uninterrupted statistics."""
    from pathkernels.core._files import write_sealed

    attn = random_attention(2, 4, 2, 4, 4, dtype=torch.float64)
    tree = pk.PathTree.complete(4, 2, skip=True)
    whole = pk.path_statistics(attn, tree, top_k=3, memory_budget=1 << 14)
    path = tmp_path / "rank0-of-1.pt"
    pk.path_statistics(attn, tree, top_k=3, memory_budget=1 << 14, checkpoint=tmp_path)
    state = read_sealed(path, "test", "", "")
    # Statistics of the first 27 leaves (an aligned block of 3^3): what a run stopped there saved.
    part = PathStatistics.empty(2, tree, torch.float64, 10, 3, "cpu")
    result = pk.path_residuals(attn, tree)
    part.add(result.residual[:, :27], result.norm[:, :27], tree.leaf_lengths(0, 27), lambda k: tree.leaf_paths(k))
    state.update(reached=27, statistics=part.state())
    write_sealed(path, state)
    resumed = pk.path_statistics(attn, tree, top_k=3, memory_budget=1 << 14, checkpoint=tmp_path)
    assert torch.equal(resumed.counts, whole.counts) and torch.equal(
        resumed.histograms["ratio"], whole.histograms["ratio"]
    )
    assert torch.equal(resumed.top_paths, whole.top_paths)
    torch.testing.assert_close(resumed.sums["ratio"], whole.sums["ratio"], rtol=1e-14, atol=0)
    state.update(reached=28)  # one leaf further than its statistics
    write_sealed(path, state)
    with pytest.raises(ValueError, match=r"not consistent: counts hold 27 paths per batch element, but leaves 0 to 28"):
        pk.path_statistics(attn, tree, top_k=3, memory_budget=1 << 14, checkpoint=tmp_path)
    state.update(reached=27)
    state["statistics"]["counts"][:, 1] += 1  # 27 paths, but not those of leaves 0..26 by length
    state["statistics"]["counts"][:, 2] -= 1
    write_sealed(path, state)
    with pytest.raises(ValueError, match=r"not consistent: counts are not those of leaves 0 to 27 by length"):
        pk.path_statistics(attn, tree, top_k=3, memory_budget=1 << 14, checkpoint=tmp_path)


def _statistics_of_leaves(attn, tree, first, stop):
    """The statistics a run streams over leaves ``first..stop-1`` (top 3), folded in one chunk."""
    stats = PathStatistics.empty(attn.shape[0], tree, torch.float64, 10, 3, "cpu")
    result = pk.path_residuals(attn, tree)
    leaves = slice(first, stop)
    paths_of = lambda k: tree.leaf_paths(k + first)  # noqa: E731
    stats.add(result.residual[:, leaves], result.norm[:, leaves], tree.leaf_lengths(first, stop), paths_of)
    return stats.state()


def test_a_later_ranks_checkpoint_is_checked_against_its_own_leaves():
    """A rank whose leaves start at 27: its counts are those of leaves 27.. it reached, not 0.."""
    from pathkernels.core.statistics import checked_state

    attn = random_attention(1, 4, 2, 4, 4, dtype=torch.float64)
    tree = pk.PathTree.complete(4, 2, skip=True)
    state = _statistics_of_leaves(attn, tree, 27, 54)
    assert checked_state(state, "t", "it", "", leaves=(27, 54), tree=tree) is state
    with pytest.raises(ValueError, match=r"^t: it is not consistent: counts hold 27 paths .* leaves 27 to 81 are 54"):
        checked_state(state, "t", "it", "", leaves=(27, 81), tree=tree)
    with pytest.raises(ValueError, match=r"counts are not those of leaves 0 to 27 by length"):
        checked_state(state, "t", "it", "", leaves=(0, 27), tree=tree)


def test_counts_of_more_leaves_than_are_listed_are_bounded_by_the_tree():
    """Beyond 2^20 leaves the counts are not recounted by length but bounded by the tree's: a whole
    tree of 2^21 leaves reaches its bound exactly, one count more exceeds it."""
    from pathkernels.core.statistics import checked_state, histogram_edges

    layers = 21
    tree = pk.PathTree.complete(layers, 1, skip=True)
    counts = torch.tensor([pk.count_by_length(layers, 1, skip=True)], dtype=torch.long)  # every leaf, by length
    state = PathStatistics.empty(1, tree, torch.float64, 10, 0, "cpu").state()
    value, bin_of_value = (
        0.5,
        int(torch.bucketize(torch.tensor(0.5, dtype=torch.float64), histogram_edges(10), right=True)),
    )
    state["counts"] = counts
    state["log10_ratio_sums"] = counts.double() * math.log10(value)
    for measure in ("ratio", "residual", "norm"):
        state["sums"][measure] = counts.double() * value
        state["sums_of_squares"][measure] = counts.double() * value * value
        state["minima"][measure] = torch.full((1, layers + 1), value, dtype=torch.float64)
        state["maxima"][measure] = torch.full((1, layers + 1), value, dtype=torch.float64)
        for extreme in ("argmin", "argmax"):  # the path of k heads on the first k layers
            state[extreme][measure] = torch.tensor(
                [[[0] * k + [-1] * (layers - k) for k in range(layers + 1)]], dtype=torch.long
            )
    for measure in ("ratio", "residual"):
        state["histograms"][measure].zero_()
        state["histograms"][measure][0, :, bin_of_value] = counts[0]
    assert checked_state(state, "t", "it", "", leaves=(0, 1 << layers), tree=tree) is state
    state["counts"] = counts.clone()
    state["counts"][0, 3] += 1  # 2^21 + 1 paths, and one of length 3 more than the tree has
    with pytest.raises(ValueError, match=r"counts hold 2,097,153 paths per batch element"):
        checked_state(state, "t", "it", "", leaves=(0, 1 << layers), tree=tree)
    with pytest.raises(ValueError, match=r"counts exceed the tree's paths of that length at index \[3\]"):
        checked_state(state, "t", "it", "", leaves=(0, (1 << layers) + 1), tree=tree)


def test_exact_zeros_resume(tmp_path):
    """A head of uniform attention makes every path through it rank 1: residual and ratio exactly
    0, a minimum of 0 that the checks accept (and the histograms' bin 0 holds)."""
    attn = random_attention(1, 3, 2, 4, 4, dtype=torch.float64)
    attn[:, 1, 0] = 0.25
    tree = pk.PathTree.complete(3, 2, skip=True)
    first = pk.path_statistics(attn, tree, top_k=2, checkpoint=tmp_path)
    assert float(first.minima["ratio"].min()) == 0.0 and int(first.histograms["ratio"][..., 0].sum()) > 0
    again = pk.path_statistics(attn, tree, top_k=2, checkpoint=tmp_path)  # read back from the checkpoint
    assert torch.equal(again.minima["ratio"], first.minima["ratio"])


def test_saved_statistics_edited_and_sealed_again_are_refused(tmp_path):
    from pathkernels.core._files import write_sealed

    attn = random_attention(1, 3, 2, 4, 4, dtype=torch.float64)
    saved = tmp_path / "stats.pt"
    pk.path_statistics(attn, pk.PathTree.complete(3, 2, skip=True), top_k=2).save(saved)
    state = read_sealed(saved, "test", "", "")
    state["histograms"]["residual"][0, 1, 3] += 5
    write_sealed(saved, state)
    with pytest.raises(
        ValueError,
        match=r"^pathkernels\.PathStatistics\.load: the file .*stats\.pt is not consistent: histograms\['residual'\] "
        r"does not sum to the number of paths .*Save the statistics again\.$",
    ):
        PathStatistics.load(saved)


def test_decompose_streams_when_per_path_results_would_be_too_large():
    pytest.importorskip("pandas")  # the by_length() and to_frame() tables
    attn = random_attention(2, 4, 3, 5, 5, dtype=torch.float64)
    kept = pk.decompose(attn)  # 256 paths × 2 × 2 float64: 8 KiB
    streamed = pk.decompose(attn, max_result_bytes=4096)
    assert isinstance(kept, pk.PathDecomposition) and isinstance(streamed, PathStatistics)
    exact_table, table = kept.by_length(), streamed.by_length()
    assert set(exact_table.columns) <= set(table.columns)  # the same table, and more
    assert bool(table["from_histogram"].all())
    for column in ("length", "path_count", "evaluated", "exact", "stderr"):
        assert table[column].tolist() == exact_table[column].tolist(), column
    torch.testing.assert_close(torch.tensor(table["mean"].tolist()), torch.tensor(exact_table["mean"].tolist()))
    assert streamed.mean_ratio()[0] == pytest.approx(kept.mean_ratio()[0], rel=1e-12)


def assert_rows_equal(stats: PathStatistics, b: int, alone: PathStatistics):
    """Row b of ``stats`` holds the statistics ``alone`` has for its only batch element."""
    for name in ("counts", "log10_ratio_sums", "top_values", "top_paths"):
        torch.testing.assert_close(getattr(stats, name)[b], getattr(alone, name)[0], rtol=1e-12, atol=0, msg=name)
    for name in ("sums", "sums_of_squares", "minima", "maxima", "argmin", "argmax", "histograms"):
        for key, tensor in getattr(stats, name).items():
            torch.testing.assert_close(tensor[b], getattr(alone, name)[key][0], rtol=1e-12, atol=0, msg=name)


def test_statistics_of_a_padded_batch_are_those_of_each_sequence_alone(tmp_path):
    """token_mask (or a stack's): each element on its real tokens, one stream per group of equal
    masks, checkpointed per group; decompose streams padded batches too."""
    layers, heads = 3, 2
    lengths = [5, 2, 2]  # elements 1 and 2 share a mask
    attn, x, w_v, w_o, mask = padded_network(lengths, layers, heads, n=5, d=3)
    tree = pk.PathTree.complete(layers, heads, skip=True)
    outputs = {"x": x, "w_v": w_v, "w_o": w_o}
    stats = pk.path_statistics(attn, tree, **outputs, token_mask=mask, top_k=3, checkpoint=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mask-group-0", "mask-group-1"]
    for b, length in enumerate(lengths):
        alone = pk.path_statistics(
            attn[b : b + 1, ..., :length, :length], tree, x=x[b : b + 1, :length], w_v=w_v, w_o=w_o, top_k=3
        )
        assert_rows_equal(stats, b, alone)
    with pytest.raises(ValueError, match="attention rows must sum to 1"):  # the padding's junk, unmasked
        pk.path_statistics(attn, tree, **outputs)
    resumed = pk.path_statistics(attn, tree, **outputs, token_mask=mask, top_k=3, checkpoint=tmp_path)
    assert torch.equal(resumed.sums["ratio"], stats.sums["ratio"])  # read back from the group files
    streamed = pk.decompose(attn, max_result_bytes=1024, token_mask=mask)
    assert isinstance(streamed, PathStatistics) and torch.equal(streamed.counts, stats.counts)
    torch.testing.assert_close(
        streamed.maxima["ratio"], pk.path_statistics(attn, tree, token_mask=mask).maxima["ratio"]
    )


def test_the_cpu_fold_equals_the_torch_fold():
    """The C++ fold (_statistics_update) against the torch ops the other devices use, bit for bit
    (the log10 sums too: both take ATen's log10 of the chunk's ratios): chunk after chunk, with
    ties, values beyond both histogram ends. (A chunk with a zero path goes to the torch fold on
    the CPU too: test_a_zero_path_leaves_the_ratio_statistics_alone.)"""
    tree = pk.PathTree.complete(4, 3, skip=True)
    paths = tree.paths()
    ops_fold = PathStatistics.empty(2, tree, torch.float32, 7, 3, "cpu")
    torch_fold = PathStatistics.empty(2, tree, torch.float32, 7, 3, "cpu")
    for start in range(0, paths.shape[0], 37):
        chunk = paths[start : start + 37]
        residual = torch.rand(2, chunk.shape[0], dtype=torch.float64) ** 12
        norm = torch.rand(2, chunk.shape[0], dtype=torch.float64) + 0.5
        residual[0, 0] = 0.0  # a zero residual
        residual[1, 1], norm[1, 1] = 40.0, 2.0  # a ratio of 20, beyond the last edge
        residual[1, -1], norm[1, -1] = 1e-45, 1e3  # below float32's range; ratio below the edges
        if chunk.shape[0] > 6:
            residual[0, 4:6], norm[0, 4:6] = 0.25, 0.125  # a tie; ratio 2, residual 0.25
        ops_fold.add(residual, norm, (chunk != -1).sum(1), lambda leaves, chunk=chunk: chunk[leaves])
        torch_fold._add_torch(residual, norm, chunk)
    for item in ("counts", "zero_norms", "log10_ratio_sums", "top_values", "top_paths"):
        torch.testing.assert_close(getattr(ops_fold, item), getattr(torch_fold, item), rtol=0, atol=0, equal_nan=True)
    for item in ("sums", "sums_of_squares", "minima", "maxima", "argmin", "argmax", "histograms"):
        for key, value in getattr(ops_fold, item).items():
            expected = getattr(torch_fold, item)[key]
            torch.testing.assert_close(value, expected, rtol=0, atol=0, equal_nan=True, msg=f"{item}[{key}]")
    assert int(ops_fold.histograms["ratio"][..., 0].sum()) > 0 and int(ops_fold.histograms["ratio"][..., -1].sum()) > 0


@pytest.mark.parametrize(
    "tree",
    [
        pk.PathTree.complete(5, 2, skip=True),
        pk.PathTree.complete(4, 3),
        pk.PathTree.complete(4, 2, skip=True, max_length=2),
    ],
    ids=["skip", "no-skip", "max_length"],
)
def test_leaf_lengths_and_paths_of_blocks(tree):
    """The streamed chunks' lengths (aligned blocks from a cached pattern, other ranges directly)
    and paths of chosen leaves equal those of the enumerated tree."""
    leaves = tree.leaf_range(0, tree.num_leaves)
    lengths = (leaves != -1).sum(1)
    choices = tree.num_heads + int(tree.skip)
    for start, stop in [
        (0, tree.num_leaves),
        (choices**2, 2 * choices**2),
        (3, 11),
        (tree.num_leaves - 1, tree.num_leaves),
    ]:
        stop = min(stop, tree.num_leaves)
        assert torch.equal(tree.leaf_lengths(start, stop), lengths[start:stop]), (start, stop)
    picked = torch.tensor([0, 5, tree.num_leaves - 1])
    assert torch.equal(tree.leaf_paths(picked), leaves[picked])


def pruned_network(batch=2):
    """A float64 network whose head 0 of layer 1 is pruned (W_O = 0): every path through it is a
    zero path (norm 0, no ratio); batch element 1 (if any) has x = 0, so all of its paths are."""
    generator = torch.Generator().manual_seed(3)
    attn = random_attention(batch, 4, 3, 5, 5, dtype=torch.float64, generator=generator, temperature=0.5)
    x = torch.randn(batch, 5, 4, dtype=torch.float64, generator=generator)
    w_v = torch.randn(4, 3, 4, 2, dtype=torch.float64, generator=generator)
    w_o = torch.randn(4, 3, 2, 4, dtype=torch.float64, generator=generator)
    w_o[1, 0] = 0
    if batch > 1:
        x[1] = 0
    return attn, {"x": x, "w_v": w_v, "w_o": w_o}


@pytest.mark.parametrize("zero_paths", [False, True], ids=["no-zero-paths", "zero-paths"])
def test_by_length_equals_a_direct_computation_from_every_path(zero_paths):
    """Every column of the streamed table against the enumerated ratios of its (batch element,
    path) pairs: count, zeros, zero paths (left out), mean, std (n − 1), min, max, log10_mean and
    the histogram's quantiles (within a bin of the order statistics). Pooled and per element; with
    zero paths (a pruned head; an element whose x is 0, all of whose paths are zero paths) no
    column turns NaN (0/0 made mean, median and std NaN; std is 0 for a single pair)."""
    pytest.importorskip("pandas")
    if zero_paths:
        attn, outputs = pruned_network()
    else:
        attn, outputs = random_attention(2, 4, 3, 5, 5, dtype=torch.float64, temperature=0.5), {}
    tree = pk.PathTree.complete(4, 3, skip=True)
    stats = pk.path_statistics(attn, tree, bins_per_decade=40, **outputs)
    result = pk.path_residuals(attn, tree, **outputs)
    lengths = tree.lengths()
    bin_factor = 10 ** (1 / 40)
    for element in (None, 0, 1):
        table = stats.by_length(element)
        pick = slice(None) if element is None else slice(element, element + 1)
        assert table["length"].tolist() == [0, 1, 2, 3, 4]
        for _, row in table.iterrows():
            chosen = lengths == row["length"]
            ratio, norm = result.ratio[pick][:, chosen].flatten(), result.norm[pick][:, chosen].flatten()
            values = ratio[norm != 0].sort().values  # the pairs with a ratio
            assert row["path_count"] == int(chosen.sum())
            assert row["zero_norm"] == int((norm == 0).sum()) and row["zeros"] == int((values == 0).sum())
            numbers = ["mean", "std", "min", "max", "median", "q05", "q10", "q25", "q75", "q90", "q95"]
            if values.numel() == 0:  # every pair a zero path: 0, not NaN
                assert [row[column] for column in numbers] == [0.0] * len(numbers), row
                continue
            assert row["mean"] == pytest.approx(values.mean().item(), rel=1e-12)
            spread = values.std(correction=1).item() if values.numel() > 1 else 0.0  # one pair: no spread
            assert row["std"] == pytest.approx(spread, rel=1e-9)
            assert row["min"] == values[0].item() and row["max"] == values[-1].item()
            positive = values[values > 0]
            if positive.numel():
                assert row["log10_mean"] == pytest.approx(positive.log10().mean().item(), rel=1e-12)
            count = values.numel()
            for column in numbers[4:]:
                level = 0.5 if column == "median" else int(column[1:]) / 100
                low = values[max(0, math.floor(level * count) - 1)].item() / bin_factor
                high = values[min(count - 1, math.ceil(level * count))].item() * bin_factor
                assert low <= row[column] <= high, (element, row["length"], column)
            assert not any(math.isnan(row[column]) for column in numbers), row
    if zero_paths:
        assert int(stats.zero_norms.sum()) > 0 and not bool(stats.mean().isnan().any())
        measured = result.norm != 0
        assert stats.mean_ratio()[0] == pytest.approx(result.ratio[measured].mean().item(), rel=1e-12)


def test_a_zero_path_leaves_the_ratio_statistics_alone():
    """A chunk with zero paths (norm 0) on the CPU goes to the torch fold, which counts them in
    zero_norms and leaves them out of every ratio statistic (the C++ fold added 0/0 = NaN to the
    sums), while the residual's and the norm's statistics count them. The fold equals that of the
    same chunk whose zero paths are replaced by paths no ratio statistic sees the difference of."""
    tree = pk.PathTree.complete(3, 2, skip=True)
    paths = tree.paths()
    lengths = (paths != -1).sum(1)
    residual = torch.rand(2, paths.shape[0], dtype=torch.float64)
    norm = residual + torch.rand(2, paths.shape[0], dtype=torch.float64)
    zero = torch.zeros_like(norm, dtype=torch.bool)
    zero[0, ::3], zero[1, 5] = True, True
    residual, norm = residual.masked_fill(zero, 0.0), norm.masked_fill(zero, 0.0)
    stats = PathStatistics.empty(2, tree, torch.float64, 10, 2, "cpu")
    stats.add(residual, norm, lengths, lambda leaves: paths[leaves])
    for b in range(2):
        for k in range(4):
            mine = lengths == k
            kept = mine & ~zero[b]
            ratio = residual[b, kept] / norm[b, kept]
            assert int(stats.counts[b, k]) == int(mine.sum()) and int(stats.zero_norms[b, k]) == int(
                (mine & zero[b]).sum()
            )
            assert int(stats.histograms["ratio"][b, k].sum()) == int(kept.sum())
            assert int(stats.histograms["residual"][b, k].sum()) == int(mine.sum())
            torch.testing.assert_close(stats.sums["ratio"][b, k], ratio.sum(), rtol=1e-14, atol=0)
            torch.testing.assert_close(stats.sums["norm"][b, k], norm[b, mine].sum(), rtol=1e-14, atol=0)
            assert float(stats.minima["ratio"][b, k]) == (ratio.min().item() if ratio.numel() else math.inf)
            assert float(stats.minima["norm"][b, k]) == norm[b, mine].min().item()  # 0 where a zero path is
            tops = [value for value, _ in stats.top(2, length=k, batch_element=b)]
            assert tops == ratio.sort(descending=True).values[:2].tolist()
    assert not bool(stats.mean("ratio").isnan().any()) and not bool(stats.std("ratio")[:, 1:].isnan().any())
    merged = stats.merge(stats)
    assert torch.equal(merged.zero_norms, 2 * stats.zero_norms)


def test_histogram_quantiles_by_hand():
    """Edges 1, 10, 100: bins below 1 (exact zeros), [1, 10), [10, 100) and from 100 up. Two counts
    in each middle bin: the quartiles log-interpolated within their bins (10^0.5, 10, 10^1.5); a
    quantile in bin 0 is 0, in the overflow bin inf, and with no counts NaN."""
    from pathkernels.core.statistics import histogram_quantiles

    edges = torch.tensor([1.0, 10.0, 100.0], dtype=torch.float64)
    histograms = torch.tensor([[0, 2, 2, 0], [0, 0, 0, 3], [2, 0, 0, 0], [0, 0, 0, 0]])
    got = histogram_quantiles(histograms, edges, q=(0.25, 0.5, 0.75))
    want = torch.tensor([[10**0.5, 10.0, 10**1.5], [math.inf] * 3, [0.0] * 3, [math.nan] * 3], dtype=torch.float64)
    torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-12, atol=0)


def test_std_of_a_length_with_one_path_is_zero():
    """The documented 0 where a length has a single path (length 0 of a tree with the skip: the
    path through no head), not 0/0; and n − 1 in the denominator elsewhere."""
    attn = random_attention(1, 2, 2, 5, 5, dtype=torch.float64)
    stats = pk.path_statistics(attn, pk.PathTree.complete(2, 2, skip=True))
    assert stats.counts[0, 0].item() == 1
    assert stats.std("ratio")[0, 0].item() == 0.0
    ratios = pk.path_residuals(attn, pk.PathTree.complete(2, 2, skip=True)).ratio[0]
    lengths = pk.PathTree.complete(2, 2, skip=True).lengths()
    for k in (1, 2):
        want = ratios[lengths == k].std(correction=1).item()
        assert stats.std("ratio")[0, k].item() == pytest.approx(want, rel=1e-9)


def test_saved_counts_that_differ_between_batch_elements_are_refused(tmp_path):
    """Every batch element sees every path: counts that differ between elements are refused by name
    (checked against the first element, whatever the batch)."""
    from pathkernels.core._files import write_sealed

    attn = random_attention(2, 3, 2, 4, 4, dtype=torch.float64)
    saved = tmp_path / "stats.pt"
    pk.path_statistics(attn, pk.PathTree.complete(3, 2, skip=True)).save(saved)
    state = read_sealed(saved, "test", "", "")
    state["counts"][1, 2] += 1
    write_sealed(saved, state)
    with pytest.raises(ValueError, match=r"counts differ between batch elements \(each sees every path\) at index"):
        PathStatistics.load(saved)


def test_std_of_equal_values_is_zero_not_nan():
    """Σx² − (Σx)²/n of equal values can round below 0: the variance is clamped at 0, so the std of
    a length whose paths all have one ratio is 0, never NaN."""
    attn = random_attention(1, 2, 2, 5, 5, dtype=torch.float64)
    stats = pk.path_statistics(attn, pk.PathTree.complete(2, 2, skip=True))
    n = int(stats.measured("ratio")[0, 2])
    stats.sums["ratio"][0, 2] = n * 0.1
    stats.sums_of_squares["ratio"][0, 2] = (n * 0.1) ** 2 / n * (1 - 4 * torch.finfo(torch.float64).eps)
    assert stats.std("ratio")[0, 2].item() == 0.0


def _swap_extreme_paths(statistics):
    """argmin['ratio'] and argmax['ratio'] of batch element 0, length 1, exchanged: both still paths
    of one head, each where the other's value was recorded."""
    low, high = statistics["argmin"]["ratio"], statistics["argmax"]["ratio"]
    low[0, 1], high[0, 1] = high[0, 1].clone(), low[0, 1].clone()


# Edits that keep the statistics consistent with themselves (checked_state accepts them, as the test
# asserts): only the engine's values at the recorded paths tell them apart.
CONSISTENT_EDITS = {
    "minima × 0.99": lambda statistics, other: [value.mul_(0.99) for value in statistics["minima"].values()],
    "maxima and top × 1.01": lambda statistics, other: [
        value.mul_(1.01) for value in [*statistics["maxima"].values(), statistics["top_values"]]
    ],
    "an argmin swapped": lambda statistics, other: _swap_extreme_paths(statistics),
    "another input's statistics": lambda statistics, other: statistics.update(other.state()),
}


def _two_inputs():
    attn = random_attention(2, 3, 2, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    other = random_attention(2, 3, 2, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return attn, other, pk.PathTree.complete(3, 2, skip=True)


@pytest.mark.parametrize("edit", sorted(CONSISTENT_EDITS))
def test_a_resumed_checkpoint_is_checked_against_the_engine(tmp_path, edit):
    """Checkpoints edited consistently (minima × 0.99, maxima and top × 1.01, an argmin swapped,
    another input's statistics under this input's identity) resumed into wrong statistics: the
    paths recorded as extremes and top are now evaluated again and compared, by name."""
    from pathkernels.core._files import write_sealed
    from pathkernels.core.statistics import checked_state

    attn, other_attn, tree = _two_inputs()
    intact = pk.path_statistics(attn, tree, top_k=2, checkpoint=tmp_path)
    path = tmp_path / "rank0-of-1.pt"
    state = read_sealed(path, "test", "", "")
    CONSISTENT_EDITS[edit](state["statistics"], pk.path_statistics(other_attn, tree, top_k=2))
    checked_state(state["statistics"], "t", "it", "", leaves=(0, 27), tree=tree)  # consistent in itself
    write_sealed(path, state)
    with pytest.raises(
        ValueError,
        match=r"^pathkernels\.path_statistics: the checkpoint .*rank0-of-1\.pt is not consistent with its inputs: "
        r"(argmin|argmax)\['(ratio|residual|norm)'\] at index \[\d, \d\] is .*, but the engine gives .* at its path "
        r"\[.*\] \(a difference beyond the engine's precision, 1e-09 relative\)\. Delete it, or pass another",
    ):
        pk.path_statistics(attn, tree, top_k=2, checkpoint=tmp_path)
    path.unlink()
    again = pk.path_statistics(attn, tree, top_k=2, checkpoint=tmp_path)
    assert torch.equal(again.minima["ratio"], intact.minima["ratio"])
    assert torch.equal(pk.path_statistics(attn, tree, top_k=2, checkpoint=tmp_path).top_values, intact.top_values)


@pytest.mark.parametrize("edit", sorted(CONSISTENT_EDITS))
def test_loaded_statistics_are_checked_against_their_inputs_when_given(tmp_path, edit):
    """PathStatistics.load(path, attn, …) and stats.verify(attn, …) evaluate the recorded paths
    again; load(path) alone checks the file's own consistency only (it holds no inputs)."""
    from pathkernels.core._files import write_sealed

    attn, other_attn, tree = _two_inputs()
    x = torch.randn(2, 4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    w = torch.randn(3, 2, 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for outputs in ({}, {"x": x, "w_v": w, "w_o": w}):
        stats = pk.path_statistics(attn, tree, top_k=2, **outputs)
        saved = tmp_path / "stats.pt"
        stats.save(saved)
        assert PathStatistics.load(saved, attn, **outputs).verify(attn, **outputs) is not None
        state = read_sealed(saved, "test", "", "")
        CONSISTENT_EDITS[edit](state, pk.path_statistics(other_attn, tree, top_k=2, **outputs))
        write_sealed(saved, state)
        edited = PathStatistics.load(saved)  # consistent in itself: nothing to compare it with
        message = r"(argmin|argmax)\['(ratio|residual|norm)'\] at index \[\d, \d\] is .*, but the engine gives"
        with pytest.raises(
            ValueError,
            match=r"^pathkernels\.PathStatistics\.load: the file .*stats\.pt does not hold "
            r"the statistics of these inputs: " + message,
        ):
            PathStatistics.load(saved, attn, **outputs)
        with pytest.raises(
            ValueError,
            match=r"^pathkernels\.PathStatistics\.verify: the statistics are not those of "
            r"these inputs: " + message + r".*compute them again with pk\.path_statistics",
        ):
            edited.verify(attn, **outputs)
    with pytest.raises(
        ValueError,
        match=r"^pathkernels\.PathStatistics\.verify: the statistics are not those of these "
        r"inputs: the statistics are of 2 batch elements, but the inputs have 1",
    ):
        stats.verify(attn[:1])
    with pytest.raises(ValueError, match=r"^pathkernels\.PathStatistics\.load: x is checked .* pass attn too"):
        PathStatistics.load(saved, x=x)


def test_float32_statistics_verify_within_float32_precision():
    attn = random_attention(2, 3, 2, 5, 5, dtype=torch.float32, generator=torch.Generator().manual_seed(4))
    tree = pk.PathTree.complete(3, 2, skip=True)
    stats = pk.path_statistics(attn, tree, top_k=3)
    assert stats.verify(attn) is stats
    stats.maxima["norm"] *= 1.001
    with pytest.raises(ValueError, match=r"^pathkernels\.PathStatistics\.verify: .* argmax\['norm'\] .* 0\.0001 "):
        stats.verify(attn)


def test_checkpoint_folders_that_cannot_be_used_are_refused_before_any_work(tmp_path, monkeypatch):
    """checkpoint="" wrote into the working directory; a file, a path under a file and a folder
    that cannot be written raised FileExistsError or NotADirectoryError, or failed at the first
    save after the work of a checkpoint interval."""
    attn, _, tree = _two_inputs()
    monkeypatch.chdir(tmp_path)
    existing = tmp_path / "file.pt"
    existing.write_bytes(b"x")
    cases = [
        ("", r"expected checkpoint to be a folder's path, got '' \(an empty path would write into the working"),
        ("  ", r"expected checkpoint to be a folder's path, got '  '"),
        (existing, r"expected checkpoint to be a folder, got '.*file\.pt', an existing file"),
        (existing / "sub", r"cannot write checkpoints to the folder checkpoint='.*file\.pt/sub': Not a directory"),
        ("/proc/pathkernels-checkpoint", r"cannot write checkpoints to the folder checkpoint='/proc/pathkernels-"),
    ]
    for checkpoint, message in cases:
        with pytest.raises(ValueError, match=r"^pathkernels\.path_statistics: " + message):
            pk.path_statistics(attn, tree, checkpoint=checkpoint)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.pt"]  # nothing written anywhere


def test_four_threads_sharing_a_checkpoint_folder_complete_or_are_refused(tmp_path):
    """Four threads sharing one folder crashed three of themselves with raw tracebacks (one's
    rename took another's partial file). One run holds the folder's lock at a time: each thread
    completes with the uninterrupted statistics or is refused by name, and the lock goes with it."""
    import threading

    attn = random_attention(2, 6, 3, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    tree = pk.PathTree.complete(6, 3, skip=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the small budget's warning: many chunks, many saves
        whole = pk.path_statistics(attn, tree, top_k=2, memory_budget=1 << 16)
    outcomes = []
    start = threading.Barrier(4)

    def run():
        start.wait()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                stats = pk.path_statistics(
                    attn, tree, top_k=2, memory_budget=1 << 16, checkpoint=tmp_path, checkpoint_every=0
                )
            outcomes.append(("completed", stats))
        except BaseException as error:  # noqa: BLE001 (what the test is for)
            outcomes.append(("refused", error))

    threads = [threading.Thread(target=run) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert len(outcomes) == 4
    completed = [value for kind, value in outcomes if kind == "completed"]
    assert completed, [str(value) for _, value in outcomes]
    for stats in completed:
        assert torch.equal(stats.counts, whole.counts) and torch.equal(stats.top_paths, whole.top_paths)
        torch.testing.assert_close(stats.sums["ratio"], whole.sums["ratio"], rtol=1e-14, atol=0)
    for kind, error in outcomes:
        if kind == "refused":
            assert isinstance(error, ValueError), repr(error)
            assert re.match(
                r"^pathkernels\.path_statistics: the checkpoint .*rank0-of-1\.pt is in use by another run in this "
                r"process \(another thread\): two runs cannot write one checkpoint",
                str(error),
            ), str(error)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0-of-1.pt"]  # no lock, no partial file left


def test_a_stale_lock_is_taken_over_and_a_live_one_refused(tmp_path):
    """A lock whose process has ended (killed mid-run), or that this process left behind, is taken
    over; a live process's lock is refused, naming it and the lock file to delete."""
    import os
    import socket

    attn, _, tree = _two_inputs()
    lock = tmp_path / "rank0-of-1.pt.lock"
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    host = socket.gethostname()
    for pid in (ended.pid, os.getpid()):
        lock.write_text(f"{pid} {host} stale-token\n")
        assert pk.path_statistics(attn, tree, checkpoint=tmp_path) is not None
        assert not lock.exists()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for holder in (f"{alive.pid} {host} token", f"1 {host}-elsewhere token", ""):
            lock.write_text(holder)
            with pytest.raises(
                ValueError,
                match=r"^pathkernels\.path_statistics: the checkpoint .*rank0-of-1\.pt is in use by (the run of "
                r"process \d+ on \S+|another run): .*if no run uses it, delete .*rank0-of-1\.pt\.lock",
            ):
                pk.path_statistics(attn, tree, checkpoint=tmp_path)
            assert lock.read_text() == holder  # left to its holder
    finally:
        alive.kill()
        alive.wait()


def test_statistics_methods_refuse_what_they_cannot_read():
    """quantiles(q=[1.5]) gave inf, measured("bogus") returned the counts, mean("bogus") raised a
    KeyError, by_length(5) "amin(): Expected reduction dim 0 to have non-zero size", and merge
    added the statistics of a tree without skip to those of a tree with."""
    attn, _, tree = _two_inputs()
    stats = pk.path_statistics(attn, tree, top_k=2)
    for q, error, message in (
        ([1.5], ValueError, r"expected q to hold levels in \[0, 1\], got 1\.5"),
        ([-0.1], ValueError, r"expected q to hold levels in \[0, 1\], got -0\.1"),
        ([math.nan], ValueError, r"expected q to hold levels in \[0, 1\], got nan"),
        ("0.5", TypeError, r"expected q to be a level in \[0, 1\] or a sequence of them, got str '0\.5'"),
        ([None], TypeError, r"expected q to hold real levels in \[0, 1\], got NoneType None"),
    ):
        with pytest.raises(error, match=r"^pathkernels\.PathStatistics\.quantiles: " + message):
            stats.quantiles(q=q)
    assert torch.equal(stats.quantiles(q=0.5)[0], stats.quantiles(q=[0.5])[0])
    for method in ("measured", "mean", "std"):
        with pytest.raises(ValueError, match=rf"^pathkernels\.PathStatistics\.{method}: expected measure to be one of"):
            getattr(stats, method)("bogus")
        with pytest.raises(TypeError, match=rf"^pathkernels\.PathStatistics\.{method}: expected measure to be one of"):
            getattr(stats, method)(None)
    with pytest.raises(ValueError, match=r"^pathkernels\.PathStatistics\.quantiles: expected measure to be one of"):
        stats.quantiles("norm")  # no histogram of the norm
    bare = pk.path_statistics(attn, pk.PathTree.complete(3, 2), top_k=2)
    with pytest.raises(ValueError, match=r"^pathkernels\.PathStatistics\.merge: skip differs \(True and False\)"):
        stats.merge(bare)
    for value, error, message in (
        (5, ValueError, r"expected batch_element in \[0, 1\], got 5"),
        (-1, ValueError, r"expected batch_element in \[0, 1\], got -1"),
        (1.0, TypeError, r"expected batch_element to be an int, got float 1\.0"),
    ):
        for method in ("by_length", "plot"):
            with pytest.raises(error, match=rf"^pathkernels\.PathStatistics\.{method}: " + message):
                getattr(stats, method)(batch_element=value)
    with pytest.raises(ValueError, match=r"^pathkernels\.PathStatistics\.to: expected device .* got str 'bogus'"):
        stats.to("bogus")


def test_saving_to_a_path_that_cannot_be_written_is_refused(tmp_path):
    """save("") raised "PosixPath('.') has an empty name", save(folder) IsADirectoryError, and a
    missing folder FileNotFoundError."""
    attn, _, tree = _two_inputs()
    stats = pk.path_statistics(attn, tree)
    for path, error, message in (
        ("", ValueError, r"expected path to be a file's path, got ''"),
        (tmp_path, ValueError, r"expected path to be a file, got '.*', an existing folder"),
        (tmp_path / "missing" / "s.pt", ValueError, r"cannot write '.*s\.pt': its folder '.*missing' does not exist"),
        ("/proc/pathkernels-stats.pt", ValueError, r"cannot write '/proc/pathkernels-stats\.pt': "),
        (3, TypeError, r"expected path to be a file's path \(a str or os\.PathLike\), got int"),
    ):
        with pytest.raises(error, match=r"^pathkernels\.PathStatistics\.save: " + message):
            stats.save(path)
    with pytest.raises(TypeError, match=r"^pathkernels\.PathStatistics\.load: expected path to be a file's path"):
        PathStatistics.load(None)
    assert list(tmp_path.iterdir()) == []


def test_a_top_k_beyond_memory_is_refused_by_name_before_any_work():
    """top_k=10**9 asked the allocator for 48 GB and failed there; the accumulators are now sized
    (top paths and histograms, twice) against the memory free, before any work."""
    import time

    attn, _, tree = _two_inputs()
    started = time.perf_counter()
    with pytest.raises(
        ValueError, match=r"^pathkernels\.path_statistics: top_k=1,000,000,000,000 \(the largest ratios"
    ):
        pk.path_statistics(attn, tree, top_k=10**12)
    assert time.perf_counter() - started < 1.0


def test_verify_takes_the_inputs_path_statistics_took():
    """A padded batch with its token_mask, a network without a batch dimension, float16 patterns
    (computed in float32): their own statistics verify, another element's do not."""
    attn, x, w_v, w_o, mask = padded_network([5, 2, 2], 3, 2, n=5, d=3)
    tree = pk.PathTree.complete(3, 2, skip=True)
    outputs = {"x": x, "w_v": w_v, "w_o": w_o, "token_mask": mask}
    stats = pk.path_statistics(attn, tree, top_k=3, **outputs)
    assert stats.verify(attn, **outputs) is stats
    swapped = {**outputs, "x": x.flip(0), "token_mask": mask.flip(0)}
    with pytest.raises(ValueError, match=r"^pathkernels\.PathStatistics\.verify: the statistics are not those of"):
        stats.verify(attn.flip(0), **swapped)
    single = random_attention(3, 2, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    assert pk.path_statistics(single, tree, top_k=2).verify(single).counts.shape == (1, 4)
    half = random_attention(1, 3, 2, 4, 4, dtype=torch.float32, generator=torch.Generator().manual_seed(7)).half()
    assert pk.path_statistics(half, tree, top_k=2).verify(half).dtype == torch.float32
