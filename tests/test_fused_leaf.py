"""The fused leaf kernels (`_fused_leaf_norms`): on CPU their per-thread code runs thread by thread
(the tensor-core kernels' mma emulated from the lanes' fragments), on CUDA as the kernels the
engine uses; all against float64 references and hand-worked values."""

import pytest
import torch

import pathkernels as pk
from pathkernels.reference import fused_leaf_norms_ref as reference
from pathkernels.testing import devices, has_tensor_cores, leaf_kernel_slack, random_attention, tolerance

fused_leaf_norms = torch.ops.pathkernels._fused_leaf_norms


# The kernels of each dtype: "tf32x3" and "tf32" run on tensor cores, float32 only.
KERNELS = {torch.float64: ["simt"], torch.float32: ["simt", "tf32x3", "tf32"]}
DTYPE_KERNELS = [(dtype, kernel) for dtype, kernels in KERNELS.items() for kernel in kernels]


# n and m on both sides of the 32/64/128-row tiles, the 64-column tiles and the 16-deep k-slices.
SHAPES = [
    (1, 1, 1),
    (2, 3, 2),
    (5, 2, 7),
    (16, 2, 16),
    (17, 3, 33),
    (32, 2, 64),
    (33, 2, 65),
    (64, 3, 64),
    (65, 2, 128),
    (100, 2, 150),
    (128, 2, 129),
]


def check_tensor_cores(device, kernel):
    """Skips tensor-core kernels on a GPU without TF32 mma (below compute capability 8.0)."""
    if kernel != "simt" and not has_tensor_cores(device):
        pytest.skip("the tensor-core leaf kernels need compute capability 8.0")


