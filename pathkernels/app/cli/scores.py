"""``pathkernels scores``: where a head looks. Its scores at one query, split by pairs of path groups
and by pairs of paths (listed where they are few, else the certified search), within a time limit."""

from __future__ import annotations

import math
from pathlib import Path

from pathkernels.analysis.score_search import top_score_pairs
from pathkernels.analysis.scores import score_decomposition, score_pairs
from pathkernels.app.cli.attribute import _Clock, built_and_captured
from pathkernels.app.cli.base import CommandLineError
from pathkernels.app.cli.common import float_format, heading, local_model, model_to_run, number, save

# Paths per side up to which every pair is listed (their table: 8 · (P + 1)² bytes, 32 MB here).
MAX_LISTED_PATHS = 2000


def scores_table(
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
    layer: int | None = None,
    head: int = 0,
    query: int | None = None,
    key: int | None = None,
    versus: int | None = None,
    top: int = 10,
    time_limit: float | None = 300.0,
    out: Path | None = None,
    started: float | None = None,
    transcoders: Path | None = None,
):
    """``pathkernels scores``: head ``(layer, head)``'s pre-softmax scores at token ``query`` of a
    GPT-2 built from a config (or a local model): every key's score and attention; the score at
    ``key`` (default: where the head attends most) split by (query group, key group), or with
    ``versus`` the difference of the two keys' scores; and the ``top`` largest and smallest pairs of
    paths, listed where each side has at most :data:`MAX_LISTED_PATHS` paths, else found by the
    certified search in the time left. With ``out``: CSV files and a heatmap of the groups.
    ``time_limit`` bounds the whole command (the model and its capture run aside and are left behind
    at the limit). ``transcoders``: a folder of transcoders replacing the model's MLPs, whose active
    features are then steps of the paths on both sides. Returns the
    :class:`~pathkernels.ScoreDecomposition`, or None when the limit came first."""
    import pandas as pd

    clock = _Clock(time_limit, started)
    local = local_model(model) if model else None  # a vision model's tokens are its image patches
    run = model_to_run(
        "scores", local, model, text, tokens, layers, heads, width, seed, bytes_per_entry=48, ids=ids, example=example
    )
    built, stage = built_and_captured(clock, run, query_key=True, transcoders=transcoders)
    if built is None:
        return _stopped(clock, stage)
    _, inputs, (stack, _) = built
    n = stack.attn.shape[-1]
    layer = stack.num_layers - 1 if layer is None else layer
    if not 0 <= layer < stack.num_layers:
        raise CommandLineError(f"--layer: expected a layer in [0, {stack.num_layers}), got {layer}")
    if not 0 <= head < stack.num_heads:
        raise CommandLineError(f"--head: expected a head in [0, {stack.num_heads}), got {head}")
    positions = {}
    for option, value in (("--query", query), ("--key", key), ("--versus", versus)):
        if value is not None and not -n <= value < n:
            raise CommandLineError(f"{option}: expected a token position in [-{n}, {n}), got {value}")
        positions[option] = None if value is None else value % n
    query = n - 1 if positions["--query"] is None else positions["--query"]
    looks = score_decomposition(stack, layer, head, query=query)
    keys = looks.keys.tolist()
    attention = stack.residual_capture.patterns(stack.attn, 0, layer=layer)[head, query, looks.keys]  # one layer's
    for option in ("--key", "--versus"):
        if positions[option] is not None and positions[option] not in keys:
            allowed = f"{keys[0]}…{keys[-1]}"
            raise CommandLineError(
                f"{option}: expected a key that token {query} may attend ({allowed}), got {positions[option]}"
            )
    key = keys[int(attention.argmax())] if positions["--key"] is None else positions["--key"]
    versus = positions["--versus"]
    if versus == key:
        raise CommandLineError(f"--versus: expected a key other than --key ({key})")

    tokenizer = run.tokenizer
    ids = inputs["input_ids"][0].tolist() if "input_ids" in inputs else None

    def token(position: int) -> str:
        if ids is None:
            return str(position)
        return (
            f"{ids[position]} ({tokenizer.decode([ids[position]])!r})" if tokenizer is not None else str(ids[position])
        )

    capped = f" (before the soft cap of {looks.soft_cap:g})" if looks.soft_cap else ""
    print(f"Attention scores of {run.source}")
    if ids is not None and "random token ids" in run.source:
        print(f"token ids: {ids[:64]}" + (f" … ({len(ids) - 64} more)" if len(ids) > 64 else ""))
    print(
        f"head: L{layer}H{head}, query token {query} = {token(query)}; scores{capped}, exactly the model's own "
        f"(largest |sum of pairs − model| {number(float((looks.scores - looks.model_scores).abs().max()), '.2g')})"
    )
    row = pd.DataFrame(
        {
            "key": keys,
            "token": [token(k) for k in keys],
            "score": looks.model_scores.tolist(),
            "attention": attention.tolist(),
        }
    )
    heading(f"L{layer}H{head}'s scores and attention at query {query}")
    print(row.to_string(index=False, float_format=float_format))

    what = f"key {key}" if versus is None else f"key {key} − key {versus}"
    groups = looks.to_frame(key, versus)
    shown = f"the {top} largest in size" if len(groups) > top else f"all {len(groups)}, largest in size first"
    heading(f"The score at {what}, by (query group, key group): {shown}")
    print(groups.head(top).to_string(index=False, float_format=float_format))

    counted = looks.path_count  # each side's paths below the layer
    every = False  # every pair in one table: the largest and the smallest would list the same pairs
    if counted <= MAX_LISTED_PATHS:
        # Twice the top: where the pairs are that few, one table lists them all.
        listed = score_pairs(stack, layer, head, query=query, key=key, top_k=2 * top)
        tables = {"largest": pd.DataFrame(listed.top[:top]), "smallest": pd.DataFrame(listed.bottom[:top])}
        pairs = listed.values.numel()  # each side's paths and its constant
        every = pairs <= 2 * top
        print(
            f"\npairs of paths: every pair of the {counted:,} path{'' if counted == 1 else 's'} per side below "
            f"layer {layer}, listed (with each side's constant: {pairs:,} pairs)"
        )
    else:
        tables = {}
        for which in ("largest", "smallest"):
            share = clock.left() / (2 if which == "largest" else 1)
            if share <= 0:
                print(f"the {top} {which} pairs: not searched, the --time-limit of {clock.seconds:g} s is spent")
                continue
            found = top_score_pairs(
                stack,
                layer,
                head,
                top,
                query=query,
                key=key,
                largest=which == "largest",
                time_limit=None if math.isinf(share) else share,
                progress=True,
            )
            verdict = "certified" if found.certified else f"not certified ({found.stopped}), gap {found.gap:.3g}"
            print(
                f"the {top} {which} pairs of {counted:,} paths per side: a best-first search visited "
                f"{found.visited[0]:,} + {found.visited[1]:,} paths in {found.seconds:.1f} s, {verdict}"
            )
            tables[which] = found.to_frame()
    shown = {"all": pd.DataFrame(listed.top)} if every else tables  # all: no two tables of the same pairs
    for which, table in shown.items():
        title = f"All {len(table)} pairs" if which == "all" else f"The {top} {which} pairs"
        heading(f"{title} (query path · key path) of the score at key {key}" + (", largest first" if every else ""))
        print(table.to_string(index=False, float_format=float_format))
    if out is not None:
        save(out, "scores_by_key", row)
        save(out, "scores_by_group", groups)
        for which, table in tables.items():
            save(out, f"score_pairs_{which}", table)
        save(out, "scores_by_group", figure=looks.plot(key, versus))
    return looks


def _stopped(clock: _Clock, stage: str) -> None:
    print(
        f"pathkernels scores: stopped at the --time-limit of {clock.seconds:g} s while {stage} "
        f"({clock.elapsed():.1f} s in); a larger --time-limit goes on to the scores"
    )
