"""Paths through the features of parallel blocks (GPT-J, Phi, parallel GPT-NeoX, Falcon): the MLP
reads the block's input beside the attention, so a path through a feature of layer l takes no head
of layer l and no source entering between (the attention's constant rows). The frozen model reads
its steps below the attention (a jump of the readout trie). Checked against the model run with
each MLP replaced by the set's own forward plus the capture's error, the model's own logits, the
terms written from the weights on a GPT-J, enumeration for the certified search, the graph's rows
and edges, and the causal check's rerun of the model.

Models are built from configs in float64 with random biases and norm parameters; the transcoder
sets are random, drawn afresh each run."""

from __future__ import annotations

import pytest
import torch
from float64_reference import float64_steps, logits_in_float64
from test_attribution_graph import check_edges_are_their_chains
from test_model_families import family_model
from test_transcoder_paths import relative, replaced_logits, transcoders_for

import pathkernels as pk
from pathkernels.adapters.residual import capture_huggingface_residual

PARALLEL = ["gptj", "phi", "gpt_neox", "falcon", "falcon-grouped"]


def captured(name: str, features: int = 6, tokens: int = 5, **options):
    state = torch.random.get_rng_state()
    model = family_model(name)  # (made at a fixed seed: the set and the tokens are drawn from the test's)
    torch.random.set_rng_state(state)
    transcoders = transcoders_for(model, features=features, **options)
    ids = torch.randint(0, 50, (1, tokens))
    stack, capture = capture_huggingface_residual(model, input_ids=ids, transcoders=transcoders)
    return model, transcoders, ids, stack, capture


@pytest.mark.parametrize("name", PARALLEL)
@pytest.mark.parametrize("skip", [False, True])
def test_a_parallel_block_replaced_plus_the_error_is_the_model_and_the_sum_of_its_paths(name, skip):
    """The model with each MLP replaced by the set's own forward on its own input plus the error
    gives its logits; every path, + the constant, sums to the model's logit; the capture knows its
    MLPs read beside the attention."""
    model, transcoders, ids, stack, capture = captured(name, skip=skip)
    assert capture.transcoders.parallel
    with float64_steps(model):
        own = model(ids).logits
        assert relative(replaced_logits(model, ids, transcoders, capture), own) < 1e-10
    everything = pk.path_attribution(stack, pk.logit(model, 11), top_k=2)
    value = float(logits_in_float64(model, input_ids=ids)[0, -1, 11])
    total = float(everything.by_source_length.sum() + everything.constant[0, 0])
    assert abs(total - value) < 1e-12 * max(1.0, abs(value)), (total, value)
    assert int(everything.counts.sum()) == int(everything.paths.shape[0])
    layers = stack.num_layers
    for path in everything.paths:  # no path takes a head and a step of the same block
        for layer in range(layers):
            assert path[layer] == -1 or path[layers + layer] == -1


