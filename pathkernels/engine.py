"""Path decompositions: per-path residual norms on a path tree, and exact sums by path length.

Notation (docs/DESIGN.md §1): attention ``A[b, l, h]`` is ``n × n`` and row-stochastic; a path p picks a
head or the skip branch (``-1``, ``A = I``, ``W = I``) at every layer;
``P_p = A[L, p_L] ⋯ A[1, p_1]`` and ``Y_p = P_p X W_p`` with ``W_p = W[1, p_1] ⋯ W[L, p_L]``,
``W[l, h] = W_V[l, h] W_O[l, h]`` kept factored.
"""
from __future__ import annotations

import contextlib
import contextvars
import numbers
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from pathkernels import distributed, masking
from pathkernels._extension import has_cuda_kernels
from pathkernels._progress import progress_bar
from pathkernels.paths import SKIP, PathTree, build_trie_chunk

DEFAULT_MEMORY_BUDGET = 1 << 30  # bytes of working memory for the engine, beyond inputs and results

# Largest |row sum − 1| accepted as row-stochastic, by the attention's dtype. Beyond it the
# centring identity the engine relies on does not hold, and the inputs are refused.
ROW_SUM_TOLERANCE = {torch.float64: 1e-8, torch.float32: 1e-4}

_FEW_LEAVES = 256  # chunks smaller than this are dominated by per-chunk overhead: warn
_ADVISED_BUDGET = 4 << 20
_LEAF_BLOCK_BYTES = 1 << 19  # CPU: a leaf block (computed, then reduced) is sized to stay in L2
_CUDA_LEAF_BLOCK_BYTES = 1 << 27  # CUDA: one launch per block of leaves, so blocks are large
# CPU: a chunk's working set is kept near the size of a last-level cache, whatever the budget (which
# stays the upper bound). On the 2-core development VM (32 MiB L3) chunks of 32 MiB instead of the
# default 1 GiB ran 10-50 % faster: complete trees at n = 32, 64 and 128, max_length and explicit trees.
_CPU_CHUNK_BYTES = 1 << 25

# Whether CUDA leaves of n <= 128 go through the fused leaf kernel (the default) or through cuBLAS
# and a separate reduction (fast mode's TF32 GEMMs, and benchmarks comparing the two).
_FUSED_LEAVES: contextvars.ContextVar[bool] = contextvars.ContextVar("pathkernels_fused_leaves", default=True)


@contextlib.contextmanager
def _leaf_kernel(fused: bool):
    """Within the block, CUDA leaves use the fused leaf kernel (``fused=True``) or cuBLAS + reduction."""
    token = _FUSED_LEAVES.set(fused)
    try:
        yield
    finally:
        _FUSED_LEAVES.reset(token)


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


@dataclass
class _Network:
    attn: Tensor  # [B, L, H, n, n]
    x: Tensor | None  # [B, n, d]
    w_v: Tensor | None  # [L, H, d, d_head]
    w_o: Tensor | None  # [L, H, d_head, d]
    batched: bool

    @property
    def width(self) -> int:
        return self.attn.shape[-1] if self.x is None else self.x.shape[-1]


def format_bytes(count: int) -> str:
    """``count`` bytes for a message: "512 bytes", "24.0 KiB", "3.50 GiB"."""
    if count < 1024:
        return f"{count:,} bytes"
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.2f} {unit} ({count:,} bytes)"
    raise AssertionError


def _first_index(mask: Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in torch.nonzero(mask)[0])


def _check_finite(t: Tensor, name: str, where: str) -> None:
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        index = _first_index(bad)
        raise ValueError(f"{where}: {name} has a non-finite value ({t[index].item()}) at index {list(index)}")


