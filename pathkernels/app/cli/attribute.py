"""``pathkernels attribute``: each path's share of a logit difference (or of a probe direction read
from a file) at one token, and the top and bottom paths, within a time limit."""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path

import torch

from pathkernels.adapters.residual import capture_huggingface_residual
from pathkernels.analysis.attribution import (
    Readout,
    logit_diff,
    logit_soft_cap,
    path_attribution,
    path_bars,
    stack_path_counts,
    unembedding,
)
from pathkernels.analysis.readout_trie import frozen_model
from pathkernels.analysis.top_paths import top_paths
from pathkernels.app.cli.base import DIRECTION_FORMS, MAX_ATTRIBUTION_PATHS, CommandLineError, within
from pathkernels.app.cli.common import (
    float_format,
    heading,
    local_model,
    model_to_run,
    number,
    read_transcoders,
    save,
)
from pathkernels.app.cli.sizes import model_shape
from pathkernels.app.experiments import fitted_title
from pathkernels.core._progress import TimeLimitReached, time_limit


def _token_id(value: str, tokenizer, vocab: int, option: str) -> int:
    """A token id from ``--target`` / ``--versus``: an integer, or with a tokenizer one token's text."""
    try:
        token = int(value)
    except ValueError:
        if tokenizer is None:
            raise CommandLineError(f"{option}: expected a token id (an integer), got {value!r}") from None
        ids = tokenizer.encode(value, add_special_tokens=False)
        if len(ids) != 1:
            raise CommandLineError(
                f"{option}: expected text that is one token, got {value!r} ({len(ids)} tokens)"
            ) from None
        token = ids[0]
    if not 0 <= token < vocab:
        raise CommandLineError(f"{option}: expected a token id in [0, {vocab}), got {token}")
    return token


class _Clock:
    """A command's ``--time-limit``: the seconds it has left, from ``start`` (``time.monotonic()``
    when the command began, before its imports; default now)."""

    def __init__(self, seconds: float | None, start: float | None = None):
        self.start = time.monotonic() if start is None else start
        self.seconds = seconds
        self.end = math.inf if seconds is None else self.start + seconds

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.end - time.monotonic()


def built_and_captured(clock: _Clock, run, *, transcoders: Path | None = None, **options):
    """``((network, inputs, (stack, capture)), None)``: the command's model built and captured
    (:func:`~pathkernels.adapters.capture_huggingface_residual` with ``options``; with ``transcoders``
    the set in that folder replacing its MLPs), each step run aside and left behind at the clock's
    limit; ``(None, stage)`` where the limit came first. A capture's refusal is one command-line line."""
    done, network = within(clock.left(), run.build)
    if not done:
        return None, "building the model"
    inputs = run.drawn_inputs() if run.inputs is None else run.inputs
    if transcoders is not None:
        options["transcoders"] = read_transcoders(Path(transcoders), network)
    try:
        done, captured = within(clock.left(), capture_huggingface_residual, network, **options, **inputs)
    except ValueError as error:
        raise CommandLineError(str(error).split(": ", 1)[-1]) from None
    if not done:
        return None, "capturing the model"
    return (network, inputs, captured), None


