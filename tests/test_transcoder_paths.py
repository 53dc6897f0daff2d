"""Paths through transcoder features: a capture whose MLPs are replaced by a transcoder set, frozen.

Each claim against a reference that shares no code with the replacement:

- the model run with each MLP replaced by its transcoder (the set's own forward on the MLP's
  input, as the model computes it) plus the capture's error reproduces the model's logits;
- the capture's activations are the set's own encoding of the model's MLP input (so its gates and
  thresholds are the format's);
- every path's attribution equals its term written literally from the weights (heads, norms,
  features, the skip map as one matrix), on a model small enough to list every path;
- the paths sum to the model's own logit in every sequential pre-norm family;
- the certified search finds the top paths of the enumeration;
- a padded batch reads as each sequence alone; what is not read yet is refused by name.

Models are built from configs in float64 with random biases and norm parameters; the transcoder
sets are random (:func:`pathkernels.testing.random_transcoders`), drawn afresh each run.
"""

import functools
import itertools
import re

import pytest
import torch
from float64_reference import float64_steps, logits_in_float64
from test_model_families import FAMILIES, family_model, uncapped
from test_real_models import gpt2, llama

import pathkernels as pk
from pathkernels.adapters.residual import _blocks, _layout, capture_huggingface_residual
from pathkernels.adapters.transcoders import random_transcoders
from pathkernels.testing import transformer_lens_major

transformers = pytest.importorskip("transformers")


def width(model) -> int:
    return model.config.get_text_config().hidden_size


def layers_of(model) -> int:
    return model.config.get_text_config().num_hidden_layers


def transcoders_for(model, features: int = 12, **options):
    return random_transcoders(layers_of(model), width(model), features, **options)


def own_mlp_inputs(model, ids):
    """The MLP's argument and the stream entering its norm, per layer, as the model computes them."""
    spec = _layout(model)
    seen = {"argument": {}, "stream": {}}
    handles = []
    for layer, block in enumerate(_blocks(model, *spec.blocks)):
        mlp_norm = spec.norms(block)[1]
        mlp = spec.mlp(block)

        def argument(module, args, layer=layer):
            seen["argument"][layer] = args[0].detach()

        def stream(module, args, layer=layer):
            seen["stream"][layer] = args[0].detach()

        handles.append(mlp.register_forward_pre_hook(argument))
        handles.append((mlp_norm or mlp).register_forward_pre_hook(stream))
    try:
        with torch.no_grad():
            logits = model(ids).logits
    finally:
        for handle in handles:
            handle.remove()
    return seen, logits


def replaced_logits(model, ids, transcoders, capture, hook: str = "mlp_input"):
    """The model run with each MLP of the set's layers replaced by the set's own forward on the
    MLP's input (``hook``: its argument, the stream entering its norm, or its argument before the
    norm's gain and bias; a cross-layer set's on the inputs of every layer up to it) plus the
    capture's error."""
    spec = _layout(model)
    handles, streams, inputs = [], {}, {}
    for layer, block in enumerate(_blocks(model, *spec.blocks)):
        if layer not in transcoders.layers:
            continue
        mlp_norm, mlp = spec.norms(block)[1], spec.mlp(block)
        error = capture.transcoders.layers[layer].error

        def keep_stream(module, args, layer=layer):
            streams[layer] = args[0]

        def replace(module, args, result, layer=layer, error=error, norm=mlp_norm):
            x = streams[layer] if hook == "stream" else args[0]
            if hook == "before_gain":
                x = (x - norm.bias) / norm.weight
            inputs[layer] = x.double()  # (a cross-layer set's output at a layer reads every input up to it)
            out = transcoders.forward(layer, inputs if transcoders.cross_layer else inputs[layer])
            return (out + error).to(result.dtype)

        handles.append((mlp_norm or mlp).register_forward_pre_hook(keep_stream))
        handles.append(mlp.register_forward_hook(replace))
    try:
        with torch.no_grad():
            return model(ids).logits
    finally:
        for handle in handles:
            handle.remove()


