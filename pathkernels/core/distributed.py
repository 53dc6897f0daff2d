"""Running one decomposition across processes with torch.distributed (gloo on CPU, NCCL on GPUs).

Under ``torchrun`` (or after ``torch.distributed.init_process_group``), :func:`pathkernels.path_residuals`,
:func:`pathkernels.decompose` and ``pathkernels paths`` split the tree's leaves into contiguous
ranges of equal size (balanced by leaf count, whatever the shape of the tree), evaluate each range
on its rank's device within its memory budget, and gather the results to rank 0 (or to every
rank) in the order of a single-process run.

Every rank must pass the same attention (and ``x``, ``w_v``, ``w_o``) and the same tree; this is
checked up front, and a rank that raises makes every rank raise: the ranks exchange a status after
the checks and after the computation, so no rank is left waiting in a collective.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["init_from_env", "launched_group", "leaf_range", "resolve_group"]


def resolve_group(group, where: str):
    """The process group to split over, or None for a single-process run.

    ``group=None`` takes the default group when torch.distributed is initialised with more than
    one process (as under torchrun); ``group=False`` forces a single-process run; a ProcessGroup is
    used as given.
    """
    if group is False:
        return None
    if group is None:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        return dist.group.WORLD
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"{where}: got a process group, but torch.distributed is not initialised")
    return group


def init_from_env(device: str = "cpu") -> bool:
    """Initialise the default process group from torchrun's environment, if present.

    Uses NCCL (and ``cuda:LOCAL_RANK``) for ``device="cuda"``, gloo otherwise. Returns whether
    this process is part of a multi-process run. Whoever calls it owns the group and must call
    ``torch.distributed.destroy_process_group()`` before the process exits (a gloo group still
    alive at interpreter exit can abort the process); :func:`launched_group` does both.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return False
    if not dist.is_initialized():
        backend = "nccl" if device == "cuda" else "gloo"
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    return dist.get_world_size() > 1


@contextlib.contextmanager
def launched_group(device: str = "cpu") -> Iterator[bool]:
    """``with launched_group(device) as distributed:`` the torchrun group for the block.

    Yields :func:`init_from_env`'s answer, and destroys the default group on the way out if this
    call created it, whether the block returns or raises.
    """
    created = "RANK" in os.environ and not (dist.is_available() and dist.is_initialized())
    try:
        yield init_from_env(device)
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def leaf_range(total: int, world: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous share of ``total`` leaves: sizes differ by at most one."""
    base, extra = divmod(total, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def _tensor_summary(t: Tensor | None) -> Any:
    """Shape, dtype and two checksums (sum and position-weighted sum, in float64) of a tensor."""
    if t is None:
        return None
    flat = t.detach().reshape(-1).double()
    weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.float64).remainder_(97)
    return {
        "shape": list(t.shape),
        "dtype": str(t.dtype),
        "sum": flat.sum().item(),
        "weighted": (flat * weights).sum().item(),
    }


def fingerprint(tensors: dict[str, Tensor | None], tree) -> dict:
    """What every rank must agree on: the inputs (by checksum) and the tree (exactly)."""
    summary: dict[str, Any] = {name: _tensor_summary(t) for name, t in tensors.items()}
    summary["tree"] = repr(tree)
    if not tree.is_complete:  # a complete tree, max_length or not, is its repr
        summary["paths_sha1"] = hashlib.sha1(tree.paths().numpy().tobytes()).hexdigest()
    return summary


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, float):  # checksums: devices may round differently
        return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))
    return a == b


def _differences(a: dict, b: dict) -> list[str]:
    return [key for key in sorted(set(a) | set(b)) if not _same(a.get(key), b.get(key))]


def agree(where: str, group, error: BaseException | None, summary: dict | None = None) -> None:
    """Collective: every rank reports its error (or None) and its fingerprint; if any rank failed
    or the fingerprints differ, every rank raises. Call it on every rank, at the same point."""
    status = None if error is None else (type(error).__name__, str(error))
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (status, summary), group=group)
    rank = dist.get_rank(group)
    for other, (other_status, _) in enumerate(gathered):
        if other_status is not None:
            if other == rank and error is not None:
                raise error
            name, message = other_status
            kind = getattr(builtins, name, None)
            kind = kind if isinstance(kind, type) and issubclass(kind, Exception) else RuntimeError
            raise kind(f"{where}: rank {other} failed: {name}: {message}")
    if summary is not None:
        reference = gathered[0][1]
        for other, (_, other_summary) in enumerate(gathered):
            differing = _differences(reference, other_summary)
            if differing:
                raise ValueError(
                    f"{where}: the ranks' inputs differ ({', '.join(differing)} of rank {other} != rank 0). "
                    "Every rank must pass the same attention, x, w_v, w_o and tree; when sampling, the "
                    "same seed or generator state"
                )


def gather_leaves(parts: list[Tensor], total: int, group, all_ranks: bool) -> list[Tensor] | None:
    """Concatenate every rank's ``[B, count_r]`` tensors along dim 1, in rank order, on rank 0
    (or on every rank). Returns None on the other ranks. Each tensor is gathered in float64 when
    any rank holds it in float64 (float32 results widen where residuals leave float32's range)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    wide = torch.tensor([part.dtype == torch.float64 for part in parts], dtype=torch.int32, device=parts[0].device)
    dist.all_reduce(wide, op=dist.ReduceOp.MAX, group=group)
    parts = [part.double() if flag else part for part, flag in zip(parts, wide.tolist())]
    counts = [leaf_range(total, world, r) for r in range(world)]
    width = max(stop - start for start, stop in counts)
    out = []
    for part in parts:
        padded = part.new_zeros(part.shape[0], width)
        padded[:, : part.shape[1]] = part
        if all_ranks:
            pieces = [torch.empty_like(padded) for _ in range(world)]
            dist.all_gather(pieces, padded, group=group)
        else:
            pieces = [torch.empty_like(padded) for _ in range(world)] if rank == 0 else None
            dist.gather(padded, pieces, dst=dist.get_global_rank(group, 0), group=group)
        if pieces is not None:
            out.append(torch.cat([p[:, : stop - start] for p, (start, stop) in zip(pieces, counts)], dim=1))
    return out if (all_ranks or rank == 0) else None
