"""Per-path attribution of a real transformer's readout (docs/DESIGN.md, "Real transformers").

With every attention pattern and normalisation scale frozen at one forward pass (a stack from
:func:`pathkernels.adapters.capture_huggingface_residual`), a readout ``u`` (a logit, a logit
difference, a probe direction) at position ``t`` is exactly

    u(t) = Σ_p attr(p) + c,   attr(p) = rᵀ T_S ⋯ T_{j+1} K_j F_{j+1} ⋯ F_S v,

a sum over paths ``p``: a source ``K_j`` (the embedding, a layer's constant rows, an MLP's output)
entering after sublayer ``j``, then one branch (the skip or a head) of every later sublayer, each a
token map ``T`` and a feature map ``F``. ``r = e_t / σ_t`` and ``v = C Γ u`` pass the frozen final
norm, and ``c = βᵀ u`` plus the readout's own bias (a model without a final norm: ``r = e_t``,
``v = u``).

Both ``rᵀ T_S ⋯`` (a row vector of n tokens) and ``F_{j+1} ⋯ F_S v`` (a column vector of d features)
build from the top sublayer down, so the paths are walked as one trie from the top: a node holds
the two vectors of the branches chosen above it, each child costs ``O(n²)`` and ``O(d · d_head)``,
and each source it meets one ``n × d`` product. The walk is depth first, in chunks of nodes sized
by the memory budget, and folds each chunk into exact per-source, per-length sums and the top and
bottom paths, so that trees too large to store stream through.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from pathkernels.adapters.residual import output_embedding
from pathkernels.core._figures import check_save_path, saved
from pathkernels.core._progress import progress_bar
from pathkernels.core.checks import check_tree_shape
from pathkernels.core.paths import PathTree, check_flag, check_int, count_attribution_paths
from pathkernels.core.planner import DEFAULT_MEMORY_BUDGET

if TYPE_CHECKING:
    from pathkernels.adapters.residual import ResidualStreamCapture
    from pathkernels.adapters.stack import AttentionStack

_WHERE = "pathkernels.path_attribution"
_NO_HEAD = -1  # a path's entry at a layer where it takes no head (the skip, or below its source)


@dataclass(frozen=True)
class Readout:
    """Readout directions in the model's output space: ``directions [R, d]`` (one row per readout,
    in the unembedding's space: before the final norm's frozen scale), ``bias [R]`` (each one's
    constant, e.g. the unembedding bias) and their ``labels``."""

    directions: Tensor
    bias: Tensor
    labels: tuple[str, ...]

    @staticmethod
    def of(value: Readout | Tensor, d_model: int, where: str = _WHERE) -> Readout:
        """``value`` as a Readout: a Readout, a vector ``[d]`` or a matrix ``[d, R]`` of R columns
        (as ``W_U[:, tokens]``), in float64."""
        if isinstance(value, Readout):
            directions, bias, labels = value.directions, value.bias, value.labels
        elif isinstance(value, Tensor) and value.dim() in (1, 2) and value.shape[0] == d_model:
            directions = value.reshape(d_model, -1).T
            bias = torch.zeros(directions.shape[0], dtype=torch.float64)
            labels = tuple(f"u{i}" for i in range(directions.shape[0]))
        else:
            got = list(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(
                f"{where}: expected readout to be a Readout (pk.logit_diff, pk.logit), a vector [d] or a matrix "
                f"[d, R] with d = {d_model}, got {got}"
            )
        if not isinstance(directions, Tensor) or directions.dim() != 2 or directions.shape[1] != d_model:
            got = list(directions.shape) if isinstance(directions, Tensor) else type(directions).__name__
            raise ValueError(f"{where}: expected readout directions [R, {d_model}], got {got}")
        count = directions.shape[0]
        if count == 0:
            raise ValueError(f"{where}: expected at least one readout direction, got directions [0, {d_model}]")
        if not isinstance(bias, Tensor) or bias.numel() != count:
            got = list(bias.shape) if isinstance(bias, Tensor) else type(bias).__name__
            raise ValueError(
                f"{where}: expected the readout's bias to hold one value per direction ({count}), got {got}"
            )
        if not isinstance(labels, (tuple, list)) or len(labels) != count:
            raise ValueError(f"{where}: expected one readout label per direction ({count}), got {labels!r}")
        for name, value in (("directions", directions), ("bias", bias)):
            if not value.is_floating_point() and value.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"{where}: expected the readout's {name} to be real numbers, got {value.dtype}")
            if not bool(torch.isfinite(value).all()):
                raise ValueError(f"{where}: expected finite readout {name}, got a NaN or infinite value")
        return Readout(directions.detach().double(), bias.detach().double().reshape(-1), tuple(map(str, labels)))


# Families whose logits are a linear map of the final norm's output (an LM head, or the tied word
# embeddings of a base model). BERT's and RoBERTa's masked-LM heads transform the last hidden
# state first (dense, GELU, LayerNorm), so a direction there is not their logit.
_LINEAR_READOUT_FAMILIES = (
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
    "gptj",
    "phi",
    "falcon",
    "opt",
)


def unembedding(model, where: str = "pathkernels.logit") -> tuple[Tensor, Tensor | None, int]:
    """``(W_U [vocab, d], b_U or None, vocab)``: the model's output embedding, or, for a base model
    whose config ties the word embeddings (GPT-2's ``AutoModel``), its input embedding; a
    TransformerLens model's ``W_U`` (transposed) and ``b_U``; a sequence classifier's ``score``
    head (``[num_labels, d]``: its class logits, read at the token the head reads, the last real
    one). Refuses Hugging Face families and heads whose logits are not linear in the final norm's
    output (BERT's pooled classifier among them)."""
    if hasattr(model, "W_U") and hasattr(model, "cfg"):  # a TransformerLens HookedTransformer or bridge
        weight = model.W_U.detach().T  # [vocab, d]
        original = model.__dict__.get("original_model")
        project = getattr(getattr(getattr(original, "base_model", None), "decoder", None), "project_out", None)
        if project is not None and weight.shape[1] != model.cfg.d_model:  # a bridged OPT: W_U reads project_out's
            weight = weight @ project.weight.detach()
        return weight, getattr(model, "b_U", None), weight.shape[0]
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if _is_classifier(model):
        score = getattr(model, "score", None)
        if model_type not in _LINEAR_READOUT_FAMILIES or not isinstance(score, torch.nn.Linear):
            raise ValueError(
                f"{where}: {type(model).__name__} classifies through a non-linear head (a pooler, such as "
                "BERT's tanh pooler, or a dense layer and an activation), so a path attribution cannot read "
                "its class logits; pass a direction [d] that reads its last hidden state (a probe) instead"
            )
        weight = score.weight.detach()  # [num_labels, d]: the class logits read the final norm's output
        return weight, score.bias, weight.shape[0]
    if model_type not in _LINEAR_READOUT_FAMILIES:
        raise ValueError(
            f"{where}: expected a GPT-2 or Llama-family model, whose logits are a linear map of its final "
            f"norm's output, got {model_type or type(model).__name__!r}; for another model pass a direction "
            "[d] that reads its last hidden state (a probe) instead"
        )
    weight, bias = output_embedding(model)  # [vocab, d] in the stream's space
    if weight is None and getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        embedding = getattr(model, "get_input_embeddings", lambda: None)()
        weight = None if embedding is None else embedding.weight.detach()
    if weight is None:
        raise ValueError(
            f"{where}: expected a model with an output embedding (an LM head, or tied word embeddings), "
            f"got {type(model).__name__}"
        )
    return weight, bias, weight.shape[0]


def logit_soft_cap(model) -> float | None:
    """The cap ``c`` of a model whose logits are soft-capped, ``c · tanh(z / c)`` of the linear
    readout ``z`` (Gemma-2's ``final_logit_softcapping``, TransformerLens's
    ``output_logits_soft_cap``), or None. A path attribution is linear, so it attributes ``z``."""
    cfg = getattr(model, "cfg", None)
    cap = getattr(cfg, "output_logits_soft_cap", None) if cfg is not None else None
    if cap is None:
        cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    return float(cap) if cap is not None and float(cap) > 0 else None


def _is_classifier(model) -> bool:
    """Whether ``model`` is a Hugging Face sequence classifier (its logits are classes, not tokens)."""
    return type(model).__name__.endswith("ForSequenceClassification")


def _logit_label(model, *tokens: int) -> str:
    """The label of the logit of ``tokens`` (one) or of their difference (two): a class logit's for
    a sequence classifier, marked as the value before the soft cap where the model caps."""
    name = "class logit" if _is_classifier(model) else "logit"
    text = " − ".join(f"{name}[{token}]" for token in tokens)
    return text if logit_soft_cap(model) is None else f"{text} (before the logit soft cap)"


def _token(value, vocab: int, name: str, where: str) -> int:
    token = check_int(value, name, where)
    if not 0 <= token < vocab:
        raise ValueError(f"{where}: expected {name} to be a token id in [0, {vocab}), got {token}")
    return token


def logit(model, token: int) -> Readout:
    """The logit of ``token``: direction ``W_U[:, token]`` (``[d]``), bias ``b_U[token]``. For a model
    whose logits are soft-capped (:func:`logit_soft_cap`) it is the logit before the cap, and its
    label says so."""
    where = "pathkernels.logit"
    weight, bias, vocab = unembedding(model, where)
    a = _token(token, vocab, "token", where)
    constant = torch.zeros(1, dtype=torch.float64) if bias is None else bias.detach()[a : a + 1].double()
    return Readout(weight[a : a + 1].double(), constant, (_logit_label(model, a),))


def logit_diff(model, a: int, b: int) -> Readout:
    """The logit difference of tokens ``a`` and ``b``: direction ``W_U[:, a] − W_U[:, b]`` (``[d]``),
    bias ``b_U[a] − b_U[b]``. For a model whose logits are soft-capped (:func:`logit_soft_cap`) it
    is the difference before the cap, and its label says so."""
    where = "pathkernels.logit_diff"
    weight, bias, vocab = unembedding(model, where)
    a, b = _token(a, vocab, "a", where), _token(b, vocab, "b", where)
    direction = (weight[a].double() - weight[b].double())[None]
    constant = torch.zeros(1, dtype=torch.float64) if bias is None else (bias[a].double() - bias[b].double()).reshape(1)
    return Readout(direction, constant.detach(), (_logit_label(model, a, b),))


@dataclass(frozen=True)
class ReadoutSteps:
    """The products of a step of the readout trie, as functions of tensors: ``values(rho [N, P, n],
    phi [N, R, d], source [n, d]) -> [N, P, R]``, ``heads(rho, phi, token_maps [H, n, n], feature_in
    [H, d, e], feature_out [H, e, d'] or None) -> ([H, N, P, n], [H, N, R, d'])`` and ``expand(z [N, R,
    e], factor [e, d]) -> [N, R, d]``. :data:`ENGINE` runs them in the C++ readout engine;
    ``pathkernels.reference`` has their plain-PyTorch form, for tests and benchmarks."""

    values: Callable[[Tensor, Tensor, Tensor], Tensor]
    heads: Callable[..., tuple[Tensor, Tensor]]
    expand: Callable[[Tensor, Tensor], Tensor]


def _engine_expand(z: Tensor, factor: Tensor) -> Tensor:
    """``z [N, R, e] @ factor [e, d]`` by the CPU engine's GEMM (the same bits however the nodes are
    batched), by ATen elsewhere."""
    if not z.is_cpu:
        return z @ factor
    return torch.ops.pathkernels._engine_mm(z.reshape(-1, z.shape[-1]), factor).view(*z.shape[:-1], factor.shape[-1])


ENGINE = ReadoutSteps(torch.ops.pathkernels._readout_values, torch.ops.pathkernels._readout_heads, _engine_expand)


@dataclass
class _Sublayer:
    """One sublayer of the frozen model, on one sequence's real tokens (n of them): an attention
    sublayer (``attn`` the patterns as computed, ``[H, n, n]``) or an MLP (``attn`` None, skip only).
    ``pre``: pre-norm, where the skip is the identity and a head reads ``D x C Γ``; post-norm, where
    every branch passes the norm after it, ``D · C Γ``."""

    layer: int
    attn: Tensor | None
    scale: Tensor  # D: 1/σ of the sublayer's norm, per token [n]
    gamma: Tensor  # Γ [d]
    w_v: Tensor | None  # [H, d, d_head]
    w_o: Tensor | None  # [H, d_head, d]
    pre: bool
    centred: bool

    def _norm_features(self, phi: Tensor) -> Tensor:  # C Γ φ
        phi = phi * self.gamma
        return phi - phi.mean(-1, keepdim=True) if self.centred else phi

    def norm_features_matrix(self) -> Tensor:
        """``C Γ`` as a ``[d, d]`` matrix."""
        d = self.gamma.shape[0]
        centre = torch.eye(d, dtype=torch.float64, device=self.gamma.device)
        if self.centred:
            centre = centre - 1.0 / d
        return centre * self.gamma[None, :]

    @functools.cached_property
    def token_maps(self) -> Tensor:
        """Every head's token map ``T_h`` ``[H, n, n]``, in the row form ``ρ' = ρ T_h``: ``A_h D``
        (pre-norm) or ``D A_h`` (post-norm)."""
        if self.pre:
            return (self.attn * self.scale[None, None, :]).contiguous()
        return (self.scale[None, :, None] * self.attn).contiguous()

    @functools.cached_property
    def norm_values(self) -> Tensor:
        """Pre-norm, ``C Γ W_V`` per head ``[H, d, d_head]``: each head's input map with the frozen
        norm before it (scale the rows, centre the columns), without a ``d × d`` product."""
        values = self.gamma[:, None] * self.w_v
        return values - values.mean(-2, keepdim=True) if self.centred else values

    @functools.cached_property
    def feature_factors(self) -> tuple[Tensor, Tensor]:
        """Every head's feature map in the row form ``φ' = φ F_in[h] F_out[h]``, ``F_in [H, d, d_head]``
        and ``F_out [H, d_head, d]``: ``Fᵀ = W_Oᵀ W_Vᵀ Γ C`` (pre-norm) or ``Γ C W_Oᵀ W_Vᵀ``
        (post-norm), with the frozen norm folded into the factor beside it."""
        w_o_t, w_v_t = self.w_o.transpose(-1, -2), self.w_v.transpose(-1, -2)
        if self.pre:  # W_Vᵀ Γ C = (C Γ W_V)ᵀ
            return w_o_t.contiguous(), self.norm_values.transpose(-1, -2).contiguous()
        # Γ C W_Oᵀ: centre the columns, scale the rows
        into = w_o_t - w_o_t.mean(-2, keepdim=True) if self.centred else w_o_t
        return (self.gamma[:, None] * into).contiguous(), w_v_t.contiguous()

    def skip(self, rho: Tensor, phi: Tensor) -> tuple[Tensor, Tensor]:
        """The skip branch: ``ρ' = Tᵀ ρ``, ``φ' = F φ`` for ρ ``[N, P, n]`` and φ ``[N, R, d]``."""
        if self.pre:
            return rho, phi
        return rho * self.scale, self._norm_features(phi)


@dataclass
class _Model:
    """The frozen model of one batch element on its real tokens: sublayers bottom up, and the
    sources, ``sources[j]`` entering below sublayer j (0: the embedding)."""

    sublayers: list[_Sublayer]
    sources: list[Tensor]  # [n, d] each, len(sublayers) + 1
    source_names: list[str]
    layers: int
    num_heads: int


def _frozen_model(stack: AttentionStack, capture: ResidualStreamCapture, batch: int, real: Tensor) -> _Model:
    """The sublayers and sources of batch element ``batch`` restricted to its ``real`` tokens."""
    device = capture.embedding.device
    pick = real.to(device)
    attn = capture.patterns(stack.attn, batch)[..., pick, :][..., pick]  # as computed, [L, H, n, n]
    w_v, w_o = stack.w_v.to(device, torch.float64), stack.w_o.to(device, torch.float64)
    scale = capture.norm_scale[batch][..., pick]  # [L, 2, n]
    pre, centred = capture.layout == "pre", capture.centred

    def normalised(t: Tensor, layer: int, which: int) -> Tensor:  # D t C Γ + 1 βᵀ (post-norm sources)
        t = t - t.mean(-1, keepdim=True) if centred else t
        return scale[layer, which, :, None] * t * capture.norm_weight[layer, which] + capture.norm_bias[layer, which]

    output_bias = capture.output_bias[:, None, :]  # [L, 1, d]: the same for every token
    if capture.attention_output_scale is not None:  # an RMSNorm on the attention's output: D' · Γ'
        out_scale, gain = capture.attention_output_scale[batch][..., pick], capture.attention_output_weight  # [L, n]
        attn = out_scale[:, None, :, None] * attn  # D' A
        w_o = w_o * gain[:, None, None, :]  # W_O Γ'
        output_bias = out_scale[..., None] * (capture.output_bias * gain)[:, None, :]  # D' 1 (b_O ⊙ γ')ᵀ
    row_sums = attn.sum(-1)  # r_h = A_h 1 [L, H, n]

    sublayers, sources, names = [], [capture.embedding[batch][pick]], ["embedding"]
    for layer in range(stack.num_layers):
        sublayers.append(
            _Sublayer(
                layer, attn[layer], scale[layer, 0], capture.norm_weight[layer, 0], w_v[layer], w_o[layer], pre, centred
            )
        )
        # The attention's constant rows: Σ_h r_h (βᵀ W_V + b_Vᵀ) W_O + 1 b_Oᵀ (pre-norm; post-norm
        # has no β before its values, and passes the rows through its norm).
        head_rows = capture.value_bias[layer] + (capture.norm_bias[layer, 0] @ w_v[layer] if pre else 0)
        constant = torch.einsum("hi,he,hed->id", row_sums[layer], head_rows, w_o[layer]) + output_bias[layer]
        sources.append(constant if pre else normalised(constant, layer, 0))
        names.append(f"L{layer} attention bias")
        mlp = capture.mlp_out[batch, layer][pick]
        sublayers.append(
            _Sublayer(layer, None, scale[layer, 1], capture.norm_weight[layer, 1], None, None, pre, centred)
        )
        sources.append(mlp if pre else normalised(mlp, layer, 1))
        names.append(f"L{layer} MLP")
    return _Model(sublayers, sources, names, stack.num_layers, stack.num_heads)


def describe_path(path: Tensor, source_name: str) -> str:
    """``path [L]`` (the head at each layer, −1 where none) from the source named ``source_name`` as
    text: ``"L3H5 → L7H1 from L2 MLP"``, or ``"L2 MLP (direct)"``."""
    heads = [f"L{layer}H{int(head)}" for layer, head in enumerate(path.tolist()) if head != _NO_HEAD]
    return f"{' → '.join(heads)} from {source_name}" if heads else f"{source_name} (direct)"


def path_bars(top: list[dict], bottom: list[dict], label: str, title: str, ax=None):
    """Horizontal bars of the ``top`` rows then the ``bottom`` ones (rows of ``"path"`` and
    ``"attribution"``, each path once), labelled by path; returns the Figure."""
    import matplotlib.pyplot as plt

    seen = {row["path"] for row in top}
    rows = top + [row for row in reversed(bottom) if row["path"] not in seen]
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 0.3 * len(rows) + 1.2))
    else:
        fig = ax.figure
    values = [row["attribution"] for row in rows]
    ax.barh(range(len(rows)), values, color=["C0" if v >= 0 else "C3" for v in values])
    ax.set_yticks(range(len(rows)), [row["path"] for row in rows], fontsize=8)
    ax.invert_yaxis()
    ax.axvline(0, color="black", linewidth=0.5)
    ax.set_xlabel(label)
    ax.set_title(title)
    return fig


