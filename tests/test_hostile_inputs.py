"""Hostile inputs to the ops: each gives a clear error that names the op and the argument, never a
silently wrong number: the reproducers of what the fuzz found."""

import math

import pytest
import torch

import pathkernels as pk
from pathkernels.testing import random_attention


def chunk_inputs(device="cpu"):
    """The smallest valid path_chunk_norms call: one 2×2 attention matrix, one leaf."""
    attn = torch.zeros(1, 1, 1, 2, 2, dtype=torch.float64, device=device)
    mean = torch.full((1, 1, 1, 2), 0.5, dtype=torch.float64, device=device)
    root = torch.tensor([[[0.5, -0.5], [-0.5, 0.5]]], dtype=torch.float64, device=device)
    index = [torch.zeros(1, dtype=torch.long, device=device)]
    return [attn, mean, root, mean[0, 0], None, None, index, index, 64]


@pytest.mark.parametrize("meta_argument", [0, 1, 2, 3])
def test_a_mix_of_meta_and_cpu_tensors_is_refused(meta_argument):
    """A meta tensor among CPU ones dispatches to the fake kernel, which returned uninitialised CPU
    memory."""
    args = chunk_inputs()
    args[meta_argument] = args[meta_argument].to("meta")
    with pytest.raises(ValueError, match=r"path_chunk_norms: expected every tensor on one device, got .* on meta"):
        torch.ops.pathkernels.path_chunk_norms(*args)


def test_the_other_ops_refuse_a_device_mix():
    attn = random_attention(3, 3, dtype=torch.float64)
    right, mean = torch.randn(3, 2, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"_fused_leaf_norms: expected every tensor on one device"):
        torch.ops.pathkernels._fused_leaf_norms(attn, right.to("meta"), mean)
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    parts, argmax = torch.ops.pathkernels.norm_parts(x, True, True)
    with pytest.raises(ValueError, match=r"norm_parts_backward: expected every tensor on one device"):
        torch.ops.pathkernels.norm_parts_backward(parts.to("meta"), x, parts, argmax, True, True)
    with pytest.raises(ValueError, match=r"_engine_mm: expected every tensor on one device"):
        torch.ops.pathkernels._engine_mm(attn, attn.to("meta"), "auto")


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
@pytest.mark.parametrize("which", ["parents", "heads"])
def test_index_tensors_of_a_non_integer_dtype_are_refused(device, dtype, which):
    """A float or bool index was truncated to some other node."""
    args = chunk_inputs(device)
    position = 6 if which == "parents" else 7
    args[position] = [args[position][0].to(dtype)]
    with pytest.raises(TypeError, match=rf"level 1: expected parents and heads of an integer dtype .*got {dtype}"):
        torch.ops.pathkernels.path_chunk_norms(*args)


def test_empty_matrices_are_refused_by_the_op():
    """n = 0 or m = 0 failed an internal assert that asked to report a bug to PyTorch."""
    args = chunk_inputs()
    args[0], args[1] = torch.zeros(1, 1, 1, 0, 0, dtype=torch.float64), torch.zeros(1, 1, 1, 0, dtype=torch.float64)
    args[2], args[3] = torch.zeros(1, 0, 2, dtype=torch.float64), torch.zeros(1, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"path_chunk_norms: expected attn \[B, L, H, n, n\] with L, H and n at least"):
        torch.ops.pathkernels.path_chunk_norms(*args)
    args = chunk_inputs()
    args[2], args[3] = torch.zeros(1, 2, 0, dtype=torch.float64), torch.zeros(1, 0, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"path_chunk_norms: expected root \[B, n, m\] with m >= 1, got \[1, 2, 0\]"):
        torch.ops.pathkernels.path_chunk_norms(*args)


