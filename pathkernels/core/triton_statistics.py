"""pk.path_statistics' fold of one chunk of leaves on the GPU, in two Triton launches.

For a chunk of c leaves with residuals ``r [B, c]``, norms ``ν [B, c]`` (float64, as the engine
reports them) and path lengths ``ℓ [c]``, the accumulators of :class:`PathStatistics` at
``[b, k]`` (batch element b, path length k) take the leaves with ``ℓ = k``:

    counts += #leaves                    zero_norms += #{ν = 0}
    sums[m] += Σ v_m                     sums_of_squares[m] += Σ v_m²     (m: ratio, residual, norm)
    log10_ratio_sums += Σ log10 ρ        (ρ = r / ν; a term 0 where ρ = 0 or ν = 0)
    minima[m] = min(minima[m], v_m)      maxima[m] likewise, NaN left out
    histograms[h][bin(v_h)] += 1         (h: ratio, residual; bin(v) = #{edges ≤ v}, NaN: the last)

A zero path (ν = 0) has no ratio: it adds 0 to the ratio's sums and takes no part in the ratio's
extremes or histogram. The op also returns, per extreme, measure, b and k, the chunk's first leaf
(in leaf order) whose value is strictly beyond the accumulator's before the chunk, or -1: the
leaves whose paths the caller records. These are the numbers of ``PathStatistics._add_torch``
(the test oracle, about 40 torch launches a chunk); only the order of the float64 sums differs.

The launches:

1. ``_fold_chunk_kernel``, grid ``(P, B)``: program p walks its span of leaves in tiles of BLOCK
   and reduces each tile per length through a one-hot ``[BLOCK, S]`` mask (S = L + 1, padded to a
   power of two). Its sums, and its extremes with their first leaves, carry across its tiles and
   are written as partials ``[B, P, ·, S]``. A value's bin is found by a binary search over the
   edges (any ascending edges; ⌈log2(E + 1)⌉ gathers, from cache) and counted with an integer
   atomic into a per-chunk scratch histogram, exact in any order.
2. ``_merge_kernel``, grid ``(B,)``: reduces the P partials in a fixed order (a run repeats to the
   bit), merges them into the accumulators, and adds the scratch histogram to the histograms.

An extreme and its first leaf are reduced together as the pair (value, leaf) in lexicographic
order: among equal values the smallest leaf index, which is the first in leaf order, whichever
program or tile saw it.

Triton is optional: importing this module works without it, and the functions raise a clear error
when called. ``TRITON_INTERPRET=1`` set when this module is imported runs the kernels on CPU
tensors in Triton's interpreter, one config, no autotuning: the tests check them so against the
torch fold.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pathkernels.core._triton import config_space as _config_space
from pathkernels.core._triton import describe_choice, interpreting, on_device, registered_op, require, tl, triton
from pathkernels.core._triton import jit as _jit

OP_NAME = "pathkernels::triton_statistics_update"
MEASURES = 3  # ratio, residual, norm (statistics._MEASURES)
HISTOGRAMS = 2  # ratio, residual (statistics._HISTOGRAMS)
# Partial fields per (b, program, length). float64: the log10 sum, then per measure the sum, the
# sum of squares, the minimum and the maximum. int64: the count, the zero norms, then per measure
# the first leaf of the minimum and of the maximum.
F64_FIELDS = 1 + 4 * MEASURES
I64_FIELDS = 2 + 2 * MEASURES
NO_LEAF = 2**31 - 1  # "no leaf" inside the kernels (leaf indices are int32 there)
MAX_LEAVES = NO_LEAF  # leaves per chunk
MAX_SLOTS = 128  # path lengths 0..127: the one-hot masks are [BLOCK, S_P2]
MERGE_BLOCK = 16  # partials reduced at once by the merge kernel
HISTOGRAM_BLOCK = 1024  # histogram bins added at once by the merge kernel
INTERPRETER_SMS = 2  # the "SMs" of the interpreter (CPU: no device to ask)
PROGRAMS_PER_SM = 4
_CONFIG_SPACE_ENV = "PATHKERNELS_TRITON_STATISTICS_CONFIGS"
_LOG10_E = 0.43429448190325176  # 1 / ln 10 (the kernels repeat this literal)

# Whether this module's kernels were decorated under the interpreter (fixed at import, as Triton does).
INTERPRETED = triton is not None and interpreting()


# Device helpers. They call none of Triton's own @jit helpers (tl.sum, tl.min, tl.zeros), whose
# interpreted or compiled form is fixed when triton is imported, so that TRITON_INTERPRET need be
# set only when this module is (as in triton_leaf.py and triton_norms.py): reductions are tl.reduce
# with Triton's own combine functions, which the interpreter still reduces with numpy.


@_jit
def _sum(x, axis: tl.constexpr):
    """tl.sum along axis (a tree in a fixed order for a given config)."""
    return tl.reduce(x, axis, tl.standard._sum_combine)


@_jit
def _min(x, axis: tl.constexpr):
    """The smallest entry along axis (the values reduced here are never NaN)."""
    return tl.reduce(x, axis, tl.standard._elementwise_min)


@_jit
def _slot_sum(value, in_slot):
    """``[S_P2]``: the sum of ``value [BLOCK]`` over the leaves of each length (``in_slot`` one-hot)."""
    return _sum(tl.where(in_slot, value[:, None], 0.0), axis=0)


@_jit
def _lexicographic_min(value, leaf, best, best_leaf):
    """The smaller pair (value, leaf) of ``(value, leaf)`` and ``(best, best_leaf)``, elementwise."""
    smaller = (value < best) | ((value == best) & (leaf < best_leaf))
    return tl.where(smaller, value, best), tl.where(smaller, leaf, best_leaf)


@_jit
def _tile_min(value, ok, leaf):
    """``[S_P2]`` per length: the smallest ``value [BLOCK]`` among the leaves ``ok [BLOCK, S_P2]``
    marks (inf if none) and the first leaf holding it (NO_LEAF if none)."""
    values = tl.where(ok, value[:, None], float("inf"))
    smallest = _min(values, axis=0)
    holders = ok & (values == smallest[None, :])
    first = _min(tl.where(holders, leaf[:, None], 2147483647), axis=0)  # NO_LEAF
    return smallest, first


@_jit
def _carry_min(value, ok, leaf, best, best_leaf):
    """The running minimum per length and its first leaf, with one more tile folded in."""
    smallest, first = _tile_min(value, ok, leaf)
    return _lexicographic_min(smallest, first, best, best_leaf)


@_jit
def _bin_of(value, edges_ptr, num_edges, EDGE_STEPS: tl.constexpr):
    """torch.bucketize(value, edges, right=True): the number of edges ≤ value (NaN: all of them),
    by binary lifting over the ascending edges; ``2**EDGE_STEPS > num_edges``."""
    position = tl.full(value.shape, 0, dtype=tl.int32)
    for step in tl.static_range(EDGE_STEPS):
        candidate = position + (1 << (EDGE_STEPS - 1 - step))
        inside = candidate <= num_edges
        edge = tl.load(edges_ptr + candidate - 1, mask=inside, other=0.0)
        position = tl.where(inside & (edge <= value), candidate, position)
    return tl.where(value != value, num_edges, position)


@_jit
def _fold_chunk_kernel(
    residual_ptr,  # [B, c] float64
    norm_ptr,  # [B, c] float64
    lengths_ptr,  # [c] int64, in [0, S)
    edges_ptr,  # [E] float64, ascending
    partial_f64_ptr,  # [B, P, F64_FIELDS, S_P2] float64, written
    partial_i64_ptr,  # [B, P, I64_FIELDS, S_P2] int64, written
    scratch_ptr,  # [2, B, S, E + 1] int64, zero before the launch, counted into
    count,  # c
    num_slots,  # S = L + 1
    num_edges,  # E
    span,  # leaves per program, a multiple of every BLOCK
    S_P2: tl.constexpr,
    EDGE_STEPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    program = tl.program_id(0)
    b = tl.program_id(1)
    programs = tl.num_programs(0)
    batch = tl.num_programs(1)
    slots = tl.arange(0, S_P2)
    zero = tl.full([S_P2], 0.0, dtype=tl.float64)
    no_leaf = tl.full([S_P2], 2147483647, dtype=tl.int32)  # NO_LEAF
    counts = tl.full([S_P2], 0, dtype=tl.int64)
    zero_norms = tl.full([S_P2], 0, dtype=tl.int64)
    log_sum = zero
    sum_ratio, sum_residual, sum_norm = zero, zero, zero
    square_ratio, square_residual, square_norm = zero, zero, zero
    # Minima of v and of -v (the maxima), each with its first leaf.
    low_ratio, low_residual, low_norm = zero + float("inf"), zero + float("inf"), zero + float("inf")
    high_ratio, high_residual, high_norm = zero + float("inf"), zero + float("inf"), zero + float("inf")
    low_ratio_leaf, low_residual_leaf, low_norm_leaf = no_leaf, no_leaf, no_leaf
    high_ratio_leaf, high_residual_leaf, high_norm_leaf = no_leaf, no_leaf, no_leaf
    row = b.to(tl.int64) * count
    start = program * span
    stop = tl.minimum(start + span, count)
    bins = num_edges + 1
    for tile in range(start, stop, BLOCK):
        leaf = tile + tl.arange(0, BLOCK)
        valid = leaf < stop
        residual = tl.load(residual_ptr + row + leaf, mask=valid, other=0.0)
        norm = tl.load(norm_ptr + row + leaf, mask=valid, other=1.0)
        length = tl.load(lengths_ptr + leaf, mask=valid, other=-1).to(tl.int32)
        in_slot = (length[:, None] == slots[None, :]) & valid[:, None]  # [BLOCK, S_P2], one-hot
        has_ratio = norm != 0.0
        ratio = residual / norm  # NaN for 0/0: a zero path, left out of the ratio's statistics
        summed_ratio = tl.where(has_ratio, ratio, 0.0)
        counts += _sum(in_slot.to(tl.int64), axis=0)
        zero_norms += _sum((in_slot & (norm == 0.0)[:, None]).to(tl.int64), axis=0)
        positive = tl.where(summed_ratio == 0.0, 1.0, summed_ratio)  # log10 only where it is kept
        log_ratio = tl.where(summed_ratio == 0.0, 0.0, tl.log(positive) * 0.43429448190325176)  # _LOG10_E
        log_sum += _slot_sum(log_ratio, in_slot)
        sum_ratio += _slot_sum(summed_ratio, in_slot)
        square_ratio += _slot_sum(summed_ratio * summed_ratio, in_slot)
        sum_residual += _slot_sum(residual, in_slot)
        square_residual += _slot_sum(residual * residual, in_slot)
        sum_norm += _slot_sum(norm, in_slot)
        square_norm += _slot_sum(norm * norm, in_slot)
        # Extremes over the numbers: NaN never is one, nor a zero path's ratio.
        ratio_ok = in_slot & (has_ratio & (ratio == ratio))[:, None]
        residual_ok = in_slot & (residual == residual)[:, None]
        norm_ok = in_slot & (norm == norm)[:, None]
        low_ratio, low_ratio_leaf = _carry_min(ratio, ratio_ok, leaf, low_ratio, low_ratio_leaf)
        high_ratio, high_ratio_leaf = _carry_min(-ratio, ratio_ok, leaf, high_ratio, high_ratio_leaf)
        low_residual, low_residual_leaf = _carry_min(residual, residual_ok, leaf, low_residual, low_residual_leaf)
        high_residual, high_residual_leaf = _carry_min(-residual, residual_ok, leaf, high_residual, high_residual_leaf)
        low_norm, low_norm_leaf = _carry_min(norm, norm_ok, leaf, low_norm, low_norm_leaf)
        high_norm, high_norm_leaf = _carry_min(-norm, norm_ok, leaf, high_norm, high_norm_leaf)
        # Histograms, exact in any order. A zero path has no ratio to count.
        counted = valid & (length >= 0) & (length < num_slots)
        ratio_row = ((0 * batch + b) * num_slots + length).to(tl.int64) * bins
        residual_row = ((1 * batch + b) * num_slots + length).to(tl.int64) * bins
        ratio_bin = _bin_of(ratio, edges_ptr, num_edges, EDGE_STEPS)
        residual_bin = _bin_of(residual, edges_ptr, num_edges, EDGE_STEPS)
        one = tl.full([BLOCK], 1, dtype=tl.int64)
        tl.atomic_add(scratch_ptr + ratio_row + ratio_bin, one, mask=counted & has_ratio, sem="relaxed")
        tl.atomic_add(scratch_ptr + residual_row + residual_bin, one, mask=counted, sem="relaxed")
    at = (b * programs + program).to(tl.int64) * (13 * S_P2) + slots  # F64_FIELDS
    tl.store(partial_f64_ptr + at + 0 * S_P2, log_sum)
    tl.store(partial_f64_ptr + at + 1 * S_P2, sum_ratio)
    tl.store(partial_f64_ptr + at + 2 * S_P2, sum_residual)
    tl.store(partial_f64_ptr + at + 3 * S_P2, sum_norm)
    tl.store(partial_f64_ptr + at + 4 * S_P2, square_ratio)
    tl.store(partial_f64_ptr + at + 5 * S_P2, square_residual)
    tl.store(partial_f64_ptr + at + 6 * S_P2, square_norm)
    tl.store(partial_f64_ptr + at + 7 * S_P2, low_ratio)
    tl.store(partial_f64_ptr + at + 8 * S_P2, low_residual)
    tl.store(partial_f64_ptr + at + 9 * S_P2, low_norm)
    tl.store(partial_f64_ptr + at + 10 * S_P2, -high_ratio)
    tl.store(partial_f64_ptr + at + 11 * S_P2, -high_residual)
    tl.store(partial_f64_ptr + at + 12 * S_P2, -high_norm)
    at = (b * programs + program).to(tl.int64) * (8 * S_P2) + slots  # I64_FIELDS
    tl.store(partial_i64_ptr + at + 0 * S_P2, counts)
    tl.store(partial_i64_ptr + at + 1 * S_P2, zero_norms)
    tl.store(partial_i64_ptr + at + 2 * S_P2, low_ratio_leaf.to(tl.int64))
    tl.store(partial_i64_ptr + at + 3 * S_P2, low_residual_leaf.to(tl.int64))
    tl.store(partial_i64_ptr + at + 4 * S_P2, low_norm_leaf.to(tl.int64))
    tl.store(partial_i64_ptr + at + 5 * S_P2, high_ratio_leaf.to(tl.int64))
    tl.store(partial_i64_ptr + at + 6 * S_P2, high_residual_leaf.to(tl.int64))
    tl.store(partial_i64_ptr + at + 7 * S_P2, high_norm_leaf.to(tl.int64))


@_jit
def _field_rows(
    partial_ptr,
    b,
    first,
    programs,
    FIELD: tl.constexpr,
    FIELDS: tl.constexpr,
    S_P2: tl.constexpr,
    MERGE: tl.constexpr,
    other,
):
    """Field FIELD of partials ``first .. first + MERGE - 1`` of batch element b: ``[MERGE, S_P2]``,
    ``other`` past the last program; and which rows are programs."""
    rows = first + tl.arange(0, MERGE)
    at = ((b * programs + rows).to(tl.int64) * FIELDS + FIELD) * S_P2
    ok = rows < programs
    values = tl.load(partial_ptr + at[:, None] + tl.arange(0, S_P2)[None, :], mask=ok[:, None], other=other)
    return values, ok


@_jit
def _sum_field(
    partial_ptr,
    b,
    programs,
    FIELD: tl.constexpr,
    FIELDS: tl.constexpr,
    S_P2: tl.constexpr,
    MERGE: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """``[S_P2]``: field FIELD summed over every program's partial, in program order, MERGE at a time."""
    total = tl.full([S_P2], 0, dtype=DTYPE)
    for first in range(0, programs, MERGE):
        values, _ = _field_rows(partial_ptr, b, first, programs, FIELD, FIELDS, S_P2, MERGE, 0)
        total += _sum(values, axis=0)
    return total


