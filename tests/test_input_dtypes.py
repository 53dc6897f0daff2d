"""float16 and bfloat16 inputs, and empty batches: one treatment in every path function.

Half-precision attention is checked row-stochastic to its own precision, then computed in float32
with its rows renormalised there; an empty batch is refused with one message everywhere.
"""

import pytest
import torch

import pathkernels as pk
from pathkernels.core.checks import renormalise_rows
from pathkernels.testing import padded_network, random_attention

LOW_PRECISION = [torch.float16, torch.bfloat16]
B, L, H, N, D = 3, 3, 2, 6, 4


def half_network(dtype):
    attn = random_attention(B, L, H, N, N, temperature=2.0).to(dtype)
    x = torch.randn(B, N, D).to(dtype)
    w_v = (torch.randn(L, H, D, D) / 2).to(dtype)
    w_o = (torch.randn(L, H, D, D) / 2).to(dtype)
    b_o = torch.randn(L, D).to(dtype)
    return attn, x, w_v, w_o, b_o


def as_float32(attn, *others):
    """What the path functions compute on: float32, attn's rows renormalised after the cast."""
    return (renormalise_rows(attn.float()), *(t.float() for t in others))


def test_half_rows_sum_to_one_only_to_their_precision():
    """The premise: these inputs would fail float32's row-sum check without the renormalisation."""
    attn = random_attention(64, 1, 1, 40, 40, temperature=2.0).to(torch.float16).float()
    assert float((attn.sum(-1) - 1).abs().max()) > 1e-4


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_path_functions_compute_half_inputs_in_float32(dtype):
    attn, x, w_v, w_o, b_o = half_network(dtype)
    attn32, x32, w_v32, w_o32, b_o32 = as_float32(attn, x, w_v, w_o, b_o)
    tree = pk.PathTree.complete(L, H, skip=True)

    got = pk.path_residuals(attn, tree, x=x, w_v=w_v, w_o=w_o)
    expected = pk.path_residuals(attn32, tree, x=x32, w_v=w_v32, w_o=w_o32)
    assert got.residual.dtype == torch.float32
    assert torch.equal(got.residual, expected.residual) and torch.equal(got.norm, expected.norm)

    products = pk.path_residuals(attn, tree)
    assert torch.equal(products.residual, pk.path_residuals(attn32, tree).residual)

    sums = pk.length_sums(attn, x, w_v, w_o, b_o=b_o)
    assert sums.dtype == torch.float32
    assert torch.equal(sums, pk.length_sums(attn32, x32, w_v32, w_o32, b_o=b_o32))

    stats = pk.path_statistics(attn, tree, x=x, w_v=w_v, w_o=w_o)
    expected_stats = pk.path_statistics(attn32, tree, x=x32, w_v=w_v32, w_o=w_o32)
    assert stats.dtype == torch.float32
    assert all(torch.equal(stats.sums[key], expected_stats.sums[key]) for key in expected_stats.sums)

    decomposition = pk.decompose(attn, x=x, w_v=w_v, w_o=w_o).results
    expected_decomposition = pk.decompose(attn32, x=x32, w_v=w_v32, w_o=w_o32).results
    assert torch.equal(decomposition.ratio, expected_decomposition.ratio)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_half_inputs_with_a_token_mask(dtype):
    attn, x, w_v, w_o, mask = padded_network([6, 4, 5], L, H, N, D, d_head=D)
    attn, x, w_v, w_o = (t.to(dtype) for t in (attn, x, w_v, w_o))
    attn32, x32, w_v32, w_o32 = as_float32(attn, x, w_v, w_o)
    tree = pk.PathTree.complete(L, H, skip=True)
    got = pk.path_residuals(attn, tree, x=x, w_v=w_v, w_o=w_o, token_mask=mask)
    for b in range(3):
        real = mask[b].nonzero().flatten()
        alone = attn[b : b + 1][..., real, :][..., real]  # the sequence alone, half precision
        expected = pk.path_residuals(alone, tree, x=x[b : b + 1, real], w_v=w_v, w_o=w_o)
        assert torch.equal(got.residual[b], expected.residual[0])
    sums = pk.length_sums(attn, x, w_v, w_o, token_mask=mask)
    assert sums.dtype == torch.float32 and bool((sums[:, ~mask] == 0).all())
    stats = pk.path_statistics(attn, tree, token_mask=mask)
    expected_sums = pk.path_statistics(attn32, tree, token_mask=mask).sums
    assert stats.dtype == torch.float32
    assert all(torch.equal(stats.sums[key], expected_sums[key]) for key in expected_sums)
    del x32, w_v32, w_o32


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_half_inputs_that_are_not_row_stochastic_are_refused(dtype):
    attn, x, w_v, w_o, _ = half_network(dtype)
    attn[1, 2, 0, 3] *= 0.9  # 10 % off: beyond half precision's rounding
    tree = pk.PathTree.complete(L, H)
    message = rf"row 3 of batch element 1, layer 2, head 0 sums to 0\.[89].*\(computed in {dtype}: tolerance 0\.01\)"
    for call in (
        lambda: pk.path_residuals(attn, tree),
        lambda: pk.length_sums(attn, x, w_v, w_o),
        lambda: pk.path_statistics(attn, tree),
        lambda: pk.decompose(attn),
    ):
        with pytest.raises(ValueError, match=message):
            call()


def test_mixed_dtypes_are_refused():
    attn, x, w_v, w_o, b_o = half_network(torch.float16)
    tree = pk.PathTree.complete(L, H)
    with pytest.raises(TypeError, match=r"expected x in attn's dtype torch.float16, got torch.float32"):
        pk.path_residuals(attn, tree, x=x.float(), w_v=w_v, w_o=w_o)
    with pytest.raises(TypeError, match=r"expected b_o in attn's dtype torch.float16 on cpu, got torch.float32"):
        pk.length_sums(attn, x, w_v, w_o, b_o=b_o.float())
    with pytest.raises(TypeError, match=r"expected attn to be float32 or float64 \(float16 and bfloat16"):
        pk.path_residuals(attn.to(torch.int64), tree)


EMPTY_MESSAGE = r"expected at least one batch element, layer and head in attn \[B, L, H, n, n\], got \[0, 3, 2, 6, 6\]"


@pytest.mark.parametrize(
    "name",
    ["path_residuals", "path_statistics", "length_sums", "decompose", "rollout", "AttentionStack"],
)
def test_an_empty_batch_is_refused_alike_everywhere(name):
    attn = random_attention(0, L, H, N, N)
    x, w_v, w_o = torch.randn(0, N, D), torch.randn(L, H, D, D), torch.randn(L, H, D, D)
    tree = pk.PathTree.complete(L, H)
    calls = {
        "path_residuals": lambda: pk.path_residuals(attn, tree),
        "path_statistics": lambda: pk.path_statistics(attn, tree),
        "length_sums": lambda: pk.length_sums(attn, x, w_v, w_o),
        "decompose": lambda: pk.decompose(attn),
        "rollout": lambda: pk.rollout(attn),
        "AttentionStack": lambda: pk.adapters.AttentionStack(attn, w_v, w_o, torch.zeros(L, D)),
    }
    where = "pathkernels.AttentionStack from the caller" if name == "AttentionStack" else f"pathkernels.{name}"
    with pytest.raises(ValueError, match=rf"{where}: {EMPTY_MESSAGE}"):
        calls[name]()
