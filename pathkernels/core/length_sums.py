"""Exact sums of the path outputs of each length, by dynamic programming over layers (no
enumeration), and the truncated outputs they give.

The recursion runs in float64 on *scaled* sums: each length's sum is kept as a mantissa whose
largest entry lies in [0.5, 1) times a power of two per batch element, ``S_k = M_k · 2^{e_k}``,
rescaled after every layer. So no intermediate overflows or underflows, whatever the depth and the
scale of the inputs (value maps that grow the stream 50× a layer over 40 layers reach 1e68 and
more), and the result is returned in the inputs' dtype where that dtype holds it; where it does
not, the call is refused, naming the lengths, rather than returning inf, NaN or 0.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pathkernels.core._memory import check_fits
from pathkernels.core._scaling import power_of_two as _power_of_two  # noqa: F401 (tests reach it here)
from pathkernels.core._scaling import times_power_of_two as _times_power_of_two
from pathkernels.core.checks import (
    check_bias,
    check_finite,
    check_flag,
    check_int,
    check_masked_network,
    check_network,
    mask_group_inputs,
)

# The exponent of a mantissa of zeros: below every real one by far, so it never sets a scale, and
# sums with it stay within int64.
_ZERO_EXPONENT = -(1 << 40)


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

    Range: the recursion runs in float64 (for float32 inputs too) on sums scaled by a power of two
    per length and batch element, rescaled every layer (the module docstring), so intermediate
    values never overflow or underflow. Each ``S_k`` is returned to its dtype's precision relative
    to its largest entry (in float32 about 6e-8 where no cancellation intervenes). Where the
    largest entry of some ``S_k`` lies outside the result dtype's normal range (float32: 1.2e-38 to
    3.4e38; float64: 2.2e-308 to 1.8e308), the call raises a ValueError naming the lengths: float32
    would return inf, NaN or 0 there. Pass float64 inputs for float64 sums, or rescale x or the
    value maps (``S_k`` scales as ``x · W^k``).

    The result is differentiable in every input (torch operations throughout; the scales are
    powers of two read from detached values, constants to autograd).

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
        ``[L+1, B, n, d]`` (``[L+1, n, d]`` unbatched) in the inputs' dtype: index k holds the sum
        over paths of length k. Without skip and biases only ``k = L`` is non-zero.

    Raises:
        ValueError: for a sum outside the result dtype's range (above), and for the inputs' checks.
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
    _check_shapes_fit(attn, x, where)  # before any pass over the values (a stride-0 input holds few)
    if token_mask is not None:
        return _masked_length_sums(attn, x, w_v, w_o, b_o, skip, token_mask, where)
    net = check_network(attn, x, w_v, w_o, where)
    if b_o is not None:
        b_o = check_bias(b_o, net, where)
    check_length_sums_fit(net, where)
    mantissas, exponents = _scaled_length_sums(net, b_o, skip)
    sums = _in_dtype(
        mantissas,
        exponents,
        net.x.dtype,
        where,
        lambda ks: f"the sums of the paths of length{'s' if len(ks) > 1 else ''} {_listed(ks)}",
        lambda k, b: f"that of length {k}" + (f" (batch element {b})" if net.batched else ""),
        lambda direction: (
            f"Pass float64 inputs for float64 sums, or scale x or the value maps {direction} (S_k scales as x · W^k)"
        ),
    )
    return sums if net.batched else sums[:, 0]


def _scaled_length_sums(net, b_o: Tensor | None, skip: bool) -> tuple[Tensor, Tensor]:
    """The recursion of :func:`length_sums` in float64 on scaled sums: mantissas ``[L+1, B, n, d]``
    (each length's and batch element's largest entry in [0.5, 1), or all 0) and int64 exponents
    ``[L+1, B]``, ``S_k[b] = M_k[b] · 2^{e_k[b]}``.

    The inputs are scaled alike (x per batch element, w_v, w_o and b_o per layer), so a head's
    products of mantissas stay within ``n · d · d_head`` of 1. A layer's new sum of length k adds
    its terms at their largest exponent ``E`` (a term ``M · 2^e`` enters as ``M · 2^{e − E}``, which
    flushes to 0 only terms below 2^-1074 of the largest), then rescales to a fresh mantissa."""
    attn = net.attn.double()
    x, x_exponent = _normalized(net.x.double(), 2)  # [B, n, d], [B]
    w_v, v_exponent = _normalized(net.w_v.double(), 3)  # [L, H, d, d_head], [L]
    w_o, o_exponent = _normalized(net.w_o.double(), 3)
    if b_o is not None:
        b_o, b_exponent = _normalized(b_o.double(), 1)  # [L, d], [L]
    layers = attn.shape[1]
    zero, zero_exponent = torch.zeros_like(x), torch.full_like(x_exponent, _ZERO_EXPONENT)
    # S_0 .. S_L as lists, updated out of place, so that autograd can follow.
    mantissas = [x] + [zero] * layers
    exponents = [x_exponent] + [zero_exponent] * layers
    for layer in range(layers):
        top = layer + 1  # lengths 0..layer can feed a head at this layer
        # Σ_h A[l, h] (M_k W_V[l, h]) W_O[l, h] for k < top: d_head columns through the n × n maps.
        valued = torch.einsum("kbjd,hde->kbhje", torch.stack(mantissas[:top]), w_v[layer])
        mixed = torch.einsum("bhij,kbhje->kbhie", attn[:, layer], valued)
        heads = torch.einsum("kbhie,hef->kbif", mixed, w_o[layer])  # [top, B, n, d]: lengths 1..top
        terms = [(heads, torch.stack(exponents[:top]) + (v_exponent[layer] + o_exponent[layer]))]
        if skip:
            terms.append((torch.stack(mantissas[1 : top + 1]), torch.stack(exponents[1 : top + 1])))
        largest = torch.stack([exponent for _, exponent in terms]).amax(0)  # [top, B]
        if b_o is not None:  # 1 b_O[l]ᵀ, a path of length 1
            largest = torch.cat([largest[:1].clamp_min(b_exponent[layer]), largest[1:]])
        new = sum(_times_power_of_two(mantissa, exponent - largest) for mantissa, exponent in terms)
        if b_o is not None:
            bias = _times_power_of_two(b_o[layer].expand_as(x), b_exponent[layer] - largest[0])
            new = torch.cat([(new[0] + bias).unsqueeze(0), new[1:]])
        new, shift = _normalized(new, 2)  # [top, B, n, d], [top, B]
        new_exponents = torch.where(shift == _ZERO_EXPONENT, _ZERO_EXPONENT, largest + shift)
        carried = slice(top + 1, None)
        mantissas = (
            ([mantissas[0]] if skip else [zero])
            + list(new.unbind(0))
            + (mantissas[carried] if skip else [zero] * (layers - top))
        )
        exponents = (
            ([exponents[0]] if skip else [zero_exponent])
            + list(new_exponents.unbind(0))
            + (exponents[carried] if skip else [zero_exponent] * (layers - top))
        )
    return torch.stack(mantissas), torch.stack(exponents)


def _normalized(t: Tensor, dims: int) -> tuple[Tensor, Tensor]:
    """``t = mantissa · 2^exponent`` per slice over its last ``dims`` dims: each slice's largest
    |entry| in [0.5, 1) (a slice of zeros stays 0, with exponent ``_ZERO_EXPONENT``). The exponent
    (int64, ``t``'s leading shape) comes from detached values: a constant to autograd."""
    reduced = tuple(range(t.dim() - dims, t.dim()))
    if any(t.shape[d] == 0 for d in reduced):  # empty slices (d_head = 0): all zero
        largest = t.new_zeros(t.shape[: t.dim() - dims])
    else:
        largest = t.detach().abs().amax(dim=reduced)
    exponent = torch.frexp(largest).exponent.long()
    exponent = torch.where(largest > 0, exponent, _ZERO_EXPONENT)
    return _times_power_of_two(t, -exponent), exponent


def _in_dtype(mantissas: Tensor, exponents: Tensor, dtype: torch.dtype, where: str, subject, detail, advice: str):
    """``mantissas [K, B, n, d] · 2^exponents [K, B]`` as a ``dtype`` tensor, refused (ValueError)
    where the largest entry of some slice ``[k, b]`` lies outside ``dtype``'s normal range: above its
    largest finite number, or below its smallest normal number, where the slice would be lost to 0
    or keep only some of its digits. For the message: ``subject(ks)`` names the slices of indices
    ``ks`` along K, ``detail(k, b)`` one slice, and ``advice(direction)`` the way round."""
    info = torch.finfo(dtype)
    largest = mantissas.detach().abs().amax(dim=(-2, -1))  # [K, B]: in [0.5, 1), or 0
    result = _times_power_of_two(mantissas, exponents).to(dtype)
    nonzero = largest > 0
    over = nonzero & ((exponents > math.frexp(info.max)[1]) | ~torch.isfinite(result.detach()).all(-1).all(-1))
    under = nonzero & (exponents < math.frexp(info.tiny)[1])
    name = str(dtype).removeprefix("torch.")
    for bad, limit, words in (
        (over, info.max, ("exceed", "largest finite number", "reaches", "inf or NaN", "down")),
        (under, info.tiny, ("lie below", "smallest normal number", "reaches only", "0 or lose digits", "up")),
    ):
        if bool(bad.any()):
            verb, edge, reaches, lost, direction = words
            log10 = (largest.log10() + exponents * math.log10(2)).masked_fill(~bad, math.nan)
            k, b = divmod(int(log10.abs().nan_to_num(-1.0).argmax()), bad.shape[1])
            ks = sorted({int(i) for i in bad.nonzero()[:, 0].tolist()})
            raise ValueError(
                f"{where}: {subject(ks)} {verb} {name}'s {edge} ({limit:.2g}): {detail(k, b)} {reaches} about "
                f"{_power_of_ten(float(log10[k, b]))}, where {name} would hold {lost}. {advice(direction)}"
            )
    return result


def _power_of_ten(log10: float) -> str:
    """``10^log10`` as "1.3e+68", whatever its size."""
    exponent = math.floor(log10)
    mantissa = round(10 ** (log10 - exponent), 1)
    if mantissa >= 10:
        mantissa, exponent = 1.0, exponent + 1
    return f"{mantissa:.1f}e{exponent:+03d}"


def _listed(ks: list[int]) -> str:
    """``[3, 4, 5, 9]`` (sorted) as "3–5, 9"."""
    runs = []
    for k in ks:
        if runs and k == runs[-1][1] + 1:
            runs[-1][1] = k
        else:
            runs.append([k, k])
    return ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in runs)


