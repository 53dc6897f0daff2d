"""Exact statistics of every path of trees too large to store: streaming per-length reductions.

:func:`path_statistics` walks the tree in the engine's memory-bounded chunks and folds each
chunk's per-path residuals and norms into per-(batch element, path length) accumulators on the
device where they were computed: counts, float64 sums and sums of squares, minima and maxima with
the paths where they occur, log-binned histograms and, optionally, the ``top_k`` paths by ratio.
Memory is ``O(B · (L+1) · bins + top_k)`` beyond one chunk, whatever the number of paths.

The statistics run over the tree's leaves: its distinct paths (every path of a complete tree).
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import os
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from torch import Tensor

from pathkernels.core import distributed
from pathkernels.core._figures import check_file_path, check_save_path, require, saved
from pathkernels.core._files import read_sealed, tensor_digest, write_sealed
from pathkernels.core._memory import check_fits, shown
from pathkernels.core._progress import progress_bar
from pathkernels.core.checks import (
    check_flag,
    check_int,
    check_masked_network,
    first_index,
    mask_group_inputs,
    renamed,
    unpack_stack,
)
from pathkernels.core.engine import check_inputs, chunk_reports, evaluate_paths, op_leaf_kernel, to_device
from pathkernels.core.engine_defaults import engine_settings
from pathkernels.core.paths import DEFAULT_MAX_PATHS, MAX_SIZE, SKIP, PathTree, _count_by_length, check_max_paths
from pathkernels.core.planner import DEFAULT_MEMORY_BUDGET, chunks

QUANTILES = (0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95)
_MEASURES = ("ratio", "residual", "norm")
_HISTOGRAMS = ("ratio", "residual")
_EXTREMES = ("argmin", "argmax")
_HISTOGRAM_TOP = 10.0  # the last regular edge; above it is the overflow bin
_NO_PATH = -2  # a path row where a length has no path


# The smallest positive float64 (a subnormal): every reported ratio or residual that is not 0 is
# at least this, so a histogram whose first edge it is counts exact zeros, and only them, in bin 0.
SMALLEST_POSITIVE = math.ldexp(1.0, -1074)


@functools.lru_cache(maxsize=8)
def histogram_edges(bins_per_decade: int) -> Tensor:
    """Log-spaced edges up to 10, ``bins_per_decade`` per decade (float64), down to the smallest
    positive float64 (the first edge is that number itself). Bin 0 counts the values below the
    first edge, which are exact zeros; the last bin values from the last edge up (and NaN). The
    engine reports float64 values for float32 inputs too, so one grid serves both."""
    low = math.log10(SMALLEST_POSITIVE)
    decades = math.log10(_HISTOGRAM_TOP) - low
    count = math.ceil(decades * bins_per_decade)
    edges = torch.logspace(
        math.log10(_HISTOGRAM_TOP) - count / bins_per_decade, math.log10(_HISTOGRAM_TOP), count + 1, dtype=torch.float64
    )
    # The grid's first point lies below the smallest positive number and may round to 0, and points
    # among the subnormals may round to one number: raised to it, then each kept once (ascending).
    return torch.unique(edges.clamp_min(SMALLEST_POSITIVE))


def positive_log10(values: Tensor) -> Tensor:
    """``log10(v)`` where ``v > 0`` and 0 at exact zeros, which the statistics count apart (NaN
    stays NaN): what ``log10_ratio_sums`` adds up."""
    return torch.where(values == 0, 0.0, values.log10())


def statistics_fold(device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """How :meth:`PathStatistics.add` folds a chunk of a ``dtype`` network's reports on ``device``:
    "native" (the C++ op; the CPU's), "torch" (torch ops; the GPU's where
    :mod:`pathkernels.core.engine_defaults` has no measured choice for the card family) or "triton"
    (core/triton_statistics.py: a GPU, or CPU tensors under TRITON_INTERPRET=1).
    PATHKERNELS_STATISTICS_FOLD, where set, wins over the table, so that one run can time the folds
    against each other. The table is asked for its narrowest entry: the fold does not know n."""
    fold = engine_settings(device, dtype, 1, where="pathkernels.path_statistics").statistics_fold
    if fold == "native" and device.type != "cpu":
        raise ValueError(
            "pathkernels.path_statistics: PATHKERNELS_STATISTICS_FOLD=native is the CPU's fold, "
            f"got tensors on {device}"
        )
    return fold


@functools.lru_cache(maxsize=8)
def _edges_on(bins_per_decade: int, device: torch.device) -> Tensor:
    """:func:`histogram_edges` on ``device``, copied there once."""
    return histogram_edges(bins_per_decade).to(device)


def histogram_quantiles(
    histogram: Tensor, edges: Tensor, q=QUANTILES, lowest: Tensor | None = None, highest: Tensor | None = None
) -> Tensor:
    """Quantiles ``[..., len(q)]`` of counts ``histogram [..., E+1]`` over ``edges [E]`` (bin 0
    below the first edge, bin E from the last one up), log-interpolated within the bin that holds
    each: exact to within one bin. 0 for bin 0 (exact zeros, with :func:`histogram_edges`), inf for
    the overflow bin, NaN where there are no counts. With ``lowest`` and ``highest`` ``[...]``,
    the smallest and largest values counted, each quantile is clamped to them (a bin is wider than
    the values in it: every value 1.6 read as a median of 1.78)."""
    histogram = histogram.double().cpu()
    if lowest is not None and highest is not None:
        lowest, highest = lowest.double().cpu().unsqueeze(-1), highest.double().cpu().unsqueeze(-1)
    cumulative = histogram.cumsum(-1)
    total = cumulative[..., -1:]
    logs = edges.log10()
    last = edges.numel()  # the overflow bin
    out = torch.full((*histogram.shape[:-1], len(q)), math.nan, dtype=torch.float64)
    for i, level in enumerate(q):
        target = level * total
        index = torch.searchsorted(cumulative, target).clamp(max=last)
        below = torch.where(index > 0, cumulative.gather(-1, (index - 1).clamp_min(0)), 0.0)
        inside = histogram.gather(-1, index)
        fraction = torch.where(inside > 0, (target - below) / inside, 0.0).clamp(0, 1)
        low, high = logs[(index - 1).clamp(0, last - 1)], logs[index.clamp(max=last - 1)]
        value = 10 ** (low + fraction * (high - low))
        value = torch.where(index == 0, 0.0, torch.where(index == last, math.inf, value))
        if lowest is not None and highest is not None:
            value = torch.minimum(torch.maximum(value, lowest), highest)
        out[..., i] = torch.where(total > 0, value, math.nan)[..., 0]
    return out


@dataclass
class PathStatistics:
    """Exact per-length statistics of the paths of one tree (see :func:`path_statistics`).

    Every tensor is indexed ``[b, k]`` (batch element, path length ``0..L``) first. ``sums`` and
    ``sums_of_squares`` hold, per measure (``ratio``, ``residual``, ``norm``), float64 totals;
    ``minima``/``maxima`` the extreme values and ``argmin``/``argmax`` ``[B, L+1, L]`` the path
    where each occurs (the first in the tree's leaf order; rows of -2 where a length has no path);
    ``histograms`` ``[B, L+1, bins+1]`` counts of the ratio and the residual over
    :func:`histogram_edges`, with under- and overflow bins; ``top_values`` ``[B, L+1, top_k]``
    the largest ratios per length (``-inf`` where a length has fewer paths) and ``top_paths``
    ``[B, L+1, top_k, L]`` their paths.

    Zero paths: a path whose term is exactly the zero matrix (norm 0: through a pruned head,
    W_O = 0, or from an all-zero x or value map) has no residual ratio (0/0). ``zero_norms`` counts
    them; the ratio's sums, log sums, extremes, histogram and top leave them out, so its means,
    standard deviations and quantiles are over the other paths (``counts − zero_norms`` of them).
    The residual's and the norm's statistics count every path (a zero path's are 0).
    """

    num_layers: int
    num_heads: int
    skip: bool
    dtype: torch.dtype
    bins_per_decade: int
    top_k: int
    counts: Tensor  # [B, L+1] int64
    log10_ratio_sums: Tensor = field(repr=False)  # [B, L+1] float64: Σ log10 ratio over ratios > 0
    sums: dict[str, Tensor] = field(repr=False)  # measure -> [B, L+1] float64
    sums_of_squares: dict[str, Tensor] = field(repr=False)
    minima: dict[str, Tensor] = field(repr=False)
    maxima: dict[str, Tensor] = field(repr=False)
    argmin: dict[str, Tensor] = field(repr=False)  # measure -> [B, L+1, L] int64 paths
    argmax: dict[str, Tensor] = field(repr=False)
    histograms: dict[str, Tensor] = field(repr=False)  # "ratio"/"residual" -> [B, L+1, bins+1] int64
    top_values: Tensor = field(repr=False)  # [B, L+1, top_k] float64
    top_paths: Tensor = field(repr=False)  # [B, L+1, top_k, L] int64
    zero_norms: Tensor = field(default=None, repr=False)  # [B, L+1] int64: paths of norm 0, without a ratio

    def __post_init__(self):
        if self.zero_norms is None:  # statistics saved before zero paths were counted apart
            self.zero_norms = torch.zeros_like(self.counts)

    @property
    def edges(self) -> Tensor:
        return histogram_edges(self.bins_per_decade)

    @classmethod
    def empty(
        cls, batch: int, tree: PathTree, dtype: torch.dtype, bins_per_decade: int, top_k: int, device
    ) -> PathStatistics:
        layers = tree.num_layers
        shape = (batch, layers + 1)
        bins = histogram_edges(bins_per_decade).numel() + 1  # regular bins + exact zeros + overflow

        def per_measure(fill, kind=torch.float64):
            return {name: torch.full(shape, fill, dtype=kind, device=device) for name in _MEASURES}

        return cls(
            num_layers=tree.num_layers,
            num_heads=tree.num_heads,
            skip=tree.skip,
            dtype=dtype,
            bins_per_decade=bins_per_decade,
            top_k=top_k,
            counts=torch.zeros(shape, dtype=torch.long, device=device),
            log10_ratio_sums=torch.zeros(shape, dtype=torch.float64, device=device),
            sums=per_measure(0.0),
            sums_of_squares=per_measure(0.0),
            minima=per_measure(math.inf),
            maxima=per_measure(-math.inf),
            argmin={
                name: torch.full((*shape, layers), _NO_PATH, dtype=torch.long, device=device) for name in _MEASURES
            },
            argmax={
                name: torch.full((*shape, layers), _NO_PATH, dtype=torch.long, device=device) for name in _MEASURES
            },
            histograms={name: torch.zeros(*shape, bins, dtype=torch.long, device=device) for name in _HISTOGRAMS},
            top_values=torch.full((*shape, top_k), -math.inf, dtype=torch.float64, device=device),
            top_paths=torch.full((*shape, top_k, layers), _NO_PATH, dtype=torch.long, device=device),
            zero_norms=torch.zeros(shape, dtype=torch.long, device=device),
        )

    # --- accumulation ------------------------------------------------------------------------

    def add(self, residual: Tensor, norm: Tensor, lengths: Tensor, paths_of: Callable[[Tensor], Tensor]) -> None:
        """Fold one chunk in: ``residual``/``norm`` ``[B, c]`` of leaves with ``lengths [c]``, in
        the tree's leaf order (so that the first path reaching an extreme is the one kept);
        ``paths_of(leaves)`` gives the paths ``[k, L]`` of chunk leaves ``leaves [k]``, asked only
        for those that reach an extreme or the top. How, :func:`statistics_fold` says: on the CPU
        one pass of the C++ op ``_statistics_update``; on a GPU torch ops (:meth:`_add_torch`) or
        the Triton fold (two launches); for a chunk that holds a zero path (whose 0/0 ratio the C++
        op would add to the sums), torch ops. Each gives the same numbers."""
        fold = statistics_fold(residual.device, self.dtype)
        if fold == "triton":
            self._add_triton(residual, norm, lengths, paths_of)
            return
        if fold == "torch" or residual.device.type != "cpu":
            self._add_torch(residual, norm, paths_of(torch.arange(residual.shape[1])))
            return
        residual, norm = residual.double().contiguous(), norm.double().contiguous()
        if bool((norm == 0).any()):
            self._add_torch(residual, norm, paths_of(torch.arange(residual.shape[1])))
            return
        stacked = {name: self._packed(name, _MEASURES) for name in ("sums", "sums_of_squares", "minima", "maxima")}
        first = torch.full((len(_EXTREMES), len(_MEASURES), *self.counts.shape), -1, dtype=torch.long)
        torch.ops.pathkernels._statistics_update(
            residual,
            norm,
            lengths,
            self.edges,
            self.counts,
            self.log10_ratio_sums,
            stacked["sums"],
            stacked["sums_of_squares"],
            stacked["minima"],
            stacked["maxima"],
            first[0],
            first[1],
            self._packed("histograms", _HISTOGRAMS),
        )
        self._record_extremes(first, paths_of)
        if self.top_k:
            self._add_top(residual / norm, lengths, paths_of)

    def _add_triton(self, residual: Tensor, norm: Tensor, lengths: Tensor, paths_of: Callable[[Tensor], Tensor]):
        """:meth:`add` through the Triton fold (core/triton_statistics.py), zero paths included."""
        from pathkernels.core.triton_statistics import triton_statistics_update

        residual, norm = residual.double().contiguous(), norm.double().contiguous()
        first = triton_statistics_update(
            residual,
            norm,
            lengths.to(residual.device).contiguous(),
            _edges_on(self.bins_per_decade, residual.device),
            self.counts,
            self.zero_norms,
            self.log10_ratio_sums,
            *(self._packed(name, _MEASURES) for name in ("sums", "sums_of_squares", "minima", "maxima")),
            self._packed("histograms", _HISTOGRAMS),
        )
        self._record_extremes(first, paths_of)
        if self.top_k:
            self._add_top(torch.where(norm != 0, residual / norm, math.nan), lengths, paths_of)

    def _record_extremes(self, first: Tensor, paths_of: Callable[[Tensor], Tensor]) -> None:
        """The paths of the chunk's leaves ``first [2, 3, B, L+1]`` (per extreme and measure: the
        first leaf reaching a new one, or -1) into argmin and argmax: one small copy to the host."""
        first = first.cpu()
        if not bool((first >= 0).any()):  # new extremes are rare once the first chunks are in
            return
        for name, leaves_of in zip(_EXTREMES, first):
            for measure, leaves in zip(_MEASURES, leaves_of):
                found = leaves >= 0  # [B, L+1]: a new extreme in this chunk, first reached at that leaf
                if bool(found.any()):
                    kept = getattr(self, name)[measure]
                    kept[found.to(kept.device)] = paths_of(leaves[found]).to(kept.device)

    def _packed(self, name: str, keys: tuple[str, ...]) -> Tensor:
        """The tensors of field ``name`` (a dict over ``keys``) as one contiguous ``[len(keys), ...]``
        tensor whose slices they are: packed on first use (the dict then holds views of it), so that
        :meth:`add` hands them to the C++ fold with no copy per chunk. Remembered per field while
        the dict holds those very views."""
        packs = self.__dict__.setdefault("_packs", {})
        values = getattr(self, name)
        base, views = packs.get(name, (None, ()))
        if base is None or any(values.get(key) is not view for key, view in zip(keys, views)):
            base = torch.stack([values[key] for key in keys])
            views = tuple(base[i] for i in range(len(keys)))
            setattr(self, name, dict(zip(keys, views)) | {k: v for k, v in values.items() if k not in keys})
            packs[name] = (base, views)
        return base

    def _add_torch(self, residual: Tensor, norm: Tensor, paths: Tensor) -> None:
        """:meth:`add` in torch ops, for any device."""
        batch, count = residual.shape
        levels = self.num_layers + 1
        paths = to_device(paths, residual.device)
        lengths = (paths != SKIP).sum(1)
        slot = (torch.arange(batch, device=residual.device).unsqueeze(1) * levels + lengths).flatten()  # [B·c]
        leaves = torch.arange(count, device=residual.device).expand(batch, count).flatten()  # within the chunk
        values = {"residual": residual.double(), "norm": norm.double()}
        values["ratio"] = values["residual"] / values["norm"]
        # A zero path (norm 0) has no ratio: it adds 0 to the ratio's sums and 1 to zero_norms.
        # (Adding 0.0 leaves a float64 sum as it was, so the sums are those of the other paths.)
        has_ratio = (values["norm"] != 0).flatten()
        self.counts.view(-1).index_add_(0, slot, torch.ones_like(slot))
        self.zero_norms.view(-1).index_add_(0, slot, (~has_ratio).long())
        ratio = torch.where(has_ratio, values["ratio"].flatten(), 0.0)
        self.log10_ratio_sums.view(-1).index_add_(0, slot, positive_log10(ratio))
        for name, value in values.items():
            flat = value.flatten()
            summed = ratio if name == "ratio" else flat
            self.sums[name].view(-1).index_add_(0, slot, summed)
            self.sums_of_squares[name].view(-1).index_add_(0, slot, summed * summed)
            number = ~flat.isnan()  # a NaN (inf/inf, beyond float64) has no place among the extremes
            if name == "ratio":
                number &= has_ratio
            # No boolean indexing (a host sync on CUDA, per chunk): the values left out are replaced
            # by ones that cannot win.
            none = torch.iinfo(torch.long).max
            for extreme, best, where, take in (
                (self.minima, torch.minimum, self.argmin, "amin"),
                (self.maxima, torch.maximum, self.argmax, "amax"),
            ):
                worst = math.inf if take == "amin" else -math.inf
                chunk_best = torch.full((batch * levels,), worst, dtype=torch.float64, device=flat.device)
                chunk_best.scatter_reduce_(0, slot, torch.where(number, flat, worst), reduce=take, include_self=True)
                # The first leaf of the chunk that reaches the chunk's extreme of its slot.
                hit = number & (flat == chunk_best[slot])
                first = torch.full((batch * levels,), none, dtype=torch.long, device=flat.device)
                first.scatter_reduce_(0, slot, torch.where(hit, leaves, none), reduce="amin", include_self=True)
                current = extreme[name].view(-1)
                better = (chunk_best < current) if take == "amin" else (chunk_best > current)
                better &= first != none
                found = paths[first.clamp(max=count - 1)]  # [B·(L+1), L]
                kept = where[name].view(-1, self.num_layers)
                kept.copy_(torch.where(better.unsqueeze(1), found, kept))
                current.copy_(best(current, chunk_best))
        edges = _edges_on(self.bins_per_decade, residual.device)  # copied to a GPU once, not per chunk
        for name in _HISTOGRAMS:
            flat = values[name].flatten()
            # Bin 0: below the first edge, exact zeros; bins 1..E-1 regular; bin E: from the last
            # edge up (and NaN). Zero paths have no ratio to count.
            index = torch.bucketize(flat, edges, right=True)
            weight = has_ratio.long() if name == "ratio" else torch.ones_like(index)
            histogram = self.histograms[name].view(-1, edges.numel() + 1)
            histogram.view(-1).index_add_(0, slot * (edges.numel() + 1) + index, weight)
        if self.top_k:
            top = torch.where(has_ratio.view_as(values["ratio"]), values["ratio"], math.nan)
            self._add_top(top, lengths, lambda leaves: paths[leaves.to(paths.device)])

    def _add_top(self, ratio: Tensor, lengths: Tensor, paths_of: Callable[[Tensor], Tensor]) -> None:
        """Merge the chunk's ratios ``[B, c]`` into the top ``top_k`` of each length. Only leaves
        beating a length's smallest kept ratio (in some batch element) are candidates, so paths
        are computed for few leaves once the top fills. A NaN ratio (0/0: a path whose product is
        zero, e.g. through a pruned head) never enters, as it never becomes an extreme. Ties go to
        the earlier leaf in the tree's order (a stable sort, the kept entries first)."""
        batch, layers = ratio.shape[0], self.num_layers
        for k in torch.unique(lengths).tolist():
            chosen = (lengths == k).nonzero().flatten()
            values = ratio[:, chosen.to(ratio.device)]  # [B, c_k]
            beats = values > self.top_values[:, k, -1:]  # the smallest kept: -inf until the top is full
            candidates = beats.any(0)
            if not bool(candidates.any()):
                continue
            values, beats = values[:, candidates], beats[:, candidates]
            chosen_paths = paths_of(chosen[candidates.to(chosen.device)]).to(ratio.device)  # [c', L]
            values = torch.where(beats, values, -math.inf)
            paths = torch.where(beats.unsqueeze(-1), chosen_paths.expand(batch, -1, -1), _NO_PATH)
            all_values = torch.cat([self.top_values[:, k], values], dim=1)  # [B, top_k + c']
            all_paths = torch.cat([self.top_paths[:, k], paths], dim=1)
            order = all_values.sort(dim=1, descending=True, stable=True).indices[:, : self.top_k]
            self.top_values[:, k] = all_values.gather(1, order)
            self.top_paths[:, k] = all_paths.gather(1, order.unsqueeze(-1).expand(-1, -1, layers))

    # --- reading -------------------------------------------------------------------------------

    def measured(self, measure: str = "ratio") -> Tensor:
        """``[B, L+1]`` how many paths ``measure``'s statistics are over: every path for the
        residual and the norm, those of norm other than 0 for the ratio."""
        measure = _check_measure(measure, _MEASURES, "pathkernels.PathStatistics.measured")
        return self.counts - self.zero_norms if measure == "ratio" else self.counts

    def mean(self, measure: str = "ratio") -> Tensor:
        """``[B, L+1]`` float64 means (NaN where a length has no path; the ratio's 0 where every
        path of a length is a zero path, whose residual is 0)."""
        measure = _check_measure(measure, _MEASURES, "pathkernels.PathStatistics.mean")
        n = self.measured(measure)
        return torch.where((n == 0) & (self.counts > 0), 0.0, self.sums[measure] / n)

    def std(self, measure: str = "ratio") -> Tensor:
        """``[B, L+1]`` sample standard deviations, ``sqrt((Σx² − (Σx)²/n) / (n − 1))`` from the
        float64 sums over the :meth:`measured` paths (0 for one path, and the ratio's where every
        path of a length is a zero path; NaN where a length has no path)."""
        measure = _check_measure(measure, _MEASURES, "pathkernels.PathStatistics.std")
        n = self.measured(measure).double()
        variance = (self.sums_of_squares[measure] - self.sums[measure] ** 2 / n) / (n - 1)
        return torch.where((n <= 1) & (self.counts > 0), 0.0, variance.clamp_min(0).sqrt())

    def quantiles(self, measure: str = "ratio", q=QUANTILES) -> tuple[Tensor, float]:
        """Quantiles ``[B, L+1, len(q)]`` read from the histogram (log-interpolated within a bin),
        and their relative error bound: the bin width, a factor ``10^(1/bins_per_decade)``.
        ``q``: levels in [0, 1] (a number or a sequence of them); anything else is refused."""
        where = "pathkernels.PathStatistics.quantiles"
        measure = _check_measure(measure, _HISTOGRAMS, where, " (the measures with histograms)")
        q = _check_levels(q, where)
        quantiles = histogram_quantiles(
            self.histograms[measure], self.edges, q, self.minima[measure], self.maxima[measure]
        )
        return quantiles, 10 ** (1 / self.bins_per_decade) - 1

    def path_counts(self) -> list[int]:
        """Exact number of leaves of each length in the tree (Python ints), from batch element 0."""
        return [int(c) for c in self.counts[0].tolist()]

    def by_length(self, batch_element: int | None = None):
        """A pandas DataFrame, one row per length that has paths: the columns of
        :meth:`PathDecomposition.by_length`, over every path exactly, then more.

        ``length``, ``path_count``, ``evaluated`` (every path), ``exact`` (True), ``mean``,
        ``stderr`` (0), ``median``, ``q10``, ``q90``, ``min``, ``max``, ``zeros`` (exact zeros,
        counted apart), ``zero_norm`` (zero paths, left out: see the class docstring) and
        ``log10_mean`` (over the ratios that are not 0) of the residual ratio; then ``std``
        (``sqrt((Σr² − (Σr)²/m) / (m − 1))`` over the m pairs with a ratio; 0 for one) and
        ``q05 … q95``. The median and the quantiles are read from the histogram:
        ``from_histogram`` is True and ``quantile_rel_error`` is their bound (one bin's width,
        where they are not 0); the rest is exact. Over every (batch element, path) pair pooled
        (counts, sums and histograms add), as the in-memory table is, or one element with
        ``batch_element``. A length whose every pair is a zero path has 0 in its ratio columns
        (a zero matrix's residual is 0), never NaN.
        """
        batch_element = self._check_batch_element(batch_element, "pathkernels.PathStatistics.by_length")
        pd = require("pandas")
        pick = slice(None) if batch_element is None else slice(batch_element, batch_element + 1)
        counts = self.counts[pick].sum(0).cpu()
        zero_norms = self.zero_norms[pick].sum(0).cpu()
        sums = self.sums["ratio"][pick].sum(0).cpu()
        squares = self.sums_of_squares["ratio"][pick].sum(0).cpu()
        logs = self.log10_ratio_sums[pick].sum(0).cpu()
        zeros = self.histograms["ratio"][pick].sum(0)[:, 0].cpu()  # bin 0 holds the exact zeros
        minima = self.minima["ratio"][pick].amin(0).cpu()
        maxima = self.maxima["ratio"][pick].amax(0).cpu()
        histogram = self.histograms["ratio"][pick].sum(0, keepdim=True)
        quantiles = histogram_quantiles(histogram, self.edges, lowest=minima[None], highest=maxima[None])[0]
        named = {f"q{round(level * 100):02d}": i for i, level in enumerate(QUANTILES)}
        error = 10 ** (1 / self.bins_per_decade) - 1
        per_element = self.counts.shape[0] if batch_element is None else 1
        rows = []
        for k in range(self.num_layers + 1):
            n = int(counts[k])
            if n == 0:
                continue
            m = n - int(zero_norms[k])  # the pairs with a ratio
            variance = (float(squares[k]) - float(sums[k]) ** 2 / m) / (m - 1) if m > 1 else 0.0
            paths = n // per_element
            row = {
                "length": k,
                "path_count": paths,
                "evaluated": paths,
                "exact": True,
                "mean": float(sums[k]) / m if m else 0.0,
                "stderr": 0.0,
                "median": float(quantiles[k, named["q50"]]) if m else 0.0,
                "q10": float(quantiles[k, named["q10"]]) if m else 0.0,
                "q90": float(quantiles[k, named["q90"]]) if m else 0.0,
                "min": float(minima[k]) if m else 0.0,
                "max": float(maxima[k]) if m else 0.0,
                "zeros": int(zeros[k]),
                "zero_norm": n - m,
                "log10_mean": float(logs[k]) / (m - int(zeros[k])) if m > int(zeros[k]) else math.nan,
                "std": math.sqrt(max(variance, 0.0)) if m > 1 else 0.0,
            }
            row.update(
                {
                    name: float(quantiles[k, i]) if m else 0.0
                    for name, i in named.items()
                    if name not in ("q10", "q50", "q90")
                }
            )
            row.update(quantile_rel_error=error, from_histogram=True)
            rows.append(row)
        frame = pd.DataFrame(rows)
        frame["path_count"] = frame["path_count"].astype(object)
        return frame

    def _check_batch_element(self, batch_element, where: str) -> int | None:
        """``batch_element``: None (every element) or an int in ``[0, B)``."""
        if batch_element is None:
            return None
        return check_int(batch_element, "batch_element", where, minimum=0, maximum=self.counts.shape[0] - 1)

    def mean_ratio(self) -> tuple[float, float]:
        """The mean residual ratio over every path and batch element (zero paths left out; 0 if
        every path is one), and its standard error: 0, as in :meth:`PathDecomposition.mean_ratio`
        for an exact tree."""
        measured = int(self.measured("ratio").sum())
        return (float(self.sums["ratio"].sum()) / measured if measured else 0.0), 0.0

    @renamed("pathkernels.PathStatistics.top", k="top_k")
    def top(self, top_k: int | None = None, *, length: int | None = None, batch_element: int = 0):
        """The ``top_k`` paths with the largest ratio (of one ``length``, or overall) for one batch
        element: a list of ``(ratio, path)``, largest first; a path is a list of L heads, -1 = skip."""
        where = "pathkernels.PathStatistics.top"
        k = self.top_k if top_k is None else check_int(top_k, "top_k", where)
        if not 0 <= k <= self.top_k:
            raise ValueError(f"{where}: expected top_k in [0, {self.top_k}] (the top_k collected), got {k}")
        batch_element = check_int(batch_element, "batch_element", where, minimum=0, maximum=self.counts.shape[0] - 1)
        values, paths = self.top_values[batch_element].cpu(), self.top_paths[batch_element].cpu()
        if length is not None:
            length = check_int(length, "length", where, minimum=0, maximum=self.num_layers)
            values, paths = values[length : length + 1], paths[length : length + 1]
        values, paths = values.flatten(), paths.reshape(-1, self.num_layers)
        order = values.argsort(descending=True, stable=True)[:k]
        return [(float(values[i]), paths[i].tolist()) for i in order.tolist() if values[i] > -math.inf]

    def to_frame(self):
        """A pandas DataFrame, one row per (batch element, length): count, ``zero_norm`` (zero
        paths, left out of the ratio's columns) and the per-measure mean, std, min, max (with the
        paths where they occur)."""
        pd = require("pandas")
        rows = []
        for b in range(self.counts.shape[0]):
            for k in range(self.num_layers + 1):
                if int(self.counts[b, k]) == 0:
                    continue
                row = {
                    "batch": b,
                    "length": k,
                    "count": int(self.counts[b, k]),
                    "zero_norm": int(self.zero_norms[b, k]),
                }
                for name in _MEASURES:
                    row.update(
                        {
                            f"{name}_mean": float(self.mean(name)[b, k]),
                            f"{name}_std": float(self.std(name)[b, k]),
                            f"{name}_min": float(self.minima[name][b, k]),
                            f"{name}_argmin": self.argmin[name][b, k].tolist(),
                            f"{name}_max": float(self.maxima[name][b, k]),
                            f"{name}_argmax": self.argmax[name][b, k].tolist(),
                        }
                    )
                rows.append(row)
        return pd.DataFrame(rows)

    def plot(self, ax=None, *, batch_element: int | None = None, path=None):
        """Ratio against length (log scale): the histogram's median and 5–95 % band, and the
        minimum and maximum. Exact zeros have no place on a log scale: they are left out, and the
        legend says how many. Returns the matplotlib Figure; with ``path`` it is also saved there."""
        check_save_path(path, "pathkernels.PathStatistics.plot")
        batch_element = self._check_batch_element(batch_element, "pathkernels.PathStatistics.plot")
        require("matplotlib")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4)) if ax is None else (ax.figure, ax)
        table = self.by_length(batch_element)
        columns = ["median", "q05", "q95", "min", "max"]
        positive = table[columns].where(table[columns] > 0)  # exact zeros have no place on a log axis
        ax.plot(table["length"], positive["median"], "o-", color="C3", label="median (histogram)")
        ax.fill_between(table["length"], positive["q05"], positive["q95"], color="C3", alpha=0.2, label="5–95 %")
        zeros = int(table["zeros"].sum())
        min_label = "min" if not zeros else f"min, where not 0 ({zeros:,} exact zeros not shown)"
        zero_paths = int(table["zero_norm"].sum())
        if zero_paths:
            min_label += f"; {zero_paths:,} zero paths (no ratio) left out"
        ax.plot(table["length"], positive["min"], "v", color="C0", ms=4, label=min_label)
        ax.plot(table["length"], positive["max"], "^", color="C0", ms=4, label="max")
        ax.set_yscale("log")
        ax.set_xlabel("path length (heads taken)")
        ax.set_ylabel("residual ratio ‖res‖ / ‖·‖ (ℓ1,∞)")
        ax.set_title(f"All paths, streamed: L = {self.num_layers}, H = {self.num_heads}")
        ax.legend(fontsize="small")
        return saved(fig, path)

    # --- combining and storing -----------------------------------------------------------------

    def merge(self, other: PathStatistics) -> PathStatistics:
        """The statistics of two disjoint sets of leaves of the same network, exactly: counts,
        sums and histograms add, extremes compare, top paths merge. Leaf indices stay those of the
        path where each occurs (ties in extremes keep this one's)."""
        if not isinstance(other, PathStatistics):
            raise TypeError(
                f"pathkernels.PathStatistics.merge: expected other to be a PathStatistics, got {type(other).__name__}"
            )
        for name in ("num_layers", "num_heads", "skip", "dtype", "bins_per_decade", "top_k"):
            if getattr(self, name) != getattr(other, name):
                raise ValueError(
                    f"pathkernels.PathStatistics.merge: {name} differs ({getattr(self, name)} and "
                    f"{getattr(other, name)})"
                )
        if self.counts.shape != other.counts.shape:
            raise ValueError(
                f"pathkernels.PathStatistics.merge: batch sizes differ ({self.counts.shape[0]} and "
                f"{other.counts.shape[0]})"
            )
        out = PathStatistics.empty(
            self.counts.shape[0],
            _TreeShape(self.num_layers, self.num_heads, self.skip),
            self.dtype,
            self.bins_per_decade,
            self.top_k,
            self.counts.device,
        )
        out.counts = self.counts + other.counts
        out.zero_norms = self.zero_norms + other.zero_norms
        out.log10_ratio_sums = self.log10_ratio_sums + other.log10_ratio_sums
        for name in _MEASURES:
            out.sums[name] = self.sums[name] + other.sums[name]
            out.sums_of_squares[name] = self.sums_of_squares[name] + other.sums_of_squares[name]
            for extreme, where, smaller in ((out.minima, out.argmin, True), (out.maxima, out.argmax, False)):
                mine = (self.minima if smaller else self.maxima)[name]
                theirs = (other.minima if smaller else other.maxima)[name]
                my_path = (self.argmin if smaller else self.argmax)[name]
                their_path = (other.argmin if smaller else other.argmax)[name]
                take_theirs = (theirs < mine) if smaller else (theirs > mine)
                extreme[name] = torch.where(take_theirs, theirs, mine)
                where[name] = torch.where(take_theirs.unsqueeze(-1), their_path, my_path)
        for name in _HISTOGRAMS:
            out.histograms[name] = self.histograms[name] + other.histograms[name]
        if self.top_k:
            values = torch.cat([self.top_values, other.top_values], dim=-1)
            paths = torch.cat([self.top_paths, other.top_paths], dim=-2)
            best = values.topk(self.top_k, dim=-1)
            out.top_values = best.values
            out.top_paths = paths.gather(-2, best.indices.unsqueeze(-1).expand(-1, -1, -1, self.num_layers))
        return out

    def place(self, batch: Tensor, part: PathStatistics) -> None:
        """Write ``part``, the statistics of batch elements ``batch`` [G] of the same tree, into
        those rows of this one (in place): how a padded batch is assembled from its mask groups."""
        for item in fields(self):
            mine, theirs = getattr(self, item.name), getattr(part, item.name)
            if isinstance(mine, Tensor):
                mine[batch.to(mine.device)] = theirs.to(mine.device)
            elif isinstance(mine, dict):
                for key, tensor in mine.items():
                    tensor[batch.to(tensor.device)] = theirs[key].to(tensor.device)
            elif mine != theirs:
                raise ValueError(f"pathkernels.PathStatistics.place: {item.name} differs ({mine} and {theirs})")

    def to(self, device) -> PathStatistics:
        """A copy with every tensor on ``device`` (a torch.device, or a str such as ``"cuda:0"``)."""
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError, ValueError):
            raise ValueError(
                f"pathkernels.PathStatistics.to: expected device to be a torch.device or a device's name such as "
                f"'cpu' or 'cuda:0', got {type(device).__name__} {shown(device)}"
            ) from None
        return PathStatistics.from_state(self.state(), device)

    def state(self) -> dict:
        """Plain tensors (on the CPU) and numbers: what :meth:`save` writes."""
        state = {}
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, Tensor):
                value = value.cpu()
            elif isinstance(value, dict):
                value = {key: tensor.cpu() for key, tensor in value.items()}
            elif isinstance(value, torch.dtype):
                value = str(value).removeprefix("torch.")
            state[item.name] = value
        return state

    @classmethod
    def from_state(cls, state: dict, device="cpu") -> PathStatistics:
        state = dict(state)
        state["dtype"] = getattr(torch, state["dtype"])
        for key, value in state.items():
            if isinstance(value, Tensor):
                state[key] = value.to(device)
            elif isinstance(value, dict):
                state[key] = {name: tensor.to(device) for name, tensor in value.items()}
        return cls(**state)

    def save(self, path) -> None:
        """Write to ``path``: a sealed file (its SHA-256 checked on reading) of plain tensors and
        numbers, written atomically. ``path`` is a file in a folder that exists; an empty path, a
        folder, or a file that cannot be written is refused (ValueError) before anything is written."""
        where = "pathkernels.PathStatistics.save"
        target = check_file_path(path, where)
        try:
            write_sealed(target, {"pathkernels.PathStatistics": 1, **self.state()})
        except OSError as error:
            raise ValueError(f"{where}: cannot write {str(target)!r}: {error.strerror or error}") from None

    @classmethod
    def load(
        cls,
        path,
        attn=None,
        *,
        x: Tensor | None = None,
        w_v: Tensor | None = None,
        w_o: Tensor | None = None,
        token_mask: Tensor | None = None,
        memory_budget: int = DEFAULT_MEMORY_BUDGET,
    ) -> PathStatistics:
        """Read what :meth:`save` wrote; a damaged, truncated or foreign file is refused, and so
        are statistics that contradict themselves (:func:`checked_state`).

        The file holds the statistics, not the inputs they were computed from. Given those inputs
        (``attn`` and, for path outputs, ``x``, ``w_v``, ``w_o``; ``token_mask`` as in
        :func:`path_statistics`), the statistics are also checked against them, as
        :meth:`verify` does: statistics of other inputs, or whose extremes or top ratios were
        edited, are refused. Without them only the file's own consistency is checked: call
        :meth:`verify` once the inputs are at hand."""
        where = "pathkernels.PathStatistics.load"
        advice = "Save the statistics again."
        state = read_sealed(check_file_path(path, where, write=False), where, "the file", advice)
        if not isinstance(state, dict) or state.pop("pathkernels.PathStatistics", None) != 1:
            raise ValueError(f"{where}: {path} was not written by PathStatistics.save")
        stats = cls.from_state(checked_state(state, where, f"the file {path}", advice))
        if attn is None:
            for name, value in (("x", x), ("w_v", w_v), ("w_o", w_o), ("token_mask", token_mask)):
                if value is not None:
                    raise ValueError(
                        f"{where}: {name} is checked against the statistics together with attn; pass attn too"
                    )
            return stats
        return stats._verify(
            attn,
            where,
            f"the file {path} does not hold the statistics of these inputs",
            _RECOMPUTE_ADVICE,
            x=x,
            w_v=w_v,
            w_o=w_o,
            token_mask=token_mask,
            memory_budget=memory_budget,
        )

    def verify(
        self,
        attn,
        *,
        x: Tensor | None = None,
        w_v: Tensor | None = None,
        w_o: Tensor | None = None,
        token_mask: Tensor | None = None,
        memory_budget: int = DEFAULT_MEMORY_BUDGET,
    ) -> PathStatistics:
        """Check these statistics against the inputs they claim to be of, and return them.

        The paths recorded as extremes (``argmin``/``argmax`` of the ratio, the residual and the
        norm) and as the top ratios are evaluated again with the engine
        (:func:`pathkernels.path_residuals` of ``attn``, ``x``, ``w_v``, ``w_o``, ``token_mask``,
        as given to :func:`path_statistics`): each recorded value must equal the engine's at its
        path, in its batch element, to the engine's precision (:data:`RECOMPUTED_TOLERANCE`: 1e-9
        of the path's norm in float64, 1e-4 in float32). Cheap: a few paths per batch element and
        length. Refused (ValueError), naming the field, index and both values: statistics of other
        inputs, extremes or top ratios edited (even all together, consistently), a path swapped
        for another. Not checked: the counts, sums, sums of squares, log sums and histograms
        beyond their own consistency (:meth:`load` checks it), which only the whole run gives."""
        return self._verify(
            attn,
            "pathkernels.PathStatistics.verify",
            "the statistics are not those of these inputs",
            _RECOMPUTE_ADVICE,
            x=x,
            w_v=w_v,
            w_o=w_o,
            token_mask=token_mask,
            memory_budget=memory_budget,
        )

    def _verify(self, attn, where: str, what: str, advice: str, **inputs) -> PathStatistics:
        """:meth:`verify` on behalf of ``where``, the statistics called ``what``."""

        def evaluate(paths: Tensor) -> tuple[Tensor, Tensor]:
            tree = PathTree.from_paths(paths, num_heads=self.num_heads)
            with torch.no_grad():
                results = evaluate_paths(attn, tree, where, **inputs)
            if self.dtype == torch.float64 and results.residual.dtype != torch.float64:
                raise ValueError(
                    f"{where}: {what}: they were computed in {self.dtype}, but these inputs compute in "
                    f"{results.residual.dtype}. {advice}"
                )
            count = paths.shape[0]
            return (
                results.residual.detach().double().cpu().reshape(-1, count),
                results.norm.detach().double().cpu().reshape(-1, count),
            )

        check_recorded_paths(self, evaluate, where, what, advice)
        return self


