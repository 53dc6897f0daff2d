"""path_residuals: the CPU path-tree engine against per-path loops, closed forms and the network."""

import itertools
import math
import re
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

import pathkernels as pk
from pathkernels.reference import (
    attention_network_ref,
    composite_norm_ref,
    path_products_ref,
    residual_norm_ref,
)
from pathkernels.testing import (
    cpu_kernel_isas,
    devices,
    float32_error_bound,
    has_tensor_cores,
    num_threads,
    output_condition_numbers,
    path_condition_numbers,
    random_attention,
    tolerance,
)


def network(batch, layers, heads, n, d=None, d_head=None, dtype=torch.float64):
    attn = random_attention(batch, layers, heads, n, n, dtype=torch.float64)
    if d is None:
        return attn.to(dtype), None, None, None
    x = torch.randn(batch, n, d, dtype=torch.float64)
    w_v = torch.randn(layers, heads, d, d_head, dtype=torch.float64) / d**0.5
    w_o = torch.randn(layers, heads, d_head, d, dtype=torch.float64) / d_head**0.5
    return attn.to(dtype), x.to(dtype), w_v.to(dtype), w_o.to(dtype)


def check_against_loop(result, attn, tree, x, w_v, w_o, dtype):
    as64 = lambda t: None if t is None else t.double().cpu()
    products = path_products_ref(as64(attn), tree.paths(), as64(x), as64(w_v), as64(w_o))
    tol = tolerance(dtype) if dtype == torch.float64 else {"rtol": 2e-4, "atol": 1e-6}
    torch.testing.assert_close(result.residual.double().cpu(), residual_norm_ref(products), **tol)
    torch.testing.assert_close(result.norm.double().cpu(), composite_norm_ref(products), **tol)
    ratio = residual_norm_ref(products) / composite_norm_ref(products)
    torch.testing.assert_close(result.ratio.double().cpu(), ratio, **tol)
    assert torch.equal(result.paths, tree.paths())
    assert torch.equal(result.lengths, (tree.paths() >= 0).sum(1))


TREES = {
    "complete": lambda L, H: pk.PathTree.complete(L, H),
    "complete_skip": lambda L, H: pk.PathTree.complete(L, H, skip=True),
    "max_length": lambda L, H: pk.PathTree.complete(L, H, skip=True, max_length=2),
    "explicit": lambda L, H: pk.PathTree.from_paths(
        torch.cat([pk.sample_paths(L, H, 40, skip=True), pk.sample_paths(L, H, 10, skip=True)[[3, 3, 7, 0]]]),
        num_heads=H,
    ),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mode", ["products", "outputs"])
@pytest.mark.parametrize("kind", list(TREES))
def test_matches_per_path_loop(device, kind, mode, dtype):
    layers, heads, n = 4, 3, 6
    tree = TREES[kind](layers, heads)
    inputs = network(2, layers, heads, n, *((5, 3) if mode == "outputs" else ()), dtype=dtype)
    attn, x, w_v, w_o = (None if t is None else t.to(device) for t in inputs)
    result = pk.path_residuals(attn, tree, x=x, w_v=w_v, w_o=w_o)
    assert result.residual.device == attn.device
    assert result.residual.shape == (2, len(tree)) and result.residual.dtype == dtype
    check_against_loop(result, attn, tree, x, w_v, w_o, dtype)


@pytest.mark.filterwarnings("ignore:.*allows chunks of at most")
def test_tiny_memory_budget_gives_the_same_results_in_many_chunks(device):
    """Bit for bit on the CPU (its GEMM computes an element alike in any call); on CUDA cuBLAS picks
    its algorithm by shape, so there the budget may move the last bits."""
    attn, x, w_v, w_o = (t.to(device) for t in network(2, 5, 3, 8, 6, 2))
    for tree in (pk.PathTree.complete(5, 3, skip=True), TREES["explicit"](5, 3)):
        big = pk.path_residuals(attn, tree, x=x, w_v=w_v, w_o=w_o)
        small = pk.path_residuals(attn, tree, x=x, w_v=w_v, w_o=w_o, memory_budget=64 * 1024)
        exact = {"rtol": 0, "atol": 0} if device == "cpu" else {"rtol": 1e-13, "atol": 0}
        torch.testing.assert_close(small.residual, big.residual, **exact)
        torch.testing.assert_close(small.norm, big.norm, **exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", ["products", "outputs"])
def test_leaf_blocks_threads_and_chunks_change_no_bit_on_the_cpu(dtype, mode):
    """The CPU engine's results are a function of the problem alone: forced leaf blocks (1 to a
    whole level), 1, 2 and 3 threads, memory budgets from the minimum up, and the same paths
    evaluated as one complete tree or as two shuffled halves give the same bits."""
    from pathkernels.core.checks import check_network
    from pathkernels.core.engine import engine_operands
    from pathkernels.core.paths import build_trie_chunk
    from pathkernels.core.planner import minimum_budget

    attn, x, w_v, w_o = network(2, 4, 3, 9, *((7, 3) if mode == "outputs" else ()), dtype=dtype)
    # Magnitudes over many binades, so that any change in the order of rounding would show.
    attn = torch.softmax(attn.double().log() * 3, -1).to(dtype)
    tree = pk.PathTree.complete(4, 3, skip=True)
    chunk = build_trie_chunk(tree.paths())
    operands = engine_operands(check_network(attn, x, w_v, w_o, "test"))
    by_op, by_budget = [], []
    for count in (1, 2, 3):
        with num_threads(count):
            for leaf_block in (1, 3, 7, 1 << 20):
                by_op.append(
                    torch.ops.pathkernels.path_chunk_norms(
                        *operands, w_v, w_o, chunk.parents, chunk.heads, leaf_block, "simt"
                    )
                )
            minimum = minimum_budget(check_network(attn, x, w_v, w_o, "test"))
            for budget in (minimum, 3 * minimum, 1 << 16, 1 << 30):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)  # small budgets warn that they are slow
                    result = pk.path_residuals(attn, tree, x=x, w_v=w_v, w_o=w_o, memory_budget=budget)
                by_budget.append((result.residual, result.norm))
    for residual, norm in by_op[1:]:
        assert torch.equal(residual, by_op[0][0]) and torch.equal(norm, by_op[0][1])
    for residual, norm in by_budget[1:]:
        assert torch.equal(residual, by_budget[0][0]) and torch.equal(norm, by_budget[0][1])
    shuffled = tree.paths()[torch.randperm(tree.num_paths)]
    halves = [pk.PathTree.from_paths(part, num_heads=3) for part in (shuffled[:100], shuffled[100:])]
    whole = {tuple(p): i for i, p in enumerate(tree.paths().tolist())}
    for half in halves:
        result = pk.path_residuals(attn, half, x=x, w_v=w_v, w_o=w_o)
        index = torch.tensor([whole[tuple(p)] for p in half.paths().tolist()])
        assert torch.equal(result.residual, by_budget[0][0][:, index])
        assert torch.equal(result.norm, by_budget[0][1][:, index])


def test_chunks_cover_a_range_with_whole_subtrees_between_built_ends():
    from pathkernels.core import checks, engine, planner

    attn = random_attention(1, 6, 3, 8, 8, dtype=torch.float64)
    tree = pk.PathTree.complete(6, 3, skip=True)  # 4^6 leaves
    net = checks.check_network(attn, None, None, None, "test")
    first, last = 37, 3001
    chunks = list(planner.chunks(tree, net, 1 << 20, first, last))
    assert chunks[0][0] == first and chunks[-1][1] == last
    assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks))
    sizes = [stop - start for start, stop, _, _ in chunks]
    whole = [size for size, (start, *_) in zip(sizes, chunks) if start % size == 0 and size > 16]
    assert whole and len(set(whole)) == 1, sizes  # one subtree size, 4^depth, in the middle
    for start, stop, chunk, _ in chunks:
        assert chunk.leaf_position.numel() == stop - start
    # The engine over such a range equals the whole tree's results there.
    full = pk.path_residuals(attn, tree)
    residual, norm = engine.leaf_norms(net, tree, first, last, 1 << 20)
    torch.testing.assert_close(residual[0], full.residual[0, first:last], rtol=1e-13, atol=0)
    torch.testing.assert_close(norm[0], full.norm[0, first:last], rtol=1e-13, atol=0)


