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
    """``figure``, first written to ``path`` (when given; the suffix gives the format) at 120 dpi,
    laid out (tight, unless it has a layout of its own: :func:`new_figure`'s constrained one)."""
    if path is not None:
        if figure.get_layout_engine() is None:
            figure.tight_layout()
        figure.savefig(path, dpi=120)
    return figure


# --- drawing: what every figure shares, so that each fits a paper ------------------------------------

ANNOTATE_CELLS = 12  # a heatmap writes its values in the cells up to this many rows and columns


def new_figure(width: float, height: float, columns: int = 1, **options):
    """``(figure, axes)``: a figure of ``width × height`` inches with constrained layout, so that
    titles, tick labels, axis labels and colour bars stay inside it whether it is saved or shown
    (one Axes, or ``columns`` of them side by side)."""
    import matplotlib.pyplot as plt

    return plt.subplots(1, columns, figsize=(width, height), layout="constrained", **options)


def titled(name: str, text: str) -> str:
    """``text`` led by the model's ``name`` (a fixture's, a folder's), where there is one."""
    return f"{name}: {text}" if name else text


def wrapped(text: str, width: int) -> str:
    """``text`` broken into lines of at most ``width`` characters, at spaces."""
    import textwrap

    return "\n".join(textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False)) or text


def heatmap(ax, values, rows: list[str], columns: list[str], label: str, *, row_label: str, column_label: str):
    """``values [R, C]`` (a CPU tensor) drawn on ``ax`` in colours symmetric around 0, each cell
    filling its share of the axes; a colour bar labelled ``label``; each cell's value written in it
    where the grid has at most :data:`ANNOTATE_CELLS` rows and columns. Returns the image."""
    limit = float(values.abs().max()) if values.numel() else 0.0
    limit = limit or 1.0
    image = ax.imshow(values.numpy(), cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto")
    ax.set_xticks(range(len(columns)), [wrapped(c, 12) for c in columns], fontsize=7)
    ax.set_yticks(range(len(rows)), [wrapped(r, 22) for r in rows], fontsize=7)
    ax.tick_params(length=0)
    ax.set_xlabel(column_label)
    ax.set_ylabel(row_label)
    if max(values.shape) <= ANNOTATE_CELLS:
        size = 8 if max(values.shape) <= 8 else 6.5
        for (r, c), value in zip(
            ((r, c) for r in range(values.shape[0]) for c in range(values.shape[1])), values.flatten().tolist()
        ):
            if abs(value) < 0.005:  # blank: the colour bar reads it as 0
                continue
            text = f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}" if abs(value) < 100 else f"{value:.0f}"
            colour = "white" if abs(value) > 0.6 * limit else "black"
            ax.text(c, r, text.replace("-", "−"), ha="center", va="center", fontsize=size, color=colour)
    colorbar = ax.figure.colorbar(image, ax=ax, fraction=0.05, pad=0.02)
    colorbar.set_label(label)
    return image


def bar_side_labels(ax, top: int) -> None:
    """Name the two groups of a bar chart whose first ``top`` rows are the largest and the rest the
    smallest: a rule between them, and "largest" / "smallest" beside it, right of the axes (not
    over the bars or the frame)."""
    ax.axhline(top - 0.5, color="0.4", linewidth=0.8, linestyle="--")
    for text, va, offset in (("▲ largest", "bottom", 2), ("▼ smallest", "top", -2)):
        ax.annotate(
            text,
            (1.0, top - 0.5),
            xycoords=("axes fraction", "data"),
            xytext=(3, offset),
            textcoords="offset points",
            ha="left",
            va=va,
            fontsize=7,
            color="0.3",
            annotation_clip=False,
        )
