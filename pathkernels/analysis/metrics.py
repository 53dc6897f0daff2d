"""Measures of rank collapse and token similarity, batched over any leading dimensions.

Every function takes token matrices ``x [..., n, d]`` (n tokens in rows, as hidden states come)
or stochastic matrices ``P [..., n, n]``, and returns one value per matrix ``[...]``. They run on
any device that torch supports and compute in the input's dtype; float16 and bfloat16 inputs are
computed, and returned, in float32 (a diversity of 1e-9 has no float16 value).

Precision at collapse. Collapse is the regime where the tokens agree to many digits, so nothing
here subtracts two nearly equal measurements (``1 − similarity`` loses every digit there). The
centred tokens ``X − 1μᵀ`` are formed in two passes (relative to the first token, then to the mean
of those differences), and token diversity, the residual ratio and the rank-1 residual (with the
singular values behind the stable and effective rank) are measured on them: a few units in the
last place even for tokens 1e-15 apart in float64. Each matrix is scaled by a power of two near
its largest entry before anything is squared, so the scale-invariant measures give the same value
for ``x``, ``1e200 · x`` and ``1e-200 · x``.

Conventions. NaN or inf (at real tokens) is refused with a ValueError naming the function and
the argument. A zero matrix counts as collapsed (its tokens are all equal): residual ratio,
rank-1 residual, token diversity, stable rank and effective rank 0, token similarity 1; its
cosine similarity is 0 (zero tokens count as orthogonal) and its Dobrushin coefficient 0.

Padded batches: every function takes ``token_mask`` (True at real tokens, e.g. a padded batch's
``attention_mask`` ``[B, n]``, or ``AttentionStack.token_mask``), which broadcasts against the rows
``x.shape[:-1]``; each matrix is then measured on its real tokens only.

- :func:`residual_ratio`: ``‖x − 1μᵀ‖_{1,∞} / ‖x‖_{1,∞}`` (Dong, Cordonnier & Loukas 2021, Figure 1);
- :func:`rank1_residual`: distance to the best rank-1 approximation (SVD), in the Frobenius or
  the composite norm;
- :func:`token_similarity`, :func:`token_diversity`, :func:`escalation_rate` (Yu & Zhang,
  arXiv 2312.06182);
- :func:`effective_rank`, :func:`stable_rank`, :func:`dobrushin`, :func:`token_cosine_similarity`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

from pathkernels.core._memory import check_fits
from pathkernels.core.checks import check_finite, check_flag
from pathkernels.core.masking import per_matrix
from pathkernels.core.ops import composite_norm

# Computed in float32: LAPACK has no half SVD, and half squares overflow at 256.
_UPCAST = {torch.float16: torch.float32, torch.bfloat16: torch.float32}

# Per dtype: the integer type of its bits, exponent bias, mantissa bits, normal exponent range.
_BITS = {torch.float64: (torch.int64, 1023, 52, -1022, 1023), torch.float32: (torch.int32, 127, 23, -126, 127)}


def _matrices(x: Tensor | Sequence[Tensor], where: str, *, min_rows: int = 1, name: str = "x") -> Tensor:
    """Check ``x`` (or stack a sequence of same-shape tensors, e.g. HF ``hidden_states``), naming it
    ``name`` in the messages."""
    if isinstance(x, (list, tuple)):
        if not x:
            raise ValueError(f"{where}: expected a tensor [..., n, d] or a non-empty sequence of them")
        kinds = {type(t).__name__ for t in x if not isinstance(t, Tensor)}
        if kinds:
            raise TypeError(
                f"{where}: expected a tensor [..., n, d] or a sequence of tensors, got a sequence holding "
                f"{', '.join(sorted(kinds))}"
            )
        shapes = {tuple(t.shape) for t in x}
        if len(shapes) != 1:
            raise ValueError(f"{where}: expected a sequence of tensors of one shape, got shapes {sorted(shapes)}")
        x = torch.stack(list(x))
    if not isinstance(x, Tensor):
        raise TypeError(f"{where}: expected {name} to be a torch.Tensor [..., n, d], got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(f"{where}: expected {name} to have at least 2 dimensions [..., n, d], got {x.dim()}")
    if not x.is_floating_point():
        raise TypeError(f"{where}: expected {name} to be a floating-point tensor, got {x.dtype}")
    if x.shape[-2] < min_rows:
        raise ValueError(
            f"{where}: expected at least {min_rows} tokens (rows) in {name} [..., n, d], got {x.shape[-2]}"
        )
    if x.shape[-1] < 1:
        raise ValueError(f"{where}: expected at least one column in {name} [..., n, d], got {list(x.shape)}")
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{where}: expected {name} on a CPU or CUDA device, got {x.device}")
    return x


def _prepare(
    x: Tensor | Sequence[Tensor],
    token_mask: Tensor | None,
    name: str,
    where: str,
    *,
    min_rows: int = 1,
    square: bool = False,
) -> Tensor:
    """``x`` checked (:func:`_matrices`), refused where it holds NaN or inf at a real token (padded
    rows, and padded columns of square inputs, may hold anything), in the dtype it is computed in."""
    x = _matrices(x, where, min_rows=min_rows, name=name)
    check_fits(  # the working copies (upcast, centred, scaled, absolute values): an expanded x is copied whole
        4 * 8 * x.numel(),
        x.device,
        where,
        f"{name} of {x.numel():,} entries {list(x.shape)} needs, in working copies,",
        "pass fewer or smaller matrices",
    )
    checked = x
    if isinstance(token_mask, Tensor) and token_mask.device.type in ("cpu", "cuda"):  # per_matrix refuses others
        try:
            real = torch.broadcast_to(token_mask.to(x.device) != 0, x.shape[:-1])
        except RuntimeError:
            real = None  # per_matrix refuses this mask with its own message
        if real is not None:
            if square and x.shape[-1] == x.shape[-2]:
                real = real[..., :, None] & real[..., None, :]
            else:
                real = real[..., None]
            checked = x.masked_fill(~real, 0)
    check_finite(checked, name, where)
    return x.to(_UPCAST.get(x.dtype, x.dtype))


# --- scaling by powers of two (exact), so that no square over- or underflows ---------------------


def _pow2(k: Tensor, dtype: torch.dtype) -> Tensor:
    """``2**k`` exactly, built from its bits; the integers k must lie in the dtype's normal range."""
    int_dtype, bias, mantissa_bits, _, _ = _BITS[dtype]
    return ((k.to(int_dtype) + bias) << mantissa_bits).view(dtype)


