"""Path decompositions: per-path residual norms on a path tree (the engine's front end).

Notation (docs/DESIGN.md §1): attention ``A[b, l, h]`` is ``n × n`` and row-stochastic; a path p picks a
head or the skip branch (``-1``, ``A = I``, ``W = I``) at every layer;
``P_p = A[L, p_L] ⋯ A[1, p_1]`` and ``Y_p = P_p X W_p`` with ``W_p = W[1, p_1] ⋯ W[L, p_L]``,
``W[l, h] = W_V[l, h] W_O[l, h]`` kept factored. The inputs are checked in :mod:`pathkernels.core.checks`,
the tree is cut into chunks by :mod:`pathkernels.core.planner`, and each chunk is one call of the C++ op
``path_chunk_norms``.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import NamedTuple

import torch
from torch import Tensor

from pathkernels.core import chunk_graphs, distributed, ops
from pathkernels.core._memory import check_fits, format_bytes
from pathkernels.core._progress import progress_bar
from pathkernels.core.checks import (
    Network,
    check_engine_device,
    check_flag,
    check_masked_network,
    check_network,
    mask_group_inputs,
    unpack_stack,
)
from pathkernels.core.engine_defaults import engine_choice, engine_settings
from pathkernels.core.paths import SKIP, PathTree, check_tree_shape
from pathkernels.core.planner import (
    DEFAULT_MEMORY_BUDGET,
    check_budget,
    check_results_fit,
    chunks,
    node_bytes,
)
from pathkernels.reference import trie_products_ref

LEAF_KERNELS = ("auto", "fused", "tensor", "gemm", "heads", "heads_128", "triton")


def op_leaf_kernel(leaf_kernel: str, fast: bool, attn, where: str) -> str:
    """The engine op's ``leaf_kernel`` for path_residuals' ``leaf_kernel`` and ``fast``: "fused" is
    the SIMT kernel ("simt"), or with fast the tensor-core kernel's one TF32 pass ("tf32", on
    compute capability ≥ 8.0; cuBLAS in TF32, "gemm", before); "tensor" the tensor-core kernel at
    float32 accuracy ("tf32x3"), or "tf32" with fast; "gemm" is cuBLAS.

    On an H200 (bench/results), "tf32" ran a complete tree 1.36× faster than cuBLAS in TF32 at the
    same accuracy, and "tf32x3" only 1.15× faster than "simt" at ten times its error (5e-7 against
    4e-8 relative at n = 64), so float32 accuracy stays on the SIMT kernel by default.

    "auto" (the default) is the kernel chosen for this card family, dtype, fast and n by measurement
    (:mod:`pathkernels.core.engine_defaults`), "fused" wherever nothing was measured.

    "heads" and "heads_128" are the heads leaf kernel ("heads_tf32x3", or "heads_tf32" with fast;
    64- or 128-column tiles): leaf levels whose every head takes the same parents in one launch
    that reads each parent once for all heads (csrc/paths/heads_leaf.h). "triton" takes the same
    leaf levels through the Triton candidate of that kernel ("triton_tf32x3", or "triton_tf32" with
    fast; pathkernels/core/triton_leaf.py, registered here on first use). On the CPU, which ignores
    the choice, they become "simt": the op's CPU backend would run the kernel's test harness, or
    Triton's interpreter."""
    if leaf_kernel not in LEAF_KERNELS:
        raise ValueError(f"{where}: expected leaf_kernel in {LEAF_KERNELS}, got {leaf_kernel!r}")
    if leaf_kernel == "auto":
        leaf_kernel = _measured_leaf_kernel(attn, fast)
    if fast:
        _check_fast(attn, where)
    if leaf_kernel in ("tensor", "heads", "heads_128", "triton"):
        dtype = getattr(attn, "dtype", None)
        if dtype != torch.float32:
            raise ValueError(
                f"{where}: leaf_kernel={leaf_kernel!r} runs on TF32 tensor cores and takes float32 attn, got {dtype}"
            )
    if leaf_kernel in ("heads", "heads_128", "triton"):
        if attn.device.type != "cuda":
            return "simt"
        if leaf_kernel == "triton":
            from pathkernels.core import triton_leaf

            triton_leaf.op()  # registered, so that the engine's C++ finds it through the dispatcher
            return "triton_tf32" if fast else "triton_tf32x3"
        return ("heads_tf32" if fast else "heads_tf32x3") + leaf_kernel.removeprefix("heads")
    if leaf_kernel == "tensor":
        return "tf32" if fast else "tf32x3"
    if leaf_kernel == "gemm":
        return "gemm"
    if fast:  # the SIMT kernel is full float32: fast mode's leaves take TF32 tensor cores
        return "tf32" if torch.cuda.get_device_capability(attn.device)[0] >= 8 else "gemm"
    return "simt"


