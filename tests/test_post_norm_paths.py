"""Paths through the features of post-norm models (BERT, RoBERTa, OPT-350m's layout): the MLP reads
the stream after the attention's residual norm, and every branch of a block, a feature's write
included, passes the norm after the MLP's residual sum. Checked against the model run with each
MLP replaced by the set's own forward plus the capture's error, the model's own hidden state,
every path of a BERT written from the weights, and enumeration for the certified search.

Models are built from configs in float64 with random biases and norm parameters; the transcoder
sets are random, drawn afresh each run."""

from __future__ import annotations

import functools

import pytest
import torch
from test_model_families import family_model
from test_real_models import bert
from test_transcoder_paths import relative

import pathkernels as pk
from pathkernels.adapters.residual import _blocks, _layout, capture_huggingface_residual
from pathkernels.adapters.transcoders import random_transcoders

transformers = pytest.importorskip("transformers")


def post_model(name: str):
    if name == "bert":
        return bert(layers=2, heads=2, width=16).eval()
    state = torch.random.get_rng_state()
    model = family_model("opt-post-projected")  # (made at a fixed seed: the set and tokens are the test's)
    torch.random.set_rng_state(state)
    return model


def replaced_run(model, ids, transcoders, capture):
    """The model run with each MLP branch replaced by the set's own forward on the MLP's input (the
    output of the norm after the attention's residual sum) plus the capture's error: its last
    hidden state (BERT) or logits (OPT)."""
    spec = _layout(model)
    kept, handles = {}, []
    for layer, block in enumerate(_blocks(model, *spec.blocks)):

        def keep(module, args, output, layer=layer):
            kept[layer] = output.double()

        def replace(module, args, output, layer=layer):
            error = capture.transcoders.layers[layer].error
            return (transcoders.forward(layer, kept[layer]) + error).to(output.dtype)

        handles.append(spec.norms(block)[0].register_forward_hook(keep))
        handles.append(spec.mlp(block).register_forward_hook(replace))
    try:
        with torch.no_grad():
            out = model(ids)
    finally:
        for handle in handles:
            handle.remove()
    return getattr(out, "logits", None) if getattr(out, "logits", None) is not None else out.last_hidden_state


@pytest.mark.parametrize("name", ["bert", "opt"])
@pytest.mark.parametrize("skip", [False, True])
def test_a_post_norm_model_replaced_plus_the_error_is_the_model_and_the_sum_of_its_paths(name, skip):
    """The model with each MLP replaced by the set's own forward plus the error gives its own output;
    every path, + the constant, sums to the readout of its stream."""
    model = post_model(name)
    width = model.config.hidden_size
    transcoders = random_transcoders(model.config.num_hidden_layers, width, 6, skip=skip)
    ids = torch.randint(3, 50, (1, 5))
    stack, capture = capture_huggingface_residual(model, input_ids=ids, transcoders=transcoders)
    assert capture.layout == "post"
    assert capture.transcoders.input_error is None or capture.transcoders.input_error < 1e-12
    with torch.no_grad():
        out = model(ids)
    own = getattr(out, "logits", None) if getattr(out, "logits", None) is not None else out.last_hidden_state
    assert relative(replaced_run(model, ids, transcoders, capture), own) < 1e-10
    readout = torch.randn(width, dtype=torch.float64)
    result = pk.path_attribution(stack, readout, top_k=2)
    total = float(result.by_source_length.sum() + result.constant[0, 0])
    assert abs(total - float(result.value[0, 0])) < 1e-10 * max(1.0, abs(float(result.value[0, 0])))
    stream = capture.residual[0, -1]
    assert abs(float(result.value[0, 0]) - float(stream @ readout)) < 1e-10 * float(stream.abs().sum())
    terms = pk.path_terms(stack, result.paths, result.path_sources)
    assert relative(terms.sum(0), capture.residual[0]) < 1e-12


