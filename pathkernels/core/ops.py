"""Typed wrappers of ``torch.ops.pathkernels``, with their fake (meta) kernels and autograd.

Shapes use ``[..., n, m]`` for a batch of n-by-m matrices: n rows (tokens), m columns.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from pathkernels.core._scaling import leading_exponent, times_power_of_two
from pathkernels.core.checks import check_flag

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

# Layout of norm_parts' outputs (csrc/common/norm_math.h): parts [..., T, 3] and argmax [..., T, 2].
# The C++ side is the source; tests/test_norms.py pins these twins to it (the layout through the
# float64 references, the targets' count through opcheck's fake-versus-real shapes, the op names
# and the input checks through the errors of the op called directly).
_L1, _LINF, _COMPOSITE = 0, 1, 2
_RESIDUAL_TARGET, _PLAIN_TARGET = 0, 1


# The most entries one norm call reduces: about a minute at the CPU kernels' 1–2·10^9 entries a second
# on two cores (2^36), a few seconds on a GPU (2^40). Only an expanded (stride-0) tensor gets there
# within memory: refused rather than left running for many minutes.
MAX_NORM_ENTRIES = {"cpu": 1 << 36, "cuda": 1 << 40}


class MatrixNorms(NamedTuple):
    """The three matrix norms of the ℓ1,∞ composite, each of shape ``[...]``."""

    l1: Tensor  # max_j Σ_i |v_ij|: max column abs sum
    linf: Tensor  # max_i Σ_j |v_ij|: max row abs sum
    composite: Tensor  # sqrt(l1 · linf)


def norm_op_name(centered: bool) -> str:
    return "pathkernels.residual_norm" if centered else "pathkernels.composite_norm"


def check_norm_input(x: Tensor, centered: bool, op: str | None = None) -> None:
    """The checks of csrc/norms/norms.cpp, for fake tensors and for non-tensor arguments; ``op``
    names the public function called (default: the op's own name)."""
    op = op or norm_op_name(centered)
    if not isinstance(x, Tensor):
        raise TypeError(f"{op}: expected x to be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(
            f"{op}: expected x to have at least 2 dimensions [..., n, m], got {x.dim()} (shape {list(x.shape)})"
        )
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{op}: expected x to be a floating-point tensor (float32, float64, float16 or bfloat16), got {x.dtype}"
        )
    if x.shape[-2] == 0:
        raise ValueError(
            f"{op}: expected x to have at least one row (n >= 1) in [..., n, m], got shape {list(x.shape)}"
        )
    limit = MAX_NORM_ENTRIES.get(x.device.type, MAX_NORM_ENTRIES["cuda"])
    if x.numel() > limit:
        raise ValueError(
            f"{op}: x has {x.numel():,} entries (shape {list(x.shape)}), more than the {limit:,} one call reduces "
            f"on {x.device.type} (minutes of work; an expanded tensor is reduced entry by entry): split the batch, "
            "or pass the distinct values of an expanded tensor"
        )


def _num_targets(centered: bool, with_norm: bool) -> int:
    return 2 if centered and with_norm else 1


def check_one_device(op: str, **tensors) -> None:
    """Raise unless every tensor (or list of tensors) given lies on one device, as the C++ ops
    check. A mix of meta and CPU tensors dispatches to the fake kernel, which would otherwise
    return uninitialised CPU memory."""
    devices = {}
    for name, value in tensors.items():
        for t in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(t, Tensor):
                devices.setdefault(t.device, name)
    if len(devices) > 1:
        found = ", ".join(f"{name} on {device}" for device, name in devices.items())
        raise ValueError(f"{op}: expected every tensor on one device, got {found}")


@torch.library.register_fake("pathkernels::norm_parts")
def _norm_parts_fake(x: Tensor, centered: bool, with_norm: bool = True) -> tuple[Tensor, Tensor]:
    check_norm_input(x, centered)
    targets = _num_targets(centered, with_norm)
    lead = x.shape[:-2]
    return x.new_empty((*lead, targets, 3)), x.new_empty((*lead, targets, 2), dtype=torch.long)


