"""The capture checks itself against the model's own, unmodified forward pass (pathkernels.adapters.
self_check): every family passes well within the tolerance, and each capture that differed from
the model (Falcon's ALiBi added twice, a mask with a hole given other positions, a TransformerLens
norm read with the wrong gain, clamped values) now reproduces the model's own numbers or is refused
by name; a capture made wrong on purpose is refused by the check."""

import dataclasses
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


@pytest.mark.parametrize("name", ["gpt2", "gemma2"])
def test_the_path_sum_reads_the_patterns_as_the_model_computed_them(name):
    """Where the stack holds its patterns renormalised (a float32 softmax in a float64 model), the
    model's are the stack's times ``attn_row_sums``: whole, per batch element, per layer, and
    written layer by layer into one buffer as ``path_sum`` reads them; ``path_sum`` equals the sum
    of a stack holding the model's patterns themselves (Gemma-2: times its attention-output norm)."""
    model = {"gpt2": gpt2}.get(name, lambda: family_model(name))().double().eval()
    stack, capture = capture_huggingface_residual(model, input_ids=torch.randint(1, 50, (2, 6)))
    sums = 1 + 1e-6 * torch.randn(stack.attn.shape[:-1], dtype=torch.float64)  # float32's rounding
    capture.attn_row_sums = sums
    computed = stack.attn * sums[..., None]
    assert torch.equal(capture.patterns(stack.attn), computed)
    assert torch.equal(capture.patterns(stack.attn, 1), computed[1])
    buffer = torch.empty_like(computed[:, 0])
    for layer in range(stack.num_layers):
        assert torch.equal(capture.patterns(stack.attn, 1, layer=layer), computed[1, layer])
        assert capture.patterns(stack.attn, layer=layer, out=buffer) is buffer
        assert torch.equal(buffer, computed[:, layer])
    as_computed = dataclasses.replace(stack, attn=computed, attn_precision=torch.float32)  # rows kept as they are
    as_computed.attn = computed
    as_computed.residual_capture = dataclasses.replace(capture, attn_row_sums=None)
    total = as_computed.path_sum()
    assert float((total - stack.path_sum()).abs().max()) < 1e-12 * float(total.abs().max())
    capture.attn_row_sums = None
    assert float((total - stack.path_sum()).abs().max()) > 1e-8 * float(total.abs().max())  # the sums matter


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


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_logits_are_compared_a_block_of_words_at_a_time(monkeypatch, dtype):
    """The logits' difference, read out a few words at a time (blocks of 2 to 7 words over 23), is
    the whole readout's ``max |normed W_Uᵀ + b_U − logits| / max |logits|`` over the real tokens,
    soft-capped or not, wherever the largest difference and the largest logit fall; padded rows
    (NaN here) are not read, and a NaN logit at a real token gives inf."""
    from types import SimpleNamespace

    from pathkernels.adapters import self_check

    vocabulary, width = 23, 5
    normed = torch.randn(2, 4, width, dtype=torch.float64)
    weight, bias = torch.randn(vocabulary, width, dtype=dtype), torch.randn(vocabulary, dtype=dtype)
    real = torch.tensor([[True, True, True, True], [False, True, True, False]])
    for cap in (None, 3.0):
        exact = normed @ weight.double().T + bias.double()
        exact = exact if cap is None else cap * torch.tanh(exact / cap)
        for word in (0, 11, vocabulary - 1):
            logits = (exact + 1e-3 * torch.randn_like(exact)).to(dtype)
            logits[1, 2, word] += 0.5  # the largest difference, in the first, a middle or the last block
            logits[0, 3, vocabulary - 1 - word] = 40.0  # the largest logit
            logits[1, 0] = logits[1, 3] = float("nan")  # padded rows
            keep = real[..., None].expand_as(logits)
            want = float((exact - logits.double())[keep].abs().max() / logits.double()[keep].abs().max())
            for rows_per_block in (2 * 6, 5 * 6, 7 * 6):  # six real rows: blocks of 2, 5 and 7 words
                monkeypatch.setattr(self_check, "_READOUT_BLOCK", rows_per_block)
                capture = SimpleNamespace(unembedding=weight, unembedding_bias=bias)
                got = self_check._readout_error(normed, capture, cap, logits, real)
                assert got == pytest.approx(want, rel=1e-5 if dtype == torch.float32 else 1e-12)
            capture = SimpleNamespace(unembedding=weight, unembedding_bias=None)
            unbiased = float((exact - bias.double() - logits.double())[keep].abs().max()) if cap is None else None
            if unbiased is not None:
                got = self_check._readout_error(normed, capture, cap, logits, real)
                assert got == pytest.approx(unbiased / float(logits.double()[keep].abs().max()), rel=1e-5)
            logits[0, 1, word] = float("nan")
            assert self_check._readout_error(normed, capture, cap, logits, real) == float("inf")


