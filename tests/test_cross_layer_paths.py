"""Paths through a cross-layer transcoder's features: a feature of layer l reads the stream entering
layer l's MLP and writes into every layer m ≥ l. Its write at m is a step of m's MLP that takes a
path from below l's MLP to above m's, nothing taken between. Checked against the set's own forward,
terms written literally from the weights (each feature read at l, then a target m chosen: the other
way round from the code, which branches at m and jumps down to l), brute-force enumeration for the
certified search, and the sums of every family."""

from __future__ import annotations

import functools

import pytest
import torch
from float64_reference import logits_in_float64
from test_attribution_graph import check_edges_are_their_chains
from test_real_models import gpt2
from test_transcoder_paths import (
    FAMILY_CASES,
    gpt2_branches,
    mlp_sides,
    own_mlp_inputs,
    relative,
    replaced_logits,
    tl_model_with_mlps,
)

import pathkernels as pk
from pathkernels.adapters.residual import capture_huggingface_residual
from pathkernels.adapters.transcoders import random_transcoders
from pathkernels.analysis.readout_trie import describe_path


def clt_for(model, features: int = 6, **options):
    config = model.config.get_text_config()
    return random_transcoders(config.num_hidden_layers, config.hidden_size, features, cross_layer=True, **options)


def tiny_clt(layers: int = 3, features: int = 4):
    """A 3-layer GPT-2 of width 8 on 4 random tokens with a cross-layer set of 4 features a layer,
    the tokens drawn again until layers 0 and 1 have a feature open (so that steps written into
    later layers exist): ``(model, transcoders, ids, stack, capture)``."""
    model = gpt2(layers=layers, heads=2, width=8).eval()
    transcoders = clt_for(model, features=features)
    for _ in range(100):
        ids = torch.randint(0, 50, (1, 4))
        stack, capture = capture_huggingface_residual(model, input_ids=ids, transcoders=transcoders)
        if all(capture.transcoders.layers[layer].features.numel() for layer in (0, 1)):
            break
    return model, transcoders, ids, stack, capture


# ------------------------------------------------------------------------------------------------
# The replaced model is the model


@pytest.mark.parametrize("activation", ["jumprelu", "relu", "topk"])
def test_the_model_with_a_cross_layer_set_plus_the_error_is_the_model(activation):
    """Each MLP replaced by the set's own forward (every earlier layer's features writing into it)
    plus the capture's error gives the model's logits; the capture's activations are the set's own
    encoding, and each layer's writes from earlier layers are their decoders' rows of the active
    features."""
    model = gpt2(layers=3, heads=2, width=16).eval()
    transcoders = clt_for(model, features=10, activation=activation)
    ids = torch.randint(0, 50, (2, 7))
    stack, capture = capture_huggingface_residual(model, input_ids=ids, transcoders=transcoders)
    seen, logits = own_mlp_inputs(model, ids)
    assert relative(replaced_logits(model, ids, transcoders, capture), logits) < 1e-10
    for layer, replaced in capture.transcoders.layers.items():
        own = transcoders.encode(layer, seen["argument"][layer].double())
        assert torch.equal((own != 0).nonzero()[:, 2].unique(), replaced.features)
        assert torch.allclose(replaced.activations, own[..., replaced.features], rtol=1e-11, atol=1e-12)
        assert sorted(replaced.decoders_from) == list(range(layer))
        for source, decoder in replaced.decoders_from.items():
            features = capture.transcoders.layers[source].features
            assert torch.equal(decoder, transcoders.w_dec[source][layer][features])
    for batch in range(2):
        result = pk.path_attribution(stack, pk.logit(model, 3), batch=batch, top_k=0)
        total = float(result.by_source_length.sum() + result.constant[0, 0])
        assert abs(total - float(logits[batch, -1, 3])) < 1e-10 * max(1.0, float(logits[batch, -1].abs().max()))


# ------------------------------------------------------------------------------------------------
# Every path is its literal term


