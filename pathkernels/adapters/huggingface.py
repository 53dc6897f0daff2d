"""Hugging Face transformers: attention patterns and per-head value-output maps.

Supported families (``model.config.model_type``): GPT-2 (fused QKV in a Conv1D), BERT and RoBERTa,
ViT, and Llama-style decoders with grouped-query attention (Llama, Mistral, Qwen2). Each family is
a small table of where the layers, the attention module and the value and output projections
live; both Linear (``y = x Wᵀ + b``) and Conv1D (``y = x W + b``) layouts are read.

Attention is read by forward hooks on the attention modules, with the model switched to eager
attention for the call (SDPA and flash kernels return no weights) and restored after.
"""

from __future__ import annotations

import inspect
import os
import sys
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from pathkernels.adapters.capture import RecomputedPatterns
from pathkernels.adapters.naming import model_name
from pathkernels.adapters.precision import in_float64
from pathkernels.adapters.stack import AttentionStack, fold_value_bias
from pathkernels.core._progress import quiet_model_loading
from pathkernels.core.masking import check_token_mask

_WHERE = "pathkernels.adapters.from_huggingface"


@dataclass(frozen=True)
class _AttentionLayer:
    """Where one layer keeps what the adapter reads."""

    attention: nn.Module  # its forward returns (attn_output, attn_weights [B, H, n, n])
    value: nn.Module  # Linear or Conv1D whose output holds the values
    value_columns: slice | Tensor  # the value columns of its output (all unless QKV is fused): [kv_heads · d_head]
    output: nn.Module  # Linear or Conv1D: concatenated heads [H·d_head] -> d
    num_heads: int
    num_kv_heads: int
    head_dim: int


def _in_out(module: nn.Module, what: str) -> tuple[Tensor, Tensor | None]:
    """``(W [in, out], b [out] | None)`` of a Linear (weight [out, in]) or a Conv1D (weight [in, out])."""
    if type(module).__name__ == "Conv1D":
        return module.weight, module.bias
    if isinstance(module, nn.Linear):
        return module.weight.T, module.bias
    raise TypeError(f"{_WHERE}: expected the {what} projection to be nn.Linear or Conv1D, got {type(module).__name__}")


def _blocks(model, *paths: str) -> nn.ModuleList:
    """The model's list of transformer blocks: the first of ``paths`` (dotted) under base_model."""
    for path in paths:
        module = model.base_model
        for name in path.split("."):
            module = getattr(module, name, None)
        if isinstance(module, nn.ModuleList):
            return module
    raise ValueError(f"{_WHERE}: found no block list ({', '.join(paths)}) in {type(model).__name__}")