def test_every_path_of_a_parallel_gptj_is_its_literal_term():
    """A 2-layer GPT-J with a transcoder on each block, every path's term written from the weights:
    a block maps its input x to ``x + Σ_h A_h (D x C Γ) W_V,h W_O,h + Σ_f diag(g_f D) (x C Γ) enc_f
    d_fᵀ`` (one LayerNorm before both, rotary queries and keys only in A); the paths are the
    products of one of those terms per block."""
    model, transcoders, ids, stack, capture = captured("gptj", features=5, tokens=4)
    layers, heads, d = stack.num_layers, stack.num_heads, stack.d_model
    centre = torch.eye(d, dtype=torch.float64) - 1.0 / d
    attn = capture.patterns(stack.attn, 0)

    def normed(layer, x):
        gamma = model.transformer.h[layer].ln_1.weight.detach().double()
        return capture.norm_scale[0, layer, 0][:, None] * (x @ centre) * gamma

    blocks = []  # per layer: (label, map) for every branch of the block
    for layer in range(layers):
        attention = model.transformer.h[layer].attn
        w_v = attention.v_proj.weight.detach().double().T.reshape(d, heads, -1).permute(1, 0, 2)
        w_o = attention.out_proj.weight.detach().double().T.reshape(heads, -1, d)
        branches = [(f"L{layer}H{h}", lambda x, layer=layer, h=h, w_v=w_v, w_o=w_o:
                     attn[layer, h] @ normed(layer, x) @ w_v[h] @ w_o[h]) for h in range(heads)]  # fmt: skip
        replaced = capture.transcoders.layers[layer]
        for index, feature in enumerate(replaced.features.tolist()):
            gate = replaced.gates[0, :, index]
            if not bool(gate.any()):
                continue
            enc, dec = transcoders.w_enc[layer][:, feature], transcoders.w_dec[layer][layer][feature]
            branches.append((f"L{layer} F{feature}", lambda x, layer=layer, gate=gate, enc=enc, dec=dec:
                             (gate * (normed(layer, x) @ enc))[:, None] * dec[None, :]))  # fmt: skip
        blocks.append(branches)
    final = model.transformer.ln_f.weight.detach().double()
    u = centre @ (final * model.lm_head.weight[7].detach().double())
    names = capture.transcoders  # the sources as the capture names them: rows from the capture
    result = pk.path_attribution(stack, pk.logit(model, 7), top_k=1)
    mine = {result.describe(p, s): float(v) for p, s, v in zip(result.paths, result.path_sources,
                                                                 result.attribution[:, 0, 0])}  # fmt: skip
    assert names is not None
    from pathkernels.analysis.readout_trie import frozen_model

    frozen = frozen_model(stack, capture, 0, torch.ones(4, dtype=torch.bool))
    entering = {}  # each source's rows and the first block it passes
    for level, name in enumerate(frozen.source_names):
        layer = int(name.split()[0][1:]) if name.startswith("L") else -1
        entering[name] = (frozen.sources[level], layer + 1)
    literal = {}

    def walk(name, term, layer, labels):
        if layer == layers:
            label = f"{' → '.join(labels)} from {name}" if labels else f"{name} (direct)"
            literal[label] = literal.get(label, 0.0) + float(capture.final_scale[0, -1] * (term[-1] @ u))
            return
        walk(name, term, layer + 1, labels)
        for label, step in blocks[layer]:
            walk(name, step(term), layer + 1, [*labels, label])

    for name, (rows, first) in entering.items():
        walk(name, rows, first, [])
    assert set(mine) == set(literal)
    scale = max(abs(v) for v in literal.values())
    assert max(abs(mine[k] - literal[k]) for k in literal) < 1e-11 * scale


@pytest.mark.parametrize("bound", ["chain", "first_head", "plain"])
def test_the_top_paths_of_parallel_blocks_are_those_of_enumeration(bound):
    model, _, _, stack, _ = captured("phi", features=6, skip=True)
    readout = pk.logit(model, 9)
    values = pk.path_attribution(stack, readout, top_k=0).attribution[:, 0, 0]
    for largest in (True, False):
        top = pk.top_paths(stack, readout, top_k=8, bound=bound, largest=largest)
        assert top.certified
        assert torch.allclose(top.values, values.topk(8, largest=largest).values, rtol=1e-10, atol=1e-13)


def test_the_terms_of_parallel_paths_sum_to_the_stream_and_a_head_beside_a_step_is_refused():
    """pk.path_terms of every path sum to the stream; a path that takes a head and a step of one
    block, or a step from the attention's constant rows, is refused by name; pk.decompose lists the
    same paths."""
    model, _, _, stack, capture = captured("gptj", features=4, skip=True)
    result = pk.path_attribution(stack, pk.logit(model, 5), top_k=1)
    terms = pk.path_terms(stack, result.paths, result.path_sources)
    assert relative(terms.sum(0), capture.residual[0]) < 1e-12
    layers = stack.num_layers
    step = next(i for i, p in enumerate(result.paths) if p[layers + 1] >= 0 and int(result.path_sources[i]) == 0)
    beside = result.paths[step].clone()
    beside[1] = 0  # a head of block 1 beside its MLP's step
    with pytest.raises(ValueError, match="and a step between where it reads and where it writes"):
        pk.path_terms(stack, beside, [0])
    alone = torch.full_like(beside, -1)
    alone[layers + 1] = result.paths[step][layers + 1]
    with pytest.raises(ValueError, match="takes a step that reads below its source"):
        pk.path_terms(stack, alone, ["L1 attention bias"])
    exact = pk.decompose(stack)
    listed = {(int(s), tuple(p.tolist())) for p, s in zip(exact.paths, exact.sources)}
    assert listed == {(int(s), tuple(p.tolist())) for p, s in zip(result.paths, result.path_sources)}


