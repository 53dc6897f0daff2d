"""The composite and residual norms of a batch of matrices as one Triton kernel each.

For x ``[..., n, m]`` (n rows, the tokens; m columns):

    ‖x‖_{1,∞} = sqrt(‖x‖_1 ‖x‖_∞),   ‖x‖_1 = max_j Σ_i |x_ij|,   ‖x‖_∞ = max_i Σ_j |x_ij|
    res(x) = x − 1μᵀ,   μ_j = (Σ_i x_ij) / n                      (docs/DESIGN.md §1)

``triton_composite_norm(x)`` is ``‖x‖_{1,∞}`` and ``triton_residual_norm(x)`` is ``‖res(x)‖_{1,∞}``
(with ``return_norm=True`` also ``‖x‖_{1,∞}`` from the same pass): the values of
``pk.composite_norm`` and ``pk.residual_norm`` (csrc/norms/norms_cuda.cu), without their autograd.
The arithmetic is theirs: float32 and float64 inputs accumulate in float64, float16 and bfloat16 in
float32 (norm_math.h's ``norm_acc_t``); μ is the column sum divided by n, correctly rounded, and the
centring subtracts in the accumulation type, so that a residual far below the mean keeps its digits;
the maxima propagate NaN (``max_beats``); the composite is ``composite_from_parts`` (sqrt of the
product, or the product of the roots where the product leaves the accumulation type's range), with
correctly rounded square roots; the result is rounded once to x's dtype. Only the order of the
sums differs (trees across threads instead of rows in order), so float32 results agree with the
CUDA and CPU kernels to the last bit but for rare double roundings, and float64 ones to a few ulp.

The kernel (``_norms_kernel``) is one launch whatever the op, and reads x once but in one case:

- **Whole matrices in registers** (``n'·m'`` up to the config's TILE elements, 1K to 16K; n', m' the
  powers of two ≥ n, m): each program owns G = TILE / (n'·m') matrices at a time, loaded as one
  ``[G, n', m']`` tile of contiguous rows; the column sums, μ, the centred values and both sets of
  abs sums are taken from that tile in registers, so the residual needs no second read.
- **Column strips** (wider matrices, ``n' · 16 ≤ TILE``): each program owns one matrix at a time and
  walks it in strips of every row and TILE / n' columns. A strip holds whole columns, so its μ, its
  centred column sums and its contribution to every row sum are complete in registers: still one
  read, for any m (``[B, 32, 768]`` is three strips of 256 columns at TILE = 8192).
- **Row tiles** (taller matrices: the autotuner takes them only where no config holds a strip of
  every row within its registers, n > 512 for float32 and float64 in the full and quick spaces,
  n > 1024 for 16-bit inputs, n > 256 with DEFAULT_CONFIG): each program owns one matrix and walks
  it in tiles of every column and TILE / m' rows, the column sums in registers. The composite norm
  is one pass. The residual is not, and cannot be without the whole matrix on chip: every centred
  sum needs μ, which needs every row. So its tiles are read twice, the second time in reverse
  order, the most recently read first, from L2 while the matrices in flight (one per program) fit
  there: about 190 KB per matrix at 2 programs per SM in the 50 MB L2 of an H100/H200. Beyond, the
  second read comes more and more from DRAM, up to twice the traffic of one read.

The grid is persistent: ``SMs × PER_SM`` programs (fewer if the batch is smaller) walk the batch,
program p taking groups p, p + P, p + 2P, …, and (PREFETCH) issuing the loads of its next strip or
group before reducing the current one, a two-deep pipeline in registers. Rows are read with unit
column stride as contiguous vectors: 128-bit loads where the rows are 16-byte aligned (the strides
are compile-time constants, so the compiler sees the alignment; the PTX test checks
``ld.global.v4``). Tile size (and with it the matrices per program and the strip width), warps,
pipeline stages, prefetch and programs per SM are tuned by ``triton.autotune`` over
CONFIG_SPACES[PATHKERNELS_TRITON_NORM_CONFIGS] (full, quick, default), keyed by n, m, the op and the
dtype.

Triton is optional: importing this module works without it, and the functions raise a clear error
when called. ``TRITON_INTERPRET=1`` must be set when this module is imported (Triton reads it when
the kernels are decorated); the kernel then runs on CPU tensors in the interpreter, one config
(DEFAULT_CONFIG, or ``config=``), no autotuning.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from pathkernels.core._triton import config_space as _config_space
from pathkernels.core._triton import describe_choice, interpreting, on_device, registered_op, require, tl, triton
from pathkernels.core._triton import jit as _jit
from pathkernels.core.checks import check_flag
from pathkernels.core.ops import check_norm_input

OPS = {False: "pathkernels.triton_composite_norm", True: "pathkernels.triton_residual_norm"}
OP_NAMES = {False: "pathkernels::triton_composite_norm", True: "pathkernels::triton_residual_norm"}
MIN_STRIP = 16  # narrowest column strip (64 bytes of a float32 row); the kernel repeats this literal
MAX_STRIP_ROWS = 1024  # n' · MIN_STRIP ≤ the largest TILE: taller matrices take row tiles alone
MAX_TILE_COLUMNS = 4096  # row tiles keep m' column sums per target in registers
MAX_OFFSET = 2**31  # offsets within a matrix are 32-bit; a view beyond is copied first
INTERPRETER_SMS = 2  # the "SMs" of the interpreter's persistent grid (CPU: no device to ask)
_CONFIG_SPACE_ENV = "PATHKERNELS_TRITON_NORM_CONFIGS"


# Whether this module's kernels were decorated under the interpreter (fixed at import, as Triton does).
INTERPRETED = triton is not None and interpreting()


# ---------------------------------------------------------------------------------------------
# Device helpers. They call none of Triton's own @jit helpers (tl.sum, tl.max, tl.zeros, tl.cdiv),
# whose interpreted or compiled form is fixed when triton is imported, so that TRITON_INTERPRET
# need be set only when this module is (as in pathkernels/triton_leaf.py, whose helpers these copy).


@_jit
def _sum(x, axis: tl.constexpr):
    """tl.sum, as tl.reduce with Triton's own combine function (the interpreter reduces it with numpy)."""
    return tl.reduce(x, axis, tl.standard._sum_combine)