@_jit
def _merge_extreme(
    partial_f64_ptr,
    partial_i64_ptr,
    b,
    programs,
    accumulator_ptr,
    first_ptr,
    at,
    in_range,
    VALUE_FIELD: tl.constexpr,
    LEAF_FIELD: tl.constexpr,
    IS_MAX: tl.constexpr,
    S_P2: tl.constexpr,
    MERGE: tl.constexpr,
):
    """The chunk's extreme per length over every program's partial, with its first leaf (the
    smallest (value, leaf) pair of the signed values); merged into the accumulator where strictly
    beyond it, its leaf written to ``first`` there, -1 elsewhere."""
    sign = -1.0 if IS_MAX else 1.0
    best = tl.full([S_P2], float("inf"), dtype=tl.float64)
    best_leaf = tl.full([S_P2], 2147483647, dtype=tl.int64)  # NO_LEAF
    for first in range(0, programs, MERGE):
        # A partial with no number holds +inf (a minimum) or -inf (a maximum): signed, +inf.
        values, ok = _field_rows(partial_f64_ptr, b, first, programs, VALUE_FIELD, 13, S_P2, MERGE, sign * float("inf"))
        values = sign * values
        leaves, _ = _field_rows(partial_i64_ptr, b, first, programs, LEAF_FIELD, 8, S_P2, MERGE, 2147483647)
        smallest = _min(values, axis=0)
        first_leaf = _min(tl.where(values == smallest[None, :], leaves, 2147483647), axis=0)
        best, best_leaf = _lexicographic_min(smallest, first_leaf, best, best_leaf)
    value = sign * best
    current = tl.load(accumulator_ptr + at, mask=in_range, other=0.0)
    if IS_MAX:
        beyond = value > current
    else:
        beyond = value < current
    beyond = beyond & (best_leaf != 2147483647)  # NO_LEAF
    tl.store(accumulator_ptr + at, tl.where(beyond, value, current), mask=in_range)
    tl.store(first_ptr + at, tl.where(beyond, best_leaf, -1), mask=in_range)


