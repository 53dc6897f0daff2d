"""Float64 means float64: the steps a Hugging Face or TransformerLens model computes in float32
whatever its dtype (the attention softmax, RMSNorms, rotary angles, Gemma's embedding scale),
computed in float64 during a float64 model's capture, so that it is decomposed at float64 precision."""

from __future__ import annotations

import math
import sys
import warnings
from contextlib import ExitStack, contextmanager

import torch
from torch import Tensor, nn


@contextmanager
def in_float64(model: nn.Module):
    """Within the block, a float64 ``model``'s forward pass computes in float64 the steps that its
    code rounds to float32: the attention softmax (:func:`softmax_in_input_precision`), GPT-J's
    attention scores, its RMSNorms (:func:`rms_norm_in_float64` on :func:`float32_rms_norms`),
    OLMo's LayerNorms (:func:`layer_norm_in_float64`), the rotary angles and their cosines and sines
    (:func:`rotary_in_float64`) and Gemma's embedding scale √d (:func:`positions_and_scales_in_float64`).
    A float32 model is unchanged."""
    # First among the norms' forward hooks, so that every other hook sees the float64 output.
    handles = [norm.register_forward_hook(rms_norm_in_float64, prepend=True) for norm in float32_rms_norms(model)]
    handles += [
        norm.register_forward_hook(layer_norm_in_float64, prepend=True)
        for norm in model.modules()
        if type(norm).__name__ == "OlmoLayerNorm"
    ]
    handles += [
        module.register_forward_hook(rotary_in_float64, with_kwargs=True)
        for module in _every_module(model)
        if _is_rotary(module)
    ]
    try:
        with ExitStack() as stack:
            stack.enter_context(softmax_in_input_precision())
            stack.enter_context(_scores_in_input_precision())
            stack.enter_context(positions_and_scales_in_float64(model))
            yield
    finally:
        for handle in handles:
            handle.remove()


# --- rotary positions --------------------------------------------------------------------------
# Hugging Face's rotary modules (Llama's and the families built like it) hold their inverse
# frequencies θ_i as float32 numbers and compute the angles p·θ_i, their cosines and sines in float32
# whatever the model's dtype: a float64 model's queries and keys would carry float32 roundings (up
# to ~1e-6 relative in the logits). In a float64 capture the angles are computed in float64 from θ
# in float64: θ_i = 1 / base^(2i/dim) from the config, scaled as its "linear", "llama3" or "yarn" rope
# type says (``_SCALINGS``), where that formula reproduces the module's own θ to float32's
# rounding; the module's θ otherwise (other scalings: the angles still in float64).


def _every_module(model: nn.Module) -> list[nn.Module]:
    """``model``'s modules and, for a TransformerLens 4.x bridge, those of the Hugging Face model it
    wraps (held outside its module tree: GPT-J's rotary table is reached only there), each once."""
    modules = {id(m): m for m in model.modules()}
    original = model.__dict__.get("original_model")
    if isinstance(original, nn.Module):
        modules |= {id(m): m for m in original.modules() if id(m) not in modules}
    return list(modules.values())


def _is_rotary(module: nn.Module) -> bool:
    """A Hugging Face rotary embedding: ``forward(x, position_ids[, layer_type]) -> (cos, sin)``
    from inverse frequencies ``inv_freq`` (or ``<layer_type>_inv_freq``)."""
    name = type(module).__name__
    return (
        name.endswith("RotaryEmbedding")
        and type(module).__module__.startswith("transformers.")
        and any(key.endswith("inv_freq") for key, _ in module.named_buffers(recurse=False))
    )


def _rope_parameters(config, layer_type: str | None) -> dict:
    """The rotary parameters of ``config`` (those of ``layer_type`` where they are per layer type)."""
    parameters = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and isinstance(parameters.get(layer_type), dict):
        parameters = parameters[layer_type]
    return parameters


