"""Exact sums of the path outputs of each length, by dynamic programming over layers (no
enumeration), and the truncated outputs they give."""

from __future__ import annotations

import torch
from torch import Tensor

from pathkernels._memory import check_fits
from pathkernels.checks import check_bias, check_masked_network, check_network, mask_group_inputs
from pathkernels.paths import check_flag, check_int


def length_sums(
    attn: Tensor,
    x: Tensor | None = None,
    w_v: Tensor | None = None,
    w_o: Tensor | None = None,
    *,
    b_o: Tensor | None = None,
    skip: bool = True,
    token_mask: Tensor | None = None,
) -> Tensor:
    """Exact sum of the path outputs of each length, by dynamic programming over layers.

    ``S_k^(l) = [skip] S_k^(l-1) + Σ_h A[l, h] S_{k-1}^(l-1) W_V[l, h] W_O[l, h] + [k = 1] 1 b_O[l]ᵀ``
    with ``S_0^(0) = X``: ``S_k^(L) = Σ_{p : len(p) = k} Y_p``. It costs ``O(L² H)`` matrix products
    and enumerates nothing, so it works when ``(H+1)^L`` is astronomically large.

    With ``b_o``, the output bias of each layer is a path of its own: ``1 b_O[l]ᵀ`` enters at layer
    l as the layer's output and is carried through the later layers like any other path (a head
    maps it to ``A 1 b_Oᵀ W = 1 (b_Oᵀ W)``, since A is row-stochastic). Its length counts layer l
    and every head taken after it. With skip, ``Σ_k S_k`` is then the output of the attention-only
    network ``X_l = X_{l-1} + Σ_h A X_{l-1} W + 1 b_O[l]ᵀ``; without ``b_o`` that of the same
    network with zero biases. A bias path is a matrix of equal rows, so its residual
    ``‖Y − 1μᵀ‖`` is exactly 0: biases shift the tokens, they never spread them apart.

    The result is differentiable in every input (plain torch operations).

    Args:
        attn: ``[B, L, H, n, n]`` (or ``[L, H, n, n]``), row-stochastic, float32 or float64; or an
            :class:`~pathkernels.adapters.AttentionStack`, whose own maps, biases and mask are
            used (``x`` defaults to its first hidden state): ``stack.length_sums(x, skip=skip)``.
            A captured stack (``capture_huggingface_residual``) gives the model's own stream.
        x: ``[B, n, d]`` (or ``[n, d]``); ``w_v``: ``[L, H, d, d_head]``; ``w_o``: ``[L, H, d_head, d]``.
        b_o: ``[L, d]`` output biases with the value biases folded in (``AttentionStack.b_o``), or
            None to leave the bias paths out.
        skip: whether the network has skip connections.
        token_mask: ``[B, n]`` (``[n]`` unbatched), True at real tokens: each batch element is
            computed on its real tokens only, and its padded rows are 0.

    Returns:
        ``[L+1, B, n, d]`` (``[L+1, n, d]`` unbatched): index k holds the sum over paths of length k.
        Without skip and biases only ``k = L`` is non-zero.
    """
    where = "pathkernels.length_sums"
    skip = check_flag(skip, "skip", where)
    if not isinstance(attn, Tensor) and hasattr(attn, "length_sums") and hasattr(attn, "w_v"):  # a stack
        given = [
            name for name, t in (("w_v", w_v), ("w_o", w_o), ("b_o", b_o), ("token_mask", token_mask)) if t is not None
        ]
        if given:
            raise ValueError(
                f"{where}: with an AttentionStack its own w_v, w_o, b_o and token_mask are used; got "
                f"{', '.join(given)} as well (pass x and skip only, or the stack's tensors without the stack)"
            )
        return attn.length_sums(x, skip=skip)
    for name, t in (("x", x), ("w_v", w_v), ("w_o", w_o)):
        if t is None:
            raise ValueError(f"{where}: expected {name}; length sums are sums of path outputs P X W")
    if token_mask is not None:
        return _masked_length_sums(attn, x, w_v, w_o, b_o, skip, token_mask, where)
    net = check_network(attn, x, w_v, w_o, where)
    layers = net.attn.shape[1]
    if b_o is not None:
        b_o = check_bias(b_o, net, where)
    check_length_sums_fit(net, where)
    zero = torch.zeros_like(net.x)
    sums = [net.x] + [zero] * layers  # S_0 .. S_L, each [B, n, d]; out of place, so autograd can follow
    for layer in range(layers):
        attn_l = net.attn[:, layer]  # [B, H, n, n]
        top = layer + 1  # lengths 0..layer can feed a head at this layer
        mixed = torch.einsum("bhij,kbjd->kbhid", attn_l, torch.stack(sums[:top]))  # [k, B, H, n, d]
        heads_out = torch.einsum("kbhid,hde,hef->kbif", mixed, net.w_v[layer], net.w_o[layer])
        carried = sums if skip else [zero] * (layers + 1)
        sums = carried[:1] + [carried[k] + heads_out[k - 1] for k in range(1, top + 1)] + carried[top + 1 :]
        if b_o is not None:
            sums[1] = sums[1] + b_o[layer]  # broadcast over the batch and the n rows: 1 b_O[l]ᵀ
    sums = torch.stack(sums)  # [L+1, B, n, d]
    return sums if net.batched else sums[:, 0]


