"""What a real transformer's residual stream holds beyond its attention (issue 24, in progress).

With every normalisation scale frozen at its value in one forward pass, a pre-LN transformer's
residual stream is an exact sum of paths: a source (the embedding, a layer's constant, an MLP's
output) followed by a chain of heads, each a token map ``A D`` and a feature map ``C Γ W_V W_O``
(docs/DESIGN.md, "Real transformers"). :func:`capture_huggingface_residual` reads, from the very
forward pass that gives the attention stack, what those terms need that the stack does not hold.
So far: GPT-2 (pre-LN, LayerNorm); other families are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from pathkernels.adapters.huggingface import _blocks, from_huggingface
from pathkernels.adapters.stack import AttentionStack

_WHERE = "pathkernels.adapters.capture_huggingface_residual"


@dataclass
class ResidualStreamCapture:
    """One forward pass of a pre-LN transformer, in float64, its norms frozen.

    ``embedding`` ``[B, n, d]``: the stream entering block 0 (token and position embeddings).
    ``norm_scale`` ``[B, L, n]``: ``1/σ_t`` of each block's attention-input norm, per token.
    ``norm_weight``, ``norm_bias`` ``[L, d]``: its γ and β. ``mlp_out`` ``[B, L, n, d]``: each MLP's
    output as computed. ``residual`` ``[B, n, d]``: the stream entering the final norm, whose
    ``final_scale`` ``[B, n]``, ``final_weight`` and ``final_bias`` ``[d]`` are kept for readouts.
    """

    embedding: Tensor
    norm_scale: Tensor
    norm_weight: Tensor
    norm_bias: Tensor
    mlp_out: Tensor
    residual: Tensor
    final_scale: Tensor
    final_weight: Tensor
    final_bias: Tensor


def _inverse_scale(x: Tensor, norm: nn.LayerNorm) -> Tensor:
    """``1/σ_t`` ``[B, n]`` of LayerNorm ``norm`` on its input ``x`` ``[B, n, d]``, in float64:
    ``σ_t = sqrt(var_t + ε)``, the biased variance over the features, as LayerNorm takes it."""
    x = x.double()
    return torch.rsqrt(x.var(-1, unbiased=False) + norm.eps)


def capture_huggingface_residual(model: nn.Module, **inputs) -> tuple[AttentionStack, ResidualStreamCapture]:
    """The attention stack of :func:`from_huggingface` and, from the same forward pass, what the
    real model's residual stream needs beyond it (:class:`ResidualStreamCapture`), in float64.

    Only GPT-2 so far (pre-LN with LayerNorm). A block computes
    ``x + Attn(LN₁(x))`` then ``+ MLP(LN₂(·))``; frozen, ``LN₁(x) = D x C Γ + 1 βᵀ`` with
    ``D = diag(norm_scale)``, so the attention sublayer is a sum of heads ``(A D) x (C Γ W_V W_O)``
    plus constant rows, and the MLP's output enters as a source.
    """
    if getattr(getattr(model, "config", None), "model_type", None) != "gpt2":
        kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ValueError(f"{_WHERE}: only GPT-2 models are captured so far, got {kind!r}")
    blocks = _blocks(model, "h")
    final_norm = model.base_model.ln_f
    seen: dict[str, list] = {"norm_in": [None] * len(blocks), "mlp_out": [None] * len(blocks), "final_in": [None]}

    def keep(name: str, index: int, output: bool):
        def hook(module, args, result=None):
            seen[name][index] = (result if output else args[0]).detach()

        return hook

    handles = []
    for i, block in enumerate(blocks):
        handles.append(block.ln_1.register_forward_pre_hook(keep("norm_in", i, output=False)))
        handles.append(block.mlp.register_forward_hook(keep("mlp_out", i, output=True)))
    handles.append(final_norm.register_forward_pre_hook(keep("final_in", 0, output=False)))
    try:
        stack = from_huggingface(model, **inputs)
    finally:
        for handle in handles:
            handle.remove()
    with torch.no_grad():
        capture = ResidualStreamCapture(
            embedding=seen["norm_in"][0].double(),
            norm_scale=torch.stack([_inverse_scale(x, b.ln_1) for x, b in zip(seen["norm_in"], blocks)], dim=1),
            norm_weight=torch.stack([b.ln_1.weight.detach().double() for b in blocks]),
            norm_bias=torch.stack([b.ln_1.bias.detach().double() for b in blocks]),
            mlp_out=torch.stack([m.double() for m in seen["mlp_out"]], dim=1),
            residual=seen["final_in"][0].double(),
            final_scale=_inverse_scale(seen["final_in"][0], final_norm),
            final_weight=final_norm.weight.detach().double(),
            final_bias=final_norm.bias.detach().double(),
        )
    return stack, capture
