"""The Triton fold of path_statistics (pathkernels.core.triton_statistics): one chunk of leaves
into the per-length accumulators in two launches. Where there is no GPU it runs in Triton's
interpreter (tests/triton_interpreter.py). Checked against the torch fold
(PathStatistics._add_torch: counts, zero norms, extremes, their paths and histograms equal, float64
sums to a few ulp), on a hand-worked chunk, through pk.path_statistics against the default fold,
and, without a GPU, on the PTX Triton compiles for sm_80 and sm_90."""

import math

import pytest
import torch
from triton_interpreter import compiled_for_the_gpu, kernel_module, printed_without_triton

import pathkernels as pk
from pathkernels.core.statistics import _HISTOGRAMS, _MEASURES, PathStatistics, statistics_fold
from pathkernels.testing import statistics_difference

MODULE = "pathkernels.core.triton_statistics"
# The interpreter's numpy warns at the 0/0 of a zero path and the log10 the kernel discards there.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning", "ignore:invalid value:RuntimeWarning")


@pytest.fixture(scope="module")
def ts():
    return kernel_module(MODULE, "the Triton statistics kernels")


@pytest.fixture(autouse=True)
def one_config(monkeypatch):
    """On the GPU the fold launches DEFAULT_CONFIG alone (the interpreter always does)."""
    monkeypatch.setenv("PATHKERNELS_TRITON_STATISTICS_CONFIGS", "default")


@pytest.fixture
def device(ts):
    return "cpu" if ts.INTERPRETED else "cuda"


def fold(ts, stats: PathStatistics, residual, norm, lengths, paths):
    """One chunk through the op, its new extremes' paths recorded as PathStatistics.add does."""
    first = ts.triton_statistics_update(
        residual,
        norm,
        lengths,
        stats.edges.to(residual.device),
        stats.counts,
        stats.zero_norms,
        stats.log10_ratio_sums,
        *(stats._packed(name, _MEASURES) for name in ("sums", "sums_of_squares", "minima", "maxima")),
        stats._packed("histograms", _HISTOGRAMS),
    )
    assert first.shape == (2, 3, *stats.counts.shape) and first.dtype == torch.long
    stats._record_extremes(first, lambda leaves: paths[leaves.cpu()])
    return first


def assert_same(got: PathStatistics, expected: PathStatistics):
    """Integers, extremes and their paths equal; float64 sums within 1e-13 (only their order differs)."""
    difference = statistics_difference(got, expected)
    assert difference["equal"] and difference["max_relative_sums"] < 1e-13, difference


def test_statistics_difference_sees_each_kind_of_difference():
    """The comparison the tests and bench_gpu_statistics.py rely on: a bin, a path, a sum."""
    tree = pk.PathTree.complete(2, 2, skip=True)
    attn = torch.softmax(torch.randn(1, 2, 2, 4, 4, dtype=torch.float64), -1)
    a, b = pk.path_statistics(attn, tree), pk.path_statistics(attn, tree)
    assert statistics_difference(a, b) == {"equal": True, "unequal": [], "max_relative_sums": 0.0}
    b.histograms["residual"][0, 1, 3] += 1
    b.argmax["norm"][0, 2, 0] = 1 - b.argmax["norm"][0, 2, 0]
    b.sums["ratio"][0, 1] *= 1 + 1e-9
    difference = statistics_difference(a, b)
    assert difference["unequal"] == ["argmax", "histograms"] and not difference["equal"]
    assert difference["max_relative_sums"] == pytest.approx(1e-9, rel=1e-3)


def chunk_values(batch: int, count: int, generator: torch.Generator, device):
    """Residuals and norms over many decades with what the statistics must handle: exact zeros,
    zero paths (0/0), subnormals, values beyond the last edge, NaN, inf, and ties."""
    residual = torch.rand(batch, count, generator=generator, dtype=torch.float64)
    residual = residual * torch.pow(10.0, -torch.randint(0, 40, (batch, count), generator=generator)).double()
    norm = torch.rand(batch, count, generator=generator, dtype=torch.float64) + 0.5
    picks = torch.randint(0, count, (8,), generator=generator)
    residual[0, picks[0]] = 0.0  # an exact zero
    residual[-1, picks[1]], norm[-1, picks[1]] = 0.0, 0.0  # a zero path
    residual[0, picks[2]] = 5e-320  # a subnormal
    residual[-1, picks[3]] = 12.0  # beyond the last edge (10)
    residual[0, picks[4]] = math.nan
    residual[-1, picks[5]] = math.inf
    residual[0, picks[6]], norm[0, picks[6]] = residual[0, picks[7]], norm[0, picks[7]]  # a tie
    return residual.to(device), norm.to(device)


