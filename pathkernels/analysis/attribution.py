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
build from the top sublayer down, so the paths are walked as one trie from the top
(:mod:`pathkernels.analysis.readout_trie`): a node holds
the two vectors of the branches chosen above it, each child costs ``O(n²)`` and ``O(d · d_head)``,
and each source it meets one ``n × d`` product. The walk is depth first, in chunks of nodes sized
by the memory budget, and folds each chunk into exact per-source, per-length sums and the top and
bottom paths, so that trees too large to store stream through.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from pathkernels.adapters.huggingface import score_head
from pathkernels.adapters.residual import output_embedding
from pathkernels.analysis.readout_trie import (
    ENGINE,
    NO_HEAD,
    Fold,
    FrozenModel,
    PathSet,
    ReadoutSteps,
    Walker,
    block_diagonal_model,
    describe_path,
    frozen_model,
)
from pathkernels.analysis.real_paths import check_between, check_steps
from pathkernels.core._figures import bar_side_labels, check_save_path, new_figure, require, saved, titled, wrapped
from pathkernels.core._progress import progress_bar
from pathkernels.core._repr import short_repr
from pathkernels.core.checks import check_flag, check_int, listed, renamed
from pathkernels.core.paths import PathTree, check_tree_shape, count_attribution_paths_by_length
from pathkernels.core.planner import DEFAULT_MEMORY_BUDGET

if TYPE_CHECKING:
    from pathkernels.adapters.stack import AttentionStack

_WHERE = "pathkernels.path_attribution"


@dataclass(frozen=True)
class Readout:
    """Readout directions in the model's output space: ``directions [R, d]`` (one row per readout,
    in the unembedding's space: before the final norm's frozen scale), ``bias [R]`` (each one's
    constant, e.g. the unembedding bias) and their ``labels``. ``pooled``: the readout is a sequence
    classifier's class logits, which the model reads at one token of its own choosing (the capture's
    ``pooled_token``): the default position of an attribution."""

    directions: Tensor
    bias: Tensor
    labels: tuple[str, ...]
    pooled: bool = False

    def __repr__(self) -> str:
        labels = ", ".join(self.labels[:3]) + (f", … ({len(self.labels)} in all)" if len(self.labels) > 3 else "")
        return short_repr(self, f"{labels}; d = {self.directions.shape[1]}")

    @staticmethod
    def of(value: Readout | Tensor, d_model: int, where: str = _WHERE) -> Readout:
        """``value`` as a Readout: a Readout, a vector ``[d]`` or a matrix ``[d, R]`` of R columns
        (as ``W_U[:, tokens]``), in float64."""
        pooled = isinstance(value, Readout) and value.pooled
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
            if value.device.type not in ("cpu", "cuda"):
                raise ValueError(f"{where}: expected the readout's {name} on a CPU or CUDA device, got {value.device}")
            if not value.is_floating_point() and value.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"{where}: expected the readout's {name} to be real numbers, got {value.dtype}")
            if not bool(torch.isfinite(value).all()):
                raise ValueError(f"{where}: expected finite readout {name}, got a NaN or infinite value")
        return Readout(
            directions.detach().double(), bias.detach().double().reshape(-1), tuple(map(str, labels)), pooled
        )


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
        head = score_head(model)
        if model_type not in _LINEAR_READOUT_FAMILIES or head is None:
            raise ValueError(
                f"{where}: {type(model).__name__} classifies through a non-linear head (a pooler, such as "
                "BERT's tanh pooler, or a dense layer and an activation), so a path attribution cannot read "
                "its class logits; pass a direction [d] that reads its last hidden state (a probe) instead"
            )
        weight, bias = head  # [num_labels, d]: the class logits read the final norm's output (OPT: projected)
        return weight, bias, weight.shape[0]
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
    ``output_logits_soft_cap``), or None. A path attribution is linear, so it attributes ``z``. A
    sequence classifier's score head is not capped (Gemma-2's included), so its cap is None."""
    if _is_classifier(model):
        return None
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


# The files a saved tokenizer leaves in its folder (transformers reads one of them); a folder with
# none has no tokenizer, whatever AutoTokenizer would make of its config.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model")


def model_tokenizer(model, tokenizer=None, where: str = "pathkernels.to_single_token", name: str = "text"):
    """The tokenizer that turns a token's text into its id: ``tokenizer`` where given, else a
    TransformerLens model's own (``model.tokenizer``), else the one saved beside a Hugging Face
    model's weights (the local folder its config names, read with ``local_files_only``: nothing is
    downloaded). Refuses, saying to pass ``tokenizer=``, where there is none."""
    if tokenizer is not None:
        return tokenizer
    own = getattr(model, "tokenizer", None)
    if own is not None:
        return own
    folder = getattr(getattr(model, "config", None), "_name_or_path", None) or getattr(model, "name_or_path", None)
    if folder and Path(folder).is_dir() and any((Path(folder) / name).is_file() for name in _TOKENIZER_FILES):
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except Exception:  # noqa: BLE001 (no tokenizer files there, or none a class reads)
            pass
    raise ValueError(
        f"{where}: {name} is text, and {type(model).__name__} has no tokenizer to read it with (a Hugging Face "
        "model does not carry one): pass tokenizer=AutoTokenizer.from_pretrained(...), or token ids"
    )


def to_single_token(model, text: str, *, tokenizer=None) -> int:
    """The id of ``text`` as one token of the model's tokenizer (:func:`model_tokenizer`), without
    special tokens: ``to_single_token(model, " the")``. Refuses text that is not exactly one token,
    listing the ids it is.

    Args:
        model: a Hugging Face or TransformerLens model (its tokenizer, unless ``tokenizer`` is given).
        text: the token's text, with its leading space where the tokenizer marks one (GPT-2's).
        tokenizer: a tokenizer to use instead of the model's.
    """
    where = "pathkernels.to_single_token"
    if not isinstance(text, str):
        raise TypeError(f"{where}: expected text to be a str, got {type(text).__name__}")
    return _single_token(text, model_tokenizer(model, tokenizer, where), "text", where)


def _single_token(text: str, tokenizer, name: str, where: str) -> int:
    """``text``'s id as one token of ``tokenizer`` (no special tokens), or ValueError naming ``name``."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    ids = ids[0] if ids and isinstance(ids[0], list) else ids
    if not ids:
        raise ValueError(f"{where}: {name}={text!r} is no token of the model's tokenizer (it encodes to nothing)")
    if len(ids) != 1:
        raise ValueError(
            f"{where}: expected {name}={text!r} to be one token of the model's tokenizer; it is {len(ids)}: {ids}"
            + (" (a leading space is part of a token in many tokenizers)" if ids else "")
        )
    return int(ids[0])