def _ldexp(m: Tensor, k: Tensor) -> Tensor:
    """``m · 2**k`` for integers k (broadcasting), exact unless the result leaves m's dtype. Where
    2**k itself is out of range (k up to ±2 · 1023), in two steps of normal factors."""
    _, _, _, low, high = _BITS[m.dtype]
    k = k.to(torch.int64)
    if bool(((k >= low) & (k <= high)).all()):
        return m * _pow2(k, m.dtype)
    first = torch.div(k, 2, rounding_mode="floor").clamp(low, high)
    second = (k - first).clamp(low, high)
    return m * _pow2(first, m.dtype) * _pow2(second, m.dtype)


def _exponent(x: Tensor, dims: tuple[int, ...]) -> Tensor:
    """int64 ``e`` with ``max |x|`` over ``dims`` in ``[2^(e−1), 2^e)``; 0 where x is all 0."""
    return torch.frexp(x.detach().abs().amax(dim=dims)).exponent.to(torch.int64)


def _scaled(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(x · 2**−e, e)`` per matrix of ``x [..., n, d]``: the largest entry of each scaled matrix in
    [½, 1) (or a zero matrix). Exact: only entries below 2^−1022 of the largest can lose bits."""
    e = _exponent(x, (-2, -1))
    return _ldexp(x, -e[..., None, None]), e


def _norm(x: Tensor, dims: tuple[int, ...] = (-2, -1)) -> tuple[Tensor, Tensor]:
    """The Euclidean (Frobenius) norm of ``x`` over its trailing ``dims`` as ``(m, e)`` with
    ``‖x‖ = m · 2**e``: where the plain norm could have lost digits to squares that over- or
    underflow, it is taken of x scaled by ``2**−e`` (its largest entry in [½, 1)), otherwise e = 0."""
    plain = torch.linalg.vector_norm(x, dim=dims)
    _, _, _, low, high = _BITS[x.dtype]
    # A norm within 2^(±range/4) is the sum of squares that neither overflow nor, beyond a share
    # of 2^(range·3/4) of it, underflow: it needs no scaling.
    if bool(((plain >= 2.0 ** (low / 4)) & (plain <= 2.0 ** (high / 4))).all()):
        return plain, torch.zeros(plain.shape, dtype=torch.int64, device=x.device)
    e = _exponent(x, dims)
    return torch.linalg.vector_norm(_ldexp(x, -e[(...,) + (None,) * len(dims)]), dim=dims), e


def _quotient(m: Tensor, e: Tensor, denominator: Tensor) -> Tensor:
    """``m · 2**e / denominator`` in float64, 0 where the denominator is 0 (m is then 0 as well)."""
    zero = denominator == 0
    return torch.where(zero, 0.0, _ldexp((m / denominator.masked_fill(zero, 1)).double(), e))


# --- the mean token and the centred tokens, accurate when the tokens nearly agree ---------------


def _sum_rows(x: Tensor) -> Tensor:
    """``Σ_i x_i`` over the rows (dim −2), compensated (Ogita, Rump & Oishi's Sum2): each addition's
    exact rounding error (TwoSum) is accumulated apart and added in at the end, as accurate as a sum
    in twice the working precision, then rounded. Entries must be far from overflow (here ≤ 1)."""
    total, error = x[..., 0, :], torch.zeros_like(x[..., 0, :])
    for i in range(1, x.shape[-2]):
        row = x[..., i, :]
        new = total + row
        row_part = new - total
        error = error + ((total - (new - row_part)) + (row - row_part))
        total = new
    return total + error


def _centre(xs: Tensor) -> tuple[Tensor, Tensor]:
    """``(μ [..., d], C [..., n, d])`` with ``xs = 1μᵀ + C``, μ the mean token.

    Subtracting a rounded mean would leave its rounding error, up to u·|μ|, in every centred entry:
    all of C once the tokens agree to the last bits. So the tokens are first taken relative to the
    first one, ``xs − 1x₁ᵀ``, which is exact wherever a column's entries agree within a factor 2
    (Sterbenz), and then centred on their own mean, whose rounding error is u relative to C itself.
    C is thereby accurate to a few ulps of its own size, and exactly 0 when the tokens are equal."""
    first = xs[..., :1, :]
    relative = xs - first
    offset = relative.mean(-2, keepdim=True)
    return (first + offset).squeeze(-2), relative - offset


def _centred_share(x: Tensor) -> Tensor:
    """``‖X − 1μᵀ‖_F / ‖X‖_F`` per matrix of ``x [..., n, d]``, float64 (0 for a zero matrix)."""
    xs, _ = _scaled(x)
    _, c = _centre(xs)
    m, e = _norm(c)
    return _quotient(m, e, torch.linalg.vector_norm(xs, dim=(-2, -1)))


# --- the best rank-1 approximation ---------------------------------------------------------------


def _deflate(a: Tensor, c: Tensor, *, values: bool, residual: bool):
    """Singular values and rank-1 residual of ``X = 1μᵀ + C`` near collapse, to a few ulps of C
    rather than of X, from ``a = √n μ [N, d]`` and the centred tokens ``C [N, n, d]`` (n, d ≥ 2,
    ``‖C‖_F ≤ ‖a‖ / 4``).

    Two reflections, H on the rows (``H·1/√n = −e₁``) and G on the columns (``a·G = −s‖a‖e₁``), give
    ``M = H X G = [[s‖a‖, 0], [c, B]]``, whose small blocks (rows 2..n of ``H C G``) come from C
    alone. M's top right singular vector is ``v ∝ (1, y)`` with ``λ y = Bᵀc + BᵀB y`` and
    ``λ = σ₁² = ‖a‖² + ‖c‖² + cᵀB y``: a fixed point that contracts by ``‖B‖²/λ ≤ 1/16`` per step.
    ``R = M (I − vvᵀ)`` is then formed block by block, without cancellation: its singular values
    are σ₂, σ₃, … and ``H R G = X − σ₁u₁v₁ᵀ``.

    Returns ``(σ [N, min(n, d)] or None, R [N, n, d], H R G or None)``.
    """
    _, n, d = c.shape
    root_n = math.sqrt(n)
    # H = I − 2wwᵀ/wᵀw with w = 1/√n + e₁: 2/wᵀw = √n/(√n + 1). Row 1 of H X is −a − 1ᵀC/√n.
    w = torch.full((n,), 1 / root_n, dtype=c.dtype, device=c.device)
    w[0] += 1
    wc = c[:, 0] + c.sum(1) / root_n
    rows = c[:, 1:] - (wc / (root_n + 1))[:, None, :]  # rows 2..n of H C
    a = a + c.sum(1) / root_n
    alpha = torch.linalg.vector_norm(a, dim=-1)
    sign = torch.where(a[:, 0] < 0, -1.0, 1.0).to(a.dtype)
    g = a.clone()
    g[:, 0] += sign * alpha  # G = I − 2ggᵀ/gᵀg with gᵀg = 2α(α + |a₁|): no cancellation
    two_over_gg = 1 / (alpha * (alpha + a[:, 0].abs()))

    def reflect_columns(t: Tensor) -> Tensor:
        return t - (t @ g[:, :, None]) * two_over_gg[:, None, None] * g[:, None, :]

    small = reflect_columns(rows)
    cv, b = small[:, :, 0], small[:, :, 1:]
    bc = (b.mT @ cv[:, :, None])[:, :, 0]
    base = alpha.square() + cv.square().sum(-1)
    y, lam = torch.zeros_like(bc), base
    eps = torch.finfo(c.dtype).eps
    for _ in range(100):  # at most ~14 steps at the contraction 1/16; 2 or 3 at real collapse
        y_next = (bc + (b.mT @ (b @ y[:, :, None]))[:, :, 0]) / lam[:, None]
        lam = base + (bc * y_next).sum(-1)
        settled = bool(((y_next - y).abs().amax(-1) <= 4 * eps * y_next.abs().amax(-1)).all())
        y = y_next
        if settled:
            break
    yy = y.square().sum(-1)
    kappa = 1 / (1 + yy)
    by = (b @ y[:, :, None])[:, :, 0]
    sigma0 = sign * alpha
    top = torch.cat([(sigma0 * yy * kappa)[:, None], -(sigma0 * kappa)[:, None] * y], -1)
    left = (cv * yy[:, None] - by) * kappa[:, None]
    right = b - ((cv + by) * kappa[:, None])[:, :, None] * y[:, None, :]
    r = torch.cat([top[:, None, :], torch.cat([left[:, :, None], right], -1)], 1)
    sigma = None
    if values:
        sigma = torch.cat([lam.sqrt()[:, None], torch.linalg.svdvals(r)[:, : min(n, d) - 1]], -1)
    rest = None
    if residual:
        rg = reflect_columns(r)
        wr = rg[:, 0] + rg.sum(1) / root_n
        rest = rg - w[None, :, None] * (wr * (root_n / (root_n + 1)))[:, None, :]
    return sigma, r, rest


def _rank1(xs: Tensor, *, values: bool = False, residual: bool = False):
    """Singular values and best rank-1 residual ``X − σ₁u₁v₁ᵀ`` of ``xs [N, n, d]`` (scaled).

    Returns ``(σ [N, min(n, d)] or None, (m, e), residual [N, n, d] or None)``, the singular values
    descending and ``‖X − σ₁u₁v₁ᵀ‖_F = m · 2**e``.

    An SVD fixes σ₂, σ₃, … only to within about u·σ₁: nothing is left of them once the tokens
    agree to 15 digits. Near collapse (``‖X − 1μᵀ‖_F ≤ √n ‖μ‖ / 4``) :func:`_deflate` works on the
    centred tokens instead, for a relative error of about u·‖X − 1μᵀ‖/σ₂; elsewhere an SVD of X.
    """
    count, n, d = xs.shape
    k = min(n, d)
    sigma = xs.new_zeros(count, k) if values else None
    tail_m = xs.new_zeros(count)
    tail_e = torch.zeros(count, dtype=torch.int64, device=xs.device)
    rest = torch.zeros_like(xs) if residual else None
    if k == 1:  # a single row or column: rank ≤ 1, σ₁ = ‖X‖_F, and the residual is exactly 0
        if values:
            sigma[:, 0] = torch.linalg.vector_norm(xs, dim=(-2, -1))
        return sigma, (tail_m, tail_e), rest
    mean, c = _centre(xs)
    a = mean * math.sqrt(n)
    alpha = torch.linalg.vector_norm(a, dim=-1)
    near = (alpha > 0) & (torch.linalg.vector_norm(c, dim=(-2, -1)) <= alpha / 4)
    chosen = near.nonzero().flatten()
    if chosen.numel():
        s, r, part = _deflate(a[chosen], c[chosen], values=values, residual=residual)
        tail_m[chosen], tail_e[chosen] = _norm(r)
        if values:
            sigma[chosen] = s
        if residual:
            rest[chosen] = part
    chosen = (~near).nonzero().flatten()
    if chosen.numel():
        x = xs[chosen]
        if residual:
            u, s, vh = torch.linalg.svd(x, full_matrices=False)
            rest[chosen] = x - s[:, :1, None] * u[:, :, :1] @ vh[:, :1, :]
        else:
            s = torch.linalg.svdvals(x)
        if values:
            sigma[chosen] = s
        tail_m[chosen], tail_e[chosen] = _norm(s[:, 1:], (-1,))
    return sigma, (tail_m, tail_e), rest


def _singular_values(x: Tensor) -> Tensor:
    """The singular values of each matrix of ``x [..., n, d]``, scaled by its own power of two."""
    xs, _ = _scaled(x)
    sigma, _, _ = _rank1(xs.reshape(-1, *xs.shape[-2:]), values=True)
    return sigma.reshape(*xs.shape[:-2], min(xs.shape[-2:]))


# --- the metrics ---------------------------------------------------------------------------------


def residual_ratio(hidden_states: Tensor | Sequence[Tensor], *, token_mask: Tensor | None = None) -> Tensor:
    """The paper's rank-collapse measure of hidden states, per matrix.

    ``ratio(X) = ‖X − 1μᵀ‖_{1,∞} / ‖X‖_{1,∞}``, with μ the mean token (column mean over the n rows)
    and ``‖·‖_{1,∞} = sqrt(‖·‖_1 ‖·‖_∞)``. 0 means every token is the same (rank-1 collapse).
    ``X − 1μᵀ`` is formed to a few ulps of its own size however close the tokens are (see the module
    notes), so the ratio keeps its digits at collapse and at any scale.

    The paper defines the residual as ``min_x ‖X − 1xᵀ‖``; centring on the mean token gives an upper
    bound of it (the minimiser of a composite norm is not the mean in general), and the one that the
    centring identity ``C(PQ) = C(P) C(Q)`` carries exactly through attention products. The ratio
    can exceed 1, up to 2: centring can enlarge a column's abs sum (``e_1`` becomes ``e_1 − 1/n``,
    abs sum ``2(n−1)/n``), e.g. 1.5 for ``X = I`` with n = 4.

    Hugging Face ``hidden_states`` of GPT-2 (and other models with a final normalisation) end
    with the state after the final LayerNorm, not the residual stream itself; the adapters'
    ``AttentionStack.hidden_states`` are the same tensors. Take the pre-LayerNorm stream from
    TransformerLens (``from_transformer_lens``: the last entry is ``resid_post``) when that matters.

    Args:
        hidden_states: ``[..., n, d]``, or a sequence of ``[B, n, d]`` tensors (one per layer, as
            Hugging Face returns them), which is stacked to ``[L+1, B, n, d]``. Finite.
        token_mask: True at real tokens, broadcasting against ``[..., n]`` (``[B, n]`` for hidden
            states): each matrix measured on its real tokens only.

    Returns:
        ``[...]`` (``[L+1, B]`` for a sequence). A zero matrix gives 0 (its tokens are all equal).
    """
    where = "pathkernels.metrics.residual_ratio"
    x = _prepare(hidden_states, token_mask, "hidden_states", where)

    def ratio(x: Tensor) -> Tensor:
        xs, _ = _scaled(x)
        _, c = _centre(xs)
        e = _exponent(c, (-2, -1))
        residual = composite_norm(_ldexp(c, -e[..., None, None]))
        return _quotient(residual, e, composite_norm(xs)).to(x.dtype)

    return per_matrix(ratio, x, token_mask, where)


_RANK1_NORMS = ("frobenius", "composite")


def rank1_residual(
    x: Tensor | Sequence[Tensor], *, relative: bool = True, norm: str = "frobenius", token_mask: Tensor | None = None
) -> Tensor:
    """Distance of each matrix to its best rank-1 approximation ``σ_1 u_1 v_1ᵀ`` (SVD).

    - ``norm="frobenius"``: ``‖X − σ_1 u_1 v_1ᵀ‖_F = sqrt(Σ_{i≥2} σ_i²)``, divided by
      ``‖X‖_F = sqrt(Σ_i σ_i²)`` when ``relative`` (then in [0, 1]; 0 for rank ≤ 1).
    - ``norm="composite"``: ``‖X − σ_1 u_1 v_1ᵀ‖_{1,∞}``, divided by ``‖X‖_{1,∞}`` when
      ``relative``: the measure of the path figure of Dong, Cordonnier & Loukas (2021). The
      truncated SVD is the best rank-1 approximation in the Frobenius and spectral norms, not in
      ``‖·‖_{1,∞}``, so this ratio can exceed 1.

    An SVD of X knows σ₂, σ₃, … only to within about u·σ₁, nothing at all once the tokens agree to
    15 digits. Near collapse (``‖X − 1μᵀ‖_F ≤ √n ‖μ‖/4``) the residual is therefore computed from the
    centred tokens, to a few ulps of ``‖X − 1μᵀ‖`` (relative error about u·‖X − 1μᵀ‖_F/σ₂).
    Matrices close to rank 1 in another way (``X ≈ u vᵀ`` with u far from constant) keep the
    SVD's absolute error u·σ₁.

    Args:
        x: ``[..., n, d]`` or a sequence of same-shape tensors (stacked). Finite.
        relative: divide by the norm of X.
        norm: ``"frobenius"`` or ``"composite"``.
        token_mask: True at real tokens, broadcasting against ``[..., n]``.

    Returns:
        ``[...]``. A zero matrix gives 0 (it is its own best rank-1 approximation).
    """
    where = "pathkernels.metrics.rank1_residual"
    x = _prepare(x, token_mask, "x", where)
    if norm not in _RANK1_NORMS:
        raise ValueError(f"{where}: expected norm in {_RANK1_NORMS}, got {norm!r}")
    relative = check_flag(relative, "relative", where)

    def frobenius(x: Tensor) -> Tensor:
        xs, e_x = _scaled(x)
        _, (m, e), _ = _rank1(xs.reshape(-1, *xs.shape[-2:]))
        m, e = m.reshape(xs.shape[:-2]), e.reshape(xs.shape[:-2])
        if relative:
            return _quotient(m, e, torch.linalg.vector_norm(xs, dim=(-2, -1))).to(x.dtype)
        return _ldexp(m, e + e_x)

    def composite(x: Tensor) -> Tensor:
        xs, e_x = _scaled(x)
        _, _, rest = _rank1(xs.reshape(-1, *xs.shape[-2:]), residual=True)
        rest = rest.reshape(xs.shape)
        e = _exponent(rest, (-2, -1))
        tail = composite_norm(_ldexp(rest, -e[..., None, None]))
        if relative:
            return _quotient(tail, e, composite_norm(xs)).to(x.dtype)
        return _ldexp(tail, e + e_x)

    return per_matrix(frobenius if norm == "frobenius" else composite, x, token_mask, where)


def token_similarity(x: Tensor | Sequence[Tensor], *, token_mask: Tensor | None = None) -> Tensor:
    """Token similarity ``t_sim(X) = ‖Π₁X‖²_F / ‖X‖²_F`` with ``Π₁ = 11ᵀ/n`` (Yu & Zhang).

    ``Π₁X`` repeats the mean token in every row, so ``t_sim = n ‖μ‖² / ‖X‖²_F`` ∈ [0, 1]; it is 1
    when all tokens are equal. μ comes from a compensated sum, so a small similarity (columns whose
    entries cancel) keeps its digits too. Near 1, its complement is :func:`token_diversity`, which
    is not ``1 − t_sim`` computed.

    Args:
        x: ``[..., n, d]`` or a sequence of same-shape tensors (stacked). Finite.
        token_mask: True at real tokens, broadcasting against ``[..., n]``.

    Returns:
        ``[...]``. A zero matrix gives 1 (its tokens are all equal).
    """
    where = "pathkernels.metrics.token_similarity"
    x = _prepare(x, token_mask, "x", where)

    def similarity(x: Tensor) -> Tensor:
        xs, _ = _scaled(x)
        m, e = _norm(_sum_rows(xs) / x.shape[-2], (-1,))
        total = torch.linalg.vector_norm(xs, dim=(-2, -1))
        share = _quotient(m * math.sqrt(x.shape[-2]), e, total).square()
        return torch.where(total == 0, 1.0, share).to(x.dtype)

    return per_matrix(similarity, x, token_mask, where)


def token_diversity(x: Tensor | Sequence[Tensor], *, token_mask: Tensor | None = None) -> Tensor:
    """``1 − t_sim(X) = ‖X − 1μᵀ‖²_F / ‖X‖²_F``: the share of energy not in the mean token, ∈ [0, 1].

    Computed from the centred tokens (see the module notes), not as ``1 − t_sim``: it keeps its
    digits as the tokens collapse (2.9e-19 for tokens 1e-9 apart, where ``1 − t_sim`` gives 0).
    It rounds to 0 only where the share is below the dtype's smallest number (tokens ~1e-162 of
    their size apart in float64); :func:`escalation_rate` does not square, and keeps those too.

    Args:
        x: ``[..., n, d]`` or a sequence of same-shape tensors (stacked). Finite.
        token_mask: True at real tokens, broadcasting against ``[..., n]``.

    Returns:
        ``[...]``. 0 exactly when all tokens are equal, a zero matrix included.
    """
    where = "pathkernels.metrics.token_diversity"
    x = _prepare(x, token_mask, "x", where)
    return per_matrix(lambda x: _centred_share(x).square().to(x.dtype), x, token_mask, where)


def escalation_rate(hidden_states: Tensor | Sequence[Tensor], *, token_mask: Tensor | None = None) -> Tensor:
    """Per-layer factor by which token diversity shrinks: ``div(X_l) / div(X_{l−1})``, l = 1..L.

    Yu & Zhang show that under repeated self-attention token similarity escalates at a linear
    rate, i.e. the diversity ``1 − t_sim`` decays geometrically; this returns the per-layer factor
    (< 1 where similarity escalates, > 1 where a layer restores diversity). The diversities are
    those of :func:`token_diversity`, accurate at collapse, and their ratio is taken before squaring
    (``(‖C_l‖/‖X_l‖ / (‖C_{l−1}‖/‖X_{l−1}‖))²``, C the centred tokens), so it stays right where the
    diversities themselves would underflow.

    Where layer l − 1 has diversity exactly 0 (all its tokens equal, e.g. a sequence of one real
    token): the rate is 1 if layer l has diversity 0 too (nothing to escalate or restore), and inf
    if layer l restores some.

    Args:
        hidden_states: ``[L+1, ..., n, d]`` (layer first), or a sequence of L+1 tensors
            ``[..., n, d]`` (e.g. Hugging Face ``hidden_states``). Finite.
        token_mask: True at real tokens, broadcasting against ``[..., n]`` (``[B, n]``).

    Returns:
        ``[L, ...]``.
    """
    where = "pathkernels.metrics.escalation_rate"
    x = _prepare(hidden_states, token_mask, "hidden_states", where)
    if x.dim() < 3 or x.shape[0] < 2:
        raise ValueError(
            f"{where}: expected at least two layers of hidden states [L+1, ..., n, d], got shape {list(x.shape)}"
        )
    share = per_matrix(_centred_share, x, token_mask, where)  # float64 [L+1, ...]
    before, after = share[:-1], share[1:]
    rate = (after / before.masked_fill(before == 0, 1)).square()
    rate = torch.where(before == 0, torch.where(after == 0, 1.0, math.inf), rate)
    return rate.to(x.dtype)


def effective_rank(x: Tensor | Sequence[Tensor], *, token_mask: Tensor | None = None) -> Tensor:
    """Effective rank (Roy & Vetterli 2007): ``exp(−Σ_i p_i log p_i)``, ``p_i = σ_i / Σ_j σ_j``.

    Between 1 (rank 1) and ``min(n, d)`` (all singular values equal); terms with ``p_i = 0`` count 0.
    The singular values are those of :func:`rank1_residual`'s computation (σ₂, σ₃, … from the
    centred tokens near collapse).

    Args:
        x: ``[..., n, d]`` or a sequence of same-shape tensors (stacked). Finite.
        token_mask: True at real tokens, broadcasting against ``[..., n]``.

    Returns:
        ``[...]``. A zero matrix gives 0 (its rank).
    """
    where = "pathkernels.metrics.effective_rank"
    x = _prepare(x, token_mask, "x", where)

    def rank(x: Tensor) -> Tensor:
        sigma = _singular_values(x)
        total = sigma.sum(-1, keepdim=True)
        p = sigma / total.masked_fill(total == 0, 1)
        return torch.where(total[..., 0] == 0, 0.0, (-torch.special.xlogy(p, p).sum(-1)).exp())

    return per_matrix(rank, x, token_mask, where)


def stable_rank(x: Tensor | Sequence[Tensor], *, token_mask: Tensor | None = None) -> Tensor:
    """Stable rank ``‖X‖²_F / ‖X‖²_2 = Σ_i σ_i² / σ_1²``, between 1 and ``rank(X)``.

    Args:
        x: ``[..., n, d]`` or a sequence of same-shape tensors (stacked). Finite.
        token_mask: True at real tokens, broadcasting against ``[..., n]``.

    Returns:
        ``[...]``. A zero matrix gives 0 (its rank).
    """
    where = "pathkernels.metrics.stable_rank"
    x = _prepare(x, token_mask, "x", where)

    def rank(x: Tensor) -> Tensor:
        sigma = _singular_values(x)
        top = sigma[..., :1]
        return (sigma / top.masked_fill(top == 0, 1)).square().sum(-1)  # 0 for a zero matrix

    return per_matrix(rank, x, token_mask, where)


def dobrushin(p: Tensor, *, token_mask: Tensor | None = None) -> Tensor:
    """Dobrushin's ergodicity coefficient ``τ₁(P) = ½ max_{i,j} Σ_k |P_ik − P_jk|``.

    For a row-stochastic P it lies in [0, 1], is 0 exactly when all rows are equal (P = 1πᵀ) and
    bounds the contraction of token differences: ``τ₁(PQ) ≤ τ₁(P) τ₁(Q)``. Any finite P is taken
    (``τ₁(cP) = |c| τ₁(P)``; 0 for a zero matrix).

    Args:
        p: ``[..., n, m]`` (usually attention ``[B, L, H, n, n]``). Finite.
        token_mask: True at real tokens, with ``p.dim() - 1`` dims broadcasting against
            ``[..., n]`` (``mask[:, None, None, :]`` for attention ``[B, L, H, n, n]``): the rows,
            and for a square ``p`` the columns too, restricted to the real tokens.

    Returns:
        ``[...]``.
    """
    where = "pathkernels.metrics.dobrushin"
    p = _prepare(p, token_mask, "p", where, square=True)

    def coefficient(p: Tensor) -> Tensor:
        ps, e = _scaled(p)  # so that sums of entries near the largest float do not overflow
        flat = ps.reshape(-1, *p.shape[-2:])
        distances = torch.cdist(flat, flat, p=1)  # [N, n, n]: ℓ1 distance between rows i and j
        return _ldexp(distances.amax(dim=(-2, -1)).reshape(p.shape[:-2]) / 2, e)

    return per_matrix(coefficient, p, token_mask, where, square=p.shape[-1] == p.shape[-2])


def token_cosine_similarity(
    x: Tensor | Sequence[Tensor], *, eps: float = 1e-12, token_mask: Tensor | None = None
) -> Tensor:
    """Mean cosine similarity over pairs of distinct tokens: ``mean_{i≠j} ⟨x_i, x_j⟩ / (‖x_i‖ ‖x_j‖)``.

    Args:
        x: ``[..., n, d]`` with n ≥ 2, or a sequence of same-shape tensors (stacked). Finite.
        eps: lower bound on a token's norm, relative to the largest absolute entry of its matrix
            (the measure is scale-invariant): a token whose norm is below ``eps · max|x|`` is
            divided by that bound instead of its norm, so that a zero token counts as orthogonal
            to the rest and a tiny one as nearly so. With the default 1e-12 only tokens 10^12
            times smaller than the largest entry are affected.
        token_mask: True at real tokens, broadcasting against ``[..., n]``.

    Returns:
        ``[...]`` in [-1, 1]. A zero matrix gives 0.
    """
    where = "pathkernels.metrics.token_cosine_similarity"
    x = _prepare(x, token_mask, "x", where, min_rows=2)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"{where}: expected eps to be a positive real number, got {type(eps).__name__} {eps!r}")
    if not (0 < eps < math.inf):  # NaN too
        raise ValueError(f"{where}: expected eps to be a positive finite number, got {eps!r}")

    def similarity(x: Tensor) -> Tensor:
        n = x.shape[-2]
        if n < 2:
            raise ValueError(f"{where}: expected at least 2 real tokens per matrix, got {n}")
        xs, _ = _scaled(x)
        # The bound eps · max|x| of the scaled matrix (its largest entry in [½, 1), not 1), kept
        # positive (a zero matrix, or eps · max below the dtype's range: a zero token divides to 0).
        largest = xs.abs().amax((-2, -1), keepdim=True)
        bound = (largest * eps).clamp_min(torch.finfo(xs.dtype).tiny)
        unit = xs / torch.maximum(torch.linalg.vector_norm(xs, dim=-1, keepdim=True), bound)
        # Σ_{i,j} ⟨u_i, u_j⟩ = ‖Σ_i u_i‖²; remove the diagonal Σ_i ‖u_i‖².
        total = unit.sum(-2).square().sum(-1)
        diagonal = unit.square().sum((-2, -1))
        return (total - diagonal) / (n * (n - 1))

    return per_matrix(similarity, x, token_mask, where)
