"""The heads leaf kernel (`_heads_leaf_norms`): the leaves of a block of parents under every head in
one launch, their column means from the centring identity. On the CPU its per-thread code runs
thread by thread (csrc/paths/heads_leaf_cpu.cpp), on CUDA as the kernel; both against
`_fused_leaf_norms` called head by head, an independent float64 reference and hand-worked values."""

import warnings

import pytest
import torch

import pathkernels as pk
from pathkernels.testing import (
    devices,
    float32_error_bound,
    has_tensor_cores,
    leaf_kernel_slack,
    output_condition_numbers,
    path_condition_numbers,
    random_attention,
)

heads_leaf_norms = torch.ops.pathkernels._heads_leaf_norms
fused_leaf_norms = torch.ops.pathkernels._fused_leaf_norms

KERNELS = ["tf32x3", "tf32x3_128", "tf32", "tf32_128"]
# The per-head kernel with the same TF32 passes: its products are the very same bits.
PER_HEAD = {"tf32x3": "tf32x3", "tf32x3_128": "tf32x3", "tf32": "tf32", "tf32_128": "tf32"}
U = 2.0**-24

# (n, H, c, m): n = 8, 32, 64, 128 and 37 (tile rows 32/64/128, partial k-slices and m-blocks, and
# 4-byte copies where n % 4 != 0), m across the 64- and 128-column tiles (several tiles: the
# cross-CTA fold) and not a multiple of 4 (4-byte copies of right), c = 1 … 5 (blocks of two
# parents in the harness, a partial last block), one to five heads.
SHAPES = [
    (8, 3, 5, 9),
    (32, 2, 4, 64),
    (37, 3, 5, 70),
    (64, 2, 3, 150),
    (128, 3, 2, 129),
    (100, 1, 1, 257),
    (5, 5, 2, 3),
    (1, 2, 3, 4),
]


def check_tensor_cores(device):
    if not has_tensor_cores(device):
        pytest.skip("the heads leaf kernels need compute capability 8.0")


def heads_leaf_norms_ref(attn, attn_mean, right, mean, scale=None):
    """float64 on the CPU, pure PyTorch: per parent k and head h, R = s_k C(A_h) R'_k and
    μ = μ_k + s_k R'_kᵀ a_h; returns ‖R‖_{1,∞} and ‖1μᵀ + R‖_{1,∞}, each [c, H]."""
    attn, attn_mean, right, mean = (t.detach().double().cpu() for t in (attn, attn_mean, right, mean))
    s = torch.ones(right.shape[1], dtype=torch.float64) if scale is None else scale.double().cpu()
    leaves = torch.einsum("hik,kcj->chij", attn, right) * s[:, None, None, None]
    means = mean[:, None, :] + s[:, None, None] * torch.einsum("hk,kcj->chj", attn_mean, right)

    def composite(x):
        return (x.abs().sum(-2).amax(-1) * x.abs().sum(-1).amax(-1)).sqrt()

    return composite(leaves), composite(leaves + means[:, :, None, :])


def per_head(attn, attn_mean, right, mean, scale, kernel):
    """`_fused_leaf_norms` head by head, each head's leaf means computed in float64 and rounded."""
    s = torch.ones(right.shape[1], dtype=torch.float64) if scale is None else scale.double().cpu()
    residual, norm = [], []
    for h in range(attn.shape[0]):
        shift = torch.einsum("k,kcj->cj", attn_mean[h].double().cpu(), right.double().cpu())
        mean_h = (mean.double().cpu() + s[:, None] * shift).float().to(attn.device)
        r, p = fused_leaf_norms(attn[h], right, mean_h, scale, PER_HEAD[kernel])
        residual.append(r.cpu())
        norm.append(p.cpu())
    return torch.stack(residual, 1), torch.stack(norm, 1)