def _token(value, vocab: int, name: str, where: str, model=None, tokenizer=None) -> int:
    """A token id from an int, or from one token's text through the model's tokenizer."""
    if isinstance(value, str):
        value = _single_token(value, model_tokenizer(model, tokenizer, where, name), name, where)
    token = check_int(value, name, where)
    if not 0 <= token < vocab:
        raise ValueError(f"{where}: expected {name} to be a token id in [0, {vocab}), got {token}")
    return token


def logit(model, token: int | str, *, tokenizer=None) -> Readout:
    """The logit of ``token`` (an id, or one token's text: :func:`to_single_token`): direction
    ``W_U[:, token]`` (``[d]``), bias ``b_U[token]``. For a model whose logits are soft-capped
    (:func:`logit_soft_cap`) it is the logit before the cap, and its label says so."""
    where = "pathkernels.logit"
    weight, bias, vocab = unembedding(model, where)
    a = _token(token, vocab, "token", where, model, tokenizer)
    constant = torch.zeros(1, dtype=torch.float64) if bias is None else bias.detach()[a : a + 1].double()
    return Readout(weight[a : a + 1].double(), constant, (_logit_label(model, a),), _is_classifier(model))


def logit_diff(model, a: int | str, b: int | str, *, tokenizer=None) -> Readout:
    """The logit difference of tokens ``a`` and ``b`` (ids, or each one token's text:
    :func:`to_single_token`, ``logit_diff(model, " Mary", " John")``): direction ``W_U[:, a] −
    W_U[:, b]`` (``[d]``), bias ``b_U[a] − b_U[b]``. For a model whose logits are soft-capped
    (:func:`logit_soft_cap`) it is the difference before the cap, and its label says so."""
    where = "pathkernels.logit_diff"
    weight, bias, vocab = unembedding(model, where)
    text = [name for name, value in (("a", a), ("b", b)) if isinstance(value, str)]
    if text:  # one tokenizer for both (read from disk where it is the one saved beside the model)
        tokenizer = model_tokenizer(model, tokenizer, where, text[0])
    a, b = _token(a, vocab, "a", where, model, tokenizer), _token(b, vocab, "b", where, model, tokenizer)
    direction = (weight[a].double() - weight[b].double())[None]
    constant = torch.zeros(1, dtype=torch.float64) if bias is None else (bias[a].double() - bias[b].double()).reshape(1)
    return Readout(direction, constant.detach(), (_logit_label(model, a, b),), _is_classifier(model))


def own_tokens(tokens: list[int]) -> str:
    """Where a batch's mean is read: "each element's own token (8, 5, 8)" (the first four shown)."""
    shown = ", ".join(map(str, tokens[:4])) + (", …" if len(tokens) > 4 else "")
    return f"each element's own token ({shown})"


def named(result, stack):
    """``result`` with the stack's model name (``AttentionStack.name``) for its figure titles."""
    result.model_name = getattr(stack, "name", "")
    return result


def check_kept(k: int, kept: int, paths, where: str) -> None:
    """Refuse a plot of ``k`` bars per side beyond the ``kept`` paths a result holds (its ``top_k``),
    where the tree had more: it would silently draw fewer."""
    if k > kept and int(paths) > kept:
        raise ValueError(
            f"{where}: expected top_k <= {kept}, the paths this result kept (its top_k); got top_k = {k}: "
            f"attribute again with top_k={k} to plot {k}"
        )


def pair_bars(
    top: list[dict],
    bottom: list[dict],
    k: int | None,
    kept_total: tuple[int, int],
    title: str,
    where,
    *,
    ax=None,
    path=None,
):
    """:func:`path_bars` of score pairs (rows of ``"query path"``, ``"key path"``, ``"value"``), the
    ``k`` largest and smallest (default: every one kept; beyond them refused where there were more,
    ``kept_total``: how many were kept and how many pairs there are). Returns the Figure, saved to
    ``path`` where given."""
    check_save_path(path, where)
    kept, total = kept_total
    k = max(kept, 1) if k is None else check_int(k, "top_k", where, minimum=1)
    check_kept(k, kept, total, where)

    def bars(rows):
        return [{"path": f"{row['query path']} · {row['key path']}", "attribution": row["value"]} for row in rows[:k]]

    return saved(path_bars(bars(top), bars(bottom), "pair term (query side · key side)", title, ax), path)


