"""Padded batches: evaluate each batch element on its real tokens only.

A padded batch holds sequences of different lengths in one ``[B, n]`` grid; ``token_mask [B, n]``
(True = a real token, as Hugging Face's ``attention_mask``) says which positions are real. Padded
queries get rows that sum to 1 as well (GPT-2 spreads them uniformly over every position), so
nothing in the attention itself marks them, and they would enter every path product as if they
were tokens. Restricted to its real tokens, a sequence's attention is row-stochastic again: real
queries give padded keys zero weight.

The functions here group the batch elements by their mask (a batch of right-padded sequences of
three lengths is three groups), so that each group runs as one batched call on its real tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class MaskGroup:
    """Batch elements that share one mask: ``batch [G]`` indices and their real ``tokens [n_real]``."""

    batch: Tensor
    tokens: Tensor


def check_token_mask(token_mask, batch: int, n: int, device: torch.device, where: str) -> Tensor | None:
    """``token_mask`` as a bool ``[B, n]`` tensor on ``device``, or None when every token is real.

    Accepts bool masks and 0/1 masks of any real dtype (Hugging Face's ``attention_mask``); every
    batch element must keep at least one token.
    """
    if token_mask is None:
        return None
    if not isinstance(token_mask, Tensor):
        raise TypeError(f"{where}: expected token_mask to be a torch.Tensor [B, n], got {type(token_mask).__name__}")
    check_mask_device(token_mask, where)
    if token_mask.shape != (batch, n):
        raise ValueError(f"{where}: expected token_mask of shape [B, n] = [{batch}, {n}], got {list(token_mask.shape)}")
    if token_mask.dtype != torch.bool:
        if token_mask.is_complex():
            raise TypeError(
                f"{where}: expected token_mask of bools or 0/1 values (1 = a real token), got {token_mask.dtype}"
            )
        if bool(((token_mask != 0) & (token_mask != 1)).any()):
            raise ValueError(
                f"{where}: expected token_mask of bools or 0/1 values (1 = a real token), got "
                f"{token_mask.dtype} values {torch.unique(token_mask)[:5].tolist()}"
            )
        token_mask = token_mask != 0
    empty = ~token_mask.any(-1)
    if bool(empty.any()):
        raise ValueError(
            f"{where}: token_mask keeps no token of batch element {int(empty.nonzero()[0])}; every "
            "element needs at least one real token"
        )
    if bool(token_mask.all()):
        return None
    return token_mask.to(device)


def check_mask_device(token_mask: Tensor, where: str) -> None:
    """Refuse a mask that holds no values to read (the meta device)."""
    if token_mask.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{where}: expected token_mask on a CPU or CUDA device, got {token_mask.device}")


def batched_mask(token_mask, batched: bool):
    """``token_mask`` of unbatched inputs (``[n]``) as a batch of one; anything else unchanged."""
    return token_mask.unsqueeze(0) if not batched and isinstance(token_mask, Tensor) else token_mask


def mask_groups(token_mask: Tensor) -> Iterator[MaskGroup]:
    """The batch elements of ``token_mask [B, n]`` grouped by identical masks, in first-seen order."""
    patterns, inverse = torch.unique(token_mask.cpu(), dim=0, return_inverse=True)
    order = sorted(range(patterns.shape[0]), key=lambda g: int((inverse == g).nonzero()[0]))
    for g in order:
        batch = (inverse == g).nonzero().flatten().to(token_mask.device)
        yield MaskGroup(batch, patterns[g].nonzero().flatten().to(token_mask.device))


def restrict(t: Tensor, group: MaskGroup, *, batch_dim: int = 0, token_dims: tuple[int, ...] = (-2,)) -> Tensor:
    """``t`` at the group's batch elements (``batch_dim``) and real tokens (each of ``token_dims``)."""
    t = t.index_select(batch_dim, group.batch)
    for dim in token_dims:
        t = t.index_select(dim, group.tokens)
    return t


def per_matrix(fn, x: Tensor, token_mask: Tensor | None, where: str, *, square: bool = False) -> Tensor:
    """``fn(x)`` for a function of matrices ``[..., n, d] -> [...]``, each matrix on its real rows.

    ``token_mask`` broadcasts against ``x.shape[:-1]`` (for hidden states ``[L+1, B, n, d]`` a
    ``[B, n]`` mask). With ``square`` the columns are tokens too (``[..., n, n]``, e.g. attention,
    whose mask must then have ``x.dim() - 1`` dims) and are restricted like the rows.
    """
    if token_mask is None:
        return fn(x)
    if not isinstance(token_mask, Tensor):
        raise TypeError(f"{where}: expected token_mask to be a torch.Tensor, got {type(token_mask).__name__}")
    check_mask_device(token_mask, where)
    if square and token_mask.dim() != x.dim() - 1:
        raise ValueError(
            f"{where}: expected token_mask with {x.dim() - 1} dims for matrices {list(x.shape)} (e.g. [B, 1, 1, n] "
            f"for attention [B, L, H, n, n]), got {list(token_mask.shape)}"
        )
    try:
        mask = torch.broadcast_to(token_mask, x.shape[:-1])
    except RuntimeError:
        raise ValueError(
            f"{where}: expected token_mask to broadcast against the rows {list(x.shape[:-1])} of x, got "
            f"{list(token_mask.shape)}"
        ) from None
    flat_x = x.reshape(-1, *x.shape[-2:])
    flat_mask = check_token_mask(mask.reshape(-1, x.shape[-2]), flat_x.shape[0], x.shape[-2], x.device, where)
    if flat_mask is None:
        return fn(x)
    out = None
    for group in mask_groups(flat_mask):
        part = fn(restrict(flat_x, group, token_dims=(-2, -1) if square else (-2,)))
        if out is None:
            out = part.new_empty(flat_x.shape[0])
        out[group.batch] = part
    return out.reshape(x.shape[:-2])