_RECOMPUTE_ADVICE = "They were computed from other inputs, or edited: compute them again with pk.path_statistics"


def _check_measure(measure, allowed: tuple[str, ...], where: str, which: str = "") -> str:
    """``measure`` if it is one of ``allowed`` (a str), else a refusal naming ``where`` (``which``:
    what the allowed measures are, for the message)."""
    if not isinstance(measure, str):
        raise TypeError(
            f"{where}: expected measure to be one of {allowed}{which}, got {type(measure).__name__} {shown(measure)}"
        )
    if measure not in allowed:
        raise ValueError(f"{where}: expected measure to be one of {allowed}{which}, got {shown(measure)}")
    return measure


def _check_levels(q, where: str) -> tuple[float, ...]:
    """Quantile levels ``q`` (a real number or a sequence of them, each in [0, 1]) as a tuple."""
    levels = (q,) if isinstance(q, numbers.Real) and not isinstance(q, bool) else q
    if isinstance(levels, Tensor):
        usable = levels.dim() <= 1 and not levels.is_complex() and levels.device.type != "meta"
        levels = levels.reshape(-1).tolist() if usable else None
    if isinstance(levels, (str, bytes)) or not isinstance(levels, (list, tuple)):
        raise TypeError(
            f"{where}: expected q to be a level in [0, 1] or a sequence of them, got {type(q).__name__} {shown(q)}"
        )
    for level in levels:
        if isinstance(level, bool) or not isinstance(level, numbers.Real):
            raise TypeError(
                f"{where}: expected q to hold real levels in [0, 1], got {type(level).__name__} {shown(level)}"
            )
        if not 0 <= level <= 1:  # NaN too
            raise ValueError(f"{where}: expected q to hold levels in [0, 1], got {shown(level)}")
    return tuple(float(level) for level in levels)


