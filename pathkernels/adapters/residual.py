"""What a real transformer's residual stream holds beyond its attention.

With every normalisation scale frozen at its value in one forward pass, a pre-norm transformer's
residual stream is an exact sum of paths: a source (the embedding, a layer's constant, an MLP's
output) followed by a chain of heads, each a token map ``A D`` and a feature map ``C Γ W_V W_O``
(docs/DESIGN.md, "Real transformers"); so is a post-norm one's, each branch scaled by the norm
after it. :func:`capture_huggingface_residual` reads, from the very forward pass that gives the
attention stack, what those terms need that the stack does not hold: GPT-2 and ViT (pre-LN),
BERT and RoBERTa (post-LN) and the Llama family (Llama, Mistral, Qwen2: pre-norm RMSNorm,
grouped-query attention, rotary positions); other families are refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor, nn

from pathkernels.adapters.capture import ResidualStreamCapture, weights_fingerprint
from pathkernels.adapters.huggingface import (
    _attention_layers,
    _blocks,
    _prepared_inputs,
    _read_stack,
    _value_output,
    input_batch_size,
)
from pathkernels.adapters.precision import norm_eps, rms_gain
from pathkernels.adapters.query_key import QUERY_KEY_FAMILIES, QueryKeyCapture, query_key_capture, recording
from pathkernels.adapters.replacement import MlpInputs, check_replaceable, replace_mlps
from pathkernels.adapters.self_check import (
    check_cached_capture,
    check_huggingface_capture,
    check_tolerance,
    check_transformer_lens_capture,
    warn_if_training,
)
from pathkernels.adapters.stack import AttentionStack
from pathkernels.adapters.transformer_lens import (
    _bias,
    _per_query_head,
    check_tokens,
    from_transformer_lens,
    model_and_cache,
    require_patterns,
    run_cached,
)
from pathkernels.core._progress import progress_bar
from pathkernels.core.checks import all_finite, check_flag

_WHERE = "pathkernels.adapters.capture_huggingface_residual"


@dataclass(frozen=True)
class _Layout:
    """Where one family keeps what the capture reads."""

    layout: str  # "pre" or "post"
    norm: str  # "layernorm" or "rmsnorm"
    blocks: tuple[str, ...]  # the blocks' list under base_model: the first of these paths that exists
    # A block's norms before its attention and before its MLP (None: none; a parallel block's MLP
    # reads the block's input, through its own norm or the attention's).
    norms: Callable[[nn.Module], tuple[nn.Module | None, nn.Module | None]]
    mlp: Callable[[nn.Module], nn.Module]  # the module whose output is the MLP's branch
    final_norm: str | None = None  # under base_model, dotted (pre-norm models)
    # RMSNorms on the attention's and the MLP's outputs, before their residual sums (Gemma-2, OLMo 2).
    output_norms: Callable[[nn.Module], tuple[nn.Module, nn.Module]] | None = None


def _first(block: nn.Module, *names: str) -> nn.Module | None:
    """The first of ``block``'s submodules ``names`` that it has."""
    return next((getattr(block, name) for name in names if getattr(block, name, None) is not None), None)


_LLAMA = _Layout(
    "pre", "rmsnorm", ("layers",), lambda b: (b.input_layernorm, b.post_attention_layernorm), lambda b: b.mlp, "norm"
)
_GEMMA2 = _Layout(
    "pre",
    "rmsnorm",
    ("layers",),
    lambda b: (b.input_layernorm, b.pre_feedforward_layernorm),
    lambda b: b.mlp,
    "norm",
    lambda b: (b.post_attention_layernorm, b.post_feedforward_layernorm),
)
_BERT = _Layout(
    "post",
    "layernorm",
    ("encoder.layer",),
    lambda b: (b.attention.output.LayerNorm, b.output.LayerNorm),
    lambda b: b.output.dense,
)


def _opt_layout(config) -> _Layout:
    """OPT: pre-norm (``do_layer_norm_before``, most sizes) or post-norm (OPT-350m)."""
    pre = config.do_layer_norm_before
    final = "decoder.final_layer_norm" if pre and not getattr(config, "_remove_final_layer_norm", False) else None
    return _Layout(
        "pre" if pre else "post",
        "layernorm",
        ("decoder.layers",),
        lambda b: (b.self_attn_layer_norm, b.final_layer_norm),
        lambda b: b.fc2,
        final,
    )


_LAYOUTS = {
    "gpt2": _Layout("pre", "layernorm", ("h",), lambda b: (b.ln_1, b.ln_2), lambda b: b.mlp, "ln_f"),
    "bert": _BERT,
    "roberta": _BERT,
    "vit": _Layout(
        "pre",
        "layernorm",
        ("layers", "encoder.layer"),  # transformers 5, 4
        lambda b: (b.layernorm_before, b.layernorm_after),
        lambda b: b.mlp if hasattr(b, "mlp") else b.output.dense,  # 4.x adds the residual in ViTOutput
        "layernorm",
    ),
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,  # its query and key norms shape the patterns only
    "gemma": _LLAMA,  # (1 + w) norms (rms_gain), embeddings scaled before block 0
    "gemma2": _GEMMA2,
    "gemma3_text": _GEMMA2,
    "olmo": _Layout(
        "pre",
        "layernorm",
        ("layers",),
        lambda b: (b.input_layernorm, b.post_attention_layernorm),
        lambda b: b.mlp,
        "norm",
    ),
    "olmo2": _Layout(
        "pre",
        "rmsnorm",
        ("layers",),
        lambda b: (None, None),
        lambda b: b.mlp,
        "norm",
        lambda b: (b.post_attention_layernorm, b.post_feedforward_layernorm),
    ),
    "gpt_neox": _Layout(  # parallel (use_parallel_residual) or not: the same frozen paths
        "pre",
        "layernorm",
        ("layers",),
        lambda b: (b.input_layernorm, b.post_attention_layernorm),
        lambda b: b.mlp,
        "final_layer_norm",
    ),
    "gptj": _Layout("pre", "layernorm", ("h",), lambda b: (b.ln_1, b.ln_1), lambda b: b.mlp, "ln_f"),  # parallel
    "phi": _Layout(
        "pre",
        "layernorm",
        ("layers",),
        lambda b: (b.input_layernorm, b.input_layernorm),
        lambda b: b.mlp,
        "final_layernorm",
    ),
    "falcon": _Layout(
        "pre",
        "layernorm",
        ("h",),
        lambda b: (
            _first(b, "ln_attn", "input_layernorm"),
            _first(b, "ln_mlp", "post_attention_layernorm", "input_layernorm"),
        ),
        lambda b: b.mlp,
        "ln_f",
    ),
}
CAPTURED_FAMILIES = (
    "GPT-2, GPT-NeoX (Pythia), GPT-J, Phi, Falcon, OPT, BERT, RoBERTa, ViT, Llama, Mistral, Qwen2, Qwen3, Gemma, "
    "Gemma-2, Gemma-3, OLMo and OLMo 2"
)


