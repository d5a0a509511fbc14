"""The bf16 dot-product kernels (AVX512-BF16 assembly, sycl/kernels/moe_gemm_dot.cpp) against the
float64 reference, on CPUs that run them: the plan picks them where it should, and their sums are
right on shapes that break the assembly's 32-element k step and its 4 x 6 tile (K below, at and past
multiples of 32, N not a multiple of 6, short last row tiles), through index tables, with bias,
gated, and bitwise the same for every worker count. (N is never a multiple of 16, so that on CPUs
with AMX, whose engine takes bf16 at whole 16-column tiles first, these shapes too run on them.)"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch

import moe_xpu
from moe_xpu import fused, ops
from reference import assert_matches_reference, assert_non_finite_rows_propagate
from test_fused_moe import check as check_fused
from test_fused_moe import make_block
from test_moe_gemm import ROUTINGS, offsets, route


@pytest.fixture
def dot(C):
    """The launcher (conftest.py), on a CPU whose bf16 kernels include the dot-product family."""
    if not C.device_description(0)["bf16_dot"]:
        pytest.skip("no bf16 dot-product kernels here: needs a CPU with AVX512-BF16 and the OpenCL CPU "
                    "compiler targeting it (not MOE_XPU_BF16_DOT=0)")
    return C


def linear_weights(E, K, N):
    """nn.Linear-layout experts [E, N, K] seen as [E, K, N]: contiguous along K."""
    return torch.randn(E, N, K, dtype=torch.bfloat16).transpose(1, 2)


def plan(C, a, b, offs, gather_index=None, out_dtype=None, **overrides):
    rows = a.shape[0] if gather_index is None else gather_index.shape[0]
    out = torch.empty(rows, b.shape[2], dtype=out_dtype or b.dtype)
    a_, b_, offs_, gi_, _ = ops.kernel_ready(a, b, offs, gather_index, None)
    args = ops.gemm_args(a_, b_, offs_, gi_, None, out)
    for name, value in overrides.items():
        setattr(args, name, value)
    return C.plan_gemm(args), args, out


def test_plan_picks_the_dot_kernels_for_bf16_groups_of_several_rows(dot):
    E, K, N = 8, 256, 90  # (N not a multiple of 16: the shapes an AMX engine does not take)
    b = linear_weights(E, K, N)
    many = torch.randn(8 * E, K, dtype=torch.bfloat16)
    assert "moe_gemm_k_dot<" in plan(dot, many, b, offsets([8] * E))[0].kernel_name
    assert "moe_gemm_k_dot<float," in plan(dot, many, b, offsets([8] * E), out_dtype=torch.float32)[0].kernel_name
    # Decode (a row or two a group) streams the weights: the vector kernel's one-row tile.
    one = torch.randn(E, K, dtype=torch.bfloat16)
    assert "moe_gemm_k_lanes<" in plan(dot, one, b, offsets([1] * E))[0].kernel_name
    # [E, K, N] weights, float16, float32 A, the vector kernels forced or a tile override: not this family.
    assert "k_dot" not in plan(dot, many, b.contiguous(), offsets([8] * E))[0].kernel_name
    assert "k_dot" not in plan(dot, many.half(), b.half(), offsets([8] * E))[0].kernel_name
    assert "k_dot" not in plan(dot, many.float(), b, offsets([8] * E), out_dtype=torch.bfloat16)[0].kernel_name
    assert "k_dot" not in plan(dot, many, b, offsets([8] * E), engine=1)[0].kernel_name
    tile_m, tile_n = dot.device_description(0)["k_lanes_tiles"][-1]  # a vector kernel tile compiled here
    assert "k_dot" not in plan(dot, many, b, offsets([8] * E), tile_m=tile_m, tile_n=tile_n)[0].kernel_name


@pytest.mark.parametrize(
    "K,N,routing",
    list(itertools.product([32, 33, 95, 96, 1000], [1, 6, 7, 13], ROUTINGS)),
)
def test_matches_reference(dot, K, N, routing):
    E, T = 5, 41
    a = torch.randn(T, K, dtype=torch.bfloat16)
    b = linear_weights(E, K, N)
    counts = route(routing, E, T)
    offs = offsets(counts)
    bias = torch.randn(E, N, dtype=torch.bfloat16)
    if T / E > 2:
        assert "k_dot" in plan(dot, a, b, offs)[0].kernel_name
    out = moe_xpu.moe_gemm(a, b, offs, bias=bias)
    assert_matches_reference(out, a, b, offs, bias=bias)
    assert not out[int(offs[-1]) :].any(), "rows past group_offsets[-1] must be zero"


@pytest.mark.parametrize("K,index_dtype", list(itertools.product([31, 64, 130], [torch.int32, torch.int64])))
def test_index_table_float_output_and_strided_rows(dot, K, index_dtype):
    E, T, N = 4, 30, 20
    wide = torch.randn(T, K + 9, dtype=torch.bfloat16)
    a = wide[:, 3 : 3 + K]  # rows K + 9 elements apart
    b = linear_weights(E, K, N)
    counts = [11, 0, 27, 22]
    offs = offsets(counts, index_dtype)
    gather = torch.randint(0, T, (sum(counts),), dtype=index_dtype)
    assert "k_dot" in plan(dot, a, b, offs, gather)[0].kernel_name
    out = moe_xpu.moe_gemm(a, b, offs, gather_index=gather, out_dtype=torch.float32)
    assert_matches_reference(out, a, b, offs, gather_index=gather, out_dtype=torch.float32)


def test_one_expert_takes_everything_and_zero_tokens(dot):
    K, N = 4096 + 16, 30
    a = torch.randn(300, K, dtype=torch.bfloat16)
    b = linear_weights(3, K, N)
    offs = offsets([0, 300, 0])
    assert_matches_reference(moe_xpu.moe_gemm(a, b, offs), a, b, offs)
    empty = moe_xpu.moe_gemm(a[:0], b, offsets([0, 0, 0]))
    assert empty.shape == (0, N)


def test_non_finite_inputs_propagate(dot):
    E, K, N = 2, 64, 12
    a = torch.randn(12, K, dtype=torch.bfloat16)
    b = linear_weights(E, K, N)
    assert_non_finite_rows_propagate(moe_xpu.moe_gemm, a, b, offsets([6, 6]))


def test_bitwise_the_same_for_every_worker_count(dot):
    E, K, N = 6, 200, 50
    a = torch.randn(60, K, dtype=torch.bfloat16)
    b = linear_weights(E, K, N)
    offs = offsets([10, 3, 0, 25, 7, 15])
    outs = []
    for workers in (0, 1, 3, 16):
        p, args, out = plan(dot, a, b, offs, num_workers=workers)
        assert "k_dot" in p.kernel_name
        dot.moe_gemm(args)
        outs.append(out)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    assert_matches_reference(outs[0], a, b, offs)


@pytest.mark.parametrize("activation,bias", list(itertools.product(["silu", "gelu_tanh"], [False, True])))
def test_fused_moe_on_the_dot_kernels(dot, activation, bias):
    # 40 tokens top-2 of 8 experts: 10 rows an expert, H = 101 (three k steps and a remainder),
    # I = 38. Both GEMMs run on the dot kernels (the first gated), with h in bf16 between them.
    x, gu, dn, w, ids, biases = make_block(40, 101, 38, 8, 2, torch.bfloat16, bias=bias)
    fused._PREPARED.clear()
    out = moe_xpu.fused_moe(x, gu, dn, w, ids, activation=activation, gate_up_bias=biases[0],
                            down_bias=biases[1])
    assert [p.h_dtype for p in fused._PREPARED.values()] == [torch.bfloat16]
    check_fused(out, x, gu, dn, w, ids, activation, biases)
    again = moe_xpu.fused_moe(x, gu, dn, w, ids, activation=activation, gate_up_bias=biases[0],
                              down_bias=biases[1])
    assert torch.equal(out, again)


# The N-contiguous kernel (moe_gemm_n_dot): [E, K, N] weights, N a multiple of its 64 columns.
# Its k step is a pair of B rows: K odd leaves one k for the lanes. (On CPUs with AMX the engine
# takes [E, K, N] bf16 groups of 5+ rows at K % 32 == 0 first: the plan checks allow for it.)


def _takes_n_dot(C, a, b, offs, gather_index=None, **kw) -> bool:
    name = plan(C, a, b, offs, gather_index, **kw)[0].kernel_name
    if C.device_description(0)["matrix_shapes"] and "matrix_kn" in name:
        return True
    return "moe_gemm_n_dot<" in name


def test_plan_picks_the_n_dot_kernel(dot):
    E, K, N = 8, 250, 128
    b = torch.randn(E, K, N, dtype=torch.bfloat16)
    many = torch.randn(8 * E, K, dtype=torch.bfloat16)
    assert _takes_n_dot(dot, many, b, offsets([8] * E))
    assert "moe_gemm_n_dot<float>" in plan(dot, many, b, offsets([8] * E), out_dtype=torch.float32)[0].kernel_name
    one = torch.randn(E, K, dtype=torch.bfloat16)
    assert "n_dot" not in plan(dot, one, b, offsets([1] * E))[0].kernel_name  # decode: streaming tile
    assert "n_dot" not in plan(dot, many, b[:, :, :96], offsets([8] * E))[0].kernel_name  # N % 64
    assert "n_dot" not in plan(dot, many, b, offsets([8] * E), engine=1)[0].kernel_name
    assert "n_dot" not in plan(dot, many.half(), b.half(), offsets([8] * E))[0].kernel_name


@pytest.mark.parametrize(
    "K,N,routing",
    list(itertools.product([2, 3, 31, 97, 1000], [64, 192], ROUTINGS)),
)
def test_n_dot_matches_reference(dot, K, N, routing):
    E, T = 5, 41
    a = torch.randn(T, K, dtype=torch.bfloat16)
    b = torch.randn(E, K, N, dtype=torch.bfloat16)
    counts = route(routing, E, T)
    offs = offsets(counts)
    bias = torch.randn(E, N, dtype=torch.bfloat16)
    assert _takes_n_dot(dot, a, b, offs)
    out = moe_xpu.moe_gemm(a, b, offs, bias=bias)
    assert_matches_reference(out, a, b, offs, bias=bias)
    assert not out[int(offs[-1]) :].any(), "rows past group_offsets[-1] must be zero"


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_n_dot_index_table_float_output_and_strides(dot, index_dtype):
    E, T, K, N = 4, 30, 77, 128
    a = torch.randn(T, K + 9, dtype=torch.bfloat16)[:, 3 : 3 + K]  # rows K + 9 elements apart
    b = torch.randn(E, K, N + 40, dtype=torch.bfloat16)[:, :, 8 : 8 + N]  # B rows N + 40 apart
    counts = [11, 0, 27, 22]
    offs = offsets(counts, index_dtype)
    gather = torch.randint(0, T, (sum(counts),), dtype=index_dtype)
    assert _takes_n_dot(dot, a, b, offs, gather, out_dtype=torch.float32)
    out = moe_xpu.moe_gemm(a, b, offs, gather_index=gather, out_dtype=torch.float32)
    assert_matches_reference(out, a, b, offs, gather_index=gather, out_dtype=torch.float32)


def test_n_dot_one_expert_takes_everything_and_worker_counts(dot):
    E, K, N = 3, 301, 64
    a = torch.randn(300, K, dtype=torch.bfloat16)
    b = torch.randn(E, K, N, dtype=torch.bfloat16)
    offs = offsets([0, 300, 0])
    outs = []
    for workers in (0, 1, 3, 16):
        p, args, out = plan(dot, a, b, offs, num_workers=workers)
        assert "n_dot" in p.kernel_name or "matrix_kn" in p.kernel_name
        dot.moe_gemm(args)
        outs.append(out)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    assert_matches_reference(outs[0], a, b, offs)


# B rows whose byte stride is a multiple of 2048 share few cache sets: a unit of several row tiles
# then interleaves its B pairs into scratch once and its later tiles read that copy
# (sizes.hpp: n_dot_packs). The copy must give the same bits as reading B.


def _rows_apart(b, stride):
    """b's values with its rows `stride` elements apart."""
    E, K, N = b.shape
    out = torch.full((E, K, stride), float("nan"), dtype=b.dtype)
    out[:, :, :N] = b
    return out[:, :, :N]