@pytest.mark.parametrize(
    "layers, heads, skip, batch, chunks",
    [(1, 2, True, 1, 1), (3, 3, True, 2, 3), (4, 6, True, 1, 2), (2, 5, False, 3, 2), (5, 3, True, 2, 1)],
)
def test_the_fold_equals_the_torch_fold(ts, device, layers, heads, skip, batch, chunks):
    """Chunks of one tree folded in turn; trees of 2,401 leaves (five programs of 512 a chunk), or
    one; the first chunk sets every extreme, later ones some."""
    tree = pk.PathTree.complete(layers, heads, skip=skip)
    count = tree.num_leaves
    lengths, paths = tree.leaf_lengths(0, count), tree.leaf_paths(torch.arange(count))
    generator = torch.Generator().manual_seed(layers * 100 + heads)
    got = PathStatistics.empty(batch, tree, torch.float32, 3, 0, device)
    expected = PathStatistics.empty(batch, tree, torch.float32, 3, 0, "cpu")
    for _ in range(chunks):
        residual, norm = chunk_values(batch, count, generator, device)
        fold(ts, got, residual, norm, lengths.to(device), paths)
        expected._add_torch(residual.cpu(), norm.cpu(), paths)
    assert_same(got, expected)
    assert int(got.zero_norms.sum()) == chunks and int(got.counts.sum()) == chunks * batch * count


def test_a_hand_worked_chunk(ts, device):
    """One layer, one head, skip: leaves [skip, head] of lengths [0, 1], B = 1, two chunks. Values
    and bins worked out by hand over the edges 10^-1, 10^0, 10^1 (ascending: bin = #edges ≤ v)."""
    tree = pk.PathTree.complete(1, 1, skip=True)
    stats = PathStatistics.empty(1, tree, torch.float64, 1, 0, device)
    edges = torch.tensor([0.1, 1.0, 10.0], dtype=torch.float64, device=device)
    stats.histograms = {name: torch.zeros(1, 2, 4, dtype=torch.long, device=device) for name in _HISTOGRAMS}
    lengths = torch.tensor([0, 1], device=device)

    def add(residual, norm):
        return ts.triton_statistics_update(
            torch.tensor([residual], dtype=torch.float64, device=device),
            torch.tensor([norm], dtype=torch.float64, device=device),
            lengths,
            edges,
            stats.counts,
            stats.zero_norms,
            stats.log10_ratio_sums,
            *(stats._packed(name, _MEASURES) for name in ("sums", "sums_of_squares", "minima", "maxima")),
            stats._packed("histograms", _HISTOGRAMS),
        ).cpu()

    first = add([0.5, 2.0], [1.0, 4.0])  # ratios 0.5 and 0.5
    assert first.tolist() == [[[[0, 1]]] * 3, [[[0, 1]]] * 3]  # every extreme new, at its only leaf
    first = add([0.05, 0.0], [0.5, 0.0])  # ratio 0.1 (length 0); a zero path (length 1)
    # Length 0: ratio 0.1 < 0.5 is a new minimum, residual 0.05 too, norm 0.5 < 1 too; no new maximum.
    # Length 1: the zero path has no ratio; its residual 0 and norm 0 are new minima.
    assert first.tolist() == [[[[0, -1]], [[0, 1]], [[0, 1]]], [[[-1, -1]]] * 3]
    assert stats.counts.tolist() == [[2, 2]] and stats.zero_norms.tolist() == [[0, 1]]
    sums = {name: [float(v) for v in stats.sums[name][0]] for name in _MEASURES}
    assert sums == {"ratio": pytest.approx([0.6, 0.5]), "residual": pytest.approx([0.55, 2.0]), "norm": [1.5, 4.0]}
    squares = [float(v) for v in stats.sums_of_squares["ratio"][0]]
    assert squares == pytest.approx([0.26, 0.25], rel=1e-15)
    assert float(stats.log10_ratio_sums[0, 0]) == pytest.approx(math.log10(0.5) - 1.0, rel=1e-15)
    assert float(stats.log10_ratio_sums[0, 1]) == pytest.approx(math.log10(0.5), rel=1e-15)
    assert [float(v) for v in stats.minima["ratio"][0]] == [0.1, 0.5]
    assert [float(v) for v in stats.maxima["ratio"][0]] == [0.5, 0.5]
    assert [float(v) for v in stats.minima["norm"][0]] == [0.5, 0.0]
    # Bins: 0.5 → 1 (≥ 0.1), 0.1 → 1 (equal to an edge counts above it), 2.0 → 2, 0.05 → 0, 0 → 0;
    # the zero path has no ratio bin.
    assert stats.histograms["ratio"].tolist() == [[[0, 2, 0, 0], [0, 1, 0, 0]]]
    assert stats.histograms["residual"].tolist() == [[[1, 1, 0, 0], [1, 0, 1, 0]]]


