"""A mutation check: do the tests notice when one token of the code changes?

    python tools/mutate.py pathkernels/core/paths.py --function count_paths --limit 40 --seed 0 \\
        -- tests/test_paths.py -k count

applies single-token mutations, one at a time, to the functions of one module, runs the given
pytest arguments against each mutant (with a per-mutant timeout), and reports the mutants that
survive: changes no test noticed. The mutations (each located exactly through the module's AST,
and applied as a text edit of that token):

- a comparison flipped: ``<`` ↔ ``<=``, ``>`` ↔ ``>=``, ``==`` ↔ ``!=``;
- an operator swapped: ``+`` ↔ ``-``; an off-by-one dropped: ``n - 1`` → ``n``, ``n + 1`` → ``n``;
- a bound dropped: ``min(a, b)`` / ``max(a, b)`` → one argument, ``x.clamp_min(v)`` /
  ``x.clamp_max(v)`` → ``x``;
- a constant changed: ``1`` → ``0`` and ``1`` → ``2``;
- a reduction swapped: ``.mean(`` ↔ ``.sum(``;
- a ``raise`` removed (the statement becomes ``pass``).

The checkout is never modified: the package is copied into a temporary folder, whose copy of the
module is mutated and restored after each mutant (in ``try``/``finally``, so also on Ctrl-C,
SIGTERM and a timeout), and the tests run in a fresh ``python -S`` whose path puts that copy first
(``-S`` keeps an editable install's import hook away, ``-P`` the working folder; site-packages
follow the copy). Others
running tests from the same checkout at the same time never see a mutant. Bytecode is not
written, so that two mutants of one size within one second cannot share a stale ``.pyc``. Tests
that start another interpreter (``python -m ...``) run the checkout's code, not the mutant.

A mutant is killed when the tests fail or time out, and survives when they pass. The tests must
pass on the unmutated copy first (the baseline), whose time sets the default timeout. Exit code:
0, or 1 when a mutant survives (with ``--fail-on-survivors``), 2 for a bad invocation.
"""

from __future__ import annotations

import argparse
import ast
import json
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
REDUCTIONS = {"mean": "sum", "sum": "mean"}


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
        self.generic_visit(node)

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
        self.generic_visit(node)

    def visit_Constant(self, node):
        if type(node.value) is int and node.value == 1:
            start, end = self.span(node)
            if self.text(start, end) == "1":
                self.add(node, "constant", start, end, "0")
                self.add(node, "constant", start, end, "2")

    def visit_Raise(self, node):
        start, end = self.span(node)
        self.add(node, "raise removed", start, end, "pass")
        self.generic_visit(node)


def find_mutants(source: bytes) -> tuple[list[Mutant], list[str]]:
    """Every mutant of ``source`` and the names of its functions."""
    finder = _Finder(source)
    finder.visit(ast.parse(source))
    return finder.mutants, finder.functions


def apply(source: bytes, mutant: Mutant) -> bytes:
    return source[: mutant.start] + mutant.replacement.encode() + source[mutant.end :]


def package_copy(module: Path, folder: Path) -> tuple[Path, str]:
    """The module's top-level package copied into ``folder`` with its compiled extensions (which an
    editable install keeps in site-packages), and the path to put first on ``PYTHONPATH``."""
    relative = module.resolve().relative_to(ROOT)
    package = ROOT / relative.parts[0]
    target = folder / package.name
    shutil.copytree(package, target, ignore=shutil.ignore_patterns("__pycache__"))
    site = Path(sysconfig.get_paths()["purelib"]) / package.name
    for extension in list(site.glob("*.so")) + list(site.glob("*.pyd")):
        if not (target / extension.name).exists():
            shutil.copy2(extension, target / extension.name)
    return folder / relative, str(folder)


