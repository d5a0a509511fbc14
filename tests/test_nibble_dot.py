"""The weight-decoding dot-product kernels (moe_gemm_nibble_dot and moe_gemm_fp8_dot in
sycl/kernels/moe_gemm_dot.cpp: int4 with one zero point, MXFP4 and fp8 e4m3 weights decoded to bf16
in registers, AVX512-BF16 dot products) on CPUs that run them: the plan picks it where it should and nowhere else, and against float64 on the
dequantized weights it is within the quantized kernels' bound (twice the naive float32 error plus a
few output ulps) on shapes that break its 4 x 4 tile and its 128-k block (K with a short last
block, N not a multiple of 4, short last row tiles, empty groups, one group taking every row),
through index tables and strided rows, with a bias, for bf16 and float32 output, and bitwise the
same for every worker count. (Its state line: test_bf16_dot.py, with the other families'.)"""

from __future__ import annotations

import itertools

import pytest
import torch

import moe_xpu
from moe_xpu import quant
from test_moe_gemm import ROUTINGS, offsets, route
from test_quant import assert_quant_close

# The formats it takes: symmetric int4 in each group size, and MXFP4.
NIBBLE_FORMATS = [("int4", {"group_size": 128}), ("int4", {"group_size": 64}), ("int4", {"group_size": 32}),
                  ("mxfp4", {})]
NIBBLE_IDS = ["int4-g128", "int4-g64", "int4-g32", "mxfp4"]


@pytest.fixture
def nibble_dot(C):
    """The launcher (conftest.py), on a CPU whose 4-bit kernels include the dot-product kernel."""
    if not C.device_description(0)["nibble_dot"]:
        pytest.skip("no 4-bit dot-product kernel here: needs a CPU with AVX512-BF16 and the OpenCL CPU "
                    "compiler targeting it (not MOE_XPU_NIBBLE_DOT=0)")
    return C


def run(a, q, go, gather_index=None, bias=None, out_dtype=torch.bfloat16, **overrides):
    """run_quant with the launcher's arguments overridden; returns the output and the kernel's name."""
    C = moe_xpu._runtime.sycl_module()
    plans = []

    def configure(args):
        for name, value in overrides.items():
            setattr(args, name, value)
        plans.append(C.plan_gemm(args))

    out = quant.run_quant(a, q, go, None, gather_index, bias, out_dtype, configure=configure)
    return out, plans[0].kernel_name


def weights(E, K, N, fmt, kw):
    return moe_xpu.quantize_experts(torch.randn(E, N, K).transpose(1, 2), fmt, **kw)


def record_fused_kernels(C, monkeypatch):
    """The kernel names fused_moe's quantized launches plan, in order, appended to the list returned."""
    from moe_xpu import fused_quant

    kernels, run_quant = [], fused_quant.run_quant

    def recording(*args, **kwargs):
        kwargs["configure"] = lambda a: kernels.append(C.plan_gemm(a).kernel_name)
        return run_quant(*args, **kwargs)

    monkeypatch.setattr(fused_quant, "run_quant", recording)
    return kernels


