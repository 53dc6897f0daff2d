"""Pure-PyTorch references of every op (``<op>_ref``): slow, obvious, float64-capable.

They compute in the dtype they are given; tests pass float64 copies.
"""
from __future__ import annotations

import torch
from torch import Tensor


def residual_ref(x: Tensor) -> Tensor:
    """``x − 1·μᵀ`` with μ the mean over the rows: ``[..., n, m] -> [..., n, m]``."""
    return x - x.mean(dim=-2, keepdim=True)


def matrix_norms_ref(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(‖x‖_1, ‖x‖_∞, ‖x‖_{1,∞})`` by torch.linalg: ``[..., n, m] -> 3 × [...]``."""
    if x.shape[-1] == 0:
        zero = x.new_zeros(x.shape[:-2])
        return zero, zero, zero
    l1 = torch.linalg.matrix_norm(x, ord=1)
    linf = torch.linalg.matrix_norm(x, ord=float("inf"))
    return l1, linf, torch.sqrt(l1 * linf)


def composite_norm_ref(x: Tensor) -> Tensor:
    return matrix_norms_ref(x)[2]


def residual_norm_ref(x: Tensor) -> Tensor:
    return composite_norm_ref(residual_ref(x))