def slack(attn, attn_mean, right, scale, kernel):
    """Absolute error the float32 kernels may carry into the norms, [c, H]: the products' bound
    (leaf_kernel_slack, per head) and the means' float32 dot products a_hᵀR'_k (n·u times
    |a_h|ᵀ|R'_k| per column, reaching a column sum n times and a row sum once per column)."""
    s = torch.ones(right.shape[1], dtype=torch.float64) if scale is None else scale.double().cpu()
    n = attn.shape[-1]
    products = torch.stack([leaf_kernel_slack(a, right, PER_HEAD[kernel]) for a in attn], 1)
    dots = n * U * torch.einsum("hk,kcj->chj", attn_mean.double().abs().cpu(), right.double().abs().cpu())
    means = 4 * torch.maximum(n * dots.amax(-1), dots.sum(-1))
    return s[:, None] * (products + means)


def make_inputs(n, heads, count, m, device, *, stochastic=True, scaled=True):
    """C(A), a, right (a run of a level: row stride (count + 3)·m), μ and power-of-two scales."""
    if stochastic:
        attn = random_attention(heads, n, n, dtype=torch.float64)
    else:
        attn = torch.randn(heads, n, n, dtype=torch.float64)
    attn_mean = attn.mean(-2)
    centred = attn - attn_mean[:, None, :]
    level = torch.randn(n, count + 3, m)
    right = level[:, 2 : count + 2]
    mean = torch.randn(count, m)
    scale = 2.0 ** torch.randint(-40, 40, (count,), dtype=torch.float64) if scaled else None
    to = lambda t: None if t is None else t.to(device)
    return to(centred.float()), to(attn_mean.float()), to(right), to(mean), to(scale)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_against_per_head_kernel_and_float64(device, kernel, shape):
    check_tensor_cores(device)
    n, heads, count, m = shape
    attn, attn_mean, right, mean, scale = make_inputs(n, heads, count, m, device, stochastic=n != 100)
    residual, norm = heads_leaf_norms(attn, attn_mean, right, mean, scale, kernel)
    assert residual.shape == norm.shape == (count, heads) and residual.dtype == norm.dtype == torch.float64
    assert residual.device == attn.device
    # The same products as the per-head kernel, bit for bit: only the sums (float32, depth ≤ ~16,
    # against float64) and the means' float32 dot products differ (seen: ≤ 2e-7).
    for got, want in zip((residual, norm), per_head(attn, attn_mean, right, mean, scale, kernel)):
        torch.testing.assert_close(got.cpu(), want, rtol=2e-6, atol=0)
    bound = slack(attn, attn_mean, right, scale, kernel)
    for got, want in zip((residual, norm), heads_leaf_norms_ref(attn, attn_mean, right, mean, scale)):
        error = (got.cpu() - want).abs()
        assert (error <= 1e-5 * want + bound).all(), (error / want).max()


@pytest.mark.parametrize("kernel", ["tf32x3", "tf32x3_128"])
def test_scaled_parents(device, kernel):
    """R_k = scale_k R'_k: the residual is scale_k times the unscaled one, bit for bit, and the
    product 1μᵀ + R is taken at the true scale, also far outside float32's range: R negligible
    against μ (parents 0 and 4), the product R alone (parent 1: μ_k = 0), R dominating (parent 3)."""
    check_tensor_cores(device)
    n, heads, count, m = 40, 3, 5, 70
    attn, attn_mean, right, _, _ = make_inputs(n, heads, count, m, device)
    mean = torch.randn(count, m, device=device) * 1e-3
    mean[1] = 0
    scale = torch.tensor([2.0**-300, 2.0**-200, 2.0**-10, 2.0**40, 2.0**-60], dtype=torch.float64, device=device)
    residual, norm = heads_leaf_norms(attn, attn_mean, right, mean, scale, kernel)
    unscaled_residual, _ = heads_leaf_norms(attn, attn_mean, right, mean, None, kernel)
    assert torch.equal(residual, unscaled_residual * scale[:, None])
    assert residual[0].max().item() < 1e-80 and norm[1].max().item() < 1e-50
    expected_residual, expected_norm = heads_leaf_norms_ref(attn, attn_mean, right, mean, scale)
    torch.testing.assert_close(residual.cpu(), expected_residual, rtol=1e-5, atol=0)
    torch.testing.assert_close(norm.cpu(), expected_norm, rtol=1e-5, atol=0)


