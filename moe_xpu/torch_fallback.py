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


ACTIVATIONS = {
    "silu": torch.nn.functional.silu,
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
}


def fused_moe(*args) -> torch.Tensor:
    """Per-expert loop in float32; the k contributions of a token are summed in slot order."""
    return fused_moe_per_slot(*args).sum(dim=1).to(args[0].dtype)


def fused_moe_per_slot(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
) -> torch.Tensor:
    """Each (token, slot) pair's weighted expert output, float32 [T, k, H] (zeros for sentinels)."""
    T, k = topk_ids.shape
    I = gate_up_proj.shape[1] // 2
    act = ACTIVATIONS[activation]
    x = hidden_states.float()
    contrib = torch.zeros(T, k, hidden_states.shape[1], dtype=torch.float32, device=x.device)
    for e in topk_ids.unique().tolist():
        if e < 0:  # the sentinel: an expert that lives elsewhere
            continue
        tokens, slots = (topk_ids == e).nonzero(as_tuple=True)
        gate_up = x[tokens] @ gate_up_proj[e].float().t()
        if gate_up_bias is not None:
            gate_up = gate_up + gate_up_bias[e].float()
        h = (act(gate_up[:, :I]) * gate_up[:, I:]).to(hidden_states.dtype).float()
        y = h @ down_proj[e].float().t()
        if down_bias is not None:
            y = y + down_bias[e].float()
        contrib[tokens, slots] = y * topk_weights[tokens, slots, None].float()
    return contrib
