"""The main job: moe_gemm on an MoE-shaped problem on the default device, checked against
PyTorch and timed beside torch.nn.functional.grouped_mm.

64 tokens routed top-8 over 64 experts (512 rows), hidden 2048 -> 2048, bfloat16 weights in
nn.Linear layout [E, N, K] (as Hugging Face models store them), read in place."""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import moe_xpu
from moe_xpu import _runtime
from moe_xpu.bench import median_time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=2048, help="K")
    parser.add_argument("--out-features", type=int, default=2048, help="N")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    device = torch.device("xpu" if hasattr(torch, "xpu") and torch.xpu.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    T, k, E, K, N = args.tokens, args.top_k, args.experts, args.hidden, args.out_features

    # Route tokens top-k by random logits, then sort (token, slot) pairs by expert.
    topk_ids = torch.randn(T, E).topk(k, dim=1).indices.flatten()
    order = torch.argsort(topk_ids, stable=True)
    gather_index = (order // k).to(device)  # token row of each expert-ordered row
    group_offsets = torch.bincount(topk_ids, minlength=E).cumsum(0).to(torch.int32).to(device)
    x = torch.randn(T, K, dtype=dtype, device=device)
    w = torch.randn(E, N, K, dtype=dtype, device=device) / K**0.5  # nn.Linear layout
    b = w.transpose(1, 2)  # [E, K, N] view, no copy

    print(f"device: {device} ({_runtime.cpu_backend() if device.type == 'cpu' else 'sycl'} backend)")
    print(f"problem: {T} tokens x top-{k} = {T * k} rows, E={E}, K={K}, N={N}, {args.dtype}")

    start = time.perf_counter()
    out = moe_xpu.moe_gemm(x, b, group_offsets, gather_index=gather_index)
    print(f"first call (includes kernel build or cache load): {time.perf_counter() - start:.2f} s")

    # Check against plain PyTorch in float64.
    rows = x.double()[gather_index]
    expected = torch.zeros(T * k, N, dtype=torch.float64, device=device)
    start_row = 0
    for g, end in enumerate(group_offsets.tolist()):
        expected[start_row:end] = rows[start_row:end] @ b[g].double()
        start_row = end
    err = (out.double() - expected).abs().max().item()
    # A few roundings of the output dtype at the output's scale (fp32 accumulation inside).
    tol = 4 * torch.finfo(dtype).eps * max(1.0, expected.abs().max().item())
    print(f"max |moe_gemm - float64 reference| = {err:.2e} ({'OK' if err < tol else 'MISMATCH'})")
    if err >= tol:
        raise SystemExit(1)

    gathered = x[gather_index]
    t_ours = median_time(lambda: moe_xpu.moe_gemm(x, b, group_offsets, gather_index=gather_index), args.repeats)
    t_peer = median_time(lambda: F.grouped_mm(x[gather_index], b, offs=group_offsets), args.repeats)
    t_peer_pre = median_time(lambda: F.grouped_mm(gathered, b, offs=group_offsets), args.repeats)
    flops = 2 * T * k * K * N
    print(f"moe_gemm (gather fused)          {t_ours * 1e3:8.2f} ms  {flops / t_ours / 1e9:7.1f} GFLOP/s")
    print(f"grouped_mm (gather copy + GEMM)  {t_peer * 1e3:8.2f} ms  {flops / t_peer / 1e9:7.1f} GFLOP/s")
    print(f"grouped_mm (pre-gathered input)  {t_peer_pre * 1e3:8.2f} ms  {flops / t_peer_pre / 1e9:7.1f} GFLOP/s")
    print(f"speed-up over grouped_mm: {t_peer / t_ours:.2f}x")


if __name__ == "__main__":
    main()