def path_bars(top: list[dict], bottom: list[dict], label: str, title: str, ax=None):
    """Horizontal bars of the ``top`` rows then the ``bottom`` ones (rows of ``"path"`` and
    ``"attribution"``, each path once), labelled by path; returns the Figure."""
    seen = {row["path"] for row in top}
    rows = top + [row for row in reversed(bottom) if row["path"] not in seen]
    if ax is None:
        longest = max((len(row["path"]) for row in rows), default=10)
        fig, ax = new_figure(min(5.5 + 0.055 * longest, 10), 0.3 * len(rows) + 1.4)
    else:
        fig = ax.figure
    values = [row["attribution"] for row in rows]
    ax.barh(range(len(rows)), values, color=["C0" if v >= 0 else "C3" for v in values])
    ax.set_yticks(range(len(rows)), [row["path"] for row in rows], fontsize=8)
    ax.invert_yaxis()
    ax.axvline(0, color="black", linewidth=0.5)
    if 0 < len(top) < len(rows):  # a rule between the largest and the smallest, each group named
        bar_side_labels(ax, len(top))
    ax.set_xlabel(wrapped(label, 70))
    ax.set_title(wrapped(title, 70), fontsize="medium")
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
            source and number of heads; ``counts [S, L+1]`` how many paths each sums. With a
            capture's transcoders (``replaced``), a path's steps are its heads and its MLP steps,
            and L counts both kinds: the choices ``[…, 2L]`` hold the head of each layer, then each
            MLP's step (a feature's id; ``num_features + k`` for its skip map's k-th direction).
        unenumerated: ``[P, R]`` what paths longer than ``max_length`` carry (``value − constant −``
            the sums; 0 up to rounding when every path was enumerated).
        top / bottom: the ``top_k`` largest and smallest attributions per (position, readout):
            ``values [k, P, R]``, ``paths [k, P, R, L]`` (the head at each layer, −1 where none) and
            ``sources [k, P, R]``.
        paths, path_sources, attribution: every enumerated path (``[M, L]``, ``[M]``) and its
            attribution ``[M, P, R]``, when they fit the memory budget (else None).
        absolute: ``[P, R]`` the sum of the absolute attributions of the enumerated paths: what a
            path's ``share`` is of (``attribution / absolute``), defined whatever the readout's sign or
            size; the shares' absolute values sum to 1 over the enumerated paths.
        by_head: ``[L, H, L, P, R]``: at ``[l, h, i]`` the sum of the attributions of every enumerated
            path whose ``i``-th head from its source is head h of layer l (exact; ``through_head``
            sums over ``i``).
    """

    batch: int | None
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
    absolute: Tensor | None = None
    by_head: Tensor | None = None
    model_name: str = ""  # the model's name for figure titles (AttentionStack.name)
    replaced: object | None = None  # the MLPs replaced by transcoders (their steps' names), or None

    def read_at(self, position: int) -> int | str:
        """Where the ``position``-th readout is read: its token, or for a batch's mean (``positions
        [B, P]``) "each element's own token" with the tokens."""
        if self.positions.dim() == 1:
            return int(self.positions[position])
        return own_tokens(self.positions[:, position].tolist())

    def _at(self, position: int) -> str:
        read = self.read_at(position)
        return f"token {read}" if isinstance(read, int) else read

    def __repr__(self) -> str:
        paths = int(self.counts.sum())
        mean = "" if self.batch is not None else f"the mean of {self.positions.shape[0]} elements: "
        if self.value.numel() == 1:
            headline = (
                f"{mean}{self.labels[0]} at {self._at(0)}: {float(self.value[0, 0]):.6g} "
                f"(constant {float(self.constant[0, 0]):.4g}), {paths:,} paths"
            )
        else:
            headline = f"{mean}{self.value.shape[0]} position(s) × {self.value.shape[1]} readout(s), {paths:,} paths"
        return short_repr(self, headline)

    @property
    def through_head(self) -> Tensor:
        """``[L, H, P, R]``: the sum over every enumerated path through head h of layer l."""
        if self.by_head is None:
            raise ValueError("pathkernels.PathAttribution.through_head: this result holds no per-head totals")
        return self.by_head.sum(2)

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
        """A path as text, its steps from the source up: ``"L3H5 → L7H1 from L2 MLP"``, ``"L0H1 →
        L1 F812 from embedding"`` (through a transcoder's feature), or ``"L2 MLP (direct)"``."""
        return describe_path(path, self.source_names[int(source)], self.replaced)

    def table(self, *, position: int = 0, readout: int = 0, which: str = "top") -> list[dict]:
        """The top (or ``which="bottom"``) paths of one position and readout (indices into
        ``positions`` and ``labels``) as rows: rank, path, source, length, attribution and its
        ``share``: the attribution over the sum of the enumerated paths' absolute attributions
        (``absolute``), so that it means the same whatever the readout's sign or size."""
        where = "pathkernels.PathAttribution.table"
        if not isinstance(which, str) or which not in ("top", "bottom"):
            raise ValueError(f"{where}: expected which='top' or 'bottom', got {which!r}")
        position, readout = self._check_cell(position, readout, where)
        values, paths, sources = (
            (self.top_values, self.top_paths, self.top_sources)
            if which == "top"
            else (self.bottom_values, self.bottom_paths, self.bottom_sources)
        )
        whole = math.nan if self.absolute is None else float(self.absolute[position, readout])
        rows = []
        for rank in range(values.shape[0]):
            value = float(values[rank, position, readout])
            path = paths[rank, position, readout]
            rows.append(
                {
                    "rank": rank + 1,
                    "path": self.describe(path, int(sources[rank, position, readout])),
                    "source": self.source_names[int(sources[rank, position, readout])],
                    "length": int((path != NO_HEAD).sum()),
                    "attribution": value,
                    "share": value / whole if whole > 0 else math.nan,
                }
            )
        return rows

    def head_table(self, *, position: int = 0, readout: int = 0):
        """Every head's total (:attr:`by_head`) at one position and readout as a pandas DataFrame,
        largest magnitude first: the head (``"L1H3"``), the sum over every enumerated path through
        it (``total``), its ``share`` of ``absolute``, and the sums by the head's place in the path
        (``as head 1``: paths that take it first from their source, …; NaN where a head's layer
        puts it no later)."""
        where = "pathkernels.PathAttribution.head_table"
        position, readout = self._check_cell(position, readout, where)
        by_head = self.through_head  # refuses a result without per-head totals
        places = self.by_head[..., position, readout]  # [L, H, L]
        whole = math.nan if self.absolute is None else float(self.absolute[position, readout])
        rows = []
        for layer in range(places.shape[0]):
            for head in range(places.shape[1]):
                total = float(by_head[layer, head, position, readout])
                row = {"head": f"L{layer}H{head}", "total": total, "share": total / whole if whole > 0 else math.nan}
                for place in range(layer + 1):  # a head of layer l is at most the (l+1)-th of its path
                    row[f"as head {place + 1}"] = float(places[layer, head, place])
                rows.append(row)
        return require("pandas").DataFrame(sorted(rows, key=lambda row: -abs(row["total"])))

    def _check_cell(self, position, readout, where: str) -> tuple[int, int]:
        """``position`` and ``readout`` as indices into ``positions`` and ``labels`` (ints in range)."""
        position = check_int(position, "position", where, minimum=0, maximum=self.value.shape[0] - 1)
        readout = check_int(readout, "readout", where, minimum=0, maximum=self.value.shape[1] - 1)
        return position, readout

    @renamed("pathkernels.PathAttribution.plot", k="top_k")
    def plot(self, top_k: int | None = None, *, position: int = 0, readout: int = 0, ax=None, path=None):
        """The ``top_k`` largest and ``top_k`` smallest attributions of one position and readout as
        horizontal bars, labelled by path (default: every path kept; more than were kept is refused
        where the tree has more). Returns the matplotlib Figure; with ``path`` it is also saved
        there (the format from the suffix)."""
        where = "pathkernels.PathAttribution.plot"
        check_save_path(path, where)
        position, readout = self._check_cell(position, readout, where)
        kept = self.top_values.shape[0]
        k = max(kept, 1) if top_k is None else check_int(top_k, "top_k", where, minimum=1)
        check_kept(k, kept, self.counts.sum(), where)
        top = self.table(position=position, readout=readout)[:k]
        bottom = self.table(position=position, readout=readout, which="bottom")[:k]
        label = f"attribution to {self.labels[readout]} at {self._at(position)}"
        title = titled(
            self.model_name, f"top and bottom paths (the readout: {float(self.value[position, readout]):.4g})"
        )
        return saved(path_bars(top, bottom, label, title, ax), path)

    def to_frame(self, *, position: int | None = None, readout: int | None = None, which: str = "top"):
        """:meth:`table` as a pandas DataFrame (pandas is optional): every position and readout
        (``position``: the token read, ``readout``: its label, as the first columns), or the one of
        ``position`` and ``readout`` (indices into ``positions`` and ``labels``) where given."""
        import pandas as pd

        where = "pathkernels.PathAttribution.to_frame"
        if not isinstance(which, str) or which not in ("top", "bottom"):
            raise ValueError(f"{where}: expected which='top' or 'bottom', got {which!r}")
        cells = [
            self._check_cell(p, r, where)
            for p in (range(self.value.shape[0]) if position is None else [position])
            for r in (range(self.value.shape[1]) if readout is None else [readout])
        ]
        rows = [
            {"position": self.read_at(p), "readout": self.labels[r], **row}
            for p, r in cells
            for row in self.table(position=p, readout=r, which=which)
        ]
        columns = ["position", "readout", "rank", "path", "source", "length", "attribution", "share"]
        return pd.DataFrame(rows, columns=columns)