@pytest.mark.parametrize(
    "layers, heads, n, dtype, depth",
    [
        (8, 4, 32, torch.float32, 6),  # (5^5 + 5^4) nodes of 4 KiB: 15 MiB; one layer deeper, 75 MiB
        (6, 6, 64, torch.float32, 4),  # (7^3 + 7^2) × 16 KiB: 6 MiB; deeper, 43 MiB
        (5, 8, 128, torch.float64, 3),  # (9^2 + 9) × 128 KiB: 11 MiB; deeper, 101 MiB
    ],
)
def test_cpu_subtrees_hold_their_two_largest_levels_within_the_cache_cap(layers, heads, n, dtype, depth):
    """On the CPU a complete tree's subtree chunks are as deep as keeps their last two internal
    levels and the two workers' leaf blocks (3 MiB here) within 32 MiB, and a smaller memory budget
    still bounds every chunk's whole trie."""
    from pathkernels.core import checks, planner

    attn = random_attention(1, layers, heads, n, n, dtype=dtype)
    tree = pk.PathTree.complete(layers, heads, skip=True)
    net = checks.check_network(attn, None, None, None, "test")
    with num_threads(2), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # 16 MiB is a small budget at n = 128
        sizes = {stop - start for start, stop, *_ in planner.chunks(tree, net, 1 << 30, 0, tree.num_paths)}
        assert sizes == {(heads + 1) ** depth}
        budget = 16 << 20
        fixed = planner.leaf_blocks(net, budget)[2]
        for start, stop, chunk, _ in itertools.islice(planner.chunks(tree, net, budget, 0, tree.num_paths), 20):
            assert planner.trie_bytes(chunk.internal_nodes(), stop - start, net) + fixed <= budget


@pytest.mark.skipif("cuda" not in devices(), reason="needs a GPU and the CUDA kernels")
@pytest.mark.parametrize("leaf_kernel", ["fused", "tensor", "gemm", "heads"])
def test_fast_mode_error_is_bounded(leaf_kernel):
    """TF32 GEMMs: a 10-bit mantissa, so about 1e-3 relative error per level, against float32;
    the leaves through the tensor-core kernel's one TF32 pass ("fused" and "tensor" on compute
    capability ≥ 8.0) or cuBLAS ("gemm")."""
    if leaf_kernel in ("tensor", "heads") and not has_tensor_cores("cuda"):
        pytest.skip("the tensor-core leaf kernels need compute capability 8.0")
    layers = 5
    attn = random_attention(2, layers, 4, 64, 64, device="cuda")
    x = torch.randn(2, 64, 32, device="cuda")
    w_v, w_o = torch.randn(layers, 4, 32, 8, device="cuda") / 6, torch.randn(layers, 4, 8, 32, device="cuda") / 3
    before = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    for args in ({}, {"x": x, "w_v": w_v, "w_o": w_o}):
        tree = pk.PathTree.complete(layers, 4, skip=True)
        exact = pk.path_residuals(attn, tree, **args)
        fast = pk.path_residuals(attn, tree, fast=True, leaf_kernel=leaf_kernel, **args)
        relative = ((fast.ratio - exact.ratio).abs() / exact.ratio).max().item()
        assert relative < 3e-3 * layers, relative
    assert getattr(torch.backends.cuda.matmul, "fp32_precision", None) == before  # restored


def test_fast_mode_is_for_cuda_float32():
    attn = random_attention(1, 2, 2, 4, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="fast=True runs the GEMMs on TF32 tensor cores, which only CUDA float32 has"):
        pk.path_residuals(attn, pk.PathTree.complete(2, 2), fast=True)


@pytest.mark.skipif("cuda" not in devices(), reason="needs a GPU and the CUDA kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_and_cuda_agree(dtype):
    attn, x, w_v, w_o = network(2, 4, 3, 16, 8, 4, dtype=dtype)
    for tree in (pk.PathTree.complete(4, 3, skip=True), TREES["explicit"](4, 3)):
        for args in ({}, {"x": x, "w_v": w_v, "w_o": w_o}):
            cpu = pk.path_residuals(attn, tree, **args)
            gpu = pk.path_residuals(attn.cuda(), tree, **{k: v.cuda() for k, v in args.items()})
            tol = tolerance(dtype) if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-6}
            torch.testing.assert_close(gpu.residual.cpu(), cpu.residual, **tol)
            torch.testing.assert_close(gpu.norm.cpu(), cpu.norm, **tol)


def test_unbatched_inputs_and_materialize():
    attn, x, w_v, w_o = network(1, 3, 2, 5, 4, 2)
    tree = pk.PathTree.from_paths(torch.tensor([[1, -1, 0], [0, 0, 0], [1, -1, 0]]))
    result = pk.path_residuals(attn[0], tree, x=x[0], w_v=w_v, w_o=w_o, materialize=True)
    assert result.residual.shape == (3,) and result.products.shape == (3, 5, 4)
    expected = path_products_ref(attn, tree.paths(), x, w_v, w_o)[0]
    torch.testing.assert_close(result.products, expected)
    torch.testing.assert_close(result.residual, residual_norm_ref(expected))
    assert torch.equal(result.residual[0], result.residual[2])


