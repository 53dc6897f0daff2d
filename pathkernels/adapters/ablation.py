"""Running a Hugging Face model with one path's term removed where it enters.

The causal check of a path (:func:`pathkernels.causal_check`) takes its term out of the one input it
enters and lets the model recompute what that touches:

- a score path: the input of one head's query (or key) projection at its layer. The term ``Y`` is
  subtracted from the stream entering the layer, the layer's norm is recomputed on what is left
  (``frozen``: held at the clean run's scale, ``D (Y C) Γ`` removed from its output), and only that
  head's columns of the projection take the result; its scores, its pattern and everything after
  it follow from the model's own forward pass;
- a value path: the stream entering the final norm, which is recomputed (or held, ``frozen``);
- a path into a transcoder feature: the feature's encoder input at one token. The transcoder is
  not part of the model, so the caller recomputes the feature's activation from the clean stream
  entering the MLP's norm (:func:`mlp_norm_scale` recomputes that norm), and the model takes the
  change of what the feature writes, added to the MLP's output at that token: everything above
  follows from the model's own forward pass (:func:`run_with_mlp_writes`).

Each path is one row of a batch whose first row is the clean run, so that every change is measured
within one forward pass.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from pathkernels.adapters.huggingface import _attention_layers, _blocks, _prepared_inputs, stream_huggingface_attention
from pathkernels.adapters.query_key import _projection, recording
from pathkernels.adapters.residual import _inverse_scale, _layout, _module_at


@dataclass
class AblatedRun:
    """One forward pass of ``1 + M`` rows (the clean run, then one row per removed term).

    ``queries [1+M, H, n, e]`` and ``keys [1+M, H_kv, n, e]``: the layer's, as its attention used
    them; ``scaling``: its score scale; ``patterns [1+M, H, n, n]``: the layer's; ``final [1+M, n, d]``:
    the final norm's output (None without one)."""

    queries: Tensor
    keys: Tensor
    scaling: float
    patterns: Tensor
    final: Tensor | None


def projection_columns(
    attention: nn.Module, side: str, head: int, heads: int, kv_heads: int, head_dim: int
) -> tuple[nn.Module, Tensor]:
    """The projection module whose output holds head ``head``'s query (``side="query"``) or its key
    head's key, and those columns of its output (a key head serves ``H / H_kv`` query heads)."""
    group = head // (heads // kv_heads)
    step = torch.arange(head_dim)
    if hasattr(attention, "c_attn"):  # GPT-2: [q | k | v]
        start = head * head_dim if side == "query" else heads * head_dim + group * head_dim
        return attention.c_attn, start + step
    if type(attention).__name__.startswith("Falcon") and attention.new_decoder_architecture:
        per_group = heads // kv_heads  # per key head [q_1 … q_g | k | v]
        start = group * (per_group + 2) * head_dim
        offset = (head % per_group) * head_dim if side == "query" else per_group * head_dim
        return attention.query_key_value, start + offset + step
    if type(attention).__name__.startswith("Falcon") and attention.multi_query:  # [q_1 … q_H | k | v]
        start = head * head_dim if side == "query" else heads * head_dim
        return attention.query_key_value, start + step
    if hasattr(attention, "query_key_value"):  # GPT-NeoX, Falcon: per head [q | k | v]
        return attention.query_key_value, head * 3 * head_dim + (0 if side == "query" else head_dim) + step
    if side == "query":
        return attention.q_proj, head * head_dim + step
    return attention.k_proj, group * head_dim + step


def input_norm(model: nn.Module, layer: int) -> nn.Module | None:
    """The norm before layer ``layer``'s attention (None where it has none: OLMo 2)."""
    spec = _layout(model)
    return spec.norms(_blocks(model, *spec.blocks)[layer])[0]


def final_norm(model: nn.Module) -> nn.Module | None:
    """The norm before the unembedding (None where there is none)."""
    spec = _layout(model)
    return None if spec.final_norm is None else _module_at(model.base_model, spec.final_norm)


