"""Float64 means float64: the steps a Hugging Face or TransformerLens model computes in float32
whatever its dtype (the attention softmax, RMSNorms), computed in float64 during a float64 model's
capture, so that it is decomposed at float64 precision."""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch
from torch import Tensor, nn


@contextmanager
def in_float64(model: nn.Module):
    """Within the block, a float64 ``model``'s forward pass computes in float64 the steps that its
    code rounds to float32: the attention softmax (:func:`softmax_in_input_precision`), GPT-J's
    attention scores, its RMSNorms (:func:`rms_norm_in_float64` on :func:`float32_rms_norms`) and
    OLMo's LayerNorms (:func:`layer_norm_in_float64`). A float32 model is unchanged."""
    # First among the norms' forward hooks, so that every other hook sees the float64 output.
    handles = [norm.register_forward_hook(rms_norm_in_float64, prepend=True) for norm in float32_rms_norms(model)]
    handles += [
        norm.register_forward_hook(layer_norm_in_float64, prepend=True)
        for norm in model.modules()
        if type(norm).__name__ == "OlmoLayerNorm"
    ]
    try:
        with softmax_in_input_precision(), _scores_in_input_precision():
            yield
    finally:
        for handle in handles:
            handle.remove()


def _gptj_attention_in_input_precision(original):
    """GPT-J's eager attention, which rounds the queries and keys to float32 "to avoid overflow",
    without that rounding for float64 inputs (the same steps otherwise)."""

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        if query.dtype != torch.float64:
            return original(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        weights = torch.matmul(query, key.transpose(2, 3)) * scaling
        if attention_mask is not None:
            weights = weights + attention_mask
        weights = torch.nn.functional.softmax(weights, dim=-1).to(value.dtype)
        weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
        return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights

    return attention


# Hugging Face modules whose eager attention rounds a float64 model's scores to float32, and the
# replacement that keeps them in the input's precision.
_FLOAT32_SCORES = {"transformers.models.gptj.modeling_gptj": _gptj_attention_in_input_precision}


@contextmanager
def _scores_in_input_precision():
    """Within the block, the eager attention of :data:`_FLOAT32_SCORES`'s modules keeps float64
    scores in float64 (process-wide, restored after)."""
    swapped = []
    for name, replacement in _FLOAT32_SCORES.items():
        module = sys.modules.get(name)
        original = getattr(module, "eager_attention_forward", None)
        if original is not None:
            module.eager_attention_forward = replacement(original)
            swapped.append((module, original))
    try:
        yield
    finally:
        for module, original in swapped:
            module.eager_attention_forward = original


@contextmanager
def softmax_in_input_precision():
    """Within the block, ``torch.nn.functional.softmax(x, dtype=torch.float32)`` of a float64 ``x``
    computes in float64.

    Most Hugging Face families (Llama, Gemma, Qwen, GPT-NeoX, OPT, ViT, …) take the attention
    softmax in float32 whatever the model's dtype, so a float64 model's patterns would carry float32
    roundings (rows summing to 1 only to ~1e-7). A float64 model is decomposed at float64
    precision: its patterns are computed from its float64 scores in float64. The replacement is
    process-wide while the block runs (the model's forward pass), and restored after."""
    original = torch.nn.functional.softmax

    def softmax(input, dim=None, _stacklevel=3, dtype=None):  # noqa: A002 (torch's own argument name)
        if dtype == torch.float32 and isinstance(input, Tensor) and input.dtype == torch.float64:
            dtype = torch.float64
        return original(input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)

    torch.nn.functional.softmax = softmax
    try:
        yield
    finally:
        torch.nn.functional.softmax = original


def rms_norm_in_float64(module: nn.Module, args: tuple, output: Tensor) -> Tensor | None:
    """A forward hook that computes an RMSNorm in float64 when its input is float64.

    Hugging Face's RMSNorms (Llama's, Gemma's, …) and TransformerLens 4.x's native ones round their
    input to float32 whatever the model's dtype, so a float64 model's stream would hold float32
    roundings that no frozen linear map reproduces (~1e-7 relative); the capture's forward pass
    computes ``γ ⊙ x / sqrt(mean(x²) + ε)`` (no γ in a parameter-free one) in float64 instead."""
    x = args[0]
    if x.dtype != torch.float64:
        return None
    normalised = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm_eps(module))
    gain = rms_gain(module)
    return normalised if gain is None else gain.to(normalised.dtype) * normalised


# Norms whose ε is fixed in their code, not held as an attribute.
_FIXED_EPS = {"OlmoLayerNorm": 1e-5}


def norm_eps(module: nn.Module) -> float:
    """The ε a norm module adds to its variance or mean square."""
    for name in ("variance_epsilon", "eps"):
        if hasattr(module, name):
            return float(getattr(module, name))
    if type(module).__name__ in _FIXED_EPS:
        return _FIXED_EPS[type(module).__name__]
    raise ValueError(f"pathkernels.adapters: cannot tell the epsilon of the norm {type(module).__name__}")


def layer_norm_in_float64(module: nn.Module, args: tuple, output: Tensor) -> Tensor | None:
    """A forward hook that computes a parameter-free LayerNorm (OLMo's, which rounds its input to
    float32) in float64 when its input is float64."""
    x = args[0]
    if x.dtype != torch.float64:
        return None
    return torch.nn.functional.layer_norm(x, x.shape[-1:], None, None, eps=norm_eps(module))


def rms_gain(module: nn.Module) -> Tensor | None:
    """The gain ``γ`` ``[d]`` of an RMSNorm module, ``y = γ ⊙ x / sqrt(mean(x²) + ε)``, in float64 (None
    for a parameter-free one). Gemma-style norms store ``γ − 1`` as their weight and compute
    ``(1 + w)``; which convention a module follows is read from its own output on a constant input,
    where ``x / sqrt(mean(x²) + ε)`` is ``1 / sqrt(1 + ε)`` in every feature."""
    weight = getattr(module, "weight", None)
    if weight is None:
        return None
    w = weight.detach().double()
    probe = torch.ones(1, w.shape[-1], dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        seen = module.forward(probe).double()[0] * (1 + norm_eps(module)) ** 0.5  # forward: no hooks
    offset = bool((seen - (w + 1)).abs().max() < (seen - w).abs().max())
    return w + 1 if offset else w


def float32_rms_norms(model: nn.Module) -> list[nn.Module]:
    """The RMSNorms of a model that compute in float32 whatever its dtype: Hugging Face's (Llama's
    ``variance_epsilon`` ones, Gemma's ``eps`` ones) and TransformerLens 4.x's native ones (a
    HookedTransformer's own RMSNorms compute in the model's dtype)."""
    return [
        module
        for module in model.modules()
        if type(module).__name__ in ("NativeRMSNorm", "NativeRMSNormPre")
        or (
            type(module).__name__.endswith("RMSNorm")
            and type(module).__module__.startswith("transformers.")
            and (hasattr(module, "variance_epsilon") or hasattr(module, "eps"))
        )
    ]