@_jit
def _merge_kernel(
    partial_f64_ptr,  # [B, P, F64_FIELDS, S_P2] float64
    partial_i64_ptr,  # [B, P, I64_FIELDS, S_P2] int64
    scratch_ptr,  # [2, B, S, E + 1] int64
    counts_ptr,  # [B, S] int64
    zero_norms_ptr,  # [B, S] int64
    log_sums_ptr,  # [B, S] float64
    sums_ptr,  # [3, B, S] float64
    squares_ptr,  # [3, B, S] float64
    minima_ptr,  # [3, B, S] float64
    maxima_ptr,  # [3, B, S] float64
    histograms_ptr,  # [2, B, S, E + 1] int64
    first_ptr,  # [2, 3, B, S] int64, written: the first leaf of a new minimum / maximum, or -1
    programs,  # P
    num_slots,  # S
    num_edges,  # E
    S_P2: tl.constexpr,
    MERGE: tl.constexpr,
    HISTOGRAM: tl.constexpr,
):
    b = tl.program_id(0)
    batch = tl.num_programs(0)
    slots = tl.arange(0, S_P2)
    in_range = slots < num_slots
    at = b * num_slots + slots  # [B, S] accumulators
    plane = batch * num_slots  # one measure's [B, S]
    counts = _sum_field(partial_i64_ptr, b, programs, 0, 8, S_P2, MERGE, tl.int64)
    tl.store(counts_ptr + at, tl.load(counts_ptr + at, mask=in_range) + counts, mask=in_range)
    zero_norms = _sum_field(partial_i64_ptr, b, programs, 1, 8, S_P2, MERGE, tl.int64)
    tl.store(zero_norms_ptr + at, tl.load(zero_norms_ptr + at, mask=in_range) + zero_norms, mask=in_range)
    log_sums = _sum_field(partial_f64_ptr, b, programs, 0, 13, S_P2, MERGE, tl.float64)
    tl.store(log_sums_ptr + at, tl.load(log_sums_ptr + at, mask=in_range) + log_sums, mask=in_range)
    for m in tl.static_range(3):  # MEASURES: ratio, residual, norm
        sums = _sum_field(partial_f64_ptr, b, programs, 1 + m, 13, S_P2, MERGE, tl.float64)
        tl.store(sums_ptr + m * plane + at, tl.load(sums_ptr + m * plane + at, mask=in_range) + sums, mask=in_range)
        squares = _sum_field(partial_f64_ptr, b, programs, 4 + m, 13, S_P2, MERGE, tl.float64)
        square_at = squares_ptr + m * plane + at
        tl.store(square_at, tl.load(square_at, mask=in_range) + squares, mask=in_range)
        _merge_extreme(
            partial_f64_ptr,
            partial_i64_ptr,
            b,
            programs,
            minima_ptr + m * plane,
            first_ptr + m * plane,
            at,
            in_range,
            7 + m,
            2 + m,
            False,
            S_P2,
            MERGE,
        )
        _merge_extreme(
            partial_f64_ptr,
            partial_i64_ptr,
            b,
            programs,
            maxima_ptr + m * plane,
            first_ptr + (3 + m) * plane,
            at,
            in_range,
            10 + m,
            5 + m,
            True,
            S_P2,
            MERGE,
        )
    # The chunk's histogram counts: this b's [S, E + 1] rows of each histogram, contiguous.
    row_length = num_slots * (num_edges + 1)
    for h in tl.static_range(2):  # HISTOGRAMS: ratio, residual
        base = (h * batch + b).to(tl.int64) * row_length
        for first in range(0, row_length, HISTOGRAM):
            bins = first + tl.arange(0, HISTOGRAM)
            ok = bins < row_length
            added = tl.load(scratch_ptr + base + bins, mask=ok, other=0)
            kept = tl.load(histograms_ptr + base + bins, mask=ok, other=0)
            tl.store(histograms_ptr + base + bins, kept + added, mask=ok)


