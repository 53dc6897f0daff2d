"""Model families and options beyond GPT-2, BERT, ViT and the Llama family: each decomposed exactly,
or refused by name, never a silently wrong number.

- Hugging Face sequence classifiers (GPT-2, Llama, Qwen2): the class-logit difference through the
  ``score`` head at the last real token; BERT's pooled classifier refused.
- TransformerLens options that change the stream or the readout: ``final_rms`` (an RMSNorm before
  the unembedding of a LayerNorm model), soft-capped logits (attributed before the cap, and
  labelled so), norms after each sublayer (refused).
- TransformerBridges over Gemma (its norms compute ``x̂ · (1 + w)``), float32 and float64, and over
  Gemma-2 (norms after each sublayer: refused).

Models are built from configs with random biases and norm parameters; the TransformerLens cases
run against 3.x here and against 4.x in tests/test_transformer_lens_versions.py (names holding
"transformer_lens" or "bridge").
"""

import copy
import itertools
import math
import re

import pytest
import torch
from float64_reference import logits_in_float64

import pathkernels as pk
from pathkernels.adapters.residual import capture_huggingface_residual

transformers = pytest.importorskip("transformers")


def complete(result) -> torch.Tensor:
    """``Σ_p attr(p) + constant`` ``[P, R]``: every path's attribution with the constant."""
    return result.by_source_length.sum((0, 1)) + result.constant


