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
import math

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


def test_a_pooled_classifier_is_refused_by_name():
    model = classifier("bert")
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


def test_transformer_lens_norms_after_each_sublayer_are_refused_by_name():
    model = tl_model(normalization_type="RMS", use_normalization_before_and_after=True)
    if not getattr(model.cfg, "use_normalization_before_and_after", False):
        pytest.skip("this TransformerLens ignores use_normalization_before_and_after")
    with pytest.raises(ValueError, match=r"capture_transformer_lens_residual: .*norm on each sublayer's output"):
        pk.adapters.capture_transformer_lens_residual(model, torch.randint(0, 50, (1, 4)))


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


def test_a_transformer_bridge_over_a_gemma2_is_refused_by_name(tmp_path):
    """Gemma-2 normalises each sublayer's output as well as its input (``ln1_post``, ``ln2_post``)."""
    from test_adapters import bridge_over

    bridge = bridge_over(gemma(2, torch.float32), tmp_path)
    with pytest.raises(ValueError, match=r"capture_transformer_lens_residual: .*norm on each sublayer's output"):
        pk.adapters.capture_transformer_lens_residual(bridge, torch.randint(0, 40, (1, 4)))


def test_the_soft_cap_of_a_hugging_face_config_is_read():
    config = transformers.Gemma2Config(final_logit_softcapping=30.0)
    holder = type("Holder", (), {"config": config})()
    assert math.isclose(pk.analysis.attribution.logit_soft_cap(holder), 30.0)