def relative(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


# ------------------------------------------------------------------------------------------------
# The replaced model is the model


@pytest.mark.parametrize(
    "options",
    [
        {"activation": "jumprelu"},
        {"activation": "relu", "skip": True},
        {"activation": "topk", "k": 3, "rectify": True},
        {"activation": "topk", "k": 9, "input_hook": "resid_mid", "input_normalization": "constant_norm_rescale"},
        {"activation": "jumprelu", "input_normalization": "constant_norm_rescale", "skip": True},
        {"activation": "jumprelu", "input_hook": "resid_mid", "input_normalization": "layer_norm", "skip": True},
        {"activation": "relu", "input_hook": "mlp_input_before_gain", "layers": (1,)},
    ],
    ids=[
        "jumprelu",
        "relu-skip",
        "topk-rectified",
        "topk-signed-rescaled-stream",
        "rescaled-input-skip",
        "layer-normed-stream-skip",
        "before-gain-one-layer",
    ],
)
def test_the_model_with_its_mlps_replaced_plus_the_error_is_the_model(options):
    """Each replaced MLP, run as the set computes it on the MLP's own input, plus the capture's error,
    gives the model's logits; and the capture's activations are the set's encoding of that input."""
    model = gpt2(layers=2, heads=2, width=16).eval()
    transcoders = transcoders_for(model, **options)
    ids = torch.randint(0, 50, (2, 7))
    stack, capture = capture_huggingface_residual(model, input_ids=ids, transcoders=transcoders)
    seen, logits = own_mlp_inputs(model, ids)
    hook = {"resid_mid": "stream", "mlp_input_before_gain": "before_gain"}.get(options.get("input_hook"), "mlp_input")
    assert relative(replaced_logits(model, ids, transcoders, capture, hook), logits) < 1e-10
    for batch in range(2):  # and the paths through the features, the constant rows and the error sum to it
        result = pk.path_attribution(stack, pk.logit(model, 3), batch=batch, top_k=0)
        total = float(result.by_source_length.sum() + result.constant[0, 0])
        assert abs(total - float(logits[batch, -1, 3])) < 1e-10 * max(1.0, float(logits[batch, -1].abs().max()))
    for layer, replaced in capture.transcoders.layers.items():
        x = seen["argument" if hook != "stream" else "stream"][layer].double()
        if hook == "before_gain":  # the norm's output less its bias, over its gain
            ln_2 = model.transformer.h[layer].ln_2
            x = (x - ln_2.bias.double()) / ln_2.weight.double()
        own = transcoders.encode(layer, x)
        assert torch.equal((own != 0).nonzero()[:, 2].unique(), replaced.features)  # every active feature, no other
        assert torch.allclose(replaced.activations, own[..., replaced.features], rtol=1e-11, atol=1e-12)


def test_a_feature_is_a_step_only_where_its_gate_opens():
    """The gates are the format's: a threshold raised above every pre-activation closes its feature
    (it is no step), and a feature active at one token has gate 0 at every other."""
    model = gpt2(layers=2, heads=2, width=16).eval()
    transcoders = transcoders_for(model, features=16)
    ids = torch.randint(0, 50, (1, 6))
    _, capture = capture_huggingface_residual(model, input_ids=ids, transcoders=transcoders)
    replaced = capture.transcoders.layers[0]
    closed = int(replaced.features[0])
    transcoders.threshold[0][closed] = 1e9
    _, again = capture_huggingface_residual(model, input_ids=ids, transcoders=transcoders)
    assert closed not in again.transcoders.layers[0].features.tolist()
    assert set(again.transcoders.layers[0].features.tolist()) == set(replaced.features.tolist()) - {closed}
    pre = replaced.activations  # a = g ⊙ pre: zero exactly where the gate is
    assert torch.equal(pre != 0, replaced.gates != 0)


# ------------------------------------------------------------------------------------------------
# Every path is its literal term


def gpt2_branches(model, stack, capture):
    """A pre-LN GPT-2's branches on a term ``x [n, d]`` of sequence 0, written from the weights:
    ``norm_input(l, which, x) = D x C Γ`` (the frozen LayerNorm before the attention or the MLP, β
    left to the sources), ``head(l, h, x) = A_h (D x C Γ₁) W_V,h W_O,h`` and ``feature(l, g, enc,
    dec, x) = diag(g) (D x C Γ₂) enc decᵀ``."""
    d = stack.d_model
    centre = torch.eye(d, dtype=torch.float64) - 1.0 / d
    attn = capture.patterns(stack.attn, 0)
    blocks = model.transformer.h

    def norm_input(layer: int, which: int, x):
        gamma = (blocks[layer].ln_1 if which == 0 else blocks[layer].ln_2).weight.double()
        return capture.norm_scale[0, layer, which][:, None] * (x @ centre) * gamma

    def head(layer, h, x):
        return attn[layer, h] @ norm_input(layer, 0, x) @ stack.w_v[layer, h].double() @ stack.w_o[layer, h].double()

    def feature(layer, gate, enc, dec, x):
        return (gate[:, None] * (norm_input(layer, 1, x) @ enc)[:, None]) * dec[None, :]

    return norm_input, head, feature


def literal_attributions(model, ids, transcoders, stack, capture, position: int, u: torch.Tensor) -> dict:
    """Every path's attribution of a pre-LN GPT-2 with its MLPs replaced, written from the weights:
    ``{label: value}``. A head reads ``D x C Γ₁`` and writes ``A_h (·) W_V,h W_O,h``; a feature f of
    layer l writes ``diag(g_f D₂) (x C Γ₂) enc_f d_fᵀ`` (g from the set's own encoding of the
    model's MLP input); the skip map ``diag(D₂) (x C Γ₂) W_skip``; the readout ``e_tᵀ D_f (·) C Γ_f u``.
    Sources: the embedding, each layer's attention constant rows, transcoder constant rows and error,
    as the capture names them (their values taken from the capture: the sums test holds them)."""
    layers, heads = stack.num_layers, stack.num_heads
    d = stack.d_model
    centre = torch.eye(d, dtype=torch.float64) - 1.0 / d
    attn = capture.patterns(stack.attn, 0)
    seen, _ = own_mlp_inputs(model, ids)
    blocks = model.transformer.h
    norm_input, head_step, feature_step = gpt2_branches(model, stack, capture)

    def skip_step(layer, w_skip, x):
        return norm_input(layer, 1, x) @ w_skip

    steps = []  # (layer, kind, index, function) in the order a path passes them, bottom up
    for layer in range(layers):
        steps += [(layer, "attn", h, functools.partial(head_step, layer, h)) for h in range(heads)]
        gates = (transcoders.encode(layer, seen["argument"][layer][0].double()) != 0).double()  # [n, F]
        for f in gates.any(0).nonzero().flatten().tolist():
            enc, dec = transcoders.w_enc[layer][:, f], transcoders.w_dec[layer][layer][f]
            steps.append((layer, "mlp", f, functools.partial(feature_step, layer, gates[:, f], enc, dec)))
        if transcoders.w_skip[layer] is not None:
            steps.append((layer, "mlp", "skip", functools.partial(skip_step, layer, transcoders.w_skip[layer])))
    final = model.transformer.ln_f.weight.double()
    readout_vector = centre @ (final * u)

    def read(x):
        return float(capture.final_scale[0, position] * (x[position] @ readout_vector))

    sources = [("embedding", capture.embedding[0], -1)]
    for layer in range(layers):
        replaced = capture.transcoders.layers[layer]
        sources.append((f"L{layer} attention bias", None, (layer, "attn")))  # its rows: below
        sources.append((f"L{layer} transcoder bias", replaced.bias[0], (layer, "mlp")))
        sources.append((f"L{layer} MLP error", replaced.error[0], (layer, "mlp")))
    values = {}
    for name, source, entry in sources:
        if source is None:  # the attention's constant rows: Σ_h (A_h 1)(βᵀ W_V + b_V) W_O + b_O
            layer = entry[0]
            block = blocks[layer].attn
            beta = blocks[layer].ln_1.bias.double()
            rows = torch.zeros_like(capture.embedding[0])
            for h in range(heads):
                b_v = capture.value_bias[layer, h]
                rows += attn[layer, h].sum(-1)[:, None] * ((beta @ stack.w_v[layer, h].double() + b_v)
                                                           @ stack.w_o[layer, h].double())[None, :]  # fmt: skip
            source = rows + block.c_proj.bias.double()
        # The steps above the source: a source entering at (layer, "attn") passes that layer's MLP on.
        if entry == -1:
            above = steps
        else:
            layer, kind = entry
            above = [s for s in steps if s[0] > layer or (kind == "attn" and s[0] == layer and s[1] == "mlp")]
        slots = sorted({(s[0], s[1]) for s in above})
        options = {slot: [None] + [s for s in above if (s[0], s[1]) == slot] for slot in slots}
        for choice in itertools.product(*options.values()):
            term = source
            labels = []
            for step in choice:
                if step is not None:
                    term = step[3](term)
                    layer, kind, index = step[0], step[1], step[2]
                    labels.append(f"L{layer}H{index}" if kind == "attn" else f"L{layer} F{index}" if index != "skip"
                                  else f"L{layer} skip")  # fmt: skip
            label = f"{' → '.join(labels)} from {name}" if labels else f"{name} (direct)"
            values[label] = values.get(label, 0.0) + read(term)
    return values


def tiny_skip_transcoded():
    """A 2-layer GPT-2 of width 8 on 4 random tokens, captured with a skip-transcoder of 5 features on
    each layer: ``(model, transcoders, ids, stack, capture)``."""
    model = gpt2(layers=2, heads=2, width=8).eval()
    transcoders = transcoders_for(model, features=5, skip=True)
    ids = torch.randint(0, 50, (1, 4))
    stack, capture = capture_huggingface_residual(model, input_ids=ids, transcoders=transcoders)
    return model, transcoders, ids, stack, capture


def test_every_path_through_heads_and_features_is_its_literal_term():
    """On a 2-layer GPT-2 with a skip-transcoder on each layer: every path's attribution equals its
    term written from the weights, the skip map's rank-one steps summing to the literal ``W_skip``
    step; and the paths sum to the model's own logit."""
    model, transcoders, ids, stack, capture = tiny_skip_transcoded()
    token = 7
    result = pk.path_attribution(stack, pk.logit(model, token), top_k=3)
    mine = {}
    for path, source, value in zip(result.paths, result.path_sources, result.attribution[:, 0, 0]):
        label = re.sub(r"skip\[\d+\]", "skip", result.describe(path, source))  # the skip map's steps, summed
        mine[label] = mine.get(label, 0.0) + float(value)
    literal = literal_attributions(model, ids, transcoders, stack, capture, 3, model.lm_head.weight[token].double())
    assert set(mine) == set(literal)
    scale = max(abs(v) for v in literal.values())
    assert max(abs(mine[k] - literal[k]) for k in literal) < 1e-11 * scale
    own = model(ids).logits[0, -1, token].item()
    assert abs(float(result.value[0, 0]) - own) < 1e-10 * abs(own) + 1e-12
    assert abs(sum(literal.values()) + float(result.constant[0, 0]) - own) < 1e-10 * max(1.0, abs(own))


def test_the_terms_of_paths_through_features_sum_to_the_stream_and_read_out_as_their_attributions():
    """pk.path_terms of every path of a 2-layer GPT-2 with skip-transcoders: they sum to the stream
    entering the final norm, and each read out through the frozen final norm is its attribution."""
    model, _, _, stack, capture = tiny_skip_transcoded()
    token = 9
    result = pk.path_attribution(stack, pk.logit(model, token), top_k=2)
    terms = pk.path_terms(stack, result.paths, result.path_sources)  # [M, n, d]
    assert relative(terms.sum(0), capture.residual[0]) < 1e-12
    d = 8
    centre = torch.eye(d, dtype=torch.float64) - 1.0 / d
    u = centre @ (model.transformer.ln_f.weight.detach().double() * model.lm_head.weight[token].detach().double())
    read = capture.final_scale[0, -1] * (terms[:, -1] @ u)
    assert relative(read, result.attribution[:, 0, 0]) < 1e-12
    # A feature that no token of the sequence opens has no term; a column beyond the set is refused.
    closed = sorted(set(range(5)) - set(capture.transcoders.layers[1].features.tolist()))
    if closed:
        path = torch.full((1, 4), -1)
        path[0, 3] = closed[0]
        assert float(pk.path_terms(stack, path, [0]).abs().max()) == 0.0
    path = torch.full((1, 4), -1)
    path[0, 2] = 5 + 8  # F = 5 features and at most d = 8 skip directions: beyond them
    with pytest.raises(ValueError, match=r"expected paths\[:, 2\] \(layer 0's MLP step\) in \[-1, "):
        pk.path_terms(stack, path, [0])


# ------------------------------------------------------------------------------------------------
# Every family


FAMILY_CASES = {
    "gpt2": lambda: gpt2(layers=2, heads=2, width=16).eval(),
    "llama": lambda: llama(layers=2, heads=4, kv_heads=2, width=16).eval(),
    "gemma2": lambda: uncapped(family_model("gemma2")),
    "olmo2": lambda: family_model("olmo2"),
    "gpt_neox-sequential": lambda: family_model("gpt_neox-sequential"),
    "opt": lambda: family_model("opt"),
}


@pytest.mark.parametrize("name", list(FAMILY_CASES))
@pytest.mark.parametrize("output_hook", ["mlp_output", "mlp_module_output"])
def test_a_family_with_transcoders_is_the_sum_of_its_paths(name, output_hook):
    """Σ every path through heads and features, + the constant, = the model's own logit (float64);
    for Gemma-2 and OLMo 2 a set writing the MLP module's output passes the frozen norm after it."""
    model = FAMILY_CASES[name]()
    transcoders = transcoders_for(model, features=8, output_hook=output_hook, skip=name == "llama")
    ids = torch.randint(0, 50, (1, 5))
    stack, capture = capture_huggingface_residual(model, input_ids=ids, transcoders=transcoders)
    assert capture.transcoders.input_error is None or capture.transcoders.input_error < 1e-12
    result = pk.path_attribution(stack, pk.logit(model, 11), top_k=2, max_length=3)
    everything = pk.path_attribution(stack, pk.logit(model, 11), top_k=2)
    # The capture's stream is the model's computed in float64 (Hugging Face rounds softmax, norms and
    # rotary angles to float32 even in a float64 model: its own forward is within ~1e-6 of it).
    value = float(logits_in_float64(model, input_ids=ids)[0, -1, 11])
    total = float(everything.by_source_length.sum() + everything.constant[0, 0])
    assert abs(total - value) < 1e-12 * max(1.0, abs(value)), (total, value)
    assert abs(float(result.value[0, 0]) - value) < 1e-10 * max(1.0, abs(value))
    own = model(ids).logits[0, -1, 11].item()
    assert abs(total - own) < 1e-5 * max(1.0, abs(own))
    assert int(everything.counts.sum()) == int(everything.paths.shape[0])
    assert everything.paths.shape[1] == 2 * stack.num_layers
    if output_hook == "mlp_module_output" and name in ("gemma2", "olmo2"):
        # The error is then what the norm after the module leaves: not the plain set's output.
        assert any("MLP error" in name for name in everything.source_names)


def mlp_sides(model, ids) -> dict:
    """``{layer: (the MLP module's argument, its output, the norm after it's output)}`` of a model
    with a norm after each MLP (Gemma-2, OLMo 2), its norms run in float64 as the capture runs them."""
    seen, handles = {}, []
    for layer, block in enumerate(model.model.layers):

        def module(m, args, result, layer=layer):
            seen[layer] = (args[0].detach().double(), result.detach().double())

        def after(m, args, result, layer=layer):
            seen[layer] = (*seen[layer], result.detach().double())

        handles.append(block.mlp.register_forward_hook(module))
        handles.append(block.post_feedforward_layernorm.register_forward_hook(after))
    try:
        with torch.no_grad(), float64_steps(model):
            model(ids)
    finally:
        for handle in handles:
            handle.remove()
    return seen


@pytest.mark.parametrize("name", ["gemma2", "olmo2"])
def test_a_set_writing_the_mlp_modules_output_passes_the_norm_after_it(name):
    """Where the set writes the MLP module's output and a norm follows the module (Gemma-2, OLMo 2),
    the error is the sublayer's output less the set's output through that norm, frozen at the
    model's own module output: ``mlp_out − (set(x) / rms(m)) ⊙ γ``, written here from the model's
    hooks and the norm's weight."""
    model = FAMILY_CASES[name]()
    transcoders = transcoders_for(model, features=8, output_hook="mlp_module_output", skip=True)
    ids = torch.randint(0, 50, (1, 5))
    _, capture = capture_huggingface_residual(model, input_ids=ids, transcoders=transcoders)
    seen = mlp_sides(model, ids)
    for layer, replaced in capture.transcoders.layers.items():
        argument, output, sublayer = seen[layer]
        norm = model.model.layers[layer].post_feedforward_layernorm
        gain = (1 + norm.weight.double()) if name == "gemma2" else norm.weight.double()
        eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
        inverse_rms = torch.rsqrt(output.pow(2).mean(-1, keepdim=True) + eps)
        expected = sublayer - inverse_rms * transcoders.forward(layer, argument) * gain
        assert relative(replaced.error, expected) < 1e-7


def test_a_float32_model_with_transcoders_is_decomposed_to_float32s_precision():
    model = gpt2(layers=2, heads=2, width=16).float().eval()
    transcoders = transcoders_for(model, features=8, dtype=torch.float32)
    ids = torch.randint(0, 50, (1, 6))
    stack, capture = capture_huggingface_residual(model, input_ids=ids, transcoders=transcoders)
    result = pk.path_attribution(stack, pk.logit(model, 4), top_k=2)
    own = model(ids).logits[0, -1, 4].item()
    total = float(result.by_source_length.sum() + result.constant[0, 0])
    assert abs(total - own) < 1e-4 * max(1.0, abs(own))


def test_a_padded_batch_with_transcoders_reads_as_each_sequence_alone():
    """Left padding: each element's attribution (its own active features) equals its sequence's alone."""
    model = gpt2(layers=2, heads=2, width=16).eval()
    transcoders = transcoders_for(model, features=10)
    sequences = [torch.randint(1, 50, (length,)) for length in (6, 4)]
    ids = torch.zeros(2, 6, dtype=torch.long)
    mask = torch.zeros(2, 6, dtype=torch.long)
    for b, sequence in enumerate(sequences):
        ids[b, 6 - len(sequence) :], mask[b, 6 - len(sequence) :] = sequence, 1
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    stack, _ = capture_huggingface_residual(
        model, input_ids=ids, attention_mask=mask, position_ids=positions, transcoders=transcoders
    )
    for b, sequence in enumerate(sequences):
        alone, _ = capture_huggingface_residual(model, input_ids=sequence[None], transcoders=transcoders)
        padded = pk.path_attribution(stack, pk.logit(model, 2), batch=b, top_k=5)
        single = pk.path_attribution(alone, pk.logit(model, 2), top_k=5)
        assert torch.allclose(padded.value, single.value, rtol=1e-10)
        assert torch.allclose(padded.top_values, single.top_values, rtol=1e-9, atol=1e-12)
        assert [padded.describe(p, s) for p, s in zip(padded.top_paths[:, 0, 0], padded.top_sources[:, 0, 0])] == [
            single.describe(p, s) for p, s in zip(single.top_paths[:, 0, 0], single.top_sources[:, 0, 0])
        ]


# ------------------------------------------------------------------------------------------------
# The certified search


@pytest.mark.parametrize("bound", ["node", "chain", "first_head", "plain"])
@pytest.mark.parametrize("largest", [True, False])
def test_the_top_paths_through_features_are_those_of_enumeration(bound, largest):
    model = llama(layers=2, heads=4, kv_heads=2, width=16).eval()
    transcoders = transcoders_for(model, features=10, skip=True)
    ids = torch.randint(0, 50, (1, 6))
    stack, _ = capture_huggingface_residual(model, input_ids=ids, transcoders=transcoders)
    readout = pk.logit(model, 9)
    every = pk.path_attribution(stack, readout, top_k=0)
    values = every.attribution[:, 0, 0]
    top = pk.top_paths(stack, readout, top_k=8, bound=bound, largest=largest)
    assert top.certified
    expected = values.topk(8, largest=largest).values
    assert torch.allclose(top.values, expected, rtol=1e-10, atol=1e-13)
    assert top.total == values.numel()
    labels = {every.describe(p, s) for p, s in zip(every.paths, every.path_sources)}
    assert all(row["path"] in labels for row in top.table())


@pytest.mark.parametrize("cross_layer", [False, True])
def test_a_batchs_attributions_and_the_search_of_its_mean_go_through_every_elements_features(cross_layer):
    """batch_attribution: each element over the batch's features (those active in no token of it
    carry 0) equals its own path_attribution, and the mean is theirs; top_paths(batch=...) finds the
    top of the mean of every path, as the batch's enumeration lists it."""
    model = gpt2(layers=2, heads=2, width=16).eval()
    transcoders = transcoders_for(model, features=8, skip=not cross_layer, cross_layer=cross_layer)
    ids = torch.randint(0, 50, (3, 5))
    stack, _ = capture_huggingface_residual(model, input_ids=ids, transcoders=transcoders)
    readout = pk.logit(model, 4)
    together = pk.batch_attribution(stack, readout, top_k=5)
    for b, element in enumerate(together.elements):
        alone = pk.path_attribution(stack, readout, batch=b, top_k=5)
        assert torch.allclose(element.value, alone.value, rtol=1e-12)
        assert torch.allclose(element.by_source_length.sum(1), alone.by_source_length.sum(1), rtol=1e-10, atol=1e-13)
        assert torch.allclose(element.top_values, alone.top_values, rtol=1e-10)
    values = torch.stack([element.attribution[:, 0, 0] for element in together.elements]).mean(0)
    assert torch.allclose(together.mean.attribution[:, 0, 0], values, rtol=1e-12, atol=1e-15)
    top = pk.top_paths(stack, readout, top_k=5, batch=[0, 1, 2])
    assert top.certified
    assert torch.allclose(top.values, values.topk(5).values, rtol=1e-10, atol=1e-14)


# ------------------------------------------------------------------------------------------------
# Refused by name


@pytest.mark.parametrize("cross_layer", [False, True])
def test_a_trees_restriction_through_features_folds_exactly_its_paths(cross_layer):
    """tree= with a capture's transcoders: a stored tree of choices [2L] (some of the paths
    path_attribution lists, and one no sequence opens) folds exactly those choices from every
    source: its sums by source and length, its top paths and every kept attribution are those of
    the full enumeration restricted to them, in each element and in a batch's mean; a tree of L
    columns, a complete tree or an invalid step is refused by name."""
    model = gpt2(layers=3, heads=2, width=8).eval()
    transcoders = transcoders_for(model, features=4, skip=not cross_layer, cross_layer=cross_layer)
    ids = torch.randint(0, 50, (2, 4))
    stack, _ = capture_huggingface_residual(model, input_ids=ids, transcoders=transcoders)
    readout = pk.logit(model, 3)
    every = pk.path_attribution(stack, readout, top_k=0)
    values = every.attribution[:, 0, 0]
    chosen = every.paths[values.abs().argsort(descending=True)[:12]].unique(dim=0)
    tree = pk.PathTree.from_paths(chosen)
    keys = {tuple(row.tolist()) for row in chosen}
    inside = torch.tensor([tuple(row.tolist()) in keys for row in every.paths])
    restricted = pk.path_attribution(stack, readout, tree=tree, top_k=5)
    assert int(restricted.counts.sum()) == int(inside.sum()) and int(inside.sum()) >= len(keys)
    lengths = (every.paths != -1).sum(1)
    expected = torch.zeros_like(restricted.by_source_length)
    expected[:, :, 0, 0].index_put_((every.path_sources[inside], lengths[inside]), values[inside], accumulate=True)
    assert torch.allclose(restricted.by_source_length, expected, rtol=1e-12, atol=1e-14)
    assert torch.allclose(restricted.top_values[:, 0, 0], values[inside].topk(5).values, rtol=1e-12, atol=1e-14)
    assert torch.allclose(restricted.value, every.value, rtol=1e-12)  # the readout itself: the whole
    mean = pk.batch_attribution(stack, readout, tree=tree, top_k=0).mean
    both = pk.batch_attribution(stack, readout, top_k=0).mean
    kept = torch.tensor([tuple(row.tolist()) in keys for row in both.paths])
    assert torch.allclose(mean.by_source_length.sum(), both.attribution[kept, 0, 0].sum(), rtol=1e-12, atol=1e-14)
    layers = stack.num_layers
    with pytest.raises(ValueError, match=r"a tree holds paths' choices \[M, 6\]"):
        pk.path_attribution(stack, readout, tree=pk.PathTree.from_paths(chosen[:, :layers]))
    with pytest.raises(ValueError, match=r"a tree holds paths' choices \[M, 6\] .* got a complete tree"):
        pk.path_attribution(stack, readout, tree=pk.PathTree.complete(2 * layers, 2))
    wrong = chosen[:1].clone()
    wrong[0, 0] = 5  # no head 5
    with pytest.raises(ValueError, match=r"expected heads in \[-1, 2\) in the tree's first 3 columns"):
        pk.path_attribution(stack, readout, tree=pk.PathTree.from_paths(wrong))
    wrong = torch.full((1, 2 * layers), -1)
    wrong[0, layers] = 1000  # beyond layer 0's steps
    with pytest.raises(ValueError, match=r"layer 0's MLP step"):
        pk.path_attribution(stack, readout, tree=pk.PathTree.from_paths(wrong))


@pytest.mark.parametrize(
    "case, match",
    [
        ("resid_pre", "reads 'resid_pre'; a replaced MLP reads one of"),
        ("resid_post", "writes 'resid_post'; a replaced MLP writes one of"),
        ("width", "d_in=12 wide vectors; the model's width is 16"),
        ("layers", "is for layer 5; the model has 2 layers"),
        ("not a set", "expected transcoders to be a pathkernels.adapters.TranscoderSet"),
    ],
)
def test_a_set_the_capture_cannot_replace_is_refused_before_the_forward_pass(case, match):
    model = gpt2(layers=2, heads=2, width=16).eval()
    transcoders = transcoders_for(model, features=4)
    if case in ("resid_pre", "resid_post"):
        setattr(transcoders, "input_hook" if case == "resid_pre" else "output_hook", case)
    elif case == "width":
        transcoders = random_transcoders(2, 12, 4)
    elif case == "layers":
        transcoders = random_transcoders(6, 16, 4, layers=(5,))
    elif case == "not a set":
        transcoders = {"layer_0": transcoders}
    with pytest.raises((ValueError, TypeError), match=match):
        capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (1, 4)), transcoders=transcoders)


