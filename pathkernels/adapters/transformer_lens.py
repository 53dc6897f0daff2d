"""TransformerLens 3.x and 4.x: patterns from the activation cache, ``W_V``/``W_O`` from the model.

Works with what users of either version hold: a 3.x ``HookedTransformer``, and a
``TransformerBridge`` (4.x's only model class, also in late 3.x), whether it wraps a Hugging Face
model (``boot_transformers``) or 4.x's own native model (``boot_native``, e.g. an attention-only
one). All expose ``run_with_cache``, ``cfg.n_layers`` and the stacked ``W_V [L, H_kv, d, d_head]``,
``W_O [L, H, d_head, d]``, ``b_V [L, H_kv, d_head]`` and ``b_O [L, d]``; where a grouped-query
model keeps one value head per group (``H_kv < H``, as 4.x's bridges do), each is repeated for the
query heads that share it. Hook names are TransformerLens's: ``blocks.{l}.attn.hook_pattern``,
``blocks.{l}.hook_resid_pre`` and ``blocks.{L-1}.hook_resid_post``.
"""

from __future__ import annotations

import torch

from pathkernels.adapters.capture import fingerprint_mismatch, weights_fingerprint
from pathkernels.adapters.naming import model_name
from pathkernels.adapters.precision import in_float64
from pathkernels.adapters.stack import AttentionStack, fold_value_bias

_WHERE = "pathkernels.adapters.from_transformer_lens"


def _is_cache(obj) -> bool:
    return type(obj).__name__ == "ActivationCache" and hasattr(obj, "model")


def model_and_cache(first, second, where: str):
    """``(model, tokens, cache)`` from arguments given as ``(model, tokens)``, ``(model, cache)`` or
    ``(cache, model or None)``: a cache made by ``model.run_with_cache`` holds the activations, so
    the model need not run again (its ``model`` is the model where none is given)."""
    if _is_cache(first):
        if second is not None and not (hasattr(second, "run_with_cache") and hasattr(second, "cfg")):
            raise TypeError(
                f"{where}: with an ActivationCache first, expected the model (or nothing) second, got "
                f"{type(second).__name__}: pass (model, cache), or (model, tokens) to run it"
            )
        return (first.model if second is None else second), None, first
    if _is_cache(second):
        mismatch = None if second.model is first else fingerprint_mismatch(first, weights_fingerprint(second.model))
        if mismatch is not None:
            raise ValueError(
                f"{where}: the ActivationCache was made by another model than the one given ({mismatch}); pass the "
                "model that ran it, or the tokens to run this one"
            )
        return first, None, second
    return first, second, None


def _hook_names(num_layers: int) -> list[str]:
    names = [f"blocks.{layer}.attn.hook_pattern" for layer in range(num_layers)]
    names += [f"blocks.{layer}.hook_resid_pre" for layer in range(num_layers)]
    return names + [f"blocks.{num_layers - 1}.hook_resid_post"]


