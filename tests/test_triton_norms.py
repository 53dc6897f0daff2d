"""The Triton norm kernels (pathkernels.core.triton_norms): ‖x‖_{1,∞} and ‖x − 1μᵀ‖_{1,∞} of a
batch of matrices in one launch. Where there is no GPU they run in Triton's interpreter:
TRITON_INTERPRET=1 is set only while this file imports pathkernels.core.triton_norms (Triton reads it when
the kernels are decorated) and restored at once, so no other test sees it. On a GPU the same tests
run the compiled kernel. Checked against a float64 reference written from the formula, against
pk.composite_norm / pk.residual_norm (the C++ ops), on a hand-worked matrix, and, without a GPU, on
the PTX that Triton compiles for sm_80 and sm_90."""

import math

import pytest
import torch
from triton_interpreter import compiled_for_the_gpu, kernel_module, printed_without_triton

import pathkernels as pk

MODULE = "pathkernels.core.triton_norms"
# Room against pk's values: float32 and float64 differ from the C++ kernels in the order of the sums
# only (both accumulate in float64): a float32 result is the same float64 value rounded, a float64
# result a few ulp apart; 16-bit results (float32 sums) one rounding of x's dtype at most.
ULPS = {torch.float32: 2.0**-23, torch.float64: 2.0**-49, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
DTYPES = list(ULPS)

# (n, m) with DEFAULT_CONFIG (tiles of 4096 elements): whole matrices, one or several per program
# (1 × 1: 4096 per program, 3 × 5 padded to 4 × 8, 16 × 256), column strips with a partial last
# strip (64 × 65: 64 + 1 columns, 33 × 70, 17 × 300: three strips of 128) and with padding rows
# (200 × 20: strips of 256 × 16), and row tiles (300 × 7: 512 rows padded, more than a strip holds).
SHAPES = [(1, 1), (3, 5), (16, 256), (64, 64), (64, 65), (33, 70), (17, 300), (200, 20), (300, 7)]


@pytest.fixture(scope="module")
def tn():
    return kernel_module(MODULE, "the Triton norm kernels")


@pytest.fixture(autouse=True)
def one_config(monkeypatch):
    """On the GPU the ops launch DEFAULT_CONFIG alone (the interpreter always does): one compilation
    per case, no autotuning, unless a test asks for the autotuner."""
    monkeypatch.setenv("PATHKERNELS_TRITON_NORM_CONFIGS", "default")


@pytest.fixture
def device(tn):
    """The interpreter's CPU tensors, or the GPU's (this file's tests need no other device)."""
    return "cpu" if tn.INTERPRETED else "cuda"


def reference(x):
    """(‖x − 1μᵀ‖_{1,∞}, ‖x‖_{1,∞}) in float64 on the CPU, from the definitions: μ_j = Σ_i x_ij / n,
    ‖v‖_{1,∞} = sqrt(max_j Σ_i |v_ij| · max_i Σ_j |v_ij|), 0 for m = 0; NaN propagates (amax)."""
    x = x.detach().double().cpu()
    if x.shape[-1] == 0:
        zero = x.new_zeros(x.shape[:-2])
        return zero, zero

    def composite(v):
        return torch.sqrt(v.abs().sum(-2).amax(-1) * v.abs().sum(-1).amax(-1))

    mean = x.sum(-2, keepdim=True) / x.shape[-2]
    return composite(x - mean), composite(x)


def assert_close(got, expected, dtype, ulps=4):
    """got (x's dtype) within `ulps` roundings of x's dtype of expected (float64), NaN where it is NaN."""
    assert got.dtype == dtype and got.shape == expected.shape
    torch.testing.assert_close(got.double().cpu(), expected.double().cpu(), rtol=ulps * ULPS[dtype], atol=0,
                               equal_nan=True)  # fmt: skip


def check_all(tn, x, config=None, ulps=4):
    """Both ops (and the residual without its norm) against the float64 reference and pk's ops."""
    residual, norm = tn.triton_residual_norm(x, return_norm=True, config=config)
    composite = tn.triton_composite_norm(x, config=config)
    want_residual, want_norm = reference(x)
    for got, want in ((residual, want_residual), (norm, want_norm), (composite, want_norm)):
        assert_close(got, want, x.dtype, ulps + 4)  # the reference rounds x's sums its own way
    mine = pk.residual_norm(x.cpu(), return_norm=True)
    assert_close(residual, mine[0].double(), x.dtype, ulps)
    assert_close(norm, mine[1].double(), x.dtype, ulps)
    assert_close(composite, pk.composite_norm(x.cpu()).double(), x.dtype, ulps)
    return residual, norm, composite


# --- values ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference_and_ops(tn, device, shape):
    """float32 and float64 on every shape, in DEFAULT_CONFIG (test_designs walks the grid)."""
    n, m = shape
    for dtype, batch in ((torch.float32, 3), (torch.float64, 2)):
        x = torch.randn(batch, n, m, dtype=torch.float64).to(device=device, dtype=dtype)
        residual, _, _ = check_all(tn, x)
        assert torch.equal(tn.triton_residual_norm(x), residual)  # without the norm: the same arithmetic


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(tn, device, dtype):
    """16-bit inputs accumulate in float32, as the C++ kernels do, and round once to x's dtype
    (bfloat16 to nearest even, also in the interpreter, whose own conversion truncates)."""
    for n, m in ((5, 7), (64, 64), (33, 70)):
        x = (torch.randn(3, n, m) * 3).to(device=device, dtype=dtype)
        check_all(tn, x, ulps=1)


def test_hand_worked(tn, device):
    """x = [[1, -2], [3, 4]]: column abs sums (4, 6), row abs sums (3, 7): ‖x‖ = √42.
    μ = (2, 1), x − 1μᵀ = [[-1, -3], [1, 3]]: column sums (2, 6), row sums (4, 4): √24. Every sum
    is exact, so the results are √42 and √24 correctly rounded, in each dtype."""
    for dtype in DTYPES:
        x = torch.tensor([[1.0, -2.0], [3.0, 4.0]], dtype=dtype, device=device)
        residual, norm = tn.triton_residual_norm(x, return_norm=True)
        assert residual.shape == () and residual.dtype == dtype
        assert residual.item() == torch.tensor(math.sqrt(24.0), dtype=torch.float64).to(dtype).item()
        assert norm.item() == torch.tensor(math.sqrt(42.0), dtype=torch.float64).to(dtype).item()
        assert tn.triton_composite_norm(x).item() == norm.item()


def test_identity_and_rank_one(tn, device):
    """res(I_n) has abs sums 2(n − 1)/n; a matrix of equal rows has residual exactly 0 (its column
    means are its rows), also with n a power of two or not and several matrices per program."""
    for n in (1, 5, 64):
        eye = torch.eye(n, dtype=torch.float64, device=device).expand(3, n, n)
        assert torch.equal(tn.triton_composite_norm(eye), torch.ones(3, dtype=torch.float64, device=device))
        expected = torch.full((3,), 2 * (n - 1) / n, dtype=torch.float64)
        torch.testing.assert_close(tn.triton_residual_norm(eye).cpu(), expected, rtol=1e-15, atol=0)
        rows = torch.randn(4, 1, 7, device=device).expand(4, n, 7)
        assert torch.equal(tn.triton_residual_norm(rows), torch.zeros(4, device=device))


def test_small_residual_keeps_float32_precision(tn, device):
    """Nearly rank 1 (the residual 1e-6 of the entries): the sums and the centring run in float64,
    so the float32 result has float32's relative accuracy (float32 sums would lose about half)."""
    base = torch.rand(1, 48, dtype=torch.float64) + 1.0
    x = (base.expand(40, 48) + 1e-6 * torch.randn(40, 48, dtype=torch.float64)).float()
    expected = reference(x)[0]
    got = tn.triton_residual_norm(x.to(device))
    torch.testing.assert_close(got.double().cpu(), expected, rtol=2e-7, atol=0)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy meets the overflow
def test_composite_beyond_float64_products(tn, device):
    """‖·‖_1 ‖·‖_∞ overflows (1e200 entries) or underflows (1e-200): the composite is then
    sqrt(‖·‖_1) sqrt(‖·‖_∞), composite_from_parts's rule, as pk.composite_norm gives it."""
    for scale in (1e200, 1e-200):
        x = scale * torch.tensor([[1.0, 2.0], [3.0, 4.0], [-5.0, 1.0]], dtype=torch.float64)
        got = tn.triton_composite_norm(x.to(device)).item()
        assert math.isfinite(got) and got > 0
        assert got == pytest.approx(pk.composite_norm(x).item(), rel=1e-15)
        assert tn.triton_residual_norm(x.to(device)).item() == pytest.approx(pk.residual_norm(x).item(), rel=1e-15)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy meets the NaN and ∞
def test_nan_and_inf_propagate_as_in_the_ops(tn, device):
    """A NaN makes both norms NaN; an infinity makes the norm infinite and the residual NaN (∞ − ∞ in
    the centring), as in pk's ops; other matrices of the same program are untouched. Also in the
    second strip of a strip-walked matrix and in a row tile."""
    for shape, config in (((4, 6, 5), None), ((4, 8, 40), (128, 1, True, 4, 1)), ((4, 40, 8), (64, 1, False, 2, 1))):
        x = torch.randn(*shape, dtype=torch.float64)
        x[1, 2, -3] = float("nan")
        x[2, -1, 0] = float("inf")
        x[3, 4, -1] = -float("inf")
        residual, norm = tn.triton_residual_norm(x.to(device), return_norm=True, config=config)
        want_residual, want_norm = pk.residual_norm(x, return_norm=True)
        torch.testing.assert_close(residual.cpu(), want_residual, equal_nan=True, rtol=1e-15, atol=0)
        torch.testing.assert_close(norm.cpu(), want_norm, equal_nan=True, rtol=1e-15, atol=0)
        assert residual[1].isnan() and norm[1].isnan() and norm[2].isinf() and residual[2].isnan()
        assert residual[0].isfinite() and norm[0].isfinite()
        composite = tn.triton_composite_norm(x.to(device), config=config)
        torch.testing.assert_close(composite.cpu(), want_norm, equal_nan=True, rtol=1e-15, atol=0)


# --- the three designs, configs and the persistent grid ---------------------------------------


@pytest.mark.parametrize(
    "shape, config, design",
    [
        ((37, 3, 5), (256, 1, True, 2, 1), "whole"),  # 8 per program, a partial last group
        ((37, 3, 5), (256, 2, False, 4, 1), "whole"),
        ((5, 12, 40), (256, 1, True, 2, 1), "strips"),  # 16 × 16 strips, a partial third
        ((5, 12, 40), (512, 1, False, 4, 1), "strips"),
        ((3, 21, 10), (64, 1, True, 2, 1), "rows"),  # tiles of 4 rows, a partial last tile
        ((2, 9, 40), (32, 1, True, 2, 1), "rows"),  # 64 columns > TILE: one row per tile
    ],
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) and len(v) == 3 else None,
)
def test_designs(tn, device, shape, config, design):
    """Each design (tile_shape), with prefetch or without, on more matrices than the grid has programs
    (the interpreter's grid: 2 "SMs" × per_sm), so that every program walks several groups."""
    b, n, m = shape
    assert tn.tile_shape(n, m, config[0]).design == design
    x = torch.randn(b, n, m, dtype=torch.float64, device=device)
    check_all(tn, x, config=config)
    check_all(tn, x.float(), config=config)