def test_closed_form_for_blended_attention():
    # A = αI + (1−α)11ᵀ/n: res(A) = α(I − 11ᵀ/n), and products multiply the α's, so a path's
    # residual norm is (Π α) · 2(n−1)/n and its product has norm 1.
    layers, heads, n = 5, 3, 7
    alpha = torch.rand(layers, heads, dtype=torch.float64) * 0.9 + 0.05
    eye, uniform = torch.eye(n, dtype=torch.float64), torch.full((n, n), 1.0 / n, dtype=torch.float64)
    attn = alpha[..., None, None] * eye + (1 - alpha[..., None, None]) * uniform
    tree = pk.PathTree.complete(layers, heads, skip=True)
    result = pk.path_residuals(attn, tree)
    paths = tree.paths()
    factors = torch.where(paths >= 0, alpha[torch.arange(layers), paths.clamp(min=0)], torch.ones(()))
    expected = factors.prod(1) * 2 * (n - 1) / n
    torch.testing.assert_close(result.residual, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(result.norm, torch.ones_like(expected), rtol=1e-12, atol=0)


@pytest.mark.parametrize("leaf_kernel", ["fused", "tensor"])
def test_deep_float32_chain_keeps_relative_precision(device, leaf_kernel):
    # Multiplying first and centring last floors at ~1e-7 in float32; the engine carries the
    # residual itself and must match float64 to 1e-4 relative far below that, with either leaf
    # kernel (the tensor-core one at float32 accuracy; the CPU engine ignores the choice).
    if leaf_kernel == "tensor" and not has_tensor_cores(device):
        pytest.skip("the tensor-core leaf kernels need compute capability 8.0")
    n = 16
    for layers in range(12, 60, 4):
        attn = random_attention(1, layers, 1, n, n, dtype=torch.float64)
        tree = pk.PathTree.complete(layers, 1)
        truth = pk.path_residuals(attn, tree).residual.item()
        if truth < 1e-10:
            break
    assert truth < 1e-10, truth
    single = pk.path_residuals(attn.float().to(device), tree, leaf_kernel=leaf_kernel).residual.item()
    assert abs(single - truth) <= 1e-4 * truth, (single, truth)
    naive = residual_norm_ref(path_products_ref(attn.float(), tree.paths()).double()).item()
    assert abs(naive - truth) > 1e-4 * truth  # the naive route does lose it


def zero_sum_integers(batch, layers, heads, n, spread):
    """``E [B, L, H, n, n]``: integers in [-spread, spread] (the last column balances), rows summing to 0."""
    e = torch.randint(-spread, spread + 1, (batch, layers, heads, n, n), dtype=torch.float64)
    e[..., -1] = -e[..., :-1].sum(-1)
    return e


def dyadic_attention(e, delta):
    """``A = 11ᵀ/n + δE`` with δ a power of two: every entry is exact in float32 and float64 alike,
    so both engines see the same matrices, and ``C(A) = δ C(E)`` shrinks residuals by about
    δ‖C(E)‖ per head."""
    n = e.shape[-1]
    assert 1.0 / n - delta * e.abs().max() >= 0
    return 1.0 / n + delta * e


def test_float32_range_sixty_layer_chain():
    """A residual of about 1e-80 (float32's range ends at 1.2e-38): the float32 engine carries
    power-of-two scales and reports it in float64, to float32's relative precision."""
    n, layers = 8, 60
    e = zero_sum_integers(1, layers, 1, n, spread=2)
    chain = torch.eye(n, dtype=torch.float64) - 1.0 / n
    for layer in range(layers):
        chain = (e[0, layer, 0] - e[0, layer, 0].mean(0)) @ chain
    # C(A) = δ C(E): pick the power of two δ that puts the residual nearest 1e-80.
    delta = 2.0 ** round(math.log2((1e-80 / residual_norm_ref(chain).item()) ** (1 / layers)))
    attn = dyadic_attention(e, delta)
    tree = pk.PathTree.complete(layers, 1)
    truth = pk.path_residuals(attn, tree).residual.item()
    assert 1e-95 < truth < 1e-65, truth
    single = pk.path_residuals(attn.float(), tree)
    assert single.residual.dtype == torch.float64  # float32 cannot hold it
    assert single.norm.dtype == torch.float32  # the product's norm (1) can
    assert abs(single.residual.item() - truth) <= 1e-4 * truth, (single.residual.item(), truth)
    assert single.ratio.item() == pytest.approx(truth, rel=1e-4)


@pytest.mark.parametrize("leaf_kernel", ["fused", "tensor", "gemm", "heads"])
@pytest.mark.parametrize("mode", ["products", "outputs"])
def test_float32_range_across_a_tree(device, mode, leaf_kernel):
    if leaf_kernel in ("tensor", "heads") and not has_tensor_cores(device):
        pytest.skip("the tensor-core leaf kernels need compute capability 8.0")
    """Paths of every length, from residuals near 1 to far below 1e-38, in one float32 run: each
    within 1e-4 of the float64 engine on the same (exact) inputs, the norms too, whichever leaf
    kernel; and path_statistics sees the very same values."""
    layers, heads, n = 9, 2, 8
    attn = dyadic_attention(zero_sum_integers(2, layers, heads, n, spread=4), 2.0**-20)
    args = {}
    if mode == "outputs":
        _, x, w_v, w_o = network(2, layers, heads, n, 6, 3, dtype=torch.float32)
        args = {"x": x, "w_v": w_v, "w_o": w_o}
    tree = pk.PathTree.complete(layers, heads, skip=True)
    truth = pk.path_residuals(attn.to(device), tree, **{k: v.double().to(device) for k, v in args.items()})
    single = pk.path_residuals(
        attn.float().to(device), tree, leaf_kernel=leaf_kernel, **{k: v.to(device) for k, v in args.items()}
    )
    assert truth.residual.min() < 1e-42 and truth.residual.max() > 1e-3
    assert single.residual.dtype == torch.float64
    # 1e-4, or the κ bound where a path's factors cancel (random W can do that): see docs §6.
    error = ((single.residual - truth.residual).abs() / truth.residual).cpu()
    batch, path = torch.nonzero(error > 1e-4, as_tuple=True)
    if len(path):
        kappa = path_condition_numbers(attn, tree.paths()[path], **{k: v.double() for k, v in args.items()})
        bound = float32_error_bound(kappa[batch, torch.arange(len(path))], layers, n)
        assert (error[batch, path] <= bound).all(), (error[batch, path], bound)
    # The norms: 2e-4, or the same κ bound with |X| |W_p| uncentred, where the output's own entries cancel.
    error = ((single.norm.double() - truth.norm).abs() / truth.norm).cpu()
    batch, path = torch.nonzero(error > 2e-4, as_tuple=True)
    if len(path):
        kappa = output_condition_numbers(attn, tree.paths()[path], **args)
        bound = float32_error_bound(kappa[batch, torch.arange(len(path))], layers, n)
        assert (error[batch, path] <= bound).all(), (error[batch, path], bound)
    stats = pk.path_statistics(
        attn.float().to(device), tree, leaf_kernel=leaf_kernel, **{k: v.to(device) for k, v in args.items()}
    )
    lengths = tree.paths().ne(-1).sum(1)
    for b in range(2):
        for length in range(layers + 1):
            values = single.residual[b, lengths == length]
            assert stats.minima["residual"][b, length].item() == values.min().item()
            assert stats.maxima["residual"][b, length].item() == values.max().item()


@pytest.mark.filterwarnings("ignore:.*allows chunks of at most")
def test_chunks_settled_late_report_what_chunks_settled_at_once_do(device, monkeypatch):
    """The chunk pipeline (a chunk's range checks read after the next chunk is queued) changes no
    value: float32 trees whose out-of-range leaves, rerun in float64, lie in many chunks."""
    from pathkernels.core import engine

    layers, heads, n, d = 11, 1, 8, 4
    # Exact in float32 and float64 alike, so that the float64 engine sees the very same matrices.
    attn = dyadic_attention(zero_sum_integers(2, layers, heads, n, spread=2), 2.0**-7).float().to(device)
    x = torch.randn(2, n, d, device=device)
    # Value maps of 1e8 from layer 3 on: the longest paths overflow float32 (the float64 rerun).
    scales = torch.tensor([1.0] * 3 + [1e8] * 8, device=device)
    w_v = torch.eye(d, device=device).expand(layers, heads, d, d) * scales[:, None, None, None]
    w_o = torch.eye(d, device=device).expand(layers, heads, d, d).clone()
    tree = pk.PathTree.complete(layers, heads, skip=True)
    reruns = []
    monkeypatch.setattr(engine, "out_of_range_in_float64", _counted(engine.out_of_range_in_float64, reruns))
    for outputs in ({}, {"x": x, "w_v": w_v, "w_o": w_o}):
        results = {}
        for synced in (True, False):
            monkeypatch.setattr(engine, "_SYNC_CHUNKS", synced)
            results[synced] = (
                pk.path_residuals(attn, tree, memory_budget=1 << 14, **outputs),
                pk.path_statistics(attn, tree, memory_budget=1 << 14, **outputs),
            )
        (settled, stats_settled), (late, stats_late) = results[True], results[False]
        if outputs:
            assert late.residual.dtype == torch.float64  # values beyond float32's range, from the reruns
            # Those are the float64 engine's very values, rounded to float32 where it holds them (a
            # rerun of the wrong leaves would not be).
            wide = {k: v.double() for k, v in outputs.items()}
            truth = pk.path_residuals(attn.double(), tree, memory_budget=1 << 14, **wide)
            largest = torch.finfo(torch.float32).max
            beyond = truth.norm > largest
            assert bool(beyond.any())
            for got, value in ((late.norm, truth.norm), (late.residual, truth.residual)):
                reported = torch.where(value.abs() > largest, value, value.float().double())
                assert torch.equal(got[beyond], reported[beyond])
        assert torch.equal(late.residual, settled.residual) and torch.equal(late.norm, settled.norm)
        for name in ("ratio", "residual", "norm"):
            assert torch.equal(stats_late.sums[name], stats_settled.sums[name])
            assert torch.equal(stats_late.minima[name], stats_settled.minima[name])
            assert torch.equal(stats_late.maxima[name], stats_settled.maxima[name])
        assert torch.equal(stats_late.histograms["residual"], stats_settled.histograms["residual"])
    assert len(reruns) >= 8, len(reruns)  # several chunks of the outputs' tree went to float64, both ways


def _counted(function, calls: list):
    def counted(*args, **kwargs):
        calls.append(None)
        return function(*args, **kwargs)

    return counted


def test_float32_range_in_a_padded_batch():
    """A padded batch whose second group of masks holds residuals below float32's range: the
    first group's float32 results widen with it, and no value is rounded away."""
    layers, n = 30, 8
    e = zero_sum_integers(1, layers, 1, n, spread=2)
    deep = dyadic_attention(e, 2.0**-9)[0]  # [L, 1, 8, 8]: residuals far below 1e-38
    attn = torch.zeros(2, layers, 1, n + 1, n + 1, dtype=torch.float64)
    attn[0] = random_attention(layers, 1, n + 1, n + 1, dtype=torch.float64)  # every token real
    attn[1, ..., :n, :n] = deep  # token n is padding
    attn[1, ..., n, :] = 1.0 / (n + 1)
    mask = torch.ones(2, n + 1, dtype=torch.bool)
    mask[1, n] = False
    tree = pk.PathTree.complete(layers, 1)
    result = pk.path_residuals(attn.float(), tree, token_mask=mask)
    assert result.residual.dtype == torch.float64
    alone = [pk.path_residuals(attn[:1].float(), tree), pk.path_residuals(deep[None].float(), tree)]
    assert alone[0].residual.dtype == torch.float32 and alone[1].residual.item() < 1e-40
    for b in range(2):
        assert result.residual[b].item() == alone[b].residual.double().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_cpu_range_shortcut_answers_as_the_full_checks_do(dtype):
    """The CPU's one-pass range check (the extremes of a chunk's reports) against the full checks,
    with every pair of edge values placed among plain reports: where it answers "in range", no full
    check flags anything, and it says so wherever they flag nothing but for a float32 residual of
    exactly 0 (in range, but below the normal numbers the extremes test)."""
    from pathkernels.core import engine

    float32, float64 = torch.finfo(torch.float32), torch.finfo(torch.float64)
    edges = [0.0, 5e-324, float32.tiny / 2, float32.tiny, 1e-31, engine.SMALLEST_ACCURATE_FLOAT32_NORM, 1.0]
    edges += [float32.max, float32.max * (1 + 2**-20), 1e300, float64.max, math.inf, math.nan]
    plain = torch.rand(2, 5, dtype=torch.float64) + 0.5
    answers = set()
    for residual_edge, norm_edge in itertools.product(edges, repeat=2):
        residual, norm = plain.clone(), plain.clone() * 3
        residual[1, 2], norm[0, 4] = residual_edge, norm_edge
        flagged = bool(engine._full_range_flags(residual, norm, dtype).any())
        shortcut = engine._plainly_in_range(residual, norm, dtype)
        expected = not flagged and not (dtype == torch.float32 and residual_edge == 0.0)
        assert shortcut == expected, (residual_edge, norm_edge, flagged)
        answers.add(shortcut)
    assert answers == {True, False}
    assert not engine._plainly_in_range(plain[:, :0], plain[:, :0], dtype)


def test_float32_products_with_tiny_norms_come_from_float64():
    """The column means carry no scale: a float32 product below 1e-30 (here a tiny X) had a μ near
    underflow and a norm that lost digits (it was only warned about). Such leaves are now computed
    again in float64: float32 then reports the float64 values."""
    attn, x, w_v, w_o = network(1, 3, 2, 6, 5, 2, dtype=torch.float32)
    attn64 = attn.double() / attn.double().sum(-1, keepdim=True)
    tree = pk.PathTree.complete(3, 2, skip=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tiny = pk.path_residuals(attn, tree, x=x * 1e-33, w_v=w_v, w_o=w_o)
        stats = pk.path_statistics(attn, tree, x=x * 1e-33, w_v=w_v, w_o=w_o)
    exact = pk.path_residuals(attn64, tree, x=(x * 1e-33).double(), w_v=w_v.double(), w_o=w_o.double())
    for got, want in ((tiny.residual, exact.residual), (tiny.norm, exact.norm), (tiny.ratio, exact.ratio)):
        torch.testing.assert_close(got.double(), want, rtol=2e-4, atol=0)
    torch.testing.assert_close(stats.sums["ratio"].sum(), exact.ratio.sum(), rtol=2e-4, atol=0)


@pytest.mark.parametrize(
    "layers, growth",
    [(60, 1e5), (26, 1e-5), (30, 1e20)],
    ids=["to 1e+300", "to 1e-130", "past float64"],
)
def test_float32_products_across_float64s_range_agree_with_float64(layers, growth):
    """Value maps scaled by 1e5 over 60 layers (products to 1e300) gave NaN in float32; shrinking
    ones (to 1e-130) lost their column means. Both now agree with float64 to float32's precision;
    a product beyond float64's range is warned about by name, never returned as a silent NaN, in a
    float32 network and in a float64 one (which returned NaN without a word)."""
    n, d = 6, 4
    attn = random_attention(1, layers, 1, n, n, dtype=torch.float32)
    x = torch.randn(1, n, d)
    w_v = growth * torch.eye(d).expand(layers, 1, d, d).clone()
    w_o = torch.eye(d).expand(layers, 1, d, d).clone()
    tree = pk.PathTree.complete(layers, 1)
    attn64 = attn.double() / attn.double().sum(-1, keepdim=True)
    if growth > 1e6:  # float32 and float64 networks alike, every entry point of the engine
        beyond = r"1 path\(s\) lie beyond float64's range .* for example \[\[0, 0,"
        for network_args in ((attn, x, w_v, w_o), (attn64, x.double(), w_v.double(), w_o.double())):
            a, x_, v, o = network_args
            with pytest.warns(RuntimeWarning, match=beyond):
                pk.path_residuals(a, tree, x=x_, w_v=v, w_o=o)
            with pytest.warns(RuntimeWarning, match=beyond):
                pk.path_statistics(a, tree, x=x_, w_v=v, w_o=o)
        return
    got = pk.path_residuals(attn, tree, x=x, w_v=w_v, w_o=w_o)
    want = pk.path_residuals(attn64, tree, x=x.double(), w_v=w_v.double(), w_o=w_o.double())
    assert bool(torch.isfinite(got.ratio).all())
    # The residual of 60 collapsing products is 1e-29 to 1e-32 of the norm: each product's float32
    # rounding, carried through the centring, leaves it within ~4e-6 in 400 draws and 1.7e-5 in a
    # rarer one; the norm stays within 1e-8.
    torch.testing.assert_close(got.norm.double(), want.norm, rtol=1e-5, atol=0)
    for a, b in ((got.residual, want.residual), (got.ratio, want.ratio)):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=0)
    stats = pk.path_statistics(attn, tree, x=x, w_v=w_v, w_o=w_o)
    assert stats.maxima["ratio"][0, layers].item() == pytest.approx(want.ratio.item(), rel=1e-4)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sum_of_all_path_outputs_is_the_network(dtype):
    layers, heads = 4, 3
    attn, x, w_v, w_o = network(2, layers, heads, 6, 5, 2, dtype=dtype)
    tol = tolerance(dtype) if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-5}
    for skip in (True, False):
        tree = pk.PathTree.complete(layers, heads, skip=skip)
        total = pk.path_residuals(attn, tree, x=x, w_v=w_v, w_o=w_o, materialize=True).products.sum(1)
        torch.testing.assert_close(total, attention_network_ref(attn, x, w_v, w_o, skip=skip), **tol)
        sums = pk.length_sums(attn, x, w_v, w_o, skip=skip)
        torch.testing.assert_close(sums.sum(0), total, **tol)


