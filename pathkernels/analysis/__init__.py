"""Analyses of what the adapters capture: per-path attribution of a real model's readouts, and
the certified search for its top paths.

The layer between the adapters (which read models) and the application (command line, demo): it
imports the core and reads the adapters' captures, and neither imports it.
"""

from pathkernels.analysis.attribution import PathAttribution, Readout, logit, logit_diff, path_attribution
from pathkernels.analysis.top_paths import TopPaths, top_paths

__all__ = ["PathAttribution", "Readout", "TopPaths", "logit", "logit_diff", "path_attribution", "top_paths"]