@dataclass
class PathAttribution:
    """Attributions of one batch element's readouts to its paths (:func:`path_attribution`).

    Shapes: P positions, R readouts, S sources (``source_names``: the embedding, then per layer its
    attention's constant rows and its MLP's output), L layers.

    Attributes:
        positions: ``[P]`` token positions read out; ``labels``: the R readouts' names.
        value: ``[P, R]`` the readouts of the model's own stream (the capture's, through the frozen
            final norm): ``Σ_p attr(p) + constant`` over every path, exactly.
        constant: ``[P, R]`` the part no path carries: the final norm's ``βᵀ u`` and the readout's bias.
        by_source_length: ``[S, L+1, P, R]`` exact sums of the enumerated paths' attributions by
            source and number of heads; ``counts [S, L+1]`` how many paths each sums.
        unenumerated: ``[P, R]`` what paths longer than ``max_length`` carry (``value − constant −``
            the sums; 0 up to rounding when every path was enumerated).
        top / bottom: the ``top_k`` largest and smallest attributions per (position, readout):
            ``values [k, P, R]``, ``paths [k, P, R, L]`` (the head at each layer, −1 where none) and
            ``sources [k, P, R]``.
        paths, path_sources, attribution: every enumerated path (``[M, L]``, ``[M]``) and its
            attribution ``[M, P, R]``, when they fit the memory budget (else None).
    """

    batch: int
    positions: Tensor
    labels: tuple[str, ...]
    source_names: list[str]
    value: Tensor
    constant: Tensor
    by_source_length: Tensor
    counts: Tensor
    top_values: Tensor
    top_paths: Tensor
    top_sources: Tensor
    bottom_values: Tensor
    bottom_paths: Tensor
    bottom_sources: Tensor
    paths: Tensor | None = None
    path_sources: Tensor | None = None
    attribution: Tensor | None = None

    @property
    def by_length(self) -> Tensor:
        """``[L+1, P, R]``: exact sums of the enumerated attributions by number of heads."""
        return self.by_source_length.sum(0)

    @property
    def by_source(self) -> Tensor:
        """``[S, P, R]``: exact sums of the enumerated attributions by source."""
        return self.by_source_length.sum(1)

    @property
    def unenumerated(self) -> Tensor:
        return self.value - self.constant - self.by_source_length.sum((0, 1))

    def describe(self, path: Tensor, source: int) -> str:
        """A path as text, source first: ``"L3H5 → L7H1 from L2 MLP"``, or ``"L2 MLP (direct)"``."""
        return describe_path(path, self.source_names[int(source)])

    def table(self, *, position: int = 0, readout: int = 0, which: str = "top") -> list[dict]:
        """The top (or ``which="bottom"``) paths of one position and readout (indices into
        ``positions`` and ``labels``) as rows: rank, path, source, length, attribution and its
        share of ``value − constant``."""
        if which not in ("top", "bottom"):
            raise ValueError(f"PathAttribution.table: expected which='top' or 'bottom', got {which!r}")
        values, paths, sources = (
            (self.top_values, self.top_paths, self.top_sources)
            if which == "top"
            else (self.bottom_values, self.bottom_paths, self.bottom_sources)
        )
        whole = float(self.value[position, readout] - self.constant[position, readout])
        rows = []
        for rank in range(values.shape[0]):
            value = float(values[rank, position, readout])
            path = paths[rank, position, readout]
            rows.append(
                {
                    "rank": rank + 1,
                    "path": self.describe(path, int(sources[rank, position, readout])),
                    "source": self.source_names[int(sources[rank, position, readout])],
                    "length": int((path != _NO_HEAD).sum()),
                    "attribution": value,
                    "share": value / whole if whole != 0 else math.nan,
                }
            )
        return rows

    def plot(self, k: int = 10, *, position: int = 0, readout: int = 0, ax=None, path=None):
        """The ``k`` largest and ``k`` smallest attributions of one position and readout as
        horizontal bars, labelled by path. Returns the matplotlib Figure; with ``path`` it is also
        saved there (the format from the suffix)."""
        where = "pathkernels.PathAttribution.plot"
        check_save_path(path, where)
        k = check_int(k, "k", where)
        top = self.table(position=position, readout=readout)[:k]
        bottom = self.table(position=position, readout=readout, which="bottom")[:k]
        token = int(self.positions[position])
        label = f"attribution to {self.labels[readout]} at token {token}"
        title = f"top and bottom paths (the readout: {float(self.value[position, readout]):.4g})"
        return saved(path_bars(top, bottom, label, title, ax), path)

    def to_frame(self, *, position: int = 0, readout: int = 0, which: str = "top"):
        """:meth:`table` as a pandas DataFrame (pandas is optional)."""
        import pandas as pd

        return pd.DataFrame(self.table(position=position, readout=readout, which=which))