def _measured_leaf_kernel(attn, fast: bool) -> str:
    """``leaf_kernel="auto"``: the measured table's kernel for attn's device, dtype and n, "fused"
    where attn is no tensor yet (the checks that follow refuse it)."""
    if not isinstance(attn, Tensor) or attn.dim() < 2:
        return "fused"
    return engine_choice(attn.device, attn.dtype, attn.shape[-1], fast).leaf_kernel


class PathResiduals:
    """Per-path results of :func:`path_residuals`.

    ``residual[b, i] = ‖res(M)‖_{1,∞}`` and ``norm[b, i] = ‖M‖_{1,∞}`` for ``M = P_p`` (or
    ``Y_p``) of path ``paths[i]``; ``[M]`` instead of ``[B, M]`` when attn had no batch dim.
    ``paths`` ``[M, L]`` and ``lengths`` ``[M]`` are built from the tree on first use, so a
    complete tree of 10^7 paths costs no path list unless asked for.
    """

    def __init__(self, residual: Tensor, norm: Tensor, tree: PathTree, products: Tensor | None = None):
        self.residual = residual  # [B, M]
        self.norm = norm  # [B, M]
        self.tree = tree
        self.products = products  # [B, M, n, n] or [B, M, n, d] with materialize=True
        self._paths: Tensor | None = None

    @property
    def paths(self) -> Tensor:
        """``[M, L]`` int64 in result order, ``-1`` = skip."""
        if self._paths is None:
            self._paths = self.tree.paths()
        return self._paths

    @property
    def lengths(self) -> Tensor:
        """``[M]`` int64: heads taken by each path."""
        return (self.paths != SKIP).sum(1)

    @property
    def ratio(self) -> Tensor:
        """``residual / norm``, the paper's relative residual, ``[B, M]``."""
        return self.residual / self.norm

    def __repr__(self) -> str:
        return f"PathResiduals(residual={list(self.residual.shape)}, tree={self.tree!r})"


def engine_operands(net: Network):
    """Centred attention C(A) = A − 1aᵀ, a = 1ᵀA/n, and the root: C(X) and mean(X), or C(I) and 1/n."""
    attn64 = net.attn.double()
    attn_mean = attn64.mean(-2)  # [B, L, H, n]
    attn_centred = attn64 - attn_mean.unsqueeze(-2)
    batch, n = net.attn.shape[0], net.attn.shape[-1]
    if net.x is None:
        eye = torch.eye(n, dtype=torch.float64, device=net.attn.device)
        root = (eye - 1.0 / n).expand(batch, n, n)
        root_mean = torch.full((batch, n), 1.0 / n, dtype=torch.float64, device=net.attn.device)
    else:
        x64 = net.x.double()
        root_mean = x64.mean(-2)
        root = x64 - root_mean.unsqueeze(-2)
    dtype = net.attn.dtype
    return attn_centred.to(dtype), attn_mean.to(dtype), root.to(dtype).contiguous(), root_mean.to(dtype)


