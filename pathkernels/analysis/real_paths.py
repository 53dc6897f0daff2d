"""Exact decompositions of a captured model's residual stream into its paths.

With every pattern and normalisation scale frozen at one forward pass (a stack from
:func:`pathkernels.adapters.capture_huggingface_residual` or ``capture_transformer_lens_residual``),
the stream the blocks leave is exactly a sum of path terms (docs/DESIGN.md, "Real transformers"):
a source ``K_j`` ``[n, d]`` (the embedding, a layer's constant rows, an MLP's output) entering below
sublayer j, then one branch of every sublayer above it, each a token map on the left and a feature
map on the right,

    Y_p = T_top ⋯ T_bottom K_j G_bottom ⋯ G_top,

with ``T = A D`` and ``G = C Γ W_V W_O`` for a pre-norm head (a skip is the identity), and for a
post-norm model ``D A`` and ``W_V W_O C Γ`` for a head, ``D`` and ``C Γ`` for a skip.
:func:`decompose_model` measures each term as :func:`pathkernels.decompose` measures a path of an
attention network: its residual ``‖Y_p − 1 mean(Y_p)ᵀ‖_{1,∞}``, its norm ``‖Y_p‖_{1,∞}`` and their
ratio, on each sequence's real tokens.

The terms are built from the bottom up on a trie per source (a node holds the product of the
branches below it), depth first in chunks sized by the memory budget: ``n² d`` for the token map and
``2 n d d_head`` for the factored feature map per head child.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from pathkernels.analysis.readout_trie import (
    NO_HEAD,
    FrozenModel,
    Sublayer,
    describe_path,
    frozen_model,
)
from pathkernels.core._figures import require, wrapped
from pathkernels.core._memory import format_bytes
from pathkernels.core._progress import progress_bar
from pathkernels.core.checks import check_flag, check_int
from pathkernels.core.decompose import (
    DEFAULT_MAX_RESULT_BYTES,
    PathDecomposition,
    register_model_decomposer,
    sample_weights,
)
from pathkernels.core.engine import PathResiduals
from pathkernels.core.ops import residual_norm
from pathkernels.core.paths import MAX_ENUMERATED_PATHS, PathTree
from pathkernels.core.planner import DEFAULT_MEMORY_BUDGET

_WHERE = "pathkernels.decompose"
_ROUND_OFF = 1e-6  # a residual ratio below this is round-off (float32's unit round-off is 6e-8)


@dataclass
class ModelPathDecomposition(PathDecomposition):
    """:class:`~pathkernels.PathDecomposition` of a captured model's paths: each path is a source
    and the heads it passes, ``sources[i]`` indexing ``source_names``. ``by_length()``, ``plot()``
    and the estimators are those of the attention-network decomposition; ``to_frame()`` names each
    path as ``"L3H5 → L7H1 from L2 MLP"``, and :meth:`by_source` sums it up per source."""

    sources: Tensor = field(default=None, repr=False)  # [M] int64
    source_names: list[str] = field(default_factory=list)
    stack: object = field(default=None, repr=False)  # the captured stack decomposed (for terms())
    replaced: object = field(default=None, repr=False)  # the MLPs replaced by transcoders, or None

    def to_frame(self):
        """A pandas DataFrame, one row per path: ``path`` (its heads and source), ``source``,
        ``length``, ``ratio``, ``residual`` and ``norm`` (averaged over the batch)."""
        pd = require("pandas")
        residuals = self.results.residual.double().reshape(-1, self.paths.shape[0]).mean(0)
        norms = self.results.norm.double().reshape(-1, self.paths.shape[0]).mean(0)
        names = [self.source_names[int(s)] for s in self.sources]
        return pd.DataFrame(
            {
                "path": [describe_path(path, name, self.replaced) for path, name in zip(self.paths, names)],
                "source": names,
                "length": self.lengths.tolist(),
                "ratio": self.path_ratio().tolist(),
                "residual": residuals.tolist(),
                "norm": norms.tolist(),
            }
        )

    @property
    def bias_paths(self) -> Tensor:
        """``[M]`` bool: the paths from an attention-bias source (the direct ones' rows are the same
        at every token, so their residual ratio is round-off)."""
        bias = torch.tensor([name.endswith("attention bias") for name in self.source_names], dtype=torch.bool)
        return bias[self.sources.cpu()]

    def plot(self, ax=None, *, path=None, title: str | None = None):
        """:meth:`PathDecomposition.plot`, the paths from an attention-bias source drawn apart (grey)
        and left out of the median and the band: the direct ones' rows are the same at every token,
        so their ratio is round-off (~1e-15) and would set the band's scale; those through heads
        mix rows scaled by the frozen norms, and the legend gives the range of their ratios.
        ``title`` defaults to the model the stack was captured from (its name), with L and H."""
        apart = self.bias_paths
        if title is None:
            stack = self.stack
            name, source = getattr(stack, "name", ""), getattr(stack, "source", "")
            model = f"{name} ({source})" if name and source else name or source or "a captured model"
            title = f"{self.method} path decomposition of {model}: L = {self.num_layers}, H = {self.num_heads}"
        return super().plot(ax, path=path, title=title, apart=apart, apart_label=wrapped(self._bias_label(apart), 34))

    def _bias_label(self, apart: Tensor) -> str:
        """The legend's words for the bias paths, from their ratios: how many are round-off and the
        range of the others."""
        ratio = self._ratios().cpu()[:, apart]
        ratio = ratio[~ratio.isnan() & (ratio > 0)]
        roundoff = ratio[ratio < _ROUND_OFF]
        measured = ratio[ratio >= _ROUND_OFF]
        parts = []
        if measured.numel():
            parts.append(f"ratio {float(measured.min()):.2g}–{float(measured.max()):.2g}")
        if roundoff.numel():
            parts.append(
                "round-off" if not measured.numel() else f"{roundoff.numel()} at round-off, at the bottom edge"
            )
        return "attention-bias paths, not in the band" + (f" ({'; '.join(parts)})" if parts else "")

    def terms(self, index=None, *, batch: int = 0, tokens=None, memory_budget: int = DEFAULT_MEMORY_BUDGET) -> Tensor:
        """The term vectors ``[M', T, d]`` of the decomposed paths ``index`` (an int, a slice, a list
        or a bool mask over the M paths; default: all) on tokens ``tokens`` of sequence ``batch``:
        :func:`path_terms` of this decomposition's stack."""
        chosen = torch.arange(self.paths.shape[0])[index if index is not None else slice(None)].reshape(-1)
        return path_terms(
            self.stack,
            self.paths[chosen],
            self.sources[chosen],
            batch=batch,
            tokens=tokens,
            memory_budget=memory_budget,
        )

    def by_source(self):
        """A pandas DataFrame, one row per source: its ``paths`` and the ``mean``, ``min`` and
        ``max`` residual ratio over its (batch element, path) pairs."""
        pd = require("pandas")
        ratio = self.results.ratio.double().reshape(-1, self.paths.shape[0])
        rows = []
        for index, name in enumerate(self.source_names):
            values = ratio[:, self.sources == index].flatten()
            values = values[~values.isnan()]
            rows.append(
                {
                    "source": name,
                    "paths": int((self.sources == index).sum()),
                    "mean": values.mean().item() if values.numel() else math.nan,
                    "min": values.min().item() if values.numel() else math.nan,
                    "max": values.max().item() if values.numel() else math.nan,
                }
            )
        return pd.DataFrame(rows)


