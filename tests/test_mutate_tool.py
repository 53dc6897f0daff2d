"""tools/mutate.py on small synthetic modules: its operators, its invalid mutants, its test seed and
its check that the tests import the mutated copy (no transformers, no extension needed)."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("pathkernels_mutate_tool", ROOT / "tools" / "mutate.py")
mutate = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = mutate  # dataclasses look their module up there
_spec.loader.exec_module(mutate)


def edits(source: str, kind: str | None = None) -> set[tuple[str, str]]:
    """The (original, replacement) pairs of the mutants of ``source`` (of one kind)."""
    mutants, _ = mutate.find_mutants(textwrap.dedent(source).encode())
    return {(m.original, m.replacement) for m in mutants if kind is None or m.kind == kind}


def mutated(source: str, kind: str) -> set[str]:
    """The mutated function bodies' changed lines, for the mutants of one kind."""
    source = textwrap.dedent(source).encode()
    mutants, _ = mutate.find_mutants(source)
    lines = []
    for mutant in mutants:
        if mutant.kind == kind:
            lines.append(mutate.apply(source, mutant).decode().splitlines()[mutant.line - 1].strip())
    return set(lines)


def test_integer_constants():
    source = """
        def f(x):
            return x[3] + 0
    """
    assert edits(source, "constant") == {("3", "4"), ("3", "2"), ("3", "0"), ("0", "1"), ("0", "-1")}


def test_float_constants():
    source = """
        def f(x):
            return 0.5 * x, x + 0.0, 1e-05 * x
    """
    assert edits(source, "constant") == {
        ("0.5", "1.0"),
        ("0.5", "0.25"),
        ("0.5", "0.0"),
        ("0.0", "1.0"),
        ("1e-05", "2e-05"),
        ("1e-05", "5e-06"),
        ("1e-05", "0.0"),
    }


def test_axes():
    source = """
        def f(x, torch, F):
            a = x.sum(dim=-1)
            b = torch.softmax(x, 0)
            c = x.mean(1, keepdim=True)
            d = x.norm(2, -2)
            e = torch.linalg.norm(x, 2, -1)
            g = torch.stack([x, x], axis=2)
            h = F.log_softmax(x, dim=-3)
            i = x.amax(d)  # not a literal: no axis mutant
            return a
    """
    assert mutated(source, "axis") == {
        "a = x.sum(dim=-2)",
        "b = torch.softmax(x, 1)",
        "c = x.mean(0, keepdim=True)",
        "d = x.norm(2, -1)",
        "e = torch.linalg.norm(x, 2, -2)",
        "g = torch.stack([x, x], axis=1)",
        "h = F.log_softmax(x, dim=-2)",
    }


def test_dropped_terms():
    source = """
        def f(a, b, c):
            return (a + b) * c - a * b
    """
    assert edits(source, "term dropped") == {
        ("(a + b) * c - a * b", "((a + b) * c)"),
        ("(a + b) * c", "(a + b)"),
        ("a + b", "a"),
        ("a * b", "a"),
    }
    for mutant in mutate.find_mutants(textwrap.dedent(source).encode())[0]:
        assert mutate.compiles(mutate.apply(textwrap.dedent(source).encode(), mutant))


def test_no_duplicates_and_no_identity():
    source = textwrap.dedent(
        """
        def f(n):
            return n - 1
        """
    ).encode()
    mutants, _ = mutate.find_mutants(source)
    outputs = [mutate.apply(source, m) for m in mutants]
    assert len(outputs) == len(set(outputs)) and source not in outputs
    # n - 1 -> n is found as an off-by-one and as a dropped term: it counts once
    assert [m.kind for m in mutants if m.replacement == "n"] == ["off by one"]


def test_syntax_error_mutants_are_invalid():
    # a real case (core/triton_norms.py): ``max(0, x).bit_length()`` -> ``0.bit_length()``
    source = textwrap.dedent(
        """
        def width(k):
            return max(0, k).bit_length()
        """
    ).encode()
    mutants, _ = mutate.find_mutants(source)
    invalid = [m for m in mutants if not mutate.compiles(mutate.apply(source, m))]
    assert [(m.kind, m.replacement) for m in invalid] == [("max bound dropped", "0")]


