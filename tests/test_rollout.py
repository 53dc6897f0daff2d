"""pk.rollout: the weighted path sum it equals, hand-worked cases, batching, fusions, bad input."""

import pytest
import torch

import pathkernels as pk
from pathkernels.testing import random_attention, tolerance


def test_mean_rollout_is_the_weighted_sum_over_the_complete_tree(device):
    """Â_l = ½(I + mean_h A[l,h]) gives R = Σ_p 2^-L H^-len(p) P_p over every path with skip."""
    layers, heads = 4, 3
    attn = random_attention(2, layers, heads, 6, 6, dtype=torch.float64, device=device)
    tree = pk.PathTree.complete(layers, heads, skip=True)
    result = pk.path_residuals(attn, tree, materialize=True)
    weights = 0.5**layers * float(heads) ** -result.lengths.double()
    expected = torch.einsum("bmij,m->bij", result.products, weights.to(device))
    torch.testing.assert_close(pk.rollout(attn), expected)


def test_hand_worked():
    a = torch.tensor([[[[1.0, 0.0], [0.5, 0.5]]]], dtype=torch.float64)  # L = H = 1
    torch.testing.assert_close(pk.rollout(a), torch.tensor([[1.0, 0.0], [0.25, 0.75]], dtype=torch.float64))
    torch.testing.assert_close(pk.rollout(a, residual=False), a[0, 0])
    # Two layers without skip: the product A2 A1, later layer on the left.
    a1 = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    a2 = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    torch.testing.assert_close(pk.rollout(torch.stack([a1, a2]).unsqueeze(1), residual=False), a2 @ a1)


@pytest.mark.parametrize("fusion", ["mean", "max", "min"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batched_fusions_match_a_plain_loop(device, fusion, dtype):
    attn = random_attention(3, 4, 5, 7, 7, dtype=dtype, device=device)
    out = pk.rollout(attn, head_fusion=fusion)
    for b in range(3):
        expected = torch.eye(7, dtype=torch.float64, device=device)
        for layer in range(4):
            fused = getattr(attn[b, layer].double(), {"mean": "mean", "max": "amax", "min": "amin"}[fusion])(0)
            fused = fused + torch.eye(7, dtype=torch.float64, device=device)
            expected = (fused / fused.sum(-1, keepdim=True)) @ expected
        torch.testing.assert_close(out[b].double(), expected, **tolerance(dtype))
        torch.testing.assert_close(pk.rollout(attn[b], head_fusion=fusion), out[b])
    torch.testing.assert_close(
        out.sum(-1).double(), torch.ones(3, 7, dtype=torch.float64, device=device), **tolerance(dtype)
    )


@pytest.mark.parametrize(
    "dtype, level", [(torch.float64, 1e308), (torch.float32, 3e38), (torch.float16, 3e4), (torch.bfloat16, 3e38)]
)
def test_rows_whose_sums_overflow_are_normalised(dtype, level):
    """Entries near the top of the dtype's range: a row sum overflows, and dividing by it gave 0
    everywhere. Each row is scaled by a power of two first, so the rollout is the one of the same
    attention scaled down (uniform rows: 1/n everywhere)."""
    attn = torch.full((1, 2, 1, 3, 3), level, dtype=dtype)
    for residual in (True, False):  # the identity is below the entries' last digit
        got = pk.rollout(attn, residual=residual)
        torch.testing.assert_close(got.double(), torch.full((1, 3, 3), 1 / 3, dtype=torch.float64), **tolerance(dtype))
    mixed = random_attention(1, 3, 2, 5, 5, dtype=torch.float64) * torch.tensor(
        [1e307, 1.0, 1e-300], dtype=torch.float64
    ).view(1, 3, 1, 1, 1)
    torch.testing.assert_close(
        pk.rollout(mixed, residual=False), pk.rollout(mixed / mixed.sum(-1, keepdim=True), residual=False)
    )


def test_discard_ratio_zeroes_the_smallest_off_diagonal_entries():
    a = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.4, 0.1], [0.7, 0.1, 0.1, 0.1]])
    out = pk.rollout(a[None, None], residual=False, discard_ratio=0.34)  # one of three off-diagonal entries
    kept = torch.tensor([[0.1, 0.0, 0.3, 0.4], [0.4, 0.3, 0.2, 0.0], [0.25, 0.25, 0.4, 0.0], [0.7, 0.0, 0.1, 0.1]])
    # Row 3 ties at 0.1: topk drops one of the tied entries; check the row sums and the others.
    torch.testing.assert_close(out[:3], kept[:3] / kept[:3].sum(-1, keepdim=True))
    assert out[3, 3] > 0 and torch.isclose(out[3].sum(), torch.tensor(1.0))


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"attn": torch.ones(2, 3, 3)}, ValueError, r"expected attn \[B, L, H, n, n\]"),
        ({"attn": torch.ones(1, 1, 2, 3)}, ValueError, r"expected attn \[B, L, H, n, n\]"),
        ({"attn": torch.ones(1, 1, 2, 2, dtype=torch.int64)}, TypeError, "floating-point"),
        ({"attn": torch.ones(1, 1, 2, 2), "head_fusion": "sum"}, ValueError, "head_fusion"),
        ({"attn": torch.ones(1, 1, 2, 2), "discard_ratio": 1.0}, ValueError, r"discard_ratio in \[0, 1\)"),
        ({"attn": -torch.ones(1, 1, 2, 2)}, ValueError, "non-negative"),
        ({"attn": torch.zeros(1, 1, 2, 2), "residual": False}, ValueError, "sums to 0"),
        (
            {"attn": torch.ones(0, 1, 2, 2)},
            ValueError,
            r"expected at least one batch element, layer and head in attn \[B, L, H, n, n\], got \[1, 0, 1, 2, 2\]",
        ),
    ],
)
def test_bad_input(kwargs, error, message):
    with pytest.raises(error, match="pathkernels.rollout: .*" + message):
        pk.rollout(**kwargs)


