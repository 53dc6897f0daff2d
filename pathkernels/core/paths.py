"""Path trees: which paths to evaluate, and how they share prefixes.

A path picks, at each of L layers, one of H heads or (with skip connections) the skip branch,
written ``-1``. Its length is the number of layers where it takes a head. Path counts are exact
Python ints: ``(H+1)^L`` exceeds 2^63 for real models.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from pathkernels.core._docs import doc_path
from pathkernels.core._memory import available_memory, check_fits, format_bytes, format_count, shown
from pathkernels.core.checks import check_flag, check_int, named_errors

SKIP = -1

# A tree whose path list would exceed this many paths is not enumerated (paths() and evaluation
# refuse with the count); sampling and length_sums handle such networks.
MAX_ENUMERATED_PATHS = 1 << 31  # path lists and per-path results
MAX_LEAVES = 1 << 62  # leaf indices are int64: a complete tree streamed by path_statistics stays below

# The most paths one call evaluates unless its max_paths= says otherwise: the work that
# pk.path_statistics streams (and pk.decompose through it) without complaint. Measured rates
# (docs/BENCHMARKS.md) run from about 10^5 paths/s (2 CPU cores, n = 64) to 5.9·10^6 (an H200), so
# 10^10 paths take half an hour to a day; a 10^15-path tree would take years.
DEFAULT_MAX_PATHS = 10**10
SLOWEST_PATHS_PER_SECOND = 1e5  # the range of rates a refusal quotes, as its message words them
FASTEST_PATHS_PER_SECOND = 6e6


def check_max_paths(num_paths: int, max_paths, where: str, ways_round: str) -> int:
    """``max_paths`` as an int >= 1, and a refusal (ValueError) before any work when the call would
    evaluate ``num_paths`` > ``max_paths`` paths: the message names the count, the bound, the time
    it would take at the measured rates, ``ways_round`` and the larger ``max_paths=`` that runs it.
    The one check of a call's work by its number of paths (pk.decompose, pk.path_statistics)."""
    max_paths = check_int(max_paths, "max_paths", where, minimum=1)
    if num_paths > max_paths:
        fastest, slowest = (
            _duration(min(num_paths, 10**300) / rate)  # an int beyond float64 does not divide
            for rate in (FASTEST_PATHS_PER_SECOND, SLOWEST_PATHS_PER_SECOND)
        )
        raise ValueError(
            f"{where}: the call would evaluate {format_count(num_paths)} paths, more than max_paths="
            f"{format_count(max_paths)}: {fastest} to "
            f"{slowest} at the 6·10^6 to 10^5 paths/s measured on an H200 and on 2 CPU cores "
            f"({doc_path('BENCHMARKS.md')}). "
            f"{ways_round}; or pass max_paths={shown(num_paths)} to run them all"
        )
    return max_paths


def _duration(seconds: float) -> str:
    """``seconds`` for a message: "40 s", "3.2 hours", "317 years", "3.2e+06 years"."""
    for unit, size in (("years", 365.25 * 86400), ("days", 86400), ("hours", 3600), ("minutes", 60), ("s", 1)):
        if seconds >= 2 * size or unit == "s":
            count = seconds / size
            return (
                f"{count:.1f} {unit}"
                if count < 10
                else f"{count:,.0f} {unit}"
                if count < 1e6
                else f"{count:.1e} {unit}"
            )
    raise AssertionError


# The most bits the exact counts of one call may take, all together: 2^22 bits (512 KiB), a
# count of about 10^1,262,611. Beyond it a count is of no use, and computing it is slow: the
# powers H^L take super-linear time in their bits (3^L at 2^22 bits, 0.3 s on 2 CPU cores; at
# 9.5·10^7 bits, ``count_paths(6·10**7, 3)``, 36 s to 5 minutes), and
# ``count_by_length(10**4, 10**4, skip=True)`` took 80 s for 1.3·10^9 bits.
MAX_COUNT_BITS = 1 << 22


def count_paths(num_layers: int, num_heads: int, *, skip: bool = False, max_length: int | None = None) -> int:
    """Exact number of paths with at most ``max_length`` heads: ``H^L`` without skip (every path
    takes L heads, so 0 when ``max_length < L``: the sum of :func:`count_by_length`);
    ``Σ_{k ≤ max_length} C(L, k) H^k`` with skip (``(H+1)^L`` when ``max_length`` keeps every
    path). Refused (ValueError), in well under a second, when the counts would take more than
    ``MAX_COUNT_BITS`` bits (a count of about 10^1,262,611 or more: beyond any use)."""
    where = "pathkernels.count_paths"
    num_layers, num_heads, max_length = _check_shape_args(num_layers, num_heads, max_length, where)
    skip = check_flag(skip, "skip", where)
    if not skip:
        if max_length is not None and max_length < num_layers:
            return 0  # every path takes a head at each of the L layers: none has at most max_length
        _check_count_size(num_layers, num_heads, num_heads, 1, where)
        return num_heads**num_layers
    if max_length is None or max_length >= num_layers:
        _check_count_size(num_layers, num_heads, num_heads + 1, 1, where)
        return (num_heads + 1) ** num_layers
    return sum(_length_terms(num_layers, num_heads, max_length, where))


def count_by_length(num_layers: int, num_heads: int, *, skip: bool = False, max_length: int | None = None) -> list[int]:
    """Exact path counts by length ``k = 0..L``: ``C(L, k) H^k`` with skip, only ``H^L`` at k = L
    without (0 beyond ``max_length``). Refused (ValueError) when they would take more than
    ``MAX_COUNT_BITS`` bits, or the list more than ``MAX_LENGTH_COUNTS`` entries."""
    where = "pathkernels.count_by_length"
    num_layers, num_heads, max_length = _check_shape_args(num_layers, num_heads, max_length, where)
    return _count_by_length(num_layers, num_heads, check_flag(skip, "skip", where), max_length, where)


