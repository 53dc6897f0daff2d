"""Drop-in replacements for the utilities of the paper's official code, backed by the fused ops.

The names, signatures and semantics follow the authors' code for Dong, Cordonnier & Loukas (2021),
so an analysis script written against it runs unchanged:

- ``l1_matrix_norm(x)``: max column abs sum, ``[..., n, m] -> [...]``;
- ``linf_matrix_norm(x)``: max row abs sum;
- ``composite_norm(x)``: ``sqrt(l1 · linf)``;
- ``sample_path(depth, num_layers, num_heads)``: ``depth`` distinct layers in increasing order,
  a head for each, drawn with Python's ``random`` exactly as the original (same seed, same path);
- ``sample_P_matrix(attentions, depth)``: attentions ``[L, S, H, t, t]`` (layers, samples, heads);
  one random sample, one random path, and the product in **ascending** layer order,
  ``P = A[l_1] A[l_2] ⋯ A[l_depth]`` with ``l_1 < l_2 < …``.

The ascending order is the original code's and is the **reverse** of the paper's path product
``P_path = A[l_depth] ⋯ A[l_1]`` (and of :func:`pathkernels.path_residuals`): both are
row-stochastic, but they are different matrices. Differences from the original, all deliberate:
the identity is made in the attentions' dtype and device (the original's ``torch.eye(t)`` is CPU
float32), and the norms take any floating dtype and device through the fused kernels.
"""

from __future__ import annotations

import random

import torch
from torch import Tensor

from pathkernels.core import ops
from pathkernels.core.checks import check_int

__all__ = ["composite_norm", "l1_matrix_norm", "linf_matrix_norm", "sample_P_matrix", "sample_path"]


def l1_matrix_norm(x: Tensor) -> Tensor:
    """``‖x‖_1 = max_j Σ_i |x_ij|`` (max column abs sum): ``[..., n, m] -> [...]``."""
    ops.check_norm_input(x, False, op="pathkernels.compat.l1_matrix_norm")
    return ops.matrix_norms(x).l1


def linf_matrix_norm(x: Tensor) -> Tensor:
    """``‖x‖_∞ = max_i Σ_j |x_ij|`` (max row abs sum): ``[..., n, m] -> [...]``."""
    ops.check_norm_input(x, False, op="pathkernels.compat.linf_matrix_norm")
    return ops.matrix_norms(x).linf


def composite_norm(x: Tensor) -> Tensor:
    """``sqrt(‖x‖_1 ‖x‖_∞)``: ``[..., n, m] -> [...]``."""
    ops.check_norm_input(x, False, op="pathkernels.compat.composite_norm")
    return ops.composite_norm(x)


def sample_path(depth: int, num_layers: int, num_heads: int) -> tuple[list[int], list[int]]:
    """A random path of ``depth`` heads: ``(layers, heads)``, layers distinct and increasing.

    Uses Python's ``random`` module, with the original's calls in the original's order, so
    ``random.seed(s)`` reproduces the original's paths.
    """
    return _sample_path(depth, num_layers, num_heads, "pathkernels.compat.sample_path")


def _sample_path(depth, num_layers, num_heads, where: str) -> tuple[list[int], list[int]]:
    """:func:`sample_path` on behalf of ``where``, which its errors name."""
    num_layers = check_int(num_layers, "num_layers", where, minimum=0)
    num_heads = check_int(num_heads, "num_heads", where, minimum=1)
    depth = check_int(depth, "depth", where)
    if not 0 <= depth <= num_layers:
        raise ValueError(f"{where}: expected 0 <= depth <= num_layers = {num_layers}, got {depth}")
    selected_layers = sorted(random.sample(list(range(num_layers)), depth))
    selected_heads = random.choices(list(range(num_heads)), k=depth)
    return selected_layers, selected_heads


def sample_P_matrix(attentions: Tensor, depth: int) -> Tensor:
    """Product of the attention matrices along a random path of ``depth`` heads.

    Args:
        attentions: ``[L, S, H, t, t]``: layers, samples, heads.
        depth: number of heads on the path, ``0 <= depth <= L``.

    Returns:
        ``[t, t]``: ``A[l_1, s, h_1] A[l_2, s, h_2] ⋯`` in ascending layer order (the original's
        order, the reverse of the paper's), for a random sample s.
    """
    where = "pathkernels.compat.sample_P_matrix"
    if not isinstance(attentions, Tensor) or attentions.dim() != 5 or attentions.shape[-1] != attentions.shape[-2]:
        shape = list(attentions.shape) if isinstance(attentions, Tensor) else type(attentions).__name__
        raise ValueError(f"{where}: expected attentions [L, S, H, t, t], got {shape}")
    if not attentions.is_floating_point():
        raise TypeError(f"{where}: expected attentions of a real floating-point dtype, got {attentions.dtype}")
    if attentions.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{where}: expected attentions on a CPU or CUDA device, got {attentions.device}")
    if 0 in attentions.shape[:3]:
        raise ValueError(
            f"{where}: expected at least one layer, sample and head in attentions, got {list(attentions.shape)}"
        )
    num_layers, num_samples, num_heads, t, _ = attentions.shape
    selected_layers, selected_heads = _sample_path(depth, num_layers, num_heads, where)
    sample_idx = random.choice(list(range(num_samples)))
    product = torch.eye(t, dtype=attentions.dtype, device=attentions.device)
    for layer, head in zip(selected_layers, selected_heads):
        product = product @ attentions[layer, sample_idx, head]
    return product
