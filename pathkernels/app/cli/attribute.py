"""``pathkernels attribute``: each path's share of a logit difference at one token, and the top and
bottom paths, within a time limit."""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path

import torch

from pathkernels.adapters.residual import capture_huggingface_residual
from pathkernels.analysis.attribution import logit_diff, path_attribution, path_bars, unembedding
from pathkernels.analysis.top_paths import top_paths
from pathkernels.app.cli.base import MAX_ATTRIBUTION_PATHS, CommandLineError, within
from pathkernels.app.cli.common import (
    check_attention_fits,
    float_format,
    heading,
    local_model,
    model_inputs,
    save,
    sequence_length,
)
from pathkernels.core._memory import check_fits
from pathkernels.core._progress import TimeLimitReached, time_limit
from pathkernels.core.paths import count_attribution_paths


def _token_id(value: str, tokenizer, vocab: int, option: str) -> int:
    """A token id from ``--target`` / ``--versus``: an integer, or with a tokenizer one token's text."""
    try:
        token = int(value)
    except ValueError:
        if tokenizer is None:
            raise CommandLineError(f"pathkernels: {option}: expected a token id (an integer), got {value!r}") from None
        ids = tokenizer.encode(value, add_special_tokens=False)
        if len(ids) != 1:
            raise CommandLineError(
                f"pathkernels: {option}: expected text that is one token, got {value!r} ({len(ids)} tokens)"
            ) from None
        token = ids[0]
    if not 0 <= token < vocab:
        raise CommandLineError(f"pathkernels: {option}: expected a token id in [0, {vocab}), got {token}")
    return token


class _Clock:
    """A command's ``--time-limit``: the seconds it has left, from the start of its work."""

    def __init__(self, seconds: float | None):
        self.start = time.monotonic()
        self.seconds = seconds
        self.end = math.inf if seconds is None else self.start + seconds

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.end - time.monotonic()


def _gpt2_bytes(config, tokens: int) -> int:
    """Bytes a GPT-2 built from ``config`` needs in float64 for ``tokens`` tokens: its parameters
    (initialised in float32, then a float64 copy: 12 bytes each) and its capture (the attention
    maps and their copies, 40 bytes per entry, and about 24 activations of [n, d] per layer)."""
    d, layers, heads = config.n_embd, config.n_layer, config.n_head
    parameters = (config.vocab_size + config.n_positions) * d + layers * (12 * d * d + 13 * d) + 2 * d
    return 12 * parameters + 40 * layers * heads * tokens * tokens + 8 * 24 * layers * tokens * d


