"""pk.adapters: Hugging Face and TransformerLens models built from configs (no downloads).

Each extracted map is checked against the model's own computation: a layer's attention output is
``Σ_h A[l,h] X_l W_V[l,h] W_O[l,h] + b_O[l]``, with X_l the attention module's input.
"""

import contextlib
import copy
import os
import warnings

import pytest
import torch

import pathkernels as pk
from pathkernels import adapters
from pathkernels.core.checks import check_row_stochastic
from pathkernels.reference import (
    composite_norm_ref,
    path_products_ref,
    residual_norm_ref,
)
from pathkernels.testing import transformer_lens_attention_only, transformer_lens_major

transformers = pytest.importorskip("transformers")


def randomise_biases(model):
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or name.split(".")[-1] in ("b_Q", "b_K", "b_V", "b_O"):  # HF, TransformerLens
                parameter.normal_(0, 0.5)
    return model


def hf_case(family: str):
    """A tiny model of the family (random biases, so the folding is exercised) and its inputs."""
    tf = transformers
    tokens = {"input_ids": torch.randint(0, 50, (2, 7))}
    if family == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=50, n_positions=16))
    elif family == "bert":
        model = tf.BertModel(
            tf.BertConfig(
                num_hidden_layers=2,
                num_attention_heads=4,
                hidden_size=32,
                intermediate_size=64,
                vocab_size=50,
                max_position_embeddings=16,
            )
        )
        tokens["attention_mask"] = torch.tensor([[1] * 7, [1] * 5 + [0] * 2])  # padded keys: rows still sum to 1
    elif family == "vit":
        model = tf.ViTModel(
            tf.ViTConfig(
                image_size=16,
                patch_size=4,
                num_hidden_layers=2,
                num_attention_heads=4,
                hidden_size=32,
                intermediate_size=64,
            )
        )
        tokens = {"pixel_values": torch.randn(2, 3, 16, 16)}
    else:  # a Llama-style decoder with grouped-query attention: 4 query heads share 2 key/value heads
        model = tf.LlamaForCausalLM(
            tf.LlamaConfig(
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                hidden_size=32,
                intermediate_size=64,
                vocab_size=50,
                attention_bias=True,
            )
        )
    return randomise_biases(model), tokens


FAMILIES = ["gpt2", "bert", "vit", "llama"]


@pytest.mark.parametrize("family", FAMILIES)
def test_huggingface_maps_reproduce_every_attention_output(family):
    model, inputs = hf_case(family)
    layers = adapters.huggingface._attention_layers(model)
    seen_inputs, seen_outputs = {}, {}

    def keep_input(index):
        def hook(module, args, kwargs):
            seen_inputs[index] = args[0] if args else kwargs["hidden_states"]

        return hook

    def keep_output(index):
        def hook(module, args, output):
            seen_outputs[index] = output

        return hook

    handles = [
        layer.attention.register_forward_pre_hook(keep_input(i), with_kwargs=True) for i, layer in enumerate(layers)
    ]
    handles += [layer.output.register_forward_hook(keep_output(i)) for i, layer in enumerate(layers)]
    stack = adapters.from_huggingface(model, **inputs)
    for handle in handles:
        handle.remove()

    n = stack.attn.shape[-1]
    assert stack.attn.shape == (2, 2, 4, n, n) and stack.w_v.shape == (2, 4, 32, 8) and stack.w_o.shape == (2, 4, 8, 32)
    assert stack.hidden_states.shape == (3, 2, n, 32)
    assert stack.head_labels()[:5] == ["L0H0", "L0H1", "L0H2", "L0H3", "L1H0"]
    for layer in range(2):
        x = seen_inputs[layer].double()
        w_v, w_o = stack.w_v[layer].double(), stack.w_o[layer].double()
        heads = sum(stack.attn[:, layer, h].double() @ x @ w_v[h] @ w_o[h] for h in range(4))
        expected = heads + stack.b_o[layer].double()
        torch.testing.assert_close(seen_outputs[layer].double(), expected, rtol=1e-5, atol=1e-5)

    # The patterns are the model's own (eager, output_attentions=True).
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    reference.eval()
    with torch.no_grad():
        attentions = reference(**inputs, output_attentions=True).attentions
    torch.testing.assert_close(stack.attn, torch.stack(attentions, dim=1))