def path_residuals(
    attn: Tensor,
    tree: PathTree,
    *,
    x: Tensor | None = None,
    w_v: Tensor | None = None,
    w_o: Tensor | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    progress: bool = False,
    materialize: bool = False,
    group=None,
    all_ranks: bool = False,
    fast: bool = False,
    token_mask: Tensor | None = None,
    leaf_kernel: str = "auto",
) -> PathResiduals | None:
    """Residual norms of every path of ``tree``, evaluated on its shared-prefix trie.

    Without ``x`` it measures the attention products ``M = P_p = A[L, p_L] ⋯ A[1, p_1]``; with
    ``x``, ``w_v`` and ``w_o`` the path outputs ``M = Y_p = P_p X W_p`` (W kept factored). For each
    batch element and path: ``residual = ‖M − 1μᵀ‖_{1,∞}`` (μ the column mean over the n rows),
    ``norm = ‖M‖_{1,∞}``, ``ratio = residual / norm``.

    The engine carries ``C(M)`` itself down the trie with the centring identity
    ``C(P Q) = C(P) C(Q)`` (exact for row-stochastic P), so a residual of 1e-30 keeps its relative
    precision in float32. Each level is a few large GEMMs; leaves are reduced to norms block by
    block and never stored.

    Args:
        attn: ``[B, L, H, n, n]`` or ``[L, H, n, n]``, float32 or float64, row-stochastic
            (rows summing to 1 within 1e-4 in float32, 1e-8 in float64; others are refused); or an
            :class:`~pathkernels.adapters.AttentionStack`, whose ``w_v``, ``w_o`` and
            ``token_mask`` are then the defaults (pass ``x`` for path outputs).
        tree: a :class:`PathTree` with ``tree.num_layers == L``.
        x: ``[B, n, d]`` (``[n, d]`` for unbatched attn), with ``w_v [L, H, d, d_head]`` and
            ``w_o [L, H, d_head, d]``.
        memory_budget: bytes of working memory beyond inputs and results; the tree is traversed in
            chunks that fit it, whatever its size.
        progress: show a progress bar over paths (tqdm if installed).
        materialize: also return the products ``[B, M, n, n]`` or ``[B, M, n, d]``; refused when
            they would not fit the memory budget (single process only).
        group: a torch.distributed process group to split the leaves over; ``None`` (default)
            takes the default group when one is initialised with several processes (torchrun),
            ``False`` keeps the call on this process. Every rank passes the same inputs; each
            evaluates a contiguous, equal share of the leaves on attn's device, within its own
            ``memory_budget``; progress shows on rank 0 only. See :mod:`pathkernels.core.distributed`.
        all_ranks: with a group, gather the results on every rank instead of rank 0 only.
        fast: CUDA float32 only: run the GEMMs on TF32 tensor cores (10-bit mantissa, float32
            accumulation), about 1e-3 relative error per level instead of float32's 1e-7, with
            the leaves through the tensor-core kernel's one-pass variant (cuBLAS in TF32 on GPUs
            before compute capability 8.0, or with ``leaf_kernel="gemm"``). Off by default; the
            norms and the centring stay in full precision.
        token_mask: ``[B, n]`` (``[n]`` for unbatched attn), True (or 1) at real tokens, e.g. a
            padded batch's ``attention_mask``: each batch element is evaluated on its real tokens
            only, ``P_p`` restricted to them (its rows must still sum to 1 there). Elements that
            share a mask run as one batch. Not with ``materialize`` (the products differ in size).
        leaf_kernel: CUDA only: ``"auto"`` (the default) takes the kernel measured fastest at
            float32 accuracy on this card family for this dtype, ``fast`` and n
            (:mod:`pathkernels.core.engine_defaults`: so far ``"fused"`` everywhere); ``"fused"``
            reduces leaves of n ≤ 128 on chip in the fused leaf kernel, on CUDA cores; ``"tensor"``
            does the same on TF32 tensor cores at float32 accuracy (3×TF32; float32 attn, compute
            capability ≥ 8.0): on an H200 1.15× faster than ``"fused"`` at about ten times its
            rounding error (5e-7 against 4e-8 relative at n = 64), hence not chosen; ``"gemm"``
            runs cuBLAS into a scratch block and reduces that (the benchmarks' comparison);
            ``"heads"`` and ``"heads_128"``
            (float32, compute capability ≥ 8.0) take each leaf level whose every head has the
            same parents (complete trees) in one launch over all heads on TF32 tensor cores
            (3×TF32, or one pass with ``fast``; 64- or 128-column tiles), reading each parent once
            instead of once per head, other leaves as ``"tensor"``; ``"triton"`` takes the same
            levels through the Triton candidate of that kernel (Triton installed;
            ``pathkernels.core.triton_leaf``, autotuned on the card): candidates that
            ``bench/gpu_check.sh`` times against the others. Ignored on CPU.

    Returns:
        :class:`PathResiduals` with ``residual``, ``norm`` and ``ratio`` ``[B, M]``, ``paths``
        ``[M, L]`` and ``lengths`` ``[M]`` in the tree's result order. With a group, None on
        ranks other than 0 unless ``all_ranks``. The results carry no gradient: inputs that
        require grad are read as data (:func:`length_sums` and the norm ops are differentiable).

    Raises:
        ValueError: before any work, for inputs that are not row-stochastic or not finite, a
            ``memory_budget`` below the engine's minimum (the message gives it), or results that
            would not fit the device's available memory (the message says how much they need).
    """
    return evaluate_paths(
        attn,
        tree,
        "pathkernels.path_residuals",
        x=x,
        w_v=w_v,
        w_o=w_o,
        memory_budget=memory_budget,
        progress=progress,
        materialize=materialize,
        group=group,
        all_ranks=all_ranks,
        fast=fast,
        token_mask=token_mask,
        leaf_kernel=leaf_kernel,
    )