class _PathSet:
    """Membership of head choices ``[N, L]`` (−1 where none) in a tree's paths, by an integer key
    per row (the choices + 1 as base-(H+1) digits) where it fits int64, else by tuples."""

    def __init__(self, paths: Tensor, num_heads: int):
        layers = paths.shape[1]
        self.fits = (num_heads + 1) ** layers < 2**62
        self.weights = (num_heads + 1) ** torch.arange(layers, dtype=torch.long) if self.fits else None
        self.keys = self._keys(paths).unique() if self.fits else {tuple(row) for row in paths.tolist()}

    def _keys(self, choices: Tensor) -> Tensor:
        return (choices + 1) @ self.weights

    def contains(self, choices: Tensor) -> Tensor:
        """``[N]`` bool."""
        if self.fits:
            return torch.isin(self._keys(choices), self.keys)
        return torch.tensor([tuple(row) in self.keys for row in choices.tolist()], dtype=torch.bool)


class _Fold:
    """Accumulates emitted attributions: sums by source and length, counts, the top k (and with
    ``bottom`` the bottom k), and (when ``keep``) every path."""

    def __init__(
        self,
        sources: int,
        layers: int,
        positions: int,
        readouts: int,
        top_k: int,
        keep: bool,
        bottom: bool = True,
        only: _PathSet | None = None,
    ):
        self.only = only  # fold only these paths' attributions (a tree's), when given
        self.sums = torch.zeros(sources, layers + 1, positions, readouts, dtype=torch.float64)
        self.counts = torch.zeros(sources, layers + 1, dtype=torch.long)
        self.k = top_k
        self.best = [
            torch.zeros(0, positions, readouts, dtype=torch.float64),  # values
            torch.zeros(0, positions, readouts, layers, dtype=torch.long),  # paths
            torch.zeros(0, positions, readouts, dtype=torch.long),  # sources
        ]
        self.worst = [t.clone() for t in self.best]
        self.bottom = bottom
        self.kept: list[tuple[Tensor, Tensor, Tensor]] | None = [] if keep else None

    def add(self, source: int, values: Tensor, choices: Tensor, lengths: Tensor) -> None:
        """values ``[N, P, R]`` of N paths from ``source``, their choices ``[N, L]`` and lengths ``[N]``,
        on any device (the fold keeps its results on the CPU)."""
        values, choices, lengths = values.cpu(), choices.cpu(), lengths.cpu()
        if self.only is not None:
            inside = self.only.contains(choices)
            values, choices, lengths = values[inside], choices[inside], lengths[inside]
        self.sums[source].index_add_(0, lengths, values)
        self.counts[source].index_add_(0, lengths, torch.ones_like(lengths))
        if self.kept is not None:
            self.kept.append((choices, torch.full_like(lengths, source), values))
        if self.k > 0:
            self.best = self._merge(self.best, values, choices, source, largest=True)
            if self.bottom:
                self.worst = self._merge(self.worst, values, choices, source, largest=False)

    def _merge(self, held, values, choices, source, *, largest: bool):
        held_values, held_paths, held_sources = held
        k = min(self.k, values.shape[0])
        chosen = torch.topk(values, k, dim=0, largest=largest)  # [k, P, R]
        paths = choices[chosen.indices]  # [k, P, R, L]
        all_values = torch.cat([held_values, chosen.values])
        all_paths = torch.cat([held_paths, paths])
        all_sources = torch.cat([held_sources, torch.full_like(chosen.indices, source)])
        keep = torch.topk(all_values, min(self.k, all_values.shape[0]), dim=0, largest=largest).indices
        gather = keep[..., None].expand(-1, -1, -1, all_paths.shape[-1])
        return [all_values.gather(0, keep), all_paths.gather(0, gather), all_sources.gather(0, keep)]


