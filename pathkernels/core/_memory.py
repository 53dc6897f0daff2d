"""Memory: how much a device has free, and byte counts as messages print them."""

from __future__ import annotations

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


def format_bytes(count: int) -> str:
    """``count`` bytes for a message: "512 bytes", "24.0 KiB", "3.50 GiB"."""
    if count < 1024:
        return f"{count:,} bytes"
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.2f} {unit} ({count:,} bytes)"
    raise AssertionError
