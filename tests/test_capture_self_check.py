"""The capture checks itself against the model's own, unmodified forward pass (pathkernels.adapters.
self_check): every family passes well within the tolerance, and each capture that differed from
the model (Falcon's ALiBi added twice, a mask with a hole given other positions, a TransformerLens
norm read with the wrong gain, clamped values) now reproduces the model's own numbers or is refused
by name; a capture made wrong on purpose is refused by the check."""

import warnings

import pytest
import torch

import pathkernels as pk
from pathkernels.adapters.residual import capture_huggingface_residual, capture_transformer_lens_residual
from pathkernels.adapters.self_check import check_tolerance

transformers = pytest.importorskip("transformers")

from test_model_families import FAMILIES, family_model  # noqa: E402
from test_real_models import bert, gpt2, llama  # noqa: E402

_REFUSED = r"does not reproduce the model's own forward pass on the same inputs"


def model_logits(model, **inputs) -> torch.Tensor:
    """``model(**inputs).logits`` as a user calls it: eval mode, no gradients, nothing changed."""
    model.eval()
    with torch.no_grad():
        return model(**inputs).logits.double()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", [*FAMILIES, "gpt2", "llama", "bert"])
def test_every_family_checks_itself_well_within_the_tolerance(name, dtype):
    """Each family's capture, weights ×5 with random biases and norm gains, against its own forward:
    the stream and the logits within a tenth of the tolerance (the measured margin); check=False
    runs no check."""
    model = {"gpt2": gpt2, "llama": llama, "bert": bert}[name]() if name in ("gpt2", "llama", "bert") else None
    model = family_model(name, dtype) if model is None else model.to(dtype)
    ids = torch.randint(0, 50, (2, 7))
    _, capture = capture_huggingface_residual(model, input_ids=ids)
    check = capture.check
    assert check.tolerance == check_tolerance(dtype)
    assert check.stream_error < check.tolerance / 10, check
    assert check.logits_error is None or check.logits_error < check.tolerance / 10, check
    assert (check.logits_error is None) == (name in ("bert", "opt-post-projected"))  # no linear LM readout
    _, unchecked = capture_huggingface_residual(model, input_ids=ids, check=False)
    assert unchecked.check is None


def falcon_with_alibi(**extra):
    torch.manual_seed(0)
    config = transformers.FalconConfig(
        num_hidden_layers=2, num_attention_heads=4, hidden_size=32, vocab_size=50, alibi=True, **extra
    )
    model = transformers.FalconForCausalLM(config).double().eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(5) if parameter.dim() == 2 else parameter.normal_(0, 0.3)
    return model


def _alibi_added_twice(module, args, kwargs):
    """A pre-hook that adds the position bias a Falcon folds into its mask a second time in its
    eager path (the one that gives the patterns), as that path did before transformers 5.25; the
    masked entries are kept."""
    mask = kwargs["attention_mask"]
    if module.config._attn_implementation != "eager":
        return None
    return args, {**kwargs, "attention_mask": torch.where(mask > torch.finfo(mask.dtype).min / 2, 2 * mask, mask)}


