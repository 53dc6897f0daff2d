"""A mutation check: do the tests notice when one token of the code changes?

    python tools/mutate.py pathkernels/core/paths.py --function count_paths --limit 40 --seed 0 \\
        --test-seed 0 -- tests/test_paths.py -k count

applies single-token mutations, one at a time, to the functions of one module, runs the given
pytest arguments against each mutant (with a per-mutant timeout), and reports the mutants that
survive: changes no test noticed. The mutations (each located exactly through the module's AST,
and applied as a text edit of that expression):

- a comparison flipped: ``<`` ↔ ``<=``, ``>`` ↔ ``>=``, ``==`` ↔ ``!=``;
- an operator swapped: ``+`` ↔ ``-``; an off-by-one dropped: ``n - 1`` → ``n``, ``n + 1`` → ``n``;
- a term dropped: ``a + b``, ``a - b`` and ``a * b`` → ``a``;
- a bound dropped: ``min(a, b)`` / ``max(a, b)`` → one argument, ``x.clamp_min(v)`` /
  ``x.clamp_max(v)`` → ``x``;
- a constant changed: an integer ``k`` → ``k + 1``, ``k - 1`` and ``0``; a float ``x`` → ``2x``,
  ``x/2`` and ``0.0`` (``0.0`` → ``1.0``);
- an axis changed: ``dim=k`` / ``axis=k`` in any call, and the positional dim of ``sum``, ``mean``,
  ``amax``, ``amin``, ``norm``, ``softmax`` and ``log_softmax``: ``-1`` ↔ ``-2``, ``0`` ↔ ``1``,
  another ``k`` one step towards the middle;
- a reduction swapped: ``.mean(`` ↔ ``.sum(``;
- a ``raise`` removed (the statement becomes ``pass``).

Two edits that give the same source count once, and an edit that changes nothing not at all.
A mutant whose module no longer compiles is *invalid*: it is listed, never run, and counts
neither as killed nor in the kill rate (``--limit`` samples among the valid ones).

The checkout is never modified: the package is copied into a temporary folder, whose copy of the
module is mutated and restored after each mutant (in ``try``/``finally``, so also on Ctrl-C,
SIGTERM and a timeout). The tests run in a fresh interpreter with its site-packages as usual
(``.pth`` files included: no ``-S``), started on a small runner script in that folder, so that the
folder comes first on ``sys.path``; the runner takes out the import hooks (``sys.meta_path``
finders, such as an editable install's) that would import the package from elsewhere, and after
the tests checks that every module of the package came from the copy (the run is refused
otherwise: the baseline says so and stops). Others running tests from the same checkout at the
same time never see a mutant. Bytecode is not written, so that two mutants of one size within one
second cannot share a stale ``.pyc``. Tests that start another interpreter (``python -m ...``)
run the checkout's code, not the mutant.

Every run (the baseline and each mutant) gets the same test seed, ``--test-seed`` (default 0):
``PATHKERNELS_TEST_SEED``, which tests/conftest.py gives ``torch.manual_seed``, hypothesis's
``--hypothesis-seed`` where hypothesis is installed (with an example database of its own per run,
so that no run replays another's failures) and ``PYTHONHASHSEED``, so a mutant's verdict can be
reproduced.

A mutant is killed when the tests fail or time out, and survives when they pass; the kill rate is
killed / run. The tests must pass on the unmutated copy first (the baseline), whose time sets the
default timeout. ``--json`` writes every result, the counts, both seeds and the source that was
mutated (with its SHA-256: the checkout may change while the mutants run). Exit code:
0, or 1 when a mutant survives (with ``--fail-on-survivors``), 2 for a bad invocation or a
baseline that fails or does not import the copy.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

COMPARISONS = {ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="), ast.GtE: (">=", ">")}
COMPARISONS |= {ast.Eq: ("==", "!="), ast.NotEq: ("!=", "==")}
OPERATORS = {ast.Add: ("+", "-"), ast.Sub: ("-", "+")}
DROPPED_TERMS = (ast.Add, ast.Sub, ast.Mult)
REDUCTIONS = {"mean": "sum", "sum": "mean"}
# where the dim stands among the positional arguments of a method call (x.sum(-1), x.norm(2, -1));
# one further on when called from a module (torch.sum(x, -1), torch.linalg.norm(x, 2, -1))
POSITIONAL_DIM = {"sum": 0, "mean": 0, "amax": 0, "amin": 0, "softmax": 0, "log_softmax": 0, "norm": 1}
MODULES = {"torch", "F", "functional", "linalg", "np", "numpy", "nn"}
AXIS_KEYWORDS = ("dim", "axis")
# atoms: replacing an operand of this kind by itself needs no parentheses
ATOMS = (ast.Name, ast.Attribute, ast.Call, ast.Subscript, ast.Constant, ast.List, ast.Tuple, ast.Dict, ast.Set)
RUNNER = "_pathkernels_mutate_runner.py"
WRONG_IMPORT = 97  # the runner's exit code when a module of the package came from outside the copy


@dataclass(frozen=True)
class Mutant:
    """One edit: bytes ``start..end`` of the module replaced by ``replacement``."""

    function: str  # the innermost function (or method) holding it, "Class.method"
    line: int
    kind: str
    start: int
    end: int
    original: str
    replacement: str

    @property
    def name(self) -> str:
        def short(text: str) -> str:
            text = " ".join(text.split())
            return repr(text if len(text) <= 60 else text[:57] + "...")

        return f"{self.function}:{self.line} {self.kind}: {short(self.original)} -> {short(self.replacement)}"


def other_axis(axis: int) -> int:
    """Another axis: -1 ↔ -2, 0 ↔ 1, any other one step towards the middle (2 → 1, -3 → -2)."""
    return {-1: -2, -2: -1, 0: 1, 1: 0}.get(axis, axis - 1 if axis > 0 else axis + 1)


def int_literal(node) -> int | None:
    """The value of ``k`` or ``-k`` for an int literal ``k`` (not a bool), else None."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = int_literal(node.operand)
        return None if inner is None else -inner
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    return None