def _gpt2_layers(model, config) -> list[_AttentionLayer]:
    d, heads = config.hidden_size, config.num_attention_heads
    return [
        _AttentionLayer(block.attn, block.attn.c_attn, slice(2 * d, 3 * d), block.attn.c_proj, heads, heads, d // heads)
        for block in _blocks(model, "h")
    ]


def _bert_layers(model, config) -> list[_AttentionLayer]:
    d, heads = config.hidden_size, config.num_attention_heads
    return [
        _AttentionLayer(
            layer.attention.self,
            layer.attention.self.value,
            slice(None),
            layer.attention.output.dense,
            heads,
            heads,
            d // heads,
        )
        for layer in _blocks(model, "encoder.layer", "layer")
    ]


def _vit_layers(model, config) -> list[_AttentionLayer]:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    out = []
    for layer in _blocks(model, "layers", "encoder.layer"):  # transformers 5, 4
        block = layer.attention
        if hasattr(block, "v_proj"):  # transformers >= 5: one module holds q/k/v/o
            out.append(_AttentionLayer(block, block.v_proj, slice(None), block.o_proj, heads, heads, head_dim))
        else:  # transformers 4: ViTAttention(attention=ViTSelfAttention, output=ViTSelfOutput)
            out.append(
                _AttentionLayer(
                    block.attention, block.attention.value, slice(None), block.output.dense, heads, heads, head_dim
                )
            )
    return out


def _llama_layers(model, config) -> list[_AttentionLayer]:
    return _self_attention_layers(_blocks(model, "layers"), "self_attn", "v_proj", "o_proj", config)


def _fused_value_columns(layout: str, heads: int, kv_heads: int, head_dim: int) -> Tensor:
    """The value columns, kv head by kv head, of a fused query-key-value projection's output:
    - ``"per_head"`` (GPT-NeoX, Falcon without multi-query): per head ``[q | k | v]``;
    - ``"per_group"`` (Falcon's new decoder architecture): per kv group ``[q_1 … q_g | k | v]``;
    - ``"multi_query"`` (Falcon-7B): ``[q_1 … q_H | k | v]``, one key/value head."""
    step = torch.arange(head_dim)
    if layout == "per_head":
        starts = torch.arange(heads) * 3 + 2
    elif layout == "per_group":
        per_group = heads // kv_heads + 2
        starts = torch.arange(kv_heads) * per_group + per_group - 1
    else:
        starts = torch.tensor([heads + 1])
    return (starts[:, None] * head_dim + step[None, :]).reshape(-1)


def _self_attention_layers(blocks, attention: str, value: str, output: str, config, kv_heads=None, head_dim=None):
    """Layers whose attention module ``block.<attention>`` holds separate ``value`` and ``output``
    projections (OPT, GPT-J, Phi, OLMo and the Llama-style families)."""
    heads = config.num_attention_heads
    kv_heads = kv_heads or getattr(config, "num_key_value_heads", None) or heads
    head_dim = head_dim or getattr(config, "head_dim", None) or config.hidden_size // heads
    out = []
    for block in blocks:
        module = getattr(block, attention)
        out.append(
            _AttentionLayer(
                module, getattr(module, value), slice(None), getattr(module, output), heads, kv_heads, head_dim
            )
        )
    return out


def _gpt_neox_layers(model, config) -> list[_AttentionLayer]:
    heads = config.num_attention_heads
    head_dim = config.hidden_size // heads
    columns = _fused_value_columns("per_head", heads, heads, head_dim)
    return [
        _AttentionLayer(
            layer.attention, layer.attention.query_key_value, columns, layer.attention.dense, heads, heads, head_dim
        )
        for layer in _blocks(model, "layers")
    ]


# What the adapters read of a Falcon attention module, in every transformers release they accept.
_FALCON_ATTRIBUTES = (
    "query_key_value",
    "dense",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "new_decoder_architecture",
    "multi_query",
)


def _falcon_layers(model, config) -> list[_AttentionLayer]:
    for block in _blocks(model, "h"):
        for name in _FALCON_ATTRIBUTES:
            getattr(block.self_attention, name)  # an AttributeError names what a release changed
    heads = config.num_attention_heads
    head_dim = config.hidden_size // heads
    if config.new_decoder_architecture:
        kv_heads, layout = config.num_kv_heads, "per_group"
    elif config.multi_query:
        kv_heads, layout = 1, "multi_query"
    else:
        kv_heads, layout = heads, "per_head"
    columns = _fused_value_columns(layout, heads, kv_heads, head_dim)
    return [
        _AttentionLayer(
            block.self_attention,
            block.self_attention.query_key_value,
            columns,
            block.self_attention.dense,
            heads,
            kv_heads,
            head_dim,
        )
        for block in _blocks(model, "h")
    ]


def _gptj_layers(model, config) -> list[_AttentionLayer]:
    heads = config.n_head
    return _self_attention_layers(
        _blocks(model, "h"), "attn", "v_proj", "out_proj", config, heads, config.n_embd // heads
    )


def _phi_layers(model, config) -> list[_AttentionLayer]:
    return _self_attention_layers(_blocks(model, "layers"), "self_attn", "v_proj", "dense", config)


def _opt_layers(model, config) -> list[_AttentionLayer]:
    heads = config.num_attention_heads
    return _self_attention_layers(
        _blocks(model, "decoder.layers", "layers"), "self_attn", "v_proj", "out_proj", config, heads
    )


def has_eager_attention_function(module: nn.Module) -> bool:
    """Whether the modeling module that defines ``module``'s class (a model or an attention layer)
    has transformers' shared ``eager_attention_forward``: every family's but Falcon's before
    transformers 5.25, whose attention computed its scores and softmax inline (in the model's
    dtype; the shared function takes the softmax in float32)."""
    return hasattr(sys.modules[type(module).__module__], "eager_attention_forward")


@dataclass(frozen=True)
class _Family:
    """What the adapter needs to know of one model family."""

    layers: Callable  # (model, config) -> list[_AttentionLayer]
    # Its eager attention takes the softmax in float32 whatever the model's dtype (the adapters
    # compute it in float64 for a float64 model: softmax_in_input_precision); a callable of the
    # model where that depends on the installed transformers.
    softmax_in_float32: bool | Callable[[nn.Module], bool]
    zero_based_positions: bool  # position_ids default to 0..n-1 (a left-padded sequence's must start at 0)


_FAMILIES: dict[str, _Family] = {
    "gpt2": _Family(_gpt2_layers, softmax_in_float32=False, zero_based_positions=True),
    "bert": _Family(_bert_layers, softmax_in_float32=False, zero_based_positions=True),
    "roberta": _Family(_bert_layers, softmax_in_float32=False, zero_based_positions=False),  # from input_ids
    "vit": _Family(_vit_layers, softmax_in_float32=True, zero_based_positions=False),
    "llama": _Family(_llama_layers, softmax_in_float32=True, zero_based_positions=True),
    "mistral": _Family(_llama_layers, softmax_in_float32=True, zero_based_positions=True),
    "qwen2": _Family(_llama_layers, softmax_in_float32=True, zero_based_positions=True),
    "qwen3": _Family(_llama_layers, softmax_in_float32=True, zero_based_positions=True),
    "gemma": _Family(_llama_layers, softmax_in_float32=True, zero_based_positions=True),
    "gemma2": _Family(_llama_layers, softmax_in_float32=True, zero_based_positions=True),
    "gemma3_text": _Family(_llama_layers, softmax_in_float32=True, zero_based_positions=True),
    "olmo": _Family(_llama_layers, softmax_in_float32=True, zero_based_positions=True),
    "olmo2": _Family(_llama_layers, softmax_in_float32=True, zero_based_positions=True),
    "gpt_neox": _Family(_gpt_neox_layers, softmax_in_float32=True, zero_based_positions=True),
    "gptj": _Family(_gptj_layers, softmax_in_float32=False, zero_based_positions=True),
    "phi": _Family(_phi_layers, softmax_in_float32=True, zero_based_positions=True),
    "falcon": _Family(_falcon_layers, softmax_in_float32=has_eager_attention_function, zero_based_positions=True),
    "opt": _Family(_opt_layers, softmax_in_float32=True, zero_based_positions=False),  # from attention_mask
}


def _family(model) -> _Family:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in _FAMILIES:
        raise ValueError(
            f"{_WHERE}: expected a transformers model of type {sorted(_FAMILIES)}, got "
            f"{type(model).__name__} (model_type {model_type!r})"
        )
    return _FAMILIES[model_type]


# The transformers releases whose modules the adapters are tested against (Makefile's constraints
# file pins the newest; `make test-newest` tries whatever is newer).
TESTED_TRANSFORMERS = "5.24 to 5.25"


def _attention_layers(model, where: str = _WHERE) -> list[_AttentionLayer]:
    family = _family(model)
    try:
        return family.layers(model, model.config)
    except AttributeError as error:  # a module renamed or restructured by another transformers release
        raise ValueError(changed_modules(model, error, where)) from error


def changed_modules(model, error: Exception, where: str = _WHERE) -> str:
    """The message for a model whose modules lack what the adapters read (``error``): the family,
    the installed transformers release and the tested ones."""
    return (
        f"{where}: this {model.config.model_type!r} model's modules lack what pathkernels reads ({error}); {releases()}"
    )


def releases() -> str:
    """The installed transformers release beside the tested ones, for refusals that a release's
    changed modules explain."""
    import transformers

    return (
        f"transformers {transformers.__version__} is installed and pathkernels is tested with transformers "
        f"{TESTED_TRANSFORMERS} (docs/BUILD.md)"
    )


def _position_limit(model) -> int | None:
    """The most tokens a model with learned absolute positions embeds (None: rotary, or no limit
    known): its position table's rows, but for RoBERTa, whose positions start after its padding
    index."""
    table = _position_table(model)
    if table is not None and model.config.model_type == "roberta":
        return table - (getattr(model.config, "pad_token_id", 1) or 0) - 1
    return table


def _position_table(model) -> int | None:
    """The rows of a model's learned position embedding that ``position_ids`` index (OPT adds its
    offset of 2 itself); None where positions are not looked up in a table (rotary, ALiBi, ViT)."""
    config = model.config
    if config.model_type == "gpt2":
        return getattr(config, "n_positions", None)
    if config.model_type in ("bert", "roberta", "opt"):
        return getattr(config, "max_position_embeddings", None)
    return None


def _forward_parameters(model) -> set[str]:
    """The names ``model.forward`` takes as named parameters (not those its ``**kwargs`` would
    swallow unread)."""
    parameters = inspect.signature(model.forward).parameters.values()
    return {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def input_batch_size(inputs: dict) -> int:
    """How many sequences (or images) ``inputs`` hold: the first axis of their ``input_ids``,
    ``inputs_embeds`` or ``pixel_values`` (not of another input, which may broadcast: a ``[1, n]``
    ``position_ids``)."""
    main = ("input_ids", "inputs_embeds", "pixel_values")
    return next(inputs[name].shape[0] for name in main if isinstance(inputs.get(name), Tensor))


def _check_inputs(model, inputs: dict, where: str) -> None:
    """Refuse, in the caller's name, inputs that the model would fail on with its own errors (an
    embedding's IndexError, a stack error) or run on to a wrong shape; and a model's output given
    as an input, saying why the model runs."""
    for name, value in inputs.items():
        if any(kind.__name__ == "ModelOutput" for kind in type(value).__mro__):
            raise ValueError(
                f"{where}: {name} is a model output; expected the model's inputs (input_ids=..., attention_mask=...). "
                "An output's hidden states do not hold what the capture reads (each norm's scale, each MLP's output, "
                "the patterns computed in float64), so the model runs once, in the capture"
            )
    if not any(isinstance(inputs.get(name), Tensor) for name in ("input_ids", "inputs_embeds", "pixel_values")):
        raise ValueError(
            f"{where}: expected input_ids [B, n] (or inputs_embeds [B, n, d], or pixel_values for ViT) as a "
            f"tensor among the inputs, got {sorted(inputs) or 'none'}"
        )
    mask = inputs.get("attention_mask")
    if mask is not None and not isinstance(mask, Tensor):
        raise TypeError(
            f"{where}: expected attention_mask to be a torch.Tensor [B, n] (1 = a real token) or None, got "
            f"{type(mask).__name__}"
        )
    for name in ("input_ids", "inputs_embeds", "pixel_values", "attention_mask", "position_ids"):
        value = inputs.get(name)
        if isinstance(value, Tensor) and value.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{where}: expected {name} on a CPU or CUDA device, got {value.device}")
        if isinstance(value, Tensor) and value.dim() >= 2 and 0 in value.shape[:2]:
            raise ValueError(
                f"{where}: expected at least one batch element and one token in {name}, got {list(value.shape)}"
            )
    ids = inputs.get("input_ids")
    if isinstance(ids, Tensor):
        if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"{where}: expected input_ids of shape [B, n] and an integer dtype, got {_described(ids)}")
        vocab = getattr(model.config, "vocab_size", None)
        if vocab is not None and ids.numel() > 0 and not (0 <= int(ids.min()) and int(ids.max()) < vocab):
            raise ValueError(
                f"{where}: expected input_ids in [0, {vocab}) (the model's vocab_size), got values from "
                f"{int(ids.min())} to {int(ids.max())}"
            )
    sequence = next((inputs[k] for k in ("input_ids", "inputs_embeds") if isinstance(inputs.get(k), Tensor)), None)
    if sequence is None:  # pixel_values: the patches are the tokens
        return
    batch, tokens = sequence.shape[:2]
    limit = _position_limit(model)
    if limit is not None and tokens > limit:
        raise ValueError(f"{where}: {tokens} tokens, but the model embeds positions for at most {limit}")
    positions = inputs.get("position_ids")
    if isinstance(positions, Tensor):
        if (
            positions.is_floating_point()
            or positions.is_complex()
            or positions.dtype == torch.bool
            or positions.dim() not in (1, 2)
            or positions.shape[-1] != tokens
            or (positions.dim() == 2 and positions.shape[0] not in (1, batch))
        ):
            raise ValueError(
                f"{where}: expected position_ids of an integer dtype and shape [B, n] = [{batch}, {tokens}] (or "
                f"[1, n], [n]), got {_described(positions)}"
            )
        table = _position_table(model)
        if table is not None:
            low, high = (int(value) for value in torch.aminmax(positions))
            if not (0 <= low and high < table):
                raise ValueError(
                    f"{where}: expected position_ids in [0, {table}) (the model's learned positions), got values "
                    f"from {low} to {high}"
                )
    mask = inputs.get("attention_mask")
    if isinstance(mask, Tensor):
        check_token_mask(mask, batch, tokens, mask.device, f"{where} (attention_mask, the stack's token_mask)")
    unknown = sorted(set(inputs) - _forward_parameters(model))
    if unknown:
        raise TypeError(
            f"{where}: got unexpected keyword argument(s) {unknown}: neither the capture's nor among "
            f"{type(model).__name__}.forward's named parameters (its **kwargs would ignore them); the capture takes "
            "check, query_key and the model's inputs (input_ids, attention_mask, position_ids, …)"
        )


def _described(t: Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def _prepared_inputs(model, inputs: dict, where: str) -> dict:
    """``inputs`` checked (:func:`_check_inputs`), with ``position_ids`` derived from a left-padded
    ``attention_mask`` when the caller gave none (as ``generate`` does): in each row whose padding
    all comes before its first real token, a real token's position is the number of real tokens
    before it, so that the row sees the positions it has alone. That differs from
    ``model(**inputs)``, which counts positions from the first column whatever the mask: the call
    says so (a UserWarning naming the rows) and how to have the model's own (pass ``position_ids``).
    Other rows (no padding, right padding, a hole among the real tokens) keep the model's own
    positions, as do families whose positions do not start at 0 (RoBERTa) or are not token
    positions (ViT)."""
    _check_inputs(model, inputs, where)
    mask = inputs.get("attention_mask")
    if inputs.get("position_ids") is not None or not isinstance(mask, Tensor) or mask.dim() != 2:
        return inputs
    real = mask != 0
    suffix = (real.long().cummax(-1).values == real.long()).all(-1)  # once real, real to the end of the row
    left_padded = suffix & ~real.all(-1) & real.any(-1)
    if not (bool(left_padded.any()) and _family(model).zero_based_positions):
        return inputs
    rows = left_padded.nonzero().flatten().tolist()
    warnings.warn(
        f"{where}: the left-padded row(s) {_listed(rows)} get positions counted from their first real token (as "
        "generate gives them, so each reads as it does alone), where model(**inputs) counts from the first "
        "column; pass position_ids (e.g. torch.arange(n).expand(B, n) for the model's own) to choose",
        UserWarning,
        stacklevel=_outside_the_package(),
    )
    arange = torch.arange(real.shape[-1], device=mask.device).expand_as(mask)
    rebuilt = (real.long().cumsum(-1) - 1).masked_fill(~real, 1)
    return {**inputs, "position_ids": torch.where(left_padded[:, None], rebuilt, arange)}


def _outside_the_package() -> int:
    """The ``stacklevel`` of a warning issued by the caller of this function that names the first
    frame outside pathkernels (the user's call, through however many of the package's frames)."""
    frame, level = sys._getframe(1), 1
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def _listed(rows: list[int], shown: int = 8) -> str:
    """``[0, 3, 5]`` as "0, 3, 5", at most ``shown`` of them and how many more."""
    text = ", ".join(str(row) for row in rows[:shown])
    return text if len(rows) <= shown else f"{text} and {len(rows) - shown} more"


def _value_output(layer: _AttentionLayer) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """``(w_v [H, d, d_head], w_o [H, d_head, d], b_v [H, d_head] | None, b_o [d] | None)``."""
    heads, kv_heads, head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
    value_weight, value_bias = _in_out(layer.value, "value")
    value_weight = value_weight[:, layer.value_columns]  # [d, kv_heads · d_head]
    d = value_weight.shape[0]
    w_v = value_weight.reshape(d, kv_heads, head_dim).permute(1, 0, 2)  # [kv_heads, d, d_head]
    b_v = None if value_bias is None else value_bias[layer.value_columns].reshape(kv_heads, head_dim)
    if kv_heads != heads:  # grouped-query attention: query head h reads key/value head h // (H / kv_heads)
        w_v = w_v.repeat_interleave(heads // kv_heads, dim=0)
        b_v = None if b_v is None else b_v.repeat_interleave(heads // kv_heads, dim=0)
    output_weight, output_bias = _in_out(layer.output, "output")  # [H · d_head, d]
    w_o = output_weight.reshape(heads, head_dim, -1)
    return w_v, w_o, b_v, output_bias


@contextmanager
def _eager_eval(model):
    """Eager attention and eval mode for the call; the user's settings are restored after."""
    config = model.config
    original = getattr(config, "_attn_implementation", None)
    setter = getattr(model, "set_attn_implementation", None)

    def set_implementation(value):
        settable = getattr(model, "_can_set_attn_implementation", lambda: True)()
        if setter is not None and isinstance(value, str) and settable:
            setter(value)
        else:  # a family that chooses its attention by the config alone (Falcon)
            config._attn_implementation = value

    was_training = model.training
    if original != "eager":
        set_implementation("eager")
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
        if original != "eager":
            set_implementation(original)


def stream_huggingface_attention(
    model: nn.Module, callback: Callable[[int, Tensor], None], *, return_output: bool = False, **inputs
):
    """Run ``model(**inputs)`` and hand each layer's attention to ``callback`` as soon as it exists.

    ``callback(layer, attn)`` gets ``attn [B, H, n, n]`` (detached) during the forward pass, layer
    by layer, so long inputs never hold all L layers at once. Runs under ``torch.no_grad()``, in
    eval mode and with eager attention (both restored after). A left-padded ``attention_mask``
    without ``position_ids`` gets positions derived from the mask, as in :func:`from_huggingface`.

    Returns:
        None, or with ``return_output=True`` the model's output (logits and all, which a REPL
        would otherwise print in full).

    Raises:
        RuntimeError: if some layer produced no attention weights. ValueError: an empty batch.
    """
    where = "pathkernels.adapters.stream_huggingface_attention"
    output = _stream(model, _attention_layers(model), callback, _prepared_inputs(model, inputs, where))
    return output if return_output else None


def _finite_in_float32(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """A forward pre-hook that keeps an additive float64 attention mask finite in float32.

    Llama-family attention adds the mask in the model's dtype and takes the softmax in float32; a
    float64 model masks with float64's minimum, which is -inf in float32, so a fully masked row (a
    left-padded query) becomes NaN, and the next layer's values carry that NaN to every real token.
    At half float32's minimum a masked weight is still exactly 0 and a fully masked row uniform."""
    mask = kwargs.get("attention_mask")
    if not isinstance(mask, Tensor) or mask.dtype != torch.float64:
        return None
    floor = torch.finfo(torch.float32).min / 2
    return args, {**kwargs, "attention_mask": mask.clamp(min=floor)}


@contextmanager
def finite_masks(model: nn.Module, layers: list[_AttentionLayer] | None = None):
    """Within the block, a family that takes its softmax in float32 gets its float64 attention masks
    kept finite in float32 (:func:`_finite_in_float32`), which changes no finite result: without
    it a float64 model's padded queries give NaN rows, which reach the real tokens of the next
    layer as ``0 · NaN``."""
    handles = []
    in_float32 = _family(model).softmax_in_float32
    if in_float32(model) if callable(in_float32) else in_float32:
        layers = _attention_layers(model) if layers is None else layers
        handles = [layer.attention.register_forward_pre_hook(_finite_in_float32, with_kwargs=True) for layer in layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def score_head(model: nn.Module) -> tuple[Tensor, Tensor | None] | None:
    """``(W [num_labels, d], b or None)``: a Hugging Face sequence classifier's linear ``score`` head
    in the stream's space (OPT's ``project_out``, which maps the last hidden state to the head's
    width, folded in), None for a model without one."""
    score = getattr(model, "score", None)
    if not isinstance(score, nn.Linear):
        return None
    weight = score.weight.detach()
    project = getattr(getattr(getattr(model, "base_model", None), "decoder", None), "project_out", None)
    if project is not None:  # OPT: score(project_out(x))
        weight = weight @ project.weight.detach()
    return weight, None if score.bias is None else score.bias.detach()


def _alibi_once(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """A forward pre-hook on Falcon's attention: its ALiBi bias added once, as its normal forward
    adds it. Falcon folds ALiBi (scaled by 1/√d_head) into the attention mask, which its SDPA path
    adds to the scaled scores; the eager path, the one that returns the patterns, adds the mask and
    ALiBi again (4.5e-3 to 6.5e-2 of the logits off). Zeroing the second leaves the mask's."""
    alibi = kwargs.get("alibi")
    if not isinstance(alibi, Tensor):
        return None
    return args, {**kwargs, "alibi": torch.zeros_like(alibi)}


def _stream(model: nn.Module, layers: list[_AttentionLayer], callback: Callable[[int, Tensor], None], inputs: dict):
    """stream_huggingface_attention on layers already found."""
    seen = [False] * len(layers)

    def make_hook(index: int):
        def hook(module, args, output):
            weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            if not isinstance(weights, Tensor):
                raise RuntimeError(
                    f"{_WHERE}: layer {index} ({type(module).__name__}) returned no attention weights; "
                    "it needs eager attention, which this model may not support"
                )
            seen[index] = True
            callback(index, weights.detach())

        return hook

    handles = [layer.attention.register_forward_hook(make_hook(i)) for i, layer in enumerate(layers)]
    if getattr(model.config, "model_type", None) == "falcon" and getattr(model.config, "alibi", False):
        handles += [layer.attention.register_forward_pre_hook(_alibi_once, with_kwargs=True) for layer in layers]
    try:
        with _eager_eval(model), torch.no_grad(), finite_masks(model, layers), in_float64(model):
            output = model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    missing = [i for i, ok in enumerate(seen) if not ok]
    if missing:
        raise RuntimeError(f"{_WHERE}: no attention pattern came from layer(s) {missing} of {len(layers)}")
    return output


def from_huggingface(model: nn.Module, **inputs) -> AttentionStack:
    """Attention, per-head value-output maps and hidden states of one forward pass.

    ``model(**inputs, output_hidden_states=True)`` runs once (no grad, eval mode, eager attention;
    the user's settings are restored). For a GPT-2, BERT/RoBERTa, ViT or Llama-style model (or one
    with a head on top: ``model.base_model`` is used).

    A padded batch passes its ``attention_mask [B, n]`` (1 = a real token) among the inputs, and
    the stack carries it as ``token_mask``: the engine, the metrics and rollout then evaluate each
    sequence on its real tokens only. (Padded queries get rows that sum to 1 too, GPT-2 spreading
    them over every position, so without the mask they would count as tokens.) With left padding
    and no ``position_ids``, the positions are derived from the mask as ``generate`` does (a real
    token's position is the number of real tokens before it), so that each sequence sees the
    positions it has alone; RoBERTa derives its own from the padding tokens, and ViT has none.

    Float64 means float64: Llama, Mistral, Qwen2 and ViT take the softmax (and the Llama family its
    RMSNorms and rotary angles) in float32 even in a float64 model; for a float64 model the pass
    computes those steps in float64 (:func:`pathkernels.adapters.precision.in_float64`), so that
    the patterns are the model's own computed in float64 throughout, their rows summing to 1 to
    float64's rounding. The model's unmodified forward pass differs from it by float32's rounding
    (~1e-7 relative, up to ~1e-6 where the rotary angles dominate).

    Returns:
        :class:`AttentionStack` with ``attn [B, L, H, n, n]``, ``w_v [L, H, d, d_head]``,
        ``w_o [L, H, d_head, d]``, ``b_o [L, d]`` (value biases folded in) and ``hidden_states
        [L+1, B, n, d]``, all in the model's dtype. A head's share of layer l's attention output
        (before any residual add or normalisation) is ``attn[:, l, h] @ X_l @ w_v[l, h] @ w_o[l, h]``,
        with ``X_l`` the attention module's input.
    """
    return _read_stack(model, inputs)[0]


def _read_stack(
    model: nn.Module,
    inputs: dict,
    where: str = _WHERE,
    on_layer: Callable[[], None] | None = None,
    hold: bool = True,
    tolerance: float = 0.0,
) -> tuple[AttentionStack, Tensor | None]:
    """:func:`from_huggingface`'s stack, and its patterns ``[B, L, H, n, n]`` exactly as the model
    computed them (the stack's own are renormalised where the softmax was coarser than the model);
    the inputs' errors name ``where``, the caller; ``on_layer()`` is called as each layer's
    patterns come. ``hold=False``: the patterns are not kept (None), only each layer's product with
    a random probe, and the stack's ``attn`` is a :class:`~pathkernels.adapters.capture.
    RecomputedPatterns` (checked to ``tolerance``), which a capture of the queries and keys reads."""
    layers = _attention_layers(model, where)
    patterns: list[Tensor] = []  # one [B, L, H, n, n] tensor, each layer's written as it comes
    probes: list[Tensor] = []  # hold=False: the probe v [n] and the model's A v [B, L, H, n]

    def keep(index: int, attn: Tensor) -> None:
        batch, heads, queries, keys = attn.shape
        if hold:
            if not patterns:
                patterns.append(attn.new_empty(batch, len(layers), heads, queries, keys))
            patterns[0][:, index] = attn
        else:
            if not probes:
                probe = torch.rand(keys, generator=torch.Generator().manual_seed(keys), dtype=torch.float64) * 2 - 1
                model_probe = attn.new_empty(batch, len(layers), heads, queries, dtype=torch.float64)
                probes.extend((probe.to(attn.device), model_probe))
            probes[1][:, index] = attn @ probes[0].to(attn.dtype)
        if on_layer is not None:
            on_layer()

    # OPT's project_out maps the last hidden state to the word-embedding width: keep its input,
    # the stream the blocks leave.
    projection = getattr(getattr(model.base_model, "decoder", None), "project_out", None)
    before_projection: list[Tensor] = []
    handle = None
    if projection is not None:
        handle = projection.register_forward_pre_hook(lambda module, args: before_projection.append(args[0].detach()))
    try:
        prepared = {**_prepared_inputs(model, inputs, where), "output_hidden_states": True}
        if "logits_to_keep" in _forward_parameters(model) and "logits_to_keep" not in prepared:
            prepared["logits_to_keep"] = 1  # the stack reads no logits: the LM head on one row, not every token
        output = _stream(model, layers, keep, prepared)
    finally:
        if handle is not None:
            handle.remove()
    with torch.no_grad():  # stacking copies, so the stack does not alias or track the parameters
        maps = [_value_output(layer) for layer in layers]
        w_v = torch.stack([w for w, _, _, _ in maps])
        w_o = torch.stack([w for _, w, _, _ in maps])
        b_o = torch.stack([fold_value_bias(b_v, w_o, b_out) for _, w_o, b_v, b_out in maps])
    hidden = getattr(output, "hidden_states", None)
    if hidden is not None:
        hidden = list(hidden)
        if before_projection:
            hidden[-1] = before_projection[-1]
        hidden = torch.stack(hidden).detach()
    token_mask = inputs.get("attention_mask")
    if isinstance(token_mask, Tensor) and token_mask.dim() != 2:
        raise ValueError(
            f"{where}: expected attention_mask of shape [B, n] (1 = a real token) to carry as the "
            f"stack's token_mask, got {list(token_mask.shape)}"
        )
    attn = patterns[0] if hold else None
    if not hold:
        dtype = next(model.parameters()).dtype
        real = None if token_mask is None else token_mask.to(probes[1].device).bool()
        held = RecomputedPatterns(probes[1], probes[0], dtype, tolerance, real)
    stack = AttentionStack(
        attn=attn if hold else held,
        w_v=w_v,
        w_o=w_o,
        b_o=b_o,
        hidden_states=hidden,
        source=f"huggingface:{model.config.model_type}",
        name=model_name(model),
        token_mask=token_mask,
        attention_only=False,  # every family read has norms and MLPs
    )
    return stack, attn


# --- local model directories ----------------------------------------------------------------------

# A directory holds a tokenizer when it has one of these (fast tokenizers, GPT-2 BPE, WordPiece, SentencePiece).
_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model")
DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog because it wanted to see the other side."


@dataclass(frozen=True)
class LocalModel:
    """A transformers model read from the local disk, and what a report should say about it."""

    path: str
    model: nn.Module
    pretrained: bool  # weights loaded (else randomly initialised from its config)
    tokenizer: object | None  # the directory's tokenizer, when it has one

    @property
    def weights(self) -> str:
        return "pretrained weights" if self.pretrained else "at initialisation (random weights from its config)"

    @property
    def is_vision(self) -> bool:
        return getattr(self.model.config, "model_type", "") == "vit"


def load_local_model(path) -> LocalModel:
    """A supported transformers model from a local directory (weights loaded) or a config (a
    ``config.json``, or a directory with no weights: random weights, seed 0), with the directory's
    tokenizer when it has one. Nothing is downloaded. The model is the class the checkpoint was
    saved as (``config.architectures``: an LM head, untied or tied, a classifier's ``score``), so
    that its own head reads it out; the base model where the config names no class.

    Raises:
        FileNotFoundError: no such path. ImportError: transformers is missing. ValueError: the path
            is not a transformers model, or its architecture is not one the adapters read.
    """
    import json

    try:
        import transformers
    except ImportError:
        raise ImportError("reading a model needs transformers: pip install 'pathkernels[adapters]'") from None
    location = Path(path)
    if not location.exists():
        raise FileNotFoundError("no such file or directory (models are never downloaded)")
    has_weights = location.is_dir() and (any(location.glob("*.safetensors")) or any(location.glob("*.bin")))
    try:
        config = transformers.AutoConfig.from_pretrained(location, local_files_only=True)
        model_class = _saved_class(transformers, config)
        if has_weights:
            with quiet_model_loading():
                model = model_class.from_pretrained(location, local_files_only=True)
        else:
            torch.manual_seed(0)
            model = (
                model_class(config) if model_class is not transformers.AutoModel else model_class.from_config(config)
            )
    except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"cannot read it as a transformers model: {reason}") from None
    _attention_layers(model)  # the architecture check, before any work
    tokenizer = None
    if location.is_dir() and any((location / name).exists() for name in _TOKENIZER_FILES):
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(location, local_files_only=True)
        except Exception:  # noqa: BLE001 (files that no tokenizer class reads: treated as none)
            tokenizer = None
    return LocalModel(str(path), model, has_weights, tokenizer)


def _saved_class(transformers, config):
    """The class a checkpoint was saved as (its config's ``architectures``: a causal or masked LM, a
    sequence classifier, with the head its weights hold), or ``AutoModel`` where it names none that
    this transformers has."""
    for name in getattr(config, "architectures", None) or []:
        model_class = getattr(transformers, name, None)
        if isinstance(model_class, type) and hasattr(model_class, "from_pretrained"):
            return model_class
    return transformers.AutoModel


def local_model_inputs(
    local: LocalModel, *, text: str | None = None, num_tokens: int | None = None, batch: int = 1, seed: int = 0
) -> tuple[dict, str]:
    """Inputs for ``local.model`` and a phrase that says what they are.

    - a vision model: ``batch`` random images (seeded);
    - with ``num_tokens``: ``[batch, num_tokens]`` random token ids (seeded);
    - else with a tokenizer: ``text`` (or a fixed sentence) through it;
    - else ``[batch, 32]`` random token ids.

    Raises:
        ValueError: ``text`` without a tokenizer, a prompt of fewer than 2 tokens, or ``text`` /
            ``num_tokens`` for a vision model.
    """
    where = "pathkernels.adapters.local_model_inputs"
    generator = torch.Generator().manual_seed(seed)
    config = local.model.config
    if local.is_vision:
        if text is not None or num_tokens is not None:
            raise ValueError(
                f"{where}: text and num_tokens do not apply to the vision model {local.path}: its tokens "
                "are the image patches"
            )
        size, channels = config.image_size, getattr(config, "num_channels", 3)
        pixels = torch.randn(batch, channels, size, size, generator=generator)
        return {"pixel_values": pixels}, f"{batch} random image(s) of {size}×{size} pixels"
    if text is not None and local.tokenizer is None:
        raise ValueError(f"{where}: text needs a tokenizer, and {local.path} has none")
    if local.tokenizer is not None and num_tokens is None:
        prompt = DEFAULT_PROMPT if text is None else text
        ids = local.tokenizer(prompt, return_tensors="pt")["input_ids"]
        if ids.shape[-1] < 2:
            raise ValueError(
                f"{where}: the prompt {prompt!r} is {ids.shape[-1]} token(s); the residual of fewer than "
                "2 tokens is 0 by definition"
            )
        which = "the default prompt" if text is None else "the prompt"
        return {"input_ids": ids}, f"{which} {prompt!r} ({ids.shape[-1]} tokens, the model's tokenizer)"
    n = 32 if num_tokens is None else num_tokens
    why = " (no tokenizer in the model directory)" if local.tokenizer is None else ""
    ids = torch.randint(0, config.vocab_size, (batch, n), generator=generator)
    return {"input_ids": ids}, f"{batch} sequence(s) of {n} random token ids (seed {seed}){why}"