# ------------------------------------------------------------------------------------------------
# TransformerLens


def tl_model_with_mlps(normalization_type: str = "LN", **extra):
    from test_real_models_transformer_lens import tl_model

    return tl_model(normalization_type, **extra).eval()


def tl_replaced_logits(model, tokens, transcoders, capture, hook_name: str):
    """The TransformerLens model run with ``hook_mlp_out`` of the set's layers replaced by the set's
    own forward on the MLP's input as TransformerLens reports it (``hook_resid_mid``, or
    ``ln2.hook_normalized``) plus the capture's error."""
    kept = {}

    def keep(value, hook, layer):  # (a bridge names its hooks by their canonical names: keyed by layer)
        kept[layer] = value
        return value

    def replace(value, hook, layer):
        x = kept[layer].double()
        return (transcoders.forward(layer, x) + capture.transcoders.layers[layer].error).to(value.dtype)

    hooks = [(f"blocks.{layer}.{hook_name}", functools.partial(keep, layer=layer)) for layer in transcoders.layers]
    hooks += [(f"blocks.{layer}.hook_mlp_out", functools.partial(replace, layer=layer)) for layer in transcoders.layers]
    with torch.no_grad():
        return model.run_with_hooks(tokens, fwd_hooks=hooks)


@pytest.mark.parametrize(
    "normalization_type, input_hook",
    [("LN", "resid_mid"), ("LN", "mlp_input_before_gain"), ("LN", "mlp_input"), ("RMS", "mlp_input_before_gain")],
)
def test_a_transformer_lens_model_with_its_mlps_replaced(normalization_type, input_hook):
    """TransformerLens: the replaced model plus the error is the model, the input hook is checked
    against ``ln2.hook_normalized``, and the paths through the features sum to the model's logit."""
    pytest.importorskip("transformer_lens")
    model = tl_model_with_mlps(normalization_type)
    transcoders = random_transcoders(3, 32, 10, input_hook=input_hook, skip=True)
    tokens = torch.randint(0, 50, (1, 6))
    stack, capture = pk.adapters.capture_transformer_lens_residual(model, tokens, transcoders=transcoders)
    logits = model(tokens).detach()
    # (4.x's native RMSNorm rounds to float32 in its own forward, which the capture runs in float64)
    tolerance = 1e-6 if normalization_type == "RMS" and transformer_lens_major() == 4 else 1e-10
    if input_hook != "mlp_input":  # (the argument after the gain is no TransformerLens hook)
        hook = "hook_resid_mid" if input_hook == "resid_mid" else "ln2.hook_normalized"
        assert relative(tl_replaced_logits(model, tokens, transcoders, capture, hook), logits) < tolerance
    if input_hook == "mlp_input_before_gain":
        assert capture.transcoders.input_error < 1e-12
    result = pk.path_attribution(stack, pk.logit(model, 5), top_k=3, max_length=4)
    assert abs(float(result.value[0, 0]) - float(logits[0, -1, 5])) < tolerance * float(logits[0, -1].abs().max())
    everything = pk.top_paths(stack, pk.logit(model, 5), top_k=3)
    assert everything.certified


