"""The readout trie: a captured model frozen at one forward pass, walked as a trie of its paths.

With every attention pattern and normalisation scale frozen (a stack from
:func:`pathkernels.adapters.capture_huggingface_residual`), the model's stream is a sum of paths: a
source ``K_j`` ``[n, d]`` (the embedding, a layer's constant rows, an MLP's output) entering below
sublayer ``j``, then one branch (the skip or a head) of every sublayer above it, each a token map
``T`` and a feature map ``F`` (docs/DESIGN.md, "Real transformers"). This module holds what the
analyses of those paths share:

- :class:`FrozenModel` (built by :func:`frozen_model`): the sublayers (:class:`Sublayer`, each
  with its token maps and factored feature maps) and the sources of one batch element, on its
  real tokens; :data:`NO_HEAD` marks a layer where a path takes no head, and
  :func:`describe_path` names a path (``"L3H5 → L7H1 from L2 MLP"``);
- :class:`Walker`: the steps of the trie from the top down, a node holding ``ρ`` (``rᵀ`` through
  the token maps chosen above it, ``n`` entries) and ``φ`` (the feature maps applied to ``v``),
  each step run by :class:`ReadoutSteps` (:data:`ENGINE`, the C++ readout engine, or the
  plain-PyTorch form of :mod:`pathkernels.reference`);
- :class:`Fold`: what a walk keeps of the attributions it emits (sums by source and length, the
  top and bottom paths, every path when asked), restricted to a :class:`PathSet` when given.

:mod:`~pathkernels.analysis.attribution` walks every path (or those up to a length, or a tree's)
with them, :mod:`~pathkernels.analysis.top_paths` searches the trie best first, and
:mod:`~pathkernels.analysis.real_paths` builds each path's term from the same frozen model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

import pathkernels.core  # noqa: F401  (loads the compiled extension, whose readout ops ENGINE names)
from pathkernels.core._memory import check_fits

if TYPE_CHECKING:
    from pathkernels.adapters.capture import ResidualStreamCapture
    from pathkernels.adapters.stack import AttentionStack

NO_HEAD = -1  # a path's entry at a layer where it takes no head (the skip, or below its source)


@dataclass(frozen=True)
class ReadoutSteps:
    """The products of a step of the readout trie, as functions of tensors: ``values(rho [N, P, n],
    phi [N, R, d], source [n, d]) -> [N, P, R]``, ``heads(rho, phi, token_maps [H, n, n], feature_in
    [H, d, e], feature_out [H, e, d'] or None) -> ([H, N, P, n], [H, N, R, d'])`` and ``expand(z [N, R,
    e], factor [e, d]) -> [N, R, d]``. :data:`ENGINE` runs them in the C++ readout engine;
    ``pathkernels.reference`` has their plain-PyTorch form, for tests and benchmarks."""

    values: Callable[[Tensor, Tensor, Tensor], Tensor]
    heads: Callable[..., tuple[Tensor, Tensor]]
    expand: Callable[[Tensor, Tensor], Tensor]


def _engine_expand(z: Tensor, factor: Tensor) -> Tensor:
    """``z [N, R, e] @ factor [e, d]`` by the CPU engine's GEMM (the same bits however the nodes are
    batched), by ATen elsewhere."""
    if not z.is_cpu:
        return z @ factor
    return torch.ops.pathkernels._engine_mm(z.reshape(-1, z.shape[-1]), factor).view(*z.shape[:-1], factor.shape[-1])


ENGINE = ReadoutSteps(torch.ops.pathkernels._readout_values, torch.ops.pathkernels._readout_heads, _engine_expand)


@dataclass
class Sublayer:
    """One sublayer of the frozen model, on one sequence's real tokens (n of them): an attention
    sublayer (``attn`` the patterns as computed, ``[H, n, n]``, in the stack's dtype or float64; its
    :attr:`token_maps` float64) or an MLP (``attn`` None, skip only).
    ``pre``: pre-norm, where the skip is the identity and a head reads ``D x C Γ``; post-norm, where
    every branch passes the norm after it, ``D · C Γ``."""

    layer: int
    attn: Tensor | None
    scale: Tensor  # D: 1/σ of the sublayer's norm, per token [n]
    gamma: Tensor  # Γ [d]
    w_v: Tensor | None  # [H, d, d_head]
    w_o: Tensor | None  # [H, d_head, d]
    pre: bool
    centred: bool
    slot: int | None = None  # the column of a path's choices its branches go in (None: ``layer``)
    branch_ids: Tensor | None = None  # what a path's choice holds for each branch (None: its index)
    # A cross-layer set's steps from earlier layers: ``(first branch, level)`` runs, the branches from
    # ``first`` (to the next run's) reading the stream at ``level``, below an earlier layer's MLP.
    jumps: tuple[tuple[int, int], ...] = ()

    @property
    def column(self) -> int:
        """The column of a path's choices this sublayer's branch goes in."""
        return self.layer if self.slot is None else self.slot

    @property
    def branches(self) -> int:
        """Its branches besides the skip: the heads, or the steps of a replaced MLP (0: skip only)."""
        return 0 if self.attn is None else self.attn.shape[0]

    def branch_levels(self, below: int) -> list[tuple[int, int, int]]:
        """``(first, stop, level)``: the branches ``first..stop−1`` and the level a path goes down to
        after taking one: ``below`` (the next level, this sublayer's index), but for a cross-layer
        set's steps from an earlier layer (:attr:`jumps`), which read the stream below its MLP."""
        starts = [(0, below), *self.jumps]
        stops = [first for first, _ in starts[1:]] + [self.branches]
        return [(first, stop, level) for (first, level), stop in zip(starts, stops) if stop > first]

    def choice_values(self, device) -> Tensor:
        """``[branches]``: what a path's choice holds for each branch (a head's index, a feature's id)."""
        if self.branch_ids is None:
            return torch.arange(self.branches, device=device)
        return self.branch_ids.to(device)

    def _norm_features(self, phi: Tensor) -> Tensor:  # C Γ φ
        phi = phi * self.gamma
        return phi - phi.mean(-1, keepdim=True) if self.centred else phi

    def norm_features_matrix(self) -> Tensor:
        """``C Γ`` as a ``[d, d]`` matrix."""
        d = self.gamma.shape[0]
        centre = torch.eye(d, dtype=torch.float64, device=self.gamma.device)
        if self.centred:
            centre = centre - 1.0 / d
        return centre * self.gamma[None, :]

    @functools.cached_property
    def token_maps(self) -> Tensor:
        """Every head's token map ``T_h`` ``[H, n, n]``, in the row form ``ρ' = ρ T_h``: ``A_h D``
        (pre-norm) or ``D A_h`` (post-norm)."""
        if self.pre:  # float64 from patterns held in float32 too: the product promotes them, exactly
            return torch.mul(self.attn, self.scale[None, None, :]).contiguous()
        return torch.mul(self.scale[None, :, None], self.attn).contiguous()

    @functools.cached_property
    def value_group(self) -> int:
        """How many consecutive heads read one value map (a grouped-query model's query heads that
        share a key-value head, their ``W_V`` equal), 1 where none do and for a replaced MLP's steps."""
        if self.attn is None or self.branch_ids is not None or self.w_v is None:
            return 1
        heads = self.w_v.shape[0]
        for group in range(heads, 1, -1):
            if heads % group == 0:
                grouped = self.w_v.view(heads // group, group, *self.w_v.shape[1:])
                if torch.equal(grouped, grouped[:, :1].expand_as(grouped)):
                    return group
        return 1

    @functools.cached_property
    def norm_values(self) -> Tensor:
        """Pre-norm, ``C Γ W_V`` per head ``[H, d, d_head]``: each head's input map with the frozen
        norm before it (scale the rows, centre the columns), without a ``d × d`` product."""
        values = self.gamma[:, None] * self.w_v
        return values - values.mean(-2, keepdim=True) if self.centred else values

    @functools.cached_property
    def feature_factors(self) -> tuple[Tensor, Tensor]:
        """Every head's feature map in the row form ``φ' = φ F_in[h] F_out[h]``, ``F_in [H, d, d_head]``
        and ``F_out [H, d_head, d]``: ``Fᵀ = W_Oᵀ W_Vᵀ Γ C`` (pre-norm) or ``Γ C W_Oᵀ W_Vᵀ``
        (post-norm), with the frozen norm folded into the factor beside it."""
        w_o_t, w_v_t = self.w_o.transpose(-1, -2), self.w_v.transpose(-1, -2)
        if self.pre:  # W_Vᵀ Γ C = (C Γ W_V)ᵀ
            return w_o_t.contiguous(), self.norm_values.transpose(-1, -2).contiguous()
        # Γ C W_Oᵀ: centre the columns, scale the rows
        into = w_o_t - w_o_t.mean(-2, keepdim=True) if self.centred else w_o_t
        return (self.gamma[:, None] * into).contiguous(), w_v_t.contiguous()

    def skip(self, rho: Tensor, phi: Tensor) -> tuple[Tensor, Tensor]:
        """The skip branch: ``ρ' = Tᵀ ρ``, ``φ' = F φ`` for ρ ``[N, P, n]`` and φ ``[N, R, d]``."""
        if self.pre:
            return rho, phi
        return rho * self.scale, self._norm_features(phi)


@dataclass
class FrozenModel:
    """The frozen model of one batch element on its real tokens: sublayers bottom up, and the
    sources, ``sources[j]`` entering below sublayer j (0: the embedding)."""

    sublayers: list[Sublayer]
    sources: list[Tensor]  # [n, d] each, len(sublayers) + 1
    source_names: list[str]
    layers: int
    num_heads: int
    # A source folded as parts: level → [(index into source_names, part [n, d])], parts summing to it.
    splits: dict = field(default_factory=dict)
    # The MLPs replaced by transcoders (adapters.replacement.TranscoderCapture), whose steps fill
    # the choices' columns L..2L−1, or None (the choices are the L heads).
    replaced: object | None = None

    def path_counts(self, max_length: int) -> list[int]:
        """The paths by length ``0..layers`` (a source, then the skip or a branch of every sublayer
        above it), up to ``max_length`` branches: from source j, the coefficients of
        ``Π_{s ≥ j} (1 + b_s x)`` with ``b_s`` the branches of sublayer s; with a cross-layer set's
        steps, which skip the sublayers and sources between where they read and where they write,
        by the same recursion over levels (the paths from the top to each level, by length)."""
        counts = [0] * (self.layers + 1)
        top = min(max_length, self.layers) + 1
        above = {len(self.sources) - 1: [1] + [0] * (top - 1)}  # the paths from the top to a level
        for level in range(len(self.sources) - 1, -1, -1):
            reaching = above.pop(level)
            for length, count in enumerate(reaching):
                counts[length] += count
            if not level:
                break
            sublayer = self.sublayers[level - 1]
            moves = [(level - 1, 1, 0)] + [  # (level, ways, branches taken): the skip, then the branches
                (to, stop - first, 1) for first, stop, to in sublayer.branch_levels(level - 1)
            ]
            for to, ways, taken in moves:
                into = above.setdefault(to, [0] * top)
                for length in range(top - taken):
                    into[length + taken] += ways * reaching[length]
        return counts

    @property
    def pre_norm(self) -> bool:
        """Whether the sublayers read a normed stream through a skip that is the identity (False
        with no sublayer: the model below a head of the first layer is its embedding alone)."""
        return bool(self.sublayers) and self.sublayers[0].pre


def frozen_model(
    stack: AttentionStack,
    capture: ResidualStreamCapture,
    batch: int,
    real: Tensor,
    split_embedding: bool = False,
    batch_features: bool = False,
    where: str = "pathkernels",
    through: int | None = None,
) -> FrozenModel:
    """The sublayers and sources of batch element ``batch`` restricted to its ``real`` tokens (a
    replaced MLP's steps: the features active in this element, or with ``batch_features`` those
    active in any element of the batch, the same steps for every element, so that their walks go in
    step); with
    ``split_embedding`` (a capture with a ``token_embedding``) the embedding folded as two sources,
    "token embedding" (its index, 0) and "position embedding" (the last index): the embedding less
    its token part, so that the two sum to it exactly. ``through``: only the sublayers up to layer
    ``through``'s attention (and the sources below it), as what reads the stream entering that
    attention needs; None: every layer."""
    device = capture.embedding.device
    pick = real.to(device)
    layers = stack.num_layers if through is None else through + 1
    _check_frozen_fits(stack, int(pick.sum()), device, batch, where, layers)
    # The patterns as computed, [L, H, n, n], held as the stack holds them (a float32 model's in
    # float32: exact, and no L·H·n² float64 copy beside the float64 token maps made from them).
    owned = not (capture.attn_row_sums is None and stack.holds_patterns)  # a copy of its own, not the stack's
    if not owned:
        attn = stack.attn[batch, :layers].to(device)
    else:  # rescaled or recomputed: the layers read, one at a time into one float64 tensor
        attn = torch.empty(layers, *stack.attn.shape[2:], dtype=torch.float64, device=device)
        for layer in range(layers):
            capture.patterns(stack.attn, batch, layer=layer, out=attn[layer])
    if not bool(pick.all()):  # the real tokens' rows and columns, in one copy
        index = pick.nonzero().flatten()
        attn, owned = attn[..., index[:, None], index], True
    w_v, w_o = stack.w_v[:layers].to(device, torch.float64), stack.w_o[:layers].to(device, torch.float64)
    scale = capture.norm_scale[batch][..., pick]  # [L, 2, n]
    pre, centred = capture.layout == "pre", capture.centred

    def normalised(t: Tensor, layer: int, which: int, bias: bool = True) -> Tensor:  # D t C Γ + 1 βᵀ (post-norm)
        t = t - t.mean(-1, keepdim=True) if centred else t
        t = scale[layer, which, :, None] * t * capture.norm_weight[layer, which]
        return t + capture.norm_bias[layer, which] if bias else t

    output_bias = capture.output_bias[:, None, :]  # [L, 1, d]: the same for every token
    if capture.attention_output_scale is not None:  # an RMSNorm on the attention's output: D' · Γ'
        out_scale = capture.attention_output_scale[batch][:layers, pick]  # [L, n]
        gain = capture.attention_output_weight[:layers]
        if owned and attn.dtype == torch.float64:  # D' A, in the frozen model's own float64 copy
            attn = attn.mul_(out_scale[:, None, :, None])
        else:  # the stack's patterns, or a float32 copy: D' A in a new float64 tensor
            attn = out_scale[:, None, :, None] * attn
        w_o = w_o * gain[:, None, None, :]  # W_O Γ'
        output_bias = out_scale[..., None] * (capture.output_bias[:layers] * gain)[:, None, :]  # D' 1 (b_O ⊙ γ')ᵀ
    row_sums = attn.sum(-1, dtype=torch.float64)  # r_h = A_h 1 [L, H, n]

    sublayers, sources, names = [], [capture.embedding[batch][pick]], ["embedding"]
    reads = {}  # a replaced MLP's layer → the level its steps read: below its sublayer, or its attention's (parallel)
    for layer in range(layers):
        sublayers.append(
            Sublayer(
                layer, attn[layer], scale[layer, 0], capture.norm_weight[layer, 0], w_v[layer], w_o[layer], pre, centred
            )
        )
        # The attention's constant rows: Σ_h r_h (βᵀ W_V + b_Vᵀ) W_O + 1 b_Oᵀ (pre-norm; post-norm
        # has no β before its values, and passes the rows through its norm).
        head_rows = capture.value_bias[layer] + (capture.norm_bias[layer, 0] @ w_v[layer] if pre else 0)
        constant = torch.einsum("hi,he,hed->id", row_sums[layer], head_rows, w_o[layer]) + output_bias[layer]
        sources.append(constant if pre else normalised(constant, layer, 0))
        names.append(f"L{layer} attention bias")
        if layer == through:  # the stream entering this attention is all that is read
            break
        replaced = None if capture.transcoders is None else capture.transcoders.layers.get(layer)
        if replaced is not None:
            written = replaced.decoders_from  # a cross-layer set's earlier layers writing here
            earlier = [(capture.transcoders.layers[source], reads[source]) for source in written]
            reads[layer] = len(sublayers) - 1 if capture.transcoders.parallel else len(sublayers)
            # Post-norm, every step and both sources pass the norm after the MLP's residual sum.
            after = None if pre else (scale[layer, 1], capture.norm_weight[layer, 1], centred,
                                      functools.partial(normalised, layer=layer, which=1))  # fmt: skip
            _append_replaced_mlp(
                sublayers, sources, names, replaced, batch, pick, capture.transcoders, batch_features, earlier,
                reads[layer], after,
            )  # fmt: skip
            continue
        mlp = capture.mlp_out[batch, layer][pick]
        sublayers.append(
            Sublayer(layer, None, scale[layer, 1], capture.norm_weight[layer, 1], None, None, pre, centred)
        )
        sources.append(mlp if pre else normalised(mlp, layer, 1))
        names.append(f"L{layer} MLP")
    splits = {}
    if split_embedding:
        token = capture.token_embedding[batch][pick]
        splits[0] = [(0, token), (len(names), sources[0] - token)]
        names[0] = "token embedding"
        names.append("position embedding")
    slots = stack.num_layers * (1 if capture.transcoders is None else 2)
    return FrozenModel(sublayers, sources, names, slots, stack.num_heads, splits, capture.transcoders)


def frozen_model_bytes(stack: AttentionStack, tokens: int, layers: int | None = None) -> int:
    """What :func:`frozen_model` allocates for one batch element of ``stack`` on ``tokens`` real
    tokens, of its first ``layers`` layers (None: every one): the heads' float64 token maps
    (``L·H·n²``), the patterns where it copies them (the real tokens' of a padded sequence, in the
    stack's dtype; in float64 where they are rescaled, by row sums or an attention-output norm, or
    recomputed, every token's first), the value and output maps and their factors (``L·H·d·d_head``
    float64 four times), and the sources."""
    capture = stack.residual_capture
    layers, heads, d = stack.num_layers if layers is None else layers, stack.num_heads, stack.d_model
    head_dim = stack.w_v.shape[-1]
    rescaled = (  # made in float64: rescaled by row sums or an attention-output norm, or recomputed
        capture.attn_row_sums is not None or capture.attention_output_scale is not None or not stack.holds_patterns
    )
    copied = rescaled or tokens < stack.attn.shape[-1]
    pattern_bytes = (8 if rescaled else stack.attn.element_size()) if copied else 0
    patterns = layers * heads * tokens**2
    whole = 0  # recomputed patterns of a padded sequence: every token's first, then the real tokens'
    if not stack.holds_patterns and tokens < stack.num_tokens:
        whole = 8 * layers * heads * stack.num_tokens**2
    maps = 8 * (4 * layers * heads * d * head_dim + (2 * layers + 2) * tokens * d)
    return (8 + pattern_bytes) * patterns + whole + maps


def _check_frozen_fits(stack: AttentionStack, tokens: int, device, batch: int, where: str, layers: int) -> None:
    """Refuse, in ``where``'s name and before any work, a frozen model of ``layers`` layers that the
    memory free on ``device`` cannot hold (:func:`frozen_model_bytes`)."""
    heads = stack.num_heads
    check_fits(
        frozen_model_bytes(stack, tokens, layers),
        torch.device(device),
        where,
        f"the frozen model of batch element {batch} ({layers} layers × {heads} heads on {tokens} tokens: its float64 "
        "token maps, L·H·n², the patterns where copied, and the heads' maps) needs about",
        "pass fewer tokens, or free memory (the frozen model is built per call; the captured stack holds the rest)",
        error=MemoryError,
    )


def _append_replaced_mlp(
    sublayers, sources, names, replaced, batch: int, pick: Tensor, transcoders, batch_features: bool, earlier,
    reads: int, after=None,
) -> None:  # fmt: skip
    """A replaced MLP (:class:`~pathkernels.adapters.replacement.ReplacedLayer`) of batch element
    ``batch`` on its tokens ``pick``: a sublayer whose branches are its feature steps active there
    and its skip map's rank-one steps, each a head of d_head 1 with a diagonal token map (choices
    column ``L + layer``, holding the feature's id, or ``num_features + k``), reading at level
    ``reads`` (below the sublayer; a parallel block's, below its attention: a jump), then, for a
    cross-layer set, what the features of each earlier layer l (``earlier``: ``(its ReplacedLayer,
    the level it reads)``) write here, ids ``(layer − l) · stride + f``, each a jump down to that
    level; then its constant rows, an identity sublayer, and its error, so that each source enters
    on its own. ``after``: a post-norm model's norm after the MLP's residual sum, ``(D [n], γ,
    centred, normalised(t, bias=))``, which the steps' sublayer passes (its skip and every step) and
    the two sources pass (the constant rows with its β)."""
    layer = replaced.layer
    output_weights = replaced.output_scale[batch][pick]  # o [n]

    def steps_of(reading, decoder, weights, offset: int):  # (token weights [F'', n], inputs, outputs, ids)
        gates = reading.gates[batch][pick]  # [n, F']
        active = torch.ones_like(gates[0], dtype=torch.bool) if batch_features else gates.any(0)
        weights = gates[:, active].T * weights
        ids = reading.features.to(pick.device)[active.to(reading.features.device)] + offset * transcoders.stride
        return weights, reading.encoder[:, active].T, decoder[active], ids

    own = steps_of(replaced, replaced.decoder, replaced.token_weights[batch][pick], 0)
    token_weights, inputs, outputs, ids = ([part] for part in own)
    if replaced.skip_in is not None:
        token_weights.append(replaced.skip_weights[batch][pick].expand(replaced.num_skip, -1))
        inputs.append(replaced.skip_in)
        outputs.append(replaced.skip_out)
        ids.append(replaced.num_features + torch.arange(replaced.num_skip, device=pick.device))
    jumps = [] if reads == len(sublayers) else [(0, reads)]  # a parallel block's: below its attention
    count = sum(part.shape[0] for part in ids)
    for reading, level in earlier:
        weights = reading.input_scale[batch][pick] * output_weights  # s_l ⊙ o_m
        weights, into, out, from_ids = steps_of(
            reading, replaced.decoders_from[reading.layer], weights, layer - reading.layer
        )
        jumps.append((count, level))
        count += from_ids.shape[0]
        token_weights.append(weights), inputs.append(into), outputs.append(out), ids.append(from_ids)
    token_maps = torch.diag_embed(torch.cat(token_weights))  # [F'', n, n]
    ones = torch.ones(output_weights.shape[0], dtype=torch.float64, device=output_weights.device)
    gamma = torch.ones(inputs[0].shape[-1], dtype=torch.float64, device=output_weights.device)
    w_v, w_o = torch.cat(inputs)[:, :, None], torch.cat(outputs)[:, None, :]  # [F'', d, 1], [F'', 1, d]
    column = transcoders.num_layers + layer
    bias, error = replaced.bias[batch][pick], replaced.error[batch][pick]
    if after is None:
        steps = Sublayer(layer, token_maps, ones, gamma, w_v, w_o, True, False, column, torch.cat(ids), tuple(jumps))
    else:
        norm_scale, norm_weight, centred, normalised = after
        steps = Sublayer(
            layer, token_maps, norm_scale, norm_weight, w_v, w_o, False, centred, column, torch.cat(ids), tuple(jumps)
        )
        bias, error = normalised(bias), normalised(error, bias=False)
    sublayers.append(steps)
    sources.append(bias)
    names.append(f"L{layer} transcoder bias")
    sublayers.append(Sublayer(layer, None, ones, gamma, None, None, True, False))  # the identity
    sources.append(error)
    names.append(f"L{layer} MLP error")


def block_diagonal_model(models: list[FrozenModel]) -> FrozenModel:
    """One frozen model of several batch elements' (the same weights, each on its own real tokens, and
    with transcoders the same steps: :func:`frozen_model`'s ``batch_features``):
    their tokens one after the other, every head's token map block-diagonal, the norm scales and
    the sources stacked along the tokens. A path's value read from ``ρ`` with each element's top
    row ``ρ_b / B`` in its block is then the mean over the elements of its values: the model the
    certified search of a batch's mean walks."""
    first = models[0]
    sizes = [model.sources[0].shape[0] for model in models]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    total = sum(sizes)
    sublayers = []
    for index, sublayer in enumerate(first.sublayers):
        parts = [model.sublayers[index] for model in models]
        attn = None
        if sublayer.attn is not None:
            attn = sublayer.attn.new_zeros(sublayer.attn.shape[0], total, total)
            for part, start, size in zip(parts, offsets, sizes):
                attn[:, start : start + size, start : start + size] = part.attn
        scale = torch.cat([part.scale for part in parts])
        sublayers.append(
            Sublayer(
                sublayer.layer, attn, scale, sublayer.gamma, sublayer.w_v, sublayer.w_o, sublayer.pre, sublayer.centred,
                sublayer.slot, sublayer.branch_ids, sublayer.jumps,
            )
        )  # fmt: skip
    sources = [torch.cat([model.sources[j] for model in models]) for j in range(len(first.sources))]
    splits = {
        level: [(i, torch.cat([dict(model.splits[level])[i] for model in models])) for i, _ in parts]
        for level, parts in first.splits.items()
    }
    return FrozenModel(sublayers, sources, first.source_names, first.layers, first.num_heads, splits, first.replaced)


def describe_path(path: Tensor, source_name: str, replaced=None) -> str:
    """``path [L]`` (the head at each layer, −1 where none) from the source named ``source_name`` as
    text: ``"L3H5 → L7H1 from L2 MLP"``, or ``"L2 MLP (direct)"``. With ``replaced`` (a
    :class:`~pathkernels.adapters.replacement.TranscoderCapture`), ``path [2L]`` also holds each
    MLP's step in columns L..2L−1, named in order from the source up: ``"L0H1 → L1 F812 → L3H2
    from embedding"``."""
    choices = path.tolist()
    layers = len(choices) if replaced is None else replaced.num_layers
    steps = []
    for layer in range(layers):
        if choices[layer] != NO_HEAD:
            steps.append(f"L{layer}H{int(choices[layer])}")
        if replaced is not None and choices[layers + layer] != NO_HEAD:
            steps.append(replaced.step_label(layers + layer, int(choices[layers + layer])))
    return f"{' → '.join(steps)} from {source_name}" if steps else f"{source_name} (direct)"


class PathSet:
    """Membership of head choices ``[N, L]`` (−1 where none) in a tree's paths, by an integer key
    per row (the choices + 1 as base-(H+1) digits) where it fits int64, else by tuples. A row with a
    choice of ``num_heads`` or more (a step the tree's paths never take) is no member."""

    def __init__(self, paths: Tensor, num_heads: int):
        layers = paths.shape[1]
        self.num_heads = num_heads
        self.fits = (num_heads + 1) ** layers < 2**62
        self.weights = (num_heads + 1) ** torch.arange(layers, dtype=torch.long) if self.fits else None
        self.keys = self._keys(paths).unique() if self.fits else {tuple(row) for row in paths.tolist()}

    def _keys(self, choices: Tensor) -> Tensor:
        return (choices + 1) @ self.weights

    def contains(self, choices: Tensor) -> Tensor:
        """``[N]`` bool."""
        if self.fits:  # (a choice beyond the digits' base would alias another key)
            within = (choices < self.num_heads).all(1)
            return torch.isin(self._keys(choices.clamp_max(self.num_heads - 1)), self.keys) & within
        return torch.tensor([tuple(row) in self.keys for row in choices.tolist()], dtype=torch.bool)


class Fold:
    """Accumulates emitted attributions: sums by source and length, counts, the sum of their
    absolute values, the top k (and with ``bottom`` the bottom k), (when ``keep``) every path, and
    (given ``heads``) per-head totals: ``by_head [L, H, L, P, R]``, at ``[l, h, i]`` the sum over
    every path whose ``i``-th head from its source is head h of layer l."""

    def __init__(
        self,
        sources: int,
        layers: int,
        positions: int,
        readouts: int,
        top_k: int,
        keep: bool,
        bottom: bool = True,
        only: PathSet | None = None,
        heads: int | None = None,
        head_columns: int | None = None,
    ):
        self.only = only  # fold only these paths' attributions (a tree's), when given
        self.sums = torch.zeros(sources, layers + 1, positions, readouts, dtype=torch.float64)
        self.counts = torch.zeros(sources, layers + 1, dtype=torch.long)
        self.absolute = torch.zeros(positions, readouts, dtype=torch.float64)
        self.heads = heads
        # The choices' columns that hold heads (the first L; the rest, a replaced MLP's steps).
        self.head_columns = layers if head_columns is None else head_columns
        columns = self.head_columns
        self.by_head = (
            None if heads is None else torch.zeros(columns, heads, columns, positions, readouts, dtype=torch.float64)
        )
        self.k = top_k
        self.best = [
            torch.zeros(0, positions, readouts, dtype=torch.float64),  # values
            torch.zeros(0, positions, readouts, layers, dtype=torch.long),  # paths
            torch.zeros(0, positions, readouts, dtype=torch.long),  # sources
        ]
        self.worst = [t.clone() for t in self.best]
        self.bottom = bottom
        self.kept: list[tuple[Tensor, Tensor, Tensor]] | None = [] if keep else None

    def add(self, source: int, values: Tensor, choices: Tensor, lengths: Tensor) -> None:
        """values ``[N, P, R]`` of N paths from ``source``, their choices ``[N, L]`` and lengths ``[N]``,
        on any device (the fold keeps its results on the CPU)."""
        values, choices, lengths = values.cpu(), choices.cpu(), lengths.cpu()
        if self.only is not None:
            inside = self.only.contains(choices)
            values, choices, lengths = values[inside], choices[inside], lengths[inside]
        self.sums[source].index_add_(0, lengths, values)
        self.counts[source].index_add_(0, lengths, torch.ones_like(lengths))
        self.absolute += values.abs().sum(0)
        if self.by_head is not None:
            taken = choices[:, : self.head_columns] != NO_HEAD  # [N, L]
            order = taken.long().cumsum(1) - 1  # each head's place in its path, from the source
            layers = self.head_columns
            layer = torch.arange(layers).expand_as(taken)
            cell = ((layer * self.heads + choices[:, :layers]) * layers + order)[taken]  # into by_head's [L, H, L]
            rows = taken.nonzero()[:, 0]
            self.by_head.view(-1, *values.shape[1:]).index_add_(0, cell, values[rows])
        if self.kept is not None:
            self.kept.append((choices, torch.full_like(lengths, source), values))
        if self.k > 0:
            self.best = self._merge(self.best, values, choices, source, largest=True)
            if self.bottom:
                self.worst = self._merge(self.worst, values, choices, source, largest=False)

    def _merge(self, held, values, choices, source, *, largest: bool):
        held_values, held_paths, held_sources = held
        k = min(self.k, values.shape[0])
        chosen = torch.topk(values, k, dim=0, largest=largest)  # [k, P, R]
        paths = choices[chosen.indices]  # [k, P, R, L]
        all_values = torch.cat([held_values, chosen.values])
        all_paths = torch.cat([held_paths, paths])
        all_sources = torch.cat([held_sources, torch.full_like(chosen.indices, source)])
        keep = torch.topk(all_values, min(self.k, all_values.shape[0]), dim=0, largest=largest).indices
        gather = keep[..., None].expand(-1, -1, -1, all_paths.shape[-1])
        return [all_values.gather(0, keep), all_paths.gather(0, gather), all_sources.gather(0, keep)]


class TensorCache:
    """Tensors computed once per key and kept within ``limit_bytes`` (8 bytes an entry: float64);
    when the next one would pass the limit, everything kept is forgotten at once."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self._values: dict[tuple, Tensor] = {}
        self._bytes = 0

    def __contains__(self, key: tuple) -> bool:
        return key in self._values

    def get(self, key: tuple, compute: Callable[[], Tensor]) -> Tensor:
        """The tensor kept under ``key``, or ``compute()``'s, then kept."""
        if key not in self._values:
            value = compute()
            if self._bytes + 8 * value.numel() > self.limit_bytes:
                self._values.clear()
                self._bytes = 0
            self._values[key] = value
            self._bytes += 8 * value.numel()
        return self._values[key]


class Walker:
    """The steps of the readout trie over a frozen model, by ``steps`` (the readout engine, or
    ``pathkernels.reference``'s plain-PyTorch form).

    A chunk of nodes is ``(rho [N, P, n], phi [N, R, ·], choices [N, L], lengths [N], runs)``. With
    ``low_rank`` (pre-norm models, where a skip leaves φ alone) a node below a head keeps φ in that
    head's d_head coordinates: its basis is ``(s, h)``, the last head taken, and ``φ = z F_out[s, h]``
    with ``z [R, d_head]``, so a head's child costs ``φ F_in`` alone (no ``F_out``). Where enough
    nodes share a basis, their matrices are computed once (and cached within ``cache_bytes``): a
    child through head h' of sublayer s' is then ``z (F_out[s, h] F_in[s', h'])``, ``d_head × d_head``
    per node instead of ``d × d_head``, and the value at source K is ``ρ (K F_out[s, h]ᵀ) zᵀ``,
    ``n · d_head`` instead of ``n · d``; elsewhere φ is expanded for the step. Whether a basis's
    nodes are enough depends on the tree alone (:meth:`_shared`), so the bits do not depend on how
    the walk is chunked. ``runs`` lists the chunk's consecutive nodes of one basis, ``(count,
    basis)``: a head's children are one run, so a chunk holds at most H runs, one engine call each.
    Basis ``None``: φ in the model's d coordinates (the nodes above every head, and every node
    without ``low_rank``)."""

    def __init__(
        self,
        model: FrozenModel,
        steps: ReadoutSteps = ENGINE,
        *,
        low_rank: bool,
        max_length: int | None = None,
        cache_bytes: int = 1 << 28,
    ):
        self.model, self.steps = model, steps
        self.low_rank = low_rank and model.pre_norm
        self.max_length = model.layers if max_length is None else max_length
        self._cache = TensorCache(cache_bytes)
        self._shared_by: dict[tuple[int, bool], bool] = {}

    def _shared(self, sublayer: int, growing: bool) -> bool:
        """Whether the nodes whose last head is in ``sublayer`` are at least d_head per basis (per
        basis and level for values; with ``growing``, those that may still take a head, per basis
        and sublayer below): the count of their prefixes above it, ``Σ_k C(A, k) H^k`` over the A
        attention sublayers above, up to ``max_length − 1`` heads (``− 2`` when growing)."""
        if (sublayer, growing) not in self._shared_by:
            top = self.max_length - (2 if growing else 1)
            head_dim = self.model.sublayers[sublayer].w_v.shape[-1]
            nodes = _prefixes(self.model.sublayers[sublayer + 1 :], top)
            self._shared_by[sublayer, growing] = nodes >= head_dim
        return self._shared_by[sublayer, growing]

    def _output_factor(self, basis: tuple[int, int]) -> Tensor:  # F_out[s, h] [d_head, d]
        sublayer, head = basis
        return self.model.sublayers[sublayer].feature_factors[1][head]

    def _run_values(self, level: int, rho: Tensor, phi: Tensor, basis, part: int | None = None) -> Tensor:
        source = self.model.sources[level] if part is None else dict(self.model.splits[level])[part]
        if basis is not None:  # φ = z F_out[basis], which enough nodes share (_low)
            key = ("source", level, part, basis)
            source = self._cache.get(key, lambda: source @ self._output_factor(basis).T)
        return self.steps.values(rho, phi, source)

    def _low(self, at: int) -> bool:
        """Whether the children through sublayer ``at``'s heads keep φ in d_head coordinates: with
        ``low_rank``, where enough nodes will share each of their bases."""
        return self.low_rank and self._shared(at, growing=False)

    def _run_heads(self, at: int, rho: Tensor, phi: Tensor, basis) -> tuple[Tensor, Tensor]:
        sublayer = self.model.sublayers[at]
        feature_in, feature_out = sublayer.feature_factors
        low = self._low(at)
        if basis is not None:  # φ = z F_out[basis]
            if low and self._shared(basis[0], growing=True):
                feature_in = self._cache.get(("heads", at, basis), lambda: self._output_factor(basis) @ feature_in)
            else:
                phi = self.steps.expand(phi, self._output_factor(basis))
        return self.steps.heads(rho, phi, sublayer.token_maps, feature_in, None if low else feature_out)

    @staticmethod
    def _by_runs(step, rho: Tensor, phi: Tensor, runs: list[tuple]) -> list:
        """``step(rho, phi, basis)`` on each run of the chunk, in order."""
        results, start = [], 0
        for count, basis in runs:
            run = slice(start, start + count)
            results.append(step(rho[run], phi[run], basis))
            start += count
        return results

    def values(self, level: int, rho: Tensor, phi: Tensor, runs: list[tuple], part: int | None = None) -> Tensor:
        """``ρ K φᵀ`` at source ``level`` (or its ``part``, an index of :attr:`FrozenModel.splits`)
        for every node: ``[N, P, R]``, the attributions of the paths that end there."""
        step = functools.partial(self._run_values, level, part=part)
        return step(rho, phi, runs[0][1]) if len(runs) == 1 else torch.cat(self._by_runs(step, rho, phi, runs))

    def _heads(self, at: int, rho: Tensor, phi: Tensor, runs: list[tuple]) -> tuple[Tensor, Tensor]:
        """Every head's children of every node, head-major: ``[H, N, P, n]`` and ``[H, N, R, ·]``."""
        step = functools.partial(self._run_heads, at)
        if len(runs) == 1:
            return step(rho, phi, runs[0][1])
        parts = self._by_runs(step, rho, phi, runs)
        return torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=1)

    def children(self, level: int, rho, phi, choices, lengths, runs: list[tuple], max_length: int) -> list[tuple]:
        """The children of a chunk at ``level`` through sublayer ``level − 1``: the skip's, then (for
        nodes under ``max_length`` heads) every head's, head by head: a list of parts, each
        ``(child level, *chunk tuple)``: ``level − 1``, but for a cross-layer set's steps from an
        earlier layer, whose children are at the level below that layer's MLP
        (:meth:`Sublayer.branch_levels`)."""
        sublayer = self.model.sublayers[level - 1]
        rho_skip, phi_skip = sublayer.skip(rho, phi)
        parts = [(level - 1, rho_skip, phi_skip, choices, lengths, runs)]
        grows = lengths < max_length
        if sublayer.attn is None or not bool(grows.any()):
            return parts
        if not bool(grows.all()):
            rho, phi, choices, lengths = rho[grows], phi[grows], choices[grows], lengths[grows]
            counts = torch.tensor([count for count, _ in runs], device=grows.device)
            kept = torch.segment_reduce(grows.double(), "sum", lengths=counts).long().tolist()
            runs = [(k, basis) for k, (_, basis) in zip(kept, runs) if k]
        rho_h, phi_h = self._heads(level - 1, rho, phi, runs)
        grown = rho_h.shape[1]
        values = sublayer.choice_values(rho.device)
        low = self._low(level - 1)
        for first, stop, child_level in sublayer.branch_levels(level - 1):
            heads = stop - first
            head_choices = choices[None].repeat(heads, 1, 1)
            head_choices[:, :, sublayer.column] = values[first:stop, None]
            runs_h = [(grown, (level - 1, h)) for h in range(first, stop)] if low else [(heads * grown, None)]
            lengths_h = (lengths + 1).repeat(heads)
            rho_part, phi_part = rho_h[first:stop].flatten(0, 1), phi_h[first:stop].flatten(0, 1)
            parts.append((child_level, rho_part, phi_part, head_choices.flatten(0, 1), lengths_h, runs_h))
        return parts

    def walk(self, rho: Tensor, phi: Tensor, max_length: int, chunk: int, fold: Fold, bar) -> None:
        """Every path's attribution folded into ``fold`` (:meth:`emissions`), ``bar`` counting them."""
        for parts, choices, lengths in self.emissions(rho, phi, max_length, chunk):
            for source, values in parts:
                fold.add(source, values, choices, lengths)
            if bar is not None:
                bar.update(choices.shape[0])

    def emissions(self, rho: Tensor, phi: Tensor, max_length: int, chunk: int):
        """The walk, depth first from the top: a node at level j has chosen the branches of
        sublayers j, j+1, …; it meets source j (entering below sublayer j), then branches through
        sublayer j − 1. Yields, chunk by chunk, ``(parts, choices [N, L], lengths [N])``: ``parts``
        the ``(source index, values [N, P, R])`` of the paths that end there (one part per source,
        two where the source is split). The order depends on the tree and ``chunk`` alone, not on
        the values: walks of several batch elements with one ``chunk`` go in step."""
        choices = torch.full((1, self.model.layers), NO_HEAD, dtype=torch.long, device=rho.device)
        lengths = torch.zeros(1, dtype=torch.long, device=rho.device)
        pending = [(len(self.model.sublayers), rho, phi, choices, lengths, [(1, None)])]
        while pending:
            level, rho, phi, choices, lengths, runs = pending.pop()
            indices = [index for index, _ in self.model.splits.get(level, [])] or [None]
            parts = [
                (level if index is None else index, self.values(level, rho, phi, runs, part=index)) for index in indices
            ]
            yield parts, choices, lengths
            if level == 0:
                continue
            for child_level, *part, part_runs in self.children(level, rho, phi, choices, lengths, runs, max_length):
                for start in range(0, part[0].shape[0], chunk):
                    stop = start + chunk
                    pending.append((child_level, *(t[start:stop] for t in part), _slice_runs(part_runs, start, stop)))


def _prefixes(sublayers: list[Sublayer], top: int) -> int:
    """The branch choices over ``sublayers`` (the skip, or one of each's branches) of at most
    ``top`` branches: the coefficients of ``Π (1 + b_s x)`` up to ``x^top``."""
    counts = [1]
    for sublayer in sublayers:
        if sublayer.branches:
            counts = [a + sublayer.branches * b for a, b in zip(counts + [0], [0] + counts)]
    return sum(counts[: max(top, -1) + 1])


def _slice_runs(runs: list[tuple], start: int, stop: int) -> list[tuple]:
    """The runs ``(count, basis)`` of nodes ``start..stop-1``."""
    sliced, first = [], 0
    for count, basis in runs:
        low, high = max(start, first), min(stop, first + count)
        if low < high:
            sliced.append((high - low, basis))
        first += count
    return sliced
