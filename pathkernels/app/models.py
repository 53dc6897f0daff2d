"""Reference models: a small transformer family with switches for skip connections, MLPs and LayerNorm.

``SelfAttentionNetwork(skip=False, mlp=False, layer_norm=False)`` is the paper's pure
self-attention network (SAN); switching the parts on gives the comparison of Dong, Cordonnier &
Loukas (2021): pure attention, +MLP, +skip, and the full (post-LayerNorm) transformer. Every
forward pass can return the hidden states and the attention patterns, and
:meth:`SelfAttentionNetwork.attention_stack` hands them to the path engine with the per-head
value-output maps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from pathkernels.adapters.stack import AttentionStack

VARIANTS: dict[str, dict[str, bool]] = {
    "pure attention": {"skip": False, "mlp": False, "layer_norm": False},
    "+MLP": {"skip": False, "mlp": True, "layer_norm": False},
    "+skip": {"skip": True, "mlp": False, "layer_norm": False},
    "transformer": {"skip": True, "mlp": True, "layer_norm": True},
}


@dataclass
class NetworkOutput:
    """``output [B, n, d]``, ``hidden_states [L+1, B, n, d]`` (input first) and ``attn [B, L, H, n, n]``."""

    output: Tensor
    hidden_states: Tensor
    attn: Tensor


class MultiHeadAttention(nn.Module):
    """``Σ_h softmax(X W_Q[h] (X W_K[h])ᵀ / √d_head + mask) X W_V[h] W_O[h] + b_O``.

    Weights are stored per head: ``w_q``, ``w_k``, ``w_v`` ``[H, d, d_head]``, ``w_o`` ``[H, d_head, d]``.
    """

    def __init__(
        self, d_model: int, num_heads: int, *, d_head: int | None = None, bias: bool = True, causal: bool = False
    ):
        super().__init__()
        d_head = d_head or d_model // num_heads
        self.num_heads, self.d_head, self.causal = num_heads, d_head, causal
        scale = 1 / math.sqrt(d_model)
        self.w_q = nn.Parameter(torch.randn(num_heads, d_model, d_head) * scale)
        self.w_k = nn.Parameter(torch.randn(num_heads, d_model, d_head) * scale)
        self.w_v = nn.Parameter(torch.randn(num_heads, d_model, d_head) * scale)
        self.w_o = nn.Parameter(torch.randn(num_heads, d_head, d_model) / math.sqrt(num_heads * d_head))
        self.b_o = nn.Parameter(torch.zeros(d_model)) if bias else None

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``x [B, n, d] -> (out [B, n, d], attn [B, H, n, n])``."""
        q = torch.einsum("bnd,hde->bhne", x, self.w_q)
        k = torch.einsum("bnd,hde->bhne", x, self.w_k)
        v = torch.einsum("bnd,hde->bhne", x, self.w_v)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.d_head)
        if self.causal:
            n = x.shape[1]
            future = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        attn = scores.softmax(dim=-1)
        out = torch.einsum("bhne,hed->bnd", attn @ v, self.w_o)
        return (out if self.b_o is None else out + self.b_o), attn


class SelfAttentionNetwork(nn.Module):
    """L layers of multi-head self-attention, each optionally with a skip connection, an MLP and
    post-LayerNorm (as in the original transformer):

    ``Y = MHA(X)``; ``X' = X + Y`` with skip, else ``Y``; then ``LN`` if layer_norm; with mlp,
    ``Z = MLP(X')`` and ``X'' = X' + Z`` with skip, else ``Z``, then ``LN`` again if layer_norm.

    Args:
        d_model, num_heads, num_layers: width, heads per layer, depth.
        skip, mlp, layer_norm: the switches (``VARIANTS`` names the paper's four combinations).
        d_mlp: MLP hidden width (default ``4·d_model``); bias: biases in attention outputs and MLPs;
        causal: mask future tokens.

    Shape:
        ``x [B, n, d] -> NetworkOutput(output [B, n, d], hidden_states [L+1, B, n, d], attn [B, L, H, n, n])``.
    """

    def __init__(
        self,
        d_model: int = 64,
        num_heads: int = 4,
        num_layers: int = 6,
        *,
        skip: bool = False,
        mlp: bool = False,
        layer_norm: bool = False,
        d_mlp: int | None = None,
        bias: bool = True,
        causal: bool = False,
    ):
        super().__init__()
        self.skip, self.use_mlp, self.use_layer_norm = skip, mlp, layer_norm
        self.attention = nn.ModuleList(
            MultiHeadAttention(d_model, num_heads, bias=bias, causal=causal) for _ in range(num_layers)
        )
        d_mlp = d_mlp or 4 * d_model
        self.mlps = nn.ModuleList(
            nn.Sequential(nn.Linear(d_model, d_mlp, bias=bias), nn.ReLU(), nn.Linear(d_mlp, d_model, bias=bias))
            for _ in range(num_layers if mlp else 0)
        )
        norms = 2 * num_layers if layer_norm else 0
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(norms))

    @classmethod
    def variant(cls, name: str, **kwargs) -> SelfAttentionNetwork:
        """One of ``VARIANTS``: ``"pure attention"``, ``"+MLP"``, ``"+skip"`` or ``"transformer"``."""
        if name not in VARIANTS:
            raise ValueError(f"pathkernels.models: expected a variant in {list(VARIANTS)}, got {name!r}")
        return cls(**VARIANTS[name], **kwargs)

    def _sublayer(self, x: Tensor, y: Tensor, norm_index: int) -> Tensor:
        x = x + y if self.skip else y
        return self.norms[norm_index](x) if self.use_layer_norm else x

    def forward(self, x: Tensor) -> NetworkOutput:
        if x.dim() != 3:
            raise ValueError(
                f"pathkernels.models.SelfAttentionNetwork: expected x [B, n, d], got shape {list(x.shape)}"
            )
        hidden, patterns = [x], []
        for layer, attention in enumerate(self.attention):
            y, attn = attention(x)
            patterns.append(attn)
            x = self._sublayer(x, y, 2 * layer)
            if self.use_mlp:
                x = self._sublayer(x, self.mlps[layer](x), 2 * layer + 1)
            hidden.append(x)
        return NetworkOutput(x, torch.stack(hidden), torch.stack(patterns, dim=1))

    def attention_stack(self, result: NetworkOutput) -> AttentionStack:
        """The engine's view of a forward pass: patterns, ``W_V``/``W_O`` per head, output biases."""
        w_v = torch.stack([a.w_v for a in self.attention]).detach()
        w_o = torch.stack([a.w_o for a in self.attention]).detach()
        zeros = torch.zeros(w_o.shape[-1], dtype=w_o.dtype, device=w_o.device)
        b_o = torch.stack([zeros if a.b_o is None else a.b_o.detach() for a in self.attention])
        return AttentionStack(
            attn=result.attn.detach(),
            w_v=w_v,
            w_o=w_o,
            b_o=b_o,
            hidden_states=result.hidden_states.detach(),
            source="pathkernels.models",
        )
