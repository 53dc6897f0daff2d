"""Attribution graphs: a prompt's features, errors, tokens and logits, with the exact direct effect of
each on each, every edge split into its chains of heads.

A capture whose MLPs are replaced by transcoders (``capture_huggingface_residual(...,
transcoders=)``; :mod:`pathkernels.adapters.replacement`) is linear in its stream once the norms,
the attention patterns and the features' gates are frozen. Its *nodes*, in circuit-tracer's
order, are the active features ``(layer, position, feature)``, an error node per layer and position
(the MLP's output less the reconstruction; a layer without a transcoder: its MLP's whole output),
the token embeddings per position, and the chosen logits. A node's *value* is what it reads: a
feature's pre-activation (its activation, the gate being open), a logit's value less the mean over
the vocabulary (circuit-tracer's demeaned unembedding). The *edge* from a source node to a target
is the source's direct effect on the target's value: the sum over every chain of heads (and
skip-map steps) from the row the source writes to the target's readout, no other node between
(docs/DESIGN.md, "Attribution graphs"). So each row of the adjacency, plus the target's
``constant`` (what the biases carry: attention and transcoder constant rows, ``b_enc``, the norms'
β), is the target's value exactly.

:func:`attribution_graph` computes every row by one backward sweep of the frozen model per batch
of targets (the adjoint of the readout through the heads, ``G ← G + Σ_h T_hᵀ G F_h``);
:meth:`AttributionGraph.edge_paths` splits one edge into its chains of heads, jointly over every
layer between its ends, by the readout trie's walk; :meth:`AttributionGraph.incoming_paths` gives a
node's certified top paths through heads and features. :meth:`AttributionGraph.prune` keeps the
nodes and edges of most influence on the logits, as circuit-tracer does;
:mod:`pathkernels.analysis.graph_files` writes the graph in circuit-tracer's and Neuronpedia's
formats.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from pathkernels.analysis.attribution import CheckedReadout, PathAttribution, Readout, attribute, named
from pathkernels.analysis.readout_trie import FrozenModel, Sublayer, frozen_model
from pathkernels.analysis.top_paths import SearchOptions, TopPaths, search_top_paths
from pathkernels.core._figures import check_save_path, new_figure, require, saved, titled
from pathkernels.core._memory import format_bytes
from pathkernels.core._progress import progress_bar
from pathkernels.core._repr import short_repr
from pathkernels.core.checks import check_flag, check_int
from pathkernels.core.planner import DEFAULT_MEMORY_BUDGET

_WHERE = "pathkernels.attribution_graph"
KINDS = ("feature", "error", "token", "logit")


@dataclass
class AttributionGraph:
    """The attribution graph of one prompt (:func:`attribution_graph`). N nodes, in circuit-tracer's
    order: ``F`` features, ``L·n`` errors (layer-major), ``n`` tokens, ``K`` logits.

    Attributes:
        kinds: ``[N]`` each node's kind (an index into ``KINDS``); ``layers``, ``positions``,
            ``features``: ``[N]`` its layer (−1 for tokens, ``L`` for logits), its token position in
            the sequence, its feature id (a logit's vocabulary id; −1 elsewhere).
        activations: ``[N]`` a feature's activation (a logit's value; 0 elsewhere).
        adjacency: ``[N, N]`` float64, rows targets and columns sources: the direct effect of each
            source on each target's value (rows of tokens and errors are 0: nothing reads into them).
        values: ``[N]`` each target's value (a feature's pre-activation, a logit less the mean logit);
            ``constant``: ``[N]`` what no node carries, so that ``adjacency.sum(1) + constant ==
            values`` for every feature and logit row.
        logit_tokens, logit_probabilities: ``[K]`` the logits' vocabulary ids and probabilities.
        input_tokens: ``[n]`` the prompt's token ids at its real tokens (None where the stack does not
            hold them: pass them to the exporters); ``real_positions``: ``[n]`` those tokens' positions.
        node_mask, edge_mask, influence: after :meth:`prune` (None before): the nodes and edges kept
            and each node's cumulative influence score, as circuit-tracer's ``prune_graph`` defines them.
    """

    kinds: Tensor
    layers: Tensor
    positions: Tensor
    features: Tensor
    activations: Tensor
    adjacency: Tensor
    values: Tensor
    constant: Tensor
    logit_tokens: Tensor
    logit_probabilities: Tensor
    input_tokens: Tensor | None
    real_positions: Tensor  # [n] the sequence positions of the real tokens (a node's position is one)
    num_layers: int
    description: str  # the transcoder set's repr
    model_name: str = ""
    batch: int = 0
    node_mask: Tensor | None = None
    edge_mask: Tensor | None = None
    influence: Tensor | None = None
    active_features: int = 0  # every active feature of the prompt, nodes or not (max_feature_nodes)
    seconds: float = 0.0
    KINDS: ClassVar[tuple[str, ...]] = KINDS
    _context: dict = field(default_factory=dict, repr=False)  # the frozen model and readouts edge_paths reads

    def __repr__(self) -> str:
        counts = {kind: int((self.kinds == index).sum()) for index, kind in enumerate(KINDS)}
        edges = int((self.adjacency != 0).sum())
        headline = (
            f"{counts['feature']:,} features, {counts['error']:,} errors, {counts['token']} tokens, "
            f"{counts['logit']} logits; {edges:,} non-zero edges; {self.seconds:.3g} s"
        )
        return short_repr(self, headline)

    @property
    def num_nodes(self) -> int:
        return int(self.kinds.numel())

    def label(self, node: int) -> str:
        """A node's name: ``"L1 F812 @ 5"``, ``"L1 error @ 5"``, ``"token 5"``, ``"logit 33"``."""
        kind = KINDS[int(self.kinds[node])]
        layer, position, feature = int(self.layers[node]), int(self.positions[node]), int(self.features[node])
        if kind == "feature":
            return f"L{layer} F{feature} @ {position}"
        if kind == "error":
            return f"L{layer} error @ {position}"
        if kind == "token":
            return f"token {position}"
        return f"logit {feature}"

    def find(self, kind: str, *, layer: int | None = None, position: int | None = None, feature: int | None = None):
        """The index of the node of ``kind`` with the given layer, position and feature (a logit's
        vocabulary id); refused by name where there is none."""
        if kind not in KINDS:
            raise ValueError(f"{_WHERE}.find: kind is one of {KINDS}, got {kind!r}")
        match = self.kinds == KINDS.index(kind)
        for value, column in ((layer, self.layers), (position, self.positions), (feature, self.features)):
            if value is not None:
                match &= column == int(value)
        found = match.nonzero().flatten()
        if found.numel() != 1:
            raise ValueError(
                f"{_WHERE}.find: {found.numel()} {kind} nodes with layer={layer}, position={position}, "
                f"feature={feature}"
            )
        return int(found[0])

    def to_frame(self):
        """The nodes as a pandas DataFrame: kind, layer, position, feature, activation, value,
        constant, and (after :meth:`prune`) influence and kept."""
        import pandas as pd

        frame = pd.DataFrame(
            {
                "node": [self.label(i) for i in range(self.num_nodes)],
                "kind": [KINDS[int(k)] for k in self.kinds],
                "layer": self.layers.tolist(),
                "position": self.positions.tolist(),
                "feature": self.features.tolist(),
                "activation": self.activations.tolist(),
                "value": self.values.tolist(),
                "constant": self.constant.tolist(),
            }
        )
        if self.influence is not None:
            frame["influence"] = self.influence.tolist()
            frame["kept"] = self.node_mask.tolist()
        return frame

    def edges(self, *, pruned: bool = True):
        """The non-zero edges (those :meth:`prune` kept, when pruned) as a DataFrame: source, target,
        weight, largest first by |weight|."""
        import pandas as pd

        mask = self.adjacency != 0
        if pruned and self.edge_mask is not None:
            mask &= self.edge_mask
        targets, sources = mask.nonzero(as_tuple=True)
        weights = self.adjacency[targets, sources]
        order = weights.abs().argsort(descending=True)
        targets, sources, weights = targets[order], sources[order], weights[order]
        return pd.DataFrame(
            {
                "source": [self.label(int(s)) for s in sources],
                "target": [self.label(int(t)) for t in targets],
                "weight": weights.tolist(),
                "source_index": sources.tolist(),
                "target_index": targets.tolist(),
            }
        )

    def plot(self, *, max_edges: int = 200, ax=None, path=None):
        """The pruned graph (:meth:`prune` with its defaults, where it has not been pruned): nodes at
        (token position, layer), tokens at the bottom and logits at the top, features as dots sized
        by their influence and errors as squares; edges as lines whose width is |weight| (the
        ``max_edges`` largest), blue where positive and red where negative. Returns the matplotlib
        Figure; with ``path`` it is also saved there (the format from the suffix)."""
        where = f"{_WHERE}.plot"
        check_save_path(path, where)
        max_edges = check_int(max_edges, "max_edges", where, minimum=1)
        require("matplotlib")
        if self.node_mask is None:
            self.prune()
        figure, ax = new_figure(9, 5.5) if ax is None else (ax.figure, ax)
        kept = self.node_mask.nonzero().flatten().tolist()
        # Rows: tokens (−1), each layer's features and errors, the logits (L); a node's x its position,
        # spread a little within a (layer, position) cell so that several features stay apart.
        place = {}
        cells: dict[tuple[int, int], list[int]] = {}
        for node in kept:
            cells.setdefault((int(self.layers[node]), int(self.positions[node])), []).append(node)
        for (layer, position), members in cells.items():
            for rank, node in enumerate(members):
                spread = 0.0 if len(members) == 1 else (rank / (len(members) - 1) - 0.5) * 0.6
                place[node] = (position + spread, layer + 1)
        targets, sources = self.edge_mask.nonzero(as_tuple=True)
        weights = self.adjacency[targets, sources]
        order = weights.abs().argsort(descending=True)[:max_edges]
        largest = float(weights.abs().max()) if weights.numel() else 1.0
        for index in order.tolist():
            target, source = int(targets[index]), int(sources[index])
            if source in place and target in place:
                weight = float(weights[index])
                (x0, y0), (x1, y1) = place[source], place[target]
                ax.plot([x0, x1], [y0, y1], color="tab:blue" if weight >= 0 else "tab:red",
                        linewidth=0.3 + 3.0 * abs(weight) / largest, alpha=0.55, zorder=1)  # fmt: skip
        markers = {"feature": "o", "error": "s", "token": "^", "logit": "D"}
        for index, kind in enumerate(KINDS):
            nodes = [node for node in kept if int(self.kinds[node]) == index]
            if nodes:
                xs, ys = zip(*(place[node] for node in nodes))
                ax.scatter(xs, ys, marker=markers[kind], s=36, label=kind, zorder=2, edgecolors="black", linewidths=0.4)
        top = max((int(self.layers[node]) for node in kept), default=self.num_layers)
        ax.set_yticks(range(top + 2), ["tokens", *[f"L{layer}" for layer in range(top)], "logits"])
        ax.set_xlabel("token position")
        ax.legend(loc="upper left", fontsize="small", frameon=False)
        kept_features = sum(int(self.kinds[node]) == KINDS.index("feature") for node in kept)
        ax.set_title(titled(self.model_name, f"attribution graph: {kept_features} features, "
                            f"{int(self.edge_mask.sum())} edges kept"))  # fmt: skip
        return saved(figure, path)

    def save_circuit_tracer(self, path, **options):
        """Write the graph as circuit-tracer's graph file
        (:func:`pathkernels.analysis.graph_files.save_circuit_tracer`, ``options`` as there)."""
        from pathkernels.analysis.graph_files import save_circuit_tracer

        return save_circuit_tracer(self, path, **options)

    def save_neuronpedia(self, folder, slug: str, **options):
        """Write the graph, pruned, as the JSON Neuronpedia's graph viewer loads
        (:func:`pathkernels.analysis.graph_files.save_neuronpedia`, ``options`` as there)."""
        from pathkernels.analysis.graph_files import save_neuronpedia

        return save_neuronpedia(self, folder, slug, **options)

    def prune(self, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> AttributionGraph:
        """Keep the nodes and edges of most influence on the logits, as circuit-tracer's
        ``prune_graph`` does (its definitions, written here): a node's influence is the sum over
        every walk from the logits (weighted by their probabilities) through the adjacency with
        each row's absolute values normalised to sum 1; the nodes holding ``node_threshold`` of the
        total are kept (tokens and logits always), then the edges holding ``edge_threshold`` of the
        total edge influence of the kept nodes, then nodes left without an outgoing edge (or a
        feature without an incoming one), until nothing changes. Sets ``node_mask``, ``edge_mask``
        and ``influence`` (each node's cumulative share, circuit-tracer's ``cumulative_scores``)
        and returns the graph."""
        for name, value in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
            if not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
                raise ValueError(f"{_WHERE}.prune: expected {name} in [0, 1], got {value!r}")
        count = self.num_nodes
        tokens = int((self.kinds == KINDS.index("token")).sum())
        logits = int((self.kinds == KINDS.index("logit")).sum())
        features = int((self.kinds == KINDS.index("feature")).sum())
        weights = torch.zeros(count, dtype=torch.float64)
        weights[count - logits :] = self.logit_probabilities.double()
        node_influence = _influence(_row_normalised(self.adjacency), weights)
        node_mask = node_influence >= _threshold(node_influence, node_threshold)
        node_mask[count - logits - tokens :] = True
        kept = self.adjacency.clone()
        kept[~node_mask] = 0
        kept[:, ~node_mask] = 0
        normalised = _row_normalised(kept)
        edge_scores = normalised * (_influence(normalised, weights) + weights)[:, None]
        edge_mask = edge_scores >= _threshold(edge_scores.flatten(), edge_threshold)
        inner = count - logits - tokens  # features and errors: the nodes that must pass influence on
        while True:
            before = node_mask.clone()
            node_mask[:inner] &= edge_mask[:, :inner].any(0)
            node_mask[:features] &= edge_mask[:features].any(1)
            edge_mask[~node_mask] = False
            edge_mask[:, ~node_mask] = False
            if torch.equal(before, node_mask):
                break
        order = node_influence.argsort(descending=True)
        cumulative = torch.zeros_like(node_influence)
        total = node_influence.sum()
        cumulative[order] = node_influence[order].cumsum(0) / (total if total > 0 else 1.0)
        self.node_mask, self.edge_mask, self.influence = node_mask, edge_mask, cumulative
        return self

    def edge_paths(self, source: int, target: int, *, top_k: int = 20) -> PathAttribution:
        """The edge from node ``source`` to node ``target`` split exactly into every one of its chains
        of heads (and skip-map steps), jointly over the layers between them: a
        :class:`PathAttribution` over the frozen model between the two nodes whose only source is
        what ``source`` writes, read as ``target`` reads; its attributions sum to
        ``adjacency[target, source]``, and its per-head totals (``head_table()``) are the edge's
        head loadings. Refused above :data:`MAX_EDGE_PATHS` chains: :meth:`edge_top_paths` then
        gives the largest, certified."""
        where = f"{_WHERE}.edge_paths"
        setup = self._edge_setup(source, target, where)
        chains = sum(setup.model.path_counts(setup.max_length))
        if chains > MAX_EDGE_PATHS:
            raise ValueError(
                f"{where}: the edge {self.label(source)} → {self.label(target)} has {chains:,} chains of heads, more "
                f"than MAX_EDGE_PATHS = {MAX_EDGE_PATHS:,} to list; edge_top_paths gives the largest, certified"
            )
        result = attribute(setup, check_int(top_k, "top_k", where, minimum=0), DEFAULT_MEMORY_BUDGET)
        result.model_name = self.model_name
        return result

    def edge_top_paths(self, source: int, target: int, *, top_k: int = 10, time_limit: float | None = 60.0) -> TopPaths:
        """The ``top_k`` chains of heads carrying the most of the edge from ``source`` to ``target`` (the
        largest where the edge is positive, the most negative where it is negative), by the certified
        search of :func:`pathkernels.top_paths` over the frozen model between the two nodes."""
        where = f"{_WHERE}.edge_top_paths"
        setup = self._edge_setup(source, target, where)
        largest = bool(self.adjacency[target, source] >= 0)
        result = search_top_paths(setup, _options(check_int(top_k, "top_k", where, minimum=1), largest, time_limit))
        result.model_name = self.model_name
        return result

    def incoming_paths(self, target: int, *, top_k: int = 10, time_limit: float | None = 60.0) -> TopPaths:
        """The ``top_k`` largest paths into node ``target`` (a feature's pre-activation or a logit),
        through heads and the features below it, with the certificate of :func:`pathkernels.top_paths`
        (every source of the model below, biases and errors included)."""
        where = f"{_WHERE}.incoming_paths"
        setup = self._node_setup(target, where)
        options = _options(check_int(top_k, "top_k", where, minimum=1), True, time_limit)
        result = search_top_paths(setup, options)
        result.model_name = self.model_name
        return result

    def _node_setup(self, node: int, where: str) -> CheckedReadout:
        """The readout of node ``node`` (a feature's pre-activation, a logit) over the model below it."""
        node = self._checked_node(node, "target", where)
        kind = KINDS[int(self.kinds[node])]
        if kind not in ("feature", "logit"):
            raise ValueError(f"{where}: node {node} ({self.label(node)}) is a {kind}, which reads nothing")
        model: FrozenModel = self._context["model"]
        target = self._context["targets"][node]
        below = _model_between(model, 0, target.level)
        readout = Readout(target.phi.reshape(1, -1).cpu(), torch.zeros(1, dtype=torch.float64), (self.label(node),))
        return CheckedReadout(
            below, target.rho.reshape(1, 1, -1), target.phi.reshape(1, 1, -1),
            torch.tensor([[target.constant]], dtype=torch.float64), self.values[node].reshape(1, 1), readout,
            [int(self.positions[node])], self.batch, below.layers,
        )  # fmt: skip

    def _edge_setup(self, source: int, target: int, where: str) -> CheckedReadout:
        """The readout of ``target`` over the model between the two nodes, whose only source is what
        ``source`` writes (at the bottom; zero above), no feature step between them."""
        setup = self._node_setup(target, where)
        source = self._checked_node(source, "source", where)
        if KINDS[int(self.kinds[source])] == "logit":
            raise ValueError(f"{where}: node {source} ({self.label(source)}) is a logit, which writes nothing")
        top = len(setup.model.sources) - 1
        writes = [(rows, level) for rows, level in self._context["nodes"].writes(int(self._context["original"][source]))
                  if level <= top]  # fmt: skip
        if not writes:
            raise ValueError(
                f"{where}: {self.label(source)} writes above where {self.label(target)} reads: no edge between them"
            )
        model = self._context["model"]
        bottom = writes[0][1]
        sublayers = [  # (a parallel block's skip steps read at a level counted from the bottom here)
            dataclasses.replace(sub, jumps=tuple((first, level - bottom) for first, level in sub.jumps))
            if sub.jumps else sub
            for sub in self._context["heads_only"][bottom:top]
        ]  # fmt: skip
        sources = [torch.zeros_like(writes[0][0]) for _ in range(top - bottom + 1)]
        names = [f"(nothing at level {level})" for level in range(bottom, top + 1)]
        for rows, level in writes:  # a cross-layer feature writes at every later layer's MLP
            sources[level - bottom] = rows
            names[level - bottom] = (
                self.label(source) if level == bottom else f"{self.label(source)} (at level {level})"
            )
        edge_model = FrozenModel(sublayers, sources, names, model.layers, model.num_heads, {}, model.replaced)
        return dataclasses.replace(
            setup, model=edge_model, constant=torch.zeros(1, 1, dtype=torch.float64),
            value=self.adjacency[target, source].reshape(1, 1),
        )  # fmt: skip

    def _checked_node(self, node, name: str, where: str) -> int:
        node = check_int(node, name, where)
        if not -self.num_nodes <= node < self.num_nodes:
            raise ValueError(f"{where}: expected {name} a node index in [0, {self.num_nodes}), got {node}")
        return node % self.num_nodes


#: The most chains of heads :meth:`AttributionGraph.edge_paths` lists.
MAX_EDGE_PATHS = 10_000_000


def _options(top_k: int, largest: bool, time_limit) -> SearchOptions:
    return SearchOptions(
        k=top_k, largest=largest, time_limit=time_limit, memory_budget=DEFAULT_MEMORY_BUDGET, batch_nodes=256,
        record=False, bound="chain", progress=False, start=time.monotonic(),
    )  # fmt: skip


def _heads_only(sublayer: Sublayer, replaced, index: int) -> Sublayer:
    """A replaced MLP's sublayer (``index`` its place in the model) with its feature steps dropped (a
    cross-layer set's from earlier layers too; its skip map's kept, reading where the layer's steps
    read): what an edge's chains pass through, no node between their ends. Other sublayers as they
    are."""
    if sublayer.branch_ids is None or sublayer.attn is None:
        return sublayer
    own = replaced.layers[sublayer.layer]
    ids = sublayer.branch_ids
    keep = (ids >= own.num_features) & (ids < own.num_features + own.num_skip)
    if not bool(keep.any()):
        return Sublayer(sublayer.layer, None, sublayer.scale, sublayer.gamma, None, None, True, False)
    reads = sublayer.branch_levels(index)[0][2]  # the layer's own steps come first
    return Sublayer(
        sublayer.layer, sublayer.attn[keep], sublayer.scale, sublayer.gamma, sublayer.w_v[keep], sublayer.w_o[keep],
        True, False, sublayer.slot, sublayer.branch_ids[keep], () if reads == index else ((0, reads),),
    )  # fmt: skip


def _model_between(model: FrozenModel, bottom: int, top: int) -> FrozenModel:
    """The frozen model between levels ``bottom`` and ``top``: sublayers ``bottom..top − 1`` and the
    sources entering at levels ``bottom..top``."""
    return FrozenModel(
        model.sublayers[bottom:top], model.sources[bottom : top + 1], model.source_names[bottom : top + 1],
        model.layers, model.num_heads, {}, model.replaced,
    )  # fmt: skip


def _row_normalised(matrix: Tensor) -> Tensor:
    absolute = matrix.abs()
    return absolute / absolute.sum(1, keepdim=True).clamp_min(1e-300)


def _influence(normalised: Tensor, weights: Tensor) -> Tensor:
    """``Σ_{k ≥ 1} weights Aᵏ``: the walks from the weighted rows through ``normalised``; the graph has
    no cycle (every edge goes up the layers), so the series ends."""
    total = torch.zeros_like(weights)
    current = weights @ normalised
    for _ in range(normalised.shape[0] + 1):
        if not bool(current.any()):
            return total
        total += current
        current = current @ normalised
    raise RuntimeError(f"{_WHERE}: the influence did not converge: the adjacency has a cycle (a bug)")


def _partial_influence(normalised: Tensor, at: Tensor, count: int, probabilities: Tensor) -> Tensor:
    """Each node's influence on the logits ``[count + K]`` through the rows computed so far,
    circuit-tracer's ``compute_partial_influences``: ``normalised [r, count]`` those rows with their
    absolute values normalised to sum 1, ``at [r]`` their nodes (the K logits are nodes ``count..``),
    ``probabilities [K]`` the logits'. The walks stay among the computed nodes but for their last
    step: the weights ``x`` on the computed nodes go ``x ← x S`` (``S [r, r]``: the rows' columns of
    computed nodes) and the influence is ``(Σ x) normalised``, one product with the whole rows."""
    rows = at.numel()
    inner = at < count
    square = torch.zeros(rows, rows, dtype=torch.float64)
    square[:, inner] = normalised[:, at[inner]]
    weights = torch.zeros(rows, dtype=torch.float64)
    weights[~inner] = probabilities.double()[at[~inner] - count]
    walked = torch.zeros_like(weights)
    for _ in range(rows + 2):
        if not bool(weights.any()):
            total = torch.zeros(count + probabilities.numel(), dtype=torch.float64)
            total[:count] = walked @ normalised
            return total
        walked += weights
        weights = weights @ square
    raise RuntimeError(f"{_WHERE}: the influence did not converge: the rows have a cycle (a bug)")


def _threshold(scores: Tensor, fraction: float) -> Tensor:
    """The score above which the largest scores hold ``fraction`` of their total."""
    ordered = scores.sort(descending=True).values
    total = ordered.sum()
    if ordered.numel() == 0 or total <= 0:
        return torch.tensor(0.0, dtype=scores.dtype)
    cumulative = ordered.cumsum(0) / total
    index = int(torch.searchsorted(cumulative, torch.tensor(float(fraction), dtype=cumulative.dtype)))
    return ordered[min(index, ordered.numel() - 1)]


# ------------------------------------------------------------------------------------------------
# Nodes and the backward sweep


@dataclass
class _Target:
    """What a target node reads: ``rho [n]`` and ``phi [d]`` at ``level`` of the frozen model (the
    stream entering sublayer ``level``), plus its own ``constant`` (a feature's ``S enc + b_enc``, a
    logit's final-norm β and bias)."""

    node: int
    level: int
    rho: Tensor
    phi: Tensor
    constant: float


@dataclass
class _FeatureLayout:
    """One layer's feature nodes, numbered from ``first`` in (token, feature) order: each one's token
    ``rows [m]`` and index into the layer's replaced features ``indices [m]``, its place ``slots
    [m]`` in a ``[n, width]`` table of each token's features (``width`` the most any token has), and
    ``below [n + 1]``: how many are at the tokens before each."""

    first: int
    rows: Tensor
    indices: Tensor
    slots: Tensor
    width: int
    below: list[int]

    @staticmethod
    def of(first: int, rows: Tensor, indices: Tensor, tokens: int) -> _FeatureLayout:
        per_token = torch.bincount(rows, minlength=tokens)
        below = torch.cat([per_token.new_zeros(1), per_token.cumsum(0)])
        width = int(per_token.max()) if rows.numel() else 0
        slots = rows * width + torch.arange(rows.numel(), device=rows.device) - below[rows]
        return _FeatureLayout(first, rows, indices, slots, width, below.tolist())


class _Nodes:
    """The graph's nodes over one batch element's frozen model (on its real tokens): features in
    (layer, position, feature) order, then errors (layer-major), then tokens; and for each source
    level of the model, which nodes (or constants) enter there."""

    def __init__(self, model: FrozenModel, replaced, batch: int, real: Tensor, real_positions: Tensor):
        self.model, self.replaced = model, replaced
        n = model.sources[0].shape[0]
        layers = replaced.num_layers
        self.n, self.layers = n, layers
        pick = real.to(model.sources[0].device)
        self.roles: dict[int, tuple] = {}  # level → ("token",) | ("error", l) | ("constant",) | ("features", l)
        self.feature_sublayer: dict[int, int] = {}
        self.constant_rows: dict[int, Tensor] = {}  # level → the rows of a source no node writes
        for level, name in enumerate(model.source_names):
            if level == 0:
                self.roles[0] = ("token",)
            elif name.endswith(" MLP error") or name.endswith(" MLP"):
                self.roles[level] = ("error", int(name.split()[0][1:]))
            elif name.endswith(" transcoder bias"):
                layer = int(name.split()[0][1:])
                self.roles[level] = ("features", layer)
                self.feature_sublayer[layer] = level - 1
            else:
                self.roles[level] = ("constant",)
        # Features: (layer, real row, global index into the layer's replaced features) with gate 1.
        rows, layer_of, index_of = [], [], []
        self.feature_nodes: dict[int, _FeatureLayout] = {}
        self.layer_data = {}
        count = 0
        feature_ids, activations = [], []
        gates_of = {}
        for layer in sorted(self.feature_sublayer):
            data = replaced.layers[layer]
            gates = gates_of[layer] = data.gates[batch][pick]  # [n, F']
            acts = data.activations[batch][pick]
            on = gates.nonzero()  # [m, 2] rows (position, feature index), in position-major order
            ids = data.features.to(on.device)[on[:, 1]]
            order = torch.argsort(on[:, 0] * (data.num_features + 1) + ids, stable=True)
            on, ids = on[order], ids[order]
            self.feature_nodes[layer] = _FeatureLayout.of(count, on[:, 0], on[:, 1], n)
            output_scale, encoder_bias = data.output_scale[batch][pick], data.encoder_bias[batch][pick]
            self.layer_data[layer] = (data, acts, output_scale, data.input_scale[batch][pick], encoder_bias)
            # The constant rows less what the feature nodes write of them (their pre-activations'
            # constants through their gates, a cross-layer set's earlier layers' too): the rest
            # (b_dec, the skip term's) is no node's.
            level = self.feature_sublayer[layer] + 1
            written = sum(
                (gates_of[source] * self.layer_data[source][4]) @ decoder
                for source, decoder in replaced.writers(layer).items()
            )
            self.constant_rows[level] = model.sources[level] - output_scale[:, None] * written
            rows.append(on[:, 0].cpu())
            layer_of.append(torch.full((on.shape[0],), layer))
            index_of.append(on[:, 1].cpu())
            feature_ids.append(ids.cpu())
            activations.append(acts[on[:, 0], on[:, 1]].cpu())
            count += on.shape[0]
        self.features_count = count
        self.error_start = count
        self.token_start = count + layers * n
        self.count = self.token_start + n
        positions = real_positions.cpu()
        cat = lambda parts, dtype: torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)  # noqa: E731
        feature_rows = cat(rows, torch.long)
        self.kinds = torch.cat(
            [torch.full((count,), KINDS.index("feature")), torch.full((layers * n,), KINDS.index("error")),
             torch.full((n,), KINDS.index("token"))]
        )  # fmt: skip
        self.layers_of = torch.cat([cat(layer_of, torch.long), torch.arange(layers).repeat_interleave(n),
                                    torch.full((n,), -1)])  # fmt: skip
        self.positions = torch.cat([positions[feature_rows], positions.repeat(layers), positions])
        self.features = torch.cat([cat(feature_ids, torch.long), torch.full((layers * n + n,), -1)])
        self.activations = torch.cat(
            [cat(activations, torch.float64), torch.zeros(layers * n + n, dtype=torch.float64)]
        )
        self._rows, self._layer_of, self._index_of = feature_rows, cat(layer_of, torch.long), cat(index_of, torch.long)
        self.error_level = {role[1]: level for level, role in self.roles.items() if role[0] == "error"}

    def feature_target(self, node: int) -> _Target:
        """What feature node ``node`` reads: its pre-activation at the MLP's input (``rho = s e_t``,
        ``phi = M enc_f``) and its constant ``S enc_f + b_enc,f``."""
        layer, row, index = int(self._layer_of[node]), int(self._rows[node]), int(self._index_of[node])
        data, _, _, input_scale, encoder_bias = self.layer_data[layer]
        rho = torch.zeros(self.n, dtype=torch.float64, device=input_scale.device)
        rho[row] = input_scale[row]
        reads = self.feature_sublayer[layer] - self.replaced.parallel  # a parallel block's MLP: below its attention
        return _Target(node, reads, rho, data.encoder[:, index], float(encoder_bias[row, index]))

    def writes(self, node: int) -> list[tuple[Tensor, int]]:
        """What node ``node`` writes: ``(rows [n, d] (one non-zero), the level where they enter)``, one
        per layer it writes into (a cross-layer feature's every later layer), lowest first."""
        model = self.model
        rows = torch.zeros_like(model.sources[0])
        if node < self.features_count:
            layer, row, index = int(self._layer_of[node]), int(self._rows[node]), int(self._index_of[node])
            acts = self.layer_data[layer][1]
            written = []
            for target, decoder in self.replaced.writes(layer).items():
                rows = torch.zeros_like(model.sources[0])
                rows[row] = acts[row, index] * self.layer_data[target][2][row] * decoder[index]
                written.append((rows, self.feature_sublayer[target] + 1))
            return written
        if node < self.token_start:
            layer, row = divmod(node - self.error_start, self.n)
            if layer not in self.error_level:
                raise ValueError(f"{_WHERE}: layer {layer} has no MLP in this model: its error nodes write nothing")
            level = self.error_level[layer]
            rows[row] = model.sources[level][row]
            return [(rows, level)]
        row = node - self.token_start
        rows[row] = model.sources[0][row]
        return [(rows, 0)]

    def record(self, level: int, adjoint: Tensor, rows: Tensor, constants: Tensor) -> None:
        """Add what the sources at ``level`` give the targets whose adjoints are ``adjoint [T, n', d]``
        (the first ``n' ≤ n`` tokens: the rest are zero, :func:`_sweep`): into their node columns
        ``rows [T, nodes]`` or their ``constants [T]``."""
        role = self.roles[level]
        reach = adjoint.shape[1]
        source = self.constant_rows.get(level, self.model.sources[level])[:reach]
        per_row = torch.einsum("bnd,nd->bn", adjoint, source)  # [T, n'], a product per token (no [T, n', d] temporary)
        if role[0] == "token":
            rows[:, self.token_start : self.token_start + reach] += per_row
        elif role[0] == "error":
            start = self.error_start + role[1] * self.n
            rows[:, start : start + reach] += per_row
        else:
            constants += per_row.sum(-1)
        if role[0] != "features":
            return
        output_scale = self.layer_data[role[1]][2]
        for writer, decoder in self.replaced.writers(role[1]).items():
            layout = self.feature_nodes.get(writer)
            if layout is None or not layout.width:  # (width 0: no feature of the layer is active here)
                continue
            acts = self.layer_data[writer][1]
            # Token by token, the features active there: G[:, t] · (a_f(t) o(t) d_f), without the
            # [T, n, F'] product of every feature at every token: each token's writes padded to the
            # most any token has, one batched product over the tokens.
            feature_rows, indices = layout.rows, layout.indices
            written = (acts[feature_rows, indices] * output_scale[feature_rows])[:, None] * decoder[indices]
            padded = written.new_zeros(self.n * layout.width, written.shape[1])
            padded[layout.slots] = written
            padded = padded.view(self.n, layout.width, written.shape[1])[:reach]  # [n', width, d]
            read = torch.bmm(adjoint.transpose(0, 1), padded.transpose(1, 2))  # [n', T, width]
            below = layout.below[reach]  # the layer's nodes at the first n' tokens: a prefix of them
            read = read.transpose(0, 1).reshape(adjoint.shape[0], -1)[:, layout.slots[:below]]
            rows[:, layout.first : layout.first + below] += read


