"""pk.metrics and pk.nn: hand-worked values, float64 references on fresh random inputs, exact
(mpmath) references at collapse and at extreme scales, the conventions at zero, bad input."""

import math

import mpmath as mp
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import pathkernels as pk
from pathkernels.analysis import metrics
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
        (
            lambda: metrics.residual_ratio(torch.ones(3)),
            ValueError,
            "residual_ratio: expected hidden_states to have at least 2",
        ),
        (lambda: metrics.token_similarity(torch.ones(2, 2, dtype=torch.int64)), TypeError, "floating-point"),
        (lambda: metrics.stable_rank([torch.ones(2, 2), torch.ones(3, 2)]), ValueError, "of one shape"),
        (lambda: metrics.effective_rank([]), ValueError, "non-empty sequence"),
        (lambda: metrics.token_cosine_similarity(torch.ones(1, 4)), ValueError, "at least 2 tokens"),
        (lambda: metrics.escalation_rate(torch.ones(1, 3, 2)), ValueError, "at least two layers"),
        (lambda: metrics.dobrushin("P"), TypeError, "expected p to be a torch.Tensor"),
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


# --- exact references: mpmath on the float64 inputs as they are (each float converts exactly) --------

# 40 digits: the centred tokens of a float64 matrix need at most ~16 digits more than its entries.
DIGITS = 40


def exact_metrics(m: torch.Tensor) -> dict:
    """Every metric of one matrix ``m [n, d]``, computed on its exact values to 40 digits."""
    with mp.workdps(DIGITS):
        x = [[mp.mpf(v) for v in row] for row in m.double().tolist()]
        n, d = len(x), len(x[0])
        mean = [mp.fsum(row[j] for row in x) / n for j in range(d)]
        centred = [[row[j] - mean[j] for j in range(d)] for row in x]

        def energy(rows):
            return mp.fsum(v * v for row in rows for v in row)

        def composite(rows):
            columns = max(mp.fsum(abs(row[j]) for row in rows) for j in range(d))
            return mp.sqrt(columns * max(mp.fsum(abs(v) for v in row) for row in rows))

        total = energy(x)
        out = {
            "dobrushin": max(mp.fsum(abs(a - b) for a, b in zip(p, q)) for p in x for q in x) / 2,
            "token_diversity": energy(centred) / total if total else mp.mpf(0),
            "token_similarity": n * mp.fsum(v * v for v in mean) / total if total else mp.mpf(1),
            "residual_ratio": composite(centred) / composite(x) if total else mp.mpf(0),
        }
        if n >= 2:
            norms = [mp.sqrt(energy([row])) for row in x]
            pairs = [(i, j) for i in range(n) for j in range(n) if i != j and norms[i] and norms[j]]
            cosines = (mp.fsum(x[i][k] * x[j][k] for k in range(d)) / (norms[i] * norms[j]) for i, j in pairs)
            out["token_cosine_similarity"] = mp.fsum(cosines) / (n * (n - 1))
        if not total:
            zeros = dict.fromkeys(("rank1_frobenius", "rank1_composite", "stable_rank", "effective_rank"), 0)
            return out | zeros | {"rank1_frobenius_absolute": 0, "rank1_composite_absolute": 0}
        u, s, v = mp.svd_r(mp.matrix(x))
        sigma = sorted((s[i] for i in range(len(s))), reverse=True)
        top = max(range(len(s)), key=lambda i: s[i])
        rest = [[x[a][b] - s[top] * u[a, top] * v[top, b] for b in range(d)] for a in range(n)]
        if min(n, d) == 1:  # rank 1: the residual is 0, not the SVD's rounding at 40 digits
            rest = [[mp.mpf(0)] * d for _ in range(n)]
        tail = mp.sqrt(mp.fsum(value**2 for value in sigma[1:]))
        p = [value / mp.fsum(sigma) for value in sigma]
        return out | {
            "rank1_frobenius": tail / mp.sqrt(total),
            "rank1_frobenius_absolute": tail,
            "rank1_composite": composite(rest) / composite(x),
            "rank1_composite_absolute": composite(rest),
            "stable_rank": mp.fsum(value**2 for value in sigma) / sigma[0] ** 2,
            "effective_rank": mp.exp(-mp.fsum(q * mp.log(q) for q in p if q > 0)),
        }