# --- bad input ---------------------------------------------------------------------------------


def bad_call(**changes):
    attn, x, w_v, w_o = network(2, 3, 2, 4, 3, 2)
    args = {"attn": attn, "tree": pk.PathTree.complete(3, 2, skip=True), "x": x, "w_v": w_v, "w_o": w_o}
    args.update(changes)
    attn = args.pop("attn")
    tree = args.pop("tree")
    return lambda: pk.path_residuals(attn, tree, **args)


def with_zero_row():
    attn = network(2, 3, 2, 4)[0]
    attn[1, 2, 0, 3] = 0.0
    return attn


def with_nan():
    attn = network(2, 3, 2, 4)[0]
    attn[0, 1, 1, 2, 0] = float("nan")
    return attn


@pytest.mark.parametrize(
    "call, error, message",
    [
        (bad_call(attn=torch.rand(3, 4, 4)), ValueError, r"expected attn of shape \[B, L, H, n, n\] or \[L, H, n, n\]"),
        (bad_call(attn=torch.rand(2, 3, 2, 4, 5)), ValueError, "expected square attention"),
        (
            bad_call(attn=torch.ones(2, 3, 2, 4, 4, dtype=torch.int64)),
            TypeError,
            "expected attn to be float32 or float64",
        ),
        (
            bad_call(attn=torch.full((2, 3, 2, 4, 4), 0.25, dtype=torch.complex64)),
            TypeError,
            r"float32 or float64 \(float16 and bfloat16 are computed in float32\), got torch.complex64",
        ),
        (
            bad_call(x=torch.rand(2, 5, 3, dtype=torch.float64)),
            ValueError,
            r"expected x of shape \[B, n, d\] = \[2, 4, d\]",
        ),
        (bad_call(x=torch.rand(2, 4, 3)), TypeError, "expected x in attn's dtype torch.float64, got torch.float32"),
        (
            bad_call(w_v=torch.rand(3, 2, 5, 2, dtype=torch.float64)),
            ValueError,
            r"expected w_v of shape \[L, H, d, d_head\]",
        ),
        (bad_call(w_o=None), ValueError, "pass x, w_v and w_o together"),
        (
            bad_call(x=torch.rand(2, 4, 3, dtype=torch.float64, device="meta")),
            ValueError,
            "expected x on attn's device cpu",
        ),
        (
            bad_call(attn=network(2, 3, 2, 4)[0].to("meta"), x=None, w_v=None, w_o=None),
            ValueError,
            "expected attn on a CPU or CUDA device, got meta",
        ),
        (
            bad_call(attn=with_zero_row(), x=None, w_v=None, w_o=None),
            ValueError,
            r"row 3 of batch element 1, layer 2, head 0 sums to 0\..*Masked or padded",
        ),
        (
            bad_call(attn=with_nan(), x=None, w_v=None, w_o=None),
            ValueError,
            r"attn has a non-finite value \(nan\) at index \[0, 1, 1, 2, 0\]",
        ),
        (
            bad_call(tree=pk.PathTree.complete(4, 2)),
            ValueError,
            "the tree has 4 layers and 2 heads, attn has L = 3 and H = 2",
        ),
        (bad_call(tree="paths"), TypeError, "expected tree to be a pathkernels.PathTree"),
        (bad_call(memory_budget=0), ValueError, "expected memory_budget to be a positive int"),
        (
            bad_call(memory_budget=100),
            ValueError,
            r"memory_budget=100 bytes is too small: .* needs at least [\d,]+ bytes",
        ),
        (bad_call(memory_budget=1.5e9), ValueError, "expected memory_budget to be a positive int"),
        (
            bad_call(
                x=torch.rand(2, 4, 0, dtype=torch.float64),
                w_v=torch.rand(3, 2, 0, 2, dtype=torch.float64),
                w_o=torch.rand(3, 2, 2, 0, dtype=torch.float64),
            ),
            ValueError,
            r"expected x with at least one column \(d >= 1\), got \[2, 4, 0\]",
        ),
        (
            bad_call(attn=network(2, 3, 2, 4)[0][0], x=torch.rand(1, 4, 3, dtype=torch.float64)),
            ValueError,
            r"expected x of shape \[n, d\] = \[4, d\] \(attn has no batch dim\), got \[1, 4, 3\]",
        ),
    ],
)
def test_bad_input(call, error, message):
    with pytest.raises(error, match="pathkernels.path_residuals: .*" + message):
        call()


