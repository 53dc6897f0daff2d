"""composite_norm, residual_norm and matrix_norms: hand tables, float64 references, autograd,
torch.library checks, torch.compile and bad input, on every available device."""

import math

import pytest
import torch

import pathkernels as pk
from pathkernels.core import ops
from pathkernels.reference import (
    composite_norm_ref,
    matrix_norms_ref,
    residual_norm_ref,
    residual_ref,
)
from pathkernels.testing import devices, random_attention, random_matrices, tolerance

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def assert_close_to_ref(actual, expected_float64, dtype):
    torch.testing.assert_close(actual.double().cpu(), expected_float64.cpu(), **tolerance(dtype), equal_nan=True)


# --- hand-worked cases ----------------------------------------------------------------------


def test_hand_worked_two_by_two(device):
    # x = [[1, -2], [3, 4]]: column abs sums (4, 6), row abs sums (3, 7).
    # μ = (2, 1), res = [[-1, -3], [1, 3]]: column abs sums (2, 6), row abs sums (4, 4).
    x = torch.tensor([[1.0, -2.0], [3.0, 4.0]], dtype=torch.float64, device=device)
    plain = pk.matrix_norms(x)
    assert (plain.l1.item(), plain.linf.item()) == (6.0, 7.0)
    assert plain.composite.item() == pytest.approx(math.sqrt(42.0), rel=1e-15)
    res = pk.matrix_norms(x, residual=True)
    assert (res.l1.item(), res.linf.item()) == (6.0, 4.0)
    residual, norm = pk.residual_norm(x, return_norm=True)
    assert residual.item() == pytest.approx(math.sqrt(24.0), rel=1e-15)
    assert norm.item() == pytest.approx(math.sqrt(42.0), rel=1e-15)
    assert pk.composite_norm(x).item() == pytest.approx(math.sqrt(42.0), rel=1e-15)


@pytest.mark.parametrize("n", [1, 2, 5, 64])
def test_identity_and_uniform(device, n):
    # I: every row and column sums to 1. res(I) = I − 11ᵀ/n has abs sums (1 − 1/n) + (n − 1)/n.
    eye = torch.eye(n, dtype=torch.float64, device=device)
    assert pk.composite_norm(eye).item() == pytest.approx(1.0, rel=1e-15)
    assert pk.residual_norm(eye).item() == pytest.approx(2 * (n - 1) / n, rel=1e-14, abs=1e-15)
    # Uniform attention is exactly rank 1: its residual vanishes.
    uniform = torch.full((n, n), 1.0 / n, dtype=torch.float64, device=device)
    assert pk.residual_norm(uniform).item() == pytest.approx(0.0, abs=1e-15)
    assert pk.composite_norm(uniform).item() == pytest.approx(1.0, rel=1e-14)


def test_row_stochastic_norm_is_at_least_one(device):
    # ‖A‖_∞ = 1 for row-stochastic A, and ‖A‖_1 ≥ 1 since the column sums add up to n.
    attn = random_attention(16, 32, 32, dtype=torch.float64, device=device)
    norms = pk.matrix_norms(attn)
    torch.testing.assert_close(norms.linf, torch.ones_like(norms.linf))
    assert bool((norms.l1 >= 1 - 1e-12).all())


def test_single_row_has_zero_residual(device):
    x = random_matrices(4, 1, 7, dtype=torch.float64, device=device)
    assert torch.equal(pk.residual_norm(x), torch.zeros(4, dtype=torch.float64, device=device))


def test_ties_pick_the_first_index(device):
    # All columns and rows of the residual tie: argmax is the first of them, on every backend.
    x = torch.tensor([[1.0, -1.0], [-1.0, 1.0]], dtype=torch.float64, device=device)
    parts, argmax = torch.ops.pathkernels.norm_parts(x, True)
    assert argmax.tolist() == [[0, 0], [0, 0]]
    assert parts[0].tolist() == [2.0, 2.0, 2.0]


