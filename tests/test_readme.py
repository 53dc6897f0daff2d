"""The documentation's Python blocks run as written: pasted line by line into an interactive
interpreter, as a reader would, the README's on their own and docs/USAGE.md's in order."""

import math
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
    # Through the MLPs: the certified top paths through heads and transcoder features, as shown.
    shown = re.search(r"^```\n(certified: True.*?)^```", text, flags=re.S | re.M).group(1).strip().splitlines()
    printed = output[output.index("certified: True") :].strip().splitlines()[: len(shown)]
    assert printed[:2] == shown[:2], printed
    for shown_row, printed_row in zip(shown[2:], printed[2:]):
        assert shown_row.rsplit(maxsplit=1)[0] == printed_row.rsplit(maxsplit=1)[0]  # the path
        assert float(printed_row.split()[-1]) == pytest.approx(float(shown_row.split()[-1]), rel=1e-5)
    # The causal check of the paths through features, as shown.
    shown = re.search(r"^```\n(CausalCheck\(2 path.*?)^```", text, flags=re.S | re.M).group(1).strip().splitlines()
    printed = output[output.index("CausalCheck(2 path") :].strip().splitlines()[: len(shown)]
    assert printed[:2] == shown[:2], printed
    for shown_row, printed_row in zip(shown[2:], printed[2:]):
        assert shown_row.split("from embedding")[0] == printed_row.split("from embedding")[0]  # the path
        numbers = [float(v) for v in printed_row.split("from embedding")[1].split()]
        assert numbers == pytest.approx([float(v) for v in shown_row.split("from embedding")[1].split()], abs=0.011)
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


def demo_excerpt() -> list[str]:
    """docs/USAGE.md's excerpt of the demo's output: section 2's table, a blank line, section 5's."""
    text = USAGE.read_text()
    return re.search(r"^```\n(Median residual ratio .*?)^```", text, flags=re.S | re.M).group(1).splitlines()


ROUND_OFF = 1e-12  # the collapse table's values below this are float64's round-off: machine-dependent


def test_usage_shows_the_demos_collapse_table_to_every_printed_digit(monkeypatch, capsys):
    """Section 2 of the demo run again as ``pathkernels demo`` runs it (its networks and inputs from
    fixed seeds): every line docs/USAGE.md shows of it, as printed, but for values at float64's
    round-off, which stay below 1e-12 (docs/USAGE.md says so)."""
    pytest.importorskip("pandas")
    import argparse

    from pathkernels.app.cli import demo

    class SectionTwoDone(Exception):
        pass

    section_two = demo.collapse_table

    def collapse_then_stop(**options):
        section_two(**options)
        raise SectionTwoDone

    monkeypatch.setattr(demo, "collapse_table", collapse_then_stop)
    with pytest.raises(SectionTwoDone):
        demo.run_demo(argparse.Namespace(quick=False, device="cpu", out=None))
    printed = capsys.readouterr().out
    printed = [line.rstrip() for line in printed[printed.index("Median residual ratio") :].splitlines()]
    excerpt = demo_excerpt()
    shown = excerpt[: excerpt.index("")]
    assert len(shown) == 16 and len(printed) >= len(shown), printed  # the heading, two header lines, depths 0-12
    for shown_line, printed_line in zip(shown, printed):
        if shown_line == printed_line:
            continue
        assert len(shown_line.split()) == len(printed_line.split()), (shown_line, printed_line)
        for a, b in zip(shown_line.split(), printed_line.split()):
            assert a == b or max(abs(float(a)), abs(float(b))) < ROUND_OFF, (shown_line, printed_line)


def test_usage_gives_the_sorting_models_numbers_within_the_spread_it_states():
    """Section 5's numbers, which a training run on another machine may change, lie within the
    spread docs/USAGE.md states for them (and the prose's percentage is the table's); its path counts
    are exact: C(3, k) 4^k summed, the paths of a 3-layer, 4-head network of length ≤ k."""
    excerpt = demo_excerpt()
    section = excerpt[excerpt.index("") + 1 :]
    assert re.fullmatch(
        r"trained in \d+ s \(final loss \d\.\d{4}\); exact truncations by pk\.length_sums; k = L is the model itself",
        section[0],
    ), section[0]
    assert section[1].split() == ["max_length", "token_accuracy", "sequence_accuracy", "path_count"]
    rows = [[float(value) for value in line.split()] for line in section[2:]]
    assert [row[0] for row in rows] == [0, 1, 2, 3]
    assert [row[3] for row in rows] == [sum(math.comb(3, j) * 4**j for j in range(k + 1)) for k in range(4)]
    text = " ".join(USAGE.read_text().split())
    spread = re.search(
        r"seen on that VM: (\S+)–(\S+) at k = 0, (\S+)–(\S+) at k = 1, (\S+)–(\S+) for whole sequences at k = 1", text
    )
    low0, high0, low1, high1, low_sequence, high_sequence = spread.groups()
    for value, low, high in (
        (rows[0][1], low0, high0),
        (rows[1][1], low1, high1),
        (rows[1][2], low_sequence, high_sequence),
    ):
        digits = len(low.split(".")[1])
        assert float(low) <= round(value, digits) <= float(high), (value, low, high)
    share = re.search(r"the 13 paths of length ≤ 1 already give (\S+) % token accuracy", text).group(1)
    assert float(share) == round(100 * rows[1][1], 1)
