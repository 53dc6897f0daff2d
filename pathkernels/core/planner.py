"""The engine's memory plan: how a tree is cut into chunks that fit ``memory_budget``.

What one chunk holds while the engine evaluates it (bytes; a *node* is one ``n × m`` matrix of
the attention's dtype, ``m = n`` for attention products, ``m = d`` for path outputs):

    trie     = LIVE_LEVELS · internal_nodes · node + INDEX_BYTES_PER_LEAF · leaves
    blocks   = BUFFERS_PER_LEAF · workers · leaf_block · node
    chunk    = trie + blocks  ≤  the chunk budget (the memory budget; on CPU also a cache-sized cap)

On the CPU a complete tree's subtree chunks are held to the cap by what a level's work touches at
once instead: its two largest consecutive levels (the last two internal ones) and the blocks.
The trie formula counts every level three times over, which kept trees of few choices per layer
(H = 4 with skip) in chunks a fifth of what the cache holds, and their per-chunk overhead showed.

``LIVE_LEVELS``: two consecutive levels of the trie plus a gathered copy of parents; ``workers``:
CPU threads (one on CUDA), each reducing a block of ``leaf_block`` leaves with its own leaf,
gathered-parent and W-temporary buffers (``BUFFERS_PER_LEAF``). The smallest budget that runs is
one leaf per worker and two nodes: ``(BUFFERS_PER_LEAF · workers + 2) · node``.
"""

from __future__ import annotations

import numbers
import warnings

import torch

from pathkernels.core._memory import check_fits, format_bytes
from pathkernels.core.checks import Network
from pathkernels.core.paths import PathTree, build_trie_chunk

DEFAULT_MEMORY_BUDGET = 1 << 30  # bytes of working memory for the engine, beyond inputs and results

LIVE_LEVELS = 3  # node-sized matrices per internal node of a chunk
BUFFERS_PER_LEAF = 3  # node-sized buffers per leaf of a worker's block
INDEX_BYTES_PER_LEAF = 32  # parents, heads and leaf positions (int64) per leaf
LEAF_BLOCK_SHARE = 8  # the workers' leaf blocks together take at most 1/8 of the budget
LEAF_BLOCK_BYTES = 1 << 19  # CPU: a leaf block (computed, then reduced) stays in L2
CUDA_LEAF_BLOCK_BYTES = 1 << 27  # CUDA: one launch per block of leaves, so blocks are large
CPU_CHUNK_BYTES = 1 << 25  # CPU: a chunk's working set stays near a last-level cache (32 MiB)
RESULT_COPIES = 2  # results are built in leaf order, then in the tree's result order
FEW_LEAVES = 256  # chunks smaller than this are dominated by per-chunk overhead: warn
ADVISED_BUDGET = 4 << 20


def node_bytes(net: Network) -> int:
    return net.attn.shape[-1] * net.width * net.attn.element_size()


def trie_bytes(internal_nodes: int, leaves: int, net: Network) -> int:
    """The trie part of a chunk's working set (the module docstring's formula)."""
    return LIVE_LEVELS * internal_nodes * node_bytes(net) + INDEX_BYTES_PER_LEAF * leaves