def _check_count_size(num_layers: int, num_heads: int, base: int, terms: int, where: str) -> None:
    """Refuse ``terms`` counts of up to ``base^L`` each beyond ``MAX_COUNT_BITS`` bits together."""
    bits = terms * num_layers * math.log2(base) if base > 1 else 0.0
    _refuse_count_bits(bits, num_layers, num_heads, where)


def _check_length_counts_size(num_layers: int, num_heads: int, top: int, where: str) -> None:
    """Refuse the counts ``C(L, k) H^k``, ``k = 0..top``, beyond ``MAX_COUNT_BITS`` bits together,
    from their sizes (``log2`` of each term, by ``lgamma``), before computing any of them. Each term
    past the first takes a bit at least, so more than ``MAX_COUNT_BITS`` terms are refused unread."""
    if top + 1 > MAX_COUNT_BITS:
        _refuse_count_bits(float(top + 1), num_layers, num_heads, where)
    k = torch.arange(top + 1, dtype=torch.float64)
    log_binomial = math.lgamma(num_layers + 1) - torch.lgamma(k + 1) - torch.lgamma(num_layers - k + 1)
    bits = float((log_binomial / math.log(2) + k * math.log2(num_heads)).clamp_min(0).add(1).sum())
    _refuse_count_bits(bits, num_layers, num_heads, where)


def _refuse_count_bits(bits: float, num_layers: int, num_heads: int, where: str) -> None:
    if bits > MAX_COUNT_BITS:
        raise ValueError(
            f"{where}: the counts of num_layers={num_layers:,} layers of num_heads={num_heads:,} heads "
            f"would take about {bits:.3g} bits, more than the {MAX_COUNT_BITS:,} (a count of about "
            f"10^{MAX_COUNT_BITS * math.log10(2):,.0f}) counted exactly: beyond any use; pass fewer layers or "
            "heads, or a smaller max_length"
        )


# The longest list of counts by length (one per length 0..L) that count_by_length returns: 2^24
# entries (128 MiB of the list alone). Networks have at most thousands of layers; a list of 2^31
# (num_layers up to MAX_SIZE) took a minute and 17 GB.
MAX_LENGTH_COUNTS = 1 << 24


def _count_by_length(
    num_layers: int, num_heads: int, skip: bool, max_length: int | None, where: str = "pathkernels.count_by_length"
) -> list[int]:
    """:func:`count_by_length` of checked arguments: :func:`_length_terms` (with skip), padded with
    zeros to ``L + 1`` lengths."""
    if num_layers + 1 > MAX_LENGTH_COUNTS:
        raise ValueError(
            f"{where}: the counts by length of num_layers={num_layers:,} layers are a list of {num_layers + 1:,} "
            f"entries, more than the {MAX_LENGTH_COUNTS:,} returned; pass fewer layers (pk.count_paths counts "
            "the paths of any number of layers with a small max_length)"
        )
    top = num_layers if max_length is None else min(max_length, num_layers)
    if not skip:
        counts = [0] * (num_layers + 1)
        if top == num_layers:
            _check_count_size(num_layers, num_heads, num_heads, 1, where)
            counts[num_layers] = num_heads**num_layers
        return counts
    terms = _length_terms(num_layers, num_heads, max_length, where)
    return terms + [0] * (num_layers + 1 - len(terms))


def _length_terms(num_layers: int, num_heads: int, max_length: int | None, where: str) -> list[int]:
    """The paths of a skip tree by length ``k = 0..min(max_length, L)``, term by term:
    ``C(L, k) H^k = C(L, k−1) H^(k−1) · (L − k + 1) H / k``, exact in integers (``C(L, k−1)(L−k+1)``
    is ``k C(L, k)``), so that each term costs one product and one division by small numbers.
    Refused before any term is computed when they would take more than ``MAX_COUNT_BITS`` bits."""
    top = num_layers if max_length is None else min(max_length, num_layers)
    if top == num_layers:  # every term: (H+1)^L bounds their sum
        _check_count_size(num_layers, num_heads, num_heads + 1, 1, where)
    _check_length_counts_size(num_layers, num_heads, top, where)
    terms, term = [], 1
    for k in range(top + 1):
        if k:
            term = term * (num_layers - k + 1) * num_heads // k
        terms.append(term)
    return terms


def count_attribution_paths(layers: int, heads: int, max_length: int) -> int:
    """Paths of a captured pre- or post-norm model (a source, then the skip or a head of every
    attention layer above it: :func:`pathkernels.path_attribution`'s) with ``layers`` attention
    layers of ``heads`` heads, up to ``max_length`` heads (:func:`count_attribution_paths_by_length`,
    summed)."""
    return sum(count_attribution_paths_by_length(layers, heads, max_length))


def count_attribution_paths_by_length(layers: int, heads: int, max_length: int) -> list[int]:
    """Those paths by length ``0..L``: the embedding reaches every attention layer, layer l's two
    sources (its attention's constant rows and its MLP's output) the A = L − 1 − l layers above,
    each with ``C(A, k) H^k`` paths of length k."""
    counts = [0] * (layers + 1)
    for above, sources in [(layers, 1)] + [(layers - 1 - layer, 2) for layer in range(layers)]:
        for k in range(min(above, max_length) + 1):
            counts[k] += sources * math.comb(above, k) * heads**k
    return counts


def check_tree_shape(tree, layers: int, heads: int, where: str) -> None:
    """Raise unless ``tree`` is a PathTree of ``layers`` layers and at most ``heads`` heads (all of them
    where it is complete)."""
    if not isinstance(tree, PathTree):
        raise TypeError(f"{where}: expected tree to be a pathkernels.PathTree, got {type(tree).__name__}")
    if tree.num_layers != layers or tree.num_heads > heads or (tree.is_complete and tree.num_heads != heads):
        raise ValueError(
            f"{where}: the tree has {tree.num_layers} layers and {tree.num_heads} heads, attn has "
            f"L = {layers} and H = {heads}"
        )