@dataclass
class _ReadOut:
    """A checked readout of one batch element: the frozen model, the top node's ``rho [1, P, n]``
    (``r = e_t / σ_t`` per position) and ``phi [1, R, d]`` (``v = C Γ u`` per readout), the
    ``constant`` and the model's own ``value`` ``[P, R]``."""

    model: _Model
    rho: Tensor
    phi: Tensor
    constant: Tensor
    value: Tensor
    readout: Readout
    positions: list[int]
    batch: int
    max_length: int


def read_out(stack, readout, positions, batch, max_length, where: str) -> _ReadOut:
    """The arguments :func:`path_attribution` and :func:`pathkernels.top_paths` share, checked in
    the caller's name, and the frozen model and readout they start from."""
    capture = getattr(stack, "residual_capture", None)
    if capture is None:
        raise ValueError(
            f"{where}: expected a stack with a residual_capture (pk.adapters.capture_huggingface_residual): "
            "attributions need the model's frozen norms, MLP outputs and final norm"
        )
    batch = check_int(batch, "batch", where)
    if not 0 <= batch < stack.batch_size:
        raise ValueError(f"{where}: expected batch in [0, {stack.batch_size}), got {batch}")
    layers = stack.num_layers
    max_length = layers if max_length is None else check_int(max_length, "max_length", where)
    if not 0 <= max_length <= layers:
        raise ValueError(f"{where}: expected max_length in [0, {layers}], got {max_length}")
    read = Readout.of(readout, stack.d_model, where)
    tokens = stack.attn.shape[-1]
    real = torch.ones(tokens, dtype=torch.bool) if stack.token_mask is None else stack.token_mask[batch].cpu()
    if positions is None:
        positions = [int(real.nonzero().flatten()[-1])]
    elif not isinstance(positions, (list, tuple)):
        positions = [positions]
    positions = [check_int(p, "positions", where) for p in positions]
    for p in positions:
        if not -tokens <= p < tokens or not bool(real[p]):
            raise ValueError(
                f"{where}: expected positions of real tokens of batch element {batch} in [0, {tokens}), got {p}"
            )
    positions = [p % tokens for p in positions]
    where_real = torch.cumsum(real.long(), 0) - 1  # a real token's index among the real ones

    model = _frozen_model(stack, capture, batch, real)
    device = model.sources[0].device
    directions, bias = read.directions.to(device), read.bias.to(device)
    rows = where_real[positions].to(device)
    # The frozen final norm: r = e_t / σ_t, v = C Γ u, constant βᵀ u (post-norm: none).
    rho = torch.zeros(1, len(positions), int(real.sum()), dtype=torch.float64, device=device)
    rho[0, torch.arange(len(positions)), rows] = 1.0
    phi = directions[None].clone()
    constant = bias.expand(len(positions), -1).clone()
    if capture.final_scale is not None:
        rho = rho * capture.final_scale[batch][real.to(device)]
        phi = phi * capture.final_weight
        phi = phi - phi.mean(-1, keepdim=True) if capture.final_centred else phi
        constant = constant + (directions @ capture.final_bias)[None]
    value = (rho[0] @ capture.residual[batch][real.to(device)]) @ phi[0].T + constant
    return _ReadOut(model, rho, phi, constant, value, read, positions, batch, max_length)