def evaluate_paths(
    attn: Tensor,
    tree: PathTree,
    where: str,
    *,
    x: Tensor | None = None,
    w_v: Tensor | None = None,
    w_o: Tensor | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    progress: bool = False,
    materialize: bool = False,
    group=None,
    all_ranks: bool = False,
    fast: bool = False,
    token_mask: Tensor | None = None,
    leaf_kernel: str = "auto",
) -> PathResiduals | None:
    """:func:`path_residuals` on behalf of ``where``, the public function the user called (such as
    ``"pathkernels.decompose"``): its checks, errors and warnings name that function."""
    progress, materialize, all_ranks, fast = (
        check_flag(value, name, where)
        for name, value in (
            ("progress", progress),
            ("materialize", materialize),
            ("all_ranks", all_ranks),
            ("fast", fast),
        )
    )
    attn, x, w_v, w_o, token_mask = unpack_stack(attn, x, w_v, w_o, token_mask, where)
    if token_mask is not None:
        return _masked_path_residuals(
            attn,
            tree,
            x,
            token_mask,
            where,
            w_v=w_v,
            w_o=w_o,
            memory_budget=memory_budget,
            progress=progress,
            materialize=materialize,
            group=group,
            all_ranks=all_ranks,
            fast=fast,
            leaf_kernel=leaf_kernel,
        )
    kernel = op_leaf_kernel(leaf_kernel, fast, attn, where)
    with _tf32_matmuls() if fast else contextlib.nullcontext():
        group = distributed.resolve_group(group, where)
        if group is not None:
            return _path_residuals_across(
                attn, tree, x, w_v, w_o, memory_budget, progress, materialize, group, all_ranks, kernel, where
            )
        net, memory_budget = check_inputs(attn, tree, x, w_v, w_o, memory_budget, where)
        products = _materialize(net, tree, memory_budget, where) if materialize else None
        bar = progress_bar(tree.num_leaves, enabled=progress)
        residual, norm = leaf_norms(net, tree, 0, tree.num_leaves, memory_budget, bar, leaf_kernel=kernel, where=where)
        return _result(net, tree, residual, norm, products)


def _masked_path_residuals(attn, tree, x, token_mask, where: str, *, materialize: bool, **kwargs):
    """path_residuals of each batch element on its real tokens: one call per group of equal masks."""
    net, mask = check_masked_network(attn, x, kwargs.get("w_v"), kwargs.get("w_o"), token_mask, where)
    batched, attn, x = net.batched, net.attn, net.x
    if x is not None:  # in the compute dtype (float16 and bfloat16 come up to float32)
        kwargs.update(w_v=net.w_v, w_o=net.w_o)
    batch = attn.shape[0]
    if mask is not None and materialize:
        raise ValueError(
            f"{where}: materialize=True cannot honour token_mask (the sequences' products differ in "
            "size); materialise each sequence on its own"
        )
    if mask is None:
        result = evaluate_paths(attn, tree, where, x=x, materialize=materialize, **kwargs)
    else:
        residual = norm = None
        for _, group, group_attn, group_x in mask_group_inputs(net, mask, where):
            part = evaluate_paths(group_attn, tree, where, x=group_x, **kwargs)
            if part is None:  # a rank other than 0 of a process group: the results went to rank 0
                continue
            if residual is None:
                residual = part.residual.new_empty(batch, part.residual.shape[1])
                norm = part.norm.new_empty(batch, part.norm.shape[1])
            # A group whose float32 results widened (values outside float32's range) widens all.
            residual = _widened(residual, part.residual.dtype, where)
            norm = _widened(norm, part.norm.dtype, where)
            residual[group.batch], norm[group.batch] = part.residual, part.norm
        result = None if residual is None else PathResiduals(residual, norm, tree)
    if result is not None and not batched:
        result.residual, result.norm = result.residual[0], result.norm[0]
        result.products = None if result.products is None else result.products[0]
    return result


def _check_fast(attn, where: str) -> None:
    if not (isinstance(attn, Tensor) and attn.device.type == "cuda" and attn.dtype == torch.float32):
        raise ValueError(
            f"{where}: fast=True runs the GEMMs on TF32 tensor cores, which only CUDA float32 has; got attn "
            f"{getattr(attn, 'dtype', type(attn).__name__)} on {getattr(attn, 'device', '?')}"
        )


@contextlib.contextmanager
def _tf32_matmuls():
    """TF32 for float32 cuBLAS GEMMs inside the block (ATen reads the flag per call); restored after."""
    matmul = torch.backends.cuda.matmul
    # torch >= 2.9 names the setting fp32_precision; older versions have allow_tf32.
    name, value = ("fp32_precision", "tf32") if hasattr(matmul, "fp32_precision") else ("allow_tf32", True)
    previous = getattr(matmul, name)
    setattr(matmul, name, value)
    try:
        yield
    finally:
        setattr(matmul, name, previous)