def test_finiteness_is_read_from_the_least_and_largest_values():
    """``all_finite``: False for NaN, inf or −inf anywhere (first, middle, last; an expanded
    tensor's one stored value), True for finite values, integers and empty tensors."""
    from pathkernels.core.checks import all_finite, check_finite

    for dtype in (torch.float64, torch.float32, torch.float16):
        values = torch.randn(3, 50, dtype=dtype)
        assert all_finite(values)
        for bad in (float("nan"), float("inf"), float("-inf")):
            for index in ((0, 0), (1, 25), (2, 49)):
                broken = values.clone()
                broken[index] = bad
                assert not all_finite(broken)
                with pytest.raises(
                    ValueError, match=rf"x has a non-finite value \({bad}\) at index \[{index[0]}, {index[1]}\]"
                ):
                    check_finite(broken, "x", "where")
            assert not all_finite(torch.tensor([bad], dtype=dtype).expand(4, 7))
    assert (
        all_finite(torch.empty(0, 3)) and all_finite(torch.arange(5)) and all_finite(torch.zeros(2, 2).expand(3, 2, 2))
    )


@pytest.mark.parametrize("check", [True, False])
def test_a_capture_shows_its_progress_over_the_layers_of_both_passes(capsys, check):
    """``progress=True``: the capture counts the layers of its forward pass and of the self-check's
    (lines on stderr where no bar is drawn, the last at the end), naming the step it is at; off by
    default; not a flag, refused by name."""
    model = llama().double().eval()
    layers, ids = model.config.num_hidden_layers, torch.randint(0, 50, (1, 6))
    capture_huggingface_residual(model, input_ids=ids, query_key=True, check=check, progress=True)
    passes = 2 if check else 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    counted = f"{passes * layers}/{passes * layers} layers (100 %)"
    assert last.startswith(f"pathkernels.adapters.capture_huggingface_residual: {counted}")
    assert last.endswith("(the self-check: the logits)" if check else "(the query and key maps)")
    capture_huggingface_residual(model, input_ids=ids, check=check)
    assert capsys.readouterr().err == ""
    with pytest.raises(TypeError, match=r"capture_huggingface_residual: expected progress to be True or False"):
        capture_huggingface_residual(model, input_ids=ids, progress="yes")


def test_a_transformer_lens_capture_shows_its_steps():
    """TransformerLens: ``progress=True`` counts the forward pass, the frozen maps and the self-check."""
    import contextlib
    import io

    from test_real_models_transformer_lens import tl_model

    model, err = tl_model("LN"), io.StringIO()
    with contextlib.redirect_stderr(err):
        capture_transformer_lens_residual(model, torch.randint(0, 50, (1, 6)), progress=True)
    last = err.getvalue().strip().splitlines()[-1]
    assert last.startswith("pathkernels.adapters.capture_transformer_lens_residual: 3/3 steps (100 %)")
    assert last.endswith("(done)")
    with pytest.raises(TypeError, match=r"capture_transformer_lens_residual: expected progress to be True or False"):
        capture_transformer_lens_residual(model, torch.randint(0, 50, (1, 6)), progress=1)