def check_length_sums_fit(net, where: str) -> None:
    """Refuse up front work whose largest step would not fit the device's memory: at the last layer
    ``[L, B, H, n, d]`` of mixed sums, beside ``[L+1, B, n, d]`` sums in two copies (the step's
    output and its stacking), all in float64 (the recursion's dtype), and for float32 inputs the
    float32 result."""
    batch, layers, heads, n = net.attn.shape[:4]
    _check_fit(batch, layers, heads, n, net.x.shape[-1], net.x.dtype, net.attn.device, where)


def _check_fit(batch: int, layers: int, heads: int, n: int, d: int, dtype: torch.dtype, device, where: str) -> None:
    result = 0 if dtype == torch.float64 else (layers + 1) * batch * n * d * 4
    # The checks of the values read every entry once more (finiteness, row sums: a bool and a
    # float64 copy of attn, ``B·L·H·n²`` entries), which a stride-0 input does not hold either.
    checks = 9 * batch * layers * heads * n * n
    check_fits(
        (layers * heads + 3 * (layers + 1)) * batch * n * d * 8 + result + checks,
        device,
        where,
        f"{layers} layers × {heads} heads of [B, n, d] = [{batch}, {n}, {d}] sums need about",
        "pass fewer tokens or a smaller batch (the batch elements are independent)",
    )