@torch.library.register_fake("pathkernels::norm_parts_backward")
def _norm_parts_backward_fake(grad_parts, x, parts, argmax, centered, with_norm=True):
    check_norm_input(x, centered)
    check_one_device("pathkernels.norm_parts_backward", grad_parts=grad_parts, x=x, parts=parts, argmax=argmax)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("pathkernels::path_chunk_norms")
def _path_chunk_norms_fake(
    attn, attn_mean, root, root_mean, w_v, w_o, parents, heads, leaf_block, leaf_kernel="simt", all_heads_levels=False
):
    op = "pathkernels.path_chunk_norms"
    check_one_device(op, attn=attn, attn_mean=attn_mean, root=root, root_mean=root_mean, w_v=w_v, w_o=w_o)
    # The kernels read the index lists on the CPU wherever the operands are, but meta indices hold
    # no values: with real operands they only route the call here, to uninitialised outputs.
    if attn.device.type != "meta" and any(t.device.type == "meta" for t in [*parents, *heads]):
        raise ValueError(
            f"{op}: expected parents and heads with values (on the CPU or attn's device), got meta tensors"
        )
    for level, (parent, head) in enumerate(zip(parents, heads), start=1):
        for index in (parent, head):
            if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
                raise TypeError(
                    f"{op}: level {level}: expected parents and heads of an integer dtype (torch.long), got "
                    f"{index.dtype}"
                )
    leaves = parents[-1].shape[0]
    shape = (attn.shape[0], leaves)
    return attn.new_empty(shape, dtype=torch.float64), attn.new_empty(shape, dtype=torch.float64)


@torch.library.register_fake("pathkernels::_fused_leaf_norms")
def _fused_leaf_norms_fake(attn, right, mean, scale=None, kernel="simt"):
    check_one_device("pathkernels._fused_leaf_norms", attn=attn, right=right, mean=mean, scale=scale)
    return right.new_empty(right.shape[1], dtype=torch.float64), right.new_empty(right.shape[1], dtype=torch.float64)


@torch.library.register_fake("pathkernels::_engine_mm")
def _engine_mm_fake(a, b, isa="auto"):
    check_one_device("pathkernels._engine_mm", a=a, b=b)
    return a.new_empty((a.shape[0], b.shape[1]))


# The autograd formula of norm_parts is registered in C++ (csrc/norms/norms_autograd.cpp).


def path_chunk_norms(
    attn_centred: Tensor,
    attn_mean: Tensor,
    root: Tensor,
    root_mean: Tensor,
    w_v: Tensor | None,
    w_o: Tensor | None,
    parents: list[Tensor],
    heads: list[Tensor],
    leaf_block: int,
    leaf_kernel: str = "simt",
    all_heads_levels: bool = False,
) -> tuple[Tensor, Tensor]:
    """One chunk of a path tree, breadth-first: the per-leaf residual and norm (the engine's op).

    With ``C(A) = A − 1aᵀ`` and ``a = 1ᵀA/n``, every node of level l is ``R = C(A[l, h]) R_parent``
    (times ``W_V[l, h] W_O[l, h]`` with w_v/w_o) and its column mean ``μ = (μ_parent + R_parentᵀ a) W``;
    a leaf reports ``‖R‖_{1,∞}`` and ``‖1μᵀ + R‖_{1,∞}``. float32 nodes carry power-of-two scales,
    so that residuals far below float32's range keep their relative precision; the reports are
    float64 for every dtype.

    Args:
        attn_centred: ``[B, L, H, n, n]``, C(A); attn_mean: ``[B, L, H, n]``, a.
        root: ``[B, n, m]``, C(X) (or C(I) for attention products); root_mean: ``[B, m]``.
        w_v, w_o: ``[L, H, d, d_head]`` and ``[L, H, d_head, d]``, or both None.
        parents, heads: per level, ``[N_l]`` int64 parent positions in level l − 1 and heads
            (``-1`` = skip), the nodes sorted by head (:func:`pathkernels.core.paths.build_trie_chunk`).
        leaf_block: leaves reduced per block (per CPU thread).
        leaf_kernel: CUDA: how leaves of n ≤ 128 are reduced: ``"simt"`` (the fused on-chip
            kernel), ``"tf32x3"`` or ``"tf32"`` (the same on TF32 tensor cores, float32 only:
            float32 accuracy, or one pass), ``"gemm"`` (cuBLAS, then a reduction).
        all_heads_levels: internal levels whose every head takes the same parents (complete trees)
            in a fixed number of launches whatever H (one batched product of every head, one GEMM
            of the column means, one pass of the scales) instead of head by head; the same bits on
            the CPU.

    Returns:
        ``(residual, norm)``, each ``[B, N_L]`` float64, in the leaves' trie order.
    """
    return torch.ops.pathkernels.path_chunk_norms(
        attn_centred, attn_mean, root, root_mean, w_v, w_o, parents, heads, leaf_block, leaf_kernel, all_heads_levels
    )


