"""Sealed files: what pathkernels writes to disk and reads back (statistics, checkpoints).

A sealed file is a header line, the SHA-256 of the payload, and the payload (a ``torch.save`` of
plain tensors and numbers). It is written to a temporary file, flushed to disk and renamed over
the old one, so that a reader sees the old file or the new one, never a part. Reading checks the
header and the digest before unpickling anything: a truncated, damaged or foreign file is refused
with one message, never read into wrong numbers.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

_MAGIC = b"pathkernels sealed file 1\n"


def write_sealed(path: Path, content: Any) -> None:
    """Write ``content`` (plain tensors, numbers, strings, lists and dicts) to ``path`` atomically."""
    buffer = io.BytesIO()
    torch.save(content, buffer)
    payload = buffer.getvalue()
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as file:
        file.write(_MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)
    try:  # the rename itself, to disk (not every file system lets a folder be opened)
        folder = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(folder)
    except OSError:
        pass
    finally:
        os.close(folder)


def read_sealed(path: Path, where: str, what: str, advice: str) -> Any:
    """The content :func:`write_sealed` wrote to ``path``; a ValueError naming ``where``, ``what``
    the file is and ``advice`` (what to do) for any file that is not intact."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ValueError(f"{where}: cannot read {what} {path}: {error.strerror or error}") from None
    if not data.startswith(_MAGIC):
        problem = "it was not written by this version of pathkernels"
    else:
        digest, _, payload = data[len(_MAGIC) :].partition(b"\n")
        if hashlib.sha256(payload).hexdigest().encode() != digest:
            problem = "its contents do not match their SHA-256: it is damaged or truncated"
        else:
            try:
                return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
            except Exception as error:  # noqa: BLE001 (intact bytes that do not unpickle: refused alike)
                problem = f"its contents cannot be read ({type(error).__name__})"
    raise ValueError(f"{where}: {what} {path} cannot be used: {problem}. {advice}")


def tensor_digest(tensors: dict[str, Tensor | None]) -> str:
    """SHA-256 over the names, shapes, dtypes and bytes of ``tensors``: two inputs share it only
    if they are equal bit for bit."""
    digest = hashlib.sha256()
    for name, t in tensors.items():
        digest.update(f"{name}:".encode())
        if t is None:
            digest.update(b"None;")
            continue
        flat = t.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{list(t.shape)}:{t.dtype};".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