# --- host side ---------------------------------------------------------------------------------


class StatisticsConfig:
    """One launch configuration of the fold kernel: leaves per tile, warps."""

    def __init__(self, block: int, num_warps: int):
        self.block, self.num_warps = block, num_warps

    def __repr__(self) -> str:
        return f"StatisticsConfig(block={self.block}, num_warps={self.num_warps})"


DEFAULT_CONFIG = StatisticsConfig(block=256, num_warps=4)
MAX_BLOCK = 512  # a program's span is a multiple of it, so of every config's BLOCK
CONFIG_SPACES = {
    "full": [StatisticsConfig(block, warps) for block in (128, 256, 512) for warps in (4, 8)],
    "default": [DEFAULT_CONFIG],
}


def _autotuner(space: str):
    """The fold kernel autotuned over CONFIG_SPACES[space], keyed by the lengths and the edges. Each
    trial counts into the scratch histogram, which is zeroed before each and after the last."""
    if space not in _TUNERS:
        configs = [triton.Config({"BLOCK": c.block}, num_warps=c.num_warps, num_stages=1) for c in CONFIG_SPACES[space]]
        _TUNERS[space] = triton.autotune(configs, key=["S_P2", "EDGE_STEPS"], reset_to_zero=["scratch_ptr"])(
            _fold_chunk_kernel
        )
    return _TUNERS[space]