def literal_clt_attributions(model, ids, transcoders, stack, capture, u: torch.Tensor) -> dict:
    """Every path's attribution at the last token of a pre-LN GPT-2 with a cross-layer set, written
    from the weights: ``{label: value}``. A path passes the sublayers from its source up; at layer
    l's MLP it may read feature f (gate from the set's own encoding of the model's MLP input) and
    write it into any layer m ≥ l, ``diag(g_f D₂) (x C Γ₂) enc_f d_f^{l→m}ᵀ``, going on above m's
    MLP (the sublayers and sources between passed by). A head reads ``D x C Γ₁`` and writes
    ``A_h (·) W_V,h W_O,h``; the readout is ``e_tᵀ D_f (·) C Γ_f u``."""
    layers, heads, d = stack.num_layers, stack.num_heads, stack.d_model
    centre = torch.eye(d, dtype=torch.float64) - 1.0 / d
    attn = capture.patterns(stack.attn, 0)
    seen, _ = own_mlp_inputs(model, ids)
    blocks = model.transformer.h
    _, head, feature = gpt2_branches(model, stack, capture)

    # The slots bottom up, each (layer, kind), and what a path may take there: (label, next slot, map).
    slots = [(layer, kind) for layer in range(layers) for kind in ("attn", "mlp")]
    options = {}
    for index, (layer, kind) in enumerate(slots):
        options[index] = [(None, index + 1, None)]
        if kind == "attn":
            options[index] += [(f"L{layer}H{h}", index + 1, functools.partial(head, layer, h)) for h in range(heads)]
            continue
        gates = (transcoders.encode(layer, seen["argument"][layer][0].double()) != 0).double()  # [n, F]
        for f in gates.any(0).nonzero().flatten().tolist():
            for target in range(layer, layers):
                dec = transcoders.w_dec[layer][target][f]
                label = f"L{layer} F{f}" + ("" if target == layer else f"→L{target}")
                step = functools.partial(feature, layer, gates[:, f], transcoders.w_enc[layer][:, f], dec)
                options[index].append((label, slots.index((target, "mlp")) + 1, step))
    final = model.transformer.ln_f.weight.double()
    readout = centre @ (final * u)

    def read(x):
        return float(capture.final_scale[0, -1] * (x[-1] @ readout))

    def attention_rows(layer):  # Σ_h (A_h 1)(βᵀ W_V + b_V) W_O + b_O
        beta = blocks[layer].ln_1.bias.double()
        rows = torch.zeros_like(capture.embedding[0])
        for h in range(heads):
            value = (beta @ stack.w_v[layer, h].double() + capture.value_bias[layer, h]) @ stack.w_o[layer, h].double()
            rows += attn[layer, h].sum(-1)[:, None] * value[None, :]
        return rows + blocks[layer].attn.c_proj.bias.double()

    sources = [("embedding", capture.embedding[0], 0)]  # (name, rows, the slot it enters below)
    for layer in range(layers):
        replaced = capture.transcoders.layers[layer]
        sources.append((f"L{layer} attention bias", attention_rows(layer), 2 * layer + 1))
        sources.append((f"L{layer} transcoder bias", replaced.bias[0], 2 * layer + 2))
        sources.append((f"L{layer} MLP error", replaced.error[0], 2 * layer + 2))
    values = {}

    def walk(name, term, slot, labels):
        if slot == len(slots):
            label = f"{' → '.join(labels)} from {name}" if labels else f"{name} (direct)"
            values[label] = values.get(label, 0.0) + read(term)
            return
        for label, after, step in options[slot]:
            walk(name, term if step is None else step(term), after, labels if label is None else [*labels, label])

    for name, rows, slot in sources:
        walk(name, rows, slot, [])
    return values