def check_paths(
    paths, where: str, *, num_heads: int | None = None, num_layers: int | None = None
) -> tuple[Tensor, int]:
    """``paths`` as a CPU int64 tensor ``[M, L]`` of heads in ``[-1, num_heads)`` (-1 = skip), and
    num_heads (default: the largest head + 1). With ``num_layers``, L must equal it."""
    if num_heads is not None:
        num_heads = check_int(num_heads, "num_heads", where, minimum=1)
        if num_heads > MAX_SIZE:
            raise ValueError(f"{where}: expected num_heads <= {MAX_SIZE} (int range), got {format_count(num_heads)}")
    if isinstance(paths, (list, tuple)) and len(paths) == 0:
        raise ValueError(f"{where}: expected at least one path, got an empty {type(paths).__name__}")
    try:
        paths = torch.as_tensor(paths)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(
            f"{where}: expected paths as an integer tensor [M, L] or a list of M lists of L ints "
            f"(equal lengths; -1 = skip), got {type(paths).__name__} {str(paths)[:80]}"
        ) from None
    if paths.dtype.is_floating_point or paths.dtype.is_complex or paths.dtype == torch.bool:
        raise TypeError(f"{where}: expected paths as an integer tensor of heads, got {paths.dtype}")
    if paths.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{where}: expected paths on a CPU or CUDA device, got {paths.device}")
    if paths.dim() != 2 or paths.shape[0] == 0 or paths.shape[1] == 0:
        raise ValueError(f"{where}: expected paths of shape [M, L] with M, L >= 1, got {list(paths.shape)}")
    if num_layers is not None and paths.shape[1] != num_layers:
        raise ValueError(f"{where}: expected paths [M, L] with L = {num_layers} layers, got {list(paths.shape)}")
    paths = paths.to(device="cpu", dtype=torch.long).contiguous()
    low, high = int(paths.min()), int(paths.max())
    if num_heads is None:
        if high >= MAX_SIZE:  # a head index that no network's head tensors reach
            raise ValueError(f"{where}: expected heads in [-1, {MAX_SIZE}) (int range), got values in [{low}, {high}]")
        num_heads = max(high + 1, 1)
    if low < SKIP or high >= num_heads:
        raise ValueError(f"{where}: expected heads in [-1, {num_heads}), got values in [{low}, {high}]")
    return paths, num_heads


# Layers and heads index int64 tensors (paths, heads): sizes beyond this cannot be a network's.
MAX_SIZE = (1 << 31) - 1


def _check_shape_args(num_layers, num_heads, max_length, where: str) -> tuple[int, int, int | None]:
    num_layers = check_int(num_layers, "num_layers", where, minimum=1, maximum=MAX_SIZE)
    num_heads = check_int(num_heads, "num_heads", where, minimum=1, maximum=MAX_SIZE)
    if max_length is not None:
        max_length = check_int(max_length, "max_length", where, minimum=0)
    return num_layers, num_heads, max_length


def _too_many_paths(count: int, where: str, limit: int | None = None) -> ValueError:
    if limit is not None:
        return ValueError(
            f"{where}: the tree has {format_count(count)} paths, more than int64 leaf indices reach ({limit:,}). Use "
            "max_length, sample paths, or pk.length_sums for exact sums per path length."
        )
    return ValueError(
        f"{where}: the tree has {format_count(count)} paths, more than can be enumerated ({MAX_ENUMERATED_PATHS:,}). "
        "Use pk.path_statistics for exact per-length statistics of all of them, max_length to keep only "
        "short paths, sampling (pk.sample_paths / pk.decompose with num_samples), or pk.length_sums for "
        "exact sums per path length."
    )


@dataclass(frozen=True)
class TrieChunk:
    """Breadth-first levels of the trie over a sorted run of unique leaf paths, in engine order.

    Level l's nodes are sorted by head (skip first); ``parents[l]`` gives each node's position in
    level l-1 and ``heads[l]`` its head. ``leaf_position[i]`` is where the chunk's i-th leaf (in
    sorted order) lands among the last level's nodes.
    """

    parents: list[Tensor]
    heads: list[Tensor]
    leaf_position: Tensor

    def internal_nodes(self) -> int:
        return sum(p.numel() for p in self.parents[:-1])


def build_trie_chunk(sorted_paths: Tensor) -> TrieChunk:
    """Trie levels of ``sorted_paths`` ``[c, L]``: unique rows in lexicographic order."""
    count, num_layers = sorted_paths.shape
    # new_prefix[i]: path i starts a new prefix at the current depth (it differs from path i-1 in
    # some layer so far). Paths are sorted, so each prefix's paths are consecutive.
    new_prefix = torch.zeros(count, dtype=torch.bool)
    new_prefix[0] = True
    node_of_path = torch.zeros(count, dtype=torch.long)  # lexicographic node id at the previous depth
    position_of_node = torch.zeros(1, dtype=torch.long)  # that node's position in engine order
    parents, heads = [], []
    for layer in range(num_layers):
        column = sorted_paths[:, layer]
        new_prefix[1:] |= column[1:] != column[:-1]
        node = torch.cumsum(new_prefix.long(), 0) - 1
        first = torch.nonzero(new_prefix).squeeze(1)
        head = column[first]
        parent = position_of_node[node_of_path[first]]
        # Engine order: grouped by head (skip first), then by parent position, so that in a
        # complete tree each head's parents are the whole previous level, in order: one GEMM, no gather.
        order = torch.sort((head - SKIP) * position_of_node.numel() + parent).indices
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel())
        parents.append(parent[order])
        heads.append(head[order])
        node_of_path, position_of_node = node, rank
    return TrieChunk(parents, heads, position_of_node[node_of_path])