def test_every_path_of_a_post_norm_bert_with_transcoders_is_its_literal_term():
    """A 2-layer BERT: a block maps x to ``N₂(y + Σ_f diag(g_f)(y enc_f) d_fᵀ + bias + E)`` with
    ``y = N₁(x + Σ_h A_h x W_V,h W_O,h + …)``, N a frozen LayerNorm ``D (· C) Γ`` (β to the constant
    sources); every path is the product of one branch per sublayer, written here from the weights."""
    model = post_model("bert")
    transcoders = random_transcoders(2, 16, 4)
    ids = torch.randint(3, 50, (1, 4))
    stack, capture = capture_huggingface_residual(model, input_ids=ids, transcoders=transcoders)
    centre = torch.eye(16, dtype=torch.float64) - 1.0 / 16
    attn = capture.patterns(stack.attn, 0)
    spec = _layout(model)
    kept = {}
    handles = [spec.norms(block)[0].register_forward_hook(lambda m, a, o, layer=layer: kept.__setitem__(layer, o))
               for layer, block in enumerate(_blocks(model, *spec.blocks))]  # fmt: skip
    with torch.no_grad():
        model(ids)
    for handle in handles:
        handle.remove()

    def normed(layer, which, x):  # D (x C) Γ, no β
        return capture.norm_scale[0, layer, which][:, None] * (x @ centre) * capture.norm_weight[layer, which]

    sublayers = []  # bottom up: [(label or None, map)] per sublayer, the skip first
    for layer in range(2):
        attention = model.encoder.layer[layer].attention.self
        w_v = attention.value.weight.detach().double().T.reshape(16, 2, 8).permute(1, 0, 2)
        w_o = model.encoder.layer[layer].attention.output.dense.weight.detach().double().T.reshape(2, 8, 16)
        branches = [(None, functools.partial(normed, layer, 0))]
        branches += [(f"L{layer}H{h}", lambda x, layer=layer, h=h, w_v=w_v, w_o=w_o:
                      normed(layer, 0, attn[layer, h] @ x @ w_v[h] @ w_o[h])) for h in range(2)]  # fmt: skip
        sublayers.append(branches)
        gates = (transcoders.encode(layer, kept[layer][0].double()) != 0).double()
        steps = [(None, functools.partial(normed, layer, 1))]
        for f in gates.any(0).nonzero().flatten().tolist():
            enc, dec = transcoders.w_enc[layer][:, f], transcoders.w_dec[layer][layer][f]
            steps.append((f"L{layer} F{f}", lambda x, layer=layer, gate=gates[:, f], enc=enc, dec=dec:
                          normed(layer, 1, (gate * (x @ enc))[:, None] * dec[None, :])))  # fmt: skip
        sublayers.append(steps)
    readout = torch.randn(16, dtype=torch.float64)
    result = pk.path_attribution(stack, readout, top_k=1)
    mine = {result.describe(p, s): float(v) for p, s, v in zip(result.paths, result.path_sources,
                                                                 result.attribution[:, 0, 0])}  # fmt: skip
    from pathkernels.analysis.readout_trie import frozen_model

    frozen = frozen_model(stack, capture, 0, torch.ones(4, dtype=torch.bool))
    first = {"embedding": 0}  # the sublayer each source passes first
    for layer in range(2):
        first |= {f"L{layer} attention bias": 2 * layer + 1, f"L{layer} transcoder bias": 2 * layer + 2,
                  f"L{layer} MLP error": 2 * layer + 2}  # fmt: skip
    literal = {}

    def walk(name, term, index, labels):
        if index == len(sublayers):
            label = f"{' → '.join(labels)} from {name}" if labels else f"{name} (direct)"
            literal[label] = literal.get(label, 0.0) + float(term[-1] @ readout)
            return
        for label, step in sublayers[index]:
            walk(name, step(term), index + 1, labels if label is None else [*labels, label])

    for level, name in enumerate(frozen.source_names):
        walk(name, frozen.sources[level], first[name], [])
    assert set(mine) == set(literal)
    scale = max(abs(v) for v in literal.values())
    assert max(abs(mine[k] - literal[k]) for k in literal) < 1e-11 * scale


def test_the_top_paths_and_the_decomposition_of_a_post_norm_model_through_features():
    model = post_model("opt")
    transcoders = random_transcoders(model.config.num_hidden_layers, model.config.hidden_size, 5, skip=True)
    stack, _ = capture_huggingface_residual(model, input_ids=torch.randint(3, 50, (1, 4)), transcoders=transcoders)
    readout = pk.logit(model, 7)
    every = pk.path_attribution(stack, readout, top_k=0)
    values = every.attribution[:, 0, 0]
    for largest in (True, False):
        top = pk.top_paths(stack, readout, top_k=6, largest=largest)
        assert top.certified
        assert torch.allclose(top.values, values.topk(6, largest=largest).values, rtol=1e-10, atol=1e-13)
    exact = pk.decompose(stack)
    listed = {(int(s), tuple(p.tolist())) for p, s in zip(exact.paths, exact.sources)}
    assert listed == {(int(s), tuple(p.tolist())) for p, s in zip(every.paths, every.path_sources)}


def test_what_a_post_norm_capture_with_transcoders_does_not_do_is_refused_by_name():
    model = post_model("bert")
    ids = torch.randint(3, 50, (1, 4))
    with pytest.raises(ValueError, match="cross-layer set on a post-norm model"):
        capture_huggingface_residual(model, input_ids=ids, transcoders=random_transcoders(2, 16, 4, cross_layer=True))
    with pytest.raises(ValueError, match="'mlp_input_before_gain'.* has no norm before its MLP"):
        before_gain = random_transcoders(2, 16, 4, input_hook="mlp_input_before_gain")
        capture_huggingface_residual(model, input_ids=ids, transcoders=before_gain)
    stack, _ = capture_huggingface_residual(model, input_ids=ids, transcoders=random_transcoders(2, 16, 4))
    with pytest.raises(ValueError, match="the graph of a post-norm model"):
        pk.attribution_graph(stack)
    with pytest.raises(ValueError, match="side='feature' of a post-norm model"):
        pk.causal_check(model, stack, {"input_ids": ids}, [[-1, -1, 0, -1]], [0], side="feature", layer=1, token=3)