def randomise(model, *, norm_marker: str = "norm", norm_std: float = 0.3, bias_std: float = 0.3):
    """Every bias ~ N(0, bias_std²) and every norm weight ~ 1 + N(0, norm_std²), in place."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, bias_std)
            elif norm_marker in name and name.endswith("weight"):
                parameter.normal_(0, norm_std).add_(1)
    return model


def classifier(family: str, num_labels: int = 3):
    """A tiny float64 sequence classifier of ``family`` (GPT-2, Llama, Qwen2 or BERT)."""
    tf = transformers
    if family == "gpt2":
        config = tf.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=50, n_positions=16)
        marker = "ln_"
    elif family == "bert":
        config = tf.BertConfig(
            num_hidden_layers=2, num_attention_heads=4, hidden_size=32, intermediate_size=64, vocab_size=50
        )
        marker = "LayerNorm"
    else:
        config_class = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config}[family]
        config = config_class(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            hidden_size=32,
            intermediate_size=64,
            vocab_size=50,
        )
        marker = "norm"
    config.num_labels, config.pad_token_id = num_labels, 0
    model = tf.AutoModelForSequenceClassification.from_config(config).double()
    return randomise(model, norm_marker=marker).eval()


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_a_sequence_classifier_is_read_through_its_score_head(family):
    """The class-logit difference of a right-padded batch: ``value`` is what the model's ``score``
    head gives at each sequence's last real token, and the paths with the constant add up to it."""
    model = classifier(family)
    ids = torch.randint(1, 50, (2, 7))
    mask = torch.ones_like(ids)
    ids[1, 5:], mask[1, 5:] = 0, 0  # the pad token, as the head finds the last real token by it
    stack, _ = capture_huggingface_residual(model, input_ids=ids, attention_mask=mask)
    readout = pk.logit_diff(model, 2, 0)
    assert readout.labels == ("class logit[2] − class logit[0]",)
    logits = logits_in_float64(model, input_ids=ids, attention_mask=mask)
    for batch in (0, 1):
        result = pk.path_attribution(stack, readout, batch=batch)
        expected = (logits[batch, 2] - logits[batch, 0]).reshape(1, 1)
        torch.testing.assert_close(result.value, expected, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(complete(result), result.value, rtol=1e-12, atol=1e-12)
    single = pk.logit(model, 1)
    assert single.labels == ("class logit[1]",)
    with pytest.raises(ValueError, match=r"^pathkernels\.logit: expected token to be a token id in \[0, 3\)"):
        pk.logit(model, 3)


@pytest.mark.parametrize("case", ["no mask", "a real pad id", "a mask that disagrees"])
def test_a_classifier_is_read_at_the_token_its_head_reads(case):
    """The score head reads the rightmost token whose id is not the pad id, whatever the mask says:
    right-padded ids without a mask, and a real last token whose id is the pad id, read there (the
    last real token by the mask was another, silently); a mask that marks that token as padding is
    refused, naming the token."""
    model = classifier("llama")
    ids = torch.randint(1, 50, (1, 7))
    mask = torch.ones_like(ids)
    if case == "no mask":
        ids[0, 5:], inputs = 0, {"input_ids": ids}  # pooled: token 4; the stack sees 7 real tokens
    elif case == "a real pad id":
        ids[0, 6], inputs = 0, {"input_ids": ids, "attention_mask": mask}  # pooled: token 5
    else:
        mask[0, 4:] = 0
        ids[0, 5:], inputs = 0, {"input_ids": ids, "attention_mask": mask}  # pooled: token 4, masked
    stack, capture = capture_huggingface_residual(model, **inputs)
    readout = pk.logit_diff(model, 2, 0)
    if case == "a mask that disagrees":
        with pytest.raises(ValueError, match=r"the classifier reads batch element 0 at token 4 .* marks as padding"):
            pk.path_attribution(stack, readout)
        return
    expected_token = {"no mask": 4, "a real pad id": 5}[case]
    assert capture.pooled_token.tolist() == [expected_token]
    logits = logits_in_float64(model, **inputs)  # [1, classes]: read at the pooled token
    result = pk.path_attribution(stack, readout)
    assert result.positions.tolist() == [expected_token]
    torch.testing.assert_close(result.value, (logits[0, 2] - logits[0, 0]).reshape(1, 1), rtol=1e-10, atol=1e-10)
    probe = pk.path_attribution(stack, readout.directions[0])  # a direction reads the last real token
    assert probe.positions.tolist() == [6]


def test_a_pooled_classifier_is_refused_by_name():
    model = classifier("bert")
    _, capture = capture_huggingface_residual(model, input_ids=torch.randint(1, 50, (1, 5)))
    assert capture.pooled_token is None  # its pooler reads the first token, not a score head's token
    with pytest.raises(ValueError, match=r"^pathkernels\.logit_diff: BertForSequenceClassification classifies"):
        pk.logit_diff(model, 1, 0)


# --- TransformerLens options ---------------------------------------------------------------------


def tl_model(**extra):
    from test_real_models_transformer_lens import tl_model as build

    return build(**extra)


@pytest.mark.parametrize("normalization_type", ["LN", "LNPre"])
def test_transformer_lens_final_rms_reads_out_through_an_rms_norm(normalization_type):
    """``final_rms``: LayerNorm blocks, an RMSNorm (no centring, no β) before the unembedding."""
    model = tl_model(normalization_type=normalization_type, final_rms=True)
    tokens = torch.randint(0, 50, (2, 9))
    stack, capture = pk.adapters.capture_transformer_lens_residual(model, tokens)
    assert capture.centred and not capture.final_centred
    result = pk.path_attribution(stack, pk.logit_diff(model, 3, 7), batch=1, positions=[8, 2])
    with torch.no_grad():
        logits = model(tokens)[1].double()
    expected = (logits[[8, 2], 3] - logits[[8, 2], 7])[:, None]
    tolerance = 1e-6 if pk.testing.transformer_lens_major() >= 4 else 1e-10  # 4.x's native RMSNorm: float32
    torch.testing.assert_close(result.value, expected, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(complete(result), result.value, rtol=1e-12, atol=1e-12)


def test_transformer_lens_soft_capped_logits_are_attributed_before_the_cap():
    """``output_logits_soft_cap``: the model gives ``c · tanh(z / c)``; the attribution is of the
    linear ``z``, labelled so, and equals the model's ``z`` (recovered as ``c · atanh(logit / c)``)."""
    cap = 5.0
    model = tl_model(output_logits_soft_cap=cap)
    tokens = torch.randint(0, 50, (2, 9))
    stack, _ = pk.adapters.capture_transformer_lens_residual(model, tokens)
    readout = pk.logit_diff(model, 3, 7)
    assert readout.labels == ("logit[3] − logit[7] (before the logit soft cap)",)
    assert pk.logit(model, 3).labels == ("logit[3] (before the logit soft cap)",)
    result = pk.path_attribution(stack, readout, batch=1, positions=[8, 2])
    with torch.no_grad():
        capped = model(tokens)[1].double()
    assert float(capped.abs().max()) < 0.9 * cap  # atanh stays well conditioned
    uncapped = cap * torch.atanh(capped / cap)
    expected = (uncapped[[8, 2], 3] - uncapped[[8, 2], 7])[:, None]
    tolerance = 1e-6 if pk.testing.transformer_lens_major() >= 4 else 1e-10
    torch.testing.assert_close(result.value, expected, rtol=tolerance, atol=tolerance)
    assert not torch.allclose(result.value, (capped[[8, 2], 3] - capped[[8, 2], 7])[:, None], rtol=1e-3)


TL_BLOCKS = {
    "norms before and after each sublayer": {"normalization_type": "RMS", "use_normalization_before_and_after": True},
    "parallel attention and MLP (LayerNorm)": {"parallel_attn_mlp": True},
    "parallel attention and MLP (RMSNorm)": {"parallel_attn_mlp": True, "normalization_type": "RMS"},
    "post-norm blocks (OLMo 2)": {"normalization_type": "RMS", "original_architecture": "Olmo2ForCausalLM"},
}


@pytest.mark.parametrize("case", TL_BLOCKS)
def test_transformer_lens_blocks_with_norms_after_or_beside_their_sublayers(case):
    """Gemma-2's norms after each sublayer (an RMSNorm's D' and Γ' around every head's term), parallel
    blocks (the MLP reads the block's input) and OLMo 2's post-norm blocks: the paths sum to the
    stream, and the logit difference is the model's (4.x's native model builds the plain blocks for
    what it does not know; the capture reads what the blocks are)."""
    model = tl_model(**TL_BLOCKS[case])
    tokens = torch.randint(0, 50, (2, 9))
    stack, capture = pk.adapters.capture_transformer_lens_residual(model, tokens)
    error = (stack.length_sums().sum(0) - capture.residual).abs().max() / capture.residual.abs().max()
    assert error < 1e-12, error
    result = pk.path_attribution(stack, pk.logit_diff(model, 3, 7), batch=1, positions=[8, 2])
    with torch.no_grad():
        logits = model(tokens)[1].double()
    expected = (logits[[8, 2], 3] - logits[[8, 2], 7])[:, None]
    tolerance = 1e-6 if pk.testing.transformer_lens_major() >= 4 else 1e-10  # 4.x's native RMSNorm: float32
    torch.testing.assert_close(result.value, expected, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(complete(result), result.value, rtol=1e-12, atol=1e-12)


# --- TransformerBridges over Hugging Face Gemma models -------------------------------------------


def gemma(version: int, dtype: torch.dtype):
    """A tiny Gemma (``version`` 1) or Gemma-2 causal LM, its norm weights (stored as ``γ − 1``)
    ~ N(0, 0.3²), so that ``γ = 1 + w`` and ``w`` differ everywhere."""
    tf = transformers
    config_class, model_class = (
        (tf.GemmaConfig, tf.GemmaForCausalLM) if version == 1 else (tf.Gemma2Config, tf.Gemma2ForCausalLM)
    )
    config = config_class(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=50,
    )
    model = model_class(config).to(dtype)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                parameter.normal_(0, 0.3)
    return model.eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_transformer_bridge_over_a_gemma_reads_its_offset_norms(dtype, tmp_path):
    """Gemma's norms compute ``x̂ · (1 + w)``: read as ``x̂ · w`` the value was 47 % off and the paths
    did not sum to it. Float64: exact, against the model's forward pass with its float32 steps (the
    softmax, the norms) in float64."""
    from test_adapters import bridge_over

    model = gemma(1, dtype)
    original = copy.deepcopy(model)  # the bridge wraps the modules of the model it is given
    bridge = bridge_over(model, tmp_path, dtype=dtype)
    ids = torch.randint(0, 40, (2, 7))
    stack, capture = pk.adapters.capture_transformer_lens_residual(bridge, ids)
    result = pk.path_attribution(stack, pk.logit_diff(bridge, 3, 7), batch=1, positions=[6, 3])
    if dtype == torch.float64:
        logits, tolerance = logits_in_float64(original, input_ids=ids)[1], 1e-10
        torch.testing.assert_close(complete(result), result.value, rtol=1e-12, atol=1e-12)
    else:
        with torch.no_grad():
            logits, tolerance = original(ids).logits.double()[1], 1e-4
        torch.testing.assert_close(complete(result), result.value, rtol=1e-6, atol=1e-6)
    expected = (logits[[6, 3], 3] - logits[[6, 3], 7])[:, None]
    torch.testing.assert_close(result.value, expected, rtol=tolerance, atol=tolerance)
    error = (stack.length_sums().sum(0) - capture.residual).abs().max() / capture.residual.abs().max()
    assert error < (1e-10 if dtype == torch.float64 else 1e-5), error


@pytest.mark.parametrize("name", ["gemma2", "olmo2"])
def test_a_transformer_bridge_over_a_model_with_norms_after_its_sublayers(name, tmp_path):
    """Gemma-2 (norms before and after each sublayer, soft-capped logits) and OLMo 2 (norms after
    only), float64, through a bridge: exact against the model's float64 forward (before the cap)."""
    from test_adapters import bridge_over

    model = family_model(name)
    reference = uncapped(model)  # the bridge wraps the modules of the model it is given
    bridge = bridge_over(model, tmp_path, dtype=torch.float64)
    ids = torch.randint(0, 40, (2, 6))
    stack, capture = pk.adapters.capture_transformer_lens_residual(bridge, ids)
    assert capture.attention_output_scale is not None
    error = (stack.length_sums().sum(0) - capture.residual).abs().max() / capture.residual.abs().max()
    assert error < 1e-12, error
    result = pk.path_attribution(stack, pk.logit_diff(bridge, 3, 7), batch=1)
    logits = logits_in_float64(reference, input_ids=ids)[1]
    torch.testing.assert_close(result.value, (logits[-1, 3] - logits[-1, 7]).reshape(1, 1), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(complete(result), result.value, rtol=1e-12, atol=1e-12)


def test_the_soft_cap_of_a_hugging_face_config_is_read():
    config = transformers.Gemma2Config(final_logit_softcapping=30.0)
    holder = type("Holder", (), {"config": config})()
    assert math.isclose(pk.analysis.attribution.logit_soft_cap(holder), 30.0)


# --- Direct Hugging Face capture of more families ------------------------------------------------

SMALL = dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=32, intermediate_size=64, vocab_size=50)


def family_configs():
    """Every family the capture reads beyond GPT-2, BERT, ViT and Llama, as ``(config, model class)``
    builders: parallel blocks (GPT-NeoX, GPT-J, Phi, Falcon), Gemma's ``(1 + w)`` norms and scaled
    embeddings, norms after each sublayer (Gemma-2 and -3, OLMo 2), sliding windows, query/key norms
    (Qwen3, Gemma-3, OLMo 2), parameter-free LayerNorms (OLMo), OPT pre- and post-norm with its
    projections, multi-query and grouped attention (Falcon)."""
    tf = transformers
    gqa = dict(SMALL, num_key_value_heads=2, head_dim=8)
    falcon = dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=32, vocab_size=50)
    opt = dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=32, ffn_dim=64, vocab_size=50)
    return {
        "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**gqa)),
        "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(**gqa)),
        "gemma2": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(**gqa)),
        "gemma2-sliding-biased": lambda: tf.Gemma2ForCausalLM(
            tf.Gemma2Config(**gqa, sliding_window=3, attention_bias=True)
        ),
        "gemma3": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**gqa, sliding_window=3)),
        "olmo": lambda: tf.OlmoForCausalLM(tf.OlmoConfig(**SMALL)),
        "olmo2": lambda: tf.Olmo2ForCausalLM(tf.Olmo2Config(**SMALL, attention_bias=True)),
        "gpt_neox": lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**SMALL, rotary_pct=0.5)),
        "gpt_neox-sequential": lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**SMALL, use_parallel_residual=False)),
        "gptj": lambda: tf.GPTJForCausalLM(
            tf.GPTJConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=50, rotary_dim=4, n_positions=32)
        ),
        "phi": lambda: tf.PhiForCausalLM(tf.PhiConfig(**SMALL, partial_rotary_factor=0.5)),
        "falcon": lambda: tf.FalconForCausalLM(tf.FalconConfig(**falcon)),
        "falcon-sequential": lambda: tf.FalconForCausalLM(
            tf.FalconConfig(**falcon, parallel_attn=False, multi_query=False)
        ),
        "falcon-grouped": lambda: tf.FalconForCausalLM(
            tf.FalconConfig(**falcon, new_decoder_architecture=True, num_kv_heads=2)
        ),
        "opt": lambda: tf.OPTForCausalLM(tf.OPTConfig(**opt, word_embed_proj_dim=32)),
        "opt-post-projected": lambda: tf.OPTForCausalLM(
            tf.OPTConfig(**opt, word_embed_proj_dim=16, do_layer_norm_before=False)
        ),
    }