def test_plan_picks_the_kernel_where_it_should(nibble_dot):
    E, K, N = 6, 256, 40
    go = offsets([4] * E)
    a = torch.randn(4 * E, K).to(torch.bfloat16)
    for fmt, kw in NIBBLE_FORMATS:
        q = weights(E, K, N, fmt, kw)
        assert "moe_gemm_nibble_dot<" in run(a, q, go)[1]
        assert "moe_gemm_nibble_dot<" in run(a, q, go, out_dtype=torch.float32)[1]
        # Decode (a row a group) too: the tile runs only the rows a group holds.
        assert "moe_gemm_nibble_dot<" in run(a[:E], q, offsets([1] * E))[1]
        # float32 and float16 activations, the vector kernels forced, a tile override: not this one.
        assert "nibble_dot" not in run(a.float(), q, go, out_dtype=torch.float32)[1]
        assert "nibble_dot" not in run(a.half(), q, go, out_dtype=torch.float16)[1]
        assert "nibble_dot" not in run(a, q, go, engine=1)[1]
        assert "nibble_dot" not in run(a, q, go, tile_m=4, tile_n=4)[1]
    # A zero point per group (asymmetric int4) changes the table per group: the vector kernel.
    q = weights(E, K, N, "int4", {"group_size": 128, "zero_point": True})
    assert "nibble_dot" not in run(a, q, go)[1]
    # K shorter than one packed block: nothing for the assembly.
    q = weights(E, 64, N, "int4", {"group_size": 32})
    assert "nibble_dot" not in run(torch.randn(4 * E, 64).to(torch.bfloat16), q, go)[1]


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("K,N", [(128, 1), (256 + 32, 7), (384, 4), (512 + 96, 13), (1152, 33)])
@pytest.mark.parametrize("fmt,kw", NIBBLE_FORMATS, ids=NIBBLE_IDS)
def test_matches_float64_on_breaking_shapes(nibble_dot, fmt, kw, K, N, routing):
    group = kw.get("group_size", 32)
    K = -(-K // group) * group  # quantize_experts takes whole groups
    E, T = 5, 43
    counts = route(routing, E, T)
    go = offsets(counts)
    q = weights(E, K, N, fmt, kw)
    a = torch.randn(T + 2, K).to(torch.bfloat16)  # rows past the last offset: zeros
    bias = torch.randn(E, N)
    out, kernel = run(a, q, go, bias=bias)
    assert "nibble_dot" in kernel
    M = sum(counts)
    assert_quant_close(out[:M], a[:M], q.dequantize(), go, bias=bias)
    assert not out[M:].any()


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt,kw", [NIBBLE_FORMATS[0], NIBBLE_FORMATS[3]], ids=["int4", "mxfp4"])
def test_index_table_strided_rows_and_one_group_taking_everything(nibble_dot, fmt, kw, out_dtype):
    K, N = 640, 20
    q = weights(3, K, N, fmt, kw)
    # Rows of a wider tensor (row stride 2 K), read through an index table with repeats.
    base = torch.randn(50, 2 * K).to(torch.bfloat16)
    a = base[:, :K]
    go = offsets([0, 90, 0])
    gi = torch.randint(0, 50, (90,))
    out, kernel = run(a, q, go, gather_index=gi, out_dtype=out_dtype)
    assert "nibble_dot" in kernel and out.dtype == out_dtype
    assert_quant_close(out, a, q.dequantize(), go, gather_index=gi, out_dtype=out_dtype)
    # Through moe_gemm itself, int64 indices, and zero tokens.
    ref = moe_xpu.moe_gemm(a, q, go, gather_index=gi.long(), out_dtype=out_dtype)
    assert torch.equal(ref, out)
    empty = moe_xpu.moe_gemm(a[:0], q, offsets([0, 0, 0]))
    assert empty.shape == (0, N)


@pytest.mark.parametrize("fmt,kw", NIBBLE_FORMATS, ids=NIBBLE_IDS)
def test_agrees_with_the_vector_kernel(nibble_dot, fmt, kw):
    """Both sum the exact products of A and the codes' values and apply the scales in float: they
    agree to float rounding (not bit for bit: the dot products pair their sums differently)."""
    counts, K, N = [10, 3, 0, 25, 7, 15], 512, 44
    go = offsets(counts)
    q = weights(len(counts), K, N, fmt, kw)
    a = torch.randn(sum(counts), K).to(torch.bfloat16)
    out, kernel = run(a, q, go, out_dtype=torch.float32)
    vector, other = run(a, q, go, out_dtype=torch.float32, engine=1)
    assert "nibble_dot" in kernel and "nibble_dot" not in other
    scale = vector.abs().max().item()
    assert torch.allclose(out, vector, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("fmt,kw", [NIBBLE_FORMATS[1], NIBBLE_FORMATS[3]], ids=["int4-g64", "mxfp4"])
def test_bitwise_the_same_for_every_worker_count_and_executor(nibble_dot, fmt, kw):
    counts, K, N = [10, 3, 0, 25, 7, 15], 384 + 64, 50
    go = offsets(counts)
    q = weights(len(counts), K, N, fmt, kw)
    a = torch.randn(sum(counts), K).to(torch.bfloat16)
    outs = []
    # On the runtime's thread pool (work-groups running at once, each its own local memory) and on
    # the calling thread (one after another).
    for workers, calling_thread in itertools.product((0, 1, 3, 16), (1, 2)):
        out, kernel = run(a, q, go, num_workers=workers, calling_thread=calling_thread)
        assert "nibble_dot" in kernel
        outs.append(out)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    assert_quant_close(outs[0], a, q.dequantize(), go)


def test_special_scales_read_as_the_vector_kernel_reads_them(nibble_dot):
    """MXFP4 scale codes 0 (2^-127) and 255 (NaN) and zero blocks: the same special values as the
    vector kernel (NaN where a block's scale is NaN, finite elsewhere)."""
    E, K, N = 2, 256, 8
    q = weights(E, K, N, "mxfp4", {})
    scales = q.scale.clone()
    scales[0, 3, 1] = 255
    scales[1, 5, 0] = 0
    q = quant.QuantizedExperts("mxfp4", q.data, scales, None, q.block, q.shape, q.k_contiguous_source)
    a = torch.randn(8, K).to(torch.bfloat16)
    go = offsets([4, 4])
    out, kernel = run(a, q, go, out_dtype=torch.float32)
    vector, _ = run(a, q, go, out_dtype=torch.float32, engine=1)
    assert "nibble_dot" in kernel
    assert torch.equal(out.isnan(), vector.isnan())
    assert out[:4, 3].isnan().all() and not out[:, :3].isnan().any()
    finite = ~vector.isnan()
    assert torch.allclose(out[finite], vector[finite], rtol=1e-5, atol=1e-5 * vector[finite].abs().max().item())


@pytest.mark.parametrize("routing", ["random", "one_expert_all", "empty_experts"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("fmt,kw", [NIBBLE_FORMATS[0], NIBBLE_FORMATS[2], NIBBLE_FORMATS[3]],
                         ids=["int4-g128", "int4-g32", "mxfp4"])
def test_fused_moe_runs_both_gemms_on_it(nibble_dot, monkeypatch, fmt, kw, activation, routing):
    """fused_moe on 4-bit weights with bf16 hidden states: the gated first GEMM (2 gate and 2 up
    columns a tile) and the second (h in bf16, which it multiplies) both on this kernel, within the
    quantized fused tests' bound against float64, with biases, bitwise the same when repeated."""
    from test_fused_moe import make_block
    from test_fused_moe_quant import check, quantize_block

    # H (gate_up's K) and I (down's, even: its pairs) with a short last block where the group allows.
    short = kw.get("group_size", 32) % 128
    T, H, I, E, k = 40, 384 + short, 128 + 2 * short, 6, 2
    x, gu, dn, w, ids, biases = make_block(T, H, I, E, k, torch.bfloat16, routing, bias=True)
    q1, q2, w1, w2 = quantize_block(gu, dn, fmt, kw)
    kernels = record_fused_kernels(nibble_dot, monkeypatch)
    out = moe_xpu.fused_moe(x, q1, q2, w, ids, activation=activation, gate_up_bias=biases[0], down_bias=biases[1])
    assert "moe_gemm_nibble_dot<" in kernels[0] and kernels[0].endswith("true>"), kernels[0]
    assert "moe_gemm_nibble_dot<" in kernels[1] and kernels[1].endswith("false>"), kernels[1]
    check(out, x, w1, w2, w, ids, activation, biases)
    again = moe_xpu.fused_moe(x, q1, q2, w, ids, activation=activation, gate_up_bias=biases[0], down_bias=biases[1])
    assert torch.equal(again, out)


@pytest.mark.parametrize("fmt,kw", NIBBLE_FORMATS[:1] + NIBBLE_FORMATS[3:] + [("fp8", {}), ("fp8", {"block_size": None})],
                         ids=["int4", "mxfp4", "fp8-block128", "fp8-channel"])
def test_a_row_does_not_depend_on_its_tile(nibble_dot, fmt, kw):
    """A row tile runs only the rows it holds (1 to 4: the group's last tile may be short), each row's
    sums its own: a row's output is bitwise the same whatever else its group holds, and each group
    size's outputs are within the float64 bound."""
    K, N = (512 if fmt == "int4" else 384 + 32), 9  # whole int4 groups; a short last 128-k block otherwise
    q = weights(2, K, N, fmt, kw)
    a = torch.randn(9, K).to(torch.bfloat16)
    first = None
    for rows in range(3, 10):
        go = offsets([rows, 3])
        x = torch.cat([a[:rows], a[:3]])
        out, kernel = run(x, q, go)
        assert "_dot<" in kernel, kernel
        assert_quant_close(out, x, q.dequantize(), go)
        if first is None:
            first = out[:3], out[3:]
        assert torch.equal(out[:3], first[0]), rows  # group 0's first 3 rows, in tiles of 1 to 4 rows
        assert torch.equal(out[rows:], first[1]), rows  # group 1's 3 rows: one short tile


# fp8 e4m3 weights on the same design (moe_gemm_fp8_dot): scales per 128 x 128 block (DeepSeek-V3's
# layout) or per output channel.
FP8_FORMATS = [{}, {"block_size": None}]
FP8_IDS = ["fp8-block128", "fp8-channel"]


def test_fp8_plan_picks_the_kernel_where_it_should(nibble_dot):
    E, K, N = 6, 256, 40
    go = offsets([4] * E)
    a = torch.randn(4 * E, K).to(torch.bfloat16)
    for kw in FP8_FORMATS:
        q = weights(E, K, N, "fp8", kw)
        assert "moe_gemm_fp8_dot<uint16_t, false>" in run(a, q, go)[1]
        assert "moe_gemm_fp8_dot<float, false>" in run(a, q, go, out_dtype=torch.float32)[1]
        assert "moe_gemm_fp8_dot<uint16_t, false>" in run(a[:E], q, offsets([1] * E))[1]  # decode too
        assert "fp8_dot" not in run(a.float(), q, go, out_dtype=torch.float32)[1]
        assert "fp8_dot" not in run(a, q, go, engine=1)[1]
        assert "fp8_dot" not in run(a, q, go, tile_m=4, tile_n=4)[1]
    # Blocks of 64 columns along K: not the layouts the assembly reads.
    q = weights(E, K, N, "fp8", {"block_size": (128, 64)})
    assert "fp8_dot" not in run(a, q, go)[1]


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("K,N", [(128, 1), (256 + 17, 7), (384, 4), (1152 + 100, 133)])
@pytest.mark.parametrize("kw", FP8_FORMATS, ids=FP8_IDS)
def test_fp8_matches_float64_on_breaking_shapes(nibble_dot, kw, K, N, routing):
    E, T = 5, 43
    counts = route(routing, E, T)
    go = offsets(counts)
    q = weights(E, K, N, "fp8", kw)
    a = torch.randn(T + 2, K).to(torch.bfloat16)
    bias = torch.randn(E, N)
    out, kernel = run(a, q, go, bias=bias)
    assert "fp8_dot" in kernel
    M = sum(counts)
    assert_quant_close(out[:M], a[:M], q.dequantize(), go, bias=bias)
    assert not out[M:].any()


@pytest.mark.parametrize("kw", FP8_FORMATS, ids=FP8_IDS)
def test_fp8_every_code_and_index_table_as_the_vector_kernel(nibble_dot, kw):
    """Every e4m3 code (zeros, subnormals, both NaNs) in each column, read through an index table
    from strided rows: NaN exactly where the vector kernel has it, within float rounding of it
    elsewhere, bitwise the same for every worker count and executor."""
    E, K, N = 3, 512, 12
    codes = torch.arange(256, dtype=torch.uint8).repeat(E, N, K // 256 + 1)[:, :, :K]
    codes = codes.roll(shifts=5, dims=2)
    codes[:, :, ::7] = 0x01  # more subnormals
    data = codes.view(torch.float8_e4m3fn)
    q0 = weights(E, K, N, "fp8", kw)
    q = quant.QuantizedExperts("fp8", data.contiguous(), q0.scale, None, q0.block, q0.shape, q0.k_contiguous_source)
    base = torch.randn(30, 2 * K).to(torch.bfloat16)
    a = base[:, :K]
    go = offsets([10, 0, 14])
    gi = torch.randint(0, 30, (24,))
    out, kernel = run(a, q, go, gather_index=gi, out_dtype=torch.float32)
    vector, other = run(a, q, go, gather_index=gi, out_dtype=torch.float32, engine=1)
    assert "fp8_dot" in kernel and "fp8_dot" not in other
    assert torch.equal(out.isnan(), vector.isnan()) and out.isnan().any()
    # Away from NaN: the same codes with the NaNs set to zero, against the vector kernel and float64.
    clean = codes.clone()
    clean[(clean & 0x7F) == 0x7F] = 0
    qc = quant.QuantizedExperts("fp8", clean.view(torch.float8_e4m3fn).contiguous(), q0.scale, None, q0.block,
                                q0.shape, q0.k_contiguous_source)
    got, _ = run(a, qc, go, gather_index=gi, out_dtype=torch.float32)
    want, _ = run(a, qc, go, gather_index=gi, out_dtype=torch.float32, engine=1)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert_quant_close(got, a, qc.dequantize(), go, gather_index=gi, out_dtype=torch.float32)
    for workers, calling_thread in itertools.product((1, 3, 16), (1, 2)):
        again, _ = run(a, qc, go, gather_index=gi, out_dtype=torch.float32, num_workers=workers,
                       calling_thread=calling_thread)
        assert torch.equal(again, got)


@pytest.mark.parametrize("kw", FP8_FORMATS, ids=FP8_IDS)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_fp8_fused_moe_runs_both_gemms_on_it(nibble_dot, monkeypatch, kw, activation):
    """fused_moe on fp8 weights with bf16 hidden states: the gated first GEMM (2 gate and 2 up
    columns a tile, each pair with its own block scales) and the second (h in bf16) on this kernel,
    within the quantized fused bound, bitwise the same when repeated."""
    from test_fused_moe import make_block
    from test_fused_moe_quant import check, quantize_block

    # H with a short last block, I even with one too and not a multiple of the 128-column blocks.
    x, gu, dn, w, ids, biases = make_block(40, 256 + 64, 192 + 2, 6, 2, torch.bfloat16, "random", bias=True)
    q1, q2, w1, w2 = quantize_block(gu, dn, "fp8", kw)
    kernels = record_fused_kernels(nibble_dot, monkeypatch)
    out = moe_xpu.fused_moe(x, q1, q2, w, ids, activation=activation, gate_up_bias=biases[0], down_bias=biases[1])
    assert "moe_gemm_fp8_dot<" in kernels[0] and kernels[0].endswith("true>"), kernels
    assert "moe_gemm_fp8_dot<" in kernels[1] and kernels[1].endswith("false>"), kernels
    check(out, x, w1, w2, w, ids, activation, biases)
    again = moe_xpu.fused_moe(x, q1, q2, w, ids, activation=activation, gate_up_bias=biases[0], down_bias=biases[1])
    assert torch.equal(again, out)
