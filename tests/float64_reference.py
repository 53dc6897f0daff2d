"""A float64 model's default forward pass with the steps Hugging Face rounds to float32 computed in
float64, written here independently of the adapters: the reference their float64 captures are held
to (docs: "Float64 means float64")."""

import contextlib

import torch


@contextlib.contextmanager
def float64_steps(model):
    """Within the block, ``model``'s attention softmax (``softmax(x, dtype=torch.float32)``), its
    RMSNorms (``x / sqrt(mean(x²) + ε) · γ``, Gemma's ``γ = 1 + w``) and OLMo's LayerNorms compute in
    float64 where their input is float64. The model's own attention implementation runs (SDPA,
    where it has one: float64 throughout)."""

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

    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    handles = [norm.register_forward_hook(exact_norm) for norm in norms]
    handles += [
        m.register_forward_hook(exact_layer_norm) for m in model.modules() if type(m).__name__ == "OlmoLayerNorm"
    ]
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