@dataclass(frozen=True)
class _TreeShape:
    """What :meth:`PathStatistics.empty` reads of a tree."""

    num_layers: int
    num_heads: int
    skip: bool


# The relative rounding of a float64 sum of m non-negative terms is below m · 2^-52 (plus a little
# for the sums of squares' own squares): the slack of checked_state's bounds on the sums.
_SUM_SLACK = 2.0**-52


def checked_state(
    state,
    where: str,
    what: str,
    advice: str,
    *,
    expected: dict | None = None,
    leaves: tuple[int, int] | None = None,
    tree: PathTree | None = None,
) -> dict:
    """``state`` (what :meth:`PathStatistics.state` gives) if it is statistics that a run can have
    produced, else a ValueError ``"{where}: {what} is not consistent: {field} …. {advice}"`` naming
    the first field that contradicts the others.

    Checked: the fields and their types, dtypes and shapes ``[B, L+1, …]``; counts ``>= 0`` and
    equal for every batch element (each element sees every path), ``0 <= zero_norms <= counts``;
    per measure over its ``m`` paths (``counts − zero_norms`` for the ratio): no NaN, sums and sums
    of squares ``>= 0`` and 0 where ``m = 0``, ``m·min <= Σx <= m·max`` and ``(Σx)²/m <= Σx² <=
    m·max²`` to within the rounding of a float64 sum, the extremes ``+inf``/``-inf`` where ``m = 0``
    and ``0 <= min <= max`` elsewhere; histograms of ``bins + 1`` non-negative counts summing to
    ``m``, whose first and last occupied bins hold the minimum and the maximum; the extremes' and
    the top's paths ``[-1, H)`` heads (no skip without ``skip``) through exactly k heads at length
    k, rows of -2 where there is none; the top descending, ``min(top_k, m)`` of them, the first
    equal to the maximum ratio.

    ``expected``: field values the caller needs (``num_layers``, ``num_heads``, ``skip``,
    ``dtype``, ``bins_per_decade``, ``top_k``, ``batch``). ``leaves = (first, reached)`` with
    ``tree``: a checkpoint's leaf range, whose paths the counts must be (their total per batch
    element; per length exactly for up to 2^20 leaves, and never beyond the tree's own count)."""

    def refuse(field_name: str, problem: str):
        raise ValueError(f"{where}: {what} is not consistent: {field_name} {problem}. {advice}")

    if not isinstance(state, dict):
        refuse("the statistics", f"are a {type(state).__name__}, expected a dict of fields")
    names = [item.name for item in fields(PathStatistics)]
    missing = [name for name in names if name not in state and name != "zero_norms"]
    unknown = sorted(str(name) for name in state if name not in names)
    if missing or unknown:
        refuse(
            "the fields",
            f"are not PathStatistics' ({'missing ' + ', '.join(missing) if missing else ''}"
            f"{'; ' if missing and unknown else ''}{'unknown ' + ', '.join(unknown) if unknown else ''})",
        )

    def integer(name: str, minimum: int, maximum: int | None = None) -> int:
        value = state[name]
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or value < minimum
            or (maximum is not None and value > maximum)
        ):
            bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
            refuse(name, f"is {value!r}, expected an int {bounds}")
        return value

    layers, heads = integer("num_layers", 1, MAX_SIZE), integer("num_heads", 1, MAX_SIZE)
    bins_per_decade, top_k = integer("bins_per_decade", 1, 1000), integer("top_k", 0)
    skip = state["skip"]
    if not isinstance(skip, bool):
        refuse("skip", f"is {skip!r}, expected True or False")
    if state["dtype"] not in ("float32", "float64"):
        refuse("dtype", f"is {state['dtype']!r}, expected 'float32' or 'float64' (the engine's dtypes)")
    counts = state["counts"]
    if not (isinstance(counts, Tensor) and counts.dtype == torch.long and counts.dim() == 2 and counts.shape[0] >= 1):
        refuse("counts", f"is {_described(counts)}, expected an int64 tensor [B, L+1]")
    batch, levels = counts.shape[0], layers + 1
    shape = (batch, levels)

    def tensor(name: str, value, dtype: torch.dtype, size: tuple[int, ...], what_of: str) -> Tensor:
        if not (isinstance(value, Tensor) and value.dtype == dtype and tuple(value.shape) == size):
            refuse(
                name,
                f"is {_described(value)}, expected {what_of}: a {str(dtype).removeprefix('torch.')} tensor "
                f"{list(size)}",
            )
        return value

    def measures(name: str, keys: tuple[str, ...]) -> dict:
        value = state[name]
        if not isinstance(value, dict) or sorted(value) != sorted(keys):
            got = sorted(map(str, value)) if isinstance(value, dict) else type(value).__name__
            refuse(name, f"holds {got}, expected one tensor for each of {list(keys)}")
        return value

    def where_any(bad: Tensor, field_name: str, problem: str) -> None:
        if bool(bad.any()):
            index = first_index(bad)
            refuse(field_name, f"{problem} at index {list(index)}")

    tensor("counts", counts, torch.long, shape, f"[B, L+1] with L = {layers} layers")
    where_any(counts < 0, "counts", "hold a negative count")
    where_any(counts != counts[:1], "counts", "differ between batch elements (each sees every path)")
    given = {
        "num_layers": layers,
        "num_heads": heads,
        "skip": skip,
        "dtype": state["dtype"],
        "bins_per_decade": bins_per_decade,
        "top_k": top_k,
        "batch": batch,
    }
    for name, value in (expected or {}).items():
        value = str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value
        if given[name] != value:
            field_name = "counts" if name == "batch" else name
            got = f"are for {given[name]} batch elements" if name == "batch" else f"is {given[name]!r}"
            refuse(field_name, f"{got}, but this call has {value!r}")
    if leaves is not None:
        first, reached = leaves
        total = int(counts[0].sum())
        if total != reached - first:
            refuse(
                "counts",
                f"hold {total:,} paths per batch element, but leaves {first:,} to {reached:,} are {reached - first:,}",
            )
        if tree is not None:
            if reached - first <= 1 << 20:
                exact = torch.bincount(tree.leaf_lengths(first, reached), minlength=levels)
            else:
                exact = None
                if tree.is_complete:
                    bound = torch.tensor(_count_by_length(layers, heads, skip, tree.max_length))
                else:
                    bound = torch.bincount(tree.leaf_lengths(0, tree.num_leaves), minlength=levels)
                where_any(counts[0] > bound, "counts", "exceed the tree's paths of that length")
            if exact is not None:
                where_any(counts[0] != exact, "counts", f"are not those of leaves {first:,} to {reached:,} by length")
    zero_norms = state.get("zero_norms")
    zero_norms = torch.zeros_like(counts) if zero_norms is None else zero_norms
    tensor("zero_norms", zero_norms, torch.long, shape, "[B, L+1] like counts")
    where_any((zero_norms < 0) | (zero_norms > counts), "zero_norms", "lies outside [0, counts]")
    measured = {"ratio": counts - zero_norms, "residual": counts, "norm": counts}
    log_sums = tensor("log10_ratio_sums", state["log10_ratio_sums"], torch.float64, shape, "[B, L+1] like counts")
    where_any(~torch.isfinite(log_sums), "log10_ratio_sums", "is not finite")
    where_any((measured["ratio"] == 0) & (log_sums != 0), "log10_ratio_sums", "is not 0 where no path has a ratio")
    edges = histogram_edges(bins_per_decade)
    extremes = {name: measures(name, _MEASURES) for name in ("sums", "sums_of_squares", "minima", "maxima")}
    paths = {name: measures(name, _MEASURES) for name in _EXTREMES}
    histograms = measures("histograms", _HISTOGRAMS)

    def check_paths_at(name: str, rows: Tensor, none: Tensor) -> None:
        """``rows [..., L+1, (k,) L]``: -2 where ``none``, else paths of the tree's shape through
        exactly as many heads as the length they are filed under."""
        lengths = torch.arange(levels).view(1, levels, *([1] * (rows.dim() - 3)))
        none = none.unsqueeze(-1).expand_as(rows)
        where_any(none & (rows != _NO_PATH), name, "holds a path where there is none (expected -2)")
        low = SKIP if skip else 0
        where_any(~none & ((rows < low) | (rows >= heads)), name, f"holds a head outside [{low}, {heads})")
        taken = (rows >= 0).sum(-1)
        where_any(~none[..., 0] & (taken != lengths), name, "holds a path whose number of heads is not its length")

    for measure in _MEASURES:
        m = measured[measure]
        total = tensor(f"sums[{measure!r}]", extremes["sums"][measure], torch.float64, shape, "[B, L+1]")
        squares = tensor(
            f"sums_of_squares[{measure!r}]", extremes["sums_of_squares"][measure], torch.float64, shape, "[B, L+1]"
        )
        low = tensor(f"minima[{measure!r}]", extremes["minima"][measure], torch.float64, shape, "[B, L+1]")
        high = tensor(f"maxima[{measure!r}]", extremes["maxima"][measure], torch.float64, shape, "[B, L+1]")
        empty = m == 0
        for name, value in ((f"sums[{measure!r}]", total), (f"sums_of_squares[{measure!r}]", squares)):
            where_any(value.isnan() | (value < 0), name, "is NaN or negative")
            where_any(empty & (value != 0), name, "is not 0 where the length has no path")
        where_any(low.isnan(), f"minima[{measure!r}]", "is NaN")
        where_any(high.isnan(), f"maxima[{measure!r}]", "is NaN")
        where_any(empty & (low != math.inf), f"minima[{measure!r}]", "is not inf where the length has no path")
        where_any(empty & (high != -math.inf), f"maxima[{measure!r}]", "is not -inf where the length has no path")
        where_any(~empty & ((low < 0) | (low > high)), f"minima[{measure!r}]", "is negative or above the maximum")
        slack = 1 + m.double() * _SUM_SLACK + 1e-12
        count = m.double()
        finite = ~empty & torch.isfinite(high) & torch.isfinite(total) & torch.isfinite(squares)
        where_any(
            finite & ((total > count * high * slack) | (total * slack < count * low)),
            f"sums[{measure!r}]",
            "is not within [count · minimum, count · maximum]",
        )
        where_any(
            finite & ((squares > count * high * high * slack) | (squares * slack * slack < total * total / count)),
            f"sums_of_squares[{measure!r}]",
            "is not within [sum² / count, count · maximum²]",
        )
        for name in _EXTREMES:
            rows = tensor(
                f"{name}[{measure!r}]", paths[name][measure], torch.long, (*shape, layers), "[B, L+1, L] paths"
            )
            check_paths_at(f"{name}[{measure!r}]", rows, empty)
    for measure in _HISTOGRAMS:
        name = f"histograms[{measure!r}]"
        counts_in = tensor(
            name, histograms[measure], torch.long, (*shape, edges.numel() + 1), f"{bins_per_decade} bins per decade"
        )
        where_any(counts_in < 0, name, "is negative")
        m = measured[measure]
        where_any(counts_in.sum(-1) != m, name, "does not sum to the number of paths (counts)")
        # The first and last occupied bins hold the minimum and the maximum.
        occupied = counts_in > 0
        first_bin = torch.where(occupied.any(-1), occupied.long().argmax(-1), -1)
        last_bin = torch.where(occupied.any(-1), edges.numel() - occupied.flip(-1).long().argmax(-1), -1)
        low_bin = torch.bucketize(extremes["minima"][measure].clamp_max(1e300), edges, right=True)
        high_bin = torch.bucketize(extremes["maxima"][measure].clamp(0, 1e300), edges, right=True)
        where_any((m > 0) & (first_bin != low_bin), name, f"does not begin at the bin of minima[{measure!r}]")
        where_any((m > 0) & (last_bin != high_bin), name, f"does not end at the bin of maxima[{measure!r}]")
    top_values = tensor("top_values", state["top_values"], torch.float64, (*shape, top_k), f"[B, L+1, top_k = {top_k}]")
    top_paths = tensor("top_paths", state["top_paths"], torch.long, (*shape, top_k, layers), "[B, L+1, top_k, L]")
    where_any(top_values.isnan() | ((top_values < 0) & (top_values != -math.inf)), "top_values", "is NaN or negative")
    where_any(top_values[..., 1:] > top_values[..., :-1], "top_values", "is not in descending order")
    kept = (top_values != -math.inf).sum(-1)
    where_any(kept != measured["ratio"].clamp_max(top_k), "top_values", "does not hold min(top_k, count) ratios")
    if top_k:
        where_any(
            (measured["ratio"] > 0) & (top_values[..., 0] != extremes["maxima"]["ratio"]),
            "top_values",
            "does not begin with maxima['ratio']",
        )
    check_paths_at("top_paths", top_paths, top_values == -math.inf)
    return state