@pytest.mark.parametrize("index_dtype", [None, torch.int64])
def test_n_dot_packed_b_gives_the_bits_of_reading_b(dot, index_dtype):
    E, T, K, N = 5, 70, 611, 128
    b = torch.randn(E, K, N, dtype=torch.bfloat16)
    a = torch.randn(T, K, dtype=torch.bfloat16)
    counts = [13, 0, 1, 40, 7]
    offs = offsets(counts)
    gather = None if index_dtype is None else torch.randint(0, T, (sum(counts),), dtype=index_dtype)
    if gather is None:
        a = a[: sum(counts)]
    conflicting, spread = _rows_apart(b, 1024), _rows_apart(b, 1056)
    p_conflicting, p_spread = plan(dot, a, conflicting, offs, gather)[0], plan(dot, a, spread, offs, gather)[0]
    if "moe_gemm_n_dot<" not in p_conflicting.kernel_name:
        pytest.skip(f"the plan runs {p_conflicting.kernel_name} here (a matrix engine takes these first)")
    assert p_conflicting.scratch_bytes == K // 2 * 64 * 4  # 2048-byte rows: packed
    assert p_spread.scratch_bytes < K // 2 * 64 * 4  # 2112-byte rows: read in place
    outs = []
    for workers in (0, 1, 3):
        for weights in (conflicting, spread):
            _, args, out = plan(dot, a, weights, offs, gather, num_workers=workers)
            dot.moe_gemm(args)
            outs.append(out)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    assert_matches_reference(outs[0], a, b, offs, gather_index=gather)


