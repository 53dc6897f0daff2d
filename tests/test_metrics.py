"""pk.metrics and pk.nn: hand-worked values, float64 references on fresh random inputs, bad input."""

import math

import pytest
import torch

import pathkernels as pk
from pathkernels import metrics
from pathkernels.reference import composite_norm_ref, residual_norm_ref
from pathkernels.testing import random_attention, random_matrices, tolerance


def t(rows, device="cpu"):
    return torch.tensor(rows, dtype=torch.float64, device=device)


# --- hand-worked -------------------------------------------------------------------------------


def test_hand_worked_values(device):
    eye = t([[1, 0], [0, 1]], device)
    corner = t([[2, 0], [0, 0]], device)
    # corner: μ = (1, 0), residual [[1, 0], [-1, 0]]: ‖·‖_1 = 2, ‖·‖_∞ = 1; ‖corner‖_{1,∞} = 2.
    torch.testing.assert_close(metrics.residual_ratio(torch.stack([eye, corner])), t([1.0, math.sqrt(2) / 2], device))
    # eye: n‖μ‖² = 2 · ½ = 1 over ‖X‖²_F = 2.
    assert metrics.token_similarity(eye).item() == pytest.approx(0.5)
    assert metrics.token_diversity(corner).item() == pytest.approx(0.5)
    diag = t([[3, 0], [0, 4]], device)
    assert metrics.rank1_residual(diag).item() == pytest.approx(3 / 5)
    assert metrics.rank1_residual(diag, relative=False).item() == pytest.approx(3)
    assert metrics.stable_rank(diag).item() == pytest.approx(25 / 16)
    assert metrics.effective_rank(eye).item() == pytest.approx(2)
    p = torch.tensor([0.75, 0.25])
    assert metrics.effective_rank(t([[3, 0], [0, 1]], device)).item() == pytest.approx(math.exp(-(p * p.log()).sum()))
    assert metrics.effective_rank(t([[1, 2], [2, 4]], device)).item() == pytest.approx(1)
    torch.testing.assert_close(
        metrics.dobrushin(torch.stack([eye, t([[0.5, 0.5], [0.5, 0.5]], device), t([[0.9, 0.1], [0.2, 0.8]], device)])),
        t([1.0, 0.0, 0.7], device),
    )
    # u1 = e1, u2 = e2, u3 = (e1 + e2)/√2: pair similarities 0, 1/√2, 1/√2.
    cos = metrics.token_cosine_similarity(t([[1, 0], [0, 1], [1, 1]], device))
    assert cos.item() == pytest.approx(2 / math.sqrt(2) / 3)
    # Diversities ½ then ¼: each layer halves it.
    layers = torch.stack([eye, t([[3, 1], [1, 3]], device) / 4])
    assert metrics.token_diversity(layers[1]).item() == pytest.approx(0.2)
    assert metrics.escalation_rate(layers).item() == pytest.approx(0.2 / 0.5)


def test_de_escalation(device):
    x = t([[1, 2], [3, 6]], device)
    torch.testing.assert_close(pk.nn.DeEscalation(1.0)(x), t([[-1, -2], [1, 2]], device))
    torch.testing.assert_close(pk.nn.DeEscalation(0.5)(x), t([[0, 0], [2, 4]], device))
    batch = random_matrices(3, 2, 7, 5, dtype=torch.float64, device=device)
    out = pk.nn.DeEscalation()(batch)
    torch.testing.assert_close(metrics.token_similarity(out), torch.zeros(3, 2, dtype=torch.float64, device=device))
    assert "tau=1.0" in repr(pk.nn.DeEscalation())


# --- random inputs against float64 references --------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_against_references(device, dtype):
    x = random_matrices(4, 3, 9, 6, dtype=dtype, device=device)
    x64 = x.double()
    tol = tolerance(dtype)
    ratio = metrics.residual_ratio(x)
    torch.testing.assert_close(ratio.double(), residual_norm_ref(x64) / composite_norm_ref(x64), **tol)

    rows = x64.reshape(-1, 9, 6)
    sim, cos, _dob, srank, erank = [], [], [], [], []
    for m in rows:
        mean = m.mean(0)
        sim.append(9 * mean.dot(mean) / (m * m).sum())
        unit = m / m.norm(dim=1, keepdim=True)
        cos.append(sum(unit[i].dot(unit[j]) for i in range(9) for j in range(9) if i != j) / 72)
        sigma = torch.linalg.svdvals(m)
        srank.append((sigma**2).sum() / sigma[0] ** 2)
        p = sigma / sigma.sum()
        erank.append(torch.exp(-(p * p.log()).sum()))
    for got, want in [
        (metrics.token_similarity(x), sim),
        (metrics.token_cosine_similarity(x), cos),
        (metrics.stable_rank(x), srank),
        (metrics.effective_rank(x), erank),
    ]:
        torch.testing.assert_close(got.double().reshape(-1), torch.stack(want), **tol)

    attn = random_attention(2, 3, 5, 5, dtype=dtype, device=device).reshape(-1, 5, 5).double()
    want = torch.stack([max((a[i] - a[j]).abs().sum() for i in range(5) for j in range(5)) / 2 for a in attn])
    torch.testing.assert_close(metrics.dobrushin(attn.to(dtype)).double(), want, **tol)


