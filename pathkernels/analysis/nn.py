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
        """``x [..., n, d]`` (n ≥ 1, real floating point) -> ``X − τ·1μᵀ``. As a torch module it
        computes on any device, the meta device included (shapes only), and NaN or inf in x
        propagate to the tokens' columns they reach, as in torch."""
        where = "pathkernels.nn.DeEscalation"
        if not isinstance(x, Tensor):
            raise TypeError(f"{where}: expected x to be a torch.Tensor [..., n, d], got {type(x).__name__}")
        if x.dim() < 2 or x.shape[-2] == 0:
            raise ValueError(f"{where}: expected x [..., n, d] with n >= 1 tokens, got {list(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"{where}: expected x of a real floating-point dtype, got {x.dtype}")
        return x - self.tau * x.mean(dim=-2, keepdim=True)

    def extra_repr(self) -> str:
        return f"tau={self.tau}"