def check_row_stochastic(attn: Tensor, where: str, *, batch_index: Tensor | None = None) -> None:
    """Raise unless every row of ``attn [B, L, H, n, n]`` sums to 1 within its dtype's tolerance.

    ``batch_index [B]``: for attention restricted to one mask group's real tokens, the elements'
    indices in the full batch (named in the message)."""
    row_sums = attn.sum(-1, dtype=torch.float64)
    deviation = (row_sums - 1).abs()
    bad = deviation > ROW_SUM_TOLERANCE.get(attn.dtype, 1e-2)
    if bool(bad.any()):
        b, l, h, i = _first_index(bad)
        error = deviation.max().item()
        if batch_index is not None:
            hint = ("Restricted to the real tokens of token_mask, a real query's row must still sum to 1: its "
                    "attention must give padded keys zero weight (pass the model the same attention_mask).")
            element = f"real token {i} of batch element {int(batch_index[b])}"
        else:
            hint = (
                "A lower-precision pattern cast up sums to 1 only to its own precision: renormalise the rows "
                "(attn / attn.sum(-1, keepdim=True)) after the cast, as AttentionStack.to() does."
                if error < 1e-3 else
                "Masked or padded queries give zero rows and dropout in training mode rescales them: pass "
                "token_mask (the attention_mask) for a padded batch, or drop those tokens, and take attention "
                "in eval mode."
            )
            element = f"row {i} of batch element {b}"
        raise ValueError(
            f"{where}: attention rows must sum to 1 (the centring identity needs P·1 = 1), but {element}, layer "
            f"{l}, head {h} sums to {row_sums[b, l, h, i].item():.9g}. {hint}"
        )


def restricted_attention(attn: Tensor, group: masking.MaskGroup, where: str) -> Tensor:
    """``attn [B, L, H, n, n]`` at one mask group's elements and real tokens, checked row-stochastic."""
    restricted = masking.restrict(attn, group, token_dims=(-2, -1))
    check_row_stochastic(restricted, where, batch_index=group.batch)
    return restricted


