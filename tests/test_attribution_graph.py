"""Attribution graphs through transcoder features (pk.attribution_graph), each claim against a
reference that shares no code with the graph's backward sweep:

- every feature and logit row of the adjacency plus its constant is the node's value, and the
  values are the model's own (its logits less their mean, the set's own pre-activations);
- every edge equals the sum of its chains of heads listed by the readout trie's walk (the C++
  readout engine), and the edges into layer-0 features equal their terms written from the weights;
- the pruning keeps what circuit-tracer's definitions keep on a hand-worked graph;
- the files are those circuit-tracer and Neuronpedia read: the fields and shapes of their
  published code, the links' weights the adjacency's, the chains' weights the certified search's.

Models are built from configs in float64 with random biases and norm parameters; the transcoder
sets are random (pathkernels.adapters.random_transcoders), drawn afresh each run.
"""

import json

import pytest
import torch
from float64_reference import logits_in_float64
from test_model_families import family_model, uncapped
from test_real_models import gpt2, llama

import pathkernels as pk
from pathkernels.adapters.residual import capture_huggingface_residual
from pathkernels.adapters.transcoders import random_transcoders
from pathkernels.analysis.graph import KINDS, AttributionGraph
from pathkernels.analysis.graph_files import CIRCUIT_TRACER_KEYS

transformers = pytest.importorskip("transformers")

FEATURE, ERROR, TOKEN, LOGIT = (KINDS.index(kind) for kind in KINDS)


def small(name: str):
    return {
        "gpt2": lambda: gpt2(layers=2, heads=2, width=16).eval(),
        "llama": lambda: llama(layers=2, heads=4, kv_heads=2, width=16).eval(),
        "gemma2": lambda: uncapped(family_model("gemma2")),
    }[name]()


def graph_of(model, features=10, tokens=6, **options):
    config = model.config.get_text_config()
    transcoders = random_transcoders(config.num_hidden_layers, config.hidden_size, features, **options)
    ids = torch.randint(0, 50, (1, tokens))
    stack, capture = capture_huggingface_residual(model, input_ids=ids, transcoders=transcoders)
    return pk.attribution_graph(stack), stack, capture, transcoders, ids


@pytest.mark.parametrize(
    "name, options",
    [("gpt2", {"skip": True}), ("llama", {}), ("gemma2", {"output_hook": "mlp_module_output", "skip": True})],
)
def test_each_row_plus_its_constant_is_the_nodes_value(name, options):
    """Σ_sources adjacency[t, s] + constant[t] = value[t] for every feature and logit (float64);
    the logit values are the model's own logits less their mean over the vocabulary, the feature
    values the set's own pre-activations of the capture's frozen input."""
    model = small(name)
    graph, stack, capture, transcoders, ids = graph_of(model, **options)
    targets = (graph.kinds == FEATURE) | (graph.kinds == LOGIT)
    total = graph.adjacency.sum(1) + graph.constant
    scale = graph.values[targets].abs().max()
    assert float((total - graph.values)[targets].abs().max()) < 1e-12 * scale
    assert float(graph.adjacency[~targets].abs().max()) == 0.0  # nothing reads into tokens and errors
    own = logits_in_float64(model, input_ids=ids)[0, -1]
    logits = graph.kinds == LOGIT
    expected = own[graph.logit_tokens] - own.mean()
    assert torch.allclose(graph.values[logits], expected, rtol=1e-10, atol=1e-10)
    assert torch.allclose(graph.logit_probabilities, torch.softmax(own, -1)[graph.logit_tokens], rtol=1e-9)
    for node in (graph.kinds == FEATURE).nonzero().flatten().tolist()[:20]:
        layer, position, feature = int(graph.layers[node]), int(graph.positions[node]), int(graph.features[node])
        replaced = capture.transcoders.layers[layer]
        index = int((replaced.features == feature).nonzero()[0])
        assert float(graph.values[node]) == float(replaced.activations[0, position, index])
        assert float(replaced.gates[0, position, index]) == 1.0
    # The logits chosen as circuit-tracer chooses them: the most probable, until 0.95 or 10 of them.
    probabilities = torch.softmax(own, -1).sort(descending=True).values
    count = int(logits.sum())
    assert count == min(10, int(torch.searchsorted(probabilities.cumsum(0), torch.tensor(0.95, dtype=own.dtype))) + 1)


