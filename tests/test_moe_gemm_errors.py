"""Bad input raises a clear exception naming the argument, before any kernel runs."""

from __future__ import annotations

import pytest
import torch

import moe_xpu


def good():
    a = torch.randn(10, 8)
    b = torch.randn(3, 8, 5)
    offs = torch.tensor([2, 6, 9], dtype=torch.int32)
    return a, b, offs


def with_(**changes):
    a, b, offs = good()
    kwargs = dict(a=a, b=b, group_offsets=offs)
    kwargs.update(changes)
    return kwargs


BAD = [
    ("a_rank", with_(a=torch.randn(10, 8, 1)), "a must be 2-D"),
    ("b_rank", with_(b=torch.randn(8, 5)), "b must be 3-D"),
    ("offs_rank", with_(group_offsets=torch.tensor([[2, 6, 9]], dtype=torch.int32)), "group_offsets must be 1-D"),
    ("k_mismatch", with_(b=torch.randn(3, 7, 5)), "K dimension"),
    ("e_mismatch", with_(group_offsets=torch.tensor([2, 9], dtype=torch.int32)), "group_offsets must have E"),
    ("a_dtype", with_(a=torch.randn(10, 8).double(), b=torch.randn(3, 8, 5).double()), "a must be float32"),
    ("a_int", with_(a=torch.ones(10, 8, dtype=torch.int32)), "a must be float32"),
    ("mixed_dtype", with_(b=torch.randn(3, 8, 5, dtype=torch.bfloat16)), "b must have a's dtype"),
    ("offs_dtype", with_(group_offsets=torch.tensor([2.0, 6.0, 9.0])), "group_offsets must be int32 or int64"),
    ("offs_decreasing", with_(group_offsets=torch.tensor([2, 1, 9], dtype=torch.int32)), "non-decreasing"),
    ("offs_negative", with_(group_offsets=torch.tensor([-1, 6, 9], dtype=torch.int32)), "non-negative"),
    ("offs_beyond", with_(group_offsets=torch.tensor([2, 6, 11], dtype=torch.int32)), "exceeds the 10 rows"),
    ("gather_len", with_(gather_index=torch.arange(8)), "gather_index must have group_offsets"),
    ("gather_range", with_(gather_index=torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 10])), "gather_index values"),
    ("gather_negative", with_(gather_index=torch.tensor([0, 1, 2, 3, -1, 5, 6, 7, 8])), "gather_index values"),
    ("gather_dtype", with_(gather_index=torch.arange(9).float()), "gather_index must be int32 or int64"),
    ("gather_rank", with_(gather_index=torch.arange(9).view(3, 3)), "gather_index must be 1-D"),
    ("bias_shape", with_(bias=torch.randn(3, 4)), "bias must have shape"),
    ("bias_dtype", with_(bias=torch.randn(3, 5, dtype=torch.float16)), "bias must have a's dtype"),
    ("out_dtype", with_(out_dtype=torch.float16), "out_dtype must be"),
    ("mixed_device", with_(group_offsets=torch.tensor([2, 6, 9], dtype=torch.int32, device="meta")), "share a device"),
    ("not_tensor", with_(group_offsets=[2, 6, 9]), "group_offsets must be a torch.Tensor"),
]


@pytest.mark.parametrize("backend", ["sycl", "torch"])
@pytest.mark.parametrize("name,kwargs,message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_clear_error(monkeypatch, backend, name, kwargs, message):
    monkeypatch.setenv("MOE_XPU_BACKEND", backend)
    kwargs = dict(kwargs)
    a, b, offs = kwargs.pop("a"), kwargs.pop("b"), kwargs.pop("group_offsets")
    with pytest.raises((ValueError, TypeError), match=message):
        moe_xpu.moe_gemm(a, b, offs, **kwargs)


def test_error_is_a_value_and_type_error():
    a, b, offs = good()
    with pytest.raises(moe_xpu.MoeXpuInputError):
        moe_xpu.moe_gemm(a, b[:, :4], offs)
    assert issubclass(moe_xpu.MoeXpuInputError, ValueError)
    assert issubclass(moe_xpu.MoeXpuInputError, TypeError)


def test_direct_op_call_validates_too():
    a, b, _ = good()
    with pytest.raises((ValueError, TypeError), match="non-decreasing"):
        torch.ops.moe_xpu.moe_gemm(a, b, torch.tensor([5, 2, 9], dtype=torch.int32))


def test_bad_backend_name(monkeypatch):
    monkeypatch.setenv("MOE_XPU_BACKEND", "cuda")
    a, b, offs = good()
    with pytest.raises(ValueError, match="MOE_XPU_BACKEND"):
        moe_xpu.moe_gemm(a, b, offs)