@dataclass
class CheckedReadout:
    """A checked readout of one batch element: the frozen model, the top node's ``rho [1, P, n]``
    (``r = e_t / σ_t`` per position) and ``phi [1, R, d]`` (``v = C Γ u`` per readout), the
    ``constant`` and the model's own ``value`` ``[P, R]``."""

    model: FrozenModel
    rho: Tensor
    phi: Tensor
    constant: Tensor
    value: Tensor
    readout: Readout
    positions: list[int]
    batch: int | None
    max_length: int
    read_at: str | None = None  # where a batch's mean is read (its elements' own tokens), else None


def read_out(
    stack, readout, positions, batch, max_length, where: str, split_embedding: bool = False, in_batch: bool = False
) -> CheckedReadout:
    """The arguments :func:`path_attribution` and :func:`pathkernels.top_paths` share, checked in
    the caller's name, and the frozen model and readout they start from (``split_embedding``: its
    embedding as token and position sources; ``in_batch``: read beside the batch's other elements, a
    replaced MLP's steps those of the whole batch: :func:`frozen_model`)."""
    capture = getattr(stack, "residual_capture", None)
    if capture is None:
        raise ValueError(
            f"{where}: expected a stack with a residual_capture (pk.adapters.capture_huggingface_residual): "
            "attributions need the model's frozen norms, MLP outputs and final norm"
        )
    batch = check_int(batch, "batch", where)
    if not 0 <= batch < stack.batch_size:
        raise ValueError(f"{where}: expected batch in [0, {stack.batch_size}), got {batch}")
    # A path's steps: a head per layer, and a replaced MLP's step per layer.
    layers = stack.num_layers * (1 if getattr(capture, "transcoders", None) is None else 2)
    max_length = layers if max_length is None else check_int(max_length, "max_length", where)
    if not 0 <= max_length <= layers:
        raise ValueError(f"{where}: expected max_length in [0, {layers}], got {max_length}")
    read = Readout.of(readout, stack.d_model, where)
    tokens = stack.attn.shape[-1]
    real = torch.ones(tokens, dtype=torch.bool) if stack.token_mask is None else stack.token_mask[batch].cpu()
    pooled = getattr(capture, "pooled_token", None)
    if positions is None and read.pooled and pooled is not None:
        # The token the classifier's score head reads, by the model's rule (its pad id), which
        # need not be the last token the mask marks real.
        positions = [int(pooled[batch])]
        if not bool(real[positions[0]]):
            raise ValueError(
                f"{where}: the classifier reads batch element {batch} at token {positions[0]} (the rightmost whose "
                "id is not its pad id), which the attention mask marks as padding; pass positions, or a mask "
                "that agrees with the ids"
            )
    elif positions is None:
        positions = [int(real.nonzero().flatten()[-1])]
    else:
        positions = listed(positions)
        positions = list(positions) if isinstance(positions, (list, tuple)) else [positions]
    if len(positions) == 0:
        raise ValueError(f"{where}: expected at least one position in positions, got an empty list")
    positions = [check_int(p, "positions", where) for p in positions]
    for p in positions:
        if not -tokens <= p < tokens or not bool(real[p]):
            raise ValueError(
                f"{where}: expected positions of real tokens of batch element {batch} in [0, {tokens}), got {p}"
            )
    positions = [p % tokens for p in positions]
    where_real = torch.cumsum(real.long(), 0) - 1  # a real token's index among the real ones

    if split_embedding and capture.token_embedding is None:
        raise ValueError(
            f"{where}: split_embedding=True needs a model whose stream starts as a token embedding plus a learned "
            "position embedding (GPT-2, OPT, a TransformerLens model with standard positions); this capture's has no "
            "position embedding apart (rotary positions act inside the attention, and BERT normalises the sum)"
        )
    model = frozen_model(stack, capture, batch, real, split_embedding, batch_features=in_batch, where=where)
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
    return CheckedReadout(model, rho, phi, constant, value, read, positions, batch, max_length)