def _skip(sublayer: Sublayer, terms: Tensor) -> Tensor:
    """A sublayer's skip on terms ``[N, n, d]``: the identity pre-norm, ``D Y C Γ`` post-norm."""
    if sublayer.pre:
        return terms
    centred = terms - terms.mean(-1, keepdim=True) if sublayer.centred else terms
    return sublayer.scale[:, None] * centred * sublayer.gamma


def _heads(sublayer: Sublayer, terms: Tensor, first: int = 0, stop: int | None = None) -> Tensor:
    """Every head's branch on terms ``[N, n, d]``: ``T_h Y G_h`` ``[H, N, n, d]``, with
    ``G_h = F_out[h]ᵀ F_in[h]ᵀ`` (the readout's row-form factors, :attr:`Sublayer.feature_factors`):
    one GEMM into every head's d_head columns, the token maps there (``n² d_head`` rather than
    ``n² d``), then each head's ``d_head × d`` factor. ``first``, ``stop``: only branches
    ``first..stop−1`` (a cross-layer set's steps that read the stream ``terms`` hold)."""
    feature_in, feature_out = (factor[first:stop] for factor in sublayer.feature_factors)  # [H, d, e], [H, e, d]
    heads, head_dim, d = feature_in.shape[0], feature_in.shape[-1], terms.shape[-1]
    nodes, tokens = terms.shape[0], terms.shape[1]
    into = feature_out.transpose(-1, -2).permute(1, 0, 2).reshape(d, heads * head_dim)  # [d, H·e]
    narrow = (terms.reshape(-1, d) @ into).view(nodes, tokens, heads, head_dim).permute(2, 0, 1, 3)  # [H, N, n, e]
    narrow = _on_tokens(sublayer.token_maps[first:stop], narrow)
    wide = torch.bmm(narrow.reshape(heads, nodes * tokens, head_dim), feature_in.transpose(-1, -2))  # [H, N·n, d]
    return wide.view(heads, nodes, tokens, d)


def _on_tokens(token_maps: Tensor, narrow: Tensor) -> Tensor:
    """``T_b X_b`` for every branch b: the token maps ``[B, n, n]`` on the token axis of ``narrow
    [B, N, n, r]``, the N nodes folded into the columns (one ``[n, n] × [n, N·r]`` product per
    branch: a matmul broadcast over N copies the maps N times, 4.3 GB for 16 nodes at
    Llama-3.2-1B's shape and 1,024 tokens, and runs 3× slower)."""
    branches, nodes, tokens, width = narrow.shape
    folded = narrow.permute(0, 2, 1, 3).reshape(branches, tokens, nodes * width)
    return torch.bmm(token_maps, folded).view(branches, tokens, nodes, width).permute(0, 2, 1, 3)