def test_materialized_products_beyond_the_budget_are_refused():
    """At the smallest budget the engine runs with (it grows with the thread count), products that
    do not fit are refused with the sizes, whatever the machine."""
    from pathkernels.core._memory import format_bytes
    from pathkernels.core.checks import check_network
    from pathkernels.core.planner import minimum_budget

    attn, x, w_v, w_o = network(2, 3, 8, 4, 3, 2)
    tree = pk.PathTree.complete(3, 8, skip=True)  # 729 paths: [2, 729, 4, 3] float64 is 137 KiB
    budget = minimum_budget(check_network(attn, x, w_v, w_o, "test"))
    message = (
        "pathkernels.path_residuals: materialize=True needs 136.69 KiB (139,968 bytes) for [B, M, n, m] = "
        f"[2, 729, 4, 3], over memory_budget={format_bytes(budget)};"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        pk.path_residuals(attn, tree, x=x, w_v=w_v, w_o=w_o, materialize=True, memory_budget=budget)


def test_the_minimum_budget_is_exact_and_small_budgets_warn():
    from pathkernels.core.checks import check_network
    from pathkernels.core.planner import minimum_budget

    attn = network(1, 3, 2, 8)[0]
    tree = pk.PathTree.complete(3, 2, skip=True)
    minimum = minimum_budget(check_network(attn, None, None, None, "test"))
    with pytest.raises(ValueError, match=f"needs at least {minimum:,} bytes"):
        pk.path_residuals(attn, tree, memory_budget=minimum - 1)
    with pytest.warns(RuntimeWarning, match=r"allows chunks of at most \d+ leaves .* a few hundred times slower"):
        small = pk.path_residuals(attn, tree, memory_budget=minimum)
    torch.testing.assert_close(small.residual, pk.path_residuals(attn, tree).residual)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default budget does not warn
        pk.path_residuals(attn, tree, memory_budget=np.int64(1 << 30))  # numpy integers are integers


def test_results_that_cannot_fit_are_refused_before_any_work():
    # 2^31 paths × B = 8, residual and norm in float32, twice over: 128 GiB, beyond any machine here.
    attn = torch.full((8, 31, 1, 2, 2), 0.5)
    tree = pk.PathTree.complete(31, 1, skip=True)
    with pytest.raises(ValueError, match=r"the results of 2,147,483,648 paths × B = 8 .* need 256.00 GiB .* available"):
        pk.path_residuals(attn, tree)


def test_inputs_that_require_grad_give_results_without_gradient():
    attn, x, w_v, w_o = network(2, 3, 2, 4, d=3, d_head=2)
    x = x.clone().requires_grad_()
    tree = pk.PathTree.complete(3, 2, skip=True)
    result = pk.path_residuals(attn.requires_grad_(), tree, x=x, w_v=w_v, w_o=w_o)
    assert not result.residual.requires_grad
    expected = pk.path_residuals(attn.detach(), tree, x=x.detach(), w_v=w_v, w_o=w_o)
    torch.testing.assert_close(result.residual, expected.residual)
    assert pk.decompose(attn, x=x, w_v=w_v, w_o=w_o).results.ratio.shape == (2, 27)
    # length_sums stays differentiable.
    pk.length_sums(attn, x, w_v, w_o).sum().backward()
    assert x.grad is not None


# --- the op itself -----------------------------------------------------------------------------


def test_fixed_size_calls_compile():
    from pathkernels.core.checks import check_network
    from pathkernels.core.engine import engine_operands
    from pathkernels.core.paths import build_trie_chunk

    attn = network(1, 3, 2, 5)[0]
    tree = pk.PathTree.complete(3, 2, skip=True)
    chunk = build_trie_chunk(tree.paths())
    operands = engine_operands(check_network(attn, None, None, None, "test"))

    def ratio(attn_c, attn_mean, root, root_mean):
        residual, norm = torch.ops.pathkernels.path_chunk_norms(
            attn_c, attn_mean, root, root_mean, None, None, chunk.parents, chunk.heads, 4
        )
        return residual / norm

    torch._dynamo.reset()
    compiled = torch.compile(ratio, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(*operands), ratio(*operands))


def _op_operands(device):
    """Valid operands of path_chunk_norms for a 3-layer, 2-head complete tree with skip."""
    from pathkernels.core.checks import check_network
    from pathkernels.core.engine import engine_operands
    from pathkernels.core.paths import build_trie_chunk

    attn = network(1, 3, 2, 5)[0].to(device)
    chunk = build_trie_chunk(pk.PathTree.complete(3, 2, skip=True).paths())
    attn_c, attn_mean, root, root_mean = engine_operands(check_network(attn, None, None, None, "test"))
    return {
        "attn_centred": attn_c,
        "attn_mean": attn_mean,
        "root": root,
        "root_mean": root_mean,
        "w_v": None,
        "w_o": None,
        "parents": list(chunk.parents),
        "heads": list(chunk.heads),
        "leaf_block": 4,
    }


def _with_level(levels, level, value):
    return [value if i == level else t for i, t in enumerate(levels)]


OP_BAD_INPUTS = [
    (lambda o: {"attn_centred": o["attn_centred"][0]}, r"expected attn \[B, L, H, n, n\], got shape \[3, 2, 5, 5\]"),
    (lambda o: {"root": o["root"][:, :4]}, r"expected root \[B, n, m\] with B = 1 and n = 5, got \[1, 4, 5\]"),
    (lambda o: {"root_mean": o["root_mean"][:, :2]}, r"expected root_mean \[B, m\] = \[1, 5\], got \[1, 2\]"),
    (
        lambda o: {
            "w_v": torch.zeros(3, 2, 5, 2, dtype=torch.float64, device=o["root"].device),
            "w_o": torch.zeros(3, 2, 3, 5, dtype=torch.float64, device=o["root"].device),
        },
        r"expected w_o \[L, H, d_head, d\] = \[3, 2, 2, 5\], got \[3, 2, 3, 5\]",
    ),
    (lambda o: {"parents": o["parents"][:2]}, "expected 3 levels of parents and heads, got 2 and 3"),
    (lambda o: {"leaf_block": 0}, "expected leaf_block > 0, got 0"),
    (
        lambda o: {"parents": _with_level(o["parents"], 1, o["parents"][1] + 3)},
        r"level 2: parent positions must lie in \[0, 3\)",
    ),
    (lambda o: {"heads": _with_level(o["heads"], 2, o["heads"][2] + 1)}, r"level 3: heads must lie in \[-1, 2\)"),
]


@pytest.mark.parametrize("change, message", OP_BAD_INPUTS)
def test_op_names_the_bad_operand(device, change, message):
    operands = _op_operands(device)
    operands.update(change(operands))
    with pytest.raises(ValueError, match="pathkernels.path_chunk_norms: " + message):
        torch.ops.pathkernels.path_chunk_norms(*operands.values())


# --- memory ------------------------------------------------------------------------------------

MEMORY_SCRIPT = textwrap.dedent("""
    import resource, sys, torch
    import pathkernels as pk
    from pathkernels.testing import random_attention
    budget = int(sys.argv[1])
    attn = random_attention(1, 6, 10, 32, 32, dtype=torch.float32)
    pk.path_residuals(attn[:, :3], pk.PathTree.complete(3, 10), memory_budget=budget)  # warm-up
    tree = pk.PathTree.complete(6, 10)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = pk.path_residuals(attn, tree, memory_budget=budget)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(len(tree), (after - before) * 1024, float(result.ratio.min()))
""")


def test_memory_budget_is_honoured_on_a_million_leaves():
    budget = 64 << 20
    out = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, str(budget)], capture_output=True, text=True, check=True, timeout=600
    ).stdout.split()
    leaves, grown, ratio = int(out[0]), int(out[1]), float(out[2])
    assert leaves == 10**6 and ratio > 0
    # The results: residual and norm [1, M] float32, paths [M, 6] int64 with one transient copy,
    # lengths [M] int64. Without chunking, the level above the leaves alone takes 10^5 nodes of
    # 32·32·4 B = 410 MB.
    results = 2 * leaves * 4 + 2 * leaves * 6 * 8 + leaves * 8
    assert grown <= budget + results + (16 << 20), f"peak grew by {grown / 2**20:.1f} MiB"