# --- random inputs against the float64 reference --------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 5), (3, 9, 4), (2, 3, 16, 16), (4, 64, 33), (2, 200, 130)])
def test_matches_reference(device, dtype, shape):
    x = random_matrices(*shape, dtype=dtype, device=device)
    x64 = x.double()
    residual, norm = pk.residual_norm(x, return_norm=True)
    assert residual.dtype == dtype and residual.shape == shape[:-2]
    assert_close_to_ref(residual, residual_norm_ref(x64), dtype)
    assert_close_to_ref(norm, composite_norm_ref(x64), dtype)
    assert_close_to_ref(pk.composite_norm(x), composite_norm_ref(x64), dtype)
    # Without return_norm the kernel skips x's own sums; the residual's arithmetic is unchanged.
    assert torch.equal(pk.residual_norm(x), residual)
    for got, want in zip(pk.matrix_norms(x, residual=True), matrix_norms_ref(residual_ref(x64))):
        assert_close_to_ref(got, want, dtype)


def test_float32_keeps_relative_precision_of_small_residuals(device):
    # A nearly rank-1 matrix: the residual is 1e-6 of the entries. Sums run in float64, so the
    # float32 result keeps float32 relative accuracy against the float64 truth.
    base = torch.rand(1, 48, dtype=torch.float64) + 1.0
    x64 = base.expand(40, 48) + 1e-6 * torch.randn(40, 48, dtype=torch.float64)
    x32 = x64.float()
    expected = residual_norm_ref(x32.double())
    torch.testing.assert_close(pk.residual_norm(x32.to(device)).double().cpu(), expected, rtol=2e-6, atol=0)


@pytest.mark.parametrize("layout", ["transposed", "strided", "expanded", "sliced_batch"])
def test_non_contiguous(device, layout):
    base = random_matrices(6, 20, 24, dtype=torch.float64, device=device)
    x = {
        "transposed": base.transpose(-1, -2),
        "strided": base[:, ::2, ::3],
        "expanded": base[:1].expand(5, 20, 24),
        "sliced_batch": base.permute(1, 0, 2)[:, 1:5],
    }[layout]
    assert not x.is_contiguous()
    residual, norm = pk.residual_norm(x, return_norm=True)
    torch.testing.assert_close(residual, residual_norm_ref(x.contiguous()), **tolerance(torch.float64))
    torch.testing.assert_close(norm, composite_norm_ref(x.contiguous()), **tolerance(torch.float64))
    assert torch.equal(pk.residual_norm(x), residual)


def test_expanded_leading_dims_that_do_not_merge_are_not_copied(device):
    """x [2, 2^31, 4, 4] expanded from [2, 1, 4, 4]: its leading dims cannot merge into one batch
    dimension, so a reshape would copy 2^35 entries (256 GiB). Each distinct matrix is reduced once,
    the results expanded back; the gradient reaches the base as the reference's does."""
    base = random_matrices(2, 1, 4, 4, dtype=torch.float64, device=device)
    x = base.expand(2, 2**31, 4, 4)
    residual, norm = pk.residual_norm(x, return_norm=True)
    assert residual.shape == norm.shape == (2, 2**31)
    torch.testing.assert_close(residual[:, :3], residual_norm_ref(base).expand(2, 3), **tolerance(torch.float64))
    torch.testing.assert_close(norm[:, -1], composite_norm_ref(base)[:, 0], **tolerance(torch.float64))
    assert pk.composite_norm(x).shape == pk.matrix_norms(x).l1.shape == (2, 2**31)
    small = base.expand(2, 3, 4, 4).permute(1, 0, 2, 3)  # [3, 2, 4, 4]: strides (0, 16, ...) do not merge
    mine, ref = base.clone().requires_grad_(), base.clone().requires_grad_()
    weights = torch.rand(3, 2, dtype=torch.float64, device=device)
    (pk.residual_norm(mine.expand(2, 3, 4, 4).permute(1, 0, 2, 3)) * weights).sum().backward()
    (residual_norm_ref(ref.expand(2, 3, 4, 4).permute(1, 0, 2, 3)) * weights).sum().backward()
    torch.testing.assert_close(mine.grad, ref.grad, **tolerance(torch.float64))
    assert torch.equal(pk.residual_norm(small), pk.residual_norm(small.contiguous()))


