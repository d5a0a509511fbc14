"""fused_moe with quantized expert weights against a float64 reference on the dequantized weights."""

from __future__ import annotations

import pytest
import torch

import moe_xpu
from moe_xpu import fused_quant, torch_fallback
from reference import fused_moe_reference
from test_fused_moe import make_block

FORMATS = [("int8", {}), ("fp8", {}), ("fp8", {"block_size": None}), ("int4", {"group_size": 32}),
           ("int4", {"group_size": 64, "zero_point": True}), ("mxfp4", {})]
FORMAT_IDS = ["int8", "fp8-block128", "fp8-channel", "int4-g32", "int4-g64-zero", "mxfp4"]


def quantize_block(gate_up, down, fmt, kw):
    """Both weights as QuantizedExperts (moe_gemm's b orientation) and the float32 weights they stand for."""
    q1 = moe_xpu.quantize_experts(gate_up.float().transpose(1, 2), fmt, **kw)
    q2 = moe_xpu.quantize_experts(down.float().transpose(1, 2), fmt, **kw)
    return q1, q2, q1.dequantize().transpose(1, 2), q2.dequantize().transpose(1, 2)


def check(out, x, w1, w2, weights, ids, activation="silu", biases=(None, None)):
    """At most twice the naive float32 computation's error on the same dequantized weights, plus a
    few ulps of the output dtype."""
    ref = fused_moe_reference(x, w1, w2, weights, ids, activation, *biases)
    assert out.dtype == x.dtype and out.shape == x.shape
    if not ref.numel():
        return
    naive = torch_fallback.fused_moe(x.float(), w1, w2, weights, ids, activation, *biases)
    err = (out.double() - ref).abs().max().item()
    naive_err = (naive.double() - ref).abs().max().item()
    tol = 2 * naive_err + 4 * torch.finfo(x.dtype).eps * max(1.0, ref.abs().max().item())
    assert err <= tol, f"max error {err:.3g} > {tol:.3g} (naive float32 {naive_err:.3g})"


