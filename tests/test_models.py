"""pk.models: the four variants, and the path decomposition of their forward passes."""

import pytest
import torch

import pathkernels as pk
from pathkernels.app.models import VARIANTS, SelfAttentionNetwork


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_run_and_report_every_layer(variant):
    model = SelfAttentionNetwork.variant(variant, d_model=16, num_heads=2, num_layers=3).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    result = model(x)
    assert result.output.shape == (2, 5, 16)
    assert result.hidden_states.shape == (4, 2, 5, 16) and torch.equal(result.hidden_states[0], x)
    assert result.attn.shape == (2, 3, 2, 5, 5)
    torch.testing.assert_close(result.attn.sum(-1), torch.ones(2, 3, 2, 5, dtype=torch.float64))
    assert model.skip == VARIANTS[variant]["skip"] and len(model.mlps) == (3 if VARIANTS[variant]["mlp"] else 0)


def test_attention_only_skip_network_is_the_sum_of_its_paths(device):
    """Without biases, MLPs or normalisation, the output is exactly Σ_p P_p X W_p."""
    model = SelfAttentionNetwork(12, 3, 4, skip=True, bias=False).double().to(device)
    x = torch.randn(2, 6, 12, dtype=torch.float64, device=device)
    result = model(x)
    stack = model.attention_stack(result)
    torch.testing.assert_close(stack.length_sums().sum(0), result.output)
    products = stack.path_residuals(pk.PathTree.complete(4, 3, skip=True), x=x, materialize=True).products
    torch.testing.assert_close(products.sum(1), result.output)


def test_biased_layers_match_their_maps():
    model = SelfAttentionNetwork(12, 3, 2, skip=False).double()
    with torch.no_grad():
        for attention in model.attention:
            attention.b_o.normal_()
    x = torch.randn(2, 6, 12, dtype=torch.float64)
    result = model(x)
    stack = model.attention_stack(result)
    hidden = result.hidden_states
    for layer in range(2):
        heads = sum(
            stack.attn[:, layer, h] @ hidden[layer] @ stack.w_v[layer, h] @ stack.w_o[layer, h] for h in range(3)
        )
        torch.testing.assert_close(hidden[layer + 1], heads + stack.b_o[layer])


def test_causal_mask():
    model = SelfAttentionNetwork(8, 2, 2, causal=True)
    attn = model(torch.randn(1, 5, 8)).attn
    assert torch.all(attn.triu(1) == 0)


def test_pure_attention_collapses_and_skip_does_not():
    torch.manual_seed(0)
    x = torch.randn(4, 16, 32, dtype=torch.float64)
    with torch.no_grad():
        pure = pk.metrics.residual_ratio(
            SelfAttentionNetwork.variant("pure attention", d_model=32, num_layers=8).double()(x).hidden_states
        )
        skip = pk.metrics.residual_ratio(
            SelfAttentionNetwork.variant("+skip", d_model=32, num_layers=8).double()(x).hidden_states
        )
    assert pure[-1].max() < 1e-8 < skip[-1].min()


def test_bad_input():
    with pytest.raises(ValueError, match="expected a variant in"):
        SelfAttentionNetwork.variant("resnet")
    with pytest.raises(ValueError, match=r"expected x \[B, n, d\]"):
        SelfAttentionNetwork(8, 2, 1)(torch.randn(5, 8))