def mean_read_out(setups: list[CheckedReadout], where: str) -> CheckedReadout:
    """The checked readout of several batch elements' mean (each element's own from
    :func:`read_out`, one readout for all): the :func:`block_diagonal_model` of their frozen models,
    read at each element's positions with weight 1/B, so that every path's value is the mean of
    the elements' values of it. Refuses per-element readouts: a path's mean is then no longer one
    readout of one model."""
    first = setups[0]
    for setup in setups[1:]:
        if not torch.equal(setup.phi, first.phi) or setup.rho.shape[1] != first.rho.shape[1]:
            raise ValueError(
                f"{where}: the mean over a batch reads one readout at the same number of positions in every "
                "element; pass one readout (per-element readouts: batch_attribution gives their mean's paths)"
            )
    return CheckedReadout(
        model=block_diagonal_model([setup.model for setup in setups]),
        rho=torch.cat([setup.rho for setup in setups], -1) / len(setups),
        phi=first.phi,
        constant=torch.stack([setup.constant for setup in setups]).mean(0),
        value=torch.stack([setup.value for setup in setups]).mean(0),
        readout=first.readout,
        positions=first.positions,
        batch=None,
        max_length=first.max_length,
        read_at=own_tokens([setup.positions[0] for setup in setups]),
    )


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
    split_embedding: bool = False,
) -> PathAttribution:
    """Each path's attribution to a readout of a captured model, exact per-source and per-length
    sums, and the ``top_k`` largest and smallest paths (module docstring for the formula).

    Args:
        stack: a stack with a ``residual_capture`` (:func:`pathkernels.adapters.capture_huggingface_residual`).
        readout: :func:`logit_diff`, :func:`logit`, a :class:`Readout`, a direction ``[d]`` or
            directions ``[d, R]`` in the unembedding's space (before the final norm's frozen scale).
        positions: token positions to read out (default: the last real token of ``batch``; for a
            classifier's class logits, the token its score head reads, by its pad id).
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
        split_embedding: the embedding as two sources, "token embedding" and "position embedding"
            (last in ``source_names``), each path from it split in two that add up to it; for
            models that add learned positions to their tokens (GPT-2, OPT, TransformerLens with
            standard positions), refused elsewhere.

    Returns:
        :class:`PathAttribution`, float64. ``value`` is the readout of the capture's stream,
        ``Σ_p attr(p) + constant`` over every path; the tests hold it to the model's own logits.
    """
    top_k = check_int(top_k, "top_k", _WHERE, minimum=0)
    memory_budget = check_int(memory_budget, "memory_budget", _WHERE, minimum=1)
    progress = check_flag(progress, "progress", _WHERE)
    split_embedding = check_flag(split_embedding, "split_embedding", _WHERE)
    max_length, only = _tree_paths(stack, tree, max_length, _WHERE)
    setup = read_out(stack, readout, positions, batch, max_length, _WHERE, split_embedding)
    return named(attribute(setup, top_k, memory_budget, progress, only=only), stack)


