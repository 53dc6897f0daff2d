"""Shared fixtures: every test gets fresh random inputs, and a failure names the seed to replay.

Set PATHKERNELS_TEST_SEED=<seed> to rerun with the inputs of a failed run.
"""

import os

import pytest
import torch

from pathkernels.testing import devices


@pytest.fixture(autouse=True)
def fresh_seed(request):
    seed = int(os.environ.get("PATHKERNELS_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    yield seed


def pytest_runtest_makereport(item, call):
    if call.excinfo is not None:
        seeds = [value for key, value in item.user_properties if key == "seed"]
        if seeds:
            item.add_report_section(call.when, "seed", f"PATHKERNELS_TEST_SEED={seeds[0]}")


@pytest.fixture(params=devices())
def device(request):
    return request.param


try:  # property-based tests: a quick profile by default, a long one for fuzzing runs
    from hypothesis import HealthCheck, settings

    _COMMON = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}
    settings.register_profile("quick", max_examples=100, **_COMMON)
    settings.register_profile("long", max_examples=2000, **_COMMON)
    settings.load_profile(os.environ.get("PATHKERNELS_HYPOTHESIS_PROFILE", "quick"))
except ImportError:  # tests/test_properties.py skips itself
    pass
