"""pk.compat (pathkernels.analysis.compat): the official utilities' signatures and semantics, on the fused ops."""

import random

import pytest
import torch

from pathkernels.analysis import compat
from pathkernels.reference import matrix_norms_ref
from pathkernels.testing import random_attention, random_matrices, tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_norms_match_their_definitions(device, dtype):
    x = random_matrices(3, 4, 9, 5, dtype=dtype, device=device)
    l1, linf, composite = matrix_norms_ref(x.double())
    tol = tolerance(dtype)
    torch.testing.assert_close(compat.l1_matrix_norm(x).double(), l1, **tol)
    torch.testing.assert_close(compat.linf_matrix_norm(x).double(), linf, **tol)
    torch.testing.assert_close(compat.composite_norm(x).double(), composite, **tol)
    # The original's one-liners: max column abs sum, and the same on the transpose.
    torch.testing.assert_close(compat.l1_matrix_norm(x), x.abs().sum(-2).amax(-1), **tol)
    torch.testing.assert_close(compat.linf_matrix_norm(x), x.abs().sum(-1).amax(-1), **tol)


def test_sample_path_draws_as_the_original():
    seed = random.randrange(2**32)
    random.seed(seed)
    got = [compat.sample_path(3, 6, 4) for _ in range(5)]
    random.seed(seed)
    expected = []
    for _ in range(5):  # the original's calls, in its order
        layers = sorted(random.sample(range(6), 3))
        expected.append((layers, random.choices(range(4), k=3)))
    assert got == expected
    assert all(layers == sorted(set(layers)) and all(0 <= h < 4 for h in heads) for layers, heads in got)


def test_sample_P_matrix_multiplies_in_ascending_order(device):
    attn = random_attention(5, 3, 2, 6, 6, dtype=torch.float64, device=device)  # [L, S, H, t, t]
    seed = random.randrange(2**32)
    random.seed(seed)
    product = compat.sample_P_matrix(attn, 3)
    random.seed(seed)
    layers, heads = compat.sample_path(3, 5, 2)
    sample = random.choice(range(3))
    matrices = [attn[layer, sample, head] for layer, head in zip(layers, heads)]
    torch.testing.assert_close(product, matrices[0] @ matrices[1] @ matrices[2])
    # The paper's order is the reverse: a different matrix, also row-stochastic.
    assert not torch.allclose(product, matrices[2] @ matrices[1] @ matrices[0])
    torch.testing.assert_close(product.sum(-1), torch.ones(6, dtype=torch.float64, device=device))
    assert product.device == attn.device and product.dtype == attn.dtype
    torch.testing.assert_close(compat.sample_P_matrix(attn, 0), torch.eye(6, dtype=torch.float64, device=device))


def test_bad_input():
    with pytest.raises(ValueError, match=r"sample_path: expected 0 <= depth <= num_layers = 4, got 5"):
        compat.sample_path(5, 4, 2)
    with pytest.raises(ValueError, match=r"sample_P_matrix: expected attentions \[L, S, H, t, t\]"):
        compat.sample_P_matrix(torch.ones(2, 2, 3, 3), 1)