def test_a_transformer_lens_input_hook_that_the_model_does_not_read_is_refused():
    """The frozen input of a set reading ``ln2.hook_normalized`` is checked against that hook: a
    cache whose hook holds something else is refused by name; an attention-only model is refused."""
    pytest.importorskip("transformer_lens")
    model = tl_model_with_mlps("LN")
    transcoders = random_transcoders(3, 32, 10, input_hook="mlp_input_before_gain")
    tokens = torch.randint(0, 50, (1, 5))
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    cache.cache_dict["blocks.1.ln2.hook_normalized"] = cache["blocks.1.ln2.hook_normalized"] * 1.01
    with pytest.raises(ValueError, match=r"layer 1's transcoder differs from .* 'mlp_input_before_gain'"):
        pk.adapters.capture_transformer_lens_residual(model, cache, transcoders=transcoders)
    with pytest.raises(ValueError, match="transcoders replace a model's MLPs; this model is attention-only"):
        pk.adapters.capture_transformer_lens_residual(
            tl_model_with_mlps("LN", attn_only=True), tokens, transcoders=transcoders
        )


# ------------------------------------------------------------------------------------------------
# The decomposition through features


def composite(x: torch.Tensor) -> torch.Tensor:
    """``‖x‖_{1,∞} = sqrt(‖x‖₁ ‖x‖_∞)`` of ``[..., n, d]``, written here: the largest column sum
    and the largest row sum of |x|."""
    magnitude = x.abs()
    return (magnitude.sum(-2).amax(-1) * magnitude.sum(-1).amax(-1)).sqrt()