def test_the_first_leaf_of_an_extreme_is_the_first_in_leaf_order(ts, device):
    """Equal values across the tiles and programs of a chunk (2,401 leaves, five programs of 512):
    ratio 0.5 up to leaf 1,099, then 0.25 (in the third program and on). Each length's maximum is
    first reached at its first leaf, its minimum at its first leaf from 1,100 on."""
    tree = pk.PathTree.complete(4, 6, skip=True)
    count = tree.num_leaves
    lengths = tree.leaf_lengths(0, count)
    stats = PathStatistics.empty(1, tree, torch.float64, 1, 0, device)
    residual = torch.full((1, count), 0.5, dtype=torch.float64)
    residual[0, 1100:] = 0.25
    first = ts.triton_statistics_update(
        residual.to(device),
        torch.ones(1, count, dtype=torch.float64, device=device),
        lengths.to(device),
        stats.edges.to(device),
        stats.counts,
        stats.zero_norms,
        stats.log10_ratio_sums,
        *(stats._packed(name, _MEASURES) for name in ("sums", "sums_of_squares", "minima", "maxima")),
        stats._packed("histograms", _HISTOGRAMS),
    ).cpu()
    leaves = torch.arange(count)
    first_of = [int((lengths == k).nonzero()[0]) for k in range(5)]  # 0, 1, 8, 57, 400
    # Length 0 is the skip path alone (leaf 0, ratio 0.5); the others' minima lie from leaf 1,100.
    at_least = [0] + [int(leaves[(lengths == k) & (leaves >= 1100)][0]) for k in range(1, 5)]
    assert min(at_least[1:]) >= 1100 > 2 * 512  # beyond the first two programs; more ties after
    assert first[0, :2].tolist() == [[at_least]] * 2  # ratio, residual
    assert first[0, 2].tolist() == [first_of]  # the norms are all 1: the first leaf of each length
    assert first[1].tolist() == [[first_of]] * 3


def test_a_run_repeats_to_the_bit(ts, device):
    tree = pk.PathTree.complete(4, 6, skip=True)
    count = tree.num_leaves
    lengths, paths = tree.leaf_lengths(0, count).to(device), tree.leaf_paths(torch.arange(count))
    residual, norm = chunk_values(2, count, torch.Generator().manual_seed(7), device)
    runs = []
    for _ in range(2):
        stats = PathStatistics.empty(2, tree, torch.float32, 2, 0, device)
        fold(ts, stats, residual, norm, lengths, paths)
        runs.append(stats)
    for name in ("log10_ratio_sums", "sums", "sums_of_squares"):
        one, two = getattr(runs[0], name), getattr(runs[1], name)
        for key in one if isinstance(one, dict) else [None]:
            a, b = (one[key], two[key]) if key else (one, two)
            assert torch.equal(a.view(torch.long), b.view(torch.long)), name


@pytest.mark.parametrize("top_k", [0, 3])
def test_path_statistics_with_the_triton_fold(ts, device, monkeypatch, top_k):
    """pk.path_statistics with PATHKERNELS_STATISTICS_FOLD=triton: the same statistics (extremes' paths,
    histograms, top paths) as the default fold, over several chunks and a zero path."""
    attn = torch.softmax(torch.randn(2, 3, 3, 6, 6, dtype=torch.float64) * 3, -1)
    attn[:, 1, 2] = torch.eye(6, dtype=torch.float64)  # an identity head
    x = torch.randn(2, 6, 4, dtype=torch.float64)
    x[1, :, 0] = 1.0  # a constant column: part of batch element 1 has no residual
    w_v, w_o = torch.randn(3, 3, 4, 2, dtype=torch.float64), torch.randn(3, 3, 2, 4, dtype=torch.float64)
    w_o[2, 0] = 0.0  # every path through layer 2's head 0 is a zero path (norm 0)
    tree = pk.PathTree.complete(3, 3, skip=True)
    inputs = dict(x=x, w_v=w_v, w_o=w_o)
    kwargs = dict(top_k=top_k, memory_budget=20_000, progress=False)
    expected = pk.path_statistics(attn, tree, **inputs, **kwargs)
    assert int(expected.zero_norms.sum()) == 2 * 16  # the zero paths are there to be folded
    monkeypatch.setenv("PATHKERNELS_STATISTICS_FOLD", "triton")
    got = pk.path_statistics(attn.to(device), tree, **{k: v.to(device) for k, v in inputs.items()}, **kwargs)
    assert_same(got, expected)
    assert torch.equal(got.top_paths.cpu(), expected.top_paths)
    torch.testing.assert_close(got.top_values.cpu(), expected.top_values, rtol=0, atol=0)
    assert int(got.counts.sum()) == 2 * 4**3