@pytest.mark.parametrize("shape", [(0, 4, 5), (3, 0, 2, 2), (2, 6, 0)])
def test_empty(device, shape):
    x = torch.zeros(shape, device=device)
    residual, norm = pk.residual_norm(x, return_norm=True)
    assert residual.shape == norm.shape == pk.residual_norm(x).shape == shape[:-2]
    assert bool((residual == 0).all()) and bool((norm == 0).all())
    assert pk.composite_norm(x).shape == shape[:-2]


def test_nan_and_inf_propagate_as_in_torch(device):
    x = random_matrices(4, 6, 5, dtype=torch.float64, device=device)
    x[1, 2, 3] = float("nan")
    x[2, 0, 0] = float("inf")
    x[3, 4, 1] = -float("inf")
    residual, norm = pk.residual_norm(x, return_norm=True)
    torch.testing.assert_close(residual, residual_norm_ref(x), equal_nan=True)
    torch.testing.assert_close(norm, composite_norm_ref(x), equal_nan=True)
    assert torch.isnan(residual[1]) and torch.isinf(norm[2]) and torch.isnan(residual[2])
    torch.testing.assert_close(pk.residual_norm(x), residual, equal_nan=True)


@pytest.mark.parametrize(
    "dtype, level, power",
    [
        (torch.float64, 1e308, 1000),
        (torch.float64, 4e307, 1000),
        (torch.bfloat16, 1e38, 120),
        (torch.float32, 1e38, 120),
    ],
)
def test_sums_that_overflow_leave_the_norms_that_do_not(device, dtype, level, power):
    """Entries near the top of the range: a column sum (the mean, an ℓ1 sum, float32's accumulation
    of bfloat16) overflows, while the residual is far smaller. Every norm is the float64 reference's
    of the matrix scaled by 2^-power, scaled back (inf only where the dtype cannot hold it); a matrix
    with an inf entry keeps inf, and the gradient is finite."""
    x = level * (1 + 0.01 * random_matrices(3, 6, 4, dtype=torch.float64)).clamp(0.98, 1.0)
    x[1] = level  # a constant matrix: residual exactly 0
    x = x.to(device=device, dtype=dtype)
    scaled = x.double() * 2.0**-power
    info = torch.finfo(dtype)
    for residual in (True, False):
        got = pk.matrix_norms(x, residual=residual)
        expected = matrix_norms_ref(residual_ref(scaled) if residual else scaled)
        for name, value, want in zip(("l1", "linf", "composite"), got, expected):
            want = want * 2.0**power
            want = torch.where(want > info.max, math.inf, want)  # beyond the dtype: inf, as it must be
            torch.testing.assert_close(value.double().cpu(), want.cpu(), **tolerance(dtype), msg=f"{name} {residual}")
    residual, norm = pk.residual_norm(x, return_norm=True)
    assert float(residual[1]) == 0.0 and bool(torch.isfinite(residual).all())
    assert torch.equal(residual, pk.matrix_norms(x, residual=True).composite)
    torch.testing.assert_close(norm, pk.composite_norm(x), rtol=0, atol=0)
    with_inf = x.clone()
    with_inf[0, 0, 0] = math.inf
    assert math.isnan(float(pk.residual_norm(with_inf)[0])) and float(pk.residual_norm(with_inf)[2]) == float(
        residual[2]
    )
    if dtype == torch.float64:
        leaf = x.clone().requires_grad_()
        pk.residual_norm(leaf).sum().backward()
        assert bool(torch.isfinite(leaf.grad).all()) and bool((leaf.grad != 0).any())


@pytest.mark.skipif("cuda" not in devices(), reason="needs a GPU and the CUDA kernels")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norm", [True, False])
def test_cpu_and_cuda_agree(dtype, with_norm):
    x = random_matrices(5, 3, 37, 29, dtype=dtype)
    cpu_parts, cpu_argmax = torch.ops.pathkernels.norm_parts(x, True, with_norm)
    cuda_parts, cuda_argmax = torch.ops.pathkernels.norm_parts(x.cuda(), True, with_norm)
    torch.testing.assert_close(cuda_parts.cpu(), cpu_parts, **tolerance(dtype))
    assert torch.equal(cuda_argmax.cpu(), cpu_argmax)


# --- autograd --------------------------------------------------------------------------------