def test_the_decomposition_lists_every_path_through_features_and_measures_its_term():
    """pk.decompose of a 2-layer GPT-2 with skip-transcoders, two sequences: every path through
    heads and steps (the set path_attribution enumerates), each measured on its term (pk.path_terms,
    the residual's and the term's composite norms written here), the terms summing to each
    sequence's stream; a step closed throughout one sequence is a zero path there."""
    model = gpt2(layers=2, heads=2, width=8).eval()
    transcoders = transcoders_for(model, features=5, skip=True)
    ids = torch.randint(0, 50, (2, 4))
    stack, capture = capture_huggingface_residual(model, input_ids=ids, transcoders=transcoders)
    result = pk.decompose(stack)
    assert result.method == "exact" and result.paths.shape[1] == 4
    assert len(result.paths) == sum(result.path_counts)
    for batch in range(2):
        terms = pk.path_terms(stack, result.paths, result.sources, batch=batch)  # [M, n, d]
        assert relative(terms.sum(0), capture.residual[batch]) < 1e-12
        residual = composite(terms - terms.mean(-2, keepdim=True))
        norm = composite(terms)
        scale = float(norm.max())
        assert float((result.results.residual[batch] - residual).abs().max()) < 1e-12 * scale
        assert float((result.results.norm[batch] - norm).abs().max()) < 1e-12 * scale
    # The same path set as the enumeration of the first sequence's attributions, over the batch's steps.
    alone = pk.path_attribution(stack, pk.logit(model, 3), top_k=1)
    listed = {(int(s), tuple(p.tolist())) for p, s in zip(result.paths, result.sources)}
    own = {(int(s), tuple(p.tolist())) for p, s in zip(alone.paths, alone.path_sources)}
    assert own <= listed
    first_only = set(capture.transcoders.layers[1].features.tolist()) - set(
        capture.transcoders.layers[1].features[capture.transcoders.layers[1].gates[1].bool().any(0)].tolist()
    )
    for feature in first_only:  # open in the first sequence alone: a zero path in the second
        rows = result.paths[:, 3] == feature
        assert bool((result.results.norm[1, rows] == 0).all()) and bool((result.results.norm[0, rows] > 0).any())
    frame = result.to_frame()
    assert frame["path"].str.contains(r"L\d F\d").any() and frame["path"].str.contains(r"skip\[").any()