def _described(value) -> str:
    """A field's value for a message: a tensor's dtype and shape, or its type."""
    if isinstance(value, Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor {list(value.shape)}"
    return f"a {type(value).__name__}"


def path_statistics(
    attn: Tensor,
    tree: PathTree,
    *,
    x: Tensor | None = None,
    w_v: Tensor | None = None,
    w_o: Tensor | None = None,
    top_k: int = 0,
    bins_per_decade: int = 10,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    progress: bool = False,
    group=None,
    all_ranks: bool = False,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: float = 180.0,
    token_mask: Tensor | None = None,
    leaf_kernel: str = "auto",
    max_paths: int = DEFAULT_MAX_PATHS,
) -> PathStatistics | None:
    """Exact per-length statistics of the residual ratio, residual and norm of every path.

    The same quantities as :func:`pathkernels.path_residuals` (attention products, or path outputs
    ``P_p X W_p`` with ``x``, ``w_v`` and ``w_o``), reduced chunk by chunk on attn's device as the
    engine produces them, so that no per-path result outlives its chunk: memory is
    ``O(B · (L+1) · bins + B · (L+1) · top_k)`` beyond one chunk, for trees of any size.

    For each batch element b and path length k: the count, float64 sums and sums of squares of the
    ratio, the residual and the norm; their minima and maxima with the path where each first
    occurs; log-binned histograms of the ratio and the residual (``bins_per_decade`` bins per
    decade from float64's smallest positive number to 10, plus a bin of exact zeros and an
    overflow bin); the sum of log10 ratio over the ratios that are not 0; and, with
    ``top_k > 0``, the ``top_k`` largest ratios and their paths. A path that an explicit tree
    (:meth:`PathTree.from_paths`) lists more than once counts as often as it is listed, as in
    :func:`pathkernels.path_residuals` and ``tree.count_by_length()`` (and may fill several of the
    top places).

    Args:
        attn, tree, x, w_v, w_o, memory_budget, progress, leaf_kernel: as in
            :func:`pathkernels.path_residuals` (``leaf_kernel``: CUDA's leaf kernel, ignored on CPU).
        top_k: how many of the largest ratios to keep per batch element and length.
        bins_per_decade: histogram resolution (quantiles are read to within ``10^(1/bins) − 1``).
        group, all_ranks: as in :func:`pathkernels.path_residuals`: every rank streams its
            contiguous share of the leaves and keeps its own statistics; one gather combines them
            in rank order (counts, sums and histograms add, extremes compare, top paths merge).
            The result is the one-process result except for the float64 summation order of the
            sums (the ranks' partial sums are added last), a relative difference of about 1e-16.
        checkpoint: a folder: every ``checkpoint_every`` seconds (and at the end) each rank writes
            its partial statistics and the leaf it has reached there, atomically (write, then
            rename). A rerun with the same inputs and folder resumes where it stopped and gives
            exactly the statistics of an uninterrupted run; different inputs (or a different
            budget, bins, top_k, thread count or number of ranks) are refused. So is a checkpoint
            whose contents contradict themselves (:func:`checked_state`) or the engine: the paths
            it records as extremes and top are evaluated again, and their values must be the
            engine's (:func:`check_recorded_paths`). The folder is created and checked writable
            before any work (an empty path, an existing file or a folder that cannot be written
            is refused), and one run at a time writes a checkpoint file: it holds
            ``rank<r>-of-<world>.pt.lock`` (its pid and host) while it runs, so that a second run
            on the same folder, in another process or thread, is refused; a lock left by a run
            that has ended is taken over.
        token_mask: ``[B, n]`` (1 = a real token), or taken from an AttentionStack: each batch
            element is measured on its real tokens, as in :func:`pathkernels.path_residuals`
            (one stream per group of equal masks; with a checkpoint, each group keeps its files
            in a subfolder ``mask-group-<i>``).
        max_paths: the most paths (the tree's leaves) the call streams: a larger tree is refused
            before any work, with the time it would take at the measured rates (10^10 paths, the
            default, take half an hour on an H200 and up to a day on 2 CPU cores). Pass a tree
            with ``max_length``, a sample (:func:`pathkernels.decompose` with ``num_samples``),
            or a larger ``max_paths`` for a long run (with a ``checkpoint``).

    Returns:
        :class:`PathStatistics`, with the paths of the extremes and of the largest ratios; with a
        group, None on ranks other than 0 unless ``all_ranks``.
    """
    return stream_statistics(
        attn,
        tree,
        "pathkernels.path_statistics",
        x=x,
        w_v=w_v,
        w_o=w_o,
        top_k=top_k,
        bins_per_decade=bins_per_decade,
        memory_budget=memory_budget,
        progress=progress,
        group=group,
        all_ranks=all_ranks,
        checkpoint=checkpoint,
        checkpoint_every=checkpoint_every,
        token_mask=token_mask,
        leaf_kernel=leaf_kernel,
        max_paths=max_paths,
    )


def stream_statistics(
    attn: Tensor,
    tree: PathTree,
    where: str,
    *,
    x: Tensor | None = None,
    w_v: Tensor | None = None,
    w_o: Tensor | None = None,
    top_k: int = 0,
    bins_per_decade: int = 10,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    progress: bool = False,
    group=None,
    all_ranks: bool = False,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: float = 180.0,
    token_mask: Tensor | None = None,
    leaf_kernel: str = "auto",
    max_paths: int = DEFAULT_MAX_PATHS,
) -> PathStatistics | None:
    """:func:`path_statistics` on behalf of ``where``, the public function the user called (such
    as ``"pathkernels.decompose"``): its checks, errors and warnings name that function."""
    top_k = check_int(top_k, "top_k", where, minimum=0)
    bins_per_decade = check_int(bins_per_decade, "bins_per_decade", where, minimum=1, maximum=1000)
    progress, all_ranks = check_flag(progress, "progress", where), check_flag(all_ranks, "all_ranks", where)
    if checkpoint is not None and not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(
            f"{where}: expected checkpoint to be a folder (a str or os.PathLike) or None, got "
            f"{type(checkpoint).__name__} {checkpoint!r}"
        )
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, numbers.Real):
        raise TypeError(
            f"{where}: expected checkpoint_every to be a number of seconds, got "
            f"{type(checkpoint_every).__name__} {checkpoint_every!r}"
        )
    if not checkpoint_every >= 0:  # NaN too
        raise ValueError(f"{where}: expected checkpoint_every >= 0 seconds, got {checkpoint_every!r}")
    checkpoint = check_checkpoint_folder(checkpoint, where)
    if isinstance(tree, PathTree):  # anything else is refused by the checks below
        max_paths = check_max_paths(
            tree.num_leaves,
            max_paths,
            where,
            "Stream a tree with max_length (PathTree.complete(..., max_length=k)), sample paths (pk.decompose with "
            "num_samples or samples_per_length), or use pk.length_sums for exact sums per length",
        )
    attn, x, w_v, w_o, token_mask = unpack_stack(attn, x, w_v, w_o, token_mask, where)
    if isinstance(tree, PathTree) and isinstance(attn, Tensor) and attn.dim() in (4, 5):
        batch = attn.shape[0] if attn.dim() == 5 else 1
        check_accumulators_fit(batch, tree.num_layers, bins_per_decade, top_k, attn.device, where)
    kernel = op_leaf_kernel(leaf_kernel, False, attn, where)
    options = {
        "w_v": w_v,
        "w_o": w_o,
        "top_k": top_k,
        "bins_per_decade": bins_per_decade,
        "memory_budget": memory_budget,
        "progress": progress,
        "group": group,
        "all_ranks": all_ranks,
        "checkpoint_every": checkpoint_every,
        "leaf_kernel": leaf_kernel,
        "max_paths": max_paths,
    }
    if token_mask is not None:
        return _masked_statistics(attn, tree, x, token_mask, checkpoint, where, options)
    group = distributed.resolve_group(group, where)
    if group is None:
        net, memory_budget = check_inputs(attn, tree, x, w_v, w_o, memory_budget, where, results=False)
        settings = _Settings(
            memory_budget, bins_per_decade, top_k, checkpoint, checkpoint_every, progress, kernel, 0, 1
        )
        return _stream(net, tree, 0, tree.num_leaves, settings, where, None)

    import torch.distributed as dist

    net, error, summary = None, None, None
    try:
        net, memory_budget = check_inputs(attn, tree, x, w_v, w_o, memory_budget, where, results=False)
        summary = distributed.fingerprint({"attn": net.attn, "x": net.x, "w_v": net.w_v, "w_o": net.w_o}, tree)
    except Exception as caught:  # every rank must learn of it, or the others would wait forever
        error = caught
    distributed.agree(where, group, error, summary)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    first, last = distributed.leaf_range(tree.num_leaves, world, rank)
    settings = _Settings(
        memory_budget, bins_per_decade, top_k, checkpoint, checkpoint_every, progress and rank == 0, kernel, rank, world
    )
    stats = None
    try:
        stats = _stream(net, tree, first, last, settings, where, summary)
    except Exception as caught:
        error = caught
    distributed.agree(where, group, error)
    local = stats.to("cpu")
    gathered: list = [None] * world
    if all_ranks:
        dist.all_gather_object(gathered, local, group=group)
    else:
        dist.gather_object(local, gathered if rank == 0 else None, dst=dist.get_global_rank(group, 0), group=group)
        if rank != 0:
            return None
    merged = gathered[0]
    for part in gathered[1:]:
        merged = merged.merge(part)
    return merged.to(net.attn.device)