def test_n_dot_past_the_packed_k_reads_b(dot):
    E, K, N = 2, 4099, 64
    b = _rows_apart(torch.randn(E, K, N, dtype=torch.bfloat16), 1024)
    a = torch.randn(20, K, dtype=torch.bfloat16)
    offs = offsets([13, 7])
    p = plan(dot, a, b, offs)[0]
    if "moe_gemm_n_dot<" not in p.kernel_name:
        pytest.skip(f"the plan runs {p.kernel_name} here")
    assert p.scratch_bytes < K // 2 * 64 * 4
    assert_matches_reference(moe_xpu.moe_gemm(a, b, offs), a, b, offs)


@pytest.mark.parametrize("family", ["bf16", "int8", "nibble", "fma"])
def test_state_names_why_the_kernels_do_not_run(C, family):
    # Unlike the tests above, on every CPU: "on" exactly where the device description has them
    # (every dot-product family: bf16, test_int8_dot.py's W8A8 kernel, test_nibble_dot.py's 4-bit one,
    # test_fma_dot.py's FMA one).
    state = getattr(C, f"{family}_dot_state")()
    assert (state == "on") == C.device_description(0)[f"{family}_dot"], state
    switch = f"MOE_XPU_{family.upper()}_DOT"
    code = f"from moe_xpu import _runtime; print(_runtime.sycl_module().{family}_dot_state())"
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, switch: "0"})
    assert off.stdout.strip() == f"off ({switch}=0)"
    # A compile error in the kernels' own source turns them off like a wrong sum would, and every
    # test above would then skip: it must fail here instead.
    assert "compilation failed" not in state.lower(), state