def check_inputs(attn, tree, x, w_v, w_o, memory_budget, where: str, *, results: bool = True) -> tuple[Network, int]:
    """Everything path_residuals checks before any work: the inputs, the tree, the budget, the
    device and (with ``results``: per-path results are kept) the size of the results. Returns the
    checked inputs and the budget as an int."""
    net = check_network(attn, x, w_v, w_o, where)
    check_tree_shape(tree, *net.attn.shape[1:3], where)
    memory_budget = check_budget(memory_budget, net, where)
    check_engine_device(net.attn.device, where)
    if results:
        if tree.num_paths > 1 << 40:
            raise ValueError(f"{where}: the tree has {tree.num_paths:,} paths; results alone would not fit in memory")
        check_results_fit(net, tree, where)
    return net, memory_budget


_FLOAT32 = torch.finfo(torch.float32)


def engine_reports(values: Tensor, dtype: torch.dtype, *, outside: bool | None = None) -> Tensor:
    """The engine's float64 reports as results of ``dtype``.

    float32: the values rounded to float32, in a float32 tensor, when float32 holds every one of
    them (0, a normal number, inf or NaN); otherwise a float64 tensor, rounded to float32 where
    float32 holds the value and exact where it lies outside float32's range, as residuals of deep
    trees do (below 1.2e-38). float64 reports are returned as they are. ``outside``: whether some
    value lies outside float32's range (:func:`_outside_float32`), when the caller has read it.
    """
    if dtype == torch.float64:
        return values
    rounded = values.to(dtype)
    if outside is False:
        return rounded
    if outside is None and values.numel() > 0:
        smallest, largest = torch.aminmax(values.abs())  # one pass and one sync settle the common case
        if smallest >= _FLOAT32.tiny and largest <= _FLOAT32.max:
            return rounded
    outside_at = _outside_float32(values)
    if not bool(outside_at.any()):
        return rounded
    return torch.where(outside_at, values, rounded.double())


def _outside_float32(values: Tensor) -> Tensor:
    """Where a float64 value is finite, not 0, and outside float32's range."""
    magnitude = values.abs()
    return torch.isfinite(values) & (magnitude > 0) & ((magnitude < _FLOAT32.tiny) | (magnitude > _FLOAT32.max))


# float32 column means below this lose digits to the float32 range (the residuals carry scales,
# the means do not: docs/DESIGN.md §3), so such tiny products are computed again in float64.
SMALLEST_ACCURATE_FLOAT32_NORM = 1e-30


def _widened(results: Tensor, dtype: torch.dtype, where: str) -> Tensor:
    """``results``, as float64 once a chunk of ``dtype`` float64 arrives for float32 results (a
    report outside float32's range), checked against the memory available first."""
    if dtype != torch.float64 or results.dtype == torch.float64:
        return results
    check_fits(
        results.numel() * 8,
        results.device,
        where,
        "residuals below float32's range (1.2e-38) need float64 results,",
        "use pk.path_statistics, or fewer paths",
        error=MemoryError,
    )
    return results.double()


def chunk_norms(
    net: Network, operands: tuple, chunk, leaf_block: int, leaf_kernel: str, all_heads_levels: bool = False
) -> tuple[Tensor, Tensor]:
    """The engine op on one chunk (:func:`pathkernels.core.ops.path_chunk_norms`): float64 residual and
    norm ``[B, leaves]`` in the chunk's trie order; ``operands`` from :func:`engine_operands`."""
    attn_centred, attn_mean, root, root_mean = operands
    return ops.path_chunk_norms(
        attn_centred,
        attn_mean,
        root,
        root_mean,
        net.w_v,
        net.w_o,
        chunk.parents,
        chunk.heads,
        leaf_block,
        leaf_kernel,
        all_heads_levels,
    )


@torch.no_grad()
def leaf_norms(
    net: Network,
    tree: PathTree,
    first: int,
    last: int,
    memory_budget: int,
    bar=None,
    *,
    leaf_kernel: str = "simt",
    where: str = "pathkernels.path_residuals",
) -> tuple[Tensor, Tensor]:
    """Residual and norm ``[B, last - first]`` of leaves ``first..last-1``, chunk by chunk, in
    leaf order (``bar``: a progress bar to update and close). ``leaf_kernel``: the op's (see
    :func:`op_leaf_kernel`). Each is in attn's dtype, or float64 when a float32 value lies outside float32's
    range (:func:`engine_reports`). ``where``: the public function called, for messages."""
    device = net.attn.device
    residual = torch.empty(net.attn.shape[0], last - first, dtype=net.attn.dtype, device=device)
    norm = torch.empty_like(residual)
    device_copies: dict[int, tuple[Tensor, Tensor]] = {}
    pieces = (
        (start, stop, chunk, leaf_block, _on_device(chunk.leaf_position, device, device_copies))
        for start, stop, chunk, leaf_block in chunks(tree, net, memory_budget, first, last, where=where)
    )
    try:
        for start, stop, chunk_residual, chunk_norm in chunk_reports(net, tree, pieces, leaf_kernel, memory_budget):
            residual = _widened(residual, chunk_residual.dtype, where)
            norm = _widened(norm, chunk_norm.dtype, where)
            residual[:, start - first : stop - first] = chunk_residual
            norm[:, start - first : stop - first] = chunk_norm
            if bar is not None:
                bar.update(stop - start)
    finally:
        if bar is not None:
            bar.close()
    return residual, norm


