"""Analyses of what the adapters capture: per-path attribution of a real model's readouts, the
certified search for its top paths, and the decomposition of its stream into its paths' terms
(which :func:`pathkernels.decompose` of a captured stack runs: the core's hook, set on import).

The layer between the adapters (which read models) and the application (command line, demo): it
imports the core and reads the adapters' captures, and neither imports it.
"""

from pathkernels.analysis.attribution import PathAttribution, Readout, logit, logit_diff, path_attribution
from pathkernels.analysis.real_paths import ModelPathDecomposition, decompose_model, path_terms
from pathkernels.analysis.top_paths import TopPaths, top_paths

__all__ = [
    "ModelPathDecomposition",
    "PathAttribution",
    "Readout",
    "TopPaths",
    "decompose_model",
    "logit",
    "logit_diff",
    "path_attribution",
    "path_terms",
    "top_paths",
]
