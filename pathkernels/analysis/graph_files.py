"""An attribution graph in the files circuit tools read.

- :func:`save_circuit_tracer`: circuit-tracer's graph file (``Graph.to_pt``: a ``torch.save`` of a
  dict holding exactly the arguments of ``circuit_tracer.graph.Graph``, so that ``Graph.from_pt``
  loads it): ``input_string``, ``input_tokens [n]``, ``logit_tokens [K]``, ``logit_probabilities
  [K]``, ``active_features [A, 3]`` (layer, position, feature), ``activation_values [A]``,
  ``selected_features [F]`` (indices into ``active_features`` of the graph's feature nodes),
  ``adjacency_matrix [N, N]`` (rows targets, columns sources; nodes in the order features, errors
  layer-major, tokens, logits), ``cfg`` (a namespace with ``n_layers``, ``d_model``,
  ``tokenizer_name``, ``model_name``) and ``scan``.
- :func:`save_neuronpedia`: the JSON that circuit-tracer's ``create_graph_files`` writes and
  Neuronpedia's graph viewer loads (``metadata``, ``qParams``, ``nodes``, ``links``; node ids
  ``"{layer}_{feature}_{position}"``, ``"0_{layer}_{position}"`` for errors, ``"E_{token}_{position}"``
  and ``"{L + 1}_{token}_{position}"`` for logits), the graph pruned as circuit-tracer prunes it,
  with ``graph-metadata.json`` beside it; pathkernels adds its own fields, which those readers
  ignore: each node's ``pathkernels_value`` and ``pathkernels_constant``, and each link's
  ``pathkernels_paths``, its largest chains of heads.

Both read from circuit-tracer's published code (``circuit_tracer/graph.py``,
``circuit_tracer/utils/create_graph_files.py``, ``circuit_tracer/frontend/graph_models.py``,
``circuit_tracer/frontend/utils.py``); nothing of circuit-tracer is imported. A graph is a
:class:`pathkernels.analysis.graph.AttributionGraph` (whose ``save_circuit_tracer`` and
``save_neuronpedia`` call these; this module does not import that one, which imports it).
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

_WHERE = "pathkernels.analysis.graph_files"
CIRCUIT_TRACER_KEYS = (
    "input_string",
    "adjacency_matrix",
    "cfg",
    "active_features",
    "logit_tokens",
    "logit_probabilities",
    "input_tokens",
    "selected_features",
    "activation_values",
    "scan",
)


def _rows(graph: Any) -> torch.Tensor:
    """Each node's position as an index into the prompt's real tokens (circuit-tracer's ``pos``)."""
    return torch.searchsorted(graph.real_positions, graph.positions)


def _tokens(graph: Any, input_tokens, where: str) -> torch.Tensor:
    tokens = graph.input_tokens if input_tokens is None else torch.as_tensor(input_tokens).flatten().long()
    if tokens is None:
        raise ValueError(
            f"{where}: the graph holds no token ids (the capture read embeddings): pass input_tokens, the prompt's "
            "ids at its real tokens"
        )
    if tokens.numel() != graph.real_positions.numel():
        raise ValueError(
            f"{where}: expected input_tokens of the prompt's {graph.real_positions.numel()} real tokens, got "
            f"{tokens.numel()}"
        )
    return tokens


def save_circuit_tracer(
    graph: Any, path, *, input_string: str = "", input_tokens=None, scan=None, tokenizer_name=None
) -> Path:
    """Write ``graph`` as circuit-tracer's graph file at ``path`` (module docstring); returns the path.

    The adjacency is written in float32, as circuit-tracer keeps it; ``scan`` names the transcoder
    set (circuit-tracer's identifier; None: the set's description)."""
    where = f"{_WHERE}.save_circuit_tracer"
    tokens = _tokens(graph, input_tokens, where)
    features = graph.kinds == graph.KINDS.index("feature")
    active = torch.stack([graph.layers[features], _rows(graph)[features], graph.features[features]], 1)
    config = SimpleNamespace(
        n_layers=graph.num_layers,
        d_model=int(graph._context["model"].sources[0].shape[-1]) if graph._context else None,
        tokenizer_name=tokenizer_name,
        model_name=graph.model_name,
    )
    record = {
        "input_string": input_string,
        "adjacency_matrix": graph.adjacency.float(),
        "cfg": config,
        "active_features": active,
        "logit_tokens": graph.logit_tokens,
        "logit_probabilities": graph.logit_probabilities.float(),
        "input_tokens": tokens,
        "selected_features": torch.arange(active.shape[0]),
        "activation_values": graph.activations[features].float(),
        "scan": graph.description if scan is None else scan,
    }
    path = Path(path)
    torch.save(record, path)
    return path


def _process_token(text: str) -> str:
    """circuit-tracer's ``process_token``: line breaks and tabs shown as symbols."""
    return text.replace("\n", "⏎").replace("\t", "→").replace("\r", "↵")


def _token_text(token: int, tokenizer) -> str:
    return _process_token(tokenizer.decode([token]) if tokenizer is not None else str(token))


def save_neuronpedia(
    graph: Any,
    folder,
    slug: str,
    *,
    tokenizer=None,
    input_tokens=None,
    prompt: str | None = None,
    scan=None,
    node_threshold: float = 0.8,
    edge_threshold: float = 0.98,
    paths_per_link: int = 3,
    linked: int = 200,
    num_features: int | None = None,
) -> Path:
    """Write ``graph`` as the JSON Neuronpedia's graph viewer loads, ``folder/{slug}.json``, and add
    it to ``folder/graph-metadata.json`` (module docstring). The graph is pruned first
    (:meth:`AttributionGraph.prune` with the thresholds); the ``linked`` kept links of largest
    |weight| (None: every one) carry their ``paths_per_link`` largest chains of heads
    (``pathkernels_paths``: ``[{"path", "weight"}]``, by the certified search, with
    ``pathkernels_certified``; 0: none). ``tokenizer`` decodes the prompt's tokens (else their ids
    are shown); ``num_features``: the transcoders' width, which circuit-tracer's preset scans add as
    an offset per layer to a feature's index (None: no offset, as for a custom scan). Returns the
    JSON's path."""
    where = f"{_WHERE}.save_neuronpedia"
    if not isinstance(slug, str) or not slug or "/" in slug:
        raise ValueError(f"{where}: expected slug to be a non-empty name without '/', got {slug!r}")
    tokens = _tokens(graph, input_tokens, where)
    graph.prune(node_threshold, edge_threshold)
    rows = _rows(graph)
    logit_start = int((graph.kinds != graph.KINDS.index("logit")).sum())
    offset = 10 ** math.ceil(math.log10(num_features)) if num_features else 0
    nodes = {}
    for index in graph.node_mask.nonzero().flatten().tolist():
        kind = graph.KINDS[int(graph.kinds[index])]
        layer, position, feature = int(graph.layers[index]), int(rows[index]), int(graph.features[index])
        influence = float(graph.influence[index])
        extra = {"pathkernels_value": float(graph.values[index]), "pathkernels_constant": float(graph.constant[index])}
        if kind == "feature":
            node = {
                "node_id": f"{layer}_{feature}_{position}",
                "feature": feature + offset * layer,
                "layer": str(layer),
                "ctx_idx": position,
                "feature_type": "cross layer transcoder",
                "jsNodeId": f"{layer}_{feature}-0",
                "influence": influence,
                "activation": float(graph.activations[index]),
            }
        elif kind == "error":
            node = {
                "node_id": f"0_{layer}_{position}",
                "feature": -1,
                "layer": str(layer),
                "ctx_idx": position,
                "feature_type": "mlp reconstruction error",
                "jsNodeId": f"{layer}_{position}-0",
                "influence": influence,
                "activation": None,
            }
        elif kind == "token":
            token = int(tokens[position])
            node = {
                "node_id": f"E_{token}_{position}",
                "feature": position,
                "layer": "E",
                "ctx_idx": position,
                "feature_type": "embedding",
                "jsNodeId": f"E_{token}-{position}",
                "influence": influence,
                "activation": None,
            }
        else:
            rank = index - logit_start
            probability = float(graph.logit_probabilities[rank])
            top = str(graph.num_layers + 1)
            node = {
                "node_id": f"{top}_{feature}_{position}",
                "feature": feature,
                "layer": top,
                "ctx_idx": position,
                "feature_type": "logit",
                "token_prob": probability,
                "is_target_logit": rank == 0,
                "jsNodeId": f"L_{feature}-{position}",
                "clerp": f'Output "{_token_text(feature, tokenizer)}" (p={probability:.3f})',
                "influence": None,
                "activation": None,
            }
        node = {"token_prob": 0.0, "is_target_logit": False, "run_idx": 0, "reverse_ctx_idx": 0, "clerp": ""} | node
        nodes[index] = node | extra
    ids = [node["node_id"] for node in nodes.values()]
    repeated = sorted({node_id for node_id in ids if ids.count(node_id) > 1})
    if repeated:  # circuit-tracer's ids: a layer-0 feature f at t is "0_f_t", the error of layer f at t too
        warnings.warn(
            f"{where}: {len(repeated)} node ids name two nodes in circuit-tracer's scheme (a layer-0 feature whose "
            f"index is a layer's number, and that layer's error at the same token: {', '.join(repeated[:3])}); the "
            "viewer cannot tell their links apart",
            stacklevel=2,
        )
    links = []
    targets, sources = graph.edge_mask.nonzero(as_tuple=True)
    weights = graph.adjacency[targets, sources].abs()
    chained = set(weights.argsort(descending=True)[: weights.numel() if linked is None else linked].tolist())
    for rank, (target, source) in enumerate(zip(targets.tolist(), sources.tolist())):
        if source not in nodes or target not in nodes:
            continue
        link = {
            "source": nodes[source]["node_id"],
            "target": nodes[target]["node_id"],
            "weight": float(graph.adjacency[target, source]),
        }
        if paths_per_link and rank in chained:
            top = graph.edge_top_paths(source, target, top_k=paths_per_link)
            chains = [row for row in top.table() if row["attribution"] != 0]  # (the zero rows above the source)
            link["pathkernels_paths"] = [{"path": row["path"], "weight": row["attribution"]} for row in chains]
            link["pathkernels_certified"] = bool(top.certified)
        links.append(link)
    connected = {link["source"] for link in links} | {link["target"] for link in links}
    always = ("embedding", "logit")
    used = [node for node in nodes.values() if node["node_id"] in connected or node["feature_type"] in always]
    scan_name = graph.description if scan is None else scan
    transcoder_list = list(scan_name) if isinstance(scan_name, (list, tuple)) else []
    metadata = {
        "slug": slug,
        "scan": scan_name if isinstance(scan_name, str) else "custom",
        "transcoder_list": transcoder_list,
        "prompt_tokens": [_token_text(int(t), tokenizer) for t in tokens],
        "prompt": prompt if prompt is not None else "".join(_token_text(int(t), tokenizer) for t in tokens),
        "node_threshold": float(node_threshold),
        "pathkernels_description": graph.description,
        "pathkernels_model": graph.model_name,
    }
    document = {
        "metadata": metadata,
        "qParams": {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""},
        "nodes": used,
        "links": links,
    }
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{slug}.json"
    path.write_text(json.dumps(document, indent=2))
    index_path = folder / "graph-metadata.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else {"graphs": []}
    index["graphs"] = [entry for entry in index.get("graphs", []) if entry.get("slug") != slug] + [metadata]
    index_path.write_text(json.dumps(index, indent=2))
    return path


__all__ = ["CIRCUIT_TRACER_KEYS", "save_circuit_tracer", "save_neuronpedia"]
