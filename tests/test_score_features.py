"""The score side through transcoder features: a head's score split into pairs of paths that pass
the features of the MLPs below it.

Each claim against a reference that shares no code with the decomposition: every pair's term is
``scaling · ⟨q_p(i), k_p'(j)⟩`` with each side written through the model's own projection
weights, frozen norm and rotation (tests/test_scores.py's ``literal_sides``) from the path's term
(``pk.path_terms``, itself held to the weights in tests/test_transcoder_paths.py); the groups are
those pairs summed; everything sums to the model's own score; one side's certified search is the
sorted list of every path; the held-norm causal check moves the score by the prediction.

Models are built from configs in float64 with random biases and norm parameters; the transcoder
sets are random, drawn afresh each run.
"""

import pytest
import torch
from test_real_models import gpt2, llama
from test_scores import CONSTANT, literal_sides, record_norm_inputs
from test_transcoder_paths import transcoders_for

import pathkernels as pk
from pathkernels.adapters.residual import capture_huggingface_residual

transformers = pytest.importorskip("transformers")


MODELS = {
    "gpt2": lambda: gpt2(layers=3, heads=2, width=8).eval(),
    "llama": lambda: llama(layers=2, heads=4, kv_heads=2, width=16).eval(),
}


def captured(name: str, features: int = 5, **options):
    model = MODELS[name]()
    transcoders = transcoders_for(model, features=features, skip=True, **options)
    ids = torch.randint(0, 50, (1, 6))
    stack, capture = capture_huggingface_residual(model, input_ids=ids, query_key=True, transcoders=transcoders)
    return model, ids, stack, capture


def steps_label(path, source: str, layers: int) -> str:
    """A group's label written from a path's choices ``[2L]``: its source and its number of steps."""
    length = int((path >= 0).sum())
    return f"{source} (direct)" if length == 0 else f"{source} via {length} step{'s' * (length > 1)}"


@pytest.mark.parametrize("name, cross_layer", [("gpt2", False), ("llama", False), ("gpt2", True)])
def test_with_transcoders_every_pair_is_its_literal_pair_and_the_groups_their_sums(name, cross_layer):
    """At layer 1 (the stream below it: the embedding, layer 0's heads, its features and skip
    directions, its transcoder bias and error; with a cross-layer set, layer 2, whose stream holds
    layer 0's features written into layer 1's MLP): each pair's term equals the literal pair of the
    two paths' terms, the groups of score_decomposition are those pairs summed by (source, steps),
    and everything sums to the model's own score."""
    layer, head, query, key = 1 + cross_layer, 1, 5, 2
    for _ in range(50):  # a draw whose 4 largest pairs include a path through a layer-0 feature
        model, ids, stack, capture = captured(name, features=4, cross_layer=cross_layer)
        pairs = pk.score_pairs(stack, layer, head, query=query, key=key, top_k=4)
        if any("L0 F" in pairs.describe(i) for i in range(pairs.paths.shape[0])):
            break
    else:
        raise AssertionError("no draw of 50 listed a pair through a layer-0 feature among its 4 largest")
    record_norm_inputs(model, ids)
    layers = stack.num_layers
    assert pairs.paths.shape[1] == 2 * layers
    if cross_layer:
        assert any("→L1" in pairs.describe(i) for i in range(pairs.paths.shape[0]))
    assert "L0 MLP error" in pairs.source_names and "L0 transcoder bias" in pairs.source_names
    terms = pk.path_terms(stack, pairs.paths, pairs.sources)  # [P, n, d], each path's own term
    sides = [literal_sides(model, capture, layer, term, False) for term in terms]
    sides.append(literal_sides(model, capture, layer, torch.zeros_like(capture.embedding[0]), True))
    q = torch.stack([s[0][head, query] for s in sides])
    k = torch.stack([s[1][head, key] for s in sides])
    scaling = stack.residual_capture.query_key.scaling[layer]
    literal = scaling * q @ k.T  # [P+1, P+1]
    scale = abs(pairs.model_score) + float(literal.abs().max())
    assert float((pairs.values - literal).abs().max()) < 1e-12 * scale
    assert abs(pairs.score - pairs.model_score) < 1e-12 * scale

    decomposition = pk.score_decomposition(stack, layer, head, query=query, keys=[key, 0])
    assert any("via 1 step" in group for group in decomposition.groups)
    labels = [steps_label(p, pairs.source_names[int(s)], layers) for p, s in zip(pairs.paths, pairs.sources)]
    labels.append(CONSTANT)
    grouped = decomposition.pair_table(key)
    for a, query_group in enumerate(decomposition.groups):
        for b, key_group in enumerate(decomposition.groups):
            rows = torch.tensor([label == query_group for label in labels])
            columns = torch.tensor([label == key_group for label in labels])
            expected = float(literal[rows][:, columns].sum())
            assert abs(float(grouped[a, b]) - expected) < 1e-12 * scale, (query_group, key_group)
    assert abs(float(decomposition.scores[0]) - pairs.model_score) < 1e-12 * scale
    assert float((decomposition.scores - decomposition.model_scores).abs().max()) < 1e-12 * scale
    # The stream's paths counted through the steps (score_pairs refuses a budget with their count).
    count = pairs.paths.shape[0]
    with pytest.raises(ValueError, match=f"layer {layer}'s stream has {count:,} paths"):
        pk.score_pairs(stack, layer, head, query=query, key=key, memory_budget=1)
    if decomposition.paths is not None:  # few paths below: the same split path by path
        assert decomposition.paths == (*(pairs.describe(i) for i in range(count)), CONSTANT)
        assert float((decomposition.path_table[:, :, 0] - literal).abs().max()) < 1e-12 * scale