FAMILIES = list(family_configs())


def family_model(name: str, dtype=torch.float64):
    """A tiny model of family ``name``: weights ×5 so that heads attend sharply and matter, every
    bias ~ N(0, 0.3²), every norm's γ = 1 + N(0, 0.3²) (Gemma's stored ``γ − 1`` ~ N(0, 0.3²))."""
    torch.manual_seed(0)
    return sharpened(family_configs()[name]()).to(dtype)


def sharpened(model):
    """``model`` in float64 and eval mode, randomised in place as :func:`family_model` describes."""
    model = model.to(torch.float64).eval()
    gemma_style = type(model).__name__.startswith("Gemma")
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            is_norm = "norm" in parameter_name.lower() or parameter_name.split(".")[-2].startswith("ln")
            if parameter_name.endswith("bias"):
                parameter.normal_(0, 0.3)
            elif is_norm and parameter_name.endswith("weight"):
                parameter.normal_(0, 0.3).add_(0 if gemma_style else 1)
            elif parameter.dim() == 2:
                parameter.mul_(5)
    return model


def uncapped(model):
    """A copy of ``model`` without its final logit soft cap (Gemma-2's): the reference of a pre-cap
    attribution."""
    model = copy.deepcopy(model)
    if getattr(model.config, "final_logit_softcapping", None) is not None:
        model.config.final_logit_softcapping = None
    return model


