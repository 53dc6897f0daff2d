"""Paths of a TransformerLens model: its residual stream as an exact sum of paths, and
its logit differences as sums of path attributions, for every normalisation type, attention-only
models, grouped-query attention and rotary positions: a HookedTransformer on 3.x, a
TransformerBridge over its native model on 4.x (tests/test_transformer_lens_versions.py runs this
module against 4.x too), and bridges over Hugging Face models. Models are built from configs in
float64 with random biases and norm parameters."""

import copy

import pytest
import torch

import pathkernels as pk
from pathkernels.testing import transformer_lens_major

transformer_lens = pytest.importorskip("transformer_lens")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def tl_model(normalization_type="LN", attn_only=False, **extra):
    """The model a user of the installed TransformerLens holds, random biases and norm parameters."""
    config = dict(
        n_layers=3,
        d_model=32,
        n_ctx=16,
        d_head=8,
        n_heads=4,
        d_mlp=None if attn_only else 64,
        act_fn=None if attn_only else "gelu",
        attn_only=attn_only,
        normalization_type=normalization_type,
        d_vocab=50,
        dtype=torch.float64,
        **extra,
    )
    if transformer_lens_major() == 3:
        model = transformer_lens.HookedTransformer(transformer_lens.HookedTransformerConfig(seed=0, **config))
    else:
        from transformer_lens.config import TransformerBridgeConfig
        from transformer_lens.model_bridge import TransformerBridge

        torch.manual_seed(0)
        model = TransformerBridge.boot_native(TransformerBridgeConfig(**config), dtype=torch.float64)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            last = name.split(".")[-1]
            if last.startswith("b"):  # b, b_Q, …, bias
                parameter.normal_(0, 0.5)
            elif last in ("w", "weight") and ("ln" in name or "norm" in name):
                parameter.uniform_(0.5, 1.5)
    return model


CASES = {
    "LN": {},
    "LNPre": {"normalization_type": "LNPre"},
    "RMS": {"normalization_type": "RMS"},
    "RMSPre with GQA and rotary": {
        "normalization_type": "RMSPre",
        "n_key_value_heads": 2,
        "positional_embedding_type": "rotary",
        "rotary_dim": 8,
    },
    "attention-only without norms": {"normalization_type": None, "attn_only": True},
    "attention-only with LN": {"attn_only": True},
}


@pytest.mark.parametrize("case", CASES)
def test_a_transformer_lens_model_is_the_sum_of_its_paths(case):
    model = tl_model(**CASES[case])
    tokens = torch.randint(0, 50, (2, 9))
    stack, capture = pk.adapters.capture_transformer_lens_residual(model, tokens)
    sums = stack.length_sums()
    error = (sums.sum(0) - capture.residual).abs().max() / capture.residual.abs().max()
    assert error < 1e-10, error
    result = pk.path_attribution(stack, pk.logit_diff(model, 3, 7), batch=1, positions=[8, 2])
    complete = result.by_source_length.sum((0, 1)) + result.constant
    torch.testing.assert_close(complete, result.value, rtol=1e-10, atol=1e-10)
    with torch.no_grad():
        logits = model(tokens)[1].double()
    expected = (logits[[8, 2], 3] - logits[[8, 2], 7])[:, None]
    # 4.x's native RMSNorms compute in float32; the capture runs them in float64 (its docstring).
    float32_norms = transformer_lens_major() >= 4 and "RMS" in str(CASES[case].get("normalization_type"))
    tolerance = 1e-6 if float32_norms else 1e-10
    torch.testing.assert_close(result.value, expected, rtol=tolerance, atol=tolerance)


def test_other_models_are_refused_by_name():
    with pytest.raises(
        TypeError, match=r"expected a TransformerLens HookedTransformer or TransformerBridge, got Linear"
    ):
        pk.adapters.capture_transformer_lens_residual(torch.nn.Linear(2, 2), torch.randint(0, 50, (1, 4)))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_transformer_bridge_over_a_hugging_face_model_captures_what_the_model_gives(family, tmp_path):
    """A 4.x TransformerBridge over a float64 Hugging Face GPT-2 or Llama (grouped-query heads, a
    float32 softmax and float32 RMSNorms): the same capture as the Hugging Face model's own."""
    from test_adapters import bridge_over, hf_case, llama_style

    model = (hf_case("gpt2")[0] if family == "gpt2" else llama_style("llama")).double()
    original = copy.deepcopy(model)  # the bridge wraps the modules of the model it is given
    bridge = bridge_over(model, tmp_path, dtype=torch.float64)
    ids = torch.randint(0, 40, (2, 7))
    stack, capture = pk.adapters.capture_transformer_lens_residual(bridge, ids)
    _, expected = pk.adapters.capture_huggingface_residual(original, input_ids=ids)
    torch.testing.assert_close(capture.residual, expected.residual, rtol=1e-12, atol=1e-12)
    error = (stack.length_sums().sum(0) - capture.residual).abs().max() / capture.residual.abs().max()
    assert error < 1e-10, error
    readout = pk.logit_diff(original, 3, 7)
    torch.testing.assert_close(
        pk.path_attribution(stack, readout).value,
        pk.path_attribution(pk.adapters.capture_huggingface_residual(original, input_ids=ids)[0], readout).value,
        rtol=1e-10,
        atol=1e-10,
    )