def _rows(model: nn.Module, inputs: dict, count: int) -> dict:
    """One sequence's inputs as ``1 + count`` identical rows, a left-padded sequence's positions
    derived once from its own mask (as its capture derived them, which said so): the rows are this
    run's, not the user's, so no warning names them."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*left-padded row", category=UserWarning)
        inputs = _prepared_inputs(model, inputs, "pathkernels.causal_check")
    return {
        k: v.expand(count + 1, *v.shape[1:]) if isinstance(v, Tensor) and v.dim() >= 1 else v for k, v in inputs.items()
    }


def _keep_final(model: nn.Module, handles: list) -> list[Tensor]:
    """The final norm's output of the coming forward pass, in the list returned (empty without a
    final norm); the hook joins ``handles``."""
    finals: list[Tensor] = []
    last_norm = final_norm(model)
    if last_norm is not None:
        handles.append(last_norm.register_forward_hook(lambda module, args, output: finals.append(output.detach())))
    return finals


def mlp_norm_scale(model: nn.Module, layer: int, stream: Tensor) -> Tensor:
    """``1/σ`` ``[M]`` of the norm before layer ``layer``'s MLP on streams ``stream`` ``[M, d]``, in
    float64, as the capture computes it (1 where there is no norm: OLMo 2)."""
    spec = _layout(model)
    return _inverse_scale(stream, spec.norms(_blocks(model, *spec.blocks)[layer])[1], spec.norm)


@torch.no_grad()
def run_with_mlp_writes(
    model: nn.Module,
    inputs: dict,
    layer: int,
    count: int,
    writes: Callable[[Tensor], dict[int, Tensor]],
    module_output: bool,
) -> Tensor | None:
    """The model on ``inputs`` (one sequence) as ``1 + count`` rows: the clean run, then row m with
    ``writes(stream)[t][m]`` ``[n, d]`` added to layer t's MLP output, for each layer ``t ≥ layer``
    ``writes`` names (``layer`` alone, or a cross-layer feature's later layers too). ``writes`` gets
    the clean run's stream entering layer ``layer``'s MLP norm ``[n, d]`` (float64; the MLP's own
    input where it has no norm), which every row shares up to there, and is called once, there.
    ``module_output``: add to the MLP module's output, before a norm on it (Gemma-2's post-MLP norm,
    then recomputed); else to what the sublayer adds to the stream. Returns the final norm's output
    ``[1 + count, n, d]`` float64 (None without one)."""
    spec = _layout(model)
    blocks = _blocks(model, *spec.blocks)
    norm = spec.norms(blocks[layer])[1]
    mlp = spec.mlp(blocks[layer])
    rows = _rows(model, inputs, count)
    state: dict = {}

    def keep_stream(module, args):
        if "added" not in state:  # rows are alike below the write; OPT's MLP reads [B·n, d]
            state["added"] = writes(args[0].reshape(count + 1, -1, args[0].shape[-1])[0].double())

    def add(module, args, output, target: int):
        flat = output.reshape(count + 1, -1, output.shape[-1])
        added = state["added"].get(target)
        if added is None:
            return output
        flat = torch.cat([flat[:1], flat[1:] + added.to(flat.device, flat.dtype)])
        return flat.reshape(output.shape)

    handles = [(norm if norm is not None else mlp).register_forward_pre_hook(keep_stream)]
    for target in range(layer, len(blocks)):
        block = blocks[target]
        written = spec.mlp(block) if module_output or spec.output_norms is None else spec.output_norms(block)[1]
        handles.append(written.register_forward_hook(functools.partial(add, target=target)))
    finals = _keep_final(model, handles)
    try:
        stream_huggingface_attention(model, lambda index, attn: None, **rows)
    finally:
        for handle in handles:
            handle.remove()
    return finals[0].double() if finals else None


@torch.no_grad()
def run_without_terms(
    model: nn.Module,
    inputs: dict,
    layer: int,
    head: int,
    side: str,
    terms: Tensor,
    frozen_input: Callable[[Tensor], Tensor] | None,
    where: str,
) -> AblatedRun:
    """The model on ``inputs`` (one sequence) as ``1 + M`` rows: the clean run, then row m with
    ``terms[m]`` ``[n, d]`` removed from head ``head``'s ``side`` input at layer ``layer``.
    ``frozen_input(terms)`` gives the removal's share of the norm's output with its scale held
    (``D (Y C) Γ``); None recomputes the norm on the stream less the term."""
    attention = _attention_layers(model)[layer]
    projection, columns = projection_columns(
        attention.attention, side, head, attention.num_heads, attention.num_kv_heads, attention.head_dim
    )
    weight = _projection(projection)[0][:, columns]  # [d, e] float64
    norm = input_norm(model, layer)
    count = terms.shape[0]
    rows = _rows(model, inputs, count)
    state: dict = {}

    def keep_stream(module, args):
        state.setdefault("stream", args[0])  # the block's own call (the patch below calls the norm again)

    def patch(module, args, output):
        normed = args[0]  # the norm's output, as the block computed it
        if frozen_input is not None:
            delta = frozen_input(terms).to(normed.device, normed.dtype)
        elif norm is None:  # the projection reads the stream itself
            delta = terms.to(normed.device, normed.dtype)
        else:
            stream = state["stream"]
            delta = normed[1:] - norm(stream[1:] - terms.to(stream.device, stream.dtype))
        output = output.clone()
        output[1:, :, columns.to(output.device)] -= delta @ weight.to(delta.device, delta.dtype)
        return output

    handles = [projection.register_forward_hook(patch)]
    if norm is not None:
        handles.append(norm.register_forward_pre_hook(keep_stream))
    finals = _keep_final(model, handles)
    patterns: dict[int, Tensor] = {}

    def keep_pattern(index: int, attn: Tensor) -> None:
        if index == layer:
            patterns[index] = attn

    modules = [a.attention for a in _attention_layers(model)]
    try:
        with recording(modules, where) as seen:
            stream_huggingface_attention(model, keep_pattern, **rows)
    finally:
        for handle in handles:
            handle.remove()
    record = seen[layer]
    return AblatedRun(
        queries=record.queries.double(),
        keys=record.keys.double(),
        scaling=float(record.scaling),
        patterns=patterns[layer].double(),
        final=finals[0].double() if finals else None,
    )