def test_a_huge_leaf_block_is_the_whole_chunk():
    """leaf_block = 2^63 − 1 overflowed the block loop; it now means one block of every leaf, and
    gives what the planner's blocks give (the CPU engine's results do not depend on the blocks)."""
    from pathkernels.core.checks import check_network
    from pathkernels.core.engine import chunk_norms, engine_operands
    from pathkernels.core.planner import chunks

    attn = random_attention(2, 3, 2, 5, 5, dtype=torch.float64)
    tree = pk.PathTree.complete(3, 2, skip=True)
    net = check_network(attn, None, None, None, "test")
    operands = engine_operands(net)
    for _, _, chunk, leaf_block in chunks(tree, net, pk.DEFAULT_MEMORY_BUDGET, 0, tree.num_leaves):
        expected = chunk_norms(net, operands, chunk, leaf_block, "simt")
        got = chunk_norms(net, operands, chunk, 2**63 - 1, "simt")
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def small_network():
    attn = random_attention(1, 2, 2, 3, 3, dtype=torch.float64)
    x, w = torch.randn(1, 3, 2, dtype=torch.float64), torch.randn(2, 2, 2, 2, dtype=torch.float64)
    return attn, x, w


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda: pk.count_paths(2, -3, skip=True),
            ValueError,
            r"count_paths: expected num_heads in \[1, 2147483647\], got -3",
        ),
        (lambda: pk.count_paths(-1, 2), ValueError, r"count_paths: expected num_layers in \[1, 2147483647\], got -1"),
        (lambda: pk.count_paths(2, 2, skip="no"), TypeError, r"count_paths: expected skip to be True or False"),
        (
            lambda: pk.count_by_length(2, 0),
            ValueError,
            r"count_by_length: expected num_heads in \[1, 2147483647\], got 0",
        ),
        (
            lambda: pk.length_sums(*small_network(), small_network()[2], skip="no"),
            TypeError,
            r"length_sums: expected skip to be True or False, got str 'no'",
        ),
        (
            lambda: pk.truncated_output(torch.randn(3), 1),
            ValueError,
            r"truncated_output: expected sums \[L\+1, B, n, d\] or \[L\+1, n, d\] from pk.length_sums, got \[3\]",
        ),
        (
            lambda: pk.truncated_output(torch.randn(3, 2, 2), True),
            TypeError,
            r"truncated_output: expected max_length to be an int, got bool True",
        ),
        (
            lambda: pk.decompose(small_network()[0], max_result_bytes=-1),
            ValueError,
            r"decompose: expected max_result_bytes >= 0, got -1",
        ),
        (
            lambda: pk.decompose(small_network()[0], skip="yes"),
            TypeError,
            r"decompose: expected skip to be True or False",
        ),
        (
            lambda: pk.nn.DeEscalation(tau=float("nan")),
            ValueError,
            r"DeEscalation: expected tau to be a finite real number, got nan",
        ),
    ],
)
def test_arguments_are_validated_in_the_name_of_the_function_called(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("length", [-1, 3, 99])
def test_top_refuses_a_length_the_tree_has_not(length):
    """top(length=99) and top(length=-1) returned [] (or the last length's paths)."""
    stats = pk.path_statistics(small_network()[0], pk.PathTree.complete(2, 2, skip=True), top_k=2)
    with pytest.raises(ValueError, match=rf"PathStatistics.top: expected length in \[0, 2\], got {length}"):
        stats.top(length=length)
    with pytest.raises(ValueError, match=r"PathStatistics.top: expected batch_element in \[0, 0\], got 1"):
        stats.top(batch_element=1)


def test_the_fused_leaf_op_refuses_scales_that_are_not_positive():
    """A negative scale gave a negative norm."""
    attn = random_attention(3, 3, dtype=torch.float64)
    right, mean = torch.randn(3, 2, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)
    for bad in (-1.0, 0.0, float("nan"), float("inf")):
        scale = torch.tensor([1.0, bad], dtype=torch.float64)
        with pytest.raises(ValueError, match=r"_fused_leaf_norms: expected every scale to be a positive finite"):
            torch.ops.pathkernels._fused_leaf_norms(attn, right, mean, scale)


@pytest.mark.parametrize("damage", ["nan", "descending", "zero"])
def test_the_statistics_fold_refuses_edges_it_cannot_bin_by(damage):
    """NaN or descending edges were accepted (a NaN edge was cast to int64)."""
    from pathkernels.core.statistics import PathStatistics, histogram_edges

    tree = pk.PathTree.complete(2, 2, skip=True)
    stats = PathStatistics.empty(1, tree, torch.float64, 1, 0, "cpu")
    edges = histogram_edges(1).clone()
    if damage == "nan":
        edges[5] = float("nan")
    elif damage == "descending":
        edges = edges.flip(0)
    else:
        edges[0] = 0.0
    residual, norm = torch.rand(1, 9, dtype=torch.float64), torch.rand(1, 9, dtype=torch.float64) + 1
    first = torch.full((2, 3, 1, 3), -1, dtype=torch.long)
    packed = {name: stats._packed(name, keys) for name, keys in (("sums", ("ratio", "residual", "norm")),)}
    # The numbers are formatted as strings (streamed, they crashed a GCC 13 build): edge 5 is nan.
    detail = {"nan": r"edge 5 is nan after \d", "descending": r"edge 1 is \d.* after \d", "zero": r"edge 0 is 0$"}
    message = r"_statistics_update: expected edges to be positive, finite and strictly ascending; " + detail[damage]
    with pytest.raises(ValueError, match=message):
        torch.ops.pathkernels._statistics_update(
            residual,
            norm,
            tree.lengths(),
            edges,
            stats.counts,
            stats.log10_ratio_sums,
            packed["sums"],
            stats._packed("sums_of_squares", ("ratio", "residual", "norm")),
            stats._packed("minima", ("ratio", "residual", "norm")),
            stats._packed("maxima", ("ratio", "residual", "norm")),
            first[0],
            first[1],
            stats._packed("histograms", ("ratio", "residual")),
        )


def test_the_testing_helpers_refuse_heads_outside_the_network():
    """A head of -7 was read as skip."""
    from pathkernels.reference import path_products_ref
    from pathkernels.testing import path_condition_numbers

    attn = random_attention(1, 2, 2, 3, 3, dtype=torch.float64)
    for helper, name in (
        (path_condition_numbers, "testing.path_condition_numbers"),
        (path_products_ref, "path_products_ref"),
    ):
        with pytest.raises(ValueError, match=rf"{name}: expected heads in \[-1, 2\), got values in \[-7, 0\]"):
            helper(attn, torch.tensor([[-7, 0]]))
        with pytest.raises(ValueError, match=rf"{name}: expected paths \[M, L\] with L = 2 layers, got \[1, 3\]"):
            helper(attn, torch.tensor([[0, 0, 0]]))


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: pk.decompose(random_attention(1, 30, 30, 3, 3, dtype=torch.float64)),
            r"^pathkernels.decompose: the exact tree has [\d,]+ paths, more than even streamed statistics index",
        ),
        (lambda: pk.compat.composite_norm(torch.randn(3)), r"^pathkernels.compat.composite_norm: expected x to have"),
        (lambda: pk.compat.l1_matrix_norm(torch.randn(3)), r"^pathkernels.compat.l1_matrix_norm: expected x to have"),
        (lambda: pk.compat.linf_matrix_norm(torch.randn(3)), r"^pathkernels.compat.linf_matrix_norm: expected x"),
        (
            lambda: pk.metrics.rank1_residual(torch.full((2, 3, 3), float("nan"))),
            r"^pathkernels.metrics.rank1_residual: x has a non-finite value \(nan\) at index \[0, 0, 0\]",
        ),
        (
            lambda: pk.metrics.rank1_residual(torch.full((2, 3, 3), float("inf")), norm="composite"),
            r"^pathkernels.metrics.rank1_residual: x has a non-finite value \(inf\) at index \[0, 0, 0\]",
        ),
    ],
)
def test_errors_name_the_function_the_user_called(call, message):
    """decompose's errors named PathTree.complete, compat's named matrix_norms, and NaN reached
    the SVD as a LinAlgError."""
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("scale", [1e200, 1e-200])
def test_composite_norms_of_matrices_beyond_the_square_root_of_the_range(scale):
    """sqrt(l1 · linf) overflowed to inf above ~1e154 and underflowed to 0 below ~1e-154 in float64,
    though the norm itself is in range."""
    x = torch.full((2, 3), scale, dtype=torch.float64)
    expected = math.sqrt(6) * scale  # l1 = 2 · scale, linf = 3 · scale
    assert pk.composite_norm(x).item() == pytest.approx(expected, rel=1e-15)
    assert pk.matrix_norms(x).composite.item() == pytest.approx(expected, rel=1e-15)
    # Rows 2·scale and scale: the residual's rows are ±scale/2, so l1 = scale and linf = 1.5 · scale.
    two_rows = x + torch.tensor([[scale], [0.0]], dtype=torch.float64)
    assert pk.residual_norm(two_rows).item() == pytest.approx(math.sqrt(1.5) * scale, rel=1e-15)


