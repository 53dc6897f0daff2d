"""The optional packages behind tables and plots (pandas, matplotlib), and saving a figure: shared
by the decompositions, the streamed statistics, the analyses and the command line."""

from __future__ import annotations

import os
from pathlib import Path


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
    """Refuse a ``path=`` that is neither None, a str nor an os.PathLike, or that names an existing
    folder or a file in a folder that does not exist, before any work (the figure is drawn first)."""
    if path is None:
        return
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"{where}: expected path to be a str or os.PathLike (a file to save to), got {type(path).__name__}"
        )
    check_file_path(path, where)


def check_file_path(path, where: str, *, write: bool = True) -> Path:
    """``path`` (a str or os.PathLike naming a file) as a Path; to write, not an existing folder and
    in a folder that exists."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{where}: expected path to be a file's path (a str or os.PathLike), got {type(path).__name__}")
    text = os.fspath(path)
    if isinstance(text, bytes) or not text.strip():
        raise ValueError(f"{where}: expected path to be a file's path, got {path!r}")
    target = Path(text)
    if write:
        if target.is_dir():
            raise ValueError(f"{where}: expected path to be a file, got {text!r}, an existing folder")
        if not target.parent.is_dir():
            raise ValueError(f"{where}: cannot write {text!r}: its folder {str(target.parent)!r} does not exist")
    return target


def saved(figure, path):
    """``figure``, first written to ``path`` (when given; the suffix gives the format) at 120 dpi
    with a tight layout."""
    if path is not None:
        figure.tight_layout()
        figure.savefig(path, dpi=120)
    return figure
