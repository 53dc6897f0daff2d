"""pk.length_sums: exact sums of path outputs by length, without enumeration."""

import functools
import math
from fractions import Fraction

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


def test_heads_without_dimensions_add_nothing():
    """d_head = 0: every head writes 0, so the sums of the paths through heads are 0 (only the
    bias paths remain), as path_residuals has it; the scaling of the empty maps failed."""
    attn, x, _, _ = network(2, 3, 2, 4, 3, 2)
    w_v, w_o = torch.zeros(3, 2, 3, 0, dtype=torch.float64), torch.zeros(3, 2, 0, 3, dtype=torch.float64)
    b_o = torch.randn(3, 3, dtype=torch.float64)
    for skip in (True, False):
        sums = pk.length_sums(attn, x, w_v, w_o, skip=skip)
        assert sums.shape == (4, 2, 4, 3)
        assert torch.equal(sums[0], x if skip else torch.zeros_like(x))
        assert torch.equal(sums[1:], torch.zeros_like(sums[1:]))
        with_bias = pk.length_sums(attn, x, w_v, w_o, b_o=b_o, skip=skip)
        torch.testing.assert_close(
            with_bias.sum(0), attention_network_ref(attn, x, w_v, w_o, b_o, skip=skip), **tolerance(torch.float64)
        )


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


# --- range: sums far outside float32's range, and inputs near its ends ------------------------------

DEEP = {"layers": 40, "heads": 2, "n": 3, "d": 2, "d_head": 2}


def exact_length_sums(attn, x, w_v, w_o):
    """The recursion with skip in exact rational arithmetic (every float is a dyadic rational), on
    the inputs' own values: ``[L+1][B]`` n × d matrices of Fractions."""

    def rational(t):
        return [[Fraction(v) for v in row] for row in t.double().tolist()]

    def matmul(a, b):
        return [
            [sum((a[i][k] * b[k][j] for k in range(len(b))), Fraction(0)) for j in range(len(b[0]))]
            for i in range(len(a))
        ]

    batch, layers, heads = attn.shape[:3]
    maps = [[matmul(rational(w_v[i, h]), rational(w_o[i, h])) for h in range(heads)] for i in range(layers)]
    per_element = []
    for b in range(batch):
        sums = [rational(x[b])] + [None] * layers  # None: no path of that length yet
        for layer in range(layers):
            patterns = [rational(attn[b, layer, h]) for h in range(heads)]
            new = sums[:1]
            for k in range(1, layer + 2):
                total = sums[k]
                for h in range(heads):
                    term = matmul(matmul(patterns[h], sums[k - 1]), maps[layer][h])
                    total = term if total is None else [[u + v for u, v in zip(r, s)] for r, s in zip(total, term)]
                new.append(total)
            sums = new + sums[layer + 2 :]
        per_element.append(sums)
    return [[per_element[b][k] for b in range(batch)] for k in range(len(per_element[0]))]


@functools.cache
def deep_network(scale: float, layers: int = 40):
    """A float32 network (40 layers, 2 heads, n = 3, d = d_head = 2) whose value maps are
    multiplied by ``scale``, its first ``layers`` layers, and the exact length sums of its own
    (float32) values."""
    generator = torch.Generator().manual_seed(7)
    attn = random_attention(1, DEEP["layers"], DEEP["heads"], DEEP["n"], DEEP["n"], generator=generator)
    # Multiples of 2^-12 whose rows sum to 1 exactly, in float32 and in float64 alike.
    attn[..., :-1] = (attn[..., :-1] * 4096).floor() / 4096
    attn[..., -1] = 1 - attn[..., :-1].sum(-1)
    x = torch.randn(1, DEEP["n"], DEEP["d"], generator=generator)
    w_v = torch.randn(DEEP["layers"], DEEP["heads"], DEEP["d"], DEEP["d_head"], generator=generator) * scale / 2
    w_o = torch.randn(DEEP["layers"], DEEP["heads"], DEEP["d_head"], DEEP["d"], generator=generator) / 2
    attn, w_v, w_o = attn[:, :layers], w_v[:layers], w_o[:layers]
    return (attn, x, w_v, w_o), exact_length_sums(attn, x, w_v, w_o)