def test_tile_shape_and_prune(tn):
    """The Python twin of the kernel's tile, and the autotuner's pruning: whole matrices (several per
    program), strips, row tiles only where no tile that holds every row fits, one config per launch."""
    assert tn.tile_shape(64, 64, 8192) == ("whole", 2, 64, 64)
    assert tn.tile_shape(3, 5, 256) == ("whole", 8, 4, 8)
    assert tn.tile_shape(32, 768, 8192) == ("strips", 1, 32, 256)
    assert tn.tile_shape(256, 256, 16384) == ("strips", 1, 256, 64)
    assert tn.tile_shape(4096, 64, 8192) == ("rows", 1, 128, 64)
    assert tn.tile_shape(5000, 4096, 2048) == ("rows", 1, 1, 4096)
    if tn.triton is None:
        return
    configs = [
        tn.triton.Config({"TILE": c.tile, "PER_SM": c.per_sm, "PREFETCH": c.prefetch}, num_warps=c.num_warps)
        for c in tn.CONFIG_SPACES["full"]
    ]

    def kept(n, m, dtype=torch.float32):
        """(tile shape, per_sm, prefetch, warps, stages) of each config kept for the case."""
        x = torch.empty(0, dtype=dtype, device="meta")
        return [
            (tn.tile_shape(n, m, c.kwargs["TILE"]), c.kwargs["PER_SM"], c.kwargs["PREFETCH"], c.num_warps,
             c.num_stages)
            for c in tn._prune(configs, {"x_ptr": x}, n=n, m=m)
        ]  # fmt: skip

    def designs(n, m, dtype=torch.float32):
        return {launch[0].design for launch in kept(n, m, dtype)}

    assert designs(64, 64) == {"whole", "strips"} and designs(512, 64) == {"strips"}
    assert designs(4096, 64) == {"rows"} and designs(32, 768, torch.float16) == {"strips"}
    # n = 1024: a strip of 16 columns is 16K elements, too many float32 registers; float16 fits.
    assert designs(1024, 64) == {"rows"} and designs(1024, 64, torch.float16) == {"strips"}
    for n, m, dtype in ((64, 64, torch.float32), (128, 128, torch.float64), (8, 8, torch.float16)):
        for shape, _, _, warps, _ in kept(n, m, dtype):
            per_thread = shape.matrices * shape.rows * shape.cols * dtype.itemsize // (32 * warps)
            assert tn.MIN_THREAD_BYTES <= per_thread <= tn.MAX_THREAD_BYTES, (n, m, dtype, shape, warps)
    # 32 float32 elements per thread at 16 warps spilled (ptxas): pruned for float32, kept for float16.
    big = tn.NormConfig(16384, 1, True, 16, 1)
    assert tn.register_estimate(big, 64, 64, 4) > 128 >= tn.register_estimate(big, 64, 64, 2)
    assert all(c.kwargs["TILE"] < 16384 for c in tn._prune(configs, {"x_ptr": torch.empty(0)}, n=64, m=64))
    launches = kept(2048, 4096)  # every tile ≤ 4096 elements is one row of 4096: one config per launch
    assert len(launches) == len(set(launches)) < len(configs)