def read_direction(path: Path, width: int | None = None) -> torch.Tensor:
    """``--direction``: a probe direction ``[d]`` in float64, from a torch ``.pt`` (or ``.pth``)
    tensor, a NumPy ``.npy`` array or a text file of numbers (separated by spaces, commas or
    newlines). Refuses, naming ``--direction`` and the expected d where known, what is not a
    finite vector of real numbers of that length."""
    option = f"--direction {path}"
    expected = DIRECTION_FORMS + (f" with d = {width} (the model's hidden size)" if width is not None else "")
    if not path.is_file():
        raise CommandLineError(f"{option}: no such file; expected {expected}")
    suffix = path.suffix.lower()
    try:
        if suffix in (".pt", ".pth"):
            value = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(value, torch.Tensor):
                raise CommandLineError(f"{option}: holds a {type(value).__name__}, not a tensor; expected {expected}")
        elif suffix == ".npy":
            import numpy as np

            array = np.load(path, allow_pickle=False)
            if array.dtype.kind not in "fiu":
                raise CommandLineError(f"{option}: holds {array.dtype} numbers; expected real numbers, {expected}")
            value = torch.from_numpy(np.asarray(array, dtype=np.float64))
        else:
            words = path.read_text().replace(",", " ").split()
            numbers = []
            for word in words:
                try:
                    numbers.append(float(word))
                except ValueError:
                    raise CommandLineError(f"{option}: {word[:40]!r} is not a number; expected {expected}") from None
            value = torch.tensor(numbers, dtype=torch.float64)
    except CommandLineError:
        raise
    except Exception as error:  # noqa: BLE001 (an unreadable file, whatever the reader raises)
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CommandLineError(f"{option}: cannot read it ({reason}); expected {expected}") from None
    if value.is_complex() or value.dtype == torch.bool:
        raise CommandLineError(f"{option}: holds {str(value.dtype).removeprefix('torch.')} values; expected {expected}")
    if value.dim() != 1 or (width is not None and value.shape[0] != width):
        shape = "[" + ", ".join(map(str, value.shape)) + "]"
        raise CommandLineError(f"{option}: has shape {shape}; expected {expected}")
    if value.numel() == 0:
        raise CommandLineError(f"{option}: holds no numbers; expected {expected}")
    value = value.detach().to(torch.float64)
    if not bool(torch.isfinite(value).all()):
        raise CommandLineError(f"{option}: holds a NaN or infinite value; expected finite numbers, {expected}")
    return value


def _linear_logits(model, spec: str) -> None:
    """Refuse a logit difference of a model whose logits are not linear in its last hidden state,
    by name, pointing at --direction."""
    try:
        unembedding(model, "pathkernels attribute")
    except ValueError:
        d = getattr(model.config, "hidden_size", None)
        numbers = f"{d} numbers" if d else "d numbers"
        raise CommandLineError(
            f"--model {spec}: the logits of {type(model).__name__} ({model.config.model_type}) are not a linear "
            "map of its last hidden state (a head with a dense layer, an activation or a norm of its own, or "
            f"none), so its logit difference cannot be split among paths; pass --direction FILE ({numbers}: "
            "a probe direction read from the last hidden state) to attribute that instead"
        ) from None