def test_every_path_through_cross_layer_features_is_its_literal_term():
    """On a 3-layer GPT-2 with a cross-layer set: the paths are exactly those written from the weights
    (a feature read at l and written at any m ≥ l, nothing between), each equal to its literal
    term, and they sum to the model's own logit; the counts by length are those of the paths."""
    model, transcoders, ids, stack, capture = tiny_clt()
    token = 7
    result = pk.path_attribution(stack, pk.logit(model, token), top_k=3)
    mine = {result.describe(p, s): float(v) for p, s, v in zip(result.paths, result.path_sources,
                                                                 result.attribution[:, 0, 0])}  # fmt: skip
    assert len(mine) == result.paths.shape[0]  # no path listed twice
    u = model.lm_head.weight[token].detach().double()
    literal = literal_clt_attributions(model, ids, transcoders, stack, capture, u)
    assert set(mine) == set(literal)
    assert any("→L2" in label for label in mine) and any("→L1" in label for label in mine)
    scale = max(abs(v) for v in literal.values())
    assert max(abs(mine[k] - literal[k]) for k in literal) < 1e-11 * scale
    own = float(logits_in_float64(model, input_ids=ids)[0, -1, token])
    assert abs(sum(literal.values()) + float(result.constant[0, 0]) - own) < 1e-10 * max(1.0, abs(own))
    lengths = torch.tensor([0 if " (direct)" in k else k.count(" → ") + 1 for k in literal])
    assert result.counts.sum(0).tolist()[: int(lengths.max()) + 1] == torch.bincount(lengths).tolist()
    assert int(result.counts.sum()) == len(literal)
    again = pk.path_attribution(stack, pk.logit(model, token), top_k=3, max_length=2)  # the counts by length too
    assert int(again.counts.sum()) == int((lengths <= 2).sum())


def test_the_terms_of_paths_through_cross_layer_features_sum_to_the_stream():
    """pk.path_terms of every path sum to the stream entering the final norm and read out as their
    attributions; a path that takes a head or step between a cross-layer feature's read and write,
    or starts from a source above its read, is refused by name."""
    model, _, _, stack, capture = tiny_clt()
    token = 5
    result = pk.path_attribution(stack, pk.logit(model, token), top_k=2)
    terms = pk.path_terms(stack, result.paths, result.path_sources)
    assert relative(terms.sum(0), capture.residual[0]) < 1e-12
    centre = torch.eye(8, dtype=torch.float64) - 1.0 / 8
    u = centre @ (model.transformer.ln_f.weight.detach().double() * model.lm_head.weight[token].detach().double())
    assert relative(capture.final_scale[0, -1] * (terms[:, -1] @ u), result.attribution[:, 0, 0]) < 1e-12
    stride = capture.transcoders.stride
    long_step = next(i for i, p in enumerate(result.paths) if int(p[5]) >= 2 * stride)  # layer 0's feature at 2
    path = result.paths[long_step].clone()
    between = path.clone()
    between[2] = 0  # a head of layer 2, between the read (layer 0's MLP) and the write (layer 2's)
    with pytest.raises(ValueError, match="and a step between"):
        pk.path_terms(stack, between, [0])
    for above in ("L0 transcoder bias", "L0 MLP error", "L1 attention bias"):  # entering above the read
        with pytest.raises(ValueError, match="takes a step that reads below its source"):
            pk.path_terms(stack, path, [above])
    assert pk.path_terms(stack, path, ["L0 attention bias"]).abs().max() > 0  # entering below it
    beyond = torch.full_like(path, -1)
    beyond[5] = 3 * stride + 1  # layer −1's feature
    with pytest.raises(ValueError, match=r"a feature of a layer writing there, \(m − l\)"):
        pk.path_terms(stack, beyond, [0])


# ------------------------------------------------------------------------------------------------
# The certified search


@pytest.mark.parametrize("bound", ["node", "chain", "first_head", "plain"])
@pytest.mark.parametrize("largest", [True, False])
def test_the_top_paths_through_cross_layer_features_are_those_of_enumeration(bound, largest):
    model, _, _, stack, _ = tiny_clt(features=6)
    readout = pk.logit(model, 9)
    every = pk.path_attribution(stack, readout, top_k=0)
    values = every.attribution[:, 0, 0]
    top = pk.top_paths(stack, readout, top_k=8, bound=bound, largest=largest)
    assert top.certified
    assert torch.allclose(top.values, values.topk(8, largest=largest).values, rtol=1e-10, atol=1e-13)
    assert top.total == values.numel()
    labels = {every.describe(p, s) for p, s in zip(every.paths, every.path_sources)}
    assert all(row["path"] in labels for row in top.table())


