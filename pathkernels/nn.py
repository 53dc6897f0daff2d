"""Drop-in modules."""

from __future__ import annotations

import math
import numbers

from torch import Tensor, nn


class DeEscalation(nn.Module):
    """Remove a share τ of the mean token: ``Y = (I − τ·11ᵀ/n) X = X − τ·1μᵀ``.

    The de-escalation step of Yu & Zhang (arXiv 2312.06182): with τ = 1 it projects the tokens
    onto the complement of the all-ones direction (token similarity 0); 0 < τ < 1 removes part of
    it. No parameters; batched over any leading dimensions; tokens in dimension −2.

    Args:
        tau: the share τ of the mean token to remove (usually 1).

    Shape:
        ``[..., n, d] -> [..., n, d]``.
    """

    def __init__(self, tau: float = 1.0):
        super().__init__()
        if isinstance(tau, bool) or not isinstance(tau, numbers.Real) or not math.isfinite(tau):
            raise ValueError(f"pathkernels.nn.DeEscalation: expected tau to be a finite real number, got {tau!r}")
        self.tau = float(tau)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() < 2:
            raise ValueError(f"pathkernels.nn.DeEscalation: expected x [..., n, d], got {x.dim()} dimension(s)")
        return x - self.tau * x.mean(dim=-2, keepdim=True)

    def extra_repr(self) -> str:
        return f"tau={self.tau}"
