"""Independent float64 references for the tests: plain loops over groups, no moe_xpu code."""

from __future__ import annotations

import torch


def moe_gemm_reference(a, b, group_offsets, gather_index=None, bias=None):
    """out[i] = a[row(i)] @ b[g] (+ bias[g]) in float64; rows past group_offsets[-1] are zero."""
    a64, b64 = a.double(), b.double()
    rows = a.shape[0] if gather_index is None else gather_index.shape[0]
    out = torch.zeros(rows, b.shape[2], dtype=torch.float64)
    start = 0
    for g, end in enumerate(group_offsets.tolist()):
        for i in range(start, end):
            src = i if gather_index is None else int(gather_index[i])
            out[i] = a64[src] @ b64[g]
            if bias is not None:
                out[i] += bias[g].double()
        start = end
    return out


def naive_low_precision(a, b, group_offsets, gather_index=None, bias=None, out_dtype=None):
    """What a user would write in plain PyTorch in the working precision: the error bar's scale."""
    out_dtype = out_dtype or a.dtype
    work = a.dtype if out_dtype == a.dtype else torch.float32
    rows = a.shape[0] if gather_index is None else gather_index.shape[0]
    out = torch.zeros(rows, b.shape[2], dtype=out_dtype)
    start = 0
    for g, end in enumerate(group_offsets.tolist()):
        if end > start:
            src = a[start:end] if gather_index is None else a[gather_index[start:end]]
            prod = src.to(work) @ b[g].to(work)
            if bias is not None:
                prod = prod + bias[g].to(work)
            out[start:end] = prod.to(out_dtype)
        start = end
    return out


def assert_matches_reference(out, a, b, group_offsets, gather_index=None, bias=None, out_dtype=None):
    """Error against float64 at most twice that of the naive working-precision computation, plus
    one rounding step of the output dtype (flash-attention's accuracy bar)."""
    ref = moe_gemm_reference(a, b, group_offsets, gather_index, bias)
    expected_dtype = out_dtype or a.dtype
    assert out.dtype == expected_dtype, f"dtype {out.dtype}, expected {expected_dtype}"
    assert tuple(out.shape) == tuple(ref.shape), f"shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    naive = naive_low_precision(a, b, group_offsets, gather_index, bias, out_dtype)
    err = (out.double() - ref).abs().max().item() if ref.numel() else 0.0
    naive_err = (naive.double() - ref).abs().max().item() if ref.numel() else 0.0
    scale = max(1.0, ref.abs().max().item()) if ref.numel() else 1.0
    tol = 2 * naive_err + torch.finfo(expected_dtype).eps * scale
    assert err <= tol, f"max error {err:.3g} exceeds {tol:.3g} (naive {naive_err:.3g})"
    assert torch.isfinite(out).all()


def fused_moe_reference(x, gate_up_proj, down_proj, topk_weights, topk_ids, activation="silu",
                        gate_up_bias=None, down_bias=None):
    """Hugging Face expert semantics in float64, token by token and slot by slot."""
    act = {"silu": torch.nn.functional.silu,
           "gelu_tanh": lambda v: torch.nn.functional.gelu(v, approximate="tanh")}[activation]
    T, H = x.shape
    I = gate_up_proj.shape[1] // 2
    out = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if e < 0:
                continue
            gu = gate_up_proj[e].double() @ x[t].double()
            if gate_up_bias is not None:
                gu = gu + gate_up_bias[e].double()
            h = act(gu[:I]) * gu[I:]
            y = down_proj[e].double() @ h
            if down_bias is not None:
                y = y + down_bias[e].double()
            out[t] += float(topk_weights[t, j]) * y
    return out


def moe_gemm_grad_reference(a, b, group_offsets, grad_out, gather_index=None):
    """Gradients of sum(moe_gemm(a, b, group_offsets, gather_index, bias) * grad_out) in float64,
    in closed form group by group: (da, db, dbias)."""
    a64, b64, dy = a.double(), b.double(), grad_out.double()
    da = torch.zeros_like(a64)
    db = torch.zeros_like(b64)
    dbias = torch.zeros(b.shape[0], b.shape[2], dtype=torch.float64)
    start = 0
    for g, end in enumerate(group_offsets.tolist()):
        rows = torch.arange(start, end) if gather_index is None else gather_index[start:end].long()
        da.index_add_(0, rows, dy[start:end] @ b64[g].t())
        db[g] = a64[rows].t() @ dy[start:end]
        dbias[g] = dy[start:end].sum(0)
        start = end
    return da, db, dbias


def assert_non_finite_rows_propagate(gemm, a, b, group_offsets):
    """With a NaN in A's row 2 and an infinity in row 9 (both groups of [6, 6]), gemm(a, b, offsets)
    gives NaN across row 2, no finite value in row 9 and finite values everywhere else."""
    a[2, 40] = float("nan")
    a[9, 5] = float("inf")
    out = gemm(a, b, group_offsets)
    assert out[2].isnan().all()
    assert not out[9].isfinite().any()
    rest = [r for r in range(12) if r not in (2, 9)]
    assert out[rest].isfinite().all()
