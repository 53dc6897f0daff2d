"""The applications: what the ``pathkernels`` command runs, built on the library.

- :mod:`~pathkernels.app.cli`: the command line, one module per subcommand (the parser itself
  imports neither torch nor the library, so that ``--help`` answers at once);
- :mod:`~pathkernels.app.experiments`: the paper's experiments as DataFrames and figures
  (``pk.experiments``);
- :mod:`~pathkernels.app.models`: the demo's model zoo, the SAN family (``pk.models``);
- :mod:`~pathkernels.app.benchmarks`: the one timer and table formatter of the command line's
  ``bench`` and of the scripts in bench/.

The top layer: nothing in the library (core, adapters, analysis) imports it, and ``import
pathkernels`` does not load it (docs/DESIGN.md, "Layers").
"""