def check_edges_are_their_chains(graph, limit: int | None = None) -> int:
    """Every non-zero edge (the first ``limit``) against the sum of its chains as the readout trie's
    walk lists them (``edge_paths``), to 1e-12; returns how many were checked."""
    targets, sources = (graph.adjacency != 0).nonzero(as_tuple=True)
    edges = list(zip(targets.tolist(), sources.tolist()))[:limit]
    for target, source in edges:
        total = float(graph.edge_paths(source, target, top_k=1).by_source_length.sum())
        assert abs(total - float(graph.adjacency[target, source])) < 1e-12 * max(1.0, abs(total)), (target, source)
    return len(edges)


def test_every_edge_is_the_sum_of_its_chains_of_heads():
    """Every non-zero edge of a small graph against its chains listed by the readout trie's walk
    (the C++ readout engine), and the per-head loadings of one edge summing to it per head."""
    model = small("gpt2")
    graph, *_ = graph_of(model, features=6, tokens=5, skip=True)
    assert check_edges_are_their_chains(graph) > 50
    # An edge from a token into a logit two layers up: its head loadings and top chains.
    token = graph.find("token", position=0)
    logit = int((graph.kinds == LOGIT).nonzero()[0])
    chains = graph.edge_paths(token, logit, top_k=50)
    values = chains.attribution[:, 0, 0]
    for layer in range(2):
        for head in range(2):  # the head loadings: every chain through the head, whatever else it takes
            through = values[chains.paths[:, layer] == head].sum()
            assert abs(float(chains.through_head[layer, head, 0, 0] - through)) < 1e-13
    best = graph.edge_top_paths(token, logit, top_k=3)
    assert best.certified
    signed = chains.attribution[:, 0, 0] * (1 if float(graph.adjacency[logit, token]) >= 0 else -1)
    assert torch.allclose(best.values.abs(), signed.topk(3).values.abs(), rtol=1e-10)


@pytest.mark.parametrize("order", ["token first", "feature first"])
def test_the_top_chains_of_edges_from_different_levels_are_each_their_own(order):
    """edge_top_paths of an edge from a token (its model from the embedding up) and of one from a
    layer-0 feature (its model from that MLP's writes up), in either order, each the top of its
    own chains as edge_paths lists them: the two models share the graph's sublayers, placed at
    different levels."""
    model = small("gpt2")
    graph, *_ = graph_of(model, features=6, tokens=5, skip=True)
    logit = int((graph.kinds == LOGIT).nonzero()[0])
    token = graph.find("token", position=0)
    features = ((graph.kinds == FEATURE) & (graph.layers == 0)).nonzero().flatten().tolist()
    assert features, "no layer-0 feature: draw again"
    edges = [(token, logit), (features[0], logit)]
    for source, target in edges if order == "token first" else edges[::-1]:
        chains = graph.edge_paths(source, target, top_k=1).attribution[:, 0, 0]
        found = graph.edge_top_paths(source, target, top_k=6)
        sign = 1.0 if float(graph.adjacency[target, source]) >= 0 else -1.0
        assert found.certified
        assert torch.allclose(found.values * sign, (chains * sign).topk(6).values, rtol=1e-10, atol=1e-15)


