"""CUDA graphs for the engine's repeated chunks (``PATHKERNELS_CUDA_GRAPHS=1``; unset, as measured
for the card: :mod:`pathkernels.core.engine_defaults`, off until a GPU run times it).

A complete tree's chunks are subtrees (:meth:`PathTree.subtree_chunk`): a chain of ``k = L − depth``
prefix nodes, one a layer, then every choice of the last ``depth`` layers. The levels below the
prefix are the same tensors for every chunk; only the prefix's heads differ, and the engine's C++
picks its operands by those heads on the host, so a whole chunk's launches differ from chunk to
chunk. Split there, they repeat:

- the prefix node ``(R, μ)``, the chain's residual and column mean (``R ← C(A[l, h]) R W[l, h]``,
  ``μ ← (μ + Rᵀ a[l, h]) W[l, h]``, the skip leaving both), computed here in float64 torch ops, a
  few small products a prefix layer;
- the subtree below it: ``path_chunk_norms`` of the last ``depth`` layers with that node as its
  root, the same launches for every chunk. On CUDA they are captured once in a CUDA graph (at the
  second chunk of a shape; a shape's first chunk runs eagerly and unsplit, warming up cuBLAS, the
  allocator and Triton's autotuner, as do chunks met once, such as a tree's unaligned ends) and
  replayed with the root copied into the graph's static input: one graph launch where the engine
  made several hundred, and no host work between them.

The engine is linear in ``(root, root_mean)`` jointly: every node's R and μ, and so every report,
scales with them. A float32 root is therefore handed over as ``(R, μ) / s`` with ``s`` a power of two
near ``max|R|`` (at least ``max|μ| · 2^-40``, so that μ / s keeps float32's range as the subtree's
value maps grow it), and the reports multiplied by ``s``: exact. The engine keeps every node's
largest entry within [2^-32, 2^32] and renormalises children only, so a root must lie there too:
where ``R / s`` falls below ``2^-32`` (a residual below 2^-72 of its mean), the chunk's reports in
that batch element are NaN, which the engine's range check
(:func:`pathkernels.core.engine.out_of_range_in_float64`) evaluates again in float64, slower than
the unsplit engine, which carries such residuals in its node scales (the op takes no root scale:
a root scale of its own would remove these float64 passes). float64 roots go as they are.

On the CPU the switch runs the same split without graphs (the CPU launches nothing), which is how
the split is tested there; the capture is tested on a GPU (tests/test_chunk_graphs.py).
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from pathkernels.core import ops
from pathkernels.core.checks import Network
from pathkernels.core.paths import SKIP

# float32 roots: μ / s stays below 2^40 · 2 (headroom for the subtree's value maps), and a residual
# whose largest entry falls below 2^-32 once divided by s (below the band the engine keeps its nodes
# in) is evaluated again in float64.
_MEAN_HEADROOM_EXPONENT = 40
_SMALLEST_ROOT = 2.0**-32


def prefix_length(chunk) -> int:
    """How many leading levels of ``chunk`` hold one node each (the prefix chain), stopping short of
    the leaf level: ``0 ≤ k < L``."""
    k = 0
    while k < len(chunk.heads) - 1 and chunk.heads[k].numel() == 1:
        k += 1
    return k


def prefix_node(net: Network, operands: tuple, heads: list[int]) -> tuple[Tensor, Tensor]:
    """The residual ``R [B, n, m]`` and column mean ``μ [B, m]`` (float64) of the path through the
    first ``len(heads)`` layers taking ``heads`` (``-1``: skip), from the engine's operands
    (:func:`pathkernels.core.engine.engine_operands`): ``μ ← (μ + Rᵀ a) W`` and ``R ← C(A) R W``
    layer by layer, ``W = W_V W_O`` when the network has value maps, as the engine computes them."""
    attn_centred, attn_mean, root, root_mean = operands
    residual, mean = root.double(), root_mean.double()
    for layer, head in enumerate(heads):
        if head == SKIP:
            continue
        mean = mean + torch.einsum("bn,bnm->bm", attn_mean[:, layer, head].double(), residual)
        residual = attn_centred[:, layer, head].double() @ residual
        if net.w_v is not None:
            w_v, w_o = net.w_v[layer, head].double(), net.w_o[layer, head].double()
            residual, mean = residual @ w_v @ w_o, mean @ w_v @ w_o
    return residual, mean


def scaled_root(residual: Tensor, mean: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(R / s, μ / s)`` in ``dtype``, the power-of-two scales ``s [B]`` (float64) and ``lost [B]``:
    the batch elements whose ``R / s`` falls below ``2^-32`` (see the module's docstring). float64:
    s = 1. No host synchronisation: every step is a device op."""
    batch = residual.shape[0]
    if dtype == torch.float64:
        scale = torch.ones(batch, dtype=torch.float64, device=residual.device)
        return residual, mean, scale, torch.zeros(batch, dtype=torch.bool, device=residual.device)
    largest = residual.abs().flatten(1).amax(1)  # [B]
    largest_mean = mean.abs().amax(1)
    exponent = torch.maximum(
        torch.where(largest > 0, largest.log2().round(), -torch.inf),
        torch.where(largest_mean > 0, largest_mean.log2().ceil() - _MEAN_HEADROOM_EXPONENT, -torch.inf),
    )
    # Zero roots keep s = 1; a root beyond float64's range passes inf or NaN on, for the range check.
    scale = torch.exp2(torch.where(exponent.isfinite(), exponent, 0.0))
    lost = (largest > 0) & (largest / scale < _SMALLEST_ROOT)
    return (
        (residual / scale[:, None, None]).to(dtype).contiguous(),
        (mean / scale[:, None]).to(dtype).contiguous(),
        scale,
        lost,
    )