# The bf16 weight gradient (moe_gemm_dot_wgrad): dB = A^T dY per group, the group's rows as the
# dot tile's reduction (row pairs; an odd last row in float), groups of 2+ rows on average, its N
# (dB's N; for K-contiguous dB, computed transposed without an index table, dB's K) a multiple of
# 64. (On CPUs with AMX the matrix-engine weight gradient takes these first: the checks allow it.)


def _wgrad_out(E, K, N, layout):
    """dB filled with NaN (every element must be written): [E, K, N], or K-contiguous [E, N, K]
    seen as [E, K, N]."""
    if layout == "kn":
        return torch.full((E, K, N), float("nan"), dtype=torch.bfloat16)
    return torch.full((E, N, K), float("nan"), dtype=torch.bfloat16).transpose(1, 2)


def _wgrad(C, a, dy, offs, gather, out, workers=0, dot_expected=True):
    from test_moe_gemm_backward import _wgrad_args

    w = _wgrad_args(C, a, dy, offs, gather, out)
    w.num_workers = workers
    name = C.plan_wgrad(w).kernel_name
    matrix_first = bool(C.device_description(0)["matrix_shapes"]) and "matrix_wgrad" in name
    assert matrix_first or ("moe_gemm_dot_wgrad<" in name) == dot_expected, name
    C.moe_gemm_wgrad(w)
    return out