def attribute_table(
    *,
    model: str | None = None,
    text: str | None = None,
    ids: list[int] | None = None,
    example: bool = False,
    layers: int = 4,
    heads: int = 4,
    width: int = 64,
    tokens: int | None = None,
    seed: int = 0,
    target: str | None = None,
    versus: str | None = None,
    direction: Path | None = None,
    position: int | None = None,
    top: int = 10,
    max_length: int | None = None,
    time_limit: float | None = 300.0,
    out: Path | None = None,
    started: float | None = None,
    transcoders: Path | None = None,
):
    """``pathkernels attribute``: each path's attribution to a logit difference at one token of a
    model built from a config (or a local model), or with ``direction`` (a file: :func:`read_direction`)
    to that probe direction · the model's last hidden state, the sums by length and by source, and
    the top and bottom paths; with ``out`` also CSV files and a plot. A model with more than 10^7 paths
    gets its sums from the paths of the lengths that fit, and its top and bottom paths from the
    certified search (pk.top_paths).

    ``time_limit`` (seconds, None for none) bounds the whole command: building and capturing the
    model (which cannot be stopped part-way: they run in a thread, left behind at the limit), the
    walk over the paths (lengths 0, 1, … each walked whole within the limit: the longest that
    finished is reported, what the longer paths carry stays exact) and the two searches (each
    given half of what is left; at the limit a search returns its best list with its gap, or, if
    its set-up alone outlasts it, nothing). What stopped where is printed. Work that would not fit
    the machine's memory is refused before any is done. ``started``: when the command began
    (``time.monotonic()``, before torch and transformers were imported, which cannot be cut short),
    the time the limit counts from; default the call. Returns the PathAttribution, or None when
    the limit came before any path was attributed. ``transcoders``: a folder of transcoders replacing
    the model's MLPs (:func:`pathkernels.adapters.load_transcoders`), whose active features are then
    steps of the paths too."""
    import pandas as pd

    clock = _Clock(time_limit, started)
    probe = None
    if direction is not None:  # read first: a bad file is refused before the model is built
        expected = (model_shape(model) or {}).get("width") if model else width
        probe = read_direction(Path(direction), expected)
    if model:
        local = local_model(model)
        if local.is_vision:
            raise CommandLineError(
                f"--model {model} is a vision model; attribute reads language models (token ids) only"
            )
        if probe is None:
            _linear_logits(local.model, model)
        elif getattr(local.model.config, "hidden_size", probe.shape[0]) != probe.shape[0]:
            read_direction(Path(direction), local.model.config.hidden_size)  # refuses, naming d
    run = model_to_run(
        "attribute",
        local if model else None,
        model,
        text,
        tokens,
        layers,
        heads,
        width,
        seed,
        bytes_per_entry=40,
        ids=ids,
        example=example,
    )
    tokenizer, source = run.tokenizer, run.source
    tokens = run.tokens
    # Building and capturing cannot be stopped part-way (minutes for a large model): they run aside
    # and are left behind at the limit.
    built, stage = built_and_captured(clock, run, transcoders=transcoders)
    if built is None:
        return _stopped(clock, stage)
    network, inputs, (stack, capture) = built
    pooled = capture.pooled_token
    n = stack.attn.shape[-1]
    if position is None:  # a classifier's class logits: the token its score head reads (by its pad id)
        position = int(pooled[0]) if pooled is not None and probe is None else n - 1
    if not -n <= position < n:
        raise CommandLineError(f"--position: expected a token position in [-{n}, {n}), got {position}")
    position %= n
    with torch.no_grad():
        output = network.eval()(**inputs, output_hidden_states=True)
    last = output.hidden_states[-1][0, position].double()  # the final norm's output: what a readout reads
    if probe is not None:
        if probe.shape[0] != stack.d_model:
            read_direction(Path(direction), stack.d_model)  # refuses, naming the expected d
        name = f"the direction from {direction}"
        readout = Readout(probe[None], torch.zeros(1, dtype=torch.float64), (name,))
        own = float(last @ probe) if last.shape[-1] == probe.shape[0] else None
        label, constant_parts = f"{name} · the last hidden state", "the final norm's β, where the model has one"
    else:
        weight, bias, vocab = unembedding(network, "pathkernels attribute")
        capped = logit_soft_cap(network) is not None
        logits = getattr(output, "logits", None)
        if logits is not None and logits.dim() == 3 and not capped:
            logits = logits[0, position].double()
        elif logits is not None and pooled is not None and position == int(pooled[0]):
            logits = logits[0].double()  # the classifier's own class logits, read at this token
        else:  # a base model with tied embeddings, a classifier's head at another token, or logits before the cap
            logits = last @ weight.double().T
            logits = logits if bias is None else logits + bias.double()
        ranked = torch.argsort(logits, descending=True).tolist()
        a = ranked[0] if target is None else _token_id(target, tokenizer, vocab, "--target")
        b = next(t for t in ranked if t != a) if versus is None else _token_id(versus, tokenizer, vocab, "--versus")
        if a == b:
            raise CommandLineError(f"--versus: expected a token other than --target ({a})")
        readout = logit_diff(network, a, b)
        own = float(logits[a] - logits[b])
        classifier = type(network).__name__.endswith("ForSequenceClassification")
        kind = "class logit" if classifier else "logit"

        def token_text(token: int) -> str:
            return f"{token} ({tokenizer.decode([token])!r})" if tokenizer is not None else str(token)

        label = f"{kind}[{token_text(a)}] − {kind}[{token_text(b)}]" + (
            " (before the logit soft cap)" if capped else ""
        )
        constant_parts = "the final norm's β and the " + ("score head's bias" if classifier else "unembedding bias")
    by_length = stack_path_counts(stack)  # by steps: heads, and with --transcoders the MLPs' steps too
    layers_ = len(by_length) - 1
    step = "head" if transcoders is None else "step"

    def count(k: int) -> int:  # the paths through at most k steps
        return sum(by_length[: k + 1])

    everything = count(layers_)
    search = max_length is None and everything > MAX_ATTRIBUTION_PATHS  # top paths by the certified search
    if max_length is None:
        max_length = max((k for k in range(layers_ + 1) if count(k) <= MAX_ATTRIBUTION_PATHS), default=0)
    elif max_length > layers_:
        raise CommandLineError(f"--max-length: expected at most the model's {layers_} steps, got {max_length}")
    wanted = max_length
    # The searches get half of what is left after the walk; the walk the rest (all of it without them).
    walk_end = time.monotonic() + (clock.left() / 2 if search else clock.left())
    # Twice the top: where the paths are that few, one table lists them all (no pair of tables of the same paths).
    counts = [count(k) for k in range(wanted + 1)]
    result, max_length = _attribution_walk(stack, readout, position, 2 * top, wanted, walk_end, counts)
    paths = count(max_length)

    value, constant = float(result.value[0, 0]), float(result.constant[0, 0])
    print(f"Path attribution of {source}")
    if "random token ids" in source:  # what was drawn, so that a run can be read again
        ids = inputs["input_ids"][0].tolist()
        print(f"token ids: {ids[:64]}" + (f" … ({len(ids) - 64} more)" if len(ids) > 64 else ""))
    theirs = "n/a: the hidden state's width differs" if own is None else number(own, ".6g")
    print(
        f"readout: {label} at token {position} = {number(value, '.6g')} (the model's own: {theirs}); "
        f"{number(constant, '.4g')} of it is constant ({constant_parts})"
    )
    if paths == everything:
        closure = float(result.unenumerated[0, 0])
        print(f"paths: all {paths:,}, exactly (Σ attributions + constant − readout = {number(-closure, '.2g')})")
    else:
        print(
            f"paths: the {paths:,} through at most {max_length} {step}{'' if max_length == 1 else 's'}, of "
            f"{everything:,}; the longer ones carry "
            f"{number(float(result.unenumerated[0, 0]), '.6g')} together (exact)"
        )
    if max_length < wanted:
        print(
            f"time limit: the walk stopped at the --time-limit of {clock.seconds:g} s before the "
            f"{count(max_length + 1):,} paths through at most {max_length + 1} "
            f"{step}s ({clock.elapsed():.1f} s in); a larger --time-limit reaches them"
        )
    lengths = pd.DataFrame(
        {
            "length": [str(k) for k in range(max_length + 1)],
            "paths": result.counts.sum(0)[: max_length + 1].tolist(),
            "attribution": result.by_length[: max_length + 1, 0, 0].tolist(),
        }
    )
    if max_length < layers_:  # what the longer paths carry together, so that the rows add up to the readout
        longer = pd.DataFrame(
            {
                "length": [f"{max_length + 1}–{layers_} (together)"],
                "paths": [everything - paths],
                "attribution": [float(result.unenumerated[0, 0])],
            }
        )
        lengths = pd.concat([lengths, longer], ignore_index=True)
    sources = pd.DataFrame(
        {
            "source": result.source_names,
            "paths": result.counts.sum(1).tolist(),
            "attribution": result.by_source[:, 0, 0].tolist(),
        }
    )
    # A source that is exactly 0 (attention biases a model does not have, MLPs frozen at 0) carries
    # exactly 0 along every path: listed apart, not as rows of the table.
    empty = [name for name, source in zip(result.source_names, stack_sources_zero(stack)) if source]
    sources = sources[~sources["source"].isin(empty)]
    rows = {"largest": result.table()[:top], "smallest": result.table(which="bottom")[:top]}
    every = not search and paths <= 2 * top  # every enumerated path fits in one table: shown once, not twice
    # The tables' reach: every path, the enumerated ones, or (after a search) all of them.
    reach = "" if paths == everything else f" among the {paths:,} enumerated paths"
    of_all = {"largest": reach, "smallest": reach}
    if search:  # the top and bottom of every path, not only of the enumerated ones
        for which in ("largest", "smallest"):
            share = clock.left() / (2 if which == "largest" else 1)
            if share <= 0:
                print(f"the {top} {which} of all paths: not searched, the --time-limit of {clock.seconds:g} s is spent")
                continue
            # The search stops itself at its time limit, but not within the set-up of its bounds
            # (minutes for a GPT-2-small shape): it runs aside, and is left behind at the limit.
            done, found = within(
                share + 1.0,
                top_paths,
                stack,
                readout,
                top,
                position=position,
                largest=which == "largest",
                time_limit=None if math.isinf(share) else share,
            )
            if not done:
                print(
                    f"the {top} {which} of all paths: not searched, the set-up of the search's bounds outlasted "
                    f"the --time-limit of {clock.seconds:g} s (those of the enumerated paths are shown)"
                )
                break  # the other search's set-up would take as long
            if found.certified:
                verdict = "certified"
            elif math.isinf(found.bound):
                verdict = f"not certified ({found.stopped}): stopped before it bounded the paths it did not visit"
            else:
                verdict = f"not certified ({found.stopped}): no other path exceeds {found.bound:.4g} in size"
            print(
                f"the {top} {which} of all paths: a best-first search visited {found.visited:,} paths in "
                f"{found.seconds:.1f} s, {verdict}"
            )
            rows[which], of_all[which] = found.table(), f" among all {everything:,} paths"
    best_rows, worst_rows = rows["largest"], rows["smallest"]
    ranked = of_all["largest"] if of_all["largest"] == of_all["smallest"] else ""
    best, worst = pd.DataFrame(best_rows), pd.DataFrame(worst_rows)

    def extremes(count: int, which: str) -> str:
        return f"The {which} attribution" if count == 1 else f"The {count} {which} attributions"

    tables = [
        ("Attribution by number of heads", lengths),
        ("Attribution by source" + (f" (exactly 0, left out: {', '.join(empty)})" if empty else ""), sources),
        (extremes(len(best), "largest") + of_all["largest"], best),
        (extremes(len(worst), "smallest") + of_all["smallest"], worst),
    ]
    if every:
        which = f"all {paths:,} paths" if paths == everything else f"the {paths:,} enumerated paths"
        title = f"The attribution{'' if paths == 1 else 's'} of {which}, largest first"
        tables[2:] = [(title, pd.DataFrame(result.table()))]
    for title, table in tables:
        heading(title)
        print(table.to_string(index=False, float_format=float_format))
    if out is not None:
        for name, table in (
            ("attribution_by_length", lengths),
            ("attribution_by_source", sources),
            ("attribution_top", best),
            ("attribution_bottom", worst),
        ):
            save(out, name, table)
        plotted = name if probe is not None else f"{kind}[{a}] − {kind}[{b}]"
        plotted += f" at token {position}"
        title = fitted_title(f"top and bottom paths{ranked} (the readout: {number(value, '.4g')})", 48)
        save(out, "attribution", figure=path_bars(best_rows, worst_rows, f"attribution to {plotted}", title))
    return result


