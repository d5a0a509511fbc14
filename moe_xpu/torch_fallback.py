"""Plain-PyTorch implementation of moe_gemm: the path for CPU tensors when the SYCL runtime is
absent or MOE_XPU_BACKEND=torch. It reads group_offsets on the host, which is free for CPU
tensors; the XPU path never does."""

from __future__ import annotations

import torch


def moe_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    group_offsets: torch.Tensor,
    gather_index: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    rows = a.shape[0] if gather_index is None else gather_index.shape[0]
    out = torch.zeros(rows, b.shape[2], dtype=out_dtype, device=a.device)
    start = 0
    for g, end in enumerate(group_offsets.tolist()):
        if end > start:
            src = a[start:end] if gather_index is None else a[gather_index[start:end]]
            prod = torch.mm(src.float(), b[g].float())
            if bias is not None:
                prod += bias[g].float()
            out[start:end] = prod.to(out_dtype)
        start = end
    return out
