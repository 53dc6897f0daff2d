"""Analyses built on the core and on what the adapters capture.

- :mod:`~pathkernels.analysis.attribution`: per-path attribution of a captured model's readouts
  (``pk.path_attribution``, ``pk.logit_diff``); :mod:`~pathkernels.analysis.top_paths`: the
  certified search for its top paths; :mod:`~pathkernels.analysis.real_paths`: the decomposition of
  its stream into its paths' terms (which :func:`pathkernels.decompose` of a captured stack runs:
  the core's hook, set on import). All three walk :mod:`~pathkernels.analysis.readout_trie`, the
  frozen model as a trie of its paths; :mod:`~pathkernels.analysis.scores`: where heads look, a
  head's attention scores as exact sums over pairs of paths (``pk.score_decomposition``);
  :mod:`~pathkernels.analysis.causal`: the causal check of a path, its term removed where it
  enters and the model run on (``pk.causal_check``); :mod:`~pathkernels.analysis.graph`: the
  attribution graph of a prompt through a capture's transcoder features (``pk.attribution_graph``),
  written by :mod:`~pathkernels.analysis.graph_files` in circuit-tracer's and Neuronpedia's formats;
- :mod:`~pathkernels.analysis.metrics` (``pk.metrics``: rank collapse and token similarity),
  :mod:`~pathkernels.analysis.rollout` (``pk.rollout``), :mod:`~pathkernels.analysis.nn`
  (``pk.nn.DeEscalation``) and :mod:`~pathkernels.analysis.compat` (``pk.compat``: the paper's
  official utilities on the fused ops).

The layer above the adapters (which read models) and below the applications (command line,
demo): it imports the core and the adapters, and neither imports it (docs/DESIGN.md, "Layers").
"""

from pathkernels.analysis.attribution import (
    BatchAttribution,
    PathAttribution,
    Readout,
    batch_attribution,
    logit,
    logit_diff,
    path_attribution,
    to_single_token,
)
from pathkernels.analysis.causal import CausalCheck, causal_check
from pathkernels.analysis.graph import AttributionGraph, attribution_graph
from pathkernels.analysis.real_paths import ModelPathDecomposition, decompose_model, path_terms
from pathkernels.analysis.score_search import TopScorePairs, top_score_pairs
from pathkernels.analysis.scores import (
    ScoreDecomposition,
    ScorePairs,
    score_attribution,
    score_decomposition,
    score_decompositions,
    score_pairs,
    score_top_paths,
)
from pathkernels.analysis.top_paths import TopPaths, top_paths

__all__ = [
    "AttributionGraph",
    "BatchAttribution",
    "CausalCheck",
    "ModelPathDecomposition",
    "PathAttribution",
    "Readout",
    "ScoreDecomposition",
    "ScorePairs",
    "TopPaths",
    "TopScorePairs",
    "attribution_graph",
    "batch_attribution",
    "causal_check",
    "decompose_model",
    "logit",
    "logit_diff",
    "path_attribution",
    "path_terms",
    "score_attribution",
    "score_decomposition",
    "score_decompositions",
    "score_pairs",
    "score_top_paths",
    "to_single_token",
    "top_paths",
    "top_score_pairs",
]