@pytest.mark.parametrize("extra", [{}, {"parallel_attn": False, "multi_query": False}])
def test_falcon_with_alibi_is_captured_as_its_normal_forward_computes_it(extra):
    """Falcon folds ALiBi into the attention mask, and its eager path (the one that gives the
    patterns) added it again before transformers 5.25: the paths summed exactly to logits 4e-2 off
    the model's. Now the attribution is the model's own logit, padded batches included; with the
    bias added twice (by hand, in every release) the check refuses the capture."""
    model = falcon_with_alibi(**extra)
    ids = torch.randint(0, 50, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0  # right padding: ALiBi's positions come from the mask
    stack, capture = capture_huggingface_residual(model, input_ids=ids, attention_mask=mask)
    logits = model_logits(model, input_ids=ids, attention_mask=mask)
    for batch, position in ((0, 6), (1, 4)):
        result = pk.path_attribution(stack, pk.logit_diff(model, 3, 7), batch=batch, positions=position)
        expected = logits[batch, position, 3] - logits[batch, position, 7]
        torch.testing.assert_close(result.value, expected.reshape(1, 1), rtol=1e-10, atol=1e-10)
    assert capture.check.logits_error < 1e-12
    attention = [block.self_attention for block in model.transformer.h]
    hooks = [module.register_forward_pre_hook(_alibi_added_twice, with_kwargs=True) for module in attention]
    refused = r"capture_huggingface_residual: the capture of this falcon model " + _REFUSED
    try:
        with pytest.raises(ValueError, match=refused):
            capture_huggingface_residual(model, input_ids=ids)
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2", "llama"])
def test_a_mask_with_a_hole_keeps_the_models_own_positions(make):
    """A padding token among the real ones (not left padding): the positions are the model's own, so
    the attribution is ``model(**inputs)``'s logit (rebuilt as cumsum(mask) − 1 they were 21–32 %
    off), and no positions warning is given."""
    model = make().double().eval()  # eval: no dropout warning (the capture runs in eval mode either way)
    ids = torch.randint(1, 50, (2, 8))
    mask = torch.ones_like(ids)
    mask[0, 3] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stack, _ = capture_huggingface_residual(model, input_ids=ids, attention_mask=mask)
    logits = model_logits(model, input_ids=ids, attention_mask=mask)
    result = pk.path_attribution(stack, pk.logit_diff(model, 3, 7), positions=[7, 5])
    expected = (logits[0, [7, 5], 3] - logits[0, [7, 5], 7])[:, None]
    # Within Llama's float32 rotary angles: up to 3.7e-7 of the logits' scale over 40 seeds (1.5e-6
    # absolute, beyond the 1e-6 once allowed); positions rebuilt were 21–32 % off.
    scale = float(logits[0].abs().max())
    torch.testing.assert_close(result.value, expected, rtol=0, atol=1e-5 * scale)


def test_left_padding_rebuilds_the_positions_and_says_so():
    """Left padding: positions counted from each row's first real token, as generate gives them (the
    row reads as it does alone), with a warning naming the rows and how to have the model's own;
    given position_ids are used as they are, silently, and the check holds either way."""
    model = gpt2().double().eval()
    ids = torch.randint(1, 50, (3, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    with pytest.warns(UserWarning, match=r"capture_huggingface_residual: the left-padded row\(s\) 1 get positions"):
        stack, capture = capture_huggingface_residual(model, input_ids=ids, attention_mask=mask)
    alone, _ = capture_huggingface_residual(model, input_ids=ids[1:2, 2:])
    readout = pk.logit_diff(model, 3, 7)
    torch.testing.assert_close(
        pk.path_attribution(stack, readout, batch=1).value,
        pk.path_attribution(alone, readout).value,
        rtol=1e-10,
        atol=0,
    )
    own = torch.arange(6).expand(3, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stack, capture = capture_huggingface_residual(model, input_ids=ids, attention_mask=mask, position_ids=own)
    logits = model_logits(model, input_ids=ids, attention_mask=mask)  # the model's own positions
    result = pk.path_attribution(stack, readout, batch=1)
    torch.testing.assert_close(result.value, (logits[1, -1, 3] - logits[1, -1, 7]).reshape(1, 1), rtol=1e-10, atol=0)


def test_a_capture_that_differs_from_the_model_is_refused_with_both_differences(monkeypatch):
    """A capture made wrong on purpose (every norm's gain read 1 % high): refused by name with the
    stream's and the logits' differences; check=False keeps it."""
    from pathkernels.adapters import residual

    model = llama().double()
    ids = torch.randint(0, 50, (1, 6))
    gain = residual._gain
    monkeypatch.setattr(residual, "_gain", lambda *args: gain(*args) * 1.01)
    with pytest.raises(ValueError, match=r"this llama model " + _REFUSED + r": the sum of its paths is .* its logits"):
        capture_huggingface_residual(model, input_ids=ids)
    _, capture = capture_huggingface_residual(model, input_ids=ids, check=False)
    assert capture.check is None
    with pytest.raises(TypeError, match=r"capture_huggingface_residual: expected check to be True or False"):
        capture_huggingface_residual(model, input_ids=ids, check="yes")


transformer_lens = pytest.importorskip("transformer_lens")


def test_transformer_lens_clip_qkv_is_refused_by_name():
    """clip_qkv clamps queries, keys and values: a head is not linear in its input (the paths left 26 %
    of the logits unenumerated). Refused by name, as Hugging Face OLMo's is."""
    from test_real_models_transformer_lens import tl_model

    model = tl_model("LN", clip_qkv=0.5) if pk.testing.transformer_lens_major() == 3 else tl_model("LN")
    if pk.testing.transformer_lens_major() != 3:
        model.cfg.clip_qkv = 0.5
    with pytest.raises(ValueError, match=r"capture_transformer_lens_residual: clip_qkv=0.5 clamps"):
        capture_transformer_lens_residual(model, torch.randint(0, 50, (1, 6)))


def test_a_transformer_lens_bridge_with_offset_flags_reads_the_gain_its_norms_compute():
    """A native TransformerBridge built with rmsnorm_uses_offset=True flags its norms as computing
    ``x̂ · (1 + w)`` while they compute ``x̂ · w``: read from the flag the value was twice the model's.
    The gain is read from the norm's own output: the attribution is the model's logit and the check
    holds."""
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    config = dict(n_layers=2, d_model=32, n_ctx=16, d_head=8, n_heads=4, d_mlp=64, act_fn="gelu", d_vocab=50)
    torch.manual_seed(0)
    model = TransformerBridge.boot_native(
        TransformerBridgeConfig(**config, normalization_type="RMS", rmsnorm_uses_offset=True, dtype=torch.float64),
        dtype=torch.float64,
    )
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.split(".")[-1] in ("w", "weight") and ("ln" in name or "norm" in name):
                parameter.uniform_(0.5, 1.5)
    tokens = torch.randint(0, 50, (1, 6))
    stack, capture = capture_transformer_lens_residual(model, tokens)
    with torch.no_grad():
        logits = model(tokens).double()
    result = pk.path_attribution(stack, model.W_U[:, 3] - model.W_U[:, 7])
    expected = (logits[0, -1, 3] - logits[0, -1, 7]) - (
        0.0 if getattr(model, "b_U", None) is None else float(model.b_U.detach()[3] - model.b_U.detach()[7])
    )
    torch.testing.assert_close(result.value, expected.reshape(1, 1), rtol=1e-6, atol=1e-6)  # 4.x's float32 norms
    assert capture.check.logits_error < 1e-5


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "gemma2", "opt-post-projected"])
def test_the_path_sum_is_the_total_of_the_length_sums(name):
    """``path_sum`` (one stream through the frozen recurrence) is ``length_sums().sum(0)`` to float64's
    rounding: pre- and post-norm, norms after the sublayers, a padded batch."""
    model = {"gpt2": gpt2, "bert": bert, "llama": llama}.get(name, lambda: family_model(name))().double()
    ids = torch.randint(1, 50, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    stack, _ = capture_huggingface_residual(model, input_ids=ids, attention_mask=mask)
    total = stack.length_sums().sum(0)
    torch.testing.assert_close(stack.path_sum(), total, rtol=0, atol=1e-13 * float(total.abs().max()))
    with pytest.raises(ValueError, match=r"AttentionStack.path_sum: expected a stack with a residual_capture"):
        pk.adapters.from_huggingface(model, input_ids=ids).path_sum()


def test_an_opt_classifier_reads_its_class_logits_through_project_out():
    """OPT's score head reads project_out's output (word_embed_proj_dim wide): folded into the
    readout, the class-logit difference is the model's own (it failed with a shape message)."""
    torch.manual_seed(0)
    config = transformers.OPTConfig(
        num_hidden_layers=2, num_attention_heads=4, hidden_size=32, ffn_dim=64, vocab_size=50,
        word_embed_proj_dim=16, num_labels=3, pad_token_id=1,
    )  # fmt: skip
    model = transformers.OPTForSequenceClassification(config).double().eval()
    ids = torch.randint(2, 50, (2, 7))
    stack, capture = capture_huggingface_residual(model, input_ids=ids)
    assert capture.check.logits_error < 1e-12
    logits = model_logits(model, input_ids=ids)
    result = pk.path_attribution(stack, pk.logit_diff(model, 2, 0), batch=1)
    torch.testing.assert_close(result.value, (logits[1, 2] - logits[1, 0]).reshape(1, 1), rtol=1e-10, atol=1e-12)


def test_a_gemma2_classifier_is_not_labelled_as_capped():
    """Gemma-2's causal LM soft-caps its logits; its sequence classifier's score head does not."""
    config = transformers.Gemma2Config(
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8, hidden_size=16,
        intermediate_size=32, vocab_size=50, num_labels=3, pad_token_id=0,
    )  # fmt: skip
    classifier = transformers.Gemma2ForSequenceClassification(config)
    assert pk.analysis.attribution.logit_soft_cap(classifier) is None
    assert "soft cap" not in pk.logit_diff(classifier, 1, 2).labels[0]
    assert "before the logit soft cap" in pk.logit_diff(transformers.Gemma2ForCausalLM(config), 1, 2).labels[0]


def test_a_model_in_train_mode_with_active_dropout_is_warned_about():
    """A freshly built Hugging Face model is in train mode: its own calls apply dropout, the
    capture's do not. The capture says so (and the check, in eval mode, still holds); in eval mode,
    or with no dropout, nothing is said, and the user's mode is kept."""
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50))
    ids = torch.randint(0, 50, (1, 5))
    with pytest.warns(
        UserWarning, match=r"capture_huggingface_residual: the model is in train mode with active dropout"
    ):
        capture_huggingface_residual(model, input_ids=ids)
    assert model.training
    for quiet in (model.eval(), transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=50, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    ))):  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            capture_huggingface_residual(quiet, input_ids=ids)


