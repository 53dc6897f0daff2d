"""A float64 model's default forward pass with the steps Hugging Face rounds to float32 computed in
float64, written here independently of the adapters: the reference their float64 captures are held
to (docs: "Float64 means float64")."""

import contextlib
import math

import torch


def scaled_frequency(i: int, dim: int, parameters: dict) -> float:
    """Rotary frequency i (of dim/2) as the config's rope type scales the default one
    ``f = base^(-2i/dim)``: "default" keeps it, "linear" divides it by the factor; "llama3" (Llama
    3.1's long context) divides the long wavelengths (beyond context / low_freq_factor) by the
    factor, keeps the short ones (below context / high_freq_factor) and blends linearly in
    1 / wavelength between the two; "yarn" blends f and f / factor by a ramp over i, from the
    dimension where a frequency turns beta_fast times over the context (kept) to the one where it
    turns beta_slow times (divided), those dimensions rounded outwards unless truncate is false, and
    kept within [0, dim − 1]."""
    base = parameters["rope_theta"]
    frequency = base ** (-2 * i / dim)
    kind = parameters.get("rope_type", "default")
    if kind == "default":
        return frequency
    factor, context = parameters["factor"], parameters.get("original_max_position_embeddings")
    if kind == "linear":
        return frequency / factor
    if kind == "yarn":
        # the dimension d at which base^(-d/dim) · context = 2π · turns
        def turning(turns):
            return dim * math.log(context / (2 * math.pi * turns)) / (2 * math.log(base))

        first, last = turning(parameters.get("beta_fast", 32)), turning(parameters.get("beta_slow", 1))
        if parameters.get("truncate", True):
            first, last = math.floor(first), math.ceil(last)
        first, last = max(first, 0), min(last, dim - 1)
        ramp = min(max((i - first) / (last - first), 0.0), 1.0)  # 0: kept, 1: divided by the factor
        return (1 - ramp) * frequency + ramp * frequency / factor
    assert kind == "llama3", f"the reference knows no rope type {kind!r}"
    low, high = parameters["low_freq_factor"], parameters["high_freq_factor"]
    wavelength = 2 * math.pi / frequency
    if wavelength < context / high:
        return frequency
    if wavelength > context / low:
        return frequency / factor
    weight = (context / wavelength - low) / (high - low)  # 0 at the long end, 1 at the short one
    return weight * frequency + (1 - weight) * frequency / factor


@contextlib.contextmanager
def float64_steps(model):
    """Within the block, ``model``'s attention softmax (``softmax(x, dtype=torch.float32)``), its
    RMSNorms (``x / sqrt(mean(x²) + ε) · γ``, Gemma's ``γ = 1 + w``), OLMo's LayerNorms, the rotary
    cosines and sines (angles ``p · θ_i``, ``θ_i = 1 / base^(2i/dim)`` scaled by the rope type:
    :func:`scaled_frequency`) and Gemma's embedding scale
    ``√d`` compute in float64 where their input is float64. The model's own attention implementation
    runs (SDPA, where it has one: float64 throughout)."""

    def exact_norm(module, args, output):
        x = args[0]
        if x.dtype != torch.float64:
            return None
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        weight = getattr(module, "weight", None)
        gain = 1.0 if weight is None else (1 + weight if type(module).__name__.startswith("Gemma") else weight)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain

    softmax = torch.nn.functional.softmax

    def exact_softmax(x, dim=None, _stacklevel=3, dtype=None):
        return softmax(x, dim=dim, dtype=torch.float64 if x.dtype == torch.float64 else dtype)

    def exact_layer_norm(module, args, output):  # OLMo's parameter-free LayerNorm, ε = 1e-5
        x = args[0]
        if x.dtype != torch.float64:
            return None
        centred = x - x.mean(-1, keepdim=True)
        return centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-5)

    def exact_rotary(module, args, kwargs, output):  # (x, position_ids[, layer_type]) -> (cos, sin)
        x, positions = args[0], args[1] if len(args) > 1 else kwargs["position_ids"]
        if x.dtype != torch.float64:
            return None
        layer_type = args[2] if len(args) > 2 else kwargs.get("layer_type")
        config = module.config
        parameters = config.rope_parameters
        parameters = parameters[layer_type] if layer_type is not None else parameters
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(head_dim * parameters.get("partial_rotary_factor", 1.0))
        theta = torch.tensor([scaled_frequency(i, dim, parameters) for i in range(dim // 2)], dtype=torch.float64)
        angles = positions[..., None].double() * theta
        angles = torch.cat((angles, angles), dim=-1)
        scale = 1.0
        if parameters.get("rope_type") == "yarn":  # YaRN's "attention temperature" 0.1 ln(factor) + 1
            scale = parameters.get("attention_factor") or 0.1 * math.log(parameters["factor"]) + 1
        return angles.cos() * scale, angles.sin() * scale

    def exact_sinusoids(module, args, kwargs, output):  # GPT-J: (sin, cos) from its table
        positions = args[1] if len(args) > 1 else kwargs["position_ids"]
        if output[0].dtype != torch.float64:
            return None
        dim = module.pos_embd_dim
        theta = 1.0 / 10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        angles = positions[..., None].double() * theta
        return angles.sin(), angles.cos()

    def exact_embedding_scale(module, args, output):  # Gemma: embeddings · √d
        if output.dtype != torch.float64:
            return None
        return torch.nn.functional.embedding(args[0], module.weight, module.padding_idx) * math.sqrt(
            module.embedding_dim
        )

    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    handles = [norm.register_forward_hook(exact_norm) for norm in norms]
    handles += [
        m.register_forward_hook(exact_layer_norm) for m in model.modules() if type(m).__name__ == "OlmoLayerNorm"
    ]
    for m in model.modules():
        name = type(m).__name__
        if name == "GPTJRotaryEmbedding":
            handles.append(m.register_forward_hook(exact_sinusoids, with_kwargs=True))
        elif name.endswith("RotaryEmbedding") and type(m).__module__.startswith("transformers."):
            handles.append(m.register_forward_hook(exact_rotary, with_kwargs=True))
        elif name.endswith("ScaledWordEmbedding"):
            handles.append(m.register_forward_hook(exact_embedding_scale))
    torch.nn.functional.softmax = exact_softmax
    try:
        yield
    finally:
        torch.nn.functional.softmax = softmax
        for handle in handles:
            handle.remove()


def logits_in_float64(model, **inputs) -> torch.Tensor:
    """``model(**inputs).logits`` in float64 under :func:`float64_steps` (eval mode, no gradients)."""
    with float64_steps(model), torch.no_grad():
        return model.eval()(**inputs).logits.double()
