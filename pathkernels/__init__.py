"""pathkernels: fast path decompositions of attention networks.

Fused CPU and CUDA kernels, registered as ``torch.ops.pathkernels.*``, with a thin Python layer.
See README.md, and docs/DESIGN.md in the source tree for the math, the engine and the performance
model.

The library core is imported here. The application modules (``experiments``, ``models``,
``compat``, ``benchmarks``, ``cli``) load on first use, so ``import pathkernels`` pulls in neither
pandas, matplotlib nor the experiments.
"""

import importlib

import torch  # noqa: F401  (loads libtorch before the extension)

from pathkernels.core._extension import build_info
from pathkernels.core._extension import load as _load

_load()

from pathkernels import adapters  # noqa: E402
from pathkernels.analysis import (  # noqa: E402
    PathAttribution,
    Readout,
    TopPaths,
    logit,
    logit_diff,
    metrics,
    nn,
    path_attribution,
    path_terms,
    top_paths,
)
from pathkernels.analysis.rollout import rollout  # noqa: E402
from pathkernels.core import distributed  # noqa: E402
from pathkernels.core.decompose import PathDecomposition, decompose  # noqa: E402
from pathkernels.core.engine import PathResiduals, path_residuals  # noqa: E402
from pathkernels.core.length_sums import length_sums, truncated_output  # noqa: E402
from pathkernels.core.ops import MatrixNorms, composite_norm, matrix_norms, residual_norm  # noqa: E402
from pathkernels.core.paths import PathTree, count_by_length, count_paths, sample_paths  # noqa: E402
from pathkernels.core.planner import DEFAULT_MEMORY_BUDGET  # noqa: E402
from pathkernels.core.statistics import PathStatistics, path_statistics  # noqa: E402

__version__ = "0.1.0"

_LAZY_MODULES = {
    "compat": "pathkernels.analysis.compat",
    "experiments": "pathkernels.app.experiments",
    "models": "pathkernels.app.models",
    "testing": "pathkernels.testing",
}


def __getattr__(name: str):
    """``pk.experiments`` and the other application modules, imported on first use."""
    if name in _LAZY_MODULES:
        module = importlib.import_module(_LAZY_MODULES[name])
        globals()[name] = module
        return module
    raise AttributeError(f"module 'pathkernels' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_MODULES))


__all__ = [
    "DEFAULT_MEMORY_BUDGET",
    "MatrixNorms",
    "PathAttribution",
    "PathDecomposition",
    "PathResiduals",
    "PathStatistics",
    "PathTree",
    "Readout",
    "TopPaths",
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
    "logit",
    "logit_diff",
    "matrix_norms",
    "metrics",
    "models",
    "nn",
    "path_attribution",
    "path_residuals",
    "path_statistics",
    "path_terms",
    "residual_norm",
    "rollout",
    "sample_paths",
    "top_paths",
    "truncated_output",
]
