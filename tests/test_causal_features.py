"""The causal check of paths into transcoder features (``pk.causal_check(..., side="feature")``).

Each claim against a reference that shares no code with the check:

- the activation change is the set's own encoding (``TranscoderSet.encode``) of the model's own
  norm module applied to the stream entering the MLP less the path's term (``pk.path_terms``),
  less its encoding of the clean stream; the readout change is the model's own forward with that
  change times the feature's decoder row added to its MLP's output by a hook written here;
- held at the clean norm (``frozen=True``), the pre-activation moves by the prediction, written
  here from the norm's formula and the encoder;
- the frozen readout prediction is the sum of the attributions of every path that passes the
  feature after the removed part (a feature open at that token alone);
- paths through features read out as their attributions (``side="readout"``);
- what does not fit is refused by name.

Models are built from configs in float64 with random biases and norm parameters; the transcoder
sets are random, drawn afresh each run.
"""

import functools
import warnings

import pytest
import torch
from float64_reference import float64_steps
from test_model_families import family_model, uncapped
from test_real_models import gpt2, llama
from test_transcoder_paths import own_mlp_inputs, transcoders_for

import pathkernels as pk
from pathkernels.adapters.residual import _blocks, _layout, capture_huggingface_residual

transformers = pytest.importorskip("transformers")

FAMILIES = {
    "gpt2": lambda: gpt2(layers=2, heads=2, width=16).eval(),
    "llama": lambda: llama(layers=2, heads=4, kv_heads=2, width=16).eval(),
    "gemma2": lambda: uncapped(family_model("gemma2")),
}


