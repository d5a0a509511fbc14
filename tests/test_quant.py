"""Quantized experts: the container and quantizers, and moe_gemm on int8 (W8A8 and weight-only),
int4, fp8 and MXFP4 weights against float64 references on the dequantized values."""

from __future__ import annotations

import pytest
import torch

import moe_xpu
from moe_xpu import quant
from reference import moe_gemm_reference

FORMATS = [
    ("int8", {}),
    ("fp8", {}),
    ("fp8", {"block_size": None}),
    ("int4", {"group_size": 32}),
    ("int4", {"group_size": 128, "zero_point": True}),
    ("mxfp4", {}),
]
FORMAT_IDS = ["int8", "fp8-block128", "fp8-channel", "int4-g32", "int4-g128-zero", "mxfp4"]


def naive_float32(a, w, group_offsets, gather_index=None, bias=None):
    """The same computation done naively in float32 on the dequantized values."""
    rows = a.shape[0] if gather_index is None else gather_index.shape[0]
    out = torch.zeros(rows, w.shape[2], dtype=torch.float32)
    start = 0
    for g, end in enumerate(group_offsets.tolist()):
        if end > start:
            src = a[start:end] if gather_index is None else a[gather_index[start:end]]
            out[start:end] = src.float() @ w[g].float() + (0 if bias is None else bias[g].float())
        start = end
    return out


def assert_quant_close(out, a, w, group_offsets, gather_index=None, bias=None, out_dtype=None):
    """Error against float64 on the dequantized weights (and activations) at most twice the naive
    float32 computation's, plus a few ulps of the output dtype."""
    ref = moe_gemm_reference(a.double(), w.double(), group_offsets, gather_index, bias)
    assert out.dtype == (out_dtype or a.dtype)
    assert tuple(out.shape) == tuple(ref.shape)
    if not ref.numel():
        return
    naive = naive_float32(a, w, group_offsets, gather_index, bias)
    err = (out.double() - ref).abs().max().item()
    naive_err = (naive.double() - ref).abs().max().item()
    tol = 2 * naive_err + 4 * torch.finfo(out.dtype).eps * max(1.0, ref.abs().max().item())
    assert err <= tol, f"max error {err:.3g} exceeds {tol:.3g} (naive float32 {naive_err:.3g})"


def offsets(counts):
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)


# Shapes that break things: empty experts, one expert taking every row, zero rows, K and N that are
# no multiple of any tile, many experts, rows past the last offset (zeros), an index table.
CASES = {
    "skewed": dict(counts=[0, 37, 0, 3, 1], K=128, N=40, tail=2),
    "one-expert": dict(counts=[0, 0, 70], K=256, N=24, tail=0),
    "zero-rows": dict(counts=[0, 0, 0], K=64, N=16, tail=0),
    "many-experts": dict(counts=[1, 0, 2, 1] * 16, K=96, N=18, tail=1),
    "gathered": dict(counts=[5, 0, 9, 2], K=160, N=33, tail=0, gather=True),
    # One-row groups with K of 9 blocks of 128: the 4-bit one-row tiles stream the next column
    # tile's words through the unit (8 blocks per tile, and one more).
    "decode-long-k": dict(counts=[1, 0, 1, 1, 0, 1], K=1152, N=21, tail=1),
}


