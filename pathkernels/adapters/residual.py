"""What a real transformer's residual stream holds beyond its attention (issue 24, in progress).

With every normalisation scale frozen at its value in one forward pass, a pre-LN transformer's
residual stream is an exact sum of paths: a source (the embedding, a layer's constant, an MLP's
output) followed by a chain of heads, each a token map ``A D`` and a feature map ``C Γ W_V W_O``
(docs/DESIGN.md, "Real transformers"); so is a post-LN one's, each branch scaled by the norm
after it. :func:`capture_huggingface_residual` reads, from the very forward pass that gives the
attention stack, what those terms need that the stack does not hold. So far: GPT-2 (pre-LN) and
BERT (post-LN), both with LayerNorm; other families are refused by name.
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
    """One forward pass of a transformer, in float64, its norms frozen.

    ``layout``: ``"pre"`` (GPT-2: each sublayer reads a normalised copy of the stream, which it adds
    to) or ``"post"`` (BERT: the stream itself is normalised after each sublayer's sum).
    ``embedding`` ``[B, n, d]``: the stream entering block 0. ``norm_scale`` ``[B, L, 2, n]``: ``1/σ_t``
    of each block's two LayerNorms, per token (pre: before attention, before the MLP; post: after
    each), with their γ and β in ``norm_weight``, ``norm_bias`` ``[L, 2, d]``. ``mlp_out``
    ``[B, L, n, d]``: each MLP's output as computed (post: before its residual sum). ``residual``
    ``[B, n, d]``: the stream the blocks leave (pre: entering the final norm, whose
    ``final_scale`` ``[B, n]``, ``final_weight`` and ``final_bias`` ``[d]`` are kept for readouts;
    post: the last hidden state, and no final norm).
    """

    layout: str
    embedding: Tensor
    norm_scale: Tensor
    norm_weight: Tensor
    norm_bias: Tensor
    mlp_out: Tensor
    residual: Tensor
    final_scale: Tensor | None = None
    final_weight: Tensor | None = None
    final_bias: Tensor | None = None

    def on(self, device) -> ResidualStreamCapture:
        """A copy on ``device`` (float64 throughout, whatever the stack's dtype)."""
        return ResidualStreamCapture(**{k: v.to(device) if isinstance(v, Tensor) else v for k, v in vars(self).items()})


def _inverse_scale(x: Tensor, norm: nn.LayerNorm) -> Tensor:
    """``1/σ_t`` ``[B, n]`` of LayerNorm ``norm`` on its input ``x`` ``[B, n, d]``, in float64:
    ``σ_t = sqrt(var_t + ε)``, the biased variance over the features, as LayerNorm takes it."""
    x = x.double()
    return torch.rsqrt(x.var(-1, unbiased=False) + norm.eps)


# Per family: (layout, the blocks' list, each block's two LayerNorms, its MLP's output module).
_LAYOUTS = {
    "gpt2": ("pre", "h", lambda b: (b.ln_1, b.ln_2), lambda b: b.mlp),
    "bert": (
        "post",
        "encoder.layer",
        lambda b: (b.attention.output.LayerNorm, b.output.LayerNorm),
        lambda b: b.output.dense,
    ),
}


def capture_huggingface_residual(model: nn.Module, **inputs) -> tuple[AttentionStack, ResidualStreamCapture]:
    """The attention stack of :func:`from_huggingface` and, from the same forward pass, what the
    real model's residual stream needs beyond it (:class:`ResidualStreamCapture`), in float64.

    GPT-2 (pre-LN): a block computes ``x + Attn(LN₁(x))`` then ``+ MLP(LN₂(·))``; frozen,
    ``LN₁(x) = D x C Γ + 1 βᵀ`` with ``D = diag(1/σ)``, so the attention sublayer is a sum of heads
    ``(A D) x (C Γ W_V W_O)`` plus constant rows, and the MLP's output enters as a source.
    BERT (post-LN): ``LN₁(x + Attn(x))`` then ``LN₂(· + MLP(·))``; every branch, the skip included,
    is then scaled by ``D`` on the left and ``C Γ`` on the right (docs/DESIGN.md, "Real transformers").
    Other families are refused by name.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in _LAYOUTS:
        kind = model_type or type(model).__name__
        raise ValueError(f"{_WHERE}: only GPT-2 and BERT models are captured so far, got {kind!r}")
    layout, blocks_path, norms_of, mlp_of = _LAYOUTS[model_type]
    blocks = _blocks(model, blocks_path)
    count = len(blocks)
    seen: dict[str, list] = {"norm_in": [None] * (2 * count), "mlp_out": [None] * count, "final_in": [None]}

    def keep(name: str, index: int, output: bool):
        def hook(module, args, result=None):
            seen[name][index] = (result if output else args[0]).detach()

        return hook

    handles = []
    for i, block in enumerate(blocks):
        for j, norm in enumerate(norms_of(block)):
            handles.append(norm.register_forward_pre_hook(keep("norm_in", 2 * i + j, output=False)))
        handles.append(mlp_of(block).register_forward_hook(keep("mlp_out", i, output=True)))
    final_norm = model.base_model.ln_f if layout == "pre" else None
    if final_norm is not None:
        handles.append(final_norm.register_forward_pre_hook(keep("final_in", 0, output=False)))
    try:
        stack = from_huggingface(model, **inputs)
    finally:
        for handle in handles:
            handle.remove()
    norms = [norm for block in blocks for norm in norms_of(block)]
    with torch.no_grad():
        batch, tokens = stack.attn.shape[0], stack.attn.shape[-1]
        scales = torch.stack([_inverse_scale(x, norm) for x, norm in zip(seen["norm_in"], norms)], dim=1)
        final = {}
        if final_norm is not None:
            final = {
                "final_scale": _inverse_scale(seen["final_in"][0], final_norm),
                "final_weight": final_norm.weight.detach().double(),
                "final_bias": final_norm.bias.detach().double(),
            }
        capture = ResidualStreamCapture(
            layout=layout,
            embedding=stack.hidden_states[0].double(),
            norm_scale=scales.reshape(batch, count, 2, tokens),
            norm_weight=torch.stack([n.weight.detach().double() for n in norms]).reshape(count, 2, -1),
            norm_bias=torch.stack([n.bias.detach().double() for n in norms]).reshape(count, 2, -1),
            mlp_out=torch.stack([m.double() for m in seen["mlp_out"]], dim=1),
            residual=(seen["final_in"][0] if final_norm is not None else stack.hidden_states[-1]).double(),
            **final,
        )
    stack.residual_capture = capture
    return stack, capture