def test_gradcheck(device):
    x = random_matrices(3, 6, 5, dtype=torch.float64, device=device).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: pk.residual_norm(t, return_norm=True), (x,))
    assert torch.autograd.gradcheck(pk.residual_norm, (x,))
    assert torch.autograd.gradcheck(pk.composite_norm, (x,))
    assert torch.autograd.gradcheck(lambda t: tuple(pk.matrix_norms(t, residual=True)), (x,))


@pytest.mark.parametrize("residual", [False, True])
def test_gradient_matches_reference_autograd(device, residual):
    x = random_matrices(4, 9, 7, dtype=torch.float64, device=device)
    weights = torch.rand(4, 3, dtype=torch.float64, device=device)
    mine = x.clone().requires_grad_()
    ref = x.clone().requires_grad_()
    got = torch.stack(tuple(pk.matrix_norms(mine, residual=residual)), -1)
    want = torch.stack(matrix_norms_ref(residual_ref(ref) if residual else ref), -1)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    torch.testing.assert_close(mine.grad, ref.grad, **tolerance(torch.float64))


@pytest.mark.parametrize("residual", [False, True])
def test_second_derivatives_match_reference_autograd(device, residual):
    """A backward with create_graph=True (Hessian-vector products, gradient penalties) is itself
    differentiable: the Hessian-vector product of every part equals that of the float64 reference,
    and the first derivative it builds equals the kernel's (it was silently 0 before)."""
    x = random_matrices(4, 9, 7, dtype=torch.float64, device=device)
    weights = torch.rand(4, 3, dtype=torch.float64, device=device)
    direction = torch.randn_like(x)

    def norms(t):
        return torch.stack(tuple(pk.matrix_norms(t, residual=residual)), -1)

    def reference(t):
        return torch.stack(matrix_norms_ref(residual_ref(t) if residual else t), -1)

    products = []
    for function in (norms, reference):
        t = x.clone().requires_grad_()
        (gradient,) = torch.autograd.grad((function(t) * weights).sum(), t, create_graph=True)
        (product,) = torch.autograd.grad((gradient * direction).sum(), t)
        products.append((gradient.detach(), product))
    torch.testing.assert_close(products[0][0], products[1][0], **tolerance(torch.float64))
    torch.testing.assert_close(products[0][1], products[1][1], **tolerance(torch.float64))
    assert bool((products[0][1] != 0).any())
    t = x.clone().requires_grad_()
    (plain,) = torch.autograd.grad((norms(t) * weights).sum(), t)
    torch.testing.assert_close(products[0][0], plain, rtol=1e-14, atol=0)


def test_gradgradcheck(device):
    x = random_matrices(3, 6, 5, dtype=torch.float64, device=device).requires_grad_()
    assert torch.autograd.gradgradcheck(lambda t: pk.residual_norm(t, return_norm=True), (x,))
    assert torch.autograd.gradgradcheck(pk.composite_norm, (x,))
    assert torch.autograd.gradgradcheck(lambda t: tuple(pk.matrix_norms(t, residual=True)), (x,))
    # A Jacobian-vector product by the double-backward trick differentiates the backward by its
    # incoming gradient, at 0.
    direction = torch.randn_like(x)
    torch.testing.assert_close(
        torch.autograd.functional.jvp(pk.residual_norm, x.detach(), direction)[1],
        torch.autograd.functional.jvp(residual_norm_ref, x.detach(), direction)[1],
        **tolerance(torch.float64),
    )


def test_second_derivatives_are_finite_at_a_zero_residual(device):
    x = torch.full((3, 4, 4), 0.25, dtype=torch.float64, device=device, requires_grad=True)
    (gradient,) = torch.autograd.grad(pk.residual_norm(x).sum(), x, create_graph=True)
    (second,) = torch.autograd.grad(gradient.sum(), x, allow_unused=True)
    assert torch.equal(gradient, torch.zeros_like(x))
    assert second is None or torch.equal(second, torch.zeros_like(x))


def test_gradient_is_zero_not_nan_at_a_zero_residual(device):
    x = torch.full((3, 4, 4), 0.25, dtype=torch.float64, device=device, requires_grad=True)
    pk.residual_norm(x).sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


