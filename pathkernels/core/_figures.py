"""The optional packages behind tables and plots (pandas, matplotlib), and saving a figure: shared
by the decompositions, the streamed statistics, the analyses and the command line."""

from __future__ import annotations

import os


def require(module: str):
    """``module`` imported, or an ImportError that says how to install it."""
    try:
        return __import__(module)
    except ImportError as error:
        raise ImportError(
            f"pathkernels: this needs {module}; install it with `pip install {module}` "
            "(or `pip install pathkernels[analysis]`)"
        ) from error


def check_save_path(path, where: str) -> None:
    """Refuse a ``path=`` that is neither None, a str nor an os.PathLike, before any work."""
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"{where}: expected path to be a str or os.PathLike (a file to save to), got {type(path).__name__}"
        )


def saved(figure, path):
    """``figure``, first written to ``path`` (when given; the suffix gives the format) at 120 dpi
    with a tight layout."""
    if path is not None:
        figure.tight_layout()
        figure.savefig(path, dpi=120)
    return figure
