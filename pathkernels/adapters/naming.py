"""A model's name for people: what figure titles call the model a stack was read from."""

from __future__ import annotations

import os
from pathlib import PurePath


def model_name(model) -> str:
    """A Hugging Face model's name: the folder's name for a model read from a local directory (a
    fixture's name for ``pathkernels.fixtures.load_fixture``), the hub id for one read from the hub
    (its config's ``_name_or_path``), else its ``model_type``; a TransformerLens model's
    ``cfg.model_name``; "" where none is known."""
    config = getattr(model, "config", None)
    where = getattr(config, "_name_or_path", None)
    if isinstance(where, str) and where.strip():
        where = where.strip()
        if os.path.isdir(where):
            return PurePath(os.path.abspath(where)).name or where
        return where
    cfg = getattr(model, "cfg", None)
    name = getattr(cfg, "model_name", None) or getattr(config, "model_type", None)
    return name if isinstance(name, str) else ""