def test_gradient_of_non_contiguous_and_low_precision(device):
    base = random_matrices(3, 8, 6, dtype=torch.float32, device=device).requires_grad_()
    pk.residual_norm(base.transpose(-1, -2)).sum().backward()
    ref = base.detach().double().requires_grad_()
    residual_norm_ref(ref.transpose(-1, -2)).sum().backward()
    torch.testing.assert_close(base.grad.double(), ref.grad, **tolerance(torch.float32))
    half = random_matrices(2, 5, 5, dtype=torch.bfloat16, device=device).requires_grad_()
    pk.residual_norm(half).sum().backward()
    assert half.grad.dtype == torch.bfloat16 and torch.isfinite(half.grad).all()


def test_as_a_regulariser_it_reduces_collapse(device):
    # A few gradient steps that increase the residual norm of a near rank-1 matrix.
    x = (torch.ones(8, 8, device=device) + 0.01 * torch.randn(8, 8, device=device)).requires_grad_()
    optimizer = torch.optim.SGD([x], lr=0.05)
    start = pk.residual_norm(x).item()
    for _ in range(10):
        optimizer.zero_grad()
        (-pk.residual_norm(x)).backward()
        optimizer.step()
    assert pk.residual_norm(x).item() > start


# --- torch.library and torch.compile ---------------------------------------------------------


@pytest.mark.parametrize("centered, with_norm, targets", [(False, True, 1), (True, True, 2), (True, False, 1)])
def test_opcheck(device, centered, with_norm, targets):
    x = random_matrices(3, 7, 5, dtype=torch.float64, device=device).requires_grad_()
    torch.library.opcheck(torch.ops.pathkernels.norm_parts.default, (x, centered, with_norm))
    parts, argmax = torch.ops.pathkernels.norm_parts(x.detach(), centered, with_norm)
    assert parts.shape == (3, targets, 3) and argmax.shape == (3, targets, 2)
    grad = torch.randn_like(parts)
    torch.library.opcheck(
        torch.ops.pathkernels.norm_parts_backward.default, (grad, x.detach(), parts, argmax, centered, with_norm)
    )


@pytest.mark.parametrize("centered", [False, True])
@pytest.mark.parametrize(
    "bad, error",
    [
        (torch.zeros(3), ValueError),  # too few dims
        (torch.zeros(2, 0, 3), ValueError),  # no rows
        (torch.zeros(2, 3, dtype=torch.long), TypeError),  # not floating point
    ],
)
def test_python_checks_and_op_names_are_the_ops_own(centered, bad, error):
    """ops.check_norm_input and ops.norm_op_name repeat csrc/norms/norms.cpp (the fake kernels need
    them in Python): the op called directly, bypassing Python, raises the same error, word for word."""
    with pytest.raises(error) as from_cpp:
        torch.ops.pathkernels.norm_parts(bad, centered, True)
    with pytest.raises(error) as from_python:
        ops.check_norm_input(bad, centered)
    assert str(from_cpp.value).splitlines()[0] == str(from_python.value)
    assert str(from_python.value).startswith(ops.norm_op_name(centered) + ":")


def test_parts_layout_is_the_ops_own(device):
    """ops' _L1/_LINF/_COMPOSITE and target indices read the op's parts as csrc/common/norm_math.h
    lays them out: checked against the float64 references, target by target."""
    x = random_matrices(3, 6, 4, dtype=torch.float64, device=device)
    parts, argmax = torch.ops.pathkernels.norm_parts(x, True, True)
    for target, v in ((ops._RESIDUAL_TARGET, x - x.mean(-2, keepdim=True)), (ops._PLAIN_TARGET, x)):
        l1, linf, composite = matrix_norms_ref(v)
        torch.testing.assert_close(parts[:, target, ops._L1], l1)
        torch.testing.assert_close(parts[:, target, ops._LINF], linf)
        torch.testing.assert_close(parts[:, target, ops._COMPOSITE], composite)
        torch.testing.assert_close(argmax[:, target, 0], v.abs().sum(-2).argmax(-1))
        torch.testing.assert_close(argmax[:, target, 1], v.abs().sum(-1).argmax(-1))


def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, dynamic=False)
    def collapse_ratio(x):
        residual, norm = pk.residual_norm(x, return_norm=True)
        return residual / norm + pk.composite_norm(x)

    x = random_matrices(4, 12, 10, dtype=torch.float64, device=device)
    residual, norm = pk.residual_norm(x, return_norm=True)
    torch.testing.assert_close(collapse_ratio(x), residual / norm + pk.composite_norm(x))