def log2_largest(exact, shift=0) -> list[float]:
    """log2 of each length's largest |entry| (batch element 0), times ``2^shift``."""
    return [math.log2(max(abs(v) for row in by_batch[0] for v in row)) + shift for by_batch in exact]


def relative_errors(got, exact, shift=0) -> list[float]:
    """Each length's largest error relative to its largest entry: ``max |got − S_k| / max |S_k|``,
    against the exact sums times ``2^shift``, in exact arithmetic."""
    errors = []
    for k, by_batch in enumerate(exact):
        truth = [[v * Fraction(2) ** shift for v in row] for row in by_batch[0]]
        values = got[k, 0].double().tolist()
        error = max(abs(Fraction(g) - t) for g_row, t_row in zip(values, truth) for g, t in zip(g_row, t_row))
        errors.append(float(error / max(abs(t) for row in truth for t in row)))
    return errors


@pytest.mark.parametrize("scale, layers, shift", [(50.0, 40, -100), (0.02, 32, 100)], ids=["x50", "x0.02"])
def test_float32_sums_across_50_decades_keep_float32_precision(scale, layers, shift):
    """Value maps ×50 over 40 layers (or ×0.02 over 32): the sums of lengths 0..L span 50 decades
    and more. Shifted by 2^shift into float32's range as a whole, every length comes back to
    float32's precision; the float32 recursion gave inf and NaN (×50) or 0 (×0.02) there."""
    (attn, x, w_v, w_o), exact = deep_network(scale, layers)
    x = x * 2.0**shift  # exact: a power of two
    magnitudes = log2_largest(exact, shift)
    assert max(magnitudes) - min(magnitudes) > 150  # 45 decades and more
    assert -125 < min(magnitudes) and max(magnitudes) < 127  # and within float32's range
    sums = pk.length_sums(attn, x, w_v, w_o)
    assert sums.dtype == torch.float32 and bool(torch.isfinite(sums).all())
    # Rounded to float32 once (2^-24 = 6e-8 of the largest entry): the float32 recursion lost up to 9e-6.
    assert max(relative_errors(sums, exact, shift)) < 1e-7


@pytest.mark.parametrize("scale", [50.0, 0.02], ids=["x50", "x0.02"])
def test_float32_sums_beyond_float32_are_refused_and_float64_holds_them(scale):
    """Over 40 layers the long paths' sums leave float32's range (above 3.4e38 at ×50, below
    1.2e-38 at ×0.02): refused, naming those lengths, where float32 gave inf, NaN or 0."""
    (attn, x, w_v, w_o), exact = deep_network(scale)
    magnitudes = log2_largest(exact)
    outside = [k for k, m in enumerate(magnitudes) if (m >= 128 if scale > 1 else m < -126)]
    assert outside == list(range(outside[0], 41)) and outside[0] > 5  # the long paths
    worst = (max if scale > 1 else min)(outside, key=lambda k: magnitudes[k])  # the message's example
    decimal = math.floor(magnitudes[worst] * math.log10(2))
    words = (
        rf"exceed float32's largest finite number \(3.4e\+38\): that of length {worst} \(batch element 0\) "
        rf"reaches about [1-9]\.[0-9]e\+{decimal}, where float32 would hold inf or NaN\. Pass float64 inputs for "
        r"float64 sums, or scale x or the value maps down"
        if scale > 1
        else rf"lie below float32's smallest normal number \(1.2e-38\): that of length {worst} \(batch element 0\) "
        rf"reaches only about [1-9]\.[0-9]e-{-decimal}, where float32 would hold 0 or lose digits\. Pass float64 "
        r"inputs for float64 sums, or scale x or the value maps up"
    )
    with pytest.raises(
        ValueError, match=rf"^pathkernels\.length_sums: the sums of the paths of lengths {outside[0]}–40 {words}"
    ):
        pk.length_sums(attn, x, w_v, w_o)
    sums = pk.length_sums(*(t.double() for t in (attn, x, w_v, w_o)))
    assert sums.dtype == torch.float64
    assert max(relative_errors(sums, exact)) < 1e-13