def leaf_blocks(net: Network, memory_budget: int) -> tuple[int, int, int]:
    """``(workers, leaf_block, fixed)``: blocks run one per CPU thread (one on CUDA) of ``leaf_block``
    leaves each, and ``fixed`` is the bytes of every worker's block buffers."""
    node = node_bytes(net)
    on_cpu = net.attn.device.type == "cpu"
    workers = torch.get_num_threads() if on_cpu else 1
    block_bytes = LEAF_BLOCK_BYTES if on_cpu else CUDA_LEAF_BLOCK_BYTES
    leaf_block = max(1, min(block_bytes, memory_budget // (LEAF_BLOCK_SHARE * workers)) // node)
    return workers, leaf_block, BUFFERS_PER_LEAF * workers * leaf_block * node


def minimum_budget(net: Network) -> int:
    """The smallest memory_budget that runs: one-leaf blocks and two nodes (at that budget
    :func:`leaf_blocks` does give one-leaf blocks)."""
    workers = leaf_blocks(net, 1)[0]
    return (BUFFERS_PER_LEAF * workers + 2) * node_bytes(net)


def check_budget(memory_budget, net: Network, where: str) -> int:
    """``memory_budget`` as an int, refused when it is not a positive integer or below the minimum."""
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, numbers.Integral) or memory_budget <= 0:
        raise ValueError(f"{where}: expected memory_budget to be a positive int (bytes), got {memory_budget!r}")
    memory_budget = int(memory_budget)
    minimum = minimum_budget(net)
    if memory_budget < minimum:
        raise ValueError(
            f"{where}: memory_budget={memory_budget:,} bytes is too small: at n = {net.attn.shape[-1]}, width "
            f"{net.width} and {leaf_blocks(net, 1)[0]} worker thread(s) the engine needs at least {minimum:,} bytes "
            f"(one leaf block per worker); {format_bytes(ADVISED_BUDGET)} or more runs at full speed"
        )
    return memory_budget


def chunks(
    tree: PathTree,
    net: Network,
    memory_budget: int,
    first: int,
    last: int,
    *,
    where: str = "pathkernels.path_residuals",
):
    """Consecutive runs of leaves ``first..last-1`` whose tries fit the memory budget (on CPU, the
    smaller of it and a cache-sized working set): (start, stop, TrieChunk, leaf_block). ``where``:
    the public function called, whom the warning about a small budget names.

    A complete tree (without ``max_length``) is cut into whole subtrees of ``C^depth`` leaves,
    whose tries have a closed form (:meth:`PathTree.subtree_chunk`); only the unaligned ends of
    the range, and other trees, are built from their paths."""
    node = node_bytes(net)
    _, leaf_block, fixed = leaf_blocks(net, memory_budget)
    cpu_cap = None  # never below what one chunk needs, so that a budget that works still works
    if net.attn.device.type == "cpu":
        cpu_cap = max(CPU_CHUNK_BYTES, 4 * (fixed + 2 * node))
    chunk_budget = memory_budget if cpu_cap is None else min(memory_budget, cpu_cap)

    def chunk_bytes(chunk) -> int:
        return trie_bytes(chunk.internal_nodes(), chunk.leaf_position.numel(), net) + fixed

    if fixed + 2 * node > memory_budget:  # refused up front by check_budget; kept as the invariant
        raise AssertionError(f"memory_budget={memory_budget} is below {minimum_budget(net)}")
    # A first guess of how many leaves fit, at half a node each (a complete trie with 7 or more
    # choices per layer needs no more); from_paths halves it until the exact count fits.
    size_cap = max(1, (chunk_budget - fixed) // max(1, node // 2 + INDEX_BYTES_PER_LEAF))
    if size_cap < min(FEW_LEAVES, last - first):
        warnings.warn(
            f"{where}: memory_budget={memory_budget:,} bytes allows chunks of at most {size_cap:,} "
            f"leaves at n = {net.attn.shape[-1]}, width {net.width}; such small chunks run up to a few hundred times "
            f"slower than a budget of {format_bytes(ADVISED_BUDGET)} or more",
            RuntimeWarning,
            stacklevel=4,
        )

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
        # Subtree chunks are sized by their exact trie: L − depth prefix nodes, C^j at depth j; on the
        # CPU, the cap holds the two largest consecutive levels (the module docstring).
        def subtree_fits(depth: int) -> bool:
            internal = tree.num_layers - depth + sum(choices**j for j in range(1, depth))
            if trie_bytes(internal, choices**depth, net) + fixed > memory_budget:
                return False
            largest_levels = choices ** (depth - 1) + choices ** max(depth - 2, 0)
            return cpu_cap is None or largest_levels * node + fixed <= cpu_cap

        depth = tree.num_layers
        while depth > 0 and not subtree_fits(depth):
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


def check_results_fit(net: Network, tree: PathTree, where: str) -> None:
    """Refuse up front, before any work, results that would not fit the device's available memory."""
    check_fits(
        RESULT_COPIES * 2 * net.attn.shape[0] * tree.num_paths * net.attn.element_size(),
        net.attn.device,
        where,
        f"the results of {tree.num_paths:,} paths × B = {net.attn.shape[0]} (residual and norm in {net.attn.dtype}) "
        "need",
        "evaluate fewer paths (max_length, sampling, or a share of the tree per process with group=), or use "
        "pk.length_sums for exact sums per length",
    )