def test_torch_compile_rescues_sums_that_overflow(device):
    """Inside a compiled graph the rescue of overflowed sums is a torch.cond: the compiled norms
    and their gradient equal eager mode's (they were inf)."""
    torch._dynamo.reset()
    x = 1e306 * (1 + 0.01 * random_matrices(3, 300, 2, dtype=torch.float64, device=device))
    x[0] = random_matrices(300, 2, dtype=torch.float64, device=device)  # a matrix that needs no rescue

    def loss(t):
        residual, norm = pk.residual_norm(t, return_norm=True)
        return residual + pk.composite_norm(t)

    compiled = torch.compile(loss, fullgraph=True, dynamic=False, backend="aot_eager")
    eager_x, compiled_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = loss(eager_x), compiled(compiled_x)
    assert bool(torch.isfinite(want).all()) and torch.equal(got, want)
    want.sum().backward()
    got.sum().backward()
    assert bool(torch.isfinite(eager_x.grad).all()) and torch.equal(compiled_x.grad, eager_x.grad)


def test_torch_compile_fullgraph_backward(device):
    # The regulariser use: a compiled loss, differentiated through the C++ autograd formula.
    torch._dynamo.reset()

    def loss(x):
        residual, norm = pk.residual_norm(x, return_norm=True)
        return (residual / norm).sum() - pk.matrix_norms(x, residual=True).linf.sum()

    compiled_loss = torch.compile(loss, fullgraph=True, dynamic=False)
    x = random_matrices(4, 12, 10, dtype=torch.float64, device=device)
    compiled_x, eager_x, ref_x = (x.clone().requires_grad_() for _ in range(3))
    compiled_loss(compiled_x).backward()
    loss(eager_x).backward()
    ref_residual = residual_ref(ref_x)
    ref_ratio = composite_norm_ref(ref_residual) / composite_norm_ref(ref_x)
    (ref_ratio.sum() - matrix_norms_ref(ref_residual)[1].sum()).backward()
    torch.testing.assert_close(compiled_x.grad, eager_x.grad)
    torch.testing.assert_close(compiled_x.grad, ref_x.grad, **tolerance(torch.float64))


# --- bad input --------------------------------------------------------------------------------

BAD_INPUTS = [
    (
        lambda d: torch.ones(5, device=d),
        ValueError,
        r"expected x to have at least 2 dimensions \[\.\.\., n, m\], got 1",
    ),
    (lambda d: torch.ones(3, 3, dtype=torch.int64, device=d), TypeError, "expected x to be a floating-point tensor"),
    (
        lambda d: torch.ones(3, 3, dtype=torch.complex64, device=d),
        TypeError,
        "expected x to be a floating-point tensor",
    ),
    (lambda d: torch.ones(2, 0, 3, device=d), ValueError, r"expected x to have at least one row \(n >= 1\)"),
]


@pytest.mark.parametrize("make, error, message", BAD_INPUTS)
def test_bad_input_messages(device, make, error, message):
    x = make(device)
    with pytest.raises(error, match="pathkernels.residual_norm: " + message):
        pk.residual_norm(x)
    with pytest.raises(error, match="pathkernels.composite_norm: " + message):
        pk.composite_norm(x)
    # The op itself (C++ checks) and its fake kernel (meta tensors) say the same.
    with pytest.raises(error, match="pathkernels.residual_norm: " + message):
        torch.ops.pathkernels.norm_parts(x, True)
    with pytest.raises(error, match="pathkernels.composite_norm: " + message):
        torch.ops.pathkernels.norm_parts(x.to("meta"), False)


def test_non_tensor_input():
    with pytest.raises(TypeError, match="pathkernels.composite_norm: expected x to be a torch.Tensor, got list"):
        pk.composite_norm([[1.0, 2.0]])