# --- batch shapes and layouts -----------------------------------------------------------------


@pytest.mark.parametrize("shape", [(0, 4, 5), (3, 0, 2, 2), (2, 6, 0), (6, 0), (4, 5), (2, 3, 4, 5)])
def test_batch_shapes(tn, device, shape):
    """Empty batches, m = 0 (norms 0: nothing is launched), a 0-d batch (x [n, m]), two batch dims."""
    x = torch.randn(shape, device=device)
    residual, norm = tn.triton_residual_norm(x, return_norm=True)
    composite = tn.triton_composite_norm(x)
    assert residual.shape == norm.shape == composite.shape == shape[:-2]
    want_residual, want_norm = reference(x)
    for got, want in ((residual, want_residual), (norm, want_norm), (composite, want_norm)):
        assert_close(got, want, torch.float32, 8)


@pytest.mark.parametrize("layout", ["transposed", "strided", "expanded", "sliced_batch", "permuted_batch"])
def test_non_contiguous(tn, device, layout):
    """Any strides (the kernel takes them as compile-time constants): transposed (unit row stride),
    every other row and third column, an expanded batch (stride 0), a sliced batch, and batch dims
    that do not merge (copied by the reshape, as the C++ ops do)."""
    base = torch.randn(6, 20, 24, dtype=torch.float64, device=device)
    x = {
        "transposed": base.transpose(-1, -2),
        "strided": base[:, ::2, ::3],
        "expanded": base[:1].expand(5, 20, 24),
        "sliced_batch": base.permute(1, 0, 2)[:, 1:5],
        "permuted_batch": base.reshape(2, 3, 20, 24).transpose(0, 1),
    }[layout]
    assert not x.is_contiguous()
    residual, norm, composite = check_all(tn, x)
    contiguous = tn.triton_residual_norm(x.contiguous(), return_norm=True)
    torch.testing.assert_close(residual, contiguous[0], rtol=1e-15, atol=0)
    torch.testing.assert_close(norm, contiguous[1], rtol=1e-15, atol=0)


