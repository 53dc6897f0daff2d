"""Input checks shared by every layer: the arguments every public function takes (ints, flags), and
the engine's, length sums' and the adapters' tensors.

Every message names the function called, the argument, what was expected and what was got.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from pathkernels.core import masking
from pathkernels.core._extension import has_cuda_kernels
from pathkernels.core._memory import check_fits, shown

# Largest |row sum − 1| accepted as row-stochastic, by the precision the attention was computed in.
# Beyond it the centring identity the engine relies on does not hold, and the inputs are refused.
# (A softmax rounded to a dtype of unit roundoff u sums to 1 within u: 1.1e-16, 6.0e-8, 4.9e-4 and
# 3.9e-3 for these four.)
ROW_SUM_TOLERANCE = {torch.float64: 1e-8, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}

# Inputs in these dtypes are computed in float32: path products of many layers leave their range.
UPCAST = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


@dataclass
class Network:
    """Checked, batched inputs of a path decomposition (attention products when x is None)."""

    attn: Tensor  # [B, L, H, n, n]
    x: Tensor | None  # [B, n, d]
    w_v: Tensor | None  # [L, H, d, d_head]
    w_o: Tensor | None  # [L, H, d_head, d]
    batched: bool
    precision: torch.dtype  # the dtype attn came in (float16 and bfloat16 are computed in float32)

    @property
    def width(self) -> int:
        return self.attn.shape[-1] if self.x is None else self.x.shape[-1]


def first_index(mask: Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in torch.nonzero(mask)[0])


def distinct_view(t: Tensor) -> Tensor:
    """``t`` with each stride-0 dimension (an expanded tensor's repeats) taken once: the same values,
    without the repeats, so that a check of every value costs what the tensor holds, not its size."""
    if all(stride != 0 or size <= 1 for size, stride in zip(t.shape, t.stride())):
        return t
    return t[tuple(slice(0, 1) if stride == 0 else slice(None) for stride in t.stride())]


def check_int(value, name: str, where: str, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as a Python int: any integer type (numpy's too), not bool, within the bounds."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: expected {name} to be an int, got {type(value).__name__} {shown(value)}")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{where}: expected {name} {bounds}, got {shown(value)}")  # str() refuses 4,300 digits
    return value


@contextlib.contextmanager
def named_errors(where: str, *inner: str):
    """Refusals (ValueError, TypeError) of the functions named ``inner`` (``"pathkernels.sample_paths"``)
    raised inside the block, renamed to ``where``: the public function the user called, which built
    the counts, tree or sample on its own account. Other errors pass unchanged."""
    try:
        yield
    except (ValueError, TypeError) as error:
        message = str(error)
        for name in inner:
            if message.startswith(f"{name}:"):
                raise type(error)(f"{where}:{message[len(name) + 1 :]}") from error
        raise


def listed(value):
    """``value`` with a numpy array or a tensor turned into (nested) Python lists, a 0-d one into its
    number, so that every argument that takes ints and lists takes numpy's and torch's too; other
    values unchanged."""
    if isinstance(value, (np.ndarray, Tensor)):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def renamed(where: str, **new_names: str):
    """A decorator: the function takes each old keyword of ``new_names`` (``k="top_k"``) as its new
    name, with a FutureWarning that names both (the API's one vocabulary); both at once are refused."""

    def decorate(function):
        @functools.wraps(function)
        def call(*args, **kwargs):
            for old, new in new_names.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{where}: got both {old}= and {new}=; {old} is the old name of {new}")
                    warnings.warn(
                        f"{where}: {old}= is now called {new}= (one name across pathkernels); {old}= will go",
                        FutureWarning,
                        stacklevel=2,
                    )
                    kwargs[new] = kwargs.pop(old)
            return function(*args, **kwargs)

        return call

    return decorate


def check_flag(value, name: str, where: str) -> bool:
    """``value`` as a bool: True/False (numpy's too), nothing else (a string such as "no" is truthy)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{where}: expected {name} to be True or False, got {type(value).__name__} {shown(value)}")
    return bool(value)


def all_finite(t: Tensor) -> bool:
    """Whether every value of ``t`` is finite: by its least and largest values, which NaN and ±inf
    reach (``torch.aminmax`` propagates NaN), one pass without a boolean copy (25× faster than
    ``torch.isfinite(t).all()`` on a CPU)."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    least, largest = torch.aminmax(distinct_view(t))
    return bool(torch.isfinite(least) & torch.isfinite(largest))


def check_finite(t: Tensor, name: str, where: str) -> None:
    """Raise, naming ``name`` and the first index, unless every value of ``t`` is finite (read once
    per distinct value: an expanded tensor's repeats are not materialised)."""
    if all_finite(t):
        return
    distinct = distinct_view(t)
    bad = ~torch.isfinite(distinct)
    if bool(bad.any()):
        index = first_index(bad)
        raise ValueError(f"{where}: {name} has a non-finite value ({distinct[index].item()}) at index {list(index)}")


def check_row_stochastic(
    attn: Tensor,
    where: str,
    *,
    batch_index: Tensor | None = None,
    padded: bool = False,
    precision: torch.dtype | None = None,
) -> None:
    """Raise unless every row of ``attn [B, L, H, n, n]`` sums to 1 within the tolerance of
    ``precision``: the dtype the pattern was computed in (default attn's own).

    ``batch_index [B]``: for attention restricted to one mask group, the elements' indices in the
    full batch (named in the message); ``padded``: the group's elements have padded tokens, so the
    message says how the mask is to be honoured (and blames no mask otherwise)."""
    precision = attn.dtype if precision is None else precision
    # Coarser patterns are summed in float32, whose vectorised cascade sum errs by ~1e-7 · log n, far
    # inside their tolerance (1e-4 and more), at a twentieth of the cost of a float64 sum; a NaN or
    # inf entry makes its row's sum NaN or inf, so the sums check finiteness too.
    row_sums = attn.sum(-1, dtype=torch.float64 if attn.dtype == torch.float64 else torch.float32)
    deviation = (row_sums - 1).abs()
    bad = ~(deviation <= ROW_SUM_TOLERANCE[precision])  # NaN and inf rows too
    if bool(bad.any()):
        b, layer, h, i = first_index(bad)
        b_full = b if batch_index is None else int(batch_index[b])
        row_sum = attn[b, layer, h, i].sum(dtype=torch.float64).item()
        if not math.isfinite(row_sum):
            element = f"{'real token' if padded else 'row'} {i} of batch element {b_full}"
            cause = (
                "a model's NaN in a fully masked row reaches the real tokens through the next layers' values"
                if padded
                else "NaN or inf in the model's weights or inputs, or a step of its forward pass that overflows"
            )
            raise ValueError(
                f"{where}: attention must be finite, but {element}, layer {layer}, head {h} holds {row_sum} ({cause})"
            )
        error = deviation.max().item()
        if padded:
            hint = (
                "Restricted to the real tokens of token_mask, a real query's row must still sum to 1: its "
                "attention must give padded keys zero weight (pass the model the same attention_mask)."
            )
            element = f"real token {i} of batch element {b_full}"
        else:
            hint = (
                "A lower-precision pattern cast up sums to 1 only to its own precision: renormalise the rows "
                "(attn / attn.sum(-1, keepdim=True)) after the cast, as AttentionStack.to() does."
                if error < 1e-3
                else "Masked or padded queries give zero rows and dropout in training mode rescales them: pass "
                "token_mask (the attention_mask) for a padded batch, or drop those tokens, and take attention "
                "in eval mode."
            )
            element = f"row {i} of batch element {b_full}"
        computed = (
            "" if precision == attn.dtype else f" (computed in {precision}: tolerance {ROW_SUM_TOLERANCE[precision]:g})"
        )
        raise ValueError(
            f"{where}: attention rows must sum to 1 (the centring identity needs P·1 = 1), but {element}, layer "
            f"{layer}, head {h} sums to {row_sum:.9g}{computed}. {hint}"
        )


def renormalise_rows(attn: Tensor, token_mask: Tensor | None = None) -> Tensor:
    """``attn [B, L, H, n, n]`` with each row divided by its sum (rows summing to 0 left as they are).

    With ``token_mask [B, n]`` (bool) a real query's weights on padded keys are zeroed first, so that
    its row sums to 1 on the real tokens. For patterns computed in a coarser dtype than they are
    held in (a float32 softmax in a float64 model), after they were checked to that precision."""
    if token_mask is not None:
        padded_key_of_real_query = token_mask[:, None, None, :, None] & ~token_mask[:, None, None, None, :]
        attn = attn.masked_fill(padded_key_of_real_query, 0)
    sums = attn.sum(-1, keepdim=True)
    return attn / torch.where(sums > 0, sums, torch.ones_like(sums))


def row_stochastic(attn: Tensor, where: str, *, precision: torch.dtype | None = None, **hints) -> Tensor:
    """``attn`` checked by :func:`check_row_stochastic` (``hints``: its batch_index and padded), and
    its rows renormalised when ``precision``, the dtype it was computed in, is coarser than its own."""
    check_row_stochastic(attn, where, precision=precision, **hints)
    return attn if precision in (None, attn.dtype) else renormalise_rows(attn)


def restricted_attention(
    attn: Tensor, group: masking.MaskGroup, where: str, *, precision: torch.dtype | None = None
) -> Tensor:
    """``attn [B, L, H, n, n]`` at one mask group's elements and real tokens, checked row-stochastic
    to ``precision`` (the dtype it was computed in; default attn's own), and renormalised when that
    is coarser than attn's dtype. A group without padding is checked as unmasked attention."""
    restricted = masking.restrict(attn, group, token_dims=(-2, -1))
    padded = group.tokens.numel() < attn.shape[-1]
    return row_stochastic(restricted, where, precision=precision, batch_index=group.batch, padded=padded)


def check_masked_network(attn, x, w_v, w_o, token_mask, where: str) -> tuple[Network, Tensor | None]:
    """check_network for a padded batch, and its ``token_mask`` as a checked bool ``[B, n]`` (None
    when every token is real). attn's values are left to :func:`mask_group_inputs`, which checks
    them on each group's real tokens."""
    net = check_network(attn, x, w_v, w_o, where, attn_values=False)
    batch, n = net.attn.shape[0], net.attn.shape[-1]
    mask = masking.check_token_mask(masking.batched_mask(token_mask, net.batched), batch, n, net.attn.device, where)
    if mask is None and net.precision != net.attn.dtype:  # upcast: check and renormalise here, as unmasked
        net.attn = row_stochastic(net.attn, where, precision=net.precision)
    return net, mask


def validate_inputs(attn, x, w_v, w_o, token_mask, where: str) -> None:
    """Every check :func:`check_masked_network` and :func:`mask_group_inputs` make, attn's values
    included, for a function that hands its inputs on but names itself in the errors."""
    net, mask = check_masked_network(attn, x, w_v, w_o, token_mask, where)
    if mask is None:
        check_finite(net.attn, "attn", where)
        check_row_stochastic(net.attn, where, precision=net.precision)
    else:  # padded tokens' values are not looked at
        for _, _, restricted, _ in mask_group_inputs(net, mask, where):
            check_finite(restricted, "attn", where)


def mask_group_inputs(net: Network, mask: Tensor, where: str):
    """For each group of equal masks in order: ``(index, group, attn, x)``, attn and x restricted
    to the group's elements and real tokens (attn checked row-stochastic there; x None if absent)."""
    for index, group in enumerate(masking.mask_groups(mask)):
        x = None if net.x is None else masking.restrict(net.x, group)
        yield index, group, restricted_attention(net.attn, group, where, precision=net.precision), x


def check_network(attn, x, w_v, w_o, where: str, *, attn_values: bool = True) -> Network:
    """Validate and batch the inputs; every message names the argument, the expected and the got.

    ``attn_values=False`` leaves attn's values unchecked (finite, rows summing to 1): with a token
    mask they are checked on each mask group's real tokens (:func:`restricted_attention`).

    float16 and bfloat16 inputs come back as float32: attn's rows checked to the tolerance of the
    dtype it came in, then renormalised in float32 (``precision`` keeps the dtype it came in)."""
    if not isinstance(attn, Tensor):
        raise TypeError(f"{where}: expected attn to be a torch.Tensor, got {type(attn).__name__}")
    if attn.dim() not in (4, 5):
        raise ValueError(f"{where}: expected attn of shape [B, L, H, n, n] or [L, H, n, n], got {list(attn.shape)}")
    if attn.dtype not in ROW_SUM_TOLERANCE:
        raise TypeError(
            f"{where}: expected attn to be float32 or float64 (float16 and bfloat16 are computed in float32), "
            f"got {attn.dtype}"
        )
    if attn.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{where}: expected attn on a CPU or CUDA device, got {attn.device}")
    batched = attn.dim() == 5
    attn = attn if batched else attn.unsqueeze(0)
    batch, layers, heads, n, n2 = attn.shape
    if n != n2 or n == 0:
        raise ValueError(f"{where}: expected square attention matrices [.., n, n] with n >= 1, got {list(attn.shape)}")
    check_nonempty_batch(attn, where)
    if (x is None) != (w_v is None) or (w_v is None) != (w_o is None):
        raise ValueError(f"{where}: pass x, w_v and w_o together (path outputs) or none of them (attention products)")
    # The checks' and the computations' float64 working copies (row sums, the centred operands): an
    # expanded input of 10^10 entries is copied whole, and would fail in the allocator.
    entries = attn.numel() + (x.numel() if isinstance(x, Tensor) else 0)
    check_fits(
        3 * 8 * entries,
        attn.device,
        where,
        f"attn and x ({entries:,} entries; an expanded input is copied whole) need, in float64 working copies,",
        "pass fewer or shorter sequences",
    )
    tensors = {"attn": attn}
    if x is not None:
        for name, t in (("x", x), ("w_v", w_v), ("w_o", w_o)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{where}: expected {name} to be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != attn.dtype:
                raise TypeError(f"{where}: expected {name} in attn's dtype {attn.dtype}, got {t.dtype}")
        given = list(x.shape)
        expected = f"[B, n, d] = [{batch}, {n}, d]" if batched else f"[n, d] = [{n}, d] (attn has no batch dim)"
        if x.dim() != (3 if batched else 2):
            raise ValueError(f"{where}: expected x of shape {expected}, got {given}")
        x = x if batched else x.unsqueeze(0)
        if x.shape[:2] != (batch, n):
            raise ValueError(f"{where}: expected x of shape {expected}, got {given}")
        d = x.shape[2]
        if d == 0:
            raise ValueError(f"{where}: expected x with at least one column (d >= 1), got {given}")
        if w_v.dim() != 4 or w_v.shape[:3] != (layers, heads, d):
            raise ValueError(
                f"{where}: expected w_v of shape [L, H, d, d_head] = [{layers}, {heads}, {d}, d_head], "
                f"got {list(w_v.shape)}"
            )
        if w_o.shape != (layers, heads, w_v.shape[3], d):
            raise ValueError(
                f"{where}: expected w_o of shape [L, H, d_head, d] = {[layers, heads, w_v.shape[3], d]}, "
                f"got {list(w_o.shape)}"
            )
        tensors.update(x=x, w_v=w_v, w_o=w_o)
    for name, t in tensors.items():
        if t.device != attn.device:
            raise ValueError(f"{where}: expected {name} on attn's device {attn.device}, got {t.device}")
        if name != "attn" or attn_values:
            check_finite(t, name, where)
    precision = attn.dtype
    if precision in UPCAST:
        attn, x, w_v, w_o = (None if t is None else t.to(UPCAST[precision]) for t in (attn, x, w_v, w_o))
    if attn_values:
        attn = row_stochastic(attn, where, precision=precision)
    return Network(attn, x, w_v, w_o, batched, precision)


def check_nonempty_batch(attn: Tensor, where: str) -> None:
    """Raise for attention ``[B, L, H, n, n]`` with no batch element, layer or head: nothing to
    decompose, and every function that decomposes says so alike."""
    if 0 in attn.shape[:3]:
        raise ValueError(
            f"{where}: expected at least one batch element, layer and head in attn [B, L, H, n, n], got "
            f"{list(attn.shape)}"
        )


def check_engine_device(device: torch.device, where: str) -> None:
    if device.type != "cuda":
        return
    if not has_cuda_kernels():
        raise ValueError(
            f"{where}: the inputs are on {device}, but pathkernels was built without its CUDA kernels; "
            "rebuild it against a CUDA torch (PATHKERNELS_CUDA=ON) or move the inputs to CPU"
        )


def check_bias(b_o, net: Network, where: str) -> Tensor:
    """``b_o [L, d]`` checked against the network, in the network's compute dtype."""
    if not isinstance(b_o, Tensor):
        raise TypeError(f"{where}: expected b_o to be a torch.Tensor [L, d], got {type(b_o).__name__}")
    layers, d = net.attn.shape[1], net.x.shape[-1]
    if b_o.shape != (layers, d):
        raise ValueError(f"{where}: expected b_o of shape [L, d] = [{layers}, {d}], got {list(b_o.shape)}")
    if b_o.dtype != net.precision or b_o.device != net.attn.device:
        raise TypeError(
            f"{where}: expected b_o in attn's dtype {net.precision} on {net.attn.device}, got {b_o.dtype} on "
            f"{b_o.device}"
        )
    check_finite(b_o, "b_o", where)
    return b_o.to(net.attn.dtype)


def unpack_stack(attn, x, w_v, w_o, token_mask, where: str):
    """``(attn, x, w_v, w_o, token_mask)``, filled from an AttentionStack passed as ``attn``.

    The stack's ``w_v``/``w_o`` come in only with an ``x`` (path outputs); its ``token_mask`` is the
    default mask. Anything else passes through unchanged. Path outputs of a stack whose model has
    norms and MLPs (``attention_only=False``) warn, as its ``length_sums`` does: they are those of
    the attention-only network its attention layers make. (A stack is recognised by what it holds,
    so that this core module does not import the adapters above it.)"""
    if isinstance(attn, Tensor) or not all(hasattr(attn, name) for name in ("attn", "w_v", "w_o", "token_mask")):
        return attn, x, w_v, w_o, token_mask
    stack = attn
    if not isinstance(stack.attn, Tensor):
        raise ValueError(
            f"{where}: this stack does not hold its patterns (captured with patterns='recomputed'), and the engine "
            "takes them whole; capture with patterns='held', or use the path analyses of its residual capture "
            "(pk.path_attribution, pk.top_paths, pk.score_decomposition), which recompute them a layer at a time"
        )
    if x is not None:
        w_v = stack.w_v if w_v is None else w_v
        w_o = stack.w_o if w_o is None else w_o
        if getattr(stack, "attention_only", None) is False:
            warnings.warn(
                f"{where}: {stack.source or 'this model'} has norms and MLPs, which path outputs P X W_V W_O leave "
                "out: they are those of the attention-only network of its attention layers. For the model's own "
                "paths, capture it (pk.adapters.capture_huggingface_residual) and use stack.length_sums() or "
                "pk.path_attribution",
                UserWarning,
                stacklevel=3,
            )
    return stack.attn, x, w_v, w_o, stack.token_mask if token_mask is None else token_mask
