"""Certified top pairs of paths of one head's score, for layers too deep to list every path.

Each side of the score is a readout of the stream below the layer with ``e`` directions
(:mod:`pathkernels.analysis.scores`): path p's query vector is ``a_p = Φ_Q (ρ_Q Y_p)ᵀ`` ``[e]`` with
``ρ_Q = D_i e_i`` and ``Φ_Qᵀ = C Γ W_Q diag(ν_i γ_Q) R_iᵀ``, and likewise ``b_{p'}`` on the key side;
a pair's term is ``scaling · ⟨a_p, b_{p'}⟩``. Each side is walked as the readout trie of the frozen
model below the layer (:class:`~pathkernels.analysis.readout_trie.Walker`, φ kept in the model's
coordinates), best first by a bound on the vectors below a node:

    ‖a_p‖₂ ≤ ‖ρ‖₁ ‖Φ‖₂ M_j   for every path p below a node at level j,

``‖Φ‖₂`` the spectral norm of the node's ``[e, d]`` directions and ``M_j`` the bound of
:func:`~pathkernels.analysis.top_paths._reach_bounds` on ``|ρ … φ| / (‖ρ‖₁ ‖φ‖₂)`` (a vector readout
is the largest of its unit combinations ``wᵀ Φ``, each a scalar readout with ``‖Φᵀ w‖₂ ≤ ‖Φ‖₂``).
With ``F`` the largest bound left on a side's frontier and ``V`` the largest norm among its visited
paths (the constant counted as visited), every pair with an unvisited side is at most

    scaling · max(F_Q · max(V_K, F_K), F_K · max(V_Q, F_Q)),

so the visited pairs' top k is exact once that is at most their k-th value. The search expands the
side with the larger of the two terms.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from pathkernels.analysis.attribution import pair_bars
from pathkernels.analysis.readout_trie import NO_HEAD, FrozenModel, describe_path
from pathkernels.analysis.scores import CONSTANT, CheckedHead, checked_head, query_and_keys
from pathkernels.analysis.top_paths import (
    _BOUNDS,
    SearchOptions,
    _chain_factors,
    _first_head_reach,
    _NodeBounds,
    _product_norm,
    _reach_bounds,
    _safe_bounds,
    _spectral_norm,
)
from pathkernels.core._figures import require, titled
from pathkernels.core._progress import progress_bar
from pathkernels.core.checks import renamed
from pathkernels.core.paths import count_attribution_paths
from pathkernels.core.planner import DEFAULT_MEMORY_BUDGET

if TYPE_CHECKING:
    from pathkernels.adapters.stack import AttentionStack

_WHERE = "pathkernels.top_score_pairs"


@dataclass
class TopScorePairs:
    """The ``k`` largest (or smallest) pair terms of one head's score at (query, key), with a
    certificate (:func:`top_score_pairs`).

    Attributes:
        values: ``[k']`` the pair terms, best first; ``query_paths`` and ``key_paths``: the pairs'
            two sides as text (``"constant"``: a side's constant).
        bound: no pair with a side left unvisited has a term above ``bound`` (below ``−bound`` for
            the smallest); ``certified``: ``bound ≤`` the k-th value, so the list is exactly the
            top k; ``gap``: ``max(0, bound − k-th value)`` otherwise.
        score: the model's own score; visited: paths visited per side ``(query, key)``; total: the
            paths per side; seconds, stopped (``"certified"``, ``"exhausted"``, ``"time_limit"``,
            ``"memory_budget"``).
    """

    layer: int
    head: int
    query: int
    key: int
    largest: bool
    values: Tensor
    query_paths: list[str]
    key_paths: list[str]
    bound: float
    certified: bool
    gap: float
    score: float
    visited: tuple[int, int]
    total: int
    seconds: float
    stopped: str
    model_name: str = ""  # the model's name for figure titles (AttentionStack.name)

    def __repr__(self) -> str:
        state = "certified" if self.certified else f"not certified, gap {self.gap:.3g}"
        return (
            f"TopScorePairs(L{self.layer}H{self.head}, query {self.query}, key {self.key}, "
            f"{self.values.numel()} {'largest' if self.largest else 'smallest'}, {state}; visited "
            f"{self.visited[0]:,} + {self.visited[1]:,} of {self.total:,} paths per side in {self.seconds:.2f} s)"
        )

    def table(self) -> list[dict]:
        """Rows: rank, query path, key path, value, and its ``fraction`` of the score."""
        return [
            {
                "rank": rank + 1,
                "query path": q,
                "key path": k,
                "value": float(v),
                "fraction": float(v) / self.score if self.score else math.nan,
            }
            for rank, (q, k, v) in enumerate(zip(self.query_paths, self.key_paths, self.values))
        ]

    def to_frame(self):
        """:meth:`table` as a pandas DataFrame (pandas is optional)."""
        return require("pandas").DataFrame(self.table())

    @renamed("pathkernels.TopScorePairs.plot", k="top_k")
    def plot(self, top_k: int | None = None, *, ax=None, path=None):
        """The ``top_k`` pairs found as horizontal bars (default: all; more refused); the title
        says whether the list is certified. Returns the matplotlib Figure, saved to ``path``."""
        how = "certified" if self.certified else f"not certified: gap {self.gap:.3g}"
        which = "largest" if self.largest else "smallest"
        title = titled(
            self.model_name, f"L{self.layer}H{self.head}, query {self.query}, key {self.key}: the {which} pairs ({how})"
        )
        rows = self.table()
        where = "pathkernels.TopScorePairs.plot"
        return pair_bars(rows, [], top_k, (len(rows), self.total**2), title, where, ax=ax, path=path)


class _Side:
    """One side's best-first walk over head sequences (as :class:`~pathkernels.analysis.top_paths._NodeBounds`
    walks a scalar readout's): a node has taken heads down to its last, head h of attention sublayer
    a, and holds ``r = ρ T_top ⋯ T_{a,h}`` ``[n]`` and ``Z = V_{a,h} ⋯ Φᵀ`` ``[d_head, e]``, so that the
    vectors below it are ``(r K_i U_{a,h}) Z`` for the paths that take no further head (its tails,
    computed when it is expanded) and, for those that do, at most ``‖r‖₁ ‖U_{a,h} Z‖₂ W_a`` (its
    bound; ``W`` the reach of the paths below sublayer a that take another head,
    :func:`~pathkernels.analysis.top_paths._first_head_reach`, or the chain bound's where smaller).
    The root (no head) holds ``ρ`` and ``Φᵀ`` ``[d, e]``."""

    def __init__(
        self, head: CheckedHead, which: str, row: int, bounds: _NodeBounds, with_head: list[float], record: bool = False
    ):
        self.head, self.bounds, self.with_head = head, bounds, with_head
        # With ``record`` (tests): every node's bound and every visited path's heads, top down.
        self.record = ([], [()] * (1 + len(head.model.sources))) if record else None
        columns = head.readout_columns(which, row)  # Φᵀ [d, e]
        n = head.positions.numel()
        rho = torch.zeros(n, dtype=torch.float64, device=columns.device)
        rho[row] = head.scale[row]
        model = head.model
        names = model.source_names
        constant = head.constant(which, torch.tensor([row], device=rho.device))[0]
        sources = torch.stack(model.sources)  # [S+1, n, d]
        root = (rho @ sources) @ columns  # [S+1, e]: every path that takes no head
        self.vectors = [constant[None], root]
        self.labels = [CONSTANT] + [f"{name} (direct)" for name in names]
        self.largest_norm = float(torch.cat(self.vectors).norm(dim=-1).max())
        self.heap: list[tuple[float, int]] = []
        self.nodes: dict[int, tuple] = {}
        self.counter = 0
        self.expanded = 0
        self.kappa: dict[tuple[int, int], float] = {}
        if bounds is not None:  # the root's children: the top head of every path that takes one
            attention = len(bounds.index)
            outputs = bounds.outputs  # V [A·H, e, d]
            self.columns = columns
            z = torch.einsum("ced,dk->cek", outputs, columns)  # [A·H, d_head, e]
            r = bounds.through(rho[None], attention)[0]  # [A·H, n]
            basis = [(a, h) for a in range(attention) for h in range(bounds.heads)]
            self._push(basis, r, z, [()] * len(basis), None)

    def _push(self, basis: list[tuple[int, int]], r: Tensor, z: Tensor, above: list[tuple], parent) -> None:
        """Nodes of last head ``basis[m] = (a, h)``, ``r [M, n]``, ``z [M, d_head, e]`` and the heads
        ``above[m]`` they took before it, each with its bound. A node keeps ``r`` and, rather than its
        ``z``, its parent's ``(basis, Z)`` (None: the root), from which :meth:`expand` makes it again:
        a frontier of ``n`` numbers per node instead of ``n + d_head · e``."""
        if not basis:
            return
        b = self.bounds
        grams = torch.stack([b.grams[a][h] for a, h in basis])  # (U/unit)ᵀ(U/unit) [M, e', e']
        units = torch.stack([b.value_units[a][h, 0, 0] for a, h in basis])
        scale = z.abs().flatten(1).amax(-1).clamp_min(torch.finfo(torch.float64).tiny)
        scaled = z / scale[:, None, None]  # a largest entry of 1: the Gram matrices stay in range
        through = torch.linalg.eigvalsh(scaled.mT @ grams @ scaled)[:, -1].clamp_min(0).sqrt() * scale * units  # ‖U Z‖₂
        own = torch.linalg.eigvalsh(scaled.mT @ scaled)[:, -1].clamp_min(0).sqrt() * scale  # ‖Z‖₂
        reach = torch.tensor([self.with_head[a] for a, _ in basis], dtype=torch.float64, device=r.device)
        kappa = torch.tensor([self._kappa(a, h) for a, h in basis], dtype=torch.float64, device=r.device)
        bound = r.abs().sum(-1) * torch.maximum(own * kappa, through * reach)  # its tails, and below them
        for m, value in enumerate(_safe_bounds(bound).tolist()):
            if self.record is not None:
                self.record[0].append((above[m] + (basis[m],), value))
            self.counter += 1
            self.nodes[self.counter] = (basis[m], r[m], parent, m, above[m] + (basis[m],))
            heapq.heappush(self.heap, (-value, self.counter))

    def _kappa(self, a: int, h: int) -> float:
        """``κ' = max_{i, t} ‖(K_i U_{a,h})_t‖₂`` over the sources below sublayer a: how far a node's
        tails reach, ``‖(r K_i U) Z‖₂ ≤ ‖r‖₁ κ' ‖Z‖₂``."""
        if (a, h) not in self.kappa:
            maps = self.bounds.source_maps(a)[h]  # [n, (i, d_head)]
            self.kappa[a, h] = float(maps.view(maps.shape[0], -1, self.bounds.head_dim).norm(dim=-1).max())
        return self.kappa[a, h]

    @property
    def frontier(self) -> float:
        """The largest bound left on the frontier (0 when it is empty)."""
        return -self.heap[0][0] if self.heap else 0.0

    def expand(self, count: int) -> int:
        """Pops the ``count`` nodes of largest bound: each's tails become visited paths, and its
        children (the next head, at every attention sublayer below) join the frontier. Returns the
        paths visited."""
        popped = [self.nodes.pop(heapq.heappop(self.heap)[1]) for _ in range(min(count, len(self.heap)))]
        b, names, layers = self.bounds, self.head.model.source_names, self.head.model.layers
        visited = 0
        by_basis: dict[tuple[int, int], list] = {}
        for node in popped:
            by_basis.setdefault(node[0], []).append(node)
        for (a, h), nodes in by_basis.items():
            r = torch.stack([node[1] for node in nodes])  # [N, n]
            z = torch.stack([self._features(node) for node in nodes])  # [N, d_head, e]
            index = b.index[a]
            maps = (r @ b.source_maps(a)[h]).view(r.shape[0], index + 1, b.head_dim)  # r K_i U [N, I, d_head]
            tails = maps @ z  # [N, I, e]
            self.vectors.append(tails.flatten(0, 1))
            for node in nodes:
                choices = [NO_HEAD] * layers
                for sub, head in node[4]:
                    choices[self.head.model.sublayers[b.index[sub]].layer] = head
                path = torch.tensor(choices)
                self.labels += [describe_path(path, names[i]) for i in range(index + 1)]
                if self.record is not None:
                    self.record[1].extend([node[4]] * (index + 1))
            visited += tails.shape[0] * tails.shape[1]
            self.largest_norm = max(self.largest_norm, float(tails.norm(dim=-1).max()))
            if a == 0:
                continue
            children_r = b.through(r, a)  # [N, a·H, n]
            pair = b.pair_map(a, h).view(b.head_dim, a * b.heads, b.head_dim)  # (V_c U_{a,h})ᵀ
            children_z = torch.einsum("Nfk,fcg->Ncgk", z, pair)  # V_c U_{a,h} Z [N, a·H, d_head, e]
            below = [(sub, g) for sub in range(a) for g in range(b.heads)]
            for m, node in enumerate(nodes):
                self._push(below, children_r[m], children_z[m], [node[4]] * len(below), ((a, h), z[m]))
        self.expanded += len(popped)
        return visited

    def _features(self, node: tuple) -> Tensor:
        """A node's ``Z`` ``[d_head, e]``: ``V_c Φᵀ`` below the root, ``V_c U_{a,h} Z_parent`` below a
        head (its ``m``-th child, in the order of :meth:`expand`)."""
        _, _, parent, child, _ = node
        b = self.bounds
        if parent is None:
            return b.outputs[child] @ self.columns
        (a, h), z = parent
        pair = b.pair_map(a, h).view(b.head_dim, a * b.heads, b.head_dim)[:, child]  # (V_c U_{a,h})ᵀ
        return pair.T @ z

    def all_vectors(self) -> Tensor:
        return torch.cat(self.vectors)


class _LevelSide:
    """One side's best-first walk over the readout trie, level by level (:class:`_Side`'s interface),
    for a frozen model whose sublayers differ in their branches (a capture's transcoders: a
    replaced MLP's steps are heads of d_head 1, thousands of them). A node at level j has passed the
    sublayers ``j…`` above it and holds ``ρ`` ``[n]`` and its directions ``Φᵀ = B z``: ``B`` ``[d, r]``
    the output map of the last branch it took (``F_out[b]ᵀ``; the side's own columns at the root) and
    ``z`` ``[r, e]``, so that a node keeps ``n + r e`` numbers. Every path below it, its tail (source j
    entering right there, its vector ``(ρ K_j) B z`` computed exactly) and those that continue, has a
    vector of norm at most ``‖ρ‖₁ σ(B z) M_j`` (module docstring; ``M_j`` of
    :func:`~pathkernels.analysis.top_paths._reach_bounds`). Expanding a node visits its tail and pushes
    its children at level ``j − 1``: the skip (the identity, pre-norm) and each branch b of
    sublayer ``j − 1``, ``ρ T_b`` and ``F_out[b]ᵀ (F_in[b]ᵀ B z)``."""

    def __init__(self, head: CheckedHead, which: str, row: int, reach: Tensor):
        self.head, self.reach = head, reach.tolist()
        model = head.model
        self.model, self.names = model, model.source_names
        self.sources = model.sources
        columns = head.readout_columns(which, row)  # Φᵀ [d, e]
        rho = torch.zeros(head.positions.numel(), dtype=torch.float64, device=columns.device)
        rho[row] = head.scale[row]
        constant = head.constant(which, torch.tensor([row], device=rho.device))[0]
        self.vectors, self.labels = [constant[None]], [CONSTANT]
        self.largest_norm = float(constant.norm())
        self.heap: list[tuple[float, int]] = []
        self.nodes: dict[int, tuple] = {}
        self.counter = self.expanded = 0
        root_norm = _spectral_norm(columns[None])[0]
        identity = torch.eye(columns.shape[-1], dtype=torch.float64, device=columns.device)
        self._push([(len(self.sources) - 1, rho, columns, identity, ())], [float(root_norm)])

    def _push(self, nodes: list[tuple], norms: list[float]) -> None:
        """Nodes ``(level, ρ, B, z, taken)`` with ``σ(B z)`` each, on the frontier by their bound
        (``taken``: the ``(column, choice)`` of each branch the node took, top down), kept with that
        norm, which the node's skip child shares."""
        for node, norm in zip(nodes, norms):
            bound = float(_safe_bounds(torch.tensor(float(node[1].abs().sum()) * norm * self.reach[node[0]])))
            self.counter += 1
            self.nodes[self.counter] = (*node, norm)
            heapq.heappush(self.heap, (-bound, self.counter))

    @property
    def frontier(self) -> float:
        """The largest bound left on the frontier (0 when it is empty)."""
        return -self.heap[0][0] if self.heap else 0.0

    def expand(self, count: int) -> int:
        """Pops the ``count`` nodes of largest bound: each's tail becomes a visited path, and its
        children at the level below join the frontier. Returns the paths visited."""
        popped = [self.nodes.pop(heapq.heappop(self.heap)[1]) for _ in range(min(count, len(self.heap)))]
        replaced = self.model.replaced
        for level, rho, basis, z, taken, norm in popped:
            directions = basis @ z  # Φᵀ [d, e]
            tail = (rho @ self.sources[level]) @ directions  # [e]: source `level` entering right here
            self.vectors.append(tail[None])
            choices = torch.full((self.model.layers,), NO_HEAD, dtype=torch.long)
            for column, value in taken:
                choices[column] = value
            self.labels.append(describe_path(choices, self.names[level], replaced))
            self.largest_norm = max(self.largest_norm, float(tail.norm()))
            if level == 0:
                continue
            sublayer = self.model.sublayers[level - 1]
            children = [(level - 1, rho, basis, z, taken)]  # the skip: pre-norm, the identity
            norms = [norm]
            if sublayer.attn is not None and sublayer.branches:
                feature_in, feature_out = sublayer.feature_factors  # [B, d, r], [B, r, d]
                inner = torch.einsum("bdr,de->bre", feature_in, directions)  # z' = F_in[b]ᵀ Φᵀ [B, r, e]
                outputs = feature_out.mT  # B' = F_out[b]ᵀ [B, d, r]
                norms += _product_norm(outputs, inner).tolist()  # σ(B' z') from an r × r Gram matrix
                rhos = rho @ sublayer.token_maps  # ρ T_b [B, n] (T_b [B, n, n])
                column, values = sublayer.column, sublayer.choice_values("cpu").tolist()
                for first, stop, below in sublayer.branch_levels(level - 1):  # (a cross-layer step: further down)
                    for b in range(first, stop):
                        children.append((below, rhos[b], outputs[b], inner[b], (*taken, (column, values[b]))))
            self._push(children, norms)
        self.expanded += len(popped)
        return len(popped)

    def all_vectors(self) -> Tensor:
        return torch.cat(self.vectors)


def head_sequence_bounds(model: FrozenModel, bound: str) -> tuple[_NodeBounds | None, list[float] | None]:
    """The search's set-up over a frozen model's head sequences: its per-head maps
    (:class:`~pathkernels.analysis.top_paths._NodeBounds`) and ``W_a`` per attention sublayer a, the
    reach of the paths below its level that take another head (the first-head bound, or with
    ``bound="chain"`` the chain bound where smaller); ``(None, None)`` below the first layer."""
    if not any(sublayer.attn is not None for sublayer in model.sublayers):
        return None, None
    node_bounds = _NodeBounds(model)
    first = _first_head_reach(model)
    chains = _chain_factors(model) if bound == "chain" else [math.inf] * len(model.sources)
    return node_bounds, [min(first[index], chains[index]) for index in node_bounds.index]


@renamed(_WHERE, k="top_k")
def top_score_pairs(
    stack: AttentionStack,
    layer: int,
    head: int,
    top_k: int = 20,
    *,
    query: int | None = None,
    key: int,
    batch: int = 0,
    largest: bool = True,
    bound: str = "chain",
    time_limit: float | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    batch_nodes: int = 256,
    progress: bool = False,
    allow_masked: bool = False,
) -> TopScorePairs:
    """The exact ``top_k`` largest (or smallest) pairs (query path, key path) of head ``(layer, head)``'s
    score at (query, key), by a best-first search over both sides' tries with a certificate
    (module docstring): for layers whose paths are too many to list (:func:`pathkernels.score_pairs`
    lists them where they are few).

    Args:
        stack: a stack captured with its queries and keys (``query_key=True``).
        layer, head, query (default: the last real token), key, batch: the score.
        top_k: how many pairs (``k=``, its old name, is taken with a FutureWarning); largest: the
            largest terms, or the smallest.
        bound: the node bound's reach (``"chain"``, ``"first_head"`` or ``"plain"``:
            :func:`pathkernels.top_paths`' bounds per level).
        time_limit: seconds; at the limit the best list so far comes back with its gap.
        memory_budget: bytes for both frontiers and the visited vectors; reaching it also stops.
        batch_nodes: nodes expanded per step.
        progress: report the paths visited, the bound and the k-th value.
        allow_masked: also a key the mask forbids the query (refused by default).

    Returns:
        :class:`TopScorePairs`; the tests hold it to the full list of :func:`pathkernels.score_pairs`.
    """
    if bound not in _BOUNDS or bound in ("auto", "node"):  # before the shared checks, whose message lists them
        raise ValueError(f"{_WHERE}: expected bound in ('chain', 'first_head', 'plain'), got {bound!r}")
    options = SearchOptions.checked(
        _WHERE, top_k, largest, time_limit, memory_budget, batch_nodes, False, bound, progress, time.monotonic()
    )
    k, largest, time_limit, memory_budget = options.k, options.largest, options.time_limit, options.memory_budget
    checked = checked_head(stack, layer, head, batch, _WHERE)
    query, keys = query_and_keys(checked, query, key, _WHERE, allow_masked, "key")
    key = int(keys[0])
    model = checked.model
    if model.replaced is None:  # heads alone: the walk over head sequences
        node_bounds, with_head = head_sequence_bounds(model, bound)
        sides = (
            _Side(checked, "query", query, node_bounds, with_head),
            _Side(checked, "key", key, node_bounds, with_head),
        )
        total = count_attribution_paths(model.layers, model.num_heads, model.layers)
    else:  # a replaced MLP's steps too: the walk level by level
        reach = _reach_bounds(model, bound)
        sides = (_LevelSide(checked, "query", query, reach), _LevelSide(checked, "key", key, reach))
        total = sum(model.path_counts(model.layers))
    scaling = float(checked.maps.scaling[checked.layer]) * (1.0 if largest else -1.0)
    magnitude = abs(scaling)
    e, n = checked.maps.w_q.shape[-1], checked.positions.numel()  # e: a head's width, and each side's
    node_bytes = 8 * n + 8 * model.layers + 250  # r, the heads above, the heap's entry (Z made on expansion)
    if model.replaced is not None:  # a level walk's node keeps its z [r, e] (r ≤ a head's width)
        node_bytes += 8 * e * e
    parent_bytes = 8 * e * e  # each expanded node's Z [d_head, e], which its children share
    bar = progress_bar(2 * total, enabled=options.progress, unit="path", desc=_WHERE)
    # Every pair of the paths visited from the start (each side's constant and its paths that take
    # no head); after that, each expansion pairs its side's new paths with the other side's visited.
    initial = scaling * (sides[0].all_vectors() @ sides[1].all_vectors().T)
    seen = [initial.shape[0], initial.shape[1]]
    top = torch.topk(initial.flatten(), min(k, initial.numel()))
    best_values = top.values.cpu()
    best_pairs = torch.stack([top.indices // initial.shape[1], top.indices % initial.shape[1]], 1).cpu()
    stopped = "exhausted"
    while True:
        query_side, key_side = sides
        f_q, f_k = query_side.frontier, key_side.frontier
        v_q, v_k = query_side.largest_norm, key_side.largest_norm
        through_query, through_key = f_q * max(v_k, f_k), f_k * max(v_q, f_q)
        remaining = magnitude * max(through_query, through_key)
        kth = float(best_values[k - 1]) if best_values.numel() >= k else -math.inf
        if bar is not None:
            bar.set_postfix_str(f"bound {remaining:.3g}, k-th {kth:.3g}")
        if remaining <= kth:
            stopped = "certified"
            break
        if not query_side.heap and not key_side.heap:
            break
        if time_limit is not None and time.monotonic() - options.start > time_limit:
            stopped = "time_limit"
            break
        held = sum(len(s.nodes) * node_bytes + s.expanded * parent_bytes + 8 * e * len(s.labels) for s in sides)
        if held > memory_budget:
            stopped = "memory_budget"
            break
        which = 0 if (through_query >= through_key and query_side.heap) or not key_side.heap else 1
        visited = sides[which].expand(options.batch_nodes)
        if bar is not None:
            bar.update(visited)
        # Pair the new vectors of this side with every vector of the other side.
        mine, other = sides[which].all_vectors(), sides[1 - which].all_vectors()
        new = mine[seen[which] :]
        values = scaling * (new @ other.T)  # [new, other]
        index_new = torch.arange(seen[which], mine.shape[0])
        seen[which] = mine.shape[0]
        take = min(k, values.numel())
        top = torch.topk(values.flatten(), take)
        rows, columns = top.indices // values.shape[1], top.indices % values.shape[1]
        pairs = torch.stack([index_new[rows.cpu()], columns.cpu()], 1)
        pairs = pairs if which == 0 else pairs.flip(1)
        merged_values = torch.cat([best_values, top.values.cpu()])
        merged_pairs = torch.cat([best_pairs, pairs])
        keep = torch.topk(merged_values, min(k, merged_values.numel())).indices
        best_values, best_pairs = merged_values[keep], merged_pairs[keep]
    if bar is not None:
        bar.close()
    kth = float(best_values[k - 1]) if best_values.numel() >= k else -math.inf
    remaining = 0.0 if stopped == "exhausted" else remaining
    certified = stopped in ("certified", "exhausted")
    sign = 1.0 if largest else -1.0
    return TopScorePairs(
        layer=checked.layer,
        head=checked.head,
        query=int(checked.positions[query]),
        key=int(checked.positions[key]),
        largest=largest,
        values=sign * best_values,
        query_paths=[sides[0].labels[int(i)] for i in best_pairs[:, 0]],
        key_paths=[sides[1].labels[int(i)] for i in best_pairs[:, 1]],
        bound=remaining,
        certified=certified,
        gap=0.0 if certified else max(0.0, remaining - kth),
        score=float(checked.model_scores(query, keys)[0]),
        model_name=getattr(stack, "name", ""),
        visited=(len(sides[0].labels) - 1, len(sides[1].labels) - 1),  # the constant is not a path
        total=total,
        seconds=time.monotonic() - options.start,
        stopped=stopped,
    )