# Copies of the accumulators a run may hold at once: its own, and one more (a checkpoint's bytes
# while it is written, a merge's result, a padded batch's assembled statistics).
ACCUMULATOR_COPIES = 2


def accumulator_bytes(batch: int, num_layers: int, bins_per_decade: int, top_k: int) -> int:
    """Bytes of :class:`PathStatistics`' tensors for ``batch`` elements of ``num_layers`` layers:
    per (element, length), two histograms of ``bins + 1`` int64 bins, ``top_k`` float64 ratios with
    their int64 paths, the extremes' paths and the float64 sums (a few dozen numbers)."""
    bins = histogram_edges(bins_per_decade).numel() + 1
    per_length = 8 * (2 * bins + top_k * (1 + num_layers) + 2 * len(_MEASURES) * num_layers + 24)
    return batch * (num_layers + 1) * per_length


def check_accumulators_fit(
    batch: int, num_layers: int, bins_per_decade: int, top_k: int, device: torch.device, where: str
) -> None:
    """Refuse (ValueError) before any work the statistics whose accumulators, chiefly the top_k paths
    and the histograms, would not fit the memory ``device`` has free (:data:`ACCUMULATOR_COPIES`
    copies of them), naming top_k and bins_per_decade, rather than fail in the allocator."""
    need = ACCUMULATOR_COPIES * accumulator_bytes(batch, num_layers, bins_per_decade, top_k)
    check_fits(
        need,
        device,
        where,
        f"top_k={top_k:,} (the largest ratios and their paths of {num_layers} layers) and bins_per_decade="
        f"{bins_per_decade} (histograms), kept per batch element and path length for B = {batch} × "
        f"{num_layers + 1} lengths, need about",
        "pass a smaller top_k (the paths of PathStatistics.top), or fewer bins_per_decade",
    )