def _check_shapes_fit(attn, x, where: str) -> None:
    """:func:`check_length_sums_fit` from the shapes alone, before :func:`check_network` reads the
    values: inputs of the expected ranks only (the others are refused by the checks that follow)."""
    if not (isinstance(attn, Tensor) and isinstance(x, Tensor) and (attn.dim(), x.dim()) in ((5, 3), (4, 2))):
        return
    if attn.device.type not in ("cpu", "cuda"):
        return
    batch, layers, heads, n = (attn.shape if attn.dim() == 5 else (1, *attn.shape))[:4]
    _check_fit(batch, layers, heads, n, x.shape[-1], x.dtype, attn.device, where)


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

    Summed in float64, each batch element scaled by a power of two of its own, so that elements of
    any scales keep their digits and a sum beyond the range of ``sums``' dtype is refused
    (ValueError, as in :func:`length_sums`) rather than returned as inf, NaN or 0. Differentiable.

    Args:
        sums: ``[L+1, B, n, d]`` (or ``[L+1, n, d]``), as :func:`length_sums` returns them.
        max_length: an int ``>= 0``; lengths above L add nothing.

    Returns:
        ``[B, n, d]`` (or ``[n, d]``), in ``sums``' dtype.
    """
    where = "pathkernels.truncated_output"
    if not isinstance(sums, Tensor) or sums.dim() not in (3, 4) or sums.shape[0] == 0:
        raise ValueError(
            f"{where}: expected sums [L+1, B, n, d] or [L+1, n, d] from pk.length_sums, got "
            f"{list(sums.shape) if isinstance(sums, Tensor) else type(sums).__name__}"
        )
    if not sums.dtype.is_floating_point:
        raise TypeError(
            f"{where}: expected sums of a floating-point dtype (pk.length_sums gives them), got {sums.dtype}"
        )
    if sums.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{where}: expected sums on a CPU or CUDA device, got {sums.device}")
    max_length = check_int(max_length, "max_length", where, minimum=0)
    check_finite(sums, "sums", where)
    kept = sums[: max_length + 1]
    if sums.numel() == 0:
        return kept.sum(0)
    batched = sums.dim() == 4
    kept = kept.double() if batched else kept.double().unsqueeze(1)  # [K, B, n, d]
    # One power of two per batch element, over its lengths (|entries| < 1): the elements' scales are
    # their own, so one of 1e-300 beside one of 1e300 keeps its digits.
    scaled, scale = _normalized(kept.transpose(0, 1).flatten(1), 1)  # [B, K·n·d], [B]
    total = scaled.reshape(kept.transpose(0, 1).shape).sum(1)  # [B, n, d], at most L + 1 in size
    mantissas, shift = _normalized(total, 2)  # a fresh scale per batch element
    exponents = torch.where(shift == _ZERO_EXPONENT, _ZERO_EXPONENT, shift + scale)
    out = _in_dtype(
        mantissas.unsqueeze(0),
        exponents.unsqueeze(0),
        sums.dtype,
        where,
        lambda ks: f"the output of the paths of length ≤ {max_length}",
        lambda k, b: f"batch element {b}" if batched else "it",
        lambda direction: f"Pass float64 sums (length_sums of float64 inputs), or scale the inputs {direction}",
    )[0]
    return out if batched else out[0]