def test_draws_through_features_are_uniform_and_samples_are_the_exact_measures():
    """50,000 draws with replacement over the paths of a 2-layer GPT-2 with transcoders (and over
    those of two steps): every path's frequency within six standard deviations of its expectation,
    and Pearson's χ² over all of them within six of its own;
    a uniform sample and a stratified one measure their paths as the exact decomposition does."""
    from pathkernels.analysis.readout_trie import frozen_model
    from pathkernels.analysis.real_paths import _draw

    model = gpt2(layers=2, heads=2, width=8).eval()
    stack, capture = capture_huggingface_residual(
        model, input_ids=torch.randint(0, 50, (1, 4)), transcoders=transcoders_for(model, features=4)
    )
    exact = pk.decompose(stack)
    frozen = frozen_model(stack, capture, 0, torch.ones(4, dtype=torch.bool))
    for lengths in (list(range(5)), [2]):
        population = int(sum((exact.lengths == k).sum() for k in lengths))
        draws = 50_000
        choices, sources = _draw(frozen, draws, lengths, torch.Generator().manual_seed(1))
        unique, frequency = torch.unique(torch.cat([sources[:, None], choices], 1), dim=0, return_counts=True)
        assert unique.shape[0] == population
        expected = draws / population
        spread = (expected * (1 - 1 / population)) ** 0.5
        assert bool(((frequency - expected).abs() < 6 * spread).all()), (frequency.min(), frequency.max())
        # And jointly: Pearson's χ² over every path within six of its standard deviations of its mean
        # (a small bias spread over many paths passes each path's test, not this one).
        chi2, dof = float(((frequency - expected) ** 2 / expected).sum()), population - 1
        assert chi2 < dof + 6 * (2 * dof) ** 0.5, (chi2, dof)
    ratio_of = {
        (int(s), tuple(p.tolist())): exact.results.ratio[:, i]
        for i, (s, p) in enumerate(zip(exact.sources, exact.paths))
    }
    uniform = pk.decompose(stack, num_samples=30, generator=torch.Generator().manual_seed(0))
    keys = [(int(s), tuple(p.tolist())) for s, p in zip(uniform.sources, uniform.paths)]
    assert uniform.method == "uniform" and len(set(keys)) == 30
    # NaN at a zero path: two features open at no common token (diagonal token maps) give a 0 term.
    expected = torch.stack([ratio_of[k] for k in keys], 1)
    torch.testing.assert_close(uniform.results.ratio, expected, rtol=1e-10, atol=1e-14, equal_nan=True)
    stratified = pk.decompose(stack, samples_per_length={0: 100, 2: 10}, generator=torch.Generator().manual_seed(0))
    table = stratified.by_length().set_index("length")
    assert bool(table.loc[0, "exact"]) and table.loc[2, "evaluated"] == 10