def _check_network(attn, x, w_v, w_o, where: str) -> _Network:
    """Validate and batch the inputs; every message names the argument, the expected and the got."""
    if not isinstance(attn, Tensor):
        raise TypeError(f"{where}: expected attn to be a torch.Tensor, got {type(attn).__name__}")
    if attn.dim() not in (4, 5):
        raise ValueError(f"{where}: expected attn of shape [B, L, H, n, n] or [L, H, n, n], got {list(attn.shape)}")
    if attn.dtype not in ROW_SUM_TOLERANCE:
        raise TypeError(f"{where}: expected attn to be float32 or float64, got {attn.dtype}")
    if attn.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{where}: expected attn on a CPU or CUDA device, got {attn.device}")
    batched = attn.dim() == 5
    attn = attn if batched else attn.unsqueeze(0)
    batch, layers, heads, n, n2 = attn.shape
    if n != n2 or n == 0:
        raise ValueError(f"{where}: expected square attention matrices [.., n, n] with n >= 1, got {list(attn.shape)}")
    if batch == 0 or layers == 0 or heads == 0:
        raise ValueError(f"{where}: expected non-empty B, L and H in attn, got {list(attn.shape)}")
    if (x is None) != (w_v is None) or (w_v is None) != (w_o is None):
        raise ValueError(f"{where}: pass x, w_v and w_o together (path outputs) or none of them (attention products)")
    tensors = {"attn": attn}
    if x is not None:
        for name, t in (("x", x), ("w_v", w_v), ("w_o", w_o)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{where}: expected {name} to be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != attn.dtype:
                raise TypeError(f"{where}: expected {name} in attn's dtype {attn.dtype}, got {t.dtype}")
        given = list(x.shape)
        expected = f"[B, n, d] = [{batch}, {n}, d]" if batched else f"[n, d] = [{n}, d] (attn has no batch dim)"
        if x.dim() != (3 if batched else 2):
            raise ValueError(f"{where}: expected x of shape {expected}, got {given}")
        x = x if batched else x.unsqueeze(0)
        if x.shape[:2] != (batch, n):
            raise ValueError(f"{where}: expected x of shape {expected}, got {given}")
        d = x.shape[2]
        if d == 0:
            raise ValueError(f"{where}: expected x with at least one column (d >= 1), got {given}")
        if w_v.dim() != 4 or w_v.shape[:3] != (layers, heads, d):
            raise ValueError(
                f"{where}: expected w_v of shape [L, H, d, d_head] = [{layers}, {heads}, {d}, d_head], "
                f"got {list(w_v.shape)}"
            )
        if w_o.shape != (layers, heads, w_v.shape[3], d):
            raise ValueError(
                f"{where}: expected w_o of shape [L, H, d_head, d] = {[layers, heads, w_v.shape[3], d]}, "
                f"got {list(w_o.shape)}"
            )
        tensors.update(x=x, w_v=w_v, w_o=w_o)
    for name, t in tensors.items():
        if t.device != attn.device:
            raise ValueError(f"{where}: expected {name} on attn's device {attn.device}, got {t.device}")
        _check_finite(t, name, where)
    check_row_stochastic(attn, where)
    return _Network(attn, x, w_v, w_o, batched)


def _check_tree(tree, net: _Network, where: str) -> None:
    if not isinstance(tree, PathTree):
        raise TypeError(f"{where}: expected tree to be a pathkernels.PathTree, got {type(tree).__name__}")
    layers, heads = net.attn.shape[1:3]
    if tree.num_layers != layers or tree.num_heads > heads or (tree.is_complete and tree.num_heads != heads):
        raise ValueError(
            f"{where}: the tree has {tree.num_layers} layers and {tree.num_heads} heads, attn has "
            f"L = {layers} and H = {heads}"
        )


def _check_engine_device(device: torch.device, where: str) -> None:
    if device.type != "cuda":
        return
    if not has_cuda_kernels():
        raise ValueError(
            f"{where}: the inputs are on {device}, but pathkernels was built without its CUDA kernels; "
            "rebuild it against a CUDA torch (PATHKERNELS_CUDA=ON) or move the inputs to CPU"
        )


def _engine_operands(net: _Network):
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


def _node_bytes(net: _Network) -> int:
    return net.attn.shape[-1] * net.width * net.attn.element_size()


def _leaf_blocks(net: _Network, memory_budget: int) -> tuple[int, int, int]:
    """``(workers, leaf_block, fixed)``: blocks run one per CPU thread (one on CUDA) of ``leaf_block``
    leaves each, and ``fixed`` bytes are each worker's leaf block, gathered parents and W
    temporaries (3 node-sized buffers per leaf)."""
    node_bytes = _node_bytes(net)
    on_cpu = net.attn.device.type == "cpu"
    workers = torch.get_num_threads() if on_cpu else 1
    block_bytes = _LEAF_BLOCK_BYTES if on_cpu else _CUDA_LEAF_BLOCK_BYTES
    leaf_block = max(1, min(block_bytes, memory_budget // (8 * workers)) // node_bytes)
    return workers, leaf_block, 3 * workers * leaf_block * node_bytes


def minimum_budget(net: _Network) -> int:
    """The smallest memory_budget that runs: one leaf per worker, ``fixed + 2 nodes`` with
    ``fixed = 3 · workers · node`` (:func:`_leaf_blocks` gives one-leaf blocks at that budget)."""
    workers = _leaf_blocks(net, 1)[0]
    return (3 * workers + 2) * _node_bytes(net)


def _chunks(tree: PathTree, net: _Network, memory_budget: int, first: int, last: int):
    """Consecutive runs of leaves ``first..last-1`` whose tries fit the memory budget (on CPU, the
    smaller of it and a cache-sized working set): (start, stop, TrieChunk, leaf_block).

    A complete tree (without ``max_length``) is cut into whole subtrees of ``C^depth`` leaves,
    whose tries have a closed form (:meth:`PathTree.subtree_chunk`); only the unaligned ends of
    the range, and other trees, are built from their paths."""
    node_bytes = _node_bytes(net)
    on_cpu = net.attn.device.type == "cpu"
    _, leaf_block, fixed = _leaf_blocks(net, memory_budget)
    chunk_budget = memory_budget
    if on_cpu:  # never below what one chunk needs, so that a budget that works still works
        chunk_budget = min(memory_budget, max(_CPU_CHUNK_BYTES, 4 * (fixed + 2 * node_bytes)))

    def chunk_bytes(chunk) -> int:
        # Two consecutive levels live at once, plus a gathered copy of parents, plus the index arrays.
        return 3 * chunk.internal_nodes() * node_bytes + 32 * chunk.leaf_position.numel() + fixed

    if fixed + 2 * node_bytes > memory_budget:  # checked up front by _check_inputs; kept as the invariant
        raise AssertionError(f"memory_budget={memory_budget} is below {minimum_budget(net)}")
    size_cap = max(1, (chunk_budget - fixed) // max(1, node_bytes // 2 + 32))
    if size_cap < min(_FEW_LEAVES, last - first):
        warnings.warn(
            f"pathkernels.path_residuals: memory_budget={memory_budget:,} bytes allows chunks of at most {size_cap:,} "
            f"leaves at n = {net.attn.shape[-1]}, width {net.width}; such small chunks run up to a few hundred times "
            f"slower than a budget of {format_bytes(_ADVISED_BUDGET)} or more",
            RuntimeWarning, stacklevel=4)

    def from_paths(start: int, last: int):
        size = max(1, min(last - start, size_cap))
        while start < last:
            stop = min(last, start + size)
            chunk = build_trie_chunk(tree.leaf_range(start, stop))
            while chunk_bytes(chunk) > chunk_budget and stop - start > 1:
                size = max(1, (stop - start) // 2)
                stop = start + size
                chunk = build_trie_chunk(tree.leaf_range(start, stop))
            yield start, stop, chunk, leaf_block
            start = stop

    choices = tree.num_heads + int(tree.skip)
    depth = 0
    if tree.is_complete and tree.max_length is None and choices > 1:
        # Subtree chunks are sized by their exact trie: L − depth prefix nodes, C^j at depth j.
        def subtree_bytes(depth: int) -> int:
            internal = tree.num_layers - depth + sum(choices**j for j in range(1, depth))
            return 3 * internal * node_bytes + 32 * choices**depth + fixed

        depth = tree.num_layers
        while depth > 0 and subtree_bytes(depth) > chunk_budget:
            depth -= 1
    if depth < 2:  # subtrees too small to pay off
        yield from from_paths(first, last)
        return
    block = choices**depth
    aligned = min(last, -(-first // block) * block)
    yield from from_paths(first, aligned)
    start = aligned
    while start + block <= last:
        yield start, start + block, tree.subtree_chunk(start, depth), leaf_block
        start += block
    yield from from_paths(start, last)


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
            ``memory_budget``; progress shows on rank 0 only. See :mod:`pathkernels.distributed`.
        all_ranks: with a group, gather the results on every rank instead of rank 0 only.
        fast: CUDA float32 only: run the GEMMs on TF32 tensor cores (10-bit mantissa, float32
            accumulation), about 1e-3 relative error per level instead of float32's 1e-7, with
            the leaves through cuBLAS rather than the fused leaf kernel. Off by default; the norms
            and the centring stay in full precision.
        token_mask: ``[B, n]`` (``[n]`` for unbatched attn), True (or 1) at real tokens, e.g. a
            padded batch's ``attention_mask``: each batch element is evaluated on its real tokens
            only, ``P_p`` restricted to them (its rows must still sum to 1 there). Elements that
            share a mask run as one batch. Not with ``materialize`` (the products differ in size).

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
    where = "pathkernels.path_residuals"
    if isinstance(memory_budget, numbers.Integral) and not isinstance(memory_budget, bool):
        memory_budget = int(memory_budget)  # numpy integers too
    attn, x, w_v, w_o, token_mask = unpack_stack(attn, x, w_v, w_o, token_mask)
    if token_mask is not None:
        return _masked_path_residuals(attn, tree, x, token_mask, where, w_v=w_v, w_o=w_o, memory_budget=memory_budget,
                                      progress=progress, materialize=materialize, group=group, all_ranks=all_ranks,
                                      fast=fast)
    if fast:
        _check_fast(attn, where)
        with _tf32_matmuls(), _leaf_kernel(fused=False):  # the fused leaf kernel is full float32
            return path_residuals(attn, tree, x=x, w_v=w_v, w_o=w_o, memory_budget=memory_budget, progress=progress,
                                  materialize=materialize, group=group, all_ranks=all_ranks)
    group = distributed.resolve_group(group, where)
    if group is not None:
        return _path_residuals_across(attn, tree, x, w_v, w_o, memory_budget, progress, materialize, group, all_ranks)
    net = _check_inputs(attn, tree, x, w_v, w_o, memory_budget, where)
    products = _materialize(net, tree, memory_budget, where) if materialize else None
    bar = progress_bar(tree.num_leaves, enabled=progress)
    residual, norm = _leaf_norms(net, tree, 0, tree.num_leaves, memory_budget, bar)
    return _result(net, tree, residual, norm, products)


def unpack_stack(attn, x, w_v, w_o, token_mask):
    """``(attn, x, w_v, w_o, token_mask)``, filled from an AttentionStack passed as ``attn``.

    The stack's ``w_v``/``w_o`` come in only with an ``x`` (path outputs); its ``token_mask`` is the
    default mask. Anything else passes through unchanged."""
    from pathkernels.adapters.stack import AttentionStack

    if not isinstance(attn, AttentionStack):
        return attn, x, w_v, w_o, token_mask
    stack = attn
    if x is not None:
        w_v = stack.w_v if w_v is None else w_v
        w_o = stack.w_o if w_o is None else w_o
    return stack.attn, x, w_v, w_o, stack.token_mask if token_mask is None else token_mask


def _masked_path_residuals(attn, tree, x, token_mask, where: str, *, materialize: bool, **kwargs):
    """path_residuals of each batch element on its real tokens: one call per group of equal masks."""
    if not isinstance(attn, Tensor) or attn.dim() not in (4, 5):
        raise ValueError(f"{where}: expected attn of shape [B, L, H, n, n] or [L, H, n, n], got "
                         f"{getattr(attn, 'shape', type(attn).__name__)}")
    batched = attn.dim() == 5
    if not batched:
        attn = attn.unsqueeze(0)
        x = None if not isinstance(x, Tensor) else x.unsqueeze(0)
        token_mask = token_mask.unsqueeze(0) if isinstance(token_mask, Tensor) else token_mask
    mask = masking.check_token_mask(token_mask, attn.shape[0], attn.shape[-1], attn.device, where)
    if mask is not None and materialize:
        raise ValueError(f"{where}: materialize=True cannot honour token_mask (the sequences' products differ in "
                         "size); materialise each sequence on its own")
    if mask is None:
        result = path_residuals(attn, tree, x=x, materialize=materialize, **kwargs)
    else:
        residual = norm = None
        for group in masking.mask_groups(mask):
            part = path_residuals(restricted_attention(attn, group, where), tree,
                                  x=None if x is None else masking.restrict(x, group), **kwargs)
            if part is None:  # a rank other than 0 of a process group: the results went to rank 0
                continue
            if residual is None:
                residual = part.residual.new_empty(attn.shape[0], part.residual.shape[1])
                norm = torch.empty_like(residual)
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


def _check_inputs(attn, tree, x, w_v, w_o, memory_budget, where: str) -> _Network:
    net = _check_network(attn, x, w_v, w_o, where)
    _check_tree(tree, net, where)
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, numbers.Integral) or memory_budget <= 0:
        raise ValueError(f"{where}: expected memory_budget to be a positive int (bytes), got {memory_budget!r}")
    minimum = minimum_budget(net)
    if memory_budget < minimum:
        raise ValueError(
            f"{where}: memory_budget={int(memory_budget):,} bytes is too small: at n = {net.attn.shape[-1]}, width "
            f"{net.width} and {_leaf_blocks(net, 1)[0]} worker thread(s) the engine needs at least {minimum:,} bytes "
            f"(one leaf block per worker); {format_bytes(_ADVISED_BUDGET)} or more runs at full speed"
        )
    if tree.num_paths > 1 << 40:
        raise ValueError(f"{where}: the tree has {tree.num_paths:,} paths; results alone would not fit in memory")
    _check_engine_device(net.attn.device, where)
    _check_results_fit(net, tree, where)
    return net


# The results (residual and norm per path and batch element) are built twice over at the end: in leaf
# order, then in the tree's result order.
_RESULT_COPIES = 2


def _check_results_fit(net: _Network, tree: PathTree, where: str) -> None:
    """Refuse up front, before any work, results that would not fit the device's available memory."""
    need = _RESULT_COPIES * 2 * net.attn.shape[0] * tree.num_paths * net.attn.element_size()
    available = available_memory(net.attn.device)
    if available is not None and need > available:
        raise ValueError(
            f"{where}: the results of {tree.num_paths:,} paths × B = {net.attn.shape[0]} (residual and norm in "
            f"{net.attn.dtype}) need {format_bytes(need)}, more than the {format_bytes(available)} available on "
            f"{net.attn.device}; evaluate fewer paths (max_length, sampling, or a share of the tree per process with "
            "group=), or use pk.length_sums for exact sums per length"
        )


def available_memory(device: torch.device) -> int | None:
    """Bytes free on ``device`` now: the CUDA allocator's free memory, or the host's available
    physical memory (Linux ``MemAvailable``); None where that cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@torch.no_grad()
def _leaf_norms(net: _Network, tree: PathTree, first: int, last: int, memory_budget: int, bar) -> tuple[Tensor, Tensor]:
    """Residual and norm ``[B, last - first]`` of leaves ``first..last-1``, chunk by chunk."""
    attn_centred, attn_mean, root, root_mean = _engine_operands(net)
    device = net.attn.device
    residual = torch.empty(net.attn.shape[0], last - first, dtype=net.attn.dtype, device=device)
    norm = torch.empty_like(residual)
    device_copies: dict[int, tuple[Tensor, Tensor]] = {}
    try:
        for start, stop, chunk, leaf_block in _chunks(tree, net, memory_budget, first, last):
            chunk_residual, chunk_norm = torch.ops.pathkernels.path_chunk_norms(
                attn_centred, attn_mean, root, root_mean, net.w_v, net.w_o, chunk.parents, chunk.heads, leaf_block,
                _FUSED_LEAVES.get(),
            )
            leaf_position = _on_device(chunk.leaf_position, device, device_copies)
            residual[:, start - first : stop - first] = chunk_residual[:, leaf_position]
            norm[:, start - first : stop - first] = chunk_norm[:, leaf_position]
            if bar is not None:
                bar.update(stop - start)
    finally:
        if bar is not None:
            bar.close()
    return residual, norm


def _on_device(t: Tensor, device: torch.device, copies: dict[int, tuple[Tensor, Tensor]]) -> Tensor:
    """``t`` on ``device``, copied once per tensor object (subtree chunks share their leaf order)."""
    if t.device == device:
        return t
    if id(t) not in copies:
        copies.clear()
        copies[id(t)] = (t, t.to(device))  # holding t keeps its id from being reused
    return copies[id(t)][1]


def _result(net: _Network, tree: PathTree, residual: Tensor, norm: Tensor, products: Tensor | None) -> PathResiduals:
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


def _path_residuals_across(attn, tree, x, w_v, w_o, memory_budget, progress, materialize, group, all_ranks):
    """path_residuals split over the ranks of ``group`` (see pathkernels.distributed)."""
    where = "pathkernels.path_residuals"
    import torch.distributed as dist

    net, error, summary = None, None, None
    try:
        if materialize:
            raise ValueError(f"{where}: materialize=True is for small trees on one process; pass group=False")
        net = _check_inputs(attn, tree, x, w_v, w_o, memory_budget, where)
        summary = distributed.fingerprint({"attn": net.attn, "x": net.x, "w_v": net.w_v, "w_o": net.w_o}, tree)
    except Exception as caught:  # every rank must learn of it, or the others would wait forever
        error = caught
    distributed.agree(where, group, error, summary)

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    first, last = distributed.leaf_range(tree.num_leaves, world, rank)
    parts = None
    try:
        bar = progress_bar(last - first, enabled=progress and rank == 0, desc=f"pathkernels (rank 0 of {world})")
        parts = _leaf_norms(net, tree, first, last, memory_budget, bar)
    except Exception as caught:
        error = caught
    distributed.agree(where, group, error)
    gathered = distributed.gather_leaves(list(parts), tree.num_leaves, group, all_ranks)
    if gathered is None:
        return None
    return _result(net, tree, gathered[0], gathered[1], None)


@torch.no_grad()
def _materialize(net: _Network, tree: PathTree, memory_budget: int, where: str) -> Tensor:
    """The products themselves, ``[B, M, n, m]``, by the same trie in plain PyTorch (small trees)."""
    need = net.attn.shape[0] * tree.num_paths * _node_bytes(net)
    if need > memory_budget:
        raise ValueError(
            f"{where}: materialize=True needs {format_bytes(need)} for [B, M, n, m] = "
            f"{[net.attn.shape[0], tree.num_paths, net.attn.shape[-1], net.width]}, over memory_budget="
            f"{format_bytes(memory_budget)}; leave materialize off (the norms need no products) or raise the budget"
        )
    chunk = build_trie_chunk(tree.leaf_range(0, tree.num_leaves))
    batch, n = net.attn.shape[0], net.attn.shape[-1]
    device = net.attn.device
    if net.x is None:
        level = torch.eye(n, dtype=net.attn.dtype, device=device).expand(batch, 1, n, n)
    else:
        level = net.x.unsqueeze(1)  # [B, 1, n, d]
    for layer, (parents, heads) in enumerate(zip(chunk.parents, chunk.heads)):
        parents, heads = parents.to(device), heads.to(device)
        nodes = level[:, parents]  # [B, N, n, m]
        out = nodes.clone()
        for head in heads.unique().tolist():
            if head == SKIP:
                continue
            sel = heads == head
            product = net.attn[:, layer, head].unsqueeze(1) @ nodes[:, sel]
            if net.x is not None:
                product = product @ net.w_v[layer, head] @ net.w_o[layer, head]
            out[:, sel] = product
        level = out
    leaves = level[:, chunk.leaf_position.to(device)]
    leaf_of_path = tree.leaf_of_path()
    return leaves if leaf_of_path is None else leaves[:, leaf_of_path.to(device)]


def length_sums(attn: Tensor, x: Tensor, w_v: Tensor, w_o: Tensor, *, b_o: Tensor | None = None,
                skip: bool = True, token_mask: Tensor | None = None) -> Tensor:
    """Exact sum of the path outputs of each length, by dynamic programming over layers.

    ``S_k^(l) = [skip] S_k^(l-1) + Σ_h A[l, h] S_{k-1}^(l-1) W_V[l, h] W_O[l, h] + [k = 1] 1 b_O[l]ᵀ``
    with ``S_0^(0) = X``: ``S_k^(L) = Σ_{p : len(p) = k} Y_p``. It costs ``O(L² H)`` matrix products
    and enumerates nothing, so it works when ``(H+1)^L`` is astronomically large.

    With ``b_o``, the output bias of each layer is a path of its own: ``1 b_O[l]ᵀ`` enters at layer
    l as the layer's output and is carried through the later layers like any other path (a head
    maps it to ``A 1 b_Oᵀ W = 1 (b_Oᵀ W)``, since A is row-stochastic). Its length counts layer l
    and every head taken after it. With skip, ``Σ_k S_k`` is then the output of the attention-only
    network ``X_l = X_{l-1} + Σ_h A X_{l-1} W + 1 b_O[l]ᵀ``; without ``b_o`` that of the same
    network with zero biases. A bias path is a matrix of equal rows, so its residual
    ``‖Y − 1μᵀ‖`` is exactly 0: biases shift the tokens, they never spread them apart.

    The result is differentiable in every input (plain torch operations).

    Args:
        attn: ``[B, L, H, n, n]`` (or ``[L, H, n, n]``), row-stochastic, float32 or float64.
        x: ``[B, n, d]`` (or ``[n, d]``); ``w_v``: ``[L, H, d, d_head]``; ``w_o``: ``[L, H, d_head, d]``.
        b_o: ``[L, d]`` output biases with the value biases folded in (``AttentionStack.b_o``), or
            None to leave the bias paths out.
        skip: whether the network has skip connections.
        token_mask: ``[B, n]`` (``[n]`` unbatched), True at real tokens: each batch element is
            computed on its real tokens only, and its padded rows are 0.

    Returns:
        ``[L+1, B, n, d]`` (``[L+1, n, d]`` unbatched): index k holds the sum over paths of length k.
        Without skip and biases only ``k = L`` is non-zero.
    """
    where = "pathkernels.length_sums"
    for name, t in (("x", x), ("w_v", w_v), ("w_o", w_o)):
        if t is None:
            raise ValueError(f"{where}: expected {name}; length sums are sums of path outputs P X W")
    if token_mask is not None:
        return _masked_length_sums(attn, x, w_v, w_o, b_o, skip, token_mask, where)
    net = _check_network(attn, x, w_v, w_o, where)
    layers = net.attn.shape[1]
    if b_o is not None:
        _check_bias(b_o, net, where)
    zero = torch.zeros_like(net.x)
    sums = [net.x] + [zero] * layers  # S_0 .. S_L, each [B, n, d]; out of place, so autograd can follow
    for layer in range(layers):
        attn_l = net.attn[:, layer]  # [B, H, n, n]
        top = layer + 1  # lengths 0..layer can feed a head at this layer
        mixed = torch.einsum("bhij,kbjd->kbhid", attn_l, torch.stack(sums[:top]))  # [k, B, H, n, d]
        heads_out = torch.einsum("kbhid,hde,hef->kbif", mixed, net.w_v[layer], net.w_o[layer])
        carried = sums if skip else [zero] * (layers + 1)
        sums = carried[:1] + [carried[k] + heads_out[k - 1] for k in range(1, top + 1)] + carried[top + 1 :]
        if b_o is not None:
            sums[1] = sums[1] + b_o[layer]  # broadcast over the batch and the n rows: 1 b_O[l]ᵀ
    sums = torch.stack(sums)  # [L+1, B, n, d]
    return sums if net.batched else sums[:, 0]


def _masked_length_sums(attn, x, w_v, w_o, b_o, skip: bool, token_mask, where: str) -> Tensor:
    """length_sums of each batch element on its real tokens, zeros on its padded rows."""
    shapes_ok = (isinstance(attn, Tensor) and attn.dim() in (4, 5) and isinstance(x, Tensor)
                 and x.dim() == attn.dim() - 2 and x.shape[:-1] == attn.shape[:-4] + attn.shape[-1:])
    if not shapes_ok:  # the plain checks name what is wrong
        _check_network(attn, x, w_v, w_o, where)
        raise ValueError(f"{where}: expected attn [B, L, H, n, n] with x [B, n, d], got {list(attn.shape)} and "
                         f"{list(x.shape)}")
    batched = attn.dim() == 5
    if not batched:
        attn, x = attn.unsqueeze(0), x.unsqueeze(0)
        token_mask = token_mask.unsqueeze(0) if isinstance(token_mask, Tensor) else token_mask
    mask = masking.check_token_mask(token_mask, attn.shape[0], attn.shape[-1], attn.device, where)
    if mask is None:
        sums = length_sums(attn, x, w_v, w_o, b_o=b_o, skip=skip)
    else:
        sums = x.new_zeros(attn.shape[1] + 1, *x.shape)
        for group in masking.mask_groups(mask):
            part = length_sums(restricted_attention(attn, group, where), masking.restrict(x, group),
                               w_v, w_o, b_o=b_o, skip=skip)  # [L+1, G, n_real, d]
            sums[:, group.batch.unsqueeze(1), group.tokens] = part
    return sums if batched else sums[:, 0]


def _check_bias(b_o, net: _Network, where: str) -> None:
    if not isinstance(b_o, Tensor):
        raise TypeError(f"{where}: expected b_o to be a torch.Tensor [L, d], got {type(b_o).__name__}")
    layers, d = net.attn.shape[1], net.x.shape[-1]
    if b_o.shape != (layers, d):
        raise ValueError(f"{where}: expected b_o of shape [L, d] = [{layers}, {d}], got {list(b_o.shape)}")
    if b_o.dtype != net.attn.dtype or b_o.device != net.attn.device:
        raise TypeError(
            f"{where}: expected b_o in attn's dtype {net.attn.dtype} on {net.attn.device}, got {b_o.dtype} on "
            f"{b_o.device}"
        )
    _check_finite(b_o, "b_o", where)


def truncated_output(sums: Tensor, max_length: int) -> Tensor:
    """Output of the paths of length ≤ ``max_length``: ``Σ_{k ≤ max_length} S_k`` from :func:`length_sums`."""
    if not 0 <= max_length:
        raise ValueError(f"pathkernels.truncated_output: expected max_length >= 0, got {max_length}")
    return sums[: max_length + 1].sum(0)

