"""pathkernels: fast path decompositions of attention networks.

Fused CPU and CUDA kernels, registered as ``torch.ops.pathkernels.*``, with a thin Python layer.
See README.md, and docs/DESIGN.md in the source tree for the math, the engine and the performance
model.

The package is laid out by layer, each importing only those below it (docs/DESIGN.md, "Layers"):
:mod:`pathkernels.core` (the ops, path trees, engine, length sums, statistics, decompositions),
:mod:`pathkernels.adapters` (reading Hugging Face and TransformerLens models),
:mod:`pathkernels.analysis` (attribution, top paths, metrics, rollout) and :mod:`pathkernels.app`
(the command line, experiments, demo models, benchmark helpers). The public names below are
this package's, whichever layer defines them.

Loading: if torch is already imported when pathkernels is, ``import pathkernels`` imports the
library layers (core, adapters, analysis) at once, which loads the compiled extension and
registers ``torch.ops.pathkernels.*``; otherwise it imports nothing, and the first use of a
public name (or of any module of the layers) imports them. ``pk.experiments``, ``pk.models``,
``pk.compat`` and ``pk.testing`` load on first use only, so ``import pathkernels`` never pulls in
the applications, pandas or matplotlib.
"""

import importlib as _importlib
import sys as _sys

__version__ = "0.1.0"

# The public names of the library layers and the modules that define them.
_LIBRARY_NAMES = {
    "AttributionGraph": "pathkernels.analysis.graph",
    "CausalCheck": "pathkernels.analysis.causal",
    "DEFAULT_MEMORY_BUDGET": "pathkernels.core.planner",
    "MatrixNorms": "pathkernels.core.ops",
    "PathAttribution": "pathkernels.analysis.attribution",
    "PathDecomposition": "pathkernels.core.decompose",
    "PathResiduals": "pathkernels.core.engine",
    "PathStatistics": "pathkernels.core.statistics",
    "PathTree": "pathkernels.core.paths",
    "Readout": "pathkernels.analysis.attribution",
    "ScoreDecomposition": "pathkernels.analysis.scores",
    "ScorePairs": "pathkernels.analysis.scores",
    "TopPaths": "pathkernels.analysis.top_paths",
    "TopScorePairs": "pathkernels.analysis.score_search",
    "BatchAttribution": "pathkernels.analysis.attribution",
    "attribution_graph": "pathkernels.analysis.graph",
    "batch_attribution": "pathkernels.analysis.attribution",
    "build_info": "pathkernels.core._extension",
    "causal_check": "pathkernels.analysis.causal",
    "composite_norm": "pathkernels.core.ops",
    "count_by_length": "pathkernels.core.paths",
    "count_paths": "pathkernels.core.paths",
    "decompose": "pathkernels.core.decompose",
    "length_sums": "pathkernels.core.length_sums",
    "logit": "pathkernels.analysis.attribution",
    "logit_diff": "pathkernels.analysis.attribution",
    "matrix_norms": "pathkernels.core.ops",
    "path_attribution": "pathkernels.analysis.attribution",
    "path_residuals": "pathkernels.core.engine",
    "path_statistics": "pathkernels.core.statistics",
    "path_terms": "pathkernels.analysis.real_paths",
    "residual_norm": "pathkernels.core.ops",
    "score_attribution": "pathkernels.analysis.scores",
    "score_decomposition": "pathkernels.analysis.scores",
    "score_decompositions": "pathkernels.analysis.scores",
    "score_pairs": "pathkernels.analysis.scores",
    "score_top_paths": "pathkernels.analysis.scores",
    "rollout": "pathkernels.analysis.rollout",
    "sample_paths": "pathkernels.core.paths",
    "top_paths": "pathkernels.analysis.top_paths",
    "to_single_token": "pathkernels.analysis.attribution",
    "top_score_pairs": "pathkernels.analysis.score_search",
    "truncated_output": "pathkernels.core.length_sums",
}
# The library's modules that are public names (pk.metrics, ...), the layers themselves included.
_LIBRARY_MODULES = {
    "core": "pathkernels.core",
    "adapters": "pathkernels.adapters",
    "analysis": "pathkernels.analysis",
    "distributed": "pathkernels.core.distributed",
    "metrics": "pathkernels.analysis.metrics",
    "nn": "pathkernels.analysis.nn",
}
# Modules imported on first use only.
_ON_USE_MODULES = {
    "app": "pathkernels.app",
    "compat": "pathkernels.analysis.compat",
    "experiments": "pathkernels.app.experiments",
    "models": "pathkernels.app.models",
    "testing": "pathkernels.testing",
}


def _load_library() -> None:
    """Import the library layers (the core first: it loads the extension) and bind their public
    names here. Importing the analysis layer also sets :func:`decompose`'s hook for captured
    models."""
    for name, module in _LIBRARY_MODULES.items():
        globals()[name] = _importlib.import_module(module)
    for name, module in _LIBRARY_NAMES.items():
        globals()[name] = getattr(_importlib.import_module(module), name)


def __getattr__(name: str):
    """The public names, their layers imported on first use (see the module docstring)."""
    if name in _LIBRARY_NAMES or name in _LIBRARY_MODULES:
        _load_library()
        return globals()[name]
    if name in _ON_USE_MODULES:
        module = _importlib.import_module(_ON_USE_MODULES[name])
        globals()[name] = module
        return module
    raise AttributeError(f"module 'pathkernels' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LIBRARY_NAMES) | set(_LIBRARY_MODULES) | set(_ON_USE_MODULES))


__all__ = [
    "AttributionGraph",
    "BatchAttribution",
    "CausalCheck",
    "DEFAULT_MEMORY_BUDGET",
    "MatrixNorms",
    "PathAttribution",
    "PathDecomposition",
    "PathResiduals",
    "PathStatistics",
    "PathTree",
    "Readout",
    "ScoreDecomposition",
    "ScorePairs",
    "TopPaths",
    "TopScorePairs",
    "adapters",
    "attribution_graph",
    "batch_attribution",
    "build_info",
    "causal_check",
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
    "score_attribution",
    "score_decomposition",
    "score_decompositions",
    "score_pairs",
    "score_top_paths",
    "to_single_token",
    "top_paths",
    "top_score_pairs",
    "truncated_output",
]

# Users who call torch.ops.pathkernels.* directly have imported torch first: load the ops for them.
if "torch" in _sys.modules:
    _load_library()