def run_tests(pytest_args: list[str], path: str, timeout: float) -> tuple[str, float]:
    """``("passed" | "failed" | "timeout", seconds)``: pytest on ``pytest_args`` in a fresh ``python
    -S -P`` importing from ``path`` first (``-P``: not from the working folder, the checkout),
    killed with its whole process group after ``timeout``."""
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join([path, sysconfig.get_paths()["purelib"]])
    environment["PYTHONDONTWRITEBYTECODE"] = "1"
    command = [sys.executable, "-S", "-P", "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *pytest_args]
    start = time.monotonic()
    process = subprocess.Popen(
        command, cwd=ROOT, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
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
    return ("passed" if code == 0 else "failed"), time.monotonic() - start


def _interrupted(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools/mutate.py",
        description="Single-token mutations of one module's functions, each run against a subset of the tests.",
    )
    parser.add_argument("module", type=Path, help="the module to mutate, e.g. pathkernels/core/paths.py")
    parser.add_argument("--function", action="append", default=[], help="only this function (repeatable)")
    parser.add_argument("--limit", type=int, help="run this many mutants, sampled (default: every one)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sample")
    parser.add_argument("--timeout", type=float, help="seconds per mutant (default: 3 × the baseline, at least 30)")
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
        parser.error(f"{args.module}: expected a Python module of this checkout")
    source = module.read_bytes()
    mutants, functions = find_mutants(source)
    if args.function:
        unknown = [f for f in args.function if f not in functions]
        if unknown:
            parser.error(f"--function: {', '.join(unknown)} not in {args.module} (it has {', '.join(functions)})")
        mutants = [m for m in mutants if m.function in args.function]
    total = len(mutants)
    if args.survivors_of is not None:
        previous = json.loads(args.survivors_of.read_text())["results"]
        wanted = {(r["start"], r["end"], r["replacement"]) for r in previous if r["outcome"] == "survived"}
        mutants = [m for m in mutants if (m.start, m.end, m.replacement) in wanted]
        if len(mutants) != len(wanted):
            parser.error(f"--survivors-of: {args.survivors_of} does not match {args.module} as it is now")
    elif args.limit is not None and args.limit < total:
        mutants = sorted(random.Random(args.seed).sample(mutants, args.limit), key=lambda m: m.start)
    if args.list:
        for mutant in mutants:
            print(mutant.name)
        print(f"{len(mutants)} of {total} mutants")
        return 0
    if not args.pytest_args:
        parser.error("expected the tests to run after --, e.g. -- tests/test_paths.py")

    # SIGTERM as Ctrl-C: the copy is restored, the tests stopped and the temporary folder removed.
    signal.signal(signal.SIGTERM, _interrupted)
    with tempfile.TemporaryDirectory(prefix="pathkernels-mutants-") as folder:
        copy, path = package_copy(module, Path(folder))
        status, baseline = run_tests(args.pytest_args, path, timeout=3600)
        if status != "passed":
            print(f"the tests do not pass on the unmutated code ({status}): nothing to measure", file=sys.stderr)
            return 2
        timeout = args.timeout or max(30.0, 3 * baseline)
        name = module.relative_to(ROOT)
        print(f"{name}: {len(mutants)} of {total} mutants; baseline {baseline:.1f} s, timeout {timeout:.0f} s")
        results, start = [], time.monotonic()
        for i, mutant in enumerate(mutants, 1):
            try:
                copy.write_bytes(apply(source, mutant))
                status, seconds = run_tests(args.pytest_args, path, timeout)
            finally:
                copy.write_bytes(source)  # restored before anything else happens
            outcome = {"passed": "survived", "failed": "killed", "timeout": "killed (timeout)"}[status]
            results.append({**asdict(mutant), "name": mutant.name, "outcome": outcome, "seconds": round(seconds, 1)})
            print(f"[{i}/{len(mutants)}] {outcome:16} {seconds:5.1f} s  {mutant.name}", flush=True)
        elapsed = time.monotonic() - start
    survived = [r for r in results if r["outcome"] == "survived"]
    killed = len(results) - len(survived)
    print(f"\n{len(results)} mutants: {killed} killed, {len(survived)} survived, in {elapsed:.0f} s")
    for result in survived:
        print(f"  survived: {result['name']}")
    if args.json:
        args.json.write_text(
            json.dumps({"module": str(args.module), "baseline": baseline, "results": results}, indent=1)
        )
    return 1 if survived and args.fail_on_survivors else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted: the tests stopped, the copy restored and removed; the checkout was never changed")
        sys.exit(130)