def test_length_sums_refuse_work_that_would_not_fit(monkeypatch):
    """Its largest step, [L, B, H, n, d], failed in torch's allocator; the estimate comes first."""
    from pathkernels.core import _memory as module  # where every memory check reads the device's free memory

    attn = random_attention(2, 3, 2, 5, 5, dtype=torch.float64)
    x, w = torch.randn(2, 5, 4, dtype=torch.float64), torch.randn(3, 2, 4, 4, dtype=torch.float64)
    need = (3 * 2 + 3 * 4) * 2 * 5 * 4 * 8 + 9 * 2 * 3 * 2 * 5 * 5  # the sums, and the checks' copies of attn
    monkeypatch.setattr(module, "available_memory", lambda device: need - 1)
    with pytest.raises(ValueError, match=r"length_sums: 3 layers × 2 heads of \[B, n, d\] = \[2, 5, 4\] sums need"):
        pk.length_sums(attn, x, w, w)
    monkeypatch.setattr(module, "available_memory", lambda device: need)
    assert pk.length_sums(attn, x, w, w).shape == (4, 2, 5, 4)


METRICS = [
    "residual_ratio",
    "token_similarity",
    "token_diversity",
    "escalation_rate",
    "effective_rank",
    "stable_rank",
    "dobrushin",
    "token_cosine_similarity",
    "rank1_residual",
]
HOSTILE_MATRICES = {
    "integer": lambda: torch.ones(2, 3, 3, dtype=torch.long),
    "complex": lambda: torch.ones(2, 3, 3, dtype=torch.complex64),
    "one dim": lambda: torch.ones(3),
    "no rows": lambda: torch.ones(2, 0, 3),
    "no columns": lambda: torch.ones(2, 3, 0),
    "meta": lambda: torch.ones(2, 3, 3, device="meta"),
    "empty list": lambda: [],
    "shapes differ": lambda: [torch.ones(3, 3), torch.ones(2, 3)],
    "nested lists": lambda: [[1.0, 2.0], [3.0, 4.0]],  # was a raw AttributeError ('list' has no shape)
}