@functools.lru_cache(maxsize=16)
def _heads_taken(choices: int, depth: int) -> Tensor:
    """``[choices^depth]``: how many of its ``depth`` base-``choices`` digits are not 0 (skip), per
    index."""
    index = torch.arange(choices**depth, dtype=torch.long)
    taken = torch.zeros_like(index)
    for _ in range(depth):
        taken += (index % choices != 0).long()
        index = index // choices
    return taken


class PathTree:
    """A set of paths through ``num_layers`` layers of ``num_heads`` heads, evaluated on a trie.

    Build one with :meth:`complete` or :meth:`from_paths`. Results of :func:`pk.path_residuals`
    come back in the order of :meth:`paths`: lexicographic (skip ``-1`` before head 0, layer 1
    most significant) for complete trees, the user's own order for :meth:`from_paths`.
    """

    def __init__(self, num_layers: int, num_heads: int, *, skip: bool, max_length: int | None, paths: Tensor | None):
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.skip = skip
        self.max_length = max_length
        self._paths = paths  # [M, L] in result order, or None for a complete tree
        self._short: _ShortPaths | None = None  # a complete tree with max_length < L: its heads alone
        self._unique: tuple[Tensor, Tensor] | None = None
        self._multiplicities: Tensor | None = None  # of the leaves, for explicit trees with repeats
        self._subtrees: dict[int, tuple[list[Tensor], list[Tensor], Tensor]] = {}

    # --- construction ----------------------------------------------------------------------------

    @classmethod
    def complete(cls, num_layers: int, num_heads: int, skip: bool = False, max_length: int | None = None) -> PathTree:
        """All ``H^L`` paths, or ``(H+1)^L`` with the skip branch; ``max_length`` keeps only paths
        with at most that many heads (the tree is pruned, not filtered afterwards).

        ``skip`` is off by default here, as in :func:`count_paths` and :func:`sample_paths`: a tree
        is a set of attention products, and the bare one is the pure-attention network's ``H^L``
        products (the paper's object). :func:`pathkernels.decompose` describes a whole network
        instead, and defaults to ``skip=True`` because the networks users hold have skip
        connections; pass ``skip`` explicitly wherever it matters."""
        where = "pathkernels.PathTree.complete"
        num_layers, num_heads, max_length = _check_shape_args(num_layers, num_heads, max_length, where)
        skip = check_flag(skip, "skip", where)
        if max_length is not None and not skip and max_length < num_layers:
            raise ValueError(
                f"pathkernels.PathTree.complete: without skip every path has length {num_layers}, so "
                f"max_length={max_length} keeps no path; pass skip=True"
            )
        tree = cls(num_layers, num_heads, skip=skip, max_length=max_length, paths=None)
        short = max_length is not None and max_length < num_layers
        with named_errors(where, "pathkernels.count_paths"):  # counted on this call's behalf
            num_paths = tree.num_paths
        if num_paths > MAX_LEAVES or (short and num_paths > MAX_ENUMERATED_PATHS):
            raise _too_many_paths(num_paths, where, MAX_LEAVES if num_paths > MAX_LEAVES else None)
        if short:
            check_fits(
                _short_paths_bytes(num_layers, max_length, num_paths),
                torch.device("cpu"),
                where,
                f"the {format_count(num_paths)} paths of at most max_length={max_length} heads over num_layers="
                f"{num_layers:,} layers, held by their heads, need about",
                "pass fewer layers or a smaller max_length, or use pk.length_sums for exact sums per path length",
            )
            tree._short = _ShortPaths(num_layers, num_heads, max_length)
        return tree

    @classmethod
    def from_paths(cls, paths, num_heads: int | None = None) -> PathTree:
        """Any ``[M, L]`` set of paths (head per layer, ``-1`` = skip), in any order, with
        duplicates; results come back in this order. ``num_heads`` defaults to the largest head + 1."""
        where = "pathkernels.PathTree.from_paths"
        paths, num_heads = check_paths(paths, where, num_heads=num_heads)
        low = int(paths.min())
        return cls(paths.shape[1], num_heads, skip=bool(low == SKIP), max_length=None, paths=paths)

    # --- what the tree holds ---------------------------------------------------------------------

    @property
    def is_complete(self) -> bool:
        return self._paths is None or self.max_length is not None

    @property
    def num_paths(self) -> int:
        """Exact number of paths (a Python int; it may exceed 2^63)."""
        if self._paths is not None:
            return self._paths.shape[0]
        return count_paths(self.num_layers, self.num_heads, skip=self.skip, max_length=self.max_length)

    def __len__(self) -> int:
        return self.num_paths

    def __repr__(self) -> str:
        kind = "complete" if self.is_complete else "explicit"
        return (
            f"PathTree({kind}, num_layers={self.num_layers}, num_heads={self.num_heads}, skip={self.skip}, "
            f"max_length={self.max_length}, paths={format_count(self.num_paths)})"
        )

    def count_by_length(self) -> list[int]:
        """Exact path counts by length ``0..L`` (Python ints)."""
        if self.is_complete:
            return count_by_length(self.num_layers, self.num_heads, skip=self.skip, max_length=self.max_length)
        return torch.bincount(self.lengths(), minlength=self.num_layers + 1).tolist()

    def nodes_per_level(self) -> list[int]:
        """Distinct prefixes at each depth ``0..L`` (level 0 is the root); the last are the leaves."""
        if self._short is not None:
            return list(self._short.nodes_per_level)
        if self._paths is None:
            choices = self.num_heads + int(self.skip)
            return [choices**level for level in range(self.num_layers + 1)]
        unique = self._unique_paths()[0]
        return [1] + [int(torch.unique(unique[:, :level], dim=0).shape[0]) for level in range(1, self.num_layers + 1)]

    def paths(self) -> Tensor:
        """``[M, L]`` int64 paths in result order; refused beyond ``MAX_ENUMERATED_PATHS`` (a
        complete tree that large is for :func:`pathkernels.path_statistics`, which reads its
        paths a chunk at a time)."""
        if self._paths is not None:
            return self._paths
        where = "pathkernels.PathTree.paths"
        if self.num_paths > MAX_ENUMERATED_PATHS:
            raise _too_many_paths(self.num_paths, where)
        table = self.num_paths * self.num_layers * 8
        available = available_memory(torch.device("cpu"))
        if available is not None and table > available // 2:
            raise ValueError(
                f"{where}: the {self.num_paths:,} paths over {self.num_layers} layers take {format_bytes(table)} as "
                f"a table [M, L], more than half the {format_bytes(available)} available; read them a range at a "
                "time with path_range(start, stop)"
            )
        return self._path_range(0, self.num_paths)

    def lengths(self) -> Tensor:
        """``[M]`` int64: heads taken by each path."""
        if self._short is not None:
            return self._short.lengths(0, self.num_paths)
        return (self.paths() != SKIP).sum(1)

    # --- what the engine needs -------------------------------------------------------------------

    def path_range(self, start: int, stop: int) -> Tensor:
        """Paths ``start..stop-1`` in result order, as ``[stop - start, L]``: ints with
        ``0 <= start <= stop <= num_paths`` (anything else is refused, not clamped or wrapped
        round), the table no larger than half the memory available."""
        start, stop = self._check_range(start, stop, self.num_paths, "pathkernels.PathTree.path_range", "paths")
        return self._path_range(start, stop)

    def _check_range(self, start, stop, count: int, where: str, what: str) -> tuple[int, int]:
        """``start``, ``stop`` as ints with ``0 <= start <= stop <= count``, and the ``[stop - start, L]``
        int64 table they ask for within half the memory available (checked for large tables only)."""
        start = check_int(start, "start", where, minimum=0)
        stop = check_int(stop, "stop", where, minimum=0)
        if not start <= stop <= count:
            raise ValueError(
                f"{where}: expected 0 <= start <= stop <= {format_count(count)} (the tree's {what}), got start="
                f"{format_count(start)} and stop={format_count(stop)}"
            )
        table = (stop - start) * self.num_layers * 8
        if table > 1 << 28:  # reading the memory available costs a file read: only where it may matter
            available = available_memory(torch.device("cpu"))
            if available is not None and table > available // 2:
                raise ValueError(
                    f"{where}: {what} {format_count(start)} to {format_count(stop)} over {self.num_layers} layers take "
                    f"{format_bytes(table)} as a table [stop - start, L], more than half the "
                    f"{format_bytes(available)} available; read a smaller range at a time"
                )
        return start, stop

    def _path_range(self, start: int, stop: int) -> Tensor:
        """:meth:`path_range` of checked bounds."""
        if self._paths is not None:
            return self._paths[start:stop]
        if self._short is not None:
            return self._short.table(start, stop)
        return self._complete_paths(torch.arange(start, stop, dtype=torch.long))

    def _complete_paths(self, index: Tensor) -> Tensor:
        """Paths ``index [k]`` of a complete tree: the base-C digits of each index (C choices per
        layer, the most significant first), shifted so that skip is -1."""
        choices = self.num_heads + int(self.skip)
        index = index.clone()
        digits = torch.empty(index.shape[0], self.num_layers, dtype=torch.long)
        for layer in range(self.num_layers - 1, -1, -1):
            torch.remainder(index, choices, out=digits[:, layer])
            index = index.div_(choices, rounding_mode="floor")
        return digits.sub_(int(self.skip))

    def leaf_paths(self, leaves: Tensor) -> Tensor:
        """Paths ``[k, L]`` of the leaves ``leaves [k]`` (int64 positions in leaf order)."""
        if not isinstance(leaves, Tensor) or leaves.dtype not in (torch.int32, torch.int64) or leaves.dim() != 1:
            got = f"{list(leaves.shape)} {leaves.dtype}" if isinstance(leaves, Tensor) else type(leaves).__name__
            raise TypeError(f"pathkernels.PathTree.leaf_paths: expected leaves as a 1-D integer tensor [k], got {got}")
        if leaves.numel() and not (0 <= int(leaves.min()) and int(leaves.max()) < self.num_leaves):
            raise ValueError(
                f"pathkernels.PathTree.leaf_paths: expected leaves in [0, {self.num_leaves}), got values from "
                f"{int(leaves.min())} to {int(leaves.max())}"
            )
        if self._short is not None:
            return self._short.gather(leaves.cpu().long())
        if self._paths is None:
            return self._complete_paths(leaves.cpu())
        return self._unique_paths()[0][leaves.cpu()]

    def leaf_lengths(self, start: int, stop: int) -> Tensor:
        """``[stop - start]`` int64: heads taken by leaves ``start..stop-1``. For the aligned
        blocks of ``C^depth`` leaves that complete trees are streamed in, the low digits' pattern
        is computed once and the block's prefix adds its own count. ``0 <= start <= stop <=
        num_leaves``, as in :meth:`leaf_range`."""
        start, stop = self._check_range(start, stop, self.num_leaves, "pathkernels.PathTree.leaf_lengths", "leaves")
        if self._paths is not None:
            return (self._unique_paths()[0][start:stop] != SKIP).sum(1)
        if self._short is not None:
            return self._short.lengths(start, stop)
        if not self.skip:
            return torch.full((stop - start,), self.num_layers, dtype=torch.long)
        choices = self.num_heads + 1
        depth = 0
        while choices**depth < stop - start:
            depth += 1
        block = choices**depth
        if block != stop - start or start % block != 0:
            return (self._path_range(start, stop) != SKIP).sum(1)
        prefix, prefix_heads = start // block, 0
        for _ in range(self.num_layers - depth):
            prefix, digit = divmod(prefix, choices)
            prefix_heads += int(digit != 0)
        return _heads_taken(choices, depth) + prefix_heads

    def _unique_paths(self) -> tuple[Tensor, Tensor]:
        """Sorted unique paths and, for each path in result order, its row among them."""
        if self._unique is None:
            if self._paths is None:
                raise AssertionError("complete trees are sorted and unique by construction")
            self._unique = torch.unique(self._paths, dim=0, sorted=True, return_inverse=True)
        return self._unique

    @property
    def num_leaves(self) -> int:
        """Distinct paths (the trie's leaves)."""
        return self.num_paths if self._paths is None else self._unique_paths()[0].shape[0]

    def leaf_range(self, start: int, stop: int) -> Tensor:
        """Leaves ``start..stop-1`` (unique paths in lexicographic order), ``0 <= start <= stop <=
        num_leaves`` (as in :meth:`path_range`)."""
        start, stop = self._check_range(start, stop, self.num_leaves, "pathkernels.PathTree.leaf_range", "leaves")
        if self._paths is None:
            return self._path_range(start, stop)
        return self._unique_paths()[0][start:stop]

    def subtree_chunk(self, start: int, depth: int) -> TrieChunk:
        """The trie chunk of leaves ``start..start + C^depth - 1`` of a complete tree without
        ``max_length`` (C = H, plus 1 with skip), ``start`` a multiple of ``C^depth``: one prefix of
        ``L - depth`` layers and every choice below it. The levels :func:`build_trie_chunk` would
        give, in closed form: level ``L - depth + j`` has ``C^j`` nodes, node k taking choice
        ``k // C^(j-1)`` with parent ``k % C^(j-1)``, and the leaf with free digits
        ``d_1 … d_depth`` (most significant first) lands at ``Σ_j d_j C^(j-1)``.
        """
        if self._paths is not None or self._short is not None:
            raise ValueError("pathkernels.PathTree.subtree_chunk: only for complete trees without max_length")
        choices = self.num_heads + int(self.skip)
        block = choices**depth
        if not 0 <= depth <= self.num_layers or start % block or start + block > self.num_leaves:
            raise ValueError(f"pathkernels.PathTree.subtree_chunk: no subtree of depth {depth} starts at leaf {start}")
        if depth not in self._subtrees:  # the levels below the prefix are the same for every start
            choice = torch.arange(choices, dtype=torch.long) - int(self.skip)
            parents, heads, width = [], [], 1
            for _ in range(depth):
                parents.append(torch.arange(width, dtype=torch.long).repeat(choices))
                heads.append(choice.repeat_interleave(width))
                width *= choices
            index = torch.arange(block, dtype=torch.long)
            position = torch.zeros(block, dtype=torch.long)
            for j in range(depth, 0, -1):  # least significant free digit (the last layer) first
                position += index.remainder(choices) * choices ** (j - 1)
                index = index.div(choices, rounding_mode="floor")
            self._subtrees = {depth: (parents, heads, position)}  # one depth at a time is in use
        parents, heads, position = self._subtrees[depth]
        prefix = self._path_range(start, start + 1)[0, : self.num_layers - depth]
        root = torch.zeros(1, dtype=torch.long)
        return TrieChunk([root] * prefix.numel() + parents, list(prefix.reshape(-1, 1)) + heads, position)

    def leaf_multiplicities(self, start: int, stop: int) -> Tensor | None:
        """``[stop - start]`` int64: how many times each of leaves ``start..stop-1`` is listed among
        the tree's paths; None when every path is listed once (complete trees, and explicit ones
        without repeats)."""
        start, stop = self._check_range(
            start, stop, self.num_leaves, "pathkernels.PathTree.leaf_multiplicities", "leaves"
        )
        if self._paths is None or self.num_leaves == self.num_paths:
            return None
        if self._multiplicities is None:
            self._multiplicities = torch.bincount(self._unique_paths()[1], minlength=self.num_leaves)
        return self._multiplicities[start:stop]

    def leaf_of_path(self) -> Tensor | None:
        """For each path in result order, its leaf; None when paths and leaves coincide."""
        if self._paths is None:
            return None
        return self._unique_paths()[1]


