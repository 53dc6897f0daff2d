"""Property-based tests (hypothesis): the ops and the engine against float64 references over
shapes, dtypes, trees, budgets, masks and edge values, and every op safe to call with bad indices.

Two profiles (tests/conftest.py): ``quick`` (the default, part of ``make test``, under a minute)
and ``long`` for a fuzzing run: ``pytest tests/test_properties.py --hypothesis-profile=long``.
"""

import warnings

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import pathkernels as pk  # noqa: E402
from pathkernels.core.checks import check_network  # noqa: E402
from pathkernels.core.planner import minimum_budget  # noqa: E402
from pathkernels.reference import (  # noqa: E402
    attention_network_ref,
    composite_norm_ref,
    fused_leaf_norms_ref,
    matrix_norms_ref,
    path_products_ref,
    residual_norm_ref,
)
from pathkernels.testing import leaf_kernel_slack, num_threads, random_attention, tolerance  # noqa: E402

DTYPES = st.sampled_from([torch.float32, torch.float64])


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@st.composite
def matrices(draw):
    """A batch of matrices [*lead, n, m] with edge values: zeros, equal rows, huge and tiny scales,
    single rows or columns, empty batches and non-contiguous layouts."""
    lead = draw(st.lists(st.integers(0, 3), max_size=2))
    n, m = draw(st.integers(1, 9)), draw(st.integers(0, 9))
    dtype = draw(DTYPES)
    kind = draw(st.sampled_from(["normal", "zeros", "equal_rows", "huge", "tiny", "integers"]))
    g = _generator(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(*lead, n, m, generator=g, dtype=torch.float64)
    if kind == "zeros":
        x.zero_()
    elif kind == "equal_rows":
        x = x[..., :1, :].expand_as(x).clone()
    elif kind == "huge":
        x *= 1e30 if dtype == torch.float64 else 1e15
    elif kind == "tiny":
        x *= 1e-30 if dtype == torch.float64 else 1e-15
    elif kind == "integers":
        x = x.mul(3).round()
    x = x.to(dtype)
    if draw(st.booleans()) and x.dim() >= 2:  # a transposed layout, same values
        x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
    return x


@given(x=matrices(), residual=st.booleans())
def test_norm_ops_match_the_float64_reference(x, residual):
    wide = x.double()
    # float32 rounds the result once; the kernels accumulate in float64, so only that rounding
    # and the float32 rounding of the centred entries remain (scaled by the magnitudes involved).
    close = tolerance(x.dtype) | {
        "atol": tolerance(x.dtype)["atol"] * float(wide.abs().amax().clamp_min(1)) if x.numel() else 0.0
    }
    l1, linf, composite = pk.matrix_norms(x, residual=residual)
    expected = matrix_norms_ref(wide - wide.mean(-2, keepdim=True) if residual else wide)
    for got, want in zip((l1, linf, composite), expected):
        assert got.shape == x.shape[:-2] and got.dtype == x.dtype
        torch.testing.assert_close(got.double(), want, **close)
    res, norm = pk.residual_norm(x, return_norm=True)
    torch.testing.assert_close(res.double(), residual_norm_ref(wide), **close)
    torch.testing.assert_close(norm.double(), composite_norm_ref(wide), **close)
    assert torch.equal(pk.residual_norm(x), res)  # the residual-only pass gives the same bits


@st.composite
def networks(draw):
    batch, layers, heads = draw(st.integers(1, 2)), draw(st.integers(1, 4)), draw(st.integers(1, 3))
    n = draw(st.integers(1, 6))
    dtype = draw(DTYPES)
    g = _generator(draw(st.integers(0, 2**31 - 1)))
    temperature = draw(st.sampled_from([0.3, 1.0, 5.0]))
    attn = random_attention(batch, layers, heads, n, n, dtype=dtype, generator=g, temperature=temperature)
    outputs = None
    if draw(st.booleans()):
        d, d_head = draw(st.integers(1, 5)), draw(st.integers(1, 3))
        outputs = (
            torch.randn(batch, n, d, generator=g, dtype=torch.float64).to(dtype),
            (torch.randn(layers, heads, d, d_head, generator=g, dtype=torch.float64) * d**-0.5).to(dtype),
            (torch.randn(layers, heads, d_head, d, generator=g, dtype=torch.float64) * d_head**-0.5).to(dtype),
        )
    return attn, outputs


@st.composite
def trees(draw, layers: int, heads: int):
    kind = draw(st.sampled_from(["complete", "max_length", "explicit"]))
    skip = draw(st.booleans()) or kind == "max_length"
    if kind == "complete":
        return pk.PathTree.complete(layers, heads, skip=skip)
    if kind == "max_length":
        return pk.PathTree.complete(layers, heads, skip=True, max_length=draw(st.integers(0, layers)))
    # Any set of paths, in any order, with duplicates.
    paths = draw(
        st.lists(
            st.lists(st.integers(-1 if skip else 0, heads - 1), min_size=layers, max_size=layers),
            min_size=1,
            max_size=12,
        )
    )
    return pk.PathTree.from_paths(paths, num_heads=heads)


@given(data=st.data(), network=networks())
def test_path_residuals_match_the_per_path_float64_loop(data, network):
    attn, outputs = network
    layers, heads = attn.shape[1], attn.shape[2]
    tree = data.draw(trees(layers, heads))
    x, w_v, w_o = outputs if outputs is not None else (None, None, None)
    minimum = minimum_budget(check_network(attn, x, w_v, w_o, "test"))
    budget = data.draw(st.sampled_from([minimum, 4 * minimum, 1 << 20, 1 << 30]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # small budgets warn that they are slow
        result = pk.path_residuals(attn, tree, x=x, w_v=w_v, w_o=w_o, memory_budget=budget)
    wide = [None if t is None else t.double() for t in (x, w_v, w_o)]
    attn64 = attn.double()
    attn64 = attn64 / attn64.sum(-1, keepdim=True)  # the rows of float32 softmax sum to 1 within 1e-7
    products = path_products_ref(attn64, tree.paths(), *wide)
    # The engine measures the centred chain C(A_L)⋯C(A_1) C(X) W (docs/DESIGN.md §1); in float32 the
    # rounding of each factor enters relative to the factors' magnitudes, hence the absolute term.
    scale = 1.0 if x is None else float(products.abs().amax().clamp_min(1))
    close = (
        {"rtol": 1e-10, "atol": 1e-10 * scale}
        if attn.dtype == torch.float64
        else {"rtol": 1e-4, "atol": 1e-5 * scale * layers}
    )
    assert result.residual.shape == (attn.shape[0], len(tree))
    torch.testing.assert_close(result.residual.double(), residual_norm_ref(products), **close)
    torch.testing.assert_close(result.norm.double(), composite_norm_ref(products), **close)


LEAF_KERNELS = st.sampled_from(
    [(torch.float64, "simt"), (torch.float32, "simt"), (torch.float32, "tf32x3"), (torch.float32, "tf32")]
)


@given(
    n=st.integers(1, 128),
    count=st.integers(0, 3),
    m=st.integers(1, 140),
    kernel=LEAF_KERNELS,
    kind=st.sampled_from(["normal", "zeros", "integers", "huge", "tiny", "dyadic"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_fused_leaf_kernels_match_the_float64_reference(n, count, m, kernel, kind, seed):
    """Every fused leaf kernel's per-thread code (CPU harness; the tensor-core kernels' mma
    emulated) over tile edges (n across 32/64/128 rows, m across 64-column tiles) and values:
    zero leaves, integers and dyadic values (exact in TF32's 11 bits: 3×TF32 and one TF32 pass
    are then as exact as CUDA cores), and magnitudes near float32's ends."""
    dtype, name = kernel
    g = _generator(seed)
    attn = torch.randn(n, n, generator=g, dtype=torch.float64)
    right = torch.randn(n, count, m, generator=g, dtype=torch.float64)
    mean = torch.randn(count, m, generator=g, dtype=torch.float64)
    if kind == "zeros":
        right.zero_()
    elif kind in ("integers", "dyadic"):
        attn, right, mean = attn.mul(4).round(), right.mul(4).round(), mean.mul(4).round()
        if kind == "dyadic":
            attn, right = attn / 8, right * 2.0**-20
    elif kind == "huge":
        right *= 1e30 if dtype == torch.float64 else 1e15
    elif kind == "tiny":
        right *= 1e-30 if dtype == torch.float64 else 1e-15
    attn, right, mean = attn.to(dtype), right.to(dtype), mean.to(dtype)
    residual, norm = torch.ops.pathkernels._fused_leaf_norms(attn, right, mean, None, name)
    expected = fused_leaf_norms_ref(attn, right, mean)
    # Entries of at most ~5 bits and n <= 128 terms: every product and partial sum is exact in float32.
    exact = kind in ("zeros", "integers", "dyadic")
    for got, want in zip((residual, norm), expected):
        if exact:
            torch.testing.assert_close(got, want, rtol=1e-15, atol=0)
        elif dtype == torch.float64:
            torch.testing.assert_close(got, want, **tolerance(dtype))
        else:
            error = (got - want).abs()
            assert (error <= 1e-5 * want + leaf_kernel_slack(attn, right, name)).all(), (error, want)


@given(network=networks(), skip=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_length_sums_with_biases_sum_to_the_network(network, skip, seed):
    attn, outputs = network
    if outputs is None:
        return
    x, w_v, w_o = (t.double() for t in outputs)
    attn = attn.double() / attn.double().sum(-1, keepdim=True)
    b_o = torch.randn(attn.shape[1], x.shape[-1], generator=_generator(seed), dtype=torch.float64)
    sums = pk.length_sums(attn, x, w_v, w_o, b_o=b_o, skip=skip)
    expected = attention_network_ref(attn, x, w_v, w_o, b_o, skip=skip)
    torch.testing.assert_close(sums.sum(0), expected, rtol=1e-10, atol=1e-10 * float(expected.abs().max() + 1))


@given(layers=st.integers(1, 5), heads=st.integers(1, 3), skip=st.booleans(), data=st.data())
def test_sampling_without_replacement_gives_distinct_paths_of_the_length(layers, heads, skip, data):
    length = data.draw(st.none() | st.integers(0 if skip else layers, layers))
    available = (
        pk.count_paths(layers, heads, skip=skip)
        if length is None
        else pk.count_by_length(layers, heads, skip=skip)[length]
    )
    count = data.draw(st.integers(0, available))
    paths = pk.sample_paths(
        layers,
        heads,
        count,
        skip=skip,
        length=length,
        replace=False,
        generator=_generator(data.draw(st.integers(0, 2**31 - 1))),
    )
    assert paths.shape == (count, layers) and torch.unique(paths, dim=0).shape[0] == count
    if count:
        assert int(paths.min()) >= (-1 if skip else 0) and int(paths.max()) < heads
        if length is not None:
            assert bool(((paths != -1).sum(1) == length).all())


@given(network=networks(), data=st.data())
def test_masked_batches_match_each_element_alone(network, data):
    attn, _ = network
    batch, n = attn.shape[0], attn.shape[-1]
    lengths = [data.draw(st.integers(1, n)) for _ in range(batch)]
    padded = attn.clone()
    mask = torch.zeros(batch, n, dtype=torch.bool)
    for b, length in enumerate(lengths):
        mask[b, :length] = True
        block = padded[b, ..., :length, :length].double()
        padded[b, ..., :length, :length] = (block / block.sum(-1, keepdim=True)).to(attn.dtype)
        padded[b, ..., :length, length:] = 0
    tree = pk.PathTree.complete(attn.shape[1], attn.shape[2], skip=True)
    masked = pk.path_residuals(padded, tree, token_mask=mask)
    for b, length in enumerate(lengths):
        alone = pk.path_residuals(padded[b : b + 1, ..., :length, :length], tree)
        torch.testing.assert_close(masked.residual[b], alone.residual[0], rtol=0, atol=0)


@given(
    n=st.integers(1, 5),
    m=st.integers(0, 5),
    column=st.integers(-10, 10),
    row=st.integers(-10, 10),
    centered=st.booleans(),
)
def test_norm_backward_is_safe_with_any_argmax(n, m, column, row, centered):
    """The op is public: an argmax entry out of range is refused (IndexError), never read."""
    x = torch.randn(2, n, m, dtype=torch.float64)
    parts = torch.ones(2, 1, 3, dtype=torch.float64)
    argmax = torch.tensor([column, row]).expand(2, 1, 2).contiguous()
    valid = 0 <= column < max(m, 1) and 0 <= row < n
    if valid:
        grad = torch.ops.pathkernels.norm_parts_backward(parts, x, parts, argmax, centered, False)
        assert grad.shape == x.shape and bool(torch.isfinite(grad).all())
    else:
        with pytest.raises(IndexError, match=r"expected every entry of argmax\[\.\.\., [01]\]"):
            torch.ops.pathkernels.norm_parts_backward(parts, x, parts, argmax, centered, False)


@given(data=st.data(), network=networks())
def test_results_are_bitwise_independent_of_threads_and_budget(data, network):
    """Threads only split independent work (whole leaves), and the CPU engine's GEMM computes an
    element alike in any call, so neither the thread count nor the memory budget changes a bit."""
    attn, outputs = network
    x, w_v, w_o = outputs if outputs is not None else (None, None, None)
    tree = data.draw(trees(attn.shape[1], attn.shape[2]))
    results = []
    for count, budget in ((1, 1 << 30), (2, 1 << 30), (3, 1 << 30), (2, 1 << 20), (3, None)):
        with num_threads(count), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            budget = budget or minimum_budget(check_network(attn, x, w_v, w_o, "test"))  # at this thread count
            result = pk.path_residuals(attn, tree, x=x, w_v=w_v, w_o=w_o, memory_budget=budget)
        results.append((result.residual, result.norm))
    for residual, norm in results[1:]:
        assert torch.equal(residual, results[0][0]) and torch.equal(norm, results[0][1])
