"""Memory: how much a device has free, and byte counts (and other counts) as messages print them."""

from __future__ import annotations

import math
import numbers

import torch


def available_memory(device: torch.device) -> int | None:
    """Bytes free on ``device`` now: the CUDA allocator's free memory, or the host's available
    physical memory (Linux ``MemAvailable``); None where that cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_fits(
    need: int, device: torch.device, where: str, needs: str, advice: str, *, error: type[Exception] = ValueError
) -> None:
    """Raise ``error`` before any work when ``need`` bytes exceed what ``device`` has free, as
    "{where}: {needs} {need}, more than the {available} available on {device}; {advice}"."""
    available = available_memory(device)
    if available is not None and need > available:
        raise error(
            f"{where}: {needs} {format_bytes(need)}, more than the {format_bytes(available)} available on {device}; "
            f"{advice}"
        )


FREE_SHARE = 2  # a budget left to the machine is 1/FREE_SHARE of the memory free when the work starts


def working_budget(memory_budget, device: torch.device, where: str, fallback: int) -> tuple[int, str]:
    """``(bytes, how it was chosen)`` for a function's ``memory_budget`` argument: a positive int
    as given, or None for half the memory free on ``device`` now (``fallback`` where that cannot
    be read). The text names it in a refusal: ``"memory_budget=1,000"`` or ``"memory_budget (half
    the 12.00 GiB available on cpu)"``."""
    if memory_budget is not None:
        if isinstance(memory_budget, bool) or not isinstance(memory_budget, numbers.Integral) or memory_budget < 1:
            raise ValueError(
                f"{where}: expected memory_budget to be a positive int or None, got {shown(memory_budget)}"
            )
        return int(memory_budget), f"memory_budget={int(memory_budget):,}"
    available = available_memory(device)
    if available is None:
        return fallback, f"memory_budget (by default {format_bytes(fallback)})"
    named = f"memory_budget (by default half the {format_bytes(available)} available on {device})"
    return available // FREE_SHARE, named


def format_bytes(count: int) -> str:
    """``count`` bytes for a message: "512 bytes", "24.0 KiB", "3.50 GiB"; counts beyond any
    memory (2^80 bytes and more) as :func:`format_count` writes them."""
    if count < 1024:
        return f"{count:,} bytes"
    if count >= 1 << 80:  # a yobibyte: no memory holds it, and its TiB would not fit a float
        return f"{format_count(count)} bytes"
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.2f} {unit} ({count:,} bytes)"
    raise AssertionError


def format_count(count: int) -> str:
    """An exact int for a message: ``"23,298,085,122,481"`` up to 100 digits, ``"about 1.23·10^4,300"``
    beyond (Python refuses to write an int of more than 4,300 digits, and such a count is read by
    its size). Anything else as ``repr`` gives it."""
    if isinstance(count, bool) or not isinstance(count, numbers.Integral):
        return repr(count)
    count = int(count)
    if abs(count) < 10**100:
        return f"{count:,}"
    bits = abs(count).bit_length()
    exponent10 = math.log10(abs(count) >> (bits - 64)) + (bits - 64) * math.log10(2)
    power = math.floor(exponent10)
    mantissa = 10 ** (exponent10 - power)
    if mantissa >= 9.995:  # rounds up to 10.00
        mantissa, power = 1.0, power + 1
    return f"{'-' if count < 0 else ''}about {mantissa:.2f}·10^{power:,}"


def shown(value, limit: int = 200) -> str:
    """``value`` for a message: ``repr``, cut to ``limit`` characters; an int by :func:`format_count`
    beyond 100 digits (``repr`` of an int of more than 4,300 digits raises)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and abs(int(value)) >= 10**100:
        return format_count(value)
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"