def branch_sum(sublayer: Sublayer, terms: Tensor, first: int = 0, stop: int | None = None) -> Tensor:
    """Every branch of a sublayer on terms ``[N, n, d]``, summed: ``Σ_b T_b Y G_b`` ``[N, n, d]``
    (:func:`_heads`' sum over b, without its ``[B, N, n, d]`` product: a replaced MLP has thousands
    of branches, each of d_head 1); ``first``, ``stop``: only branches ``first..stop−1``."""
    feature_in, feature_out = (factor[first:stop] for factor in sublayer.feature_factors)  # [B, d, r], [B, r, d]
    branches, width = feature_in.shape[0], feature_in.shape[0] * feature_in.shape[-1]
    nodes, tokens, d = terms.shape
    # Two GEMMs over every branch's r columns at once (B·r = d for a layer's heads), the token maps
    # between them on each branch's columns; heads that share a value map (grouped-query
    # attention) read it once in the first GEMM.
    group = sublayer.value_group if first == 0 and stop in (None, sublayer.branches) else 1
    into = feature_out[::group].permute(2, 0, 1).reshape(d, width // group)  # [d, B·r / g]
    narrow = (terms.reshape(-1, d) @ into).view(nodes, tokens, branches // group, -1).permute(2, 0, 1, 3)
    narrow = narrow.repeat_interleave(group, 0) if group > 1 else narrow  # [B, N, n, r]
    narrow = _on_tokens(sublayer.token_maps[first:stop], narrow)
    out_of = feature_in.transpose(-1, -2).reshape(width, d)  # [B·r, d]
    return (narrow.permute(1, 2, 0, 3).reshape(nodes * tokens, width) @ out_of).view(nodes, tokens, d)


def carry_up(model: FrozenModel, terms: Tensor, position: int) -> Tensor:
    """Terms ``[N, n, d]`` entering at ``position`` (below sublayer ``position``) carried to the top
    by every branch: the sum over every path from there, the frozen model's effect. Sublayer by
    sublayer ``Y ↦ skip(Y) + Σ_b T_b Y G_b``, a cross-layer set's steps that read at p written where
    they write (:func:`_moves`)."""
    moves = _moves(model)
    arriving: dict[int, Tensor] = {}
    for here in range(position, len(model.sublayers)):
        if here in arriving:
            terms = terms + arriving.pop(here)
        moved = _skip(model.sublayers[here], terms)
        for q, first, stop, after in moves[here]:
            grown = branch_sum(model.sublayers[q], terms, first, stop)
            if after == here + 1:
                moved = moved + grown
            else:
                arriving[after] = arriving[after] + grown if after in arriving else grown
        terms = moved
    return terms + arriving.pop(len(model.sublayers), 0)


def _every_term(model: FrozenModel, max_length: int, chunk: int) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """Every path's term of one frozen sequence, in chunks: ``(terms [N, n, d], choices [N, L],
    source)``, each source's trie depth first from the bottom. A node at position s has passed
    sublayers j … s − 1 above its source j; its children pass sublayer s (the skip or a branch), or
    a cross-layer set's step that reads here and writes above (:func:`_moves`)."""
    device = model.sources[0].device
    top = len(model.sublayers)
    moves = _moves(model)
    for source in range(top + 1):
        choices = torch.full((1, model.layers), NO_HEAD, dtype=torch.long, device=device)
        pending = [(source, model.sources[source][None], choices, torch.zeros(1, dtype=torch.long, device=device))]
        while pending:
            position, terms, choices, lengths = pending.pop()
            if position == top:
                yield terms, choices, source
                continue
            parts = [(position + 1, _skip(model.sublayers[position], terms), choices, lengths)]
            grows = lengths < max_length
            for q, first, stop, after in moves[position] if bool(grows.any()) else []:
                sublayer = model.sublayers[q]
                grown = _heads(sublayer, terms[grows], first, stop)  # [H, N', n, d]
                heads = grown.shape[0]
                head_choices = choices[grows][None].repeat(heads, 1, 1)
                head_choices[:, :, sublayer.column] = sublayer.choice_values(device)[first:stop, None]
                lengths_h = (lengths[grows] + 1).repeat(heads)
                parts.append((after, grown.flatten(0, 1), head_choices.flatten(0, 1), lengths_h))
            for after, *part in reversed(parts):  # the skip's subtree first
                for start in range(0, part[0].shape[0], chunk):
                    pending.append((after, *(t[start : start + chunk] for t in part)))


def _canonical_order(choices: Tensor, sources: Tensor) -> Tensor:
    """The permutation that sorts paths by source, then heads layer by layer (skip first)."""
    order = torch.arange(sources.numel())
    for column in [*choices.unbind(1)][::-1] + [sources]:  # least significant key first, stable sorts
        order = order[torch.sort(column[order], stable=True).indices]
    return order


def _head(sublayer: Sublayer, terms: Tensor, head: int) -> Tensor:
    """One head's branch on terms ``[N, n, d]``: ``T_h Y G_h``, in :func:`_heads`' order."""
    feature_in, feature_out = sublayer.feature_factors
    narrow = torch.matmul(sublayer.token_maps[head], terms @ feature_out[head].T)  # [N, n, e]
    return narrow @ feature_in[head].T


def terms_of(model: FrozenModel, choices: Tensor, sources: Tensor, split: int | None = None) -> Tensor:
    """The terms ``[M, n, d]`` of given paths (``choices [M, L]``, ``sources [M]``), each passing the
    sublayers from its source up: its head's branch where it takes one, the skip elsewhere.

    ``split``: a column of a replaced MLP's steps (``L + l``), which every path takes: the terms
    ``[M, n, n, d]`` split by the token where each passes that step (its token map is diagonal, so
    its output's row t is what the path carries through the step at token t), summing to the terms."""
    device = model.sources[0].device
    choices, sources = choices.to(device), sources.to(device)
    count, tokens = sources.numel(), model.sources[0].shape[0]
    terms = torch.zeros(count, *model.sources[0].shape, dtype=torch.float64, device=device)
    for position, sublayer in enumerate(model.sublayers + [None]):
        entering = sources == position
        terms[entering] = model.sources[position]
        if sublayer is None:
            break
        on = sources <= position
        taken = choices[:, sublayer.column] if sublayer.attn is not None else torch.full_like(sources, NO_HEAD)
        skipping = on & (taken == NO_HEAD)
        terms[skipping] = _skip(sublayer, terms[skipping])
        branch_of = {int(value): index for index, value in enumerate(sublayer.choice_values("cpu").tolist())}
        for value in taken[on & (taken != NO_HEAD)].unique().tolist():
            chosen = on & (taken == value)
            if value in branch_of:
                terms[chosen] = _head(sublayer, terms[chosen], branch_of[value])
            else:  # a feature closed at every token of this sequence: its step writes nothing
                terms[chosen] = 0.0
        if split is not None and sublayer.attn is not None and sublayer.column == split:  # one copy per token
            rows = torch.eye(tokens, dtype=terms.dtype, device=device)  # copy t keeps row t
            terms = (terms[:, None] * rows[None, :, :, None]).flatten(0, 1)
            choices, sources = choices.repeat_interleave(tokens, 0), sources.repeat_interleave(tokens, 0)
    return terms if split is None else terms.view(count, tokens, tokens, -1)


def path_terms(
    stack,
    paths,
    sources,
    *,
    batch: int = 0,
    tokens=None,
    split_at: int | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> Tensor:
    """The term vectors of chosen paths of a captured model, ``Y_p`` ``[M, T, d]`` in float64: what
    each path writes into the stream the blocks leave (module docstring), on tokens ``tokens`` of
    sequence ``batch``. Summed over every path they give that stream; read out, each gives its
    attribution (:func:`pathkernels.path_attribution`); ``pk.decompose(stack)`` measures them.

    Args:
        stack: a captured stack (:func:`pathkernels.adapters.capture_huggingface_residual` or
            ``capture_transformer_lens_residual``).
        paths: ``[M, L]`` ints, the head each path takes at each layer (−1: none), as
            ``ModelPathDecomposition.paths`` and ``PathAttribution.paths`` hold them. A path takes
            heads only above its source. With a capture's transcoders ``[M, 2L]``: then each MLP's
            step (a feature id, ``F + k`` for its skip map's k-th direction; a feature closed at every
            token of the sequence writes nothing).
        sources: ``[M]`` source indices into the stack's source names (``"embedding"``, ``"L{l}
            attention bias"``, ``"L{l} MLP"``, as the results' ``source_names``), or those names.
        batch: the sequence.
        tokens: positions among the sequence's tokens (default: every real token, in order); a
            padded token has no term.
        split_at: with a capture's transcoders, a layer whose MLP step every path takes: each
            term split by the token where the path passes that step (a feature's token map is
            diagonal), ``[M, n, T, d]`` over the sequence's n real tokens, summing to the terms.
            Read out, the split gives a path's share through each of the attribution graph's
            (layer, position, feature) nodes. The step is the one in column ``L + split_at``,
            where it writes: a cross-layer step of layer l's feature written there splits by
            the token of the graph's node (l, position, feature).
        memory_budget: bytes for the result and the work (``M · n · d`` float64 per chunk of
            paths, n times that when split); beyond it, refused with what it would need.

    Returns:
        ``[M, T, d]`` float64 on the capture's device (``[M, n, T, d]`` with ``split_at``).
    """
    where = "pathkernels.path_terms"
    capture = getattr(stack, "residual_capture", None)
    if capture is None:
        raise ValueError(
            f"{where}: expected a captured stack (pk.adapters.capture_huggingface_residual): a path's term needs the "
            "model's frozen norms and sources"
        )
    batch = check_int(batch, "batch", where, minimum=0, maximum=stack.batch_size - 1)
    memory_budget = check_int(memory_budget, "memory_budget", where, minimum=1)
    n_all = stack.attn.shape[-1]
    real = torch.ones(n_all, dtype=torch.bool) if stack.token_mask is None else stack.token_mask[batch].cpu().bool()
    model = frozen_model(stack, capture, batch, real)
    names = model.source_names
    choices, source_index = _checked_paths(paths, sources, model, names, where)
    real_positions = real.nonzero().flatten()
    if tokens is None:
        rows = torch.arange(real_positions.numel())
    else:
        wanted = _as_index_tensor(tokens, "tokens", "positions (an int, a list of ints or an integer tensor)", where)
        wanted = wanted.reshape(-1)
        if wanted.dtype.is_floating_point or wanted.dtype == torch.bool:
            raise TypeError(f"{where}: expected tokens to be integer positions, got {wanted.dtype}")
        wanted = torch.where(wanted < 0, wanted + n_all, wanted)
        if bool(((wanted < 0) | (wanted >= n_all)).any()) or not bool(real[wanted.clamp(0, n_all - 1)].all()):
            raise ValueError(
                f"{where}: expected tokens among the real positions of sequence {batch} (of {n_all}), got "
                f"{torch.as_tensor(tokens).reshape(-1).tolist()}"
            )
        rows = torch.searchsorted(real_positions, wanted)  # each position's index among the real tokens
    n, d = real_positions.numel(), stack.d_model
    count = choices.shape[0]
    split = None if split_at is None else _split_column(model, choices, split_at, where)
    copies = 1 if split is None else n  # a split term: one copy per token where the path passes the step
    result_bytes = 8 * count * copies * rows.numel() * d
    per_path = 8 * copies * n * d * 3  # a chunk's terms, and a head's branch beside them
    if result_bytes + per_path > memory_budget:
        raise ValueError(
            f"{where}: the terms of {count:,} paths on {rows.numel()} tokens take {format_bytes(result_bytes)} and "
            f"a chunk at least {format_bytes(per_path)}, more than memory_budget={memory_budget:,} bytes; pass fewer "
            "paths or tokens, or a larger memory_budget"
        )
    chunk = max(1, (memory_budget - result_bytes) // per_path)
    device = model.sources[0].device
    out = torch.empty(
        count, *([copies] if split is not None else []), rows.numel(), d, dtype=torch.float64, device=device
    )
    rows = rows.to(device)
    for start in range(0, count, chunk):
        stop = min(count, start + chunk)
        out[start:stop] = terms_of(model, choices[start:stop], source_index[start:stop], split)[..., rows, :]
    return out


def _split_column(model: FrozenModel, choices: Tensor, layer, where: str) -> int:
    """The column of layer ``layer``'s MLP steps (``L + layer``), checked: a capture with
    transcoders, a replaced layer, and every path taking a step there."""
    if model.replaced is None:
        raise ValueError(f"{where}: split_at splits a term where it passes a transcoder step; this capture has none")
    layers = model.replaced.num_layers
    layer = check_int(layer, "split_at", where, minimum=0, maximum=layers - 1)
    if layer not in model.replaced.layers:
        raise ValueError(
            f"{where}: expected split_at to be a layer whose MLP the capture replaced "
            f"({sorted(model.replaced.layers)}), got {layer}"
        )
    if bool((choices[:, layers + layer] == NO_HEAD).any()):
        raise ValueError(
            f"{where}: split_at={layer} splits each path where it passes the step in layer {layer}'s MLP column (a "
            f"cross-layer step: where it writes); expected every path to take one (paths[:, {layers + layer}] a "
            "feature or skip direction), got -1"
        )
    return layers + layer


def _as_index_tensor(value, name: str, expected: str, where: str) -> Tensor:
    """``value`` (an int, a nested list of numbers or a tensor on a CPU or CUDA device) as a tensor;
    anything else refused naming ``name`` and what was ``expected``."""
    if isinstance(value, Tensor):
        if value.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{where}: expected {name} on a CPU or CUDA device, got {value.device}")
        return value
    if isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"{where}: expected {name} as {expected}, got {type(value).__name__} {value!r}")
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        got = f"{type(value).__name__} {str(value)[:80]}"
        raise TypeError(f"{where}: expected {name} as {expected}, got {got}") from None


def _checked_paths(paths, sources, model: FrozenModel, names: list[str], where: str) -> tuple[Tensor, Tensor]:
    """``(choices [M, L], sources [M])`` checked against the frozen model: heads in ``[−1, H)``, a
    source index or name each, and heads only above the path's source. With a capture's transcoders
    the choices are ``[M, 2L]``: then each MLP's step, a feature id or the skip map's ``F + k``."""
    paths = _as_index_tensor(paths, "paths", f"[M, {model.layers}] ints, the head at each layer (−1: none)", where)
    if paths.dim() == 1:
        paths = paths[None]
    if paths.dim() != 2 or paths.shape[1] != model.layers or paths.dtype.is_floating_point or paths.dtype == torch.bool:
        raise ValueError(
            f"{where}: expected paths [M, {model.layers}] of head indices (−1: none), got "
            f"{list(paths.shape)} {str(paths.dtype).removeprefix('torch.')}"
        )
    heads = paths if model.replaced is None else paths[:, : model.replaced.num_layers]
    if bool(((heads < NO_HEAD) | (heads >= model.num_heads)).any()):
        raise ValueError(f"{where}: expected heads in [-1, {model.num_heads}) in paths, got {heads.unique().tolist()}")
    if model.replaced is not None:  # each MLP's column: a feature id or a skip-map direction, where it has a transcoder
        check_steps(paths, model.replaced, where)
    if isinstance(sources, (str, int)):
        sources = [sources]
    if isinstance(sources, (list, tuple)) and sources and all(isinstance(s, str) for s in sources):
        unknown = [s for s in sources if s not in names]
        if unknown:
            raise ValueError(f"{where}: expected sources among {names}, got {unknown}")
        sources = [names.index(s) for s in sources]
    sources = _as_index_tensor(sources, "sources", f"[M] indices or names of {names}", where).reshape(-1)
    if sources.dtype.is_floating_point or sources.dtype == torch.bool:
        raise TypeError(f"{where}: expected sources as indices or names, got {sources.dtype}")
    if sources.numel() == 1 and paths.shape[0] > 1:
        sources = sources.expand(paths.shape[0])
    if sources.numel() != paths.shape[0]:
        raise ValueError(f"{where}: expected one source per path ({paths.shape[0]}), got {sources.numel()}")
    if bool(((sources < 0) | (sources >= len(names))).any()):
        raise ValueError(f"{where}: expected source indices in [0, {len(names)}), got {sources.tolist()}")
    # Source j enters below sublayer j: a column's branch lies below the source where its sublayer does.
    where_column = torch.full((model.layers,), -1, dtype=torch.long)  # each column's sublayer (−1: none)
    for index, sublayer in enumerate(model.sublayers):
        if sublayer.attn is not None:
            where_column[sublayer.column] = index
    if model.replaced is not None and (model.replaced.cross_layer or model.replaced.parallel):  # steps that jump
        _check_reads(paths, sources, model.replaced, where_column, names, where)
    below = (where_column[None, :] < sources[:, None]) & (where_column[None, :] >= 0)  # [M, columns]
    if bool(((paths != NO_HEAD) & below).any()):
        bad = int(((paths != NO_HEAD) & below).any(1).nonzero()[0])
        raise ValueError(
            f"{where}: path {bad} takes a head below its source ({names[int(sources[bad])]}): {paths[bad].tolist()}"
        )
    return paths.long(), sources.long()


def steps_taken(paths: Tensor, replaced) -> Iterator[tuple[int, int, int, int]]:
    """``(row, l, m, b)`` for every MLP step of ``paths [M, 2L]``: layer l's feature or skip direction
    b, written at layer m (:meth:`TranscoderCapture.decode`)."""
    layers = replaced.num_layers
    for column in range(layers, 2 * layers):
        for row in (paths[:, column] != NO_HEAD).nonzero().flatten().tolist():
            yield row, *replaced.decode(column, int(paths[row, column]))


def check_between(paths: Tensor, replaced, where: str) -> None:
    """Each MLP step of ``paths [M, 2L]`` (layer l's, written at m: :meth:`TranscoderCapture.decode`)
    on a path that takes nothing between where it reads and where it writes: no head of layers
    l+1..m (and of layer l itself in a parallel block, whose MLP reads below its attention), no MLP
    step of layers l..m−1. Refused by name otherwise."""
    layers = replaced.num_layers
    for row, source, target, _ in steps_taken(paths, replaced):
        between = [*range(source + 1 - replaced.parallel, target + 1), *range(layers + source, layers + target)]
        if bool((paths[row, between] != NO_HEAD).any()):
            raise ValueError(
                f"{where}: path {row} takes layer {source}'s step written at layer {target} and a step between "
                f"where it reads and where it writes (columns {between} must be -1): {paths[row].tolist()}"
            )


def _check_reads(paths: Tensor, sources: Tensor, replaced, where_column: Tensor, names, where: str) -> None:
    """:func:`check_between`, and each MLP step from a source that enters below where it reads
    (``where_column``: each column's sublayer)."""
    check_between(paths, replaced, where)
    layers = replaced.num_layers
    for row, source, _, _ in steps_taken(paths, replaced):
        if int(sources[row]) > int(where_column[layers + source]) - replaced.parallel:
            raise ValueError(
                f"{where}: path {row} takes a step that reads below its source ({names[int(sources[row])]}): "
                f"{paths[row].tolist()}"
            )


def check_steps(paths: Tensor, replaced, where: str) -> None:
    """Each MLP column of ``paths [M, 2L]`` a step of that layer's transcoder: a feature id or a skip
    direction, and with a cross-layer set an earlier layer's feature written there, ``(m − l) ·
    stride + f``."""
    layers = replaced.num_layers
    for layer in range(layers):
        column = paths[:, layers + layer]
        here = replaced.layers.get(layer)
        limit = 0 if here is None else here.num_features + here.num_skip
        offset, index = column.div(replaced.stride, rounding_mode="floor"), column.remainder(replaced.stride)
        earlier = (column >= 0) & (offset > 0) & replaced.cross_layer
        if here is not None and bool(earlier.any()):
            allowed = torch.zeros(layer + 1, dtype=torch.bool)
            allowed[list(here.decoders_from)] = True
            source = layer - offset[earlier]
            width = torch.tensor([replaced.layers[int(s)].num_features if s >= 0 and allowed[s] else 0
                                  for s in source.clamp_min(-1).tolist()])  # fmt: skip
            wrong = (source < 0) | (index[earlier] >= width)
            if bool(wrong.any()):
                raise ValueError(
                    f"{where}: expected paths[:, {layers + layer}] (layer {layer}'s MLP step) a feature of a layer "
                    f"writing there, (m − l) · {replaced.stride} + f, got {column[earlier][wrong].unique().tolist()}"
                )
        if bool(((column < NO_HEAD) | ((column >= limit) & ~earlier)).any()):
            raise ValueError(
                f"{where}: expected paths[:, {layers + layer}] (layer {layer}'s MLP step) in [-1, {limit}) (its "
                f"features, then its skip map's directions), got {column.unique().tolist()}"
            )


def _moves(model: FrozenModel) -> list[list[tuple[int, int, int, int]]]:
    """Per position p (the stream entering sublayer p), the branches a path may take there, bottom
    up: ``(q, first, stop, after)``, branches ``first..stop−1`` of sublayer q, after which the path is
    at position ``after``: sublayer p's own branches (``q = p``, ``after = p + 1``), and a
    cross-layer set's steps of a later MLP q that read the stream here (``after = q + 1``: the
    sublayers and sources between are passed by). Besides them, the skip (p to p + 1)."""
    moves: list[list[tuple[int, int, int, int]]] = [[] for _ in model.sources]
    for index, sublayer in enumerate(model.sublayers):
        if sublayer.attn is not None:
            for first, stop, level in sublayer.branch_levels(index):
                moves[level].append((index, first, stop, index + 1))
    return moves


def _completions(model: FrozenModel, moves, top: int) -> list[list[int]]:
    """``N[p][k]``: the ways from position p to the top taking exactly ``k ≤ top`` branches, exact
    integers: ``N[p][k] = N[p+1][k] + Σ_moves (stop − first) N[after][k−1]``."""
    size = len(model.sources)
    counts = [[0] * (top + 1) for _ in range(size)]
    counts[size - 1][0] = 1
    for position in range(size - 2, -1, -1):
        row = counts[position]
        row[:] = counts[position + 1]
        for _, first, stop, after in moves[position]:
            above = counts[after]
            for k in range(1, top + 1):
                row[k] += (stop - first) * above[k - 1]
    return counts


def _ratio(numerator: int, denominator: int) -> float:
    """``numerator / denominator`` as a float, for integers beyond float64's range."""
    return (numerator << 60) // denominator / 2.0**60 if denominator else 0.0


def _draw(model: FrozenModel, count: int, lengths: list[int], generator) -> tuple[Tensor, Tensor]:
    """``count`` paths drawn uniformly, with replacement, from those whose length is in ``lengths``:
    a (source, length) pair in proportion to its paths, then, position by position from the source
    up, the skip or one of the moves there (:func:`_moves`), each with the share of the remaining
    paths that take it (``(stop − first) N[after][k−1] / N[p][k]``, :func:`_completions`), and a
    uniform branch of the move taken."""
    moves = _moves(model)
    top = max(lengths)
    completions = _completions(model, moves, top)
    pairs = [(j, k) for j in range(len(model.sources)) for k in lengths if completions[j][k]]
    total = sum(completions[j][k] for j, k in pairs)
    weights = torch.tensor([_ratio(completions[j][k], total) for j, k in pairs], dtype=torch.float64)
    picked = torch.multinomial(weights, count, replacement=True, generator=generator)
    sources = torch.tensor([pairs[i][0] for i in picked.tolist()], dtype=torch.long)
    remaining = torch.tensor([pairs[i][1] for i in picked.tolist()], dtype=torch.long)
    position = sources.clone()
    choices = torch.full((count, model.layers), NO_HEAD, dtype=torch.long)
    for here in range(len(model.sources) - 1):
        options = [(None, here + 1, 1, 0)] + [
            ((q, first), after, stop - first, 1) for q, first, stop, after in moves[here]
        ]
        if len(options) == 1:
            position[position == here] = here + 1
            continue
        # shares[o, k]: the share of the paths from here with k branches left that take option o
        shares = torch.tensor(
            [[_ratio(ways * completions[after][k - taken], completions[here][k]) if k >= taken else 0.0
              for k in range(top + 1)] for _, after, ways, taken in options],
            dtype=torch.float64,
        )  # fmt: skip
        draws = torch.rand(count, generator=generator, dtype=torch.float64)
        branch = torch.rand(count, generator=generator, dtype=torch.float64)
        at = position == here
        cumulative = shares.cumsum(0)
        last = (shares > 0).long().cumsum(0).argmax(0)  # the last option a length can take: rounding lands there
        cumulative[last, torch.arange(top + 1)] = math.inf
        option = (draws[None, :] >= cumulative[:, remaining]).sum(0)
        for index, (move, after, ways, _) in enumerate(options):
            rows = at & (option == index)
            position[rows] = after
            if move is None or not bool(rows.any()):
                continue
            q, first = move
            sublayer = model.sublayers[q]
            picked_branch = first + (branch[rows] * ways).long().clamp_max(ways - 1)
            choices[rows, sublayer.column] = sublayer.choice_values("cpu")[picked_branch]
            remaining[rows] -= 1
    return choices, sources


def _every_path_of_length(model: FrozenModel, length: int) -> tuple[Tensor, Tensor]:
    """Every path of exactly ``length`` branches (a stratum small enough to evaluate whole)."""
    moves = _moves(model)
    completions = _completions(model, moves, length)
    top = len(model.sources) - 1
    choices, sources = [], []

    def walk(here: int, left: int, path: list[int], source: int) -> None:
        if here == top:
            choices.append(list(path))
            sources.append(source)
            return
        if completions[here + 1][left]:
            walk(here + 1, left, path, source)
        if not left:
            return
        for q, first, stop, after in moves[here]:
            if not completions[after][left - 1]:
                continue
            sublayer = model.sublayers[q]
            for value in sublayer.choice_values("cpu")[first:stop].tolist():
                path[sublayer.column] = value
                walk(after, left - 1, path, source)
            path[sublayer.column] = NO_HEAD

    for source in range(len(model.sources)):
        if completions[source][length]:
            walk(source, length, [NO_HEAD] * model.layers, source)
    return torch.tensor(choices, dtype=torch.long).reshape(-1, model.layers), torch.tensor(sources, dtype=torch.long)


def _distinct(model: FrozenModel, count: int, lengths: list[int], generator) -> tuple[Tensor, Tensor]:
    """``count`` distinct paths drawn uniformly without replacement (draws, keeping first
    occurrences, until there are enough)."""
    choices = torch.zeros(0, model.layers, dtype=torch.long)
    sources = torch.zeros(0, dtype=torch.long)
    while sources.numel() < count:
        more = _draw(model, count - sources.numel() + 16, lengths, generator)
        choices, sources = torch.cat([choices, more[0]]), torch.cat([sources, more[1]])
        rows = torch.cat([sources[:, None], choices], 1)
        _, inverse = torch.unique(rows, dim=0, return_inverse=True)
        first = torch.full((int(inverse.max()) + 1,), rows.shape[0], dtype=torch.long)
        first.scatter_reduce_(0, inverse, torch.arange(rows.shape[0]), reduce="amin")
        keep = first.sort().values
        choices, sources = choices[keep], sources[keep]
    return choices[:count], sources[:count]


def decompose_model(
    stack,
    *,
    max_length: int | None = None,
    num_samples: int | None = None,
    samples_per_length: int | dict[int, int] | None = None,
    generator: torch.Generator | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    progress: bool = False,
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
) -> ModelPathDecomposition:
    """The paths of a captured model and their terms' residual ratios (module docstring): every
    path, or a sample with the estimators of :class:`~pathkernels.PathDecomposition`.

    Args:
        stack: a stack with a ``residual_capture``.
        max_length: only paths through at most this many heads (default: every path).
        num_samples: paths drawn uniformly without replacement from every path.
        samples_per_length: paths drawn per length (an int for every length ``≤ max_length``, or
            ``{k: n_k}``); a length with no more paths than asked for is evaluated whole.
        generator: for the draws.
        memory_budget: bytes for the chunks of terms in flight.
        progress: a progress bar over the paths of every sequence.
        max_result_bytes: refuse, before any work, a decomposition whose per-path results (the
            paths, their sources, and a residual and a norm per sequence) would take more.

    Returns:
        :class:`ModelPathDecomposition`, float64: ``results.residual``, ``norm`` and ``ratio``
        ``[B, M]``, paths ``[M, L]`` and ``sources [M]`` (sorted by source, then by heads, when
        exact; in draw order when sampled). The terms of each sequence sum to the captured stream.
    """
    layers, heads = stack.num_layers, stack.num_heads
    max_length = None if max_length is None else check_int(max_length, "max_length", _WHERE, minimum=0)
    memory_budget = check_int(memory_budget, "memory_budget", _WHERE, minimum=1)
    max_result_bytes = check_int(max_result_bytes, "max_result_bytes", _WHERE, minimum=0)
    progress = check_flag(progress, "progress", _WHERE)
    if num_samples is not None and samples_per_length is not None:
        raise ValueError(f"{_WHERE}: pass at most one of num_samples and samples_per_length")
    tokens = stack.attn.shape[-1]
    masks = [
        torch.ones(tokens, dtype=torch.bool) if stack.token_mask is None else stack.token_mask[b].cpu()
        for b in range(stack.batch_size)
    ]
    # With transcoders, every element walks the steps active in any of them: one path set for all.
    models = [frozen_model(stack, stack.residual_capture, b, real, batch_features=True) for b, real in enumerate(masks)]
    columns = models[0].layers  # L heads, or with transcoders 2L: each MLP's step after them
    max_length = columns if max_length is None else max_length
    counts = models[0].path_counts(max_length)
    per_path = 8 * (columns + 1) + 16 * stack.batch_size  # choices, source, residual and norm per sequence
    asked = sum(counts) if num_samples is None and samples_per_length is None else None
    if num_samples is not None:
        num_samples = check_int(num_samples, "num_samples", _WHERE, minimum=1)
        asked = min(num_samples, sum(counts))
    if asked is not None and asked * per_path > max_result_bytes:
        raise ValueError(
            f"{_WHERE}: the results of {asked:,} paths would take {format_bytes(asked * per_path)}, more than "
            f"max_result_bytes ({format_bytes(max_result_bytes)}); pass a smaller max_length, num_samples or "
            "samples_per_length, or use pk.length_sums (exact sums per length) or pk.top_paths"
        )
    drawn = _sample(models[0], counts, max_length, num_samples, samples_per_length, generator)
    term_bytes = 8 * tokens * stack.d_model  # one term [n, d] in float64
    if drawn is None:
        method = "exact"
        if sum(counts) > MAX_ENUMERATED_PATHS:
            raise ValueError(
                f"{_WHERE}: the model has {sum(counts):,} paths of at most {max_length} heads, beyond the "
                f"{MAX_ENUMERATED_PATHS:,} a decomposition lists; pass a smaller max_length, num_samples or "
                "samples_per_length, or use pk.length_sums (exact sums per length) or pk.top_paths"
            )
        widest = max((sublayer.branches for sublayer in models[0].sublayers), default=0)
        chunk = max(1, memory_budget // (4 * (widest + 1) * term_bytes))  # a chunk and its children

        def pieces(model):
            for terms, choices, source in _every_term(model, max_length, chunk):
                yield terms, choices, torch.full((terms.shape[0],), source)

    else:
        method, drawn_choices, drawn_sources, counts = drawn
        chunk = max(1, memory_budget // (4 * term_bytes))

        def pieces(model):
            for start in range(0, drawn_sources.numel(), chunk):
                choices, sources = drawn_choices[start : start + chunk], drawn_sources[start : start + chunk]
                yield terms_of(model, choices, sources), choices, sources

    evaluated_paths = sum(counts) if drawn is None else drawn_sources.numel()
    bar = progress_bar(evaluated_paths * len(models), enabled=progress, unit="path", desc=_WHERE)
    residuals, norms = [], []
    for model in models:
        parts = []
        for terms, choices, sources in pieces(model):
            residual, norm = residual_norm(terms, return_norm=True)
            parts.append((choices.cpu(), sources.cpu(), residual.cpu(), norm.cpu()))
            if bar is not None:
                bar.update(terms.shape[0])
        paths, path_sources, residual, norm = (torch.cat(column) for column in zip(*parts))
        if method == "exact":  # the tries' depth-first order, sorted (the same for every sequence)
            order = _canonical_order(paths, path_sources)
            paths, path_sources, residual, norm = paths[order], path_sources[order], residual[order], norm[order]
        residuals.append(residual)
        norms.append(norm)
    if bar is not None:
        bar.close()
    lengths = (paths != NO_HEAD).sum(1)
    # A path's choices: heads, and with transcoders feature ids and skip directions too.
    ids = max([heads] + [int(s.choice_values("cpu").max()) + 1 for s in models[0].sublayers if s.branches])
    results = PathResiduals(torch.stack(residuals), torch.stack(norms), PathTree.from_paths(paths, num_heads=ids))
    return ModelPathDecomposition(
        results=results,
        method=method,
        num_layers=layers,
        num_heads=heads,
        skip=True,
        path_counts=list(counts),
        weights=sample_weights(method, lengths, list(counts)),
        sources=path_sources,
        source_names=models[0].source_names,
        stack=stack,
        replaced=models[0].replaced,
    )


def _sample(model: FrozenModel, counts, max_length, num_samples, samples_per_length, generator):
    """The sample ``(method, choices, sources, counts)`` the arguments ask for (``num_samples``
    already checked by the caller), or None for every path (also when the sample would hold every
    path)."""
    total, top = sum(counts), min(max_length, model.layers)
    if num_samples is not None:
        if max_length != model.layers:
            raise ValueError(
                f"{_WHERE}: uniform sampling draws from all paths; for short paths use samples_per_length "
                "with max_length"
            )
        if num_samples >= total:
            return None
        choices, sources = _distinct(model, num_samples, list(range(top + 1)), generator)
        return "uniform", choices, sources, counts
    if samples_per_length is None:
        return None
    if isinstance(samples_per_length, int) and not isinstance(samples_per_length, bool):
        samples_per_length = {k: samples_per_length for k in range(top + 1) if counts[k] > 0}
    if not isinstance(samples_per_length, dict):
        raise TypeError(f"{_WHERE}: expected samples_per_length as an int or a dict {{length: count}}")
    parts = []
    for k, wanted in sorted(samples_per_length.items()):
        if not isinstance(k, int) or not 0 <= k <= top or counts[k] == 0:
            raise ValueError(f"{_WHERE}: no paths of length {k} (lengths 0..{top} exist)")
        wanted = check_int(wanted, f"samples_per_length[{k}]", _WHERE, minimum=1)
        parts.append(
            _every_path_of_length(model, k) if wanted >= counts[k] else _distinct(model, wanted, [k], generator)
        )
    choices, sources = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    stratum_counts = [counts[k] if k in samples_per_length else 0 for k in range(model.layers + 1)]
    return "stratified", choices, sources, stratum_counts


register_model_decomposer(decompose_model)