def test_progress_reports_every_path(capsys):
    attn = network(1, 4, 3, 5)[0]
    tree = pk.PathTree.complete(4, 3, skip=True)
    pk.path_residuals(attn, tree, progress=True, memory_budget=64 * 1024)
    err = capsys.readouterr().err
    assert "256" in err and "pathkernels" in err


def test_condition_numbers_bound_the_float32_error():
    from pathkernels.testing import float32_error_bound, path_condition_numbers

    attn = random_attention(2, 4, 3, 6, 6, dtype=torch.float64, temperature=0.3)
    tree = pk.PathTree.complete(4, 3, skip=True)
    kappa = path_condition_numbers(attn, tree.paths())
    assert kappa.shape == (2, len(tree)) and bool((kappa >= 1 - 1e-12).all())
    exact = pk.path_residuals(attn, tree).residual
    single = pk.path_residuals((attn / attn.sum(-1, keepdim=True)).float(), tree).residual.double()
    error = (single - exact).abs() / exact
    assert bool((error <= float32_error_bound(kappa, 4, 6) + 1e-7).all())
    # The skip-only path is C(I): no cancellation at all; products of centred factors do cancel.
    assert float(kappa[0, 0]) == pytest.approx(1.0)
    assert float(kappa[:, tree.lengths() >= 2].min()) > 1


