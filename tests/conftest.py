import pytest
import torch

from moe_xpu import _runtime


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def C():
    """The launcher module, for tests that drive it directly (tile, worker and engine overrides)."""
    module = _runtime.sycl_module()
    if module is None:
        pytest.skip("SYCL launcher not built")
    return module
