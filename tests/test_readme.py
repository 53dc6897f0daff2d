"""The README's Python blocks run as written: pasted in order into a fresh interpreter."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
NOT_RUN = "# under torchrun"  # a block that starts so needs torchrun and GPUs


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_the_readme_has_python_blocks():
    blocks = python_blocks()
    assert len(blocks) >= 6
    assert sum(block.startswith(NOT_RUN) for block in blocks) == 1


def test_readme_python_blocks_run_in_order_in_a_fresh_interpreter(tmp_path):
    for module in ("pandas", "matplotlib", "transformers", "transformer_lens"):
        pytest.importorskip(module)
    run_blocks([block for block in python_blocks() if not block.startswith(NOT_RUN)], tmp_path)


def test_readme_transformer_lens_blocks_run_alone(tmp_path):
    """The TransformerLens example on its own (tests/test_transformer_lens_versions.py runs this
    against 4.x too)."""
    pytest.importorskip("transformer_lens")
    blocks = [block for block in python_blocks() if "transformer_lens" in block]
    assert blocks
    run_blocks(blocks, tmp_path)


def run_blocks(blocks: list[str], tmp_path) -> None:
    script = "\n\n".join(f"# --- README block {i}\n{block}" for i, block in enumerate(blocks))
    path = tmp_path / "readme_blocks.py"
    path.write_text(script)
    env = {**os.environ, "MPLBACKEND": "Agg", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, f"a README block failed:\n{run.stderr[-4000:]}"
