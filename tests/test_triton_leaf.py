"""The Triton leaf kernel (pathkernels.core.triton_leaf): every head's leaves of a block of
parents in one launch. Where there is no GPU it runs in Triton's interpreter: TRITON_INTERPRET=1 is
set only while this file imports pathkernels.core.triton_leaf (Triton reads it when the kernels are
decorated) and restored at once, so no other test sees it. On a GPU the same tests run the compiled
kernel. Checked against a float64 reference written from the formula, against the CPU-tested
`_fused_leaf_norms` op head by head, against a float64 emulation of the TF32 arithmetic (the operands
rounded by frexp, independently of the kernel's bit arithmetic), and on hand-worked leaves whose
exact values tell the three precisions apart."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton_interpreter import compiled_for_the_gpu, kernel_module, printed_without_triton

import pathkernels as pk
from pathkernels.reference import composite_norm_ref
from pathkernels.reference import triton_leaf_norms_ref as reference
from pathkernels.testing import random_attention

MODULE = "pathkernels.core.triton_leaf"
U = 2.0**-24  # float32's unit round-off
# Error per product beyond float32's, relative to |C(A)| |R'|: tf32x3 drops lo·lo and rounds lo;
# one TF32 pass rounds both operands to 11 significant bits. Triton's own tf32x3 (GPU only; the
# interpreter runs it as IEEE) is given more room: its split of lo is not documented.
EXTRA = {"ieee": 0.0, "tf32x3": 3 * 2.0**-22, "tf32": 2.0**-10, "tf32x3-triton": 2.0**-20}
PRECISIONS = ["ieee", "tf32x3", "tf32"]

# (n, m, H, c): n and m on both sides of the 16/32/64/128-row blocks, the 32-deep k-slices and the
# 64-column tiles of the default config; H odd, so that the last group of two heads is partial.
SHAPES = [
    (1, 1, 1, 1),
    (3, 5, 2, 3),
    (17, 33, 3, 4),
    (40, 70, 3, 2),
    (64, 64, 2, 2),
    (100, 150, 1, 2),
    (128, 129, 2, 1),
]


@pytest.fixture(scope="module")
def triton_leaf():
    return kernel_module(MODULE, "the Triton leaf kernels")


@pytest.fixture(autouse=True)
def one_config(monkeypatch):
    """On the GPU the op launches DEFAULT_CONFIG alone (the interpreter always does): one compilation
    per case, no autotuning, unless a test asks for the autotuner."""
    monkeypatch.setenv("PATHKERNELS_TRITON_CONFIGS", "default")


@pytest.fixture
def device(triton_leaf):
    """The interpreter's CPU tensors, or the GPU's (this file's tests need no other device)."""
    return "cpu" if triton_leaf.INTERPRETED else "cuda"


def leaf_inputs(n, m, heads, count, device, *, mean_scale=1.0):
    """C(A_h) and a_h of random attention, and random parents R' [n, c, m] and means μ_k: float32."""
    attn = random_attention(heads, n, n, dtype=torch.float64)
    attn_mean = attn.mean(1)
    attn_centred = attn - attn_mean[:, None, :]
    parents = torch.randn(n, count, m, dtype=torch.float64)
    parent_means = torch.randn(count, m, dtype=torch.float64) * mean_scale
    return [t.float().to(device) for t in (attn_centred, attn_mean, parents, parent_means)]


def slack(attn_centred, attn_mean, parents, scale=None, precision="ieee"):
    """Absolute errors [c, H] that the kernel's float32 arithmetic may carry into (residual, norm):
    the dot-product bound (n·2⁻²⁴ plus the precision's operand rounding) times the largest column or
    row sum of |C(A_h)| |R'_k|, ×4 for the composite's geometric mean; the norm adds μ's float32 dot
    a_hᵀR'_k (n·2⁻²⁴ |a_h|ᵀ|R'_k| per column, in each of a column's n entries and in a row's m)."""
    n = attn_centred.shape[-1]
    magnitude = torch.einsum("hik,kcj->chij", attn_centred.double().abs().cpu(), parents.double().abs().cpu())
    largest = torch.maximum(magnitude.sum(-2).amax(-1), magnitude.sum(-1).amax(-1))
    residual = 4 * (n * U + EXTRA[precision]) * largest
    shift = torch.einsum("hk,kcj->chj", attn_mean.double().abs().cpu(), parents.double().abs().cpu())
    mean = 4 * n * U * torch.maximum(n * shift.amax(-1), shift.sum(-1))
    if scale is not None:
        residual = residual * scale.double().cpu()[:, None]
        mean = mean * scale.double().cpu()[:, None]
    return residual, residual + mean


def assert_within(got, expected, bound):
    error = (got.double().cpu() - expected).abs()
    assert (error <= 1e-12 * expected + bound).all(), (error, bound)


def tf32(x):
    """float64 copy of x (float32) rounded to TF32 from the definition: 11 significant bits, to
    nearest, ties away from zero (x = f·2^e, 0.5 ≤ |f| < 1, keeps round(f·2¹¹)/2¹¹)."""
    fraction, exponent = torch.frexp(x.double().cpu())
    kept = torch.sign(fraction) * torch.floor(fraction.abs() * 2**11 + 0.5) / 2**11
    return torch.ldexp(kept, exponent)


def emulated(attn_centred, attn_mean, parents, parent_means, precision):
    """The norms of the leaves whose products are taken as the precision's split defines them, in
    float64 (every product of TF32 parts exact): ieee C·R, tf32 hi(C)·hi(R), tf32x3
    hi·hi + hi·lo + lo·hi with lo = tf32(x − hi). μ is the float32 kernel's in every precision."""
    attn, right = attn_centred.double().cpu(), parents.double().cpu()
    if precision == "ieee":
        leaves = torch.einsum("hik,kcj->chij", attn, right)
    else:
        attn_hi, right_hi = tf32(attn_centred), tf32(parents)
        leaves = torch.einsum("hik,kcj->chij", attn_hi, right_hi)
        if precision == "tf32x3":
            attn_lo, right_lo = tf32((attn - attn_hi).float()), tf32((right - right_hi).float())
            leaves = leaves + torch.einsum("hik,kcj->chij", attn_hi, right_lo)
            leaves = leaves + torch.einsum("hik,kcj->chij", attn_lo, right_hi)
    means = parent_means.double().cpu()[:, None, :] + torch.einsum("hk,kcj->chj", attn_mean.double().cpu(), right)
    return composite_norm_ref(leaves), composite_norm_ref(leaves + means[:, :, None, :])


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_float64_reference(triton_leaf, device, precision, shape):
    n, m, heads, count = shape
    inputs = leaf_inputs(n, m, heads, count, device)
    residual, norm = triton_leaf.triton_leaf_norms(*inputs, precision=precision)
    assert residual.shape == norm.shape == (count, heads) and residual.device == inputs[0].device
    assert residual.dtype == norm.dtype == torch.float64
    bounds = slack(*inputs[:3], precision=precision)
    for got, expected, bound in zip((residual, norm), reference(*inputs), bounds):
        assert_within(got, expected, bound)


def rounded_down_by_tf32(shape, device):
    """float32 entries ±2^e (1 + 2⁻¹²), e in {-2, …, 1}: each lies a quarter of a TF32 unit above
    ±2^e, so one TF32 pass shrinks every one of them by the same factor 1/(1 + 2⁻¹²). Random
    parents round up and down at random, and their leaves' norms may land within the IEEE slack of
    the exact ones (1 seed in 60 did); with these the farthest lies > 2× the slack away in each of
    3,000 seeds tried."""
    signs = torch.randint(0, 2, shape) * 2 - 1
    exponents = torch.randint(-2, 2, shape)
    return (signs * torch.ldexp(torch.full(shape, 1 + 2.0**-12, dtype=torch.float64), exponents)).float().to(device)


@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
def test_tf32_arithmetic_matches_its_emulation(triton_leaf, device, precision):
    """The kernel's products are those of the explicit split, up to float32's accumulation alone:
    its results lie within the IEEE slack of the float64 emulation of the split. The parents are
    ones that TF32 rounds by a known amount, so for one TF32 pass the emulation is far from the
    exact leaves and this checks the rounding itself."""
    attn_centred, attn_mean, parents, parent_means = leaf_inputs(64, 48, 3, 3, device, mean_scale=0.1)
    parents = rounded_down_by_tf32(parents.shape, device)
    assert (tf32(parents) * (1 + 2.0**-12) == parents.double().cpu()).all()
    inputs = [attn_centred, attn_mean, parents, parent_means]
    got = triton_leaf.triton_leaf_norms(*inputs, precision=precision)
    bounds = slack(*inputs[:3], precision="ieee")
    for value, expected, bound in zip(got, emulated(*inputs, precision), bounds):
        assert_within(value, expected, bound)
    if precision == "tf32":
        exact = reference(*inputs)[0]
        assert ((emulated(*inputs, precision)[0] - exact).abs() > bounds[0]).any()


HAND_WORKED_LEFT = [[0.5, -0.5], [-0.5, 0.5]]


@pytest.mark.parametrize("precision", [*PRECISIONS, "tf32x3-triton"])
def test_hand_worked_leaf(triton_leaf, device, precision):
    """C(A) = [[.5, -.5], [-.5, .5]] times R' = I: every column and row of R sums to 1 in |·|, so 1.
    With μ_k = (1, 2) and a = (.25, .75), μ = μ_k + R'ᵀa = (1.25, 2.75) and
    1μᵀ + R = [[1.75, 2.25], [.75, 3.25]]: column sums (2.5, 5.5), row sums (4, 4), so √22.
    Every value is exact in TF32, so each precision gets them exactly."""
    attn = torch.tensor([HAND_WORKED_LEFT], device=device)
    attn_mean = torch.tensor([[0.25, 0.75]], device=device)
    parents = torch.eye(2, device=device)[:, None, :]
    parent_means = torch.tensor([[1.0, 2.0]], device=device)
    residual, norm = triton_leaf.triton_leaf_norms(attn, attn_mean, parents, parent_means, precision=precision)
    assert residual.tolist() == [[1.0]]
    assert norm.item() == pytest.approx(22**0.5, rel=1e-15)


def test_precisions_by_hand(triton_leaf, device):
    """x = 1 + 2⁻¹² + 2⁻²³ needs 24 significant bits; C(A) = (x/2)·[[1, −1], [−1, 1]], R' = x·I, so
    every entry of R is ±x²/2 and the residual is x² = 1 + 2⁻¹¹ + 2⁻²² + 2⁻²⁴ + 2⁻⁴⁶, whose bits tell
    the arithmetic apart: IEEE rounds x·x once (1 + 2⁻¹¹ + 2⁻²² + 2⁻²³); 3×TF32 splits x/2 into
    .5 + (2⁻¹³ + 2⁻²³) and x into 1 + (2⁻¹² + 2⁻²²) (lo rounded to TF32: ties away from zero) and adds
    lo·hi + hi·lo + hi·hi exactly (1 + 2⁻¹¹ + 2⁻²¹); one TF32 pass keeps .5 · 1 (1). An unrounded lo
    would give IEEE's value, a missing lo·hi or hi·lo 1 + 2⁻¹² + 2⁻²²."""
    x = 1 + 2.0**-12 + 2.0**-23
    attn = (x / 2) * torch.tensor([[[1.0, -1.0], [-1.0, 1.0]]], device=device)
    parents = x * torch.eye(2, device=device)[:, None, :]
    zeros = torch.zeros(1, 2, device=device)
    expected = {"ieee": 1 + 2.0**-11 + 2.0**-22 + 2.0**-23, "tf32x3": 1 + 2.0**-11 + 2.0**-21, "tf32": 1.0}
    for precision, value in expected.items():
        residual, norm = triton_leaf.triton_leaf_norms(attn, zeros, parents, zeros, precision=precision)
        assert residual.item() == value, precision
        assert norm.item() == value, precision  # μ = 0: the product is its residual
    # Triton's own 3×TF32 (the interpreter runs it as IEEE): float32-accurate, its bits its own.
    residual, _ = triton_leaf.triton_leaf_norms(attn, zeros, parents, zeros, precision="tf32x3-triton")
    assert residual.item() == pytest.approx(x * x, rel=2.0**-20)


def test_matches_fused_leaf_op_head_by_head(triton_leaf, device):
    """The engine's path for the same leaves: per head, μ = μ_k + s R'ᵀa_h (rounded to float32, as
    the engine passes it) and the CPU-tested `_fused_leaf_norms` of C(A_h) and R'. Both report
    float64 sums of the same float32 products, so they agree within both kernels' slack (and μ's
    rounding for the norm)."""
    n, m, heads, count = 33, 40, 3, 4
    inputs = leaf_inputs(n, m, heads, count, device)
    attn_centred, attn_mean, parents, parent_means = inputs
    scale = torch.tensor([1.0, 2.0**-20, 2.0**5, 0.5], dtype=torch.float64, device=device)
    kernels = {"ieee": "simt", "tf32x3": "tf32x3", "tf32": "tf32"}
    for precision, kernel in kernels.items():
        residual, norm = triton_leaf.triton_leaf_norms(*inputs, scale, precision=precision)
        residual_bound, norm_bound = slack(attn_centred, attn_mean, parents, scale, precision)
        for h in range(heads):
            shift = torch.einsum("k,kcj->cj", attn_mean[h].double(), parents.double())
            mean = (parent_means.double() + scale[:, None] * shift).float()
            fused = torch.ops.pathkernels._fused_leaf_norms(attn_centred[h], parents, mean, scale, kernel)
            rounding = 4 * U * torch.maximum(n * mean.abs().amax(-1), mean.abs().sum(-1)).double().cpu()
            assert_within(residual[:, h], fused[0].cpu(), 2 * residual_bound[:, h])
            assert_within(norm[:, h], fused[1].cpu(), 2 * norm_bound[:, h] + rounding)


@pytest.mark.parametrize("precision", ["ieee", "tf32x3"])
def test_scaled_leaves(triton_leaf, device, precision):
    """Parent k is R_k = s_k R'_k (the engine's renormalised nodes): the residual is s_k times the
    unscaled one, bit for bit, and the product 1μᵀ + R is taken at the true scale, also where s_k R'
    lies far below float32's range."""
    n, m, heads, count = 40, 70, 2, 5
    inputs = leaf_inputs(n, m, heads, count, device, mean_scale=1e-3)
    inputs[3][1] = 0  # with s = 2⁻²⁰⁰: μ = s R'ᵀa, a product far below float32's range
    scale = torch.tensor([2.0**-300, 2.0**-200, 2.0**-10, 2.0**40, 2.0**-60], dtype=torch.float64, device=device)
    residual, norm = triton_leaf.triton_leaf_norms(*inputs, scale, precision=precision)
    unscaled, _ = triton_leaf.triton_leaf_norms(*inputs, precision=precision)
    assert torch.equal(residual, unscaled * scale[:, None])
    assert residual[0].max().item() < 1e-80 and norm[1].max().item() < 1e-50  # far outside float32's range
    bounds = slack(*inputs[:3], scale, precision)
    for got, expected, bound in zip((residual, norm), reference(*inputs, scale), bounds):
        assert_within(got, expected, bound)


def test_norms_beyond_float64_products(triton_leaf, device):
    """Scales far from 1 (2⁻⁶⁰⁰, 2⁵⁰⁰) with μ_k = 0: every entry of 1μᵀ + R is s times the unscaled
    one, so are its sums, and ‖·‖_1 ‖·‖_∞ leaves float64's range (underflow, overflow); the composite
    is then sqrt(‖·‖_1) sqrt(‖·‖_∞), as composite_from_parts takes it: s times the unscaled norm."""
    inputs = leaf_inputs(12, 10, 2, 2, device)
    inputs[3] = torch.zeros_like(inputs[3])
    scale = torch.tensor([2.0**-600, 2.0**500], dtype=torch.float64, device=device)
    residual, norm = triton_leaf.triton_leaf_norms(*inputs, scale, precision="ieee")
    unscaled_residual, unscaled_norm = triton_leaf.triton_leaf_norms(*inputs, precision="ieee")
    assert torch.equal(residual, unscaled_residual * scale[:, None])
    torch.testing.assert_close(norm, unscaled_norm * scale[:, None], rtol=1e-14, atol=0)


@pytest.mark.parametrize(
    "config",
    [(32, 16, 1, 4, 2), (64, 32, 3, 4, 2), (128, 64, 2, 8, 2), (32, 128, 4, 4, 1)],
    ids=lambda c: "m{}-k{}-h{}".format(*c[:3]),
)
def test_launch_configs(triton_leaf, device, config):
    """Every tiling reduces the same leaves: column tiles narrower than m (row sums added over tiles),
    k-slices shallower and deeper than n, head groups of one, of all heads, and partial ones."""
    n, m, heads, count = 70, 100, 3, 2
    inputs = leaf_inputs(n, m, heads, count, device)
    got = triton_leaf.triton_leaf_norms(*inputs, precision="tf32x3", config=config)
    for value, expected, bound in zip(got, reference(*inputs), slack(*inputs[:3], precision="tf32x3")):
        assert_within(value, expected, bound)


def test_layouts_and_strides(triton_leaf, device):
    """Any strides: C(A) transposed, parents as a run of a level ([n, N, m] narrowed, as the engine
    passes them) or as a [c, n, m] tensor transposed, means with a column stride, a strided scale."""
    n, m, heads, count = 24, 20, 2, 3
    attn_centred, attn_mean, parents, parent_means = leaf_inputs(n, m, heads, count, device)
    level = torch.randn(n, count + 3, m, device=device)
    run = level[:, 2 : count + 2]
    stacked = torch.randn(count, n, m, device=device).transpose(0, 1)
    means_t = torch.randn(m, count, device=device).t()
    scale = torch.tensor([1.0, 9.0, 2.0**-3, 7.0, 4.0, 5.0], dtype=torch.float64, device=device)[::2]
    attn_t = attn_centred.transpose(1, 2)
    attn_mean_strided = torch.stack([attn_mean, attn_mean], -1)[..., 0]
    for args in [
        (attn_t, attn_mean, run, parent_means, None),
        (attn_centred, attn_mean_strided, stacked, means_t, scale),
        (attn_t, attn_mean, parents, means_t, scale),
    ]:
        got = triton_leaf.triton_leaf_norms(*args, precision="ieee")
        for value, expected, bound in zip(got, reference(*args), slack(*args[:3], args[4])):
            assert_within(value, expected, bound)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy meets the NaN and ∞
def test_nan_and_inf_reach_the_norms(triton_leaf, device):
    """A NaN in a parent makes every norm of its leaves NaN, an infinity makes them infinite (or NaN
    where ∞ − ∞ arises), as in the CUDA kernels; the other parents' leaves are untouched."""
    n, m, heads, count = 20, 40, 2, 3
    inputs = leaf_inputs(n, m, heads, count, device)
    parents = inputs[2].clone()
    parents[3, 0, 35] = float("nan")  # parent 0, in the second of two 32-column tiles
    parents[5, 2, 1] = float("inf")  # parent 2
    config = (32, 16, 1, 4, 2)
    residual, norm = triton_leaf.triton_leaf_norms(*inputs[:2], parents, inputs[3], precision="ieee", config=config)
    assert residual[0].isnan().all() and norm[0].isnan().all()
    assert not residual[2].isfinite().any() and not norm[2].isfinite().any()
    clean = [*inputs[:2], parents[:, 1:2], inputs[3][1:2]]
    expected = triton_leaf.triton_leaf_norms(*clean, precision="ieee", config=config)
    assert torch.equal(residual[1:2], expected[0]) and torch.equal(norm[1:2], expected[1])


def test_no_parents(triton_leaf, device):
    attn_centred, attn_mean, _, _ = leaf_inputs(8, 5, 3, 1, device)
    residual, norm = triton_leaf.triton_leaf_norms(
        attn_centred, attn_mean, torch.zeros(8, 0, 5, device=device), torch.zeros(0, 5, device=device)
    )
    assert residual.shape == norm.shape == (0, 3) and residual.dtype == torch.float64


def test_bad_input(triton_leaf, device):
    fn = triton_leaf.triton_leaf_norms
    attn, attn_mean, parents, means = leaf_inputs(4, 3, 2, 2, device)
    name = "pathkernels.triton_leaf_norms: "
    cases = [
        ((torch.zeros(2, 129, 129, device=device), torch.zeros(2, 129, device=device), parents, means), ValueError,
         "expected 1 <= n <= 128 rows, got n = 129"),
        ((attn[:, :, :3], attn_mean, parents, means), ValueError, r"expected attn_centred \[H, n, n\]"),
        ((attn, attn_mean[:, :3], parents, means), ValueError, r"expected attn_mean \[H, n\] = \[2, 4\]"),
        ((attn, attn_mean, parents[:3], means), ValueError, r"expected parents \[n, c, m\] with n = 4"),
        ((attn, attn_mean, parents[:, :, :0], means[:, :0]), ValueError,
         r"expected parents \[n, c, m\] with n = 4 and m >= 1, got shape \[4, 2, 0\]"),
        ((attn, attn_mean, parents, means[:1]), ValueError, r"expected parent_means \[c, m\] = \[2, 3\]"),
        ((attn.double(), attn_mean, parents, means), TypeError, "expected attn_centred in torch.float32"),
        ((attn, attn_mean, parents.half(), means), TypeError, "expected parents in torch.float32"),
        ((attn, attn_mean, parents, means, torch.ones(3, dtype=torch.float64, device=device)), ValueError,
         r"expected scale \[c\] = \[2\], got \[3\]"),
        ((attn, attn_mean, parents, means, torch.ones(2, device=device)), TypeError,
         "expected scale in torch.float64"),
        ((attn, attn_mean, parents, means, torch.tensor([1.0, -2.0], dtype=torch.float64, device=device)),
         ValueError, "expected every scale to be a positive finite number"),
        ((attn, attn_mean, parents, means.to("meta")), ValueError,
         "expected every tensor on one device, got attn_centred on"),
        ((attn, attn_mean, "parents", means), TypeError, "expected parents to be a torch.Tensor, got str"),
    ]  # fmt: skip
    for args, error, message in cases:
        with pytest.raises(error, match=name + message):
            fn(*args)
    with pytest.raises(ValueError, match=name + "expected precision in"):
        fn(attn, attn_mean, parents, means, precision="fp16")


def test_refuses_the_other_device(triton_leaf):
    """Compiled kernels take CUDA tensors; interpreted ones, CPU tensors: the other is refused."""
    wrong = "meta"
    if triton_leaf.INTERPRETED and torch.cuda.is_available():
        wrong = "cuda"
    elif not triton_leaf.INTERPRETED:
        wrong = "cpu"
    if wrong == "meta":
        pytest.skip("no second device to refuse")
    inputs = leaf_inputs(4, 3, 2, 2, wrong)
    with pytest.raises(ValueError, match="pathkernels.triton_leaf_norms: "):
        triton_leaf.triton_leaf_norms(*inputs)


def test_torch_op_schema_and_fake(triton_leaf, device):
    """The registered op (torch.library.triton_op) and its fake kernel: shapes on fake tensors, the
    checks that need no data, and torch.library.opcheck (on the GPU, its autograd and AOT checks
    as well; the interpreter's kernels cannot run on the fake tensors those trace with)."""
    op = triton_leaf.op()
    assert op is torch.ops.pathkernels.triton_leaf_norms.default
    assert str(op._schema) == (
        "pathkernels::triton_leaf_norms(Tensor attn_centred, Tensor attn_mean, Tensor parents, "
        'Tensor parent_means, Tensor? scale=None, str precision="tf32x3") -> (Tensor, Tensor)'
    )
    inputs = leaf_inputs(6, 5, 3, 4, device)
    scale = torch.full((4,), 0.5, dtype=torch.float64, device=device)
    with torch._subclasses.FakeTensorMode() as mode:
        fakes = [mode.from_tensor(t) for t in (*inputs, scale)]
        residual, norm = op(*fakes, "ieee")
        assert residual.shape == norm.shape == (4, 3) and norm.dtype == torch.float64
        with pytest.raises(ValueError, match=r"expected parent_means \[c, m\]"):
            op(*fakes[:3], fakes[3][:2], None, "ieee")
    if device == "cuda":
        torch.library.opcheck(op, (*inputs, scale, "ieee"))
    else:
        torch.library.opcheck(op, (*inputs, scale, "ieee"), test_utils=("test_schema", "test_faketensor"))


def test_autotuned_op(triton_leaf, device, monkeypatch):
    """The op as the engine would call it: on the GPU through the autotuner (its quick space here),
    which then names its choice; in the interpreter with the default config."""
    if device != "cuda":
        pytest.skip("the autotuner runs on the GPU only")
    monkeypatch.setenv("PATHKERNELS_TRITON_CONFIGS", "quick")
    inputs = leaf_inputs(64, 64, 4, 8, device)
    got = triton_leaf.triton_leaf_norms(*inputs, precision="tf32x3")
    for value, expected, bound in zip(got, reference(*inputs), slack(*inputs[:3], precision="tf32x3")):
        assert_within(value, expected, bound)
    chosen = triton_leaf.chosen_config()
    assert chosen is not None and {"BLOCK_M", "BLOCK_K", "GROUP_H", "num_warps"} <= set(chosen["config"])


def test_compile_fullgraph(triton_leaf, device):
    """torch.compile traces into the op (triton_op) and runs its kernel (GPU only)."""
    if device != "cuda":
        pytest.skip("torch.compile of Triton kernels needs the GPU")
    inputs = leaf_inputs(32, 32, 2, 4, device)

    @torch.compile(fullgraph=True)
    def leaf_ratios(attn_centred, attn_mean, parents, parent_means):
        residual, norm = torch.ops.pathkernels.triton_leaf_norms(attn_centred, attn_mean, parents, parent_means)
        return residual / norm

    triton_leaf.op()
    residual, norm = reference(*inputs)
    torch.testing.assert_close(leaf_ratios(*inputs).cpu(), residual / norm, rtol=1e-4, atol=0)


# --- the engine's "triton_*" leaf kernels -----------------------------------------------------------
# path_chunk_norms(leaf_kernel="triton_tf32x3" | "triton_tf32") takes each leaf level whose every head
# has the same parents through this op, which the engine's C++ calls through the dispatcher
# (csrc/paths/engine.h, every_head_leaves), on the CPU in the interpreter as on the GPU.


@pytest.mark.parametrize("precision", ["tf32x3", "tf32"])
@pytest.mark.parametrize("layers, heads, n, skip", [(3, 3, 8, False), (2, 2, 37, True), (1, 4, 5, True)])
def test_the_engine_takes_complete_leaf_levels_through_the_op(
    triton_leaf, device, monkeypatch, precision, layers, heads, n, skip
):
    """Complete trees, two batch elements in one chunk: the op launched once per batch element for
    every head's leaves, within its precision of the float64 engine (a leaf written to another's
    place would be off by far more); the skip leaves reduced as before."""
    from test_heads_leaf import engine_attention, engine_norms, relative_errors

    triton_leaf.op()
    launched = []
    launch = triton_leaf._launch

    def counted(attn_centred, attn_mean, parents, *args, **kwargs):
        launched.append((attn_centred.shape[0], parents.shape[1]))  # heads, parents
        return launch(attn_centred, attn_mean, parents, *args, **kwargs)

    monkeypatch.setattr(triton_leaf, "_launch", counted)
    attn = engine_attention(2, layers, heads, n).to(device)
    tree = pk.PathTree.complete(layers, heads, skip=skip)
    got, want = engine_norms(attn, tree, "triton_" + precision)
    parents = (heads + skip) ** (layers - 1)
    assert launched == [(heads, parents)] * 2
    last_head = tree.paths()[:, -1] >= 0
    for error in relative_errors(got, want):
        error = error.view(2, -1).cpu()
        assert error[:, last_head].max() < (2e-2 if precision == "tf32" else 2e-5)
        if skip:
            assert error[:, ~last_head].max() < 5e-6


def test_the_engine_names_the_triton_leaf_kernels(triton_leaf, device):
    """The public name "triton" (the CPU sends "simt", as for "heads"); float64 refused by name."""
    from test_heads_leaf import engine_attention, engine_norms

    attn = engine_attention(1, 2, 2, 4)
    tree = pk.PathTree.complete(2, 2)
    if device == "cpu":
        fused = pk.path_residuals(attn, tree)
        result = pk.path_residuals(attn, tree, leaf_kernel="triton")
        assert torch.equal(result.residual, fused.residual) and torch.equal(result.norm, fused.norm)
    with pytest.raises(ValueError, match="leaf_kernel='triton' runs on TF32 tensor cores and takes float32"):
        pk.path_residuals(attn.double().to(device), tree, leaf_kernel="triton")
    with pytest.raises(TypeError, match="leaf_kernel='triton_tf32' runs on TF32 tensor cores"):
        engine_norms(attn.double() / attn.double().sum(-1, keepdim=True), tree, "triton_tf32")


def test_the_engine_refuses_the_op_unregistered():
    """The engine's C++ finds the op through the dispatcher: in a process that never registered it,
    leaf_kernel="triton_tf32x3" is refused with what to do, not a crash (a fresh interpreter)."""
    script = (
        "import torch, pathkernels as pk\n"
        "from pathkernels.core.engine import check_inputs, leaf_norms\n"
        "attn = torch.softmax(torch.randn(1, 2, 2, 4, 4), -1)\n"
        "tree = pk.PathTree.complete(2, 2)\n"
        "net, budget = check_inputs(attn, tree, None, None, None, 2**22, 'test')\n"
        "try:\n"
        "    leaf_norms(net, tree, 0, tree.num_leaves, budget, leaf_kernel='triton_tf32x3', where='test')\n"
        "except RuntimeError as error:\n"
        "    print(str(error).splitlines()[0])\n"
    )
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(
        "pathkernels.path_chunk_norms: leaf_kernel 'triton_tf32x3' calls the Triton op "
        "pathkernels::triton_leaf_norms, which is not registered"
    ), result.stdout


COMPILE_SCRIPT = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import pathkernels.core.triton_leaf as t

kernel = t._leaf_norms_kernel
pointers = {"attn_ptr": "*fp32", "attn_mean_ptr": "*fp32", "parents_ptr": "*fp32", "parent_means_ptr": "*fp32",
            "scale_ptr": "*fp64", "residual_ptr": "*fp64", "norm_ptr": "*fp64"}
patterns = {"mma": r"\bmma\.sync\.aligned\.\w+\.row\.col\.f32\.tf32\.tf32\.f32",
            "wgmma": r"\bwgmma\.mma_async\.\S*tf32", "fma": r"\bfma\.rn\.f32", "sqrt": r"\bsqrt\.rn\.f64"}
counts = {}
for arch in (80, 90):
    for precision, code in t.PRECISIONS.items():
        constants = {"PRECISION": code, "HAS_SCALE": True, "BLOCK_N": 32, "BLOCK_M": 32, "BLOCK_K": 16, "GROUP_H": 2}
        signature = {a: pointers.get(a, "constexpr" if a in constants else "i32") for a in kernel.arg_names}
        source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
        options = {"num_warps": 4, "num_stages": 1}
        ptx = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options).asm["ptx"]
        counts[f"{arch}/{precision}"] = {k: len(re.findall(p, ptx)) for k, p in patterns.items()}