# ------------------------------------------------------------------------------------------------
# Every family


@pytest.mark.parametrize("name", ["gpt2", "llama", "gemma2"])
@pytest.mark.parametrize("output_hook", ["mlp_output", "mlp_module_output"])
def test_a_family_with_a_cross_layer_set_is_the_sum_of_its_paths(name, output_hook):
    """Σ every path, + the constant, = the model's logit; where the set writes the MLP module's output
    before a norm (Gemma-2), each layer's error is the sublayer's output less the set's own output
    through that norm, frozen at the module's own output."""
    model = FAMILY_CASES[name]()
    transcoders = clt_for(model, features=5, output_hook=output_hook)
    ids = torch.randint(0, 50, (1, 5))
    stack, capture = capture_huggingface_residual(model, input_ids=ids, transcoders=transcoders)
    everything = pk.path_attribution(stack, pk.logit(model, 11), top_k=2)
    value = float(logits_in_float64(model, input_ids=ids)[0, -1, 11])
    total = float(everything.by_source_length.sum() + everything.constant[0, 0])
    assert abs(total - value) < 1e-12 * max(1.0, abs(value)), (total, value)
    assert int(everything.counts.sum()) == int(everything.paths.shape[0])
    if name == "gemma2" and output_hook == "mlp_module_output":
        seen = mlp_sides(model, ids)
        arguments = {layer: seen[layer][0] for layer in seen}
        for layer, replaced in capture.transcoders.layers.items():
            _, output, sublayer = seen[layer]
            norm = model.model.layers[layer].post_feedforward_layernorm
            inverse_rms = torch.rsqrt(output.pow(2).mean(-1, keepdim=True) + norm.eps)
            expected = sublayer - inverse_rms * transcoders.forward(layer, arguments) * (1 + norm.weight.double())
            assert relative(replaced.error, expected) < 1e-7


def test_a_transformer_lens_model_with_a_cross_layer_set_is_the_sum_of_its_paths():
    pytest.importorskip("transformer_lens")
    model = tl_model_with_mlps("LN")
    transcoders = random_transcoders(3, 32, 6, cross_layer=True, input_hook="resid_mid")
    tokens = torch.randint(0, 50, (1, 5))
    stack, capture = pk.adapters.capture_transformer_lens_residual(model, tokens, transcoders=transcoders)
    logits = model(tokens).detach()
    result = pk.path_attribution(stack, pk.logit(model, 5), top_k=3)
    assert abs(float(result.value[0, 0]) - float(logits[0, -1, 5])) < 1e-10 * float(logits[0, -1].abs().max())
    assert any("→L" in result.describe(p, s) for p, s in zip(result.paths, result.path_sources))
    assert pk.top_paths(stack, pk.logit(model, 5), top_k=3).certified


# ------------------------------------------------------------------------------------------------
# The decomposition