def _passed_down(sublayer: Sublayer, adjoint: Tensor, index: int) -> list[tuple[int, Tensor]]:
    """What a pre-norm sublayer (``index`` its place) adds to the adjoint ``G [T, n', d]`` of the
    stream leaving it, carried to the stream where its branches read: ``Σ_b T_bᵀ G F_in,b F_out,b``
    over its branches (a replaced MLP's: its skip map's steps only; its features are nodes), on the
    first ``n'`` tokens, as ``(level, added)`` per level they read at (the stream entering it, or a
    parallel block's below its attention); empty for a sublayer without branches (the adjoint passes
    unchanged)."""
    if sublayer.attn is None:
        return []
    reach = adjoint.shape[1]
    token_maps = sublayer.token_maps[:, :reach, :reach]
    feature_in, feature_out = sublayer.feature_factors  # [H, d, e], [H, e, d]
    added = []
    for first, stop, level in sublayer.branch_levels(index):
        narrow = torch.einsum("bnd,hde->bhne", adjoint, feature_in[first:stop])  # b: the targets
        narrow = torch.einsum("hst,bhse->bhte", token_maps[first:stop], narrow)  # T_hᵀ on the token axis
        added.append((level, torch.einsum("bhne,hed->bnd", narrow, feature_out[first:stop])))
    return added