@pytest.mark.parametrize("padding", ["left", "right"])
def test_a_long_prompts_logits_are_compared_at_a_spread_of_positions_with_each_last_token(monkeypatch, padding):
    """Where every token's logits would pass the check's budget (lowered here to 3 positions' worth),
    the model runs with ``logits_to_keep`` at an even spread of positions that fits and each
    sequence's last real token (left or right padding), and the check compares those, the count
    kept in ``check``; a capture made wrong at a last token outside the spread alone (its final
    norm's scale) is refused."""
    from pathkernels.adapters import self_check

    model = llama().double()
    ids = torch.randint(0, 50, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0 if padding == "left" else 1
    if padding == "right":
        mask[1, 6:] = 0
    positions = torch.arange(9).expand(2, 9)  # the model's own, left padding or right
    row = 2 * model.config.vocab_size * 8  # one position's logits of both sequences, float64
    monkeypatch.setattr(self_check, "_CHECKED_LOGITS_BYTES", 5 * row)
    stack, capture = capture_huggingface_residual(model, input_ids=ids, attention_mask=mask, position_ids=positions)
    kept = self_check._checked_positions(model, capture, mask.bool())
    last = 5 if padding == "right" else 8
    assert kept.tolist() == sorted({0, 4, 8, last})  # three spread over 0..8, and the last real tokens
    assert capture.check.logits_positions == kept.numel()
    monkeypatch.setattr(self_check, "_CHECKED_LOGITS_BYTES", 1 << 40)
    _, whole = capture_huggingface_residual(model, input_ids=ids, attention_mask=mask, position_ids=positions)
    assert whole.check.logits_positions is None
    assert 0 < capture.check.logits_error < capture.check.tolerance / 10
    monkeypatch.setattr(self_check, "_CHECKED_LOGITS_BYTES", 5 * row)
    from pathkernels.adapters import residual

    scale = residual._inverse_scale

    def off_at_the_last_token(x, norm, kind):  # the final norm's 1/σ 1 % high at the second sequence's last token
        result = scale(x, norm, kind)
        if norm is model.model.norm:
            result = result.clone()
            result[1, last] *= 1.01
        return result

    monkeypatch.setattr(residual, "_inverse_scale", off_at_the_last_token)
    with pytest.raises(ValueError, match=r"the sum of its paths is .* its logits"):
        capture_huggingface_residual(model, input_ids=ids, attention_mask=mask, position_ids=positions)


def test_the_score_side_holds_the_queries_and_keys_as_computed_once_per_key_head(monkeypatch):
    """A grouped-query float32 model's capture holds its queries and keys in float32, exactly as
    its attention received them, and its query and key projections as it holds them; the keys
    once per key head (not repeated for the 2 query heads that share each, and so are keys given
    repeated); a head's, read in float64, are its key head's."""
    from contextlib import contextmanager

    from pathkernels.adapters import residual

    model = llama().float()
    ids = torch.randint(0, 50, (1, 7))
    seen = []
    original = residual.recording

    @contextmanager
    def recording(modules, where):  # the records the capture reads, kept to compare
        with original(modules, where) as records:
            seen.append(records)
            yield records

    monkeypatch.setattr(residual, "recording", recording)
    _, capture = capture_huggingface_residual(model, input_ids=ids, query_key=True)
    maps = capture.query_key
    heads, key_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    assert maps.queries.dtype == maps.keys.dtype == maps.w_q.dtype == maps.w_k.dtype == torch.float32
    attention = model.model.layers[1].self_attn
    assert torch.equal(maps.w_q[1, 3], attention.q_proj.weight.T.reshape(-1, heads, maps.w_q.shape[-1])[:, 3])
    assert maps.side_maps("query", 1, 3)[0].dtype == torch.float64
    assert maps.keys.shape[2] == key_heads < heads == maps.queries.shape[2]
    for layer, record in enumerate(seen[0]):
        assert torch.equal(maps.queries[:, layer], record.queries) and torch.equal(maps.keys[:, layer], record.keys)
        for head in range(heads):
            key = maps.computed("key", 0, layer, head)
            assert key.dtype == torch.float64 and torch.equal(
                key, record.keys[0, head // (heads // key_heads)].double()
            )
    repeated = dataclasses.replace(maps, keys=maps.keys.repeat_interleave(heads // key_heads, 2))  # as a builder may
    assert torch.equal(repeated.keys, maps.keys)  # kept once per key head


def test_inputs_that_broadcast_over_the_batch_do_not_set_its_size():
    """A ``[1, n]`` ``position_ids`` passed before the ``[2, n]`` ``input_ids`` broadcasts over the
    batch, as in the model's own forward: the capture's MLP outputs are ``[2, L, n, d]``, each
    sequence's own, and the capture checks itself against the model."""
    model = gpt2().eval()
    ids = torch.randint(0, 50, (2, 6))
    stack, capture = capture_huggingface_residual(model, position_ids=torch.arange(6)[None], input_ids=ids)
    assert capture.mlp_out.shape == (2, stack.num_layers, 6, stack.d_model)
    assert capture.check.stream_error < capture.check.tolerance / 10