@pytest.mark.parametrize("kernel", KERNELS)
def test_hand_worked_leaves(device, kernel):
    # A_0 = I: C(A_0) = [[.5, -.5], [-.5, .5]], a_0 = (.5, .5); A_1 = [[1, 0], [1, 0]]: C(A_1) = 0,
    # a_1 = (1, 0). Parent R' = [[1, 2], [-1, -2]], μ = (1, 0).
    # Head 0: R = R', column sums (2, 4), row sums (3, 3): √12; μ + R'ᵀa_0 = (1, 0), 1μᵀ + R =
    #   [[2, 2], [0, -2]]: column sums (2, 4), row sums (4, 2): 4.
    # Head 1: R = 0; μ + R'ᵀa_1 = (2, 2), 1μᵀ + R = 2·11ᵀ: 4.
    check_tensor_cores(device)
    attn = torch.tensor([[[0.5, -0.5], [-0.5, 0.5]], [[0.0, 0.0], [0.0, 0.0]]], device=device)
    attn_mean = torch.tensor([[0.5, 0.5], [1.0, 0.0]], device=device)
    right = torch.tensor([[1.0, 2.0], [-1.0, -2.0]], device=device)[:, None, :]
    mean = torch.tensor([[1.0, 0.0]], device=device)
    residual, norm = heads_leaf_norms(attn, attn_mean, right, mean, None, kernel)
    assert residual.tolist() == [[12**0.5, 0.0]]
    assert norm.tolist() == [[4.0, 4.0]]


@pytest.mark.parametrize("kernel", KERNELS)
def test_tf32_split_by_hand(device, kernel):
    """right = (1 + 2⁻¹²)·I: 1 + 2⁻¹² needs 12 mantissa bits, TF32 keeps 10. 3×TF32 splits it exactly
    into hi = 1 and lo = 2⁻¹² and gets C(A) right's residual 1 + 2⁻¹² exactly; one pass rounds it to 1."""
    check_tensor_cores(device)
    attn = torch.tensor([[[0.5, -0.5], [-0.5, 0.5]]], device=device)
    right = (1 + 2.0**-12) * torch.eye(2, device=device)[:, None, :]
    zeros = torch.zeros(1, 2, device=device)
    residual, _ = heads_leaf_norms(attn, zeros, right, zeros, None, kernel)
    assert residual.item() == (1.0 if kernel.startswith("tf32_") or kernel == "tf32" else 1 + 2.0**-12)


@pytest.mark.parametrize("kernel", ["tf32x3", "tf32_128"])
def test_leaves_do_not_depend_on_layout_or_blocking(device, kernel):
    """A leaf's bits depend on its own operands only: not on the other parents in its block, nor on
    the copy width (16-byte cp.async for aligned operands, 4-byte otherwise)."""
    check_tensor_cores(device)
    n, heads, count, m = 32, 3, 5, 200
    attn, attn_mean, right, mean, scale = make_inputs(n, heads, count, m, device)
    together = heads_leaf_norms(attn, attn_mean, right, mean, scale, kernel)
    for k in range(count):
        alone = heads_leaf_norms(attn, attn_mean, right[:, k : k + 1], mean[k : k + 1], scale[k : k + 1], kernel)
        for a, b in zip(alone, together):
            assert torch.equal(a[0], b[k])
    # The same values one float past a 16-byte boundary: every copy of right in 4 bytes.
    storage = torch.empty(n * count * m + 1, device=device)
    shifted = storage[1:].view(n, count, m)
    shifted.copy_(right)
    assert shifted.data_ptr() % 16 != 0 and right.data_ptr() % 16 == 0
    for a, b in zip(heads_leaf_norms(attn, attn_mean, shifted, mean, scale, kernel), together):
        assert torch.equal(a, b)