def _module_call(function: ast.Attribute) -> bool:
    """Whether ``function`` is a module's function (``torch.sum``), not a method (``x.sum``)."""
    value = function.value
    while isinstance(value, ast.Attribute):
        if value.attr in MODULES:
            return True
        value = value.value
    return isinstance(value, ast.Name) and value.id in MODULES


class _Finder(ast.NodeVisitor):
    """Collects the mutants of a module's source (``bytes``), inside functions only."""

    def __init__(self, source: bytes):
        self.source = source
        self.line_starts = [0]
        for line in source.splitlines(keepends=True):
            self.line_starts.append(self.line_starts[-1] + len(line))
        self.scope: list[str] = []
        self.functions: list[str] = []
        self.mutants: list[Mutant] = []

    # positions
    def offset(self, line: int, column: int) -> int:
        return self.line_starts[line - 1] + column  # ast columns are UTF-8 byte offsets

    def span(self, node) -> tuple[int, int]:
        return self.offset(node.lineno, node.col_offset), self.offset(node.end_lineno, node.end_col_offset)

    def text(self, start: int, end: int) -> str:
        return self.source[start:end].decode()

    def add(self, node, kind: str, start: int, end: int, replacement: str) -> None:
        if self.scope:
            function = ".".join(self.scope)
            self.mutants.append(Mutant(function, node.lineno, kind, start, end, self.text(start, end), replacement))

    def operator_between(self, left, right, token: str) -> tuple[int, int] | None:
        """Where ``token`` stands between two operands (outside any comment)."""
        start, end = self.span(left)[1], self.span(right)[0]
        segment = self.source[start:end].decode()
        code = re.sub(r"#[^\n]*", lambda m: " " * len(m.group()), segment)
        found = [m.start() for m in re.finditer(re.escape(token), code)]
        found = [
            i
            for i in found
            if code[i + len(token) : i + len(token) + 1] != "=" and (i == 0 or code[i - 1] not in "<>=!")
        ]
        if len(found) != 1:
            return None
        before = len(segment[: found[0]].encode())
        return start + before, start + before + len(token.encode())

    # scopes
    def visit_ClassDef(self, node):
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    def visit_FunctionDef(self, node):
        self.scope.append(node.name)
        self.functions.append(".".join(self.scope))
        for statement in node.body:  # not the defaults or decorators: they run at import
            self.visit(statement)
        self.scope.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    # mutations
    def visit_Compare(self, node):
        operands = [node.left, *node.comparators]
        for op, left, right in zip(node.ops, operands, operands[1:]):
            if type(op) in COMPARISONS:
                token, replacement = COMPARISONS[type(op)]
                where = self.operator_between(left, right, token)
                if where:
                    self.add(node, "comparison", *where, replacement)
        self.generic_visit(node)

    def visit_BinOp(self, node):
        if type(node.op) in OPERATORS:
            token, replacement = OPERATORS[type(node.op)]
            where = self.operator_between(node.left, node.right, token)
            if where:
                self.add(node, "operator", *where, replacement)
            if isinstance(node.right, ast.Constant) and node.right.value == 1 and type(node.right.value) is int:
                start, end = self.span(node)
                self.add(node, "off by one", start, end, self.text(*self.span(node.left)))
        if isinstance(node.op, DROPPED_TERMS):
            # the node's span holds the left operand's own parentheses, which the operand's does not
            start, end = self.span(node)
            left_start, left_end = self.span(node.left)
            left = self.text(left_start, left_end)
            parenthesised = left_start != start or not isinstance(node.left, ATOMS)
            self.add(node, "term dropped", start, end, f"({left})" if parenthesised else left)
        self.generic_visit(node)

    def axis(self, node, where) -> None:
        """``where``, an int literal used as an axis, set to another axis."""
        value = int_literal(where)
        if value is not None:
            self.add(node, "axis", *self.span(where), str(other_axis(value)))

    def visit_Call(self, node):
        function = node.func
        if (
            isinstance(function, ast.Name)
            and function.id in ("min", "max")
            and len(node.args) >= 2
            and not node.keywords
        ):
            start, end = self.span(node)
            for argument in node.args:
                if not isinstance(argument, ast.Starred):
                    self.add(node, f"{function.id} bound dropped", start, end, self.text(*self.span(argument)))
        if isinstance(function, ast.Attribute):
            if function.attr in ("clamp_min", "clamp_max"):
                start, end = self.span(node)
                self.add(node, f"{function.attr} dropped", start, end, self.text(*self.span(function.value)))
            if function.attr in REDUCTIONS:
                end = self.offset(function.end_lineno, function.end_col_offset)
                self.add(node, "reduction", end - len(function.attr), end, REDUCTIONS[function.attr])
        name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
        if name in POSITIONAL_DIM:
            index = POSITIONAL_DIM[name] + (isinstance(function, ast.Attribute) and _module_call(function))
            if index < len(node.args) and not any(isinstance(a, ast.Starred) for a in node.args[: index + 1]):
                self.axis(node, node.args[index])
        for keyword in node.keywords:
            if keyword.arg in AXIS_KEYWORDS:
                self.axis(node, keyword.value)
        self.generic_visit(node)

    def visit_Constant(self, node):
        if type(node.value) not in (int, float):  # not bool, str, complex, bytes
            return
        start, end = self.span(node)
        try:  # the span of a constant in an f-string may be off (before Python 3.12)
            if ast.literal_eval(self.text(start, end)) != node.value:
                return
        except (ValueError, SyntaxError):
            return
        if type(node.value) is int:
            for value in (node.value + 1, node.value - 1, 0):
                self.add(node, "constant", start, end, str(value))
        else:
            x = node.value
            for value in (x * 2, x / 2, 0.0) if x != 0.0 else (1.0,):
                if math.isfinite(value):
                    self.add(node, "constant", start, end, repr(value))

    def visit_Raise(self, node):
        start, end = self.span(node)
        self.add(node, "raise removed", start, end, "pass")
        self.generic_visit(node)