def path_attribution(
    stack: AttentionStack,
    readout: Readout | Tensor,
    *,
    positions: int | list[int] | None = None,
    batch: int = 0,
    max_length: int | None = None,
    tree: PathTree | None = None,
    top_k: int = 20,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    progress: bool = False,
) -> PathAttribution:
    """Each path's attribution to a readout of a captured model, exact per-source and per-length
    sums, and the ``top_k`` largest and smallest paths (module docstring for the formula).

    Args:
        stack: a stack with a ``residual_capture`` (:func:`pathkernels.adapters.capture_huggingface_residual`).
        readout: :func:`logit_diff`, :func:`logit`, a :class:`Readout`, a direction ``[d]`` or
            directions ``[d, R]`` in the unembedding's space (before the final norm's frozen scale).
        positions: token positions to read out (default: the last real token of ``batch``).
        batch: the batch element.
        max_length: enumerate only paths through at most this many heads (default: every path).
            What the longer paths carry together is still exact: ``unenumerated``.
        tree: enumerate only these head choices (a :class:`~pathkernels.PathTree` over the L
            layers: its paths' heads, −1 where none), each from every source below its lowest
            head; what the others carry is ``unenumerated``.
        top_k: how many largest and smallest paths to keep per (position, readout).
        memory_budget: bytes for the walk's chunks; every path's attribution is kept
            (``attribution``) only when it fits a quarter of it.
        progress: a progress bar over the paths.

    Returns:
        :class:`PathAttribution`, float64. ``value`` is the readout of the capture's stream,
        ``Σ_p attr(p) + constant`` over every path; the tests hold it to the model's own logits.
    """
    top_k = check_int(top_k, "top_k", _WHERE, minimum=0)
    memory_budget = check_int(memory_budget, "memory_budget", _WHERE, minimum=1)
    progress = check_flag(progress, "progress", _WHERE)
    only = None
    if tree is not None:
        check_tree_shape(tree, stack.num_layers, stack.num_heads, _WHERE)
        paths = tree.paths()
        longest = int((paths != _NO_HEAD).sum(1).max()) if paths.shape[0] else 0
        max_length = longest if max_length is None else min(check_int(max_length, "max_length", _WHERE), longest)
        only = _PathSet(paths, stack.num_heads)
    setup = read_out(stack, readout, positions, batch, max_length, _WHERE)
    return attribute(setup, top_k, memory_budget, progress, only=only)


