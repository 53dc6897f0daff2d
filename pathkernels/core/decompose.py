"""The analysis front door: exact or sampled path decompositions with tables, estimators and plots."""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field

import torch
from torch import Tensor

from pathkernels.core._figures import check_save_path, new_figure, require, saved
from pathkernels.core._memory import format_count
from pathkernels.core.checks import check_flag, check_int, named_errors, unpack_stack, validate_inputs
from pathkernels.core.engine import PathResiduals, evaluate_paths
from pathkernels.core.paths import (
    DEFAULT_MAX_PATHS,
    MAX_ENUMERATED_PATHS,
    MAX_LEAVES,
    PathTree,
    check_max_paths,
    check_tree_shape,
    count_attribution_paths_by_length,
    count_by_length,
    sample_paths,
)
from pathkernels.core.planner import DEFAULT_MEMORY_BUDGET
from pathkernels.core.statistics import PathStatistics, stream_statistics

# Exact decompositions whose per-path results would take more than this stream to PathStatistics.
DEFAULT_MAX_RESULT_BYTES = 1 << 30

_MAX_SCATTER = 20_000  # points drawn by PathDecomposition.plot

# decompose(stack) of a stack that holds a captured model: pathkernels.analysis.real_paths registers
# its decomposition here on import (the analysis layer builds on this module, not the reverse).
_model_decomposer = None


def register_model_decomposer(function) -> None:
    """Set what :func:`decompose` calls for a stack with a ``residual_capture``."""
    global _model_decomposer
    _model_decomposer = function