def attribute_table(
    *,
    model: str | None = None,
    text: str | None = None,
    layers: int = 4,
    heads: int = 4,
    width: int = 64,
    tokens: int | None = None,
    seed: int = 0,
    target: str | None = None,
    versus: str | None = None,
    position: int | None = None,
    top: int = 10,
    max_length: int | None = None,
    time_limit: float | None = 300.0,
    out: Path | None = None,
):
    """``pathkernels attribute``: each path's attribution to a logit difference at one token of a
    model built from a config (or a local model), the sums by length and by source, and the top
    and bottom paths; with ``out`` also CSV files and a plot. A model with more than 10^7 paths
    gets its sums from the paths of the lengths that fit, and its top and bottom paths from the
    certified search (pk.top_paths).

    ``time_limit`` (seconds, None for none) bounds the whole command: building and capturing the
    model (which cannot be stopped part-way: they run in a thread, left behind at the limit), the
    walk over the paths (lengths 0, 1, … each walked whole within the limit: the longest that
    finished is reported, what the longer paths carry stays exact) and the two searches (each
    given half of what is left; at the limit a search returns its best list with its gap, or, if
    its set-up alone outlasts it, nothing). What stopped where is printed. Work that would not fit
    the machine's memory is refused before any is done. Returns the PathAttribution, or None when
    the limit came before any path was attributed."""
    import pandas as pd
    import transformers

    clock = _Clock(time_limit)
    if model:
        local = local_model(model)
        if local.is_vision:
            raise CommandLineError(
                f"pathkernels attribute: --model {model} is a vision model, with no logits to attribute"
            )
        inputs, what = model_inputs(local, text, tokens)
        config = local.model.config
        parameters = sum(p.numel() for p in local.model.parameters() if p.dtype != torch.float64)
        check_fits(
            8 * parameters,
            torch.device("cpu"),
            "pathkernels attribute",
            f"the model's float64 copy ({parameters:,} parameters) needs about",
            "attribute a smaller model, or one saved in float64",
            error=CommandLineError,
        )
        check_attention_fits(
            "attribute",
            batch=1,
            layers=config.num_hidden_layers,
            heads=config.num_attention_heads,
            tokens=sequence_length(local, inputs),
            bytes_per_entry=40,  # the float64 maps, the capture's copies and the walk's token maps
            device="cpu",
        )
        build, tokenizer = local.model.double, local.tokenizer
        source = f"{model}, {local.weights}; inputs: {what}"
    else:
        tokens = 16 if tokens is None else tokens
        config = transformers.GPT2Config(
            n_layer=layers,
            n_head=heads,
            n_embd=width,
            vocab_size=1000,
            n_positions=max(tokens, 16),
            bos_token_id=0,
            eos_token_id=0,
        )
        check_fits(
            _gpt2_bytes(config, tokens),
            torch.device("cpu"),
            "pathkernels attribute",
            f"a GPT-2 of L = {layers}, H = {heads}, d = {width} and its capture of {tokens} tokens need about",
            "pass a smaller --layers, --width or --tokens",
            error=CommandLineError,
        )
        inputs, tokenizer = None, None  # the token ids are drawn after the model, from the same seed
        source = f"a GPT-2 built from a config (L = {layers}, H = {heads}, d = {width}), {tokens} random token ids"

        def build():
            torch.manual_seed(seed)
            return transformers.GPT2LMHeadModel(config).double()

    # Building and capturing cannot be stopped part-way (minutes for a large model): they run aside
    # and are left behind at the limit.
    done, network = within(clock.left(), build)
    if not done:
        return _stopped(clock, "building the model")
    if inputs is None:
        inputs = {"input_ids": torch.randint(0, 1000, (1, tokens))}
    try:
        done, captured = within(clock.left(), capture_huggingface_residual, network, **inputs)
    except ValueError as error:
        raise CommandLineError(f"pathkernels attribute: {str(error).split(': ', 1)[-1]}") from None
    if not done:
        return _stopped(clock, "capturing the model")
    stack = captured[0]
    n = stack.attn.shape[-1]
    position = n - 1 if position is None else position
    if not -n <= position < n:
        raise CommandLineError(f"pathkernels: --position: expected a token position in [-{n}, {n}), got {position}")
    position %= n
    try:
        weight, bias, vocab = unembedding(network, "pathkernels attribute")
    except ValueError as error:
        raise CommandLineError(str(error)) from None
    with torch.no_grad():
        output = network.eval()(**inputs)
    if getattr(output, "logits", None) is not None:
        logits = output.logits[0, position].double()
    else:  # a base model with tied embeddings (AutoModel): its last hidden state is the final norm's output
        logits = output.last_hidden_state[0, position].double() @ weight.double().T
        logits = logits if bias is None else logits + bias.double()
    ranked = torch.argsort(logits, descending=True).tolist()
    a = ranked[0] if target is None else _token_id(target, tokenizer, vocab, "--target")
    b = next(t for t in ranked if t != a) if versus is None else _token_id(versus, tokenizer, vocab, "--versus")
    if a == b:
        raise CommandLineError(f"pathkernels: --versus: expected a token other than --target ({a})")
    layers_, heads_ = stack.num_layers, stack.num_heads
    everything = count_attribution_paths(layers_, heads_, layers_)
    search = max_length is None and everything > MAX_ATTRIBUTION_PATHS  # top paths by the certified search
    if max_length is None:
        max_length = max(
            (k for k in range(layers_ + 1) if count_attribution_paths(layers_, heads_, k) <= MAX_ATTRIBUTION_PATHS),
            default=0,
        )
    elif max_length > layers_:
        raise CommandLineError(
            f"pathkernels: --max-length: expected at most the model's {layers_} layers, got {max_length}"
        )
    readout = logit_diff(network, a, b)
    wanted = max_length
    # The searches get half of what is left after the walk; the walk the rest (all of it without them).
    walk_end = time.monotonic() + (clock.left() / 2 if search else clock.left())
    result, max_length = _attribution_walk(stack, readout, position, top, wanted, walk_end)
    paths = count_attribution_paths(layers_, heads_, max_length)

    def token_text(token: int) -> str:
        return f"{token} ({tokenizer.decode([token])!r})" if tokenizer is not None else str(token)

    value, constant = float(result.value[0, 0]), float(result.constant[0, 0])
    print(f"Path attribution of {source}")
    print(
        f"readout: logit[{token_text(a)}] − logit[{token_text(b)}] at token {position} = {value:.6g} "
        f"(the model's own: {float(logits[a] - logits[b]):.6g}); {constant:.4g} of it is constant "
        "(the final norm's β and the unembedding bias)"
    )
    if paths == everything:
        closure = float(result.unenumerated[0, 0])
        print(f"paths: all {paths:,}, exactly (Σ attributions + constant − readout = {-closure:.2g})")
    else:
        print(
            f"paths: the {paths:,} through at most {max_length} head{'' if max_length == 1 else 's'}, of "
            f"{everything:,}; the longer ones carry "
            f"{float(result.unenumerated[0, 0]):.6g} together (exact)"
        )
    if max_length < wanted:
        print(
            f"time limit: the walk stopped at the --time-limit of {clock.seconds:g} s before the "
            f"{count_attribution_paths(layers_, heads_, max_length + 1):,} paths through at most {max_length + 1} "
            f"heads ({clock.elapsed():.1f} s in); a larger --time-limit reaches them"
        )
    lengths = pd.DataFrame(
        {
            "length": range(max_length + 1),
            "paths": result.counts.sum(0)[: max_length + 1].tolist(),
            "attribution": result.by_length[: max_length + 1, 0, 0].tolist(),
        }
    )
    sources = pd.DataFrame(
        {
            "source": result.source_names,
            "paths": result.counts.sum(1).tolist(),
            "attribution": result.by_source[:, 0, 0].tolist(),
        }
    )
    rows = {"largest": result.table(), "smallest": result.table(which="bottom")}
    of_all = {"largest": "", "smallest": ""}  # the tables' reach: the enumerated paths, or all of them
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
            verdict = (
                "certified"
                if found.certified
                else f"not certified ({found.stopped}): no other path exceeds {found.bound:.4g} in size"
            )
            print(
                f"the {top} {which} of all paths: a best-first search visited {found.visited:,} paths in "
                f"{found.seconds:.1f} s, {verdict}"
            )
            rows[which], of_all[which] = found.table(), f" of all {everything:,} paths"
    best_rows, worst_rows = rows["largest"], rows["smallest"]
    ranked = of_all["largest"] if of_all["largest"] == of_all["smallest"] else ""
    best, worst = pd.DataFrame(best_rows), pd.DataFrame(worst_rows)
    for title, table in (
        ("by number of heads", lengths),
        ("by source", sources),
        (f"the {top} largest{of_all['largest']}", best),
        (f"the {top} smallest{of_all['smallest']}", worst),
    ):
        heading(f"Attribution {title}")
        print(table.to_string(index=False, float_format=float_format))
    if out is not None:
        for name, table in (
            ("attribution_by_length", lengths),
            ("attribution_by_source", sources),
            ("attribution_top", best),
            ("attribution_bottom", worst),
        ):
            save(out, name, table)
        label = f"attribution to logit[{a}] − logit[{b}] at token {position}"
        title = f"top and bottom paths{ranked} (the readout: {value:.4g})"
        save(out, "attribution", figure=path_bars(best_rows, worst_rows, label, title))
    return result


def _stopped(clock: _Clock, stage: str) -> None:
    """Say that ``attribute`` reached its time limit after ``stage``, before any path."""
    print(
        f"pathkernels attribute: stopped at the --time-limit of {clock.seconds:g} s while {stage} "
        f"({clock.elapsed():.1f} s in): no path attributed; a larger --time-limit goes on to the paths"
    )


def _attribution_walk(stack, readout, position: int, top: int, wanted: int, end: float):
    """``(result, k)``: :func:`pathkernels.path_attribution` of the paths through at most k heads
    for the largest ``k <= wanted`` whose walk finishes by ``end`` (``time.monotonic()``).

    Lengths 0 and up, each walk whole (what the longer paths carry together is exact in each): a
    walk still running at ``end`` is stopped between two chunks and the previous one is kept.
    After each walk the next goes straight to ``wanted`` when the rate just measured says it
    takes at most half of what is left. Length 0 (a few paths) runs whatever the limit."""
    layers, heads = stack.num_layers, stack.num_heads
    counts = [count_attribution_paths(layers, heads, k) for k in range(wanted + 1)]
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