def test_the_edges_into_a_layer_0_feature_are_their_terms_written_from_the_weights():
    """A layer-0 feature f at token t reads ``s_t (x_t C Γ₂) · enc_f`` of the stream entering its
    MLP, ``x = E + Σ_h A_h D₁ (E C Γ₁) W_V,h W_O,h + constant rows``: the edge from token p is
    ``s_t [δ_pt (E_p C Γ₂ · enc_f) + Σ_h A_h[t, p] D₁[p] ((E_p C Γ₁) W_V,h W_O,h C Γ₂ · enc_f)]``, with
    the weights read from the Hugging Face modules."""
    model = small("gpt2")
    graph, stack, capture, transcoders, ids = graph_of(model, features=8, tokens=5)
    d = 16
    centre = torch.eye(d, dtype=torch.float64) - 1.0 / d
    block = model.transformer.h[0]
    gamma1, gamma2 = block.ln_1.weight.detach().double(), block.ln_2.weight.detach().double()
    w_qkv = block.attn.c_attn.weight.detach().double()  # [d, 3d] (Conv1D: x @ W)
    w_v = w_qkv[:, 2 * d :].reshape(d, 2, d // 2).permute(1, 0, 2)  # [H, d, e]
    w_o = block.attn.c_proj.weight.detach().double().reshape(2, d // 2, d)  # [H, e, d]
    attn = capture.patterns(stack.attn, 0)[0]  # [H, n, n]
    scale1, scale2 = capture.norm_scale[0, 0, 0], capture.norm_scale[0, 0, 1]
    embedding = capture.embedding[0]
    checked = 0
    for node in ((graph.kinds == FEATURE) & (graph.layers == 0)).nonzero().flatten().tolist():
        t, f = int(graph.positions[node]), int(graph.features[node])
        encoder = centre @ (gamma2 * transcoders.w_enc[0][:, f])  # C Γ₂ enc_f
        for p in range(5):
            expected = float(embedding[p] @ encoder) if p == t else 0.0
            for h in range(2):
                written = (embedding[p] @ centre * gamma1) @ w_v[h] @ w_o[h]
                expected += float(attn[h, t, p] * scale1[p] * (written @ encoder))
            expected *= float(scale2[t])
            got = float(graph.adjacency[node, graph.find("token", position=p)])
            assert abs(got - expected) < 1e-11 * max(1.0, abs(expected)), (node, p, got, expected)
            checked += 1
    assert checked >= 10


def test_a_padded_batch_element_has_the_graph_of_its_sequence_alone():
    model = small("gpt2")
    config = model.config
    transcoders = random_transcoders(config.n_layer, config.n_embd, 8)
    sequence = torch.randint(1, 50, (4,))
    ids = torch.zeros(2, 6, dtype=torch.long)
    mask = torch.zeros(2, 6, dtype=torch.long)
    ids[1, 2:], mask[1, 2:] = sequence, 1
    ids[0], mask[0] = torch.randint(1, 50, (6,)), 1
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    padded, _ = capture_huggingface_residual(
        model, input_ids=ids, attention_mask=mask, position_ids=positions, transcoders=transcoders
    )
    alone, _ = capture_huggingface_residual(model, input_ids=sequence[None], transcoders=transcoders)
    mine, theirs = pk.attribution_graph(padded, batch=1), pk.attribution_graph(alone)
    assert torch.equal(mine.kinds, theirs.kinds) and torch.equal(mine.features, theirs.features)
    assert torch.equal(mine.positions, theirs.positions + 2)
    assert torch.allclose(mine.adjacency, theirs.adjacency, rtol=1e-9, atol=1e-12)
    assert torch.equal(mine.input_tokens, sequence)


# ------------------------------------------------------------------------------------------------
# Pruning


def hand_graph() -> AttributionGraph:
    """Two tokens, one feature, no errors (L = 0 layers of errors), one logit: token 0 → feature
    (weight 2), token 1 → feature (−1), feature → logit (3), token 1 → logit (1)."""
    kinds = torch.tensor([FEATURE, TOKEN, TOKEN, LOGIT])
    adjacency = torch.zeros(4, 4, dtype=torch.float64)
    adjacency[0, 1], adjacency[0, 2], adjacency[3, 0], adjacency[3, 2] = 2.0, -1.0, 3.0, 1.0
    return AttributionGraph(
        kinds=kinds, layers=torch.tensor([0, -1, -1, 1]), positions=torch.tensor([1, 0, 1, 1]),
        features=torch.tensor([5, -1, -1, 7]), activations=torch.zeros(4, dtype=torch.float64), adjacency=adjacency,
        values=torch.zeros(4, dtype=torch.float64), constant=torch.zeros(4, dtype=torch.float64),
        logit_tokens=torch.tensor([7]), logit_probabilities=torch.tensor([1.0], dtype=torch.float64),
        input_tokens=torch.tensor([3, 4]), real_positions=torch.tensor([0, 1]), num_layers=0, description="hand",
    )  # fmt: skip


def test_pruning_follows_circuit_tracers_definitions_on_a_hand_worked_graph():
    """Rows normalised by their absolute sums: the logit's row is (3/4 feature, 1/4 token 1), the
    feature's (2/3 token 0, 1/3 token 1). Influence from the logit (probability 1): feature 3/4,
    token 0: 3/4 · 2/3 = 1/2, token 1: 1/4 + 3/4 · 1/3 = 1/2, the logit 0. Cumulative shares of the
    sorted influences (3/4, 1/2, 1/2, 0, over 7/4): 3/7, 5/7, 1, 1."""
    graph = hand_graph().prune(node_threshold=0.8, edge_threshold=1.0)
    assert graph.node_mask.tolist() == [True, True, True, True]
    got = graph.influence
    assert abs(float(got[0]) - 3 / 7) < 1e-15 and float(got[3]) == 1.0
    assert sorted(got[1:3].tolist()) == pytest.approx([5 / 7, 1.0], abs=1e-15)  # the tokens tie: either order
    assert graph.edge_mask.sum() == 4
    # Edge scores: each row's normalised weights times its target's influence plus its logit weight:
    # feature → logit 3/4, token 0 → feature 1/2, token 1 → logit 1/4, token 1 → feature 1/4 (of 7/4).
    # edge_threshold 0.6 keeps the first two (3/7 < 0.6 ≤ 5/7).
    graph = hand_graph().prune(node_threshold=1.0, edge_threshold=0.6)
    assert sorted(graph.edge_mask.nonzero().tolist()) == [[0, 1], [3, 0]]
    assert graph.node_mask.tolist() == [True, True, True, True]
    # 0.3 keeps feature → logit alone; the feature then has no incoming edge, so it goes, and its
    # edge with it (the tokens and the logit always stay).
    graph = hand_graph().prune(node_threshold=1.0, edge_threshold=0.3)
    assert not bool(graph.edge_mask.any())
    assert graph.node_mask.tolist() == [False, True, True, True]


def test_prune_refuses_thresholds_outside_zero_and_one():
    with pytest.raises(ValueError, match="expected node_threshold in"):
        hand_graph().prune(node_threshold=1.5)
    with pytest.raises(ValueError, match="expected edge_threshold in"):
        hand_graph().prune(edge_threshold=-0.1)


# ------------------------------------------------------------------------------------------------
# Files


# circuit-tracer's frontend/graph_models.py: every field of a Node, and a Link's.
NODE_FIELDS = {
    "node_id": str, "feature": int, "layer": str, "ctx_idx": int, "feature_type": str, "token_prob": float,
    "is_target_logit": bool, "run_idx": int, "reverse_ctx_idx": int, "jsNodeId": str, "clerp": str,
    "influence": (float, type(None)), "activation": (float, type(None)),
}  # fmt: skip
METADATA_FIELDS = {"slug", "scan", "transcoder_list", "prompt_tokens", "prompt", "node_threshold"}
QPARAMS = {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""}


def test_the_circuit_tracer_file_holds_what_its_graph_class_takes(tmp_path):
    model = small("gpt2")
    graph, *_rest, ids = graph_of(model, features=8)
    path = graph.save_circuit_tracer(tmp_path / "graph.pt", input_string="a prompt")
    record = torch.load(path, weights_only=False)
    assert set(record) == set(CIRCUIT_TRACER_KEYS)  # Graph(**record) takes exactly these
    features = int((graph.kinds == FEATURE).sum())
    n, layers, k = 6, 2, graph.logit_tokens.numel()
    assert record["adjacency_matrix"].shape == (features + layers * n + n + k,) * 2
    assert record["adjacency_matrix"].dtype == torch.float32
    assert torch.equal(record["adjacency_matrix"], graph.adjacency.float())
    assert record["active_features"].shape == (features, 3)
    assert torch.equal(record["selected_features"], torch.arange(features))
    assert record["activation_values"].shape == (features,)
    assert torch.equal(record["input_tokens"], ids[0])
    assert record["cfg"].n_layers == 2 and record["input_string"] == "a prompt"
    # The features' rows as circuit-tracer orders them: (layer, position, feature) ascending.
    keys = record["active_features"].tolist()
    assert keys == sorted(keys)
    for (layer, position, feature), value in zip(keys, record["activation_values"].tolist()):
        node = graph.find("feature", layer=layer, position=position, feature=feature)
        assert value == pytest.approx(float(graph.activations[node]), rel=1e-6)


def test_the_neuronpedia_file_has_the_viewers_fields_and_the_graphs_weights(tmp_path):
    model = small("gpt2")
    graph, *_ = graph_of(model, features=8, skip=True)
    path = graph.save_neuronpedia(tmp_path, "a-graph", paths_per_link=2)
    document = json.loads(path.read_text())
    assert set(document) == {"metadata", "qParams", "nodes", "links"}
    assert METADATA_FIELDS <= set(document["metadata"]) and document["metadata"]["slug"] == "a-graph"
    assert document["qParams"] == QPARAMS
    ids = {}
    for node in document["nodes"]:
        for name, kind in NODE_FIELDS.items():
            assert isinstance(node[name], kind), (name, node)
        ids[node["node_id"]] = node
    kinds = {node["feature_type"] for node in document["nodes"]}
    assert (
        {"embedding", "logit"} <= kinds <= {"embedding", "logit", "cross layer transcoder", "mlp reconstruction error"}
    )
    assert sum(node["is_target_logit"] for node in document["nodes"]) == 1
    assert len(document["links"]) == int(graph.edge_mask.sum()) > 0
    by_id, twice = {}, set()
    for index in range(graph.num_nodes):
        if graph.node_mask[index]:
            node_id = _node_id(graph, index)
            twice |= {node_id} if node_id in by_id else set()
            by_id.setdefault(node_id, index)
    for link in document["links"]:
        assert link["source"] in ids and link["target"] in ids
        if link["source"] in twice or link["target"] in twice:
            continue  # circuit-tracer's ids collide there (save_neuronpedia warns): checked below
        source, target = by_id[link["source"]], by_id[link["target"]]
        assert link["weight"] == float(graph.adjacency[target, source])
        chains = graph.edge_top_paths(source, target, top_k=2)
        kept = [row for row in chains.table() if row["attribution"] != 0]
        assert [chain["weight"] for chain in link["pathkernels_paths"]] == [row["attribution"] for row in kept]
    index = json.loads((tmp_path / "graph-metadata.json").read_text())
    assert [entry["slug"] for entry in index["graphs"]] == ["a-graph"]
    graph.save_neuronpedia(tmp_path, "a-graph", paths_per_link=0)  # written again: listed once
    assert len(json.loads((tmp_path / "graph-metadata.json").read_text())["graphs"]) == 1


def test_the_ids_circuit_tracers_scheme_gives_two_nodes_are_named_in_a_warning(tmp_path):
    """A layer-0 feature whose index is 1, active at token t, is "0_1_t", as the error of layer 1 at t
    is: the file is written as circuit-tracer writes it, and the collision named."""
    graph = hand_graph()
    graph.kinds = torch.tensor([FEATURE, ERROR, TOKEN, LOGIT])
    graph.layers, graph.features = torch.tensor([0, 1, -1, 1]), torch.tensor([1, -1, -1, 7])
    graph.positions = torch.tensor([1, 1, 1, 1])
    graph.num_layers, graph.input_tokens, graph.real_positions = 2, torch.tensor([3, 4]), torch.tensor([0, 1])
    rows = [[0, 1.0, 2.0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [3.0, 1.0, 0, 0]]  # error → feature → logit, …
    graph.adjacency = torch.tensor(rows, dtype=torch.float64)
    with pytest.warns(UserWarning, match=r"1 node ids name two nodes in circuit-tracer's scheme .*0_1_1"):
        graph.save_neuronpedia(tmp_path, "collide", paths_per_link=0, node_threshold=1.0, edge_threshold=1.0)


def _node_id(graph, index: int) -> str:
    kind = KINDS[int(graph.kinds[index])]
    layer, position, feature = int(graph.layers[index]), int(graph.positions[index]), int(graph.features[index])
    if kind == "feature":
        return f"{layer}_{feature}_{position}"
    if kind == "error":
        return f"0_{layer}_{position}"
    if kind == "token":
        return f"E_{int(graph.input_tokens[position])}_{position}"
    return f"{graph.num_layers + 1}_{feature}_{position}"


# ------------------------------------------------------------------------------------------------
# Refused by name


def test_what_the_graph_cannot_do_is_refused_by_name(tmp_path):
    model = small("gpt2")
    ids = torch.randint(0, 50, (1, 5))
    plain, _ = capture_huggingface_residual(model, input_ids=ids)
    with pytest.raises(ValueError, match="expected a stack captured with transcoders="):
        pk.attribution_graph(plain)
    graph, stack, *_ = graph_of(model, features=6, tokens=5)
    with pytest.raises(ValueError, match="expected position of a real token"):
        pk.attribution_graph(stack, position=9)
    with pytest.raises(ValueError, match=r"expected logits as vocabulary ids in \[0, 50\)"):
        pk.attribution_graph(stack, logits=[3, 50])
    with pytest.raises(ValueError, match="expected desired_logit_prob in"):
        pk.attribution_graph(stack, desired_logit_prob=0.0)
    logit = int((graph.kinds == LOGIT).nonzero()[0])
    token = graph.find("token", position=1)
    with pytest.raises(ValueError, match="is a logit, which writes nothing"):
        graph.edge_paths(logit, logit)
    with pytest.raises(ValueError, match="is a token, which reads nothing"):
        graph.incoming_paths(token)
    with pytest.raises(ValueError, match=r"expected target a node index in \[0, "):
        graph.edge_paths(token, graph.num_nodes)
    with pytest.raises(ValueError, match="expected slug to be a non-empty name"):
        graph.save_neuronpedia(tmp_path, "a/b")
    with pytest.raises(ValueError, match="expected input_tokens of the prompt's 5 real tokens"):
        graph.save_circuit_tracer(tmp_path / "g.pt", input_tokens=[1, 2])


def test_a_graph_of_the_most_influential_features_keeps_every_row_exact():
    """max_feature_nodes: the features chosen in circuit-tracer's order (the first batch, of most
    influence through the logits' rows alone, includes the largest direct writers into the logits);
    their edges are the full graph's, and what the features left out write is in the constants."""
    model = small("gpt2")
    graph, stack, *_ = graph_of(model, features=10, tokens=6)
    total = int((graph.kinds == FEATURE).sum())
    part = pk.attribution_graph(stack, max_feature_nodes=total // 3)
    assert int((part.kinds == FEATURE).sum()) == total // 3 and part.active_features == total
    targets = (part.kinds == FEATURE) | (part.kinds == LOGIT)
    assert float((part.adjacency.sum(1) + part.constant - part.values)[targets].abs().max()) < 1e-12
    full_index = [
        graph.find(KINDS[int(k)], layer=int(layer), position=int(p), feature=int(f)) if KINDS[int(k)] != "token"
        else graph.find("token", position=int(p))
        for k, layer, p, f in zip(part.kinds, part.layers, part.positions, part.features)
    ]  # fmt: skip
    full = graph.adjacency[full_index][:, full_index]
    assert torch.allclose(part.adjacency[targets], full[targets], rtol=1e-12, atol=1e-14)
    # The logits' strongest feature source is among those chosen.
    logit_rows = graph.adjacency[graph.kinds == LOGIT][:, graph.kinds == FEATURE].abs().sum(0)
    strongest = int((graph.kinds == FEATURE).nonzero()[int(logit_rows.argmax())])
    assert (int(graph.layers[strongest]), int(graph.positions[strongest]), int(graph.features[strongest])) in {
        (int(layer), int(p), int(f)) for layer, p, f in zip(part.layers, part.positions, part.features)
    }
    with pytest.raises(ValueError, match="pass a smaller max_feature_nodes"):
        pk.attribution_graph(stack, memory_budget=1000)


def test_the_sweeps_on_a_causal_models_first_tokens_equal_one_sweep_of_every_token(monkeypatch):
    """The targets swept in groups on the tokens up to the last each reads (the model's token maps
    are causal) and joining at their own levels give the rows of one sweep of every target on every
    token; and the groups split where the work per token makes it worth a sweep."""
    from pathkernels.analysis import graph as graph_module

    model = small("gpt2")
    with monkeypatch.context() as patch:
        patch.setattr(graph_module, "_GROUP_OVERHEAD", 0)  # a group per reach
        graph, stack, *_ = graph_of(model, features=12, tokens=9)
    with monkeypatch.context() as patch:
        patch.setattr(graph_module, "_causal", lambda sublayers: False)
        whole = pk.attribution_graph(stack)
    assert graph_module._causal(graph._context["heads_only"])
    assert torch.equal(whole.kinds, graph.kinds) and torch.equal(whole.features, graph.features)
    assert torch.allclose(whole.adjacency, graph.adjacency, rtol=1e-13, atol=1e-15)
    assert torch.allclose(whole.constant, graph.constant, rtol=1e-13, atol=1e-15)
    targets = [graph_module._Target(node, 0, rho, torch.zeros(3), 0.0) for node, rho in
               enumerate(torch.eye(8, dtype=torch.float64)[[0, 0, 1, 7, 7, 7]])]  # fmt: skip
    with monkeypatch.context() as patch:
        patch.setattr(graph_module, "_GROUP_OVERHEAD", 4)
        groups = graph_module._reach_groups(targets, True, 8)
    assert [(reach, [t.node for t in group]) for reach, group in groups] == [(2, [0, 1, 2]), (8, [3, 4, 5])]
    assert [(reach, len(group)) for reach, group in graph_module._reach_groups(targets, False, 8)] == [(8, 6)]


def test_a_layer_where_no_feature_is_active_has_no_feature_nodes_and_exact_rows():
    model = small("gpt2")
    for seed in range(20):
        torch.manual_seed(seed)
        graph, stack, capture, *_ = graph_of(model, features=8, tokens=5, density=0.02)
        silent = [layer for layer, r in capture.transcoders.layers.items() if r.features.numel() == 0]
        if silent and int((graph.kinds == FEATURE).sum()):
            break
    else:
        pytest.fail("no draw left a layer without an active feature beside one with some")
    assert not bool(((graph.kinds == FEATURE) & (graph.layers == silent[0])).any())
    targets = (graph.kinds == FEATURE) | (graph.kinds == LOGIT)
    assert float((graph.adjacency.sum(1) + graph.constant - graph.values)[targets].abs().max()) < 1e-12
