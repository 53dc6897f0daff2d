"""The exact top paths of a readout without visiting the whole tree: a best-first search over the
readout trie with a certificate (docs/DESIGN.md, "The top paths, certified").

A node of the trie (:mod:`pathkernels.analysis.readout_trie`) has chosen the branches of the top
sublayers; it holds ``ρ`` (``rᵀ`` through their token maps, ``n`` entries) and ``φ`` (their feature
maps applied to ``v``, ``d`` entries). Every path below it has the attribution ``ρ'ᵀ K φ'``, where
``ρ'``, ``φ'`` continue through the branches below and ``K`` is the source where it ends. So

    |attr| ≤ ‖ρ'‖₁ ‖φ'‖₂ max_t ‖K_t‖₂ ≤ ‖ρ‖₁ ‖φ‖₂ · M_j,

with ``‖ρᵀ T‖₁ ≤ ‖ρ‖₁ ‖T‖_∞`` (the largest row sum of |T|) and ``‖F φ‖₂ ≤ σ_max(F) ‖φ‖₂`` for each
branch, and ``M_j = max_{i ≤ j} κ_i Π_{i ≤ m < j} G_m`` over the sources i a node at level j can still
reach: ``κ_i`` the largest row norm of source i, ``G_m`` the largest factor ``‖T‖_∞ σ_max(F)`` of
sublayer m's branches (the skip's is 1 in a pre-norm model). In a pre-norm model the source is
paired with the path's lowest head instead, whose ``d_head`` values are all of φ it meets
(:func:`_first_head_factors`), a bound tighter by about ``√(d / d_head)``. The search expands the
nodes of largest bound first, in batches, and stops when no unexpanded node's bound exceeds the
k-th value found: then no path left unvisited can enter the top k, and the bound is the certificate.
"""

from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from pathkernels.analysis.attribution import Readout, read_out
from pathkernels.analysis.readout_trie import Fold, FrozenModel, Sublayer, Walker, describe_path
from pathkernels.core._progress import progress_bar
from pathkernels.core.paths import check_flag, check_int, count_attribution_paths
from pathkernels.core.planner import DEFAULT_MEMORY_BUDGET

_WHERE = "pathkernels.top_paths"
_BOUNDS = ("chain", "first_head", "plain")


@dataclass
class TopPaths:
    """The ``k`` largest attributions (or smallest, ``largest=False``) of one readout at one token.

    Attributes:
        values: ``[k']`` attributions, best first (``k' ≤ k`` when the tree has fewer paths);
            ``paths [k', L]`` (the head at each layer, −1 where none) and ``sources [k']`` (into
            ``source_names``).
        bound: no path left unvisited has an attribution above ``bound`` (below ``−bound`` for the
            smallest, on the negated readout); ``certified``: ``bound ≤`` the k-th value, so the
            list is exactly the top k; ``gap``: ``max(0, bound − k-th value)`` otherwise.
        visited: paths whose attribution was computed; ``expanded``: trie nodes expanded;
            ``total``: paths in the tree; ``seconds``: the search's time; ``stopped``: why it
            ended (``"certified"``, ``"time_limit"`` or ``"memory_budget"``).
        recorded: with ``record=True``, every visited path ``(paths, sources, values)``.
    """

    values: Tensor
    paths: Tensor
    sources: Tensor
    source_names: list[str]
    label: str
    position: int
    largest: bool
    bound: float
    certified: bool
    gap: float
    visited: int
    expanded: int
    total: int
    seconds: float
    stopped: str
    recorded: tuple[Tensor, Tensor, Tensor] | None = None

    def table(self) -> list[dict]:
        """Rows: rank, path (text), source, length, attribution."""
        return [
            {
                "rank": rank + 1,
                "path": describe_path(self.paths[rank], self.source_names[int(self.sources[rank])]),
                "source": self.source_names[int(self.sources[rank])],
                "length": int((self.paths[rank] >= 0).sum()),
                "attribution": float(self.values[rank]),
            }
            for rank in range(self.values.shape[0])
        ]


def _branch_bounds(model: FrozenModel) -> Tensor:
    """``G_m`` per sublayer: the largest ``‖T‖_∞ σ_max(F)`` over its branches, the skip's included."""
    factors = []
    for sublayer in model.sublayers:
        factors.append(max(_skip_factor(sublayer), _head_factor(sublayer)))
    return torch.tensor(factors, dtype=torch.float64)


