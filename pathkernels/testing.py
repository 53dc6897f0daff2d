"""Generators, devices and tolerances shared by the tests and the benchmarks."""
from __future__ import annotations

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
    """The devices this machine can test: CPU, plus CUDA when a GPU and CUDA kernels exist."""
    import pathkernels

    found = ["cpu"]
    if torch.cuda.is_available() and pathkernels.build_info()["cuda"]:
        found.append("cuda")
    return found


def random_matrices(*shape: int, dtype=torch.float32, device="cpu", generator=None) -> Tensor:
    """Standard normal entries: ``shape`` is ``(..., n, m)``."""
    return torch.randn(*shape, generator=generator, dtype=torch.float64).to(device=device, dtype=dtype)


def random_attention(*shape: int, dtype=torch.float32, device="cpu", generator=None, temperature=1.0) -> Tensor:
    """Row-stochastic ``[..., n, n]`` matrices: softmax of Gaussian scores (rows sum to 1)."""
    scores = torch.randn(*shape, generator=generator, dtype=torch.float64) / temperature
    return scores.softmax(dim=-1).to(device=device, dtype=dtype)
