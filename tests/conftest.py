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
