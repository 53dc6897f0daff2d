"""AttentionStack: what the adapters extract from a model, in the engine's layout."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from pathkernels.engine import (
    PathResiduals,
    check_row_stochastic,
    length_sums,
    path_residuals,
)
from pathkernels.paths import SKIP, PathTree


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

    Raises:
        ValueError: at construction, if an attention row does not sum to 1 (to the dtype's precision).
    """

    attn: Tensor
    w_v: Tensor
    w_o: Tensor
    b_o: Tensor
    hidden_states: Tensor | None = None
    source: str = ""

    def __post_init__(self):
        check_row_stochastic(self.attn, f"pathkernels.AttentionStack from {self.source or 'the caller'}")
        layers, heads = self.attn.shape[1], self.attn.shape[2]
        if self.w_v.shape[:2] != (layers, heads) or self.w_o.shape[:2] != (layers, heads):
            raise ValueError(
                f"pathkernels.AttentionStack: attn {list(self.attn.shape)} has {layers} layers and {heads} heads, "
                f"but w_v is {list(self.w_v.shape)} and w_o is {list(self.w_o.shape)}"
            )

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

    def head_labels(self) -> list[str]:
        """``["L0H0", "L0H1", …]``: TransformerLens's labels, layer-major."""
        return [f"L{layer}H{head}" for layer in range(self.num_layers) for head in range(self.num_heads)]

    def w_path(self, path: Sequence[int] | Tensor) -> tuple[Tensor, Tensor]:
        """``W_path = Π_l W_V[l, p_l] W_O[l, p_l]`` (skipped layers left out) as two factors.

        Returns ``(left [d, d_head], right [d_head, d])`` with ``left @ right = W_path``, so
        ``transformer_lens.FactoredMatrix(*stack.w_path(path))`` is the path's factored map. A path
        that skips every layer gives ``(I_d, I_d)``.

        Args:
            path: ``L`` head indices, ``-1`` for skip.
        """
        heads = [int(h) for h in (path.tolist() if isinstance(path, Tensor) else path)]
        if len(heads) != self.num_layers or not all(-1 <= h < self.num_heads for h in heads):
            raise ValueError(
                f"pathkernels.AttentionStack.w_path: expected {self.num_layers} heads in [-1, {self.num_heads}), "
                f"got {heads}"
            )
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
        path outputs ``P_p X W_p`` with ``x [B, n, d]`` (e.g. ``stack.residual_stream(0)``)."""
        if x is None:
            return path_residuals(self.attn, tree, **kwargs)
        return path_residuals(self.attn, tree, x=x, w_v=self.w_v, w_o=self.w_o, **kwargs)

    def length_sums(self, x: Tensor | None = None, *, skip: bool = True) -> Tensor:
        """:func:`pathkernels.length_sums` from ``x`` (default ``hidden_states[0]``): ``[L+1, B, n, d]``."""
        return length_sums(self.attn, self.residual_stream(0) if x is None else x, self.w_v, self.w_o, skip=skip)

    def to(self, *args, **kwargs) -> AttentionStack:
        """A copy with every tensor moved or cast like ``Tensor.to``.

        A cast renormalises the attention rows in the new dtype: float32 patterns cast to float64
        sum to 1 only to ~1e-7, and the centring identity needs row sums of 1 to the new precision.
        """
        hidden = None if self.hidden_states is None else self.hidden_states.to(*args, **kwargs)
        attn = self.attn.to(*args, **kwargs)
        if attn.dtype != self.attn.dtype:
            attn = attn / attn.sum(-1, keepdim=True)
        return replace(self, attn=attn, w_v=self.w_v.to(*args, **kwargs),
                       w_o=self.w_o.to(*args, **kwargs), b_o=self.b_o.to(*args, **kwargs), hidden_states=hidden)


def fold_value_bias(b_v: Tensor | None, w_o: Tensor, b_o: Tensor | None) -> Tensor:
    """``b_O + Σ_h b_V[h] W_O[h]``: b_v ``[H, d_head]`` (or None), w_o ``[H, d_head, d]`` -> ``[d]``."""
    folded = torch.zeros(w_o.shape[-1], dtype=w_o.dtype, device=w_o.device) if b_o is None else b_o.clone()
    if b_v is not None:
        folded = folded + torch.einsum("he,hed->d", b_v, w_o)
    return folded