def stack_path_counts(stack, batch: int = 0) -> list[int]:
    """The paths of batch element ``batch`` of a captured stack by their number of steps, ``0..S``:
    a source, then the skip or a branch of every sublayer above it (S = L heads; 2L with a capture's
    transcoders, whose active features are steps too, so that the counts are the element's own)."""
    capture = getattr(stack, "residual_capture", None)
    if getattr(capture, "transcoders", None) is None:
        layers = stack.num_layers
        return count_attribution_paths_by_length(layers, stack.num_heads, layers)
    tokens = stack.attn.shape[-1]
    real = torch.ones(tokens, dtype=torch.bool) if stack.token_mask is None else stack.token_mask[batch].cpu()
    model = frozen_model(stack, capture, batch, real)
    return model.path_counts(model.layers)


def _tree_paths(stack, tree: PathTree | None, max_length, where: str) -> tuple[int | None, PathSet | None]:
    """``(max_length, only)``: a tree's head choices as the paths to fold and the longest of them as
    the walk's depth (within ``max_length``), or ``(max_length, None)`` without a tree. With a
    capture's transcoders the tree holds choices ``[2L]``: heads, then each MLP's step."""
    if tree is None:
        return max_length, None
    replaced = getattr(getattr(stack, "residual_capture", None), "transcoders", None)
    if replaced is None:
        check_tree_shape(tree, stack.num_layers, stack.num_heads, where)
        paths, ids = tree.paths(), stack.num_heads
    else:
        paths, ids = _tree_steps(tree, stack, replaced, where)
    longest = int((paths != NO_HEAD).sum(1).max()) if paths.shape[0] else 0
    max_length = longest if max_length is None else min(check_int(max_length, "max_length", where), longest)
    return max_length, PathSet(paths, ids)


def _tree_steps(tree, stack, replaced, where: str) -> tuple[Tensor, int]:
    """A tree's paths ``[M, 2L]`` through heads and MLP steps (a stored tree, such as
    ``PathTree.from_paths(result.paths)``), each checked as :func:`pk.path_terms` checks a path's
    choices, and the number of distinct choice values they may hold."""
    columns = 2 * stack.num_layers
    if not isinstance(tree, PathTree):
        raise TypeError(f"{where}: expected tree to be a pathkernels.PathTree, got {type(tree).__name__}")
    if tree.num_layers != columns or tree.is_complete:
        raise ValueError(
            f"{where}: with the capture's transcoders a tree holds paths' choices [M, {columns}] (the head of each "
            f"layer, then each MLP's step, as path_attribution's paths hold them: PathTree.from_paths(paths)); got "
            f"a {'complete ' if tree.is_complete else ''}tree of {tree.num_layers} layers"
        )
    paths = tree.paths()
    heads = paths[:, : stack.num_layers]
    if bool(((heads < NO_HEAD) | (heads >= stack.num_heads)).any()):
        raise ValueError(f"{where}: expected heads in [-1, {stack.num_heads}) in the tree's first {stack.num_layers} "
                         f"columns, got {heads.unique().tolist()}")  # fmt: skip
    check_steps(paths, replaced, where)
    check_between(paths, replaced, where)
    return paths, max(stack.num_heads, int(paths.max()) + 1)


@dataclass
class BatchAttribution:
    """Path attributions over a batch of prompts (:func:`batch_attribution`): ``elements``, each
    element's own :class:`PathAttribution` (its readout at its own positions), and ``mean``, their
    exact average: a :class:`PathAttribution` whose every sum, total and value is the mean of the
    elements' (the mean of their attributions path by path, its top and bottom paths those of that
    mean), with ``positions`` ``[B, P]`` (each element's own) and ``batch`` None."""

    elements: list[PathAttribution]
    mean: PathAttribution

    def __repr__(self) -> str:
        return f"BatchAttribution({len(self.elements)} elements; mean: {self.mean!r})"

    def to_frame(self, *, which: str = "top"):
        """Every element's :meth:`PathAttribution.to_frame` and the mean's, one frame, the first
        column ``element`` (its batch index, or "mean")."""
        pd = require("pandas")
        frames = [r.to_frame(which=which).assign(element=r.batch) for r in self.elements]
        frames.append(self.mean.to_frame(which=which).assign(element="mean"))
        frame = pd.concat(frames, ignore_index=True)
        return frame[["element", *[c for c in frame.columns if c != "element"]]]

    @renamed("pathkernels.BatchAttribution.plot", k="top_k")
    def plot(self, top_k: int | None = None, **options):
        """The mean's :meth:`PathAttribution.plot` (options as there)."""
        return self.mean.plot(top_k, **options)


