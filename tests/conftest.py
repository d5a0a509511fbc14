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


@pytest.fixture(params=["sycl", "torch"])
def backend(request, monkeypatch):
    """Runs a test on both CPU backends: the SYCL CPU device and the plain-PyTorch fallback."""
    monkeypatch.setenv("MOE_XPU_BACKEND", request.param)
    if request.param == "sycl" and _runtime.sycl_module() is None:
        pytest.skip("SYCL launcher not built")
    return request.param
