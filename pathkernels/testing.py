"""Generators, devices and tolerances shared by the tests and the benchmarks."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

# One table: how close an op's output must be to the float64 reference, by the input's dtype.
# float32 accumulates in float64 inside the kernels, so only the final rounding remains.
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float64: {"rtol": 1e-12, "atol": 1e-12},
    torch.float32: {"rtol": 2e-6, "atol": 1e-6},
    torch.float16: {"rtol": 2e-3, "atol": 1e-3},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2},
}


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return TOLERANCES[dtype]


def devices() -> list[str]:
    """The devices this machine can test: CPU, plus CUDA when a GPU and CUDA kernels exist.

    ``PATHKERNELS_TEST_DEVICES=cuda`` (a comma-separated list) keeps only those of them, e.g. for a
    quick GPU check (bench/gpu_check.sh --quick) that leaves the CPU cases to CI.
    """
    import os

    from pathkernels.core._extension import has_cuda_kernels

    found = ["cpu"]
    if torch.cuda.is_available() and has_cuda_kernels():
        found.append("cuda")
    wanted = os.environ.get("PATHKERNELS_TEST_DEVICES")
    if wanted:
        found = [device for device in found if device in {w.strip() for w in wanted.split(",")}]
    return found


@contextlib.contextmanager
def num_threads(count: int) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(count)``, restoring the previous count after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def cpu_kernel_isas() -> list[str]:
    """The CPU kernels' instruction sets this CPU and build run, widest first, of "avx512", "avx2" and
    "portable": those the engine's GEMM (``_engine_mm``'s ``isa``) and its leaf reduction
    (``PATHKERNELS_ENGINE_REDUCTION_ISA``) accept, which share one check."""
    from pathkernels.core import ops  # noqa: F401  (registers the ops)

    found = []
    for isa in ("avx512", "avx2", "portable"):
        try:
            torch.ops.pathkernels._engine_mm(torch.ones(1, 1), torch.ones(1, 1), isa)
        except ValueError:
            continue
        found.append(isa)
    return found


def has_tensor_cores(device) -> bool:
    """Whether the tensor-core leaf kernels (``leaf_kernel="tensor"``) can run on ``device``: a CUDA
    device of compute capability 8.0 or later. On the CPU the engine ignores the choice (True)."""
    device = torch.device(device)
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 8


def random_matrices(*shape: int, dtype=torch.float32, device="cpu", generator=None) -> Tensor:
    """Standard normal entries: ``shape`` is ``(..., n, m)``."""
    return torch.randn(*shape, generator=generator, dtype=torch.float64).to(device=device, dtype=dtype)


def random_attention(*shape: int, dtype=torch.float32, device="cpu", generator=None, temperature=1.0) -> Tensor:
    """Row-stochastic ``[..., n, n]`` matrices: softmax of Gaussian scores (rows sum to 1)."""
    scores = torch.randn(*shape, generator=generator, dtype=torch.float64) / temperature
    return scores.softmax(dim=-1).to(device=device, dtype=dtype)


def padded_network(lengths: list[int], layers: int, heads: int, n: int, d: int, d_head: int = 2):
    """A hand-padded batch, float64: ``attn [B, L, H, n, n]`` whose block of real tokens is
    row-stochastic for each sequence (its first ``lengths[b]`` tokens) and whose padded entries
    are junk, ``x [B, n, d]``, ``w_v``/``w_o`` and the ``token_mask [B, n]`` (bool)."""
    batch = len(lengths)
    attn = torch.rand(batch, layers, heads, n, n, dtype=torch.float64)
    x = torch.randn(batch, n, d, dtype=torch.float64)
    w_v = torch.randn(layers, heads, d, d_head, dtype=torch.float64)
    w_o = torch.randn(layers, heads, d_head, d, dtype=torch.float64)
    mask = torch.zeros(batch, n, dtype=torch.bool)
    for b, length in enumerate(lengths):
        mask[b, :length] = True
        attn[b, ..., :length] = random_attention(layers, heads, n, length, dtype=torch.float64)
        attn[b, ..., :length, length:] = 0
    return attn, x, w_v, w_o, mask


# Unit round-off of each dtype the engine computes in.
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float64: 2.0**-53}


def path_condition_numbers(
    attn: Tensor, paths: Tensor, x: Tensor | None = None, w_v: Tensor | None = None, w_o: Tensor | None = None
) -> Tensor:
    """Condition number of each path's residual, in float64: ``[B, M]``.

    ``κ_p = ‖ |C(A_L)| ⋯ |C(A_1)| ‖_{1,∞} / ‖ C(A_L) ⋯ C(A_1) ‖_{1,∞}`` for attention products, with
    ``|C(X)| |W_p|`` (``|W_V| |W_O|`` per layer) appended for path outputs; ``|·|`` is the
    elementwise absolute value and ``C(M) = M − 1(1ᵀM)/n`` the centring. It is 1 when no
    cancellation happens and grows when the centred factors cancel each other: a product of L
    matrices over n-long sums computed in a dtype of unit round-off u has a relative error of at
    most about ``κ_p · (L + 2) · n · u`` (:func:`float32_error_bound`), and typically far less.

    Args:
        attn: ``[B, L, H, n, n]``; paths: ``[M, L]`` (``-1`` = skip); optional x ``[B, n, d]``,
            w_v ``[L, H, d, d_head]``, w_o ``[L, H, d_head, d]`` for path outputs.

    Returns:
        ``[B, M]`` float64 (inf where the residual is exactly 0).
    """
    from pathkernels.core.paths import check_paths
    from pathkernels.reference import composite_norm_ref

    paths, _ = check_paths(
        paths, "pathkernels.testing.path_condition_numbers", num_heads=attn.shape[2], num_layers=attn.shape[1]
    )
    attn = attn.double()
    centred = attn - attn.mean(-2, keepdim=True)
    batch, n = attn.shape[0], attn.shape[-1]
    if x is None:
        start = torch.eye(n, dtype=torch.float64) - 1.0 / n
        exact, bound = start.expand(batch, n, n), start.abs().expand(batch, n, n)
    else:
        x = x.double()
        exact = x - x.mean(-2, keepdim=True)
        bound = exact.abs()
    kappas = []
    for path in paths.tolist():
        product, magnitude = exact, bound
        for layer, head in enumerate(path):
            if head < 0:
                continue
            product = centred[:, layer, head] @ product
            magnitude = centred[:, layer, head].abs() @ magnitude
            if x is not None:
                w_v64, w_o64 = w_v[layer, head].double(), w_o[layer, head].double()
                product = product @ w_v64 @ w_o64
                magnitude = magnitude @ w_v64.abs() @ w_o64.abs()
        kappas.append(composite_norm_ref(magnitude) / composite_norm_ref(product))
    return torch.stack(kappas, dim=1)


def output_condition_numbers(
    attn: Tensor, paths: Tensor, x: Tensor | None = None, w_v: Tensor | None = None, w_o: Tensor | None = None
) -> Tensor:
    """Condition number of each path's norm (not its residual's: :func:`path_condition_numbers`), in
    float64: ``[B, M]``.

    ``κ_p = ‖ P_p |X| |W_p| ‖_{1,∞} / ‖ P_p X W_p ‖_{1,∞}``, uncentred (``|W_V| |W_O|`` per layer):
    1 for attention products alone (non-negative factors), and large where the output's entries
    cancel in their sums. The norm's relative error in float32 is then at most about
    :func:`float32_error_bound` of it.

    Args:
        attn: ``[B, L, H, n, n]``; paths: ``[M, L]`` (``-1`` = skip); optional x ``[B, n, d]``,
            w_v ``[L, H, d, d_head]``, w_o ``[L, H, d_head, d]`` for path outputs.
    """
    from pathkernels.reference import composite_norm_ref, path_products_ref

    maps = {name: t.double() for name, t in (("x", x), ("w_v", w_v), ("w_o", w_o)) if t is not None}
    attn = attn.double()
    exact = composite_norm_ref(path_products_ref(attn, paths, **maps))
    magnitude = composite_norm_ref(path_products_ref(attn, paths, **{k: v.abs() for k, v in maps.items()}))
    return magnitude / exact


def leaf_kernel_slack(attn: Tensor, right: Tensor, kernel: str = "simt") -> Tensor:
    """Absolute error a float32 leaf kernel's product ``C(A) right_k`` may carry into its norms,
    per leaf: the dot-product bound ``γ_n = n·2⁻²⁴`` times the largest column or row sum of
    ``|C(A)| |right_k|``, ×4 for the composite's geometric mean. It matters where ``1μᵀ + R``
    cancels. One TF32 pass (``"tf32"``) first rounds both operands to 11 significant bits: ``2·2⁻¹¹``
    more per product; 3×TF32 (``"tf32x3"``) drops ``lo·lo`` and rounds ``lo``: ``3·2⁻²²`` more."""
    magnitude = torch.einsum("ik,kcj->cij", attn.double().abs().cpu(), right.double().abs().cpu())
    largest_sum = torch.maximum(magnitude.sum(-2).amax(-1), magnitude.sum(-1).amax(-1))
    extra = {"simt": 0.0, "tf32x3": 3 * 2.0**-22, "tf32": 2.0**-10}[kernel]
    return 4 * (attn.shape[0] * 2.0**-24 + extra) * largest_sum


def float32_error_bound(kappa: Tensor, num_layers: int, n: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """A worst-case relative error of the engine's residuals: ``κ · (L + 2) · n · u``.

    ``u`` is the unit round-off of ``dtype`` (2^-24 for float32). Where it is well below the
    accuracy you need, float32 suffices; otherwise compute in float64.
    """
    return kappa * (num_layers + 2) * n * UNIT_ROUNDOFF[dtype]


def transformer_lens_major() -> int | None:
    """The installed TransformerLens's major version (3 or 4), or None when it is not installed."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        import transformer_lens
    except ImportError:
        return None
    try:
        return int(version("transformer-lens").split(".")[0])
    except PackageNotFoundError:  # a source tree on the path: 4.x removed HookedTransformer
        return 3 if "HookedTransformer" in dir(transformer_lens) else 4


