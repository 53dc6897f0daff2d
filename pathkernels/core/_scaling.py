"""Exact scaling by powers of two, the same on every device: how results far outside a dtype's
range keep their digits (length sums, norms, the top-paths search)."""

from __future__ import annotations

import torch
from torch import Tensor


def power_of_two(k: Tensor) -> Tensor:
    """``2^k`` in float64, exactly, for int64 ``k`` (0 below ``2^-1074``; ``k <= 1023``): built
    from its bits, so that every device gives the same numbers (``torch.ldexp`` goes through a
    float32 power for integer exponents)."""
    k = k.clamp(-1075, 1023)
    normal = (k + 1023).clamp_min(0) << 52  # biased exponent, zero mantissa
    subnormal = torch.bitwise_left_shift(torch.ones_like(k), (k + 1074).clamp(0, 51))
    bits = torch.where(k >= -1022, normal, torch.where(k >= -1074, subnormal, torch.zeros_like(k)))
    return bits.view(torch.float64)


def times_power_of_two(t: Tensor, k: Tensor) -> Tensor:
    """``t · 2^k`` (float64 ``t``; int64 ``k`` of ``t``'s leading shape, broadcast over the rest):
    two exact factors, so that scales up to ``2^±2046`` apply, and a result below 2^-1074 is 0."""
    k = k.clamp(-2200, 2046).reshape(tuple(k.shape) + (1,) * (t.dim() - k.dim()))
    half = torch.div(k, 2, rounding_mode="floor")
    return t * power_of_two(half) * power_of_two(k - half)


def leading_exponent(t: Tensor, dims, *, keepdim: bool = False) -> Tensor:
    """int64 ``e`` with ``2^e ≤ max |t| < 2^(e+1)`` over ``dims`` (reduced away, or kept as size-1
    dimensions with ``keepdim``; 0 where the slice is all zero or not finite): ``t · 2^-e`` has its
    largest entry in [1, 2)."""
    peak = t.detach().abs().amax(dim=dims, keepdim=keepdim)
    exponent = torch.frexp(peak).exponent.long() - 1
    return torch.where((peak > 0) & peak.isfinite(), exponent, torch.zeros_like(exponent))