def test_the_fold_switch(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert (statistics_fold(cpu), statistics_fold(cuda)) == ("native", "torch")
    monkeypatch.setenv("PATHKERNELS_STATISTICS_FOLD", "triton")
    assert (statistics_fold(cpu), statistics_fold(cuda)) == ("triton", "triton")
    monkeypatch.setenv("PATHKERNELS_STATISTICS_FOLD", "native")
    with pytest.raises(ValueError, match=r"PATHKERNELS_STATISTICS_FOLD=native is the CPU's fold, got tensors on cuda"):
        statistics_fold(cuda)
    monkeypatch.setenv("PATHKERNELS_STATISTICS_FOLD", "fast")
    with pytest.raises(
        ValueError, match=r"expected PATHKERNELS_STATISTICS_FOLD in \['auto', 'native', 'torch', 'triton'\]"
    ):
        statistics_fold(cpu)


def test_the_torch_switch_folds_the_cpu_in_torch_ops(monkeypatch):
    """PATHKERNELS_STATISTICS_FOLD=torch on the CPU gives what the C++ op gives (the switch works)."""
    attn = torch.softmax(torch.randn(1, 3, 2, 5, 5, dtype=torch.float64), -1)
    tree = pk.PathTree.complete(3, 2, skip=True)
    expected = pk.path_statistics(attn, tree)
    monkeypatch.setenv("PATHKERNELS_STATISTICS_FOLD", "torch")
    assert_same(pk.path_statistics(attn, tree), expected)


def test_inputs_are_refused_by_name(ts, device):
    tree = pk.PathTree.complete(2, 2, skip=True)
    stats = PathStatistics.empty(1, tree, torch.float64, 1, 0, device)
    residual = torch.rand(1, 9, dtype=torch.float64, device=device)
    args = [
        residual,
        residual + 1,
        tree.leaf_lengths(0, 9).to(device),
        stats.edges.to(device),
        stats.counts,
        stats.zero_norms,
        stats.log10_ratio_sums,
        *(stats._packed(name, _MEASURES) for name in ("sums", "sums_of_squares", "minima", "maxima")),
        stats._packed("histograms", _HISTOGRAMS),
    ]
    op = "pathkernels.triton_statistics_update"
    for index, damaged, message in (
        (1, residual.float(), r"expected norm \[1, 9\] contiguous float64 on .*, got \[1, 9\] torch.float32"),
        (2, args[2][:5], r"expected lengths \[9\] contiguous int64"),
        (4, stats.counts.t(), r"expected counts \[B, L\+1\] with B = 1, got \[3, 1\]"),
        (7, args[7].transpose(1, 2), r"expected sums \[3, 1, 3\] contiguous float64"),
        (0, residual[0], r"expected residual \[B, c\], got \[9\]"),
    ):
        bad = list(args)
        bad[index] = damaged
        with pytest.raises(ValueError, match=rf"^{op}: {message}"):
            ts.triton_statistics_update(*bad)


COMPILE_SCRIPT = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import pathkernels.core.triton_statistics as t

f64 = {"residual_ptr", "norm_ptr", "edges_ptr", "partial_f64_ptr", "log_sums_ptr", "sums_ptr", "squares_ptr",
       "minima_ptr", "maxima_ptr"}
counts = {}
for arch in (80, 90):
    for kernel, constants in ((t._fold_chunk_kernel, {"S_P2": 8, "EDGE_STEPS": 9, "BLOCK": 256}),
                              (t._merge_kernel, {"S_P2": 8, "MERGE": 16, "HISTOGRAM": 1024})):
        signature = {a: ("*fp64" if a in f64 else "*i64") if a.endswith("_ptr") else
                     "constexpr" if a in constants else "i32" for a in kernel.arg_names}
        source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
        options = {"num_warps": 4, "num_stages": 1}
        ptx = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options).asm["ptx"]
        counts[f"{arch}/{kernel.__name__}"] = {
            "integer_atomics": len(re.findall(r"\b(?:red|atom)\.global\S*\.add\.u64", ptx)),
            "float_atomics": len(re.findall(r"\b(?:red|atom)\.global\S*\.add\.f64", ptx)),
            "f64_fma": len(re.findall(r"\bfma\.rn\.f64", ptx)),
        }
