"""Measures of rank collapse and token similarity, batched over any leading dimensions.

Every function takes token matrices ``x [..., n, d]`` (n tokens in rows, as hidden states come)
or stochastic matrices ``P [..., n, n]``, and returns one value per matrix ``[...]``. They run on
any device and dtype that torch supports, and compute in the input's dtype.

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

from collections.abc import Sequence

import torch
from torch import Tensor

from pathkernels.checks import check_finite
from pathkernels.masking import per_matrix
from pathkernels.ops import composite_norm, residual_norm


def _finite(x: Tensor, where: str) -> Tensor:
    """``x``, refused (:func:`~pathkernels.checks.check_finite`) where it holds NaN or inf: an SVD
    has no answer there."""
    check_finite(x, "x", where)
    return x


def _matrices(x: Tensor | Sequence[Tensor], where: str, *, min_rows: int = 1) -> Tensor:
    """Check ``x`` (or stack a sequence of same-shape tensors, e.g. HF ``hidden_states``)."""
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
        raise TypeError(f"{where}: expected x to be a torch.Tensor [..., n, d], got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(f"{where}: expected x to have at least 2 dimensions [..., n, d], got {x.dim()}")
    if not x.is_floating_point():
        raise TypeError(f"{where}: expected a floating-point tensor, got {x.dtype}")
    if x.shape[-2] < min_rows:
        raise ValueError(f"{where}: expected at least {min_rows} tokens (rows) in [..., n, d], got {x.shape[-2]}")
    if x.shape[-1] < 1:
        raise ValueError(f"{where}: expected at least one column in [..., n, d], got {list(x.shape)}")
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{where}: expected x on a CPU or CUDA device, got {x.device}")
    return x


def residual_ratio(hidden_states: Tensor | Sequence[Tensor], *, token_mask: Tensor | None = None) -> Tensor:
    """The paper's rank-collapse measure of hidden states, per matrix.

    ``ratio(X) = ‖X − 1μᵀ‖_{1,∞} / ‖X‖_{1,∞}``, with μ the mean token (column mean over the n rows)
    and ``‖·‖_{1,∞} = sqrt(‖·‖_1 ‖·‖_∞)``. 0 means every token is the same (rank-1 collapse).

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
            Hugging Face returns them), which is stacked to ``[L+1, B, n, d]``.
        token_mask: True at real tokens, broadcasting against ``[..., n]`` (``[B, n]`` for hidden
            states): each matrix measured on its real tokens only.

    Returns:
        ``[...]`` (``[L+1, B]`` for a sequence). A zero matrix gives NaN (0/0).
    """
    x = _matrices(hidden_states, "pathkernels.metrics.residual_ratio")

    def ratio(x: Tensor) -> Tensor:
        residual, norm = residual_norm(x, return_norm=True)
        return residual / norm

    return per_matrix(ratio, x, token_mask, "pathkernels.metrics.residual_ratio")


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

    Args:
        x: ``[..., n, d]`` or a sequence of same-shape tensors (stacked).
        relative: divide by the norm of X.
        norm: ``"frobenius"`` or ``"composite"``.
        token_mask: True at real tokens, broadcasting against ``[..., n]``.

    Returns:
        ``[...]``.
    """
    where = "pathkernels.metrics.rank1_residual"
    x = _matrices(x, where)
    if norm not in _RANK1_NORMS:
        raise ValueError(f"{where}: expected norm in {_RANK1_NORMS}, got {norm!r}")

    def frobenius(x: Tensor) -> Tensor:
        sigma = torch.linalg.svdvals(_finite(x, where))
        tail = sigma[..., 1:].square().sum(-1).sqrt()
        return tail / sigma.square().sum(-1).sqrt() if relative else tail

    def composite(x: Tensor) -> Tensor:
        u, sigma, vh = torch.linalg.svd(_finite(x, where), full_matrices=False)
        rank1 = sigma[..., :1, None] * u[..., :, :1] @ vh[..., :1, :]
        tail = composite_norm(x - rank1)
        return tail / composite_norm(x) if relative else tail

    return per_matrix(frobenius if norm == "frobenius" else composite, x, token_mask, where)