@pytest.mark.parametrize(
    "inputs",
    ["x 1e30", "x 1e-30", "w_v 1e30, w_o 1e-30", "w_v 1e-30, w_o 1e30"],
)
def test_float32_inputs_near_the_ends_of_float32(inputs):
    """x of about 1e30 or 1e-30 (2^±100, exact), or value maps whose factors are (their product
    unchanged), over 40 layers: the sums are those of the unscaled network times the scale, to
    float32's precision."""
    (attn, x, w_v, w_o), exact = deep_network(2.0)
    shift = {"x 1e30": 100, "x 1e-30": -100}.get(inputs, 0)
    assert -125 < min(log2_largest(exact, shift)) and max(log2_largest(exact, shift)) < 127  # float32 holds them
    if inputs.startswith("w_v"):
        power = 100 if inputs.startswith("w_v 1e30") else -100
        w_v, w_o = w_v * 2.0**power, w_o * 2.0**-power
    sums = pk.length_sums(attn, x * 2.0**shift, w_v, w_o)
    assert sums.dtype == torch.float32
    assert max(relative_errors(sums, exact, shift)) < 1e-7


@pytest.mark.parametrize("power", [30, -30])
def test_float64_sums_beyond_float64_are_refused_by_length(power):
    """Value maps ×2^±30 over 40 layers: the sums of length k are 2^(±30k) times those of the
    unscaled network, exactly, and leave float64's range for the long paths. The rescaled recursion
    keeps their exponents, so the refusal names them and their size; without it they overflowed to
    inf or, worse, flushed to 0 silently."""
    (attn, x, w_v, w_o), exact = deep_network(2.0)
    attn, x, w_v, w_o = (t.double() for t in (attn, x, w_v, w_o))
    magnitudes = [m + power * k for k, m in enumerate(log2_largest(exact))]  # log2 of each length's largest
    outside = [k for k, m in enumerate(magnitudes) if (m >= 1024 if power > 0 else m < -1022)]
    assert outside == list(range(outside[0], 41)) and outside[0] > 20
    worst = (max if power > 0 else min)(outside, key=lambda k: magnitudes[k])
    decimal = math.floor(magnitudes[worst] * math.log10(2))
    words = (
        rf"exceed float64's largest finite number \(1.8e\+308\): that of length {worst} \(batch element 0\) "
        rf"reaches about [1-9]\.[0-9]e\+{decimal}, where float64 would hold inf or NaN"
        if power > 0
        else rf"lie below float64's smallest normal number \(2.2e-308\): that of length {worst} \(batch element 0\) "
        rf"reaches only about [1-9]\.[0-9]e-{-decimal}, where float64 would hold 0 or lose digits"
    )
    with pytest.raises(
        ValueError, match=rf"^pathkernels\.length_sums: the sums of the paths of lengths {outside[0]}–40 {words}"
    ):
        pk.length_sums(attn, x, w_v * 2.0**power, w_o)


def test_float64_sums_beyond_the_product_of_their_factors():
    """float64 value maps whose factors are 2^±1000 (the product W_V W_O unchanged): x W_V alone
    overflows float64 in a plain recursion. And sums beyond float64's range are refused."""
    (attn, x, w_v, w_o), exact = deep_network(50.0)
    attn, x, w_v, w_o = (t.double() for t in (attn, x, w_v, w_o))
    sums = pk.length_sums(attn, x, w_v * 2.0**1000, w_o * 2.0**-1000)
    assert max(relative_errors(sums, exact)) < 1e-13
    with pytest.raises(
        ValueError, match=r"^pathkernels\.length_sums: the sums of the paths of lengths [0-9]+–40 exceed float64's"
    ):
        pk.length_sums(attn, x * 2.0**900, w_v, w_o)