def apply(source: bytes, mutant: Mutant) -> bytes:
    return source[: mutant.start] + mutant.replacement.encode() + source[mutant.end :]


def find_mutants(source: bytes) -> tuple[list[Mutant], list[str]]:
    """Every mutant of ``source`` and the names of its functions: one per distinct mutated source
    (the first found), none that leaves the source as it was, in the order of the source."""
    finder = _Finder(source)
    finder.visit(ast.parse(source))
    seen, mutants = {source}, []
    for mutant in sorted(finder.mutants, key=lambda m: (m.start, -m.end)):
        mutated = apply(source, mutant)
        if mutated not in seen:
            seen.add(mutated)
            mutants.append(mutant)
    return mutants, finder.functions


def compiles(source: bytes, filename: str = "<mutant>") -> bool:
    """Whether ``source`` is still a Python module (a mutant that is not is invalid, never run)."""
    try:
        compile(source, filename, "exec", dont_inherit=True)
    except (SyntaxError, ValueError):  # ValueError: a null byte
        return False
    return True


def package_root(module: Path) -> Path:
    """The top-level package holding ``module``: its highest folder with an ``__init__.py``."""
    package = module.parent
    if not (package / "__init__.py").is_file():
        raise ValueError(f"{module} is not in a package")
    while (package.parent / "__init__.py").is_file():
        package = package.parent
    return package


