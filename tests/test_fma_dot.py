"""The FMA dot-product kernels (assembly, sycl/kernels/moe_gemm_fma.cpp) against the float64
reference, where they run: at 8 floats a register (an AVX2 CPU, or an AVX-512 one under the OpenCL
CPU target core-avx2: tests/device_matrix.py) on float32, bf16 and fp16 weights, at 16 (AVX-512) on
bf16 and fp16 weights. The plan picks them where it should, and their sums are right on shapes
that break the assembly's k step (8 or 16 elements) and its tiles (3 x 4 or 4 x 6, and the decode
tile 1 x 8): K below, at and past multiples of the step, N not a multiple of the tile's columns,
short last row tiles, one row a group, units of many row tiles; through index tables, with bias,
gated, and bitwise the same for every worker count."""

from __future__ import annotations

import itertools

import pytest
import torch

import moe_xpu
from moe_xpu import fused, ops
from reference import assert_matches_reference, assert_non_finite_rows_propagate
from test_fused_moe import check as check_fused
from test_fused_moe import make_block
from test_moe_gemm import ROUTINGS, offsets, route

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def fma(C):
    """The launcher (conftest.py), on a CPU whose kernels include the FMA dot-product family."""
    if not C.device_description(0)["fma_dot"]:
        pytest.skip(f"no FMA dot-product kernels here: {C.fma_dot_state()}")
    return C


def width(C) -> int:
    """Floats a register of the kernels: 8 (AVX2) or 16 (AVX-512)."""
    return C.device_description(0)["vector_width"]


def tile(C) -> tuple[int, int]:
    """The family's register tile at this width (rows, columns)."""
    return (3, 4) if width(C) == 8 else (4, 6)


def bf16_dot(C) -> bool:
    """Whether bf16 weights run on the bf16 dot-product kernels here (AVX512-BF16) instead."""
    return bool(C.device_description(0)["bf16_dot"])


def own_dtype(C):
    """A weight dtype the family takes at this width: float32 on AVX2; on AVX-512 bf16, or fp16
    where the CPU has AVX512-BF16 (bf16 then runs on the dot-product kernels)."""
    if width(C) == 8:
        return torch.float32
    return torch.float16 if bf16_dot(C) else torch.bfloat16


def elsewhere(C, dtype) -> str | None:
    """Why weights of dtype do not run on the family here, or None where they do (AVX-512: 16-bit
    ones only, float32 weights staying on the vector kernels, whose k loop is the same there; bf16
    not where the bf16 dot-product kernels take it)."""
    if width(C) == 16 and dtype == torch.float32:
        return "float32 weights run on the vector kernels on AVX-512"
    if dtype == torch.bfloat16 and bf16_dot(C):
        return "bf16 weights run on the bf16 dot-product kernels on this CPU"
    return None


def takes(C, dtype):
    """Skips unless the family takes weights of dtype here."""
    if (why := elsewhere(C, dtype)) is not None:
        pytest.skip(why)


def linear_weights(E, K, N, dtype=torch.float32):
    """nn.Linear-layout experts [E, N, K] seen as [E, K, N]: contiguous along K."""
    return torch.randn(E, N, K, dtype=dtype).transpose(1, 2)


def plan(C, a, b, offs, gather_index=None, out_dtype=None, **overrides):
    """The plan of the launch moe_gemm makes (16-bit A widened where the plan asks for it), its
    arguments, its output and the A they point at (kept alive by the caller)."""
    rows = a.shape[0] if gather_index is None else gather_index.shape[0]
    out = torch.empty(rows, b.shape[2], dtype=out_dtype or b.dtype)
    a_, b_, offs_, gi_, _ = ops.kernel_ready(a, b, offs, gather_index, None)

    def args_for(x):
        args = ops.gemm_args(x, b_, offs_, gi_, None, out)
        for name, value in overrides.items():
            setattr(args, name, value)
        return args

    args = args_for(a_)
    p = C.plan_gemm(args)
    if p.widen_a:
        a_ = a_.float()
        args = args_for(a_)
        p = C.plan_gemm(args)
    return p, args, out, a_