COMPUTED = {
    "residual_ratio": metrics.residual_ratio,
    "rank1_frobenius": metrics.rank1_residual,
    "rank1_frobenius_absolute": lambda x: metrics.rank1_residual(x, relative=False),
    "rank1_composite": lambda x: metrics.rank1_residual(x, norm="composite"),
    "rank1_composite_absolute": lambda x: metrics.rank1_residual(x, norm="composite", relative=False),
    "token_similarity": metrics.token_similarity,
    "token_diversity": metrics.token_diversity,
    "token_cosine_similarity": metrics.token_cosine_similarity,
    "stable_rank": metrics.stable_rank,
    "effective_rank": metrics.effective_rank,
    "dobrushin": metrics.dobrushin,
}


def assert_exact(x: torch.Tensor, rtol: float = 1e-12, svd_atol: float = 0.0):
    """Every metric of ``x [B, n, d]`` (float64) within ``rtol`` of the exact value, plus 1e-30 of
    the matrix's scale (the reference's own rounding, e.g. its SVD of an exactly rank-1 matrix).

    ``svd_atol``: for matrices far from collapse, the rank-1 residuals may be off by this share of
    the norm they are relative to (an SVD's σ₂ is known within u·σ₁: documented)."""
    wanted = [exact_metrics(m) for m in x]
    for name, function in COMPUTED.items():
        if name not in wanted[0]:
            continue
        got = function(x)
        for b, want in enumerate(wanted):
            value = got[b].item()
            absolute = name.endswith("absolute") or name == "dobrushin"
            scale = mp.mpf(x[b].abs().max().item()) * math.sqrt(x[b].numel()) if absolute else 1  # ≥ ‖x‖_F
            slack = svd_atol if name.startswith("rank1") else 0
            error = abs(mp.mpf(value) - want[name])
            assert error <= rtol * abs(want[name]) + scale * (mp.mpf("1e-30") + slack), (
                f"{name}[{b}]: got {value!r}, exact {mp.nstr(want[name], 17)}"
            )


def collapsing(batch, n, d, noise, generator=None):
    """``X = 1vᵀ + noise · N`` in float64: tokens ``noise`` apart (relative), v and N standard normal."""
    v = torch.randn(batch, 1, d, generator=generator, dtype=torch.float64)
    return v + noise * torch.randn(batch, n, d, generator=generator, dtype=torch.float64)


# --- precision at collapse and at extreme scales -----------------------------------------------


@pytest.mark.parametrize("scale", [1.0, 1e200, 1e-200])
@pytest.mark.parametrize("noise", [0.2, 0.05, 1e-3, 1e-6, 1e-9, 1e-12, 1e-15])
def test_collapse_is_measured_to_the_last_digits(noise, scale):
    """Tokens 0.2 … 1e-15 apart, at scales whose squares over- or underflow: every metric within
    1e-12 of the exact value (``1 − similarity`` gave 0 for the diversity at 1e-9, NaN at 1e±200).
    At 0.2 and 0.05 the deflation near collapse (``‖C‖_F ≤ √n ‖μ‖ / 4``) runs with its fixed point
    ``y`` far from 0, so each of its terms counts."""
    assert_exact(collapsing(2, 6, 4, noise) * scale)


@st.composite
def token_matrices(draw):
    """``(x [1, n, d] float64, collapsing)`` at a scale ``10^±290``: collapsing tokens (``1vᵀ + 10^-k N``
    with k from 3 to 16, or equal tokens), or tokens far from collapse: ``1vᵀ + N``, or centred
    ones (column means ~u·|x|: a similarity ~1e-32, which an uncompensated mean misses)."""
    n, d = draw(st.integers(1, 7)), draw(st.integers(1, 6))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    kind = draw(st.sampled_from(["collapsing", "random", "centred"]))
    if kind == "collapsing":
        k = draw(st.integers(3, 17))
        x = collapsing(1, n, d, 0.0 if k == 17 else 10.0**-k, g)
    elif kind == "random":
        x = collapsing(1, n, d, 1.0, g)
    else:
        z = torch.randn(1, n, d, generator=g, dtype=torch.float64)
        x = z - z.mean(-2, keepdim=True)
    return x * 10.0 ** draw(st.integers(-290, 290)), kind == "collapsing"


@given(token_matrices())
def test_every_metric_matches_the_exact_value_over_shapes_and_scales(case):
    x, collapsed = case
    assert_exact(x, svd_atol=0 if collapsed else 1e-14)


def test_similarity_of_cancelling_tokens_keeps_its_digits():
    # Summed in order, 1 + 1e-12 − 1 keeps 1e-12 to 4 digits only; the compensated sum, to all 16.
    x = t([[1.0, 3.0], [1e-12, 3.0], [-1.0, -6.0]])
    want = exact_metrics(x)["token_similarity"]
    assert want < 1e-24
    assert abs(mp.mpf(metrics.token_similarity(x).item()) - want) <= 1e-14 * want


def test_escalation_rate_over_many_layers_at_collapse():
    """Five layers whose diversity falls by about 1e-6, 1e-4, 1e-12, 1e-8: each rate is its own
    pair of layers' ratio, also past the range of float64 diversities (tokens 1e-100 … 1e-300
    apart, diversities down to 1e-600)."""
    v, noise = torch.randn(1, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)

    def layer(spread):  # four equal columns and three of size `spread`
        return torch.cat([v.expand(6, 4), spread * noise], -1)

    for spreads in ([1.0, 1e-3, 1e-5, 1e-11, 1e-15], [1e-3, 1e-100, 1e-170, 1e-250, 1e-300]):
        layers = torch.stack([layer(spread) for spread in spreads])
        with mp.workdps(DIGITS):
            ratios = []  # ‖X − 1μᵀ‖_F / ‖X‖_F, exactly
            for m in layers:
                exact = exact_metrics(m)
                ratios.append(mp.sqrt(exact["token_diversity"]))
            want = [(ratios[i + 1] / ratios[i]) ** 2 for i in range(len(ratios) - 1)]
        got = metrics.escalation_rate(layers)
        for i, value in enumerate(got.tolist()):
            assert abs(mp.mpf(value) - want[i]) <= 1e-12 * want[i], f"layer {i + 1}: {value} vs {mp.nstr(want[i], 17)}"
    # The batch is kept apart from the layers: [L+1, B, n, d] -> [L, B].
    batch = torch.stack([collapsing(3, 5, 4, noise) for noise in (1e-2, 1e-7, 1e-13)])
    rates = metrics.escalation_rate(batch)
    diversities = metrics.token_diversity(batch)
    torch.testing.assert_close(rates, diversities[1:] / diversities[:-1], rtol=1e-13, atol=0)


def test_escalation_rate_at_exactly_equal_tokens():
    """0 → 0 is 1 (nothing to lose), 0 → positive inf, positive → 0 is 0; never NaN."""
    equal = torch.ones(5, 3, dtype=torch.float64)
    diverse = collapsing(1, 5, 3, 1e-4)[0]
    layers = torch.stack([diverse, equal, 2 * equal, diverse, torch.zeros(5, 3, dtype=torch.float64)])
    rates = metrics.escalation_rate(layers)
    assert rates.tolist() == [0.0, 1.0, math.inf, 0.0]
    # One real token per matrix: every diversity is 0, every rate 1.
    hidden = torch.randn(4, 2, 5, 3, dtype=torch.float64)
    mask = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    rates = metrics.escalation_rate(hidden, token_mask=mask)
    assert rates[:, 0].tolist() == [1.0, 1.0, 1.0]
    assert bool(rates[:, 1].isfinite().all())


# --- conventions at zero, non-finite input, half precision -------------------------------------

ZERO_VALUES = {
    "residual_ratio": 0.0,
    "rank1_frobenius": 0.0,
    "rank1_frobenius_absolute": 0.0,
    "rank1_composite": 0.0,
    "rank1_composite_absolute": 0.0,
    "token_similarity": 1.0,
    "token_diversity": 0.0,
    "token_cosine_similarity": 0.0,
    "stable_rank": 0.0,
    "effective_rank": 0.0,
    "dobrushin": 0.0,
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(ZERO_VALUES))
def test_a_zero_matrix_has_its_documented_value(name, dtype):
    x = torch.randn(3, 4, 3).to(dtype)
    x[1] = 0
    got = COMPUTED[name](x)
    assert got[1].item() == ZERO_VALUES[name]
    assert bool(got.isfinite().all())


METRIC_ARGUMENTS = [
    ("residual_ratio", "hidden_states"),
    ("rank1_residual", "x"),
    ("token_similarity", "x"),
    ("token_diversity", "x"),
    ("escalation_rate", "hidden_states"),
    ("effective_rank", "x"),
    ("stable_rank", "x"),
    ("dobrushin", "p"),
    ("token_cosine_similarity", "x"),
]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("name, argument", METRIC_ARGUMENTS)
def test_non_finite_input_is_refused(name, argument, bad):
    x = torch.rand(2, 3, 3, dtype=torch.float64)
    x[1, 2, 0] = bad
    message = rf"^pathkernels.metrics.{name}: {argument} has a non-finite value \({bad}\) at index \[1, 2, 0\]"
    with pytest.raises(ValueError, match=message):
        getattr(metrics, name)(x)


@pytest.mark.parametrize("name", [name for name, _ in METRIC_ARGUMENTS])
def test_non_finite_padding_is_ignored(name):
    function = getattr(metrics, name)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    if name == "escalation_rate":  # [L+1, B, n, d]
        x = torch.rand(3, 2, 4, 3, dtype=torch.float64)
        x[:, 1, 3] = math.nan  # a padded token
        torch.testing.assert_close(function(x, token_mask=mask)[:, 1], function(x[:, 1:, :3])[:, 0])
        return
    x = torch.rand(2, 4, 4, dtype=torch.float64)
    x[1, 3] = math.nan
    if name == "dobrushin":
        x[1, :, 3] = math.inf  # a padded token's column too
        torch.testing.assert_close(function(x, token_mask=mask)[1], function(x[1:, :3, :3])[0])
        # A matrix that is not square: the mask selects its rows only (its columns are not tokens).
        wide = torch.rand(2, 4, 5, dtype=torch.float64)
        wide[1, 3] = math.nan
        torch.testing.assert_close(function(wide, token_mask=mask)[1], function(wide[1:, :3])[0])
    else:
        torch.testing.assert_close(function(x, token_mask=mask)[1], function(x[1:, :3])[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(COMPUTED))
def test_half_inputs_are_computed_in_float32(name, dtype):
    x = (collapsing(2, 5, 4, 1e-2) * 300).to(dtype)  # squares beyond float16's range
    got = COMPUTED[name](x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, COMPUTED[name](x.float()), rtol=0, atol=0)
    torch.testing.assert_close(got.double(), COMPUTED[name](x.double()), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("scale", [1.0, 1e-30, 3e20])
def test_token_cosine_eps_bounds_a_tokens_norm_by_the_largest_entry(dtype, scale):
    """eps is what its docstring says: a lower bound on a token's norm of eps times the largest
    absolute entry of the matrix. The code bounded the norm of the matrix scaled to a largest entry
    in [½, 1) by eps, so eps · 2^e instead: with a largest entry of 3 (e = 2) and eps = 0.5 a token
    of norm 1.6 (above 1.5) was cut to 0.8 of itself."""
    f = pk.metrics.token_cosine_similarity
    parallel = torch.tensor([[3.0, 0.0], [1.6, 0.0]], dtype=dtype) * scale  # norm 1.6 > eps · 3 = 1.5
    assert f(parallel, eps=0.5).item() == pytest.approx(1.0, rel=1e-6)
    small = torch.tensor([[3.0, 0.0], [1.2, 0.0]], dtype=dtype) * scale  # 1.2 < 1.5: divided by 1.5
    assert f(small, eps=0.5).item() == pytest.approx(0.8, rel=1e-6)
    # The default: only tokens 10^12 times below the largest entry are touched; a zero token is
    # orthogonal to the rest, and a zero matrix gives 0.
    with_zero = torch.tensor([[1.0, 2.0], [0.0, 0.0], [2.0, 4.0]], dtype=dtype) * scale
    assert f(with_zero).item() == pytest.approx(1 / 3, rel=1e-6)
    assert f(torch.zeros(3, 2, dtype=dtype)).item() == 0.0
