"""The leaf level of the path tree as one Triton kernel over every head.

The CUDA engine reduces a level's leaves head by head (``_fused_leaf_norms``, one launch per head,
plus a GEMV per head for the column means), so each parent's residual is read once per head and
once more for its means. Here one launch covers a block of parents and every head: for parent k
(``R_k = s_k R'_k``, ``R'_k`` the stored residual, ``s_k`` its power-of-two scale) and head h
(``C(A_h) = A_h − 1 a_hᵀ``, ``a_h = 1ᵀA_h / n``) the leaf is

    R = s_k C(A_h) R'_k,   μ = μ_k + s_k R'_kᵀ a_h,   M = 1μᵀ + R   (docs/DESIGN.md §1, the centring identity)

and the kernel reports ``‖R‖_{1,∞}`` and ``‖M‖_{1,∞}`` (``‖X‖_{1,∞} = sqrt(‖X‖_1 ‖X‖_∞)``, the largest
column and row abs sums). No leaf is ever stored, and μ needs no GEMV: the program that multiplies
``C(A_h)`` by a k-slice of ``R'_k`` also folds ``a_h``'s k-slice into the column sums ``a_hᵀ R'_k``.

Semantics match ``torch.ops.pathkernels._fused_leaf_norms`` (csrc/paths/fused_leaf.h): the abs sums
are accumulated in float64 from float32 products, the residual's sums are of ``R'`` and multiplied by
``s_k`` at the end (``leaf_report``), the product's are of ``s_k R' + μ`` at the true scale, the
composite is ``norm_math.h``'s ``composite_from_parts``; both reports are float64. The one
difference is μ, which the engine rounds to float32 before the leaf kernel and this kernel keeps in
float64 (``μ_k + s_k · (a_hᵀ R'_k)``, the dot product in float32).

Precision of the product ``C(A_h) R'_k`` (``precision``): ``"ieee"`` (float32 fused multiply-adds on
CUDA cores), ``"tf32"`` (one TF32 tensor-core pass on operands rounded to TF32, about 2⁻¹¹ relative
per product), ``"tf32x3"`` (3×TF32, float32 accuracy: each operand split exactly into
``hi = tf32(x)`` and ``lo = tf32(x − hi)`` by integer arithmetic on its bits, as tensor_leaf.h does,
and each product taken as ``lo·hi + hi·lo + hi·hi``), and ``"tf32x3-triton"`` (Triton's own
``input_precision="tf32x3"``, for comparison on the GPU). The explicit split is chosen over Triton's
own so that the Triton interpreter, which ignores ``input_precision``, runs the same arithmetic as
the GPU: its operands are TF32 values exactly, each product of two is exact in float32, and only
the order of the float32 sums differs, so the CPU tests check the rounding and the split too.

Triton is optional: importing this module works without it, and the functions raise a clear error
when called. ``TRITON_INTERPRET=1`` must be set when this module is imported (Triton reads it when
the kernels are decorated; the kernels call none of Triton's own @jit helpers, so it need not have
been set when triton itself was imported); the kernels then run on CPU tensors in the interpreter,
one config, no autotuning.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from pathkernels.core._triton import config_space as _config_space
from pathkernels.core._triton import describe_choice, interpreting, on_device, registered_op, require, tl, triton
from pathkernels.core._triton import jit as _jit

OP = "pathkernels.triton_leaf_norms"
OP_NAME = "pathkernels::triton_leaf_norms"
MAX_ROWS = 128  # n: the whole leaf's rows live in one program's tile
# input_precision of the kernel's product, as the PRECISION constexpr.
PRECISIONS = {"ieee": 0, "tf32": 1, "tf32x3": 2, "tf32x3-triton": 3}
_CONFIG_SPACE_ENV = "PATHKERNELS_TRITON_CONFIGS"


# Whether this module's kernels were decorated under the interpreter (fixed at import, as Triton does).
INTERPRETED = triton is not None and interpreting()


# ---------------------------------------------------------------------------------------------
# The kernel. Its helpers are Triton device functions; the kernel's docstring gives the ownership.


@_jit
def _tf32_round(x):
    """x rounded to TF32 (10 mantissa bits, to nearest, ties away from zero, as cvt.rna.tf32.f32):
    tensor_leaf.h's tf32_round, integer arithmetic on the bits, so that the interpreter rounds
    exactly as the GPU does. The low 13 bits come out zero, so a tensor core reads the value
    exactly. Infinities and NaNs pass unchanged (a carry must not reach the sign)."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x1000) & -8192).to(tl.float32, bitcast=True)  # -8192 = 0xffffe000
    return tl.where((bits & 0x7F800000) == 0x7F800000, x, rounded)