@pytest.mark.parametrize("hostile", sorted(HOSTILE_MATRICES))
@pytest.mark.parametrize("metric", METRICS)
def test_metrics_refuse_hostile_matrices_in_their_own_name(metric, hostile):
    """No column, the meta device and NaN before an SVD raised torch's errors (IndexError,
    RuntimeError, LinAlgError); token_diversity named token_similarity."""
    with pytest.raises((ValueError, TypeError), match=rf"^pathkernels\.metrics\.{metric}: expected"):
        getattr(pk.metrics, metric)(HOSTILE_MATRICES[hostile]())


@pytest.mark.parametrize("metric", ["effective_rank", "stable_rank", "rank1_residual"])
def test_svd_metrics_refuse_nan(metric):
    with pytest.raises(
        ValueError, match=rf"^pathkernels\.metrics\.{metric}: x has a non-finite value \(nan\) at index \[0, 0, 0\]"
    ):
        getattr(pk.metrics, metric)(torch.full((2, 3, 3), float("nan")))


def test_result_methods_refuse_hostile_arguments_in_their_own_name():
    """top('2') raised a raw comparison TypeError, leaf_paths(slice) an AttributeError, and
    plot(path=3) matplotlib's AttributeError."""
    attn = torch.softmax(torch.randn(1, 3, 2, 4, 4, dtype=torch.float64), -1)
    tree = pk.PathTree.complete(3, 2)
    x = torch.randn(1, 4, 3, dtype=torch.float64)
    w = torch.randn(3, 2, 3, 3, dtype=torch.float64)
    stats = pk.path_statistics(attn, tree, top_k=2)
    decomposition = pk.decompose(attn, x=x, w_v=w, w_o=w)
    with pytest.raises(TypeError, match=r"^pathkernels\.PathStatistics\.top: expected top_k to be an int, got str '2'"):
        stats.top("2")
    with pytest.raises(TypeError, match=r"^pathkernels\.PathTree\.leaf_paths: expected leaves as a 1-D integer"):
        tree.leaf_paths(slice(0, 2))
    with pytest.raises(ValueError, match=r"^pathkernels\.PathTree\.leaf_paths: expected leaves in \[0, 8\), got"):
        tree.leaf_paths(torch.tensor([9]))
    for result, name in ((stats, "PathStatistics"), (decomposition, "PathDecomposition")):
        with pytest.raises(TypeError, match=rf"^pathkernels\.{name}\.plot: expected path to be a str or os\.PathLike"):
            result.plot(path=3)
        # A folder that does not exist, refused before the figure is drawn (matplotlib's
        # FileNotFoundError came after it), as PathStatistics.save refuses it.
        with pytest.raises(
            ValueError, match=rf"^pathkernels\.{name}\.plot: cannot write .*its folder .* does not exist"
        ):
            result.plot(path="/nonexistent-folder/figure.png")