@pytest.mark.parametrize("power", [0, 600])
def test_gradients_through_the_scaled_recursion_are_those_of_the_network(power):
    """Σ_k S_k is the network's output: its gradients in every input, through the scaled recursion,
    equal autograd's through the plain network (float64, value maps ×50 over 40 layers, biases;
    with power, W_V and W_O carry factors 2^±power, whose gradients scale by 2^∓power exactly)."""
    (attn, x, w_v, w_o), _ = deep_network(50.0)
    attn, x, w_v, w_o = (t.double() for t in (attn, x, w_v, w_o))
    b_o = torch.randn(40, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    direction = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    inputs = [t.clone().requires_grad_() for t in (x, w_v * 2.0**power, w_o * 2.0**-power, b_o)]
    sums = pk.length_sums(attn, inputs[0], inputs[1], inputs[2], b_o=inputs[3])
    got = torch.autograd.grad((sums.sum(0) * direction).sum(), inputs)
    plain = [t.clone().requires_grad_() for t in (x, w_v, w_o, b_o)]
    expected = torch.autograd.grad((attention_network_ref(attn, *plain[:3], plain[3]) * direction).sum(), plain)
    for name, g, e, factor in zip(("x", "w_v", "w_o", "b_o"), got, expected, (0, -power, power, 0)):
        assert bool(e.abs().amax() > 1e40)  # the gradients are as far out as the sums
        torch.testing.assert_close(g * 2.0**-factor, e, rtol=1e-10, atol=1e-10 * float(e.abs().amax()), msg=name)


def test_truncated_output_refuses_a_sum_beyond_its_dtype():
    big = torch.full((3, 1, 2, 2), 2e38)
    with pytest.raises(
        ValueError,
        match=r"^pathkernels\.truncated_output: the output of the paths of length ≤ 1 exceed float32's largest "
        r"finite number \(3.4e\+38\): batch element 0 reaches about 4\.0e\+38",
    ):
        pk.truncated_output(big, 1)
    assert pk.truncated_output(big, 0).equal(big[0])
    torch.testing.assert_close(pk.truncated_output(big / 4, 1), big[0] / 2, rtol=0, atol=0)
    # float32 entries near both ends sum exactly where float32 holds the result.
    mixed = torch.tensor([[[1e38, 1e-30]], [[1e38, 1e-30]]])  # [L+1, n, d] = [2, 1, 2]
    torch.testing.assert_close(pk.truncated_output(mixed, 1), torch.tensor([[2e38, 2e-30]]), rtol=1e-7, atol=0)
    with pytest.raises(ValueError, match=r"^pathkernels\.truncated_output: .* exceed float64's largest finite number"):
        pk.truncated_output(torch.full((2, 2, 2), 1e308, dtype=torch.float64), 1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_truncated_output_scales_each_batch_element_alone(dtype):
    """Batch elements of 1e-300 and 1e300 (float32: 1e-30 and 1e30) side by side: each element's
    sum is its own, to the last digits (one power of two for the whole batch made the small one 0)."""
    tiny, huge = (1e-300, 1e300) if dtype == torch.float64 else (1e-30, 1e30)
    sums = torch.randn(4, 3, 2, 5, dtype=torch.float64)
    sums[:, 0] *= tiny
    sums[:, 2] *= huge
    sums = sums.to(dtype)
    got = pk.truncated_output(sums, 2)
    expected = sums[:3].double().sum(0)
    for b in range(3):
        torch.testing.assert_close(got[b].double(), expected[b], rtol=torch.finfo(dtype).eps, atol=0, msg=str(b))


def test_refusals_write_numbers_and_lengths_as_read():
    """The range refusals' numbers ("1.3e+68") and length lists ("3–5, 9")."""
    from pathkernels.core.length_sums import _listed, _power_of_ten

    assert _power_of_ten(math.log10(1.34e68)) == "1.3e+68"
    assert _power_of_ten(math.log10(1.26e-38)) == "1.3e-38"
    assert _power_of_ten(math.log10(9.96)) == "1.0e+01"  # rounds up into the next decade
    assert _listed([3, 4, 5, 9]) == "3–5, 9"
    assert _listed([0, 2]) == "0, 2"
    assert _listed([1, 2]) == "1–2"
    assert _listed([0, 2, 3]) == "0, 2–3"  # a run continues the last run, not the first


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_memory_estimate_counts_each_array_of_the_recursion(monkeypatch, dtype):
    """[L, B, H, n, d] mixed sums, [L+1, B, n, d] sums in three copies (float64), a float32 result,
    and the checks' bool and float64 copies of attn (9 bytes per entry): B, L, H, n and d all differ,
    so that a size read from the wrong dimension changes the estimate."""
    from pathkernels.core import _memory

    batch, layers, heads, n, d = 2, 3, 4, 5, 6
    attn, x, w_v, w_o = network(batch, layers, heads, n, d, 7, dtype=dtype)
    result = 0 if dtype == torch.float64 else (layers + 1) * batch * n * d * 4
    need = (layers * heads + 3 * (layers + 1)) * batch * n * d * 8 + result + 9 * batch * layers * heads * n * n
    monkeypatch.setattr(_memory, "available_memory", lambda device: need - 1)
    with pytest.raises(ValueError, match=r"^pathkernels\.length_sums: 3 layers × 4 heads of \[B, n, d\] = \[2, 5, 6\]"):
        pk.length_sums(attn, x, w_v, w_o)
    monkeypatch.setattr(_memory, "available_memory", lambda device: need)
    assert pk.length_sums(attn, x, w_v, w_o).shape == (layers + 1, batch, n, d)


def test_a_padded_batch_is_summed_on_each_sequences_real_tokens():
    """Sequences of 5, 3 and 2 real tokens of 5: each one's sums are those of its real block alone,
    its padded rows 0; one length more than the layers (3, and 2 heads: no size stands for another)."""
    from pathkernels.testing import padded_network

    attn, x, w_v, w_o, mask = padded_network([5, 3, 2], layers=3, heads=2, n=5, d=4)
    sums = pk.length_sums(attn, x, w_v, w_o, token_mask=mask)
    assert sums.shape == (4, 3, 5, 4)
    for b, length in enumerate([5, 3, 2]):
        alone = pk.length_sums(attn[b : b + 1, :, :, :length, :length], x[b : b + 1, :length], w_v, w_o)
        torch.testing.assert_close(sums[:, b, :length], alone[:, 0])
        assert not sums[:, b, length:].any()


@pytest.mark.parametrize(
    "sums, error, message",
    [
        (
            torch.ones(3, 2),
            ValueError,
            r"expected sums \[L\+1, B, n, d\] or \[L\+1, n, d\] from pk.length_sums, got \[3, 2\]",
        ),
        (torch.ones(0, 2, 2), ValueError, r"expected sums \[L\+1, B, n, d\] .*got \[0, 2, 2\]"),
        (torch.ones(3, 2, 2, device="meta"), ValueError, r"expected sums on a CPU or CUDA device, got meta"),
        (torch.ones(3, 2, 2, dtype=torch.long), TypeError, r"expected sums of a floating-point dtype"),
        (torch.full((3, 2, 2), math.nan), ValueError, r"sums has a non-finite value \(nan\)"),
    ],
)
def test_truncated_output_refuses_what_length_sums_does_not_give(sums, error, message):
    """They gave a number: an empty sum, an integer sum, NaN, a sum over the wrong axis."""
    with pytest.raises(error, match=r"^pathkernels\.truncated_output: " + message):
        pk.truncated_output(sums, 1)


def test_powers_of_two_are_exact_down_to_the_subnormals():
    """The scales' powers of two, built from their bits: every 2^k from 2^-1074 (the smallest
    subnormal) to 2^1023 exactly, 0 below, and products of two of them reaching 2^±2046."""
    from pathkernels.core.length_sums import _power_of_two, _times_power_of_two

    k = torch.arange(-1080, 1024)
    got = _power_of_two(k)
    want = torch.tensor([math.ldexp(1.0, int(e)) for e in k], dtype=torch.float64)  # 0 below 2^-1074
    assert torch.equal(got, want)
    t = torch.tensor([[1.5], [0.75], [1.0]], dtype=torch.float64)
    scaled = _times_power_of_two(t, torch.tensor([2046 - 1024, -2046 + 1000, -1100]))
    assert scaled.tolist() == [[math.ldexp(1.5, 1022)], [math.ldexp(0.75, -1046)], [0.0]]