def test_discard_ratio_counts_the_off_diagonal_entries():
    """int((n − 1) · ratio) of each row's n − 1 off-diagonal entries are zeroed: one of three at
    ratio 0.5 (n · ratio would zero two)."""
    a = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.15, 0.25, 0.4, 0.2], [0.6, 0.1, 0.05, 0.25]])
    out = pk.rollout(a[None, None], residual=False, discard_ratio=0.5)
    kept = a.clone()
    for row, column in enumerate([1, 3, 0, 2]):  # each row's smallest off-diagonal entry
        kept[row, column] = 0
    torch.testing.assert_close(out, kept / kept.sum(-1, keepdim=True))


def test_discard_ratio_keeps_the_diagonal_even_where_it_ties_the_largest_entry():
    """A zero diagonal lifted to exactly the largest entry would tie the off-diagonal entries it must
    stay above: the lift is the largest entry plus 1."""
    a = torch.full((3, 3), 0.5, dtype=torch.float64).fill_diagonal_(0.0)
    out = pk.rollout(a[None, None], residual=False, discard_ratio=0.5)  # one of the two 0.5s per row
    assert torch.equal(out.diagonal(), torch.zeros(3, dtype=torch.float64))
    assert torch.equal((out > 0).sum(-1), torch.ones(3, dtype=torch.long))  # the other 0.5, normalised to 1
    assert torch.equal(out.sum(-1), torch.ones(3, dtype=torch.float64))


def test_masked_rollout_is_each_sequence_on_its_real_tokens():
    """Three sequences of 5, 3 and 2 real tokens (B ≠ n, so that no index can stand for another):
    each equals the rollout of its real block alone, and its padded rows and columns are 0."""
    from pathkernels.testing import padded_network

    attn, _, _, _, mask = padded_network([5, 3, 2], layers=2, heads=3, n=5, d=2)
    out = pk.rollout(attn, token_mask=mask)
    assert out.shape == (3, 5, 5)
    for b, length in enumerate([5, 3, 2]):
        alone = pk.rollout(attn[b : b + 1, :, :, :length, :length])[0]
        torch.testing.assert_close(out[b, :length, :length], alone)
        assert not out[b, length:].any() and not out[b, :, length:].any()
    torch.testing.assert_close(pk.rollout(attn[0], token_mask=mask[0]), out[0])  # unbatched


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"attn": torch.ones(1, 1, 2, 2, device="meta")}, ValueError, r"expected attn on a CPU or CUDA device"),
        ({"discard_ratio": "0.5"}, TypeError, r"expected discard_ratio to be a real number in \[0, 1\), got str"),
        ({"discard_ratio": float("nan")}, ValueError, r"expected discard_ratio in \[0, 1\), got nan"),
        ({"head_fusion": None}, ValueError, r"expected head_fusion in \('mean', 'max', 'min'\), got None"),
        ({"token_mask": torch.zeros(2)}, ValueError, r"token_mask keeps no token of batch element 0"),
    ],
)
def test_arguments_of_the_wrong_kind_are_refused_in_its_name(kwargs, error, message):
    """A meta tensor reached the values (an error of torch's); a string ratio was compared with a
    number (TypeError: '<=' not supported)."""
    with pytest.raises(error, match="^pathkernels.rollout: " + message):
        pk.rollout(**({"attn": torch.full((1, 1, 2, 2), 0.5)} | kwargs))