@pytest.mark.parametrize("deviation", [1e-5, 1e-7, -1e-6])
def test_float64_attention_rows_must_sum_to_one_within_1e_8(deviation):
    """float64 patterns sum to 1 within 1e-8 (ROW_SUM_TOLERANCE; a float64 softmax within 1e-16):
    a row off by 1e-7 … 1e-5 is refused by every engine function, by name, and one off by 1e-10 is
    taken. A tolerance raised to 1e-3 was caught only by an adapter test that skips without
    transformers; this one needs neither transformers nor TransformerLens."""
    attn = random_attention(2, 2, 2, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x = torch.randn(2, 4, 3, dtype=torch.float64)
    w = torch.randn(2, 2, 3, 3, dtype=torch.float64)
    tree = pk.PathTree.complete(2, 2, skip=True)
    calls = {
        "path_residuals": lambda a: pk.path_residuals(a, tree),
        "path_statistics": lambda a: pk.path_statistics(a, tree),
        "decompose": lambda a: pk.decompose(a),
        "length_sums": lambda a: pk.length_sums(a, x, w, w),
    }
    off, close = attn.clone(), attn.clone()
    off[1, 1, 0, 2] *= 1 + deviation  # one row of batch element 1, layer 1, head 0
    close[1, 1, 0, 2] *= 1 + 1e-10
    for name, call in calls.items():
        with pytest.raises(
            ValueError,
            match=rf"^pathkernels\.{name}: attention rows must sum to 1 .* row 2 of batch element 1, layer 1, "
            rf"head 0 sums to {1 + deviation:.9g}",
        ):
            call(off)
        call(close)  # within 1e-8: taken


def test_w_path_refuses_entries_that_are_not_heads():
    """stack.w_path([0.5, -1, 1]) took 0.5 as head 0 (int() truncates), True as head 1 and "1" as 1."""
    from pathkernels.adapters.stack import AttentionStack

    attn = random_attention(1, 3, 2, 4, 4, dtype=torch.float64)
    w = torch.randn(3, 2, 5, 5, dtype=torch.float64)
    stack = AttentionStack(attn=attn, w_v=w, w_o=w, b_o=torch.zeros(3, 5, dtype=torch.float64))
    for path in ([0.5, -1, 1], [True, -1, 1], ["1", -1, 1], torch.tensor([0.0, -1.0, 1.0]), "01-", 3):
        with pytest.raises(TypeError, match=r"^pathkernels\.AttentionStack\.w_path: expected a path of 3 entries"):
            stack.w_path(path)
    with pytest.raises(ValueError, match=r"^pathkernels\.AttentionStack\.w_path: expected a path of 3 entries.*got"):
        stack.w_path([0, -1, 2])
    left, right = stack.w_path(torch.tensor([1, -1, 0]))
    torch.testing.assert_close(left @ right, w[0, 1] @ w[0, 1] @ w[2, 0] @ w[2, 0])


def test_huge_expanded_inputs_are_refused_at_once():
    """Expanded (stride-0) inputs hold few values but name 10^10 to 10^12 entries: norms that would
    reduce them for many minutes, and functions whose float64 working copies exceed memory (a raw
    allocator error before), are refused by name within a second."""
    import time

    cases = {
        "pathkernels.residual_norm": lambda: pk.residual_norm(torch.ones(1, 1).expand(10**6, 10**6)),
        "pathkernels.composite_norm": lambda: pk.composite_norm(torch.ones(1, 1, 1).expand(10**4, 10**4, 10**4)),
        "pathkernels.matrix_norms": lambda: pk.matrix_norms(torch.ones(1, 1).expand(10**6, 10**6), residual=True),
        "pathkernels.metrics.residual_ratio": lambda: pk.metrics.residual_ratio(
            torch.ones(1, 1, 1).expand(10**4, 10**4, 10**4)
        ),
        "pathkernels.rollout": lambda: pk.rollout(torch.full((1, 1, 1, 1, 1), 1.0).expand(1, 10**5, 1, 10**4, 10**4)),
        "pathkernels.path_residuals": lambda: pk.path_residuals(
            torch.full((1, 1, 1, 1, 1), 1.0).expand(1, 1, 1, 10**5, 10**5), pk.PathTree.complete(1, 1)
        ),
    }
    for where, call in cases.items():
        start = time.monotonic()
        with pytest.raises(ValueError, match="^" + where.replace(".", r"\.") + r": .*(entries|need)"):
            call()
        assert time.monotonic() - start < 1.0, where
    # What such an input holds is still checked, once per distinct value.
    nan = torch.full((1, 1, 1, 1, 1), float("nan")).expand(1, 2, 1, 3, 3)
    with pytest.raises(ValueError, match=r"^pathkernels\.path_residuals: attn has a non-finite value \(nan\)"):
        pk.path_residuals(nan, pk.PathTree.complete(2, 1))