@_jit
def _multiply_add(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b, a [BLOCK_N, BLOCK_K] of C(A), b [BLOCK_K, BLOCK_M] of R', in float32.

    3×TF32 adds the small terms first (lo·hi, hi·lo, then hi·hi), as tensor_leaf.h's passes; lo·lo
    (below 2⁻²² of the product) is dropped."""
    if PRECISION == 0:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    elif PRECISION == 1:
        acc = tl.dot(_tf32_round(a), _tf32_round(b), acc, input_precision="tf32")
    elif PRECISION == 2:
        a_hi = _tf32_round(a)
        b_hi = _tf32_round(b)
        a_lo = _tf32_round(a - a_hi)  # a − a_hi is exact: a_hi is a with fewer bits
        b_lo = _tf32_round(b - b_hi)
        acc = tl.dot(a_lo, b_hi, acc, input_precision="tf32")
        acc = tl.dot(a_hi, b_lo, acc, input_precision="tf32")
        acc = tl.dot(a_hi, b_hi, acc, input_precision="tf32")
    else:
        acc = tl.dot(a, b, acc, input_precision="tf32x3")
    return acc


@_jit
def _sum(x, axis: tl.constexpr):
    """tl.sum, as tl.reduce with Triton's own combine function. The kernel calls none of Triton's
    @jit helpers (tl.sum, tl.max, tl.zeros), whose interpreted or compiled form is fixed when triton
    is imported, so that TRITON_INTERPRET need be set only when this module is; the interpreter
    still recognises the combine function and reduces with numpy (a combine function of ours would
    be called element by element, a hundred times slower)."""
    return tl.reduce(x, axis, tl.standard._sum_combine)


@_jit
def _max(x, axis: tl.constexpr):
    """The largest entry along axis, NaN where one is NaN (torch.amax's rule, and norm_math.h's
    max_beats: a NaN in a leaf must reach its norms, as in the CUDA kernels). tl.reduce with Triton's
    own combine function, as _sum; that one drops NaNs (max.f64), so a NaN's presence is counted
    apart and the sum, NaN then, stands for the maximum."""
    nans = tl.reduce((x != x).to(tl.int32), axis, tl.standard._sum_combine)
    return tl.where(nans > 0, _sum(x, axis), tl.reduce(x, axis, tl.standard._elementwise_max))


@_jit
def _maximum(a, b):
    """max(a, b), NaN where either is (tl.maximum drops a NaN)."""
    return tl.where((a != a) | (b != b), a + b, tl.maximum(a, b))


@_jit
def _composite(l1, linf):
    """sqrt(l1 · linf), or sqrt(l1) · sqrt(linf) where the product leaves float64's range:
    norm_math.h's composite_from_parts. tl.sqrt of float64 is correctly rounded (sqrt.rn.f64)."""
    product = l1 * linf
    # A subnormal product has lost digits already (below 2.2e-308): the roots' product, as there.
    subnormal = (product < 2.2250738585072014e-308) & (l1 != 0.0) & (linf != 0.0)
    out_of_range = ((product - product) != 0.0) | subnormal
    return tl.where(out_of_range, tl.sqrt(l1) * tl.sqrt(linf), tl.sqrt(product))


@_jit
def _leaf_norms_kernel(
    attn_ptr,  # C(A) [H, n, n] float32
    attn_mean_ptr,  # a [H, n] float32
    parents_ptr,  # R' [n, c, m] float32
    parent_means_ptr,  # μ_k [c, m] float32
    scale_ptr,  # s [c] float64 (unused without HAS_SCALE)
    residual_ptr,  # [c, H] float64, contiguous
    norm_ptr,  # [c, H] float64, contiguous
    n,
    m,
    H,
    stride_ah,
    stride_ai,
    stride_ak,
    stride_mh,
    stride_mk,
    stride_pi,
    stride_pc,
    stride_pj,
    stride_qc,
    stride_qj,
    stride_s,
    PRECISION: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_H: tl.constexpr,
):
    """Program p owns parent k = p // ⌈H / GROUP_H⌉ and the GROUP_H heads of group p mod ⌈H / GROUP_H⌉:
    for each of its heads, the whole leaf (every row, BLOCK_N ≥ n, and every column, BLOCK_M at a
    time), so its column sums are complete per column tile and its row sums are added up over the
    tiles in registers: the program writes the two norms and nothing else. The heads of one parent
    are consecutive programs (or one program), so R'_k comes from DRAM once and from cache after.

    Per column tile, the k-loop multiplies C(A_h)[:, k-slice] by R'_k[k-slice, tile] into a
    float32 accumulator and, from the same loaded R' slice, adds a_h[k-slice]ᵀ R'_k[k-slice, tile]
    to the tile's shift (float32, fused multiply-adds whatever PRECISION): μ = μ_k + s · shift, with
    no GEMV and no second read of R'. The epilogue converts to float64 (the C++ kernels' accumulation
    type): |v| for the residual, |s·v + μ| for the product (s a power of two: s·v is exact), masked
    outside the leaf."""
    pid = tl.program_id(0)
    head_groups = (H + GROUP_H - 1) // GROUP_H
    parent = (pid // head_groups).to(tl.int64)  # 64-bit offsets: c·m may exceed 2³¹
    first_head = (pid % head_groups) * GROUP_H
    rows = tl.arange(0, BLOCK_N)
    row_inside = rows < n
    if HAS_SCALE:
        scale = tl.load(scale_ptr + parent * stride_s)
    else:
        scale = tl.full([], 1.0, tl.float64)
    parent_base = parents_ptr + parent * stride_pc
    parent_mean_base = parent_means_ptr + parent * stride_qc
    for g in range(0, GROUP_H):
        head = first_head + g
        if head < H:  # the last group may be partial
            attn_base = attn_ptr + head * stride_ah
            attn_mean_base = attn_mean_ptr + head * stride_mh
            row_residual = tl.full([BLOCK_N], 0.0, tl.float64)  # row abs sums so far, over the tiles
            row_product = tl.full([BLOCK_N], 0.0, tl.float64)
            col_residual = tl.full([], 0.0, tl.float64)  # largest column abs sum so far
            col_product = tl.full([], 0.0, tl.float64)
            for col0 in range(0, m, BLOCK_M):
                cols = col0 + tl.arange(0, BLOCK_M)
                col_inside = cols < m
                acc = tl.full([BLOCK_N, BLOCK_M], 0.0, tl.float32)
                shift = tl.full([BLOCK_M], 0.0, tl.float32)
                for k0 in range(0, n, BLOCK_K):
                    ks = k0 + tl.arange(0, BLOCK_K)
                    k_inside = ks < n
                    a = tl.load(
                        attn_base + rows[:, None] * stride_ai + ks[None, :] * stride_ak,
                        mask=row_inside[:, None] & k_inside[None, :],
                        other=0.0,
                    )
                    r = tl.load(
                        parent_base + ks[:, None].to(tl.int64) * stride_pi + cols[None, :] * stride_pj,
                        mask=k_inside[:, None] & col_inside[None, :],
                        other=0.0,
                    )
                    a_mean = tl.load(attn_mean_base + ks * stride_mk, mask=k_inside, other=0.0)
                    shift += _sum(a_mean[:, None] * r, axis=0)
                    acc = _multiply_add(a, r, acc, PRECISION)
                parent_mean = tl.load(parent_mean_base + cols * stride_qj, mask=col_inside, other=0.0)
                mean = parent_mean.to(tl.float64) + scale * shift.to(tl.float64)
                v = acc.to(tl.float64)
                # Rows and columns outside the leaf hold 0 in acc (their operands were loaded as 0), so
                # |v| needs no mask; s·0 + μ does.
                residual = tl.abs(v)
                product = tl.where(row_inside[:, None] & col_inside[None, :], tl.abs(v * scale + mean[None, :]), 0.0)
                col_residual = _maximum(col_residual, _max(_sum(residual, axis=0), axis=0))
                col_product = _maximum(col_product, _max(_sum(product, axis=0), axis=0))
                row_residual += _sum(residual, axis=1)
                row_product += _sum(product, axis=1)
            out = parent * H + head
            tl.store(residual_ptr + out, scale * _composite(col_residual, _max(row_residual, axis=0)))
            tl.store(norm_ptr + out, _composite(col_product, _max(row_product, axis=0)))


# ---------------------------------------------------------------------------------------------
# Launch configurations.


class LeafConfig(NamedTuple):
    """One launch configuration: column tile, k-slice, heads per program, warps, pipeline stages."""

    block_m: int
    block_k: int
    group_h: int
    num_warps: int = 4
    num_stages: int = 2


# The autotuner's space: column tiles of 32 to 128 columns, k-slices of 16 (deeper pipelines) or 32,
# one head per program (the most programs) or four (R' reused from L1), 4 or 8 warps. k-slices of 64
# are left out: compiled for sm_90 (Triton 3.6, ptxas's resource usage) they spill, the IEEE FMA
# product by kilobytes. _prune drops what does not fit a case, and tiles whose float64 epilogue
# would hold more than 32 elements per thread (those spill too).
CONFIG_SPACES = {
    "full": [
        LeafConfig(32, 16, 1, 4, 2),
        LeafConfig(32, 32, 1, 4, 2),
        LeafConfig(32, 32, 1, 8, 2),
        LeafConfig(32, 32, 4, 4, 2),
        LeafConfig(64, 16, 1, 4, 3),
        LeafConfig(64, 16, 1, 8, 3),
        LeafConfig(64, 32, 1, 4, 2),
        LeafConfig(64, 32, 1, 8, 2),
        LeafConfig(64, 32, 4, 8, 2),
        LeafConfig(128, 16, 1, 8, 3),
        LeafConfig(128, 32, 1, 8, 2),
    ],
    "quick": [
        LeafConfig(32, 32, 1, 4, 2),
        LeafConfig(64, 16, 1, 8, 3),
        LeafConfig(64, 32, 1, 4, 2),
        LeafConfig(64, 32, 4, 8, 2),
    ],
}
MAX_EPILOGUE_ELEMENTS = 32  # BLOCK_N · BLOCK_M / threads: float64 values per thread in the epilogue
# The interpreter's config (no autotuning there), and the one config of the space "default" (the
# GPU tests: one compilation per case, no tuning): two heads per program, so that head groups and
# their last, partial group are exercised, and k-slices of 32, so that n > 32 loops.
DEFAULT_CONFIG = LeafConfig(64, 32, 2, 4, 2)
CONFIG_SPACES["default"] = [DEFAULT_CONFIG]


def _block_rows(n: int) -> int:
    """BLOCK_N: the smallest power of two ≥ n, at least 16 (tl.dot's smallest dimension). A traced
    (symbolic) n is specialised: the kernel is compiled for its BLOCK_N."""
    return max(16, 1 << (int(n) - 1).bit_length())


def _prune(configs, named_args, **kwargs):
    """The configs that fit a case: k-slices no deeper than BLOCK_N, column tiles no wider than
    needed, head groups no larger than H (a larger one launches the same programs as GROUP_H = H),
    at most MAX_EPILOGUE_ELEMENTS per thread; the smallest tile where none is left."""
    block_n = _block_rows(named_args["n"])
    block_m = max(32, 1 << (named_args["m"] - 1).bit_length())
    heads = named_args["H"]

    def fits(c):
        kw = c.kwargs
        elements = block_n * kw["BLOCK_M"] // (32 * c.num_warps)
        return (
            kw["BLOCK_K"] <= block_n
            and kw["BLOCK_M"] <= block_m
            and (kw["GROUP_H"] == 1 or kw["GROUP_H"] <= heads)
            and elements <= MAX_EPILOGUE_ELEMENTS
        )

    kept = [c for c in configs if fits(c)]
    return kept or [min(configs, key=lambda c: (c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_K"], -c.num_warps))]


_AUTOTUNERS: dict = {}


def _autotuner(space: str):
    """The autotuned kernel over CONFIG_SPACES[space], keyed by (n, m, H, PRECISION)."""
    if space not in _AUTOTUNERS:
        configs = [
            triton.Config(
                {"BLOCK_M": c.block_m, "BLOCK_K": c.block_k, "GROUP_H": c.group_h},
                num_warps=c.num_warps,
                num_stages=c.num_stages,
            )
            for c in CONFIG_SPACES[space]
        ]

        def bench(kernel_call, quantiles):  # shorter than the default 25 + 100 ms per config
            return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)

        _AUTOTUNERS[space] = triton.autotune(
            configs=configs,
            key=["n", "m", "H", "PRECISION"],
            prune_configs_by={"early_config_prune": _prune},
            do_bench=bench,
        )(_leaf_norms_kernel)
    return _AUTOTUNERS[space]


def config_space() -> str:
    """The autotuner's space: PATHKERNELS_TRITON_CONFIGS, "full" (the default), "quick" (four
    configs, for a short GPU check) or "default" (DEFAULT_CONFIG alone: no tuning)."""
    return _config_space(_CONFIG_SPACE_ENV, CONFIG_SPACES, OP)


def chosen_config() -> dict | None:
    """What the autotuner last chose (for the benchmarks): the config and every config's time in
    ms (median), or None before any autotuned launch."""
    return describe_choice(_AUTOTUNERS.get(config_space()))


# ---------------------------------------------------------------------------------------------
# Checks, launch, the torch op and its wrapper.


def require_triton(op: str = OP) -> None:
    """Raise a clear error where Triton is not installed."""
    require(op)


def _check(attn_centred, attn_mean, parents, parent_means, scale, precision, op: str = OP) -> None:
    """The checks that need no data (they also run on fake tensors)."""
    for name, t in [
        ("attn_centred", attn_centred),
        ("attn_mean", attn_mean),
        ("parents", parents),
        ("parent_means", parent_means),
    ]:
        if not isinstance(t, Tensor):
            raise TypeError(f"{op}: expected {name} to be a torch.Tensor, got {type(t).__name__}")
    if attn_centred.dim() != 3 or attn_centred.shape[1] != attn_centred.shape[2] or attn_centred.shape[0] < 1:
        raise ValueError(f"{op}: expected attn_centred [H, n, n] with H >= 1, got shape {list(attn_centred.shape)}")
    heads, n = attn_centred.shape[0], attn_centred.shape[1]
    if not 1 <= n <= MAX_ROWS:
        raise ValueError(f"{op}: expected 1 <= n <= {MAX_ROWS} rows, got n = {n}")
    if list(attn_mean.shape) != [heads, n]:
        raise ValueError(f"{op}: expected attn_mean [H, n] = {[heads, n]}, got {list(attn_mean.shape)}")
    if parents.dim() != 3 or parents.shape[0] != n or parents.shape[2] < 1:
        raise ValueError(f"{op}: expected parents [n, c, m] with n = {n} and m >= 1, got shape {list(parents.shape)}")
    count, m = parents.shape[1], parents.shape[2]
    if list(parent_means.shape) != [count, m]:
        raise ValueError(f"{op}: expected parent_means [c, m] = {[count, m]}, got {list(parent_means.shape)}")
    for name, t in [
        ("attn_centred", attn_centred),
        ("attn_mean", attn_mean),
        ("parents", parents),
        ("parent_means", parent_means),
    ]:
        if t.dtype != torch.float32:
            raise TypeError(f"{op}: expected {name} in torch.float32, got {t.dtype}")
    if scale is not None:
        if not isinstance(scale, Tensor):
            raise TypeError(f"{op}: expected scale to be a torch.Tensor or None, got {type(scale).__name__}")
        if list(scale.shape) != [count]:
            raise ValueError(f"{op}: expected scale [c] = [{count}], got {list(scale.shape)}")
        if scale.dtype != torch.float64:
            raise TypeError(f"{op}: expected scale in torch.float64, got {scale.dtype}")
    if precision not in PRECISIONS:
        raise ValueError(f"{op}: expected precision in {list(PRECISIONS)}, got {precision!r}")
    tensors = {"attn_centred": attn_centred, "attn_mean": attn_mean, "parents": parents, "parent_means": parent_means}
    if scale is not None:
        tensors["scale"] = scale
    devices = {}
    for name, t in tensors.items():
        devices.setdefault(t.device, name)
    if len(devices) > 1:
        found = ", ".join(f"{name} on {device}" for device, name in devices.items())
        raise ValueError(f"{op}: expected every tensor on one device, got {found}")
    device = attn_centred.device
    if device.type == "meta":
        return
    if INTERPRETED and device.type != "cpu":
        raise ValueError(f"{op}: the kernels run in Triton's interpreter (TRITON_INTERPRET=1): expected CPU tensors")
    if not INTERPRETED and device.type != "cuda":
        raise ValueError(
            f"{op}: expected CUDA tensors, got {device.type} (set TRITON_INTERPRET=1 before importing "
            "pathkernels.core.triton_leaf to run the kernel on CPU tensors in Triton's interpreter)"
        )
    if count * heads >= 2**31:
        raise ValueError(f"{op}: too many leaves ({count} parents × {heads} heads) for one launch")


def _launch(
    attn_centred: Tensor,
    attn_mean: Tensor,
    parents: Tensor,
    parent_means: Tensor,
    scale: Tensor | None,
    precision: str,
    residual: Tensor,
    norm: Tensor,
    config: LeafConfig | None = None,
) -> None:
    """One launch into residual and norm ([c, H] float64, contiguous): autotuned on the GPU, with
    ``config`` (or DEFAULT_CONFIG in the interpreter) otherwise."""
    heads, n = attn_centred.shape[0], attn_centred.shape[1]
    count, m = parents.shape[1], parents.shape[2]
    if count == 0:
        return
    args = (
        attn_centred,
        attn_mean,
        parents,
        parent_means,
        parent_means if scale is None else scale,  # a placeholder pointer without a scale
        residual,
        norm,
        n,
        m,
        heads,
        *attn_centred.stride(),
        *attn_mean.stride(),
        *parents.stride(),
        *parent_means.stride(),
        1 if scale is None else scale.stride(0),
    )
    constants = {"PRECISION": PRECISIONS[precision], "HAS_SCALE": scale is not None, "BLOCK_N": _block_rows(n)}
    if config is None and not INTERPRETED:
        kernel = _autotuner(config_space())

        def grid(meta):
            return (count * triton.cdiv(heads, meta["GROUP_H"]),)

        torch.library.wrap_triton(kernel)[grid](*args, **constants)
        return
    config = config or DEFAULT_CONFIG
    grid = (count * triton.cdiv(heads, config.group_h),)
    torch.library.wrap_triton(_leaf_norms_kernel)[grid](
        *args,
        **constants,
        BLOCK_M=config.block_m,
        BLOCK_K=config.block_k,
        GROUP_H=config.group_h,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def _outputs(attn_centred: Tensor, parents: Tensor) -> tuple[Tensor, Tensor]:
    shape = (parents.shape[1], attn_centred.shape[0])
    residual = attn_centred.new_empty(shape, dtype=torch.float64)
    return residual, torch.empty_like(residual)


def _triton_leaf_norms_impl(
    attn_centred: Tensor,
    attn_mean: Tensor,
    parents: Tensor,
    parent_means: Tensor,
    scale: Optional[Tensor] = None,  # noqa: UP045 (torch.library's schema inference reads typing.Optional)
    precision: str = "tf32x3",
) -> tuple[Tensor, Tensor]:
    """The op's body (registered by triton_op): checks, outputs, one launch on the inputs' device."""
    _check(attn_centred, attn_mean, parents, parent_means, scale, precision)
    residual, norm = _outputs(attn_centred, parents)
    with on_device(attn_centred.device):
        _launch(attn_centred, attn_mean, parents, parent_means, scale, precision, residual, norm)
    return residual, norm


def _triton_leaf_norms_fake(attn_centred, attn_mean, parents, parent_means, scale=None, precision="tf32x3"):
    """The op's fake kernel: the checks that need no data, and empty [c, H] float64 outputs."""
    _check(attn_centred, attn_mean, parents, parent_means, scale, precision)
    return _outputs(attn_centred, parents)


def op():
    """``torch.ops.pathkernels.triton_leaf_norms``, registered (torch.library.triton_op, with a fake
    kernel) on first use."""
    require_triton()
    return registered_op(OP_NAME, _triton_leaf_norms_impl, _triton_leaf_norms_fake)


def triton_leaf_norms(
    attn_centred: Tensor,
    attn_mean: Tensor,
    parents: Tensor,
    parent_means: Tensor,
    scale: Tensor | None = None,
    precision: str = "tf32x3",
    *,
    config: LeafConfig | None = None,
) -> tuple[Tensor, Tensor]:
    """The norms of every head's leaves of a block of parents, in one Triton launch.

    For parent k and head h, with ``R_k = s_k R'_k`` and ``C(A_h) = A_h − 1a_hᵀ``:

        R = C(A_h) R_k,   μ = μ_k + R_kᵀ a_h,   M = 1μᵀ + R,
        residual[k, h] = ‖R‖_{1,∞},   norm[k, h] = ‖M‖_{1,∞},   ‖X‖_{1,∞} = sqrt(‖X‖_1 ‖X‖_∞)

    (``‖X‖_1`` the largest column abs sum, ``‖X‖_∞`` the largest row abs sum): the leaves
    ``path_chunk_norms`` reports for the children of these parents through every head.

    Args:
        attn_centred: ``[H, n, n]`` float32, ``C(A_h)`` (1 ≤ n ≤ 128).
        attn_mean: ``[H, n]`` float32, ``a_h = 1ᵀA_h / n``.
        parents: ``[n, c, m]`` float32, ``R'_k`` (the engine's layout: any strides; a ``[c, n, m]``
            tensor passes as ``.transpose(0, 1)``).
        parent_means: ``[c, m]`` float32, ``μ_k``.
        scale: ``[c]`` float64 powers of two ``s_k`` (the engine's node scales, positive and
            finite), or None for 1.
        precision: ``"tf32x3"`` (float32 accuracy on tensor cores, the default), ``"ieee"`` (float32
            on CUDA cores), ``"tf32"`` (one TF32 pass, about 1e-3 relative), or ``"tf32x3-triton"``
            (Triton's own 3×TF32).
        config: a fixed launch configuration instead of the autotuner's choice (tests, benchmarks);
            the kernel is then launched directly, not through the torch op.

    Returns:
        ``(residual, norm)``, each ``[c, H]`` float64.

    Runs on CUDA tensors, or on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1 set before
    this module is imported). Raises RuntimeError where Triton is not installed.
    """
    require_triton()
    _check(attn_centred, attn_mean, parents, parent_means, scale, precision)
    if scale is not None and scale.numel() and not bool((torch.isfinite(scale) & (scale > 0)).all()):
        raise ValueError(f"{OP}: expected every scale to be a positive finite number")
    if config is None:
        return op()(attn_centred, attn_mean, parents, parent_means, scale, precision)
    residual, norm = _outputs(attn_centred, parents)
    with on_device(attn_centred.device):
        _launch(attn_centred, attn_mean, parents, parent_means, scale, precision, residual, norm, LeafConfig(*config))
    return residual, norm
