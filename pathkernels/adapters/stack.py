"""AttentionStack: what the adapters extract from a model, in the engine's layout."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from pathkernels.adapters.capture import RecomputedPatterns, ResidualStreamCapture
from pathkernels.core import masking
from pathkernels.core.checks import (
    ROW_SUM_TOLERANCE,
    check_flag,
    check_nonempty_batch,
    check_row_stochastic,
    renormalise_rows,
    restricted_attention,
)
from pathkernels.core.engine import PathResiduals, path_residuals
from pathkernels.core.length_sums import length_sums
from pathkernels.core.paths import SKIP, PathTree
from pathkernels.reference import post_ln_length_sums_ref, pre_ln_length_sums_ref


@dataclass
class AttentionStack:
    """Attention patterns and per-head value-output maps of one forward pass.

    A head's contribution to its layer's attention output is ``A[l, h] X_l W_V[l, h] W_O[l, h]``,
    and the layer adds ``b_O[l]`` once (value biases are folded into it: rows of A sum to 1, so
    ``A (X W_V + 1 b_Vᵀ) W_O = A X W_V W_O + 1 b_Vᵀ W_O``).

    Attributes:
        attn: ``[B, L, H, n, n]`` attention probabilities (rows sum to 1; causal models have zeros
            above the diagonal).
        w_v: ``[L, H, d, d_head]``; grouped-query models repeat each key/value head for the query
            heads that share it.
        w_o: ``[L, H, d_head, d]``.
        b_o: ``[L, d]``: the output bias plus ``Σ_h b_V[l, h] W_O[l, h]``.
        hidden_states: ``[L+1, B, n, d]`` as the source reports them (for Hugging Face, the
            model's ``hidden_states``), or None.
        source: where it came from, e.g. ``"huggingface:gpt2"``.
        attn_precision: the dtype the patterns were computed in, where coarser than attn's (a
            bridge whose float64 model took its softmax in float32 some way the adapters could not
            change), or None. Where it is coarser than
            attn's own, the rows are checked to that precision at construction and renormalised in
            attn's dtype, so that they sum to 1 to its precision, and ``repr`` says so; otherwise it
            is set to None.
        token_mask: ``[B, n]`` bool, True at real tokens (a padded batch's ``attention_mask``), or
            None when every token is real. :func:`pathkernels.path_residuals`,
            :func:`pathkernels.decompose`, :func:`pathkernels.rollout`, :meth:`length_sums` and the
            metrics evaluate each batch element on its real tokens only when given a stack.
        attention_only: whether the model is the attention-only network these maps make (True:
            a TransformerLens ``attn_only`` model without norms), or has LayerNorm and MLPs that
            the stack leaves out (False: every Hugging Face model read, so that
            :meth:`length_sums` warns that its sums are not the model's residual stream); None
            when not known (a stack built by hand).
        residual_capture: what the model's residual stream needs beyond the attention (frozen
            norm scales, γ, β, MLP outputs: :func:`pathkernels.adapters.capture_huggingface_residual`),
            or None. With it, :meth:`length_sums` sums the model's own stream by path length.
        name: the model's name for people, which figure titles use (the folder a model was read
            from, e.g. ``"gpt2_4l"``; :func:`pathkernels.adapters.naming.model_name`), or "".

    Raises:
        ValueError: at construction, if an attention row of a real token, restricted to the real
            tokens, does not sum to 1 (to the precision it was computed in), or attn has no batch
            element, layer or head.
    """

    attn: Tensor
    w_v: Tensor
    w_o: Tensor
    b_o: Tensor
    hidden_states: Tensor | None = None
    source: str = ""
    token_mask: Tensor | None = None
    attn_precision: torch.dtype | None = None
    attention_only: bool | None = None
    residual_capture: ResidualStreamCapture | None = None
    name: str = ""

    def __post_init__(self):
        where = f"pathkernels.AttentionStack from {self.source or 'the caller'}"
        if self.attn.dim() != 5:
            raise ValueError(f"{where}: expected attn of shape [B, L, H, n, n], got {list(self.attn.shape)}")
        check_nonempty_batch(self.attn, where)
        self.token_mask = masking.check_token_mask(
            self.token_mask, self.attn.shape[0], self.attn.shape[-1], self.attn.device, where
        )
        if self.attn_precision is not None and self.attn_precision not in ROW_SUM_TOLERANCE:
            raise ValueError(
                f"{where}: expected attn_precision to be one of {sorted(map(str, ROW_SUM_TOLERANCE))} or None, "
                f"got {self.attn_precision}"
            )
        if self.attn_precision is not None and not _coarser(self.attn_precision, self.attn.dtype):
            self.attn_precision = None  # held at least as coarsely as computed: nothing to renormalise
        if not self.holds_patterns:  # a softmax in float64 when read, its rows checked then
            self.attn_precision = None
        elif self.token_mask is None:
            check_row_stochastic(self.attn, where, precision=self.attn_precision)
        else:
            for group in masking.mask_groups(self.token_mask):
                restricted_attention(self.attn, group, where, precision=self.attn_precision)
        if self.attn_precision is not None:
            self.attn = renormalise_rows(self.attn, self.token_mask)
        layers, heads = self.attn.shape[1], self.attn.shape[2]
        if self.w_v.shape[:2] != (layers, heads) or self.w_o.shape[:2] != (layers, heads):
            raise ValueError(
                f"pathkernels.AttentionStack: attn {list(self.attn.shape)} has {layers} layers and {heads} heads, "
                f"but w_v is {list(self.w_v.shape)} and w_o is {list(self.w_o.shape)}"
            )

    @property
    def holds_patterns(self) -> bool:
        """Whether ``attn`` holds the patterns (False: a capture with ``patterns="recomputed"``,
        whose :class:`~pathkernels.adapters.capture.RecomputedPatterns` recomputes a layer's when
        read through ``residual_capture.patterns``)."""
        return not isinstance(self.attn, RecomputedPatterns)

    @property
    def computed_in(self) -> torch.dtype:
        """The dtype the model computed its patterns in (held patterns: their own, or the coarser
        ``attn_precision``)."""
        if not self.holds_patterns:
            return self.attn.computed_in
        return self.attn_precision or self.attn.dtype

    @property
    def num_layers(self) -> int:
        return self.attn.shape[1]

    @property
    def num_heads(self) -> int:
        return self.attn.shape[2]

    @property
    def d_model(self) -> int:
        return self.w_v.shape[2]

    @property
    def d_head(self) -> int:
        return self.w_v.shape[3]

    @property
    def batch_size(self) -> int:
        return self.attn.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.attn.shape[-1]

    def __repr__(self) -> str:
        hidden = "None" if self.hidden_states is None else str(list(self.hidden_states.shape))
        mask = "None" if self.token_mask is None else f"{int(self.token_mask.sum())} of {self.token_mask.numel()} real"
        return (
            f"AttentionStack(source={self.source or 'the caller'!r},\n"
            f"  attn={list(self.attn.shape)} [B, L, H, n, n], w_v={list(self.w_v.shape)}, w_o={list(self.w_o.shape)}, "
            f"b_o={list(self.b_o.shape)},\n"
            f"  hidden_states={hidden}, token_mask={mask}, dtype={self.attn.dtype}{self._precision_note()}"
            f"{'' if self.holds_patterns else ' (patterns recomputed when read)'}, "
            f"device={self.attn.device})"
        )

    def _precision_note(self) -> str:
        if self.attn_precision is None:
            return ""
        return f" (softmax computed in {self.attn_precision}; rows renormalised in {self.attn.dtype})"

    def head_labels(self) -> list[str]:
        """``["L0H0", "L0H1", …]``: TransformerLens's labels, layer-major."""
        return [f"L{layer}H{head}" for layer in range(self.num_layers) for head in range(self.num_heads)]

    def w_path(self, path: Sequence[int] | Tensor) -> tuple[Tensor, Tensor]:
        """``W_path = Π_l W_V[l, p_l] W_O[l, p_l]`` (skipped layers left out) as two factors.

        Returns ``(left [d, d_head], right [d_head, d])`` with ``left @ right = W_path``, so
        ``transformer_lens.FactoredMatrix(*stack.w_path(path))`` is the path's factored map. A path
        that skips every layer gives ``(I_d, I_d)``.

        Args:
            path: ``L`` entries, one per layer: a head index, or ``-1`` for skip.
        """
        import numbers  # here, not at the top: this method is the part of the module that checks entries

        where = "pathkernels.AttentionStack.w_path"
        expected = (
            f"expected a path of {self.num_layers} entries, one per layer, each a head in 0..{self.num_heads - 1} "
            "or -1 for skip"
        )
        if isinstance(path, Tensor):
            if path.dtype.is_floating_point or path.dtype.is_complex or path.dtype == torch.bool or path.dim() != 1:
                raise TypeError(f"{where}: {expected} (ints); got a {path.dtype} tensor of shape {list(path.shape)}")
            path = path.tolist()
        elif hasattr(path, "dtype") and hasattr(path, "tolist"):  # a numpy array: its entries, checked below
            path = path.tolist()
        if isinstance(path, (str, bytes)) or not isinstance(path, Sequence):
            raise TypeError(f"{where}: {expected} (ints); got {type(path).__name__} {path!r}"[:300])
        for entry in path:  # 0.5 or True would pass int() as a head
            if isinstance(entry, bool) or not isinstance(entry, numbers.Integral):
                got = f"{list(path)!r}, an entry {type(entry).__name__}"[:200]
                raise TypeError(f"{where}: {expected} (ints); got {got}")
        heads = [int(h) for h in path]
        if len(heads) != self.num_layers or not all(-1 <= h < self.num_heads for h in heads):
            raise ValueError(f"{where}: {expected}; got {heads} ({len(heads)} entries)")
        taken = [(layer, head) for layer, head in enumerate(heads) if head != SKIP]
        if not taken:
            eye = torch.eye(self.d_model, dtype=self.w_v.dtype, device=self.w_v.device)
            return eye, eye
        first_layer, first_head = taken[0]
        right = self.w_o[first_layer, first_head]
        for layer, head in taken[1:]:
            right = right @ self.w_v[layer, head] @ self.w_o[layer, head]
        return self.w_v[first_layer, first_head], right

    def residual_stream(self, layer: int = 0) -> Tensor:
        """``hidden_states[layer]``, ``[B, n, d]``: the input X of a path decomposition."""
        if self.hidden_states is None:
            raise ValueError(f"pathkernels.AttentionStack: {self.source or 'this stack'} holds no hidden states")
        return self.hidden_states[layer]

    def path_residuals(self, tree: PathTree, *, x: Tensor | None = None, **kwargs) -> PathResiduals:
        """:func:`pathkernels.path_residuals` on this stack: attention products without ``x``,
        path outputs ``P_p X W_p`` with ``x [B, n, d]`` (e.g. ``stack.residual_stream(0)``).
        A padded stack is evaluated on each sequence's real tokens. Path outputs of a model with
        norms and MLPs (``attention_only=False``) warn: they are the attention-only network's."""
        return path_residuals(self, tree, x=x, **kwargs)

    def length_sums(self, x: Tensor | None = None, *, skip: bool = True, biases: bool = True) -> Tensor:
        """:func:`pathkernels.length_sums` from ``x`` (default ``hidden_states[0]``): ``[L+1, B, n, d]``.

        With ``biases`` (the default) each layer's output bias ``b_o`` is a path of its own, so
        that for an attention-only model ``Σ_k S_k`` is its final residual stream; ``biases=False``
        leaves them out. A padded stack is computed on each sequence's real tokens (padded rows 0).
        A stack of a model with LayerNorm and MLPs (``attention_only=False``) warns: the sums are
        those of the attention-only network its attention layers make, not the model's stream.

        With a :attr:`residual_capture`, the sums are instead the model's own, in float64: every
        path from a source (the embedding, a layer's constant rows, an MLP's output) through its
        heads, the norms frozen (docs/DESIGN.md, "Real transformers"), so that ``Σ_k S_k`` is the
        stream the blocks leave (before a final norm); padded rows are 0. ``x``, ``skip=False``
        and ``biases=False`` do not apply there.
        """
        where = "pathkernels.AttentionStack.length_sums"
        skip, biases = check_flag(skip, "skip", where), check_flag(biases, "biases", where)
        if self.residual_capture is not None:
            return self._model_length_sums(x, skip, biases)
        if self.attention_only is False:
            warnings.warn(
                f"pathkernels.AttentionStack.length_sums: {self.source or 'this model'} has LayerNorm and MLPs, "
                "which these sums leave out: they describe the attention-only network of its attention layers "
                "(patterns and value-output maps as captured), not the model's residual stream",
                UserWarning,
                stacklevel=2,
            )
        return length_sums(
            self.attn,
            self.residual_stream(0) if x is None else x,
            self.w_v,
            self.w_o,
            b_o=self.b_o if biases else None,
            skip=skip,
            token_mask=self.token_mask,
        )

    def path_sum(self) -> Tensor:
        """The sum of every path of the captured model (a stack with a :attr:`residual_capture`):
        ``Σ_k S_k`` of :meth:`length_sums`, ``[B, n, d]`` float64, by one stream through the frozen
        recurrence (L times fewer products than the sums by length). It is the stream the blocks
        leave (before a final norm) wherever the capture reproduces the model; padded rows are 0."""
        if self.residual_capture is None:
            raise ValueError(
                "pathkernels.AttentionStack.path_sum: expected a stack with a residual_capture "
                "(pk.adapters.capture_huggingface_residual); an attention-only stack's total is length_sums().sum(0)"
            )
        return self._model_length_sums(None, True, True, collapse=True)[0]

    def _model_length_sums(self, x, skip: bool, biases: bool, collapse: bool = False) -> Tensor:
        """:meth:`length_sums` of the captured model, by the float64 recurrences of
        :mod:`pathkernels.reference` (one pass over the layers, ``O(L H n² d)``: no path is
        enumerated, so no engine is needed)."""
        if x is not None or not skip or not biases:
            raise ValueError(
                "pathkernels.AttentionStack.length_sums: this stack holds the model's captured residual stream, "
                "whose sources are its own embedding, constants and MLP outputs: x, skip=False and biases=False "
                "do not apply"
            )
        capture = self.residual_capture
        device = capture.embedding.device
        real = None if self.token_mask is None else self.token_mask.to(device)
        out_scale = capture.attention_output_scale  # [B, L, n]: an RMSNorm on the attention's output, D'
        batch, _, heads, tokens, _ = self.attn.shape
        buffer = torch.empty(batch, heads, tokens, tokens, dtype=torch.float64, device=device)

        def patterns(layer: int) -> Tensor:  # one layer's in float64 at a time, not L·H·n² float64 at once
            attn = capture.patterns(self.attn, layer=layer, out=buffer)
            if real is not None:  # padded queries' rows may be NaN (a fully masked softmax)
                attn = attn.masked_fill_(~(real[:, None, :, None] & real[:, None, None, :]), 0)
            return attn if out_scale is None else attn.mul_(out_scale[:, layer, None, :, None])  # D' A

        w_v, w_o = self.w_v.to(device), self.w_o.to(device)  # the reference takes each layer's to float64
        biases = (capture.value_bias, capture.output_bias, capture.embedding, capture.mlp_out)
        if out_scale is not None:  # D' · Γ'
            gain = capture.attention_output_weight  # [L, d]
            w_o = w_o * gain[:, None, None, :]  # W_O Γ'
            # D' 1 (b_O ⊙ γ')ᵀ differs by token: it enters with the MLP's output, b_O itself as 0.
            mlp_out = _WithTokenBias(capture.mlp_out, out_scale, capture.output_bias * gain)
            biases = (capture.value_bias, torch.zeros_like(capture.output_bias), capture.embedding, mlp_out)
        if capture.layout == "post":
            norms = (capture.norm_scale, capture.norm_weight, capture.norm_bias)
            reference = post_ln_length_sums_ref
        else:  # pre-norm: the norm before the attention; the MLP's output is a source
            norms = (capture.norm_scale[:, :, 0], capture.norm_weight[:, 0], capture.norm_bias[:, 0])
            reference = pre_ln_length_sums_ref
        sums = reference(patterns, *norms, w_v, w_o, *biases, centred=capture.centred, collapse=collapse)
        if self.token_mask is not None:
            sums = sums * self.token_mask.to(sums.device)[None, :, :, None]
        return sums

    def to(self, *args, **kwargs) -> AttentionStack:
        """A copy with every tensor moved or cast like ``Tensor.to``.

        A cast to a finer dtype keeps the precision the patterns were computed in as
        ``attn_precision``, so their rows are renormalised in the new dtype: float32 patterns cast
        to float64 sum to 1 only to ~1e-7, and the centring identity needs row sums of 1 to the new
        precision.
        """
        hidden = None if self.hidden_states is None else self.hidden_states.to(*args, **kwargs)
        attn = self.attn.to(*args, **kwargs)
        mask = None if self.token_mask is None else self.token_mask.to(device=attn.device)
        return replace(
            self,
            attn=attn,
            w_v=self.w_v.to(*args, **kwargs),
            w_o=self.w_o.to(*args, **kwargs),
            b_o=self.b_o.to(*args, **kwargs),
            hidden_states=hidden,
            token_mask=mask,
            attn_precision=self.attn_precision or self.attn.dtype,  # kept only where coarser than the new dtype
            residual_capture=None if self.residual_capture is None else self.residual_capture.on(attn.device),
        )