def batch_attribution(
    stack: AttentionStack,
    readout: Readout | Tensor | list,
    *,
    batch: list[int] | None = None,
    positions: list | None = None,
    max_length: int | None = None,
    tree: PathTree | None = None,
    top_k: int = 20,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    progress: bool = False,
    split_embedding: bool = False,
) -> BatchAttribution:
    """:func:`path_attribution` of every element of a batch of prompts, and their exact mean: the
    everyday measurement over a prompt set (the average logit difference of IOI prompts, each read
    at its own final token).

    For elements ``b`` with readouts ``u_b`` at positions ``t_b``, the mean attribution of a path is
    ``(1/B) Σ_b attr_b(p)``, each from element b's own frozen patterns and norms; the sums by
    source, length and head are the means of the elements' sums, so they add up, with the mean
    constant, to the mean of the model's own values.

    Args:
        stack: a stack with a ``residual_capture`` of the batch (padded sequences read their real
            tokens only).
        readout: one readout for every element, or a list of one per element (each element's own
            target: ``[pk.logit_diff(model, io, s) for io, s in names]``), each with the same number
            of directions R.
        batch: the elements (default: every one).
        positions: each element's positions: None (each its last real token), one int or list for
            every element, or a list of one list per element (``[[21], [25], [24], [16]]``: one
            position each); every element reads the same number P. A flat list with one int per
            element (``[21, 25, 24, 16]`` for a batch of 4) is refused as ambiguous.
        max_length, tree, top_k, memory_budget, progress, split_embedding: as in
            :func:`path_attribution`; the budget is shared by the elements.

    Returns:
        :class:`BatchAttribution`. The elements' walks go in step, and each chunk's values are
        averaged and folded as they come: the mean's top and bottom paths are exact whatever the
        number of paths (its every path's attribution is kept where it fits the budget).
    """
    where = "pathkernels.batch_attribution"
    elements = list(range(stack.batch_size)) if batch is None else listed(batch)
    if not isinstance(elements, (list, tuple)) or not elements:
        raise ValueError(f"{where}: expected batch to be a non-empty list of batch elements, got {batch!r}")
    elements = [check_int(b, "batch", where, minimum=0, maximum=stack.batch_size - 1) for b in elements]
    count = len(elements)
    readouts = list(readout) if isinstance(readout, (list, tuple)) else [readout] * count
    if len(readouts) != count:
        raise ValueError(f"{where}: expected one readout, or a list of {count} (one per element), got {len(readouts)}")
    per_element = _positions_per_element(positions, count, where)
    top_k = check_int(top_k, "top_k", where, minimum=0)
    memory_budget = check_int(memory_budget, "memory_budget", where, minimum=1)
    progress = check_flag(progress, "progress", where)
    split_embedding = check_flag(split_embedding, "split_embedding", where)
    max_length, only = _tree_paths(stack, tree, max_length, where)
    setups = []
    for b, read, at in zip(elements, readouts, per_element):
        setup = read_out(stack, read, at, b, max_length, where, split_embedding, in_batch=True)
        if setups and setup.value.shape != setups[0].value.shape:
            raise ValueError(
                f"{where}: expected every element to read the same number of positions and readouts; element {b} "
                f"reads {list(setup.value.shape)}, element {elements[0]} {list(setups[0].value.shape)}"
            )
        setups.append(setup)
    results, mean = attribute_in_step(setups, top_k, memory_budget, progress, only)
    return BatchAttribution([named(result, stack) for result in results], named(mean, stack))


def _positions_per_element(positions, count: int, where: str) -> list:
    """:func:`batch_attribution`'s ``positions`` as one entry per element (None: its last real
    token). A flat list of ``count`` ints (``count`` > 1) is refused as ambiguous: it could mean
    one position per element or every position in every element."""
    positions = listed(positions)
    if positions is None or not isinstance(positions, (list, tuple)):
        return [positions] * count
    positions = [listed(p) for p in positions]
    nested = [isinstance(p, (list, tuple)) for p in positions]
    if not any(nested):
        if len(positions) == count and count > 1:
            shown, more = list(positions)[:4], "…" if count > 4 else ""
            raise ValueError(
                f"{where}: positions={shown}{more} has one int per element of the batch of {count}, which could "
                f"mean one position per element or each of them in every element: pass {[[p] for p in shown]}{more} "
                f"(one list per element) for the first, [{shown}{more}] * {count} for the second"
            )
        return [list(positions)] * count
    if not all(nested) or len(positions) != count:
        raise ValueError(
            f"{where}: expected positions as None, one int or list for every element, or a list of {count} lists "
            f"(one per element); got {len(positions)} entries, {sum(nested)} of them lists"
        )
    return [list(p) for p in positions]