def _masked_statistics(attn, tree: PathTree, x, token_mask, checkpoint, where: str, options: dict):
    """path_statistics of each batch element on its real tokens: one stream per group of equal
    masks, placed into the batch's rows."""
    net, mask = check_masked_network(attn, x, options["w_v"], options["w_o"], token_mask, where)
    options = {**options, "w_v": net.w_v, "w_o": net.w_o}  # in the compute dtype
    if mask is None:
        return stream_statistics(net.attn, tree, where, x=net.x, checkpoint=checkpoint, **options)
    out = None
    for index, group, group_attn, group_x in mask_group_inputs(net, mask, where):
        folder = None if checkpoint is None else Path(checkpoint) / f"mask-group-{index}"
        part = stream_statistics(group_attn, tree, where, x=group_x, checkpoint=folder, **options)
        if part is None:  # a rank other than 0 of a process group: the statistics went to rank 0
            continue
        if out is None:
            batch = net.attn.shape[0]
            out = PathStatistics.empty(batch, tree, part.dtype, part.bins_per_decade, part.top_k, part.counts.device)
        out.place(group.batch, part)
    return out


@dataclass(frozen=True)
class _Settings:
    memory_budget: int
    bins_per_decade: int
    top_k: int
    checkpoint: str | os.PathLike | None
    checkpoint_every: float
    progress: bool
    leaf_kernel: str  # the engine op's (engine.op_leaf_kernel)
    rank: int
    world: int