class _WithTokenBias:
    """The MLP outputs ``[B, L, n, d]`` plus a bias that differs by token, ``D'_l 1 (b ⊙ γ')ᵀ``
    (``scale [B, L, n]``, ``bias [L, d]``), one layer at a time as the reference reads them
    (``[:, layer]``), not a second ``[B, L, n, d]`` float64 copy (2 GB at Gemma-2-2B's shape and
    4,096 tokens)."""

    def __init__(self, mlp_out: Tensor, scale: Tensor, bias: Tensor):
        self.mlp_out, self.scale, self.bias = mlp_out, scale, bias

    def __getitem__(self, index: tuple) -> Tensor:
        rows, layer = index
        return self.mlp_out[rows, layer] + self.scale[rows, layer, :, None] * self.bias[layer]


def _coarser(computed_in: torch.dtype, held_in: torch.dtype) -> bool:
    """Whether patterns computed in one dtype and held in another sum to 1 only to the first's
    precision (a float32 softmax in a float64 model)."""
    return torch.finfo(computed_in).eps > torch.finfo(held_in).eps


def fold_value_bias(b_v: Tensor | None, w_o: Tensor, b_o: Tensor | None) -> Tensor:
    """``b_O + Σ_h b_V[h] W_O[h]``: b_v ``[H, d_head]`` (or None), w_o ``[H, d_head, d]`` -> ``[d]``."""
    folded = torch.zeros(w_o.shape[-1], dtype=w_o.dtype, device=w_o.device) if b_o is None else b_o.clone()
    if b_v is not None:
        folded = folded + torch.einsum("he,hed->d", b_v, w_o)
    return folded