def test_huggingface_restores_the_users_settings():
    model, inputs = hf_case("gpt2")
    model.train()
    assert model.config._attn_implementation == "sdpa"
    stack = adapters.from_huggingface(model, **inputs)
    assert model.training and model.config._attn_implementation == "sdpa"
    check_row_stochastic(stack.attn, "test")  # eval mode: no dropout in the patterns


def test_huggingface_streams_one_layer_at_a_time():
    model, inputs = hf_case("llama")
    received = []
    keep = lambda layer, attn: received.append((layer, attn))  # noqa: E731
    assert adapters.stream_huggingface_attention(model, keep, **inputs) is None  # nothing for a REPL to print
    assert [layer for layer, _ in received] == [0, 1]
    received.clear()
    output = adapters.stream_huggingface_attention(model, keep, return_output=True, **inputs)
    assert output.logits.shape == (2, 7, 50)
    stack = adapters.from_huggingface(model, **inputs)
    for layer, attn in received:
        torch.testing.assert_close(attn, stack.attn[:, layer])


def test_huggingface_stack_feeds_the_engine(device):
    model, inputs = hf_case("gpt2")
    stack = adapters.from_huggingface(model, **inputs).to(device=device, dtype=torch.float64)
    tree = pk.PathTree.complete(2, 4, skip=True)
    with pytest.warns(UserWarning, match=r"path_residuals: huggingface:\w+ has norms and MLPs"):
        result = stack.path_residuals(tree, x=stack.residual_stream(0))  # the attention-only network's
    products = path_products_ref(stack.attn, result.paths.to(device), stack.residual_stream(0), stack.w_v, stack.w_o)
    torch.testing.assert_close(result.residual, residual_norm_ref(products))
    torch.testing.assert_close(result.norm, composite_norm_ref(products))


def llama_style(model_type: str):
    """A tiny float64 decoder of a family that takes its softmax in float32."""
    config_class = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config"}[model_type]
    config = getattr(transformers, config_class)(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=50,
    )
    return transformers.AutoModelForCausalLM.from_config(config).double()


def eager_patterns(model, inputs: dict, *, in_float64: bool = False) -> torch.Tensor:
    """The patterns ``[B, L, H, n, n]`` that a copy of ``model`` returns with eager attention, its own
    forward pass, or with ``in_float64`` the independent float64 reference's (tests/float64_reference.py)."""
    from float64_reference import float64_steps

    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    with torch.no_grad(), float64_steps(reference) if in_float64 else contextlib.nullcontext():
        return torch.stack(reference.eval()(**inputs, output_attentions=True).attentions, dim=1)


def rotary_llama(rope_parameters: dict, **sizes) -> torch.nn.Module:
    """A float64 Llama of two layers (four query heads over two key-value heads, head_dim 16) with
    these rotary parameters; ``sizes`` override the config's."""
    config = dict(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=32,
        head_dim=16,
        intermediate_size=64,
        vocab_size=50,
        max_position_embeddings=64,
        rope_parameters=rope_parameters,
    )
    return transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**{**config, **sizes})).double()


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "vit"])
def test_float64_models_with_a_float32_softmax(family):
    """Their eager attention takes the softmax in float32 (rows summing to 1 only to ~1e-7): the
    adapter computes a float64 model's patterns in float64, as the model would in float64 throughout."""
    if family == "vit":
        model, inputs = hf_case("vit")
        model = model.double()
        inputs = {"pixel_values": inputs["pixel_values"].double()}
    else:
        model, inputs = llama_style(family), {"input_ids": torch.randint(0, 50, (2, 9))}
    raw, exact = eager_patterns(model, inputs), eager_patterns(model, inputs, in_float64=True)
    assert float((raw.sum(-1) - 1).abs().max()) > 1e-12  # the premise: float32 rounding, not float64's
    stack = adapters.from_huggingface(model, **inputs)
    assert stack.attn.dtype == torch.float64 and stack.attn_precision is None
    assert float((stack.attn.sum(-1, dtype=torch.float64) - 1).abs().max()) < 1e-14
    torch.testing.assert_close(stack.attn, exact, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(stack.attn, raw, rtol=1e-6, atol=1e-7)  # the model's own, to float32 precision
    tree = pk.PathTree.complete(2, 4, skip=True)
    with pytest.warns(UserWarning, match=r"path_residuals: huggingface:\w+ has norms and MLPs"):
        result = stack.path_residuals(tree, x=stack.residual_stream(0))  # the attention-only network's
    products = path_products_ref(stack.attn, result.paths, stack.residual_stream(0), stack.w_v, stack.w_o)
    torch.testing.assert_close(result.residual, residual_norm_ref(products), rtol=1e-10, atol=1e-12)


# head_dim 16: frequencies 10000^(-i/8), i < 8 (wavelengths 2π · 10^(i/2)), unless rope_theta says
# otherwise.
ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.5},
    # a context of 64 keeps frequency 0, blends 1 and 2, divides the rest
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    # a context of 100: the ramp over frequencies j runs from dimension -0.61 (rounded to -1,
    # clamped to 0) to 2.40 (rounded to 3): j = 0 kept, 1 and 2 blended, the rest divided
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 100},
    # base 100, a context of 2^16: from 2.30 to 16.07 (clamped to dim − 1 = 15), unrounded
    "yarn-untruncated": {
        "rope_type": "yarn",
        "rope_theta": 100.0,
        "factor": 8.0,
        "original_max_position_embeddings": 2**16,
        "beta_fast": 2774.0,
        "beta_slow": 1.0,
        "truncate": False,
    },
}