def _skip_factor(sublayer: Sublayer) -> float:
    if sublayer.pre:
        return 1.0
    return float(sublayer.scale.max()) * float(_spectral_norm(sublayer.norm_features_matrix()))


def _token_norms(sublayer: Sublayer) -> Tensor:
    """``‖T_h‖_∞`` per head ``[H]``, the largest row sum of ``|T_h|``: ``T = A D`` (pre-norm) or
    ``D A`` (post-norm)."""
    return sublayer.token_maps.abs().sum(-1).amax(-1)


def _head_factor(sublayer: Sublayer) -> float:
    """The largest ``‖T_h‖_∞ σ_max(F_h)`` over the heads (0 for an MLP), F_h a product of a
    ``d × d_head`` and a ``d_head × d`` factor (:func:`_product_norm`)."""
    if sublayer.attn is None:
        return 0.0
    if sublayer.pre:  # F = C Γ W_V W_O
        left, right = sublayer.norm_values, sublayer.w_o
    else:  # F = W_V W_O C Γ
        left, right = sublayer.w_v, sublayer.w_o @ sublayer.norm_features_matrix()
    return float((_token_norms(sublayer) * _product_norm(left, right)).max())


def _spectral_norm(matrix: Tensor) -> Tensor:
    """``σ_max`` over the last two dimensions: the square root of the largest eigenvalue of the
    smaller Gram matrix. (The symmetric eigensolver, because LAPACK's batched SVD and QR of small
    matrices stall for seconds on a loaded two-core machine; the eigensolver does not.)"""
    gram = matrix.mT @ matrix if matrix.shape[-1] <= matrix.shape[-2] else matrix @ matrix.mT
    return torch.linalg.eigvalsh(gram)[..., -1].clamp_min(0).sqrt()


def _product_norm(left: Tensor, right: Tensor) -> Tensor:
    """``σ_max(left @ right)`` for ``left [..., d, e]``, ``right [..., e, d']`` without the ``d × d'``
    product: ``‖L R x‖² = xᵀ Rᵀ (LᵀL) R x = ‖(LᵀL)^{1/2} R x‖²``, so it is ``σ_max((LᵀL)^{1/2} R)``,
    an ``e × d'`` matrix."""
    values, vectors = torch.linalg.eigh(left.mT @ left)
    root = (vectors * values.clamp_min(0).sqrt()[..., None, :]) @ vectors.mT
    return _spectral_norm(root @ right)


def _reach_bounds(model: FrozenModel, bound: str = "chain") -> Tensor:
    """``M_j`` for j = 0..S: a bound on ``|attr| / (‖ρ‖₁ ‖φ‖₂)`` over every path below a node at
    level j. Post-norm: the largest ``κ_i Π_{i ≤ m < j} G_m`` over the sources i ≤ j. Pre-norm,
    where a skip is the identity: the larger of ``max_{i ≤ j} κ_i`` (paths that take no further
    head) and, for the paths that do, the smaller of two bounds: ``max_s C_s Π_{s < m < j} G_m``
    over the attention sublayers s < j where a path takes its lowest head, with the source folded
    into that head (:func:`_first_head_factors`), and the chain bound of :func:`_chain_factors`.
    ``bound`` picks fewer of them: ``"first_head"`` leaves the chain bound out, ``"plain"`` takes the
    post-norm form for every model."""
    kappa = [float(source.norm(dim=-1).max()) for source in model.sources]
    growth = _branch_bounds(model).tolist()
    if not model.sublayers[0].pre or bound == "plain":
        reach = [kappa[0]]
        for level in range(1, len(model.sources)):
            reach.append(max(kappa[level], growth[level - 1] * reach[-1]))
        return torch.tensor(reach, dtype=torch.float64)
    first = _first_head_factors(model)
    chains = _chain_factors(model) if bound == "chain" else [math.inf] * len(model.sources)
    no_head, with_head = [kappa[0]], [0.0]
    for level in range(1, len(model.sources)):
        no_head.append(max(no_head[-1], kappa[level]))
        with_head.append(max(growth[level - 1] * with_head[-1], first[level - 1]))
    with_head = [min(a, b) for a, b in zip(with_head, chains)]
    return torch.tensor([max(a, b) for a, b in zip(no_head, with_head)], dtype=torch.float64)