def test_output_condition_numbers_are_one_without_cancellation_and_bound_the_norms():
    """Attention products alone are non-negative (κ = 1); with value maps of mixed signs the outputs
    cancel (κ > 1), and the float32 norms lie within the bound of that κ. Hand-worked: n = 1,
    X = [[2, -1]], W_V = [[1], [1]], W_O = [[1, 0]]: X W = [[1, 0]] and |X| |W| = [[3, 0]], so κ = 3."""
    from pathkernels.testing import float32_error_bound, output_condition_numbers

    attn = random_attention(2, 3, 2, 5, 5, dtype=torch.float64)
    tree = pk.PathTree.complete(3, 2, skip=True)
    kappa = output_condition_numbers(attn, tree.paths())
    torch.testing.assert_close(kappa, torch.ones_like(kappa), rtol=1e-12, atol=0)
    maps = {
        "x": torch.randn(2, 5, 4, dtype=torch.float64),
        "w_v": torch.randn(3, 2, 4, 2, dtype=torch.float64),
        "w_o": torch.randn(3, 2, 2, 4, dtype=torch.float64),
    }
    kappa = output_condition_numbers(attn, tree.paths(), **maps)
    assert kappa.shape == (2, len(tree)) and bool((kappa >= 1 - 1e-12).all()) and float(kappa.max()) > 1
    exact = pk.path_residuals(attn, tree, **maps).norm
    single = pk.path_residuals(
        (attn / attn.sum(-1, keepdim=True)).float(), tree, **{k: v.float() for k, v in maps.items()}
    ).norm.double()
    assert bool(((single - exact).abs() / exact <= float32_error_bound(kappa, 3, 5) + 1e-7).all())
    one = torch.ones(1, 1, 1, 1, 1, dtype=torch.float64)
    hand = {
        "x": torch.tensor([[[2.0, -1.0]]], dtype=torch.float64),
        "w_v": torch.tensor([[1.0], [1.0]], dtype=torch.float64).expand(1, 1, 2, 1),
        "w_o": torch.tensor([[1.0, 0.0]], dtype=torch.float64).expand(1, 1, 1, 2),
    }
    assert float(output_condition_numbers(one, torch.tensor([[0]]), **hand)) == pytest.approx(3.0, rel=1e-15)


@pytest.mark.parametrize("outputs", [False, True])
def test_path_chunk_norms_passes_opcheck(device, outputs):
    from pathkernels.core import ops
    from pathkernels.core.checks import check_network
    from pathkernels.core.engine import engine_operands
    from pathkernels.core.paths import build_trie_chunk

    attn, x, w_v, w_o = network(1, 3, 2, 5, d=3 if outputs else None, d_head=2 if outputs else None)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    attn, x, w_v, w_o = to(attn), to(x), to(w_v), to(w_o)
    chunk = build_trie_chunk(pk.PathTree.complete(3, 2, skip=True).paths())
    args = (
        *engine_operands(check_network(attn, x, w_v, w_o, "test")),
        w_v,
        w_o,
        list(chunk.parents),
        list(chunk.heads),
        4,
        "simt",
    )
    torch.library.opcheck(torch.ops.pathkernels.path_chunk_norms.default, args)
    residual, norm = ops.path_chunk_norms(*args)
    assert residual.shape == norm.shape == (1, 27)


# --- every head at once where the heads share their parents: PATHKERNELS_ENGINE_LEVELS and _LEAVES --