@pytest.mark.parametrize("name", FAMILIES)
def test_a_family_is_the_sum_of_its_paths_and_reads_out_its_logits(name):
    """Float64: the paths sum to the stream entering the final norm (1e-12), the readout is the
    model's logit difference computed in float64 throughout (1e-10; before the soft cap for
    Gemma-2), and the paths with the constant add up to it (1e-12)."""
    model = family_model(name)
    ids = torch.randint(0, 50, (2, 7))
    stack, capture = capture_huggingface_residual(model, input_ids=ids)
    sums = stack.length_sums()
    error = (sums.sum(0) - capture.residual).abs().max() / capture.residual.abs().max()
    assert error < 1e-12, error
    assert all(float(s.abs().max()) > 1e-3 for s in sums[: stack.num_layers + 1])  # every length carries weight
    readout = pk.logit_diff(model, 3, 7)
    result = pk.path_attribution(stack, readout, batch=1, positions=[6, 2])
    logits = logits_in_float64(uncapped(model), input_ids=ids)[1]
    expected = (logits[[6, 2], 3] - logits[[6, 2], 7])[:, None]
    torch.testing.assert_close(result.value, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(complete(result), result.value, rtol=1e-12, atol=1e-12)
    capped = pk.analysis.attribution.logit_soft_cap(model) is not None
    assert ("before the logit soft cap" in readout.labels[0]) == capped


@pytest.mark.parametrize("name", ["gemma2", "gpt_neox", "falcon-grouped", "opt", "olmo2"])
def test_a_float32_family_is_decomposed_to_float32s_precision(name):
    model = family_model(name, torch.float32)
    ids = torch.randint(0, 50, (2, 7))
    stack, capture = capture_huggingface_residual(model, input_ids=ids)
    error = (stack.length_sums().sum(0) - capture.residual).abs().max() / capture.residual.abs().max()
    assert error < 1e-5, error
    result = pk.path_attribution(stack, pk.logit_diff(model, 3, 7), batch=0)
    with torch.no_grad():
        logits = uncapped(model)(input_ids=ids).logits.double()[0]
    expected = (logits[-1, 3] - logits[-1, 7]).reshape(1, 1)
    torch.testing.assert_close(result.value, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["gemma2-sliding-biased", "gpt_neox", "phi", "falcon", "opt", "olmo2"])
def test_a_left_padded_batch_reads_as_each_sequence_alone(name):
    model = family_model(name)
    long = torch.randint(1, 50, (1, 7))
    short = torch.randint(1, 50, (1, 4))
    ids = torch.cat([long, torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1)])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    stack, _ = capture_huggingface_residual(model, input_ids=ids, attention_mask=mask)
    alone, _ = capture_huggingface_residual(model, input_ids=short)
    readout = pk.logit_diff(model, 3, 7)
    padded = pk.path_attribution(stack, readout, batch=1)
    single = pk.path_attribution(alone, readout)
    torch.testing.assert_close(padded.value, single.value, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(padded.by_source_length, single.by_source_length, rtol=1e-9, atol=1e-10)


def literal_pre_norm_terms(stack, capture, below: int | None = None) -> dict:
    """Every path's term ``[n, d]`` of a pre-norm model's first sequence, written from the design's
    matrices: a head of layer l is the token map ``D'_l A_h D_l`` and the feature map
    ``C Γ_l W_V W_O Γ'_l`` (``D'``, ``Γ'``: the norm on the attention's output, else I); the sources
    are the embedding, per layer the constant rows ``D' (Σ_h (A_h 1)(βᵀ W_V + b_Vᵀ) W_O + 1 b_Oᵀ) Γ'``
    and the MLP's output. Keys: ``(heads per layer, source name)``. ``below``: only the layers
    under it (the paths of the stream entering layer ``below``)."""
    layers, heads, d = stack.num_layers if below is None else below, stack.num_heads, stack.d_model
    n = stack.attn.shape[-1]
    attn, w_v, w_o = stack.attn[0].double(), stack.w_v.double(), stack.w_o.double()
    centre = torch.eye(d, dtype=torch.float64) - (1.0 / d if capture.centred else 0.0)
    out_scale = torch.ones(layers, n, dtype=torch.float64)
    out_gain = torch.ones(layers, d, dtype=torch.float64)
    if capture.attention_output_scale is not None:
        out_scale, out_gain = capture.attention_output_scale[0], capture.attention_output_weight

    def token_map(layer, head):
        return torch.diag(out_scale[layer]) @ attn[layer, head] @ torch.diag(capture.norm_scale[0, layer, 0])

    def feature_map(layer, head):
        into = centre @ torch.diag(capture.norm_weight[layer, 0]) @ w_v[layer, head]
        return into @ w_o[layer, head] @ torch.diag(out_gain[layer])

    sources = [(0, "embedding", capture.embedding[0])]
    for layer in range(layers):
        rows = sum(
            attn[layer, h].sum(-1, keepdim=True)
            @ ((capture.norm_bias[layer, 0] @ w_v[layer, h] + capture.value_bias[layer, h]) @ w_o[layer, h])[None]
            for h in range(heads)
        )
        rows = torch.diag(out_scale[layer]) @ (rows + capture.output_bias[layer]) @ torch.diag(out_gain[layer])
        sources.append((layer + 1, f"L{layer} attention bias", rows))
        sources.append((layer + 1, f"L{layer} MLP", capture.mlp_out[0, layer]))
    out = {}
    for first_layer, name, source in sources:
        for choice in itertools.product([-1, *range(heads)], repeat=layers - first_layer):
            term = source
            for layer, head in zip(range(first_layer, layers), choice):
                if head >= 0:
                    term = token_map(layer, head) @ term @ feature_map(layer, head)
            out[((-1,) * first_layer + choice, name)] = term
    return out


def literal_pre_norm_attributions(stack, capture, position: int, u: torch.Tensor) -> dict:
    """Every path's attribution from its literal term: ``r Y_p v`` with the frozen final norm's
    ``r = e_t / σ_t`` and ``v = C_f Γ_f u``."""
    d, n = stack.d_model, stack.attn.shape[-1]
    r = torch.zeros(n, dtype=torch.float64)
    r[position] = capture.final_scale[0, position]
    centre = torch.eye(d, dtype=torch.float64) - (1.0 / d if capture.final_centred else 0.0)
    v = centre @ torch.diag(capture.final_weight) @ u
    return {key: float(r @ term @ v) for key, term in literal_pre_norm_terms(stack, capture).items()}


@pytest.mark.parametrize("name", [f for f in FAMILIES if f != "opt-post-projected"])
def test_each_path_of_a_family_is_its_literal_term(name):
    model = family_model(name)
    stack, capture = capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (1, 5)))
    u = torch.randn(stack.d_model, dtype=torch.float64)
    result = pk.path_attribution(stack, u, positions=3)
    expected = literal_pre_norm_attributions(stack, capture, 3, u)
    got = {
        (tuple(p.tolist()), result.source_names[int(s)]): float(a[0, 0])
        for p, s, a in zip(result.paths, result.path_sources, result.attribution)
    }
    assert got.keys() == expected.keys()
    scale = max(abs(value) for value in expected.values())
    for key, value in expected.items():
        assert math.isclose(got[key], value, rel_tol=1e-10, abs_tol=1e-12 * scale), (key, got[key], value)