print(json.dumps(counts))
"""


def test_compiles_for_the_gpu(triton_leaf, device):
    """Without a GPU: the kernel compiled by Triton for sm_80 and sm_90 (its own ptxas; no driver), in
    a fresh interpreter without TRITON_INTERPRET, and the PTX's shape: IEEE on CUDA cores alone, each
    TF32 precision on tensor cores (mma.sync, or wgmma on sm_90 where the tile allows), 3×TF32 in three passes
    (Triton's own tf32x3 as well), and the composite's float64 square roots correctly rounded."""
    if device == "cuda":
        pytest.skip("the GPU runs the compiled kernel itself")
    counts = compiled_for_the_gpu(COMPILE_SCRIPT)
    for arch in (80, 90):
        ieee, tf32, tf32x3, native = (counts[f"{arch}/{p}"] for p in ("ieee", "tf32", "tf32x3", "tf32x3-triton"))
        assert ieee["mma"] == ieee["wgmma"] == 0 and ieee["fma"] > 0, (arch, ieee)
        # Three passes of one layout each (the layout, and so the count per pass, is Triton's choice).
        one = tf32["mma"] + tf32["wgmma"]
        for passes in (tf32x3, native):
            three = passes["mma"] + passes["wgmma"]
            assert one > 0 and three > one and three % 3 == 0, (arch, tf32, passes)
        assert all(c["sqrt"] > 0 for c in (ieee, tf32, tf32x3, native))


def test_without_triton():
    """Where Triton is not installed, pathkernels and this module import, and the kernel's functions
    raise an error that names them (a fresh interpreter in which `import triton` fails)."""
    output = printed_without_triton(
        "import torch, pathkernels, pathkernels.core.triton_leaf as t\n"
        "x = torch.zeros(2, 2)\n"
        "try:\n"
        "    t.triton_leaf_norms(x[None], x[:1], x[:, None], x[:1])\n"
        "except RuntimeError as error:\n"
        "    print(error)\n"
    )
    message = "pathkernels.triton_leaf_norms: needs Triton (pip install triton), which is not installed"
    assert output.strip() == message