def test_a_difference_that_is_not_a_number_is_refused():
    """NaN in either difference (a reconstruction with NaN rows) refuses the capture, whichever of
    the two it is: a maximum taken over them would have let a NaN second one pass."""
    from pathkernels.adapters.self_check import _refuse_if_beyond

    for stream, logits in ((float("nan"), 0.0), (0.0, float("nan")), (0.0, float("inf")), (1e-3, None)):
        with pytest.raises(ValueError, match=r"^where: the capture of this gpt2 model does not reproduce"):
            _refuse_if_beyond("gpt2", stream, logits, 2e-4, "where")
    _refuse_if_beyond("gpt2", 1e-5, None, 2e-4, "where")
    _refuse_if_beyond("gpt2", 1e-5, 1e-6, 2e-4, "where")


def test_weights_that_are_not_finite_are_named_whether_or_not_the_capture_is_checked():
    """A NaN in an MLP's weight (no padding) was blamed on a padded query, and check=False, the
    advice given, kept a capture whose every attribution was NaN. Now the capture is refused
    either way, naming the fields that hold NaN and the parameters; a finite model passes."""
    from pathkernels.adapters.self_check import _refuse_if_not_finite

    model = gpt2().double().eval()
    ids = torch.randint(0, 50, (1, 6))
    capture_huggingface_residual(model, input_ids=ids)
    with torch.no_grad():
        model.transformer.h[-1].mlp.c_fc.weight[0, 0] = float("nan")  # the last layer: no attention reads it
    last = len(model.transformer.h) - 1
    for check in (True, False):
        with pytest.raises(
            ValueError,
            match=r"^pathkernels\.adapters\.capture_huggingface_residual: the capture holds NaN or inf in mlp_out.*"
            rf"the model's parameters hold NaN or inf \(transformer\.h\.{last}\.mlp\.c_fc\.weight\)",
        ):
            capture_huggingface_residual(model, input_ids=ids, check=check)
    # Read by a later layer's attention, the NaN is found there, and not blamed on padding.
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"attention must be finite, .* \(NaN or inf in the model's weights or inputs"):
        capture_huggingface_residual(model, input_ids=ids, check=False)
    # A forward pass that is not finite without padding is not blamed on padding.
    stream, real = torch.full((1, 3, 4), float("inf")), torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"overflows, where the capture's float64 does not\), so there is nothing"):
        _refuse_if_not_finite("gpt2", stream, real, "where")
    with pytest.raises(ValueError, match=r"a padded query with no key to attend.*without padding$"):
        _refuse_if_not_finite("gpt2", stream, torch.tensor([[True, True, False]]), "where")