print(json.dumps(counts))
"""


def test_compiles_for_the_gpu(ts, device):
    """Without a GPU: both kernels compiled by Triton for sm_80 and sm_90 (its own ptxas; no driver)
    in a fresh interpreter without TRITON_INTERPRET; the histograms counted with integer atomics, no
    float atomics anywhere (the sums' order is fixed), float64 arithmetic in the fold (the log10)."""
    if device == "cuda":
        pytest.skip("the GPU runs the compiled kernels themselves")
    counts = compiled_for_the_gpu(COMPILE_SCRIPT)
    for arch in (80, 90):
        fold_counts, merge = counts[f"{arch}/_fold_chunk_kernel"], counts[f"{arch}/_merge_kernel"]
        assert fold_counts["integer_atomics"] > 0 and fold_counts["f64_fma"] > 0, (arch, fold_counts)
        assert fold_counts["float_atomics"] == merge["float_atomics"] == merge["integer_atomics"] == 0, (arch, merge)


def test_without_triton():
    output = printed_without_triton(
        "import torch, pathkernels, pathkernels.core.triton_statistics as t\n"
        "try:\n"
        "    t.triton_statistics_update(*[torch.zeros(1)] * 12)\n"
        "except RuntimeError as error:\n"
        "    print(error)\n"
    )
    message = "pathkernels.triton_statistics_update: needs Triton (pip install triton), which is not installed"
    assert output.strip() == message


def test_extremes_recorded_in_either_order_of_chunks(ts, device):
    """A later chunk's smaller minimum replaces an earlier one's path; an equal one does not."""
    tree = pk.PathTree.complete(1, 2, skip=True)
    paths = tree.leaf_paths(torch.arange(3))
    lengths = tree.leaf_lengths(0, 3).to(device)
    stats = PathStatistics.empty(1, tree, torch.float64, 1, 0, device)
    norm = torch.ones(1, 3, dtype=torch.float64, device=device)
    fold(ts, stats, torch.tensor([[0.5, 0.3, 0.4]], dtype=torch.float64, device=device), norm, lengths, paths)
    assert stats.argmin["ratio"][0, 1].tolist() == paths[1].tolist()
    fold(ts, stats, torch.tensor([[0.5, 0.4, 0.3]], dtype=torch.float64, device=device), norm, lengths, paths)
    assert stats.argmin["ratio"][0, 1].tolist() == paths[1].tolist()  # 0.3 again: the first kept
    fold(ts, stats, torch.tensor([[0.5, 0.4, 0.2]], dtype=torch.float64, device=device), norm, lengths, paths)
    assert stats.argmin["ratio"][0, 1].tolist() == paths[2].tolist()
    assert stats.argmax["ratio"][0, 1].tolist() == paths[2].tolist()  # 0.4 at leaf 2 in chunk 1


def test_the_autotuned_fold_counts_each_leaf_once(ts, device, monkeypatch):
    """On the GPU, the fold's first launch is autotuned: every config runs on the chunk, counting
    into the scratch histogram, which must be zeroed between the trials and before the real launch
    (reset_to_zero), so that the histograms count each leaf once. (The interpreter runs one config.)"""
    if device != "cuda":
        pytest.skip("the interpreter does not autotune")
    monkeypatch.setenv("PATHKERNELS_TRITON_STATISTICS_CONFIGS", "full")
    ts._TUNERS.clear()
    tree = pk.PathTree.complete(4, 6, skip=True)
    count = tree.num_leaves
    lengths, paths = tree.leaf_lengths(0, count), tree.leaf_paths(torch.arange(count))
    residual, norm = chunk_values(2, count, torch.Generator().manual_seed(3), device)
    got = PathStatistics.empty(2, tree, torch.float32, 2, 0, device)
    expected = PathStatistics.empty(2, tree, torch.float32, 2, 0, "cpu")
    for _ in range(2):
        fold(ts, got, residual, norm, lengths.to(device), paths)
        expected._add_torch(residual.cpu(), norm.cpu(), paths)
    assert_same(got, expected)
    assert ts.chosen_config() is not None