def test_a_term_splits_by_the_token_where_it_passes_a_feature():
    """path_terms(split_at=l): the copies sum to the term; copy t is the term with the feature's gate
    closed at every other token (the capture's gates edited here); read out at the last token
    through a feature of the last layer, only the copy at that token is not 0. Paths that do not
    take a step at that layer, or a layer with no transcoder, are refused by name."""
    import copy

    for _ in range(30):  # a draw with a layer-1 feature open at the last token and 3 paths through layer 0's
        model, transcoders, ids, stack, capture = tiny_skip_transcoded()
        result = pk.path_attribution(stack, pk.logit(model, 4), top_k=1)
        layers = stack.num_layers
        through = (result.paths[:, layers] >= 0) & (result.paths[:, layers] < 5)  # a layer-0 feature
        if bool(capture.transcoders.layers[1].gates[0, -1].any()) and int(through.sum()) >= 3:
            break
    paths, sources = result.paths[through][:12], result.path_sources[through][:12]
    whole = pk.path_terms(stack, paths, sources)
    split = pk.path_terms(stack, paths, sources, split_at=0)  # [M, n, n, d]
    assert split.shape == (paths.shape[0], 4, 4, 8)
    assert relative(split.sum(1), whole) < 1e-12
    replaced = capture.transcoders.layers[0]
    for m in range(3):
        column = int((replaced.features == int(paths[m, layers])).nonzero())
        for t in range(4):
            edited = copy.deepcopy(stack)
            gates = edited.residual_capture.transcoders.layers[0].gates
            kept = gates[0, t, column].clone()
            gates[0, :, column] = 0
            gates[0, t, column] = kept
            alone = pk.path_terms(edited, paths[m : m + 1], sources[m : m + 1])[0]
            assert float((split[m, t] - alone).abs().max()) <= 1e-12 * float(whole[m].abs().max())
    top_layer = capture.transcoders.layers[1]
    open_last = top_layer.features[top_layer.gates[0, -1].bool()].tolist()  # layer-1 features open at the last token
    last = torch.tensor([int(p) in open_last for p in result.paths[:, layers + 1]])
    top = pk.path_terms(stack, result.paths[last][:6], result.path_sources[last][:6], split_at=1)
    u = (torch.eye(8, dtype=torch.float64) - 1 / 8) @ (
        model.transformer.ln_f.weight.detach().double() * model.lm_head.weight[4].detach().double()
    )
    read = capture.final_scale[0, -1] * (top[:, :, -1] @ u)  # [M, n]: each copy's attribution
    assert float(read[:, :-1].abs().max()) == 0.0
    assert relative(read[:, -1], result.attribution[last][:6, 0, 0]) < 1e-12 and float(read.abs().max()) > 0
    with pytest.raises(ValueError, match=r"expected every path to take one \(paths\[:, 3\]"):
        pk.path_terms(stack, torch.full((1, 4), -1), [0], split_at=1)
    plain, _ = capture_huggingface_residual(model, input_ids=ids)
    with pytest.raises(ValueError, match="split_at splits a term where it passes a transcoder step; this capture"):
        pk.path_terms(plain, torch.full((1, 2), -1), [0], split_at=0)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("cross_layer", [False, True])
