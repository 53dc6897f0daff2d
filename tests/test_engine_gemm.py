"""The CPU engine's GEMM (csrc/paths/gemm_cpu.h, ``torch.ops.pathkernels._engine_mm``).

Every element is one chain of fused multiply-adds over k in increasing order, so its bits depend on
neither the call's shape, the element's place in it, nor the kernel's vector width: the engine's
results are then the same whatever memory budget and thread count cut its work into calls.
"""

import platform

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import pathkernels  # noqa: E402, F401  (registers the ops)
from pathkernels.testing import cpu_kernel_isas  # noqa: E402

mm = torch.ops.pathkernels._engine_mm
ISAS = cpu_kernel_isas()
# The vector kernels contract each term into an FMA; the portable kernel uses std::fma where the
# CPU has one. Every x86-64 CPU with AVX2 has FMA, and the other architectures we build for do.
HAS_FMA = platform.machine() not in ("x86_64", "AMD64") or torch.backends.cpu.get_cpu_capability() != "DEFAULT"


@st.composite
def operands(draw):
    rows, depth, cols = draw(st.integers(1, 40)), draw(st.integers(0, 70)), draw(st.integers(1, 200))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    a = torch.randn(rows, depth, generator=g, dtype=torch.float64)
    b = torch.randn(depth, cols, generator=g, dtype=torch.float64)
    kind = draw(st.sampled_from(["normal", "integers", "wide_range"]))
    if kind == "integers":
        a, b = a.mul(4).round(), b.mul(4).round()
    elif kind == "wide_range":  # magnitudes spread over 2^-20 .. 2^20, so that rounding order shows
        a = a * torch.exp2(torch.randint(-20, 21, a.shape, generator=g).double())
    return a.to(dtype), b.to(dtype)


@given(operands())
def test_every_kernel_gives_the_same_bits_within_the_float64_bound(ab):
    a, b = ab
    reference = a.double() @ b.double()
    # |fl(Σ a_k b_k) − Σ a_k b_k| ≤ γ_K Σ |a_k b_k|, γ_K ≈ K·u (sequential sum, one rounding per term)
    unit = torch.finfo(a.dtype).eps / 2
    bound = 1.01 * a.shape[1] * unit * (a.double().abs() @ b.double().abs()) + torch.finfo(a.dtype).tiny
    results = {isa: mm(a, b, isa) for isa in ISAS}
    for isa, result in results.items():
        assert result.dtype == a.dtype and result.shape == (a.shape[0], b.shape[1])
        assert bool(((result.double() - reference).abs() <= bound).all()), isa
    if HAS_FMA:
        for isa, result in results.items():
            assert torch.equal(result, results["portable"]), isa
    assert torch.equal(mm(a, b), results[ISAS[0]])  # "auto" is the widest kernel


@given(operands(), st.data())
def test_an_element_does_not_depend_on_the_call_that_computes_it(ab, data):
    """Any block of rows and columns, cut from operands laid out with other strides, gives the
    elements of the whole product bit for bit: the engine's blocks may fall anywhere."""
    a, b = ab
    whole = mm(a, b)
    r0 = data.draw(st.integers(0, a.shape[0] - 1))
    r1 = data.draw(st.integers(r0 + 1, a.shape[0]))
    c0 = data.draw(st.integers(0, b.shape[1] - 1))
    c1 = data.draw(st.integers(c0 + 1, b.shape[1]))
    part = mm(a[r0:r1], b[:, c0:c1])  # views: row strides of the whole operands
    assert torch.equal(part, whole[r0:r1, c0:c1])
    transposed = mm(a.t().contiguous().t()[r0:r1], b.t().contiguous().t()[:, c0:c1])  # column-major inputs
    assert torch.equal(transposed, whole[r0:r1, c0:c1])
    wider = torch.cat([b, b.flip(1)], 1)  # more columns after, the same ones first
    assert torch.equal(mm(a, wider)[:, : b.shape[1]], whole)


def test_terms_are_added_one_by_one_in_order():
    """float32: 1 + 2^-24 rounds back to 1 (a tie, to even), twice; summing the two small terms
    first would give 1 + 2^-23."""
    a = torch.tensor([[1.0, 2.0**-24, 2.0**-24]])
    b = torch.ones(3, 1)
    for isa in ISAS:
        assert mm(a, b, isa).item() == 1.0
    assert mm(a.flip(1), b).item() == 1.0 + 2.0**-23  # small terms first: they add up before the 1


@pytest.mark.skipif(not HAS_FMA, reason="this CPU has no fused multiply-add")
def test_each_term_is_one_fused_multiply_add():
    """(1 + 2^-12)² = 1 + 2^-11 + 2^-24: a separate multiply rounds the 2^-24 away, a fused
    multiply-add onto −1 keeps it."""
    a = torch.tensor([[-1.0, 1.0 + 2.0**-12]])
    b = torch.tensor([[1.0], [1.0 + 2.0**-12]])
    for isa in ISAS:
        assert mm(a, b, isa).item() == 2.0**-11 + 2.0**-24


def test_empty_operands_and_opcheck():
    assert mm(torch.ones(3, 0), torch.ones(0, 4)).equal(torch.zeros(3, 4))
    assert mm(torch.ones(0, 2), torch.ones(2, 4)).shape == (0, 4)
    torch.library.opcheck(mm, (torch.randn(5, 3), torch.randn(3, 7)))


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: mm(torch.ones(2, 3), torch.ones(4, 2)), ValueError, r"expected a \[r, k\], b \[k, c\]"),
        (lambda: mm(torch.ones(2, 3), torch.ones(3, 2, dtype=torch.float64)), TypeError, "in one dtype"),
        (lambda: mm(torch.ones(2, 2), torch.ones(2, 2), "sse"), ValueError, r"expected isa in \('auto'"),
    ],
)
def test_bad_input(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_size_from_1_to_130_and_its_tails(dtype):
    """Every n from 1 to 130, the engine's shapes (``[n, n] @ [n, n]``, and a batch of parents
    ``[3n, n] @ [n, n + 5]``, whose rows and columns leave tails past any register block): each
    kernel within the float64 bound, and (with FMA) the same bits as the portable one, so that a
    change to a kernel's blocking or tail handling cannot pass unseen at any size."""
    g = torch.Generator().manual_seed(130)
    unit = torch.finfo(dtype).eps / 2
    for n in range(1, 131):
        for rows, cols in ((n, n), (3 * n, n + 5)):
            a = torch.randn(rows, n, generator=g, dtype=torch.float64).to(dtype)
            b = torch.randn(n, cols, generator=g, dtype=torch.float64).to(dtype)
            reference = a.double() @ b.double()
            bound = 1.01 * n * unit * (a.double().abs() @ b.double().abs()) + torch.finfo(dtype).tiny
            portable = mm(a, b, "portable")
            for isa in ISAS:
                result = mm(a, b, isa)
                assert bool(((result.double() - reference).abs() <= bound).all()), (isa, n, rows, cols)
                if HAS_FMA:
                    assert torch.equal(result, portable), (isa, n, rows, cols)