def _assert_within_a_rounding(got, a, dy, offs, gather):
    """Every element within one bf16 rounding of the float64 gradient (plus float32 summation)."""
    from reference import moe_gemm_grad_reference

    E, K, N = got.shape
    _, want, _ = moe_gemm_grad_reference(a, torch.zeros(E, K, N), offs, dy, gather)
    err = (got.double() - want).abs()
    bound = want.abs() * 2.0**-8 + 1e-5 * max(1.0, want.abs().max().item())
    assert not got.isnan().any(), "every element of dB must be written"
    assert torch.all(err <= bound), f"max error {err.max():.3g}, worst excess {(err - bound).max():.3g}"


def test_plan_picks_the_dot_wgrad_kernel(dot):
    from test_moe_gemm_backward import _wgrad_args

    def name(counts, K, N, dtype=torch.bfloat16, engine=0, layout="kn", gathered=False):
        a = torch.randn(sum(counts), K).to(dtype)
        dy = torch.randn(sum(counts), N).to(dtype)
        out = torch.empty(len(counts), K, N, dtype=dtype)
        if layout == "linear":
            out = torch.empty(len(counts), N, K, dtype=dtype).transpose(1, 2)
        gather = torch.arange(sum(counts)) if gathered else None
        w = _wgrad_args(dot, a, dy, offsets(counts, torch.int64), gather, out)
        w.engine = engine
        return dot.plan_wgrad(w).kernel_name

    amx = bool(dot.device_description(0)["matrix_shapes"])
    assert "moe_gemm_dot_wgrad<uint16_t>" in name([64] * 4, 70, 128) or amx
    assert "moe_gemm_dot_wgrad<uint16_t>" in name([64] * 4, 70, 128, gathered=True) or amx
    assert "moe_gemm_dot_wgrad<uint16_t>" in name([64] * 4, 128, 70, layout="linear") or amx
    assert "moe_gemm_dot_wgrad<uint16_t>" in name([2] * 4, 70, 128) or amx
    assert "dot_wgrad" not in name([1, 2, 1, 3], 70, 128)                # few rows a group
    assert "dot_wgrad" not in name([64] * 4, 70, 96)                     # N % 64
    assert "dot_wgrad" not in name([64] * 4, 96, 128, layout="linear")   # transposed: K % 64
    assert "dot_wgrad" not in name([64] * 4, 128, 70, layout="linear", gathered=True)  # would gather dY
    assert "dot_wgrad" not in name([64] * 4, 70, 128, torch.float32)
    assert "dot_wgrad" not in name([64] * 4, 70, 128, torch.float16)
    assert "dot_wgrad" not in name([64] * 4, 70, 128, engine=1)          # the vector kernel asked for


@pytest.mark.parametrize("K,N,layout,gathered", [
    (k, n, layout, gathered)
    for (k, n, layout) in [(1, 128, "kn"), (6, 64, "kn"), (13, 128, "kn"), (70, 192, "kn"),
                           (128, 1, "linear"), (64, 6, "linear"), (192, 13, "linear"), (64, 70, "linear")]
    for gathered in (False, True)])
def test_dot_wgrad_matches_reference(dot, K, N, layout, gathered):
    """Empty groups, odd and even row counts, a single row, the tile's rows (K, or N transposed)
    below, at and past its 6 (its 2- and 4-row assembly); worker counts that cut the units
    anywhere: bitwise equal. K-contiguous dB with an index table is the vector kernel's."""
    counts = [0, 257, 6, 0, 91, 1, 133]
    rows = sum(counts)
    a = torch.randn(rows + 5, K, dtype=torch.bfloat16)
    dy = torch.randn(rows, N, dtype=torch.bfloat16)
    gather = torch.randint(0, rows + 5, (rows,), dtype=torch.int32) if gathered else None
    if not gathered:
        a = a[:rows]
    offs = offsets(counts, torch.int64)
    dot_expected = not (layout == "linear" and gathered)
    first = _wgrad(dot, a, dy, offs, gather, _wgrad_out(len(counts), K, N, layout), dot_expected=dot_expected)
    _assert_within_a_rounding(first, a, dy, offs, gather)
    for workers in (1, 3, 7):
        again = _wgrad(dot, a, dy, offs, gather, _wgrad_out(len(counts), K, N, layout), workers, dot_expected)
        assert torch.equal(again, first), f"{workers} workers"


