"""moe_xpu::moe_gemm as a torch op: opcheck on sample inputs, torch.compile, registration."""

from __future__ import annotations

import pytest
import torch

import moe_xpu
from reference import assert_matches_reference


def sample_inputs():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(24, 16, dtype=dtype, generator=g)
        b = torch.randn(4, 16, 12, dtype=dtype, generator=g)
        b_linear = torch.randn(4, 12, 16, dtype=dtype, generator=g).transpose(1, 2)
        offs = torch.tensor([5, 5, 14, 20], dtype=torch.int32)
        bias = torch.randn(4, 12, dtype=dtype, generator=g)
        yield (a, b, offs), {}
        yield (a, b_linear, offs.long()), {"bias": bias}
        yield (a, b, offs), {"gather_index": torch.randint(0, 24, (20,), generator=g)}
        yield (a, b_linear, offs), {"out_dtype": torch.float32}


@pytest.mark.parametrize("sample", list(sample_inputs()))
def test_opcheck(sample):
    args, kwargs = sample
    torch.library.opcheck(torch.ops.moe_xpu.moe_gemm.default, args, kwargs)


def test_registered_for_cpu_and_xpu():
    op = torch.ops.moe_xpu.moe_gemm.default
    for key in ("CPU", "XPU"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key), key


def test_torch_compile_fullgraph():
    def layer(x, w, offs, idx):
        h = moe_xpu.moe_gemm(x, w, offs, gather_index=idx)
        return torch.relu(h) * 2

    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(16, 32)
    w = torch.randn(4, 64, 32).transpose(1, 2)
    offs = torch.tensor([3, 10, 10, 16], dtype=torch.int32)
    idx = torch.randperm(16)
    out = compiled(x, w, offs, idx)
    expected = torch.relu(moe_xpu.moe_gemm(x, w, offs, gather_index=idx)) * 2
    torch.testing.assert_close(out, expected)


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.randn(10, 8, dtype=torch.bfloat16)
        b = torch.randn(3, 8, 6, dtype=torch.bfloat16)
        offs = torch.tensor([1, 4, 7], dtype=torch.int32)
        out = moe_xpu.moe_gemm(a, b, offs, out_dtype=torch.float32)
        assert out.shape == (10, 6) and out.dtype == torch.float32
        out = moe_xpu.moe_gemm(a, b, offs, gather_index=torch.arange(7))
        assert out.shape == (7, 6) and out.dtype == torch.bfloat16


def test_public_function_and_op_agree():
    a = torch.randn(12, 9)
    b = torch.randn(2, 9, 7)
    offs = torch.tensor([4, 12], dtype=torch.int64)
    out = torch.ops.moe_xpu.moe_gemm(a, b, offs)
    assert torch.equal(out, moe_xpu.moe_gemm(a, b, offs))
    assert_matches_reference(out, a, b, offs)


def test_info_command_reports_device_and_kernels():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "moe_xpu", "info", "--warm-up"], capture_output=True,
                            text=True, timeout=300, check=True)
    for expected in ("torch", "CPU backend", "compute units", "sub-groups", "kernel source", "kernel cache",
                     "float32 kernels ready"):
        assert expected in result.stdout, (expected, result.stdout)


def test_eager_calls_take_the_op_whenever_torch_machinery_is_active():
    """Plain eager calls skip the dispatcher; under a dispatch mode, a functorch transform,
    with gradients to record, or while compiling, the call goes through the torch op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from moe_xpu import _dispatch

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    a, b = torch.randn(6, 4), torch.randn(2, 4, 3)
    offs = torch.tensor([2, 6], dtype=torch.int32)
    assert _dispatch.direct_call_ok(a, b, offs, None)
    with Log() as log:
        out = moe_xpu.moe_gemm(a, b, offs)
    assert "moe_xpu.moe_gemm.default" in log.ops
    torch.testing.assert_close(out, moe_xpu.moe_gemm(a, b, offs), rtol=0, atol=0)
    assert not _dispatch.direct_call_ok(a.clone().requires_grad_(), b, offs)
    with torch.no_grad():
        assert _dispatch.direct_call_ok(a.clone().requires_grad_(), b, offs)
    assert torch.vmap(lambda x: torch.tensor(_dispatch.direct_call_ok(x)))(torch.randn(3)).logical_not().all()


def test_gradient_flows_through_the_op():
    """A call that needs a gradient goes through the op, whose autograd formula gives it (the
    gradients themselves are checked in test_moe_gemm_backward.py)."""
    a = torch.randn(6, 4, requires_grad=True)
    out = moe_xpu.moe_gemm(a, torch.randn(2, 4, 3), torch.tensor([2, 6], dtype=torch.int32))
    assert out.grad_fn is not None
    out.sum().backward()
    assert a.grad is not None and a.grad.shape == a.shape