@dataclass
class PathDecomposition:
    """Per-path residual ratios of one network, with the weights that make them estimators.

    ``results`` holds ``residual``, ``norm`` and ``ratio`` ``[B, M]`` for the evaluated paths.
    ``weights[i]`` is how many paths of the decomposed set path i stands for, the inverse of its
    chance to be drawn (Horvitz–Thompson, :func:`sample_weights`): 1 for an exact tree, ``N / n``
    when n distinct paths were drawn uniformly without replacement from all N, and ``count_k / n_k``
    for a path of length k when ``n_k`` distinct paths of that length were drawn (stratified by
    length; the set is then the strata asked for). ``Σ_i weights[i] f(path_i)`` (:meth:`estimate`) is
    an unbiased estimate of ``Σ_p f(p)`` over the set for every sample. What else is estimated:
    :meth:`mean_ratio`'s uniform sample mean and stratified weighted mean are unbiased for the mean
    over the set; a per-length mean of a uniform sample (``by_length``) is unbiased given that the
    length was drawn at all (a length not drawn has no row statistics). Standard errors carry the
    finite-population correction ``sqrt(1 − n_k / count_k)``: a length whose every path was
    evaluated is exact, with standard error 0.

    Zero paths: a path whose term is exactly the zero matrix (norm 0: a path through a pruned head,
    W_O = 0; an all-zero x or value map; a captured model's constant rows at zero-initialised
    biases, and the heads they pass) has no residual ratio: its
    ``results.ratio`` is 0/0 = NaN, and ``to_frame()`` shows it so. Every statistic of the ratio
    (the tables, :meth:`path_ratio`'s batch means, :meth:`mean_ratio`, the plots) leaves such
    (batch element, path) pairs out and counts them in a ``zero_norm`` column: they add nothing
    to the network's output, and counting them as collapsed (ratio 0) would pull the means down.
    Where every pair of a length is a zero path, its ratio columns are 0 (the zero matrix's
    residual is 0), never NaN.
    """

    results: PathResiduals
    method: str  # "exact", "uniform" or "stratified"
    num_layers: int
    num_heads: int
    skip: bool
    path_counts: list[int]  # exact number of paths of each length 0..L in the decomposed set
    weights: Tensor = field(repr=False)  # [M] float64

    @property
    def paths(self) -> Tensor:
        return self.results.paths

    @property
    def lengths(self) -> Tensor:
        return self.results.lengths

    def path_ratio(self) -> Tensor:
        """``[M]``: each path's residual ratio, averaged over the batch elements where the path is
        not a zero path (NaN where it is one in every element)."""
        return self._ratios().nanmean(0)

    def _ratios(self) -> Tensor:
        """``[B, M]`` float64 ratios, NaN at zero paths (norm 0), whatever 0/0 gave."""
        ratio = self.results.ratio.double().reshape(-1, self.paths.shape[0])
        norm = self.results.norm.reshape(-1, self.paths.shape[0])
        return torch.where(norm.to(ratio.device) == 0, math.nan, ratio)

    def to_frame(self):
        """A pandas DataFrame, one row per evaluated path.

        Columns: ``path`` (TransformerLens head labels of the heads taken, in layer order, e.g.
        ``"L0H1 L2H3"``; ``"skip"`` for the all-skip path), ``length``, ``ratio``, ``residual`` and
        ``norm`` (averaged over the batch; the ratio over the elements where the path is not a
        zero path, NaN for a path that is one in every element) and ``weight`` (how many paths of
        the network it stands for).
        """
        pd = require("pandas")
        residuals = self.results.residual.double().reshape(-1, self.paths.shape[0])
        norms = self.results.norm.double().reshape(-1, self.paths.shape[0])
        labels = [
            " ".join(f"L{layer}H{head}" for layer, head in enumerate(path) if head >= 0) or "skip"
            for path in self.paths.tolist()
        ]
        return pd.DataFrame(
            {
                "path": labels,
                "length": self.lengths.tolist(),
                "ratio": self.path_ratio().tolist(),
                "residual": residuals.mean(0).tolist(),
                "norm": norms.mean(0).tolist(),
                "weight": self.weights.tolist(),
            }
        )

    def by_length(self):
        """A pandas DataFrame, one row per path length k that has paths.

        Columns: ``length``, ``path_count`` (exact, a Python int), ``evaluated`` (paths), ``exact``
        (every path of that length evaluated), then statistics of the residual ratio over every
        (batch element, evaluated path) pair of that length, pooled, zero paths left out (the
        class docstring): ``mean``, ``stderr`` (0 where exact; else ``s/sqrt(n') · sqrt(1 −
        n/count)``, s the standard deviation of the n' paths' batch means, since paths are what
        is sampled), ``median``, ``q10``, ``q90``, ``min``, ``max``, ``zeros`` (pairs whose ratio
        is exactly 0: below float64's range, or a path whose rows are all equal), ``zero_norm``
        (pairs that are zero paths, left out) and ``log10_mean`` (the mean of log10 ratio over
        the pairs whose ratio is not 0; NaN where there is none). The streamed table of
        :meth:`PathStatistics.by_length` has these columns with the same definitions, its median
        and quantiles read from a histogram.
        """
        pd = require("pandas")
        ratio = self._ratios().cpu()  # [B, M], NaN at zero paths
        zero_paths = self.results.norm.reshape(ratio.shape).cpu() == 0
        path_means = ratio.nanmean(0)
        lengths = self.lengths.cpu()
        rows = []
        for k, count in enumerate(self.path_counts):
            if count == 0:
                continue
            chosen = lengths == k
            pairs = ratio[:, chosen].flatten()
            values = pairs[~zero_paths[:, chosen].flatten()]  # the pairs with a ratio
            evaluated = int(chosen.sum())
            exact = evaluated >= count  # sampled paths are distinct, so this means all of them
            row = {"length": k, "path_count": count, "evaluated": evaluated, "exact": exact}
            if evaluated:
                means = path_means[chosen]
                means = means[~means.isnan()]  # the paths that are not zero paths in every element
                std = means.std(correction=1).item() if means.numel() > 1 else math.nan
                stderr = std / math.sqrt(means.numel()) * math.sqrt(1 - evaluated / count) if means.numel() else 0.0
                numbers = values[~values.isnan()]
                nonzero = values[values != 0]
                some = values.numel() > 0  # else every pair is a zero path: its columns are 0
                row.update(
                    mean=values.mean().item() if some else 0.0,
                    stderr=0.0 if exact else stderr,
                    median=values.quantile(0.5).item() if some else 0.0,  # interpolated, as the others
                    q10=values.quantile(0.1).item() if some else 0.0,
                    q90=values.quantile(0.9).item() if some else 0.0,
                    min=numbers.min().item() if numbers.numel() else 0.0,
                    max=numbers.max().item() if numbers.numel() else 0.0,
                    zeros=int((values == 0).sum()),
                    zero_norm=pairs.numel() - values.numel(),
                    log10_mean=nonzero.log10().mean().item() if nonzero.numel() else math.nan,
                )
            rows.append(row)
        frame = pd.DataFrame(rows)
        frame["path_count"] = frame["path_count"].astype(object)  # exact counts may exceed int64
        return frame

    def estimate(self, values: Tensor | None = None) -> float:
        """The Horvitz–Thompson estimate ``Σ_i weights[i] f_i`` of ``Σ_p f(p)`` over every path of the
        decomposed set (exact for an exact tree; unbiased for a sample, the class docstring).

        Args:
            values: ``f_i`` per evaluated path ``[M]``; default the residual ratio averaged over the
                batch (:meth:`path_ratio`), zero paths counted as 0.
        """
        where = "pathkernels.PathDecomposition.estimate"
        if values is None:
            values = self.path_ratio().nan_to_num(nan=0.0)
        if not isinstance(values, Tensor) or values.shape != self.weights.shape:
            got = list(values.shape) if isinstance(values, Tensor) else type(values).__name__
            raise ValueError(f"{where}: expected values of shape [{self.weights.shape[0]}] (one per path), got {got}")
        return float((self.weights * values.double().cpu()).sum())

    def mean_ratio(self) -> tuple[float, float]:
        """Estimate of the mean residual ratio over all paths, with its standard error.

        Over the paths' batch means (:meth:`path_ratio`), zero paths left out (0 if every path is
        one). Exact trees: the plain mean (stderr 0). Uniform sampling (n of N paths, without
        replacement; n' of them not zero paths): the sample mean, ``stderr = s / sqrt(n') ·
        sqrt(1 − n/N)``. Stratified: ``Σ_k w_k mean_k / Σ_k w_k`` with ``w_k = count_k · n'_k /
        n_k`` (the estimated number of paths of length k that are not zero paths: ``count_k``
        when there are none) and ``stderr² = Σ_k (w_k / Σ w)² s_k² / n'_k · (1 − n_k / count_k)``.
        """
        ratio = self.path_ratio()
        lengths = self.lengths.to(ratio.device)
        kept = ~ratio.isnan()
        if self.method in ("exact", "uniform"):
            n, total, values = ratio.numel(), sum(self.path_counts), ratio[kept]
            mean = values.mean().item() if values.numel() else 0.0
            if self.method == "exact" or n >= total:
                return mean, 0.0
            spread = values.std(correction=1).item() if values.numel() > 1 else math.nan
            return mean, spread / math.sqrt(values.numel()) * math.sqrt(1 - n / total) if values.numel() else 0.0
        strata = []  # (w_k, mean_k, variance term before the shares)
        for k, count in enumerate(self.path_counts):
            chosen = lengths == k
            evaluated, values = int(chosen.sum()), ratio[chosen & kept]
            if count == 0 or values.numel() == 0:
                continue
            weight = count * (values.numel() / evaluated)
            term = 0.0
            if evaluated < count:  # an exactly evaluated length adds no variance
                spread = values.var(correction=1).item() if values.numel() > 1 else math.nan
                term = spread / values.numel() * (1 - evaluated / count)
            strata.append((weight, values.mean().item(), term))
        total = sum(weight for weight, _, _ in strata)
        mean = sum(weight / total * stratum_mean for weight, stratum_mean, _ in strata) if strata else 0.0
        variance = sum((weight / total) ** 2 * term for weight, _, term in strata)
        return mean, math.sqrt(variance)

    def plot(self, ax=None, *, path=None, title: str | None = None, apart: Tensor | None = None, apart_label=""):
        """Residual ratio against path length (log scale): every (batch element, evaluated path)
        pair as a point (a random 20,000 of them when there are more), the per-length median and
        the 10–90 % band. Exact zeros have no place on a log scale: they are left out, and the
        legend says how many. ``title``: what the figure shows (say which network; default: the
        method, L and H). ``apart`` ``[M]`` bool: paths drawn apart, in grey under ``apart_label``,
        and left out of the median and the band (a captured model's bias paths). The legend
        stands right of the axes, off the points. Returns the matplotlib Figure; with ``path`` it
        is also saved there (the format from the suffix: .png, .pdf, .svg, …)."""
        check_save_path(path, "pathkernels.PathDecomposition.plot")
        if apart is not None:
            apart = self._checked_apart(apart, "pathkernels.PathDecomposition.plot")
        require("matplotlib")
        if ax is None:
            fig, ax = new_figure(9, 4)
        else:
            fig = ax.figure
        ratio = self._ratios().cpu()
        apart = None if apart is None else apart.cpu()
        band = self.quantiles_by_length(apart) if apart is not None else None
        floor = None
        if apart is not None and bool((ratio[:, apart] > 0).any()):
            aside = ratio[:, apart]
            kept = ratio[:, ~apart]
            kept = kept[kept > 0]
            # The axis spans the paths in the band; those apart below it sit on its bottom edge.
            floor = float(kept.min()) / 3 if kept.numel() else None
            shown_aside = aside > 0
            values = aside[shown_aside]
            if floor is not None:
                values = values.clamp(min=floor)
            ax.scatter(  # (none where the bias rows are 0: zero paths)
                (self.lengths.cpu()[apart].expand_as(aside)[shown_aside]).numpy() + 0.2,
                values.numpy(),
                s=8,
                marker="v",
                color="0.5",
                alpha=0.6,
                label=apart_label,
                clip_on=False,
            )
        lengths = self.lengths.cpu()
        if apart is not None:
            ratio, lengths = ratio[:, ~apart], lengths[~apart]
        lengths = lengths.expand_as(ratio).flatten()
        ratio = ratio.flatten()
        zeros = int((ratio == 0).sum())
        zero_paths = int(ratio.isnan().sum())
        shown = ratio > 0
        ratio, lengths = ratio[shown], lengths[shown]
        generator = torch.Generator().manual_seed(0)
        label = "paths" if self.results.ratio.shape[0] == 1 else "(batch element, path) pairs"
        if ratio.numel() > _MAX_SCATTER:  # a readable (and fast) figure: a random subset of the points
            keep = torch.randperm(ratio.numel(), generator=generator)[:_MAX_SCATTER]
            ratio, lengths = ratio[keep], lengths[keep]
            label = f"{_MAX_SCATTER:,} of {int(shown.sum()):,} {label}"
        if zeros:
            label += f" ({zeros:,} exact zeros not shown)"
        if zero_paths:
            label += f" ({zero_paths:,} zero paths, without a ratio, not shown)"
        jitter = (torch.rand(ratio.shape, generator=generator) - 0.5) * 0.3
        ax.scatter((lengths + jitter).numpy(), ratio.numpy(), s=4, alpha=0.3, label=label)
        table = self.by_length() if band is None else band
        table = table[table["evaluated"] > 0]
        positive = table[["median", "q10", "q90"]].where(table[["median", "q10", "q90"]] > 0)  # 0: not on a log axis
        ax.plot(table["length"], positive["median"], "o-", color="C3", label="median")
        ax.fill_between(table["length"], positive["q10"], positive["q90"], color="C3", alpha=0.2, label="10–90 %")
        ax.set_yscale("log")
        if floor is not None:
            ax.set_ylim(bottom=floor)
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("path length (heads taken)")
        ax.set_ylabel("residual ratio ‖res‖ / ‖·‖ (ℓ1,∞)")
        if title is None:
            ax.set_title(f"{self.method} decomposition: L = {self.num_layers}, H = {self.num_heads}")
        else:
            ax.set_title(textwrap.fill(title, 70), fontsize="small")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
        return saved(fig, path)

    def _checked_apart(self, apart, where: str) -> Tensor:
        """``apart`` as a CPU bool tensor ``[M]``, one flag per evaluated path, or refused by name."""
        count = self.lengths.shape[0]
        if not isinstance(apart, Tensor) or apart.dtype != torch.bool or tuple(apart.shape) != (count,):
            got = f"{list(apart.shape)} {apart.dtype}" if isinstance(apart, Tensor) else type(apart).__name__
            raise ValueError(f"{where}: expected apart to be a bool tensor [M] = [{count}] (one per path), got {got}")
        return apart.cpu()

    def quantiles_by_length(self, apart: Tensor):
        """Per length, the median and the 10–90 % quantiles of the residual ratio over every (batch
        element, path) pair of the paths not ``apart`` (``[M]`` bool; zero paths left out), as a
        DataFrame with :meth:`by_length`'s columns ``length``, ``evaluated`` (pairs), ``median``,
        ``q10`` and ``q90``: the band of :meth:`plot` when it draws paths apart."""
        apart = self._checked_apart(apart, "pathkernels.PathDecomposition.quantiles_by_length")
        pd = require("pandas")
        ratio = self._ratios().cpu()
        rows = []
        lengths = self.lengths.cpu()
        for k in sorted(set(lengths.tolist())):
            pairs = ratio[:, (lengths == k) & ~apart].flatten()
            pairs = pairs[~pairs.isnan()]
            if pairs.numel() == 0:
                continue
            q10, median, q90 = torch.quantile(pairs, torch.tensor([0.1, 0.5, 0.9], dtype=pairs.dtype)).tolist()
            rows.append({"length": k, "evaluated": pairs.numel(), "median": median, "q10": q10, "q90": q90})
        return pd.DataFrame(rows, columns=["length", "evaluated", "median", "q10", "q90"])