def _stream(
    net, tree: PathTree, first: int, last: int, settings: _Settings, where: str, fingerprint: dict | None
) -> PathStatistics:
    """The statistics of leaves ``first..last-1``, chunk by chunk, resuming from a checkpoint.
    ``fingerprint``: the inputs' :func:`distributed.fingerprint`, when the caller has it."""
    stats = PathStatistics.empty(
        net.attn.shape[0], tree, net.attn.dtype, settings.bins_per_decade, settings.top_k, net.attn.device
    )
    if settings.checkpoint is None:
        return _stream_from(stats, first, net, tree, first, last, settings, where, None)
    store = _Checkpoint(settings, net, tree, first, last, where, fingerprint)
    with store.locked():  # one writer per checkpoint file: a second run is refused, not interleaved
        reached = first
        resumed = store.load()
        if resumed is not None:
            stats, reached = resumed[0].to(net.attn.device), resumed[1]
            # Consistent edits (extremes scaled together, an argmin swapped, another input's statistics
            # under this input's identity) pass the checks of the contents: the engine's values at the
            # recorded paths do not.
            check_recorded_paths(
                stats,
                lambda paths: _engine_values(net, tree.num_heads, paths, settings, where),
                where,
                f"the checkpoint {store.path} is not consistent with its inputs",
                _CHECKPOINT_ADVICE,
            )
        return _stream_from(stats, reached, net, tree, first, last, settings, where, store)


def _stream_from(
    stats: PathStatistics,
    reached: int,
    net,
    tree: PathTree,
    first: int,
    last: int,
    settings: _Settings,
    where: str,
    store: _Checkpoint | None,
) -> PathStatistics:
    """:func:`_stream` from leaf ``reached`` on, ``stats`` those of leaves ``first..reached-1``."""
    bar = progress_bar(last - first, enabled=settings.progress, desc="pathkernels statistics")
    if bar is not None and reached > first:
        bar.update(reached - first)
    saved_at = time.monotonic()
    try:
        with torch.no_grad():
            # The chunks are those of an uninterrupted run (the same boundaries, so the same float64
            # summation order); those already folded into a checkpoint are skipped.
            resumed_at = reached
            pieces = (
                (start, stop, chunk, leaf_block, to_device(chunk.leaf_position, net.attn.device))
                for start, stop, chunk, leaf_block in chunks(
                    tree, net, settings.memory_budget, first, last, where=where
                )
                if stop > resumed_at
            )
            for start, stop, residual, norm in chunk_reports(
                net, tree, pieces, settings.leaf_kernel, settings.memory_budget
            ):
                if start != reached:
                    raise ValueError(
                        f"{where}: the checkpoint {store.path if store else ''} is not consistent: reached is "
                        f"{reached:,}, inside a chunk of this run (leaves {start:,} to {stop:,}). Delete it, or pass "
                        "another checkpoint folder, to start afresh."
                    )
                # The values path_residuals would report (float32-rounded where float32 holds them).
                lengths = to_device(tree.leaf_lengths(start, stop), residual.device)
                paths_of = lambda reports, start=start: tree.leaf_paths(reports + start)  # noqa: E731
                repeats = tree.leaf_multiplicities(start, stop)
                if repeats is not None:  # a path listed several times counts as often as listed
                    leaf = torch.arange(start, stop).repeat_interleave(repeats)  # each report's leaf
                    paths_of = lambda reports, leaf=leaf: tree.leaf_paths(leaf[reports.cpu()])  # noqa: E731
                    repeats = to_device(repeats, residual.device)
                    residual, norm = residual.repeat_interleave(repeats, 1), norm.repeat_interleave(repeats, 1)
                    lengths = lengths.repeat_interleave(repeats)
                stats.add(residual, norm, lengths, paths_of)
                reached = stop
                if bar is not None:
                    bar.update(stop - start)
                if store is not None and time.monotonic() - saved_at >= settings.checkpoint_every:
                    store.save(stats, reached)
                    saved_at = time.monotonic()
    finally:
        if bar is not None:
            bar.close()
    if store is not None:
        store.save(stats, reached)
    return stats


def _engine_values(net, num_heads: int, paths: Tensor, settings: _Settings, where: str) -> tuple[Tensor, Tensor]:
    """The residuals and norms ``[B, M]`` (float64, on the CPU) that the engine reports for
    ``paths [M, L]`` (sorted, unique) of the checked network ``net``, by the same chunks, kernel and
    budget as a stream: what :func:`check_recorded_paths` compares a resumed checkpoint with."""
    tree = PathTree.from_paths(paths, num_heads=num_heads)
    pieces = (
        (start, stop, chunk, leaf_block, to_device(chunk.leaf_position, net.attn.device))
        for start, stop, chunk, leaf_block in chunks(tree, net, settings.memory_budget, 0, tree.num_leaves, where=where)
    )
    residuals, norms = [], []
    with torch.no_grad():
        for _, _, residual, norm in chunk_reports(net, tree, pieces, settings.leaf_kernel, settings.memory_budget):
            residuals.append(residual.double().cpu())
            norms.append(norm.double().cpu())
    leaf = tree.leaf_of_path()  # the leaves are the unique paths, sorted: the paths themselves here
    return torch.cat(residuals, 1)[:, leaf], torch.cat(norms, 1)[:, leaf]


# How far a recorded extreme or top ratio may lie from the engine's value at its path, computed
# again, relative to the path's norm (the ratio's: to 1 + the ratio). The same engine on the same
# inputs gives the same bits on one device (float64 and float32 alike, measured); across devices
# and kernels float32 differs by up to about 5e-7 (the "tf32x3" kernels: docs/DESIGN.md), float64
# by about 1e-15. Edits of 1 % (minima × 0.99) lie far beyond either.
RECOMPUTED_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
_VERIFY_BLOCK = 1 << 22  # (batch element, path) values computed again at a time