@_jit
def _bits(x, ACC_F64: tl.constexpr):
    """x's bit patterns as signed integers of its width."""
    if ACC_F64:
        bits = x.to(tl.int64, bitcast=True)
    else:
        bits = x.to(tl.int32, bitcast=True)
    return bits


@_jit
def _max(x, axis: tl.constexpr, ACC_F64: tl.constexpr):
    """The largest abs sum along axis, NaN where one is NaN (torch.amax's rule, and norm_math.h's
    max_beats; Triton's own max drops NaNs: max.f64). The values reduced here are abs sums: +0 or
    more, +∞, or a NaN of positive sign (|·| clears the sign, and a sum with a NaN operand gives
    that NaN or the GPU's canonical NaN, both positive). Read as signed integers, the bit patterns
    of such values are ordered as the values are, and a positive NaN lies above +∞: the integer
    maximum is the float maximum with NaN propagation, in one reduction (counting the NaNs apart
    took three cross-thread reductions per maximum)."""
    bits = tl.reduce(_bits(x, ACC_F64), axis, tl.standard._elementwise_max)
    return bits.to(x.dtype, bitcast=True)


@_jit
def _maximum(a, b, ACC_F64: tl.constexpr):
    """max(a, b) of abs sums (as _max), NaN where either is."""
    return tl.maximum(_bits(a, ACC_F64), _bits(b, ACC_F64)).to(a.dtype, bitcast=True)


@_jit
def _widen(x, ACC_F64: tl.constexpr):
    """x in the accumulation type: float64 for float32/float64 inputs, float32 for 16-bit ones."""
    if ACC_F64:
        y = x.to(tl.float64)
    else:
        y = x.to(tl.float32)
    return y


@_jit
def _mean(column_sums, n: tl.constexpr, ACC_F64: tl.constexpr):
    """column_sums / n, correctly rounded (float32's `/` in Triton is div.full, not IEEE)."""
    if ACC_F64:
        mean = column_sums / n
    else:
        mean = tl.math.div_rn(column_sums, tl.full(column_sums.shape, n, tl.float32))
    return mean


@_jit
def _sqrt(x, ACC_F64: tl.constexpr):
    """Correctly rounded square root (sqrt.rn.f64; sqrt_rn for float32, whose tl.sqrt is approximate)."""
    if ACC_F64:
        root = tl.sqrt(x)
    else:
        root = tl.sqrt_rn(x)
    return root


