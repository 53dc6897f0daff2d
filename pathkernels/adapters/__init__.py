"""Adapters: read a model's attention and value-output maps into an :class:`AttentionStack`.

- :func:`from_huggingface` / :func:`stream_huggingface_attention`: transformers models (GPT-2,
  BERT/RoBERTa, ViT, Llama-style with grouped-query attention);
- :func:`from_transformer_lens`: a ``HookedTransformer`` (or ``TransformerBridge``) with tokens,
  or an ``ActivationCache``.

transformers and transformer-lens are optional; each adapter imports only what it reads.
"""
from pathkernels.adapters.huggingface import (
    from_huggingface,
    stream_huggingface_attention,
)
from pathkernels.adapters.stack import AttentionStack
from pathkernels.adapters.transformer_lens import from_transformer_lens

__all__ = ["AttentionStack", "from_huggingface", "from_transformer_lens", "stream_huggingface_attention"]