def attribute(
    setup: _ReadOut,
    top_k: int,
    memory_budget: int,
    progress: bool = False,
    steps: ReadoutSteps = ENGINE,
    low_rank: bool = True,
    only: _PathSet | None = None,
) -> PathAttribution:
    """:func:`path_attribution` of a checked readout (:func:`read_out`), its trie steps by ``steps``
    (the engine, or for comparisons ``pathkernels.reference``'s plain-PyTorch form); ``low_rank``
    as in :class:`_Walker` (pre-norm models only)."""
    model, rho, phi, read, positions = setup.model, setup.rho, setup.phi, setup.readout, setup.positions
    layers, max_length = model.layers, setup.max_length
    heads, d = model.num_heads, phi.shape[-1]
    total = count_attribution_paths(layers, heads, max_length)
    node_bytes = 8 * (rho.shape[1] * rho.shape[2] + phi.shape[1] * d)
    chunk = max(1, memory_budget // (4 * (heads + 1) * node_bytes))
    keep = total * (8 * len(positions) * len(read.labels) + 8 * (layers + 1)) <= memory_budget // 4
    fold = _Fold(len(model.sources), layers, len(positions), len(read.labels), top_k, keep, only=only)
    bar = progress_bar(total, enabled=progress, unit="path", desc=_WHERE)
    walker = _Walker(model, steps, low_rank=low_rank, max_length=max_length, cache_bytes=memory_budget // 2)
    walker.walk(rho, phi, max_length, chunk, fold, bar)
    if bar is not None:
        bar.close()
    kept = {}
    if fold.kept is not None:
        choices, sources, values = (torch.cat(parts) for parts in zip(*fold.kept))  # the root's at least
        kept = {"paths": choices, "path_sources": sources, "attribution": values}
    return PathAttribution(
        batch=setup.batch,
        positions=torch.tensor(positions),
        labels=read.labels,
        source_names=model.source_names,
        value=setup.value.cpu(),
        constant=setup.constant.cpu(),
        by_source_length=fold.sums,
        counts=fold.counts,
        top_values=fold.best[0],
        top_paths=fold.best[1],
        top_sources=fold.best[2],
        bottom_values=fold.worst[0],
        bottom_paths=fold.worst[1],
        bottom_sources=fold.worst[2],
        **kept,
    )


class _Walker:
    """The steps of the readout trie over a frozen model, by ``steps`` (the readout engine, or
    ``pathkernels.reference``'s plain-PyTorch form).

    A chunk of nodes is ``(rho [N, P, n], phi [N, R, ·], choices [N, L], lengths [N], runs)``. With
    ``low_rank`` (pre-norm models, where a skip leaves φ alone) a node below a head keeps φ in that
    head's d_head coordinates: its basis is ``(s, h)``, the last head taken, and ``φ = z F_out[s, h]``
    with ``z [R, d_head]``, so a head's child costs ``φ F_in`` alone (no ``F_out``). Where enough
    nodes share a basis, their matrices are computed once (and cached within ``cache_bytes``): a
    child through head h' of sublayer s' is then ``z (F_out[s, h] F_in[s', h'])``, ``d_head × d_head``
    per node instead of ``d × d_head``, and the value at source K is ``ρ (K F_out[s, h]ᵀ) zᵀ``,
    ``n · d_head`` instead of ``n · d``; elsewhere φ is expanded for the step. Whether a basis's
    nodes are enough depends on the tree alone (:meth:`_shared`), so the bits do not depend on how
    the walk is chunked. ``runs`` lists the chunk's consecutive nodes of one basis, ``(count,
    basis)``: a head's children are one run, so a chunk holds at most H runs, one engine call each.
    Basis ``None``: φ in the model's d coordinates (the nodes above every head, and every node
    without ``low_rank``)."""

    def __init__(
        self,
        model: _Model,
        steps: ReadoutSteps = ENGINE,
        *,
        low_rank: bool,
        max_length: int | None = None,
        cache_bytes: int = 1 << 28,
    ):
        self.model, self.steps = model, steps
        self.low_rank = low_rank and model.sublayers[0].pre
        self.max_length = model.layers if max_length is None else max_length
        self.cache_bytes = cache_bytes
        self._cache: dict[tuple, Tensor] = {}
        self._cached = 0
        self._shared_by: dict[tuple[int, bool], bool] = {}

    def _remember(self, key: tuple, compute) -> Tensor:
        if key not in self._cache:
            value = compute()
            if self._cached + 8 * value.numel() > self.cache_bytes:
                self._cache.clear()
                self._cached = 0
            self._cache[key] = value
            self._cached += 8 * value.numel()
        return self._cache[key]

    def _shared(self, sublayer: int, growing: bool) -> bool:
        """Whether the nodes whose last head is in ``sublayer`` are at least d_head per basis (per
        basis and level for values; with ``growing``, those that may still take a head, per basis
        and sublayer below): the count of their prefixes above it, ``Σ_k C(A, k) H^k`` over the A
        attention sublayers above, up to ``max_length − 1`` heads (``− 2`` when growing)."""
        if (sublayer, growing) not in self._shared_by:
            above = sum(1 for s in self.model.sublayers[sublayer + 1 :] if s.attn is not None)
            top = self.max_length - (2 if growing else 1)
            heads, head_dim = self.model.num_heads, self.model.sublayers[sublayer].w_v.shape[-1]
            nodes = sum(math.comb(above, k) * heads**k for k in range(min(top, above) + 1))
            self._shared_by[sublayer, growing] = nodes >= head_dim
        return self._shared_by[sublayer, growing]

    def _output_factor(self, basis: tuple[int, int]) -> Tensor:  # F_out[s, h] [d_head, d]
        sublayer, head = basis
        return self.model.sublayers[sublayer].feature_factors[1][head]

    def _run_values(self, level: int, rho: Tensor, phi: Tensor, basis) -> Tensor:
        source = self.model.sources[level]
        if basis is not None:  # φ = z F_out[basis], which enough nodes share (_low)
            source = self._remember(("source", level, basis), lambda: source @ self._output_factor(basis).T)
        return self.steps.values(rho, phi, source)

    def _low(self, at: int) -> bool:
        """Whether the children through sublayer ``at``'s heads keep φ in d_head coordinates: with
        ``low_rank``, where enough nodes will share each of their bases."""
        return self.low_rank and self._shared(at, growing=False)

    def _run_heads(self, at: int, rho: Tensor, phi: Tensor, basis) -> tuple[Tensor, Tensor]:
        sublayer = self.model.sublayers[at]
        feature_in, feature_out = sublayer.feature_factors
        low = self._low(at)
        if basis is not None:  # φ = z F_out[basis]
            if low and self._shared(basis[0], growing=True):
                feature_in = self._remember(("heads", at, basis), lambda: self._output_factor(basis) @ feature_in)
            else:
                phi = self.steps.expand(phi, self._output_factor(basis))
        return self.steps.heads(rho, phi, sublayer.token_maps, feature_in, None if low else feature_out)

    @staticmethod
    def _by_runs(step, rho: Tensor, phi: Tensor, runs: list[tuple]) -> list:
        """``step(rho, phi, basis)`` on each run of the chunk, in order."""
        results, start = [], 0
        for count, basis in runs:
            run = slice(start, start + count)
            results.append(step(rho[run], phi[run], basis))
            start += count
        return results

    def values(self, level: int, rho: Tensor, phi: Tensor, runs: list[tuple]) -> Tensor:
        """``ρ K φᵀ`` at source ``level`` for every node: ``[N, P, R]``, the attributions of the
        paths that end there."""
        step = functools.partial(self._run_values, level)
        return step(rho, phi, runs[0][1]) if len(runs) == 1 else torch.cat(self._by_runs(step, rho, phi, runs))

    def _heads(self, at: int, rho: Tensor, phi: Tensor, runs: list[tuple]) -> tuple[Tensor, Tensor]:
        """Every head's children of every node, head-major: ``[H, N, P, n]`` and ``[H, N, R, ·]``."""
        step = functools.partial(self._run_heads, at)
        if len(runs) == 1:
            return step(rho, phi, runs[0][1])
        parts = self._by_runs(step, rho, phi, runs)
        return torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=1)

    def children(self, level: int, rho, phi, choices, lengths, runs: list[tuple], max_length: int) -> list[tuple]:
        """The children of a chunk at ``level`` through sublayer ``level − 1``: the skip's, then (for
        nodes under ``max_length`` heads) every head's, head by head: a list of parts, each a chunk
        tuple."""
        sublayer = self.model.sublayers[level - 1]
        rho_skip, phi_skip = sublayer.skip(rho, phi)
        parts = [(rho_skip, phi_skip, choices, lengths, runs)]
        grows = lengths < max_length
        if sublayer.attn is None or not bool(grows.any()):
            return parts
        if not bool(grows.all()):
            rho, phi, choices, lengths = rho[grows], phi[grows], choices[grows], lengths[grows]
            counts = torch.tensor([count for count, _ in runs], device=grows.device)
            kept = torch.segment_reduce(grows.double(), "sum", lengths=counts).long().tolist()
            runs = [(k, basis) for k, (_, basis) in zip(kept, runs) if k]
        rho_h, phi_h = self._heads(level - 1, rho, phi, runs)
        heads, grown = rho_h.shape[0], rho_h.shape[1]
        head_choices = choices[None].repeat(heads, 1, 1)
        head_choices[:, :, sublayer.layer] = torch.arange(heads, device=rho.device)[:, None]
        runs_h = [(grown, (level - 1, h)) for h in range(heads)] if self._low(level - 1) else [(heads * grown, None)]
        lengths_h = (lengths + 1).repeat(heads)
        return parts + [(rho_h.flatten(0, 1), phi_h.flatten(0, 1), head_choices.flatten(0, 1), lengths_h, runs_h)]

    def walk(self, rho: Tensor, phi: Tensor, max_length: int, chunk: int, fold: _Fold, bar) -> None:
        """Depth first from the top: a node at level j has chosen the branches of sublayers j, j+1, …;
        it meets source j (entering below sublayer j), then branches through sublayer j − 1."""
        choices = torch.full((1, self.model.layers), _NO_HEAD, dtype=torch.long, device=rho.device)
        lengths = torch.zeros(1, dtype=torch.long, device=rho.device)
        pending = [(len(self.model.sublayers), rho, phi, choices, lengths, [(1, None)])]
        while pending:
            level, rho, phi, choices, lengths, runs = pending.pop()
            values = self.values(level, rho, phi, runs)
            fold.add(level, values, choices, lengths)
            if bar is not None:
                bar.update(values.shape[0])
            if level == 0:
                continue
            for *part, part_runs in self.children(level, rho, phi, choices, lengths, runs, max_length):
                for start in range(0, part[0].shape[0], chunk):
                    stop = start + chunk
                    pending.append((level - 1, *(t[start:stop] for t in part), _slice_runs(part_runs, start, stop)))


def _slice_runs(runs: list[tuple], start: int, stop: int) -> list[tuple]:
    """The runs ``(count, basis)`` of nodes ``start..stop-1``."""
    sliced, first = [], 0
    for count, basis in runs:
        low, high = max(start, first), min(stop, first + count)
        if low < high:
            sliced.append((high - low, basis))
        first += count
    return sliced