def _layout(model) -> _Layout:
    """The capture's layout of ``model``'s family, refused by name where it has none."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type == "opt":
        return _opt_layout(config)
    if model_type not in _LAYOUTS:
        raise ValueError(
            f"{_WHERE}: {CAPTURED_FAMILIES} models are captured, got {model_type or type(model).__name__!r}"
        )
    if model_type == "olmo" and getattr(config, "clip_qkv", None) is not None:
        raise ValueError(
            f"{_WHERE}: OLMo with clip_qkv clamps its values, so a head is not linear in its input; not captured"
        )
    return _LAYOUTS[model_type]


def _module_at(root: nn.Module, path: str) -> nn.Module | None:
    for name in path.split("."):
        root = getattr(root, name, None)
    return root


def _inverse_scale(x: Tensor, norm: nn.Module | None, kind: str) -> Tensor:
    """``1/σ_t`` ``[B, n]`` of the norm on its input ``x`` ``[B, n, d]``, in float64: LayerNorm's
    ``σ_t = sqrt(var_t + ε)`` (the biased variance over the features), RMSNorm's
    ``σ_t = sqrt(mean_t(x²) + ε)``; 1 where there is no norm."""
    x = x.double()
    if norm is None:
        return torch.ones(x.shape[:-1], dtype=torch.float64, device=x.device)
    if kind == "layernorm":
        return torch.rsqrt(x.var(-1, unbiased=False) + norm_eps(norm))
    return torch.rsqrt(x.pow(2).mean(-1) + norm_eps(norm))


def capture_huggingface_residual(
    model: nn.Module,
    *,
    check: bool = True,
    query_key: bool = False,
    patterns: str = "held",
    transcoders=None,
    progress: bool = False,
    **inputs,
) -> tuple[AttentionStack, ResidualStreamCapture]:
    """The attention stack of :func:`from_huggingface` and, from the same forward pass, what the
    real model's residual stream needs beyond it (:class:`ResidualStreamCapture`), in float64.

    Pre-norm (GPT-2, ViT; Llama, Mistral, Qwen2): a block computes ``x + Attn(N₁(x))`` then
    ``+ MLP(N₂(·))``; frozen, ``N₁(x) = D x C Γ + 1 βᵀ`` with ``D = diag(1/σ)`` (RMSNorm: no ``C``,
    no β), so the attention sublayer is a sum of heads ``(A D) x (C Γ W_V W_O)`` plus constant
    rows, and the MLP's output enters as a source. Post-norm (BERT, RoBERTa): ``N₁(x + Attn(x))`` then
    ``N₂(· + MLP(·))``; every branch, the skip included, is then scaled by ``D`` on the left and
    ``C Γ`` on the right (docs/DESIGN.md, "Real transformers"). Other families are refused by name.

    Rotary positions and grouped-query attention change nothing: the patterns are read as
    computed. A float64 model's softmax, RMSNorms and rotary angles, which Hugging Face computes in
    float32, run in float64 for this pass (:func:`pathkernels.adapters.precision.in_float64`), so
    that its stream is exactly the sum of its paths and the model's own in float64; its unmodified
    forward pass differs from it by float32's rounding (about 1e-7 relative, up to 2e-6).

    The capture checks itself (``check=True``, the default; :mod:`pathkernels.adapters.self_check`):
    the model runs once more, unmodified, on the same inputs, and the sum of the paths and the
    logits read out from it must match the model's stream and logits to within
    :func:`~pathkernels.adapters.self_check.check_tolerance`, or the capture is refused by name. It
    costs one more forward pass and the length sums; ``capture.check`` holds the differences found.

    With ``query_key=True`` the same forward pass also reads the score side, every head's frozen
    query and key maps and the queries and keys the model computed
    (:class:`~pathkernels.adapters.query_key.QueryKeyCapture`, as ``capture.query_key``), which
    :func:`pathkernels.score_decomposition` decomposes into pairs of paths; families:
    :data:`~pathkernels.adapters.query_key.QUERY_KEY_FAMILIES` (others refused by name).

    With ``transcoders`` (a per-layer or skip :class:`~pathkernels.adapters.TranscoderSet`, from
    :func:`~pathkernels.adapters.load_transcoders`), each MLP of its layers is replaced by its
    transcoder, frozen at this pass (``capture.transcoders``, :mod:`pathkernels.adapters.replacement`):
    its active features become path steps, and its constant rows and its error (the MLP's output less
    the reconstruction) sources, so that the paths still sum to the model's stream. Sequential
    pre-norm families; a parallel block (GPT-J, Phi, parallel GPT-NeoX and Falcon) and post-norm
    models are refused by name.

    ``patterns="recomputed"`` (with ``query_key=True``) keeps no patterns: the stack's ``attn`` is a
    :class:`~pathkernels.adapters.capture.RecomputedPatterns`, each layer's recomputed in float64
    from the captured queries and keys when an analysis reads it, a block of rows at a time, so
    that the capture holds ``O(L·H·n·e)`` for them rather than ``L·H·n²`` (14 GB in float32 at
    Gemma-2-2B's shape and 4,096 tokens). They are the float64 softmax of the model's own scores,
    which differ from its patterns by the model's rounding (about 1e-7 relative in float32); each
    layer's is checked against the model's own when first read (the self-check reads every layer),
    and the paths sum to the model's stream and logits within the same tolerance. The engine's
    functions that take a stack's patterns whole, as an attention-only network's (``pk.rollout``,
    ``pk.path_residuals``), refuse such a stack by name. Default ``"held"``: the patterns as the model computed them.

    ``progress=True`` shows a bar over the layers of the capture's forward pass and of the
    self-check's (plain lines on stderr where no bar can be drawn), naming the step between them
    (the query and key maps, the path sum, the logits).

    Returns:
        ``(stack, capture)``; the capture is also ``stack.residual_capture``, which
        :meth:`AttentionStack.length_sums` decomposes.
    """
    check = check_flag(check, "check", _WHERE)
    query_key = check_flag(query_key, "query_key", _WHERE)
    progress = check_flag(progress, "progress", _WHERE)
    if patterns not in ("held", "recomputed"):
        raise ValueError(f"{_WHERE}: expected patterns to be 'held' or 'recomputed', got {patterns!r}")
    if patterns == "recomputed" and not query_key:
        raise ValueError(
            f"{_WHERE}: patterns='recomputed' recomputes them from the captured queries and keys; pass query_key=True "
            "with it"
        )
    spec = _layout(model)
    if query_key and model.config.model_type not in QUERY_KEY_FAMILIES:
        raise ValueError(
            f"{_WHERE}: query_key=True reads the queries and keys of {', '.join(QUERY_KEY_FAMILIES)} models; "
            f"not yet of {model.config.model_type!r}"
        )
    if query_key and spec.layout == "post":
        raise ValueError(
            f"{_WHERE}: query_key=True reads pre-norm models; this {model.config.model_type!r} normalises after each "
            "residual sum (post-norm), whose score side is not read yet"
        )
    warn_if_training(model, _WHERE)
    inputs = _prepared_inputs(model, inputs, _WHERE)
    blocks = _blocks(model, *spec.blocks)
    count = len(blocks)
    if transcoders is not None:
        _check_replaceable_family(model, spec, transcoders, count)
    norms = [norm for block in blocks for norm in spec.norms(block)]
    outputs = [] if spec.output_norms is None else [spec.output_norms(block) for block in blocks]
    final_norm = None if spec.final_norm is None else _module_at(model.base_model, spec.final_norm)
    seen: dict[str, list] = {
        "norm_scale": [None] * (2 * count),  # 1/σ of each norm's input, [B, n] (OPT's MLP norm: [B·n])
        "mlp_out": [],  # one [B, L, n, d] float64 buffer, each layer's written as it comes
        "final_in": [None],
        "output_scale": [None] * count,
    }
    batch_size = input_batch_size(inputs)

    def keep(name: str, index: int, output: bool):
        def hook(module, args, result=None):  # a copy: some families add to the branch in place (Falcon)
            seen[name][index] = (result if output else args[0]).detach().clone()

        return hook

    def scale_of(name: str, index: int, kind: str):  # the norm's 1/σ per token: its input is not kept
        def hook(module, args):
            seen[name][index] = _inverse_scale(args[0].detach(), module, kind)

        return hook

    def mlp_output(index: int):  # written into the float64 buffer: no copy per layer in the model's dtype
        def hook(module, args, result):
            out = result.detach()
            out = out.reshape(batch_size, -1, out.shape[-1])  # OPT's MLP reads its tokens flattened, [B·n, d]
            if not seen["mlp_out"]:
                seen["mlp_out"].append(torch.empty(batch_size, count, *out.shape[1:], dtype=torch.float64,
                                                   device=out.device))  # fmt: skip
            seen["mlp_out"][0][:, index] = out

        return hook

    handles = [
        norm.register_forward_pre_hook(scale_of("norm_scale", i, spec.norm))
        for i, norm in enumerate(norms)
        if norm is not None
    ]
    # The MLP's branch as it enters the stream: after the norm on its output, where there is one.
    mlp_branches = [spec.mlp(block) if not outputs else outputs[i][1] for i, block in enumerate(blocks)]
    handles += [module.register_forward_hook(mlp_output(i)) for i, module in enumerate(mlp_branches)]
    handles += [
        out[0].register_forward_pre_hook(scale_of("output_scale", i, "rmsnorm")) for i, out in enumerate(outputs)
    ]
    if transcoders is not None:  # the MLP's argument as the model computed it, and what a norm after it reads
        seen |= {"norm_in": [None] * (2 * count), "mlp_in": [None] * count, "module_out": [None] * count}
        handles += [  # the stream entering each MLP's norm, which the transcoders' inputs are checked against
            norms[2 * i + 1].register_forward_pre_hook(keep("norm_in", 2 * i + 1, output=False))
            for i in range(count)
            if norms[2 * i + 1] is not None
        ]
        for i, block in enumerate(blocks):
            mlp_norm = norms[2 * i + 1]
            if spec.layout == "post":  # the MLP reads the stream after the attention's residual norm
                handles.append(norms[2 * i].register_forward_hook(keep("mlp_in", i, output=True)))
            elif mlp_norm is not None:
                handles.append(mlp_norm.register_forward_hook(keep("mlp_in", i, output=True)))
            else:  # no norm before the MLP (OLMo 2): it reads the stream itself
                handles.append(spec.mlp(block).register_forward_pre_hook(keep("mlp_in", i, output=False)))
            if outputs:
                handles.append(outputs[i][1].register_forward_pre_hook(keep("module_out", i, output=False)))
    if final_norm is not None:
        handles.append(final_norm.register_forward_pre_hook(keep("final_in", 0, output=False)))
    # The token embedding, where the stream entering block 0 is it plus a learned position
    # embedding (GPT-2's wte + wpe, OPT's embed_tokens + embed_positions): the two are apart.
    seen["token_embedding"] = [None]
    if model.config.model_type in _ADDED_POSITION_FAMILIES and _adds_positions_to_tokens(model):
        handles.append(model.get_input_embeddings().register_forward_hook(keep("token_embedding", 0, output=True)))
    attention = _attention_layers(model)
    # Closed when the capture returns; a refusal leaves it to be collected.
    bar = progress_bar(len(attention) * (2 if check else 1), enabled=progress, unit="layer", desc=_WHERE)
    try:
        with ExitStack() as scope:
            modules = [a.attention for a in attention]
            scores_seen = scope.enter_context(recording(modules, _WHERE)) if query_key else None
            tolerance = check_tolerance(next(model.parameters()).dtype)
            on_layer = None if bar is None else bar.update
            stack, attn = _read_stack(model, inputs, _WHERE, on_layer, patterns == "held", tolerance)
    finally:
        for handle in handles:
            handle.remove()
    with torch.no_grad():
        batch, tokens, d = stack.attn.shape[0], stack.attn.shape[-1], stack.d_model
        device = stack.attn.device
        ones = torch.ones(batch, tokens, dtype=torch.float64, device=device)  # no norm: 1/σ = 1
        scales = torch.stack(  # OPT's MLP norm reads its tokens flattened, [B·n]
            [ones if scale is None else scale.reshape(batch, tokens) for scale in seen["norm_scale"]], dim=1
        )
        weights = torch.stack([_gain(n, spec.norm, d, device) for n in norms]).reshape(count, 2, -1)
        biases = torch.stack([_shift(n, spec.norm, d, device) for n in norms]).reshape(count, 2, -1)
        value_bias, output_bias = _attention_biases(model, stack)
        extra = {}
        if final_norm is not None:
            extra |= {
                "final_scale": _inverse_scale(seen["final_in"][0], final_norm, spec.norm),
                "final_weight": _gain(final_norm, spec.norm, d, device),
                "final_bias": _shift(final_norm, spec.norm, d, device),
            }
        if outputs:
            extra |= {
                "attention_output_scale": torch.stack(seen["output_scale"], dim=1),
                "attention_output_weight": torch.stack([_gain(out[0], "rmsnorm", d, device) for out in outputs]),
            }
        unembedding, unembedding_bias = output_embedding(model)
        capture = ResidualStreamCapture(
            layout=spec.layout,
            norm=spec.norm,
            embedding=stack.hidden_states[0].double(),
            norm_scale=scales.reshape(batch, count, 2, tokens),
            norm_weight=weights,
            norm_bias=biases,
            value_bias=value_bias,
            output_bias=output_bias,
            mlp_out=seen["mlp_out"][0],
            residual=(seen["final_in"][0] if final_norm is not None else stack.hidden_states[-1]).double(),
            attn_row_sums=None if stack.attn_precision is None else attn.double().sum(-1),
            unembedding=unembedding,
            unembedding_bias=unembedding_bias,
            pooled_token=pooled_tokens(model, inputs.get("input_ids"), batch, tokens),
            input_ids=None if inputs.get("input_ids") is None else inputs["input_ids"].detach().cpu(),
            token_embedding=None if seen["token_embedding"][0] is None else seen["token_embedding"][0].double(),
            **extra,
        )
        if scores_seen is not None:
            if bar is not None:
                bar.set_postfix_str("the query and key maps")
            first = attention[0]
            capture.query_key = query_key_capture(
                modules,
                scores_seen,
                first.num_heads,
                first.num_kv_heads,
                first.head_dim,
                _WHERE,
                scaled_queries=model.config.model_type == "opt",
            )
            scores_seen.clear()  # what the model handed its attention, held by the capture now
            _check_query_key(capture, stack)
        if transcoders is not None:
            parallel = _parallel_blocks(model.config)
            capture.transcoders = _replaced_mlps(transcoders, capture, stack, seen, norms, outputs, parallel)
    stack, capture = _attached(stack, capture, model, _WHERE)
    if check:
        projection = getattr(getattr(model.base_model, "decoder", None), "project_out", None)
        final_input = final_norm if final_norm is not None else projection
        capture.check = check_huggingface_capture(model, inputs, stack, capture, final_input, _WHERE, bar)
    if bar is not None:
        bar.close()
    return stack, capture


def _parallel_blocks(config) -> bool:
    """Whether a block's MLP reads the block's input, beside its attention (GPT-J, Phi, GPT-NeoX's
    ``use_parallel_residual``, Falcon's ``parallel_attn`` or new decoder)."""
    kind = config.model_type
    if kind in ("gptj", "phi"):
        return True
    if kind == "gpt_neox":
        return bool(config.use_parallel_residual)
    if kind == "falcon":
        return bool(getattr(config, "parallel_attn", False) or getattr(config, "new_decoder_architecture", False))
    return False


def _check_replaceable_family(model, spec: _Layout, transcoders, layers: int) -> None:
    """Refuse, before the forward pass, a model or set whose MLPs the capture cannot replace."""
    if spec.layout != "pre" and getattr(transcoders, "input_hook", None) == "mlp_input_before_gain":
        raise ValueError(
            f"{_WHERE}: transcoders reads 'mlp_input_before_gain', the MLP's input before its norm's gain; this "
            f"post-norm {model.config.model_type!r} has no norm before its MLP (it reads the stream itself: "
            "'mlp_input' or 'resid_mid')"
        )
    if spec.layout != "pre" and getattr(transcoders, "cross_layer", False):
        raise ValueError(
            f"{_WHERE}: transcoders is a cross-layer set on a post-norm model ({model.config.model_type!r}): a "
            "feature's write into a later layer would pass every norm between, which a cross-layer set does not "
            "read; per-layer and skip transcoders are read"
        )
    check_replaceable(transcoders, layers, model.config.get_text_config().hidden_size, _WHERE)


def _replaced_mlps(
    transcoders, capture: ResidualStreamCapture, stack: AttentionStack, seen, norms, outputs, parallel: bool
):
    """The capture's MLPs of ``transcoders``' layers replaced (:func:`~pathkernels.adapters.replacement.
    replace_mlps`) from what the forward pass's hooks kept, the frozen input checked against the
    model's own MLP input (``parallel``: each MLP reads its block's input, beside the attention)."""
    batch, tokens, d = capture.embedding.shape

    def stacked(values) -> Tensor:  # [B, L, n, d] float64
        return torch.stack([v.double().reshape(batch, tokens, d) for v in values], dim=1)

    count = len(seen["mlp_in"])
    module_input = stacked(seen["mlp_in"])
    if capture.layout == "post":  # the MLP reads the stream itself (after the attention's norm): no norm before it
        ones = torch.ones(batch, count, tokens, dtype=torch.float64, device=module_input.device)
        gains = torch.ones(count, d, dtype=torch.float64, device=module_input.device)
        inputs = MlpInputs(
            module_input, ones, gains, gains * 0, False, capture.mlp_out, own_inputs={"mlp_input": module_input}
        )
        return replace_mlps(transcoders, inputs, stack.token_mask, check_tolerance(stack.computed_in), _WHERE)
    stream = stacked([seen["norm_in"][2 * i + 1] if norms[2 * i + 1] is not None else seen["mlp_in"][i]
                      for i in range(count)])  # fmt: skip
    extra = {}
    if outputs:
        extra["output_scale"] = torch.stack(
            [
                _inverse_scale(x, out[1], "rmsnorm").reshape(batch, tokens)
                for x, out in zip(seen["module_out"], outputs)
            ],
            dim=1,
        )
        extra["output_weight"] = torch.stack([_gain(out[1], "rmsnorm", d, stream.device) for out in outputs])
    inputs = MlpInputs(
        stream=stream,
        norm_scale=capture.norm_scale[:, :, 1],
        norm_weight=capture.norm_weight[:, 1],
        norm_bias=capture.norm_bias[:, 1],
        centred=capture.centred,
        mlp_out=capture.mlp_out,
        own_inputs={"mlp_input": module_input},
        **extra,
    )
    return replace_mlps(transcoders, inputs, stack.token_mask, check_tolerance(stack.computed_in), _WHERE, parallel)


# Families whose stream entering block 0 is the token embedding plus a learned position embedding
# (BERT's and RoBERTa's pass a LayerNorm after the sum, ViT's embeds patches: not split).
_ADDED_POSITION_FAMILIES = ("gpt2", "opt")


def _adds_positions_to_tokens(model: nn.Module) -> bool:
    """Whether the input embedding's output is added to the positions as it is: not through
    OPT-350m's ``project_in``, and not scaled (an ``embed_scale`` other than 1)."""
    decoder = getattr(model.base_model, "decoder", None)
    if getattr(decoder, "project_in", None) is not None:
        return False
    return float(getattr(decoder, "embed_scale", 1.0) or 1.0) == 1.0


def _check_query_key(capture: ResidualStreamCapture, stack: AttentionStack, where: str = _WHERE) -> None:
    """Refuse a score capture whose frozen maps do not rebuild the model's own queries and keys
    from the stream entering each layer (``hidden_states[l]``) through the frozen norm before its
    attention, to within :func:`check_tolerance` of the model's dtype."""

    def inputs(batch: int, layer: int) -> Tensor:  # [n, d]: one block's input, one at a time in float64
        stream = stack.hidden_states[layer, batch].to(capture.norm_scale.device, torch.float64)
        if capture.centred:
            stream = stream - stream.mean(-1, keepdim=True)
        return capture.norm_scale[batch, layer, 0, :, None] * stream * capture.norm_weight[layer, 0]

    real = torch.ones(stack.batch_size, stack.num_tokens, dtype=torch.bool, device=capture.norm_scale.device)
    if stack.token_mask is not None:
        real = stack.token_mask.to(real.device).bool()
    error = capture.query_key.reconstruction_error(inputs, capture.norm_bias[:, 0], real)
    _refuse_score_side(error, stack, "the frozen query and key maps rebuild the model's own queries and keys", where)


def _refuse_score_side(error: float, stack: AttentionStack, what: str, where: str) -> None:
    """Refuse a score capture where ``what`` (a check of it) holds only to ``error``, beyond
    :func:`check_tolerance` of the model's dtype (a NaN refuses too)."""
    tolerance = check_tolerance(stack.computed_in)
    if not error <= tolerance:
        raise ValueError(
            f"{where}: {what} only to {error:.2g} (relative), beyond the tolerance {tolerance:g}; this family's score "
            "side is not read correctly, so it is refused rather than decomposed"
        )


def pooled_tokens(model: nn.Module, input_ids: Tensor | None, batch: int, tokens: int) -> Tensor | None:
    """``[B]``: the token a Hugging Face sequence classifier's ``score`` head reads in each sequence,
    by its own rule: the rightmost token whose id is not the (text) config's ``pad_token_id``
    (whatever the attention mask says; 0 where every id is the pad id), or the last token where the
    model has no pad id or was given embeddings. None for any other model, a classifier without a
    ``score`` head among them (BERT's reads its pooler at the first token)."""
    if not type(model).__name__.endswith("ForSequenceClassification") or not isinstance(
        getattr(model, "score", None), nn.Linear
    ):
        return None
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    pad = getattr(config, "pad_token_id", None)
    if pad is None or not isinstance(input_ids, Tensor):
        return torch.full((batch,), tokens - 1, dtype=torch.long)
    ids = input_ids.detach().cpu().reshape(batch, tokens)
    return (torch.arange(tokens) * (ids != pad)).argmax(-1)


def output_embedding(model) -> tuple[Tensor | None, Tensor | None]:
    """``(W_U [vocab, d], b_U | None)`` of a Hugging Face model's LM head in the stream's space (OPT's
    ``project_out`` folded in), or ``(None, None)`` without one."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if head is None:
        return None, None
    weight = head.weight.detach()
    project = getattr(getattr(model.base_model, "decoder", None), "project_out", None)
    if project is not None:  # OPT: logits = project_out(N(x)) W_Uᵀ
        weight = weight @ project.weight.detach()
    return weight, None if head.bias is None else head.bias.detach()


def _gain(norm: nn.Module | None, kind: str, d: int, device) -> Tensor:
    """A Hugging Face norm's γ ``[d]`` in float64: an RMSNorm's as it computes it (Gemma's store
    ``γ − 1``), a LayerNorm's weight; 1 for no norm or a norm without parameters (OLMo's)."""
    gain = None
    if norm is not None:
        gain = rms_gain(norm) if kind == "rmsnorm" else getattr(norm, "weight", None)
    if gain is None:
        return torch.ones(d, dtype=torch.float64, device=device)
    return gain.detach().double()


def _shift(norm: nn.Module | None, kind: str, d: int, device) -> Tensor:
    """A LayerNorm's β ``[d]`` in float64; 0 for an RMSNorm, no norm or a norm without a bias."""
    bias = getattr(norm, "bias", None) if norm is not None and kind == "layernorm" else None
    if bias is None:
        return torch.zeros(d, dtype=torch.float64, device=device)
    return bias.detach().double()


def _attached(
    stack: AttentionStack, capture: ResidualStreamCapture, model: nn.Module, where: str
) -> tuple[AttentionStack, ResidualStreamCapture]:
    """``(stack, capture)`` with the capture's padded tokens zeroed and the capture attached to the
    stack as its ``residual_capture``; refused, in the caller's name, where a value the paths are
    made of is still NaN or inf (a model whose weights hold them): every path through it would be
    NaN, whether or not the capture is checked against the model."""
    if stack.token_mask is not None:
        capture = _zero_padded_tokens(capture, stack.token_mask)
    values = {field.name: getattr(capture, field.name) for field in fields(capture)}
    values |= {"w_v": stack.w_v, "w_o": stack.w_o}
    bad = [name for name, value in values.items() if isinstance(value, Tensor) and not all_finite(value)]
    if bad:
        parameters = [name for name, p in model.named_parameters() if not all_finite(p.detach())]
        raise ValueError(
            f"{where}: the capture holds NaN or inf in {', '.join(bad)} (at real tokens), so every path through "
            "them would be NaN; "
            + (
                f"the model's parameters hold NaN or inf ({', '.join(parameters[:3])}"
                + (f" and {len(parameters) - 3} more" if len(parameters) > 3 else "")
                + ")"
                if parameters
                else "the model's forward pass is not finite there"
            )
        )
    capture.model_fingerprint = weights_fingerprint(model)
    stack.residual_capture = capture
    return stack, capture


def _zero_padded_tokens(capture: ResidualStreamCapture, token_mask: Tensor) -> ResidualStreamCapture:
    """``capture`` with every per-token value of a padded token set to 0: a padded query's fully
    masked softmax can give NaN rows (Llama's in float64), which no real token reads but which
    would reach the real rows of a product as ``0 · NaN``."""
    padded = ~token_mask
    where = {  # each field's padded entries, broadcast to its shape
        "embedding": padded[:, :, None],  # [B, n, d]
        "token_embedding": padded[:, :, None],
        "residual": padded[:, :, None],
        "norm_scale": padded[:, None, None, :],  # [B, L, 2, n]
        "final_scale": padded,  # [B, n]
        "mlp_out": padded[:, None, :, None],  # [B, L, n, d]
        "attn_row_sums": padded[:, None, None, :],  # [B, L, H, n]
        "attention_output_scale": padded[:, None, :],  # [B, L, n]
    }
    fields = {}
    for name, mask in where.items():
        value = getattr(capture, name)
        if value is not None:
            fields[name] = value.masked_fill(mask.to(value.device), 0)
    return replace(capture, **fields)


# TransformerLens's normalisation types: (the capture's norm, whether it has γ, whether it has β).
_TL_NORMS = {
    "LN": ("layernorm", True, True),
    "LNPre": ("layernorm", False, False),  # γ and β folded into the weights after it
    "RMS": ("rmsnorm", True, False),
    "RMSPre": ("rmsnorm", False, False),
    None: ("none", False, False),
}


def capture_transformer_lens_residual(
    model,
    tokens=None,
    *,
    attention_mask=None,
    check: bool = True,
    query_key: bool = False,
    transcoders=None,
    progress: bool = False,
) -> tuple[AttentionStack, ResidualStreamCapture]:
    """:func:`capture_huggingface_residual` for a TransformerLens ``HookedTransformer`` (3.x) or
    ``TransformerBridge`` (4.x: over its native models or a Hugging Face one; the same hooks).

    One ``run_with_cache`` (eval mode, no gradients) gives the patterns and, from TransformerLens's
    own hooks, every norm's ``hook_scale`` (``σ_t``, so ``D = 1/σ``), the MLP outputs
    (``hook_mlp_out``), the stream entering the final norm and the embedding (``hook_resid_pre`` of
    block 0, positions included); γ and β come from ``ln1``/``ln2``/``ln_final`` (``LN``, ``RMS``;
    ``LNPre``/``RMSPre`` models have them folded into the weights after, and no norm is the
    identity), the unembedding from ``W_U``/``b_U``. Attention-only models have no MLP sources.
    Grouped-query models and rotary positions change nothing. A float64 model's steps that compute
    in float32 (4.x's native RMSNorms, a bridged Hugging Face model's softmax and RMSNorms) run in
    float64 for this pass, as in :func:`capture_huggingface_residual`; Gemma-style norms, which
    compute ``x̂ · (1 + w)``, are read as such; ``final_rms`` (an RMSNorm before the unembedding of
    a LayerNorm model) is read as it is. Parallel blocks (``parallel_attn_mlp``: the MLP reads the
    block's input) give the same frozen paths. RMSNorms on a sublayer's output (Gemma-2's
    ``use_normalization_before_and_after``, ``ln1_post``/``ln2_post``; OLMo 2's post-norm blocks)
    scale each head's term and the sublayer's constants on both sides, ``D' · (⋯) · Γ'``; a
    LayerNorm there is refused by name. The capture checks itself against the model's own forward
    pass, as :func:`capture_huggingface_residual` does (``check``). ``query_key=True`` also reads the
    score side (:class:`~pathkernels.adapters.query_key.QueryKeyCapture`) of a HookedTransformer, a
    4.x TransformerBridge over TransformerLens's native model, or a bridge over a Hugging Face model
    of :data:`~pathkernels.adapters.query_key.QUERY_KEY_FAMILIES`: ``W_Q``, ``W_K``, their biases,
    the scaling, rotary positions (either pairing, partial; a bridge's from the ``hook_cos``/``hook_sin``
    its attention was handed), query/key RMSNorms (frozen at their ``hook_scale``), the soft cap and
    ALiBi (its bias, a term per pair of tokens), checked against the queries and keys its hooks
    report and (but for a native bridge) the scores its ``hook_attn_scores`` report; what it does
    not read is refused by name. ``transcoders``: each MLP of the set's layers replaced by its
    transcoder, as in :func:`capture_huggingface_residual` (the stream entering the MLP's norm from
    ``hook_resid_mid``, or a parallel block's input from ``hook_resid_pre`` where the block fires no
    ``hook_resid_mid``; the set's input checked against ``ln2.hook_normalized`` where it reads that;
    a bridge whose blocks share one norm before the attention and the MLP, as over Phi, Falcon or
    GPT-J, is refused by name: capture the Hugging Face model itself). ``progress=True`` shows its
    steps as they come (the forward pass, the frozen maps, the self-check).
    """
    where = "pathkernels.adapters.capture_transformer_lens_residual"
    progress = check_flag(progress, "progress", where)
    bar = progress_bar(3, enabled=progress, unit="step", desc=where)  # closed at the end, as above

    def step(name: str, first: bool = False) -> None:  # the step ``name`` starts, the one before it done
        if bar is not None:
            bar.update(0 if first else 1)
            bar.set_postfix_str(name)

    model, tokens, given_cache = model_and_cache(model, tokens, where)
    check = check_flag(check, "check", where)
    query_key = check_flag(query_key, "query_key", where)
    if query_key:
        _check_transformer_lens_query_key(model, where)
    warn_if_training(model, where)
    cfg = getattr(model, "cfg", None)
    if cfg is None or not hasattr(model, "run_with_cache"):
        raise TypeError(
            f"{where}: expected a TransformerLens HookedTransformer or TransformerBridge, got {type(model).__name__}"
        )
    if cfg.normalization_type not in _TL_NORMS:
        raise ValueError(f"{where}: normalization_type {cfg.normalization_type!r} is not captured")
    original = model.__dict__.get("original_model") if hasattr(model, "__dict__") else None
    clip = getattr(cfg, "clip_qkv", None) or getattr(getattr(original, "config", None), "clip_qkv", None)
    if clip is not None:
        raise ValueError(
            f"{where}: clip_qkv={clip} clamps the queries, keys and values, so a head is not linear in its input "
            "and the paths would not sum to the model's stream; not captured"
        )
    inputs, outputs = _tl_sublayer_norms(model, cfg, where)
    if transcoders is not None:
        if cfg.attn_only:
            raise ValueError(f"{where}: transcoders replace a model's MLPs; this model is attention-only")
        check_replaceable(transcoders, cfg.n_layers, cfg.d_model, where)
    if given_cache is None:
        if tokens is None:
            raise ValueError(f"{where}: expected tokens to run the model on, or the ActivationCache of a run")
        tokens = check_tokens(model, tokens, where)
    norm, has_weight, has_bias = _TL_NORMS[cfg.normalization_type]
    # TransformerLens's final_rms: an RMSNorm (with γ unless the weights are folded) before the
    # unembedding of a LayerNorm model.
    final_norm = "rmsnorm" if norm == "layernorm" and getattr(cfg, "final_rms", False) else None
    layers, attn_only = cfg.n_layers, bool(cfg.attn_only)
    normed = norm != "none"
    names = {f"blocks.{layer}.attn.hook_pattern" for layer in range(layers)}
    names |= {f"blocks.{layer}.hook_resid_pre" for layer in range(layers)} | {f"blocks.{layers - 1}.hook_resid_post"}
    sublayer_norms = [name for name in (*inputs, *(outputs or ())) if name is not None]
    sublayer_norms = sublayer_norms if not attn_only else [name for name in sublayer_norms if name.startswith("ln1")]
    if normed:
        names |= {f"blocks.{layer}.{ln}.hook_scale" for layer in range(layers) for ln in sublayer_norms}
        names |= {"ln_final.hook_scale"}
    if not attn_only:
        names |= {f"blocks.{layer}.hook_mlp_out" for layer in range(layers)}
    # Hooks a block may not fire, read where it does: a parallel block's hook_resid_mid (3.x's
    # parallel_attn_mlp and bridges over parallel models never fire it), the MLP's norm's output (a
    # model without norms, or a bridge whose blocks share one norm, has none): checked below by name.
    optional = set()
    if transcoders is not None:
        names |= {f"blocks.{layer}.hook_resid_mid" for layer in range(layers)}
        if getattr(cfg, "parallel_attn_mlp", False):
            optional |= {f"blocks.{layer}.hook_resid_mid" for layer in range(layers)}
        if inputs[1] is not None:
            normalized = {f"blocks.{layer}.{inputs[1]}.hook_normalized" for layer in range(layers)}
            names |= normalized
            optional |= normalized
    split = cfg.positional_embedding_type == "standard"  # resid_pre of block 0 = hook_embed + hook_pos_embed
    if split:
        names |= {"hook_embed"}
    if query_key:
        names |= {f"blocks.{layer}.attn.{name}" for layer in range(layers) for name in _score_hooks(model)}
        if _query_key_norms(model):
            names |= {f"blocks.{layer}.attn.{n}_norm.hook_scale" for layer in range(layers) for n in ("q", "k")}
    step("the forward pass", first=True)
    if given_cache is None:
        cache = run_cached(model, tokens, names, attention_mask)
    else:
        cache = given_cache
        missing = sorted(names - optional - set(cache.keys()))
        if missing:
            raise ValueError(
                f"{where}: the ActivationCache lacks {len(missing)} of the {len(names)} hooks the capture reads "
                f"(e.g. {missing[0]}); make it with model.run_with_cache(tokens) and no names_filter, or pass the "
                "tokens instead"
            )
    require_patterns(model, cache, where)
    step("the frozen maps")
    stack = from_transformer_lens(cache, attention_mask=attention_mask)
    batch, tokens_n, d = stack.attn.shape[0], stack.attn.shape[-1], stack.d_model
    ones = torch.ones(batch, tokens_n, dtype=torch.float64, device=stack.attn.device)

    def inverse_scale(name: str) -> Tensor:
        return 1.0 / cache[name].double().reshape(batch, tokens_n) if name in cache else ones

    def parameter(module_name: str, attribute: str, present: bool, fill: float) -> Tensor:
        module = model
        for part in module_name.split("."):
            module = getattr(module, part, None) if not part.isdigit() else module[int(part)]
        if present and module is not None and hasattr(module, attribute):
            value = getattr(module, attribute).detach().double()
            return value + 1 if attribute == "w" and _uses_weight_offset(module, cfg) else value
        return torch.full((d,), fill, dtype=torch.float64, device=stack.attn.device)

    def per_layer(ln: str | None, make) -> Tensor:  # [L, ...] of one norm slot, its value or the identity's
        return torch.stack([make(None if ln is None else f"blocks.{layer}.{ln}") for layer in range(layers)])

    def scale_of(name):
        return ones if name is None else inverse_scale(f"{name}.hook_scale")

    def weight_of(name):
        return parameter(name or "", "w", has_weight and name is not None, 1.0)

    def bias_of(name):
        return parameter(name or "", "b", has_bias and name is not None, 0.0)

    with torch.no_grad():
        first, second = inputs[0], inputs[1] if not attn_only else inputs[0]  # attention-only: one norm
        scales = torch.stack([per_layer(first, scale_of), per_layer(second, scale_of)], 1).permute(2, 0, 1, 3)
        weights = torch.stack([per_layer(first, weight_of), per_layer(second, weight_of)], 1)  # [L, 2, d]
        biases = torch.stack([per_layer(first, bias_of), per_layer(second, bias_of)], 1)
        extra = {}
        if outputs is not None:  # an RMSNorm on the attention's output (the MLP's is in hook_mlp_out)
            extra = {
                "attention_output_scale": per_layer(outputs[0], scale_of).permute(1, 0, 2),  # [B, L, n]
                "attention_output_weight": per_layer(outputs[0], lambda name: parameter(name, "w", True, 1.0)),
            }
        heads = stack.num_heads
        b_v, b_o = _bias(model, "b_V"), _bias(model, "b_O")
        value_bias = (
            torch.zeros(layers, heads, stack.d_head, dtype=torch.float64)
            if b_v is None
            else _per_query_head(b_v, heads, "b_V").double()
        )
        output_bias = torch.zeros(layers, d, dtype=torch.float64) if b_o is None else b_o.double()
        embedding = cache["blocks.0.hook_resid_pre"].double()
        mlp_out = (
            torch.zeros(batch, layers, tokens_n, d, dtype=torch.float64)
            if attn_only
            else torch.stack([cache[f"blocks.{layer}.hook_mlp_out"].double() for layer in range(layers)], dim=1)
        )
        capture = ResidualStreamCapture(
            layout="pre",
            norm=norm,
            embedding=embedding,
            norm_scale=scales,
            norm_weight=weights,
            norm_bias=biases,
            value_bias=value_bias,
            output_bias=output_bias,
            mlp_out=mlp_out,
            residual=cache[f"blocks.{layers - 1}.hook_resid_post"].double(),
            attn_row_sums=(
                None
                if stack.attn_precision is None  # else the stack's rows are renormalised: keep the model's sums
                else torch.stack([cache[f"blocks.{layer}.attn.hook_pattern"] for layer in range(layers)], 1)
                .double()
                .sum(-1)
            ),
            final_scale=inverse_scale("ln_final.hook_scale"),
            final_weight=parameter("ln_final", "w", has_weight and normed, 1.0),
            final_bias=parameter("ln_final", "b", has_bias and final_norm is None, 0.0),
            unembedding=model.W_U.detach().T,
            unembedding_bias=None if getattr(model, "b_U", None) is None else model.b_U.detach(),
            final_norm=final_norm,
            token_embedding=cache["hook_embed"].double() if split and "hook_embed" in cache else None,
            input_ids=tokens.detach().cpu() if isinstance(tokens, Tensor) else None,
            **extra,
        )
        if query_key:
            capture.query_key = _transformer_lens_query_key(model, cfg, cache, stack, attention_mask)
            if not _native_bridge(model):  # (a native bridge's hook_attn_scores holds its pattern)
                _check_transformer_lens_scores(capture.query_key, cache, stack, where)
        if transcoders is not None:
            mlp_norm, mlp_output_norm = inputs[1], None if outputs is None else outputs[1]

            def stacked(hook: str) -> Tensor:  # [B, L, n, d] of a hook in every block
                return torch.stack([cache[f"blocks.{layer}.{hook}"].double() for layer in range(layers)], dim=1)

            if normed and f"blocks.0.{mlp_norm}.hook_scale" not in cache:
                raise ValueError(
                    f"{where}: this model's blocks read one norm before both the attention and the MLP ({mlp_norm} "
                    "is never run: a TransformerLens bridge over Phi, Falcon or GPT-J), which the capture does not "
                    "read as the MLP's input for transcoders; capture the Hugging Face model itself "
                    "(capture_huggingface_residual(model, transcoders=...))"
                )
            reads_norm = mlp_norm is not None and f"blocks.0.{mlp_norm}.hook_normalized" in cache
            own = {"mlp_input_before_gain": stacked(f"{mlp_norm}.hook_normalized")} if reads_norm else {}
            extra = {}
            if mlp_output_norm is not None:  # an RMSNorm on the MLP's output (ln2_post): hook_mlp_out is after it
                extra["output_scale"] = per_layer(mlp_output_norm, scale_of).permute(1, 0, 2)
                extra["output_weight"] = per_layer(mlp_output_norm, lambda name: parameter(name, "w", True, 1.0))
            # The MLP reads the block's input (3.x's parallel_attn_mlp, which has no hook_resid_mid; 4.x's
            # HookedTransformer runs the flag's blocks sequentially, through hook_resid_mid).
            parallel = bool(getattr(cfg, "parallel_attn_mlp", False)) and "blocks.0.hook_resid_mid" not in cache
            if not parallel and "blocks.0.hook_resid_mid" not in cache:
                raise ValueError(
                    f"{where}: the ActivationCache lacks blocks.0.hook_resid_mid, which the transcoders read (the "
                    "stream entering each MLP); make it with model.run_with_cache(tokens) and no names_filter"
                )
            mlp_inputs = MlpInputs(
                stream=stacked("hook_resid_pre" if parallel else "hook_resid_mid"),
                norm_scale=capture.norm_scale[:, :, 1],
                norm_weight=capture.norm_weight[:, 1],
                norm_bias=capture.norm_bias[:, 1],
                centred=capture.centred,
                mlp_out=capture.mlp_out,
                own_inputs=own,
                **extra,
            )
            tolerance = check_tolerance(stack.computed_in)
            capture.transcoders = replace_mlps(transcoders, mlp_inputs, stack.token_mask, tolerance, where, parallel)
    stack, capture = _attached(stack, capture, model, where)
    if query_key:
        _check_query_key(capture, stack, where)
    step("the self-check")
    if check:
        capture.check = (
            check_transformer_lens_capture(model, tokens, attention_mask, stack, capture, where)
            if given_cache is None
            else check_cached_capture(model, cache, stack, capture, where)
        )
    step("done")
    if bar is not None:
        bar.close()
    return stack, capture


def _check_transformer_lens_query_key(model, where: str) -> None:
    """Refuse, by name, what ``query_key=True`` does not read of a TransformerLens model."""
    cfg = model.cfg
    if type(model).__name__ != "HookedTransformer" and not _native_bridge(model) and not _hugging_face_bridge(model):
        raise ValueError(
            f"{where}: query_key=True reads a HookedTransformer's queries and keys, and a TransformerBridge's over "
            f"TransformerLens's native model or a Hugging Face one; not a {type(model).__name__}"
        )
    if _hugging_face_bridge(model):
        _check_hugging_face_bridge_query_key(model, where)
    if _query_key_norms(model) and cfg.positional_embedding_type != "rotary":
        raise ValueError(
            f"{where}: query_key=True reads query/key norms of models with rotary positions (its hooks hold the "
            f"normed queries after the rotation only); not with {cfg.positional_embedding_type!r} positions"
        )
    unread = {
        "use_logn_attn": "logn attention scaling",
        "use_attention_sinks": "attention sinks",
        "use_dynamic_ntk_rope": "dynamic NTK rotary positions",
    }
    if _hugging_face_bridge(model):
        unread |= _BRIDGE_UNREAD
    for flag, what in unread.items():
        if getattr(cfg, flag, False):
            raise ValueError(f"{where}: query_key=True does not read {what} ({flag}) yet")
    if cfg.positional_embedding_type not in ("standard", "rotary", "shortformer", "alibi"):
        raise ValueError(
            f"{where}: query_key=True does not read {cfg.positional_embedding_type!r} positions (a bias added to "
            "the scores) yet"
        )


def _check_transformer_lens_scores(query_key: QueryKeyCapture, cache, stack: AttentionStack, where: str) -> None:
    """Refuse a score capture whose queries and keys, scaling, bias and cap do not give the scores
    the model's ``hook_attn_scores`` report (to :func:`check_tolerance` of its dtype)."""
    layers = query_key.w_q.shape[0]
    scores = torch.stack([cache[f"blocks.{layer}.attn.hook_attn_scores"] for layer in range(layers)], 1)
    what = "the captured queries and keys, scaling and position terms give the model's own scores (hook_attn_scores)"
    _refuse_score_side(query_key.score_error(scores), stack, what, where)


# A TransformerBridge's options that change the queries or keys beside its hooks: not read.
_BRIDGE_UNREAD = {
    "qk_norm_after_rope": "query/key norms after the rotation",
    "gated_q_proj": "gated query projections",
    "use_split_qkv_input": "split query/key/value inputs",
    "use_attn_in": "per-head attention inputs",
}


def _check_hugging_face_bridge_query_key(model, where: str) -> None:
    """Refuse, by name, a TransformerBridge over a Hugging Face family whose score side is not read
    (its options are refused with the others: :data:`_BRIDGE_UNREAD`). TransformerLens itself
    refuses a model whose query/key norms its bridge does not apply, Phi's ``qk_layernorm`` among
    them."""
    family = model.original_model.config.model_type
    if family not in QUERY_KEY_FAMILIES:
        raise ValueError(
            f"{where}: query_key=True reads bridges over Hugging Face {', '.join(QUERY_KEY_FAMILIES)} models; "
            f"not over {family!r}"
        )


def _rotary_bridge(model) -> bool:
    """Whether ``model`` is a TransformerBridge over a rotary Hugging Face model: its attention
    hands each layer the model's own ``(cos, sin)`` through ``hook_cos``/``hook_sin``."""
    return (
        _hugging_face_bridge(model)
        and model.cfg.positional_embedding_type == "rotary"
        and hasattr(model.blocks[0].attn, "hook_cos")
    )


def _score_hooks(model) -> tuple[str, ...]:
    """The hooks a TransformerLens model's score side is read from: its queries and keys as its
    attention uses them (after the rotation where its hooks have them) and its scores. A bridge
    over a rotary Hugging Face model fires ``hook_rot_q``/``hook_rot_k`` where its attention
    rotates them itself; a fused-projection one (GPT-NeoX's) only ``hook_q``/``hook_k`` and the
    rotation it hands its own ``_apply_rotary_pos_emb``."""
    if _rotary_bridge(model):
        return ("hook_rot_q", "hook_rot_k", "hook_q", "hook_k", "hook_cos", "hook_sin", "hook_attn_scores")
    if _hugging_face_bridge(model):
        return ("hook_q", "hook_k", "hook_attn_scores")
    rotary = model.cfg.positional_embedding_type == "rotary" and not _native_bridge(model)
    return ("hook_rot_q", "hook_rot_k", "hook_attn_scores") if rotary else ("hook_q", "hook_k", "hook_attn_scores")


def _query_key_norms(model) -> bool:
    """Whether a TransformerLens model's attention has query/key norms (per head, or over every head:
    its OLMo 2 architecture)."""
    attention = model.blocks[0].attn
    return getattr(attention, "q_norm", None) is not None


def _transformer_lens_norm_scales(model, cache, layers: int, heads: int, batch: int, tokens: int, which: str):
    """``(1/σ [B, L, H, n], γ [L, H, e])`` of the query (``which="q_norm"``) or key norms, from their
    ``hook_scale`` (σ per token, per head or over every head) and weights; ones without norms."""
    attention = [block.attn for block in model.blocks]
    head_dim = attention[0].W_Q.shape[-1]
    if not _query_key_norms(model):
        ones = torch.ones(batch, layers, heads, tokens, dtype=torch.float64)
        return ones, torch.ones(layers, heads, head_dim, dtype=torch.float64)
    scales, gains = [], []
    for layer, a in enumerate(attention):
        norm = getattr(a, which)
        sigma = cache[f"blocks.{layer}.attn.{which}.hook_scale"].double()  # [B, n, (heads,) 1]
        if getattr(a, "_qk_norm_phase", None) == "post_reshape" and not getattr(a, "_qk_norm_per_head", False):
            inverse = (1.0 / sigma).reshape(batch, -1, tokens)  # a bridge norms [B, H, n, e]: [B, heads, n]
        else:
            inverse = (1.0 / sigma).reshape(batch, tokens, -1).transpose(1, 2)  # [B, count or 1, n]
        weight = getattr(norm, "w", None)
        gain = (
            torch.ones(inverse.shape[1] * head_dim, dtype=torch.float64) if weight is None else weight.detach().double()
        )
        if weight is not None and _uses_weight_offset(norm, model.cfg):
            gain = gain + 1
        count = gain.numel() // head_dim if gain.numel() > head_dim else inverse.shape[1]
        gain = gain.reshape(-1, head_dim).expand(count, head_dim)
        inverse = inverse.expand(batch, count, tokens)
        if count != heads:
            inverse, gain = inverse.repeat_interleave(heads // count, 1), gain.repeat_interleave(heads // count, 0)
        scales.append(inverse)
        gains.append(gain)
    return torch.stack(scales, 1), torch.stack(gains)


def _hugging_face_bridge(model) -> bool:
    """Whether ``model`` is a TransformerBridge over a Hugging Face model (its attention components
    wrap the model's own attention modules, whose ``scaling`` they use)."""
    original = model.__dict__.get("original_model") if hasattr(model, "__dict__") else None
    return (
        type(model).__name__ == "TransformerBridge"
        and original is not None
        and type(original).__module__.startswith("transformers.")
        and hasattr(getattr(model.blocks[0].attn, "original_component", None), "scaling")
    )


def _native_bridge(model) -> bool:
    """Whether ``model`` is a TransformerLens 4.x bridge over its native model (NativeAttention)."""
    blocks = getattr(model, "blocks", None)
    try:
        attention = blocks[0].attn.original_component
    except (AttributeError, IndexError, TypeError):
        return False
    return type(model).__name__ == "TransformerBridge" and type(attention).__name__ == "NativeAttention"


def _transformer_lens_query_key(model, cfg, cache, stack: AttentionStack, attention_mask) -> QueryKeyCapture:
    """A TransformerLens model's score side from its weights and, for the check, its own queries,
    keys and scores in ``cache``: ``W_Q``, ``W_K`` ``[L, H, d, e]`` (grouped keys repeated),
    ``b_Q``, ``b_K`` (zeros where a bridge has none), the scaling per layer, and its rotary angles
    at each token's position (a HookedTransformer's at ``attention_mask``'s offsets, as its
    ``apply_rotary`` takes them; a native bridge's at 0 … n−1; a bridge over a Hugging Face model's
    as its hooks report them)."""
    layers, heads = cfg.n_layers, cfg.n_heads
    batch, tokens = stack.attn.shape[0], stack.attn.shape[-1]
    device = stack.attn.device

    def per_query_head(t: Tensor) -> Tensor:
        return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], 1)

    native, bridged, rotary_bridge = _native_bridge(model), _hugging_face_bridge(model), _rotary_bridge(model)
    attention = [block.attn for block in model.blocks]
    w_q = torch.stack([a.W_Q.detach() for a in attention]).double()
    w_k = per_query_head(torch.stack([a.W_K.detach() for a in attention]).double())

    def bias(a, name: str, like: Tensor) -> Tensor:  # a bridge over a model without them holds None
        value = getattr(a, name, None)
        return torch.zeros(like.shape[::2], dtype=like.dtype) if value is None else value.detach()

    b_q = torch.stack([bias(a, "b_Q", a.W_Q) for a in attention]).double()
    b_k = per_query_head(torch.stack([bias(a, "b_K", a.W_K) for a in attention]).double())
    hooks = _score_hooks(model)
    rotary = cfg.positional_embedding_type == "rotary" and not bridged
    # A native bridge's positions are 0 … n−1 whatever the mask; a HookedTransformer's rotary
    # offsets a left-padded row's real tokens to start at 0 (a Hugging Face bridge hands its own).
    positions = torch.arange(tokens, device=device).expand(batch, tokens)
    if rotary and attention_mask is not None and not native:
        positions = (attention_mask.to(device).long().cumsum(1) - 1).clamp_min(0)
    cos = sin = None
    if rotary_bridge:  # as its attention rotated them, with the (cos, sin) it was handed
        queries, keys, cos, sin = _bridge_rotated_sides(attention, cache, batch)
    else:
        own = [  # [B, L, n, H, e]
            torch.stack([cache[f"blocks.{layer}.attn.{name}"] for layer in range(layers)], 1).double()
            for name in hooks[:2]
        ]
        queries, keys = (t.permute(0, 1, 3, 2, 4) for t in own)  # [B, L, H, n, e]
    if native and rotary:  # its hooks hold them before the rotation: rotated by its own function
        turned = [
            a.original_component.rotary.apply_rope(queries[:, i], keys[:, i], position_ids=positions)
            for i, a in enumerate(attention)
        ]
        queries, keys = (torch.stack(parts, 1) for parts in zip(*turned))
    keys = keys if keys.shape[2] == heads else keys.repeat_interleave(heads // keys.shape[2], 2)
    if native:  # its hook_attn_scores holds the pattern: the pairs it allows are causal and real
        causal = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()
        real = (
            torch.ones(batch, tokens, dtype=torch.bool, device=device)
            if attention_mask is None
            else (attention_mask.to(device).bool())
        )
        allowed = (causal[None] & real[:, None, :])[:, None].expand(batch, layers, tokens, tokens)
    else:
        scores = torch.stack([cache[f"blocks.{layer}.attn.hook_attn_scores"] for layer in range(layers)], 1)
        allowed = (scores.double() > -1e30).all(2)  # masked pairs hold -inf: [B, L, n, n]
    if rotary:
        tables = [
            (a.original_component.rotary.cos_cached, a.original_component.rotary.sin_cached)
            if native
            else (a.rotary_cos, a.rotary_sin)
            for a in attention
        ]
        cos = torch.stack([c.detach().double()[positions] for c, _ in tables], 1)  # [B, L, n, r]
        sin = torch.stack([s.detach().double()[positions] for _, s in tables], 1)
    if bridged:
        scale = [1.0 / a.original_component.scaling for a in attention]
    else:
        scale = [a.original_component.scale if native else a.attn_scale for a in attention]
    query_scale, query_gain = _transformer_lens_norm_scales(model, cache, layers, heads, batch, tokens, "q_norm")
    key_scale, key_gain = _transformer_lens_norm_scales(model, cache, layers, heads, batch, tokens, "k_norm")
    cap = float(getattr(cfg, "attn_scores_soft_cap", -1.0) or -1.0)
    position_bias = None
    if cfg.positional_embedding_type == "alibi":  # its own bias, as its forward left it cached [H, n', n']
        bias = torch.stack([a.alibi.detach()[:, -tokens:, :tokens] for a in attention]).double().to(device)
        position_bias = bias[None].expand(batch, -1, -1, -1, -1)
    return QueryKeyCapture(
        w_q=w_q,
        b_q=b_q,
        w_k=w_k,
        b_k=b_k,
        query_scale=query_scale.to(device),
        key_scale=key_scale.to(device),
        query_gain=query_gain.to(device),
        key_gain=key_gain.to(device),
        scaling=torch.tensor([1.0 / float(value) for value in scale], dtype=torch.float64),
        allowed=allowed,
        soft_cap=torch.full((layers,), max(cap, 0.0), dtype=torch.float64),
        queries=queries,
        keys=keys,
        cos=cos,
        sin=sin,
        interleaved=native or bool(getattr(cfg, "rotary_adjacent_pairs", False)),  # native: adjacent pairs
        position_bias=position_bias,
    )


def _bridge_rotated_sides(attention, cache, batch: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(queries, keys [B, L, H(_kv), n, e], cos, sin [B, L, n, r])`` of a bridge over a rotary
    Hugging Face model, as its attention rotated them: ``hook_rot_q``/``hook_rot_k`` where they
    fire, else ``hook_q``/``hook_k`` turned by the bridge's own ``_apply_rotary_pos_emb`` (its
    fused-projection attention, GPT-NeoX's), with the ``hook_cos``/``hook_sin`` it was handed."""
    queries, keys, cos, sin = [], [], [], []
    for layer, a in enumerate(attention):
        hook = f"blocks.{layer}.attn."
        turn = [cache[hook + name].double() for name in ("hook_cos", "hook_sin")]
        turn = [t.expand(batch, *t.shape[1:]) for t in turn]  # [B, n, r]
        if hook + "hook_rot_q" in cache:
            query, key = (cache[hook + name].double().transpose(1, 2) for name in ("hook_rot_q", "hook_rot_k"))
        else:
            query, key = (cache[hook + name].double().transpose(1, 2) for name in ("hook_q", "hook_k"))
            query, key = a._apply_rotary_pos_emb(query, key, *turn)
        queries.append(query)
        keys.append(key)
        cos.append(turn[0])
        sin.append(turn[1])
    return torch.stack(queries, 1), torch.stack(keys, 1), torch.stack(cos, 1), torch.stack(sin, 1)


def _uses_weight_offset(norm, cfg) -> bool:
    """Whether a TransformerLens norm computes ``x̂ · (1 + w)`` (Gemma-style norms store γ as an offset
    from 1) rather than ``x̂ · w``: read from the norm's own output on a probe, the ratio of its
    output (less its bias) to the normalised probe compared with ``w`` and ``1 + w``. Flags can be
    wrong: a 4.x native bridge built with ``rmsnorm_uses_offset=True`` says ``uses_weight_offset``
    while its norms compute ``x̂ · w``, which made the value twice the model's. Where the output
    matches neither (a norm of another form), the flags decide: 4.x bridges say so per norm
    (``uses_weight_offset``), 3.x bridges apply the config's ``rmsnorm_uses_offset`` to every norm
    they wrap, and a HookedTransformer's own norms hold γ itself."""
    weight = getattr(norm, "w", None)
    if isinstance(weight, Tensor) and weight.dim() == 1:
        measured = _measured_gain(norm, weight)
        if measured is not None:
            gain, scale = measured
            plain = float((gain - weight.double()).abs().max())
            offset = float((gain - 1 - weight.double()).abs().max())
            if min(plain, offset) <= 1e-3 * scale:
                return offset < plain
    flag = getattr(norm, "uses_weight_offset", None)
    if flag is not None:
        return bool(flag)
    return hasattr(norm, "original_component") and bool(getattr(cfg, "rmsnorm_uses_offset", False))


def _measured_gain(norm, weight: Tensor) -> tuple[Tensor, float] | None:
    """``(γ [d], max |γ| + 1)`` of a norm from its output on a fixed probe: ``(N(x) − β) / x̂`` with
    ``x̂`` the probe centred (a LayerNorm) and divided by its root mean square; None where the norm
    cannot be called on it."""
    generator = torch.Generator().manual_seed(0)
    probe = torch.randn(1, 1, weight.shape[0], generator=generator, dtype=torch.float64)
    probe = (probe.sign() * (probe.abs() + 0.5)).to(weight.device, weight.dtype)  # no entry near 0
    centred = not _is_rms_norm(norm)
    try:
        with torch.no_grad():
            output = norm(probe).double().reshape(-1)
    except Exception:  # noqa: BLE001 (a norm that is not a plain module of the stream: the flags decide)
        return None
    x = probe.double().reshape(-1)
    x = x - x.mean() if centred else x
    normalised = x / x.pow(2).mean().sqrt()
    bias = getattr(norm, "b", None)
    if centred and isinstance(bias, Tensor):
        output = output - bias.detach().double().reshape(-1)
    if output.shape != normalised.shape or bool((normalised.abs() < 1e-3).any()):
        return None
    return output / normalised, float(weight.detach().double().abs().max()) + 1.0


# TransformerLens's post-norm decoders (OLMo 2 and 3): their ln1 and ln2 normalise each sublayer's
# output, not its input.
_TL_POST_NORM_ARCHITECTURES = ("Olmo2ForCausalLM", "Olmo3ForCausalLM")


def _tl_sublayer_norms(model, cfg, where: str) -> tuple[tuple[str | None, str | None], tuple[str, str] | None]:
    """The names of a TransformerLens block's norms: before its attention and its MLP (None: none),
    and on their outputs (None where there are none), as the blocks hold them: ``ln1``, ``ln2``
    before; ``ln1_post``, ``ln2_post`` after (Gemma-2's ``use_normalization_before_and_after``; a
    4.x bridge over OLMo 2 has only these); a 3.x OLMo 2 (HookedTransformer, or a bridge over the
    Hugging Face model) applies ``ln1`` and ``ln2`` after its sublayers instead. A norm after a
    sublayer must be an RMSNorm (a frozen diagonal on each side); others are refused by name."""
    blocks = list(getattr(model, "blocks", None) or [])
    has = lambda name: bool(blocks) and all(hasattr(block, name) for block in blocks)  # noqa: E731
    original = model.__dict__.get("original_model") if hasattr(model, "__dict__") else None
    original_config = getattr(original, "config", None)
    post_norm = type(model).__name__ == "HookedEncoder" or getattr(original_config, "model_type", None) in (
        "bert",
        "roberta",
    )
    if post_norm or getattr(original_config, "do_layer_norm_before", True) is False:
        raise ValueError(
            f"{where}: post-norm blocks (BERT's, OPT-350m's: a norm after each residual sum) are not captured "
            "through TransformerLens; capture the Hugging Face model itself (capture_huggingface_residual)"
        )
    # A HookedTransformer, or a bridge over a Hugging Face model (not over 4.x's native one, which
    # has no post-norm blocks).
    hugging_face = original is not None and type(original).__module__.startswith("transformers.")
    reads_post_norm = type(model).__name__ == "HookedTransformer" or hugging_face
    architecture = getattr(cfg, "original_architecture", None) or getattr(cfg, "architecture", None)
    if has("ln1_post"):
        inputs = ("ln1" if has("ln1") else None, "ln2" if has("ln2") else None)
        outputs = ("ln1_post", "ln2_post")
    elif architecture in _TL_POST_NORM_ARCHITECTURES and reads_post_norm:
        inputs, outputs = (None, None), ("ln1", "ln2")
    else:
        return ("ln1", "ln2"), None
    for block in blocks:
        for name in outputs:
            norm = getattr(block, name, None)
            if norm is not None and not _is_rms_norm(norm):
                raise ValueError(
                    f"{where}: the norm after a sublayer ({name}, {type(norm).__name__}) centres its input; only "
                    "RMSNorms after a sublayer are captured"
                )
    return inputs, outputs


def _is_rms_norm(norm) -> bool:
    """Whether a TransformerLens norm is an RMSNorm: its class says so, or a bridge's flag does."""
    flag = getattr(norm, "uses_rms_norm", None)
    return bool(flag) if flag is not None else "RMS" in type(norm).__name__


def _attention_biases(model: nn.Module, stack: AttentionStack) -> tuple[Tensor, Tensor]:
    """``(b_V [L, H, d_head], b_O [L, d])`` in float64, zeros where the model has none (grouped-query
    models repeat each key/value head's bias for the query heads that share it)."""
    value_biases, output_biases = [], []
    for layer in _attention_layers(model):
        _, _, b_v, b_out = _value_output(layer)
        value_biases.append(torch.zeros(stack.num_heads, stack.d_head) if b_v is None else b_v.detach())
        output_biases.append(torch.zeros(stack.d_model) if b_out is None else b_out.detach())
    return torch.stack([b.double() for b in value_biases]), torch.stack([b.double() for b in output_biases])