def check_length_sums_fit(net, where: str) -> None:
    """Refuse up front work whose largest step would not fit the device's memory: at the last layer
    ``[L, B, H, n, d]`` of mixed sums, beside ``[L+1, B, n, d]`` sums in two copies (the step's
    output and its stacking)."""
    batch, layers, heads, n = net.attn.shape[:4]
    d = net.x.shape[-1]
    check_fits(
        (layers * heads + 3 * (layers + 1)) * batch * n * d * net.x.element_size(),
        net.attn.device,
        where,
        f"{layers} layers × {heads} heads of [B, n, d] = [{batch}, {n}, {d}] sums need about",
        "pass fewer tokens or a smaller batch (the batch elements are independent)",
    )


def _masked_length_sums(attn, x, w_v, w_o, b_o, skip: bool, token_mask, where: str) -> Tensor:
    """length_sums of each batch element on its real tokens, zeros on its padded rows."""
    net, mask = check_masked_network(attn, x, w_v, w_o, token_mask, where)
    batched, attn, x, w_v, w_o = net.batched, net.attn, net.x, net.w_v, net.w_o
    if b_o is not None:
        b_o = check_bias(b_o, net, where)
    if mask is None:
        sums = length_sums(attn, x, w_v, w_o, b_o=b_o, skip=skip)
    else:
        sums = x.new_zeros(attn.shape[1] + 1, *x.shape)
        for _, group, group_attn, group_x in mask_group_inputs(net, mask, where):
            part = length_sums(group_attn, group_x, w_v, w_o, b_o=b_o, skip=skip)  # [L+1, G, n_real, d]
            sums[:, group.batch.unsqueeze(1), group.tokens] = part
    return sums if batched else sums[:, 0]


def truncated_output(sums: Tensor, max_length: int) -> Tensor:
    """Output of the paths of length ≤ ``max_length``: ``Σ_{k ≤ max_length} S_k`` from :func:`length_sums`.

    Args:
        sums: ``[L+1, B, n, d]`` (or ``[L+1, n, d]``), as :func:`length_sums` returns them.
        max_length: an int ``>= 0``; lengths above L add nothing.

    Returns:
        ``[B, n, d]`` (or ``[n, d]``).
    """
    where = "pathkernels.truncated_output"
    if not isinstance(sums, Tensor) or sums.dim() < 3:
        raise ValueError(
            f"{where}: expected sums [L+1, B, n, d] or [L+1, n, d] from pk.length_sums, got "
            f"{list(sums.shape) if isinstance(sums, Tensor) else type(sums).__name__}"
        )
    max_length = check_int(max_length, "max_length", where, minimum=0)
    return sums[: max_length + 1].sum(0)
