"""The TransformerLens adapter tests, run again against the other major version.

The environment holds TransformerLens 3.x (``make test`` installs it); ``make test`` also puts 4.x
beside it in build/transformer-lens-4. This test runs the adapter, masking and README tests that
touch TransformerLens in a fresh interpreter with 4.x first on the path, and requires every one of
them to run (none skipped) and pass.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TL4 = ROOT / "build" / "transformer-lens-4"
SELECTED = [
    "tests/test_adapters.py",
    "tests/test_capture_self_check.py",
    "tests/test_cross_layer_paths.py",
    "tests/test_masking.py",
    "tests/test_model_families.py",
    "tests/test_parallel_block_paths.py",
    "tests/test_readme.py",
    "tests/test_real_models_transformer_lens.py",
    "tests/test_scores.py",
    "tests/test_transcoder_paths.py",
]


def test_the_transformer_lens_tests_pass_against_4x():
    if os.environ.get("PATHKERNELS_EXPECT_TRANSFORMER_LENS"):
        pytest.skip("already the run against a chosen TransformerLens")
    if not (TL4 / "transformer_lens").is_dir():
        message = f"TransformerLens 4.x is not installed in {TL4} (make test installs it)"
        if os.environ.get("CI"):  # in CI the run against 4.x is required, not optional
            pytest.fail(f"{message}; CI={os.environ['CI']} needs it")
        pytest.skip(message)
    pytest.importorskip("transformers")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TL4), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "PATHKERNELS_EXPECT_TRANSFORMER_LENS": "4",
    }
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *SELECTED]
    run = subprocess.run(
        [*command, "-k", "transformer_lens or bridge"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0, f"against TransformerLens 4.x:\n{run.stdout[-6000:]}\n{run.stderr[-2000:]}"
    assert "skipped" not in summary and "passed" in summary, f"against TransformerLens 4.x: {summary}"
    assert int(summary.split(" passed")[0].split()[-1]) >= 9, summary
