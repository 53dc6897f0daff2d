"""pk.length_sums: exact sums of path outputs by length, without enumeration."""

import pytest
import torch

import pathkernels as pk
from pathkernels.reference import attention_network_ref, path_products_ref
from pathkernels.testing import random_attention, tolerance


def network(batch, layers, heads, n, d, d_head, dtype=torch.float64, scale=None):
    attn = random_attention(batch, layers, heads, n, n, dtype=dtype)
    x = torch.randn(batch, n, d, dtype=dtype)
    w_v = torch.randn(layers, heads, d, d_head, dtype=dtype) * (scale or d**-0.5)
    w_o = torch.randn(layers, heads, d_head, d, dtype=dtype) * (scale or d_head**-0.5)
    return attn, x, w_v, w_o


@pytest.mark.parametrize("skip", [True, False])
def test_each_length_is_the_sum_of_its_paths(skip):
    layers, heads = 4, 3
    attn, x, w_v, w_o = network(2, layers, heads, 5, 4, 2)
    sums = pk.length_sums(attn, x, w_v, w_o, skip=skip)
    assert sums.shape == (layers + 1, 2, 5, 4)
    tree = pk.PathTree.complete(layers, heads, skip=skip)
    outputs = path_products_ref(attn, tree.paths(), x, w_v, w_o)  # [B, M, n, d]
    for k in range(layers + 1):
        expected = outputs[:, tree.lengths() == k].sum(1)
        torch.testing.assert_close(sums[k], expected, **tolerance(torch.float64))
    if not skip:
        assert bool((sums[:layers] == 0).all())


def bias_path_outputs_ref(attn, w_v, w_o, b_o, skip):
    """Every bias path by enumeration: ``1 b_O[l]ᵀ`` at layer l, then a head (or skip) per later
    layer; its length counts layer l and the heads after it. -> {length: sum of outputs [B, n, d]}."""
    batch, layers, heads, n, _ = attn.shape
    sums = {}
    for layer in range(layers):
        later = layers - layer - 1
        tails = pk.PathTree.complete(later, heads, skip=skip).paths().tolist() if later else [[]]
        for tail in tails:
            y = b_o[layer].expand(batch, n, -1)
            for offset, head in enumerate(tail):
                if head >= 0:
                    at = layer + 1 + offset
                    y = attn[:, at, head] @ y @ w_v[at, head] @ w_o[at, head]
            length = 1 + sum(head >= 0 for head in tail)
            sums[length] = sums.get(length, 0) + y
    return sums


@pytest.mark.parametrize("skip", [True, False])
def test_bias_paths_are_paths_of_their_own(skip):
    layers, heads = 3, 2
    attn, x, w_v, w_o = network(2, layers, heads, 4, 3, 2)
    b_o = torch.randn(layers, 3, dtype=torch.float64)
    with_bias = pk.length_sums(attn, x, w_v, w_o, b_o=b_o, skip=skip)
    without = pk.length_sums(attn, x, w_v, w_o, skip=skip)
    bias_sums = bias_path_outputs_ref(attn, w_v, w_o, b_o, skip)
    for k in range(layers + 1):
        torch.testing.assert_close(
            with_bias[k] - without[k], bias_sums.get(k, torch.zeros_like(x)), **tolerance(torch.float64)
        )
        # A bias path has equal rows: its residual after centring is 0.
        torch.testing.assert_close(
            pk.residual_norm(with_bias[k] - without[k]), torch.zeros(2, dtype=torch.float64), rtol=0, atol=1e-12
        )
    network_output = attention_network_ref(attn, x, w_v, w_o, b_o, skip=skip)
    torch.testing.assert_close(with_bias.sum(0), network_output, **tolerance(torch.float64))
    with pytest.raises(ValueError, match=r"length_sums: expected b_o of shape \[L, d\] = \[3, 3\], got \[3, 4\]"):
        pk.length_sums(attn, x, w_v, w_o, b_o=torch.zeros(3, 4, dtype=torch.float64))


def test_truncated_output_and_unbatched_inputs():
    attn, x, w_v, w_o = network(1, 5, 2, 4, 3, 2)
    sums = pk.length_sums(attn[0], x[0], w_v, w_o)
    assert sums.shape == (6, 4, 3)
    torch.testing.assert_close(pk.truncated_output(sums, 5), attention_network_ref(attn, x, w_v, w_o)[0])
    torch.testing.assert_close(pk.truncated_output(sums, 0), x[0])
    torch.testing.assert_close(pk.truncated_output(sums, 2), sums[0] + sums[1] + sums[2])


def test_gpt2_small_scale():
    # L = 12, H = 12, n = 128, d = 768: 13^12 ≈ 2.3e13 paths, summed exactly by length.
    attn, x, w_v, w_o = network(1, 12, 12, 128, 768, 64, dtype=torch.float32, scale=0.02)
    sums = pk.length_sums(attn, x, w_v, w_o)
    assert sums.shape == (13, 1, 128, 768) and bool(torch.isfinite(sums).all())
    expected = attention_network_ref(attn.double(), x.double(), w_v.double(), w_o.double())
    torch.testing.assert_close(sums.sum(0).double(), expected, rtol=1e-4, atol=1e-4)


def test_bad_input():
    attn, x, w_v, w_o = network(1, 3, 2, 4, 3, 2)
    with pytest.raises(ValueError, match="pathkernels.length_sums: expected x; length sums are sums of path outputs"):
        pk.length_sums(attn, None, w_v, w_o)
    with pytest.raises(ValueError, match=r"pathkernels.length_sums: expected w_o of shape \[L, H, d_head, d\]"):
        pk.length_sums(attn, x, w_v, w_o[:, :, :1])
    with pytest.raises(ValueError, match="truncated_output: expected max_length >= 0"):
        pk.truncated_output(pk.length_sums(attn, x, w_v, w_o), -1)


def test_length_sums_are_differentiable():
    attn, x, w_v, w_o = network(1, 2, 2, 3, 2, 2)
    b_o = torch.randn(2, 2, dtype=torch.float64)
    inputs = [t.clone().requires_grad_() for t in (x, w_v, w_o, b_o)]
    torch.autograd.gradcheck(lambda x, w_v, w_o, b_o: pk.length_sums(attn, x, w_v, w_o, b_o=b_o, skip=True), inputs)
    torch.autograd.gradcheck(lambda x, w_v, w_o, b_o: pk.length_sums(attn, x, w_v, w_o, b_o=b_o, skip=False), inputs)
