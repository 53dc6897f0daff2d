"""Short, one-line ``repr`` of the library's result records: shapes, not tensors' contents."""

from __future__ import annotations

import dataclasses

from torch import Tensor

_LONGEST_VALUE = 40  # characters of one field's value beyond which it is cut


def short_repr(record, headline: str = "") -> str:
    """``Name(headline; field=[shape], …)`` of a dataclass ``record``: each tensor field as its shape,
    a long list as its length, a nested record by its type, other values cut at a few dozen
    characters; fields that are None left out. ``headline``: a few numbers that say what it holds."""
    parts = []
    for field in dataclasses.fields(record):
        value = getattr(record, field.name)
        if value is None:
            continue
        if isinstance(value, Tensor):
            text = str(list(value.shape))
        elif isinstance(value, (list, tuple)) and len(value) > 4:
            text = f"[{len(value)} items]"
        elif dataclasses.is_dataclass(value):
            text = type(value).__name__
        else:
            text = repr(value)
            text = text if len(text) <= _LONGEST_VALUE else text[: _LONGEST_VALUE - 1] + "…"
        parts.append(f"{field.name}={text}")
    head = f"{headline}; " if headline else ""
    return f"{type(record).__name__}({head}{', '.join(parts)})"
