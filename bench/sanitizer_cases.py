"""Small cases of every CUDA kernel, for compute-sanitizer (bench/gpu_check.sh runs it).

Each case launches the kernels once on shapes that exercise the edges: one row, one column, a
column count that is not a multiple of the block, non-contiguous inputs, ties and every dtype.

    python bench/sanitizer_cases.py [norms] [engine] [leaves]   (default: all three groups)
"""

import os
import sys
from unittest import mock

import torch

import pathkernels as pk

assert torch.cuda.is_available() and pk.build_info()["cuda"], "needs a GPU and pathkernels built with CUDA"
groups = set(sys.argv[1:]) or {"norms", "engine", "leaves"}
assert groups <= {"norms", "engine", "leaves"}, f"unknown groups {groups - {'norms', 'engine', 'leaves'}}"
tensor_cores = torch.cuda.get_device_capability()[0] >= 8


def norm_cases():
    shapes = [(1, 1), (1, 7), (5, 1), (3, 33, 130), (2, 129, 65), (0, 4, 4), (4, 2, 0)]
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        for shape in shapes:
            x = torch.randn(shape, device="cuda").to(dtype).requires_grad_()
            residual, norm = pk.residual_norm(x, return_norm=True)
            (residual.sum() + norm.sum() + pk.composite_norm(x).sum()).backward()
        base = torch.randn(4, 40, 24, device="cuda", dtype=dtype)
        pk.residual_norm(base.transpose(-1, -2))
        pk.composite_norm(base[:, ::3, ::2])


def engine_cases():
    """Leaf reductions of complete (skip, max_length) and explicit trees, both modes, every leaf kernel."""
    attn = torch.softmax(torch.randn(2, 3, 2, 9, 9, device="cuda", dtype=torch.float64), dim=-1)
    x = torch.randn(2, 9, 5, device="cuda", dtype=torch.float64)
    w_v = torch.randn(3, 2, 5, 3, device="cuda", dtype=torch.float64)
    w_o = torch.randn(3, 2, 3, 5, device="cuda", dtype=torch.float64)
    trees = [
        pk.PathTree.complete(3, 2),
        pk.PathTree.complete(3, 2, skip=True),
        pk.PathTree.complete(3, 2, skip=True, max_length=1),
        pk.PathTree.from_paths(torch.tensor([[1, -1, 0], [0, 0, 0], [1, -1, 0]]), num_heads=2),
    ]
    for tree in trees:
        for dtype in (torch.float32, torch.float64):
            for kernel in ("fused", "gemm") + (("tensor",) if dtype == torch.float32 and tensor_cores else ()):
                pk.path_residuals(attn.to(dtype), tree, memory_budget=1 << 16, leaf_kernel=kernel)
                pk.path_residuals(
                    attn.to(dtype), tree, x=x.to(dtype), w_v=w_v.to(dtype), w_o=w_o.to(dtype), leaf_kernel=kernel
                )
    # float32 nodes renormalised on the way down (residuals far below float32's range).
    e = torch.randint(-4, 5, (2, 6, 2, 8, 8), device="cuda").double()
    e[..., -1] = -e[..., :-1].sum(-1)
    for kernel in ("fused", "gemm") + (("tensor",) if tensor_cores else ()):
        pk.path_residuals((1 / 8 + 2.0**-22 * e).float(), pk.PathTree.complete(6, 2, skip=True), leaf_kernel=kernel)
    # The internal levels all heads at once (one batched product into strided views of the level).
    with mock.patch.dict(os.environ, {"PATHKERNELS_ENGINE_LEVELS": "all_heads"}):
        for tree in trees[:3]:
            for dtype in (torch.float32, torch.float64):
                pk.path_residuals(attn.to(dtype), tree, memory_budget=1 << 16)
        pk.path_residuals((1 / 8 + 2.0**-22 * e).float(), pk.PathTree.complete(6, 2, skip=True))


def leaf_cases():
    """The fused leaf kernels alone: every tile height (32, 64, 128 rows), partial k-slices and
    column tiles, several column tiles per leaf (row sums folded across tiles), strided leaves; the
    all-heads kernel's variants likewise."""
    for dtype in (torch.float32, torch.float64):
        kernels = ["simt"] + (["tf32x3", "tf32"] if dtype == torch.float32 and tensor_cores else [])
        for n, count, m in [(1, 1, 1), (17, 3, 65), (64, 2, 64), (100, 2, 130), (128, 1, 129)]:
            level = torch.randn(n, count + 2, m, device="cuda", dtype=dtype)
            scale = 2.0 ** torch.randint(-300, 4, (count,), device="cuda", dtype=torch.float64)
            for kernel in kernels:
                torch.ops.pathkernels._fused_leaf_norms(
                    torch.randn(n, n, device="cuda", dtype=dtype),
                    level[:, 1 : count + 1],
                    torch.randn(count, m, device="cuda", dtype=dtype),
                    scale,
                    kernel,
                )
    if not tensor_cores:
        return
    # The all-heads leaf kernel: every variant, one and several column tiles (the cross-tile finish),
    # tile heights 32, 64, 128, a strided block of parents, scales far below float32's range.
    big_tiles = torch.cuda.get_device_properties(0).shared_memory_per_block_optin >= 168 * 1024
    for n, heads, count, m in [(1, 1, 1, 1), (17, 3, 5, 65), (64, 4, 3, 200), (100, 2, 9, 130)]:
        level = torch.randn(n, count + 2, m, device="cuda")
        scale = 2.0 ** torch.randint(-300, 4, (count,), device="cuda", dtype=torch.float64)
        attn = torch.randn(heads, n, n, device="cuda")
        for kernel in ("tf32x3", "tf32") + (("tf32x3_128", "tf32_128") if big_tiles or n <= 64 else ()):
            torch.ops.pathkernels._heads_leaf_norms(
                attn,
                torch.randn(heads, n, device="cuda"),
                level[:, 1 : count + 1],
                torch.randn(count, m, device="cuda"),
                scale,
                kernel,
            )


for group, cases in (("norms", norm_cases), ("engine", engine_cases), ("leaves", leaf_cases)):
    if group in groups:
        cases()
        torch.cuda.synchronize()
        print(f"{group} cases ran")