def _norm_parts(x: Tensor, centered: bool, with_norm: bool, op: str | None = None) -> Tensor:
    """parts ``[..., T, 3]``: target 0 is ``x − 1·μᵀ`` when centered, else x; target 1, present only
    when centered and with_norm, is x itself (skipping it spares the CPU kernel a third of its
    arithmetic). with_norm is ignored when not centered. ``op`` names the caller in errors."""
    check_norm_input(x, centered, op)
    x, leading = _without_expanded_copies(x)
    parts = torch.ops.pathkernels.norm_parts(x, centered, with_norm)[0]
    # Rare: sums that overflowed (or inputs that are not finite). A data-dependent branch: inside
    # torch.compile's graphs a torch.cond, so that compiled norms rescue them too.
    if x.numel() and x.device.type != "meta":
        if torch.compiler.is_compiling():
            parts = torch.cond(
                parts.isfinite().all(),
                lambda x, parts: parts.clone(),
                lambda x, parts: _rescaled_parts_in_graph(x, parts, centered, with_norm),
                (x, parts),
            )
        elif not bool(parts.isfinite().all()):
            parts = _rescaled_parts(x, parts, centered, with_norm)
    return parts if leading is None else parts.expand(*leading, *parts.shape[-2:])


def _without_expanded_copies(x: Tensor) -> tuple[Tensor, torch.Size | None]:
    """``(x', leading)``: where x's leading dimensions do not merge into one batch dimension (the
    kernels' ``[batch, n, m]``, which would then be a copy of every repeat) because some are
    expanded (stride 0), x narrowed to one slice along each of those, and x's leading shape, which
    the parts are expanded back to: the same numbers without the copy. Otherwise ``(x, None)``; so
    too for a leaf that requires grad, whose gradient has x's full shape anyway."""
    if x.dim() <= 3:  # one leading dimension or none: always a view
        return x, None
    sizes, strides = x.shape[:-2], x.stride()[:-2]
    kept = [d for d in range(len(sizes)) if sizes[d] != 1]
    if all(strides[a] == strides[b] * sizes[b] for a, b in zip(kept, kept[1:])):
        return x, None
    expanded = [d for d in kept if strides[d] == 0]
    if not expanded or (x.requires_grad and x.is_leaf):
        return x, None
    for d in expanded:
        x = x.narrow(d, 0, 1)
    return x, sizes


def _rescaled_parts(x: Tensor, parts: Tensor, centered: bool, with_norm: bool) -> Tensor:
    """``parts`` with those of the finite matrices whose parts came out inf or NaN computed again
    (:func:`_scaled_norm_parts`). Sums of finite entries (column sums, the column mean) can
    overflow where the norm itself does not: a matrix of 1e308 has residual 0, and the kernel's
    float32 accumulation of bfloat16 overflows at 3.4e38. What stays inf is beyond the dtype. The
    other matrices are computed again as they were (the same bits), apart, so that no gradient
    passes through the overflowed parts (0 · inf would make it NaN); matrices with an inf or NaN
    entry keep their parts."""
    n, m = x.shape[-2:]
    flat_x, flat_parts = x.reshape(-1, n, m), parts.detach().reshape(-1, *parts.shape[-2:])
    redo = _to_rescue(flat_x, flat_parts)
    rows, others = redo.nonzero().flatten(), (~redo).nonzero().flatten()
    if rows.numel() == 0:
        return parts
    again = _scaled_norm_parts(flat_x[rows].double(), centered, with_norm).to(parts.dtype)
    out = flat_parts.new_zeros(flat_parts.shape).index_put((rows,), again)
    if others.numel():
        out = out.index_put((others,), torch.ops.pathkernels.norm_parts(flat_x[others], centered, with_norm)[0])
    return out.reshape(parts.shape)