@pytest.mark.parametrize(("dtype", "kernel"), DTYPE_KERNELS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_float64_reference(device, dtype, kernel, shape):
    check_tensor_cores(device, kernel)
    n, count, m = shape
    attn = torch.randn(n, n, dtype=dtype, device=device)
    level = torch.randn(n, count + 3, m, dtype=dtype, device=device)
    right = level[:, 2 : count + 2]  # a run of a level: row stride (count + 3)·m, as the engine passes
    mean = torch.randn(count, m, dtype=dtype, device=device)
    residual, norm = fused_leaf_norms(attn, right, mean, None, kernel)
    assert residual.shape == norm.shape == (count,) and residual.device == attn.device
    assert residual.dtype == norm.dtype == torch.float64  # the reports are float64 for every dtype
    expected_residual, expected_norm = reference(attn, right, mean)
    for got, expected in [(residual, expected_residual), (norm, expected_norm)]:
        if dtype == torch.float64:
            torch.testing.assert_close(got.cpu(), expected, **tolerance(dtype))
        else:
            error = (got.double().cpu() - expected).abs()
            bound = 1e-5 * expected + leaf_kernel_slack(attn, right, kernel)
            assert (error <= bound).all(), (error, bound)


@pytest.mark.parametrize(("dtype", "kernel"), [c for c in DTYPE_KERNELS if c[1] != "tf32"])
def test_scaled_leaves(device, dtype, kernel):
    """Leaf k is scale_k · C(A) right_k (the engine's renormalised nodes): the residual is scale_k
    times the unscaled one, bit for bit, and the product 1μᵀ + R is taken at the true scale, also
    where scale_k · right_k lies far below float32's range."""
    check_tensor_cores(device, kernel)
    n, count, m = 40, 5, 70
    attn = torch.randn(n, n, dtype=dtype, device=device)
    right = torch.randn(n, count, m, dtype=dtype, device=device)
    mean = torch.randn(count, m, dtype=dtype, device=device) * 1e-3
    mean[1] = 0  # a product that is its residual alone
    scale = torch.tensor([2.0**-300, 1e0, 2.0**-10, 2.0**40, 2.0**-60], dtype=torch.float64, device=device)
    scale[1] = 2.0**-200
    residual, norm = fused_leaf_norms(attn, right, mean, scale, kernel)
    unscaled_residual, _ = fused_leaf_norms(attn, right, mean, None, kernel)
    assert torch.equal(residual, unscaled_residual * scale)
    expected_residual, expected_norm = reference(attn, right, mean, scale)
    assert residual[0].item() < 1e-80 and norm[1].item() < 1e-50  # far outside float32's range
    rtol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(residual.cpu(), expected_residual, rtol=rtol, atol=0)
    # Leaves 0 and 4: R is negligible against 1μᵀ; leaf 1: the product is R; leaf 3: R dominates.
    torch.testing.assert_close(norm.cpu(), expected_norm, rtol=rtol, atol=0)
    with pytest.raises(ValueError, match=r"expected scale \[c\] = \[5\], got \[4\]"):
        fused_leaf_norms(attn, right, mean, scale[:4])
    with pytest.raises(TypeError, match="expected scale in torch.float64, got torch.float32"):
        fused_leaf_norms(attn, right, mean, scale.float())


@pytest.mark.parametrize(("dtype", "kernel"), DTYPE_KERNELS)
def test_hand_worked_leaf(device, dtype, kernel):
    # C(A) = [[.5, -.5], [-.5, .5]] times I is C(A): every column and row sums to 1 in |·|, so 1;
    # with μ = (1, 2): [[1.5, 1.5], [.5, 2.5]] has column sums (2, 4) and row sums (3, 3): √12.
    check_tensor_cores(device, kernel)
    attn = torch.tensor([[0.5, -0.5], [-0.5, 0.5]], dtype=dtype, device=device)
    right = torch.eye(2, dtype=dtype, device=device)[:, None, :]
    mean = torch.tensor([[1.0, 2.0]], dtype=dtype, device=device)
    residual, norm = fused_leaf_norms(attn, right, mean, None, kernel)
    assert residual.tolist() == [1.0]
    assert norm.item() == pytest.approx(12**0.5, rel=1e-15)


@pytest.mark.parametrize("kernel", KERNELS[torch.float32])
def test_tf32_split_by_hand(device, kernel):
    """right = (1 + 2⁻¹²)·I: 1 + 2⁻¹² needs 12 mantissa bits, TF32 keeps 10. 3×TF32 splits it
    exactly into hi = 1 and lo = 2⁻¹² and gets C(A) right's residual 1 + 2⁻¹² exactly, as CUDA
    cores do; one TF32 pass rounds it to 1."""
    check_tensor_cores(device, kernel)
    attn = torch.tensor([[0.5, -0.5], [-0.5, 0.5]], device=device)
    right = (1 + 2.0**-12) * torch.eye(2, device=device)[:, None, :]
    residual, _ = fused_leaf_norms(attn, right, torch.zeros(1, 2, device=device), None, kernel)
    assert residual.item() == (1.0 if kernel == "tf32" else 1 + 2.0**-12)


def test_zero_leaves_and_non_contiguous_operands(device):
    attn = torch.randn(8, 8, dtype=torch.float64, device=device)
    residual, norm = fused_leaf_norms(
        attn,
        torch.randn(8, 0, 5, dtype=torch.float64, device=device),
        torch.randn(0, 5, dtype=torch.float64, device=device),
    )
    assert residual.shape == norm.shape == (0,)
    # One column, with stride 0 on that dimension (any stride is valid for a dimension of size 1).
    right = torch.randn(8 * 3, dtype=torch.float64, device=device).as_strided((8, 3, 1), (3, 1, 0))
    mean = torch.randn(3, 1, dtype=torch.float64, device=device)
    for value, expected in zip(fused_leaf_norms(attn, right, mean), reference(attn, right, mean)):
        torch.testing.assert_close(value.cpu(), expected, **tolerance(torch.float64))
    right = torch.randn(5, 3, 8, dtype=torch.float64, device=device).permute(2, 1, 0)  # column stride 15
    mean = torch.randn(5, 3, dtype=torch.float64, device=device).t()
    got = fused_leaf_norms(attn.t(), right, mean)
    for value, expected in zip(got, reference(attn.t(), right, mean)):
        torch.testing.assert_close(value.cpu(), expected, **tolerance(torch.float64))


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((129, 129, 2, 4), ValueError, r"expected 1 <= n <= 128 rows, got n = 129"),
        ((4, 5, 2, 4), ValueError, r"expected attn \[n, n\], got shape \[4, 5\]"),
        ((4, 4, 2, 0), ValueError, r"expected right \[n, c, m\] with n = 4 and m >= 1"),
    ],
)
def test_bad_input(device, args, error, message):
    rows, cols, count, m = args
    attn = torch.randn(rows, cols, device=device)
    with pytest.raises(error, match=message):
        fused_leaf_norms(attn, torch.randn(rows, count, m, device=device), torch.randn(count, m, device=device))