# --- checks, the torch ops, the GPU's code ----------------------------------------------------


def test_bad_input(tn, device):
    composite, residual = tn.triton_composite_norm, tn.triton_residual_norm
    cases = [
        (torch.ones(5, device=device), ValueError, r"expected x to have at least 2 dimensions \[\.\.\., n, m\], got 1"),
        (torch.ones(3, 3, dtype=torch.int64, device=device), TypeError, "expected x to be a floating-point tensor"),
        (torch.ones(2, 0, 3, device=device), ValueError, r"expected x to have at least one row \(n >= 1\)"),
        (torch.empty(2, 1025, 4097, device="meta"), ValueError,
         r"expected n <= 1024 rows or m <= 4096 columns, got shape \[2, 1025, 4097\]"),
        ([[1.0, 2.0]], TypeError, "expected x to be a torch.Tensor, got list"),
    ]  # fmt: skip
    for x, error, message in cases:
        with pytest.raises(error, match="pathkernels.triton_composite_norm: " + message):
            composite(x)
        with pytest.raises(error, match="pathkernels.triton_residual_norm: " + message):
            residual(x)
    with pytest.raises(TypeError, match="pathkernels.triton_residual_norm: expected return_norm to be True or False"):
        residual(torch.ones(2, 2, device=device), return_norm="yes")