@_jit
def _bfloat16_round(x):
    """float32 x rounded to the nearest bfloat16 (ties to even), still as float32, by integer
    arithmetic on the bits: the GPU's store would round so (cvt.rn.bf16.f32), Triton's interpreter
    truncates; rounded here, the store's conversion is exact on both. NaN passes unchanged."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)  # -65536 = 0xffff0000
    return tl.where(x != x, x, rounded)


@_jit
def _result(l1, linf, ACC_F64: tl.constexpr, BF16: tl.constexpr):
    """The composite norm as stored: composite_from_parts, rounded once to x's dtype by the store
    (bfloat16 rounded here first, see _bfloat16_round)."""
    value = _composite(l1, linf, ACC_F64)
    if BF16:
        value = _bfloat16_round(value)
    return value


@_jit
def _composite(l1, linf, ACC_F64: tl.constexpr):
    """sqrt(l1 · linf), or sqrt(l1) · sqrt(linf) where the product leaves the type's range:
    norm_math.h's composite_from_parts. Its test for an infinite or NaN product, `p − p != 0`, is
    written here as `not |p| <= the largest finite value` (false for ∞ and NaN alike): compiled,
    `p − p` with p = l1 · linf is contracted into fma(l1, linf, −p), the product's rounding error,
    nonzero for most finite products (seen in the PTX: fma.rn.f64), which would take the roots'
    product, an ulp away, for every matrix."""
    product = l1 * linf
    if ACC_F64:
        largest = 1.7976931348623157e308
        smallest = 2.2250738585072014e-308
    else:
        largest = 3.4028234663852886e38
        smallest = 1.17549435e-38
    # Below the smallest normal number the product has lost digits already: the roots' product.
    out_of_range = (~(tl.abs(product) <= largest)) | ((product < smallest) & (l1 != 0.0) & (linf != 0.0))
    return tl.where(out_of_range, _sqrt(l1, ACC_F64) * _sqrt(linf, ACC_F64), _sqrt(product, ACC_F64))


# ---------------------------------------------------------------------------------------------
# The kernel.


@_jit
def _load_strip(
    x_ptr,
    group,
    strip,
    batch,
    g,
    rows,
    cols,
    offsets,
    n: tl.constexpr,
    m: tl.constexpr,
    SB: tl.constexpr,
    SC: tl.constexpr,
    PN: tl.constexpr,
    BM: tl.constexpr,
    G: tl.constexpr,
):
    """Strip ``strip`` (columns strip·BM …) of the G matrices of group ``group``: a [G, PN, BM] tile in
    x's dtype, 0 outside the matrices (padding rows and columns, matrices past the batch)."""
    b = group * G + g
    mask = (b < batch)[:, None, None]
    if PN != n:
        mask = mask & (rows < n)[None, :, None]
    if m % BM != 0:
        mask = mask & ((strip * BM + cols) < m)[None, None, :]
    starts = x_ptr + b.to(tl.int64) * SB  # [G] matrix starts: 64-bit, the batch may exceed 2³¹ elements
    return tl.load(starts[:, None, None] + (offsets + strip * BM * SC)[None, :, :], mask=mask, other=0.0)