def test_bad_kernel(device):
    attn, right = torch.randn(4, 4, device=device), torch.randn(4, 2, 3, device=device)
    mean = torch.randn(2, 3, device=device)
    for kernel in ("gemm", "TF32", ""):
        with pytest.raises(ValueError, match=rf"expected kernel in \('simt', 'tf32x3', 'tf32'\), got '{kernel}'"):
            fused_leaf_norms(attn, right, mean, None, kernel)
    with pytest.raises(TypeError, match=r"kernel='tf32x3' runs on TF32 tensor cores and takes torch.float32"):
        fused_leaf_norms(attn.double(), right.double(), mean.double(), None, "tf32x3")


def test_bad_dtypes_and_shapes(device):
    attn = torch.randn(4, 4, device=device)
    with pytest.raises(
        TypeError, match=r"_fused_leaf_norms: expected right and mean in torch.float32, got torch.float64"
    ):
        fused_leaf_norms(
            attn, torch.randn(4, 2, 3, device=device, dtype=torch.float64), torch.randn(2, 3, device=device)
        )
    with pytest.raises(ValueError, match=r"expected mean \[c, m\] = \[2, 3\], got \[3, 2\]"):
        fused_leaf_norms(attn, torch.randn(4, 2, 3, device=device), torch.randn(3, 2, device=device))
    with pytest.raises(TypeError, match="expected attn to be float32 or float64, got torch.float16"):
        fused_leaf_norms(
            attn.half(), torch.randn(4, 2, 3, device=device).half(), torch.randn(2, 3, device=device).half()
        )


def test_opcheck():
    attn = torch.randn(6, 6, dtype=torch.float64)
    torch.library.opcheck(
        fused_leaf_norms, (attn, torch.randn(6, 3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64))
    )
    attn = torch.randn(6, 6)
    torch.library.opcheck(fused_leaf_norms, (attn, torch.randn(6, 3, 5), torch.randn(3, 5), None, "tf32x3"))


@pytest.mark.skipif("cuda" not in devices(), reason="needs a GPU and the CUDA kernels")
@pytest.mark.parametrize(("dtype", "kernel"), DTYPE_KERNELS)
def test_cpu_harness_and_cuda_kernel_agree(dtype, kernel):
    check_tensor_cores("cuda", kernel)
    attn = torch.randn(70, 70, dtype=dtype)
    right, mean = torch.randn(70, 5, 90, dtype=dtype), torch.randn(5, 90, dtype=dtype)
    scale = 2.0 ** torch.tensor([-200.0, 0.0, 3.0, -20.0, -1000.0], dtype=torch.float64)
    cpu = fused_leaf_norms(attn, right, mean, scale, kernel)
    gpu = fused_leaf_norms(attn.cuda(), right.cuda(), mean.cuda(), scale.cuda(), kernel)
    # FMA on the GPU, not here; the tensor core's own summation order and rounding, not the ideal one.
    tol = tolerance(dtype) if dtype == torch.float64 else {"rtol": 1e-3 if kernel == "tf32" else 1e-5, "atol": 0}
    for a, b in zip(gpu, cpu):
        torch.testing.assert_close(a.cpu(), b, **tol)


@pytest.mark.skipif("cuda" not in devices(), reason="needs a GPU and the CUDA kernels")
@pytest.mark.parametrize("other", ["gemm", "tensor"])
@pytest.mark.parametrize("n", [8, 64, 130])  # 130: beyond the fused kernels, cuBLAS and the reduction
def test_engine_leaf_kernels_agree(n, other):
    check_tensor_cores("cuda", "tf32x3" if other == "tensor" else "simt")
    layers, heads = 3, 3
    attn = random_attention(2, layers, heads, n, n, device="cuda")
    x = torch.randn(2, n, 24, device="cuda")
    w_v = torch.randn(layers, heads, 24, 8, device="cuda") / 5
    w_o = torch.randn(layers, heads, 8, 24, device="cuda") / 3
    tree = pk.PathTree.complete(layers, heads, skip=True)
    for args in ({}, {"x": x, "w_v": w_v, "w_o": w_o}):
        simt = pk.path_residuals(attn, tree, **args)
        compared = pk.path_residuals(attn, tree, leaf_kernel=other, **args)
        # Two float32 summation orders, as in test_engine.py's CPU-versus-CUDA comparison.
        torch.testing.assert_close(compared.residual, simt.residual, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(compared.norm, simt.norm, rtol=1e-4, atol=1e-6)
