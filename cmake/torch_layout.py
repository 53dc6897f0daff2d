"""Print the layout of the installed torch as KEY=VALUE lines for CMakeLists.txt.

Run at configure time with the Python that will import the extension, so that the extension is
compiled against exactly that torch.
"""

import os
import re

import torch


def cuda_architectures() -> str:
    """CMake architecture list, "|"-separated (CMakeLists.txt splits the output on ";"):
    TORCH_CUDA_ARCH_LIST if set ("9.0;8.0+PTX", "9.0a"), else the local GPU's, else Hopper (sm_90),
    the cards this project is tuned for."""
    requested = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if requested:
        archs = []
        for item in re.split(r"[;\s]+", requested):
            # An optional a/f suffix names the architecture-specific feature set (sm_90a).
            match = re.fullmatch(r"(\d+)\.(\d+)([af]?)(\+PTX)?", item)
            if not match:
                raise SystemExit(
                    f"TORCH_CUDA_ARCH_LIST: cannot parse {item!r}; expected e.g. '9.0', '9.0a' or '8.0+PTX'"
                )
            major, minor, suffix, ptx = match.groups()
            archs.append(f"{major}{minor}{suffix}" + ("" if ptx else "-real"))
        return "|".join(archs)
    if torch.version.cuda and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}{minor}"
    return "90"


torch_dir = os.path.dirname(torch.__file__)
include = os.path.join(torch_dir, "include")
print(f"TORCH_VERSION={torch.__version__}")
print(f"TORCH_CUDA_VERSION={torch.version.cuda or ''}")
print(f"TORCH_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
print(f"TORCH_LIB_DIR={os.path.join(torch_dir, 'lib')}")
print(f"TORCH_INCLUDE_DIRS={include}|{os.path.join(include, 'torch', 'csrc', 'api', 'include')}")
print(f"TORCH_CUDA_ARCHS={cuda_architectures() if torch.version.cuda else ''}")