class _ShortPaths:
    """Every path with at most ``k`` heads through ``L`` layers, in lexicographic order (skip
    first), held by its heads alone: entry e says that path ``row[e]`` takes head ``head[e]`` at
    layer ``layer[e]``, the entries sorted by path and, within one, by layer (CSR: path i owns
    entries ``start[i]..start[i+1]-1``). That is ``M · k`` entries at most, where the ``[M, L]``
    table of the same paths is mostly skips: at L = 20,000 and k = 1, 20,001 entries against a
    3.2 GB table.

    Built by the heads' depth, not layer by layer. In lexicographic order, the paths below a prefix
    that ends at layer p with budget b (heads it may still take) start with those that skip every
    layer from p on, and those whose next head is h at layer q ≥ p occupy rows
    ``s + N(L-q-1, b) + h·N(L-q-1, b-1)`` onwards, ``N(L-q-1, b-1)`` of them, with
    ``N(r, b) = Σ_{j≤b} C(r, j) H^j`` the paths over r layers with at most b heads and s the
    prefix's first row: the skip child comes first at every layer. So one vectorised step per
    head taken writes every entry of that depth, and the work is the entries' count.
    """

    def __init__(self, num_layers: int, num_heads: int, max_length: int):
        self.num_layers = num_layers
        completions = _short_path_counts(num_layers, num_heads, max_length)  # [L + 1, k + 1]: N(r, b)
        self.num_paths = int(completions[num_layers, max_length])
        # Every prefix of at most k heads continues (it may skip to the end), so depth l has N(l, k).
        self.nodes_per_level = [int(v) for v in completions[:, max_length]]
        heads = np.arange(num_heads if max_length >= 1 else 0, dtype=np.int64)  # none to take at k = 0
        rows, layers, taken = [], [], []
        # Open prefixes (those that may still take a head): first row, next layer, budget.
        starts = np.zeros(1 if max_length >= 1 else 0, dtype=np.int64)
        nexts = np.zeros_like(starts)
        budgets = np.full_like(starts, max_length)
        while starts.size:
            span = num_layers - nexts  # layers where each prefix's next head may sit
            owner = np.repeat(np.arange(starts.size), span)
            layer = nexts[owner] + _ranges(span)
            budget = budgets[owner]
            remaining = num_layers - layer - 1
            block = completions[remaining, budget - 1]  # rows under each (layer, head) child
            first = (starts[owner] + completions[remaining, budget])[:, None] + heads * block[:, None]  # [c, H]
            first, block = first.ravel(), np.repeat(block, num_heads)
            layer, budget = np.repeat(layer, num_heads), np.repeat(budget, num_heads)
            head = np.tile(heads, owner.size)
            rows.append(np.repeat(first, block) + _ranges(block))
            layers.append(np.repeat(layer, block))
            taken.append(np.repeat(head, block))
            open_ = (budget > 1) & (layer + 1 < num_layers)
            starts, nexts, budgets = first[open_], layer[open_] + 1, budget[open_] - 1
        # CSR without a sort: the entries of depth d are each path's (d+1)-th head, at start[row] + d.
        counts = np.bincount(np.concatenate(rows or [np.zeros(0, np.int64)]), minlength=self.num_paths)
        start = np.concatenate([[0], np.cumsum(counts)])
        layer_of, head_of = np.empty(int(start[-1]), np.int64), np.empty(int(start[-1]), np.int64)
        for depth, (row, layer, head) in enumerate(zip(rows, layers, taken)):
            position = start[row] + depth
            layer_of[position], head_of[position] = layer, head
        self.layer, self.head = torch.from_numpy(layer_of), torch.from_numpy(head_of)
        self.row = torch.from_numpy(np.repeat(np.arange(self.num_paths, dtype=np.int64), counts))
        self.start = torch.from_numpy(start)

    def lengths(self, start: int, stop: int) -> Tensor:
        """``[stop - start]`` int64: heads taken by paths ``start..stop-1``."""
        return self.start[start + 1 : stop + 1] - self.start[start:stop]

    def table(self, start: int, stop: int) -> Tensor:
        """Paths ``start..stop-1`` as the ``[stop - start, L]`` table (``-1`` = skip)."""
        table = torch.full((stop - start, self.num_layers), SKIP, dtype=torch.long)
        first, last = int(self.start[start]), int(self.start[stop])
        table[self.row[first:last] - start, self.layer[first:last]] = self.head[first:last]
        return table

    def gather(self, index: Tensor) -> Tensor:
        """Paths ``index [k]`` (any order) as a ``[k, L]`` table."""
        counts = self.start[index + 1] - self.start[index]
        owner = torch.repeat_interleave(torch.arange(index.numel()), counts)
        entry = self.start[index].repeat_interleave(counts) + torch.from_numpy(_ranges(counts.numpy()))
        table = torch.full((index.numel(), self.num_layers), SKIP, dtype=torch.long)
        table[owner, self.layer[entry]] = self.head[entry]
        return table