def check_recorded_paths(stats: PathStatistics, evaluate, where: str, what: str, advice: str) -> None:
    """Refuse statistics whose recorded paths the engine contradicts: the paths of the extremes
    (``argmin``/``argmax`` of each measure) and of the top ratios are evaluated again, by
    ``evaluate(paths [M, L]) -> (residual, norm)`` ``[B, M]`` float64, and each recorded value must
    equal the engine's at its path, in its batch element, within :data:`RECOMPUTED_TOLERANCE` of the
    statistics' dtype: else ``"{where}: {what}: {field} at index … is …, but the engine gives ….
    {advice}"`` (``what`` says what the statistics are and that they do not match).

    What this catches: extremes or top ratios edited (even together, so that the contents stay
    consistent), a path swapped for another, statistics of other inputs. What it cannot: edits of
    the counts, sums, sums of squares, log sums or histograms that keep them consistent with each
    other and with the extremes (:func:`checked_state` bounds them; they are not recomputed, which
    would take the whole run)."""
    layers = stats.num_layers
    batch = stats.counts.shape[0]
    fields_of = [
        (f"{extreme}[{measure!r}]", getattr(stats, extreme)[measure], values[measure], measure)
        for extreme, values in (("argmin", stats.minima), ("argmax", stats.maxima))
        for measure in _MEASURES
    ]
    if stats.top_k:
        fields_of.append(("top_values", stats.top_paths, stats.top_values, "ratio"))
    rows = [paths.cpu().reshape(batch, -1, layers) for _, paths, _, _ in fields_of]
    flat = torch.cat(rows, 1).reshape(-1, layers)
    present = flat[:, 0] != _NO_PATH
    if not bool(present.any()):
        return
    unique, inverse = torch.unique(flat[present], dim=0, sorted=True, return_inverse=True)
    index = torch.full((flat.shape[0],), -1, dtype=torch.long)
    index[present] = inverse
    index = index.view(batch, -1)  # [B, recorded rows]: each row's path among the unique ones
    stored = torch.cat([values.cpu().reshape(batch, -1) for _, _, values, _ in fields_of], 1)
    measure_of = torch.cat(
        [torch.full((paths[0].numel() // layers,), _MEASURES.index(m)) for _, paths, _, m in fields_of]
    )
    field_of = torch.cat([torch.full((paths[0].numel() // layers,), i) for i, (_, paths, _, _) in enumerate(fields_of)])
    tolerance = RECOMPUTED_TOLERANCE.get(stats.dtype, 1e-4)
    block = max(1, _VERIFY_BLOCK // batch)
    for start in range(0, unique.shape[0], block):
        stop = min(start + block, unique.shape[0])
        residual, norm = evaluate(unique[start:stop])
        if residual.shape[0] != batch:
            raise ValueError(
                f"{where}: {what}: the statistics are of {batch} batch elements, but the inputs have "
                f"{residual.shape[0]}. {advice}"
            )
        inside = (index >= start) & (index < stop)
        column = (index - start).clamp(0, stop - start - 1)
        r, n = residual.gather(1, column), norm.gather(1, column)
        value = torch.stack([r / n, r, n])  # [3, B, rows]: ratio, residual, norm
        value = value.gather(0, measure_of.expand(batch, -1).unsqueeze(0))[0]
        scale = torch.where(measure_of == 0, 1 + value.abs(), n)
        ok = (value == stored) | ((value - stored).abs() <= tolerance * scale)
        bad = inside & ~ok
        if bool(bad.any()):
            b, row = (int(i) for i in bad.nonzero()[0])
            name, paths, _, _ = fields_of[int(field_of[row])]
            position = row - int((field_of < field_of[row]).sum())
            location = [b, *torch.unravel_index(torch.tensor(position), paths.shape[1:-1])]
            raise ValueError(
                f"{where}: {what}: {name} at index {[int(i) for i in location]} "
                f"is {float(stored[b, row]):.17g}, but the engine gives {float(value[b, row]):.17g} at its path "
                f"{unique[int(index[b, row])].tolist()} (a difference beyond the engine's precision, {tolerance:g} "
                f"relative). {advice}"
            )


_CHECKPOINT_ADVICE = "Delete it, or pass another checkpoint folder, to start afresh."


def check_checkpoint_folder(checkpoint, where: str) -> Path | None:
    """``checkpoint`` (None, or a folder as a str or os.PathLike) as a Path, the folder created and
    checked writable before any work: an empty path (which would write into the working directory),
    an existing file, or a folder that cannot be created or written to is refused, naming ``where``."""
    if checkpoint is None:
        return None
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(
            f"{where}: expected checkpoint to be a folder (a str or os.PathLike) or None, got "
            f"{type(checkpoint).__name__} {checkpoint!r}"
        )
    text = os.fspath(checkpoint)
    if isinstance(text, bytes) or not text.strip():
        raise ValueError(
            f"{where}: expected checkpoint to be a folder's path, got {checkpoint!r} (an empty path would write "
            "into the working directory: pass '.' for that)"
        )
    folder = Path(text)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{where}: expected checkpoint to be a folder, got {str(folder)!r}, an existing file")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=folder, prefix=".pathkernels-probe-", delete=True)
        probe.close()
    except OSError as error:
        raise ValueError(
            f"{where}: cannot write checkpoints to the folder checkpoint={str(folder)!r}: "
            f"{error.strerror or error}; pass a folder this process may write to"
        ) from None
    return folder


# The checkpoint locks this process holds (their paths), so that a second run in another thread,
# which shares the pid written in the lock, is refused, while a lock this process left behind is
# taken over.
_HELD_LOCKS: set[str] = set()
_HELD_LOCKS_GUARD = threading.Lock()


def _process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this machine (a process of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError among them: it runs, as another user
        return True
    return True


# Raised when what a checkpoint holds changes meaning: 2 when the histograms' bin 0 came to hold
# exact zeros only and the log sums to leave them out; 3 when checkpoints became sealed files
# (pathkernels/_files.py) with a SHA-256 of the inputs in their identity; 4 when zero paths (norm
# 0) left the ratio's sums for a count of their own (zero_norms).
_CHECKPOINT_FORMAT = 4


class _Checkpoint:
    """One rank's partial statistics in ``folder/rank<r>-of-<world>.pt``, with what they are of."""

    def __init__(
        self, settings: _Settings, net, tree: PathTree, first: int, last: int, where: str, fingerprint: dict | None
    ):
        self.where = where
        folder = Path(settings.checkpoint)
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"rank{settings.rank}-of-{settings.world}.pt"
        if fingerprint is None:
            fingerprint = distributed.fingerprint({"attn": net.attn, "x": net.x, "w_v": net.w_v, "w_o": net.w_o}, tree)
        identity = dict(fingerprint)
        tree_paths = None if tree.is_complete else tree.paths()  # a complete tree is its repr, in the fingerprint
        identity.update(
            format=_CHECKPOINT_FORMAT,
            inputs_sha256=tensor_digest(
                {"attn": net.attn, "x": net.x, "w_v": net.w_v, "w_o": net.w_o, "paths": tree_paths}
            ),
            leaves=[first, last],
            memory_budget=settings.memory_budget,
            bins_per_decade=settings.bins_per_decade,
            top_k=settings.top_k,
            leaf_kernel=settings.leaf_kernel if net.attn.device.type == "cuda" else None,  # the CPU ignores it
            device=net.attn.device.type,
            threads=torch.get_num_threads() if net.attn.device.type == "cpu" else 1,
        )
        self.identity = identity
        self.tree = tree
        self.expected = {
            "num_layers": tree.num_layers,
            "num_heads": tree.num_heads,
            "skip": tree.skip,
            "dtype": net.attn.dtype,
            "bins_per_decade": settings.bins_per_decade,
            "top_k": settings.top_k,
            "batch": net.attn.shape[0],
        }

    @contextlib.contextmanager
    def locked(self):
        """Hold ``<file>.lock`` for the block: created exclusively (``O_CREAT | O_EXCL``) with this
        process's pid, host and a token of its own, and removed at the end. A lock whose process
        has ended (on this host), or that this process left behind, is stale: taken over (renamed
        away, then created afresh). Any other lock, another run's (in another thread of this
        process too), is refused before any work, naming the checkpoint and the holder."""
        lock = self.path.with_name(self.path.name + ".lock")
        key = str(lock.resolve())
        with _HELD_LOCKS_GUARD:  # threads share the pid: they are told apart here
            busy = key in _HELD_LOCKS
            if not busy:
                _HELD_LOCKS.add(key)
        if busy:
            self._refuse_lock(lock, "another run in this process (another thread)")
        try:
            token = f"{os.getpid()} {socket.gethostname()} {uuid.uuid4().hex}"
            if not self._acquire(lock, token):
                holder = _read_lock(lock)
                parts = (holder or "").split()
                who = f"the run of process {parts[0]} on {parts[1]}" if len(parts) == 3 else "another run"
                self._refuse_lock(lock, who)
            try:
                yield
            finally:
                if _read_lock(lock) == token:
                    with contextlib.suppress(OSError):
                        os.unlink(lock)
        finally:
            with _HELD_LOCKS_GUARD:
                _HELD_LOCKS.discard(key)

    def _refuse_lock(self, lock: Path, who: str):
        raise ValueError(
            f"{self.where}: the checkpoint {self.path} is in use by {who}: two runs cannot write one checkpoint. "
            f"Wait for that run to end, or pass another checkpoint folder (if no run uses it, delete {lock})"
        )

    def _acquire(self, lock: Path, token: str) -> bool:
        """Create ``lock`` holding ``token``, taking over a stale one; False where another run holds it."""
        for _ in range(3):  # each round takes over at most one stale lock
            try:
                descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = _read_lock(lock)
                if holder is None or not _stale(holder):
                    return False
                stale = lock.with_name(f"{lock.name}.stale-{uuid.uuid4().hex}")
                try:
                    os.rename(lock, stale)  # atomic: of two runs taking it over, one renames it
                except FileNotFoundError:
                    continue
                if _read_lock(stale) != holder:  # a newer lock, created meanwhile: put it back
                    with contextlib.suppress(OSError):
                        os.link(stale, lock)
                    with contextlib.suppress(OSError):
                        os.unlink(stale)
                    return False
                with contextlib.suppress(OSError):
                    os.unlink(stale)
                continue
            except OSError as error:
                raise ValueError(
                    f"{self.where}: cannot create the checkpoint lock {lock}: {error.strerror or error}; pass a "
                    "checkpoint folder this process may write to"
                ) from None
            with os.fdopen(descriptor, "w") as file:
                file.write(token + "\n")
            return True
        return False

    def load(self) -> tuple[PathStatistics, int] | None:
        if not self.path.exists():
            return None
        advice = _CHECKPOINT_ADVICE
        state = read_sealed(self.path, self.where, "the checkpoint", advice)
        if not (isinstance(state, dict) and isinstance(state.get("identity"), dict) and "statistics" in state):
            raise ValueError(f"{self.where}: the checkpoint {self.path} is not one of path_statistics'. {advice}")
        differing = [key for key in self.identity if state["identity"].get(key) != self.identity[key]]
        if differing:
            raise ValueError(
                f"{self.where}: the checkpoint {self.path} was written for other inputs or settings "
                f"({', '.join(differing)} differ); use another folder, or delete it to start afresh"
            )
        # Intact bytes and the right identity still leave the contents to check: a file edited and
        # sealed again, or written by a faulty run, must not resume into wrong statistics.
        what = f"the checkpoint {self.path}"
        first, last = self.identity["leaves"]
        reached = state.get("reached")
        if isinstance(reached, bool) or not isinstance(reached, int) or not first <= reached <= last:
            raise ValueError(
                f"{self.where}: {what} is not consistent: reached is {reached!r}, expected a leaf in "
                f"[{first:,}, {last:,}] (this rank's leaves). {advice}"
            )
        statistics = checked_state(
            state["statistics"],
            self.where,
            what,
            advice,
            expected=self.expected,
            leaves=(first, reached),
            tree=self.tree,
        )
        return PathStatistics.from_state(statistics), reached

    def save(self, stats: PathStatistics, reached: int) -> None:
        write_sealed(self.path, {"identity": self.identity, "reached": reached, "statistics": stats.state()})


def _stale(holder: str) -> bool:
    """Whether a lock held by ``holder`` ("pid host token") is left over from a run that has ended:
    a process of this host that is gone, or this process itself (whose live runs hold the lock in
    ``_HELD_LOCKS`` first, so that one it finds on disk was left behind)."""
    parts = holder.split()
    if len(parts) != 3 or not parts[0].isdigit() or parts[1] != socket.gethostname():
        return False  # not a lock of this version, or another host's: it cannot be told stale
    pid = int(parts[0])
    return pid == os.getpid() or not _process_alive(pid)


def _read_lock(lock: Path) -> str | None:
    """The holder a checkpoint lock names ("pid host token"), or None where it cannot be read (gone,
    or not yet written: a run that has just created it)."""
    try:
        text = lock.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text or None