class _Subtree:
    """The operands below a prefix of ``k`` layers, and the levels they were made for (held, so
    that a later chunk is recognised by identity: :meth:`PathTree.subtree_chunk` hands every chunk
    of a depth the same level tensors)."""

    def __init__(
        self, net: Network, operands: tuple, chunk, k: int, leaf_block: int, leaf_kernel: str, all_heads_levels: bool
    ):
        attn_centred, attn_mean = operands[:2]
        self.parents, self.heads = chunk.parents[k:], chunk.heads[k:]
        self.leaf_block, self.leaf_kernel, self.all_heads_levels = leaf_block, leaf_kernel, all_heads_levels
        # Contiguous once (a view for one batch element), not copied by the op at every call.
        self.attn_centred = attn_centred[:, k:].contiguous()
        self.attn_mean = attn_mean[:, k:].contiguous()
        self.w_v = None if net.w_v is None else net.w_v[k:].contiguous()
        self.w_o = None if net.w_o is None else net.w_o[k:].contiguous()
        self.sightings = 0
        self.graph = None

    def serves(self, chunk, k: int, leaf_block: int) -> bool:
        return (
            len(chunk.heads) - k == len(self.heads)
            and all(a is b for a, b in zip(chunk.parents[k:], self.parents))
            and all(a is b for a, b in zip(chunk.heads[k:], self.heads))
            and leaf_block == self.leaf_block
        )

    def run(self, root: Tensor, root_mean: Tensor) -> tuple[Tensor, Tensor]:
        """``path_chunk_norms`` of the subtree with this root: ``(residual, norm) [B, leaves]``."""
        return ops.path_chunk_norms(
            self.attn_centred,
            self.attn_mean,
            root,
            root_mean,
            self.w_v,
            self.w_o,
            self.parents,
            self.heads,
            self.leaf_block,
            self.leaf_kernel,
            self.all_heads_levels,
        )