def _rescaled_parts_in_graph(x: Tensor, parts: Tensor, centered: bool, with_norm: bool) -> Tensor:
    """:func:`_rescaled_parts` by shapes that do not depend on the values, for torch.cond's branch
    in compiled graphs: every matrix is computed twice more, as it was with the rescued ones
    zeroed, and scaled with the others zeroed (zeros keep every gradient finite), and each keeps
    the one that applies."""
    n, m = x.shape[-2:]
    flat_x, flat_parts = x.reshape(-1, n, m), parts.detach().reshape(-1, *parts.shape[-2:])
    redo = _to_rescue(flat_x, flat_parts).view(-1, 1, 1)
    kept = torch.ops.pathkernels.norm_parts(torch.where(redo, 0, flat_x), centered, with_norm)[0]
    again = _scaled_norm_parts(torch.where(redo, flat_x.double(), 0), centered, with_norm).to(parts.dtype)
    return torch.where(redo, again, kept).reshape(parts.shape)


def _to_rescue(flat_x: Tensor, flat_parts: Tensor) -> Tensor:
    """``[N]`` bool: the finite matrices ``flat_x [N, n, m]`` whose parts ``[N, T, 3]`` are not."""
    return (~flat_parts.isfinite().flatten(1).all(1)) & flat_x.detach().isfinite().flatten(1).all(1)


def _scaled_norm_parts(matrices: Tensor, centered: bool, with_norm: bool) -> Tensor:
    """The parts of float64 ``matrices [N, n, m]``, computed on each matrix divided by a power of
    two that brings its largest entry into [1, 2) (exactly), and multiplied back."""
    exponent = leading_exponent(matrices.detach(), (-2, -1))
    # The norms are homogeneous of degree 1, so their gradient at x is the gradient at x / 2^e: the
    # scalings pass values only (their gradient is the identity), else the gradient would be scaled
    # up by 2^e before it is scaled down, and overflow in between (inf where it is about 1).
    scaled = times_power_of_two(matrices.detach(), -exponent) + (matrices - matrices.detach())
    again = torch.ops.pathkernels.norm_parts(scaled, centered, with_norm)[0]
    return times_power_of_two(again.detach(), exponent) + (again - again.detach())


def matrix_norms(x: Tensor, *, residual: bool = False) -> MatrixNorms:
    """ℓ1, ℓ∞ and composite norms of a batch of matrices, in one fused pass.

    Args:
        x: ``[..., n, m]``, float32/float64 (float16/bfloat16 accumulate in float32). Any strides.
        residual: measure ``v = x − 1·μᵀ`` (μ the column mean over the n rows) instead of ``v = x``.

    Returns:
        ``MatrixNorms(l1, linf, composite)``, each ``[...]`` in x's dtype, with
        ``l1 = max_j Σ_i |v_ij|``, ``linf = max_i Σ_j |v_ij|``, ``composite = sqrt(l1 · linf)``.
        Differentiable (subgradient through the maxima).
    """
    residual = check_flag(residual, "residual", "pathkernels.matrix_norms")
    parts = _norm_parts(x, residual, with_norm=False, op="pathkernels.matrix_norms")[..., _RESIDUAL_TARGET, :]
    return MatrixNorms(parts[..., _L1], parts[..., _LINF], parts[..., _COMPOSITE])