@pytest.mark.parametrize("scaling", sorted(ROPE_SCALINGS))
def test_float64_rotary_positions_with_scaled_frequencies(scaling):
    """Llama's rotary module computes θ and the angles in float32 whatever the model's dtype; a
    float64 model's scaled θ ("linear", Llama 3.1's "llama3", "yarn") is computed again in float64 from the
    config, and the patterns are the float64 forward pass's (the reference scales each frequency by
    its own code), not the float32 angles' (1e-9 and more apart at 40 positions)."""
    model = rotary_llama({"rope_theta": 10000.0, **ROPE_SCALINGS[scaling]})
    inputs = {"input_ids": torch.randint(0, 50, (2, 40))}
    raw, exact = eager_patterns(model, inputs), eager_patterns(model, inputs, in_float64=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stack = adapters.from_huggingface(model, **inputs)
    assert not [w for w in caught if "RotaryEmbedding" in str(w.message)]  # θ computed here: nothing to say
    torch.testing.assert_close(stack.attn, exact, rtol=1e-12, atol=1e-14)
    assert float((stack.attn - raw).abs().max()) > 1e-9  # the premise: float32 angles are visibly apart


def test_a_float64_rotary_module_whose_theta_is_not_computed_here_is_named():
    """Dynamic NTK's θ is not computed again here: the module's float32 θ is kept, and the capture
    says so (the patterns are still the model's own to float32's rounding of the angles)."""
    model = rotary_llama({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}, num_hidden_layers=1)
    inputs = {"input_ids": torch.randint(0, 50, (1, 12))}
    with pytest.warns(
        UserWarning, match=r"LlamaRotaryEmbedding of a float64 model: its rope type 'dynamic' is not one"
    ):
        stack = adapters.from_huggingface(model, **inputs)
    torch.testing.assert_close(stack.attn, eager_patterns(model, inputs), rtol=1e-6, atol=1e-7)


def test_a_float32_softmax_is_still_checked():
    """attn_precision widens the tolerance to float32's, no further: a row off by 1e-3 is refused."""
    model, inputs = llama_style("llama"), {"input_ids": torch.randint(0, 50, (1, 6))}
    stack = adapters.from_huggingface(model, **inputs)
    attn = stack.attn.clone()
    attn[0, 1, 2, 4] *= 1.001
    with pytest.raises(ValueError, match=r"row 4 of batch element 0, layer 1, head 2 sums to 1\.00.*computed in "):
        adapters.AttentionStack(attn, stack.w_v, stack.w_o, stack.b_o, attn_precision=torch.float32)
    # Models that take the softmax in their own dtype keep float64's tolerance.
    gpt2, inputs = hf_case("gpt2")
    assert adapters.from_huggingface(gpt2.double(), **inputs).attn_precision is None


def test_a_row_error_blames_the_mask_only_where_there_is_padding():
    attn = torch.full((2, 1, 1, 4, 4), 0.25, dtype=torch.float64)
    attn[1, 0, 0, :, 3] = 0.0  # element 1: its padded key gets no weight
    attn[1, 0, 0, :, :3] = 1 / 3
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    w = torch.randn(1, 1, 3, 3, dtype=torch.float64)
    unpadded = attn.clone()
    unpadded[0, 0, 0, 2] += 1e-6  # element 0 has no padding: a cast's rounding, not the mask's fault
    with pytest.raises(ValueError, match=r"row 2 of batch element 0, .* renormalise the rows") as error:
        adapters.AttentionStack(unpadded, w, w, torch.zeros(1, 3, dtype=torch.float64), token_mask=mask)
    assert "token_mask" not in str(error.value)
    padded = attn.clone()
    padded[1, 0, 0, 1] = torch.tensor([0.3, 0.3, 0.3, 0.1])  # real query 1 gives its padded key weight
    with pytest.raises(ValueError, match=r"real token 1 of batch element 1, .* Restricted to the real tokens"):
        adapters.AttentionStack(padded, w, w, torch.zeros(1, 3, dtype=torch.float64), token_mask=mask)


def test_a_left_padded_float64_llama_gives_its_real_tokens_patterns():
    """Hugging Face's float64 Llama masks with float64's minimum, -inf in its float32 softmax, so a
    fully masked (left-padded) query's row is NaN and the next layer's values spread it to every real
    token. The adapter keeps the mask finite in float32: each real token's pattern is then the one
    the sequence has alone."""
    model = llama_style("llama")
    ids = torch.randint(0, 50, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :4] = 0
    stack = adapters.from_huggingface(model, input_ids=ids, attention_mask=mask)
    alone = adapters.from_huggingface(model, input_ids=ids[1:, 4:])
    torch.testing.assert_close(stack.attn[1, :, :, 4:, 4:], alone.attn[0], rtol=1e-6, atol=1e-7)
    assert bool(stack.hidden_states[:, 1, 4:].isfinite().all())


def test_nan_attention_is_refused_with_its_place():
    attn = torch.full((1, 2, 1, 3, 3), 1 / 3, dtype=torch.float64)
    attn[0, 1, 0, 2, 0] = float("nan")
    w = torch.randn(2, 1, 3, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"attention must be finite, but row 2 of batch element 0, layer 1, head 0"):
        adapters.AttentionStack(attn, w, w, torch.zeros(2, 3, dtype=torch.float64))
    padded = torch.tensor([0.0, 0.5, 0.5], dtype=torch.float64).expand(1, 2, 1, 3, 3).clone()  # token 0 padded
    padded[0, 1, 0, 2, 1] = float("nan")
    with pytest.raises(ValueError, match=r"attention must be finite, but real token \d of batch element 0, layer 1"):
        adapters.AttentionStack(
            padded, w, w, torch.zeros(2, 3, dtype=torch.float64), token_mask=torch.tensor([[0, 1, 1]])
        )


def test_an_empty_batch_is_refused_before_the_model_runs():
    model, _ = hf_case("gpt2")
    for name, value in (("input_ids", torch.zeros(0, 5, dtype=torch.long)), ("pixel_values", torch.zeros(0, 3, 4, 4))):
        message = rf"from_huggingface: expected at least one batch element and one token in {name}, got \[0, "
        with pytest.raises(ValueError, match=message):
            adapters.from_huggingface(model, **{name: value})
    with pytest.raises(ValueError, match=r"one token in input_ids, got \[1, 0\]"):
        adapters.stream_huggingface_attention(model, print, input_ids=torch.zeros(1, 0, dtype=torch.long))


TINY_GPT2 = dict(n_layer=1, n_head=2, n_embd=8, vocab_size=50)
TINY_ENCODER = dict(num_hidden_layers=1, num_attention_heads=2, hidden_size=8, intermediate_size=16, vocab_size=50)
POSITIONED = {  # families with learned absolute positions: a tiny model and the most tokens it embeds
    "gpt2": (lambda: transformers.GPT2Model(transformers.GPT2Config(**TINY_GPT2, n_positions=16)), 16),
    "bert": (lambda: transformers.BertModel(transformers.BertConfig(**TINY_ENCODER, max_position_embeddings=16)), 16),
    # RoBERTa's positions start after its padding index 1: 16 rows embed 14 tokens
    "roberta": (
        lambda: transformers.RobertaModel(transformers.RobertaConfig(**TINY_ENCODER, max_position_embeddings=16)),
        14,
    ),
    "opt": (  # OPT's table has 2 rows more than max_position_embeddings: 16 tokens
        lambda: transformers.OPTModel(
            transformers.OPTConfig(
                num_hidden_layers=1,
                num_attention_heads=2,
                hidden_size=8,
                ffn_dim=16,
                vocab_size=50,
                max_position_embeddings=16,
                word_embed_proj_dim=8,
            )
        ),
        16,
    ),
}


@pytest.mark.parametrize("family", sorted(POSITIONED))
def test_tokens_beyond_the_learned_positions_are_refused_by_name(family):
    """At its limit a model runs, and so does the adapter; one token more, the model itself fails (an
    embedding's IndexError, or a buffer's RuntimeError), and the adapter refuses the inputs in its
    own words first."""
    build, limit = POSITIONED[family]
    model = build().eval()
    model(input_ids=torch.randint(2, 50, (1, limit)))
    adapters.from_huggingface(model, input_ids=torch.randint(2, 50, (1, limit)))
    too_many = torch.randint(2, 50, (1, limit + 1))
    with pytest.raises((IndexError, RuntimeError)):
        model(input_ids=too_many)
    with pytest.raises(
        ValueError, match=rf"from_huggingface: {limit + 1} tokens, but the model embeds positions for at most {limit}$"
    ):
        adapters.from_huggingface(model, input_ids=too_many)


@pytest.mark.parametrize("family", sorted(POSITIONED))
def test_position_ids_beyond_the_learned_positions_are_refused_by_name(family):
    """position_ids index a learned table of 16 rows (OPT adds its offset itself): its last row
    runs, one beyond or a negative one fails in the model (an IndexError), and the adapter refuses
    it in its own words first; so too position_ids of another shape or dtype."""
    build, _ = POSITIONED[family]
    model = build().eval()
    ids = torch.randint(2, 50, (1, 3))
    edge = torch.tensor([[0, 1, 15]])
    model(input_ids=ids, position_ids=edge)
    adapters.from_huggingface(model, input_ids=ids, position_ids=edge)
    for bad in ([[0, 1, 16]], [[-1, 0, 1]]):
        with pytest.raises(
            ValueError, match=r"from_huggingface: expected position_ids in \[0, 16\) \(the model's learned positions\)"
        ):
            adapters.from_huggingface(model, input_ids=ids, position_ids=torch.tensor(bad))
    for bad in (torch.zeros(1, 3), torch.zeros(1, 4, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long)):
        with pytest.raises(ValueError, match=r"from_huggingface: expected position_ids of an integer dtype and shape"):
            adapters.from_huggingface(model, input_ids=ids, position_ids=bad)


@pytest.mark.parametrize(
    "inputs, message",
    [
        ({}, r"expected input_ids \[B, n\] \(or inputs_embeds \[B, n, d\], or pixel_values for ViT\) as a tensor"),
        (
            {"input_ids": torch.ones(2, 5)},
            r"expected input_ids of shape \[B, n\] and an integer dtype, got \[2, 5\] float32",
        ),
        ({"input_ids": torch.ones(5, dtype=torch.long)}, r"expected input_ids of shape \[B, n\] .*, got \[5\] int64"),
        (
            {"input_ids": torch.full((1, 5), 50)},
            r"expected input_ids in \[0, 50\) \(the model's vocab_size\), got values",
        ),
        (
            {"input_ids": torch.ones(1, 17, dtype=torch.long)},
            r"17 tokens, but the model embeds positions for at most 16",
        ),
        (
            {"input_ids": torch.ones(2, 5, dtype=torch.long), "attention_mask": torch.ones(2, 4)},
            r"\(attention_mask, the stack's token_mask\): expected token_mask of shape \[B, n\] = \[2, 5\]",
        ),
        (
            {"input_ids": torch.ones(2, 5, dtype=torch.long), "attention_mask": torch.tensor([[1] * 5, [0] * 5])},
            r"token_mask keeps no token of batch element 1",
        ),
    ],
    ids=[
        "no input",
        "float ids",
        "one dim",
        "beyond the vocabulary",
        "beyond the positions",
        "mask shape",
        "empty row",
    ],
)
def test_huggingface_inputs_are_checked_before_the_model_runs(inputs, message):
    """These raised the model's own errors (an embedding's IndexError, a dtype RuntimeError, a
    stack of mismatched shapes) or named the stack instead of the function called."""
    model, _ = hf_case("gpt2")  # vocab 50, 16 positions
    with pytest.raises(ValueError, match=r"^pathkernels\.adapters\.from_huggingface.*" + message):
        adapters.from_huggingface(model, **inputs)
    with pytest.raises(ValueError, match=r"^pathkernels\.adapters\.stream_huggingface_attention.*" + message):
        adapters.stream_huggingface_attention(model, print, **inputs)


def test_huggingface_bad_input():
    with pytest.raises(ValueError, match=r"from_huggingface: expected a transformers model of type \["):
        adapters.from_huggingface(torch.nn.Linear(2, 2))
    attn = torch.full((1, 1, 1, 3, 3), 1 / 3)
    attn[0, 0, 0, 2] = 0.0
    with pytest.raises(ValueError, match=r"row 2 of batch element 0, layer 0, head 0 sums to 0\. Masked or padded"):
        check_row_stochastic(attn, "test")


# --- TransformerLens ----------------------------------------------------------------------------


def attention_only(**overrides):
    """TransformerLens and an attention-only model of the installed version (3.x: HookedTransformer,
    4.x: a TransformerBridge over its native model), float64, no normalisation."""
    tl = pytest.importorskip("transformer_lens")
    expected = os.environ.get("PATHKERNELS_EXPECT_TRANSFORMER_LENS")
    if expected:  # the 4.x run of these tests must not fall back on another version
        assert transformer_lens_major() == int(expected), f"expected TransformerLens {expected}.x, got {tl.__file__}"
    return tl, transformer_lens_attention_only(**overrides)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_transformer_lens_path_sum_is_the_residual_stream():
    """Attention-only, no normalisation, zero biases: Σ over all paths = the final residual stream."""
    _, model = attention_only()
    tokens = torch.randint(0, 20, (2, 8))
    stack = adapters.from_transformer_lens(model, tokens)
    assert stack.attention_only is True
    assert stack.attn.shape == (2, 3, 4, 8, 8) and stack.hidden_states.shape == (4, 2, 8, 16)
    torch.testing.assert_close(stack.length_sums().sum(0), stack.hidden_states[-1])
    # The same through the engine's materialised path products.
    tree = pk.PathTree.complete(3, 4, skip=True)
    products = stack.path_residuals(tree, x=stack.residual_stream(0), materialize=True).products
    torch.testing.assert_close(products.sum(1), stack.hidden_states[-1])


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_transformer_lens_with_biases_sums_to_the_residual_stream():
    """Random b_V and b_O: the bias paths close the sum (they are left out with biases=False)."""
    _, model = attention_only()
    randomise_biases(model)
    tokens = torch.randint(0, 20, (2, 8))
    stack = adapters.from_transformer_lens(model, tokens)
    assert stack.b_o.abs().max() > 0.1
    torch.testing.assert_close(stack.length_sums().sum(0), stack.hidden_states[-1], rtol=1e-12, atol=1e-12)
    gap = (stack.length_sums(biases=False).sum(0) - stack.hidden_states[-1]).abs().max()
    assert gap > 0.1  # what leaving the biases out costs


def test_length_sums_of_a_model_with_norms_and_mlps_say_what_they_describe():
    """A GPT-2's stack.length_sums() was 3.8 away from its residual stream, silently: it is the
    attention-only network of its attention layers, and now says so. Hand-built stacks do not warn."""
    model, inputs = hf_case("gpt2")
    stack = adapters.from_huggingface(model, **inputs)
    assert stack.attention_only is False
    with pytest.warns(UserWarning, match=r"huggingface:gpt2 has LayerNorm and MLPs, which these sums leave out"):
        stack.length_sums()
    by_hand = adapters.AttentionStack(stack.attn, stack.w_v, stack.w_o, stack.b_o, stack.hidden_states)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        by_hand.length_sums()


def test_gpt2_attention_sublayers_are_their_length_sums():
    """GPT-2 with random biases: each attention sublayer's output is the sum over its paths, the bias
    path included (one layer, no skip: the heads plus 1 b_oᵀ)."""
    model, inputs = hf_case("gpt2")
    model = model.double()
    layers = adapters.huggingface._attention_layers(model)
    seen_inputs, seen_outputs = {}, {}
    handles = [
        layer.attention.register_forward_pre_hook(
            lambda module, args, kwargs, i=i: seen_inputs.__setitem__(i, args[0] if args else kwargs["hidden_states"]),
            with_kwargs=True,
        )
        for i, layer in enumerate(layers)
    ]
    handles += [
        layer.output.register_forward_hook(lambda module, args, output, i=i: seen_outputs.__setitem__(i, output))
        for i, layer in enumerate(layers)
    ]
    stack = adapters.from_huggingface(model, **inputs).to(torch.float64)
    for handle in handles:
        handle.remove()
    for layer in range(2):
        one = slice(layer, layer + 1)
        sums = pk.length_sums(
            stack.attn[:, one], seen_inputs[layer], stack.w_v[one], stack.w_o[one], b_o=stack.b_o[one], skip=False
        )
        torch.testing.assert_close(sums.sum(0), seen_outputs[layer], rtol=1e-9, atol=1e-9)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("kv_heads", [None, 2])
def test_transformer_lens_maps_and_folded_biases(kv_heads):
    tl, model = attention_only(n_key_value_heads=kv_heads) if kv_heads else attention_only()
    randomise_biases(model)
    tokens = torch.randint(0, 20, (2, 8))
    _, cache = model.run_with_cache(tokens)
    stack = adapters.from_transformer_lens(cache)
    torch.testing.assert_close(stack.attn, adapters.from_transformer_lens(model, tokens).attn)
    for layer in range(3):
        x = cache[f"blocks.{layer}.hook_resid_pre"]
        expected = sum(stack.attn[:, layer, h] @ x @ stack.w_v[layer, h] @ stack.w_o[layer, h] for h in range(4))
        torch.testing.assert_close(cache[f"blocks.{layer}.hook_attn_out"], expected + stack.b_o[layer])
    left, right = stack.w_path([1, -1, 2])
    factored = tl.FactoredMatrix(left, right)
    torch.testing.assert_close(factored.AB, stack.w_v[0, 1] @ stack.w_o[0, 1] @ stack.w_v[2, 2] @ stack.w_o[2, 2])
    eye = torch.eye(16, dtype=torch.float64)
    assert all(torch.equal(f, eye) for f in stack.w_path([-1, -1, -1]))
    with pytest.raises(
        ValueError,
        match=r"expected a path of 3 entries, one per layer, each a head in 0..3 or -1 for "
        r"skip; got \[1, -1\] \(2 entries\)",
    ):
        stack.w_path([1, -1])


def bridge_over(model, folder, dtype=torch.float32):
    """A TransformerBridge over a Hugging Face model saved to ``folder`` with a word-level tokenizer
    of its vocabulary (nothing downloaded). The bridge wraps ``model``'s own modules."""
    try:
        from transformer_lens.model_bridge import TransformerBridge
    except ImportError:
        pytest.skip("this transformer_lens has no TransformerBridge")
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"t{i}": i for i in range(model.config.vocab_size - 1)} | {"[UNK]": model.config.vocab_size - 1}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", bos_token="t1", eos_token="t2", pad_token="t3"
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return TransformerBridge.boot_transformers(str(folder), hf_model=model, dtype=dtype)