def test_the_decomposition_through_cross_layer_features_lists_every_path_and_measures_its_term():
    """pk.decompose of a 3-layer GPT-2 with a cross-layer set, two sequences: exactly the paths
    path_attribution enumerates over the batch's features, each measured on its term (composite
    norms written here), the terms summing to each sequence's stream."""
    model = gpt2(layers=3, heads=2, width=8).eval()
    ids = torch.randint(0, 50, (2, 4))
    stack, capture = capture_huggingface_residual(model, input_ids=ids, transcoders=clt_for(model, features=3))
    result = pk.decompose(stack)
    assert result.method == "exact" and len(result.paths) == sum(result.path_counts)
    listed = {(int(s), tuple(p.tolist())) for p, s in zip(result.paths, result.sources)}
    assert len(listed) == len(result.paths)
    walked = pk.batch_attribution(stack, pk.logit(model, 3), top_k=0).mean
    assert listed == {(int(s), tuple(p.tolist())) for p, s in zip(walked.paths, walked.path_sources)}
    assert any("→L2" in label for label in result.to_frame()["path"])
    for batch in range(2):
        terms = pk.path_terms(stack, result.paths, result.sources, batch=batch)
        assert relative(terms.sum(0), capture.residual[batch]) < 1e-12
        magnitude = lambda x: (x.abs().sum(-2).amax(-1) * x.abs().sum(-1).amax(-1)).sqrt()  # noqa: E731  ‖x‖_{1,∞}
        norm, residual = magnitude(terms), magnitude(terms - terms.mean(-2, keepdim=True))
        scale = float(norm.max())
        assert float((result.results.norm[batch] - norm).abs().max()) < 1e-12 * scale
        assert float((result.results.residual[batch] - residual).abs().max()) < 1e-12 * scale


def test_draws_through_cross_layer_features_are_uniform_and_strata_are_whole():
    """50,000 draws over every path of a 3-layer GPT-2 with a cross-layer set (and over those of two
    steps): each path's frequency within six standard deviations, Pearson's χ² within six of its
    own; a stratum asked for whole is exactly the paths of its length; samples measure as the
    exact decomposition does."""
    from pathkernels.analysis.readout_trie import frozen_model
    from pathkernels.analysis.real_paths import _draw, _every_path_of_length

    model = gpt2(layers=3, heads=2, width=8).eval()
    for _ in range(200):  # redrawn until some layer has both features open (a choice among its steps), and
        transcoders = clt_for(model, features=2)  # layers 0 and 1 one each (steps written into later layers)
        ids = torch.randint(0, 50, (1, 3))
        stack, capture = capture_huggingface_residual(model, input_ids=ids, transcoders=transcoders)
        counts = [layer.features.numel() for layer in capture.transcoders.layers.values()]
        if max(counts) == 2 and min(counts[:2]) >= 1:
            break
    exact = pk.decompose(stack)
    frozen = frozen_model(stack, capture, 0, torch.ones(3, dtype=torch.bool), batch_features=True)
    every = {(int(s), tuple(p.tolist())) for p, s in zip(exact.paths, exact.sources)}
    assert any(value >= capture.transcoders.stride for _, path in every for value in path)  # steps to a later layer
    for lengths in (list(range(7)), [2]):
        population = {key for key in every if sum(v != -1 for v in key[1]) in lengths}
        draws = 50_000
        choices, sources = _draw(frozen, draws, lengths, torch.Generator().manual_seed(1))
        unique, frequency = torch.unique(torch.cat([sources[:, None], choices], 1), dim=0, return_counts=True)
        assert {(int(row[0]), tuple(row[1:].tolist())) for row in unique} == population
        expected = draws / len(population)
        spread = (expected * (1 - 1 / len(population))) ** 0.5
        assert bool(((frequency - expected).abs() < 6 * spread).all()), (frequency.min(), frequency.max())
        chi2, dof = float(((frequency - expected) ** 2 / expected).sum()), len(population) - 1
        assert chi2 < dof + 6 * (2 * dof) ** 0.5, (chi2, dof)
    for length in range(4):
        choices, sources = _every_path_of_length(frozen, length)
        found = [(int(s), tuple(p.tolist())) for p, s in zip(choices, sources)]
        assert len(found) == len(set(found))
        assert set(found) == {key for key in every if sum(v != -1 for v in key[1]) == length}
    ratio_of = {(int(s), tuple(p.tolist())): exact.results.ratio[:, i] for i, (s, p) in
                enumerate(zip(exact.sources, exact.paths))}  # fmt: skip
    uniform = pk.decompose(stack, num_samples=30, generator=torch.Generator().manual_seed(0))
    keys = [(int(s), tuple(p.tolist())) for s, p in zip(uniform.sources, uniform.paths)]
    expected = torch.stack([ratio_of[k] for k in keys], 1)
    torch.testing.assert_close(uniform.results.ratio, expected, rtol=1e-10, atol=1e-14, equal_nan=True)