def test_the_paths_of_a_post_norm_opt_are_their_literal_terms():
    """OPT-350m's layout (norms after each sublayer, project_in and project_out): every path written
    literally from the design's matrices (the post-norm enumeration of BERT's test), summed by length,
    against the stack's length sums; and those against the model's last hidden state."""
    from test_real_models import enumerated_post_norm_sums

    model = family_model("opt-post-projected")
    stack, capture = capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (1, 5)))
    assert capture.layout == "post"
    expected = enumerated_post_norm_sums(stack, capture)
    sums = stack.length_sums()[:, 0]
    scale = float(expected.abs().max())
    torch.testing.assert_close(sums, expected, rtol=1e-12, atol=1e-12 * scale)
    torch.testing.assert_close(sums.sum(0), capture.residual[0], rtol=1e-12, atol=1e-12 * scale)


@pytest.mark.parametrize("name", ["gemma2", "gpt_neox", "falcon-grouped", "olmo2", "opt-post-projected"])
def test_the_top_paths_of_a_family_are_those_of_enumeration(name):
    from test_top_paths import assert_same_as_enumeration

    model = family_model(name)
    stack, _ = capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (1, 6)))
    assert_same_as_enumeration(stack, pk.logit_diff(model, 1, 2), 8)


def test_an_olmo_that_clips_its_values_is_refused_by_name():
    config = transformers.OlmoConfig(**SMALL, clip_qkv=8.0)
    with pytest.raises(ValueError, match=r"capture_huggingface_residual: OLMo with clip_qkv clamps its values"):
        capture_huggingface_residual(transformers.OlmoForCausalLM(config), input_ids=torch.randint(0, 50, (1, 4)))