def _sweep(
    model: FrozenModel, sublayers: list[Sublayer], nodes: _Nodes, targets: list[_Target], reach: int
) -> tuple[Tensor, Tensor]:
    """The rows ``[T, nodes]`` and constants ``[T]`` of ``targets`` (sorted by level, highest first):
    one backward pass from the highest level to the embedding through ``sublayers`` (the model's,
    :func:`_heads_only`), each target joining at its level. Only the targets joined so far (a
    prefix) are carried, and only the first ``reach`` tokens: every target reads there, and the
    token maps are causal where ``reach < n`` (:func:`_causal`), so the adjoint is zero below."""
    device = model.sources[0].device
    count = len(targets)
    adjoint = torch.zeros(count, reach, model.sources[0].shape[1], dtype=torch.float64, device=device)
    rows = torch.zeros(count, nodes.count, dtype=torch.float64, device=device)
    constants = torch.zeros(count, dtype=torch.float64, device=device)
    rho = torch.stack([target.rho[:reach] for target in targets])  # [T, n']
    phi = torch.stack([target.phi for target in targets])  # [T, d]
    joined = 0
    arriving: dict[int, Tensor] = {}  # level → what branches reading there (below sublayers above it) pass down
    for level in range(targets[0].level, -1, -1):
        joining = joined
        while joining < count and targets[joining].level == level:
            joining += 1
        if joining > joined:
            adjoint[joined:joining] += rho[joined:joining, :, None] * phi[joined:joining, None, :]
            joined = joining
        if level in arriving:
            added = arriving.pop(level)
            adjoint[: added.shape[0]] += added
        nodes.record(level, adjoint[:joined], rows[:joined], constants[:joined])
        if level:
            for below, added in _passed_down(sublayers[level - 1], adjoint[:joined], level - 1):
                if below == level - 1:
                    adjoint[:joined] += added
                    continue
                held = arriving.setdefault(below, added)  # (the targets joined since hold more rows)
                if held is not added:
                    larger, smaller = (held, added) if held.shape[0] >= added.shape[0] else (added, held)
                    larger[: smaller.shape[0]] += smaller
                    arriving[below] = larger
    return rows, constants