_TUNERS: dict = {}


def config_space() -> str:
    """The autotuner's space, from PATHKERNELS_TRITON_STATISTICS_CONFIGS ("full" when unset)."""
    return _config_space(_CONFIG_SPACE_ENV, CONFIG_SPACES, "pathkernels.triton_statistics_update")


def chosen_config() -> dict | None:
    """The fold kernel's last autotuned choice and every config's time (bench/), or None."""
    return describe_choice(_TUNERS.get(config_space()))


def require_triton() -> None:
    require("pathkernels.triton_statistics_update")


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check(
    residual,
    norm,
    lengths,
    edges,
    counts,
    zero_norms,
    log10_ratio_sums,
    sums,
    sums_of_squares,
    minima,
    maxima,
    histograms,
) -> None:
    """Shapes, dtypes, devices and layouts (no value is read: no host synchronisation)."""
    op = "pathkernels.triton_statistics_update"
    if not isinstance(residual, Tensor) or residual.dim() != 2:
        raise ValueError(f"{op}: expected residual [B, c], got {_shape(residual)}")
    batch, count = residual.shape
    if not isinstance(counts, Tensor) or counts.dim() != 2 or counts.shape[0] != batch:
        raise ValueError(f"{op}: expected counts [B, L+1] with B = {batch}, got {_shape(counts)}")
    levels = counts.shape[1]
    if not 1 <= levels <= MAX_SLOTS:
        raise ValueError(f"{op}: expected at most {MAX_SLOTS - 1} layers (counts [B, L+1]), got L = {levels - 1}")
    if count > MAX_LEAVES:
        raise ValueError(f"{op}: expected at most {MAX_LEAVES:,} leaves in a chunk, got {count:,}")
    if not isinstance(edges, Tensor) or edges.dim() != 1:
        raise ValueError(f"{op}: expected edges [E], got {_shape(edges)}")
    bins = edges.numel() + 1
    expected = {
        "residual": (residual, torch.float64, (batch, count)),
        "norm": (norm, torch.float64, (batch, count)),
        "lengths": (lengths, torch.int64, (count,)),
        "edges": (edges, torch.float64, (bins - 1,)),
        "counts": (counts, torch.int64, (batch, levels)),
        "zero_norms": (zero_norms, torch.int64, (batch, levels)),
        "log10_ratio_sums": (log10_ratio_sums, torch.float64, (batch, levels)),
        "sums": (sums, torch.float64, (MEASURES, batch, levels)),
        "sums_of_squares": (sums_of_squares, torch.float64, (MEASURES, batch, levels)),
        "minima": (minima, torch.float64, (MEASURES, batch, levels)),
        "maxima": (maxima, torch.float64, (MEASURES, batch, levels)),
        "histograms": (histograms, torch.int64, (HISTOGRAMS, batch, levels, bins)),
    }
    device = residual.device
    for name, (tensor, dtype, shape) in expected.items():
        if (
            not isinstance(tensor, Tensor)
            or tensor.dtype != dtype
            or tuple(tensor.shape) != shape
            or not tensor.is_contiguous()
            or tensor.device != device
        ):
            got = _shape(tensor) + (f" {tensor.dtype} on {tensor.device}" if isinstance(tensor, Tensor) else "")
            raise ValueError(
                f"{op}: expected {name} {list(shape)} contiguous {str(dtype).removeprefix('torch.')} on {device}, "
                f"got {got}"
            )
    if INTERPRETED and device.type != "cpu":
        raise ValueError(f"{op}: Triton's interpreter (TRITON_INTERPRET=1) runs on CPU tensors, got {device}")
    if not INTERPRETED and device.type != "cuda":
        raise ValueError(f"{op}: expected CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors), got {device}")


