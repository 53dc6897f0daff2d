"""Attention rollout (Abnar & Zuidema 2020), batched and correctly normalised."""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

from pathkernels.core import masking
from pathkernels.core._memory import check_fits
from pathkernels.core._scaling import leading_exponent, power_of_two
from pathkernels.core.checks import check_finite, check_flag, check_nonempty_batch, distinct_view, unpack_stack

_FUSIONS = ("mean", "max", "min")


def rollout(
    attn: Tensor,
    *,
    head_fusion: str = "mean",
    residual: bool = True,
    discard_ratio: float = 0.0,
    token_mask: Tensor | None = None,
) -> Tensor:
    """Attention rollout: ``R = Â_L ⋯ Â_2 Â_1`` with one fused, normalised matrix per layer.

    Per layer l: fuse the heads, ``F_l = mean_h A[l, h]`` (or the elementwise max or min); zero the
    smallest ``discard_ratio`` share of each row's off-diagonal entries; with ``residual`` add the
    skip connection, ``F_l + I``; then divide each row by its sum, ``Â_l = F_l / (F_l 1)``.
    ``R[i, j]`` is how much token i at the output draws on token j at the input.

    With mean fusion, ``residual=True`` and nothing discarded, ``Â_l = ½ (I + (1/H) Σ_h A[l, h])``,
    so ``R = Σ_p 2^{−L} H^{−len(p)} P_p`` over the complete path tree with skip: a weighted path sum.

    Unlike the popular ViT implementation, each row is normalised (it divides by the column sums,
    without ``keepdim``) and every batch element is rolled out, not only the first.

    Args:
        attn: ``[B, L, H, n, n]`` or ``[L, H, n, n]``, non-negative (attention probabilities); or
            an :class:`~pathkernels.adapters.AttentionStack` (its ``token_mask`` is the default).
        head_fusion: ``"mean"``, ``"max"`` or ``"min"`` over heads.
        residual: add the identity (the skip connection) before normalising.
        discard_ratio: in [0, 1): share of each row's off-diagonal entries to zero (the smallest).
        token_mask: ``[B, n]`` (``[n]`` unbatched), True at real tokens: each batch element is
            rolled out over its real tokens only (``n_real`` of them, ``discard_ratio`` counted
            among those), and its rows and columns of padded tokens are 0.

    Returns:
        ``[B, n, n]`` (``[n, n]`` unbatched), row-stochastic on the real tokens.
    """
    where = "pathkernels.rollout"
    attn, _, _, _, token_mask = unpack_stack(attn, None, None, None, token_mask, "pathkernels.rollout")
    if not isinstance(attn, Tensor):
        raise TypeError(f"{where}: expected attn to be a torch.Tensor [B, L, H, n, n], got {type(attn).__name__}")
    if attn.dim() not in (4, 5) or attn.shape[-1] != attn.shape[-2]:
        raise ValueError(f"{where}: expected attn [B, L, H, n, n] or [L, H, n, n], got shape {list(attn.shape)}")
    if not attn.is_floating_point():
        raise TypeError(f"{where}: expected floating-point attention, got {attn.dtype}")
    if attn.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{where}: expected attn on a CPU or CUDA device, got {attn.device}")
    if not isinstance(head_fusion, str) or head_fusion not in _FUSIONS:
        raise ValueError(f"{where}: expected head_fusion in {_FUSIONS}, got {head_fusion!r}")
    residual = check_flag(residual, "residual", where)
    if isinstance(discard_ratio, bool) or not isinstance(discard_ratio, numbers.Real):
        raise TypeError(
            f"{where}: expected discard_ratio to be a real number in [0, 1), got "
            f"{type(discard_ratio).__name__} {discard_ratio!r}"
        )
    if not 0.0 <= discard_ratio < 1.0:
        raise ValueError(f"{where}: expected discard_ratio in [0, 1), got {discard_ratio}")
    batched = attn.dim() == 5
    attn = attn if batched else attn.unsqueeze(0)
    check_nonempty_batch(attn, where)
    batch, layers, _, n, _ = attn.shape
    check_fits(  # the fused layers [B, L, n, n] and the running product, in the working copies
        4 * attn.element_size() * batch * (layers + 1) * n * n,
        attn.device,
        where,
        f"the fused layers of {batch} × {layers} matrices of {n} × {n} need",
        "pass fewer layers or shorter sequences (an expanded input is fused whole)",
    )
    if bool((distinct_view(attn) < 0).any()):
        raise ValueError(f"{where}: expected non-negative attention probabilities")
    check_finite(attn, "attn", where)
    if token_mask is not None:
        mask = masking.check_token_mask(
            masking.batched_mask(token_mask, batched), attn.shape[0], attn.shape[-1], attn.device, where
        )
        if mask is not None:
            result = attn.new_zeros(attn.shape[0], attn.shape[-1], attn.shape[-1])
            for group in masking.mask_groups(mask):
                part = _rollout(
                    masking.restrict(attn, group, token_dims=(-2, -1)), head_fusion, residual, discard_ratio, where
                )
                index = group.tokens
                result[group.batch.view(-1, 1, 1), index.view(1, -1, 1), index.view(1, 1, -1)] = part
            return result if batched else result[0]
    result = _rollout(attn, head_fusion, residual, discard_ratio, where)
    return result if batched else result[0]


def _rollout(attn: Tensor, head_fusion: str, residual: bool, discard_ratio: float, where: str) -> Tensor:
    """The rollout of checked, batched attention ``[B, L, H, n, n]`` -> ``[B, n, n]``."""
    n = attn.shape[-1]
    eye = torch.eye(n, dtype=attn.dtype, device=attn.device)
    if head_fusion == "mean":
        fused = attn.mean(dim=2)
    elif head_fusion == "max":
        fused = attn.amax(dim=2)
    else:
        fused = attn.amin(dim=2)  # [B, L, n, n]
    discard = int((n - 1) * discard_ratio)
    if discard > 0:
        # Rank each row's off-diagonal entries; the diagonal is lifted above all so it is kept.
        ranked = fused + eye * (fused.amax() + 1)
        smallest = ranked.topk(discard, dim=-1, largest=False).indices
        fused = fused.scatter(-1, smallest, 0.0)
    if residual:
        fused = fused + eye
    # Each row scaled by a power of two (exactly) to a largest entry in [1, 2), so that its sum
    # cannot overflow however large the entries (1e308 in float64, 3e4 in float16).
    fused = fused * power_of_two(-leading_exponent(fused, -1, keepdim=True)).to(fused.dtype)
    sums = fused.sum(dim=-1, keepdim=True)
    if bool((sums <= 0).any()):
        raise ValueError(f"{where}: a fused attention row sums to 0; use residual=True or a smaller discard_ratio")
    fused = fused / sums
    result = fused[:, 0]
    for layer in range(1, fused.shape[1]):
        result = fused[:, layer] @ result
    return result
