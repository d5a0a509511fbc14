"""The N-contiguous FMA kernel (moe_gemm_n_fma, assembly, sycl/kernels/moe_gemm_fma.cpp) against
the float64 reference, where it runs: at 8 floats a register (an AVX2 CPU, or an AVX-512 one under
the OpenCL CPU target core-avx2: tests/device_matrix.py) on [E, K, N] weights of float32, bf16 and
fp16, with A of the weights' dtype (16-bit A widened in the k loop) or float32. The plan picks it
where it should, and its sums are right on shapes that break its 6 x 16 tile and its packed copy of
a unit's B strip: short last row tiles (1 to 5 rows), one row a group, units of many row tiles, K
below and past the prefetch distance, index tables, strided rows of A and of B, bias, and bitwise
the same for every worker count."""

from __future__ import annotations

import itertools

import pytest
import torch

import moe_xpu
from reference import assert_matches_reference, assert_non_finite_rows_propagate
from test_fma_dot import assert_bitwise_for_every_worker_count, plan
from test_moe_gemm import ROUTINGS, offsets, route

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def fma(C):
    """The launcher (conftest.py), on a CPU whose kernels include the N-contiguous FMA kernel."""
    d = C.device_description(0)
    if not d["fma_dot"]:
        pytest.skip(f"no FMA dot-product kernels here: {C.fma_dot_state()}")
    if d["vector_width"] != 8:
        pytest.skip("the N-contiguous FMA kernel is AVX2's (on AVX-512 the vector kernel's loop is the same)")
    return C


def kernel(C, a, b, offs, gather_index=None, **kw) -> str:
    return plan(C, a, b, offs, gather_index, **kw)[0].kernel_name