# Shapes that break things: one expert taking every token, experts without tokens, sentinel slots,
# many experts, sizes no tile divides (H and I multiples of 64 only for the 4-bit group sizes).
SHAPES = {
    "random": dict(T=19, H=128, I=64, E=8, k=3, routing="random"),
    "one-expert": dict(T=23, H=64, I=192, E=4, k=1, routing="one_expert_all"),
    "empty-experts": dict(T=9, H=192, I=64, E=16, k=2, routing="empty_experts"),
    "many-experts": dict(T=33, H=64, I=64, E=64, k=4, routing="random"),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("fmt,kw", FORMATS, ids=FORMAT_IDS)
def test_matches_reference(fmt, kw, shape, backend):
    s = SHAPES[shape]
    x, gu, dn, w, ids, _ = make_block(s["T"], s["H"], s["I"], s["E"], s["k"], torch.float32, s["routing"])
    q1, q2, w1, w2 = quantize_block(gu, dn, fmt, kw)
    check(moe_xpu.fused_moe(x, q1, q2, w, ids), x, w1, w2, w, ids)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt,kw", [FORMATS[0], FORMATS[1], FORMATS[3], FORMATS[5]], ids=["int8", "fp8", "int4", "mxfp4"])
def test_16_bit_activations_with_biases_and_gelu(fmt, kw, dtype):
    x, gu, dn, w, ids, biases = make_block(17, 128, 32, 8, 2, dtype, bias=True)
    q1, q2, w1, w2 = quantize_block(gu, dn, fmt, kw)
    out = moe_xpu.fused_moe(x, q1, q2, w, ids, activation="gelu_tanh", gate_up_bias=biases[0], down_bias=biases[1])
    check(out, x, w1, w2, w, ids, "gelu_tanh", biases)


def test_zero_tokens_and_sentinel_slots():
    x, gu, dn, w, ids, _ = make_block(12, 64, 32, 4, 2, torch.float32)
    q1, q2, w1, w2 = quantize_block(gu, dn, "int4", {"group_size": 32})
    assert moe_xpu.fused_moe(x[:0], q1, q2, w[:0], ids[:0]).shape == (0, 64)
    ids[::2, 0] = moe_xpu.SENTINEL_EXPERT  # experts living elsewhere contribute nothing
    check(moe_xpu.fused_moe(x, q1, q2, w, ids), x, w1, w2, w, ids)


def test_equals_the_float_kernels_on_the_dequantized_weights():
    """float32: both paths split K alike, so the quantized kernel is the float kernel fed the
    dequantized weights (a check that the dequantization, not only the tolerance, is right)."""
    x, gu, dn, w, ids, _ = make_block(21, 128, 64, 8, 2, torch.float32)
    q1, q2, w1, w2 = quantize_block(gu, dn, "fp8", {})
    torch.testing.assert_close(moe_xpu.fused_moe(x, q1, q2, w, ids), moe_xpu.fused_moe(x, w1, w2, w, ids),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt,kw", [FORMATS[0], FORMATS[5]], ids=["int8", "mxfp4"])
def test_bitwise_deterministic(fmt, kw):
    x, gu, dn, w, ids, _ = make_block(40, 128, 64, 8, 4, torch.bfloat16)
    q1, q2, _, _ = quantize_block(gu, dn, fmt, kw)
    first = moe_xpu.fused_moe(x, q1, q2, w, ids)
    assert all(torch.equal(first, moe_xpu.fused_moe(x, q1, q2, w, ids)) for _ in range(3))


def test_errors_name_the_argument():
    x, gu, dn, w, ids, _ = make_block(5, 64, 24, 4, 2, torch.float32)
    q1, q2, _, _ = quantize_block(gu, dn, "int8", {})
    with pytest.raises(moe_xpu.MoeXpuInputError, match="both be QuantizedExperts"):
        moe_xpu.fused_moe(x, q1, dn, w, ids)
    wrong = moe_xpu.quantize_experts(gu.float(), "int8")  # quantized along the wrong axis
    with pytest.raises(moe_xpu.MoeXpuInputError, match=r"gate_up_proj must be \[E, 2I, H\].*transpose"):
        moe_xpu.fused_moe(x, wrong, q2, w, ids)
    with pytest.raises(moe_xpu.MoeXpuInputError, match="down_proj must be"):
        moe_xpu.fused_moe(x, q1, q1, w, ids)
    with pytest.raises(moe_xpu.MoeXpuInputError, match="gate_up_bias must have shape"):
        moe_xpu.fused_moe(x, q1, q2, w, ids, gate_up_bias=torch.zeros(4, 3))
    bad_ids = ids.clone()
    bad_ids[0, 0] = 4
    with pytest.raises(moe_xpu.MoeXpuInputError, match="topk_ids"):
        moe_xpu.fused_moe(x, q1, q2, w, bad_ids)


def test_opcheck_and_torch_compile_fullgraph():
    x, gu, dn, w, ids, biases = make_block(6, 64, 32, 4, 2, torch.float32, bias=True)
    q1, q2, _, _ = quantize_block(gu, dn, "int4", {"group_size": 32})
    args = fused_quant.op_arguments(x, q1, q2, w, ids, "silu", *biases)
    torch.library.opcheck(torch.ops.moe_xpu.fused_moe_quant.default, args)
    compiled = torch.compile(lambda h, i, tw: moe_xpu.fused_moe(h, q1, q2, tw, i, gate_up_bias=biases[0],
                                                                down_bias=biases[1]), fullgraph=True)
    torch.testing.assert_close(compiled(x, ids, w), moe_xpu.fused_moe(x, q1, q2, w, ids, gate_up_bias=biases[0],
                                                                      down_bias=biases[1]))