def _per_query_head(t: torch.Tensor, heads: int, name: str) -> torch.Tensor:
    """``t [L, H_kv, ...]`` with each key/value head repeated for the ``heads // H_kv`` query heads
    that share it (query head h reads key/value head ``h // (heads / H_kv)``, as TransformerLens and
    Hugging Face order them)."""
    kv_heads = t.shape[1]
    if kv_heads == heads:
        return t
    if heads % kv_heads:
        raise ValueError(f"{_WHERE}: {name} has {kv_heads} heads, which do not divide the {heads} attention heads")
    return t.repeat_interleave(heads // kv_heads, dim=1)


def _bias(model, name: str) -> torch.Tensor | None:
    """``model.b_V`` or ``model.b_O`` detached, or None for a model without that bias (a bridge over
    a Hugging Face model without attention biases, such as Llama, fails to stack them)."""
    try:
        bias = getattr(model, name)
    except (AttributeError, TypeError):
        return None
    return None if bias is None else bias.detach()


def _attention_only(model) -> bool | None:
    """Whether the model is the attention-only network its maps make: ``attn_only`` and no norm
    (None when its config says neither, as an ActivationCache's may not)."""
    cfg = getattr(model, "cfg", None)
    if cfg is None or not hasattr(cfg, "attn_only"):
        return None
    return bool(cfg.attn_only) and getattr(cfg, "normalization_type", None) is None


def _softmax_precision(model, attn: torch.Tensor) -> torch.dtype | None:
    """For a bridge over a Hugging Face model, ``torch.float32`` where its float64 patterns ``attn``
    were computed in float32 (rows that miss 1 by more than float64's rounding, yet within
    float32's); None otherwise. The adapters compute a float64 model's softmax in float64
    (:func:`~pathkernels.adapters.huggingface.softmax_in_input_precision`), so this is the
    fallback for an attention the bridge computes in float32 some other way."""
    original = model.__dict__.get("original_model") if hasattr(model, "__dict__") else None
    if original is None or attn.dtype != torch.float64:
        return None
    miss = (attn.sum(-1) - 1).abs()
    return torch.float32 if bool(((miss > 1e-13) & (miss < 1e-5)).any()) else None


def check_tokens(model, tokens, where: str):
    """``tokens`` as the model will read them, refused in the caller's name where the model would
    index its embedding out of range (a negative id wraps around to the end of the vocabulary):
    ids ``[B, n]`` (or ``[n]``; a nested list becomes a tensor) in ``[0, d_vocab)``, at least one
    batch element and one token. Text passes through, for the model to tokenise."""
    if isinstance(tokens, str) or (isinstance(tokens, (list, tuple)) and tokens and isinstance(tokens[0], str)):
        return tokens
    if isinstance(tokens, (list, tuple)):
        try:
            tokens = torch.tensor(tokens)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(
                f"{where}: expected tokens to be token ids [B, n] or text, got a ragged or mixed list"
            ) from None
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(
            f"{where}: expected tokens to be a tensor of token ids [B, n] or text, got {type(tokens).__name__}"
        )
    if tokens.dim() not in (1, 2) or 0 in tokens.shape:
        raise ValueError(
            f"{where}: expected tokens [B, n] (or [n]) with at least one batch element and one token, got "
            f"{list(tokens.shape)}"
        )
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise TypeError(f"{where}: expected integer token ids, got {tokens.dtype}")
    vocab = getattr(model.cfg, "d_vocab", None)
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or (vocab is not None and vocab > 0 and high >= vocab):
        raise ValueError(
            f"{where}: expected token ids in [0, {vocab}) (the model's d_vocab), got values from {low} to {high}"
        )
    context = getattr(model.cfg, "n_ctx", None)  # a HookedTransformer's masks and positions stop there
    if type(model).__name__ == "HookedTransformer" and isinstance(context, int) and tokens.shape[-1] > context:
        raise ValueError(f"{where}: {tokens.shape[-1]} tokens, but the model's context is n_ctx = {context}")
    return tokens


def require_patterns(model, cache, where: str) -> None:
    """Refuse, in the caller's name, a model whose run gave no attention patterns (some bridges of
    some TransformerLens versions expose no ``hook_pattern``)."""
    missing = [f"blocks.{layer}.attn.hook_pattern" for layer in range(model.cfg.n_layers)]
    missing = [name for name in missing if name not in cache]
    if missing:
        architecture = getattr(model.cfg, "architecture", None) or type(model).__name__
        raise ValueError(
            f"{where}: this TransformerLens's {architecture} gives no attention patterns ({missing[0]}); read the "
            "Hugging Face model itself (from_huggingface, capture_huggingface_residual) instead"
        )


def run_cached(model, tokens, names: set[str], attention_mask=None):
    """``model.run_with_cache(tokens)`` keeping only the hooks ``names``, in eval mode (restored
    after: a TransformerBridge wraps an HF model whose attention dropout would act) and without
    gradients; the cache."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), in_float64(model):
            extra = {} if attention_mask is None else {"attention_mask": attention_mask}
            _, cache = model.run_with_cache(tokens, names_filter=lambda name: name in names, **extra)
    finally:
        model.train(was_training)
    return cache


def from_transformer_lens(model_or_cache, tokens=None, *, attention_mask=None) -> AttentionStack:
    """Attention patterns, per-head value-output maps and the residual stream from TransformerLens.

    Args:
        model_or_cache: a ``HookedTransformer`` / ``TransformerBridge`` (then ``tokens`` is run
            through ``run_with_cache``, keeping only the hooks read here), or an
            ``ActivationCache`` from ``model.run_with_cache`` (its ``model`` gives the weights).
        tokens: ``[B, n]`` token ids, or text the model tokenises; only with a model. The model
            runs once in eval mode (restored after), without gradients.
        attention_mask: ``[B, n]``, 1 at real tokens, for a padded batch: passed to the model's
            forward (with a model) and carried as the stack's ``token_mask``, so that each
            sequence is evaluated on its real tokens only. With a cache, the mask it was run with.

    Returns:
        :class:`AttentionStack`: ``attn [B, L, H, n, n]`` from ``hook_pattern``, ``w_v``/``w_o``
        from ``W_V``/``W_O``, ``b_o = b_O + Σ_h b_V W_O`` and ``hidden_states [L+1, B, n, d]``
        (``resid_pre`` of every layer, then the last ``resid_post``; None if the cache lacks them).
        ``transformer_lens.FactoredMatrix(*stack.w_path(path))`` is a path's ``W_path``.

    Raises:
        ValueError: if an attention row does not sum to 1 (padding, or a cache made in training mode),
            or tokens hold no batch element or no token.
    """
    if _is_cache(tokens) and not _is_cache(model_or_cache):  # (model, cache): the cache's own model is the one
        model_or_cache, tokens = tokens, None
    from_model = not _is_cache(model_or_cache)
    if not from_model:
        if tokens is not None:
            raise ValueError(f"{_WHERE}: pass tokens with a model, not with an ActivationCache")
        cache, model = model_or_cache, model_or_cache.model
    else:
        model = model_or_cache
        if not (hasattr(model, "run_with_cache") and hasattr(model, "cfg")):
            raise TypeError(
                f"{_WHERE}: expected a HookedTransformer, TransformerBridge or ActivationCache, "
                f"got {type(model).__name__}"
            )
        if tokens is None:
            raise ValueError(f"{_WHERE}: expected tokens to run the model on")
        tokens = check_tokens(model, tokens, _WHERE)
        cache = run_cached(model, tokens, set(_hook_names(model.cfg.n_layers)), attention_mask)

    num_layers = model.cfg.n_layers
    patterns = []
    for layer in range(num_layers):
        name = f"blocks.{layer}.attn.hook_pattern"
        if from_model:
            require_patterns(model, cache, _WHERE)
        if name not in cache:
            raise ValueError(f"{_WHERE}: the cache has no {name}; run the model with that hook cached")
        pattern = cache[name]
        patterns.append(pattern if pattern.dim() == 4 else pattern.unsqueeze(0))  # caches without batch dim
    residual_names = _hook_names(num_layers)[num_layers:]
    hidden = None
    if all(name in cache for name in residual_names):
        hidden = torch.stack(
            [cache[name] if cache[name].dim() == 3 else cache[name].unsqueeze(0) for name in residual_names]
        )
    attn = torch.stack(patterns, dim=1).detach()
    heads = attn.shape[2]
    with torch.no_grad():
        w_v = _per_query_head(model.W_V.detach(), heads, "W_V").clone()
        w_o = model.W_O.detach().clone()
        b_v, b_out = _bias(model, "b_V"), _bias(model, "b_O")
        b_v = None if b_v is None else _per_query_head(b_v, heads, "b_V")
        b_o = torch.stack(
            [
                fold_value_bias(
                    None if b_v is None else b_v[layer], w_o[layer], None if b_out is None else b_out[layer]
                )
                for layer in range(num_layers)
            ]
        )
    return AttentionStack(
        attn=attn,
        w_v=w_v,
        w_o=w_o,
        b_o=b_o,
        hidden_states=None if hidden is None else hidden.detach(),
        source=f"transformer_lens:{type(model).__name__}",
        name=model_name(model),
        token_mask=attention_mask,
        attn_precision=_softmax_precision(model, attn),
        attention_only=_attention_only(model),
    )
