"""The documentation's Python blocks run as written: pasted line by line into an interactive
interpreter, as a reader would, the README's on their own and docs/USAGE.md's in order."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README, USAGE = ROOT / "README.md", ROOT / "docs" / "USAGE.md"
NOT_RUN = "# under torchrun"  # a block that starts so needs torchrun and GPUs

# Feeds stdin's text to code.InteractiveConsole one line at a time, as a paste into the REPL is fed
# (a compound statement must end with a blank line there), and fails on the first error.
REPL = """
import code, sys, traceback

class Console(code.InteractiveConsole):
    def showsyntaxerror(self, filename=None, **kwargs):
        traceback.print_exc(); sys.exit(1)
    def showtraceback(self):
        traceback.print_exc(); sys.exit(1)

console = Console()
for line in sys.stdin.read().splitlines():
    console.push(line)
console.push("")
"""


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


def environment() -> dict:
    return {**os.environ, "MPLBACKEND": "Agg", "HF_HUB_OFFLINE": "1"}


def test_the_docs_have_python_blocks():
    assert len(python_blocks(README)) >= 1
    blocks = python_blocks(USAGE)
    assert len(blocks) >= 6
    assert sum(block.startswith(NOT_RUN) for block in blocks) == 1


def test_readme_blocks_paste_into_a_python_repl(tmp_path):
    pytest.importorskip("pandas")
    pytest.importorskip("transformers")
    output = paste(python_blocks(README), tmp_path)
    # The first look's table, as the README shows it (to its printed digits, give or take rounding).
    shown = re.search(r"^```\n( length path_count.*?)^```", README.read_text(), flags=re.S | re.M).group(1)
    printed = output[output.index(" length path_count") :]
    rows = [float(v) for line in shown.strip().splitlines()[1:] for v in line.split()]
    got = [float(v) for line in printed.strip().splitlines()[1 : len(shown.strip().splitlines())] for v in line.split()]
    assert got == pytest.approx(rows, rel=1e-5), printed
    # The attribution example's logit difference and its top paths, as shown.
    text = README.read_text()
    shown = re.search(r"^```\n(logit of the predicted token .*?)^```", text, flags=re.S | re.M)
    shown = shown.group(1).strip().splitlines()
    printed = output[output.index("logit of the predicted token ") :].strip().splitlines()[: len(shown)]
    assert printed[0] == shown[0], printed
    for shown_row, printed_row in zip(shown[2:-1], printed[2:-1]):
        assert shown_row.split()[:-2] == printed_row.split()[:-2]  # rank and path
        assert float(printed_row.split()[-2]) == pytest.approx(float(shown_row.split()[-2]), rel=1e-4, abs=2e-6)
    assert printed[-1] == shown[-1]  # the sums by number of heads
    # Where the induction head looks: the score line, and the pairs as shown.
    shown = re.search(r"^```\n(L1H0's score, query .*?)^```", text, flags=re.S | re.M).group(1).strip().splitlines()
    printed = output[output.index("L1H0's score, query ") :].strip().splitlines()[: len(shown)]
    assert printed[0] == shown[0], printed
    for shown_row, printed_row in zip(shown[2:], printed[2:]):
        assert shown_row.split()[:-2] == printed_row.split()[:-2]  # rank and both paths
        assert float(printed_row.split()[-2]) == pytest.approx(float(shown_row.split()[-2]), rel=1e-5)


def test_usage_python_blocks_paste_in_order_into_a_python_repl(tmp_path):
    for module in ("pandas", "matplotlib", "transformers", "transformer_lens"):
        pytest.importorskip(module)
    paste([block for block in python_blocks(USAGE) if not block.startswith(NOT_RUN)], tmp_path)


def test_readme_transformer_lens_blocks_run_alone(tmp_path):
    """The TransformerLens example on its own (tests/test_transformer_lens_versions.py runs this
    against 4.x too)."""
    pytest.importorskip("transformer_lens")
    blocks = [block for block in python_blocks(USAGE) if "transformer_lens" in block]
    assert blocks
    paste(blocks, tmp_path)


def paste(blocks: list[str], tmp_path) -> str:
    """Paste ``blocks`` into a fresh interactive interpreter; its stdout."""
    run = subprocess.run(
        [sys.executable, "-c", REPL],
        input="\n\n".join(blocks),
        cwd=tmp_path,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, f"a documentation block failed, pasted into the REPL:\n{run.stderr[-4000:]}"
    return run.stdout
