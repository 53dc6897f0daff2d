"""PATHKERNELS_CUDA_GRAPHS=1: chunks split below their prefix chain (core/chunk_graphs.py), the
subtrees replayed from CUDA graphs on a GPU. On the CPU the same split runs without graphs: its
numbers against the engine's and a float64 truth, its root scales by hand, collapsed prefixes."""

import warnings

import pytest
import torch

import pathkernels as pk
from pathkernels.core import chunk_graphs, engine
from pathkernels.core.checks import check_network
from pathkernels.core.engine_defaults import engine_settings
from pathkernels.core.paths import SKIP
from pathkernels.testing import float32_error_bound, path_condition_numbers, random_attention

GRAPHS = "PATHKERNELS_CUDA_GRAPHS"


@pytest.fixture
def spied(monkeypatch):
    """The ChunkGraphs each engine run makes, and how many chunks each split (prefix nodes made)."""
    made, prefixes = [], []

    class Recorded(chunk_graphs.ChunkGraphs):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    real_prefix_node = chunk_graphs.prefix_node

    def prefix_node(net, operands, heads):
        prefixes.append(list(heads))
        return real_prefix_node(net, operands, heads)

    monkeypatch.setattr(chunk_graphs, "ChunkGraphs", Recorded)
    monkeypatch.setattr(chunk_graphs, "prefix_node", prefix_node)
    return made, prefixes


def network(batch, layers, heads, n, dtype, outputs: bool, temperature=1.0):
    """attn (rows renormalised in dtype) and, with outputs, x, w_v, w_o; every tensor in dtype."""
    attn = random_attention(batch, layers, heads, n, n, dtype=dtype, temperature=temperature)
    attn = attn / attn.sum(-1, keepdim=True)
    if not outputs:
        return attn, {}
    d, d_head = 6, 3
    return attn, {
        "x": torch.randn(batch, n, d, dtype=dtype),
        "w_v": torch.randn(layers, heads, d, d_head, dtype=dtype) / d**0.5,
        "w_o": torch.randn(layers, heads, d_head, d, dtype=dtype) / d_head**0.5,
    }


def wide(attn, outputs):
    """The same network in float64 (attention rows renormalised there): the truth of a float32 run."""
    attn = attn.double()
    return attn / attn.sum(-1, keepdim=True), {key: value.double() for key, value in outputs.items()}


def relative(result, truth):
    return max(
        ((result.residual - truth.residual).abs() / truth.residual.abs()).max().item(),
        ((result.norm - truth.norm).abs() / truth.norm.abs()).max().item(),
    )


def test_the_switch_is_off_unless_set_and_refuses_other_values(monkeypatch):
    def graphs():
        return engine_settings("cpu", torch.float32, 4).graphs

    monkeypatch.delenv(GRAPHS, raising=False)
    assert not graphs()
    monkeypatch.setenv(GRAPHS, "0")
    assert not graphs()
    monkeypatch.setenv(GRAPHS, "1")
    assert graphs()
    monkeypatch.setenv(GRAPHS, "auto")
    assert not graphs()  # the CPU's choice
    monkeypatch.setenv(GRAPHS, "yes")
    with pytest.raises(ValueError, match=r"path_residuals: expected PATHKERNELS_CUDA_GRAPHS in \['auto', '0', '1'\]"):
        pk.path_residuals(random_attention(2, 2, 4, 4), pk.PathTree.complete(2, 2))


