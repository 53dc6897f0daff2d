"""The library core: everything that drives the compiled ops, and nothing that reads a model.

- :mod:`~pathkernels.core.ops`: typed wrappers of ``torch.ops.pathkernels.*`` (fake kernels,
  autograd); :mod:`~pathkernels.core.triton_norms` and :mod:`~pathkernels.core.triton_leaf`, the
  Triton candidates (imported on their own, with triton);
- :mod:`~pathkernels.core.paths`: PathTree, exact counts (of attention networks' and captured
  models' paths), sampling, trie chunks; :mod:`~pathkernels.core.checks` and
  :mod:`~pathkernels.core.masking`: input checks and padded batches;
- :mod:`~pathkernels.core.planner` (the memory plan) and :mod:`~pathkernels.core.engine`
  (``path_residuals``), :mod:`~pathkernels.core.distributed` (trees split over ranks);
- :mod:`~pathkernels.core.length_sums`, :mod:`~pathkernels.core.statistics` (streamed per-path
  statistics) and :mod:`~pathkernels.core.decompose` (PathDecomposition);
- private helpers: ``_extension`` (loading the binary), ``_memory``, ``_progress``, ``_files``
  (sealed checkpoints) and ``_figures`` (optional pandas and matplotlib, saved figures).

The lowest layer: it imports neither the adapters, the analyses nor the applications (see
docs/DESIGN.md, "Layers"). Importing it loads the compiled extension, which registers
``torch.ops.pathkernels``; the public names are :mod:`pathkernels`'.
"""

import torch  # noqa: F401  (loads libtorch before the extension)

from pathkernels.core._extension import load as _load

_load()
