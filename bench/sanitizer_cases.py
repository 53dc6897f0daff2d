"""Small cases of every CUDA kernel, for compute-sanitizer (bench/gpu_check.sh runs it).

Each case launches the kernels once on shapes that exercise the edges: one row, one column, a
column count that is not a multiple of the block, non-contiguous inputs, ties and every dtype.
"""
import torch

import pathkernels as pk

assert torch.cuda.is_available() and pk.build_info()["cuda"], "needs a GPU and pathkernels built with CUDA"
shapes = [(1, 1), (1, 7), (5, 1), (3, 33, 130), (2, 129, 65), (0, 4, 4), (4, 2, 0)]
for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
    for shape in shapes:
        x = torch.randn(shape, device="cuda").to(dtype).requires_grad_()
        residual, norm = pk.residual_norm(x, return_norm=True)
        (residual.sum() + norm.sum() + pk.composite_norm(x).sum()).backward()
    base = torch.randn(4, 40, 24, device="cuda", dtype=dtype)
    pk.residual_norm(base.transpose(-1, -2))
    pk.composite_norm(base[:, ::3, ::2])
torch.cuda.synchronize()
print("sanitizer cases ran")
