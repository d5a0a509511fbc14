import os

import pytest
import torch

# Small CI scope by default; MOE_XPU_TEST_SCOPE=full adds the larger shapes.
FULL_SCOPE = os.environ.get("MOE_XPU_TEST_SCOPE", "ci") == "full"


def pytest_collection_modifyitems(config, items):
    if FULL_SCOPE:
        return
    skip = pytest.mark.skip(reason="larger shape: MOE_XPU_TEST_SCOPE=full")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