def attribute_in_step(
    setups: list[CheckedReadout], top_k: int, memory_budget: int, progress: bool = False, only: PathSet | None = None
) -> tuple[list[PathAttribution], PathAttribution]:
    """:func:`attribute` of several batch elements' checked readouts (the same paths, positions and
    readout count), their walks in step (:meth:`Walker.emissions`, one chunk size), and of their
    mean: each chunk's values averaged over the elements and folded, so that the mean's top and
    bottom paths, sums and totals are exact whatever the number of paths, within ``memory_budget``
    (shared by the elements' walks and folds)."""
    first = setups[0]
    model = first.model
    max_length = first.max_length
    readouts = len(first.readout.labels)
    total = sum(model.path_counts(max_length))
    share = max(1, memory_budget // (len(setups) + 1))
    chunk = min(_chunk(setup, share) for setup in setups)
    folds, together = [_fold(first, top_k, share, only) for _ in setups], _fold(first, top_k, share, only)
    walks = [
        Walker(setup.model, ENGINE, low_rank=True, max_length=max_length, cache_bytes=share // 2).emissions(
            setup.rho, setup.phi, max_length, chunk
        )
        for setup in setups
    ]
    bar = progress_bar(total, enabled=progress, unit="path", desc="pathkernels.batch_attribution")
    for steps in itertools.zip_longest(*walks):  # (zip would stop silently at the shortest)
        if any(step is None for step in steps) or not all(torch.equal(s[1], steps[0][1]) for s in steps[1:]):
            raise RuntimeError("pathkernels.batch_attribution: the elements' walks went out of step (a bug)")
        choices, lengths = steps[0][1], steps[0][2]
        for element, (parts, _, _) in zip(folds, steps):
            for source, values in parts:
                element.add(source, values, choices, lengths)
        for index, (source, _) in enumerate(steps[0][0]):
            together.add(source, torch.stack([step[0][index][1] for step in steps]).mean(0), choices, lengths)
        if bar is not None:
            bar.update(choices.shape[0])
    if bar is not None:
        bar.close()
    results = [_result(setup, element) for setup, element in zip(setups, folds)]
    mean = _result(first, together)
    mean.batch, mean.positions = None, torch.stack([r.positions for r in results])
    mean.labels = tuple(_common_label([r.labels[i] for r in results], i) for i in range(readouts))
    mean.value = torch.stack([r.value for r in results]).mean(0)
    mean.constant = torch.stack([r.constant for r in results]).mean(0)
    return results, mean


def _common_label(labels: list[str], index: int) -> str:
    """One label for the ``index``-th readout of every element: theirs where they agree, else what
    kind of readout each element's own is (its logit, its logit difference)."""
    if all(label == labels[0] for label in labels):
        return labels[0]
    if all(" − " in label for label in labels):
        return "each element's own logit difference"
    if all(label.startswith(("logit[", "class logit[")) for label in labels):
        return "each element's own logit"
    return f"each element's own readout {index}"


def attribute(
    setup: CheckedReadout,
    top_k: int,
    memory_budget: int,
    progress: bool = False,
    steps: ReadoutSteps = ENGINE,
    low_rank: bool = True,
    only: PathSet | None = None,
) -> PathAttribution:
    """:func:`path_attribution` of a checked readout (:func:`read_out`), its trie steps by ``steps``
    (the engine, or for comparisons ``pathkernels.reference``'s plain-PyTorch form); ``low_rank``
    as in :class:`~pathkernels.analysis.readout_trie.Walker` (pre-norm models only)."""
    model, max_length = setup.model, setup.max_length
    fold = _fold(setup, top_k, memory_budget, only)
    total = sum(model.path_counts(max_length))
    bar = progress_bar(total, enabled=progress, unit="path", desc=_WHERE)
    walker = Walker(model, steps, low_rank=low_rank, max_length=max_length, cache_bytes=memory_budget // 2)
    walker.walk(setup.rho, setup.phi, max_length, _chunk(setup, memory_budget), fold, bar)
    if bar is not None:
        bar.close()
    return _result(setup, fold)


def _fold(setup: CheckedReadout, top_k: int, memory_budget: int, only: PathSet | None) -> Fold:
    """A fold of a walk of ``setup``'s paths, with per-head totals; it keeps every path's
    attribution where they fit a quarter of ``memory_budget``."""
    model, positions, readouts = setup.model, len(setup.positions), len(setup.readout.labels)
    total = sum(model.path_counts(setup.max_length))
    keep = total * (8 * positions * readouts + 8 * (model.layers + 1)) <= memory_budget // 4
    head_columns = model.layers if model.replaced is None else model.replaced.num_layers
    return Fold(
        len(model.source_names),
        model.layers,
        positions,
        readouts,
        top_k,
        keep,
        only=only,
        heads=model.num_heads,
        head_columns=head_columns,
    )


def _chunk(setup: CheckedReadout, memory_budget: int) -> int:
    """Nodes per chunk of a walk within ``memory_budget``: a quarter of it for a chunk's nodes and
    their children (``ρ [P, n]`` and ``φ [R, d]`` each)."""
    node_bytes = 8 * (setup.rho.shape[1] * setup.rho.shape[2] + setup.phi.shape[1] * setup.phi.shape[-1])
    branches = max((sublayer.branches for sublayer in setup.model.sublayers), default=0)
    return max(1, memory_budget // (4 * (branches + 1) * node_bytes))


def _result(setup: CheckedReadout, fold: Fold) -> PathAttribution:
    """The :class:`PathAttribution` of a checked readout from its walk's ``fold``."""
    kept = {}
    if fold.kept is not None:
        choices, sources, values = (torch.cat(parts) for parts in zip(*fold.kept))  # the root's at least
        kept = {"paths": choices, "path_sources": sources, "attribution": values}
    return PathAttribution(
        batch=setup.batch,
        positions=torch.tensor(setup.positions),
        labels=setup.readout.labels,
        source_names=setup.model.source_names,
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
        absolute=fold.absolute,
        by_head=fold.by_head,
        replaced=setup.model.replaced,
        **kept,
    )