@pytest.mark.parametrize("name", ["gptj", "falcon"])
def test_a_parallel_graphs_rows_and_edges_are_exact(name):
    """Rows plus constants are the nodes' values (a feature reads its block's input), and every
    edge is the sum of its chains (a skip map's steps read below the attention too)."""
    model, _, _, stack, _ = captured(name, features=5, skip=True)
    graph = pk.attribution_graph(stack)
    kinds = pk.AttributionGraph.KINDS
    targets = (graph.kinds == kinds.index("feature")) | (graph.kinds == kinds.index("logit"))
    total = graph.adjacency.sum(1) + graph.constant
    assert float((total - graph.values)[targets].abs().max()) < 1e-12 * float(graph.values[targets].abs().max())
    assert check_edges_are_their_chains(graph, limit=150) > 0


def test_a_path_into_a_parallel_feature_removed_is_the_models_own_rerun():
    """side="feature" in a GPT-J: the activation change is the set's own encoding of the block's
    LayerNorm on the block's input less the path's term; the readout change the model's own rerun
    with the change times the decoder row added to the MLP's output by a hook of the test's."""
    for _ in range(50):
        model, transcoders, ids, stack, capture = captured("gptj", features=8, tokens=6)
        replaced = capture.transcoders.layers[1]
        if bool(replaced.gates[0, 5].any()):
            break
    feature = int(replaced.features[replaced.gates[0, 5].bool()][0])
    layers = stack.num_layers
    paths = torch.full((2, 2 * layers), -1)
    paths[:, layers + 1] = feature
    paths[1, 0] = 1  # through L0H1 below it
    check = pk.causal_check(model, stack, {"input_ids": ids}, paths, [0, 0], side="feature", layer=1, token=5,
                            readout=pk.logit(model, 3))  # fmt: skip
    below = paths.clone()
    below[:, layers + 1] = -1
    terms = pk.path_terms(stack, below, [0, 0], tokens=[5])[:, 0]
    block = model.transformer.h[1]
    seen = []
    handle = block.ln_1.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    with torch.no_grad(), float64_steps(model):
        model(ids)
    handle.remove()
    stream = seen[0][0, 5].double()
    with torch.no_grad():
        clean = transcoders.encode(1, block.ln_1(stream[None]))[0, feature]
        moved = transcoders.encode(1, block.ln_1(stream[None] - terms))[:, feature]
    assert relative(check.activation_change, moved - clean) < 1e-9
    readouts = []
    for change in (moved - clean).tolist():

        def add(module, args, output, change=change):
            output = output.clone()
            output[0, 5] += change * transcoders.w_dec[1][1][feature]
            return output

        with torch.no_grad(), float64_steps(model):
            clean_logit = float(model(ids).logits[0, -1, 3])
            handle = block.mlp.register_forward_hook(add)
            readouts.append(float(model(ids).logits[0, -1, 3]) - clean_logit)
            handle.remove()
    assert relative(check.readout_change, torch.tensor(readouts, dtype=torch.float64)) < 1e-9
    with pytest.raises(ValueError, match="takes layer 1's step written at layer 1 and a step between"):
        beside = paths[:1].clone()
        beside[0, 1] = 0  # a head of block 1: beside the MLP, not below it
        pk.causal_check(model, stack, {"input_ids": ids}, beside, [0], side="feature", layer=1, token=5)