def exact_inverse_frequencies(module: nn.Module, layer_type: str | None = None) -> Tensor:
    """The rotary module's inverse frequencies θ ``[dim/2]`` in float64: from its config's formula
    where that reproduces the module's own (float32) θ to within 4e-7 relative, else its own θ."""
    prefix = f"{layer_type}_" if layer_type is not None else ""
    held = getattr(module, prefix + "inv_freq").detach().double()
    config = getattr(module, "config", None)
    parameters = _rope_parameters(config, layer_type)
    kind = parameters.get("rope_type", "default")
    base = parameters.get("rope_theta")
    if config is None or base is None or kind not in _SCALINGS:
        _warn_float32_rotary(module, f"its rope type {kind!r} is not one whose θ is computed here")
        return held
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * parameters.get("partial_rotary_factor", 1.0))
    exponents = torch.arange(0, dim, 2, dtype=torch.float64, device=held.device) / dim
    try:
        exact = _SCALINGS[kind](1.0 / float(base) ** exponents, parameters)
    except (KeyError, TypeError, ValueError):  # a parameter missing or malformed: the module's own θ
        _warn_float32_rotary(module, f"its {kind!r} rope parameters are incomplete")
        return held
    if exact.shape != held.shape or not bool(((exact - held).abs() <= 4e-7 * held.abs()).all()):
        _warn_float32_rotary(module, f"the config's {kind!r} formula does not reproduce its θ")
        return held
    return exact


def _warn_float32_rotary(module: nn.Module, why: str) -> None:
    """Say that a float64 capture keeps some of ``module``'s float32 rotary arithmetic, and why."""
    warnings.warn(
        f"pathkernels: {type(module).__name__} of a float64 model: {why}, so its float32 values are kept "
        "and the patterns carry float32's rounding of the rotary angles (~1e-7 relative) instead of float64's",
        UserWarning,
        stacklevel=2,
    )