def token_similarity(x: Tensor | Sequence[Tensor], *, token_mask: Tensor | None = None) -> Tensor:
    """Token similarity ``t_sim(X) = ‖Π₁X‖²_F / ‖X‖²_F`` with ``Π₁ = 11ᵀ/n`` (Yu & Zhang).

    ``Π₁X`` repeats the mean token in every row, so ``t_sim = n ‖μ‖² / ‖X‖²_F`` ∈ [0, 1]; it is 1
    when all tokens are equal.

    Args:
        x: ``[..., n, d]`` or a sequence of same-shape tensors (stacked).
        token_mask: True at real tokens, broadcasting against ``[..., n]``.

    Returns:
        ``[...]``.
    """
    return _token_similarity(x, token_mask, "pathkernels.metrics.token_similarity")


def _token_similarity(x, token_mask, where: str) -> Tensor:
    x = _matrices(x, where)

    def similarity(x: Tensor) -> Tensor:
        mean = x.mean(dim=-2)
        return x.shape[-2] * mean.square().sum(-1) / x.square().sum((-2, -1))

    return per_matrix(similarity, x, token_mask, where)


def token_diversity(x: Tensor | Sequence[Tensor], *, token_mask: Tensor | None = None) -> Tensor:
    """``1 − t_sim(X) = ‖(I − Π₁)X‖²_F / ‖X‖²_F``: the share of energy not in the mean token.

    Args:
        x: ``[..., n, d]`` or a sequence of same-shape tensors (stacked).
        token_mask: True at real tokens, broadcasting against ``[..., n]``.

    Returns:
        ``[...]``.
    """
    return 1 - _token_similarity(x, token_mask, "pathkernels.metrics.token_diversity")


def escalation_rate(hidden_states: Tensor | Sequence[Tensor], *, token_mask: Tensor | None = None) -> Tensor:
    """Per-layer factor by which token diversity shrinks: ``div(X_l) / div(X_{l−1})``, l = 1..L.

    Yu & Zhang show that under repeated self-attention token similarity escalates at a linear
    rate, i.e. the diversity ``1 − t_sim`` decays geometrically; this returns the per-layer factor
    (< 1 where similarity escalates, > 1 where a layer restores diversity).

    Args:
        hidden_states: ``[L+1, ..., n, d]`` (layer first), or a sequence of L+1 tensors
            ``[..., n, d]`` (e.g. Hugging Face ``hidden_states``).
        token_mask: True at real tokens, broadcasting against ``[..., n]`` (``[B, n]``).

    Returns:
        ``[L, ...]``.
    """
    x = _matrices(hidden_states, "pathkernels.metrics.escalation_rate")
    if x.dim() < 3 or x.shape[0] < 2:
        raise ValueError(
            "pathkernels.metrics.escalation_rate: expected at least two layers of hidden states "
            f"[L+1, ..., n, d], got shape {list(x.shape)}"
        )
    diversity = token_diversity(x, token_mask=token_mask)
    return diversity[1:] / diversity[:-1]


def effective_rank(x: Tensor | Sequence[Tensor], *, token_mask: Tensor | None = None) -> Tensor:
    """Effective rank (Roy & Vetterli 2007): ``exp(−Σ_i p_i log p_i)``, ``p_i = σ_i / Σ_j σ_j``.

    Between 1 (rank 1) and ``min(n, d)`` (all singular values equal); terms with ``p_i = 0`` count 0.

    Args:
        x: ``[..., n, d]`` or a sequence of same-shape tensors (stacked).
        token_mask: True at real tokens, broadcasting against ``[..., n]``.

    Returns:
        ``[...]``.
    """
    where = "pathkernels.metrics.effective_rank"
    x = _matrices(x, where)

    def rank(x: Tensor) -> Tensor:
        sigma = torch.linalg.svdvals(_finite(x, where))
        p = sigma / sigma.sum(-1, keepdim=True)
        return (-torch.special.xlogy(p, p).sum(-1)).exp()

    return per_matrix(rank, x, token_mask, "pathkernels.metrics.effective_rank")


