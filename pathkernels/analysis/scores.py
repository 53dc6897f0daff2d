"""Where heads look: a head's attention scores as exact sums over pairs of paths.

With every norm frozen at one forward pass, the stream entering layer l is a sum of paths (a
source below l, then heads below l; :mod:`pathkernels.analysis.readout_trie`), and head h's
pre-softmax score at query i and key j is bilinear in that stream at i and at j
(:mod:`pathkernels.adapters.query_key`). So it splits exactly (docs/DESIGN.md, "Where heads look"):

    s_ij = Σ_{p, p'} scaling · ⟨q_p(i), k_{p'}(j)⟩,

p and p' running over the paths of the stream and over one constant each (the norm's β and the
projection's bias through the same frozen maps). ``q_p(i) = R_i (ν_i γ_Q ⊙ (D_i (Y_p C Γ)_i W_Q))``
for a pre-norm model: the path's term ``Y_p`` through the frozen norm, the query projection, a frozen
query norm and the rotation at i; likewise ``k_{p'}(j)``.

- :func:`score_decomposition`: the score grouped by (source, number of heads) on each side, for a
  query and every key it may attend (or chosen keys), exact at any depth: the groups' terms come
  from one pass over the layers below, as the sums by length do.
- :func:`score_pairs`: every pair of paths, where they are few enough to list, with the top and
  bottom pairs.
- :func:`score_attribution`: one side fixed to the model's own query or key, the score is a linear
  readout of the stream at the other token, so every path on that side gets its exact share from
  the readout trie (:func:`pathkernels.path_attribution`'s walk).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from pathkernels.adapters.query_key import SIDES
from pathkernels.analysis.attribution import CheckedReadout, PathAttribution, Readout, attribute, named, pair_bars
from pathkernels.analysis.readout_trie import FrozenModel, Sublayer, describe_path, frozen_model
from pathkernels.analysis.real_paths import _every_term, _moves, _skip, branch_sum
from pathkernels.analysis.top_paths import SearchOptions, TopPaths, search_top_paths
from pathkernels.core._figures import check_save_path, heatmap, new_figure, require, saved, titled, wrapped
from pathkernels.core._memory import format_bytes, working_budget
from pathkernels.core._progress import progress_bar
from pathkernels.core.checks import check_flag, check_int, listed, renamed
from pathkernels.core.planner import DEFAULT_MEMORY_BUDGET

if TYPE_CHECKING:
    from pathkernels.adapters.stack import AttentionStack

_WHERE = "pathkernels.score_decomposition"
CONSTANT = "constant"  # the label of a side's constant: its norm's β and its bias through the frozen maps
POSITION = "position bias"  # the label of what the model adds to a score whatever the stream (ALiBi)
FEW_PATHS = 12  # score_decomposition also splits the score path by path where the stream has at most this many


@dataclass
class CheckedHead:
    """One head of a captured stack at one sequence, checked: the frozen model below its layer (on
    the sequence's real tokens), its query/key maps and where its tokens are."""

    stack: AttentionStack
    layer: int
    head: int
    batch: int
    model: FrozenModel  # the sublayers and sources below the head's layer
    positions: Tensor  # [n] the real tokens' positions in the sequence
    scale: Tensor  # [n] D of the layer's attention-input norm
    gamma: Tensor  # [d] Γ
    shift: Tensor  # [d] β (0 for RMSNorm)
    centred: bool

    @property
    def maps(self):
        return self.stack.residual_capture.query_key

    def inputs(self, parts: Tensor, rows: Tensor) -> Tensor:
        """The attention's input ``D (Y C) Γ`` (no β) of stream parts ``[..., T, d]`` at real-token
        indices ``rows [T]``."""
        parts = parts - parts.mean(-1, keepdim=True) if self.centred else parts
        return self.scale[rows, None] * parts * self.gamma

    def side(self, which: str, parts: Tensor, rows: Tensor) -> Tensor:
        """One side's vectors ``[..., T, e]`` of stream parts ``[..., n, d]`` at real-token indices
        ``rows [T]`` (the parts' constant not included)."""
        inputs = self.inputs(parts[..., rows, :], rows)
        return self.maps.project(which, inputs, self.batch, self.layer, self.head, self.positions[rows])

    def readout_columns(self, which: str, row: int) -> Tensor:
        """One side as a readout of the stream at real-token index ``row``: ``Φᵀ`` ``[d, e]`` with
        ``x_t Φᵀ D_t`` the side's vector of a stream row ``x_t`` (its constant apart), i.e. the
        side's own linear map (:meth:`side`: the frozen norm's ``C Γ``, the projection, a query/key
        norm, the rotation) applied to every basis row; ``D_t`` is left to the readout's ``ρ``."""
        d = self.gamma.shape[0]
        basis = torch.eye(d, dtype=torch.float64, device=self.gamma.device)
        basis = basis - basis.mean(-1, keepdim=True) if self.centred else basis
        rows = self.positions[row : row + 1]
        return self.maps.project(which, (basis * self.gamma)[:, None, :], self.batch, self.layer, self.head, rows)[:, 0]

    def constant(self, which: str, rows: Tensor) -> Tensor:
        """One side's constant ``[T, e]`` at real-token indices ``rows``."""
        return self.maps.constant(which, self.shift, self.batch, self.layer, self.head, self.positions[rows])

    def model_scores(self, query: int, keys: Tensor) -> Tensor:
        """The model's own scores ``[K]`` of real-token index ``query`` against ``keys``."""
        scores = self.maps.model_scores(self.batch, self.layer, self.head)
        return scores[self.positions[query], self.positions[keys]]

    def position_bias(self, query: int, keys: Tensor) -> Tensor:
        """The position bias ``[K]`` (ALiBi; zeros without one) of ``query`` against ``keys``."""
        bias = self.maps.bias(self.batch, self.layer, self.head)
        return bias[self.positions[query], self.positions[keys]]


def checked_head(stack, layer, head, batch, where: str) -> CheckedHead:
    """Head ``(layer, head)`` of sequence ``batch`` of a stack captured with its queries and keys,
    every argument refused in ``where``'s name where it is not what is expected; what the score
    analyses of this module, the pair search and the causal check start from."""
    capture = getattr(stack, "residual_capture", None)
    if capture is None or getattr(capture, "query_key", None) is None:
        raise ValueError(
            f"{where}: expected a stack captured with its queries and keys "
            "(pk.adapters.capture_huggingface_residual(model, query_key=True, ...))"
        )
    if capture.layout != "pre":
        raise ValueError(f"{where}: scores of post-norm models (BERT's) are not decomposed yet")
    layer = check_int(layer, "layer", where, minimum=0, maximum=stack.num_layers - 1)
    head = check_int(head, "head", where, minimum=0, maximum=stack.num_heads - 1)
    batch = check_int(batch, "batch", where, minimum=0, maximum=stack.batch_size - 1)
    tokens = stack.attn.shape[-1]
    real = torch.ones(tokens, dtype=torch.bool) if stack.token_mask is None else stack.token_mask[batch].cpu().bool()
    full = frozen_model(stack, capture, batch, real, where=where, through=layer)  # up to the head's layer
    model, attention = _model_below(full, layer)
    device = capture.embedding.device
    return CheckedHead(
        stack,
        layer,
        head,
        batch,
        model,
        real.nonzero().flatten().to(device),
        attention.scale,
        attention.gamma,
        capture.norm_bias[layer, 0],
        attention.centred,
    )


def _model_below(full: FrozenModel, layer: int) -> tuple[FrozenModel, Sublayer]:
    """The frozen model below layer ``layer``'s attention sublayer, and that sublayer. Below it: each
    layer's attention, then its MLP's sublayer (or a replaced MLP's steps and its identity). With
    transcoders a path keeps the whole model's ``[2L]`` columns (heads, then MLP steps), as
    pk.path_terms takes them; else the heads below, ``[l]``."""
    below = next(i for i, sub in enumerate(full.sublayers) if sub.attn is not None and sub.column == layer)
    columns = layer if full.replaced is None else full.layers
    model = FrozenModel(
        full.sublayers[:below],
        full.sources[: below + 1],
        full.source_names[: below + 1],
        columns,
        full.num_heads,
        replaced=full.replaced,
    )
    return model, full.sublayers[below]


def _position(value, name: str, head: CheckedHead, where: str) -> int:
    """A token position of the head's sequence as its index among the real tokens."""
    tokens = head.stack.attn.shape[-1]
    position = check_int(value, name, where, minimum=-tokens, maximum=tokens - 1) % tokens
    index = (head.positions == position).nonzero().flatten()
    if index.numel() == 0:
        raise ValueError(f"{where}: expected {name} to be a real token of batch element {head.batch}, got {value}")
    return int(index[0])


def query_and_keys(
    head: CheckedHead, query, keys, where: str, allow_masked: bool = False, name: str = "keys"
) -> tuple[int, Tensor]:
    """``(query index, key indices [K])`` among the real tokens: the last real token and every key
    it may attend by default. A key the mask forbids the query (a later token under causal
    attention) is refused unless ``allow_masked``: the model never uses its score."""
    query = head.positions.numel() - 1 if query is None else _position(query, "query", head, where)
    allowed = head.maps.allowed[head.batch, head.layer, head.positions[query], head.positions]  # [n]
    if keys is None and name == "keys":
        return query, allowed.nonzero().flatten()
    keys = listed(keys)
    keys = list(keys) if isinstance(keys, (list, tuple)) else [keys]
    if not keys:
        raise ValueError(f"{where}: expected {name} to hold at least one position, got {keys!r}")
    indices = [_position(k, name, head, where) for k in keys]
    if not check_flag(allow_masked, "allow_masked", where):
        forbidden = [k for k, i in zip(keys, indices) if not bool(allowed[i])]
        if forbidden:
            raise ValueError(
                f"{where}: the mask forbids query {int(head.positions[query])} to attend {name} {forbidden} (a later "
                "token under causal attention), so the model never uses that score; pass allow_masked=True to "
                "decompose it anyway"
            )
    return query, torch.tensor(indices, device=head.positions.device)


def _source_lengths(moves, source: int) -> int:
    """How many lengths (0, 1, …) the paths from ``source`` to the top take: a recursion over the
    positions above it, each length reachable at the skip's and at every move's position after."""
    longest = [-1] * len(moves)
    longest[source] = 0
    for position in range(source, len(moves) - 1):
        if longest[position] < 0:
            continue
        longest[position + 1] = max(longest[position + 1], longest[position])
        for *_, after in moves[position]:
            longest[after] = max(longest[after], longest[position] + 1)
    return longest[-1] + 1


def _source_parts(model: FrozenModel, source: int, moves, chunk: int) -> Tensor:
    """Source ``source``'s part of the stream entering the sublayer above ``model``, split by the
    number of steps (heads; with transcoders, heads and MLP steps) its paths take: ``[g, n, d]``,
    row k the sum of its paths of k steps, exact, by one pass over the sublayers above it (the
    skip on every row, and every branch on row k added to row k + 1; a cross-layer set's steps that
    read here added where they write, :func:`~pathkernels.analysis.real_paths._moves`). The rows
    are held in one buffer and the branches run over ``chunk`` rows at a time, from the top row
    down, so that each chunk reads its rows before the chunk above adds into them."""
    top = len(model.sublayers)
    size = _source_lengths(moves, source)
    parts = model.sources[source].new_zeros(size, *model.sources[source].shape)
    parts[0] = model.sources[source]
    live = 1  # rows 0 … live − 1 hold paths
    arriving: dict[int, list] = {}  # position → [rows held, the rows' terms]
    for position in range(source, top + 1):
        if position in arriving:
            held, terms = arriving.pop(position)
            parts[:held] += terms[:held]
            live = max(live, held)
        if position == top:
            break
        here = moves[position]
        sublayer = model.sublayers[position]
        for start in reversed(range(0, live, chunk)):
            rows = slice(start, min(start + chunk, live))
            grown = [
                (after, branch_sum(model.sublayers[q], parts[rows], first, stop)) for q, first, stop, after in here
            ]
            parts[rows] = _skip(sublayer, parts[rows])
            for after, terms in grown:  # one step longer: rows + 1
                if after == position + 1:
                    parts[rows.start + 1 : rows.stop + 1] += terms
                else:
                    buffer = arriving.setdefault(after, [0, torch.zeros_like(parts)])
                    buffer[0] = max(buffer[0], rows.stop + 1)
                    buffer[1][rows.start + 1 : rows.stop + 1] += terms
        if any(after == position + 1 for *_, after in here):
            live += 1
    return parts[:live]


def _group_label(names: list[str], group: tuple[int, int], steps: bool = False) -> str:
    """``"L0 MLP via 2 heads"`` (``steps``: a capture with transcoders, ``"… via 2 steps"``)."""
    source, length = group
    unit = "step" if steps else "head"
    return f"{names[source]} (direct)" if length == 0 else f"{names[source]} via {length} {unit}{'s' * (length > 1)}"


@dataclass
class ScoreDecomposition:
    """One head's scores at one query, split by pairs of path groups (:func:`score_decomposition`).

    Attributes:
        layer, head, batch, query: the head, the sequence and the query's position.
        keys: ``[K]`` the keys' positions.
        groups: the labels of the groups, the same on both sides: ``"embedding (direct)"``,
            ``"L0 MLP via 2 heads"``, …, and :data:`CONSTANT` last (β and the projection's bias).
        table: ``[G, G, K]`` float64: entry ``[a, b, k]`` is ``scaling · ⟨q_a(query), k_b(key k)⟩``,
            group a's query against group b's key.
        position: ``[K]`` what the model adds to each score whatever the stream (ALiBi), 0 without.
        scores: ``[K]`` the pre-softmax scores, the table's sum plus ``position`` (pre-cap where the
            model caps them).
        model_scores: ``[K]`` the model's own, from its queries and keys as it computed them.
        allowed: ``[K]`` whether the mask lets the query attend each key.
        soft_cap: the cap of a soft-capped model (the scores here are before it), else None.
        path_count: the paths of the stream below the layer, each side's (with a capture's
            transcoders, through the active features below).
        paths, path_table: where the stream below the layer has at most :data:`FEW_PATHS` paths
            (the first layers of a small model), the same split path by path, so that the heads
            the groups merge stand apart: ``paths`` their labels (``"L0H1 from embedding"``, …,
            :data:`CONSTANT` last) and ``path_table [P+1, P+1, K]``; else None.
        model_name: the model's name for figure titles (the stack's ``name``).
    """

    layer: int
    head: int
    batch: int
    query: int
    keys: Tensor
    groups: tuple[str, ...]
    table: Tensor
    scores: Tensor
    model_scores: Tensor
    allowed: Tensor
    soft_cap: float | None = None
    position: Tensor | None = None
    paths: tuple[str, ...] | None = None
    path_table: Tensor | None = None
    model_name: str = ""
    path_count: int = 0

    def __repr__(self) -> str:
        error = float((self.scores - self.model_scores).abs().max()) if self.scores.numel() else 0.0
        capped = f", pre-cap (cap {self.soft_cap:g})" if self.soft_cap else ""
        return (
            f"ScoreDecomposition(L{self.layer}H{self.head}, batch {self.batch}, query {self.query}, "
            f"{self.keys.numel()} keys, {len(self.groups)} groups per side{capped}; "
            f"largest |sum − model| {error:.2g})"
        )

    def _key(self, key: int | None) -> int:
        if key is None:
            if self.keys.numel() != 1:
                raise ValueError(
                    f"pathkernels.ScoreDecomposition: expected key= one of the {self.keys.numel()} key positions "
                    f"{self.keys.tolist()[:8]}…"
                )
            return 0
        key = check_int(key, "key", "pathkernels.ScoreDecomposition")
        where = (self.keys == key).nonzero().flatten()
        if where.numel() == 0:
            raise ValueError(f"pathkernels.ScoreDecomposition: key {key} is not among the keys {self.keys.tolist()}")
        return int(where[0])

    def pair_table(self, key: int | None = None, other: int | None = None) -> Tensor:
        """``[G, G]``: the table at one key position, or (``other`` given) the difference of two
        keys' tables, which explains why the head prefers ``key`` to ``other``."""
        table = self.table[..., self._key(key)]
        return table if other is None else table - self.table[..., self._key(other)]

    def by_query_group(self) -> Tensor:
        """``[G, K]``: each query group's share of every key's score (the key side summed)."""
        return self.table.sum(1)

    def by_key_group(self) -> Tensor:
        """``[G, K]``: each key group's share of every key's score (the query side summed)."""
        return self.table.sum(0)

    def to_frame(self, key: int | None = None, other: int | None = None):
        """A pandas DataFrame of :meth:`pair_table`: one row per (query group, key group), largest
        magnitude first, with its ``fraction`` of the total (the score, or the difference: the
        fractions sum to 1; an attribution table's ``share`` is of the absolute values' sum)."""
        pd = require("pandas")
        table = self.pair_table(key, other)
        rows = [
            {"query group": q, "key group": k, "value": float(table[a, b])}
            for a, q in enumerate(self.groups)
            for b, k in enumerate(self.groups)
        ]
        if self.position is not None and bool(self.position.any()):
            bias = self.position[self._key(key)] - (0 if other is None else self.position[self._key(other)])
            rows.append({"query group": POSITION, "key group": POSITION, "value": float(bias)})
        total = sum(row["value"] for row in rows)
        frame = pd.DataFrame(rows)
        frame["fraction"] = frame["value"] / total if total != 0 else float("nan")
        return frame.reindex(frame["value"].abs().sort_values(ascending=False).index).reset_index(drop=True)

    def plot(self, key: int | None = None, other: int | None = None, *, ax=None, path=None):
        """A heatmap of :meth:`pair_table` (query side down, key side across), colours symmetric
        around 0 with a labelled colour bar, each cell's value written in it where the grid is
        small; path by path (:attr:`path_table`: the heads apart) where the stream below the layer
        has few paths, else by group. Rows and columns that are 0 throughout (an MLP that is
        zero) are left out. Saved to ``path`` when given. Returns the figure."""
        check_save_path(path, "pathkernels.ScoreDecomposition.plot")
        require("matplotlib")
        if self.path_table is not None:
            index = self._key(key)
            table = self.path_table[..., index]
            if other is not None:
                table = table - self.path_table[..., self._key(other)]
            names = self.paths
        else:
            table, names = self.pair_table(key, other), self.groups
        table = table.cpu()
        used = (table.abs().sum(1) > 0) | (table.abs().sum(0) > 0)
        labels = [g for g, u in zip(names, used.tolist()) if u]
        table = table[used][:, used]
        if ax is None:
            side = max(4.5, 0.6 * len(labels))
            _, ax = new_figure(side + 2.4, side + 1.3)
        what = f"key {int(self.keys[self._key(key)])}" + ("" if other is None else f" − key {int(other)}")
        label = "score term" if other is None else f"score term, {what}"
        heatmap(ax, table, labels, labels, label, row_label="query side", column_label="key side")
        title = f"L{self.layer}H{self.head} score, query {self.query}, {what}"
        ax.set_title(wrapped(titled(self.model_name, title), 60), fontsize=9)
        return saved(ax.figure, path)


def score_decomposition(
    stack: AttentionStack,
    layer: int,
    head: int,
    *,
    query: int | None = None,
    keys=None,
    batch: int = 0,
    allow_masked: bool = False,
    memory_budget: int | None = None,
    progress: bool = False,
) -> ScoreDecomposition:
    """Head ``(layer, head)``'s pre-softmax scores at one query, split exactly by pairs of path
    groups (source, number of heads) on the query and the key side (module docstring).

    Args:
        stack: a stack captured with its queries and keys
            (``pk.adapters.capture_huggingface_residual(model, query_key=True, ...)``).
        layer, head: the head.
        query: the query token's position (default: the last real token).
        keys: a key position or positions (default: every key the query may attend).
        batch: the sequence.
        allow_masked: also decompose keys the mask forbids the query (refused by default: the
            model never uses their scores).
        memory_budget: bytes for the result (the table ``[G+1, G+1, K]`` float64 and each side's
            vectors) and the work: one source's groups ``[g, n, d]`` at a time, their branches run
            over as many groups as fit. Default None: half the memory free now. Refused by name,
            with the bytes it needs, where the result and one group's work do not fit.
        progress: a progress bar over the sources.

    Returns:
        :class:`ScoreDecomposition`; its ``table [G, G, K]`` sums to the scores, which the tests
        hold to the model's own to 1e-12 relative (float64).
    """
    return _decompositions(stack, layer, [head], query, keys, batch, _WHERE, allow_masked, memory_budget, progress)[0]


def score_decompositions(
    stack: AttentionStack,
    layer: int,
    heads=None,
    *,
    query: int | None = None,
    keys=None,
    batch: int = 0,
    allow_masked: bool = False,
    memory_budget: int | None = None,
    progress: bool = False,
) -> list[ScoreDecomposition]:
    """:func:`score_decomposition` of several heads of one layer (``heads``: a list of head indices;
    default every head), the stream's groups computed once for all of them (at GPT-2-small's shape,
    every head of the top layer at one query and every key takes about as long as one head).
    ``memory_budget`` covers every head's result (``H · (G+1)² · K`` float64 for the tables)."""
    where = "pathkernels.score_decompositions"
    return _decompositions(stack, layer, heads, query, keys, batch, where, allow_masked, memory_budget, progress)


def _decompositions(
    stack, layer, heads, query, keys, batch, where: str, allow_masked=False, memory_budget=None, progress=False
) -> list[ScoreDecomposition]:
    heads = list(range(stack.num_heads)) if heads is None and hasattr(stack, "num_heads") else listed(heads)
    if isinstance(heads, (int, Tensor)) or not hasattr(heads, "__iter__"):
        heads = [heads]
    if not heads:
        raise ValueError(f"{where}: expected heads to hold at least one head, got {heads!r}")
    first = checked_head(stack, layer, heads[0], batch, where)  # the frozen model below is the heads' own
    checked = [first] + [
        replace(first, head=check_int(head, "head", where, minimum=0, maximum=stack.num_heads - 1))
        for head in heads[1:]
    ]
    query, keys = query_and_keys(first, query, keys, where, allow_masked)
    progress = check_flag(progress, "progress", where)
    model = first.model
    budget, named_budget = working_budget(memory_budget, model.sources[0].device, where, DEFAULT_MEMORY_BUDGET)
    moves = _moves(model)
    sizes = [_source_lengths(moves, source) for source in range(len(model.sources))]
    groups = [(source, length) for source, size in enumerate(sizes) for length in range(size)]
    rows = torch.tensor([query], device=keys.device)
    chunk = _group_chunk(first, moves, max(sizes), len(groups), keys.numel(), len(checked), budget, named_budget, where)
    # Each side's vectors of every group, one source's groups at a time: [G, e] and [G, K, e] per head.
    queries = [[] for _ in checked]
    key_vectors = [[] for _ in checked]
    bar = progress_bar(len(sizes), enabled=progress, unit="source", desc=where)
    for source in range(len(sizes)):
        parts = _source_parts(model, source, moves, chunk)
        for rows_of in range(0, parts.shape[0], chunk):
            part = parts[rows_of : rows_of + chunk]
            for one, query_side, key_side in zip(checked, queries, key_vectors):
                query_side.append(one.side("query", part, rows)[:, 0])
                key_side.append(one.side("key", part, keys))
        del parts
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    steps = model.replaced is not None
    labels = (*(_group_label(model.source_names, g, steps) for g in groups), CONSTANT)
    positions = first.positions
    allowed = first.maps.allowed[first.batch, first.layer, positions[query], positions[keys]].cpu()
    cap = float(first.maps.soft_cap[first.layer])
    count = _stream_path_count(model)
    few = _few_paths(model, count)
    results = []
    for one, query_side, key_side in zip(checked, queries, key_vectors):
        query_side = torch.cat([*query_side, one.constant("query", rows)])  # [G+1, e]
        key_side = torch.cat([*key_side, one.constant("key", keys)[None]])  # [G+1, K, e]
        table = one.maps.scaling[one.layer] * torch.einsum("ae,bke->abk", query_side, key_side)
        del query_side, key_side
        path_table = None
        if few is not None:  # the same split path by path: the heads the groups merge, apart
            query_paths = torch.cat([one.side("query", few[1], rows)[:, 0], one.constant("query", rows)])
            key_paths = torch.cat([one.side("key", few[1], keys), one.constant("key", keys)[None]])
            path_table = (one.maps.scaling[one.layer] * torch.einsum("ae,bke->abk", query_paths, key_paths)).cpu()
        position = one.position_bias(query, keys)
        results.append(
            ScoreDecomposition(
                layer=one.layer,
                head=one.head,
                batch=one.batch,
                query=int(positions[query]),
                keys=positions[keys].cpu(),
                groups=labels,
                table=table.cpu(),
                scores=(table.sum((0, 1)) + position).cpu(),
                model_scores=one.model_scores(query, keys).cpu(),
                allowed=allowed,
                soft_cap=cap or None,
                position=position.cpu(),
                paths=None if few is None else few[0],
                path_table=path_table,
                model_name=getattr(stack, "name", ""),
                path_count=count,
            )
        )
    return results


def _group_chunk(
    head: CheckedHead, moves, rows: int, groups: int, keys: int, heads: int, budget: int, named_budget: str, where: str
) -> int:
    """How many of a source's groups each branch and projection runs over at once, within
    ``budget`` bytes beside the result (every head's table ``[G+1, G+1, K]`` and side vectors, float64)
    and one source's ``rows`` groups ``[rows, n, d]`` (with a buffer per cross-layer target); refused
    by name where not even one group's work fits."""
    model = head.model
    tokens, d = model.sources[0].shape
    e = head.constant("query", torch.zeros(1, dtype=torch.long, device=head.positions.device)).shape[-1]
    result = 8 * heads * (groups + 1) * (e * (1 + keys) + (groups + 1) * keys)
    jumps = len({after for position, here in enumerate(moves) for *_, after in here if after > position + 1})
    held = 8 * rows * tokens * d * (1 + jumps)
    moved = [(model.sublayers[q], stop - first) for here in moves for q, first, stop, _ in here]
    widest = max([d] + [branches * sublayer.feature_factors[0].shape[-1] for sublayer, branches in moved])
    per_group = 8 * tokens * (3 * widest + 3 * d) + 8 * 3 * keys * d  # a branch's intermediates, a side's inputs
    if result + held + per_group > budget:
        raise ValueError(
            f"{where}: the result ({heads} head(s) × {groups + 1}² groups × {keys} key(s), float64) and the work "
            f"(one source's {rows} groups of [{tokens}, {d}] and one group's branches) need "
            f"{format_bytes(result + held + per_group)}, more than {named_budget} = {format_bytes(budget)}; pass fewer "
            "keys or heads, or a larger memory_budget"
        )
    return max(1, (budget - result - held) // per_group)


def _stream_path_count(model: FrozenModel) -> int:
    """The paths of the stream entering the layer above ``model``: ``Σ_j Π_{s ≥ j} (b_s + 1)`` over
    the sublayers above source j, ``b_s`` their branches (``(H + 1)^(attention sublayers above)``
    without transcoders)."""
    return sum(model.path_counts(model.layers))


def _few_paths(model: FrozenModel, count: int) -> tuple[tuple[str, ...], Tensor] | None:
    """``(labels, terms [P, n, d])`` of every path of the stream entering the layer above ``model``
    (``count`` of them; the constant's label last), where they number at most :data:`FEW_PATHS`;
    else None."""
    if count > FEW_PATHS:
        return None
    labels, terms = [], []
    for chunk, choices, source in _every_term(model, model.layers, FEW_PATHS):
        terms.append(chunk)
        labels += [describe_path(c, model.source_names[source], model.replaced) for c in choices.cpu()]
    return (*labels, CONSTANT), torch.cat(terms)


@dataclass
class ScorePairs:
    """Every pair of paths' term of one head's score at one (query, key) (:func:`score_pairs`).

    ``values [P+1, P+1]``: ``scaling · ⟨q_p(query), k_{p'}(key)⟩`` for the P paths of the stream
    below the head and a last row and column for each side's constant; ``paths [P, L']`` (the head
    taken at each layer below, −1 where none; with transcoders ``[P, 2L]``, each layer's head then
    each MLP's step, as :func:`pathkernels.path_terms` takes them) and ``sources [P]`` index
    ``source_names``; ``score``
    is their sum plus ``position`` (what the model adds whatever the stream: ALiBi, else 0),
    ``model_score`` the model's own. ``top``/``bottom``: the ``k`` largest and
    smallest pairs as rows."""

    layer: int
    head: int
    batch: int
    query: int
    key: int
    values: Tensor
    paths: Tensor
    sources: Tensor
    source_names: list[str]
    score: float
    model_score: float
    top: list[dict]
    bottom: list[dict]
    position: float = 0.0
    model_name: str = ""  # the model's name for figure titles (AttentionStack.name)
    replaced: object | None = None  # the MLPs replaced by transcoders (their steps' names), or None

    def describe(self, index: int) -> str:
        """Path ``index`` (or the constant, index P) as text."""
        if index == self.paths.shape[0]:
            return CONSTANT
        return describe_path(self.paths[index], self.source_names[int(self.sources[index])], self.replaced)

    def __repr__(self) -> str:
        best = self.top[0] if self.top else None
        shown = f"; top pair {best['query path']} · {best['key path']} = {best['value']:.4g}" if best else ""
        return (
            f"ScorePairs(L{self.layer}H{self.head}, batch {self.batch}, query {self.query}, key {self.key}, "
            f"{self.paths.shape[0]} paths per side, score {self.score:.6g}{shown})"
        )

    def to_frame(self, which: str = "top"):
        """The top (or ``which="bottom"``) pairs as a pandas DataFrame."""
        if which not in ("top", "bottom"):
            raise ValueError(f"pathkernels.ScorePairs.to_frame: expected which to be 'top' or 'bottom', got {which!r}")
        return require("pandas").DataFrame(self.top if which == "top" else self.bottom)

    @renamed("pathkernels.ScorePairs.plot", k="top_k")
    def plot(self, top_k: int | None = None, *, ax=None, path=None):
        """The ``top_k`` largest and smallest pair terms as horizontal bars (default: every pair
        kept; more refused). Returns the matplotlib Figure, saved to ``path`` where given."""
        pairs = (self.paths.shape[0] + 1) ** 2
        title = titled(
            self.model_name, f"L{self.layer}H{self.head}'s score, query {self.query}, key {self.key}: {self.score:.4g}"
        )
        where = "pathkernels.ScorePairs.plot"
        return pair_bars(self.top, self.bottom, top_k, (len(self.top), pairs), title, where, ax=ax, path=path)


def score_pairs(
    stack: AttentionStack,
    layer: int,
    head: int,
    *,
    query: int | None = None,
    key: int,
    batch: int = 0,
    top_k: int = 20,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    allow_masked: bool = False,
) -> ScorePairs:
    """Every pair (query path, key path)'s term of head ``(layer, head)``'s score at one query and
    key, by listing every path of the stream below the layer (module docstring), and the ``top_k``
    largest and smallest pairs.

    The paths below layer l number ``Σ_j (H + 1)^(heads above source j)``; the pairs' table is their
    square, so this is for shallow layers and small models (refused beyond ``memory_budget``:
    :func:`score_decomposition` groups the pairs exactly at any depth, and
    :func:`pathkernels.top_score_pairs` finds the top pairs with a certificate).

    Returns:
        :class:`ScorePairs`; its ``values`` and ``position`` sum to the score, which the tests hold
        to the model's own.
    """
    where = "pathkernels.score_pairs"
    checked = checked_head(stack, layer, head, batch, where)
    top_k = check_int(top_k, "top_k", where, minimum=0)
    memory_budget = check_int(memory_budget, "memory_budget", where, minimum=1)
    query, keys = query_and_keys(checked, query, key, where, allow_masked, "key")
    model = checked.model
    count = _stream_path_count(model)
    need = 8 * (count + 1) ** 2 + 8 * count * (model.layers + 2 * checked.maps.w_q.shape[-1])
    if need > memory_budget:
        raise ValueError(
            f"{where}: layer {checked.layer}'s stream has {count:,} paths, whose pairs take {format_bytes(need)}, more "
            f"than memory_budget={memory_budget:,} bytes; use score_decomposition (exact sums by path group at any "
            "depth) or top_score_pairs (the top pairs, certified), or a larger memory_budget"
        )
    rows = torch.tensor([query, int(keys[0])], device=checked.positions.device)
    sides, paths, sources = [], [], []
    widest = max((sublayer.branches for sublayer in model.sublayers), default=0)  # heads, or a replaced MLP's steps
    chunk = max(1, memory_budget // (8 * 4 * model.sources[0].numel() * (widest + 1)))
    for terms, choices, source in _every_term(model, model.layers, chunk):
        sides.append(
            torch.stack([checked.side("query", terms, rows[:1])[:, 0], checked.side("key", terms, rows[1:])[:, 0]])
        )
        paths.append(choices)
        sources.append(torch.full((choices.shape[0],), source, dtype=torch.long, device=choices.device))
    sides = torch.cat(sides, 1)  # [2, P, e]
    queries = torch.cat([sides[0], checked.constant("query", rows[:1])])
    key_vectors = torch.cat([sides[1], checked.constant("key", rows[1:])])
    values = checked.maps.scaling[checked.layer] * queries @ key_vectors.T  # [P+1, P+1]
    result = ScorePairs(
        layer=checked.layer,
        head=checked.head,
        batch=checked.batch,
        query=int(checked.positions[query]),
        key=int(checked.positions[keys[0]]),
        values=values.cpu(),
        paths=torch.cat(paths).cpu(),
        sources=torch.cat(sources).cpu(),
        source_names=model.source_names,
        score=float(values.sum()) + float(checked.position_bias(query, keys)[0]),
        model_score=float(checked.model_scores(query, keys)[0]),
        top=[],
        bottom=[],
        position=float(checked.position_bias(query, keys)[0]),
        model_name=getattr(stack, "name", ""),
        replaced=model.replaced,
    )
    flat = result.values.flatten()
    width = result.values.shape[1]
    total = result.score
    for largest, rows_out in ((True, result.top), (False, result.bottom)):
        picked = torch.topk(flat, min(top_k, flat.numel()), largest=largest)
        for rank, (value, index) in enumerate(zip(picked.values.tolist(), picked.indices.tolist()), 1):
            a, b = divmod(index, width)
            rows_out.append(
                {
                    "rank": rank,
                    "query path": result.describe(a),
                    "key path": result.describe(b),
                    "value": value,
                    "fraction": value / total if total != 0 else float("nan"),
                }
            )
    return result


def score_attribution(
    stack: AttentionStack,
    layer: int,
    head: int,
    *,
    query: int | None = None,
    key: int,
    side: str = "query",
    batch: int = 0,
    max_length: int | None = None,
    top_k: int = 20,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    progress: bool = False,
    allow_masked: bool = False,
) -> PathAttribution:
    """Every path's exact share of head ``(layer, head)``'s score at (query, key), one side at a time.

    With the key fixed to the model's own ``k_j`` (``side="query"``), the score is a linear readout
    of the stream at the query: ``s = rᵀ X v + c`` with ``r = D_i e_i``, ``v = C Γ W_Q (ν_i γ_Q ⊙
    R_iᵀ k_j) · scaling`` and ``c`` the query's constant against ``k_j``; so each query path's share
    comes from the readout trie, as :func:`pathkernels.path_attribution` gives a logit's. ``side="key"``
    fixes the query and reads the stream at the key.

    Args:
        stack: a stack captured with its queries and keys (``query_key=True``).
        layer, head: the head; query (default: the last real token) and key: token positions.
        side: ``"query"`` (each query path's share, the key as the model computed it) or ``"key"``.
        batch: the sequence.
        max_length: only paths through at most this many heads (clamped to the layers below);
            what the longer ones carry is ``unenumerated``, exactly.
        top_k, memory_budget, progress: as in :func:`pathkernels.path_attribution`.
        allow_masked: also a key the mask forbids the query (refused by default).

    Returns:
        :class:`~pathkernels.PathAttribution` over the paths below the layer (their ``paths`` have one
        entry per layer below it); ``value`` is the model's own score, ``constant`` the side's
        constant against the fixed vector. The tests hold each path's share to its row (column) of
        :func:`score_pairs`' table.
    """
    where = "pathkernels.score_attribution"
    setup = _one_side(stack, layer, head, query, key, side, batch, max_length, where, allow_masked)
    top_k = check_int(top_k, "top_k", where, minimum=0)
    memory_budget = check_int(memory_budget, "memory_budget", where, minimum=1)
    return named(attribute(setup, top_k, memory_budget, check_flag(progress, "progress", where)), stack)


@renamed("pathkernels.score_top_paths", k="top_k")
def score_top_paths(
    stack: AttentionStack,
    layer: int,
    head: int,
    top_k: int = 20,
    *,
    query: int | None = None,
    key: int,
    side: str = "query",
    batch: int = 0,
    largest: bool = True,
    max_length: int | None = None,
    time_limit: float | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    batch_nodes: int = 4096,
    bound: str = "node",
    progress: bool = False,
    allow_masked: bool = False,
) -> TopPaths:
    """The exact ``top_k`` largest (or smallest) paths of one side of head ``(layer, head)``'s score at
    (query, key), the other side held at the model's own vector: :func:`score_attribution`'s readout
    searched best first with a certificate, as :func:`pathkernels.top_paths` searches a logit's
    (its arguments of the same names), for layers too deep to walk whole.

    Returns:
        :class:`~pathkernels.TopPaths` over the paths below the layer.
    """
    where = "pathkernels.score_top_paths"
    options = SearchOptions.checked(
        where, top_k, largest, time_limit, memory_budget, batch_nodes, False, bound, progress, time.monotonic()
    )
    setup = _one_side(stack, layer, head, query, key, side, batch, max_length, where, allow_masked)
    return named(search_top_paths(setup, options), stack)


def _one_side(
    stack, layer, head, query, key, side, batch, max_length, where: str, allow_masked: bool = False
) -> CheckedReadout:
    """One side of a head's score at (query, key) as a readout of the stream below its layer, the
    other side fixed to the model's own vector (:func:`score_attribution`)."""
    if side not in SIDES:
        raise ValueError(f"{where}: expected side to be 'query' or 'key', got {side!r}")
    checked = checked_head(stack, layer, head, batch, where)
    query, keys = query_and_keys(checked, query, key, where, allow_masked, "key")
    key = int(keys[0])
    read, other = (query, key) if side == "query" else (key, query)
    maps, device = checked.maps, checked.positions.device
    fixed = maps.computed("key" if side == "query" else "query", checked.batch, checked.layer, checked.head)
    fixed = fixed[checked.positions[other]].to(device)  # [e]: the model's own vector on the fixed side
    scaling = maps.scaling[checked.layer]
    # s = scaling ⟨x_i Φᵀ D_i + c, f⟩: a readout r = D_i e_i, v = scaling Φᵀ f, constant scaling ⟨c, f⟩.
    phi = (scaling * (checked.readout_columns(side, read) @ fixed))[None, None]  # [1, 1, d]
    bias = scaling * (checked.constant(side, torch.tensor([read], device=device))[0] @ fixed)
    bias = bias + checked.position_bias(query, keys)[0]  # ALiBi's term goes with the constant
    rho = torch.zeros(1, 1, checked.positions.numel(), dtype=torch.float64, device=device)
    rho[0, 0, read] = checked.scale[read]  # r = D_i e_i
    value = checked.model_scores(query, keys).reshape(1, 1)
    label = f"L{checked.layer}H{checked.head} score {int(checked.positions[query])}→{int(checked.positions[key])}"
    readout = Readout(phi[0].cpu(), bias.reshape(1).cpu(), (f"{label} ({side} side)",))
    layers = checked.model.layers
    if max_length is not None:  # a path below layer l takes at most l heads (with transcoders, 2l steps)
        most = stack.num_layers if checked.model.replaced is None else checked.model.layers
        layers = min(layers, check_int(max_length, "max_length", where, minimum=0, maximum=most))
    positions = [int(checked.positions[read])]
    return CheckedReadout(checked.model, rho, phi, bias.reshape(1, 1), value, readout, positions, checked.batch, layers)
