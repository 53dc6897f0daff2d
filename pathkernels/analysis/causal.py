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
  (:func:`pathkernels.path_attribution`).

All the paths of one call are rows of one batched forward pass, after a clean row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from pathkernels.adapters.ablation import final_norm, run_without_terms
from pathkernels.adapters.capture import fingerprint_mismatch
from pathkernels.adapters.precision import in_float64
from pathkernels.adapters.self_check import check_tolerance
from pathkernels.analysis.attribution import Readout
from pathkernels.analysis.readout_trie import NO_HEAD, FrozenModel, describe_path, frozen_model, refuse_transcoders
from pathkernels.analysis.real_paths import _checked_paths, terms_of
from pathkernels.analysis.scores import checked_head, query_and_keys
from pathkernels.core._figures import check_save_path, new_figure, require, saved, titled, wrapped
from pathkernels.core.checks import check_flag, check_int

if TYPE_CHECKING:
    from pathkernels.adapters.stack import AttentionStack

_WHERE = "pathkernels.causal_check"
_SIDES = ("query", "key", "readout")
_AT = ("every", "one")  # a score path removed from the head's input at every token, or at the scored one


@dataclass
class CausalCheck:
    """What removing each path's term did (:func:`causal_check`); one entry per path.

    ``paths``: the paths as text. ``predicted``: the frozen prediction of the change, ``−`` each
    path's share (of the head's score at (query, key), or of the readout). ``score_change``: the
    head's measured score change (score paths); ``pattern_change``: its attention at (query, key)
    (unfrozen score paths); ``readout_change``: the readout at ``position`` (value paths, and score
    paths given a readout, unfrozen). ``clean``: the clean run's score, attention and readout (those
    measured). ``frozen``: whether the norm the term leaves was held at its clean scale."""

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

    def __repr__(self) -> str:
        return f"CausalCheck({self._summary()})"

    def _summary(self) -> str:
        """What was removed, where, and what the model recomputed: the repr's text and the figure's
        title."""
        if self.side == "readout":
            where, how = f"the readout at token {self.position}", "final norm recomputed"
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
        for name, values in (
            ("score change", self.score_change),
            ("attention change", self.pattern_change),
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
        keys' scores move too, and the label says it holds them); a score path's readout change has none (the frozen
        model holds the patterns, so it predicts 0), a value path's is ``−`` its attribution."""
        panels = []
        if self.score_change is not None:
            panels.append(("score change", self.score_change, self.predicted, "frozen prediction"))
        if self.pattern_change is not None:
            clean = torch.tensor(self.clean["attention"], dtype=torch.float64)
            moved = clean * self.predicted.double().exp()
            predicted = moved / (1 - clean + moved) - clean
            how = "from the predicted score" + (", other keys held" if self.at == "every" else "")
            panels.append(("attention change", self.pattern_change, predicted, how))
        if self.readout_change is not None:
            score_path = self.side != "readout"
            predicted = None if score_path else self.predicted
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
            ``layer``; a grouped-query model's key head serves its whole group) or ``"readout"``
            (a value path, removed before the final norm).
        query, key: the score's tokens (default query: the last real token); position: where the
            readout is read (default: the query, or the last real token).
        readout: a readout (:func:`pathkernels.logit_diff`, a direction ``[d]``) to measure too.
        frozen: hold the norm the removal touches at its clean scale (the change is then the
            frozen prediction, exactly: a check of the hooks); score paths then report the score
            change alone.
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
    if at != "every" and side == "readout":
        raise ValueError(f"{_WHERE}: at={at!r} is for score paths; a value path leaves the stream at every token")
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
    frozen_paths, names, chosen = _described(stack, paths, sources, batch)  # checked in this function's name
    choices = torch.stack([c for c, _ in chosen])
    terms = terms_of(frozen_paths, choices, torch.tensor([s for _, s in chosen]))  # [M, n_real, d]
    tokens = stack.attn.shape[-1]
    real = torch.ones(tokens, dtype=torch.bool) if stack.token_mask is None else stack.token_mask[batch].cpu().bool()
    full = terms.new_zeros(terms.shape[0], tokens, terms.shape[-1])
    full[:, real.to(full.device)] = terms
    read = None if readout is None else Readout.of(readout, stack.d_model, _WHERE)
    if read is not None and len(read.labels) != 1:
        raise ValueError(f"{_WHERE}: expected one readout direction, got {len(read.labels)}")
    if side == "readout":
        if frozen:
            raise ValueError(
                f"{_WHERE}: frozen=True with side='readout' is each path's attribution itself (pk.path_attribution); "
                "the check recomputes the final norm"
            )
        return _value_paths(model, stack, full, names, read, position, batch, real)
    removal = _ScoreRemoval(side, layer, head, query, key, position, frozen, batch, allow_masked, at)
    return _score_paths(model, stack, inputs, full, names, chosen, read, removal)


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


def _described(stack, paths, sources, batch) -> tuple[FrozenModel, list[str], list[tuple[Tensor, int]]]:
    """The frozen model of sequence ``batch``, and the paths as text and as ``(choices [L], source
    index)``."""
    tokens = stack.attn.shape[-1]
    real = torch.ones(tokens, dtype=torch.bool) if stack.token_mask is None else stack.token_mask[batch].cpu().bool()
    refuse_transcoders(stack.residual_capture, _WHERE, "causal_check")
    model = frozen_model(stack, stack.residual_capture, batch, real)
    names = model.source_names
    choices, index = _checked_paths(paths, sources, model, names, _WHERE)
    chosen = [(c, int(i)) for c, i in zip(choices.cpu(), index.cpu())]
    return model, [describe_path(c, names[i]) for c, i in chosen], chosen


def _above(choices: Tensor, source: int, layer: int) -> bool:
    """Whether a path takes a head at ``layer`` or above, or starts from a source above its
    attention (the sources below layer l are the first ``2 l + 1``)."""
    return bool((choices[layer:] != NO_HEAD).any()) or source > 2 * layer


def _score_paths(model, stack, inputs, terms, names, chosen, read, removal: _ScoreRemoval) -> CausalCheck:
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
    above = [name for name, (choices, source) in zip(names, chosen) if _above(choices, source, checked.layer)]
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
    other = (maps.keys if side == "query" else maps.queries)[batch, checked.layer, checked.head]
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


def _check_clean_score(model, clean: float, maps, batch: int, checked, i: int, j: int) -> None:
    """Refuse a model or inputs that are not the stack's: the clean run's score of query i and key
    j must be the capture's, to the capture's own tolerance against its model (relative to
    ``scaling · |q_i| |k_j|``, the most the score can be); else the changes measured would belong to
    another forward pass than the paths predicted from."""
    query = maps.queries[batch, checked.layer, checked.head][i]
    key = maps.keys[batch, checked.layer, checked.head][j].to(query.device)
    scaling = float(maps.scaling[checked.layer])
    captured = scaling * float(query @ key)
    bound = abs(scaling) * float(query.norm() * key.norm())
    parameter = next(model.parameters(), None)
    tolerance = check_tolerance(parameter.dtype if parameter is not None else torch.float64)
    if not abs(clean - captured) <= tolerance * bound:  # NaN fails too
        raise ValueError(
            f"{_WHERE}: the model on these inputs scores query {i} against key {j} at {clean:.6g}, but the stack's "
            f"capture at {captured:.6g} (beyond {tolerance:g} of its largest possible size, {bound:.3g}): expected "
            "the model and the inputs the stack was captured from"
        )


def _position(position, positions: Tensor, batch: int, tokens: int) -> int:
    """``position`` among the real tokens ``positions`` of a sequence of ``tokens``; negative counts
    from the end, as in pk.path_attribution."""
    tokens_real = positions.tolist()
    position = check_int(position, "position", _WHERE)
    if -tokens <= position < 0:
        position += tokens
    if position not in tokens_real:
        raise ValueError(f"{_WHERE}: expected position to be a real token of batch element {batch}, got {position}")
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