class _ChunkInFlight(NamedTuple):
    """A chunk's float64 reports ``[B, leaves]`` (leaf order) whose range flags are on their way to
    the host: ``flags`` (:func:`_range_flags`) is complete once ``event`` has passed (None: it is
    already, on the CPU, or there is nothing to check, float64)."""

    start: int
    stop: int
    residual: Tensor
    norm: Tensor
    flags: Tensor | None
    event: object | None


# PATHKERNELS_SYNC_CHUNKS=1 settles each chunk before the next one is queued (the behaviour before
# the pipeline, kept for timing one against the other on a GPU).
_SYNC_CHUNKS = os.environ.get("PATHKERNELS_SYNC_CHUNKS") == "1"


def chunk_reports(net: Network, tree: PathTree, pieces, leaf_kernel: str, memory_budget: int):
    """What each chunk of leaves reports, in order: ``(start, stop, residual, norm)``, ``[B, leaves]``
    in leaf order, as results of attn's dtype (:func:`engine_reports`), with values out of float32's
    range computed again in float64 (:func:`out_of_range_in_float64`).

    ``pieces``: ``(start, stop, chunk, leaf_block, leaf_position)``, the chunk's leaf order on the
    results' device. On CUDA a chunk is settled one chunk late: its range checks, which read a flag on
    the host, wait until the next chunk's kernels are queued, so the GPU does not idle while the host
    reads a flag and plans the next chunk. With PATHKERNELS_CUDA_GRAPHS=1 the chunks that repeat a
    subtree below a prefix are split there, and on CUDA their subtrees replayed from a CUDA graph
    (:mod:`pathkernels.core.chunk_graphs`)."""
    operands = engine_operands(net)
    settings = engine_settings(net.attn.device, net.attn.dtype, net.attn.shape[-1])
    all_heads_levels = settings.engine_levels == "all_heads"

    def evaluate(chunk, leaf_block: int) -> tuple[Tensor, Tensor]:
        return chunk_norms(net, operands, chunk, leaf_block, leaf_kernel, all_heads_levels)

    if settings.graphs:
        evaluate = chunk_graphs.ChunkGraphs(
            net, operands, leaf_kernel, all_heads_levels, evaluate, capture=net.attn.device.type == "cuda"
        )
    pending = None
    for start, stop, chunk, leaf_block, leaf_position in pieces:
        residual, norm = evaluate(chunk, leaf_block)
        residual, norm = residual[:, leaf_position], norm[:, leaf_position]
        flags, event = _range_flags(net, residual, norm)
        if pending is not None:
            yield _settled(net, tree, pending, memory_budget)
        pending = _ChunkInFlight(start, stop, residual, norm, flags, event)
        if _SYNC_CHUNKS:
            yield _settled(net, tree, pending, memory_budget)
            pending = None
    if pending is not None:
        yield _settled(net, tree, pending, memory_budget)