@pytest.mark.parametrize("side", ["query", "key"])
@pytest.mark.parametrize("cross_layer", [False, True])
def test_with_transcoders_one_side_is_the_pair_rows_and_its_search_the_sorted_paths(side, cross_layer):
    """score_attribution's paths through features are the pair table's rows (columns) summed over
    the other side; score_top_paths, largest and smallest, on every bound, is the sorted list of
    them, certified (a cross-layer set's too)."""
    model, ids, stack, _ = captured("gpt2", features=6, cross_layer=cross_layer)
    layer, head, query, key = 2, 0, 5, 3
    pairs = pk.score_pairs(stack, layer, head, query=query, key=key)
    result = pk.score_attribution(stack, layer, head, query=query, key=key, side=side)
    scale = abs(pairs.model_score) + float(pairs.values.abs().max())
    sums = pairs.values.sum(1 if side == "query" else 0)
    index = {(tuple(p.tolist()), int(s)): i for i, (p, s) in enumerate(zip(pairs.paths, pairs.sources))}
    assert result.attribution.shape[0] == pairs.paths.shape[0]
    for path, source, value in zip(result.paths, result.path_sources, result.attribution[:, 0, 0]):
        assert abs(float(value) - float(sums[index[(tuple(path.tolist()), int(source))]])) < 1e-12 * scale
    assert abs(float(result.value) - pairs.model_score) < 1e-12 * scale
    every = result.attribution[:, 0, 0]
    for bound in ("node", "chain", "plain"):
        for largest in (True, False):
            found = pk.score_top_paths(
                stack, layer, head, 5, query=query, key=key, side=side, largest=largest, bound=bound
            )
            assert found.certified and found.total == every.numel()
            expected = torch.sort(every, descending=largest).values[:5]
            torch.testing.assert_close(found.values, expected, rtol=0, atol=1e-12 * scale)


def test_with_transcoders_a_held_norm_removal_moves_the_score_by_the_prediction():
    """causal_check of key paths through layer 0's features, removed from a layer-1 head's key
    input with the norm held: the score moves by the prediction (a check of the hooks). The draw
    is repeated until some path through a feature moves the key (a feature open at the key)."""
    layer, head, query, key = 1, 1, 5, 2
    for _ in range(20):
        model, ids, stack, _ = captured("gpt2", features=6)
        pairs = pk.score_pairs(stack, layer, head, query=query, key=key)
        moving = pairs.values.abs().amax(0) > 0
        through = [i for i in range(pairs.paths.shape[0]) if "L0 F" in pairs.describe(i) and moving[i]][:4]
        if through:
            break
    assert through, "no draw opened a feature at the key"
    check = pk.causal_check(
        model,
        stack,
        {"input_ids": ids},
        pairs.paths[through],
        pairs.sources[through],
        side="key",
        layer=layer,
        head=head,
        query=query,
        key=key,
        frozen=True,
    )
    assert check.paths == [pairs.describe(i) for i in through]
    scale = float(check.predicted.abs().max())
    assert float((check.score_change - check.predicted).abs().max()) < 1e-10 * scale
    above = torch.full((1, 2 * stack.num_layers), -1)
    above[0, stack.num_layers + 1] = int(stack.residual_capture.transcoders.layers[1].features[0])
    with pytest.raises(ValueError, match="expected paths of the stream entering layer 1"):
        pk.causal_check(model, stack, {"input_ids": ids}, above, [0], side="key", layer=1, head=0, query=query, key=key)


@pytest.mark.parametrize("name, cross_layer", [("gpt2", False), ("llama", False), ("gpt2", True)])
def test_with_transcoders_the_certified_top_pairs_are_the_listed_pairs_top(name, cross_layer):
    """top_score_pairs through features, largest and smallest, on every bound: certified, and its
    values and pairs the top of every pair score_pairs lists; stopped at once (a time limit passed
    before the first expansion), the bound it reports is above every pair it did not list."""
    _, _, stack, _ = captured(name, features=4, cross_layer=cross_layer)
    layer, head, query, key = stack.num_layers - 1, 1, 5, 2
    listed = pk.score_pairs(stack, layer, head, query=query, key=key, top_k=8)
    scale = float(listed.values.abs().max())
    for bound in ("chain", "first_head", "plain"):
        for largest, rows in ((True, listed.top), (False, listed.bottom)):
            found = pk.top_score_pairs(
                stack, layer, head, 8, query=query, key=key, largest=largest, bound=bound, batch_nodes=3
            )
            assert found.certified and found.stopped in ("certified", "exhausted"), found
            assert found.total == listed.paths.shape[0]
            assert [row["value"] for row in found.table()] == pytest.approx(
                [row["value"] for row in rows], abs=1e-12 * scale
            )
            assert [(r["query path"], r["key path"]) for r in found.table()][:3] == [
                (r["query path"], r["key path"]) for r in rows
            ][:3]
    for largest in (True, False):
        stopped = pk.top_score_pairs(stack, layer, head, 8, query=query, key=key, largest=largest, time_limit=1e-9)
        signed = torch.sort(listed.values.flatten() * (1 if largest else -1), descending=True).values
        shown = stopped.values * (1 if largest else -1)
        ceiling = max(stopped.bound, float(shown.min())) if shown.numel() else stopped.bound
        assert float(signed[shown.numel() :].max()) <= ceiling + 1e-12 * scale