@_jit
def _norms_kernel(
    x_ptr,  # [batch, n, m], strides SB, SR, SC (elements)
    out_ptr,  # [batch], x's dtype: ‖res(x)‖_{1,∞} when CENTERED, else ‖x‖_{1,∞}
    norm_ptr,  # [batch], x's dtype: ‖x‖_{1,∞} (written only when CENTERED and WITH_NORM)
    batch,
    n: tl.constexpr,
    m: tl.constexpr,
    SB: tl.constexpr,
    SR: tl.constexpr,
    SC: tl.constexpr,
    PN: tl.constexpr,  # the smallest power of two ≥ n
    PM: tl.constexpr,  # the smallest power of two ≥ max(m, 1)
    CENTERED: tl.constexpr,
    WITH_NORM: tl.constexpr,
    MEASURE_X: tl.constexpr,  # the norms of x itself are an output: not CENTERED, or WITH_NORM
    ACC_F64: tl.constexpr,  # accumulate in float64 (float32/float64 x), else float32
    BF16: tl.constexpr,  # x (and the outputs) are bfloat16
    TILE: tl.constexpr,  # elements of x a program holds in registers at a time (a power of two)
    PER_SM: tl.constexpr,  # programs per SM: read by the launch grid only
    PREFETCH: tl.constexpr,  # load the next strip before reducing this one (whole matrices and strips)
):
    """Program p owns matrices (groups of G matrices) p, p + P, p + 2P, … of the batch (P programs:
    a persistent grid) and writes their norms and nothing else. The shape of its register tile
    follows from n, m and TILE (module docstring; tile_shape is the Python twin):

    - whole matrices: ``[G, n', m']``, G = TILE / (n'·m');
    - column strips: ``[1, n', TILE / n']``, where ``n' · 16 ≤ TILE``;
    - row tiles: ``[TILE / m', m']`` (at least one row), the residual's second pass in reverse.

    Strides are compile-time constants (the tests pass transposed, strided and expanded views), so
    rows of unit column stride are read as 128-bit vectors where their alignment allows. Offsets
    within a matrix are 32-bit (the wrapper guarantees they fit); the batch offset is 64-bit."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    if PN * 16 <= TILE:
        # Every row of a matrix fits: whole matrices (one strip, G ≥ 1) or column strips (G = 1).
        if PN * PM <= TILE:
            G: tl.constexpr = TILE // (PN * PM)
            BM: tl.constexpr = PM
        else:
            G: tl.constexpr = 1
            BM: tl.constexpr = TILE // PN
        STRIPS: tl.constexpr = (m + BM - 1) // BM  # 1 for whole matrices
        g = tl.arange(0, G)
        rows = tl.arange(0, PN)
        cols = tl.arange(0, BM)
        offsets = rows[:, None] * SR + cols[None, :] * SC  # [PN, BM], loop-invariant
        groups = (batch + G - 1) // G
        if PREFETCH:
            pending = _load_strip(x_ptr, pid, 0, batch, g, rows, cols, offsets, n, m, SB, SC, PN, BM, G)
        for group in tl.range(pid, groups, programs):
            b = group * G + g
            inside = b < batch
            zero_rows = _widen(tl.full([G, PN], 0.0, tl.float32), ACC_F64)
            zero_maxima = _widen(tl.full([G], 0.0, tl.float32), ACC_F64)
            rows_x, l1_x = zero_rows, zero_maxima  # Σ_j |x_ij| so far (over the strips), max_j Σ_i |x_ij|
            rows_r, l1_r = zero_rows, zero_maxima  # the same of x − 1μᵀ
            for s in range(0, STRIPS):
                if PREFETCH:
                    # Register double-buffering: the loads of the next strip (of this group, or the
                    # first of the program's next group) are issued before this one is reduced, so
                    # that they are in flight while it computes. Past the batch they are masked out.
                    tile = pending
                    last = (s + 1) // STRIPS  # 1 at the last strip, else 0
                    pending = _load_strip(
                        x_ptr, group + last * programs, (s + 1) % STRIPS, batch, g, rows, cols, offsets,
                        n, m, SB, SC, PN, BM, G,
                    )  # fmt: skip
                else:
                    tile = _load_strip(x_ptr, group, s, batch, g, rows, cols, offsets, n, m, SB, SC, PN, BM, G)
                v = _widen(tile, ACC_F64)  # outside the matrix: 0
                if MEASURE_X:
                    a = tl.abs(v)
                    l1_x = _maximum(l1_x, _max(_sum(a, axis=1), 1, ACC_F64), ACC_F64)
                    rows_x += _sum(a, axis=2)
                if CENTERED:
                    # The strip holds whole columns: μ, then the centred sums, from registers.
                    mean = _mean(_sum(v, axis=1), n, ACC_F64)  # [G, BM]; 0 outside the matrix
                    centred = v - mean[:, None, :]
                    if PN != n:
                        centred = tl.where((rows < n)[None, :, None], centred, 0.0)  # padding rows: not −μ
                    c = tl.abs(centred)
                    l1_r = _maximum(l1_r, _max(_sum(c, axis=1), 1, ACC_F64), ACC_F64)
                    rows_r += _sum(c, axis=2)
            if CENTERED:
                tl.store(out_ptr + b, _result(l1_r, _max(rows_r, 1, ACC_F64), ACC_F64, BF16), mask=inside)
                if WITH_NORM:
                    tl.store(norm_ptr + b, _result(l1_x, _max(rows_x, 1, ACC_F64), ACC_F64, BF16), mask=inside)
            else:
                tl.store(out_ptr + b, _result(l1_x, _max(rows_x, 1, ACC_F64), ACC_F64, BF16), mask=inside)
    else:
        # Row tiles: every column, BN rows at a time; column sums in registers across the tiles.
        if PM <= TILE:
            BN: tl.constexpr = TILE // PM
        else:
            BN: tl.constexpr = 1
        TILES: tl.constexpr = (n + BN - 1) // BN
        rows = tl.arange(0, BN)
        cols = tl.arange(0, PM)
        offsets = rows[:, None] * SR + cols[None, :] * SC  # [BN, PM], loop-invariant
        col_inside = cols < m
        for b in tl.range(pid, batch, programs):
            start = x_ptr + tl.cast(b, tl.int64) * SB  # (tl.cast: b is a Python int in the interpreter)
            zero_cols = _widen(tl.full([PM], 0.0, tl.float32), ACC_F64)
            zero = _widen(tl.full([], 0.0, tl.float32), ACC_F64)
            col_sum, col_x, linf_x = zero_cols, zero_cols, zero  # Σ_i x_ij, Σ_i |x_ij|, max_i Σ_j |x_ij|
            for k in range(0, TILES):
                r0 = k * BN
                mask = ((r0 + rows) < n)[:, None] & col_inside[None, :]
                tile = tl.load(start + r0 * SR + offsets, mask=mask, other=0.0)
                v = _widen(tile, ACC_F64)
                if CENTERED:
                    col_sum += _sum(v, axis=0)
                if MEASURE_X:
                    a = tl.abs(v)
                    col_x += _sum(a, axis=0)
                    linf_x = _maximum(linf_x, _max(_sum(a, axis=1), 0, ACC_F64), ACC_F64)
            if CENTERED:
                mean = _mean(col_sum, n, ACC_F64)
                col_r, linf_r = zero_cols, zero
                for k in range(0, TILES):  # the second read, last tile first (likeliest still in L2)
                    r0 = (TILES - 1 - k) * BN
                    mask = ((r0 + rows) < n)[:, None] & col_inside[None, :]
                    tile = tl.load(start + r0 * SR + offsets, mask=mask, other=0.0)
                    c = tl.abs(tl.where(mask, _widen(tile, ACC_F64) - mean[None, :], 0.0))
                    col_r += _sum(c, axis=0)
                    linf_r = _maximum(linf_r, _max(_sum(c, axis=1), 0, ACC_F64), ACC_F64)
                tl.store(out_ptr + b, _result(_max(col_r, 0, ACC_F64), linf_r, ACC_F64, BF16))
                if WITH_NORM:
                    tl.store(norm_ptr + b, _result(_max(col_x, 0, ACC_F64), linf_x, ACC_F64, BF16))
            else:
                tl.store(out_ptr + b, _result(_max(col_x, 0, ACC_F64), linf_x, ACC_F64, BF16))


# ---------------------------------------------------------------------------------------------
# Launch configurations.


class NormConfig(NamedTuple):
    """One launch configuration: register tile (elements of x per program at a time: with n and m,
    it sets the matrices per program, the strip width or the rows per tile), programs per SM of the
    persistent grid, register double-buffering of the next strip, warps, pipeline stages."""

    tile: int
    per_sm: int = 4
    prefetch: bool = True
    num_warps: int = 4
    num_stages: int = 1


class TileShape(NamedTuple):
    """What a config's tile means for one (n, m): the kernel's design ("whole", "strips", "rows"),
    matrices per program at a time, rows and columns of the register tile."""

    design: str
    matrices: int
    rows: int
    cols: int


def _pow2(k: int) -> int:
    """The smallest power of two ≥ k (1 for k ≤ 1)."""
    return 1 << max(0, int(k) - 1).bit_length()


def tile_shape(n: int, m: int, tile: int) -> TileShape:
    """The kernel's register tile for an n × m matrix and a config's TILE (the kernel derives the
    same from its constexprs; the launch grid uses this twin)."""
    pn, pm = _pow2(n), _pow2(max(m, 1))
    if pn * MIN_STRIP <= tile:
        if pn * pm <= tile:
            return TileShape("whole", tile // (pn * pm), pn, pm)
        return TileShape("strips", 1, pn, tile // pn)
    return TileShape("rows", 1, max(1, tile // pm), pm)


# The autotuner's space. Tiles of 1K to 16K elements (4 to 64 KiB of float32): whole matrices up
# to 64 × 128, several per program below that (a 64 × 64 float32 matrix: 1 or 2 per program),
# column strips beyond (16 to 512 columns); 16 or 32 elements per thread (four or eight 128-bit
# loads of float32), so that every thread keeps several loads in flight; the next strip prefetched
# into registers or not (the register pipeline: Triton's own pipeliner left these loads alone at
# every num_stages in the PTX of Triton 3.9, so stages > 1 appear once, to be measured); programs
# per SM near the occupancy the registers allow. Registers, from ptxas -v for sm_90 (Triton 3.9),
# residual with its norm of float32 (the most): 16 elements per thread 107–126 with prefetch, 80–102
# without; 32 elements 160–212 with, 146–164 without; 32 elements at 16 warps (at most 128
# registers) spilled 56–356 bytes, which _prune's register estimate now drops.
CONFIG_SPACES = {
    "full": [
        NormConfig(1024, 8, True, 2, 1),  # 16 per thread, 64-thread programs
        NormConfig(2048, 4, True, 4, 1),  # 16
        NormConfig(2048, 8, True, 4, 1),  # 16, more programs than fit at once
        NormConfig(2048, 5, True, 2, 1),  # 32
        NormConfig(4096, 2, True, 8, 1),  # 16
        NormConfig(4096, 2, False, 8, 1),  # 16, no prefetch
        NormConfig(4096, 3, True, 4, 1),  # 32
        NormConfig(8192, 1, True, 16, 1),  # 16
        NormConfig(8192, 1, True, 16, 2),  # 16, stages 2
        NormConfig(8192, 1, True, 8, 1),  # 32
        NormConfig(8192, 1, False, 8, 1),  # 32, no prefetch
        NormConfig(8192, 2, False, 8, 1),  # 32, no prefetch, two programs per SM where they fit
        NormConfig(16384, 1, True, 16, 1),  # 32: 16-bit inputs only (the register estimate)
    ],
    "quick": [
        NormConfig(2048, 4, True, 4, 1),
        NormConfig(4096, 2, True, 8, 1),
        NormConfig(4096, 3, True, 4, 1),
        NormConfig(8192, 1, True, 16, 1),
        NormConfig(8192, 2, False, 8, 1),
    ],
}
MIN_THREAD_BYTES = 16  # at least one 128-bit load per thread
MAX_THREAD_BYTES = 256  # at most 64 float32 (or 32 float64) elements of x per thread
REGISTERS = 65536  # per SM (sm_80, sm_90)
# The interpreter's config (no autotuning there), and the one config of the space "default" (GPU
# tests: one compilation per case, no tuning).
DEFAULT_CONFIG = NormConfig(4096, 2, True, 8, 1)
CONFIG_SPACES["default"] = [DEFAULT_CONFIG]


def register_estimate(config: NormConfig, n: int, m: int, element_size: int) -> int:
    """Registers per thread, roughly, of the heaviest op (the residual with its norm): 40 plus, per
    element of x a thread holds, its bytes (twice with prefetch) and 1.5 times the accumulation
    type's (the widened values and the centred ones), plus the thread's share of the running sums
    (two per row of the tile; three per column for row tiles), in 4-byte registers. It matches
    the ptxas counts above within about 15 %, above them."""
    shape = tile_shape(n, m, config.tile)
    threads = 32 * config.num_warps
    elements = shape.matrices * shape.rows * shape.cols // threads
    accumulation = 8 if element_size >= 4 else 4
    per_element = element_size * (2 if config.prefetch else 1) + 1.5 * accumulation
    sums = 3 * shape.cols if shape.design == "rows" else 2 * shape.matrices * shape.rows
    return int(40 + elements * per_element / 4 + -(-sums // threads) * accumulation / 4)


def _fits(config: NormConfig, n: int, m: int, element_size: int) -> bool:
    """Whether a config suits a case: bytes of x per thread within [MIN_THREAD_BYTES,
    MAX_THREAD_BYTES], and registers (register_estimate) within what a program of its warps may use
    (255, or the SM's share of each thread)."""
    shape = tile_shape(n, m, config.tile)
    per_thread = shape.matrices * shape.rows * shape.cols * element_size // (32 * config.num_warps)
    registers = min(255, REGISTERS // (32 * config.num_warps))
    return (
        MIN_THREAD_BYTES <= per_thread <= MAX_THREAD_BYTES
        and register_estimate(config, n, m, element_size) <= registers
    )


def _prune(configs, named_args, **kwargs):
    """The configs that fit the case (_fits), one per distinct launch; row tiles only where no tile
    that holds every row fits (the residual reads row tiles twice, strips once); the smallest tile
    where nothing fits."""
    args = {**named_args, **kwargs}
    n, m = args["n"], args["m"]
    element_size = args["x_ptr"].element_size()
    fitting = []
    for c in configs:
        kw = c.kwargs
        config = NormConfig(kw["TILE"], kw["PER_SM"], bool(kw["PREFETCH"]), c.num_warps, c.num_stages)
        if _fits(config, n, m, element_size):
            fitting.append((c, (tile_shape(n, m, config.tile), *config[1:])))
    one_read = [(c, launch) for c, launch in fitting if launch[0].design != "rows"]
    kept, seen = [], set()
    for c, launch in one_read or fitting:
        if launch not in seen:
            seen.add(launch)
            kept.append(c)
    return kept or [min(configs, key=lambda c: (c.kwargs["TILE"], c.num_warps))]


_AUTOTUNERS: dict = {}
_LAST_CASE: dict = {}


def _autotuner(space: str):
    """The autotuned kernel over CONFIG_SPACES[space], keyed by n, m, the op's flags and (Triton adds
    them) the dtypes of the tensor arguments."""
    if space not in _AUTOTUNERS:
        configs = [
            triton.Config(
                {"TILE": c.tile, "PER_SM": c.per_sm, "PREFETCH": c.prefetch},
                num_warps=c.num_warps,
                num_stages=c.num_stages,
            )
            for c in CONFIG_SPACES[space]
        ]

        def bench(kernel_call, quantiles):  # shorter than the default 25 + 100 ms per config
            return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)

        _AUTOTUNERS[space] = triton.autotune(
            configs=configs,
            key=["n", "m", "CENTERED", "WITH_NORM", "ACC_F64"],
            prune_configs_by={"early_config_prune": _prune},
            do_bench=bench,
        )(_norms_kernel)
    return _AUTOTUNERS[space]


def config_space() -> str:
    """The autotuner's space: PATHKERNELS_TRITON_NORM_CONFIGS, "full" (the default), "quick" (five
    configs, for a short GPU check) or "default" (DEFAULT_CONFIG alone: no tuning)."""
    return _config_space(_CONFIG_SPACE_ENV, CONFIG_SPACES, OPS[False])


def chosen_config() -> dict | None:
    """What the autotuner last chose (for the benchmarks): the config, its tile for the last case
    (design, matrices per program, tile rows and columns), every config's time in ms (median), or
    None before any autotuned launch."""
    chosen = describe_choice(_AUTOTUNERS.get(config_space()))
    if chosen is not None and _LAST_CASE:
        tile = chosen["config"]["TILE"]
        chosen["tile"] = tile_shape(_LAST_CASE["n"], _LAST_CASE["m"], tile)._asdict()
    return chosen


# ---------------------------------------------------------------------------------------------
# Checks, launch, the torch ops and their wrappers.


def require_triton(op: str = OPS[False]) -> None:
    """Raise a clear error where Triton is not installed."""
    require(op)


def _check(x, centered: bool) -> None:
    """The checks that need no data (they also run on fake tensors): pk.composite_norm's and
    pk.residual_norm's (the same words, under this op's name), the shape limits, the device."""
    op = OPS[centered]
    check_norm_input(x, centered, op)
    n, m = x.shape[-2], x.shape[-1]
    if n > MAX_STRIP_ROWS and m > MAX_TILE_COLUMNS:
        raise ValueError(
            f"{op}: expected n <= {MAX_STRIP_ROWS} rows or m <= {MAX_TILE_COLUMNS} columns, got "
            f"shape {list(x.shape)} (pk.{'residual' if centered else 'composite'}_norm takes any shape)"
        )
    device = x.device
    if device.type == "meta":
        return
    if INTERPRETED and device.type != "cpu":
        raise ValueError(f"{op}: the kernels run in Triton's interpreter (TRITON_INTERPRET=1): expected CPU tensors")
    if not INTERPRETED and device.type != "cuda":
        raise ValueError(
            f"{op}: expected CUDA tensors, got {device.type} (set TRITON_INTERPRET=1 before importing "
            "pathkernels.core.triton_norms to run the kernel on CPU tensors in Triton's interpreter)"
        )


def _as_batch(x: Tensor) -> Tensor:
    """x as [B, n, m] (a view where the leading dims merge, as the C++ ops do), copied to contiguous
    where an offset within one matrix would leave 32 bits."""
    n, m = x.shape[-2], x.shape[-1]
    x3 = x.reshape(math.prod(x.shape[:-2]), n, m)
    if (n - 1) * x3.stride(1) + (m - 1) * x3.stride(2) >= MAX_OFFSET:
        x3 = x3.contiguous()
    return x3


def _outputs(x: Tensor, centered: bool, with_norm: bool) -> tuple[Tensor, Tensor]:
    """[...] outputs in x's dtype (zeros for m = 0, whose norms are 0 and which launches nothing), and
    an empty norm output where it is not asked for."""
    make = torch.zeros if x.shape[-1] == 0 else torch.empty
    out = make(x.shape[:-2], dtype=x.dtype, device=x.device)
    norm = make(x.shape[:-2], dtype=x.dtype, device=x.device) if centered and with_norm else x.new_empty(0)
    return out, norm


_SM_COUNTS: dict = {}


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the device (INTERPRETER_SMS on the CPU)."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def _programs(batch: int, n: int, m: int, tile: int, per_sm: int, sms: int) -> int:
    """The persistent grid: SMs × per_sm programs, no more than there are groups of matrices."""
    groups = -(-batch // tile_shape(n, m, tile).matrices)
    return max(1, min(groups, sms * per_sm))


def _launch(x: Tensor, centered: bool, with_norm: bool, out: Tensor, norm: Tensor, config=None) -> None:
    """One launch into out and norm ([...], contiguous): autotuned on the GPU, with ``config`` (or
    DEFAULT_CONFIG in the interpreter) otherwise."""
    x3 = _as_batch(x)
    batch, n, m = x3.shape
    if batch == 0 or m == 0:
        return
    args = (x3, out, norm if centered and with_norm else x3, batch)  # x3: a placeholder pointer, never written
    # Shapes and strides are compile-time constants: int() specialises symbolic ones (torch.compile
    # with dynamic shapes), as a new shape or layout compiles a new kernel anyway.
    n, m = int(n), int(m)
    constants = {
        "n": n,
        "m": m,
        "SB": int(x3.stride(0)),
        "SR": int(x3.stride(1)),
        "SC": int(x3.stride(2)),
        "PN": _pow2(n),
        "PM": _pow2(m),
        "CENTERED": centered,
        "WITH_NORM": centered and with_norm,
        "MEASURE_X": not centered or with_norm,
        "ACC_F64": x.dtype in (torch.float32, torch.float64),
        "BF16": x.dtype == torch.bfloat16,
    }
    sms = _sm_count(x.device)
    _LAST_CASE.update(n=n, m=m)
    if config is None and not INTERPRETED:

        def grid(meta):
            return (_programs(batch, n, m, meta["TILE"], meta["PER_SM"], sms),)

        torch.library.wrap_triton(_autotuner(config_space()))[grid](*args, **constants)
        return
    config = NormConfig(*(config or DEFAULT_CONFIG))
    grid = (_programs(batch, n, m, config.tile, config.per_sm, sms),)
    torch.library.wrap_triton(_norms_kernel)[grid](
        *args,
        **constants,
        TILE=config.tile,
        PER_SM=config.per_sm,
        PREFETCH=config.prefetch,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def _run(x: Tensor, centered: bool, with_norm: bool, config=None) -> tuple[Tensor, Tensor]:
    out, norm = _outputs(x, centered, with_norm)
    with on_device(x.device):
        _launch(x, centered, with_norm, out, norm, config)
    return out, norm


def _triton_composite_norm_impl(x: Tensor) -> Tensor:
    """The op's body (registered by triton_op): checks, output, one launch on x's device."""
    _check(x, False)
    return _run(x, False, False)[0]


def _triton_composite_norm_fake(x):
    """The fake kernel: the checks that need no data, and an empty [...] output in x's dtype."""
    _check(x, False)
    return _outputs(x, False, False)[0]


def _triton_residual_norm_impl(x: Tensor, return_norm: bool = False) -> tuple[Tensor, Tensor]:
    """The op's body: (residual, norm); norm is an empty [0] tensor unless return_norm."""
    _check(x, True)
    return _run(x, True, return_norm)


def _triton_residual_norm_fake(x, return_norm=False):
    _check(x, True)
    return _outputs(x, True, return_norm)


def op(centered: bool):
    """``torch.ops.pathkernels.triton_residual_norm`` (centered) or ``triton_composite_norm``,
    registered (torch.library.triton_op, with a fake kernel) on first use."""
    require_triton(OPS[centered])
    if centered:
        return registered_op(OP_NAMES[True], _triton_residual_norm_impl, _triton_residual_norm_fake)
    return registered_op(OP_NAMES[False], _triton_composite_norm_impl, _triton_composite_norm_fake)


def triton_composite_norm(x: Tensor, *, config: NormConfig | None = None) -> Tensor:
    """The ℓ1,∞ composite norm of a batch of matrices, in one Triton launch that reads x once.

    ``‖x‖_{1,∞} = sqrt(max_j Σ_i |x_ij| · max_i Σ_j |x_ij|)``: ``pk.composite_norm(x)``'s value
    (float64 sums for float32/float64, float32 for float16/bfloat16), without autograd.

    Args:
        x: ``[..., n, m]``, float32/float64/float16/bfloat16, any strides, n ≥ 1; n ≤ 1024 or
            m ≤ 4096.
        config: a fixed launch configuration (:class:`NormConfig`) instead of the autotuner's choice
            (tests, benchmarks); the kernel is then launched directly, not through the torch op.

    Returns:
        ``[...]`` in x's dtype (0 where m = 0).

    Runs on CUDA tensors, or on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1 set before
    this module is imported). Raises RuntimeError where Triton is not installed.
    """
    require_triton(OPS[False])
    _check(x, False)
    if config is None:
        return op(False)(x)
    return _run(x, False, False, config)[0]


def triton_residual_norm(
    x: Tensor, *, return_norm: bool = False, config: NormConfig | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """Composite norm of the residual ``res(x) = x − 1·μᵀ`` (μ the column mean over the n rows), in
    one Triton launch that reads x once (twice, the second time mostly from L2, for matrices taller
    than a strip of every row fits in registers: n > 512 for float32, see the module docstring).

    ``‖res(x)‖_{1,∞} = sqrt(max_j Σ_i |x_ij − μ_j| · max_i Σ_j |x_ij − μ_j|)``, ``μ_j = Σ_i x_ij / n``:
    ``pk.residual_norm(x, return_norm=...)``'s values, without autograd.

    Args:
        x: ``[..., n, m]``, float32/float64/float16/bfloat16, any strides, n ≥ 1; n ≤ 1024 or
            m ≤ 4096.
        return_norm: also return ``‖x‖_{1,∞}`` from the same pass (for the residual ratio).
        config: a fixed launch configuration instead of the autotuner's choice (tests, benchmarks).

    Returns:
        ``[...]``, or ``(residual, norm)`` with ``return_norm=True``, in x's dtype.
    """
    require_triton(OPS[True])
    return_norm = check_flag(return_norm, "return_norm", OPS[True])
    _check(x, True)
    if config is None:
        residual, norm = op(True)(x, return_norm)
    else:
        residual, norm = _run(x, True, return_norm, config)
    return (residual, norm) if return_norm else residual