def test_transformer_bridge_matches_huggingface(tmp_path):
    pytest.importorskip("transformer_lens")
    model, inputs = hf_case("gpt2")
    original = copy.deepcopy(model)  # the bridge wraps the modules of the model it is given
    bridge = bridge_over(model, tmp_path)
    from_bridge = adapters.from_transformer_lens(bridge, inputs["input_ids"])
    from_hf = adapters.from_huggingface(original, **inputs)
    torch.testing.assert_close(from_bridge.attn, from_hf.attn)
    for name in ("w_v", "w_o", "b_o"):
        torch.testing.assert_close(getattr(from_bridge, name), getattr(from_hf, name))


def test_transformer_bridge_over_a_float64_llama(tmp_path):
    """No attention biases, grouped-query heads and a float32 softmax in a float64 model: the bridge
    gives what the Hugging Face adapter gives, the patterns computed in float64 alike."""
    pytest.importorskip("transformer_lens")
    model = llama_style("llama")
    original = copy.deepcopy(model)
    bridge = bridge_over(model, tmp_path, dtype=torch.float64)
    ids = torch.randint(0, 50, (2, 7))
    from_bridge = adapters.from_transformer_lens(bridge, ids)
    from_hf = adapters.from_huggingface(original, input_ids=ids)
    assert from_bridge.attn_precision is None and from_hf.attn_precision is None
    assert from_bridge.w_v.shape == (2, 4, 32, 8) and not bool(from_bridge.b_o.any())
    for name in ("attn", "w_v", "w_o", "b_o"):
        torch.testing.assert_close(getattr(from_bridge, name), getattr(from_hf, name), rtol=1e-12, atol=1e-12)
    # Hugging Face's last hidden state is after the final norm; TransformerLens's resid_post before it.
    torch.testing.assert_close(from_bridge.hidden_states[:-1], from_hf.hidden_states[:-1], rtol=1e-12, atol=1e-12)
    with pytest.raises(
        ValueError,
        match=r"expected tokens \[B, n\] \(or \[n\]\) with at least one batch element and one token, got \[0, 3\]",
    ):
        adapters.from_transformer_lens(bridge, torch.zeros(0, 3, dtype=torch.long))


