"""The causal check of a path: take its term out where it enters, and measure what changes.

The decompositions are exact for the model frozen at one forward pass: every norm's scale and every
pattern held. :func:`causal_check` asks what the path does when they are not held. Each path's term
``Y_p`` (:func:`pathkernels.path_terms`) is removed from the one input it enters
(:mod:`pathkernels.adapters.ablation`):

- a score path (``side="query"`` or ``"key"``): the input of one head's query or key projection at
  its layer. Everything else comes from the clean run; the layer's norm is recomputed on the stream
  less the term, the head's scores and softmax follow, and so does every layer above. Reported: the
  head's score and attention at (query, key), and a readout at a position. Its frozen prediction is
  ``−`` the path's share of the score (:func:`pathkernels.score_attribution`); ``frozen=True`` holds
  the norm at the clean run's scale, and the measured score change then equals it exactly (the
  tests hold it to 1e-12 relative, which tests the hooks).
- a value path (``side="readout"``): the stream entering the final norm, which is recomputed (or
  held, ``frozen``); reported: the readout's change, beside ``−`` its attribution
  (:func:`pathkernels.path_attribution`). Paths through transcoder features too.
- a path into a transcoder feature (``side="feature"``, a capture with ``transcoders=``): the
  input of one feature's encoder at one token, where the path passes the feature. Its
  pre-activation is recomputed from the clean stream less the term (the MLP's norm and the set's
  own normalisation recomputed, or held, ``frozen``), its activation through the set's own
  activation (a JumpReLU's threshold, a TopK among the clean pre-activations of the others), and
  the change of what it writes is added to the MLP's output there: every layer above follows from
  the model's own forward pass. The other features at that MLP read what they read (the term left
  this feature's input only), so this is the replaced model (transcoder plus error) with one
  activation changed. Its frozen predictions: ``−`` the path's share of the pre-activation, that
  times the gate for the activation, and that times the feature's frozen effect on the readout
  (every path from it up, norms, patterns and gates held).

All the paths of one call are rows of one batched forward pass, after a clean row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from pathkernels.adapters.ablation import final_norm, mlp_norm_scale, run_with_mlp_writes, run_without_terms
from pathkernels.adapters.capture import fingerprint_mismatch
from pathkernels.adapters.precision import in_float64
from pathkernels.adapters.replacement import input_frame
from pathkernels.adapters.self_check import check_tolerance
from pathkernels.analysis.attribution import Readout
from pathkernels.analysis.readout_trie import (
    NO_HEAD,
    FrozenModel,
    describe_path,
    frozen_model,
)
from pathkernels.analysis.real_paths import _checked_paths, carry_up, steps_taken, terms_of
from pathkernels.analysis.scores import checked_head, query_and_keys
from pathkernels.core._figures import check_save_path, new_figure, require, saved, titled, wrapped
from pathkernels.core.checks import check_flag, check_int

if TYPE_CHECKING:
    from pathkernels.adapters.stack import AttentionStack

_WHERE = "pathkernels.causal_check"
_SIDES = ("query", "key", "readout", "feature")
_AT = ("every", "one")  # a score path removed from the head's input at every token, or at the scored one


@dataclass
class CausalCheck:
    """What removing each path's term did (:func:`causal_check`); one entry per path.

    ``paths``: the paths as text. ``predicted``: the frozen prediction of the change, ``−`` each
    path's share (of the head's score at (query, key), of the readout, or of the feature's
    pre-activation). ``score_change``: the head's measured score change (score paths);
    ``pattern_change``: its attention at (query, key) (unfrozen score paths); ``readout_change``: the
    readout at ``position`` (value paths, and score and feature paths given a readout, unfrozen for
    score paths). Feature paths (``side="feature"``): ``features`` ``[M]`` the feature each path
    enters at layer ``layer``, token ``token``; ``preactivation_change`` and ``activation_change``
    measured; ``predicted_activation`` (``predicted`` times the frozen gate) and
    ``predicted_readout`` (that times the feature's frozen effect on the readout). ``clean``: the
    clean run's values (those measured; a feature path's per path). ``frozen``: whether the norm the
    term leaves was held at its clean scale."""

    side: str
    layer: int | None
    head: int | None
    query: int | None
    key: int | None
    position: int | None
    frozen: bool
    paths: list[str]
    predicted: Tensor
    score_change: Tensor | None
    pattern_change: Tensor | None
    readout_change: Tensor | None
    clean: dict
    readout_label: str | None = None
    model_name: str = ""  # the model's name for figure titles (AttentionStack.name)
    at: str = "every"  # a score path removed from the head's input at every token, or at the scored one ("one")
    features: Tensor | None = None
    token: int | None = None
    preactivation_change: Tensor | None = None
    activation_change: Tensor | None = None
    predicted_activation: Tensor | None = None
    predicted_readout: Tensor | None = None

    def __repr__(self) -> str:
        return f"CausalCheck({self._summary()})"

    def _summary(self) -> str:
        """What was removed, where, and what the model recomputed: the repr's text and the figure's
        title."""
        if self.side == "readout":
            where, how = f"the readout at token {self.position}", "final norm recomputed"
        elif self.side == "feature":
            ids = sorted(set(self.features.tolist()))
            named = f"L{self.layer} F{ids[0]}'s" if len(ids) == 1 else f"the L{self.layer} features'"
            where = f"{named} input at token {self.token}"
            how = "the MLP's norm held" if self.frozen else "norms and patterns recomputed"
        else:
            token = (
                "every token" if self.at == "every" else f"token {self.key if self.side == 'key' else self.query} only"
            )
            where = f"L{self.layer}H{self.head}'s {self.side} at ({self.query}, {self.key}), at {token}"
            how = "norms and patterns recomputed"
        return f"{len(self.paths)} path(s) removed from {where}, {'norms held' if self.frozen else how}"

    def to_frame(self):
        """One row per path: its prediction and what was measured."""
        pd = require("pandas")
        columns = {"path": self.paths, "predicted": self.predicted.tolist()}
        if self.features is not None:
            columns = {"path": self.paths, "feature": self.features.tolist(), "predicted": self.predicted.tolist()}
        for name, values in (
            ("score change", self.score_change),
            ("attention change", self.pattern_change),
            ("pre-activation change", self.preactivation_change),
            ("predicted activation change", self.predicted_activation),
            ("activation change", self.activation_change),
            ("predicted readout change", self.predicted_readout),
            ("readout change", self.readout_change),
        ):
            if values is not None:
                columns[name] = values.tolist()
        return pd.DataFrame(columns)

    def panels(self) -> list[tuple[str, Tensor, Tensor | None, str]]:
        """What :meth:`plot` draws, one entry per change measured: ``(what, measured [M], frozen
        prediction [M] or None, what the prediction is)``. The score's prediction is ``−`` the path's
        share; the attention's follows from it with the other keys' scores held (``a e^δ / (1 − a +
        a e^δ) − a``, ``a`` the clean attention: what ``at="one"`` does; with ``at="every"`` the other
        keys' scores move too, and the label says it holds them); a score path's readout change has
        none (the frozen model holds the patterns, so it predicts 0), a value path's is ``−`` its
        attribution. A feature path's panels: its pre-activation's change beside ``−`` its share,
        its activation's beside that through the frozen gate, its readout's beside the frozen
        model's (:attr:`predicted_readout`)."""
        panels = []
        if self.side == "feature":
            panels.append(("pre-activation change", self.preactivation_change, self.predicted, "frozen prediction"))
            panels.append(("activation change", self.activation_change, self.predicted_activation, "frozen gate"))
        if self.score_change is not None:
            panels.append(("score change", self.score_change, self.predicted, "frozen prediction"))
        if self.pattern_change is not None:
            clean = torch.tensor(self.clean["attention"], dtype=torch.float64)
            moved = clean * self.predicted.double().exp()
            predicted = moved / (1 - clean + moved) - clean
            how = "from the predicted score" + (", other keys held" if self.at == "every" else "")
            panels.append(("attention change", self.pattern_change, predicted, how))
        if self.readout_change is not None:
            predicted = {"readout": self.predicted, "feature": self.predicted_readout}.get(self.side)
            what = "readout change" if self.readout_label is None else f"change of {self.readout_label}"
            panels.append((what, self.readout_change, predicted, "frozen prediction"))
        return panels

    def plot(self, *, ax=None, path=None):
        """Each removed path's measured changes, one panel each, side by side: the score's, the
        attention's and the readout's (those measured), each beside its frozen prediction as paired
        horizontal bars (:meth:`panels`). ``ax``: an Axes (the first panel alone) or one per panel.
        Returns the matplotlib Figure, saved to ``path``."""
        check_save_path(path, "pathkernels.CausalCheck.plot")
        require("matplotlib")
        panels = self.panels()
        count = len(self.paths)
        if ax is None:
            longest = max((len(name) for name in self.paths), default=10)
            fig, axes = new_figure(
                1.5 + 0.055 * longest + 3.0 * len(panels), 0.45 * count + 1.9, len(panels), sharey=True
            )
            axes = list(axes) if len(panels) > 1 else [axes]
        else:
            axes = list(ax) if isinstance(ax, (list, tuple)) else [ax]
            fig = axes[0].figure
        rows = torch.arange(count, dtype=torch.float64)
        for index, (one, (what, measured, predicted, told)) in enumerate(zip(axes, panels)):
            if predicted is not None:
                one.barh((rows - 0.2).tolist(), predicted.tolist(), height=0.4, color="C0", label=told)
            one.barh((rows + 0.2).tolist(), measured.tolist(), height=0.4, color="C1", label="measured")
            one.axvline(0, color="black", linewidth=0.5)
            one.set_xlabel(what)
            one.set_yticks(rows.tolist(), self.paths, fontsize=8)
            one.tick_params(labelleft=index == 0)
            if predicted is None:
                one.set_title("no frozen prediction\n(the frozen model holds the patterns)", fontsize="small")
            one.legend(fontsize="small", loc="best")
        for one in axes[: len(panels)]:  # the first path on top (shared axes turn together)
            if not one.yaxis_inverted():
                one.invert_yaxis()
        title = titled(self.model_name, self._summary())
        if len(axes) > 1:
            fig.suptitle(title, fontsize="medium")
        else:
            axes[0].set_title(wrapped(title, 70), fontsize="small")
        return saved(fig, path)


def _single_row(inputs: dict, batch: int, size: int) -> dict:
    """``inputs`` with every batched tensor cut to row ``batch``, kept as a batch of one."""
    if not isinstance(inputs, dict) or not inputs:
        raise TypeError(f"{_WHERE}: expected inputs to be the dict of model inputs the stack was captured from")
    out = {}
    for name, value in inputs.items():
        if isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == size:
            value = value[batch : batch + 1]
        out[name] = value
    return out


def causal_check(
    model,
    stack: AttentionStack,
    inputs: dict,
    paths,
    sources,
    *,
    side: str = "key",
    layer: int | None = None,
    head: int | None = None,
    query: int | None = None,
    key: int | None = None,
    readout: Readout | Tensor | None = None,
    position: int | None = None,
    frozen: bool = False,
    batch: int = 0,
    allow_masked: bool = False,
    at: str = "every",
    feature: int | None = None,
    token: int | None = None,
) -> CausalCheck:
    """Remove each path's term from the one input where it enters and measure the change (module
    docstring), all paths in one batched forward pass.

    Args:
        model: the Hugging Face model the stack was captured from.
        stack: its capture (``pk.adapters.capture_huggingface_residual(model, query_key=True, **inputs)``;
            ``query_key`` for score paths).
        inputs: the inputs of that capture (a dict: ``input_ids``, ``attention_mask``, …).
        paths, sources: the paths, as :func:`pathkernels.path_terms` takes them (``[M, L]`` heads,
            −1 where none; sources by index or name). Score paths must lie below ``layer``.
        side: ``"query"`` or ``"key"`` (a score path, removed from head ``head``'s input at
            ``layer``; a grouped-query model's key head serves its whole group), ``"readout"``
            (a value path, removed before the final norm) or ``"feature"`` (a path into a
            transcoder feature of layer ``layer``'s MLP, removed from its encoder's input at
            ``token``; module docstring).
        query, key: the score's tokens (default query: the last real token); position: where the
            readout is read (default: the query, or the last real token).
        feature, token: ``side="feature"``: the feature id and the token where the paths enter
            it (default token: the last real one). Without ``feature``, each path's own step at
            layer ``layer``'s MLP (``paths [M, 2L]``, column ``L + layer``) names the feature it
            enters, and what lies below that step is removed; with it, the paths end below that
            MLP. Nothing of a path may lie above the MLP (no head above ``layer``, no later step).
        readout: a readout (:func:`pathkernels.logit_diff`, a direction ``[d]``) to measure too.
        frozen: hold the norm the removal touches at its clean scale (the change is then the
            frozen prediction, exactly: a check of the hooks); score paths then report the score
            change alone. For feature paths the pre-activation's change is then the prediction;
            the activation follows the set's own activation and the model above is recomputed.
        batch: the sequence.
        allow_masked: also a key the mask forbids the query (refused by default: the model never
            uses that score, and its attention there is 0 whatever the path).
        at: where a score path's term leaves the head's input: ``"every"`` (the default) at every
            token, so that every key's score (``side="key"``) or every query's row moves: the
            path's whole effect on the head; ``"one"`` at the scored token alone (key ``key`` for
            ``side="key"``, query ``query`` for ``side="query"``), so that only the score at
            (query, key) moves and the attention there follows from it alone. The frozen
            prediction is the same for both; the attention and readout changes differ.

    Returns:
        :class:`CausalCheck`.
    """
    if side not in _SIDES:
        raise ValueError(f"{_WHERE}: expected side to be one of {_SIDES}, got {side!r}")
    if at not in _AT:
        raise ValueError(f"{_WHERE}: expected at to be one of {_AT}, got {at!r}")
    if at != "every" and side in ("readout", "feature"):
        raise ValueError(f"{_WHERE}: at={at!r} is for score paths; a {side} path leaves its input as side= says")
    if side != "feature" and (feature is not None or token is not None):
        raise ValueError(f"{_WHERE}: feature= and token= are for side='feature', got side={side!r}")
    if getattr(getattr(model, "config", None), "model_type", None) is None:
        raise TypeError(
            f"{_WHERE}: expected model to be the Hugging Face model the stack was captured from, got "
            f"{type(model).__name__}; TransformerLens models are not run by the causal check yet"
        )
    frozen = check_flag(frozen, "frozen", _WHERE)
    batch = check_int(batch, "batch", _WHERE, minimum=0, maximum=stack.batch_size - 1)
    capture = stack.residual_capture
    if capture is None:
        raise ValueError(f"{_WHERE}: expected a captured stack (pk.adapters.capture_huggingface_residual)")
    mismatch = fingerprint_mismatch(model, capture.model_fingerprint)
    if mismatch is not None:
        raise ValueError(
            f"{_WHERE}: expected model to be the model the stack was captured from; its weights are not the ones "
            f"the capture read: {mismatch}"
        )
    read = None if readout is None else Readout.of(readout, stack.d_model, _WHERE)
    if read is not None and len(read.labels) != 1:
        raise ValueError(f"{_WHERE}: expected one readout direction, got {len(read.labels)}")
    frozen_paths, names, chosen = _described(stack, paths, sources, batch)  # checked in this function's name
    if side == "feature":
        removal = _FeatureRemoval(layer, feature, token, position, frozen, batch)
        return _feature_paths(model, stack, inputs, frozen_paths, names, chosen, read, removal)
    choices = torch.stack([c for c, _ in chosen])
    terms = terms_of(frozen_paths, choices, torch.tensor([s for _, s in chosen]))  # [M, n_real, d]
    tokens = stack.attn.shape[-1]
    real = torch.ones(tokens, dtype=torch.bool) if stack.token_mask is None else stack.token_mask[batch].cpu().bool()
    full = terms.new_zeros(terms.shape[0], tokens, terms.shape[-1])
    full[:, real.to(full.device)] = terms
    if side == "readout":
        if frozen:
            raise ValueError(
                f"{_WHERE}: frozen=True with side='readout' is each path's attribution itself (pk.path_attribution); "
                "the check recomputes the final norm"
            )
        return _value_paths(model, stack, full, names, read, position, batch, real)
    removal = _ScoreRemoval(side, layer, head, query, key, position, frozen, batch, allow_masked, at)
    return _score_paths(model, stack, inputs, frozen_paths, full, names, chosen, read, removal)


@dataclass(frozen=True)
class _ScoreRemoval:
    """What :func:`causal_check` was asked of score paths (its arguments of the same names)."""

    side: str
    layer: int | None
    head: int | None
    query: int | None
    key: int | None
    position: int | None
    frozen: bool
    batch: int
    allow_masked: bool
    at: str


@dataclass(frozen=True)
class _FeatureRemoval:
    """What :func:`causal_check` was asked of feature paths (its arguments of the same names)."""

    layer: int | None
    feature: int | None
    token: int | None
    position: int | None
    frozen: bool
    batch: int


def _described(stack, paths, sources, batch) -> tuple[FrozenModel, list[str], list[tuple[Tensor, int]]]:
    """The frozen model of sequence ``batch``, and the paths as text and as ``(choices [L], source
    index)``."""
    tokens = stack.attn.shape[-1]
    real = torch.ones(tokens, dtype=torch.bool) if stack.token_mask is None else stack.token_mask[batch].cpu().bool()
    model = frozen_model(stack, stack.residual_capture, batch, real)
    names = model.source_names
    choices, index = _checked_paths(paths, sources, model, names, _WHERE)
    chosen = [(c, int(i)) for c, i in zip(choices.cpu(), index.cpu())]
    return model, [describe_path(c, names[i], model.replaced) for c, i in chosen], chosen


def _sublayer_of(model: FrozenModel, column: int) -> int:
    """The index of the sublayer whose branches go in a path's column ``column``: a layer's
    attention (``l``), or with transcoders a replaced MLP's steps (``L + l``)."""
    return next(i for i, sub in enumerate(model.sublayers) if sub.attn is not None and sub.column == column)


def _above(model: FrozenModel, choices: Tensor, source: int, at: int) -> bool:
    """Whether a path takes a branch of sublayer ``at`` or above, or starts from a source above it
    (source j enters below sublayer j)."""
    later = [sub.column for sub in model.sublayers[at:] if sub.attn is not None]
    return source > at or bool((choices[later] != NO_HEAD).any())


def _score_paths(model, stack, inputs, paths_model, terms, names, chosen, read, removal: _ScoreRemoval) -> CausalCheck:
    """:func:`causal_check` of score paths: ``terms [M, n, d]`` taken out of one head's query or
    key input as ``removal`` says, beside their frozen predictions."""
    side, layer, head, query, key = removal.side, removal.layer, removal.head, removal.query, removal.key
    position, frozen, batch, allow_masked, at = (
        removal.position,
        removal.frozen,
        removal.batch,
        removal.allow_masked,
        removal.at,
    )
    if layer is None or head is None or key is None:
        raise ValueError(f"{_WHERE}: a score path needs layer, head and key (the head's input it is removed from)")
    checked = checked_head(stack, layer, head, batch, _WHERE)
    query, keys = query_and_keys(checked, query, key, _WHERE, allow_masked, "key")
    maps, capture = checked.maps, stack.residual_capture
    level = _sublayer_of(paths_model, checked.layer)
    above = [name for name, (choices, source) in zip(names, chosen) if _above(paths_model, choices, source, level)]
    if above:
        raise ValueError(
            f"{_WHERE}: expected paths of the stream entering layer {checked.layer} (heads and source below it), "
            f"got {', '.join(above[:3])}"
        )
    if frozen and bool((maps.query_scale != 1).any() | (maps.key_scale != 1).any()):
        raise ValueError(
            f"{_WHERE}: frozen=True holds the layer's input norm only; this model's query/key norms would be "
            "recomputed inside its attention, so the change would not be the frozen prediction: use frozen=False"
        )
    positions, key = checked.positions, int(keys[0])
    i, j = int(positions[query]), int(positions[key])
    if at == "one":  # the term leaves the head's input at the scored token alone
        kept = torch.zeros(terms.shape[1], 1, dtype=terms.dtype, device=terms.device)
        kept[i if side == "query" else j] = 1
        terms = terms * kept
    # The frozen prediction: each path's share of the score with the other side as the model computed it.
    rows = torch.tensor([query if side == "query" else key], device=positions.device)
    real_terms = terms[:, positions]
    vectors = checked.side(side, real_terms, rows)[:, 0]  # [M, e]
    other = maps.computed("key" if side == "query" else "query", batch, checked.layer, checked.head)
    other = other[j if side == "query" else i].to(vectors.device)
    predicted = -(maps.scaling[checked.layer] * (vectors @ other)).cpu()

    scale, gamma, centred = capture.norm_scale[batch, checked.layer, 0], checked.gamma, checked.centred

    def held(t: Tensor) -> Tensor:  # D (Y C) Γ at the clean scale
        t = t.to(scale.device, torch.float64)
        t = t - t.mean(-1, keepdim=True) if centred else t
        return scale[None, :, None] * t * gamma

    single = _single_row(inputs, batch, stack.batch_size)
    sequence = next((single[k] for k in ("input_ids", "inputs_embeds") if isinstance(single.get(k), Tensor)), None)
    if sequence is None or sequence.dim() < 2 or tuple(sequence.shape[:2]) != (1, stack.attn.shape[-1]):
        got = "no input_ids" if sequence is None else f"a sequence of shape {list(sequence.shape)}"
        raise ValueError(
            f"{_WHERE}: expected inputs of the stack's {stack.batch_size} sequence(s) of {stack.attn.shape[-1]} "
            f"tokens (those it was captured from), got {got}"
        )
    run = run_without_terms(model, single, checked.layer, checked.head, side, terms, held if frozen else None, _WHERE)
    group = checked.head // (run.queries.shape[1] // run.keys.shape[1])
    scores = run.scaling * (run.queries[:, checked.head, i] * run.keys[:, group, j]).sum(-1)  # [1+M]
    _check_clean_score(model, float(scores[0]), maps, batch, checked, i, j)
    attention = run.patterns[:, checked.head, i, j]
    position = i if position is None else _position(position, positions, batch, stack.attn.shape[-1])
    clean = {"score": float(scores[0])}
    pattern_change = readout_change = None
    if not frozen:
        pattern_change = (attention[1:] - attention[0]).cpu()
        clean["attention"] = float(attention[0])
        if read is not None:
            readout_change, clean["readout"] = _readout_changes(run.final, read, position, where=_WHERE)
    return CausalCheck(
        side=side,
        layer=checked.layer,
        head=checked.head,
        query=i,
        key=j,
        position=position if read is not None else None,
        frozen=frozen,
        paths=names,
        predicted=predicted,
        score_change=(scores[1:] - scores[0]).cpu(),
        pattern_change=pattern_change,
        readout_change=readout_change,
        clean=clean,
        readout_label=None if read is None else read.labels[0],
        model_name=getattr(stack, "name", ""),
        at=at,
    )


def _feature_paths(model, stack, inputs, frozen: FrozenModel, names, chosen, read, removal: _FeatureRemoval):
    """:func:`causal_check` of paths into a transcoder feature (module docstring): each path's part
    below the feature removed from its encoder's input at one token, beside the frozen predictions."""
    capture, batch = stack.residual_capture, removal.batch
    replacement = capture.transcoders
    if replacement is None:
        raise ValueError(
            f"{_WHERE}: side='feature' follows paths into transcoder features; expected a capture with "
            "transcoders (pk.adapters.capture_huggingface_residual(model, transcoders=…))"
        )
    if removal.layer is None:
        raise ValueError(f"{_WHERE}: side='feature' needs layer, the MLP whose feature the paths enter")
    if capture.layout != "pre":
        raise ValueError(f"{_WHERE}: side='feature' of a post-norm model (BERT's) is not run yet")
    layer = check_int(removal.layer, "layer", _WHERE, minimum=0, maximum=stack.num_layers - 1)
    replaced, transcoders = replacement.layers.get(layer), replacement.transcoder_set
    if replaced is None:
        raise ValueError(
            f"{_WHERE}: expected layer to be one whose MLP the capture replaced ({sorted(replacement.layers)}), "
            f"got {layer}"
        )
    column = replacement.num_layers + layer
    choices = torch.stack([c for c, _ in chosen])
    sources = torch.tensor([source for _, source in chosen])
    steps, step_columns = _steps_reading_at(choices, replacement, layer)
    if removal.feature is None:
        if bool(((steps == NO_HEAD) | (steps >= replaced.num_features)).any()):
            raise ValueError(
                f"{_WHERE}: expected each path to pass a feature at layer {layer}'s MLP (paths[:, {column}] a "
                f"feature id below {replaced.num_features}), or feature= with paths that end below it; got "
                f"{steps.tolist()}"
            )
        features = steps.clone()
    else:
        feature = check_int(removal.feature, "feature", _WHERE, minimum=0, maximum=replaced.num_features - 1)
        if bool((steps != NO_HEAD).any()):
            raise ValueError(
                f"{_WHERE}: with feature=, expected paths that end below layer {layer}'s MLP (paths[:, {column}] "
                f"= -1), got {steps.tolist()}"
            )
        features = torch.full_like(steps, feature)
    below = choices.clone()
    below[torch.arange(below.shape[0]), step_columns] = NO_HEAD  # (a cross-layer step reading here writes above)
    reads = _sublayer_of(frozen, column) - replacement.parallel  # a parallel block's MLP reads below its attention
    above = [name for name, path, source in zip(names, below, sources.tolist()) if _above(frozen, path, source, reads)]
    if above:
        raise ValueError(
            f"{_WHERE}: expected paths that end at layer {layer}'s MLP (heads and steps below it, a source below "
            f"it), got {', '.join(above[:3])}"
        )
    tokens = stack.attn.shape[-1]
    real = torch.ones(tokens, dtype=torch.bool) if stack.token_mask is None else stack.token_mask[batch].cpu().bool()
    positions = real.nonzero().flatten()
    token = int(positions[-1]) if removal.token is None else _position(removal.token, positions, batch, tokens, "token")
    row = int((positions == token).nonzero())
    removed = terms_of(frozen, below, sources)[:, row]  # [M, d]: each path's term in the stream entering the MLP

    # The frozen gate of each feature at the token (0 for a feature open nowhere in the batch, which
    # is no step), and a unit activation's frozen effect on the readout: its write o_t d_f Γ_o
    # carried up through every branch above.
    index = {int(f): i for i, f in enumerate(replaced.features.tolist())}
    known = torch.tensor([int(f) in index for f in features.tolist()])
    columns = torch.tensor([index.get(int(f), 0) for f in features.tolist()], dtype=torch.long)
    device = removed.device
    gates = replaced.gates[batch, token].cpu()[columns] * known
    effect = None
    position = int(positions[-1]) if removal.position is None else _position(removal.position, positions, batch, tokens)
    if read is not None:  # (a cross-layer feature writes into every later layer's MLP too)
        carried = removed.new_zeros(len(names), positions.numel(), removed.shape[-1])
        for target, decoder in replacement.writes(layer).items():
            unit = removed.new_zeros(len(names), positions.numel(), removed.shape[-1])
            output_scale = float(replacement.layers[target].output_scale[batch, token])
            unit[:, row] = output_scale * decoder.to(device)[columns.to(device)]  # [M, d]
            carried += carry_up(frozen, unit, _sublayer_of(frozen, replacement.num_layers + target) + 1)
        pushed = removed.new_zeros(len(names), tokens, removed.shape[-1])
        pushed[:, real.to(device)] = carried
        effect = -_value_predictions(stack, pushed, read, position, batch) * known  # [M]

    # The measured changes: the pre-activation recomputed from the run's clean stream less the term.
    weight, bias = capture.norm_weight[layer, 1], capture.norm_bias[layer, 1]
    w_enc = transcoders.w_enc[layer].to(device, torch.float64)
    b_enc = transcoders.b_enc[layer].to(device, torch.float64)
    w_dec = {  # [M, d] into each layer the features write
        target: w.to(device, torch.float64)[features.to(device)] for target, w in transcoders.w_dec[layer].items()
    }
    picked = torch.arange(len(names), device=device)
    measured: dict = {}

    def frame_of(streams: Tensor):  # the set's input frame on streams [M, d], the MLP's norm recomputed
        return input_frame(transcoders, streams, mlp_norm_scale(model, layer, streams), weight, bias, capture.centred)

    def activate(pre: Tensor) -> Tensor:  # the set's own activation, where the set's tensors are
        return transcoders.activate(layer, pre.to(transcoders.w_enc[layer].device)).to(pre.device)

    def writes(stream: Tensor) -> Tensor:  # the clean stream entering the MLP's norm [n, d]
        x = stream[token].to(device, torch.float64)
        clean_frame = frame_of(x[None])
        pre = clean_frame(x[None, None])[0, 0] @ w_enc + b_enc  # [F]
        acts = activate(pre[None])[0]
        _check_clean_feature(acts, pre, replaced, batch, token, model, layer)
        measured["encoder"] = clean_frame.apply(w_enc[:, features.to(device)])  # M enc_f [d, M], any feature
        less = x[None] - removed  # [M, d]
        if removal.frozen:  # the norm's scale and the format's normalisation held at the clean stream's
            x_in = clean_frame(less[:, None])[:, 0]
        else:
            x_in = frame_of(less)(less[:, None])[:, 0]
        moved = (x_in * w_enc[:, features.to(device)].T).sum(-1) + b_enc[features.to(device)]  # [M]
        everything = pre.expand(len(names), -1).clone()  # the other features as they were
        everything[picked, features.to(device)] = moved
        acts_moved = activate(everything)[picked, features.to(device)]
        measured["pre"], measured["act"] = pre[features.to(device)], acts[features.to(device)]
        measured["pre_change"], measured["act_change"] = moved - measured["pre"], acts_moved - measured["act"]
        added = {}
        for target, decoder in w_dec.items():
            added[target] = stream.new_zeros(len(names), *stream.shape).double()
            added[target][:, token] = (measured["act_change"][:, None] * decoder).to(stream.device)
        return added

    single = _single_row(inputs, batch, stack.batch_size)
    final = run_with_mlp_writes(
        model, single, layer, len(names), writes, replacement.output_hook == "mlp_module_output"
    )
    # The frozen predictions: the pre-activation's change −s_t (Y M enc_f), s_t the capture's frozen
    # scale of the set's input; the activation's through the gate; the readout's through the effect.
    scale = float(replaced.input_scale[batch, token])
    predicted = -(scale * (removed * measured["encoder"].T).sum(-1)).cpu()
    predicted_activation = predicted * gates
    predicted_readout = None if effect is None else predicted_activation * effect.cpu()
    clean = {
        "preactivation": measured["pre"].cpu().tolist(),
        "activation": measured["act"].cpu().tolist(),
    }
    readout_change = None
    if read is not None:
        readout_change, clean["readout"] = _readout_changes(final, read, position, where=_WHERE)
    return CausalCheck(
        side="feature",
        layer=layer,
        head=None,
        query=None,
        key=None,
        position=position if read is not None else None,
        frozen=removal.frozen,
        paths=names,
        predicted=predicted,
        score_change=None,
        pattern_change=None,
        readout_change=readout_change,
        clean=clean,
        readout_label=None if read is None else read.labels[0],
        model_name=getattr(stack, "name", ""),
        features=features.cpu(),
        token=token,
        preactivation_change=measured["pre_change"].cpu(),
        activation_change=measured["act_change"].cpu(),
        predicted_activation=predicted_activation,
        predicted_readout=predicted_readout,
    )


def _steps_reading_at(choices: Tensor, replacement, layer: int) -> tuple[Tensor, Tensor]:
    """``([M], [M])``: the step each path takes that reads at layer ``layer``'s MLP, as layer
    ``layer``'s feature id (or ``F + k`` for its skip map; −1 where none), and the column holding it
    (its own, ``L + layer``, or with a cross-layer set a later MLP's where that feature writes)."""
    layers = replacement.num_layers
    steps = choices[:, layers + layer].clone()
    columns = torch.full_like(steps, layers + layer)
    for row, source, target, index in steps_taken(choices, replacement) if replacement.cross_layer else []:
        if source == layer and target != layer:
            steps[row], columns[row] = index, layers + target
    return steps, columns


def _capture_tolerance(model) -> float:
    """The capture's own tolerance against a model of ``model``'s dtype (float64 without weights)."""
    parameter = next(model.parameters(), None)
    return check_tolerance(parameter.dtype if parameter is not None else torch.float64)


def _check_clean_feature(acts: Tensor, pre: Tensor, replaced, batch: int, token: int, model, layer: int) -> None:
    """Refuse a model or inputs that are not the stack's: the clean run's activations of the
    features the capture found active at ``token`` must be the capture's, to the capture's own
    tolerance against its model (relative to the largest pre-activation there)."""
    captured = replaced.activations[batch, token].to(acts.device)
    recomputed = acts[replaced.features.to(acts.device)] * replaced.gates[batch, token].to(acts.device)
    tolerance = _capture_tolerance(model)
    size = float(pre.abs().max().clamp_min(1e-300))
    difference = float((recomputed - captured).abs().max()) if captured.numel() else 0.0
    if not difference <= tolerance * size:
        raise ValueError(
            f"{_WHERE}: the model on these inputs gives layer {layer}'s features at token {token} activations "
            f"{difference:.3g} away from the capture's (beyond {tolerance:g} of the largest pre-activation, "
            f"{size:.3g}): expected the model and the inputs the stack was captured from"
        )


def _check_clean_score(model, clean: float, maps, batch: int, checked, i: int, j: int) -> None:
    """Refuse a model or inputs that are not the stack's: the clean run's score of query i and key
    j must be the capture's, to the capture's own tolerance against its model (relative to
    ``scaling · |q_i| |k_j|``, the most the score can be); else the changes measured would belong to
    another forward pass than the paths predicted from."""
    query = maps.computed("query", batch, checked.layer, checked.head)[i]
    key = maps.computed("key", batch, checked.layer, checked.head)[j].to(query.device)
    scaling = float(maps.scaling[checked.layer])
    captured = scaling * float(query @ key)
    bound = abs(scaling) * float(query.norm() * key.norm())
    tolerance = _capture_tolerance(model)
    if not abs(clean - captured) <= tolerance * bound:  # NaN fails too
        raise ValueError(
            f"{_WHERE}: the model on these inputs scores query {i} against key {j} at {clean:.6g}, but the stack's "
            f"capture at {captured:.6g} (beyond {tolerance:g} of its largest possible size, {bound:.3g}): expected "
            "the model and the inputs the stack was captured from"
        )


def _position(position, positions: Tensor, batch: int, tokens: int, name: str = "position") -> int:
    """``position`` (the argument ``name``) among the real tokens ``positions`` of a sequence of
    ``tokens``; negative counts from the end, as in pk.path_attribution."""
    tokens_real = positions.tolist()
    position = check_int(position, name, _WHERE)
    if -tokens <= position < 0:
        position += tokens
    if position not in tokens_real:
        raise ValueError(f"{_WHERE}: expected {name} to be a real token of batch element {batch}, got {position}")
    return position


def _readout_changes(final: Tensor | None, read: Readout, position: int, where: str) -> tuple[Tensor, float]:
    if final is None:
        raise ValueError(f"{where}: this model has no final norm whose output a readout reads")
    values = final[:, position] @ read.directions[0].to(final.device) + float(read.bias[0])
    return (values[1:] - values[0]).cpu(), float(values[0])


def _value_paths(model, stack, terms, names, read, position, batch, real):
    if read is None:
        raise ValueError(f"{_WHERE}: side='readout' needs a readout (pk.logit_diff, pk.logit or a direction)")
    capture = stack.residual_capture
    positions = real.nonzero().flatten()
    position = int(positions[-1]) if position is None else _position(position, positions, batch, stack.attn.shape[-1])
    residual = capture.residual[batch, position].to(terms.device)  # the stream entering the final norm
    removed = terms[:, position]  # [M, d]
    direction = read.directions[0].to(terms.device)
    if capture.final_scale is None:
        raise ValueError(f"{_WHERE}: side='readout' recomputes the final norm, which this model does not have")
    norm = final_norm(model)
    stream = torch.cat([residual[None], residual[None] - removed])
    parameter = next(norm.parameters(), None)
    dtype = parameter.dtype if parameter is not None else stream.dtype
    with in_float64(model), torch.no_grad():
        normed = norm(stream.to(dtype)[:, None]).double()[:, 0]
    values = normed @ direction + float(read.bias[0])
    change, clean_value = values[1:] - values[0], float(values[0])
    predicted = _value_predictions(stack, terms, read, position, batch)
    return CausalCheck(
        side="readout",
        layer=None,
        head=None,
        query=None,
        key=None,
        position=position,
        frozen=False,
        paths=names,
        predicted=predicted,
        score_change=None,
        pattern_change=None,
        readout_change=change.cpu(),
        clean={"readout": clean_value},
        readout_label=read.labels[0],
        model_name=getattr(stack, "name", ""),
    )


def _value_predictions(stack, terms, read, position, batch) -> Tensor:
    """``−`` each path's attribution to the readout at ``position``: ``rᵀ Y_p v`` with ``r = e_t / σ_t``
    and ``v = C Γ u`` (the frozen final norm)."""
    capture = stack.residual_capture
    v = read.directions[0].to(terms.device) * capture.final_weight
    v = v - v.mean() if capture.final_centred else v
    return -(capture.final_scale[batch, position] * (terms[:, position] @ v)).cpu()
