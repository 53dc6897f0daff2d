"""Where pathkernels' documents are on this machine, for messages that point to them."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def doc_path(name: str) -> str:
    """Where the document ``name`` (such as ``"DESIGN.md"``) can be read: the copy the build installs
    with the package (``pathkernels/docs``, beside the compiled extension), else the checkout's
    ``docs/`` folder (an editable install), else ``docs/NAME`` as the source tree names it."""
    spec = importlib.util.find_spec("pathkernels._C")
    places = [] if spec is None or spec.origin is None else [Path(spec.origin).parent / "docs" / name]
    places.append(Path(__file__).resolve().parents[2] / "docs" / name)
    for place in places:
        if place.is_file():
            return str(place)
    return f"docs/{name}"