def test_sequences_are_stacked_like_hidden_states(device):
    states = [random_matrices(2, 6, 4, dtype=torch.float64, device=device) for _ in range(4)]
    torch.testing.assert_close(metrics.residual_ratio(states), metrics.residual_ratio(torch.stack(states)))
    assert metrics.escalation_rate(states).shape == (3, 2)
    assert metrics.token_similarity(tuple(states)).shape == (4, 2)


def test_collapse_under_pure_attention_is_measured():
    """Repeated pure attention drives every measure to its collapsed value."""
    x = random_matrices(16, 8, dtype=torch.float64)
    a = random_attention(16, 16, dtype=torch.float64)
    collapsed = torch.linalg.matrix_power(a, 60) @ x
    assert metrics.residual_ratio(collapsed) < 1e-8
    assert metrics.token_similarity(collapsed) == pytest.approx(1, abs=1e-12)
    assert metrics.rank1_residual(collapsed) < 1e-8
    assert metrics.token_cosine_similarity(collapsed) == pytest.approx(1, abs=1e-12)
    assert metrics.effective_rank(collapsed) == pytest.approx(1, abs=1e-6)


# --- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: metrics.residual_ratio(torch.ones(3)), ValueError, "residual_ratio: expected x to have at least 2"),
        (lambda: metrics.token_similarity(torch.ones(2, 2, dtype=torch.int64)), TypeError, "floating-point"),
        (lambda: metrics.stable_rank([torch.ones(2, 2), torch.ones(3, 2)]), ValueError, "of one shape"),
        (lambda: metrics.effective_rank([]), ValueError, "non-empty sequence"),
        (lambda: metrics.token_cosine_similarity(torch.ones(1, 4)), ValueError, "at least 2 tokens"),
        (lambda: metrics.escalation_rate(torch.ones(1, 3, 2)), ValueError, "at least two layers"),
        (lambda: metrics.dobrushin("P"), TypeError, "expected x to be a torch.Tensor"),
        (lambda: pk.nn.DeEscalation()(torch.ones(3)), ValueError, r"DeEscalation: expected x \[..., n, d\]"),
    ],
)
def test_bad_input(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_rank1_residual_in_both_norms_by_hand():
    x = torch.tensor([[2.0, 0.0], [0.0, 1.0]], dtype=torch.float64)  # rank-1 part diag(2, 0), rest diag(0, 1)
    assert pk.metrics.rank1_residual(x).item() == pytest.approx(1 / 5**0.5, rel=1e-12)
    assert pk.metrics.rank1_residual(x, relative=False).item() == pytest.approx(1.0, rel=1e-12)
    assert pk.metrics.rank1_residual(x, norm="composite").item() == pytest.approx(1 / 2, rel=1e-12)  # 1 / sqrt(2·2)
    batch = torch.randn(3, 5, 4, dtype=torch.float64)
    u, sigma, vh = torch.linalg.svd(batch)
    rest = batch - sigma[:, :1, None] * u[:, :, :1] @ vh[:, :1, :]
    torch.testing.assert_close(
        pk.metrics.rank1_residual(batch, norm="composite"), composite_norm_ref(rest) / composite_norm_ref(batch)
    )
    with pytest.raises(ValueError, match=r"rank1_residual: expected norm in \('frobenius', 'composite'\), got 'l2'"):
        pk.metrics.rank1_residual(batch, norm="l2")


def test_residual_ratio_can_exceed_one():
    # Centring e_1 gives e_1 − 1/n, whose abs sum is 2(n − 1)/n: for X = I_4 the ratio is 1.5.
    assert pk.metrics.residual_ratio(torch.eye(4, dtype=torch.float64)).item() == pytest.approx(1.5, rel=1e-12)