@pytest.mark.parametrize("case", ["LN", "RMSPre with GQA and rotary"])
def test_a_transformer_lens_cache_is_captured_without_running_the_model_again(case, monkeypatch):
    """A user's ``ActivationCache`` (``model.run_with_cache(tokens)``, every hook) is read as it is,
    in either order, with its score side: the same capture, bit for bit, as one from the tokens,
    and the model is not run again (a forward pass is refused here). A cache that lacks a hook the
    capture reads is refused naming it; a cache first and something else second names the order."""
    model = tl_model(**CASES[case]).eval()
    tokens = torch.randint(0, 50, (2, 7))
    stack, capture = pk.adapters.capture_transformer_lens_residual(model, tokens, query_key=True)
    _, cache = model.run_with_cache(tokens)

    def refused(*args, **kwargs):
        raise AssertionError("the model ran again")

    monkeypatch.setattr(type(model), "forward", refused)
    monkeypatch.setattr(type(model), "run_with_cache", refused)
    for args in ((model, cache), (cache, model), (cache,)):
        cached_stack, cached = pk.adapters.capture_transformer_lens_residual(*args, query_key=True)
        torch.testing.assert_close(cached_stack.attn, stack.attn, rtol=0, atol=0)
        torch.testing.assert_close(cached.residual, capture.residual, rtol=0, atol=0)
        torch.testing.assert_close(cached.norm_scale, capture.norm_scale, rtol=0, atol=0)
        torch.testing.assert_close(cached.query_key.queries, capture.query_key.queries, rtol=0, atol=0)
        assert cached.check.stream_error < 1e-12 and cached.check.logits_error is None
        from_cache = pk.adapters.from_transformer_lens(model, cache)
        torch.testing.assert_close(from_cache.attn, stack.attn, rtol=0, atol=0)
    readout = pk.logit_diff(model, 1, 2)
    torch.testing.assert_close(
        pk.path_attribution(cached_stack, readout).value, pk.path_attribution(stack, readout).value, rtol=0, atol=0
    )
    partial = transformer_lens.ActivationCache(
        {name: value for name, value in cache.items() if "hook_mlp_out" not in name}, model
    )
    where = r"pathkernels\.adapters\.capture_transformer_lens_residual: "
    lacks = r"the ActivationCache lacks 3 of the \d+ hooks .*blocks\.0\.hook_mlp_out"
    with pytest.raises(ValueError, match=where + lacks):
        pk.adapters.capture_transformer_lens_residual(model, partial)
    with pytest.raises(TypeError, match=where + r"with an ActivationCache first, expected the model .* got Tensor"):
        pk.adapters.capture_transformer_lens_residual(cache, tokens)


def test_a_transformer_lens_models_embedding_splits_into_tokens_and_positions():
    """Standard positions: ``hook_embed`` is the token part; each path from the embedding splits
    into it and the position part (``hook_pos_embed``), each equal to the path's attribution on a
    copy whose stream starts with ``W_E[tokens]`` alone (and the rest); rotary models refuse."""
    import copy
    import dataclasses

    model = tl_model().eval()
    tokens = torch.randint(0, 50, (1, 7))
    stack, capture = pk.adapters.capture_transformer_lens_residual(model, tokens)
    readout = pk.logit_diff(model, 1, 2)
    split = pk.path_attribution(stack, readout, split_embedding=True)
    token = model.W_E.detach().double()[tokens]
    other = copy.copy(stack)
    other.residual_capture = dataclasses.replace(capture, embedding=token, token_embedding=None)
    alone = pk.path_attribution(other, readout)
    scale = float(split.absolute.max())
    torch.testing.assert_close(split.by_source_length[0], alone.by_source_length[0], rtol=0, atol=1e-12 * scale)
    assert split.source_names[-1] == "position embedding" and float(split.by_source[-1].abs().max()) > 0
    rotary, _ = pk.adapters.capture_transformer_lens_residual(
        tl_model(**CASES["RMSPre with GQA and rotary"]).eval(), tokens
    )
    with pytest.raises(ValueError, match=r"split_embedding=True needs a model whose stream starts as a token"):
        pk.path_attribution(rotary, readout, split_embedding=True)


def test_a_cache_of_another_model_is_refused_by_name():
    """``capture_transformer_lens_residual(model_b, cache_of_model_a)`` read the heads from the
    cache's model and the norms and unembedding from model_b: its self-check passed (3e-16) while
    every attribution matched neither model. Now refused, naming a parameter that differs; a copy of
    the cache's own model is the same model."""
    import copy

    model = tl_model().eval()
    _, cache = model.run_with_cache(torch.randint(0, 50, (1, 7)))
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.unembed.W_U.mul_(2)
    with pytest.raises(
        ValueError, match=r"the ActivationCache was made by another model than the one given \(\S+ holds other values"
    ):
        pk.adapters.capture_transformer_lens_residual(other, cache)
    stack, _ = pk.adapters.capture_transformer_lens_residual(copy.deepcopy(model), cache)
    assert stack.num_layers == 3