def _causal(sublayers: list[Sublayer]) -> bool:
    """Whether every token map is lower triangular (no token reads a later one): then a target that
    reads tokens up to t has an adjoint that is zero past t all the way down."""
    return all(
        bool(torch.triu(sublayer.token_maps, diagonal=1).eq(0).all())
        for sublayer in sublayers
        if sublayer.attn is not None
    )


def _reach_groups(targets: list[_Target], causal: bool, tokens: int) -> list[tuple[int, list[_Target]]]:
    """The targets in groups ``(reach, targets)`` swept together on their first ``reach`` tokens: one
    group of every token where the model is not causal; else groups of consecutive reaches (the
    last token each reads, plus one) chosen to minimise the work, ``Σ (overhead + size · reach)``
    with a sweep's fixed cost counted as ``_GROUP_OVERHEAD`` target-tokens."""
    if not causal:
        return [(tokens, targets)]
    reaches = [int(target.rho.nonzero().max()) + 1 if bool(target.rho.any()) else 1 for target in targets]
    sizes = Counter(reaches)
    values = sorted(sizes)
    below = [0]  # below[j]: the targets of the j smallest reaches
    for value in values:
        below.append(below[-1] + sizes[value])
    # best[j]: the least work for the targets of the j smallest reaches, cut[j] where its last group starts
    best, cut = [0.0], [0]
    for j in range(1, len(values) + 1):
        costs = [best[i] + _GROUP_OVERHEAD + (below[j] - below[i]) * values[j - 1] for i in range(j)]
        cut.append(min(range(j), key=costs.__getitem__))
        best.append(costs[cut[-1]])
    bounds, j = [], len(values)
    while j:
        bounds.append((values[cut[j]], values[j - 1]))
        j = cut[j]
    return [
        (high, [target for target, reach in zip(targets, reaches) if low <= reach <= high])
        for low, high in reversed(bounds)
    ]