def decompose(
    attn: Tensor,
    *,
    x: Tensor | None = None,
    w_v: Tensor | None = None,
    w_o: Tensor | None = None,
    skip: bool = True,
    max_length: int | None = None,
    tree: PathTree | None = None,
    num_samples: int | None = None,
    samples_per_length: int | dict[int, int] | None = None,
    generator: torch.Generator | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    progress: bool = False,
    group=None,
    all_ranks: bool = False,
    token_mask: Tensor | None = None,
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
    max_paths: int = DEFAULT_MAX_PATHS,
) -> PathDecomposition | PathStatistics | None:
    """Decompose an attention network into paths and measure each path's residual ratio.

    One call covers:
    - an exact tree: every path (``(H+1)^L`` with ``skip``, ``H^L`` without), or those of length
      ``≤ max_length``, or an explicit ``tree``;
    - uniform sampling: ``num_samples`` paths drawn uniformly from all paths;
    - stratified sampling: ``samples_per_length`` paths of each length k (an int for every length
      ``≤ max_length``, or a dict ``{k: n_k}``), each drawn as the paper's code does.

    ``skip=True`` by default: the network has skip connections, as transformers do, so its paths
    may skip layers (``(H+1)^L`` of them). :class:`PathTree` and :func:`sample_paths` build bare
    sets of attention products and default to ``skip=False``.

    Shapes as in :func:`pk.path_residuals`: attn ``[B, L, H, n, n]``, optional x ``[B, n, d]``,
    w_v ``[L, H, d, d_head]``, w_o ``[L, H, d_head, d]``. Returns a :class:`PathDecomposition`.
    ``attn`` may be an :class:`~pathkernels.adapters.AttentionStack` (its maps and token mask are
    then the defaults); ``token_mask [B, n]`` evaluates each batch element on its real tokens. A
    stack that holds a captured model (``capture_huggingface_residual``) is decomposed into the
    model's own paths instead, each a source and the heads it passes: every path, those up to
    ``max_length``, or a uniform or stratified sample (:func:`pathkernels.analysis.real_paths.decompose_model`).

    An exact decomposition of a complete tree whose per-path results (residual and norm per path
    and batch element) would exceed ``max_result_bytes`` (1 GiB by default), or 2^31 paths,
    returns the :class:`~pathkernels.PathStatistics` of every path instead, streamed in bounded
    memory: the same ``by_length()`` table, exact except its median and quantiles, which come
    from histograms (``from_histogram`` True, with their error bound).

    ``max_paths`` bounds the work: a call that would evaluate more paths (every path of the tree,
    ``num_samples``, or the sum of ``samples_per_length``) is refused before any work, with the time
    it would take at the measured rates and the ways round (``max_length``, sampling, or a larger
    ``max_paths``). The default, 10^10 paths, is what :func:`pk.path_statistics` streams by
    default: half an hour on an H200, up to a day on 2 CPU cores. It bounds a captured model's
    decomposition too (whose per-path results must also fit ``max_result_bytes``).

    Across processes (``group``, ``all_ranks``: see :func:`pk.path_residuals`) every rank draws the
    same sample from the same ``generator`` state and evaluates a disjoint share of it, so a run is
    reproducible for a given seed whatever the world size, and the estimators are those of one
    process. Ranks whose samples differ are refused up front. Returns None on ranks other than 0
    unless ``all_ranks``.
    """
    where = "pathkernels.decompose"
    ways_round = (
        "Pass max_length (only the short paths), num_samples or samples_per_length (a sample, with standard "
        "errors), or use pk.length_sums for exact sums per length"
    )
    if not isinstance(attn, Tensor) and getattr(attn, "residual_capture", None) is not None:
        options = (("x", x), ("w_v", w_v), ("w_o", w_o), ("tree", tree), ("group", group), ("token_mask", token_mask))
        passed = [name for name, value in options if value is not None] + ([] if skip is True else ["skip"])
        if passed:
            raise ValueError(
                f"{where}: a stack with a residual_capture is decomposed into the model's own paths (every path, "
                f"those up to max_length, or a sample); {', '.join(passed)} do not apply (decompose stack.attn "
                "for its attention products)"
            )
        if _model_decomposer is None:  # pathkernels.core.decompose imported without the analysis layer
            raise ImportError(
                f"{where}: a stack with a residual_capture is decomposed by pathkernels.analysis, which is not "
                "loaded: import pathkernels.analysis (pk.decompose loads it)"
            )
        top = max_length if _is_int(max_length) else attn.num_layers
        model_counts = count_attribution_paths_by_length(attn.num_layers, attn.num_heads, top)
        check_max_paths(
            _model_paths_to_evaluate(model_counts, top, num_samples, samples_per_length), max_paths, where, ways_round
        )
        return _model_decomposer(
            attn,
            max_length=max_length,
            num_samples=num_samples,
            samples_per_length=samples_per_length,
            generator=generator,
            memory_budget=memory_budget,
            progress=progress,
            max_result_bytes=max_result_bytes,
        )
    attn, x, w_v, w_o, token_mask = unpack_stack(attn, x, w_v, w_o, token_mask, where)
    if not isinstance(attn, Tensor) or attn.dim() not in (4, 5):
        raise ValueError(
            f"{where}: expected attn of shape [B, L, H, n, n] or [L, H, n, n], got "
            f"{getattr(attn, 'shape', type(attn).__name__)}"
        )
    validate_inputs(attn, x, w_v, w_o, token_mask, where)
    skip = check_flag(skip, "skip", where)
    if max_length is not None:
        max_length = check_int(max_length, "max_length", where, minimum=0)
    max_result_bytes = check_int(max_result_bytes, "max_result_bytes", where, minimum=0)
    _check_sampling(num_samples, samples_per_length, generator, where)
    layers, heads = attn.shape[-4], attn.shape[-3]
    engine_options = {
        "x": x,
        "w_v": w_v,
        "w_o": w_o,
        "memory_budget": memory_budget,
        "progress": progress,
        "group": group,
        "all_ranks": all_ranks,
    }
    chosen = [
        name
        for name, value in (("tree", tree), ("num_samples", num_samples), ("samples_per_length", samples_per_length))
        if value is not None
    ]
    if len(chosen) > 1:
        raise ValueError(f"{where}: pass at most one of tree, num_samples and samples_per_length, got {chosen}")
    if tree is not None and max_length is not None:
        raise ValueError(
            f"{where}: pass tree or max_length, not both: a tree holds its own paths, which max_length would not "
            f"cut (build the tree with PathTree.complete(..., max_length={max_length})), got max_length="
            f"{max_length} and a tree"
        )
    if tree is not None and not skip and isinstance(tree, PathTree) and tree.skip:
        raise ValueError(
            f"{where}: skip=False (a network without skip connections) and a tree whose paths skip layers "
            "contradict each other: pass skip=True, or a tree without skips (tree and skip are both given; "
            f"the tree is {tree!r})"
        )
    top = layers if max_length is None else min(max_length, layers)
    # The counts, trees and samples built here are this call's: their refusals name it.
    with named_errors(where, "pathkernels.count_by_length", "pathkernels.PathTree.complete"):
        counts = count_by_length(layers, heads, skip=skip, max_length=max_length)
    if tree is None and sum(counts) == 0:  # only without skip: every path takes all L layers' heads
        raise ValueError(
            f"{where}: without skip every path takes a head at each of the {layers} layers, so max_length="
            f"{max_length} keeps no path; pass skip=True (the network's skip connections) or max_length >= {layers}"
        )

    if tree is not None:
        check_tree_shape(tree, layers, heads, where)
        check_max_paths(tree.num_paths, max_paths, where, ways_round)
        method, counts = "exact", tree.count_by_length()
        weights = torch.ones(len(tree), dtype=torch.float64)
    elif num_samples is not None:
        if max_length is not None:
            raise ValueError(
                f"{where}: uniform sampling draws from all paths; for short paths use "
                "samples_per_length with max_length"
            )
        check_max_paths(min(num_samples, sum(counts)), max_paths, where, ways_round)
        if num_samples >= sum(counts):  # the sample would be every path: evaluate them all, exactly
            with named_errors(where, "pathkernels.PathTree.complete"):
                method, tree = "exact", PathTree.complete(layers, heads, skip=skip)
            weights = torch.ones(len(tree), dtype=torch.float64)
        else:
            method = "uniform"
            with named_errors(where, "pathkernels.sample_paths", "pathkernels.PathTree.from_paths"):
                drawn_paths = sample_paths(layers, heads, num_samples, skip=skip, generator=generator, replace=False)
                tree = PathTree.from_paths(drawn_paths, num_heads=heads)
            weights = sample_weights(method, tree.lengths(), counts)
    elif samples_per_length is not None:
        method = "stratified"
        if isinstance(samples_per_length, int):
            samples_per_length = {k: samples_per_length for k in range(top + 1) if counts[k] > 0}
        if not samples_per_length:
            raise ValueError(
                f"{where}: expected samples_per_length to ask for at least one length (a dict {{length: count}} "
                f"of lengths 0..{top}), got an empty dict"
            )
        for k in sorted(samples_per_length):
            if not 0 <= k <= top or counts[k] == 0:
                raise ValueError(
                    f"{where}: samples_per_length asks for length {k}, but there are no paths of length {k} "
                    f"(lengths 0..{top} exist with skip={skip})"
                )
        # A stratum with no more paths than asked for is evaluated whole (exactly, no repeats); the
        # others are drawn without replacement.
        strata = {k: min(n_k, counts[k]) for k, n_k in sorted(samples_per_length.items())}
        check_max_paths(sum(strata.values()), max_paths, where, ways_round)
        with named_errors(where, "pathkernels.sample_paths", "pathkernels.PathTree.from_paths"):
            parts = [
                sample_paths(layers, heads, n_k, skip=skip, length=k, generator=generator, replace=False)
                for k, n_k in strata.items()
            ]
            tree = PathTree.from_paths(torch.cat(parts), num_heads=heads)
        counts = [counts[k] if k in strata else 0 for k in range(layers + 1)]
        weights = sample_weights(method, tree.lengths(), counts)
    else:
        method = "exact"
        total = sum(counts)
        batch = attn.shape[0] if attn.dim() == 5 else 1
        result_bytes = 2 * batch * total * attn.element_size()  # residual and norm per path and batch element
        if total > MAX_LEAVES:
            raise ValueError(
                f"{where}: the exact tree has {format_count(total)} paths, more than even streamed statistics index "
                f"({MAX_LEAVES:,}); pass max_length, num_samples or samples_per_length, or use pk.length_sums "
                "for exact sums per length"
            )
        if max_length is not None and total > MAX_ENUMERATED_PATHS:  # listed, short paths: never more
            raise ValueError(
                f"{where}: the exact tree has {format_count(total)} paths; pass a smaller max_length, num_samples or "
                "samples_per_length, or use pk.length_sums for exact sums per length"
            )
        check_max_paths(total, max_paths, where, ways_round)
        if max_length is None and (total > MAX_ENUMERATED_PATHS or result_bytes > max_result_bytes):
            # Too many paths to keep one result each: the same table from streamed statistics.
            with named_errors(where, "pathkernels.PathTree.complete"):
                tree = PathTree.complete(layers, heads, skip=skip)
            return stream_statistics(attn, tree, where, token_mask=token_mask, max_paths=max_paths, **engine_options)
        with named_errors(where, "pathkernels.PathTree.complete"):
            tree = PathTree.complete(layers, heads, skip=skip, max_length=max_length)
        weights = torch.ones(len(tree), dtype=torch.float64)

    results = evaluate_paths(attn, tree, where, token_mask=token_mask, **engine_options)
    if results is None:
        return None
    return PathDecomposition(results, method, layers, heads, skip, list(counts), weights)


