"""``pathkernels graph``: the attribution graph of a prompt through a transcoder set (its features,
errors, tokens and logits, the direct effect of each on each), pruned as circuit-tracer prunes it,
written as circuit-tracer's graph file and Neuronpedia's JSON, with a plot and tables."""

from __future__ import annotations

from pathlib import Path

from pathkernels.analysis.graph import KINDS, attribution_graph
from pathkernels.app.cli.attribute import _Clock, built_and_captured
from pathkernels.app.cli.base import CommandLineError, within
from pathkernels.app.cli.common import float_format, heading, local_model, model_to_run, number, save


def graph_files(
    *,
    model: str,
    transcoders: Path,
    text: str | None = None,
    ids: list[int] | None = None,
    example: bool = False,
    tokens: int | None = None,
    seed: int = 0,
    position: int | None = None,
    slug: str = "graph",
    node_threshold: float = 0.8,
    edge_threshold: float = 0.98,
    paths_per_link: int = 3,
    max_feature_nodes: int | None = None,
    top: int = 10,
    time_limit: float | None = 600.0,
    out: Path | None = None,
    started: float | None = None,
):
    """``pathkernels graph``: the attribution graph (:func:`pathkernels.attribution_graph`) of a local
    model on its input through the transcoder set in ``transcoders``, at ``position`` (default: the
    last token; ``max_feature_nodes``: at most this many features as nodes, those of most influence).
    Prints the logits explained, the nodes and edges kept by the pruning and the ``top``
    nodes by influence and edges by weight; with ``out``, writes ``graph.pt`` (circuit-tracer),
    ``{slug}.json`` and ``graph-metadata.json`` (Neuronpedia's viewer; each link with its
    ``paths_per_link`` largest chains of heads), ``graph.png`` and the tables as CSV. The model and its
    capture run aside and are left behind at ``time_limit``. Returns the graph, or None at the limit."""
    clock = _Clock(time_limit, started)
    local = local_model(model)
    if local.is_vision:
        raise CommandLineError(f"--model {model} is a vision model; graph reads language models (token ids) only")
    built_in = (4, 4, 64)  # (the built-in network's layers, heads, width: graph reads a --model only)
    run = model_to_run(
        "graph", local, model, text, tokens, *built_in, seed, bytes_per_entry=48, ids=ids, example=example
    )
    built, stage = built_and_captured(clock, run, transcoders=transcoders)
    if built is None:
        return _stopped(clock, stage)
    _, _, (stack, capture) = built
    transcoder_set = capture.transcoders.description
    n = stack.attn.shape[-1]
    if position is not None and not -n <= position < n:
        raise CommandLineError(f"--position: expected a token position in [-{n}, {n}), got {position}")
    try:
        done, graph = within(
            clock.left(), attribution_graph, stack, position=position, max_feature_nodes=max_feature_nodes
        )
    except ValueError as error:  # (a graph beyond the memory budget names --max-feature-nodes)
        message = str(error).split(": ", 1)[-1].replace("max_feature_nodes", "--max-feature-nodes")
        raise CommandLineError(message) from None
    if not done:
        return _stopped(clock, "computing the graph's edges")
    graph.prune(node_threshold, edge_threshold)
    tokenizer = run.tokenizer

    def token_text(token: int) -> str:
        return f"{token} ({tokenizer.decode([token])!r})" if tokenizer is not None else str(token)

    import pandas as pd

    counts = {kind: int((graph.kinds == index).sum()) for index, kind in enumerate(KINDS)}
    kept = {kind: int(((graph.kinds == index) & graph.node_mask).sum()) for index, kind in enumerate(KINDS)}
    print(f"Attribution graph of {run.source}")
    print(f"transcoders: {transcoder_set}")
    print(
        f"nodes: {counts['feature']:,} active features, {counts['error']:,} errors, {counts['token']} tokens, "
        f"{counts['logit']} logits; edges computed: {int((graph.adjacency != 0).sum()):,} in {graph.seconds:.1f} s"
    )
    print(
        f"pruned (node threshold {node_threshold:g}, edge threshold {edge_threshold:g}): {kept['feature']:,} features "
        f"and {kept['error']:,} errors kept, {int(graph.edge_mask.sum()):,} edges"
    )
    logits = pd.DataFrame(
        {
            "token": [token_text(int(t)) for t in graph.logit_tokens],
            "probability": graph.logit_probabilities.tolist(),
            "logit − mean": graph.values[graph.kinds == KINDS.index("logit")].tolist(),
        }
    )
    frame = graph.to_frame()
    inner = frame[frame["kept"] & frame["kind"].isin(["feature", "error"])]
    nodes = inner.sort_values("influence").head(top)[["node", "activation", "influence"]]
    edges = graph.edges().head(top)[["source", "target", "weight"]]
    for title, table in (
        (f"Logits explained at token {int(graph.positions[-1])}", logits),
        (f"The {len(nodes)} most influential features and errors (cumulative influence, smallest first)", nodes),
        (f"The {len(edges)} largest edges kept", edges),
    ):
        heading(title)
        print(table.to_string(index=False, float_format=float_format))
    closure = float(((graph.adjacency.sum(1) + graph.constant - graph.values).abs()).max())
    print(f"\nexact: each row of edges plus its constant is its node's value (to {number(closure, '.2g')})")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        path = graph.save_circuit_tracer(out / "graph.pt", input_string=text or "", scan=str(transcoders))
        print(f"  wrote {path}")
        path = graph.save_neuronpedia(
            out, slug, tokenizer=tokenizer, node_threshold=node_threshold, edge_threshold=edge_threshold,
            paths_per_link=paths_per_link, scan=str(transcoders),
        )  # fmt: skip
        print(f"  wrote {path} and {out / 'graph-metadata.json'}")
        save(out, "graph_nodes", frame)
        save(out, "graph_edges", graph.edges())
        save(out, "graph", figure=graph.plot())
    return graph


def _stopped(clock: _Clock, stage: str) -> None:
    print(
        f"pathkernels graph: stopped at the --time-limit of {clock.seconds:g} s while {stage} "
        f"({clock.elapsed():.1f} s in): no graph; a larger --time-limit goes on"
    )