def stable_rank(x: Tensor | Sequence[Tensor], *, token_mask: Tensor | None = None) -> Tensor:
    """Stable rank ``‖X‖²_F / ‖X‖²_2 = Σ_i σ_i² / σ_1²``, between 1 and ``rank(X)``.

    Args:
        x: ``[..., n, d]`` or a sequence of same-shape tensors (stacked).
        token_mask: True at real tokens, broadcasting against ``[..., n]``.

    Returns:
        ``[...]``.
    """
    where = "pathkernels.metrics.stable_rank"
    x = _matrices(x, where)

    def rank(x: Tensor) -> Tensor:
        sigma = torch.linalg.svdvals(_finite(x, where))
        return sigma.square().sum(-1) / sigma[..., 0].square()

    return per_matrix(rank, x, token_mask, "pathkernels.metrics.stable_rank")


def dobrushin(p: Tensor, *, token_mask: Tensor | None = None) -> Tensor:
    """Dobrushin's ergodicity coefficient ``τ₁(P) = ½ max_{i,j} Σ_k |P_ik − P_jk|``.

    For a row-stochastic P it lies in [0, 1], is 0 exactly when all rows are equal (P = 1πᵀ) and
    bounds the contraction of token differences: ``τ₁(PQ) ≤ τ₁(P) τ₁(Q)``.

    Args:
        p: ``[..., n, m]`` (usually attention ``[B, L, H, n, n]``).
        token_mask: for square ``p``: True at real tokens, with ``p.dim() - 1`` dims broadcasting
            against ``[..., n]`` (``mask[:, None, None, :]`` for attention ``[B, L, H, n, n]``):
            rows and columns restricted to the real tokens.

    Returns:
        ``[...]``.
    """
    p = _matrices(p, "pathkernels.metrics.dobrushin")

    def coefficient(p: Tensor) -> Tensor:
        flat = p.reshape(-1, *p.shape[-2:])
        distances = torch.cdist(flat, flat, p=1)  # [N, n, n]: ℓ1 distance between rows i and j
        return (distances.amax(dim=(-2, -1)) / 2).reshape(p.shape[:-2])

    return per_matrix(coefficient, p, token_mask, "pathkernels.metrics.dobrushin", square=True)


def token_cosine_similarity(
    x: Tensor | Sequence[Tensor], *, eps: float = 1e-12, token_mask: Tensor | None = None
) -> Tensor:
    """Mean cosine similarity over pairs of distinct tokens: ``mean_{i≠j} ⟨x_i, x_j⟩ / (‖x_i‖ ‖x_j‖)``.

    Args:
        x: ``[..., n, d]`` with n ≥ 2, or a sequence of same-shape tensors (stacked).
        eps: lower bound on a token's norm, so a zero token counts as orthogonal to the rest.
        token_mask: True at real tokens, broadcasting against ``[..., n]``.

    Returns:
        ``[...]`` in [-1, 1].
    """
    where = "pathkernels.metrics.token_cosine_similarity"
    x = _matrices(x, where, min_rows=2)

    def similarity(x: Tensor) -> Tensor:
        n = x.shape[-2]
        if n < 2:
            raise ValueError(f"{where}: expected at least 2 real tokens per matrix, got {n}")
        unit = x / x.norm(dim=-1, keepdim=True).clamp_min(eps)
        # Σ_{i,j} ⟨u_i, u_j⟩ = ‖Σ_i u_i‖²; remove the diagonal Σ_i ‖u_i‖².
        total = unit.sum(-2).square().sum(-1)
        diagonal = unit.square().sum((-2, -1))
        return (total - diagonal) / (n * (n - 1))

    return per_matrix(similarity, x, token_mask, where)