def test_empty_and_non_contiguous_inputs(device):
    check_tensor_cores(device)
    attn, attn_mean, right, mean, scale = make_inputs(16, 3, 4, 20, device)
    residual, norm = heads_leaf_norms(attn, attn_mean, right[:, :0], mean[:0], scale[:0])
    assert residual.shape == norm.shape == (0, 3)
    residual, norm = heads_leaf_norms(attn[:0], attn_mean[:0], right, mean, scale)
    assert residual.shape == norm.shape == (4, 0)
    # attn transposed in memory, right with column stride 3, mean with column stride 2.
    attn_t = attn.transpose(1, 2).contiguous().transpose(1, 2)
    right_strided = torch.empty(16, 4, 20 * 3, device=device)[..., ::3]
    right_strided.copy_(right)
    mean_strided = torch.empty(4, 40, device=device)[:, ::2]
    mean_strided.copy_(mean)
    assert not attn_t.is_contiguous() and right_strided.stride(2) == 3 and mean_strided.stride(1) == 2
    expected = heads_leaf_norms(attn, attn_mean, right.contiguous(), mean, scale)
    for a, b in zip(heads_leaf_norms(attn_t, attn_mean, right_strided, mean_strided, scale), expected):
        assert torch.equal(a, b)


def bad_cases():
    attn, attn_mean, right, mean = torch.zeros(2, 4, 4), torch.zeros(2, 4), torch.zeros(4, 3, 5), torch.zeros(3, 5)
    good = {"attn": attn, "attn_mean": attn_mean, "right": right, "mean": mean, "scale": None, "kernel": "tf32x3"}
    cases = [
        (
            {"attn": torch.zeros(2, 129, 129), "attn_mean": torch.zeros(2, 129), "right": torch.zeros(129, 3, 5)},
            ValueError,
            r"expected 1 <= n <= 128 rows, got n = 129",
        ),
        ({"attn": torch.zeros(2, 4, 5)}, ValueError, r"expected attn \[H, n, n\], got shape \[2, 4, 5\]"),
        ({"attn": torch.zeros(4, 4)}, ValueError, r"expected attn \[H, n, n\], got shape \[4, 4\]"),
        (
            {
                "attn": torch.zeros(2**20 + 1, 1, 1),
                "attn_mean": torch.zeros(2**20 + 1, 1),
                "right": torch.zeros(1, 3, 5),
            },
            ValueError,
            r"expected at most 1048576 heads, got H = 1048577",
        ),
        ({"attn_mean": torch.zeros(3, 4)}, ValueError, r"expected attn_mean \[H, n\] = \[2, 4\], got \[3, 4\]"),
        ({"right": torch.zeros(5, 3, 5)}, ValueError, r"expected right \[n, c, m\] with n = 4 and m >= 1"),
        (
            {"right": torch.zeros(4, 3, 0), "mean": torch.zeros(3, 0)},
            ValueError,
            r"expected right \[n, c, m\] with n = 4 and m >= 1, got shape \[4, 3, 0\]",
        ),
        ({"mean": torch.zeros(5, 3)}, ValueError, r"expected mean \[c, m\] = \[3, 5\], got \[5, 3\]"),
        (
            {"attn": attn.double(), "attn_mean": attn_mean.double(), "right": right.double(), "mean": mean.double()},
            TypeError,
            r"expected attn in torch.float32 \(the kernels run on TF32 tensor cores\), got torch.float64",
        ),
        (
            {"right": right.double()},
            TypeError,
            r"expected attn_mean, right and mean in torch.float32, got torch.float64",
        ),
        ({"scale": torch.ones(2, dtype=torch.float64)}, ValueError, r"expected scale \[c\] = \[3\], got \[2\]"),
        ({"scale": torch.ones(3)}, TypeError, r"expected scale in torch.float64, got torch.float32"),
        (
            {"scale": torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)},
            ValueError,
            r"expected every scale to be a positive finite number",
        ),
        (
            {"kernel": "simt"},
            ValueError,
            r"expected kernel in \('tf32x3', 'tf32x3_128', 'tf32', 'tf32_128'\), got 'simt'",
        ),
    ]
    return [({**good, **change}, error, message) for change, error, message in cases]


@pytest.mark.parametrize(("args", "error", "message"), bad_cases())
def test_bad_input(device, args, error, message):
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with pytest.raises(error, match=rf"^pathkernels\._heads_leaf_norms: {message}"):
        heads_leaf_norms(*args.values())