def test_transformer_lens_bad_input():
    with pytest.raises(TypeError, match="expected a HookedTransformer, TransformerBridge or ActivationCache"):
        adapters.from_transformer_lens(torch.nn.Linear(2, 2), torch.zeros(1, 2))


def test_casting_up_renormalises_rows():
    model, inputs = hf_case("gpt2")
    stack = adapters.from_huggingface(model, **inputs)
    with pytest.raises(ValueError, match=r"renormalise the rows \(attn / attn.sum\(-1, keepdim=True\)\)"):
        check_row_stochastic(stack.attn.double(), "test")
    wide = stack.to(torch.float64)
    check_row_stochastic(wide.attn, "test")
    assert wide.w_v.dtype == wide.hidden_states.dtype == torch.float64
    torch.testing.assert_close(wide.attn, stack.attn.double(), rtol=1e-6, atol=1e-7)


def test_a_layer_without_weights_fails_clearly():
    model, inputs = hf_case("bert")
    attention = adapters.huggingface._attention_layers(model)[1].attention
    original = attention.forward

    def forward_without_weights(*args, **kwargs):
        return original(*args, **kwargs)[0], None

    attention.forward = forward_without_weights
    with pytest.raises(RuntimeError, match=r"layer 1 \(BertSelfAttention\) returned no attention weights"):
        adapters.from_huggingface(model, **inputs)
    assert model.config._attn_implementation == "sdpa" and model.training  # restored after the failure


def test_stack_repr_is_a_few_lines():
    model, inputs = hf_case("gpt2")
    text = repr(adapters.from_huggingface(model, **inputs))
    assert len(text) < 400 and text.count("\n") <= 3, text
    assert "attn=[2, 2, 4, 7, 7]" in text and "huggingface:gpt2" in text and "float32" in text


def test_a_hugging_face_output_given_as_input_is_refused_saying_why_the_model_runs():
    """A user holding ``model(..., output_hidden_states=True)`` passes it: refused naming the
    argument, saying that the hidden states do not hold the norm scales and MLP outputs."""
    model, inputs = hf_case("gpt2")
    output = model(**inputs, output_hidden_states=True)
    for call in (pk.adapters.from_huggingface, pk.adapters.capture_huggingface_residual):
        with pytest.raises(ValueError, match=r"output is a model output; expected the model's inputs .* norm's scale"):
            call(model, output=output)