def test_config_space_env(tn, monkeypatch):
    monkeypatch.setenv("PATHKERNELS_TRITON_NORM_CONFIGS", "huge")
    with pytest.raises(ValueError, match="PATHKERNELS_TRITON_NORM_CONFIGS in"):
        tn.config_space()
    monkeypatch.setenv("PATHKERNELS_TRITON_NORM_CONFIGS", "quick")
    assert tn.config_space() == "quick" and tn.DEFAULT_CONFIG in tn.CONFIG_SPACES["default"]


def test_refuses_the_other_device(tn):
    """Compiled kernels take CUDA tensors; interpreted ones, CPU tensors: the other is refused."""
    wrong = "meta"
    if tn.INTERPRETED and torch.cuda.is_available():
        wrong = "cuda"
    elif not tn.INTERPRETED:
        wrong = "cpu"
    if wrong == "meta":
        pytest.skip("no second device to refuse")
    with pytest.raises(ValueError, match="pathkernels.triton_residual_norm: "):
        tn.triton_residual_norm(torch.ones(2, 3, device=wrong))


def test_torch_ops_schema_and_fake(tn, device):
    """The registered ops (torch.library.triton_op, with fake kernels): schemas, shapes on fake
    tensors, the checks that need no data, torch.library.opcheck (on the GPU all of it; the
    interpreter's kernels cannot run on the fake tensors its other checks trace with)."""
    composite, residual = tn.op(False), tn.op(True)
    assert composite is torch.ops.pathkernels.triton_composite_norm.default
    assert residual is torch.ops.pathkernels.triton_residual_norm.default
    assert str(composite._schema) == "pathkernels::triton_composite_norm(Tensor x) -> Tensor"
    assert str(residual._schema) == (
        "pathkernels::triton_residual_norm(Tensor x, bool return_norm=False) -> (Tensor, Tensor)"
    )
    x = torch.randn(2, 3, 7, 5, device=device)
    with torch._subclasses.FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
        assert composite(fake).shape == (2, 3)
        out, norm = residual(fake, True)
        assert out.shape == norm.shape == (2, 3) and out.dtype == torch.float32
        assert residual(fake, False)[1].shape == (0,)
        with pytest.raises(ValueError, match="pathkernels.triton_residual_norm: expected x to have at least one row"):
            residual(mode.from_tensor(torch.zeros(2, 0, 3, device=device)), False)
    utils = None if device == "cuda" else ("test_schema", "test_faketensor")
    for op, args in ((composite, (x,)), (residual, (x, True)), (residual, (x, False))):
        if utils is None:
            torch.library.opcheck(op, args)
        else:
            torch.library.opcheck(op, args, test_utils=utils)