@pytest.mark.skipif("cuda" not in devices(), reason="needs a GPU and the CUDA kernels")
def test_mixed_devices():
    attn, attn_mean, right, mean, _ = make_inputs(8, 2, 3, 5, "cuda")
    with pytest.raises(ValueError, match=r"_heads_leaf_norms: expected attn_mean, right and mean and attn on the same"):
        heads_leaf_norms(attn, attn_mean, right.cpu(), mean)


@pytest.mark.parametrize("kernel", KERNELS)
def test_opcheck(kernel):
    attn, attn_mean, right, mean, scale = make_inputs(6, 2, 3, 5, "cpu")
    torch.library.opcheck(heads_leaf_norms, (attn, attn_mean, right, mean, scale, kernel))
    torch.library.opcheck(heads_leaf_norms, (attn, attn_mean, right, mean))


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    attn, attn_mean, right, mean, scale = make_inputs(8, 2, 3, 5, "cpu")

    @torch.compile(fullgraph=True, dynamic=False, backend="aot_eager")
    def ratio(attn, attn_mean, right, mean, scale):
        residual, norm = heads_leaf_norms(attn, attn_mean, right, mean, scale, "tf32x3")
        return residual / norm

    residual, norm = heads_leaf_norms(attn, attn_mean, right, mean, scale, "tf32x3")
    torch.testing.assert_close(ratio(attn, attn_mean, right, mean, scale), residual / norm, rtol=0, atol=0)


# --- CUDA: the kernel against the harness ------------------------------------------------------

cuda_only = pytest.mark.skipif("cuda" not in devices(), reason="needs a GPU and the CUDA kernels")


def on_cuda(inputs, kernel):
    """The op on CUDA; skipped where the variant needs more shared memory than the GPU has (the
    128-column tiles of n > 64 take 168 KiB: an H100, not an A100)."""
    try:
        return heads_leaf_norms(*(t.cuda() for t in inputs), kernel)
    except ValueError as error:
        if "bytes of shared memory per block" not in str(error):
            raise
        pytest.skip(str(error))


@cuda_only
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape", [(32, 3, 5, 90), (37, 2, 3, 200), (64, 4, 5, 64), (128, 3, 4, 300)])
def test_cuda_kernel_matches_cpu_harness(kernel, shape):
    check_tensor_cores("cuda")
    n, heads, count, m = shape
    cpu = make_inputs(n, heads, count, m, "cpu")
    on_gpu = on_cuda(cpu, kernel)
    on_cpu = heads_leaf_norms(*cpu, kernel)
    # The tensor core's own summation order and rounding, not the ideal one of the harness.
    rtol = 1e-3 if kernel.startswith("tf32_") or kernel == "tf32" else 1e-5
    for a, b in zip(on_gpu, on_cpu):
        torch.testing.assert_close(a.cpu(), b, rtol=rtol, atol=0)
    bound = slack(*cpu[:3], cpu[4], kernel)
    for got, want in zip(on_gpu, heads_leaf_norms_ref(*cpu)):
        error = (got.cpu() - want).abs()
        assert (error <= 1e-5 * want + bound).all(), (error / want).max()


@cuda_only
@pytest.mark.parametrize("kernel", ["tf32x3", "tf32x3_128"])
def test_cuda_many_parents_deterministic(kernel):
    """Enough parents for several per CTA, and five column tiles folded by whichever CTA comes
    last: the same bits on every run, and the float64 values."""
    check_tensor_cores("cuda")
    inputs = make_inputs(64, 2, 1500, 300, "cuda")
    first = on_cuda(inputs, kernel)
    for _ in range(3):
        for a, b in zip(heads_leaf_norms(*inputs, kernel), first):
            assert torch.equal(a, b)
    bound = slack(*inputs[:3], inputs[4], kernel)
    for got, want in zip(first, heads_leaf_norms_ref(*inputs)):
        error = (got.cpu() - want).abs()
        assert (error <= 1e-5 * want + bound).all(), (error / want).max()