def _source_head_factors(model: FrozenModel, index: int) -> Tensor:
    """``κ'_{s,h} = max_{i ≤ s, t} ‖(K_i U_h)_t‖₂`` per head ``[H]`` of attention sublayer s = ``index``,
    ``U_h = C Γ W_V,h``: how far a source that meets the path's lowest head, h of s, reaches
    through that head's d_head values."""
    values = model.sublayers[index].norm_values  # [H, d, d_head]
    sources = torch.stack(model.sources[: index + 1])  # [I, n, d]
    return torch.einsum("ind,hde->ihne", sources, values).norm(dim=-1).amax(dim=(0, 2))


def _first_head_factors(model: FrozenModel) -> list[float]:
    """Pre-norm, per sublayer s: ``C_s = max_{h, i ≤ s} ‖A_h D‖_∞ κ'_{i,h} σ_max(W_O,h)`` for an
    attention sublayer (0 for an MLP), with ``κ'_{i,h} = max_t ‖(K_i C Γ W_V,h)_t‖₂``. A path whose
    lowest head is h of sublayer s, from source i, then contributes ``Σ_t (ρᵀ A_h D)_t ·
    (K_i C Γ W_V,h)_t · (W_O,h φ)`` ≤ ``‖ρ‖₁ ‖A_h D‖_∞ κ'_{i,h} σ_max(W_O,h) ‖φ‖₂`` for the ρ, φ
    just above it: the source's rows meet φ only through the head's d_head values, where the
    plain ``κ_i σ_max(F_h)`` pairs them at full width."""
    factors = []
    for index, sublayer in enumerate(model.sublayers):
        if sublayer.attn is None:
            factors.append(0.0)
            continue
        output_norm = _spectral_norm(sublayer.w_o)  # [H]
        factors.append(float((_token_norms(sublayer) * _source_head_factors(model, index) * output_norm).max()))
    return factors


def _chain_factors(model: FrozenModel) -> list[float]:
    """Pre-norm, per level j: a bound on ``|attr| / (‖ρ‖₁ ‖φ‖₂)`` over the paths below a node at
    level j that take at least one more head, from the chain of those heads as a whole.

    With ``F_h = U_h V_h`` (``U = C Γ W_V`` ``d × d_head``, ``V = W_O``), a path through heads
    ``t`` (top) … ``b`` (lowest) from source i has ``attr = rᵀ K_i U_b (V_b U_·) ⋯ (V_· U_t) (V_t φ)``
    with ``‖r‖₁ ≤ ‖ρ‖₁ Π ‖T‖_∞``, so ``|attr| ≤ ‖ρ‖₁ ‖φ‖₂ σ(V_t) · Q_t``, where, over the chains
    that start at head g of sublayer s,
    ``Q_{s,g} = ‖T_{s,g}‖_∞ max(κ'_{s,g}, max_{s' < s, g'} σ(V_{s',g'} U_{s,g}) Q_{s',g'})``
    (:func:`_source_head_factors` for κ'). Consecutive heads meet through the ``d_head × d_head``
    product of one's output and the next one's input map, which is far below the product of
    their spectral norms when the heads' subspaces are not aligned."""
    chain: dict[int, Tensor] = {}  # Q per attention sublayer [H], bottom up
    for index, sublayer in enumerate(model.sublayers):
        if sublayer.attn is None:
            continue
        best = _source_head_factors(model, index)
        into = sublayer.norm_values  # U of this sublayer's heads [H, d, e]
        for lower, q in chain.items():
            pair = _spectral_norm(torch.einsum("ged,hdf->hgef", model.sublayers[lower].w_o, into))
            best = torch.maximum(best, (pair * q[None, :]).amax(1))  # [H upper, H lower] → [H upper]
        chain[index] = _token_norms(sublayer) * best
    starts = {  # σ(V_t) Q_t at the best head t of each sublayer
        index: float((_spectral_norm(model.sublayers[index].w_o) * q).max()) for index, q in chain.items()
    }
    levels = range(len(model.sources))
    return [max([start for index, start in starts.items() if index < level], default=0.0) for level in levels]


