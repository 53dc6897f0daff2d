"""The query and key side of a captured model's attention, frozen at one forward pass.

A head's pre-softmax score is bilinear in the attention's input ``y`` (the normalised stream, for a
pre-norm model) at its query token i and key token j (docs/DESIGN.md, "Where heads look"):

    s_ij = scaling · ⟨q_i, k_j⟩,   q_t = R_t (ν_t γ_Q ⊙ (y_t W_Q + b_Q)),   k_t likewise,

with ``R_t`` the rotation at position t (the identity without rotary positions, acting on the first
``r`` features of a head by the model's own ``rotate_half`` convention), ``ν_t`` and ``γ_Q`` a
query/key norm's frozen ``1/σ`` and gain (1 without one). Every map from ``y`` to ``q`` is linear
per token once ``ν`` is frozen, so the score splits exactly over any split of ``y``.

:class:`QueryKeyCapture` holds those maps for every layer and head, with the queries, keys and
scaling the model itself used, read from the same forward pass as the value side
(:func:`~pathkernels.adapters.capture_huggingface_residual` with ``query_key=True``), so that the
decomposition is checked against the model's own scores. :func:`recording` is the context that
reads them from a Hugging Face model's eager attention.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields

import torch
from torch import Tensor, nn

from pathkernels.adapters.huggingface import has_eager_attention_function, releases
from pathkernels.adapters.precision import SCORE_OBSERVERS, norm_eps, rms_gain
from pathkernels.core._repr import short_repr

# Families whose queries and keys are read, each a projection per side (or one fused: GPT-2, GPT-NeoX),
# an optional RMSNorm on each (per head, or over every head: OLMo 2) and rotary positions handed to
# the attention as ``position_embeddings``.
QUERY_KEY_FAMILIES = (
    "gpt2",
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "olmo",
    "olmo2",
    "gpt_neox",
    "phi",
    "opt",
    "vit",
    "gptj",
    "falcon",
)
SIDES = ("query", "key")


@dataclass
class QueryKeyCapture:
    """The frozen query and key maps of every head, in float64, and what the model computed with
    them.

    ``w_q`` ``[L, H, d, e]`` and ``b_q`` ``[L, H, e]`` (the projection's weight in the model's dtype,
    where that holds it exactly; :meth:`side_maps` reads it in float64): the query projections from the attention's
    input ``y``; ``w_k`` ``[L, H_k, d, e]`` and ``b_k`` ``[L, H_k, e]`` the key projections, one per
    key head (``H_k = H / key_group``: a grouped-query model's query heads ``h`` share key head
    ``h // key_group``; :meth:`side_maps` maps a query head to its own); ``query_scale`` ``[B, L, H, n]``,
    ``key_scale`` ``[B, L, H_k, n]``: a query/key norm's frozen ``1/σ`` per token (1 without one),
    with its gain ``query_gain`` ``[L, H, e]``, ``key_gain`` ``[L, H_k, e]``;
    ``cos``, ``sin`` ``[B, L, n, r]`` (in the dtype the model computed them in): the rotation of the
    first ``r`` features of every head at each
    position (``x·cos + rotate_half(x)·sin``; with ``interleaved``, the pairs are adjacent features
    rather than the two halves), None without rotary positions; ``position_bias`` ``[B, L, H, n, n]``:
    a term the model adds to each pair's score whatever the stream (ALiBi), None without one;
    ``centred``: the query/key norms are LayerNorms (Phi's ``qk_layernorm``: each head's vector
    centred before its scale), whose β ``query_shift`` ``[L, H, e]``, ``key_shift`` ``[L, H_k, e]`` is
    added after; ``scaling`` ``[L]``;
    ``allowed`` ``[B, L, n, n]``: which keys each query may attend (causal, padding, sliding
    windows); ``soft_cap`` ``[L]``: the cap ``c`` of a soft-capped score ``c·tanh(s/c)`` (0: none);
    ``queries`` ``[B, L, H, n, e]``, ``keys`` ``[B, L, H_k, n, e]``: the model's own, after norms and
    rotation, held in the dtype the model computed them in (exact; :meth:`computed` reads a head's in
    float64); keys given repeated for every query head are kept once per key head.
    """

    w_q: Tensor
    b_q: Tensor
    w_k: Tensor
    b_k: Tensor
    query_scale: Tensor
    key_scale: Tensor
    query_gain: Tensor
    key_gain: Tensor
    scaling: Tensor
    allowed: Tensor
    soft_cap: Tensor
    queries: Tensor
    keys: Tensor
    cos: Tensor | None = None
    sin: Tensor | None = None
    interleaved: bool = False
    position_bias: Tensor | None = None
    centred: bool = False
    query_shift: Tensor | None = None
    key_shift: Tensor | None = None
    key_group: int = 1

    def __post_init__(self):
        heads = self.queries.shape[2]
        if self.key_group > 1 and self.keys.shape[2] == heads:  # repeated per query head: once per key head
            self.keys = self.keys[:, :, :: self.key_group].contiguous()

    def __repr__(self) -> str:
        batch, layers, heads, tokens, _ = self.queries.shape
        return short_repr(self, f"B = {batch}, L = {layers}, H = {heads}, n = {tokens}")

    def computed(self, side: str, batch: int, layer: int, head: int) -> Tensor:
        """The model's own queries (``side`` "query") or keys of query head ``head``, ``[n, e]``
        float64 (a grouped-query head's keys: its key head's)."""
        held = self.queries if side == "query" else self.keys
        return held[batch, layer, self._held(side, head)].double()

    def on(self, device) -> QueryKeyCapture:
        """A copy on ``device``."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return QueryKeyCapture(**{k: v.to(device) if isinstance(v, Tensor) else v for k, v in moved.items()})

    def side_maps(self, side: str, layer: int, head: int | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """One side's ``(W [d, e], b [e], 1/σ of its norm [B, n], γ [e])`` for query head ``head``
        (``side``: "query" or "key", whose maps are its key head's); ``head`` None: every head the
        side holds (``H`` queries, ``H_k`` keys), ``W [·, d, e]``, ``1/σ [B, ·, n]``, ``b`` and ``γ``
        ``[·, 1, e]``."""
        if side == "query":
            w, b, scale, gain = self.w_q, self.b_q, self.query_scale, self.query_gain
        else:
            w, b, scale, gain = self.w_k, self.b_k, self.key_scale, self.key_gain
        if head is None:
            return w[layer].double(), b[layer, :, None], scale[:, layer], gain[layer, :, None]
        head = self._held(side, head)
        return w[layer, head].double(), b[layer, head], scale[:, layer, head], gain[layer, head]

    def _held(self, side: str, head: int) -> int:
        """Where query head ``head``'s maps of ``side`` are held: its own, or its key head's."""
        return head if side == "query" else head // self.key_group

    def rotate(self, x: Tensor, batch: int, layer: int, rows: Tensor) -> Tensor:
        """``R_t x_t`` for ``x [..., T, e]`` at positions ``rows [T]`` (token indices of sequence
        ``batch``): the model's rotation of the first r features, the rest unchanged."""
        if self.cos is None:
            return x
        cos, sin = self.cos[batch, layer, rows].double(), self.sin[batch, layer, rows].double()  # [T, r]
        r = cos.shape[-1]
        part = x[..., :r]
        if self.interleaved:  # adjacent pairs (GPT-J's, TransformerLens's rotary_adjacent_pairs)
            turned = torch.stack((-part[..., 1::2], part[..., ::2]), dim=-1).flatten(-2)
        else:  # the two halves (rotate_half)
            turned = torch.cat((-part[..., r // 2 :], part[..., : r // 2]), dim=-1)
        return torch.cat((part * cos + turned * sin, x[..., r:]), dim=-1)

    def _normed(self, side: str, narrow: Tensor, batch: int, layer: int, head: int | None, rows: Tensor) -> Tensor:
        """A query/key norm frozen: ``ν_t γ ⊙ (u C)`` (``C`` centres each head's vector where the norm
        is a LayerNorm; the identity for an RMSNorm and without a norm)."""
        _, _, scale, gain = self.side_maps(side, layer, head)
        if self.centred:
            narrow = narrow - narrow.mean(-1, keepdim=True)
        return narrow * (scale[batch][..., rows, None] * gain)

    def project(self, side: str, inputs: Tensor, batch: int, layer: int, head: int | None, rows: Tensor) -> Tensor:
        """The linear part of one side: ``R_t (ν_t γ ⊙ (y_t W C))`` ``[..., T, e]`` for parts of the
        attention's input ``inputs [..., T, d]`` at positions ``rows [T]`` (no bias); ``head`` None:
        every head the side holds, ``[·, T, e]`` for ``inputs [T, d]``."""
        w = self.side_maps(side, layer, head)[0]
        return self.rotate(self._normed(side, inputs @ w, batch, layer, head, rows), batch, layer, rows)

    def constant(self, side: str, shift: Tensor, batch: int, layer: int, head: int | None, rows: Tensor) -> Tensor:
        """What one side holds whatever the stream: ``R_t (ν_t γ ⊙ ((β W + b) C) + β')`` ``[T, e]`` for
        the constant ``shift [d]`` of the attention's input (its norm's β; 0 without one) and a
        query/key LayerNorm's β' (0 without one); ``head`` None: every head the side holds,
        ``[·, T, e]``."""
        w, b, _, _ = self.side_maps(side, layer, head)
        offset = shift @ w if head is not None else (shift @ w)[:, None]  # [e], or [·, 1, e] beside b
        narrow = (offset + b).expand(*b.shape[:-2], rows.numel(), -1)  # [T, e], or [·, T, e]
        narrow = self._normed(side, narrow, batch, layer, head, rows)
        after = self.query_shift if side == "query" else self.key_shift
        if after is not None:
            narrow = narrow + (after[layer, self._held(side, head)] if head is not None else after[layer, :, None])
        return self.rotate(narrow, batch, layer, rows)

    def reconstruction_error(self, inputs, shift: Tensor, real: Tensor) -> float:
        """``max |q̂ − q| / max |q|`` over every layer, head and real token, and the same for the
        keys: the queries and keys rebuilt by these maps from the attention's inputs (without β;
        ``inputs(batch, layer)`` gives one block's, ``[n, d]``) and ``shift [L, d]`` (β), against the
        model's own. ``real [B, n]`` bool marks the tokens compared."""
        worst = 0.0
        (batch_size, tokens), layers = real.shape, shift.shape[0]
        rows = torch.arange(tokens, device=real.device)
        for batch in range(batch_size):
            keep = real[batch]
            for layer in range(layers):  # every head the side holds at once: [H or H_k, n, e]
                block_input = inputs(batch, layer)
                for side, own in (("query", self.queries), ("key", self.keys)):
                    rebuilt = self.project(side, block_input, batch, layer, None, rows)
                    rebuilt = rebuilt + self.constant(side, shift[layer], batch, layer, None, rows)
                    expected = own[batch, layer][:, keep].double()  # the model's own
                    scale = expected.abs().amax((-2, -1))  # each head's, as one head at a time had
                    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
                    errors = (rebuilt[:, keep] - expected).abs().amax((-2, -1)) / scale
                    worst = max(worst, float(errors.max()))
        return worst

    def score_error(self, scores: Tensor) -> float:
        """``max |ŝ − s| / max |s|`` over every allowed pair: the scores these captured queries and
        keys give (``scaling · q kᵀ + bias``, soft-capped as the model caps them) against the
        model's own ``scores [B, L, H, n, n]`` (after its cap, as a hook reports them)."""
        keys = self.keys.double().repeat_interleave(self.key_group, 2)  # each query head's
        ours = self.scaling[None, :, None, None, None] * (self.queries.double() @ keys.transpose(-1, -2))
        if self.position_bias is not None:
            ours = ours + self.position_bias
        cap = self.soft_cap[None, :, None, None, None]
        ours = torch.where(cap > 0, cap * torch.tanh(ours / cap.clamp_min(1e-300)), ours)
        keep = self.allowed[:, :, None].expand_as(ours)
        want = scores.double().to(ours.device)
        scale = float(want[keep].abs().max()) if bool(keep.any()) else 0.0
        return float((ours - want)[keep].abs().max()) / (scale or 1.0) if bool(keep.any()) else 0.0

    def attention(self, batch: int, layer: int, out: Tensor | None = None) -> Tensor:
        """Layer ``layer``'s patterns of sequence ``batch`` recomputed from the model's own queries
        and keys, ``[H, n, n]`` float64: ``softmax_j(cap(scaling · q_i · k_j + bias_ij))`` over the
        keys ``j`` query ``i`` may attend (:attr:`allowed`; 0 elsewhere, and on the rows of queries
        that may attend none, a padded token's), as the model's eager attention computes them, in
        float64 rather than the model's dtype. A block of query rows at a time (about
        :data:`_ATTENTION_BLOCK_BYTES` of scores), so that the work beside ``out`` grows with
        ``H·n`` per row rather than ``H·n²``. ``out``: a float64 ``[H, n, n]`` to write into."""
        queries, keys = self.queries[batch, layer].double(), self.keys[batch, layer].double()  # [H or H_k, n, e]
        heads, tokens, width = queries.shape
        if out is None:
            out = torch.empty(heads, tokens, tokens, dtype=torch.float64, device=queries.device)
        allowed = self.allowed[batch, layer]  # [n, n]
        keys_t = keys.transpose(-1, -2)[:, None]  # [H_k, 1, e, n]: each key head's, for its group of query heads
        step = max(1, _ATTENTION_BLOCK_BYTES // (8 * heads * tokens))
        for start in range(0, tokens, step):
            rows = slice(start, min(start + step, tokens))
            grouped = queries[:, rows].reshape(keys.shape[0], self.key_group, -1, width)  # [H_k, g, R, e]
            scores = torch.matmul(grouped, keys_t).flatten(0, 1).mul_(self.scaling[layer])  # [H, R, n]
            if self.position_bias is not None:
                scores += self.position_bias[batch, layer, :, rows]
            cap = float(self.soft_cap[layer])
            if cap > 0:  # as the model caps them: c·tanh(s/c)
                scores = scores.div_(cap).tanh_().mul_(cap)
            scores.masked_fill_(~allowed[rows], -math.inf)
            block = torch.softmax(scores, -1)
            block.masked_fill_(~allowed[rows].any(-1)[None, :, None], 0.0)  # no key to attend: NaN -> 0
            out[:, rows] = block
        return out

    def bias(self, batch: int, layer: int, head: int) -> Tensor:
        """The position bias ``[n, n]`` of one head (zeros without one)."""
        if self.position_bias is None:
            n = self.queries.shape[-2]
            return torch.zeros(n, n, dtype=torch.float64, device=self.queries.device)
        return self.position_bias[batch, layer, head]

    def model_scores(self, batch: int, layer: int, head: int) -> Tensor:
        """The model's own pre-softmax (pre-cap) scores ``scaling · q kᵀ + bias`` ``[n, n]``, every
        pair (``allowed`` says which the mask kept)."""
        q, k = self.computed("query", batch, layer, head), self.computed("key", batch, layer, head)
        return self.scaling[layer] * (q @ k.T) + self.bias(batch, layer, head)


# Scores a recomputation holds at once beside its result (QueryKeyCapture.attention): 64 MiB.
_ATTENTION_BLOCK_BYTES = 1 << 26


# --- reading them from a Hugging Face model -----------------------------------------------------


@dataclass
class _Seen:
    """What one attention module handed its eager attention and its norms, in one forward pass."""

    queries: Tensor | None = None  # [B, H, n, e]
    keys: Tensor | None = None  # [B, H_kv, n, e]
    mask: Tensor | None = None  # [B, 1 or H, n, n] additive
    scaling: float | None = None
    soft_cap: float | None = None
    rotation: tuple[Tensor, Tensor] | None = None  # (cos, sin) [B, n, r]
    norm_inputs: dict = field(default_factory=dict)  # "q_norm"/"k_norm": their input


@contextmanager
def recording(attention_modules: list[nn.Module], where: str) -> Iterator[list[_Seen]]:
    """Within the block, what each of ``attention_modules`` (one per layer) computes its scores
    from: the rotation it is handed, its query/key norms' inputs and, from its modeling module's
    ``eager_attention_forward`` (swapped process-wide for the block, restored after), the queries,
    keys, mask and scaling the model itself uses."""
    seen = [_Seen() for _ in attention_modules]
    index = {id(module): i for i, module in enumerate(attention_modules)}
    handles, swapped = [], []

    def before(module, args, kwargs):
        rotation = kwargs.get("position_embeddings")
        if isinstance(rotation, tuple) and len(rotation) == 2 and not _alibi(module, kwargs):
            seen[index[id(module)]].rotation = tuple(t.detach() for t in rotation)
        if _replayed(module):  # its scores are computed inline: replayed here
            rotary = sys.modules[type(module).__module__].apply_rotary_pos_emb
            with torch.no_grad():
                query, key = _falcon_replay(module, args, kwargs, rotary)
            observe(module, query, key, kwargs.get("attention_mask"), module.inv_norm_factor, {})

    def norm_hook(i: int, name: str):
        def hook(module, args):
            seen[i].norm_inputs[name] = args[0].detach()

        return hook

    def observe(module, query, key, attention_mask, scaling, kwargs):
        i = index.get(id(module))
        if i is not None:
            record = seen[i]
            record.queries, record.keys = query.detach(), key.detach()
            record.mask = None if attention_mask is None else attention_mask.detach()
            record.scaling = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
            record.soft_cap = kwargs.get("softcap")

    def recorder(original):
        def attention(module, query, key, value, attention_mask, *args, **kwargs):
            observe(module, query, key, attention_mask, kwargs.get("scaling", args[0] if args else None), kwargs)
            return original(module, query, key, value, attention_mask, *args, **kwargs)

        return attention

    for i, module in enumerate(attention_modules):
        handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        for name in ("q_norm", "k_norm", "q_layernorm", "k_layernorm"):
            norm = getattr(module, name, None)
            if isinstance(norm, nn.Module):
                handles.append(norm.register_forward_pre_hook(norm_hook(i, name.replace("layernorm", "norm"))))
    for name in {type(module).__module__ for module in attention_modules if not _replayed(module)}:
        modeling = sys.modules.get(name)
        original = getattr(modeling, "eager_attention_forward", None)
        if original is None:
            raise ValueError(
                f"{where}: {name} has no eager_attention_forward to read the queries and keys from ({releases()})"
            )
        modeling.eager_attention_forward = recorder(original)
        swapped.append((modeling, original))
    SCORE_OBSERVERS.append(observe)  # a float64 pass that computes the scores itself (GPT-J's) reports here
    try:
        yield seen
    finally:
        SCORE_OBSERVERS.remove(observe)
        for handle in handles:
            handle.remove()
        for modeling, original in swapped:
            modeling.eager_attention_forward = original


def _replayed(module: nn.Module) -> bool:
    """Whether a module's queries and keys are replayed from its inputs rather than read from its
    eager attention function: Falcon's before transformers 5.25, whose attention computes its scores
    inline (from 5.25 on it calls ``eager_attention_forward`` like the other families)."""
    return type(module).__name__.startswith("Falcon") and not has_eager_attention_function(module)


def _alibi(module: nn.Module, kwargs: dict) -> bool:
    """Whether an attention module adds ALiBi rather than rotating its queries and keys: Falcon's
    with ``config.alibi``, which before transformers 5.25 was handed the bias as ``alibi`` and from
    5.25 on finds it in its mask (and is handed rotary tables it does not use)."""
    return kwargs.get("alibi") is not None or bool(getattr(getattr(module, "config", None), "alibi", False))


def _projection(module: nn.Module) -> tuple[Tensor, Tensor | None]:
    """``(W [in, out], b [out] | None)`` of a Linear or a Conv1D, in float64."""
    if type(module).__name__ == "Conv1D":
        weight, bias = module.weight, module.bias
    else:
        weight, bias = module.weight.T, module.bias
    return weight.detach().double(), None if bias is None else bias.detach().double()


def _query_key_weights(
    module: nn.Module, heads: int, kv_heads: int, head_dim: int, scaled_queries: bool = False
) -> list[tuple[Tensor, Tensor]]:
    """``[(W_Q [H, d, e], b_Q [H, e]), (W_K [H_k, d, e], b_K [H_k, e])]``, one per key head;
    ``scaled_queries``: the module multiplies its query projection's output by its ``scaling``."""
    if hasattr(module, "c_attn"):  # GPT-2: [q | k | v] columns of one projection
        weight, bias = _projection(module.c_attn)
        width = heads * head_dim
        parts = [(weight[:, :width], bias[:width]), (weight[:, width : 2 * width], bias[width : 2 * width])]
    elif type(module).__name__.startswith("Falcon"):  # fused, in one of three layouts
        weight, bias = _projection(module.query_key_value)
        parts = _falcon_query_key(module, weight, bias, heads, kv_heads, head_dim)
    elif hasattr(module, "query_key_value"):  # GPT-NeoX: per head [q | k | v]
        weight, bias = _projection(module.query_key_value)
        weight = weight.reshape(weight.shape[0], heads, 3, head_dim)
        bias = None if bias is None else bias.reshape(heads, 3, head_dim)
        parts = [
            (weight[:, :, i].reshape(weight.shape[0], -1), None if bias is None else bias[:, i].reshape(-1))
            for i in (0, 1)
        ]
    else:
        parts = [_projection(module.q_proj), _projection(module.k_proj)]
        if scaled_queries:  # OPT scales the projection's output, and its attention then by 1
            parts[0] = (parts[0][0] * module.scaling, None if parts[0][1] is None else parts[0][1] * module.scaling)
    out = []
    for (weight, bias), count in zip(parts, (heads, kv_heads)):
        w = weight.reshape(weight.shape[0], count, head_dim).permute(1, 0, 2)
        b = torch.zeros(count, head_dim, dtype=torch.float64, device=w.device) if bias is None else bias
        out.append((w.contiguous(), b.reshape(count, head_dim)))
    return out


def _falcon_split(module, fused: Tensor, heads: int, kv_heads: int, head_dim: int) -> tuple[Tensor, Tensor]:
    """The query and key parts ``([..., H, e], [..., H_kv, e])`` of the last dimension of Falcon's
    fused projection ``[..., (H + 2·H_kv)·e]`` (its output, or its weight's columns): per group of
    query heads ``[q_1 … q_g | k | v]`` (the new decoder architecture), all queries then one key and
    one value (multi-query), or per head ``[q | k | v]``."""
    lead = fused.shape[:-1]
    if module.new_decoder_architecture:
        grouped = fused.reshape(*lead, kv_heads, heads // kv_heads + 2, head_dim)
        return grouped[..., :-2, :].flatten(-3, -2), grouped[..., -2, :]
    if module.multi_query:
        grouped = fused.reshape(*lead, heads + 2, head_dim)
        return grouped[..., :-2, :], grouped[..., -2:-1, :]
    grouped = fused.reshape(*lead, heads, 3, head_dim)
    return grouped[..., 0, :], grouped[..., 1, :]


def _falcon_query_key(module, weight: Tensor, bias: Tensor | None, heads: int, kv_heads: int, head_dim: int):
    """Falcon's query and key columns of its fused projection ``[(W_Q [d, H·e], b), (W_K [d, H_kv·e], b)]``
    (:func:`_falcon_split`'s layouts)."""
    w_q, w_k = (w.flatten(-2) for w in _falcon_split(module, weight, heads, kv_heads, head_dim))
    if bias is None:
        return [(w_q, None), (w_k, None)]
    b_q, b_k = (b.flatten(-2) for b in _falcon_split(module, bias, heads, kv_heads, head_dim))
    return [(w_q, b_q), (w_k, b_k)]


def _falcon_replay(module: nn.Module, args: tuple, kwargs: dict, apply_rotary) -> tuple[Tensor, Tensor]:
    """Falcon's queries ``[B, H, n, e]`` and keys ``[B, H_kv, n, e]`` as its attention computes them
    inline before transformers 5.25 (no eager function to read them from): its own fused projection,
    split by :func:`_falcon_split`, and its rotary function on the same inputs."""
    hidden = args[0] if args else kwargs["hidden_states"]
    heads, kv_heads, head_dim = module.num_heads, module.num_kv_heads, module.head_dim
    query, key = _falcon_split(module, module.query_key_value(hidden), heads, kv_heads, head_dim)
    query, key = query.transpose(1, 2), key.transpose(1, 2)
    if not _alibi(module, kwargs):
        cos, sin = kwargs["position_embeddings"]
        query, key = apply_rotary(query, key, cos, sin)
    return query, key


def _norm_scale_gain(
    module: nn.Module, name: str, seen: _Seen, count: int, head_dim: int, shape: tuple[int, int]
) -> tuple[Tensor, Tensor]:
    """A query/key norm's frozen ``1/σ`` ``[B, count, n]`` and gain ``[count, e]`` for the ``count``
    heads of its side (query heads, or key heads): over each head's features (Qwen3, Gemma-3) or
    over every head's at once (OLMo 2); ones without a norm."""
    batch, tokens = shape
    norm = getattr(module, name, None) or getattr(module, name.replace("norm", "layernorm"), None)
    x = seen.norm_inputs.get(name)
    if not isinstance(norm, nn.Module) or x is None:
        return (
            torch.ones(batch, count, tokens, dtype=torch.float64),
            torch.ones(count, head_dim, dtype=torch.float64),
        )
    if x.dim() == 4 and _heads_first(x, tokens, count):  # normed after the heads' transpose (Gemma-3)
        x = x.transpose(1, 2)
    x = x.double()
    if isinstance(norm, nn.LayerNorm):  # Phi's qk_layernorm: the variance about each head's mean
        x = x - x.mean(-1, keepdim=True)
    inverse = torch.rsqrt(x.pow(2).mean(-1) + norm_eps(norm))  # [B, n, count] per head, [B, n] over all
    inverse = inverse[..., None].expand(batch, tokens, count) if inverse.dim() == 2 else inverse
    gain = norm.weight.detach().double() if isinstance(norm, nn.LayerNorm) else rms_gain(norm)
    gain = torch.ones(count * head_dim, dtype=torch.float64) if gain is None else gain.cpu()
    gain = gain.expand(count, head_dim) if gain.numel() == head_dim else gain.reshape(count, head_dim)
    return inverse.permute(0, 2, 1).cpu(), gain  # [B, count, n], [count, e]


def _heads_first(x: Tensor, tokens: int, count: int) -> bool:
    """Whether a per-head norm's input ``[B, ·, ·, e]`` holds the heads on axis 1 (``[B, H, n, e]``,
    after the transpose) rather than the tokens (``[B, n, H, e]``): by the shape, or where the two
    counts agree by the strides (the transpose of the projection's ``[B, n, H, e]`` view leaves the
    heads' stride the smaller)."""
    if tokens != count:
        return x.shape[1] == count
    return x.stride(1) < x.stride(2)


def _position_bias(biases: list[Tensor | None], batch: int, heads: int, tokens: int) -> Tensor | None:
    """Each layer's position bias ``[B, 1 or H, n, n]`` (None: 0) as ``[B, L, H, n, n]``, or None
    where no layer has one (no ``L·H·n²`` float64 of zeros for the families without)."""
    if all(bias is None for bias in biases):
        return None
    zero = torch.zeros((), dtype=torch.float64)
    return torch.stack([(zero if b is None else b).expand(batch, heads, tokens, tokens) for b in biases], 1)


def query_key_capture(
    attention_modules: list[nn.Module],
    seen: list[_Seen],
    heads: int,
    kv_heads: int,
    head_dim: int,
    where: str,
    scaled_queries: bool = False,
) -> QueryKeyCapture:
    """The :class:`QueryKeyCapture` of a forward pass recorded by :func:`recording` (``scaled_queries``:
    OPT's, whose query projection's output is scaled before its attention)."""
    missing = [i for i, record in enumerate(seen) if record.queries is None]
    if missing:
        raise ValueError(
            f"{where}: layers {missing} computed their scores outside eager_attention_forward (GPT-2's "
            "reorder_and_upcast_attn, say), so their queries and keys could not be read"
        )
    batch, _, tokens, _ = seen[0].queries.shape
    names = ("w_q", "b_q", "w_k", "b_k", "qs", "ks", "qg", "kg", "allowed", "q", "k")
    batch_axis = ("qs", "ks", "allowed", "q", "k")  # [B, L, ...]; the weights are [L, ...]
    per_layer: dict[str, Tensor] = {}  # each filled a layer at a time, not a list of copies stacked
    rotations, biases = [], []
    for layer, (module, record) in enumerate(zip(attention_modules, seen)):
        (w_q, b_q), (w_k, b_k) = _query_key_weights(module, heads, kv_heads, head_dim, scaled_queries)
        query_scale, query_gain = _norm_scale_gain(module, "q_norm", record, heads, head_dim, (batch, tokens))
        key_scale, key_gain = _norm_scale_gain(module, "k_norm", record, kv_heads, head_dim, (batch, tokens))
        keys = record.keys  # once per key head (QueryKeyCapture keeps them so, were they repeated)
        mask, bias = record.mask, None  # bias: [B, 1 or H, n, n], None where 0
        if mask is None:
            allowed = torch.ones(batch, tokens, tokens, dtype=torch.bool)
        else:
            mask = mask.double().cpu()[..., :tokens]
            allowed = (mask > -1e30).all(1)  # masked entries hold the dtype's lowest value or -inf
            # What the mask adds where it allows a pair: 0, or a position bias (Falcon's ALiBi).
            bias = torch.where(allowed[:, None], mask, torch.zeros((), dtype=mask.dtype))
            bias = bias if bool(bias.any()) else None
        biases.append(bias)
        values = (w_q, b_q, w_k, b_k, query_scale, key_scale, query_gain, key_gain, allowed, record.queries, keys)
        # The queries and keys as the model computed them, and the projections as it holds them (exact:
        # read in float64); OPT's scaled query projection, and the rest, in float64.
        as_computed = ("q", "k", "w_k") if scaled_queries else ("q", "k", "w_q", "w_k")
        model_dtype = record.queries.dtype
        for name, value in zip(names, values):
            dtype = torch.float64 if value.is_floating_point() else value.dtype
            if name in as_computed:
                dtype = value.dtype if name in ("q", "k") else model_dtype
            if name not in per_layer:
                shape = (
                    (value.shape[0], len(seen), *value.shape[1:]) if name in batch_axis else (len(seen), *value.shape)
                )
                per_layer[name] = torch.empty(shape, dtype=dtype)
            (per_layer[name][:, layer] if name in batch_axis else per_layer[name][layer]).copy_(value)
        rotations.append(record.rotation)
    layer_norms = [getattr(m, "q_layernorm", None) for m in attention_modules]
    centred = all(isinstance(norm, nn.LayerNorm) for norm in layer_norms)
    shifts = None
    if centred:  # β of each query/key LayerNorm, per head (key heads repeated)
        query_shift = torch.stack([m.q_layernorm.bias.detach().double().expand(heads, -1) for m in attention_modules])
        key_shift = torch.stack([m.k_layernorm.bias.detach().double().expand(kv_heads, -1) for m in attention_modules])
        shifts = (query_shift.cpu(), key_shift.cpu())
    cos = sin = None
    interleaved = type(attention_modules[0]).__name__ == "GPTJAttention"
    if any(r is not None for r in rotations):
        if any(r is None for r in rotations):
            raise ValueError(f"{where}: some layers were handed rotary positions and some were not")
        if interleaved:  # GPT-J hands (sin, cos) per pair of adjacent features: one angle for two features
            rotations = [(c.repeat_interleave(2, -1), s.repeat_interleave(2, -1)) for s, c in rotations]
        # As the model computed the angles' cosines and sines (exact; rotate reads them in float64).
        cos = torch.stack([r[0].cpu().expand(batch, tokens, -1) for r in rotations], 1)
        sin = torch.stack([r[1].cpu().expand(batch, tokens, -1) for r in rotations], 1)
    stacked = per_layer
    return QueryKeyCapture(
        w_q=stacked["w_q"],
        b_q=stacked["b_q"],
        w_k=stacked["w_k"],
        b_k=stacked["b_k"],
        query_scale=stacked["qs"],
        key_scale=stacked["ks"],
        query_gain=stacked["qg"],
        key_gain=stacked["kg"],
        scaling=torch.tensor([record.scaling for record in seen], dtype=torch.float64),
        allowed=stacked["allowed"],
        soft_cap=torch.tensor([float(record.soft_cap or 0.0) for record in seen], dtype=torch.float64),
        queries=stacked["q"],
        keys=stacked["k"],
        cos=cos,
        sin=sin,
        interleaved=interleaved,
        position_bias=_position_bias(biases, batch, heads, tokens),
        centred=centred,
        query_shift=None if shifts is None else shifts[0],
        key_shift=None if shifts is None else shifts[1],
        key_group=heads // kv_heads,
    ).on(seen[0].queries.device)