#: A sweep's fixed cost (its Python and small per-level operations), in target-tokens of its work.
_GROUP_OVERHEAD = 48


def _final_readout(capture, batch: int, real: Tensor, row: int, device):
    """The frozen final norm at real row ``row``: ``(scale, read, constant)`` with a logit of direction
    ``u`` (and bias b) equal to ``scale · x · read(u) + constant(u, b)`` for the stream ``x`` there."""
    pick = real.to(device)
    scale = 1.0 if capture.final_scale is None else float(capture.final_scale[batch][pick][row])
    weight = None if capture.final_weight is None else capture.final_weight.to(device, torch.float64)
    shift = None if capture.final_bias is None else capture.final_bias.to(device, torch.float64)

    def read(u: Tensor) -> Tensor:  # C Γ u
        u = u if weight is None else u * weight
        return u - u.mean(-1, keepdim=True) if capture.final_centred and capture.final_scale is not None else u

    def constant(u: Tensor, b: Tensor | None) -> Tensor:
        value = (u @ shift) if shift is not None else torch.zeros(u.shape[:-1], dtype=torch.float64, device=device)
        return value if b is None else value + b

    return scale, read, constant


def _input_tokens(stack, batch: int, real: Tensor) -> Tensor | None:
    ids = getattr(stack.residual_capture, "input_ids", None)
    return None if ids is None else ids[batch][real.to(ids.device)].cpu()


