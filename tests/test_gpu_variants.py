"""The kernel variants the launcher picks for each Intel GPU generation, evaluated from the GPU's
description (no GPU present): the choice itself, and those variants run on the SYCL CPU device
(sub-group-16 work-groups of four sub-groups, as on a GPU) against the float64 reference."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from moe_xpu import ops
from reference import assert_matches_reference

GPU_TARGETS = ["pvc", "bmg", "lnl", "ptl", "dg2", "mtl"]
XMX = {"pvc": (8, 16, 16, 16), "bmg": (8, 16, 16, 16), "lnl": (8, 16, 16, 16),
       "ptl": (8, 16, 16, 16), "dg2": (8, 8, 16, 8)}
# W8A8 on XMX: the int8 tile (twice the bf16 k) where the kernel fits the register file (not on
# Xe-HPG's 8 lanes, where it spilled).
XMX_INT8 = {"pvc": (8, 16, 32, 16), "bmg": (8, 16, 32, 16), "lnl": (8, 16, 32, 16), "ptl": (8, 16, 32, 16)}


def make_b(E, K, N, dtype, layout):
    if layout == "kn":
        return torch.randn(E, K, N, dtype=dtype)
    return torch.randn(E, N, K, dtype=dtype).transpose(1, 2)


def offsets(counts):
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)


def test_every_target_is_described(C):
    assert sorted(C.gpu_targets()) == sorted(GPU_TARGETS)
    for target in GPU_TARGETS:
        d = C.gpu_description(target)
        assert 16 in d["sub_group_sizes"], target
        assert d["local_mem_size"] >= 64 * 1024 and d["compute_units"] > 0, target
        expected = [XMX[target]] if target in XMX else []
        assert [tuple(s) for s in d["matrix_shapes"]] == expected, target
        assert d["int8_matrix"] == (target in XMX_INT8), target
    with pytest.raises(ValueError, match="unknown GPU target"):
        C.gpu_description("gen9")


@pytest.mark.parametrize("target", GPU_TARGETS)
def test_gpu_choice(C, target):
    """On a GPU: no K chunks and no work-group local memory (both are CPU cache tactics), the GPU
    tile table, four sub-groups per work-group, a grid from the Xe cores; bf16 with K-contiguous
    weights and several rows per expert on XMX, in the engine's tile and sub-group size."""
    for dtype in (C.DType.bfloat16, C.DType.float16):
        names = C.bundle_kernel_names(0, target, dtype, dtype)
        vector = [n for n in names if "matrix" not in n and "wgrad" not in n]
        assert vector and all(n.endswith(", 0>") for n in vector), names  # KChunk = 0 everywhere
        assert any("wgrad" in n for n in names), "the weight-gradient kernel is compiled for the GPU too"
        matrix = [n for n in names if "matrix" in n]
        if target in XMX:  # float and 16-bit A, plain and gated, and the weight gradient, at the target's engine tile
            tile = ", ".join(map(str, XMX[target]))
            assert len(matrix) == 5 and all(n.endswith(f", {tile}>") for n in matrix), matrix
            assert sum(n.startswith("moe_xpu::moe_gemm_matrix_wgrad<") for n in matrix) == 1, matrix
            assert not any("matrix_kn" in n for n in names)  # [E, K, N] stays on the vector kernels
        else:
            assert not matrix
    assert C.tile_shapes(False, False, 0, target) == [(1, 8), (2, 4)]
    assert C.tile_shapes(True, False, 0, target) == [(1, 8), (6, 4)]
    assert C.tile_shapes(True, True, 0, target) == [(1, 8), (6, 4)]
    cus = C.gpu_description(target)["compute_units"]
    for dtype, rows, E, layout in itertools.product([torch.float32, torch.bfloat16, torch.float16], [8, 4096], [8],
                                                    ["linear", "kn"]):
        a = torch.empty(rows, 2048, dtype=dtype)
        b = make_b(E, 2048, 1536, dtype, layout)
        args = ops.gemm_args(a, b, offsets([rows // E] * E), None, None, torch.empty(rows, 1536, dtype=dtype))
        plan = C.plan_gemm_on_gpu(args, target)
        # (8 rows over 8 experts still take XMX: each expert's 6 MB of weights stream from memory.)
        xmx = target in XMX and dtype != torch.float32 and layout == "linear"
        assert plan.matrix_engine == xmx, (dtype, rows, layout)
        lanes = XMX[target][3] if xmx else 16
        assert plan.sub_group_size == lanes and plan.work_group_size == 4 * lanes
        if not xmx:
            assert plan.tile_m == (1 if rows == 8 else (6 if layout == "linear" else 2))
        if os.environ.get("MOE_XPU_NUM_WORKERS"):
            continue  # the worker count is fixed (device matrix runs)
        assert plan.num_workers % 4 == 0 and plan.num_workers <= 32 * cus
        if rows == 4096 and not xmx:  # enough work: many sub-groups per Xe core (capped by the units)
            assert plan.num_workers > 16 * cus
    for report in C.kernel_report(0, C.DType.float32, C.DType.float32, target):
        assert report.local_memory_bytes == 0, report.name


def _distinct_variant_sets(C):
    """One GPU target per distinct set of variants (targets choosing the same kernels run once)."""
    seen, chosen = set(), []
    for target in GPU_TARGETS:
        key = tuple(C.bundle_kernel_names(0, target, C.DType.float32, C.DType.float32))
        if key not in seen:
            seen.add(key)
            chosen.append(target)
    return chosen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["linear", "kn"])
def test_gpu_variants_run_correctly_here(C, dtype, layout):
    """The GPU variants of every distinct GPU choice, run on the CPU device at every GPU tile
    shape and odd worker counts, on shapes that break things: empty experts, one expert taking
    most rows, sizes that are not multiples of any tile, the zeroed tail, an index table."""
    T, E, K, N = 53, 6, 67, 83
    a = torch.randn(T, K, dtype=dtype)
    b = make_b(E, K, N, dtype, layout)
    counts = [0, 31, 1, 0, 7, 5]  # 44 of 53 rows: the last 9 are the zeroed tail
    offs = offsets(counts)
    gi = torch.randint(0, T, (sum(counts),))
    a_, b_, offs_, gi_, _ = ops.kernel_ready(a, b, offs, gi, None)
    for target in _distinct_variant_sets(C):
        for (tile_m, tile_n), workers, gather in itertools.product(
                C.tile_shapes(layout == "linear", False, 0, target), [0, 5], [False, True]):
            rows = sum(counts) if gather else T
            out = torch.full((rows, N), float("nan"), dtype=dtype)
            args = ops.gemm_args(a_, b_, offs_, gi_ if gather else None, None, out)
            args.variants_for = target
            args.tile_m, args.tile_n, args.num_workers = tile_m, tile_n, workers
            C.moe_gemm(args)
            assert C.plan_gemm(args).work_group_size == 64
            assert_matches_reference(out, a, b, offs, gather_index=gi if gather else None)


def test_gpu_gated_variants_run_correctly_here(C):
    """The gated epilogue (fused MoE's first GEMM) of the GPU variants, every GPU tile shape."""
    import torch.nn.functional as F

    from moe_xpu.fused import ACTIVATIONS

    T, E, K, I = 29, 5, 45, 21
    a = torch.randn(T, K)
    b = make_b(E, K, 2 * I, torch.float32, "linear")
    offs = offsets([6, 0, 14, 1, 9])
    gi = torch.randint(0, T, (30,))
    ref = torch.cat([a[gi[s:e]].double() @ b[g].double() for g, (s, e) in
                     enumerate(zip([0, 6, 6, 20, 21], [6, 6, 20, 21, 30]))])
    expected = F.silu(ref[:, :I]) * ref[:, I:]
    a_, b_, offs_, gi_, _ = ops.kernel_ready(a, b, offs, gi, None)
    for target in _distinct_variant_sets(C):
        for tile_m, tile_n in C.tile_shapes(True, True, 0, target):
            out = torch.empty(30, I)
            args = ops.gemm_args(a_, b_, offs_, gi_, None, out)
            args.activation, args.up_offset, args.N = ACTIVATIONS["silu"], I, I
            args.variants_for, args.tile_m, args.tile_n = target, tile_m, tile_n
            C.moe_gemm(args)
            torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("target", GPU_TARGETS)
def test_gpu_w8a8_choice(C, target):
    """The int8 bundle of a GPU holds the W8A8 matrix kernel at the target's int8 tile where it has
    one, and W8A8 prefill with K-contiguous weights runs on it there."""
    names = C.bundle_kernel_names(0, target, C.DType.int8, C.DType.bfloat16)
    matrix = [n for n in names if "moe_gemm_quant_matrix<" in n]
    if target in XMX_INT8:
        assert matrix == ["moe_xpu::moe_gemm_quant_matrix<uint16_t, " + ", ".join(map(str, XMX_INT8[target])) + ">"]
    else:
        assert not matrix, names


@pytest.mark.parametrize("target", GPU_TARGETS)
@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3", "int4", "mxfp4"])
def test_gpu_dequant_matrix_kernels(C, target, dtype):
    """Each weight-only format's bundle of a GPU with XMX holds the dequantizing matrix kernel,
    plain and gated, at the target's bf16 tile on 16 lanes; Xe-HPG (8 lanes, where it spilled) and
    a GPU without XMX none."""
    names = C.bundle_kernel_names(0, target, getattr(C.DType, dtype), C.DType.float32)
    matrix = sorted(n for n in names if "moe_gemm_dequant_matrix<" in n)
    if target in XMX and XMX[target][3] == 16:
        fmt = {"int8": "Int8Weights", "fp8_e4m3": "Fp8Weights", "int4": "Int4Weights", "mxfp4": "Mxfp4Weights"}[dtype]
        tile = ", ".join(map(str, XMX[target]))
        assert matrix == [f"moe_xpu::moe_gemm_dequant_matrix<moe_xpu::{fmt}, float, {gated}, {tile}>"
                          for gated in ("false", "true")]
    else:
        assert not matrix, names


@pytest.mark.parametrize("target", GPU_TARGETS)
@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8", "mxfp4"])
def test_gpu_quantized_plan(C, target, fmt):
    """Planning a quantized launch for each GPU, engine or none (mtl has no XMX, and its engine
    tile is all zeros: the plan once divided by it): weight-only B with bf16 activations and 16
    rows a group goes to the dequantizing kernel where the bundle has it, to the vector kernel
    elsewhere."""
    import moe_xpu
    from moe_xpu import quant

    counts, K, N = [16] * 4, 256, 64
    q = moe_xpu.quantize_experts(torch.randn(4, N, K).transpose(1, 2), fmt)
    plans = []

    def configure(args):
        args.variants_for = target
        plans.append(C.plan_gemm(args))
        raise StopIteration  # planned only: a GPU's kernels do not run here

    with pytest.raises(StopIteration):
        quant.run_quant(torch.randn(64, K).to(torch.bfloat16), q, offsets(counts), None, None, None,
                        torch.float32, configure=configure)
    # (A CPU code-generation target that cannot build joint_matrix plans without any engine.)
    dequant = target in XMX and XMX[target][3] == 16 and C.device_info(0).matrix_engine
    assert plans[0].matrix_engine == dequant, plans[0].kernel_name
    assert plans[0].kernel_name.startswith("moe_xpu::moe_gemm_dequant_matrix<" if dequant else "moe_xpu::moe_gemm_quant<")


@pytest.mark.parametrize("target", ["pvc", "dg2"])
@pytest.mark.parametrize("gated", [False, True])
def test_gpu_xmx_variants_run_correctly_on_amx(C, target, gated):
    """The XMX kernel (the matrix kernel at the GPU's engine tile: 8 x 16 x 16 on 16 lanes for
    Xe-HPC/Xe2/Xe3, 8 x 8 x 16 on 8 lanes for Xe-HPG) run by the CPU device's AMX, against the
    float64 reference: empty experts, one expert taking most rows, several token tiles, the zeroed
    tail, an index table, bias."""
    if not C.device_info(0).matrix_engine:
        pytest.skip("needs a CPU with AMX-BF16 (the CPU device runs joint_matrix only there)")
    import torch.nn.functional as F

    from moe_xpu.fused import ACTIVATIONS

    T, E, K, N = 70, 5, 96, 64
    a = torch.randn(T, K, dtype=torch.bfloat16)
    b = make_b(E, K, N, torch.bfloat16, "linear")
    bias = torch.randn(E, N, dtype=torch.bfloat16)
    counts = [0, 41, 3, 0, 17]
    offs = offsets(counts)
    gi = torch.randint(0, T, (sum(counts),))
    a_, b_, offs_, gi_, bias_ = ops.kernel_ready(a, b, offs, gi, bias)
    half = N // 2
    out = torch.empty(sum(counts), half if gated else N, dtype=torch.float32)
    args = ops.gemm_args(a_, b_, offs_, gi_, bias_, out)
    args.variants_for = target
    if gated:
        args.activation, args.up_offset, args.N = ACTIVATIONS["silu"], half, half
    plan = C.plan_gemm(args)
    assert plan.matrix_engine and plan.sub_group_size == XMX[target][3]
    C.moe_gemm(args)
    if not gated:
        assert_matches_reference(out, a, b, offs, gather_index=gi, bias=bias, out_dtype=torch.float32)
        return
    ref = torch.zeros(sum(counts), N, dtype=torch.float64)
    start = 0
    for g, end in enumerate(offs.tolist()):
        ref[start:end] = a[gi[start:end]].double() @ b[g].double() + bias[g].double()
        start = end
    expected = F.silu(ref[:, :half]) * ref[:, half:]
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-3)


def test_xmx_tiles_follow_the_reported_matrix_combinations(C):
    """On a real GPU the launcher turns XMX on from what the device reports
    (sycl_ext_oneapi_matrix combinations: exact sizes, or 0 and a maximum); W8A8's int8 tile where
    signed int8 with int32 sums is reported at twice the bf16 k, on the 16-lane tile only."""
    def combo(max_m, n, k, t, acc="fp32"):
        return (max_m, 0, 0, 0, n, k, t, t, acc)

    pvc = [combo(8, 16, 16, "bf16"), combo(8, 16, 16, "fp16"), combo(8, 16, 32, "sint8", "sint32")]
    assert C.shapes_from_combinations(pvc, [16, 32]) == [(8, 16, 16, 16, True, True)]
    assert C.shapes_from_combinations(pvc[:2], [16, 32]) == [(8, 16, 16, 16, True, False)]  # no int8
    assert C.shapes_from_combinations(pvc[:2] + [combo(8, 16, 32, "sint8", "fp32")], [16]) == [(8, 16, 16, 16, True, False)]
    dg2 = [combo(8, 8, 16, "bf16"), combo(8, 8, 16, "fp16"), combo(8, 8, 32, "sint8", "sint32")]
    assert C.shapes_from_combinations(dg2, [8, 16, 32]) == [(8, 8, 16, 8, True, False)]  # W8A8 not built on 8 lanes
    assert C.shapes_from_combinations(dg2, [16, 32]) == []  # no 8-lane sub-groups: no tile
    assert C.shapes_from_combinations([combo(8, 16, 16, "bf16")], [16]) == [(8, 16, 16, 16, False, False)]
    assert C.shapes_from_combinations([combo(4, 16, 16, "bf16")], [16]) == []  # 8 rows not allowed
    assert C.shapes_from_combinations([combo(8, 16, 16, "bf16", "bf16")], [16]) == []  # no float acc
    amx = [(0, 0, 0, 16, 16, 32, "bf16", "bf16", "fp32"), (0, 0, 0, 16, 16, 64, "sint8", "sint8", "sint32")]
    assert C.shapes_from_combinations(amx, [16]) == [(16, 16, 32, 16, False, True)]
    assert C.shapes_from_combinations([], [8, 16, 32]) == []