"""ResidualStreamCapture: what a real transformer's residual stream holds beyond its attention.

The record that :func:`~pathkernels.adapters.capture_huggingface_residual` and
:func:`~pathkernels.adapters.capture_transformer_lens_residual` fill
(:mod:`pathkernels.adapters.residual`) and that an :class:`~pathkernels.adapters.AttentionStack`
carries as its ``residual_capture``: a module of its own, below both, so that the stack and the
readers that build it import it in one direction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from pathkernels.core._repr import short_repr


@dataclass
class ResidualStreamCapture:
    """One forward pass of a transformer, in float64, its norms frozen.

    ``layout``: ``"pre"`` (GPT-2, Llama: each sublayer reads a normalised copy of the stream, which
    it adds to) or ``"post"`` (BERT: the stream itself is normalised after each sublayer's sum).
    ``norm``: ``"layernorm"`` (``y = D x C Γ + 1 βᵀ``), ``"rmsnorm"`` (``y = D x Γ``: no centring
    ``C``, and β is 0) or ``"none"`` (a TransformerLens model without norms: ``D``, ``Γ`` are 1).

    ``embedding`` ``[B, n, d]``: the stream entering block 0. ``norm_scale`` ``[B, L, 2, n]``: ``1/σ_t``
    of each block's two norms, per token (pre: before attention, before the MLP; post: after each),
    with their γ and β in ``norm_weight``, ``norm_bias`` ``[L, 2, d]``. ``value_bias``
    ``[L, H, d_head]`` and ``output_bias`` ``[L, d]``: the attention's biases, apart (0 where the
    model has none); a head adds ``(A 1) b_Vᵀ W_O``, which is ``1 b_Vᵀ W_O`` only where its rows sum
    to 1. ``attn_row_sums`` ``[B, L, H, n]``: the sums of the pattern rows as the model computed
    them, where the stack holds them renormalised (a float32 softmax in a float64 model; the
    model's pattern is ``stack.attn · attn_row_sums``), else None. ``mlp_out`` ``[B, L, n, d]``: each
    MLP's output as computed (post: before its residual sum). ``residual`` ``[B, n, d]``: the
    stream the blocks leave (pre: entering the final norm, whose ``final_scale`` ``[B, n]``,
    ``final_weight`` and ``final_bias`` ``[d]`` are kept for readouts; post: the last hidden state,
    and no final norm). ``unembedding`` ``[vocab, d]`` and ``unembedding_bias`` ``[vocab]``: the
    model's output embedding (its weight as the model holds it, not copied), None without an LM head.
    ``token_embedding`` ``[B, n, d]``: where ``embedding`` is a token embedding plus a learned position
    embedding (GPT-2, OPT, a TransformerLens model with standard positions), the token part; the
    position part is ``embedding − token_embedding``; None elsewhere.
    ``final_norm``: the final norm's kind where it differs from the blocks' ``norm`` (else None).
    ``attention_output_scale`` ``[B, L, n]`` and ``attention_output_weight`` ``[L, d]``: ``1/σ'_t``
    and γ' of an RMSNorm on each attention sublayer's output (Gemma-2 and -3, OLMo 2), which
    scales every head's term, ``D' · (A D x C Γ W_V W_O) · Γ'``, and the sublayer's constant rows;
    None where the model has none. (An RMSNorm on the MLP's output is in ``mlp_out`` already.)
    ``pooled_token`` ``[B]`` int64: for a Hugging Face sequence classifier, the token whose state
    its ``score`` head reads, by the model's own rule (the rightmost token whose id is not the pad
    id; the last token where the model has no pad id or took embeddings), else None. ``check``: how
    the capture compared with the model's own forward pass (:class:`~pathkernels.adapters.self_check.
    CaptureCheck`), None where the check was turned off. ``query_key``: the frozen query and key maps
    of every head and the model's own queries and keys (:class:`~pathkernels.adapters.query_key.
    QueryKeyCapture`), read when the capture is asked for them (``query_key=True``), else None.
    ``transcoders``: the MLPs replaced by a transcoder set, frozen (:class:`~pathkernels.adapters.
    replacement.TranscoderCapture`), when the capture is given one, else None; ``mlp_out`` is then
    still each MLP's own output, which its features' paths, its constant rows and its error sum to.
    """

    layout: str
    norm: str
    embedding: Tensor
    norm_scale: Tensor
    norm_weight: Tensor
    norm_bias: Tensor
    value_bias: Tensor
    output_bias: Tensor
    mlp_out: Tensor
    residual: Tensor
    attn_row_sums: Tensor | None = None
    final_scale: Tensor | None = None
    final_weight: Tensor | None = None
    final_bias: Tensor | None = None
    unembedding: Tensor | None = None
    unembedding_bias: Tensor | None = None
    final_norm: str | None = None
    attention_output_scale: Tensor | None = None
    attention_output_weight: Tensor | None = None
    pooled_token: Tensor | None = None
    token_embedding: Tensor | None = None  # [B, n, d]: the token part of ``embedding`` (below), or None
    check: object | None = None  # the self-check's CaptureCheck (pathkernels.adapters.self_check), or None
    query_key: object | None = None  # the score side's QueryKeyCapture (pathkernels.adapters.query_key), or None
    model_fingerprint: dict | None = None  # weights_fingerprint() of the model read, or None
    transcoders: object | None = None  # the MLPs replaced (adapters.replacement.TranscoderCapture), or None
    input_ids: Tensor | None = None  # [B, n] the token ids the model read, where it read ids, else None

    def __repr__(self) -> str:
        batch, tokens, width = self.embedding.shape
        layers = self.norm_scale.shape[1]
        return short_repr(self, f"{self.layout}-norm {self.norm}, B = {batch}, L = {layers}, n = {tokens}, d = {width}")

    @property
    def centred(self) -> bool:
        """Whether the blocks' norms centre the features (LayerNorm's ``C``; RMSNorm, and a model
        without norms, ``norm="none"``, whose scales are 1, do not)."""
        return self.norm == "layernorm"

    @property
    def final_centred(self) -> bool:
        """Whether the final norm centres the features: its own kind (``final_norm``; an RMSNorm
        before the unembedding of a LayerNorm model, TransformerLens's ``final_rms``), else the
        blocks' (``norm``)."""
        return (self.norm if self.final_norm is None else self.final_norm) == "layernorm"

    def patterns(
        self, attn: Tensor, batch: int | None = None, layer: int | None = None, out: Tensor | None = None
    ) -> Tensor:
        """The stack's ``attn [B, L, H, n, n]`` as the model computed it (only batch element
        ``batch``, ``[L, H, n, n]``, and only layer ``layer``, ``[(B,) H, n, n]``, when given), in
        float64 on the capture's device: times ``attn_row_sums`` where the stack holds it
        renormalised; recomputed from the queries and keys where the stack does not hold them
        (:class:`RecomputedPatterns`). ``out``: a float64 tensor of that shape to write it into
        (one buffer reused layer after layer faults no fresh memory in)."""
        if isinstance(attn, RecomputedPatterns):
            return attn.compute(self.query_key, batch, layer, out)
        sums = self.attn_row_sums
        if batch is not None:
            attn, sums = attn[batch], None if sums is None else sums[batch]
        if layer is not None:
            attn, sums = attn[..., layer, :, :, :], None if sums is None else sums[..., layer, :, :]
        if out is not None:
            out.copy_(attn)
            return out if sums is None else out.mul_(sums[..., None])
        converted = attn.to(self.embedding.device, torch.float64)
        if sums is None:
            return converted
        if converted.data_ptr() == attn.data_ptr():  # the stack's own tensor: scaled into a new one
            return converted * sums[..., None]
        return converted.mul_(sums[..., None])  # a copy already (L·H·n² float64): scaled where it is

    def on(self, device) -> ResidualStreamCapture:
        """A copy on ``device`` (float64 throughout, whatever the stack's dtype)."""
        moved = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in vars(self).items()}
        for name in ("query_key", "transcoders"):
            if getattr(self, name) is not None:
                moved[name] = getattr(self, name).on(device)
        return ResidualStreamCapture(**moved)


class RecomputedPatterns:
    """The patterns of a stack captured without them (``patterns="recomputed"``), in their place as
    ``stack.attn``: ``shape`` ``[B, L, H, n, n]``, every layer recomputed when read, in float64,
    from the model's own queries and keys (:meth:`~pathkernels.adapters.query_key.QueryKeyCapture.
    attention`), so that a capture holds ``O(L·H·n·e)`` for them rather than ``L·H·n²``. Read them
    through :meth:`ResidualStreamCapture.patterns` (a layer at a time where that is enough); no
    tensor operation takes them as they are.

    They are the float64 softmax of the scores the model computed, which the model took in its
    own dtype (``computed_in``): they differ from its patterns by that dtype's rounding. Each
    layer's is checked against the model's own the first time it is recomputed: ``A v`` for a
    fixed random ``v`` ``[n]`` in [-1, 1] (``probe``), which the capture took of the model's patterns
    as they came (``model_probe`` ``[B, L, H, n]``), must agree on the real tokens (``real``
    ``[B, n]`` bool, or None: all) to ``tolerance`` (the capture's, for ``computed_in``), or the
    read is refused by name."""

    def __init__(
        self, model_probe: Tensor, probe: Tensor, computed_in: torch.dtype, tolerance: float, real: Tensor | None
    ):
        batch, layers, heads, tokens = model_probe.shape
        self.shape = torch.Size((batch, layers, heads, tokens, tokens))
        self.model_probe, self.probe, self.real = model_probe, probe, real
        self.computed_in, self.tolerance = computed_in, tolerance
        self._checked: set[tuple[int, int]] = set()

    dtype = torch.float64  # what a read gives

    @property
    def device(self) -> torch.device:
        return self.model_probe.device

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return 8

    def __repr__(self) -> str:
        return f"RecomputedPatterns(shape={list(self.shape)}, computed in {self.computed_in})"

    def to(self, *args, **kwargs) -> RecomputedPatterns:
        """A copy whose probes are on the device ``Tensor.to(*args, **kwargs)`` names (the
        patterns are float64 whatever dtype is asked for)."""
        device = self.probe.to(*args, **kwargs).device
        moved = RecomputedPatterns(
            self.model_probe.to(device),
            self.probe.to(device),
            self.computed_in,
            self.tolerance,
            None if self.real is None else self.real.to(device),
        )
        moved._checked = set(self._checked)
        return moved

    def compute(self, query_key, batch: int | None, layer: int | None, out: Tensor | None = None) -> Tensor:
        """:meth:`ResidualStreamCapture.patterns` of these patterns: ``[(B,) (L,) H, n, n]`` float64,
        the batch and layer axes only where ``batch``, ``layer`` are None, on ``query_key``'s
        device (written into ``out`` where given)."""
        if query_key is None:
            raise ValueError(
                "pathkernels: this stack's patterns are recomputed from its queries and keys (patterns='recomputed'), "
                "but its capture holds none"
            )
        count, layers, heads, tokens, _ = self.shape
        batches = range(count) if batch is None else [batch]
        layer_list = range(layers) if layer is None else [layer]
        shape = (*(() if batch is not None else (count,)), *(() if layer is not None else (layers,)), heads, tokens)
        if out is None:
            out = torch.empty(*shape, tokens, dtype=torch.float64, device=query_key.queries.device)
        grid = out.view(len(batches), len(layer_list), heads, tokens, tokens)
        for i, b in enumerate(batches):
            for j, index in enumerate(layer_list):
                query_key.attention(b, index, out=grid[i, j])
                self._check(grid[i, j], b, index)
        return out

    def _check(self, patterns: Tensor, batch: int, layer: int) -> None:
        """Refuse a layer's recomputed ``patterns [H, n, n]`` whose probe differs from the model's
        (class docstring), the first time it is recomputed."""
        if (batch, layer) in self._checked:
            return
        ours = patterns @ self.probe.to(patterns.device)  # [H, n]
        model = self.model_probe[batch, layer].to(patterns.device)
        if self.real is not None:
            keep = self.real[batch].to(patterns.device)
            ours, model = ours[:, keep], model[:, keep]
        error = float((ours - model).abs().max()) if ours.numel() else 0.0  # |v| ≤ 1: the entries' scale
        if not error <= self.tolerance:
            raise ValueError(
                f"pathkernels: layer {layer}'s patterns of batch element {batch}, recomputed from the captured "
                f"queries and keys, differ from the model's own by {error:.2g} (A v for a random v in [-1, 1]), "
                f"beyond the tolerance {self.tolerance:g}: this family's scores are not rebuilt as the model computes "
                "them; capture with patterns='held'"
            )
        self._checked.add((batch, layer))


def weights_fingerprint(model: nn.Module) -> dict[str, tuple]:
    """What identifies a model's weights, cheaply: for each parameter (by name), its shape and the
    float64 sums ``Σ w`` and ``Σ w²``, over blocks of ``_FINGERPRINT_BLOCK`` entries, so that at
    most a block is ever held in float64 (about 2·10⁹ entries a second on 2 cores: a second for a
    2B-parameter model). Another model, or these weights
    changed, gives another fingerprint."""
    prints, buffers = {}, {}
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            total = squares = 0.0
            for block in parameter.detach().reshape(-1).split(_FINGERPRINT_BLOCK):
                # Copied into one float64 buffer per device first: 3× faster than reducing with
                # dtype=float64, and no fresh memory faulted in per block.
                if block.device not in buffers:
                    buffers[block.device] = torch.empty(_FINGERPRINT_BLOCK, dtype=torch.float64, device=block.device)
                block = buffers[block.device][: block.numel()].copy_(block)
                total += float(block.sum())
                squares += float(torch.linalg.vector_norm(block)) ** 2
            prints[name] = (tuple(parameter.shape), total, squares)
    return prints


_FINGERPRINT_BLOCK = 1 << 20  # entries of a weight summed at once (8 MiB in float64)


def fingerprint_mismatch(model: nn.Module, expected: dict[str, tuple] | None) -> str | None:
    """None where ``model``'s weights are those fingerprinted as ``expected`` (or no fingerprint was
    taken), else what differs: the parameters' names, or the first parameter whose shape or sums
    differ (beyond 1e-6 relative, so that a change of dtype is the same weights)."""
    if expected is None:
        return None
    found = weights_fingerprint(model)
    if found.keys() != expected.keys():
        return f"other parameters ({len(found)} where the capture read {len(expected)}, or other names)"
    for name, (shape, total, squares) in expected.items():
        other_shape, other_total, other_squares = found[name]
        if other_shape != shape:
            return f"{name} has shape {list(other_shape)}, the capture read {list(shape)}"
        scale = max(squares, 1e-300) ** 0.5 * max(1.0, math.prod(shape) ** 0.5)
        if abs(other_total - total) > 1e-6 * scale or abs(other_squares - squares) > 1e-6 * max(squares, 1e-300):
            return f"{name} holds other values (Σw {other_total:.6g} where the capture read {total:.6g})"
    return None