def composite_norm(x: Tensor) -> Tensor:
    """The ℓ1,∞ composite norm of a batch of matrices.

    ``‖x‖_{1,∞} = sqrt(max_j Σ_i |x_ij| · max_i Σ_j |x_ij|)``

    Args:
        x: ``[..., n, m]``, float32/float64 (float16/bfloat16 accumulate in float32). Any strides.

    Returns:
        ``[...]`` in x's dtype. Differentiable: the (sub)gradient flows through the maximal column
        and row; at a zero matrix it is 0.
    """
    return _norm_parts(x, False, with_norm=False)[..., _RESIDUAL_TARGET, _COMPOSITE]


def residual_norm(x: Tensor, *, return_norm: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Composite norm of the residual ``res(x) = x − 1·μᵀ``, μ the column mean over the n rows.

    This is the rank-collapse measure of Dong, Cordonnier & Loukas (2021). It is computed in one
    fused pass: neither ``x − 1·μᵀ`` nor ``|x|`` is ever materialised.

    Args:
        x: ``[..., n, m]``, float32/float64 (float16/bfloat16 accumulate in float32). Any strides.
        return_norm: also return ``‖x‖_{1,∞}`` from the same pass, for the residual ratio
            ``‖res(x)‖_{1,∞} / ‖x‖_{1,∞}``.

    Returns:
        ``[...]``, or ``(residual, norm)`` with ``return_norm=True``, in x's dtype.
        Differentiable, so it can serve as a regulariser against rank collapse.
    """
    return_norm = check_flag(return_norm, "return_norm", "pathkernels.residual_norm")
    parts = _norm_parts(x, True, with_norm=return_norm, op="pathkernels.residual_norm")
    residual = parts[..., _RESIDUAL_TARGET, _COMPOSITE]
    if return_norm:
        return residual, parts[..., _PLAIN_TARGET, _COMPOSITE]
    return residual


@torch.library.register_fake("pathkernels::_heads_leaf_norms")
def _heads_leaf_norms_fake(attn, attn_mean, right, mean, scale=None, kernel="tf32x3"):
    check_one_device(
        "pathkernels._heads_leaf_norms", attn=attn, attn_mean=attn_mean, right=right, mean=mean, scale=scale
    )
    shape = (right.shape[1], attn.shape[0])
    return right.new_empty(shape, dtype=torch.float64), right.new_empty(shape, dtype=torch.float64)


def heads_leaf_norms(
    attn_centred: Tensor,
    attn_mean: Tensor,
    right: Tensor,
    mean: Tensor,
    scale: Tensor | None = None,
    kernel: str = "tf32x3",
) -> tuple[Tensor, Tensor]:
    """The leaves of a block of parents under every head, reduced on chip in one launch.

    For parent k (residual ``R_k = scale_k · R'_k``, column means ``μ_k``) and head h
    (``C(A_h) = A_h − 1 a_hᵀ``, ``a_h = 1ᵀA_h/n``), the leaf is ``R = C(A_h) R_k`` and its column means
    ``μ = μ_k + R_kᵀ a_h`` (the centring identity); neither is stored. float32 on TF32 tensor cores
    (CUDA, compute capability 8.0+); on the CPU the kernel's per-thread code runs as a test harness.

    Args:
        attn_centred: ``[H, n, n]``, C(A_h), n ≤ 128; attn_mean: ``[H, n]``, a_h.
        right: ``[n, c, m]``, the parents' R'_k (the layout of a path-tree level); mean: ``[c, m]``, μ_k.
        scale: ``[c]`` float64 (powers of two in the engine), or None for 1.
        kernel: ``"tf32x3"`` or ``"tf32x3_128"`` (3×TF32, float32 accuracy; 64- or 128-column tiles),
            ``"tf32"`` or ``"tf32_128"`` (one TF32 pass, about 2⁻¹¹ relative per product).

    Returns:
        ``(residual, norm)``, each ``[c, H]`` float64: ``‖R‖_{1,∞}`` and ``‖1μᵀ + R‖_{1,∞}``.
    """
    return torch.ops.pathkernels._heads_leaf_norms(attn_centred, attn_mean, right, mean, scale, kernel)