# What TransformerLens cannot build or does not expose, by version: these must fail, and say so.
_BRIDGE_LIMITS = {
    "falcon-grouped": (None, "TransformerLens's bridge cannot split Falcon's grouped query-key-value projection"),
    "opt-post-projected": (r"post-norm blocks \(BERT's, OPT-350m's", None),
}
_BRIDGE_LIMITS_3 = {name: (r"gives no attention patterns", None) for name in ("gptj", "opt")}


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_through_a_transformer_lens_bridge(name, tmp_path):
    """Each family through a TransformerBridge over the Hugging Face model, float64: exact against
    the model's float64 forward, or refused by name where TransformerLens gives no patterns (3.x's
    GPT-J and OPT bridges) or the blocks are post-norm."""
    from test_adapters import bridge_over

    limits = {**_BRIDGE_LIMITS, **(_BRIDGE_LIMITS_3 if pk.testing.transformer_lens_major() == 3 else {})}
    refused, unbuildable = limits.get(name, (None, None))
    model = family_model(name)
    reference = uncapped(model)
    try:
        bridge = bridge_over(model, tmp_path, dtype=torch.float64)
    except RuntimeError:
        if unbuildable:
            pytest.xfail(unbuildable)
        raise
    assert unbuildable is None, f"TransformerLens now builds {name}: test it"
    ids = torch.randint(0, 40, (1, 6))
    if refused:
        with pytest.raises(ValueError, match=r"capture_transformer_lens_residual: .*" + refused):
            pk.adapters.capture_transformer_lens_residual(bridge, ids)
        return
    stack, capture = pk.adapters.capture_transformer_lens_residual(bridge, ids)
    error = (stack.length_sums().sum(0) - capture.residual).abs().max() / capture.residual.abs().max()
    assert error < 1e-12, error
    result = pk.path_attribution(stack, pk.logit_diff(bridge, 3, 7))
    logits = logits_in_float64(reference, input_ids=ids)[0]
    torch.testing.assert_close(result.value, (logits[-1, 3] - logits[-1, 7]).reshape(1, 1), rtol=1e-10, atol=1e-10)