def relative(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def drawn(make, layer: int, token: int, **options):
    """``(model, transcoders, ids, stack)``: a model, a random set and 6 random tokens, drawn again
    (up to 30 times) until a feature of layer ``layer`` is open at ``token``."""
    model = make()  # (once: the family's model is made at a fixed seed, which would repeat every draw)
    for _ in range(30):
        transcoders = transcoders_for(model, features=12, **options)
        ids = torch.randint(0, 50, (1, 6))
        stack, _ = capture_huggingface_residual(model, input_ids=ids, transcoders=transcoders)
        if bool(stack.residual_capture.transcoders.layers[layer].gates[0, token].any()):
            break
    return model, transcoders, ids, stack


def open_feature_paths(stack, layer: int, token: int, count: int = 3):
    """Up to ``count`` paths ``([M, 2L], sources)`` that pass a feature of layer ``layer`` open at
    ``token`` and end there, the largest of them into a random readout."""
    capture = stack.residual_capture
    replaced = capture.transcoders.layers[layer]
    open_here = replaced.features[replaced.gates[0, token].bool().cpu()].tolist()
    columns = capture.transcoders.num_layers
    result = pk.path_attribution(stack, torch.randn(stack.d_model, dtype=torch.float64), positions=token)
    chosen = []
    order = result.attribution[:, 0, 0].abs().argsort(descending=True)  # the largest first: no zero source
    for path, source in zip(result.paths[order], result.path_sources[order]):
        later = [c for c in range(columns) if c > layer] + [columns + c for c in range(columns) if c > layer]
        if int(path[columns + layer]) in open_here and bool((path[later] == -1).all()):
            chosen.append((path, int(source)))
        if len(chosen) == count:
            break
    assert chosen, "no path into an open feature: draw again"
    return torch.stack([p for p, _ in chosen]), [s for _, s in chosen]


def reference_change(model, ids, transcoders, stack, paths, sources, layer, token, position, token_id, output_hook):
    """``(activation change [M], readout change [M])`` of each path's part below its feature removed
    from that feature's input at ``token``: the model's own norm on the stream less the term, the
    set's own encoding, and the model rerun with the change written by a hook of its own."""
    columns = stack.num_layers
    below = paths.clone()
    features = below[:, columns + layer].clone()
    below[:, columns + layer] = -1
    terms = pk.path_terms(stack, below, sources, tokens=[token])[:, 0]  # [M, d]
    spec = _layout(model)
    block = _blocks(model, *spec.blocks)[layer]
    norm = spec.norms(block)[1]
    seen = []
    handle = norm.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    try:
        with torch.no_grad(), float64_steps(model):  # the model's steps in float64, as the capture runs them
            model(ids)
    finally:
        handle.remove()
    stream = seen[0][0, token].double()
    with torch.no_grad(), float64_steps(model):
        clean = transcoders.encode(layer, norm(stream[None]))[0]
        moved = transcoders.encode(layer, norm(stream[None] - terms))
    changes = moved[torch.arange(len(features)), features] - clean[features]
    readouts = []
    blocks = _blocks(model, *spec.blocks)
    write_to = {  # each layer the feature writes into (a cross-layer set's: this one and every later one)
        target: blocks[target].mlp
        if output_hook == "mlp_module_output" or spec.output_norms is None
        else blocks[target].post_feedforward_layernorm
        for target in transcoders.w_dec[layer]
    }
    for change, feature in zip(changes.tolist(), features.tolist()):

        def add(module, args, output, change=change, feature=feature, target=layer):
            output = output.clone()
            output[0, token] += change * transcoders.w_dec[layer][target][feature].to(output.dtype)
            return output

        values = []
        for write in (False, True):
            with torch.no_grad(), float64_steps(model):  # its norm hooks first, then the write on their output
                handles = [
                    module.register_forward_hook(functools.partial(add, target=target))
                    for target, module in (write_to.items() if write else [])
                ]
                try:
                    values.append(float(model(ids).logits[0, position, token_id]))
                finally:
                    for handle in handles:
                        handle.remove()
        readouts.append(values[1] - values[0])
    return changes, torch.tensor(readouts, dtype=torch.float64)


@pytest.mark.parametrize(
    "name, options",
    [
        ("gpt2", {"activation": "jumprelu"}),
        ("gpt2", {"activation": "relu", "input_normalization": "constant_norm_rescale", "skip": True}),
        ("llama", {"activation": "jumprelu", "skip": True}),
        ("gemma2", {"activation": "relu", "output_hook": "mlp_module_output"}),
        ("gemma2", {"activation": "jumprelu"}),
        ("gpt2", {"activation": "jumprelu", "cross_layer": True}),
        ("gemma2", {"activation": "relu", "output_hook": "mlp_module_output", "cross_layer": True}),
    ],
    ids=[
        "gpt2-jumprelu",
        "gpt2-relu-rescaled-skip",
        "llama-jumprelu-skip",
        "gemma2-module-output",
        "gemma2-jumprelu",
        "gpt2-cross-layer",
        "gemma2-cross-layer-module-output",
    ],
)
def test_a_path_removed_where_it_enters_a_feature_is_the_models_own_rerun(name, options):
    """The activation and readout changes equal the set's own encoding and the model's own forward
    with the change written by a hook of the test's (norms and patterns recomputed)."""
    token, position, layer = 3, 5, 0
    if options.get("cross_layer"):  # read where the write into the last layer lands (no attention above it)
        position = token
    model, transcoders, ids, stack = drawn(FAMILIES[name], layer, token, **options)
    paths, sources = open_feature_paths(stack, layer, token)
    token_id = 7
    check = pk.causal_check(
        model,
        stack,
        {"input_ids": ids},
        paths,
        sources,
        side="feature",
        layer=layer,
        token=token,
        readout=pk.logit(model, token_id),
        position=position,
    )
    changes, readouts = reference_change(
        model, ids, transcoders, stack, paths, sources, layer, token, position, token_id,
        options.get("output_hook", "mlp_output"),
    )  # fmt: skip
    assert check.features.tolist() == paths[:, stack.num_layers + layer].tolist()
    assert relative(check.activation_change, changes) < 1e-9
    assert relative(check.readout_change, readouts) < 1e-9
    assert check.token == token and check.position == position
    frame = check.to_frame()
    assert list(frame["feature"]) == check.features.tolist() and "readout change" in frame


def test_held_at_the_clean_norm_the_preactivation_moves_by_the_prediction():
    """``frozen=True``: the pre-activation's change is ``−(Y − mean Y)/σ γ · enc_f``, the clean
    LayerNorm's scale held, written here; the activation's prediction passes the gate (1: open)."""
    token, layer = 4, 1
    model, transcoders, ids, stack = drawn(
        lambda: gpt2(layers=2, heads=2, width=16).eval(), layer, token, activation="relu"
    )
    paths, sources = open_feature_paths(stack, layer, token)
    check = pk.causal_check(
        model, stack, {"input_ids": ids}, paths, sources, side="feature", layer=layer, token=token, frozen=True
    )
    below = paths.clone()
    features = below[:, stack.num_layers + layer].clone()
    below[:, stack.num_layers + layer] = -1
    terms = pk.path_terms(stack, below, sources, tokens=[token])[:, 0]
    seen, _ = own_mlp_inputs(model, ids)
    stream = seen["stream"][layer][0, token].double()
    norm = model.transformer.h[layer].ln_2
    sigma = (stream.var(unbiased=False) + norm.eps).sqrt()
    normed = (terms - terms.mean(-1, keepdim=True)) / sigma * norm.weight.detach().double()
    expected = -(normed * transcoders.w_enc[layer][:, features].T.double()).sum(-1)
    assert relative(check.predicted, expected) < 1e-10
    assert relative(check.preactivation_change, expected) < 1e-10
    assert torch.equal(check.predicted_activation, check.predicted)  # every chosen feature is open there
    assert check.readout_change is None and check.predicted_readout is None
    # A feature closed at the token: its pre-activation moves, its frozen activation does not.
    replaced = stack.residual_capture.transcoders.layers[layer]
    closed = replaced.features[~replaced.gates[0, token].bool()]
    if closed.numel():
        shut = pk.causal_check(
            model,
            stack,
            {"input_ids": ids},
            below[:1],
            sources[:1],
            side="feature",
            layer=layer,
            feature=int(closed[0]),
            token=token,
            readout=pk.logit(model, 2),
        )
        assert float(shut.predicted.abs()) > 0
        assert float(shut.predicted_activation.abs()) == 0 and float(shut.predicted_readout.abs()) == 0
    # A feature open nowhere in the sequence (no step of the capture): its pre-activation moves by the
    # prediction all the same, and its frozen activation does not move.
    never = sorted(set(range(12)) - set(replaced.features.tolist()))
    if never:
        idle = pk.causal_check(
            model,
            stack,
            {"input_ids": ids},
            below,
            sources,
            side="feature",
            layer=layer,
            feature=never[0],
            token=token,
            frozen=True,
        )
        literal = -(normed * transcoders.w_enc[layer][:, never[0]].double()).sum(-1)
        assert relative(idle.predicted, literal) < 1e-10 and relative(idle.preactivation_change, literal) < 1e-10
        assert float(idle.predicted_activation.abs().max()) == 0


@pytest.mark.parametrize(
    "name, output_hook, cross_layer",
    [("gpt2", "mlp_output", False), ("gemma2", "mlp_module_output", False), ("gpt2", "mlp_output", True),
     ("gemma2", "mlp_module_output", True)],
    ids=["gpt2", "gemma2-module-output", "gpt2-cross-layer", "gemma2-cross-layer-module-output"],
)  # fmt: skip
def test_the_frozen_readout_prediction_is_the_sum_of_the_paths_through_the_feature(name, output_hook, cross_layer):
    """For a feature open at one token alone, the frozen readout prediction is ``−`` the sum of the
    attributions of every path that takes the removed part, then the feature, then anything above
    (heads and features of the next layer; a cross-layer feature's write into the next layer too):
    the feature's frozen effect, carried up (for Gemma-2's module output, through the frozen norm
    after the MLP)."""
    make = {"gpt2": lambda: gpt2(layers=2, heads=2, width=8).eval(), "gemma2": FAMILIES["gemma2"]}[name]
    model = make()  # (once: the family's model is made at a fixed seed, which would repeat every draw)
    for _ in range(100):  # a draw with a layer-0 feature open at exactly one token
        transcoders = transcoders_for(
            model, features=6, activation="relu", skip=True, output_hook=output_hook, cross_layer=cross_layer
        )
        ids = torch.randint(0, 50, (1, 4))
        stack, capture = capture_huggingface_residual(model, input_ids=ids, transcoders=transcoders)
        replaced = capture.transcoders.layers[0]
        alone = (replaced.gates[0].sum(0) == 1).nonzero().flatten()
        if cross_layer:  # open at the last token, where its write into layer 1 reaches the readout
            alone = alone[replaced.gates[0, 3, alone] == 1]
        if alone.numel():
            break
    index = int(alone[0])
    feature = int(replaced.features[index])
    token = int(replaced.gates[0, :, index].nonzero())
    token_id = 5
    result = pk.path_attribution(stack, pk.logit(model, token_id), positions=3, top_k=1)
    layers = stack.num_layers
    prefix = torch.full((2 * layers,), -1)
    prefix[0] = 1  # the removed part: L0H1 from the embedding
    through = (result.paths[:, layers] == feature) & (result.paths[:, 0] == 1) & (result.path_sources == 0)
    if cross_layer:  # layer 0's feature written into layer 1: (1 − 0) · stride + f in layer 1's column
        written = result.paths[:, layers + 1] == capture.transcoders.stride + feature
        through |= written & (result.paths[:, 0] == 1) & (result.path_sources == 0)
        assert bool(written.any())
    expected = -float(result.attribution[through, 0, 0].sum())
    path = prefix.clone()
    path[layers] = feature
    check = pk.causal_check(
        model,
        stack,
        {"input_ids": ids},
        path[None],
        [0],
        side="feature",
        layer=0,
        token=token,
        readout=pk.logit(model, token_id),
        position=3,
    )
    assert abs(float(check.predicted_readout[0]) - expected) < 1e-10 * max(1.0, abs(expected))
    # The same with feature= and the path ending below the MLP.
    again = pk.causal_check(
        model,
        stack,
        {"input_ids": ids},
        prefix[None],
        [0],
        side="feature",
        layer=0,
        feature=feature,
        token=token,
        readout=pk.logit(model, token_id),
        position=3,
    )
    assert torch.equal(again.predicted_readout, check.predicted_readout)
    assert torch.equal(again.activation_change, check.activation_change)


def test_paths_through_features_read_out_as_their_attributions():
    """``side="readout"`` of paths through features: predictions ``−`` their attributions, labels
    through the features; the final norm recomputed."""
    model = gpt2(layers=2, heads=2, width=16).eval()
    transcoders = transcoders_for(model, features=10)
    ids = torch.randint(0, 50, (1, 5))
    stack, _ = capture_huggingface_residual(model, input_ids=ids, transcoders=transcoders)
    result = pk.top_paths(stack, pk.logit(model, 3), top_k=4)
    check = pk.causal_check(
        model, stack, {"input_ids": ids}, result.paths, result.sources, side="readout", readout=pk.logit(model, 3)
    )
    assert relative(check.predicted, -result.values) < 1e-12
    assert check.paths == list(result.to_frame()["path"])


def test_what_does_not_fit_a_feature_check_is_refused_by_name():
    model = gpt2(layers=2, heads=2, width=16).eval()
    ids = torch.randint(0, 50, (1, 5))
    transcoders = transcoders_for(model, features=12, layers=(1,))
    stack, _ = capture_huggingface_residual(model, input_ids=ids, transcoders=transcoders)
    inputs = {"input_ids": ids}
    layers = stack.num_layers
    replaced = stack.residual_capture.transcoders.layers[1]
    feature = int(replaced.features[0])
    into = torch.full((1, 2 * layers), -1)
    into[0, 1] = 0
    into[0, layers + 1] = feature
    plain, _ = capture_huggingface_residual(model, input_ids=ids)
    with pytest.raises(ValueError, match="side='feature' follows paths into transcoder features"):
        pk.causal_check(model, plain, inputs, [[-1, -1]], [0], side="feature", layer=1, feature=0)
    with pytest.raises(ValueError, match=r"expected layer to be one whose MLP the capture replaced \(\[1\]\), got 0"):
        pk.causal_check(model, stack, inputs, torch.full((1, 4), -1), [0], side="feature", layer=0, feature=0)
    with pytest.raises(ValueError, match="needs layer"):
        pk.causal_check(model, stack, inputs, into, [0], side="feature")
    with pytest.raises(ValueError, match=r"expected each path to pass a feature at layer 1's MLP \(paths\[:, 3\]"):
        pk.causal_check(model, stack, inputs, torch.full((1, 4), -1), [0], side="feature", layer=1)
    with pytest.raises(ValueError, match=r"with feature=, expected paths that end below layer 1's MLP"):
        pk.causal_check(model, stack, inputs, into, [0], side="feature", layer=1, feature=feature)
    with pytest.raises(ValueError, match="feature"):
        pk.causal_check(model, stack, inputs, torch.full((1, 4), -1), [0], side="feature", layer=1, feature=12)
    with pytest.raises(ValueError, match="expected paths that end at layer 1's MLP"):
        pk.causal_check(
            model, stack, inputs, torch.full((1, 4), -1), ["L1 MLP error"], side="feature", layer=1, feature=feature
        )
    with pytest.raises(ValueError, match="feature= and token= are for side='feature'"):
        pk.causal_check(model, stack, inputs, into, [0], side="readout", feature=3, readout=pk.logit(model, 1))
    with pytest.raises(ValueError, match="expected token to be a real token of batch element 0, got 9"):
        pk.causal_check(model, stack, inputs, into, [0], side="feature", layer=1, token=9)
    other = {"input_ids": (ids + 1) % 50}
    with pytest.raises(ValueError, match="expected the model and the inputs the stack was captured from"):
        pk.causal_check(model, stack, other, into, [0], side="feature", layer=1, token=4)


def test_a_padded_sequence_checks_as_it_does_alone():
    """The left-padded second sequence of a batch, checked at its token 4 (position 6 of the padded
    row): the same predictions and changes as the sequence captured alone, and no warning from the
    check's own rows."""
    model = gpt2(layers=2, heads=2, width=16).eval()
    transcoders = transcoders_for(model, features=24, activation="relu")
    ids = torch.randint(1, 50, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    with pytest.warns(UserWarning, match="left-padded row"):
        stack, _ = capture_huggingface_residual(model, **inputs, transcoders=transcoders)
    alone_ids = ids[1:, 2:]
    alone, _ = capture_huggingface_residual(model, input_ids=alone_ids, transcoders=transcoders)
    replaced = alone.residual_capture.transcoders.layers[1]
    open_here = replaced.features[replaced.gates[0, 4].bool()]
    if not open_here.numel():
        pytest.skip("no layer-1 feature open at the token in this draw")
    path = torch.full((1, 4), -1)
    path[0, 1], path[0, 3] = 0, int(open_here[0])
    options = {"side": "feature", "layer": 1, "readout": pk.logit(model, 3)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        padded = pk.causal_check(model, stack, inputs, path, [0], batch=1, token=6, position=6, **options)
    single = pk.causal_check(model, alone, {"input_ids": alone_ids}, path, [0], token=4, position=4, **options)
    for name in ("predicted", "preactivation_change", "activation_change", "predicted_readout", "readout_change"):
        a, b = getattr(padded, name), getattr(single, name)
        assert float((a - b).abs().max()) <= 1e-9 * max(1.0, float(b.abs().max())), name