def stack_sources_zero(stack) -> list[bool]:
    """Per source of a captured stack (the embedding, then each layer's attention bias and MLP, as
    the attribution's frozen model holds them): whether it is exactly 0 in every batch element (so
    is every path from it)."""
    capture = stack.residual_capture
    zero = None
    for batch in range(stack.batch_size):
        real = torch.ones(stack.num_tokens, dtype=torch.bool) if stack.token_mask is None else stack.token_mask[batch]
        sources = frozen_model(stack, capture, batch, real.cpu().bool()).sources
        here = [bool((source == 0).all()) for source in sources]
        zero = here if zero is None else [a and b for a, b in zip(zero, here)]
    return zero


def _stopped(clock: _Clock, stage: str) -> None:
    """Say that ``attribute`` reached its time limit after ``stage``, before any path."""
    print(
        f"pathkernels attribute: stopped at the --time-limit of {clock.seconds:g} s while {stage} "
        f"({clock.elapsed():.1f} s in): no path attributed; a larger --time-limit goes on to the paths"
    )


def _attribution_walk(stack, readout, position: int, top: int, wanted: int, end: float, counts: list[int]):
    """``(result, k)``: :func:`pathkernels.path_attribution` of the paths through at most k heads
    for the largest ``k <= wanted`` whose walk finishes by ``end`` (``time.monotonic()``).

    Lengths 0 and up, each walk whole (what the longer paths carry together is exact in each): a
    walk still running at ``end`` is stopped between two chunks and the previous one is kept.
    After each walk the next goes straight to ``wanted`` when the rate just measured says it
    takes at most half of what is left. Length 0 (a few paths) runs whatever the limit. ``counts[k]``:
    the paths through at most k steps."""
    result, done, k, seconds_per_path = None, -1, 0, math.inf
    while True:
        started = time.monotonic()
        try:
            with time_limit(end) if k > 0 else contextlib.nullcontext():
                result = path_attribution(
                    stack,
                    readout,
                    positions=position,
                    max_length=k,
                    top_k=top,
                    progress=k == wanted or (done >= 0 and seconds_per_path * counts[k] > 10),
                )
        except TimeLimitReached:
            return result, done
        done, seconds_per_path = k, (time.monotonic() - started) / counts[k]
        if k == wanted:
            return result, done
        k = wanted if seconds_per_path * counts[wanted] <= (end - time.monotonic()) / 2 else k + 1