def package_copy(module: Path, folder: Path) -> Path:
    """The module's top-level package copied into ``folder`` with its compiled extensions (which an
    editable install keeps in site-packages), and the runner beside it; returns the module's copy."""
    package = package_root(module)
    target = folder / package.name
    shutil.copytree(package, target, ignore=shutil.ignore_patterns("__pycache__"))
    site = Path(sysconfig.get_paths()["purelib"]) / package.name
    for extension in list(site.glob("*.so")) + list(site.glob("*.pyd")):
        if not (target / extension.name).exists():
            shutil.copy2(extension, target / extension.name)
    (folder / RUNNER).write_text(RUNNER_SOURCE)
    return target / module.relative_to(package)


# Run as ``python RUNNER PACKAGE SEED REPORT PYTEST_ARGS...`` from the folder that holds the copy: a
# script's folder comes first on sys.path, before PYTHONPATH, site-packages and what .pth files add.
RUNNER_SOURCE = '''"""Runs pytest on the copy of a package beside this file (written by tools/mutate.py)."""

import importlib.machinery
import json
import os
import sys
import tempfile

HERE = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
package, seed, report, arguments = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
COPY = os.path.join(HERE, package)


def inside(path):
    return path is not None and os.path.realpath(path).startswith(COPY + os.sep)


def elsewhere(finder):
    """Whether an import hook (an editable install's, say) would import the package from elsewhere."""
    if finder in (importlib.machinery.PathFinder, importlib.machinery.BuiltinImporter):
        return False
    try:
        spec = finder.find_spec(package, None)
    except Exception:
        return False
    return spec is not None and not inside(spec.origin)


sys.meta_path[:] = [finder for finder in sys.meta_path if not elsewhere(finder)]
import pytest  # noqa: E402


class Seed:
    """Hypothesis's --hypothesis-seed, unless given (as a str: hypothesis ignores a falsy option),
    and an example database of this run's own, so that no run replays another's failures."""

    def __init__(self, examples):
        self.examples = examples

    @pytest.hookimpl(tryfirst=True)
    def pytest_configure(self, config):
        if hasattr(config.option, "hypothesis_seed") and config.option.hypothesis_seed is None:
            config.option.hypothesis_seed = seed
        try:  # here, not before pytest starts: an earlier import keeps pytest from rewriting its asserts
            from hypothesis.configuration import set_hypothesis_home_dir
        except ImportError:
            return
        set_hypothesis_home_dir(self.examples)


with tempfile.TemporaryDirectory(prefix="hypothesis-", dir=HERE) as examples:
    os.environ["HYPOTHESIS_STORAGE_DIRECTORY"] = examples  # hypothesis from 6.1xx; older: Seed sets it
    code = int(pytest.main(arguments, plugins=[Seed(examples)]))
modules = {name: getattr(module, "__file__", None) for name, module in list(sys.modules.items())}
modules = {name: path for name, path in modules.items() if name == package or name.startswith(package + ".")}
foreign = sorted(f"{name} ({path})" for name, path in modules.items() if path is not None and not inside(path))
with open(report, "w") as file:
    json.dump({"file": modules.get(package), "foreign": foreign, "sys.path": sys.path}, file)
if foreign:
    print(f"imported from outside the copy {COPY}: {', '.join(foreign)}", file=sys.stderr)
    sys.exit(WRONG_IMPORT)
sys.exit(code)
'''.replace("WRONG_IMPORT", str(WRONG_IMPORT))