def test_a_saved_model_is_loaded_with_the_head_it_was_saved_with(tmp_path):
    """A Llama with an untied LM head, saved: loaded as what it was saved as (the head was dropped,
    and the model refused), so that its own head reads out the attribution; a saved BERT masked LM
    keeps its LM head too (its logits are not linear: a probe direction reads it)."""
    config = transformers.LlamaConfig(**SMALL, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double().eval()
    model.save_pretrained(tmp_path / "llama")
    local = pk.adapters.load_local_model(tmp_path / "llama")
    assert type(local.model).__name__ == "LlamaForCausalLM" and local.pretrained
    assert torch.equal(local.model.lm_head.weight, model.lm_head.weight)
    ids = torch.randint(0, 50, (1, 6))
    stack, _ = capture_huggingface_residual(local.model, input_ids=ids)
    result = pk.path_attribution(stack, pk.logit_diff(local.model, 3, 7))
    logits = logits_in_float64(model, input_ids=ids)[0]
    torch.testing.assert_close(result.value, (logits[-1, 3] - logits[-1, 7]).reshape(1, 1), rtol=1e-10, atol=1e-10)
    bert = transformers.BertForMaskedLM(
        transformers.BertConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=32, intermediate_size=64)
    )
    bert.save_pretrained(tmp_path / "bert")
    assert type(pk.adapters.load_local_model(tmp_path / "bert").model).__name__ == "BertForMaskedLM"