def test_autotuned_op(tn, device, monkeypatch):
    """On the GPU through the autotuner (its quick space), which then names its choice."""
    if device != "cuda":
        pytest.skip("the autotuner runs on the GPU only")
    monkeypatch.setenv("PATHKERNELS_TRITON_NORM_CONFIGS", "quick")
    x = torch.randn(300, 64, 64, device=device)
    check_all(tn, x)
    chosen = tn.chosen_config()
    assert chosen is not None and {"TILE", "PER_SM", "PREFETCH", "num_warps"} <= set(chosen["config"])
    assert chosen["tile"]["design"] in ("whole", "strips")


def test_compile_fullgraph(tn, device):
    """torch.compile traces into the ops (triton_op) and runs their kernel (GPU only)."""
    if device != "cuda":
        pytest.skip("torch.compile of Triton kernels needs the GPU")
    x = torch.randn(8, 32, 48, device=device)
    tn.op(False), tn.op(True)

    @torch.compile(fullgraph=True)
    def ratio(x):
        residual, norm = torch.ops.pathkernels.triton_residual_norm(x, True)
        return residual / norm + torch.ops.pathkernels.triton_composite_norm(x)

    residual, norm = reference(x)
    torch.testing.assert_close(ratio(x).double().cpu(), residual / norm + norm, rtol=1e-6, atol=0)


COMPILE_SCRIPT = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import pathkernels.core.triton_norms as t

kernel = t._norms_kernel
patterns = {"v4": r"\bld\.global(\.\S+)*\.v4\.b32", "v2_64": r"\bld\.global(\.\S+)*\.v2\.b64",
            "v2_32": r"\bld\.global(\.\S+)*\.v2\.b32", "scalar": r"\bld\.global(\.(?!v\d)\S+)*\.b32\s",
            "sqrt_rn": r"\bsqrt\.rn\.f(32|64)", "div_rn": r"\bdiv\.rn\.f(32|64)",
            "approx": r"\b(sqrt|div)\.(approx|full)\.", "f64_add": r"\badd\.(rn\.)?f64", "fma": r"\bfma\.rn\.f(32|64)"}
