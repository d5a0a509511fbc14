"""The pool of CPU weight-gradient buffers (moe_xpu/_host_memory.py): a buffer is handed out again
only once nothing refers to it, and a reused buffer gives the same gradient as fresh memory."""

from __future__ import annotations

import pytest
import torch

import moe_xpu
from moe_xpu._host_memory import gradient_buffers

E, K, N = 8, 2048, 1024  # float32 dB: 64 MB, above the pool's threshold
COUNTS = [3, 0, 5, 0, 0, 1, 7, 0]  # experts without rows: their dB must be written as zeros


def _offsets(counts):
    return torch.tensor(counts).cumsum(0).to(torch.int32)


def _weight_grad(seed: int, layout: str = "linear") -> tuple[torch.Tensor, torch.Tensor]:
    """(dB of moe_gemm through autograd, its float64 reference) for inputs drawn from seed."""
    gen = torch.Generator().manual_seed(seed)
    rows = sum(COUNTS)
    a = torch.randn(rows, K, generator=gen)
    grad_out = torch.randn(rows, N, generator=gen)
    if layout == "linear":
        b = torch.randn(E, N, K, generator=gen).transpose(1, 2).detach().requires_grad_()
    else:
        b = torch.randn(E, K, N, generator=gen).requires_grad_()
    moe_xpu.moe_gemm(a, b, _offsets(COUNTS)).backward(grad_out)
    want = torch.zeros(E, K, N, dtype=torch.float64)
    start = 0
    for g, n in enumerate(COUNTS):
        want[g] = a[start:start + n].double().t() @ grad_out[start:start + n].double()
        start += n
    return b.grad, want


@pytest.fixture(autouse=True)
def _empty_pool(monkeypatch):
    monkeypatch.delenv("MOE_XPU_GRAD_BUFFERS", raising=False)
    moe_xpu.release_gradient_buffers()
    yield
    moe_xpu.release_gradient_buffers()


def _pool_on():
    if not gradient_buffers.enabled():
        pytest.skip("this torch does not report storage use counts: the pool stays off")


@pytest.mark.parametrize("layout", ["linear", "kn"])
def test_freed_buffer_is_reused_with_every_element_rewritten(layout):
    _pool_on()
    first, want = _weight_grad(0, layout)
    torch.testing.assert_close(first.double(), want, rtol=1e-5, atol=1e-4)
    address = first.data_ptr()
    del first  # (as optimizer.zero_grad() does: nothing refers to the buffer any more)
    second, want = _weight_grad(1, layout)
    assert second.data_ptr() == address, "the freed buffer was not reused"
    # The buffer held the first gradient's values, nonzero in every expert: the experts without
    # rows must be zeros again, every other element the new gradient.
    torch.testing.assert_close(second.double(), want, rtol=1e-5, atol=1e-4)


def test_reused_buffer_gives_the_gradient_of_fresh_memory_bitwise(monkeypatch):
    _pool_on()
    held, _ = _weight_grad(0)
    del held
    reused, _ = _weight_grad(2)
    monkeypatch.setenv("MOE_XPU_GRAD_BUFFERS", "0")
    fresh, _ = _weight_grad(2)
    assert reused.data_ptr() != fresh.data_ptr()
    assert torch.equal(reused, fresh)


@pytest.mark.parametrize("keep", ["tensor", "view", "storage"])
def test_a_gradient_in_use_is_never_handed_out(keep):
    """A gradient kept as a tensor, as a view of it (a parameter's .grad of transposed weights) or
    only through its storage object is left alone: the next gradient gets another buffer."""
    _pool_on()
    first, want_first = _weight_grad(0)
    kept = {"tensor": first, "view": first.transpose(1, 2), "storage": first.untyped_storage()}[keep]
    address, nbytes = first.data_ptr(), first.untyped_storage().nbytes()
    before = first.clone()
    del first
    second, want_second = _weight_grad(1)
    assert second.data_ptr() != address
    torch.testing.assert_close(second.double(), want_second, rtol=1e-5, atol=1e-4)
    if keep == "storage":
        again = torch.empty(0).set_(kept, 0, before.shape, before.stride())
    else:
        again = kept if keep == "tensor" else kept.transpose(1, 2)
    assert again.data_ptr() == address and torch.equal(again, before)
    torch.testing.assert_close(again.double(), want_first, rtol=1e-5, atol=1e-4)
    assert gradient_buffers.held_bytes() == 2 * nbytes


def test_switched_off_and_released(monkeypatch):
    _pool_on()
    grad, _ = _weight_grad(0)
    assert gradient_buffers.held_bytes() == grad.untyped_storage().nbytes()
    assert moe_xpu.release_gradient_buffers() == grad.untyped_storage().nbytes()
    assert gradient_buffers.held_bytes() == 0
    monkeypatch.setenv("MOE_XPU_GRAD_BUFFERS", "0")
    del grad
    grad, want = _weight_grad(1)
    assert gradient_buffers.held_bytes() == 0
    torch.testing.assert_close(grad.double(), want, rtol=1e-5, atol=1e-4)


def test_small_gradients_are_not_pooled():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(6, 64, generator=gen)
    b = torch.randn(2, 64, 32, generator=gen).requires_grad_()
    moe_xpu.moe_gemm(a, b, torch.tensor([2, 6], dtype=torch.int32)).sum().backward()
    assert gradient_buffers.held_bytes() == 0