# ------------------------------------------------------------------------------------------------
# The attribution graph


FEATURE, LOGIT = pk.AttributionGraph.KINDS.index("feature"), pk.AttributionGraph.KINDS.index("logit")


@pytest.mark.parametrize("name, output_hook", [("gpt2", "mlp_output"), ("gemma2", "mlp_module_output")])
def test_a_cross_layer_graphs_rows_plus_constants_are_the_nodes_values(name, output_hook):
    """Σ_sources adjacency[t, s] + constant[t] = value[t] for every feature and logit: a feature's row
    holds what every earlier layer's features wrote into the MLPs below it."""
    model = gpt2(layers=3, heads=2, width=16).eval() if name == "gpt2" else FAMILY_CASES[name]()
    transcoders = clt_for(model, features=8, output_hook=output_hook)
    ids = torch.randint(0, 50, (1, 6))
    stack, _ = capture_huggingface_residual(model, input_ids=ids, transcoders=transcoders)
    graph = pk.attribution_graph(stack)
    targets = (graph.kinds == FEATURE) | (graph.kinds == LOGIT)
    total = graph.adjacency.sum(1) + graph.constant
    assert float((total - graph.values)[targets].abs().max()) < 1e-12 * float(graph.values[targets].abs().max())
    own = logits_in_float64(model, input_ids=ids)[0, -1]
    assert torch.allclose(graph.values[graph.kinds == LOGIT], own[graph.logit_tokens] - own.mean(), atol=1e-10)


