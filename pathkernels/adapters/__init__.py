"""Adapters: read a model's attention and value-output maps into an :class:`AttentionStack`.

- :func:`from_huggingface` / :func:`stream_huggingface_attention`: transformers models (GPT-2,
  BERT/RoBERTa, ViT, Llama-style with grouped-query attention);
- :func:`capture_huggingface_residual` / :func:`capture_transformer_lens_residual`: the same stack
  with what the model's residual stream needs beyond it (GPT-2, ViT, BERT, RoBERTa, the Llama
  family; a HookedTransformer), for its exact decomposition by path and path length;
- :func:`load_local_model` / :func:`local_model_inputs`: a model directory (or config) on disk and
  inputs for it (its tokenizer's, or random ids or pixels);
- :func:`from_transformer_lens`: a ``HookedTransformer`` (or ``TransformerBridge``) with tokens,
  or an ``ActivationCache``.
- :func:`load_transcoders`: a folder of transcoders (circuit-tracer, SAELens or sparsify files:
  per-layer, skip and cross-layer) into a :class:`TranscoderSet`, checked against the model first.

transformers and transformer-lens are optional; each adapter imports only what it reads.

Inside, the arrows point one way: :mod:`~pathkernels.adapters.capture` (the
:class:`ResidualStreamCapture` record) under :mod:`~pathkernels.adapters.stack`; the stack and
:mod:`~pathkernels.adapters.precision` (float64 passes) under the readers
:mod:`~pathkernels.adapters.huggingface` and :mod:`~pathkernels.adapters.transformer_lens`; and
:mod:`~pathkernels.adapters.residual` (the captures) on top. The layer imports the core only
(docs/DESIGN.md, "Layers").
"""

from pathkernels.adapters.capture import ResidualStreamCapture
from pathkernels.adapters.huggingface import (
    LocalModel,
    from_huggingface,
    load_local_model,
    local_model_inputs,
    stream_huggingface_attention,
)
from pathkernels.adapters.residual import capture_huggingface_residual, capture_transformer_lens_residual
from pathkernels.adapters.stack import AttentionStack
from pathkernels.adapters.transcoders import TranscoderSet, load_transcoders, random_transcoders
from pathkernels.adapters.transformer_lens import from_transformer_lens

__all__ = [
    "AttentionStack",
    "LocalModel",
    "ResidualStreamCapture",
    "TranscoderSet",
    "capture_huggingface_residual",
    "capture_transformer_lens_residual",
    "from_huggingface",
    "from_transformer_lens",
    "load_local_model",
    "load_transcoders",
    "random_transcoders",
    "local_model_inputs",
    "stream_huggingface_attention",
]