@pytest.mark.parametrize("input_hook", ["mlp_input_before_gain", "resid_mid"])
@pytest.mark.parametrize("cross_layer", [False, True])
def test_a_transformer_lens_model_with_parallel_blocks_is_the_sum_of_its_paths(input_hook, cross_layer):
    """TransformerLens's ``parallel_attn_mlp``: in 3.x the MLP reads ``ln2`` of the block's input (4.x's
    HookedTransformer runs such blocks sequentially, and the capture reads them so); the model with
    each MLP replaced by the set's own forward on what it reads plus the error is the model, and the
    paths sum to its logit."""
    pytest.importorskip("transformer_lens")
    from test_transcoder_paths import tl_model_with_mlps, tl_replaced_logits

    from pathkernels.adapters.transcoders import random_transcoders

    model = tl_model_with_mlps("LN", parallel_attn_mlp=True)
    transcoders = random_transcoders(3, 32, 8, input_hook=input_hook, cross_layer=cross_layer, skip=True)
    tokens = torch.randint(0, 50, (1, 6))
    stack, capture = pk.adapters.capture_transformer_lens_residual(model, tokens, transcoders=transcoders)
    with torch.no_grad():  # (3.x runs the flag's blocks in parallel; 4.x's HookedTransformer, sequentially)
        parallel = "blocks.0.hook_resid_mid" not in model.run_with_cache(tokens)[1]
    assert capture.transcoders.parallel == parallel
    logits = model(tokens).detach()
    if not cross_layer:
        stream = "hook_resid_pre" if parallel else "hook_resid_mid"
        hook = stream if input_hook == "resid_mid" else "ln2.hook_normalized"
        assert relative(tl_replaced_logits(model, tokens, transcoders, capture, hook), logits) < 1e-10
    result = pk.path_attribution(stack, pk.logit(model, 5), top_k=3)
    assert abs(float(result.value[0, 0]) - float(logits[0, -1, 5])) < 1e-10 * float(logits[0, -1].abs().max())
    total = float(result.by_source_length.sum() + result.constant[0, 0])
    assert abs(total - float(logits[0, -1, 5])) < 1e-10 * float(logits[0, -1].abs().max())


def test_transformer_lens_parallel_blocks_from_a_full_cache_and_models_without_norms():
    """3.x's ``parallel_attn_mlp`` captured from the user's own full cache (its blocks fire no
    ``hook_resid_mid``) equals the capture from the tokens; a model without norms reads each MLP's
    input as the stream; a bridge whose blocks share one norm (over Phi) is refused by name."""
    pytest.importorskip("transformer_lens")
    from test_transcoder_paths import tl_model_with_mlps

    from pathkernels.adapters.transcoders import random_transcoders

    transcoders = random_transcoders(3, 32, 8, input_hook="resid_mid", skip=True)
    tokens = torch.randint(0, 50, (1, 6))
    for normalization_type, parallel in (("LN", True), (None, False), (None, True)):
        model = tl_model_with_mlps(normalization_type, parallel_attn_mlp=parallel)
        stack, _ = pk.adapters.capture_transformer_lens_residual(model, tokens, transcoders=transcoders)
        with torch.no_grad():
            _, cache = model.run_with_cache(tokens)
            logits = model(tokens)
        again, _ = pk.adapters.capture_transformer_lens_residual(model, cache, transcoders=transcoders)
        readout = pk.logit(model, 5)
        first, second = pk.path_attribution(stack, readout, top_k=2), pk.path_attribution(again, readout, top_k=2)
        assert torch.equal(first.by_source_length, second.by_source_length)
        total = float(first.by_source_length.sum() + first.constant[0, 0])
        assert abs(total - float(logits[0, -1, 5])) < 1e-10 * float(logits[0, -1].abs().max())


def test_a_bridge_whose_blocks_share_one_norm_is_refused_with_transcoders(tmp_path):
    pytest.importorskip("transformer_lens")
    from test_adapters import bridge_over

    model = family_model("phi")
    bridge = bridge_over(model, tmp_path, dtype=torch.float64)
    transcoders = transcoders_for(model, features=4)
    with pytest.raises(ValueError, match="blocks read one norm before both the attention and the MLP"):
        pk.adapters.capture_transformer_lens_residual(bridge, torch.randint(0, 40, (1, 5)), transcoders=transcoders)