def transformer_lens_attention_only(
    *, n_layers=3, n_heads=4, d_model=16, d_head=4, n_ctx=8, d_vocab=20, dtype=torch.float64, **overrides
):
    """A randomly initialised attention-only TransformerLens model without normalisation, as users
    of the installed version hold one: a ``HookedTransformer`` on 3.x, and on 4.x (which removed
    it) a ``TransformerBridge`` over its native model (``TransformerBridge.boot_native``).
    ``overrides`` are further config fields (e.g. ``n_key_value_heads``)."""
    config = {
        "n_layers": n_layers,
        "n_heads": n_heads,
        "d_model": d_model,
        "d_head": d_head,
        "n_ctx": n_ctx,
        "d_vocab": d_vocab,
        "attn_only": True,
        "normalization_type": None,
        "act_fn": None,
        "dtype": dtype,
        **overrides,
    }
    if transformer_lens_major() == 3:
        from transformer_lens import HookedTransformer, HookedTransformerConfig

        return HookedTransformer(HookedTransformerConfig(**config))
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    return TransformerBridge.boot_native(TransformerBridgeConfig(**config), dtype=dtype)


def statistics_difference(a, b) -> dict:
    """How two :class:`~pathkernels.PathStatistics` of the same paths differ: whether their counts,
    zero norms, histograms, extremes and the extremes' paths are equal (``"equal"``: all of them,
    ``"unequal"``: the names of those that are not), and the largest relative difference of their
    float64 sums and log sums (``"max_relative_sums"``; inf and NaN count as equal where both have
    them). Two folds of the same chunks differ only in the order of the sums."""
    exact, sums = [], 0.0
    for name in ("counts", "zero_norms", "histograms", "minima", "maxima", "argmin", "argmax"):
        mine, theirs = getattr(a, name), getattr(b, name)
        pairs = [(mine, theirs)] if isinstance(mine, Tensor) else [(mine[k], theirs[k]) for k in mine]
        if not all(torch.equal(x.cpu(), y.cpu()) for x, y in pairs):
            exact.append(name)
    for name in ("log10_ratio_sums", "sums", "sums_of_squares"):
        mine, theirs = getattr(a, name), getattr(b, name)
        for x, y in [(mine, theirs)] if isinstance(mine, Tensor) else [(mine[k], theirs[k]) for k in mine]:
            x, y = x.double().cpu(), y.double().cpu()
            finite = x.isfinite() & y.isfinite()
            if not torch.equal(x[~finite].nan_to_num(), y[~finite].nan_to_num()):
                exact.append(name)
            if bool(finite.any()):
                relative = (x[finite] - y[finite]).abs() / y[finite].abs().clamp_min(torch.finfo(torch.float64).tiny)
                sums = max(sums, float(relative.max()))
    return {"equal": not exact, "unequal": sorted(set(exact)), "max_relative_sums": sums}