def _weights(E, K, N, layout):
    w = torch.randn(E, N, K).transpose(1, 2) if layout == "linear" else torch.randn(E, K, N)
    return w


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("fmt,kw", FORMATS, ids=FORMAT_IDS)
def test_formats_float32_on_breaking_shapes(fmt, kw, case, backend):
    c = CASES[case]
    counts, K, N = c["counts"], c["K"], c["N"]
    if fmt == "int4" and K % kw["group_size"]:
        K = (K // kw["group_size"] + 1) * kw["group_size"]
    E, M = len(counts), sum(counts)
    q = moe_xpu.quantize_experts(_weights(E, K, N, "linear"), fmt, **kw)
    go = offsets(counts)
    gather = None
    if c.get("gather"):
        a = torch.randn(7, K)
        gather = torch.randint(0, 7, (M,))
    else:
        a = torch.randn(M + c["tail"], K)
    bias = torch.randn(E, N)
    out = moe_xpu.moe_gemm(a, q, go, gather_index=gather, bias=bias)
    assert_quant_close(out, a, q.dequantize(), go, gather, bias)
    if c["tail"]:
        assert (out[M:] == 0).all()


@pytest.mark.parametrize("dtype,out_dtype", [(torch.bfloat16, None), (torch.float16, None),
                                             (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("fmt,kw", FORMATS[:2] + FORMATS[3:4] + FORMATS[5:], ids=["int8", "fp8", "int4", "mxfp4"])
def test_formats_with_16_bit_activations(fmt, kw, dtype, out_dtype):
    counts, K, N = [3, 0, 20, 1], 256, 48
    q = moe_xpu.quantize_experts(torch.randn(4, N, K).transpose(1, 2), fmt, **kw)
    a = torch.randn(sum(counts), K).to(dtype)
    out = moe_xpu.moe_gemm(a, q, offsets(counts), out_dtype=out_dtype)
    assert_quant_close(out, a, q.dequantize(), offsets(counts), out_dtype=out_dtype)


@pytest.mark.parametrize("out_dtype", [None, torch.float16, torch.float32])
@pytest.mark.parametrize("case", ["skewed", "gathered", "zero-rows"])
def test_w8a8(case, out_dtype, backend):
    c = CASES[case]
    counts, K, N = c["counts"], c["K"] + 3, c["N"]  # K no multiple of 16
    E, M = len(counts), sum(counts)
    w = torch.randn(E, K, N)  # [E, K, N] contiguous: int8 read with N contiguous
    q = moe_xpu.quantize_experts(w, "int8")
    rows = 7 if c.get("gather") else M + c["tail"]
    gather = torch.randint(0, rows, (M,), dtype=torch.int32) if c.get("gather") else None
    x = torch.randn(rows, K) * torch.rand(rows, 1) * 4
    a, a_scale = moe_xpu.quantize_per_token(x)
    out = moe_xpu.moe_gemm(a, q, offsets(counts), a_scale=a_scale, gather_index=gather, out_dtype=out_dtype)
    assert out.dtype == (out_dtype or torch.bfloat16)
    a_deq = a.double() * a_scale.double()[:, None]
    assert_quant_close(out, a_deq.float(), q.dequantize(), offsets(counts), gather, out_dtype=out.dtype)


@pytest.mark.parametrize("counts,K,N,gathered", [
    ([4, 0, 9], 200, 20, False),
    # one or two rows a group (the decode tile, whose columns stream one after another on wide-
    # vector devices), K past whole 16-k steps, empty groups, rows read through an index table
    ([1, 0, 2, 1, 1, 0, 1, 2] * 4, 2051, 24, True),
    ([0, 1, 0], 16, 40, False),
])
def test_w8a8_from_int8_tensor_and_channel_scales(counts, K, N, gathered):
    """The seed API: int8 a and b tensors, a_scale per token, b_scale per output channel."""
    E, M = len(counts), sum(counts)
    b = torch.randint(-127, 128, (E, N, K), dtype=torch.int8).transpose(1, 2)
    b_scale = torch.rand(E, N) * 0.01
    rows = M + 3 if gathered else M
    a = torch.randint(-127, 128, (rows, K), dtype=torch.int8)
    a_scale = torch.rand(rows) * 0.1
    gather = torch.randint(0, rows, (M,)) if gathered else None
    out = moe_xpu.moe_gemm(a, b, offsets(counts), a_scale=a_scale, b_scale=b_scale, gather_index=gather,
                           out_dtype=torch.float32)
    if gathered:
        a, a_scale = a[gather], a_scale[gather]
    # int32 products are exact: the reference is exact too
    ref = moe_gemm_reference(a.double(), b.double(), offsets(counts))
    ref = ref * a_scale.double()[:, None]
    start = 0
    for g, end in enumerate(offsets(counts).tolist()):
        ref[start:end] *= b_scale[g].double()
        start = end
    assert torch.allclose(out.double(), ref, rtol=1e-6, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("fmt,kw", FORMATS, ids=FORMAT_IDS)
def test_bitwise_reproducible(fmt, kw):
    q = moe_xpu.quantize_experts(torch.randn(8, 256, 64), fmt, **kw)
    a = torch.randn(50, 256)
    go = offsets([10, 0, 20, 5, 5, 0, 10, 0])
    first = moe_xpu.moe_gemm(a, q, go)
    assert torch.equal(first, moe_xpu.moe_gemm(a, q, go))


@pytest.mark.parametrize("fmt,kw", [FORMATS[0], FORMATS[4], FORMATS[5]], ids=["int8", "int4-g128-zero", "mxfp4"])
def test_repeated_metadata_reads_each_calls_tensors(fmt, kw):
    """A call's plan is kept per metadata: a later call with the same shapes but other weights,
    scales, zero points, activations or row scales reads its own, and its values are checked."""
    go = offsets([3, 0, 1, 6])
    qs = [moe_xpu.quantize_experts(torch.randn(4, 256, 24), fmt, **kw) for _ in range(2)]
    xs = [torch.randn(10, 256) for _ in range(2)]
    for q in qs + qs[::-1]:
        for x in xs:
            assert_quant_close(moe_xpu.moe_gemm(x, q, go), x, q.dequantize(), go)
            if fmt == "int8":
                a8, a_scale = moe_xpu.quantize_per_token(x)
                out = moe_xpu.moe_gemm(a8, q, go, a_scale=a_scale, out_dtype=torch.float32)
                assert_quant_close(out, a8.double() * a_scale.double()[:, None], q.dequantize(), go,
                                   out_dtype=torch.float32)
    with pytest.raises(moe_xpu.MoeXpuInputError, match="non-decreasing"):
        moe_xpu.moe_gemm(xs[0], qs[0], offsets([3, 0, 1, 6]).flip(0))


@pytest.mark.parametrize("counts", [[4, 3, 0, 4, 1, 4, 4, 4], [5, 13, 0, 8, 7, 1, 9]], ids=["3-rows", "6-rows"])
@pytest.mark.parametrize("fmt,kw", [FORMATS[0], FORMATS[3], FORMATS[5]], ids=["int8", "int4", "mxfp4"])
def test_every_quantized_tile_gives_the_same_bits(C, fmt, kw, counts):
    """Groups of 3-4 rows get a 4-row tile where the CPU's tall tile is taller (its padding rows
    would be a third of the FMAs), larger groups the tall tile (for 4-bit formats decoded by
    lookup a narrower one than the float kernels': see family_tiles); one-row, tall and 4-row
    tiles compute each row the same way, so the planner's choice changes no bit, and the result
    matches float64."""
    K, N = 256, 40
    q = moe_xpu.quantize_experts(torch.randn(len(counts), N, K).transpose(1, 2), fmt, **kw)
    a = torch.randn(sum(counts), K)
    go = offsets(counts)
    width = "quant_tiles_4bit" if fmt in ("int4", "mxfp4") else "quant_tiles_8bit"
    tiles = [tuple(t) for t in C.device_description(0)[width]]
    rows_per_group = sum(counts) / len(counts)
    expected = tiles[-1] if rows_per_group <= 4 and tiles[1][0] > 4 else tiles[1]
    plans = []
    out = quant.run_quant(a, q, go, None, None, None, torch.float32,
                          configure=lambda args: plans.append(C.plan_gemm(args)))
    assert plans[0].kernel_name.startswith("moe_xpu::moe_gemm_quant<")
    assert (plans[0].tile_m, plans[0].tile_n) == expected, plans[0].kernel_name
    assert_quant_close(out, a, q.dequantize(), go)

    def forced(tile):
        def configure(args):
            args.tile_m, args.tile_n = tile
        return configure

    for tile in tiles:
        assert torch.equal(quant.run_quant(a, q, go, None, None, None, torch.float32, configure=forced(tile)), out), tile


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt,kw", [FORMATS[0], FORMATS[1], FORMATS[4], FORMATS[5]],
                         ids=["int8", "fp8-block128", "int4-g128-zero", "mxfp4"])
def test_widened_activations_give_the_16_bit_kernels_bits(C, fmt, kw, dtype):
    """16-bit activations on a vector tile of several rows are widened to float32 once a call (the
    plan's widen_a) and the float32 output rounded after: the same bits as the 16-bit kernel, which
    widens each A value as it reads it; an index table and a bias included."""
    counts, K, N = [4, 3, 0, 4, 1, 4, 4, 4], 384, 40
    q = moe_xpu.quantize_experts(torch.randn(len(counts), N, K).transpose(1, 2), fmt, **kw)
    a = torch.randn(30, K).to(dtype)
    go = offsets(counts)
    gi = torch.randint(0, 30, (sum(counts),))
    bias = torch.randn(len(counts), N).to(dtype)
    seen = []

    def configure(args):  # the vector kernels (4-bit B with bf16 A may take the dot-product kernel)
        args.engine = 1
        seen.append((args, C.plan_gemm(args)))

    out = quant.run_quant(a, q, go, None, gi, bias, dtype, configure=configure)
    (args, plan), = seen
    assert plan.widen_a  # the 16-bit plan asked for float32 A; the launch was planned for it
    assert args.a_dtype == args.out_dtype == C.DType.float32 and not C.plan_gemm(args).widen_a
    direct, bias32 = torch.empty_like(out), bias.float()  # (args hold addresses: keep the tensors)
    C.moe_gemm(quant.quant_args(a, q, go, None, gi, bias32, direct))
    assert torch.equal(out, direct)
    assert_quant_close(out, a, q.dequantize(), go, gi, bias)


_DECODE_SCRIPT = """
import sys, torch, moe_xpu
from moe_xpu import _runtime
print(_runtime.sycl_module().device_description(0)["nibble_lookup"])
torch.manual_seed(0)
results = []
for fmt, kw in [("int4", {"group_size": 32, "zero_point": True}), ("int4", {"group_size": 128}), ("mxfp4", {})]:
    g = kw.get("group_size", 32)  # K in whole blocks of 128 and, where the block allows, a short last one
    for counts, K, N in [([0, 37, 0, 3, 1], 384, 40), ([1, 0, 2, 1] * 8, 128 + g // 32 * 32 % 128, 18),
                         ([5, 9], 256 + 3 * g % 128, 33)]:
        w = torch.randn(len(counts), N, K).transpose(1, 2)
        q = moe_xpu.quantize_experts(w, fmt, **kw)
        go = torch.tensor(counts).cumsum(0).to(torch.int32)
        for dtype in (torch.float32, torch.bfloat16):
            a = torch.randn(sum(counts), K).to(dtype)
            results.append(moe_xpu.moe_gemm(a, q, go))
            results.append(moe_xpu.fused_moe(torch.randn(6, K).to(dtype), moe_xpu.quantize_experts(
                torch.randn(len(counts), 2 * 128, K).transpose(1, 2), fmt, **kw),
                moe_xpu.quantize_experts(torch.randn(len(counts), K, 128).transpose(1, 2), fmt, **kw),
                torch.rand(6, 2), torch.randint(0, len(counts), (6, 2))))
# W8A8 one-row tiles: columns one after another where the lookup is chosen, side by side elsewhere
for counts, K in [([1, 0, 2, 1] * 8, 2051), ([0, 1, 1], 48)]:
    b = torch.randint(-127, 128, (len(counts), 72, K), dtype=torch.int8).transpose(1, 2)
    a = torch.randint(-127, 128, (sum(counts), K), dtype=torch.int8)
    go = torch.tensor(counts).cumsum(0).to(torch.int32)
    results.append(moe_xpu.moe_gemm(a, b, go, a_scale=torch.rand(sum(counts)), b_scale=torch.rand(len(counts), 72),
                                    out_dtype=torch.float32))
torch.save(results, sys.argv[1])
"""


def test_4_bit_decodes_give_the_same_bits(C, tmp_path):
    """4-bit weights are decoded by a sub-group table lookup on AVX-512 CPUs and GPUs and
    arithmetically on narrower CPUs (and W8A8 one-row tiles read their columns one after another
    there, side by side elsewhere): both paths, forced on this host, give bitwise the same
    outputs (each path's accuracy is covered by the tests above on the hosts that pick it)."""
    import os
    import subprocess
    import sys

    outputs = {}
    for decode in ("lookup", "arithmetic"):
        env = dict(os.environ, MOE_XPU_NIBBLE_DECODE=decode, MOE_XPU_BACKEND="sycl")
        path = tmp_path / f"{decode}.pt"
        done = subprocess.run([sys.executable, "-c", _DECODE_SCRIPT, str(path)], env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split()[0] == ("True" if decode == "lookup" else "False")
        outputs[decode] = torch.load(path)
    assert len(outputs["lookup"]) == len(outputs["arithmetic"]) > 0
    for x, y in zip(outputs["lookup"], outputs["arithmetic"]):
        assert torch.equal(x, y)


# ---------------------------------------------------------------------------------------------
# The container and the quantizers
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["linear", "kn"])
@pytest.mark.parametrize("fmt,kw", FORMATS, ids=FORMAT_IDS)
def test_dequantize_gives_the_shape_and_layout_it_was_made_from(fmt, kw, layout):
    w = _weights(3, 128, 40, layout)
    q = moe_xpu.quantize_experts(w, fmt, **kw)
    d = q.dequantize()
    assert d.shape == w.shape and q.shape == w.shape
    assert (d.stride(1) == 1) == (layout == "linear")
    # quantization error per element within half a step of each format, relative to the block's scale
    step = {"int8": 1.0, "fp8": 0.5 * 448 / 8, "int4": 1.0, "mxfp4": 4.0}[fmt]
    scale = q.scales_per_element().transpose(1, 2)
    assert ((d - w).abs() <= step * scale + 1e-6).all()


def test_pack_nibbles_round_trip_and_lane_order():
    q = torch.randint(0, 16, (2, 11, 400), dtype=torch.uint8)  # N and K no multiple of a chunk or block
    words = quant.pack_nibbles(q)
    assert words.shape == (2, 2, 512) and words.dtype == torch.int32
    assert torch.equal(quant.unpack_nibbles(words, 11, 400), q)
    # column 10 = chunk 1, column 2 of it; block 1 of its K; lane 5
    w = int(words[1, 1, 128 + 2 * 16 + 5]) & 0xFFFFFFFF
    assert [(w >> (4 * r)) & 15 for r in range(8)] == [int(q[1, 10, 128 + 16 * r + 5]) for r in range(8)]
    w = int(words[0, 1, 3 * 128 + 2 * 16 + 5]) & 0xFFFFFFFF  # block 3: k 384..399 real, the rest zeros
    assert [(w >> (4 * r)) & 15 for r in range(8)] == [int(q[0, 10, 384 + 5])] + [0] * 7
    assert (words[:, 1, :].view(torch.uint8).view(2, 4, 8, 16, 4)[:, :, 3:] == 0).all()  # columns 11..15: padding


def test_mxfp4_from_gpt_oss_checkpoint_layout():
    """blocks [E, N, K/32, 16] uint8 (even k in the low nibble), scales [E, N, K/32] e8m0: the values
    are lut[nibble] * 2^(scale - 127), as transformers' GPT-OSS loader computes them."""
    E, N, K = 2, 6, 64
    blocks = torch.randint(0, 256, (E, N, K // 32, 16), dtype=torch.uint8)
    scales = torch.randint(120, 130, (E, N, K // 32), dtype=torch.uint8)
    q = moe_xpu.QuantizedExperts.from_mxfp4(blocks, scales)
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    lo, hi = lut[(blocks & 0xF).long()], lut[(blocks >> 4).long()]
    vals = torch.stack((lo, hi), dim=-1).reshape(E, N, K // 32, 32)
    expected = torch.ldexp(vals, scales.long()[..., None] - 127).reshape(E, N, K)
    assert torch.equal(q.dequantize(), expected.transpose(1, 2))
    a = torch.randn(5, K)
    out = moe_xpu.moe_gemm(a, q, offsets([2, 3]))
    assert_quant_close(out, a, expected.transpose(1, 2), offsets([2, 3]))


def test_fp8_from_deepseek_checkpoint_layout():
    """weight float8_e4m3fn [N, K] per expert with weight_scale_inv [ceil(N/128), ceil(K/128)]."""
    E, N, K = 2, 200, 300
    weights = [torch.randn(N, K).to(torch.float8_e4m3fn) for _ in range(E)]
    scales = [torch.rand(2, 3) + 0.5 for _ in range(E)]
    q = moe_xpu.QuantizedExperts.from_fp8(weights, scales)
    for e in range(E):
        expanded = scales[e].repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
        assert torch.equal(q.dequantize()[e], (weights[e].float() * expanded).t())
    a = torch.randn(9, K)
    out = moe_xpu.moe_gemm(a, q, offsets([4, 5]))
    assert_quant_close(out, a, q.dequantize(), offsets([4, 5]))


def test_fp8_conversion_matches_torch_for_every_byte():
    """All 256 e4m3fn codes decode in the kernel as torch decodes them (the two NaN codes as NaN)."""
    codes = torch.arange(256, dtype=torch.uint8)
    nan_codes = (codes & 0x7F) == 0x7F
    w = torch.where(nan_codes, torch.zeros_like(codes), codes).view(torch.float8_e4m3fn).reshape(1, 16, 16)
    q = moe_xpu.QuantizedExperts("fp8", w, torch.ones(1, 16, 1), None, (1, 16), (1, 16, 16))
    out = moe_xpu.moe_gemm(torch.eye(16), q, offsets([16]))  # out[k, n] = w[n, k]
    assert torch.equal(out, w[0].float().t())
    for code in (0x7F, 0xFF):
        w_nan = torch.zeros(1, 2, 16, dtype=torch.uint8)
        w_nan[0, 1, 3] = code
        q = moe_xpu.QuantizedExperts("fp8", w_nan.view(torch.float8_e4m3fn), torch.ones(1, 2, 1), None, (1, 16),
                                     (1, 16, 2))
        out = moe_xpu.moe_gemm(torch.ones(1, 16), q, offsets([1]))
        assert out[0, 0] == 0 and out[0, 1].isnan()


def test_quantize_per_token():
    x = torch.randn(6, 50)
    x[2] = 0
    q, s = moe_xpu.quantize_per_token(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (6,)
    assert (q[2] == 0).all()
    assert ((q.float() * s[:, None] - x).abs() <= s[:, None] / 2 + 1e-6).all()
    assert (q.abs().amax(dim=1)[[0, 1, 3, 4, 5]] == 127).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_per_token_on_host_gives_torchs_bits(C, dtype):
    """Small CPU inputs are quantized in one pass in the launcher (quantize_rows_on_host): the same
    bits as the torch ops' arithmetic (quant._quantize_rows) on rows that are zero, hold exact ties
    of the rounding (scale 1: 0.5, 1.5, -2.5), a NaN or an infinity, on strided rows and on a row of
    one element."""
    for T, K in [(1, 1), (6, 7), (32, 2048), (3, 1000)]:
        x = (torch.randn(T, 2 * K) * 3).to(dtype)[:, :K]  # rows 2 K apart
        assert T * K <= quant._QUANTIZE_ON_HOST and x.stride(0) == 2 * K
        if T >= 6:
            x[1] = 0
            x[2, 0] = float("nan")
            x[4, K // 2] = float("-inf")
            x[3, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5]).to(dtype)
            x[3, 4:] = x[3, 4:].clamp(-127, 127)
        q, s = moe_xpu.quantize_per_token(x)
        expected_q, expected_s = quant._quantize_rows(x)
        assert torch.equal(q, expected_q)
        assert torch.equal(s.isnan(), expected_s.isnan()) and torch.equal(s.nan_to_num(), expected_s.nan_to_num())
        if T >= 6:
            assert q[3, :4].tolist() == [127, 0, 2, -2] and s[3] == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_per_token_in_chunks_gives_the_same_bits(dtype):
    """CPU inputs past one chunk are quantized a block of rows at a time: the result is the
    whole-tensor computation's, bit for bit (a row count that leaves a short last chunk, zero rows),
    and a float32 input is left as it was."""
    K = 700
    x = (torch.randn(quant._QUANTIZE_CHUNK // K * 3 + 5, K) * 4).to(dtype)
    x[[0, 400, -1]] = 0
    before = x.clone()
    q, s = moe_xpu.quantize_per_token(x)
    scale = x.float().abs().amax(dim=1) / 127.0  # the whole tensor at once
    whole = torch.round(x.float() / torch.where(scale > 0, scale, torch.ones_like(scale))[:, None])
    assert torch.equal(x, before)
    assert torch.equal(s, scale)
    assert torch.equal(q, whole.clamp(-127, 127).to(torch.int8))
    assert (q[[0, 400, -1]] == 0).all() and (s[[0, 400, -1]] == 0).all()


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error naming the argument, before any kernel runs
# ---------------------------------------------------------------------------------------------

def test_errors_name_the_argument():
    w = torch.randn(2, 64, 16)
    q = moe_xpu.quantize_experts(w, "int8")
    a = torch.randn(4, 64)
    go = offsets([2, 2])
    Err = moe_xpu.MoeXpuInputError
    with pytest.raises(Err, match="group_size"):
        moe_xpu.quantize_experts(w, "int4", group_size=48)
    with pytest.raises(Err, match="multiple of group_size"):
        moe_xpu.quantize_experts(torch.randn(2, 96, 16), "int4", group_size=64)
    with pytest.raises(Err, match="format"):
        moe_xpu.quantize_experts(w, "nf4")
    with pytest.raises(Err, match="a_scale"):
        moe_xpu.moe_gemm(a.to(torch.int8), q, go)
    with pytest.raises(Err, match="a_scale"):
        moe_xpu.moe_gemm(a.to(torch.int8), q, go, a_scale=torch.ones(3))
    with pytest.raises(Err, match="a_scale is for int8"):
        moe_xpu.moe_gemm(a, q, go, a_scale=torch.ones(4))
    with pytest.raises(Err, match="needs int8 weights"):
        moe_xpu.moe_gemm(a.to(torch.int8), moe_xpu.quantize_experts(w, "fp8"), go, a_scale=torch.ones(4))
    with pytest.raises(Err, match="b_scale"):
        moe_xpu.moe_gemm(a.to(torch.int8), w.to(torch.int8), go, a_scale=torch.ones(4))
    with pytest.raises(Err, match="b_scale must be float32"):
        moe_xpu.moe_gemm(a.to(torch.int8), w.to(torch.int8), go, a_scale=torch.ones(4), b_scale=torch.ones(2, 15))
    with pytest.raises(Err, match="b_scale is given by"):
        moe_xpu.moe_gemm(a, q, go, b_scale=torch.ones(2, 16))
    with pytest.raises(Err, match="K"):
        moe_xpu.moe_gemm(torch.randn(4, 32), q, go)
    with pytest.raises(Err, match="group_offsets must have E"):
        moe_xpu.moe_gemm(a, q, offsets([4]))
    with pytest.raises(Err, match="bias"):
        moe_xpu.moe_gemm(a, q, go, bias=torch.randn(2, 15))
    with pytest.raises(Err, match="scale must be"):
        moe_xpu.QuantizedExperts("int8", q.data, torch.ones(2, 16, 2), None, q.block, tuple(q.shape))
    with pytest.raises(Err, match="int8 scales are per output channel"):
        moe_xpu.QuantizedExperts("int8", q.data, torch.ones(2, 16, 2), None, (1, 32), tuple(q.shape))
    with pytest.raises(Err, match="K / 32"):
        moe_xpu.QuantizedExperts.from_mxfp4(torch.zeros(1, 4, 2, 16, dtype=torch.uint8),
                                            torch.zeros(1, 4, 3, dtype=torch.uint8))
    with pytest.raises(Err, match="group_offsets"):
        moe_xpu.moe_gemm(a, q, torch.tensor([3, 1], dtype=torch.int32))  # decreasing: a value check


# ---------------------------------------------------------------------------------------------
# torch integration
# ---------------------------------------------------------------------------------------------

def _op_args(q, a, go, a_scale=None):
    E, K, N = q.shape
    return (a, q.data, q.scale, q.zero, go, a_scale, None, None, q.format, K, N, q.block[0], q.block[1], None)


@pytest.mark.parametrize("fmt,kw", [FORMATS[0], FORMATS[3]], ids=["int8", "int4"])
def test_opcheck(fmt, kw):
    q = moe_xpu.quantize_experts(torch.randn(3, 64, 24), fmt, **kw)
    a = torch.randn(10, 64)
    torch.library.opcheck(torch.ops.moe_xpu.moe_gemm_quant.default, _op_args(q, a, offsets([3, 0, 7])))
    aq, s = moe_xpu.quantize_per_token(a)
    if fmt == "int8":
        torch.library.opcheck(torch.ops.moe_xpu.moe_gemm_quant.default, _op_args(q, aq, offsets([3, 0, 7]), s))


def test_torch_compile_fullgraph():
    q = moe_xpu.quantize_experts(torch.randn(3, 64, 24), "int4", group_size=32)
    a = torch.randn(10, 64)
    go = offsets([3, 0, 7])

    def f(x):
        return moe_xpu.moe_gemm(x * 2, q, go)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(a), f(a))


@pytest.mark.parametrize("target", ["pvc", "dg2"])
@pytest.mark.parametrize("fmt,kw", [FORMATS[0], FORMATS[3], FORMATS[5]], ids=["int8", "int4", "mxfp4"])
def test_gpu_variants_run_on_the_cpu_device(fmt, kw, target, C):
    """The variants and tiles the launcher picks on a GPU, executed on the CPU device (sub-groups of
    16 with the GPU's tiles), on a skewed routing with decode-sized and taller groups."""
    counts, K, N = [1, 0, 30, 2, 9], 256, 40
    q = moe_xpu.quantize_experts(torch.randn(5, N, K).transpose(1, 2), fmt, **kw)
    a = torch.randn(sum(counts), K)
    go = offsets(counts)

    def on_gpu_target(args):
        args.variants_for = target
        assert C.plan_gemm(args).kernel_name.startswith("moe_xpu::moe_gemm_quant")

    out = quant.run_quant(a, q, go, None, None, None, torch.float32, configure=on_gpu_target)
    assert_quant_close(out, a, q.dequantize(), go)


def test_mxfp4_quantization_rounds_to_nearest_even():
    """Every e2m1 value and every midpoint between two, scaled by 2^0 (a block whose largest
    magnitude is 6, so the shared exponent is 0): values stay, midpoints go to the even code."""
    values = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    mids = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0}
    row = values + list(mids) + [-v for v in values[1:]] + [-m for m in mids] + [6.0] * 3
    assert len(row) == 32
    w = torch.tensor(row).reshape(1, 32, 1)  # [E, K, N]
    d = moe_xpu.quantize_experts(w, "mxfp4").dequantize().flatten().tolist()
    expected = values + list(mids.values()) + [-v for v in values[1:]] + [-v for v in mids.values()] + [6.0] * 3
    assert d == expected