@pytest.mark.parametrize("dtype", DTYPES)
def test_plan_picks_the_fma_kernels_for_groups_of_several_rows(fma, dtype):
    E, K, N = 8, 256, 90
    b = linear_weights(E, K, N, dtype)
    many = torch.randn(8 * E, K, dtype=dtype)
    if elsewhere(fma, dtype) is not None:
        assert "k_fma" not in plan(fma, many, b, offsets([8] * E))[0].kernel_name
        return
    rows, cols = tile(fma)
    assert f"moe_gemm_k_fma<" in (name := plan(fma, many, b, offsets([8] * E))[0].kernel_name)
    assert f", {rows}, {cols}, false, {width(fma)}>" in name
    # Decode (a row or two a group): the one-row tile.
    one = torch.randn(E, K, dtype=dtype)
    assert "moe_gemm_k_fma<" in (name := plan(fma, one, b, offsets([1] * E))[0].kernel_name)
    assert f", 1, 8, false, {width(fma)}>" in name
    # [E, K, N] weights, the vector kernels forced or a tile override: not this family.
    assert "k_fma" not in plan(fma, many, b.contiguous(), offsets([8] * E))[0].kernel_name
    assert "k_fma" not in plan(fma, many, b, offsets([8] * E), engine=1)[0].kernel_name
    tile_m, tile_n = fma.device_description(0)["k_lanes_tiles"][-1]  # a vector kernel tile
    assert "k_fma" not in plan(fma, many, b, offsets([8] * E), tile_m=tile_m, tile_n=tile_n)[0].kernel_name


@pytest.mark.parametrize(
    "dtype,K,N,routing",
    list(itertools.product(DTYPES, [8, 15, 16, 17, 31, 64, 200], [1, 4, 7, 9], ROUTINGS)),
)
@pytest.mark.parametrize("T", [41, 7])
def test_matches_reference(fma, dtype, K, N, routing, T):
    takes(fma, dtype)
    E = 5
    a = torch.randn(T, K, dtype=dtype)
    b = linear_weights(E, K, N, dtype)
    counts = route(routing, E, T)
    offs = offsets(counts)
    bias = torch.randn(E, N, dtype=dtype)
    assert "k_fma" in plan(fma, a, b, offs)[0].kernel_name
    out = moe_xpu.moe_gemm(a, b, offs, bias=bias)
    assert_matches_reference(out, a, b, offs, bias=bias)
    assert not out[int(offs[-1]) :].any(), "rows past group_offsets[-1] must be zero"


@pytest.mark.parametrize("K", [3, 7, 15])
def test_k_below_one_step_is_the_remainder_alone(fma, K):
    dtype = own_dtype(fma)
    a = torch.randn(12, K, dtype=dtype)
    b = linear_weights(2, K, 9, dtype)
    offs = offsets([5, 7])
    assert "k_fma" in plan(fma, a, b, offs)[0].kernel_name
    assert_matches_reference(moe_xpu.moe_gemm(a, b, offs), a, b, offs)


@pytest.mark.parametrize("dtype,index_dtype", list(itertools.product(DTYPES, [torch.int32, torch.int64])))
def test_index_table_float_output_and_strided_rows(fma, dtype, index_dtype):
    takes(fma, dtype)
    E, T, K, N = 4, 30, 130, 21
    wide = torch.randn(T, K + 9, dtype=dtype)
    a = wide[:, 3 : 3 + K]  # rows K + 9 elements apart
    b = linear_weights(E, K, N, dtype)
    counts = [11, 0, 27, 22]
    offs = offsets(counts, index_dtype)
    gather = torch.randint(0, T, (sum(counts),), dtype=index_dtype)
    out_dtype = torch.float32 if dtype != torch.float32 else None
    assert "k_fma" in plan(fma, a, b, offs, gather, out_dtype=out_dtype)[0].kernel_name
    out = moe_xpu.moe_gemm(a, b, offs, gather_index=gather, out_dtype=out_dtype)
    assert_matches_reference(out, a, b, offs, gather_index=gather, out_dtype=out_dtype)


def test_strided_weights_one_expert_takes_everything_and_zero_tokens(fma):
    K, N, dtype = 4096 + 5, 30, own_dtype(fma)
    a = torch.randn(300, K, dtype=dtype)  # one group of 300 rows: units of many row tiles
    b = torch.randn(3, N, K + 3, dtype=dtype)[:, :, :K].transpose(1, 2)  # weight rows K + 3 apart
    offs = offsets([0, 300, 0])
    assert "k_fma" in plan(fma, a, b, offs)[0].kernel_name
    assert_matches_reference(moe_xpu.moe_gemm(a, b, offs), a, b, offs)
    empty = moe_xpu.moe_gemm(a[:0], b, offsets([0, 0, 0]))
    assert empty.shape == (0, N)