def test_k_contiguous_weight_gradient_through_an_index_table_gathers_rows_first(dot, monkeypatch):
    """moe_gemm_wgrad of nn.Linear-layout weights with an index table: the dot kernel cannot read
    A through the table transposed, so the op gathers A's rows first and runs it on them: bitwise
    the gradient of those rows without a table."""
    from moe_xpu.backward import _moe_gemm_wgrad_op

    counts, K, N = [5, 0, 64, 1, 30], 128, 70
    rows = sum(counts)
    a = torch.randn(41, K, dtype=torch.bfloat16)
    dy = torch.randn(rows, N, dtype=torch.bfloat16)
    gather = torch.randint(0, 41, (rows,), dtype=torch.int64)
    offs = offsets(counts, torch.int64)
    launched = []
    launch = dot.moe_gemm_wgrad
    monkeypatch.setattr(dot, "moe_gemm_wgrad", lambda w: (launched.append(dot.plan_wgrad(w).kernel_name), launch(w)))
    got = _moe_gemm_wgrad_op(a, dy, offs, gather, True)
    want = _moe_gemm_wgrad_op(a[gather], dy, offs, None, True)
    assert got.stride(1) == 1  # K-contiguous, as nn.Linear weights
    assert all("dot_wgrad" in name or "matrix_wgrad" in name for name in launched), launched
    assert torch.equal(got, want)
    _assert_within_a_rounding(got, a, dy, offs, gather)


def test_dot_wgrad_one_group_takes_everything_strided_rows(dot):
    counts = [0, 301, 0]
    offs = offsets(counts, torch.int64)
    for layout, K, N in (("kn", 30, 64), ("linear", 64, 30)):
        a = torch.randn(301, K + 7, dtype=torch.bfloat16)[:, 2 : 2 + K]  # rows K + 7 elements apart
        dy = torch.randn(301, N + 40, dtype=torch.bfloat16)[:, 8 : 8 + N]  # rows N + 40 apart
        out = _wgrad(dot, a, dy, offs, None, _wgrad_out(3, K, N, layout))
        _assert_within_a_rounding(out, a, dy, offs, None)
        assert not out[0].any() and not out[2].any()


def test_dot_wgrad_non_finite_values_stay_in_their_columns(dot):
    """An inf in dY reaches only its own column of dB (the odd last row is summed apart, not as a
    pair with padding, where 0 * inf would spread a NaN)."""
    counts, K, N = [127, 65], 12, 64
    a = torch.randn(192, K, dtype=torch.bfloat16)
    dy = torch.randn(192, N, dtype=torch.bfloat16)
    dy[3, 5] = float("inf")
    out = _wgrad(dot, a, dy, offsets(counts, torch.int64), None, _wgrad_out(2, K, N, "kn"))
    assert torch.isinf(out[0, :, 5]).all() and torch.isfinite(out[0, :, :5]).all()
    assert torch.isfinite(out[0, :, 6:]).all() and torch.isfinite(out[1]).all()


def test_a_row_does_not_depend_on_its_tile(dot):
    """A row tile runs only the rows it holds (1 to 4: a group's last tile may be short), each row's
    sums its own: a row's output is bitwise the same whatever else its group holds, and each group
    size's outputs match the reference."""
    K, N = 96 + 7, 13
    b = linear_weights(2, K, N)
    a = torch.randn(9, K, dtype=torch.bfloat16)
    first = None
    for rows in range(3, 10):
        offs = offsets([rows, 3])
        x = torch.cat([a[:rows], a[:3]])
        assert "k_dot" in plan(dot, x, b, offs)[0].kernel_name
        out = moe_xpu.moe_gemm(x, b, offs)
        assert_matches_reference(out, x, b, offs)
        if first is None:
            first = out[:3], out[3:]
        assert torch.equal(out[:3], first[0]), rows  # group 0's first 3 rows, in tiles of 1 to 4 rows
        assert torch.equal(out[rows:], first[1]), rows  # group 1's 3 rows: one short tile
