"""The package's layers, checked by walking every module's imports (at module level, inside
functions and under ``if TYPE_CHECKING``; relative imports resolved) and by running it.

The layers, bottom up (docs/DESIGN.md, "Layers"); each may import its own and those it lists:

    core      pathkernels.core.*, pathkernels.reference, the compiled pathkernels._C    core
    adapters  pathkernels.adapters.*                                                   core
    analysis  pathkernels.analysis.*                                                   core, adapters
    support   pathkernels.testing, pathkernels.fixtures (test and benchmark helpers)   core
    app       pathkernels.app.*, pathkernels.__main__                                  all of them

so arrows point down only: app -> analysis -> adapters -> core, and support beside them, used by
the app and the tests. The package itself (pathkernels/__init__.py) imports none of its modules
by statement: it maps its public names to the library's modules and imports them by name, at
once where torch is already imported, else on first use (its docstring).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pathkernels"
EXTENSION = "pathkernels._C"  # the compiled module: no Python source to walk

LAYERS = {  # name: the modules it holds (each prefix and everything under it)
    "core": ("pathkernels.core", "pathkernels.reference", EXTENSION),
    "adapters": ("pathkernels.adapters",),
    "analysis": ("pathkernels.analysis",),
    "support": ("pathkernels.testing", "pathkernels.fixtures"),
    "app": ("pathkernels.app", "pathkernels.__main__"),
    "package": (),  # pathkernels/__init__.py alone
}
MAY_IMPORT = {
    "core": {"core"},
    "adapters": {"core", "adapters"},
    "analysis": {"core", "adapters", "analysis"},
    "support": {"core", "support"},
    "app": {"core", "adapters", "analysis", "support", "app", "package"},
    "package": set(),
}
# What `import pathkernels` must not load, and what the command line's --help must not import.
APPLICATION = ("pathkernels.app", "pandas", "matplotlib")
HEAVY = ("torch", "pandas", "transformers", "matplotlib", "pathkernels.core", "pathkernels.adapters")
HEAVY += ("pathkernels.analysis",)
COMMANDS = ("demo", "collapse", "paths", "attribute", "bench")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    found = {module_name(path): path for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts}
    assert "pathkernels.core" in found, sorted(found)
    return found


def layer(module: str) -> str | None:
    if module == "pathkernels":
        return "package"
    for name, prefixes in LAYERS.items():
        if any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes):
            return name
    return None


class _Imports(ast.NodeVisitor):
    """The package modules a module imports: ``(target, line, where)``, where is ``"module"`` or
    ``"function"`` (an import inside a function runs when it is called: it counts all the same)."""

    def __init__(self, name: str, is_package: bool, known: set[str]):
        self.package = name if is_package else name.rpartition(".")[0]
        self.known = known
        self.depth = 0
        self.found: list[tuple[str, int, str]] = []

    def _add(self, target: str, node: ast.AST) -> None:
        if target == "pathkernels" or target.startswith("pathkernels."):
            self.found.append((target, node.lineno, "function" if self.depth else "module"))

    def _inside(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _inside

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            parts = self.package.split(".")
            base = ".".join(parts[: len(parts) - (node.level - 1)])
            base = f"{base}.{node.module}" if node.module else base
        else:
            base = node.module
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            self._add(submodule if submodule in self.known or submodule == EXTENSION else base, node)


def import_graph() -> dict[str, list[tuple[str, int, str]]]:
    found = modules()
    known = set(found)
    graph = {}
    for name, path in found.items():
        visitor = _Imports(name, path.name == "__init__.py", known)
        visitor.visit(ast.parse(path.read_text(), filename=str(path)))
        graph[name] = visitor.found
    return graph


def find_cycle(graph: dict[str, list[tuple[str, int, str]]]) -> list[str] | None:
    """One import circle (``[a, b, …, a]``), or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        stack.append(module)
        for target, _, _ in graph.get(module, []):
            if target == module:
                continue
            if state.get(target) == "open":
                return stack[stack.index(target) :] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        stack.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


def test_every_module_is_in_a_layer_and_every_import_names_a_module():
    graph = import_graph()
    assert [m for m in graph if layer(m) is None] == [], "put each module in a layer of LAYERS"
    missing = sorted(
        f"{module}:{line} imports {target}"
        for module, imports in graph.items()
        for target, line, _ in imports
        if target not in graph and target != EXTENSION
    )
    assert missing == []