def test_many_experts(fma):
    E, K, N, dtype = 128, 72, 13, own_dtype(fma)
    counts = torch.randint(0, 7, (E,)).tolist()
    a = torch.randn(sum(counts), K, dtype=dtype)
    b = linear_weights(E, K, N, dtype)
    offs = offsets(counts)
    assert "k_fma" in plan(fma, a, b, offs)[0].kernel_name
    assert_matches_reference(moe_xpu.moe_gemm(a, b, offs), a, b, offs)


def test_non_finite_inputs_propagate(fma):
    E, K, N, dtype = 2, 64, 12, own_dtype(fma)
    a = torch.randn(12, K, dtype=dtype)
    b = linear_weights(E, K, N, dtype)
    assert "k_fma" in plan(fma, a, b, offsets([6, 6]))[0].kernel_name
    assert_non_finite_rows_propagate(moe_xpu.moe_gemm, a, b, offsets([6, 6]))


def assert_bitwise_for_every_worker_count(C, a, b, offs, kernel: str):
    """The launch on `kernel` gives bitwise the same output for 1, 3, 16 and the planned number of
    workers (share boundaries mid-group and mid-unit), and it matches the reference."""
    outs = []
    for workers in (0, 1, 3, 16):
        p, args, out, _a = plan(C, a, b, offs, num_workers=workers)
        assert kernel in p.kernel_name
        C.moe_gemm(args)
        outs.append(out)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    assert_matches_reference(outs[0], a, b, offs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bitwise_the_same_for_every_worker_count(fma, dtype):
    takes(fma, dtype)
    E, K, N = 6, 200, 50
    a = torch.randn(60, K, dtype=dtype)
    b = linear_weights(E, K, N, dtype)
    assert_bitwise_for_every_worker_count(fma, a, b, offsets([10, 3, 0, 25, 7, 15]), "k_fma")


def test_a_row_does_not_depend_on_its_tile(fma):
    """A row tile runs only the rows it holds (1 to R, the tile's rows: a group's last tile may be
    short), each row's sums its own: a row's output is bitwise the same whatever else its group
    holds, and each group size's outputs match the reference."""
    K, N, dtype = 96 + 5, 13, own_dtype(fma)
    R = tile(fma)[0]
    b = linear_weights(2, K, N, dtype)
    a = torch.randn(3 * R, K, dtype=dtype)
    first = None
    for rows in range(R, 3 * R + 1):
        offs = offsets([rows, R])
        x = torch.cat([a[:rows], a[:R]])
        assert "k_fma" in plan(fma, x, b, offs)[0].kernel_name
        out = moe_xpu.moe_gemm(x, b, offs)
        assert_matches_reference(out, x, b, offs)
        if first is None:
            first = out[:R], out[R:]
        assert torch.equal(out[:R], first[0]), rows  # group 0's first R rows, in tiles of 1 to R rows
        assert torch.equal(out[rows:], first[1]), rows  # group 1's R rows: one tile


@pytest.mark.parametrize("dtype,activation,bias",
                         list(itertools.product(DTYPES, ["silu", "gelu_tanh"], [False, True])))
def test_fused_moe_on_the_fma_kernels(fma, dtype, activation, bias):
    takes(fma, dtype)
    # 40 tokens top-2 of 8 experts: 10 rows an expert, H = 101 (12 k steps and a remainder),
    # I = 38. Both GEMMs run on the FMA kernels (the first gated), h in float32 between them.
    x, gu, dn, w, ids, biases = make_block(40, 101, 38, 8, 2, dtype, bias=bias)
    fused._PREPARED.clear()
    out = moe_xpu.fused_moe(x, gu, dn, w, ids, activation=activation, gate_up_bias=biases[0],
                            down_bias=biases[1])
    prepared = list(fused._PREPARED.values())
    assert len(prepared) == 1 and prepared[0].h_dtype == torch.float32
    for launch in (prepared[0].gate_up, prepared[0].down):
        assert "moe_gemm_k_fma<" in launch.launcher.plan.kernel_name
    check_fused(out, x, gu, dn, w, ids, activation, biases)
    again = moe_xpu.fused_moe(x, gu, dn, w, ids, activation=activation, gate_up_bias=biases[0],
                              down_bias=biases[1])
    assert torch.equal(out, again)