def top_paths(
    stack,
    readout: Readout | Tensor,
    k: int = 20,
    *,
    position: int | None = None,
    batch: int = 0,
    largest: bool = True,
    max_length: int | None = None,
    time_limit: float | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    batch_nodes: int = 4096,
    record: bool = False,
    bound: str = "chain",
    progress: bool = False,
) -> TopPaths:
    """The exact ``k`` largest (or smallest) path attributions of one readout at one token, found
    by a best-first search over the readout trie with a certificate (module docstring).

    Args:
        stack: a captured stack (:func:`pathkernels.adapters.capture_huggingface_residual`).
        readout: one direction: :func:`pathkernels.logit_diff`, :func:`pathkernels.logit`, a
            :class:`Readout` of one row or a vector ``[d]``.
        k: how many paths.
        position: the token read out (default: the last real token); ``batch``: the element.
        largest: the largest attributions, or the smallest (the largest of the negated readout).
        max_length: only paths through at most this many heads.
        time_limit: seconds; at the limit the best list so far comes back with its gap.
        memory_budget: bytes for the frontier of unexpanded nodes; reaching it also stops.
        batch_nodes: nodes expanded per step (the ones of largest bound), one readout-engine call
            per level among them, on the capture's device.
        record: keep every visited path and its attribution (for checking the certificate).
        bound: which bound prunes (docs/DESIGN.md, "The top paths, certified"): ``"chain"`` (the
            default: pre-norm models pair consecutive heads and fold the source into the lowest),
            ``"first_head"`` (the source folded, the rest per-sublayer maxima) or ``"plain"`` (the
            product of per-sublayer maxima); post-norm models use ``"plain"`` in every case.
        progress: report the paths visited, the frontier, the largest open bound and the k-th value.

    Returns:
        :class:`TopPaths`: the paths, their values, and the certificate (``bound``,
        ``certified``, ``gap``) with how much of the tree was visited.
    """
    start = time.monotonic()
    k = check_int(k, "k", _WHERE, minimum=1)
    batch_nodes = check_int(batch_nodes, "batch_nodes", _WHERE, minimum=1)
    memory_budget = check_int(memory_budget, "memory_budget", _WHERE, minimum=1)
    if time_limit is not None and not (isinstance(time_limit, (int, float)) and time_limit > 0):
        raise ValueError(
            f"{_WHERE}: expected time_limit to be a positive number of seconds or None, got {time_limit!r}"
        )
    if bound not in _BOUNDS:
        raise ValueError(f"{_WHERE}: expected bound in {_BOUNDS}, got {bound!r}")
    largest, record, progress = (
        check_flag(value, name, _WHERE)
        for name, value in (("largest", largest), ("record", record), ("progress", progress))
    )
    if position is not None and (isinstance(position, bool) or not isinstance(position, numbers.Integral)):
        raise TypeError(
            f"{_WHERE}: expected position to be one token position (an int) or None, got {type(position).__name__} "
            f"{position!r}; for several positions call top_paths once per position"
        )
    setup = read_out(stack, readout, position, batch, max_length, _WHERE)
    if len(setup.readout.labels) != 1:
        raise ValueError(f"{_WHERE}: expected one readout direction, got {len(setup.readout.labels)}")
    model, layers = setup.model, stack.num_layers
    sign = 1.0 if largest else -1.0
    reach = _reach_bounds(model, bound).to(setup.rho.device)
    walker = Walker(model, low_rank=False)  # the frontier mixes nodes below many heads: φ in d coordinates

    # The frontier: unexpanded nodes, each at a level (the source it meets next).
    rho, phi = setup.rho[:, :1], sign * setup.phi
    device = rho.device  # the capture's: the frontier lives there, the fold on the CPU
    level = torch.full((1,), len(model.sublayers), dtype=torch.long, device=device)
    choices = torch.full((1, layers), -1, dtype=torch.long, device=device)
    lengths = torch.zeros(1, dtype=torch.long, device=device)
    bounds = _bounds(rho, phi, reach, level)
    # The k largest of the (signed) attributions found, and with record every visited path.
    fold = Fold(len(model.sources), layers, 1, 1, k, keep=record, bottom=False)
    pruned, visited, expanded = -math.inf, 0, 0
    total = count_attribution_paths(layers, stack.num_heads, setup.max_length)
    bar = progress_bar(total, enabled=progress, unit="path", desc=_WHERE)
    node_bytes = 8 * (rho.shape[-1] + phi.shape[-1] + layers + 3)
    stopped = "certified"
    while level.numel():
        kth = _kth(fold, k)
        alive = bounds > kth
        if not bool(alive.all()):  # nodes whose every path is below the k-th value
            pruned = max(pruned, float(bounds[~alive].max()))
            rho, phi, level, choices, lengths, bounds = (t[alive] for t in (rho, phi, level, choices, lengths, bounds))
            if not level.numel():
                break
        if time_limit is not None and time.monotonic() - start > time_limit:
            stopped = "time_limit"
            break
        if level.numel() * node_bytes > memory_budget:
            stopped = "memory_budget"
            break
        take = torch.topk(bounds, min(batch_nodes, bounds.numel())).indices
        keep = torch.ones_like(bounds, dtype=torch.bool)
        keep[take] = False
        picked = [t[take] for t in (rho, phi, level, choices, lengths)]
        rho, phi, level, choices, lengths, bounds = (t[keep] for t in (rho, phi, level, choices, lengths, bounds))
        expanded += take.numel()
        if bar is not None:
            open_bound = float(bounds.max()) if bounds.numel() else 0.0
            bar.set_postfix_str(f"frontier {bounds.numel():,}, open bound {open_bound:.3g}, k-th {kth:.3g}")
        new = []
        for at in picked[2].unique().tolist():
            group = picked[2] == at
            g_rho, g_phi, g_choices, g_lengths = picked[0][group], picked[1][group], picked[3][group], picked[4][group]
            values = walker.values(at, g_rho, g_phi, [(g_rho.shape[0], None)])
            visited += values.shape[0]
            if bar is not None:
                bar.update(values.shape[0])
            fold.add(at, values, g_choices, g_lengths)
            if at == 0:
                continue
            runs = [(g_rho.shape[0], None)]
            for *part, _ in walker.children(at, g_rho, g_phi, g_choices, g_lengths, runs, setup.max_length):
                child_level = torch.full((part[0].shape[0],), at - 1, dtype=torch.long, device=device)
                new.append((*part[:2], child_level, *part[2:]))
        if new:
            parts = list(zip(*new))
            grown = [torch.cat(p) for p in parts]
            child_bound = _bounds(grown[0], grown[1], reach, grown[2])
            rho, phi, level, choices, lengths = (
                torch.cat([a, b]) for a, b in zip((rho, phi, level, choices, lengths), grown)
            )
            bounds = torch.cat([bounds, child_bound])
    kth = _kth(fold, k)
    # Pruned nodes were at most the k-th value when dropped, and it only grows.
    remaining = max(pruned, float(bounds.max()) if bounds.numel() else -math.inf)
    certified = remaining <= kth
    recorded = None
    if record:
        paths, sources, values = (torch.cat(parts) for parts in zip(*fold.kept))
        recorded = (paths, sources, sign * values[:, 0, 0])
    if bar is not None:
        bar.close()
    return TopPaths(
        values=sign * fold.best[0][:, 0, 0],
        paths=fold.best[1][:, 0, 0],
        sources=fold.best[2][:, 0, 0],
        source_names=model.source_names,
        label=("" if largest else "−") + setup.readout.labels[0],
        position=setup.positions[0],
        largest=largest,
        bound=remaining if math.isfinite(remaining) else 0.0,
        certified=bool(certified),
        gap=0.0 if certified else max(0.0, remaining - kth),
        visited=visited,
        expanded=expanded,
        total=total,
        seconds=time.monotonic() - start,
        stopped=stopped,
        recorded=recorded,
    )


def _bounds(rho: Tensor, phi: Tensor, reach: Tensor, level: Tensor) -> Tensor:
    """``‖ρ‖₁ ‖φ‖₂ M_level`` per node (one position, one readout)."""
    return rho[:, 0].abs().sum(-1) * phi[:, 0].norm(dim=-1) * reach[level]


def _kth(fold: Fold, k: int) -> float:
    """The k-th largest attribution found, or −inf while fewer than k paths have been visited."""
    values = fold.best[0]
    return float(values[k - 1, 0, 0]) if values.shape[0] == k else -math.inf