def _package(root: Path, tests_folder: str = "tests") -> None:
    """A package ``pkg`` with ``width``, and tests of it that pass only with the test seed 7."""
    (root / "pkg").mkdir()
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "mod.py").write_text("def width(k):\n    return max(0, k).bit_length()\n")
    (root / tests_folder).mkdir(exist_ok=True)
    (root / tests_folder / "test_mod.py").write_text(
        textwrap.dedent(
            """
            import os

            from pkg.mod import width


            def test_seed():
                assert os.environ["PATHKERNELS_TEST_SEED"] == "7"


            def test_width():
                assert width(5) == 3 and width(0) == 0


            def test_hypothesis_seed_and_examples():
                try:
                    from hypothesis import core
                    from hypothesis.configuration import storage_directory
                except ImportError:
                    return
                assert core.global_force_seed == 7
                assert "/hypothesis-" in str(storage_directory("examples", intent_to_write=False).path)
            """
        )
    )


def test_run_reports_invalid_mutants_apart_and_passes_the_seed(tmp_path, capsys):
    _package(tmp_path)
    report = tmp_path / "mutants.json"
    arguments = ["--root", str(tmp_path), "--test-seed", "7", "--json", str(report)]
    code = mutate.main([str(tmp_path / "pkg" / "mod.py"), *arguments, "--", "tests/test_mod.py"])
    output = capsys.readouterr().out
    assert code == 0, output
    result = json.loads(report.read_text())
    outcomes = {(r["replacement"], r["outcome"]) for r in result["results"]}
    # max(0, k) -> k and max(-1, k) agree with max(0, k) at 5 and 0; max(1, k) does not
    assert outcomes == {("k", "survived"), ("-1", "survived"), ("1", "killed"), ("0", "invalid")}
    assert (result["mutants"], result["invalid"], result["run"], result["killed"], result["survived"]) == (
        4,
        1,
        3,
        1,
        2,
    )
    assert result["kill_rate"] == pytest.approx(1 / 3)  # the invalid mutant is not in it
    assert result["test_seed"] == 7
    assert "test seed 7" in output and "1 invalid" in output
    assert str(tmp_path) not in output.split("the tests import ")[1].split(";")[0]  # the copy, not the original


def test_wrong_seed_fails_the_baseline(tmp_path, capsys):
    _package(tmp_path)
    code = mutate.main([str(tmp_path / "pkg" / "mod.py"), "--root", str(tmp_path), "--", "tests/test_mod.py"])
    assert code == 2
    assert "do not pass on the unmutated code (failed, test seed 0)" in capsys.readouterr().err


def test_refuses_tests_that_import_the_original(tmp_path, capsys):
    # tests beside the package: pytest puts their folder, which holds the original, first on sys.path
    _package(tmp_path, tests_folder=".")
    code = mutate.main(
        [str(tmp_path / "pkg" / "mod.py"), "--root", str(tmp_path), "--test-seed", "7", "--", "test_mod.py"]
    )
    assert code == 2
    error = capsys.readouterr().err
    assert error.startswith("refused:") and f"pkg.mod ({tmp_path / 'pkg' / 'mod.py'})" in error


def test_runner_takes_out_an_import_hook(tmp_path, monkeypatch):
    """An import hook installed at startup (as an editable install's .pth does: here through a
    sitecustomize) that maps the package to the original gives way to the copy."""
    _package(tmp_path)
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(
        textwrap.dedent(
            f"""
            import importlib.util, sys

            class Editable:
                def find_spec(self, name, path=None, target=None):
                    if name == "pkg":
                        return importlib.util.spec_from_file_location(
                            name, {str(tmp_path / "pkg" / "__init__.py")!r},
                            submodule_search_locations=[{str(tmp_path / "pkg")!r}])

            sys.meta_path.insert(0, Editable())
            """
        )
    )
    copy_folder = tmp_path / "copy"
    copy_folder.mkdir()
    mutate.package_copy(tmp_path / "pkg" / "mod.py", copy_folder)
    probe = [sys.executable, "-c", "import pkg; print(pkg.__file__)"]
    environment = {**os.environ, "PYTHONPATH": str(hooks)}
    hooked = subprocess.run(probe, cwd=copy_folder, env=environment, capture_output=True, text=True, check=True)
    assert hooked.stdout.strip() == str(tmp_path / "pkg" / "__init__.py")  # the hook wins over the copy
    monkeypatch.setenv("PYTHONPATH", str(hooks))
    status, _ = mutate.run_tests(["tests/test_mod.py"], copy_folder, "pkg", 7, 60, cwd=tmp_path)
    assert status == "passed"
    assert json.loads((copy_folder / "report.json").read_text())["file"] == str(copy_folder / "pkg" / "__init__.py")