def sample_weights(method: str, lengths: Tensor, counts: list[int]) -> Tensor:
    """Horvitz–Thompson weights ``[M]`` float64 for M evaluated paths of the given ``lengths`` ``[M]``:
    how many paths of the decomposed set each stands for, the inverse of its chance to be drawn.

    - ``"exact"``: 1 (every path evaluated);
    - ``"uniform"``: ``N / M`` for each, ``N = Σ_k counts[k]``: M distinct paths drawn uniformly
      without replacement, so each path is in the sample with probability ``M / N``;
    - ``"stratified"``: ``counts[k] / n_k`` for a path of length k, ``n_k`` the distinct paths of
      that length drawn (its stratum's size, fixed in advance; ``counts[k]`` is 0 for the lengths not
      asked for, which the estimate leaves out).

    Then ``Σ_i weights[i] f(path_i)`` is an unbiased estimate of ``Σ_p f(p)`` over the decomposed set
    for any ``f``. (Weights ``count_k / n_k`` after uniform draws, whose n_k are random, leave out
    every length that happened not to be drawn: biased low.)"""
    if method == "exact":
        return torch.ones(lengths.shape[0], dtype=torch.float64)
    if method == "uniform":
        return torch.full((lengths.shape[0],), sum(counts) / max(lengths.shape[0], 1), dtype=torch.float64)
    if method != "stratified":
        raise ValueError(
            f"pathkernels.sample_weights: expected method 'exact', 'uniform' or 'stratified', got {method!r}"
        )
    drawn = torch.bincount(lengths.cpu(), minlength=len(counts))
    per_length = torch.tensor([counts[k] / max(int(drawn[k]), 1) for k in range(len(counts))], dtype=torch.float64)
    return per_length[lengths.cpu()]