@pytest.mark.parametrize("name", ["gemma2-sliding-biased", "falcon", "opt-post-projected"])
def test_the_term_vectors_of_chosen_paths(name):
    """pk.path_terms: every path's term sums to the stream; each term read out through the frozen
    final norm is its attribution (two computations); pre-norm terms equal their literal products;
    tokens and sources by name select; a padded token has none; bad paths are refused by name."""
    model = family_model(name)
    ids = torch.randint(1, 50, (2, 5))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    stack, capture = capture_huggingface_residual(model, input_ids=ids, attention_mask=mask)
    decomposition = pk.decompose(stack)
    for batch, real in ((0, [0, 1, 2, 3, 4]), (1, [2, 3, 4])):
        terms = decomposition.terms(batch=batch)
        assert terms.shape == (decomposition.paths.shape[0], len(real), stack.d_model)
        stream = capture.residual[batch][real]
        torch.testing.assert_close(terms.sum(0), stream, rtol=1e-12, atol=1e-12 * float(stream.abs().max()))
    chosen = decomposition.terms([0, 3, 5], batch=1, tokens=[2, 4])  # positions 2 and 4: real tokens 0 and 2
    torch.testing.assert_close(chosen, terms[[0, 3, 5]][:, [0, 2]], rtol=1e-12, atol=1e-15)
    attribution = pk.path_attribution(stack, pk.logit_diff(model, 3, 7), batch=0, positions=[4])
    final = capture.final_scale is not None
    direction = pk.logit_diff(model, 3, 7).directions[0]
    if final:
        direction = direction * capture.final_weight
        direction = direction - direction.mean() if capture.final_centred else direction
    picked = pk.path_terms(stack, attribution.paths, attribution.path_sources, tokens=[4])[:, 0]  # [M, d]
    scale = capture.final_scale[0, 4] if final else 1.0
    torch.testing.assert_close(scale * picked @ direction, attribution.attribution[:, 0, 0], rtol=1e-10, atol=1e-12)
    if capture.layout == "pre":
        literal = literal_pre_norm_terms(stack, capture)
        keys = list(literal)[::7]
        paths = torch.tensor([key[0] for key in keys])
        terms = pk.path_terms(stack, paths, [key[1] for key in keys], tokens=[-1, 0])
        for term, key in zip(terms, keys):
            torch.testing.assert_close(term, literal[key][[-1, 0]], rtol=1e-10, atol=1e-12)
    heads = torch.full((1, stack.num_layers), -1)
    heads[0, 0] = 1
    with pytest.raises(ValueError, match=r"^pathkernels\.path_terms: path 0 takes a head below its source \(L0 MLP\)"):
        pk.path_terms(stack, heads, "L0 MLP")
    with pytest.raises(ValueError, match=r"^pathkernels\.path_terms: expected tokens among the real positions"):
        pk.path_terms(stack, heads, "embedding", batch=1, tokens=[0])
    with pytest.raises(ValueError, match=r"^pathkernels\.path_terms: the terms of 1 paths on 5 tokens take"):
        pk.path_terms(stack, heads, "embedding", memory_budget=100)


@pytest.mark.parametrize("missing", ["multi_query", "query_key_value"])
def test_a_family_whose_modules_changed_is_refused_by_name_with_the_release(missing):
    """A module that lacks what the adapters read (as Falcon's ``_split_heads`` went in transformers
    5.25) is refused by name, with the installed and the tested releases: never a raw AttributeError."""
    from pathkernels.adapters.huggingface import TESTED_TRANSFORMERS

    model = family_model("falcon")
    delattr(model.transformer.h[1].self_attention, missing)
    message = (
        r"(from_huggingface|capture_huggingface_residual): this 'falcon' model's modules lack what pathkernels "
        rf"reads \(.*{missing}.*\); "
        rf"transformers {re.escape(transformers.__version__)} is installed and pathkernels is tested with "
        rf"transformers {TESTED_TRANSFORMERS}"
    )
    for capture in (pk.adapters.from_huggingface, capture_huggingface_residual):
        with pytest.raises(ValueError, match=message):
            capture(model, input_ids=torch.randint(0, 50, (1, 5)))


def test_a_modeling_module_without_its_eager_attention_is_refused_with_the_release(monkeypatch):
    """The score side reads queries and keys from a family's ``eager_attention_forward``; a release
    without it is refused by name, with the installed transformers."""
    modeling = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    model = family_model("qwen3")
    monkeypatch.delattr(modeling, "eager_attention_forward")
    message = (
        r"modeling_qwen3 has no eager_attention_forward to read the queries and keys from \(transformers "
        + re.escape(transformers.__version__)
    )
    with pytest.raises(ValueError, match=message):
        capture_huggingface_residual(model, input_ids=torch.randint(0, 50, (1, 5)), query_key=True)