def test_no_import_circle():
    """Not even through an import inside a function: a circle is a circle whenever it closes."""
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_imports_point_down_the_layers_only():
    upward = sorted(
        f"{module}:{line} ({where} level) imports {target}: {layer(module)} may import only "
        f"{sorted(MAY_IMPORT[layer(module)]) or 'nothing of the package'}"
        for module, imports in import_graph().items()
        for target, line, where in imports
        if target != module and layer(target) not in MAY_IMPORT[layer(module)]
    )
    assert upward == []


def test_the_checks_see_a_circle_and_an_upward_import():
    """The walker itself: an upward import inside a function, and a circle, are found."""
    graph = {
        "pathkernels.core.paths": [("pathkernels.app.cli", 3, "function")],
        "pathkernels.app.cli": [("pathkernels.core.paths", 1, "module")],
    }
    cycle = find_cycle(graph)
    assert cycle[0] == cycle[-1] and sorted(cycle[:-1]) == ["pathkernels.app.cli", "pathkernels.core.paths"]
    assert layer("pathkernels.app.cli") not in MAY_IMPORT[layer("pathkernels.core.paths")]
    source = "def f():\n    from ..app.cli import main\n"
    visitor = _Imports("pathkernels.core.paths", False, {"pathkernels.app.cli"})
    visitor.visit(ast.parse(source))
    assert visitor.found == [("pathkernels.app.cli", 2, "function")]


def run_python(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


LOADED = "import sys; print(' '.join(sorted(m for m in sys.modules if m.startswith({names}))))"


def loaded_after(code: str, names: tuple[str, ...]) -> list[str]:
    run = run_python("-c", code + "\n" + LOADED.format(names=repr(names)))
    assert run.returncode == 0, run.stderr
    return run.stdout.split()


def test_import_pathkernels_loads_no_application():
    """Alone it imports nothing (not even torch); after torch it loads the library (the ops
    registered), still without the applications, pandas or matplotlib; a public name loads the
    library on first use."""
    assert loaded_after("import pathkernels", ("torch", "pathkernels.", *APPLICATION)) == []
    code = "import torch, pathkernels; assert hasattr(torch.ops.pathkernels, 'norm_parts')"
    loaded = loaded_after(code, ("pathkernels.", *APPLICATION))
    assert "pathkernels.core.ops" in loaded and "pathkernels.analysis.real_paths" in loaded, loaded
    assert [m for m in loaded if m.startswith(APPLICATION)] == []
    loaded = loaded_after("import pathkernels; pathkernels.path_residuals", ("pathkernels.", *APPLICATION))
    assert "pathkernels.core.engine" in loaded and [m for m in loaded if m.startswith(APPLICATION)] == []


def console_script() -> str:
    """pyproject.toml's ``pathkernels = "module:function"``."""
    scripts = (ROOT / "pyproject.toml").read_text().split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    return re.search(r'^pathkernels\s*=\s*"([\w.]+:\w+)"', scripts, flags=re.M)[1]


@pytest.mark.parametrize("command", [(), *((name,) for name in COMMANDS)], ids=["main", *COMMANDS])
def test_help_imports_neither_torch_nor_the_library(command):
    """``pathkernels [COMMAND] --help``, by the console script's target and by ``python -m``:
    ``-X importtime`` lists every module imported, none of them torch, pandas, transformers,
    matplotlib or the library."""
    module, function = console_script().split(":")
    script = f"import sys; from {module} import {function}; sys.argv[0] = 'pathkernels'; sys.exit({function}())"
    for argv in (["-c", script, *command, "--help"], ["-m", "pathkernels", *command, "--help"]):
        run = run_python("-X", "importtime", *argv)
        assert run.returncode == 0 and run.stdout.startswith("usage: pathkernels"), run.stderr[-2000:]
        imported = {
            line.rsplit("|", 1)[1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")
        }
        assert "pathkernels.app.cli" in imported
        heavy = sorted(m for m in imported if m.startswith(HEAVY) and "." not in m.removeprefix("pathkernels."))
        assert heavy == [], f"{argv[:2]} {list(command)} --help imports {heavy}"