# --- the engine's "heads_*" leaf kernels -----------------------------------------------------------
# path_chunk_norms(leaf_kernel="heads_<variant>") takes each leaf level whose every head has the same
# parents through the heads kernel in one call (csrc/paths/engine.h, every_head_leaves) and the rest
# head by head. The CPU backend runs the kernel's harness there and ignores the per-head kernel, so on
# the CPU the one-pass variant ("heads_tf32") marks which leaves the heads kernel took: their error
# is TF32's (~2^-11), every other leaf's float32's (~1e-7).


def engine_norms(attn, tree, op_kernel, x=None, w_v=None, w_o=None, budget=2**22):
    """The engine's residual and norm [B, M] with the op's leaf_kernel as given (the public
    functions send the CPU "simt"), and the float64 engine's, in the tree's result order."""
    from pathkernels.core.engine import check_inputs, leaf_norms

    def run(attn, x, w_v, w_o, kernel):
        net, memory_budget = check_inputs(attn, tree, x, w_v, w_o, budget, "test")
        return leaf_norms(net, tree, 0, tree.num_leaves, memory_budget, leaf_kernel=kernel, where="test")

    def double(t):  # attention renormalised: float32 rows sum to 1 only to float32's precision
        if t is None:
            return None
        return t.double() / t.double().sum(-1, keepdim=True) if t is attn else t.double()

    got = run(attn, x, w_v, w_o, op_kernel)
    want = run(double(attn), double(x), double(w_v), double(w_o), "simt")
    return got, want


def relative_errors(got, want):
    return [((g.double() - w).abs() / w).flatten() for g, w in zip(got, want)]


def engine_attention(batch, layers, heads, n):
    return random_attention(batch, layers, heads, n, n, temperature=0.5)


@pytest.mark.parametrize("variant", KERNELS)
@pytest.mark.parametrize(
    "layers, heads, n, skip, max_length",
    [(3, 3, 8, False, None), (3, 2, 37, True, None), (4, 3, 6, True, 2), (1, 4, 5, True, None)],
)
def test_engine_takes_complete_leaf_levels_through_the_heads_kernel(variant, layers, heads, n, skip, max_length):
    """Complete trees (with and without the skip, pruned by length, one layer): every leaf under a
    head comes from the heads kernel, within its precision of the float64 engine, each in its own
    place (a leaf written to another's place is off by far more); the skip leaves are reduced as
    before, at float32's precision."""
    attn = engine_attention(2, layers, heads, n)
    tree = pk.PathTree.complete(layers, heads, skip=skip, max_length=max_length)
    got, want = engine_norms(attn, tree, "heads_" + variant)
    one_pass = variant.startswith("tf32_") or variant == "tf32"
    last_head = tree.paths()[:, -1] >= 0
    for error in relative_errors(got, want):
        error = error.view(2, -1)
        if skip:  # the skip leaves: their parents, reduced as before
            assert error[:, ~last_head].max() < 5e-6
        assert error[:, last_head].max() < (2e-2 if one_pass else 2e-5)
        if one_pass:  # TF32's rounding shows (seen: 1.5e-5 and up; float32's ≤ 3e-7): the heads kernel's
            assert error[:, last_head].max() > 2e-6


@pytest.mark.parametrize("case", ["factored W", "partial tree", "small chunks", "float64"])
def test_engine_leaves_other_levels_to_the_per_head_path(case):
    """Where the heads kernel does not apply, the engine takes the level head by head, at float32's
    precision on the CPU: W factored (each head's right operand differs), a tree whose last layer
    does not branch fully (runs with different parents). Chunks of a few parents each still branch
    fully at their leaf level (the planner splits between parents), so the kernel takes each one,
    TF32's rounding showing. float64 is refused by name."""
    layers, heads, n, d = 3, 3, 6, 4
    attn = engine_attention(2, layers, heads, n)
    tree, x, w_v, w_o, budget = pk.PathTree.complete(layers, heads, skip=True), None, None, None, 2**22
    if case == "float64":
        attn = attn.double() / attn.double().sum(-1, keepdim=True)
        with pytest.raises(TypeError, match="leaf_kernel='heads_tf32' runs on TF32 tensor cores"):
            engine_norms(attn, tree, "heads_tf32")
        return
    if case == "factored W":
        x, w_v, w_o = torch.randn(2, n, d), torch.randn(layers, heads, d, 2), torch.randn(layers, heads, 2, d)
    elif case == "partial tree":
        paths = pk.PathTree.complete(layers, heads, skip=True).paths()
        tree = pk.PathTree.from_paths(paths[torch.arange(0, len(paths), 3)], heads)
    else:
        budget = 4096  # a few leaves per chunk
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the small budget's warning
        got, want = engine_norms(attn, tree, "heads_tf32", x, w_v, w_o, budget)
    for error, bound in zip(relative_errors(got, want), float32_bounds(attn, tree, x, w_v, w_o)):
        if case == "small chunks":
            assert 2e-6 < error.max() < 2e-2
        else:
            assert (error <= bound).all(), (error.max(), bound[error.argmax()])


