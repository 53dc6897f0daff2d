"""Loading of the compiled extension, with errors that say how to rebuild it."""

from __future__ import annotations

import torch

REBUILD_HINT = (
    "Rebuild pathkernels against the installed torch: `make build` in a checkout (or "
    "`PYTHON=$(which python) make build` for an existing environment), or "
    "`pip install --no-build-isolation --no-deps --force-reinstall .` from the source tree."
)


def check_build_info(info: dict, torch_version: str = torch.__version__) -> dict:
    """Raise ImportError unless the binary was built against ``torch_version``."""
    built = info.get("torch_version")
    if built != torch_version:
        raise ImportError(
            f"pathkernels: the compiled extension was built against torch {built}, but torch "
            f"{torch_version} is installed. {REBUILD_HINT}"
        )
    return info


_BUILD_INFO: dict | None = None


def load() -> dict:
    """Import ``pathkernels._C`` (which registers ``torch.ops.pathkernels``) and check it, once."""
    global _BUILD_INFO
    if _BUILD_INFO is None:
        try:
            from pathkernels import _C
        except ImportError as error:
            raise ImportError(
                f"pathkernels: the compiled extension pathkernels._C could not be loaded ({error}). {REBUILD_HINT}"
            ) from error
        _BUILD_INFO = check_build_info(dict(_C.build_info()))
    return _BUILD_INFO


def build_info() -> dict:
    """How the compiled extension was built.

    Returns a dict with ``torch_version`` (the torch it was compiled against), ``cuda`` (whether
    the CUDA kernels are built), ``cuda_version`` and ``cuda_architectures`` (CMake's list).
    """
    return dict(load())


def has_cuda_kernels() -> bool:
    """Whether the CUDA kernels are built (not whether a GPU is present)."""
    return bool(load()["cuda"])