def switched_call(monkeypatch, variable, value, call, counted):
    """``call()`` with the environment variable ``variable`` set to ``value``, and how many ATen
    events named ``counted`` it ran (the engine switches' paths tell themselves apart by them)."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setenv(variable, value)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            result = call()
    finally:
        monkeypatch.delenv(variable)
    return result, sum(event.name == counted for event in prof.events())


def switch_case(tree_kind, dtype):
    """``call()``: ``pk.path_residuals`` on a case for the engine's switches, which must change no
    bit: the trees of TREES (complete_skip for the others), factored W, a small budget's many
    chunks, a float32 tree renormalised below float32's range, odd sizes (tails of every register
    tile, more heads than rows) and one parent on three threads."""
    layers, heads, n = 4, 3, 6
    tree = TREES.get(tree_kind, TREES["complete_skip"])(layers, heads)
    attn, x, w_v, w_o = network(2, layers, heads, n, dtype=dtype)
    budget, threads = 2**22, 2
    if tree_kind == "factored W":
        attn, x, w_v, w_o = network(2, layers, heads, n, 5, 2, dtype=dtype)
    elif tree_kind == "small chunks":
        budget = 20_000
    elif tree_kind == "odd sizes":
        layers, heads, n = 3, 7, 5
        attn, x, w_v, w_o = network(1, layers, heads, n, dtype=dtype)
        tree = pk.PathTree.complete(layers, heads)
    elif tree_kind == "one parent, three threads":
        layers, heads, n, threads = 1, 4, 33, 3
        attn, x, w_v, w_o = network(1, layers, heads, n, dtype=dtype)
        tree = pk.PathTree.complete(layers, heads)
    # Magnitudes over many binades, so that any change in the order of rounding would show.
    attn = torch.softmax(attn.double().log() * 3, -1).to(dtype)
    if tree_kind == "float32 range":
        layers, heads, n = 9, 2, 8
        attn = dyadic_attention(zero_sum_integers(2, layers, heads, n, spread=4), 2.0**-20).to(dtype)
        tree = pk.PathTree.complete(layers, heads, skip=True)

    def call():
        with num_threads(threads), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a small budget's warning
            return pk.path_residuals(attn, tree, x=x, w_v=w_v, w_o=w_o, memory_budget=budget)

    return call


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "tree_kind", [*TREES, "factored W", "small chunks", "float32 range", "odd sizes", "one parent, three threads"]
)
@pytest.mark.parametrize(
    "variable, counted", [("PATHKERNELS_ENGINE_LEVELS", "aten::repeat"), ("PATHKERNELS_ENGINE_LEAVES", "aten::empty")]
)
def test_engine_switches_change_no_bit_on_the_cpu(monkeypatch, dtype, tree_kind, variable, counted):
    """The levels whose heads share their parents, taken all heads at once, give the bits of the
    per-head path. PATHKERNELS_ENGINE_LEVELS: the internal levels in a fixed number of products
    whatever H (only that path repeats its parents' means or scales for the heads: aten::repeat).
    PATHKERNELS_ENGINE_LEAVES: every head's leaves of a parent block from one read of it, the CPU's
    default (the per-head leaf blocks allocate their operands block by block, that path none:
    aten::empty). Factored W keeps the per-head path; a float32 tree whose products fall below
    float32's range renormalises the same."""
    call = switch_case(tree_kind, dtype)
    call()  # a first call's one-time allocations, out of the counts
    expected, per_head = switched_call(monkeypatch, variable, "per_head", call, counted)
    got, all_heads = switched_call(monkeypatch, variable, "all_heads", call, counted)
    assert torch.equal(got.residual, expected.residual) and torch.equal(got.norm, expected.norm)
    one_layer = tree_kind == "one parent, three threads"  # no internal level
    if tree_kind != "explicit":  # (whose levels may, rarely, branch fully)
        taken = tree_kind != "factored W" and not (one_layer and variable == "PATHKERNELS_ENGINE_LEVELS")
        assert (all_heads != per_head) == taken, (all_heads, per_head)
    if tree_kind == "float32 range":
        assert float(expected.residual.min()) < 1e-40  # renormalised: below float32's smallest normal


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("tree_kind", ["complete_skip", "small chunks", "float32 range", "odd sizes"])
def test_every_leaf_reduction_entry_gives_the_same_bits(monkeypatch, dtype, tree_kind):
    """The leaves' norms through each entry of the reduction (its row sums as FMAs of 1 on AVX-512
    and AVX2, as adds in the portable code) have the bits of the default: unscaled and scaled
    (renormalised float32) leaves, and tails of rows and columns (n = 5)."""
    call = switch_case(tree_kind, dtype)
    expected = call()
    entries = cpu_kernel_isas()
    assert "portable" in entries
    for isa in entries:
        monkeypatch.setenv("PATHKERNELS_ENGINE_REDUCTION_ISA", isa)
        got = call()
        assert torch.equal(got.residual, expected.residual) and torch.equal(got.norm, expected.norm), isa


@pytest.mark.parametrize(
    "variable, message",
    [
        (
            "PATHKERNELS_ENGINE_LEVELS",
            r"expected PATHKERNELS_ENGINE_LEVELS in \['auto', 'per_head', 'all_heads'\] or unset",
        ),
        (
            "PATHKERNELS_ENGINE_LEAVES",
            r"expected PATHKERNELS_ENGINE_LEAVES in \['auto', 'all_heads', 'per_head'\] or unset",
        ),
        (
            "PATHKERNELS_ENGINE_REDUCTION_ISA",
            r"\(PATHKERNELS_ENGINE_REDUCTION_ISA\): expected isa in \('auto', 'avx512'",
        ),
    ],
)
def test_engine_switches_are_checked(monkeypatch, variable, message):
    attn = random_attention(1, 3, 2, 4, 4)
    monkeypatch.setenv(variable, "batched")
    with pytest.raises(ValueError, match=rf"{message}.*, got 'batched'"):
        pk.path_residuals(attn, pk.PathTree.complete(3, 2))
    monkeypatch.setenv(variable, "portable" if variable.endswith("ISA") else "per_head")
    pk.path_residuals(attn, pk.PathTree.complete(3, 2))


@pytest.mark.skipif("cuda" not in devices(), reason="needs a GPU and the CUDA kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_all_heads_levels_agree_with_the_cpu(monkeypatch, dtype):
    """On the GPU the internal levels go through one batched cuBLAS product into strided views of the
    level: the same numbers as the CPU's engine (cuBLAS may round apart), complete, pruned and
    renormalised trees."""
    attn, _, _, _ = network(2, 5, 4, 16, dtype=dtype)
    deep = dyadic_attention(zero_sum_integers(2, 9, 2, 8, spread=4), 2.0**-20).to(dtype)
    cases = [
        (attn, pk.PathTree.complete(5, 4)),
        (attn, pk.PathTree.complete(5, 4, skip=True, max_length=3)),
        (deep, pk.PathTree.complete(9, 2, skip=True)),
    ]
    for network_attn, tree in cases:
        cpu = pk.path_residuals(network_attn, tree)
        on_gpu = network_attn.cuda()
        gpu, repeats = switched_call(
            monkeypatch,
            "PATHKERNELS_ENGINE_LEVELS",
            "all_heads",
            lambda a=on_gpu, t=tree: pk.path_residuals(a, t),
            "aten::repeat",
        )
        assert repeats > 0
        tol = tolerance(dtype) if dtype == torch.float64 else {"rtol": 1e-4, "atol": 0}
        torch.testing.assert_close(gpu.residual.cpu(), cpu.residual, **tol)
        torch.testing.assert_close(gpu.norm.cpu(), cpu.norm, **tol)