# ------------------------------------------------------------------------------------------------
# The graph


def attribution_graph(
    stack,
    *,
    position: int | None = None,
    batch: int = 0,
    logits=None,
    max_logits: int = 10,
    desired_logit_prob: float = 0.95,
    max_feature_nodes: int | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    progress: bool = False,
) -> AttributionGraph:
    """The attribution graph of one prompt of a capture with transcoders (module docstring).

    Args:
        stack: a stack captured with ``transcoders=`` (:func:`pathkernels.adapters.capture_huggingface_residual`
            or ``capture_transformer_lens_residual``).
        position: the token whose logits are explained (default: the last real token).
        batch: the batch element.
        logits: vocabulary ids of the logits to explain (default: the most probable, up to
            ``max_logits`` and until their probabilities reach ``desired_logit_prob``, as
            circuit-tracer picks them).
        max_feature_nodes: at most this many feature nodes (default: every active feature), chosen
            as circuit-tracer chooses them: the logits' rows first, then, batch after batch, the
            unvisited features of most influence on the logits through the rows computed so far. A
            feature left out is no node: what it writes into a row goes into that row's constant.
        memory_budget: bytes for the rows and the adjacency (refused, naming ``max_feature_nodes``,
            where they would not fit) and for a batch of targets' adjoints (``8 n d`` bytes each).
        progress: a progress bar over the targets.

    Returns:
        :class:`AttributionGraph`, float64: ``adjacency.sum(1) + constant == values`` for every
        feature and logit node, exactly.
    """
    start = time.monotonic()
    capture = getattr(stack, "residual_capture", None)
    replaced = getattr(capture, "transcoders", None)
    if replaced is None:
        raise ValueError(
            f"{_WHERE}: expected a stack captured with transcoders= (pk.adapters.capture_huggingface_residual("
            "model, transcoders=...)): the graph's nodes are the transcoders' features"
        )
    if capture.layout != "pre":
        raise ValueError(
            f"{_WHERE}: the graph of a post-norm model (BERT's) is not computed yet (its backward sweep passes "
            "pre-norm skips); path_attribution and top_paths follow its features"
        )
    batch = check_int(batch, "batch", _WHERE, minimum=0, maximum=stack.batch_size - 1)
    memory_budget = check_int(memory_budget, "memory_budget", _WHERE, minimum=1)
    progress = check_flag(progress, "progress", _WHERE)
    max_logits = check_int(max_logits, "max_logits", _WHERE, minimum=1)
    if max_feature_nodes is not None:
        max_feature_nodes = check_int(max_feature_nodes, "max_feature_nodes", _WHERE, minimum=0)
    if isinstance(desired_logit_prob, bool) or not isinstance(desired_logit_prob, (int, float)):
        raise ValueError(f"{_WHERE}: expected desired_logit_prob to be a number in (0, 1], got {desired_logit_prob!r}")
    if not 0.0 < float(desired_logit_prob) <= 1.0:
        raise ValueError(f"{_WHERE}: expected desired_logit_prob in (0, 1], got {desired_logit_prob!r}")
    if capture.unembedding is None:
        raise ValueError(f"{_WHERE}: the capture has no unembedding (a model without an LM head): no logits to explain")
    tokens = stack.attn.shape[-1]
    real = torch.ones(tokens, dtype=torch.bool) if stack.token_mask is None else stack.token_mask[batch].cpu().bool()
    real_positions = real.nonzero().flatten()
    position = real_positions[-1].item() if position is None else check_int(position, "position", _WHERE)
    if not -tokens <= position < tokens or not bool(real[position]):
        raise ValueError(f"{_WHERE}: expected position of a real token of batch element {batch}, got {position}")
    position %= tokens
    model = frozen_model(stack, capture, batch, real)
    device = model.sources[0].device
    row = int((real_positions == position).nonzero()[0])  # the position among the real tokens

    # The logits at the position, through the frozen final norm; the chosen ones demeaned.
    unembedding = capture.unembedding.detach().to(device, torch.float64)  # [V, d]
    bias = None if capture.unembedding_bias is None else capture.unembedding_bias.detach().to(device, torch.float64)
    scale, read, constant_of = _final_readout(capture, batch, real, row, device)
    stream = capture.residual[batch][real.to(device)][row]
    full_logits = scale * (stream @ read(unembedding).T) + constant_of(unembedding, bias)  # [V]
    probabilities = torch.softmax(full_logits, -1)
    if logits is None:
        top = probabilities.topk(min(max_logits, probabilities.numel()))
        reach = torch.tensor(float(desired_logit_prob), dtype=torch.float64, device=device)
        logit_ids = top.indices[: int(torch.searchsorted(top.values.cumsum(0), reach)) + 1]
    else:
        logit_ids = torch.as_tensor(logits).flatten().to(device)
        vocabulary = unembedding.shape[0]
        if (
            logit_ids.numel() == 0
            or logit_ids.is_floating_point()
            or bool(((logit_ids < 0) | (logit_ids >= vocabulary)).any())
        ):
            raise ValueError(f"{_WHERE}: expected logits as vocabulary ids in [0, {vocabulary}), got {logits!r}")
        logit_ids = logit_ids.long()
    directions = unembedding[logit_ids] - unembedding.mean(0)  # [K, d]: circuit-tracer's demeaned columns
    biases = None if bias is None else bias[logit_ids] - bias.mean()
    logit_values = full_logits[logit_ids] - full_logits.mean()

    nodes = _Nodes(model, replaced, batch, real, real_positions)
    logit_count, features = logit_ids.numel(), nodes.features_count
    top_level = len(model.sources) - 1
    own = constant_of(directions, biases)
    logit_targets = []
    for k in range(logit_count):
        rho = torch.zeros(nodes.n, dtype=torch.float64, device=device)
        rho[row] = scale
        logit_targets.append(_Target(nodes.count + k, top_level, rho, read(directions[k]), float(own[k])))
    chosen = features if max_feature_nodes is None else min(features, max_feature_nodes)
    others = nodes.count - features  # errors and tokens
    final = chosen + others + logit_count
    # The rows (and, choosing among the features, each row normalised) and the adjacency.
    tables = 1 if chosen == features else 2
    needed = 8 * (tables * (chosen + logit_count) * nodes.count + final * final)
    if needed > memory_budget:
        raise ValueError(
            f"{_WHERE}: the graph of {chosen:,} of the {features:,} active features needs {format_bytes(needed)} for "
            f"its rows and adjacency, more than memory_budget = {format_bytes(memory_budget)}; pass a smaller "
            "max_feature_nodes (the features of most influence on the logits are chosen) or a larger memory_budget"
        )
    # Each target's row over every node (features, errors, tokens), on the CPU, in the order computed.
    table = torch.zeros(chosen + logit_count, nodes.count, dtype=torch.float64)
    normalised = None if tables == 1 else torch.zeros_like(table)  # |row| / Σ |row| (_partial_influence)
    slots: dict[int, int] = {}  # node → its row of the table
    constants: dict[int, float] = {}
    made: dict[int, _Target] = {}  # node → what it reads
    # The sublayers an edge's chains pass (a replaced MLP's features are nodes): made once, so that
    # their token maps and factors are computed once, for the sweeps and for edge_paths.
    heads_only = [_heads_only(sublayer, model.replaced, index) for index, sublayer in enumerate(model.sublayers)]
    chunk = max(1, memory_budget // (4 * 8 * model.sources[0].numel()))
    bar = progress_bar(chosen + logit_count, enabled=progress, unit="target", desc=_WHERE)

    causal = _causal(heads_only)

    def compute(targets: list[_Target]) -> None:
        targets = sorted(targets, key=lambda target: -target.level)
        computed = {}
        for reach, group in _reach_groups(targets, causal, nodes.n):
            for first in range(0, len(group), chunk):
                part = group[first : first + chunk]
                part_rows, part_constants = _sweep(model, heads_only, nodes, part, reach)
                for target, values_row, value in zip(part, part_rows.cpu(), part_constants.cpu().tolist()):
                    computed[target.node] = values_row, value + target.constant
                if bar is not None:
                    bar.update(len(part))
        first = len(slots)
        for target in targets:  # in level order, whatever the groups
            slots[target.node] = len(slots)
            table[slots[target.node]], constants[target.node] = computed[target.node]
            made[target.node] = target
        if normalised is not None:
            normalised[first : len(slots)] = _row_normalised(table[first : len(slots)])

    compute(logit_targets)
    if chosen == features:
        selected = torch.arange(features)
        compute([nodes.feature_target(node) for node in range(features)])
    else:  # circuit-tracer's order: the unvisited features of most influence on the logits, so far
        batch_size = max(1, min(chunk, 256))
        visited = torch.zeros(features, dtype=torch.bool)
        while int(visited.sum()) < chosen:
            influence = _partial_influence(
                normalised[: len(slots)], torch.tensor(list(slots)), nodes.count, probabilities[logit_ids].cpu()
            )
            influence = influence[:features].masked_fill(visited, -1.0)
            take = influence.argsort(descending=True)[: min(batch_size, chosen - int(visited.sum()))]
            visited[take] = True
            compute([nodes.feature_target(int(node)) for node in take])
        selected = visited.nonzero().flatten()
    if bar is not None:
        bar.close()

    # The graph's nodes: the selected features, then the errors, tokens and logits; the features left
    # out write into their targets' constants, so that every row still sums to its node's value.
    keep = torch.cat([selected, torch.arange(features, nodes.count)])
    left_out = torch.ones(features, dtype=torch.bool)
    left_out[selected] = False
    index = {int(node): position for position, node in enumerate(selected.tolist())}
    index |= {nodes.count + k: final - logit_count + k for k in range(logit_count)}
    adjacency = torch.zeros(final, final, dtype=torch.float64)
    constant = torch.zeros(final, dtype=torch.float64)
    at = torch.tensor([index[node] for node in slots])
    adjacency[at, : chosen + others] = table[:, keep]
    constant[at] = torch.tensor([constants[node] for node in slots], dtype=torch.float64)
    constant[at] += table[:, :features][:, left_out].sum(1)
    values = torch.zeros(final, dtype=torch.float64)
    values[:chosen] = nodes.activations[selected]
    values[final - logit_count :] = logit_values.cpu()
    by_node = {index[node]: target for node, target in made.items()}

    graph = AttributionGraph(
        kinds=torch.cat([nodes.kinds[keep], torch.full((logit_count,), KINDS.index("logit"))]),
        layers=torch.cat([nodes.layers_of[keep], torch.full((logit_count,), replaced.num_layers)]),
        positions=torch.cat([nodes.positions[keep], torch.full((logit_count,), position)]),
        features=torch.cat([nodes.features[keep], logit_ids.cpu()]),
        activations=torch.cat([nodes.activations[keep], logit_values.cpu()]),
        adjacency=adjacency,
        values=values,
        constant=constant,
        logit_tokens=logit_ids.cpu(),
        logit_probabilities=probabilities[logit_ids].cpu(),
        input_tokens=_input_tokens(stack, batch, real),
        real_positions=real_positions,
        num_layers=replaced.num_layers,
        description=replaced.description,
        batch=batch,
        active_features=features,
        seconds=time.monotonic() - start,
    )
    # (edge_paths reads a node's write by its index among every node: the selected ones keep theirs)
    original = torch.cat([keep, torch.full((logit_count,), -1)])
    graph._context = {"model": model, "targets": by_node, "nodes": nodes, "original": original}
    graph._context["heads_only"] = heads_only
    return named(graph, stack)


__all__ = ["KINDS", "MAX_EDGE_PATHS", "AttributionGraph", "attribution_graph"]