def run_tests(
    pytest_args: list[str],
    folder: Path,
    package: str,
    test_seed: int,
    timeout: float,
    cwd: Path = ROOT,
    log: Path | None = None,
) -> tuple[str, float]:
    """``("passed" | "failed" | "timeout" | "elsewhere", seconds)``: pytest on ``pytest_args`` in a
    fresh interpreter, run in ``cwd`` through the runner in ``folder``, which holds the copy of
    ``package`` (``"elsewhere"``: a module of the package came from outside the copy), with the test
    seed ``test_seed``, killed with its whole process group after ``timeout``. The output goes to
    ``log`` (default: nowhere)."""
    environment = dict(os.environ)
    environment["PYTHONDONTWRITEBYTECODE"] = "1"
    environment["PATHKERNELS_TEST_SEED"] = str(test_seed)
    environment["PYTHONHASHSEED"] = str(test_seed % 2**32)
    report = folder / "report.json"
    report.unlink(missing_ok=True)
    command = [sys.executable, str(folder / RUNNER), package, str(test_seed), str(report)]
    command += ["-x", "-q", "-p", "no:cacheprovider", *pytest_args]
    output = open(log, "wb") if log else subprocess.DEVNULL
    start = time.monotonic()
    try:
        process = subprocess.Popen(
            command, cwd=cwd, env=environment, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return "timeout", time.monotonic() - start
        except BaseException:  # Ctrl-C: stop the tests too, then let the caller restore the module
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise
    finally:
        if log:
            output.close()
    seconds = time.monotonic() - start
    if code == WRONG_IMPORT:
        return "elsewhere", seconds
    return ("passed" if code == 0 else "failed"), seconds


def _interrupted(signum, frame):
    raise KeyboardInterrupt


def _tail(path: Path, lines: int = 25) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools/mutate.py",
        description="Single-token mutations of one module's functions, each run against a subset of the tests.",
    )
    parser.add_argument("module", type=Path, help="the module to mutate, e.g. pathkernels/core/paths.py")
    parser.add_argument("--function", action="append", default=[], help="only this function (repeatable)")
    parser.add_argument("--limit", type=int, help="run this many mutants, sampled among the valid ones (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sample")
    parser.add_argument(
        "--test-seed", type=int, default=0, help="PATHKERNELS_TEST_SEED and hypothesis's seed of every run (default 0)"
    )
    parser.add_argument("--timeout", type=float, help="seconds per mutant (default: 3 × the baseline, at least 30)")
    parser.add_argument("--root", type=Path, default=ROOT, help="where the tests run (default: this checkout)")
    parser.add_argument("--list", action="store_true", help="list the mutants and stop")
    parser.add_argument("--json", type=Path, help="write every result to this file")
    parser.add_argument(
        "--survivors-of", type=Path, help="run only the mutants that survived in this --json file (after new tests)"
    )
    parser.add_argument("--fail-on-survivors", action="store_true", help="exit 1 when a mutant survives")
    parser.usage = "%(prog)s MODULE [options] -- PYTEST_ARGS..."
    argv = sys.argv[1:] if argv is None else list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    args.pytest_args = argv[split + 1 :]  # the tests to run, as pytest takes them
    module = args.module.resolve()
    if not module.is_file() or module.suffix != ".py":
        parser.error(f"{args.module}: expected a Python module")
    try:
        package_root(module)
    except ValueError as error:
        parser.error(str(error))
    source = module.read_bytes()
    mutants, functions = find_mutants(source)
    if args.function:
        unknown = [f for f in args.function if f not in functions]
        if unknown:
            parser.error(f"--function: {', '.join(unknown)} not in {args.module} (it has {', '.join(functions)})")
        mutants = [m for m in mutants if m.function in args.function]
    total = len(mutants)
    invalid = [m for m in mutants if not compiles(apply(source, m), str(module))]
    mutants = [m for m in mutants if m not in invalid]
    if args.survivors_of is not None:
        previous = json.loads(args.survivors_of.read_text())["results"]
        wanted = {(r["start"], r["end"], r["replacement"]) for r in previous if r["outcome"] == "survived"}
        mutants = [m for m in mutants if (m.start, m.end, m.replacement) in wanted]
        if len(mutants) != len(wanted):
            parser.error(f"--survivors-of: {args.survivors_of} does not match {args.module} as it is now")
    elif args.limit is not None and args.limit < len(mutants):
        mutants = sorted(random.Random(args.seed).sample(mutants, args.limit), key=lambda m: m.start)
    if args.list:
        for mutant in mutants:
            print(mutant.name)
        for mutant in invalid:
            print(f"invalid (does not compile): {mutant.name}")
        print(f"{len(mutants)} of {total} mutants; {len(invalid)} invalid")
        return 0
    if not args.pytest_args:
        parser.error("expected the tests to run after --, e.g. -- tests/test_paths.py")

    # SIGTERM as Ctrl-C: the copy is restored, the tests stopped and the temporary folder removed.
    previous_handler = signal.signal(signal.SIGTERM, _interrupted)
    try:
        with tempfile.TemporaryDirectory(prefix="pathkernels-mutants-") as folder:
            copy = package_copy(module, Path(folder))
            log = Path(folder) / "baseline.log"
            package = package_root(module).name
            tests = (args.pytest_args, Path(folder), package, args.test_seed)
            status, baseline = run_tests(*tests, 3600, args.root, log)
            report_file = Path(folder) / "report.json"
            report = json.loads(report_file.read_text()) if report_file.is_file() else {}
            if status == "elsewhere" or (status == "passed" and report.get("file") is None):
                where = "; ".join(report.get("foreign", [])) or "the tests never imported it"
                print(
                    f"refused: the tests must import {package} from its copy in {folder}, but "
                    f"{where} came from elsewhere (sys.path: {report.get('sys.path')})\n{_tail(log)}",
                    file=sys.stderr,
                )
                return 2
            if status != "passed":
                print(
                    f"the tests do not pass on the unmutated code ({status}, test seed {args.test_seed}): "
                    f"nothing to measure\n{_tail(log)}",
                    file=sys.stderr,
                )
                return 2
            timeout = args.timeout or max(30.0, 3 * baseline)
            root = args.root.resolve()
            name = module.relative_to(root) if module.is_relative_to(root) else module
            print(
                f"{name}: {total} mutants, {len(invalid)} invalid (do not compile; not run); running "
                f"{len(mutants)} (sample seed {args.seed}); test seed {args.test_seed}; the tests import "
                f"{report['file']}; baseline {baseline:.1f} s, timeout {timeout:.0f} s",
                flush=True,
            )
            results, start = [], time.monotonic()
            for i, mutant in enumerate(mutants, 1):
                try:
                    copy.write_bytes(apply(source, mutant))
                    status, seconds = run_tests(*tests, timeout, args.root)
                finally:
                    copy.write_bytes(source)  # restored before anything else happens
                if status == "elsewhere":
                    print(f"refused: with {mutant.name}, the package came from outside the copy", file=sys.stderr)
                    return 2
                outcome = {"passed": "survived", "failed": "killed", "timeout": "killed (timeout)"}[status]
                results.append(
                    {**asdict(mutant), "name": mutant.name, "outcome": outcome, "seconds": round(seconds, 1)}
                )
                print(f"[{i}/{len(mutants)}] {outcome:16} {seconds:5.1f} s  {mutant.name}", flush=True)
            elapsed = time.monotonic() - start
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
    survived = [r for r in results if r["outcome"] == "survived"]
    killed = len(results) - len(survived)
    rate = killed / len(results) if results else None
    print(
        f"\n{len(results)} mutants run: {killed} killed, {len(survived)} survived, kill rate "
        f"{'-' if rate is None else f'{100 * rate:.1f} %'}; {len(invalid)} invalid, not run; "
        f"test seed {args.test_seed}; in {elapsed:.0f} s"
    )
    for mutant in invalid:
        print(f"  invalid: {mutant.name}")
    for result in survived:
        print(f"  survived: {result['name']}")
    if args.json:
        results += [{**asdict(m), "name": m.name, "outcome": "invalid", "seconds": 0.0} for m in invalid]
        document = {"module": str(args.module), "sha256": hashlib.sha256(source).hexdigest(), "baseline": baseline}
        document |= {"test_seed": args.test_seed}
        document |= {"sample_seed": args.seed, "pytest_args": args.pytest_args, "mutants": total}
        document |= {"invalid": len(invalid), "run": len(mutants), "killed": killed, "survived": len(survived)}
        document |= {"kill_rate": rate, "results": results}
        document["source"] = source.decode()  # what was mutated: the checkout may have changed since
        args.json.write_text(json.dumps(document, indent=1))
    return 1 if survived and args.fail_on_survivors else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted: the tests stopped, the copy restored and removed; the checkout was never changed")
        sys.exit(130)