def test_every_family_the_captures_read_is_the_sum_of_its_paths_through_features(name, cross_layer):
    """Every family of the model-family tests (parallel blocks, Gemma's norms, OLMo's, Falcon's and
    OPT's layouts) with a per-layer skip set and with a cross-layer set: Σ every path + the constant
    = the model's logit in float64 (a cross-layer set on the post-norm OPT is refused by name)."""
    state = torch.random.get_rng_state()
    model = family_model(name)  # (made at a fixed seed: the set and the tokens are drawn from the test's)
    torch.random.set_rng_state(state)
    model = uncapped(model) if name.startswith("gemma2") else model
    transcoders = transcoders_for(model, features=5, cross_layer=cross_layer, skip=not cross_layer)
    ids = torch.randint(3, 50, (1, 5))
    if cross_layer and name == "opt-post-projected":
        with pytest.raises(ValueError, match="cross-layer set on a post-norm model"):
            capture_huggingface_residual(model, input_ids=ids, transcoders=transcoders)
        return
    stack, capture = capture_huggingface_residual(model, input_ids=ids, transcoders=transcoders)
    result = pk.path_attribution(stack, pk.logit(model, 3), top_k=1)
    value = float(logits_in_float64(model, input_ids=ids)[0, -1, 3])
    total = float(result.by_source_length.sum() + result.constant[0, 0])
    assert abs(total - value) < 1e-12 * max(1.0, abs(value)), (total, value)


@pytest.mark.parametrize("family", ["roberta", "vit"])
def test_a_roberta_and_a_vit_with_transcoders_are_the_sums_of_their_paths(family):
    """RoBERTa (post-norm, as BERT) and ViT (pre-norm, on pixels): the paths through a set's features
    sum to a readout of the model's own last hidden state."""
    config = dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=32, intermediate_size=64,
                  initializer_range=0.3)  # fmt: skip
    if family == "roberta":
        model = transformers.RobertaModel(
            transformers.RobertaConfig(**config, vocab_size=50, max_position_embeddings=20)
        )
        inputs = {"input_ids": torch.randint(3, 50, (1, 6))}
        marker = "LayerNorm"
    else:
        model = transformers.ViTModel(transformers.ViTConfig(**config, image_size=8, patch_size=4))
        inputs = {"pixel_values": torch.randn(1, 3, 8, 8, dtype=torch.float64)}
        marker = "layernorm"
    from test_real_models import randomised

    model = randomised(model, norm_marker=marker).eval()
    transcoders = random_transcoders(2, 32, 6, skip=True)
    stack, capture = capture_huggingface_residual(model, transcoders=transcoders, **inputs)
    readout = torch.randn(32, dtype=torch.float64)
    result = pk.path_attribution(stack, readout, top_k=1)
    total = float(result.by_source_length.sum() + result.constant[0, 0])
    with torch.no_grad(), float64_steps(model):
        hidden = model(**inputs).last_hidden_state[0, -1].double()
    if family == "vit":  # (the capture reads the stream before ViT's final LayerNorm; the readout after it)
        assert abs(total - float(result.value[0, 0])) < 1e-10 * max(1.0, abs(total))
        return
    assert abs(total - float(hidden @ readout)) < 1e-10 * float(hidden.abs().sum() * readout.abs().max())