@pytest.mark.parametrize("dtype", DTYPES)
def test_plan_picks_the_kernel_for_groups_of_several_rows(fma, dtype):
    E, K, N = 8, 256, 96
    b = torch.randn(E, K, N, dtype=dtype)
    many = torch.randn(8 * E, K, dtype=dtype)
    p = plan(fma, many, b, offsets([8] * E))[0]
    t = {torch.float32: "float", torch.bfloat16: "uint16_t", torch.float16: "sycl::half"}[dtype]
    assert p.kernel_name == f"moe_xpu::moe_gemm_n_fma<{t}, {t}, {t}>"
    assert not p.widen_a  # 16-bit A is widened in the k loop, not before the launch
    # Decode (a row or two a group), N not a multiple of 16, the vector kernels forced, a tile
    # override, weights contiguous along K: not this kernel.
    assert "n_fma" not in kernel(fma, torch.randn(E, K, dtype=dtype), b, offsets([1] * E))
    assert "n_fma" not in kernel(fma, many, b[:, :, :90], offsets([8] * E))
    vector = plan(fma, many, b, offsets([8] * E), engine=1)[0]
    assert "n_lanes" in vector.kernel_name
    assert "n_fma" not in kernel(fma, many, b, offsets([8] * E), tile_m=vector.tile_m, tile_n=vector.tile_n // 16)
    assert "n_fma" not in kernel(fma, many, b.transpose(1, 2).contiguous().transpose(1, 2), offsets([8] * E))


@pytest.mark.parametrize(
    "dtype,K,N,routing",
    list(itertools.product(DTYPES, [2, 7, 23, 24, 25, 64, 131], [16, 48], ROUTINGS)),
)
@pytest.mark.parametrize("T", [53, 9])
def test_matches_reference(fma, dtype, K, N, routing, T):
    E = 3
    a = torch.randn(T, K, dtype=dtype)
    b = torch.randn(E, K, N, dtype=dtype)
    counts = route(routing, E, T)
    offs = offsets(counts)
    bias = torch.randn(E, N, dtype=dtype)
    if sum(counts) / E > 2:
        assert "n_fma" in kernel(fma, a, b, offs)
    out = moe_xpu.moe_gemm(a, b, offs, bias=bias)
    assert_matches_reference(out, a, b, offs, bias=bias)
    assert not out[int(offs[-1]):].any(), "rows past group_offsets[-1] must be zero"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float_a_with_16_bit_weights(fma, dtype):
    """Float32 A against 16-bit weights (the variant the fused MoE's second GEMM reads its h
    with): where A holds values of the weights' dtype, bitwise the sums of the 16-bit A variant."""
    E, K, N = 3, 77, 32
    a16 = torch.randn(40, K, dtype=dtype)
    b = torch.randn(E, K, N, dtype=dtype)
    offs = offsets([13, 0, 27])
    p32, args32, out32, _a32 = plan(fma, a16.float(), b, offs, out_dtype=dtype)
    p16, args16, out16, _a16 = plan(fma, a16, b, offs)
    assert p32.kernel_name.startswith("moe_xpu::moe_gemm_n_fma<float, ")
    assert p16.kernel_name.startswith("moe_xpu::moe_gemm_n_fma<") and "float" not in p16.kernel_name
    fma.moe_gemm(args32)
    fma.moe_gemm(args16)
    assert torch.equal(out32, out16)
    assert_matches_reference(out16, a16, b, offs)


@pytest.mark.parametrize("dtype,index_dtype", list(itertools.product(DTYPES, [torch.int32, torch.int64])))
def test_index_table_float_output_and_strided_rows(fma, dtype, index_dtype):
    E, T, K, N = 4, 30, 130, 32
    wide = torch.randn(T, K + 9, dtype=dtype)
    a = wide[:, 3:3 + K]  # rows K + 9 elements apart
    b = torch.randn(E, K, N + 16, dtype=dtype)[:, :, 8:8 + N]  # weight rows N + 16 apart
    counts = [11, 0, 27, 22]
    offs = offsets(counts, index_dtype)
    gather = torch.randint(0, T, (sum(counts),), dtype=index_dtype)
    out_dtype = torch.float32 if dtype != torch.float32 else None
    assert "n_fma" in kernel(fma, a, b, offs, gather, out_dtype=out_dtype)
    out = moe_xpu.moe_gemm(a, b, offs, gather_index=gather, out_dtype=out_dtype)
    assert_matches_reference(out, a, b, offs, gather_index=gather, out_dtype=out_dtype)
    # The gather inside the kernel is the copy then the GEMM, bitwise.
    copied = moe_xpu.moe_gemm(a.index_select(0, gather.long()), b, offs, out_dtype=out_dtype)
    assert torch.equal(out, copied)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_expert_takes_everything_and_zero_tokens(fma, dtype):
    """300 rows in one group: units of 10 row tiles, the first packing the B strip and the other
    nine reading the copy, and a unit of the last 60 rows' remainder (short last tile)."""
    K, N = 1031, 64
    a = torch.randn(300, K, dtype=dtype)
    b = torch.randn(3, K, N, dtype=dtype)
    offs = offsets([0, 300, 0])
    assert "n_fma" in kernel(fma, a, b, offs)
    assert_matches_reference(moe_xpu.moe_gemm(a, b, offs), a, b, offs)
    empty = moe_xpu.moe_gemm(a[:0], b, offsets([0, 0, 0]))
    assert empty.shape == (0, N)


def test_many_experts(fma):
    E, K, N = 128, 72, 32
    counts = torch.randint(3, 9, (E,)).tolist()
    a = torch.randn(sum(counts), K)
    b = torch.randn(E, K, N)
    offs = offsets(counts)
    assert "n_fma" in kernel(fma, a, b, offs)
    assert_matches_reference(moe_xpu.moe_gemm(a, b, offs), a, b, offs)


def test_non_finite_inputs_propagate(fma):
    E, K, N = 2, 64, 16
    a = torch.randn(12, K)
    b = torch.randn(E, K, N)
    assert "n_fma" in kernel(fma, a, b, offsets([6, 6]))
    assert_non_finite_rows_propagate(moe_xpu.moe_gemm, a, b, offsets([6, 6]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_bitwise_the_same_for_every_worker_count(fma, dtype):
    E, K, N = 6, 200, 48
    a = torch.randn(160, K, dtype=dtype)
    b = torch.randn(E, K, N, dtype=dtype)
    assert_bitwise_for_every_worker_count(fma, a, b, offsets([10, 3, 0, 95, 7, 45]), "n_fma")


def test_a_row_does_not_depend_on_its_tile(fma):
    """A row tile runs only the rows it holds (1 to 6), whether it reads B's rows, packs them or
    reads the packed copy, each row's sums its own: a row's output is bitwise the same whatever
    else its group holds."""
    K, N = 101, 32
    b = torch.randn(2, K, N)
    a = torch.randn(70, K)
    first = None
    for rows in list(range(6, 19)) + [61, 66, 70]:
        offs = offsets([rows, 6])
        x = torch.cat([a[:rows], a[:6]])
        assert "n_fma" in kernel(fma, x, b, offs)
        out = moe_xpu.moe_gemm(x, b, offs)
        assert_matches_reference(out, x, b, offs)
        if first is None:
            first = out[:6], out[6:]
        assert torch.equal(out[:6], first[0]), rows
        assert torch.equal(out[rows:], first[1]), rows