def test_every_cross_layer_edge_is_the_sum_of_its_chains_and_its_literal_term():
    """Every non-zero edge of a 3-layer graph equals its chains (a cross-layer feature's writes into
    each later MLP entering the edge's model at their levels); and the edge from a layer-0 feature
    at the last token into a logit of a 2-layer GPT-2 is written from the weights: its write into
    layer 0 passes layer 1's attention (skip, or a head reading the last token's own row), its
    write into layer 1 goes straight to the final norm."""
    model, transcoders, ids, stack, capture = tiny_clt(features=5)
    graph = pk.attribution_graph(stack)
    assert check_edges_are_their_chains(graph) > 30

    model = gpt2(layers=2, heads=2, width=16).eval()
    transcoders = clt_for(model, features=8)
    d, last = 16, 4
    for _ in range(100):  # redrawn until a layer-0 feature is active at the last token
        ids = torch.randint(0, 50, (1, 5))
        stack, capture = capture_huggingface_residual(model, input_ids=ids, transcoders=transcoders)
        if bool(capture.transcoders.layers[0].gates[0, last].any()):
            break
    graph = pk.attribution_graph(stack)
    centre = torch.eye(d, dtype=torch.float64) - 1.0 / d
    block = model.transformer.h[1]
    gamma1 = block.ln_1.weight.detach().double()
    w_qkv = block.attn.c_attn.weight.detach().double()
    w_v = w_qkv[:, 2 * d :].reshape(d, 2, d // 2).permute(1, 0, 2)
    w_o = block.attn.c_proj.weight.detach().double().reshape(2, d // 2, d)
    attn = capture.patterns(stack.attn, 0)[1]
    scale1 = capture.norm_scale[0, 1, 0]
    logit = int((graph.kinds == LOGIT).nonzero()[0])
    u = model.lm_head.weight[int(graph.features[logit])].detach().double()
    u = u - model.lm_head.weight.detach().double().mean(0)  # the demeaned unembedding
    read = capture.final_scale[0, last] * (centre @ (model.transformer.ln_f.weight.detach().double() * u))
    checked = 0
    for node in ((graph.kinds == FEATURE) & (graph.layers == 0) & (graph.positions == last)).nonzero().flatten():
        f = int(graph.features[node])
        activation = float(graph.activations[node])
        low, high = activation * transcoders.w_dec[0][0][f], activation * transcoders.w_dec[0][1][f]
        through = low.clone()
        for h in range(2):
            through += attn[h, last, last] * scale1[last] * ((low @ centre * gamma1) @ w_v[h] @ w_o[h])
        expected = float((through + high) @ read)
        got = float(graph.adjacency[logit, node])
        assert abs(got - expected) < 1e-11 * max(1.0, abs(expected)), (got, expected)
        checked += 1
    assert checked >= 1


# ------------------------------------------------------------------------------------------------
# Labels


@pytest.mark.parametrize("cross_layer", [False, True])
def test_a_layer_with_no_feature_open_is_searched_and_walked(cross_layer):
    """Layer 0's features closed at every token (thresholds above every pre-activation): its MLP is a
    sublayer of no steps (only its bias and error sources); the certified search on every bound is
    still the enumeration's top."""
    model = gpt2(layers=3, heads=2, width=8).eval()
    transcoders = clt_for(model, features=4) if cross_layer else random_transcoders(3, 8, 4, skip=False)
    transcoders.threshold[0] = torch.full_like(transcoders.threshold[0], 1e9)
    ids = torch.randint(0, 50, (1, 4))
    stack, capture = capture_huggingface_residual(model, input_ids=ids, transcoders=transcoders)
    assert capture.transcoders.layers[0].features.numel() == 0
    readout = pk.logit(model, 2)
    values = pk.path_attribution(stack, readout, top_k=0).attribution[:, 0, 0]
    for bound in ("node", "chain", "first_head", "plain"):
        top = pk.top_paths(stack, readout, top_k=4, bound=bound)
        assert top.certified and torch.allclose(top.values, values.topk(4).values, rtol=1e-10, atol=1e-13)


def test_the_labels_name_where_a_cross_layer_feature_reads_and_writes():
    model, _, _, stack, capture = tiny_clt()
    replaced = capture.transcoders
    stride = replaced.stride
    assert replaced.step_label(3 + 2, 2 * stride + 1) == "L0 F1→L2"
    assert replaced.step_label(3 + 1, 1) == "L1 F1"
    assert replaced.decode(3 + 2, stride + 3) == (1, 2, 3)
    path = torch.full((6,), -1)
    path[0], path[5] = 1, 2 * stride + 3
    assert describe_path(path, "embedding", replaced) == "L0H1 → L0 F3→L2 from embedding"


def test_a_feature_causal_check_reads_a_cross_layer_step_where_it_reads():
    """side="feature" at layer 0 takes a path through layer 0's feature f given either way: f in
    layer 0's column, or f written into layer 1 (``stride + f`` in layer 1's column). Both remove
    the same part below the feature: the same changes."""
    model = gpt2(layers=2, heads=2, width=16).eval()
    transcoders = clt_for(model, features=8)
    for _ in range(100):  # redrawn until a layer-0 feature is open at the last token
        ids = torch.randint(0, 50, (1, 5))
        stack, capture = capture_huggingface_residual(model, input_ids=ids, transcoders=transcoders)
        replaced = capture.transcoders.layers[0]
        if bool(replaced.gates[0, 4].any()):
            break
    feature = int(replaced.features[replaced.gates[0, 4].bool()][0])
    own, written = torch.full((2, 4), -1), torch.full((2, 4), -1)
    own[:, 2], written[:, 3] = feature, capture.transcoders.stride + feature
    own[1, 0] = written[1, 0] = 1  # and through L0H1 below it
    checks = [
        pk.causal_check(model, stack, {"input_ids": ids}, paths, [0, 0], side="feature", layer=0, token=4,
                        readout=pk.logit(model, 3))
        for paths in (own, written)
    ]  # fmt: skip
    assert checks[0].features.tolist() == checks[1].features.tolist() == [feature, feature]
    assert torch.equal(checks[0].activation_change, checks[1].activation_change)
    assert torch.equal(checks[0].readout_change, checks[1].readout_change)
    assert float(checks[0].activation_change.abs().max()) > 0