def _range_flags(net: Network, residual: Tensor, norm: Tensor) -> tuple[Tensor | None, object | None]:
    """``[3]`` bools, on their way to the host (with the CUDA event to wait for). float32 networks:
    whether some leaf needs the float64 engine (:func:`out_of_range_in_float64`), and whether some
    residual, or some norm, lies outside float32's range (:func:`engine_reports`); float64 networks:
    whether some leaf lies beyond float64's range (inf or NaN reports), then two unused flags."""
    dtype = net.attn.dtype
    if dtype not in (torch.float32, torch.float64):
        return None, None
    if residual.device.type == "cpu" and _plainly_in_range(residual, norm, dtype):
        return torch.zeros(3, dtype=torch.bool), None
    flags = _full_range_flags(residual, norm, dtype)
    if flags.device.type != "cuda":
        return flags, None
    host = torch.empty(3, dtype=torch.bool, pin_memory=True)
    host.copy_(flags, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


def _full_range_flags(residual: Tensor, norm: Tensor, dtype: torch.dtype) -> Tensor:
    """:func:`_range_flags`' ``[3]`` bools, on the reports' device, each from its own checks."""
    if dtype == torch.float32:
        return torch.stack(
            [_needs_float64(residual, norm).any(), _outside_float32(residual).any(), _outside_float32(norm).any()]
        )
    beyond = _not_finite(residual, norm).any()
    return torch.stack([beyond, torch.zeros_like(beyond), torch.zeros_like(beyond)])


def _plainly_in_range(residual: Tensor, norm: Tensor, dtype: torch.dtype) -> bool:
    """Whether no flag of :func:`_range_flags` can be set, read from the extremes of the reports
    ``[B, leaves]`` (norms, so never negative) in one pass over each: the usual case on the CPU,
    where the many passes of the full checks cost more than the chunk's reduction. float32 networks:
    every residual a normal float32 number, every norm one of at least
    ``SMALLEST_ACCURATE_FLOAT32_NORM``; float64: every report finite. A residual of exactly 0, a NaN
    (which the extremes carry) or anything else answers False, and the full checks decide."""
    if residual.numel() == 0:
        return False
    (residual_low, residual_high), (norm_low, norm_high) = torch.aminmax(residual), torch.aminmax(norm)
    if dtype == torch.float32:
        lowest_residual, lowest_norm, highest = _FLOAT32.tiny, SMALLEST_ACCURATE_FLOAT32_NORM, _FLOAT32.max
    else:
        lowest_residual, lowest_norm, highest = 0.0, 0.0, torch.finfo(torch.float64).max
    lows = float(residual_low) >= lowest_residual and float(norm_low) >= lowest_norm
    return lows and float(residual_high) <= highest and float(norm_high) <= highest


def _settled(net: Network, tree: PathTree, chunk: _ChunkInFlight, memory_budget: int):
    """``(start, stop, residual, norm)`` of a chunk in flight, its range flags read."""
    residual, norm, dtype = chunk.residual, chunk.norm, net.attn.dtype
    if chunk.flags is None:
        return chunk.start, chunk.stop, engine_reports(residual, dtype), engine_reports(norm, dtype)
    if chunk.event is not None:
        chunk.event.synchronize()
    needs_float64, residual_outside, norm_outside = chunk.flags.tolist()
    if dtype == torch.float64:
        if needs_float64:  # some leaf beyond float64's range: its reports are inf or NaN
            leaves = _not_finite(residual, norm).nonzero().flatten()
            _warn_beyond_float64(tree.leaf_paths(leaves.cpu() + chunk.start))
        return chunk.start, chunk.stop, engine_reports(residual, dtype), engine_reports(norm, dtype)
    if needs_float64:  # rare: the float64 engine, then every check afresh
        residual, norm = out_of_range_in_float64(net, tree, chunk.start, residual, norm, memory_budget)
        return chunk.start, chunk.stop, engine_reports(residual, dtype), engine_reports(norm, dtype)
    return (
        chunk.start,
        chunk.stop,
        engine_reports(residual, dtype, outside=residual_outside),
        engine_reports(norm, dtype, outside=norm_outside),
    )


def out_of_range_in_float64(
    net: Network, tree: PathTree, start: int, residual: Tensor, norm: Tensor, memory_budget: int
) -> tuple[Tensor, Tensor]:
    """The float64 reports ``[B, k]`` of leaves ``start..start+k-1`` (leaf order), with those of a
    float32 network near or beyond float32's range evaluated again in float64.

    The per-node scales keep float32 residuals in range, not the column means μ: a product beyond
    float32's range (value maps that grow it 100× a layer, say) overflows to inf or NaN, and one
    whose norm falls below 1e-30 (a tiny X·W) has a μ near underflow. Those leaves, in any batch
    element, are computed again by the float64 engine, whose values float32 then reports (in
    float64 results where float32 cannot hold them). A path still out of range in float64 (beyond
    1e308) is warned about by name."""
    if net.attn.dtype != torch.float32:
        return residual, norm
    bad = _needs_float64(residual, norm)
    if not bool(bad.any()):
        return residual, norm
    leaves = bad.nonzero().flatten()
    paths = tree.leaf_paths(leaves.cpu() + start)
    wide = Network(
        *(None if t is None else t.double() for t in (net.attn, net.x, net.w_v, net.w_o)), True, net.precision
    )
    again = PathTree.from_paths(paths, num_heads=net.attn.shape[2])  # sorted and distinct: leaf order is this order
    wide_residual, wide_norm = leaf_norms(wide, again, 0, again.num_leaves, memory_budget)
    residual, norm = residual.clone(), norm.clone()
    residual[:, leaves.to(residual.device)] = wide_residual.to(residual.device)
    norm[:, leaves.to(norm.device)] = wide_norm.to(norm.device)
    still = _not_finite(wide_residual, wide_norm)
    if bool(still.any()):
        _warn_beyond_float64(paths[still.cpu()])
    return residual, norm


def _not_finite(residual: Tensor, norm: Tensor) -> Tensor:
    """``[leaves]``: the leaves of reports ``[B, leaves]`` that are inf or NaN in some batch element."""
    return ~(torch.isfinite(residual) & torch.isfinite(norm)).all(0)


def _warn_beyond_float64(paths: Tensor) -> None:
    """Warn, naming some of them, that the paths ``[k, L]`` lie beyond float64's range (their reports
    are inf or NaN): inputs are finite, so nothing else makes them so."""
    named = [[int(h) for h in path] for path in paths[:3]]
    warnings.warn(
        f"pathkernels: {paths.shape[0]} path(s) lie beyond float64's range (about 1e308) and have inf or NaN "
        f"norms, for example {named} (-1 = skip); scale the inputs down",
        RuntimeWarning,
        stacklevel=5,
    )


def _needs_float64(residual: Tensor, norm: Tensor) -> Tensor:
    """``[leaves]``: the leaves of float32 reports ``[B, leaves]`` near or beyond float32's range in
    some batch element (see :func:`out_of_range_in_float64`)."""
    return ~(torch.isfinite(residual) & torch.isfinite(norm) & (norm >= SMALLEST_ACCURATE_FLOAT32_NORM)).all(0)


def _on_device(t: Tensor, device: torch.device, copies: dict[int, tuple[Tensor, Tensor]]) -> Tensor:
    """``t`` on ``device``, copied once per tensor object (subtree chunks share their leaf order)."""
    if t.device == device:
        return t
    if id(t) not in copies:
        copies.clear()
        copies[id(t)] = (t, to_device(t, device))  # holding t keeps its id from being reused
    return copies[id(t)][1]


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """``t`` on ``device``. A CPU tensor bound for a GPU goes through pinned memory, without waiting
    for the stream: a copy from pageable memory waits for every kernel queued before it."""
    device = torch.device(device)
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _result(net: Network, tree: PathTree, residual: Tensor, norm: Tensor, products: Tensor | None) -> PathResiduals:
    """Per-leaf results ``[B, leaves]`` in the tree's result order, unbatched if attn was."""
    leaf_of_path = tree.leaf_of_path()
    if leaf_of_path is not None:
        leaf_of_path = leaf_of_path.to(residual.device)
        residual, norm = residual[:, leaf_of_path], norm[:, leaf_of_path]
    result = PathResiduals(residual, norm, tree, products)
    if not net.batched:
        result.residual, result.norm = residual[0], norm[0]
        result.products = None if products is None else products[0]
    return result


def _path_residuals_across(
    attn, tree, x, w_v, w_o, memory_budget, progress, materialize, group, all_ranks, leaf_kernel: str, where: str
):
    """path_residuals split over the ranks of ``group`` (see pathkernels.core.distributed)."""
    import torch.distributed as dist

    net, error, summary = None, None, None
    try:
        if materialize:
            raise ValueError(f"{where}: materialize=True is for small trees on one process; pass group=False")
        net, memory_budget = check_inputs(attn, tree, x, w_v, w_o, memory_budget, where)
        summary = distributed.fingerprint({"attn": net.attn, "x": net.x, "w_v": net.w_v, "w_o": net.w_o}, tree)
    except Exception as caught:  # every rank must learn of it, or the others would wait forever
        error = caught
    distributed.agree(where, group, error, summary)

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    first, last = distributed.leaf_range(tree.num_leaves, world, rank)
    parts = None
    try:
        bar = progress_bar(last - first, enabled=progress and rank == 0, desc=f"pathkernels (rank 0 of {world})")
        parts = leaf_norms(net, tree, first, last, memory_budget, bar, leaf_kernel=leaf_kernel, where=where)
    except Exception as caught:
        error = caught
    distributed.agree(where, group, error)
    gathered = distributed.gather_leaves(list(parts), tree.num_leaves, group, all_ranks)
    if gathered is None:
        return None
    return _result(net, tree, gathered[0], gathered[1], None)


@torch.no_grad()
def _materialize(net: Network, tree: PathTree, memory_budget: int, where: str) -> Tensor:
    """The products themselves, ``[B, M, n, m]``, refused beyond the memory budget."""
    need = net.attn.shape[0] * tree.num_paths * node_bytes(net)
    if need > memory_budget:
        raise ValueError(
            f"{where}: materialize=True needs {format_bytes(need)} for [B, M, n, m] = "
            f"{[net.attn.shape[0], tree.num_paths, net.attn.shape[-1], net.width]}, over memory_budget="
            f"{format_bytes(memory_budget)}; leave materialize off (the norms need no products) or raise the budget"
        )
    return trie_products_ref(net.attn, tree, net.x, net.w_v, net.w_o)