def float32_bounds(attn, tree, x, w_v, w_o):
    """Per-leaf relative error bounds ``[B·M]`` of float32 arithmetic on (residual, norm): 5e-6, or
    the κ bound ``κ_p (L + 2) n u`` where a path's factors cancel (random W can: 1 seed in 700 gave
    1.4e-5 at κ ≈ 2e3). The residual's κ is ``path_condition_numbers``; the norm's, its products with
    |X| and |W| over their own: the output's entries cancelling in its sums."""
    paths, maps = tree.paths(), {"x": x, "w_v": w_v, "w_o": w_o}
    attn = attn.double() / attn.double().sum(-1, keepdim=True)
    kappas = [path_condition_numbers(attn, paths, **maps), output_condition_numbers(attn, paths, **maps)]
    layers, n = attn.shape[1], attn.shape[-1]
    return [float32_error_bound(kappa, layers, n).clamp(min=5e-6).flatten() for kappa in kappas]


def test_engine_leaf_kernel_names():
    """Unknown heads variants and the Python names: refused by name; on the CPU the public
    functions send "simt" (the heads harness is a test tool), with the same numbers as "fused"."""
    attn = engine_attention(1, 2, 2, 4)
    tree = pk.PathTree.complete(2, 2)
    with pytest.raises(ValueError, match="expected leaf_kernel 'heads_' followed by 'tf32x3'.*got 'heads_fp8'"):
        engine_norms(attn, tree, "heads_fp8")
    with pytest.raises(ValueError, match="or 'heads_' and a heads leaf variant"):
        engine_norms(attn, tree, "tensor")
    fused = pk.path_residuals(attn, tree)
    for name in ("heads", "heads_128"):
        result = pk.path_residuals(attn, tree, leaf_kernel=name)
        assert torch.equal(result.residual, fused.residual) and torch.equal(result.norm, fused.norm)
    with pytest.raises(ValueError, match="leaf_kernel='heads' runs on TF32 tensor cores and takes float32"):
        pk.path_residuals(attn.double(), tree, leaf_kernel="heads")


@cuda_only
@pytest.mark.parametrize("name", ["heads", "heads_128"])
@pytest.mark.parametrize("fast", [False, True])
def test_cuda_engine_heads_kernels(name, fast):
    """path_residuals(leaf_kernel="heads"...) on the GPU against the float64 engine, complete trees
    with and without the skip and a partial one."""
    check_tensor_cores("cuda")
    attn = engine_attention(2, 3, 4, 64)
    reference = attn.double() / attn.double().sum(-1, keepdim=True)
    trees = [pk.PathTree.complete(3, 4), pk.PathTree.complete(3, 4, skip=True), pk.PathTree.from_paths([[0, 1, 2]], 4)]
    for tree in trees:
        got = pk.path_residuals(attn.cuda(), tree, leaf_kernel=name, fast=fast)
        want = pk.path_residuals(reference, tree)
        rtol = 2e-2 if fast else 2e-5
        torch.testing.assert_close(got.residual.cpu().double(), want.residual, rtol=rtol, atol=0)
        torch.testing.assert_close(got.norm.cpu().double(), want.norm, rtol=rtol, atol=0)
