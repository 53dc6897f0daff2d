"""What the Triton kernel tests share: their module imported under Triton's interpreter where there
is no GPU, and the module fixture that skips where neither can run it.

TRITON_INTERPRET=1 is set only while the module imports (Triton reads it when the kernels are
decorated) and restored at once, so that no other test sees it. On a GPU the same tests run the
compiled kernels.
"""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def import_interpreted(name: str):
    """Module ``name``, imported under TRITON_INTERPRET=1 where there is no GPU."""
    if name not in sys.modules and not torch.cuda.is_available():
        previous = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            importlib.import_module(name)
        finally:
            if previous is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = previous
    return importlib.import_module(name)


def kernel_module(name: str, what: str):
    """Module ``name`` for a test (``what``: its kernels, for the skip reason), or a skip: without
    triton, or imported earlier without the interpreter where there is no GPU."""
    pytest.importorskip("triton", reason=f"triton is not installed (pip install triton), which {what} need")
    module = import_interpreted(name)
    if not module.INTERPRETED and not torch.cuda.is_available():
        pytest.skip(f"{name} was imported without TRITON_INTERPRET=1 and there is no GPU")
    return module


ROOT = Path(__file__).resolve().parents[1]


def compiled_for_the_gpu(script: str) -> dict:
    """The JSON that ``script`` prints, run in a fresh interpreter without TRITON_INTERPRET (so that
    Triton compiles its kernels for the GPU, with its own ptxas and no driver), from the checkout."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def printed_without_triton(script: str) -> str:
    """What ``script`` prints in a fresh interpreter in which ``import triton`` fails."""
    script = "import sys; sys.modules['triton'] = None\n" + script
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout
