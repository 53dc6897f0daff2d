"""The compiled extension: build information and the errors for a mismatched binary."""

import pytest
import torch

import pathkernels as pk
from pathkernels.core._extension import check_build_info


def test_build_info_names_the_torch_it_was_built_against():
    info = pk.build_info()
    assert info["torch_version"] == torch.__version__
    assert isinstance(info["cuda"], bool)
    if info["cuda"]:
        assert info["cuda_architectures"] and info["cuda_version"]
    else:
        assert info["cuda_version"] is None


def test_ops_are_registered_with_the_dispatcher():
    assert hasattr(torch.ops.pathkernels, "norm_parts")
    assert hasattr(torch.ops.pathkernels, "norm_parts_backward")


def test_mismatched_binary_says_how_to_rebuild():
    with pytest.raises(ImportError, match=r"built against torch 1\.0\.0, but torch .* is installed\. Rebuild"):
        check_build_info({"torch_version": "1.0.0"})


def test_missing_binary_says_how_to_rebuild(monkeypatch):
    import sys

    import pathkernels
    from pathkernels.core import _extension

    monkeypatch.delattr(pathkernels, "_C")
    monkeypatch.setitem(sys.modules, "pathkernels._C", None)
    monkeypatch.setattr(_extension, "_BUILD_INFO", None)  # load() checks the binary once, then remembers
    with pytest.raises(ImportError, match=r"pathkernels\._C could not be loaded .* Rebuild pathkernels"):
        _extension.load()


def test_import_leaves_the_application_modules_unloaded():
    """import pathkernels loads the library core only: no pandas, matplotlib or experiments."""
    import subprocess
    import sys

    code = (
        "import sys, pathkernels; print(sorted(m for m in ('pandas', 'matplotlib', 'pathkernels.app', "
        "'pathkernels.app.experiments', 'pathkernels.app.models', 'pathkernels.app.benchmarks', "
        "'pathkernels.analysis.compat', 'pathkernels.app.cli') "
        "if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"
    assert pk.experiments.__name__ == "pathkernels.app.experiments"  # on first use


def test_every_requested_cuda_architecture_reaches_cmake(monkeypatch, capsys):
    """TORCH_CUDA_ARCH_LIST's entries travel to CMake "|"-separated: CMakeLists.txt splits the layout
    script's output on ";", which once cut "8.0;9.0" down to sm_80 alone."""
    import runpy
    from pathlib import Path

    layout = runpy.run_path(str(Path(__file__).parents[1] / "cmake" / "torch_layout.py"))
    capsys.readouterr()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a 9.0+PTX")
    assert layout["cuda_architectures"]() == "80-real|90a-real|90"
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.x")
    with pytest.raises(SystemExit, match="cannot parse '9.x'"):
        layout["cuda_architectures"]()


def test_the_package_carries_its_license_and_type_marker():
    """A LICENSE that matches pyproject.toml's license, and py.typed for type checkers (PEP 561)."""
    import importlib.resources
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    assert 'license = { text = "BSD-3-Clause" }' in (root / "pyproject.toml").read_text()
    assert (root / "LICENSE").read_text().startswith("BSD 3-Clause License")
    assert importlib.resources.files("pathkernels").joinpath("py.typed").is_file()


def test_the_build_installs_its_info_and_the_docs_the_messages_name():
    """Beside the extension: ``_build_info.json`` (what ``pathkernels --version`` reads without torch,
    the same as build_info()) and the docs (``pathkernels/docs``), so that a message's pointer to
    docs/FIXTURES.md or docs/BENCHMARKS.md names a file on this machine, installed or not."""
    import importlib.util
    import json
    from pathlib import Path

    from pathkernels.core._docs import doc_path

    installed = Path(importlib.util.find_spec("pathkernels._C").origin).parent
    info = json.loads((installed / "_build_info.json").read_text())
    assert info == {key: pk.build_info()[key] for key in info} and set(info) == set(pk.build_info())
    for name in ("DESIGN.md", "FIXTURES.md", "BENCHMARKS.md", "USAGE.md"):
        assert (installed / "docs" / name).is_file(), name
        assert Path(doc_path(name)).is_file() and doc_path(name).endswith(f"docs/{name}")