def _llama3_frequencies(theta: Tensor, parameters: dict) -> Tensor:
    """Llama 3.1's scaling of the inverse frequencies θ (float64): with the wavelength λ = 2π/θ and
    the pretraining context c, θ is kept where λ < c / high_freq_factor, divided by ``factor`` where
    λ > c / low_freq_factor, and in between ``(1 − s) θ / factor + s θ`` with
    ``s = (c / λ − low_freq_factor) / (high_freq_factor − low_freq_factor)`` (continuous at both ends)."""
    factor, low, high = (float(parameters[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
    context = float(parameters["original_max_position_embeddings"])
    wavelength = 2 * math.pi / theta
    smooth = (context / wavelength - low) / (high - low)
    medium = (1 - smooth) * theta / factor + smooth * theta
    scaled = torch.where(wavelength > context / low, theta / factor, medium)
    return torch.where(wavelength < context / high, theta, scaled)


def _yarn_frequencies(theta: Tensor, parameters: dict) -> Tensor:
    """YaRN's inverse frequencies (float64) from the default ones θ_j, j < dim/2: a blend
    ``r_j θ_j / factor + (1 − r_j) θ_j`` by the ramp ``r_j = clamp((j − lo) / (hi − lo), 0, 1)``,
    where lo and hi are the dimensions at which a frequency turns ``beta_fast`` (32) and
    ``beta_slow`` (1) times over the pretraining context c, ``dim · ln(c / (2π β)) / (2 ln base)``,
    rounded outwards unless ``truncate`` is false and kept within [0, dim − 1]. YaRN's scaling of the
    angles, ``attention_factor``, is the module's ``attention_scaling``, which is applied after."""
    factor, base = float(parameters["factor"]), float(parameters["rope_theta"])
    context = float(parameters["original_max_position_embeddings"])
    dim = 2 * theta.numel()

    def turning_dimension(rotations: float) -> float:
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = (
        turning_dimension(parameters.get("beta_fast") or 32),
        turning_dimension(parameters.get("beta_slow") or 1),
    )
    if parameters.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as the reference implementation does: no division by zero
    ramp = ((torch.arange(theta.numel(), dtype=torch.float64, device=theta.device) - low) / (high - low)).clamp(0, 1)
    return ramp * theta / factor + (1 - ramp) * theta


# rope type -> its inverse frequencies from the default ones θ_i = 1 / base^(2i/dim), in float64
_SCALINGS = {
    "default": lambda theta, parameters: theta,
    "linear": lambda theta, parameters: theta / float(parameters["factor"]),
    "llama3": _llama3_frequencies,
    "yarn": _yarn_frequencies,
}


def rotary_in_float64(module: nn.Module, args: tuple, kwargs: dict, output):
    """A forward hook on a rotary module that, for a float64 ``x``, computes its ``(cos, sin)`` in
    float64: angles ``p · θ_i`` for every position p (:func:`exact_inverse_frequencies`), repeated
    over the two halves of the head (``cat(freqs, freqs)``, the layout of every family that has such
    a module), times the module's attention scaling. The module's own (float32) output must agree
    with that layout to float32's rounding of the angles; where it does not, the output is kept.
    Returned in float64, whatever the module returns (OLMo's keeps its float32 ones)."""
    x = args[0] if args else kwargs.get("x")
    position_ids = args[1] if len(args) > 1 else kwargs.get("position_ids")
    layer_type = args[2] if len(args) > 2 else kwargs.get("layer_type")
    if not isinstance(x, Tensor) or x.dtype != torch.float64 or not isinstance(position_ids, Tensor):
        return None
    cos, sin = output
    prefix = f"{layer_type}_" if layer_type is not None else ""
    scaling = float(getattr(module, prefix + "attention_scaling", 1.0))
    theta = exact_inverse_frequencies(module, layer_type)
    angles = position_ids[..., None].double() * theta.to(position_ids.device)
    angles = torch.cat((angles, angles), dim=-1)
    exact_cos, exact_sin = angles.cos() * scaling, angles.sin() * scaling
    # float32 angles are off by up to about |p| · θ_max · 2^-23: a layout check, not a precision one.
    slack = abs(scaling) * (1e-6 + 3e-7 * float(position_ids.abs().max()) * float(theta.abs().max()))
    if (
        exact_cos.shape != cos.shape
        or max(float((exact_cos - cos).abs().max()), float((exact_sin - sin).abs().max())) > slack
    ):
        _warn_float32_rotary(module, "its cosines and sines do not follow the layout cat(freqs, freqs) · scaling")
        return None
    return exact_cos, exact_sin  # float64 (OLMo's module returns float32 ones, which promote against float64)


@contextmanager
def positions_and_scales_in_float64(model: nn.Module):
    """Within the block, the float32 constants a float64 ``model`` holds in float64 buffers, exact:
    Gemma's embedding scale √d (``embed_scale``, from its Python float ``scalar_embed_scale``) and
    GPT-J's table of rotary sines and cosines (``embed_positions``, computed again in float64).
    Restored after."""
    swapped = []
    for module in _every_module(model):
        scale = getattr(module, "scalar_embed_scale", None)
        held = getattr(module, "embed_scale", None)
        if isinstance(scale, (int, float)) and isinstance(held, Tensor) and held.dtype == torch.float64:
            swapped.append((module, "embed_scale", held))
            module.embed_scale = torch.tensor(float(scale), dtype=torch.float64, device=held.device)
        table = getattr(module, "embed_positions", None)
        if hasattr(module, "pos_embd_dim") and isinstance(table, Tensor) and table.dtype == torch.float64:
            exact = _sinusoid_table(table.shape[0], table.shape[1], table.device)
            if float((exact[:64] - table[:64]).abs().max()) <= 1e-5:  # the same layout
                swapped.append((module, "embed_positions", table))
                module.embed_positions = exact
    try:
        yield
    finally:
        for module, name, held in swapped:
            setattr(module, name, held)


def _sinusoid_table(positions: int, dim: int, device) -> Tensor:
    """GPT-J's ``[positions, dim]`` table ``cat(sin(p θ), cos(p θ))``, θ_i = 1 / 10000^(2i/dim), in float64."""
    theta = 1.0 / 10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim)
    angles = torch.arange(positions, dtype=torch.float64, device=device)[:, None] * theta
    return torch.cat((angles.sin(), angles.cos()), dim=1)


# Called, as ``observe(module, query, key, attention_mask, scaling, kwargs)``, by the replacements
# below that compute a float64 model's scores themselves instead of calling the model's own eager
# attention: what that function would have been handed (pathkernels.adapters.query_key.recording
# reads the queries and keys there).
SCORE_OBSERVERS: list = []


def _gptj_attention_in_input_precision(original):
    """GPT-J's eager attention, which rounds the queries and keys to float32 "to avoid overflow",
    without that rounding for float64 inputs (the same steps otherwise)."""

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        if query.dtype != torch.float64:
            return original(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        for observe in SCORE_OBSERVERS:
            observe(module, query, key, attention_mask, scaling, kwargs)
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
