"""pathkernels: fast path decompositions of attention networks.

Fused CPU and CUDA kernels, registered as ``torch.ops.pathkernels.*``, with a thin Python layer.
See README.md, and docs/DESIGN.md in the source tree for the math, the engine and the performance model.
"""
import torch  # noqa: F401  (loads libtorch before the extension)

from pathkernels._extension import load as _load

_BUILD_INFO = _load()

from pathkernels import adapters, compat, distributed, experiments, metrics, models, nn
from pathkernels.decompose import PathDecomposition, decompose
from pathkernels.engine import (
    DEFAULT_MEMORY_BUDGET,
    PathResiduals,
    length_sums,
    path_residuals,
    truncated_output,
)
from pathkernels.ops import MatrixNorms, composite_norm, matrix_norms, residual_norm
from pathkernels.paths import PathTree, count_by_length, count_paths, sample_paths
from pathkernels.rollout import rollout

__version__ = "0.1.0"


def build_info() -> dict:
    """How the compiled extension was built.

    Returns a dict with ``torch_version`` (the torch it was compiled against), ``cuda`` (whether
    the CUDA kernels are built), ``cuda_version`` and ``cuda_architectures`` (CMake's list).
    """
    return dict(_BUILD_INFO)


__all__ = [
    "DEFAULT_MEMORY_BUDGET",
    "MatrixNorms",
    "PathDecomposition",
    "PathResiduals",
    "PathTree",
    "adapters",
    "build_info",
    "compat",
    "composite_norm",
    "count_by_length",
    "count_paths",
    "decompose",
    "distributed",
    "experiments",
    "length_sums",
    "matrix_norms",
    "metrics",
    "models",
    "nn",
    "path_residuals",
    "residual_norm",
    "rollout",
    "sample_paths",
    "truncated_output",
]