@pytest.mark.parametrize("index", [10**6, -1])
def test_norm_backward_refuses_argmax_out_of_range(device, index):
    # Public op, called directly: 10^6 used to read out of bounds (SIGSEGV) and -1 gave 0 silently.
    x = torch.randn(3, 4, 5, dtype=torch.float64, device=device)
    parts = torch.ones(3, 1, 3, dtype=torch.float64, device=device)
    argmax = torch.full((3, 1, 2), index, device=device)
    with pytest.raises(
        IndexError,
        match=r"pathkernels.residual_norm: expected every entry of argmax\[\.\.\., 0\] "
        r"\(the column of ‖v‖_1\) in \[0, 5\)",
    ):
        torch.ops.pathkernels.norm_parts_backward(parts, x, parts, argmax, True, False)
    argmax[..., 0] = 0
    with pytest.raises(IndexError, match=r"argmax\[\.\.\., 1\] \(the row of ‖v‖_∞\) in \[0, 4\)"):
        torch.ops.pathkernels.norm_parts_backward(parts, x, parts, argmax, False, False)


def test_matrix_norms_errors_name_matrix_norms():
    with pytest.raises(ValueError, match=r"pathkernels.matrix_norms: expected x to have at least 2 dimensions"):
        pk.matrix_norms(torch.zeros(3))
    with pytest.raises(TypeError, match=r"pathkernels.matrix_norms: expected x to be a floating-point tensor"):
        pk.matrix_norms(torch.zeros(3, 3, dtype=torch.long), residual=True)


@pytest.mark.parametrize("exponent", [-154, -156, -158, -160, -161, -162, -163, -200])
def test_norms_whose_product_is_subnormal_keep_their_digits(device, exponent):
    """float64 entries near 1e-160: ‖·‖_1 ‖·‖_∞ is a subnormal number that has lost digits (the
    composite was 6e-6 off at 1e-160 and 1e-2 at 1e-162); the roots' product keeps them. Every norm
    op, and the engine's leaves, against a reference computed at scale 1 and scaled back."""
    scale = 10.0**exponent
    x = random_matrices(3, 5, 7, dtype=torch.float64, device=device)
    for got, unit in (
        (pk.composite_norm(x * scale), composite_norm_ref(x)),
        (pk.residual_norm(x * scale), residual_norm_ref(x)),
        (pk.matrix_norms(x * scale, residual=True).composite, residual_norm_ref(x)),
        (pk.residual_norm(x * scale, return_norm=True)[1], composite_norm_ref(x)),
    ):
        torch.testing.assert_close(got, unit * scale, rtol=1e-14, atol=0)
    attn = random_attention(2, 2, 2, 5, 5, dtype=torch.float64, device=device)
    w_v = torch.randn(2, 2, 7, 3, dtype=torch.float64, device=device)
    w_o = torch.randn(2, 2, 3, 7, dtype=torch.float64, device=device)
    tree = pk.PathTree.complete(2, 2, skip=True)
    small = pk.path_residuals(attn, tree, x=x[:2] * scale, w_v=w_v, w_o=w_o)
    plain = pk.path_residuals(attn, tree, x=x[:2], w_v=w_v, w_o=w_o)
    torch.testing.assert_close(small.residual, plain.residual * scale, rtol=1e-13, atol=0)
    torch.testing.assert_close(small.norm, plain.norm * scale, rtol=1e-13, atol=0)


@pytest.mark.parametrize("function", ["residual_norm", "composite_norm"])
def test_the_gradient_of_an_overflowing_matrix_is_the_gradient_of_it_scaled_down(function):
    """The norms are homogeneous of degree 1, so their gradient at x is their gradient at x / 2^k.
    Near the top of float64's range the column sums overflow and the norms are computed on the
    matrix scaled down; the gradient must be that of the scaled matrix, bit for bit (it was inf in
    a column whose residual entries are all 0, the gradient scaled up by 2^e before it was scaled
    down)."""
    norm = getattr(pk, function)
    x = 1e308 * (1 + 0.01 * random_matrices(3, 6, 4, dtype=torch.float64)).clamp(0.98, 1.0)
    x[:, :, 2] = 0.98e308  # a constant column: its residual entries are all 0
    big = x.clone().requires_grad_()
    norm(big).sum().backward()
    small = (x * 2.0**-1000).requires_grad_()
    norm(small).sum().backward()
    assert bool(torch.isfinite(big.grad).all())
    assert torch.equal(big.grad, small.grad)
