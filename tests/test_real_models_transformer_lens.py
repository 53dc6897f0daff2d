"""Paths of a TransformerLens HookedTransformer (3.x), issue 24: its residual stream as an exact sum
of paths, and its logit differences as sums of path attributions, for every normalisation type,
attention-only models, grouped-query attention and rotary positions. Models are built from
configs in float64 with random biases and norm parameters."""

import pytest
import torch

import pathkernels as pk

transformer_lens = pytest.importorskip("transformer_lens")
HookedTransformer = getattr(transformer_lens, "HookedTransformer", None)
if HookedTransformer is None:  # transformer-lens 4.x has no HookedTransformer
    pytest.skip("needs transformer-lens 3.x (HookedTransformer)", allow_module_level=True)
pytestmark = pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")


def hooked(normalization_type="LN", attn_only=False, **extra):
    config = transformer_lens.HookedTransformerConfig(
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
        seed=0,
        **extra,
    )
    model = HookedTransformer(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.split(".")[-1].startswith("b"):
                parameter.normal_(0, 0.5)
            elif name.split(".")[-1] == "w" and "ln" in name:
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
def test_a_hooked_transformer_is_the_sum_of_its_paths(case):
    model = hooked(**CASES[case])
    tokens = torch.randint(0, 50, (2, 9))
    stack, capture = pk.adapters.capture_transformer_lens_residual(model, tokens)
    sums = stack.length_sums()
    error = (sums.sum(0) - capture.residual).abs().max() / capture.residual.abs().max()
    assert error < 1e-10, error
    result = pk.path_attribution(stack, pk.logit_diff(model, 3, 7), batch=1, positions=[8, 2])
    with torch.no_grad():
        logits = model(tokens)[1].double()
    expected = (logits[[8, 2], 3] - logits[[8, 2], 7])[:, None]
    torch.testing.assert_close(result.value, expected, rtol=1e-10, atol=1e-10)
    complete = result.by_source_length.sum((0, 1)) + result.constant
    torch.testing.assert_close(complete, expected, rtol=1e-10, atol=1e-10)


def test_parallel_blocks_and_bridges_are_refused_by_name():
    model = hooked(parallel_attn_mlp=True)
    with pytest.raises(ValueError, match=r"^pathkernels\.adapters\.capture_transformer_lens_residual: .*parallel"):
        pk.adapters.capture_transformer_lens_residual(model, torch.randint(0, 50, (1, 4)))
    with pytest.raises(TypeError, match=r"expected a TransformerLens HookedTransformer, got Linear"):
        pk.adapters.capture_transformer_lens_residual(torch.nn.Linear(2, 2), torch.randint(0, 50, (1, 4)))