def _short_paths_bytes(num_layers: int, max_length: int, num_paths: int) -> int:
    """About the peak bytes of :class:`_ShortPaths`: per layer, the completions ``[L + 1, k + 1]``
    (twice, while stacked) and a count of nodes in a list; per entry (a head of a path, at most k a
    path) its row, layer and head with their temporaries; per path its start and count."""
    return (num_layers + 1) * (16 * (max_length + 1) + 48) + 64 * num_paths * max(max_length, 1) + 32 * num_paths


def _ranges(lengths: np.ndarray) -> np.ndarray:
    """``0..n-1`` for each n of ``lengths``, concatenated."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)


def _short_path_counts(num_layers: int, num_heads: int, max_length: int) -> np.ndarray:
    """``N [L + 1, k + 1]`` int64: ``N[r, b] = Σ_{j≤b} C(r, j) H^j``, the paths over r layers with at
    most b heads. Column by column in j: ``C(r, j) H^j = C(r, j-1) H^(j-1) · (r-j+1) H / j``, exact
    in integers; every value is at most the tree's own path count (r ≤ L, b ≤ k), which the caller
    keeps below 2^31, so int64 holds the products."""
    r = np.arange(num_layers + 1, dtype=np.int64)
    term = np.ones(num_layers + 1, dtype=np.int64)  # C(r, j) H^j at j = 0
    columns = [term]
    for j in range(1, max_length + 1):
        term = term * np.maximum(r - j + 1, 0) * num_heads // j
        columns.append(columns[-1] + term)
    return np.stack(columns, axis=1)


def _enumerate_short_paths(num_layers: int, num_heads: int, max_length: int) -> Tensor:
    """All paths with at most ``max_length`` heads, ``[M, L]`` in lexicographic order (skip first)."""
    short = _ShortPaths(num_layers, num_heads, max_length)
    return short.table(0, short.num_paths)


def _enumerate_paths_of_length(num_layers: int, num_heads: int, length: int) -> Tensor:
    """All ``C(L, k) H^k`` paths with exactly ``k = length`` heads, ``[M, L]`` in lexicographic
    order (skip first): the order of :func:`_enumerate_short_paths`, whose rows of length k these
    are, built from the k-subsets of layers so that shorter paths are never listed."""
    layer_sets = torch.tensor(list(itertools.combinations(range(num_layers), length)), dtype=torch.long)
    layer_sets = layer_sets.reshape(math.comb(num_layers, length), length)  # one empty row for k = 0
    heads = torch.cartesian_prod(*[torch.arange(num_heads)] * length) if length else torch.empty(1, 0)
    heads = heads.long().reshape(num_heads**length, length)
    every = torch.full((layer_sets.shape[0] * heads.shape[0], num_layers), SKIP, dtype=torch.long)
    every.scatter_(1, layer_sets.repeat_interleave(heads.shape[0], 0), heads.repeat(layer_sets.shape[0], 1))
    return torch.unique(every, dim=0, sorted=True)


def sample_paths(
    num_layers: int,
    num_heads: int,
    num_samples: int,
    *,
    skip: bool = False,
    length: int | None = None,
    generator: torch.Generator | None = None,
    replace: bool = True,
) -> Tensor:
    """Random paths ``[num_samples, L]`` (int64, ``-1`` = skip), reproducible from ``generator``.

    - ``length=None``: uniform over all paths (``H^L``, or ``(H+1)^L`` with ``skip``): each layer
      independently picks uniformly among its ``H`` (or ``H+1``) choices.
    - ``length=k``: uniform over the ``C(L, k) H^k`` paths of exactly k heads, as the paper's code
      samples them: k distinct layers chosen uniformly, a uniform head on each, skip elsewhere.

    With ``replace=False`` the paths are distinct: a uniformly random subset of the set, in random
    order (repeats of the draws above are dropped, or, when the samples are most of a small set,
    the set is enumerated and permuted). Asking for more distinct paths than the set has is refused.
    """
    where = "pathkernels.sample_paths"
    num_layers, num_heads, _ = _check_shape_args(num_layers, num_heads, None, where)
    num_samples = check_int(num_samples, "num_samples", where, minimum=0)
    skip = check_flag(skip, "skip", where)
    replace = check_flag(replace, "replace", where)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"{where}: expected generator to be a torch.Generator (e.g. torch.Generator()."
            f"manual_seed(0)) or None, got {type(generator).__name__} {generator!r}"
        )
    if length is not None:
        length = check_int(length, "length", where, minimum=0, maximum=num_layers)
        if length < num_layers and not skip:
            raise ValueError(f"{where}: paths of length {length} < num_layers={num_layers} need skip=True")
    # The draws [num_samples, L] in int64 and their temporaries (random keys and their order with a
    # length; repeats to drop without replacement): refused up front, not by the allocator.
    check_fits(
        SAMPLE_COPIES * 8 * num_samples * num_layers,
        torch.device("cpu"),
        where,
        f"num_samples={format_count(num_samples)} paths of {num_layers} layers (int64, with the draws' "
        "temporaries) need about",
        "draw fewer paths (num_samples), or draw them in batches",
    )
    if replace:
        return _draw_paths(num_layers, num_heads, num_samples, skip, length, generator)
    with named_errors(where, "pathkernels.count_paths", "pathkernels.count_by_length"):
        if length is None:
            available = count_paths(num_layers, num_heads, skip=skip)
        else:
            available = count_paths(num_layers, num_heads, skip=True, max_length=length) - (
                count_paths(num_layers, num_heads, skip=True, max_length=length - 1) if length else 0
            )
    if num_samples > available:
        which = "paths" if length is None else f"paths of length {length}"
        raise ValueError(
            f"{where}: expected num_samples <= {format_count(available)} with replace=False (there are "
            f"{format_count(available)} {which}), got {format_count(num_samples)}"
        )
    if 2 * num_samples >= available:  # most of a small set: enumerate it, take a random subset
        if length is None:
            with named_errors(where, "pathkernels.PathTree.complete", "pathkernels.PathTree.paths"):
                every = PathTree.complete(num_layers, num_heads, skip=skip).paths()
        else:
            every = _enumerate_paths_of_length(num_layers, num_heads, length)
        return every[torch.randperm(every.shape[0], generator=generator)[:num_samples]]
    # Fewer than half of the set: draw with replacement and drop repeats (in draw order) until there
    # are enough. Each round keeps over half of its draws in expectation, so few rounds are needed.
    kept = torch.empty(0, num_layers, dtype=torch.long)
    while kept.shape[0] < num_samples:
        drawn = torch.cat(
            [kept, _draw_paths(num_layers, num_heads, num_samples - kept.shape[0] + 16, skip, length, generator)]
        )
        _, inverse = torch.unique(drawn, dim=0, return_inverse=True)
        first = torch.full((int(inverse.max()) + 1,), drawn.shape[0], dtype=torch.long)
        first.scatter_reduce_(0, inverse, torch.arange(drawn.shape[0]), reduce="amin")
        kept = drawn[first.sort().values]
    return kept[:num_samples]


SAMPLE_COPIES = 3  # sample_paths' peak: the paths, and two arrays of their size while drawing them


def _draw_paths(
    num_layers: int, num_heads: int, num_samples: int, skip: bool, length: int | None, generator: torch.Generator | None
) -> Tensor:
    """sample_paths with replacement, on checked arguments."""
    if length is None:
        choices = num_heads + int(skip)
        return torch.randint(0, choices, (num_samples, num_layers), generator=generator) - int(skip)
    keys = torch.rand(num_samples, num_layers, generator=generator)
    layers = keys.argsort(dim=1)[:, :length]  # k distinct layers, uniformly
    heads = torch.randint(0, num_heads, (num_samples, length), generator=generator)
    paths = torch.full((num_samples, num_layers), SKIP, dtype=torch.long)
    paths.scatter_(1, layers, heads)
    return paths