def _shape(value) -> str:
    return str(list(value.shape)) if isinstance(value, Tensor) else type(value).__name__


def _programs(batch: int, count: int, sms: int) -> tuple[int, int]:
    """(programs per batch element, leaves per program): about PROGRAMS_PER_SM programs per SM in
    all, each span a multiple of MAX_BLOCK."""
    wanted = max(1, -(-PROGRAMS_PER_SM * sms // batch))
    span = -(-count // wanted)
    span = max(MAX_BLOCK, -(-span // MAX_BLOCK) * MAX_BLOCK)
    return max(1, -(-count // span)), span


def _triton_statistics_update_impl(
    residual: Tensor,
    norm: Tensor,
    lengths: Tensor,
    edges: Tensor,
    counts: Tensor,
    zero_norms: Tensor,
    log10_ratio_sums: Tensor,
    sums: Tensor,
    sums_of_squares: Tensor,
    minima: Tensor,
    maxima: Tensor,
    histograms: Tensor,
) -> Tensor:
    """The op's body (registered by triton_op): checks, then the two launches on the inputs' device."""
    accumulators = (counts, zero_norms, log10_ratio_sums, sums, sums_of_squares, minima, maxima, histograms)
    _check(residual, norm, lengths, edges, *accumulators)
    batch, count = residual.shape
    levels, num_edges = counts.shape[1], edges.numel()
    first = torch.full((2, MEASURES, batch, levels), -1, dtype=torch.long, device=residual.device)
    if count == 0 or batch == 0:
        return first
    slots_p2 = triton.next_power_of_2(levels)
    edge_steps = max(1, num_edges.bit_length())
    programs, span = _programs(batch, count, _sm_count(residual.device))
    partial_f64 = residual.new_empty((batch, programs, F64_FIELDS, slots_p2))
    partial_i64 = lengths.new_empty((batch, programs, I64_FIELDS, slots_p2))
    scratch = torch.zeros_like(histograms)
    fold_args = (residual, norm, lengths, edges, partial_f64, partial_i64, scratch, count, levels, num_edges, span)
    constants = {"S_P2": slots_p2, "EDGE_STEPS": edge_steps}
    with on_device(residual.device):
        if INTERPRETED:
            config = DEFAULT_CONFIG
            torch.library.wrap_triton(_fold_chunk_kernel)[(programs, batch)](
                *fold_args, **constants, BLOCK=config.block, num_warps=config.num_warps
            )
        else:
            torch.library.wrap_triton(_autotuner(config_space()))[(programs, batch)](*fold_args, **constants)
        torch.library.wrap_triton(_merge_kernel)[(batch,)](
            partial_f64,
            partial_i64,
            scratch,
            *accumulators,
            first,
            programs,
            levels,
            num_edges,
            S_P2=slots_p2,
            MERGE=MERGE_BLOCK,
            HISTOGRAM=HISTOGRAM_BLOCK,
        )
    return first


def _triton_statistics_update_fake(residual, norm, lengths, edges, counts, *accumulators):
    """The op's fake kernel: the checks that need no data, and the empty [2, 3, B, L+1] output."""
    return counts.new_empty((2, MEASURES, *counts.shape))


def op():
    """``torch.ops.pathkernels.triton_statistics_update``, registered (torch.library.triton_op, with
    a fake kernel; the accumulators are mutated) on first use."""
    require_triton()
    mutated = ("counts", "zero_norms", "log10_ratio_sums", "sums", "sums_of_squares", "minima", "maxima", "histograms")
    return registered_op(OP_NAME, _triton_statistics_update_impl, _triton_statistics_update_fake, mutated)


def triton_statistics_update(
    residual: Tensor,
    norm: Tensor,
    lengths: Tensor,
    edges: Tensor,
    counts: Tensor,
    zero_norms: Tensor,
    log10_ratio_sums: Tensor,
    sums: Tensor,
    sums_of_squares: Tensor,
    minima: Tensor,
    maxima: Tensor,
    histograms: Tensor,
) -> Tensor:
    """Fold one chunk of leaves into path_statistics' accumulators, in place, in two launches.

    Args (B batch elements, c leaves, L + 1 path lengths, E histogram edges; contiguous, one device):
        residual, norm: ``[B, c]`` float64, the leaves' ‖res(P X W)‖ and ‖P X W‖ in leaf order.
        lengths: ``[c]`` int64 in ``[0, L]``, each leaf's path length (leaves of other values are
            not counted).
        edges: ``[E]`` float64, strictly ascending (``statistics.histogram_edges``).
        counts, zero_norms: ``[B, L+1]`` int64; log10_ratio_sums ``[B, L+1]`` float64.
        sums, sums_of_squares, minima, maxima: ``[3, B, L+1]`` float64, per measure (ratio, residual,
            norm).
        histograms: ``[2, B, L+1, E+1]`` int64 (ratio, residual), ``bin = #{edges ≤ v}``.

    Returns:
        ``[2, 3, B, L+1]`` int64: per extreme (minimum, maximum), measure, b and length, the chunk's
        first leaf whose value is strictly beyond the accumulator's before the chunk, or -1.

    The formulas are in the module's docstring. Counts, zero norms, extremes, first leaves and
    histograms equal the torch fold's (``PathStatistics._add_torch``); the float64 sums differ from
    it in their order only, which is fixed (a run repeats to the bit).
    """
    return op()(
        residual,
        norm,
        lengths,
        edges,
        counts,
        zero_norms,
        log10_ratio_sums,
        sums,
        sums_of_squares,
        minima,
        maxima,
        histograms,
    )