class _CapturedSubtree:
    """A subtree's launches in a CUDA graph: static root inputs, static report outputs."""

    def __init__(self, subtree: _Subtree, root: Tensor, root_mean: Tensor):
        self.device = root.device  # captured and replayed on it, whatever the current device
        self.root, self.root_mean = root.clone(), root_mean.clone()
        with torch.cuda.device(self.device):
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # a run outside the capture: cuBLAS's workspace for this stream
                subtree.run(self.root, self.root_mean)
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=stream):
                self.residual, self.norm = subtree.run(self.root, self.root_mean)

    def __call__(self, root: Tensor, root_mean: Tensor) -> tuple[Tensor, Tensor]:
        """The reports for this root, in the graph's output tensors (overwritten by the next call:
        the caller gathers them into tensors of its own first, as chunk_reports does)."""
        with torch.cuda.device(self.device):
            self.root.copy_(root)
            self.root_mean.copy_(root_mean)
            self.graph.replay()
        return self.residual, self.norm


class ChunkGraphs:
    """Evaluates chunks as :func:`pathkernels.core.engine.chunk_norms` does, splitting those that
    repeat a subtree below a prefix chain (see the module's docstring), and on CUDA replaying each
    subtree from a CUDA graph. One subtree is kept at a time: a chunk of another shape releases the
    graph (and its memory) before it runs, so the engine's memory budget holds as without graphs.

    ``leaf_kernel`` and ``all_heads_levels``: the engine op's; ``unsplit(chunk, leaf_block)``: the
    engine's evaluation of a whole chunk, for those that are not split; ``capture``: whether to
    capture graphs (CUDA); False runs the split eagerly (the CPU's)."""

    def __init__(
        self, net: Network, operands: tuple, leaf_kernel: str, all_heads_levels: bool, unsplit, *, capture: bool
    ):
        self.net, self.operands, self.capture = net, operands, capture
        self.leaf_kernel, self.all_heads_levels, self.unsplit = leaf_kernel, all_heads_levels, unsplit
        self.subtree: _Subtree | None = None
        self.replays = 0  # chunks served by a graph (for tests and the profile)
        self.failure: str | None = None  # why a capture failed; the split then runs eagerly

    def __call__(self, chunk, leaf_block: int) -> tuple[Tensor, Tensor]:
        """``(residual, norm) [B, leaves]`` float64 of ``chunk`` in its trie order."""
        k = prefix_length(chunk)
        if k == 0:
            self.subtree = None
            return self.unsplit(chunk, leaf_block)
        if self.subtree is None or not self.subtree.serves(chunk, k, leaf_block):
            self.subtree = _Subtree(
                self.net, self.operands, chunk, k, leaf_block, self.leaf_kernel, self.all_heads_levels
            )
        subtree = self.subtree
        subtree.sightings += 1
        if self.capture and subtree.sightings == 1:  # a shape seen once gains nothing from a graph
            return self.unsplit(chunk, leaf_block)
        prefix_heads = [int(level[0]) for level in chunk.heads[:k]]  # host tensors: no synchronisation
        residual, mean = prefix_node(self.net, self.operands, prefix_heads)
        root, root_mean, scale, lost = scaled_root(residual, mean, self.net.attn.dtype)
        if self.capture and self.failure is None and subtree.graph is None:
            try:
                subtree.graph = _CapturedSubtree(subtree, root, root_mean)
            except RuntimeError as error:  # a launch the capture refuses: run eagerly from now on
                self.failure = str(error)
                warnings.warn(
                    f"pathkernels: a CUDA graph of the engine's chunks could not be captured ({error}); "
                    "the chunks run without graphs",
                    RuntimeWarning,
                    stacklevel=5,
                )
        if subtree.graph is not None:
            chunk_residual, chunk_norm = subtree.graph(root, root_mean)
            self.replays += 1
        else:
            chunk_residual, chunk_norm = subtree.run(root, root_mean)
        chunk_residual = torch.where(lost[:, None], torch.nan, chunk_residual * scale[:, None])
        return chunk_residual, chunk_norm * scale[:, None]