def _check_sampling(num_samples, samples_per_length, generator, where: str) -> None:
    """The sampling arguments' types and values, before any work: ``num_samples`` an int >= 1,
    ``samples_per_length`` an int >= 1 or a dict of such ints by int length, ``generator`` a
    ``torch.Generator`` (each or None)."""
    if num_samples is not None:
        check_int(num_samples, "num_samples", where, minimum=1)
    if samples_per_length is not None:
        if isinstance(samples_per_length, dict):
            for k, n_k in samples_per_length.items():
                check_int(k, "a length of samples_per_length", where, minimum=0)
                check_int(n_k, f"samples_per_length[{k}]", where, minimum=1)
        elif not _is_int(samples_per_length):
            raise TypeError(
                f"{where}: expected samples_per_length to be an int or a dict {{length: count}} of ints, got "
                f"{type(samples_per_length).__name__} {samples_per_length!r}"
            )
        else:
            check_int(samples_per_length, "samples_per_length", where, minimum=1)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"{where}: expected generator to be a torch.Generator (e.g. torch.Generator().manual_seed(0)) or None, "
            f"got {type(generator).__name__} {generator!r}"
        )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _model_paths_to_evaluate(counts: list[int], top: int, num_samples, samples_per_length) -> int:
    """How many paths the decomposition of a captured model evaluates (``counts``: its paths by
    length): ``min(num_samples, every path)``, the strata's ``Σ min(n_k, count_k)``, or every path
    up to ``top`` heads. Arguments that are not well formed count as nothing here: the
    decomposition's own checks refuse them."""
    if num_samples is not None:
        return min(num_samples, sum(counts)) if _is_int(num_samples) else 0
    if samples_per_length is not None:
        if _is_int(samples_per_length):
            samples_per_length = dict.fromkeys(range(top + 1), samples_per_length)
        if not isinstance(samples_per_length, dict):
            return 0
        return sum(
            min(n_k, counts[k])
            for k, n_k in samples_per_length.items()
            if _is_int(k) and 0 <= k < len(counts) and _is_int(n_k)
        )
    return sum(counts[: top + 1])