@pytest.mark.parametrize("outputs", [False, True])
def test_the_prefix_node_is_the_centred_product_of_the_prefix(outputs):
    """R + 1μᵀ = A_k ⋯ A_1 X W_1 ⋯ W_k written out (X = I without outputs), μ its column mean, the
    skip leaving a layer out."""
    attn, kw = network(2, 4, 3, 5, torch.float64, outputs)
    net = check_network(attn, kw.get("x"), kw.get("w_v"), kw.get("w_o"), "test")
    operands = engine.engine_operands(net)
    heads = [int(h) for h in torch.randint(-1, 3, (3,))]
    heads[1] = SKIP
    product = kw["x"] if outputs else torch.eye(5, dtype=torch.float64).expand(2, 5, 5)
    for layer, head in enumerate(heads):
        if head != SKIP:
            product = attn[:, layer, head] @ product
            if outputs:
                product = product @ kw["w_v"][layer, head] @ kw["w_o"][layer, head]
    residual, mean = chunk_graphs.prefix_node(net, operands, heads)
    torch.testing.assert_close(mean, product.mean(1), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(residual, product - product.mean(1, keepdim=True), rtol=1e-12, atol=1e-14)


def test_root_scales_by_hand():
    """s = 2^max(round(log2 max|R|), ceil(log2 max|μ|) − 40); R / s below 2^-100 is lost; zero
    roots keep s = 1; float64 roots are not scaled."""
    residual = torch.zeros(4, 2, 2, dtype=torch.float64)
    mean = torch.zeros(4, 2, dtype=torch.float64)
    residual[0, 0, 0], mean[0, 0] = 2.0**-200, 1.0  # μ's floor: s = 2^-40, R / s = 2^-160: lost
    residual[1, 1, 0], mean[1, 1] = -3 * 2.0**-50, 5.0  # floor 2^(3 − 40) above 2^round(-48.4)
    residual[2, 0, 1] = 1536.0  # 2^10.58: s = 2^11, μ = 0 sets no floor
    root, root_mean, scale, lost = chunk_graphs.scaled_root(residual, mean, torch.float32)
    assert scale.tolist() == [2.0**-40, 2.0**-37, 2.0**11, 1.0]
    assert lost.tolist() == [True, False, False, False]
    assert root.dtype == root_mean.dtype == torch.float32
    assert root[1, 1, 0].item() == -3 * 2.0**-13 and root_mean[1, 1].item() == 5 * 2.0**37
    assert root[2, 0, 1].item() == 0.75 and root[3].abs().sum().item() == 0
    root, root_mean, scale, lost = chunk_graphs.scaled_root(residual, mean, torch.float64)
    assert scale.tolist() == [1.0] * 4 and not lost.any()
    assert root is residual and root_mean is mean


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("outputs", [False, True])
def test_split_chunks_give_the_engine_numbers(device, spied, monkeypatch, dtype, skip, outputs):
    """Every subtree chunk split below its prefix (replayed from a graph on CUDA): the engine's
    numbers, float64 to 1e-12, float32 as close to the float64 truth as the unsplit engine."""
    made, prefixes = spied
    attn, kw = network(2, 5, 3, 8, dtype, outputs)
    attn, kw = attn.to(device), {key: value.to(device) for key, value in kw.items()}
    tree = pk.PathTree.complete(5, 3, skip=skip)
    budget = 1 << 15  # small chunks: dozens of subtrees of depth 2 or 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the small budget's advice
        monkeypatch.setenv(GRAPHS, "0")
        unsplit = pk.path_residuals(attn, tree, memory_budget=budget, **kw)
        assert not made
        monkeypatch.setenv(GRAPHS, "1")
        split = pk.path_residuals(attn, tree, memory_budget=budget, **kw)
    chunks = len(prefixes)
    assert chunks >= 8 and all(len(heads) >= 1 for heads in prefixes)
    assert all(graphs.capture == (device == "cuda") and graphs.failure is None for graphs in made)
    if device == "cuda":  # the first chunk of the shape runs eagerly and unsplit, every later one from the graph
        assert all(graphs.failure is None for graphs in made) and sum(graphs.replays for graphs in made) == chunks
    if dtype == torch.float64:
        torch.testing.assert_close(split.residual, unsplit.residual, rtol=1e-12, atol=0)
        torch.testing.assert_close(split.norm, unsplit.norm, rtol=1e-12, atol=0)
        return
    # float32: each residual within the engine's error bound κ_p (L + 2) n u of the float64 truth (as
    # the unsplit engine is tested), each norm within 1e-4.
    truth_attn, truth_kw = wide(attn, kw)
    truth = pk.path_residuals(truth_attn.cpu(), tree, **{key: value.cpu() for key, value in truth_kw.items()})
    kappa = path_condition_numbers(truth_attn.cpu(), tree.paths(), **{key: v.cpu() for key, v in truth_kw.items()})
    error = (split.residual.cpu().double() - truth.residual).abs() / truth.residual
    assert (error <= float32_error_bound(kappa, 5, 8)).all(), error.max()
    assert ((split.norm.cpu().double() - truth.norm).abs() / truth.norm).max() < 1e-4


def collapsed_network(layers: int, temperature: float):
    """float32, H = 2, n = 8: nearly uniform attention (C(A) ~ 1/temperature a layer) on X ≈ 1 whose
    residual is ~1e-6 of its mean, W = I: prefixes whose R falls far below float32's range while
    μ ≈ 1."""
    attn, _ = network(1, layers, 2, 8, torch.float32, False, temperature=temperature)
    x = (1 + 1e-6 * torch.randn(1, 8, 8, dtype=torch.float64)).float()
    eye = torch.eye(8).expand(layers, 2, 8, 8).contiguous()
    return attn, {"x": x, "w_v": eye, "w_o": eye.clone()}


def float64_recomputations(monkeypatch) -> list[int]:
    """How many leaves the engine evaluates again in float64 (out_of_range_in_float64's float64 runs)."""
    counted = []
    real = engine.leaf_norms

    def leaf_norms(net, tree, first, last, *args, **kwargs):
        if net.attn.dtype == torch.float64:
            counted.append(last - first)
        return real(net, tree, first, last, *args, **kwargs)

    monkeypatch.setattr(engine, "leaf_norms", leaf_norms)
    return counted


@pytest.mark.parametrize("layers, temperature", [(10, 3e4), (11, 1e5)])
def test_prefixes_far_below_their_mean_are_evaluated_in_float64(spied, monkeypatch, layers, temperature):
    """Prefix residuals of 1e-41 and below with μ ≈ 1: no power of two brings R into the band the
    engine keeps its nodes in without μ / s overflowing the subtree, so those chunks' reports are
    NaN for the engine's range check, which evaluates them again in float64: as accurate as the
    unsplit engine."""
    _, prefixes = spied
    attn, kw = collapsed_network(layers, temperature)
    tree = pk.PathTree.complete(layers, 2)
    truth = pk.path_residuals(*wide(attn, kw)[:1], tree, **wide(attn, kw)[1])
    recomputed = float64_recomputations(monkeypatch)
    roots = []
    real_scaled_root = chunk_graphs.scaled_root

    def scaled_root(residual, mean, dtype):
        roots.append(residual.abs().max().item())
        return real_scaled_root(residual, mean, dtype)

    monkeypatch.setattr(chunk_graphs, "scaled_root", scaled_root)
    monkeypatch.setenv(GRAPHS, "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        split = pk.path_residuals(attn, tree, memory_budget=1 << 14, **kw)
    assert prefixes and min(roots) < 1e-38  # the regime this test is about: subnormal roots unscaled
    assert sum(recomputed) > 0
    assert relative(split, truth) < 2e-6


def test_a_small_root_shrunk_further_by_the_subtree_keeps_its_digits(spied, monkeypatch):
    """A prefix residual of ~1e-36 beside μ ≈ 1 (column 0 constant, W = I above), below it value maps
    W_V W_O = 2^-44 I: the subtree's products fall far below float32's range within a level, which the
    engine's node scales absorb only for roots within its band. Split, every residual within float32's
    accuracy of float64, as unsplit (found by a review: 0.29 relative error before)."""
    layers, heads, n, d, k = 6, 2, 8, 4, 4
    attn, _ = network(1, layers, heads, n, torch.float32, False, temperature=10.0)
    x = torch.zeros(1, n, d)
    x[..., 0] = 1.0
    x[..., 1:] = 3e-36 * torch.randn(1, n, d - 1)
    w = torch.eye(d).expand(layers, heads, d, d).clone()
    w[k:] *= 2.0**-22
    kw = {"x": x, "w_v": w, "w_o": w.clone()}
    tree = pk.PathTree.complete(layers, heads)
    truth = pk.path_residuals(*wide(attn, kw)[:1], tree, **wide(attn, kw)[1])
    monkeypatch.setenv(GRAPHS, "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        split = pk.path_residuals(attn, tree, memory_budget=4096, **kw)
    assert spied[1] and max(len(heads) for heads in spied[1]) >= k  # prefixes through the small layers
    assert relative(split, truth) < 2e-6


def test_one_subtree_is_kept_at_a_time(spied):
    """A chunk of the kept subtree's shape reuses it; another shape replaces it; a chunk without a
    prefix chain runs unsplit and drops it. Each gives what the unsplit op gives."""
    made, prefixes = spied
    attn, _ = network(2, 4, 3, 6, torch.float64, False)
    net = check_network(attn, None, None, None, "test")
    operands = engine.engine_operands(net)
    tree = pk.PathTree.complete(4, 3, skip=True)
    graphs = chunk_graphs.ChunkGraphs(
        net,
        operands,
        "simt",
        False,
        lambda chunk, block: engine.chunk_norms(net, operands, chunk, block, "simt"),
        capture=False,
    )
    kept = []
    for start, depth in [(0, 2), (16, 2), (64, 3), (8, 1), (0, 4)]:
        chunk = tree.subtree_chunk(start, depth)
        expected = engine.chunk_norms(net, operands, chunk, 64, "simt")
        got = graphs(chunk, 64)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=0)
        kept.append(graphs.subtree)
    assert kept[0] is kept[1] and kept[1].sightings == 2
    assert kept[2] is not kept[1] and kept[2].sightings == 1
    assert kept[4] is None
    assert [len(heads) for heads in prefixes] == [2, 2, 1, 3]  # the prefix: the L − depth layers above


@pytest.mark.parametrize(
    "leaf_kernel, levels", [("fused", "per_head"), ("heads", "all_heads"), ("triton", "all_heads")]
)
def test_graphs_on_cuda_with_each_engine_candidate(device, spied, monkeypatch, leaf_kernel, levels):
    """On a GPU: the graphs replay with the all-heads candidates too (their launches captured), and
    path_statistics, which runs the same chunks, counts what it counts without them."""
    if device != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    made, _ = spied
    attn = random_attention(1, 6, 4, 32, 32, device="cuda")
    tree = pk.PathTree.complete(6, 4, skip=True)
    monkeypatch.setenv("PATHKERNELS_ENGINE_LEVELS", levels)
    monkeypatch.setenv(GRAPHS, "0")
    unsplit = pk.path_residuals(attn, tree, leaf_kernel=leaf_kernel, memory_budget=1 << 20)
    stats_unsplit = pk.path_statistics(attn, tree, leaf_kernel=leaf_kernel, memory_budget=1 << 20)
    monkeypatch.setenv(GRAPHS, "1")
    split = pk.path_residuals(attn, tree, leaf_kernel=leaf_kernel, memory_budget=1 << 20)
    stats_split = pk.path_statistics(attn, tree, leaf_kernel=leaf_kernel, memory_budget=1 << 20)
    assert made and all(graphs.failure is None for graphs in made) and made[0].replays > 0
    truth = pk.path_residuals(*wide(attn, {})[:1], tree)
    assert relative(split, truth) <= 2 * max(relative(unsplit, truth), 1e-6)
    assert torch.equal(stats_split.counts, stats_unsplit.counts)