cases = {  # name: (dtype, n, m, strides, centered, with_norm, tile, warps)
    "f32_64x64_residual": ("fp32", 64, 64, (4096, 64, 1), True, True, 4096, 8),
    "f32_32x768_strips": ("fp32", 32, 768, (32 * 768, 768, 1), True, False, 8192, 8),
    "f32_composite": ("fp32", 64, 64, (4096, 64, 1), False, False, 8192, 8),
    "f64_64x64": ("fp64", 64, 64, (4096, 64, 1), True, True, 4096, 8),
    "f16_64x64": ("fp16", 64, 64, (4096, 64, 1), True, True, 4096, 4),
    "f32_33x70": ("fp32", 33, 70, (33 * 70, 70, 1), True, True, 4096, 4),
    "f32_rows": ("fp32", 4096, 64, (4096 * 64, 64, 1), True, True, 8192, 8),
}
counts = {}
for arch, name in [(90, name) for name in cases] + [(80, "f32_64x64_residual"), (80, "f64_64x64")]:
    dtype, n, m, (sb, sr, sc), centered, with_norm, tile, warps = cases[name]
    constants = dict(n=n, m=m, SB=sb, SR=sr, SC=sc, PN=t._pow2(n), PM=t._pow2(m), CENTERED=centered,
                     WITH_NORM=with_norm, MEASURE_X=(not centered) or with_norm, ACC_F64=dtype != "fp16",
                     BF16=False, TILE=tile, PER_SM=4, PREFETCH=True)
    signature = {"x_ptr": "*" + dtype, "out_ptr": "*" + dtype, "norm_ptr": "*" + dtype, "batch": "i32"}
    signature.update({a: "constexpr" for a in kernel.arg_names if a not in signature})
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(3)}  # torch's allocations: 16-byte aligned
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=aligned)
    ptx = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps}).asm["ptx"]
    counts[f"{arch}/{name}"] = {k: len(re.findall(p, ptx)) for k, p in patterns.items()}
print(json.dumps(counts))
"""


def test_compiles_for_the_gpu(tn, device):
    """Without a GPU: the kernel compiled by Triton for sm_90 (the H100/H200; sm_80 for two cases), by
    its own ptxas (no driver), in a fresh interpreter without TRITON_INTERPRET, and the PTX's shape:
    rows of 16-byte-aligned float32 (and float16) read by 128-bit loads alone (ld.global.v4.b32;
    float64 as v2.b64), 8-byte aligned ones (m = 70) by 64-bit loads, float64 sums for float32
    inputs, correctly rounded square roots and means (no approximate sqrt or div.full), and no fused
    multiply-add: the composite's range test must not be contracted (_composite)."""
    if device == "cuda":
        pytest.skip("the GPU runs the compiled kernel itself")
    counts = compiled_for_the_gpu(COMPILE_SCRIPT)
    for arch in (80, 90):
        case = {name.split("/")[1]: c for name, c in counts.items() if name.startswith(f"{arch}/")}
        for name in ("f32_64x64_residual", "f32_32x768_strips", "f32_composite", "f16_64x64", "f32_rows"):
            if name in case:
                assert case[name]["v4"] > 0 and case[name]["scalar"] == 0, (arch, name, case[name])
        assert case["f64_64x64"]["v2_64"] > 0 and case["f64_64x64"]["v4"] == 0, (arch, case["f64_64x64"])
        if "f32_33x70" in case:
            c = case["f32_33x70"]  # rows 8-byte aligned: 64-bit loads
            assert c["v2_32"] > 0 and c["v4"] == c["scalar"] == 0, c
        for name, c in case.items():
            assert c["sqrt_rn"] > 0 and c["approx"] == 0 and c["fma"] == 0, (arch, name, c)
            assert (c["f64_add"] > 0) == (name != "f16_64x64"), (arch, name, c)
            assert (c["div_rn"] > 0) == (name != "f32_composite"), (arch, name, c)  # μ, when centred


def test_without_triton():
    """Where Triton is not installed, pathkernels and this module import, and the ops raise an error
    that names them (a fresh interpreter in which `import triton` fails)."""
    output = printed_without_triton(
        "import torch, pathkernels, pathkernels.core.triton_norms as t\n"
        "for fn in (t.triton_composite_norm, t.triton_residual_norm):\n"
        "    try:\n"
        "        fn(torch.zeros(2, 2))\n"
        "    except RuntimeError as error:\n"
        "        print(error)\n"
    )
    assert output.splitlines() == [
        f"pathkernels.triton_{name}_norm: needs Triton (pip install triton), which is not installed"
        for name in ("composite", "residual")
    ]
