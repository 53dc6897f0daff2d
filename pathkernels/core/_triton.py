"""What the Triton kernel modules (triton_leaf, triton_norms) share on the host side: the optional
import, the interpreter's switch, the decorator, the missing-Triton error, the current device for a
launch, the autotuner's space from the environment and a description of its last choice.

Device functions stay in each kernel module: whether a @jit function runs interpreted is fixed when
it is decorated, and each module is imported under the TRITON_INTERPRET its tests set.
"""

from __future__ import annotations

import contextlib
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the modules still import; their functions say what is missing
    triton = None
    tl = None

__all__ = [
    "config_space",
    "describe_choice",
    "interpreting",
    "jit",
    "on_device",
    "registered_op",
    "require",
    "tl",
    "triton",
]


def interpreting() -> bool:
    """Whether Triton's interpreter is on now: its knob (TRITON_INTERPRET, or set in code)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on", "y")


def jit(fn):
    """triton.jit where Triton is installed; otherwise the bare function, never launched."""
    return fn if triton is None else triton.jit(fn)


def require(op: str) -> None:
    """Raise a clear error, in ``op``'s name, where Triton is not installed."""
    if triton is None:
        raise RuntimeError(f"{op}: needs Triton (pip install triton), which is not installed")


def on_device(device: torch.device):
    """The inputs' GPU as the current device (Triton launches on the current one), or nothing."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def config_space(variable: str, spaces, op: str) -> str:
    """The autotuner's space named by the environment ``variable`` ("full" when unset), one of
    ``spaces``; another name is refused in ``op``'s name."""
    space = os.environ.get(variable, "full")
    if space not in spaces:
        raise ValueError(f"{op}: expected {variable} in {sorted(spaces)}, got {space!r}")
    return space


def describe_choice(tuner) -> dict | None:
    """What ``tuner`` (a triton.autotune, or None) last chose, for the benchmarks: the config and
    every config's time in ms (median), or None before any autotuned launch."""
    best = getattr(tuner, "best_config", None)
    if best is None:
        return None
    timings = getattr(tuner, "configs_timings", None) or {}

    def describe(config):
        return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}

    return {
        "config": describe(best),
        "timings_ms": [{**describe(c), "ms": t[0] if isinstance(t, (list, tuple)) else t} for c, t in timings.items()],
        "bench_s": getattr(tuner, "bench_time", None),
    }


_REGISTERED: dict = {}


def registered_op(name: str, impl, fake, mutates_args=()):
    """``torch.ops.<name>.default`` ("namespace::op"), registered on first use: ``impl`` as a
    torch.library.triton_op (its schema read from impl's signature; ``mutates_args``: the arguments
    it writes) with the fake kernel ``fake``. Later calls return the registered op."""
    if name not in _REGISTERED:
        defined = torch.library.triton_op(name, mutates_args=mutates_args)(impl)
        defined.register_fake(fake)
        namespace, op = name.split("::")
        _REGISTERED[name] = getattr(getattr(torch.ops, namespace), op).default
    return _REGISTERED[name]
