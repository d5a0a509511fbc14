"""The W8A8 dot-product kernel (AVX512-VNNI assembly, moe_gemm_quant_dot in
sycl/kernels/moe_gemm_dot.cpp) on CPUs that run it: the plan picks it where it should, and its
integer sums are exact on shapes that break the assembly's 64-byte k step and its 4 x 6 tile (K
below, at and past multiples of 64, N not a multiple of 6, short last row tiles), with the full
int8 range (-128 included, which the kernel's +128 shift of A must undo), through index tables,
with bias, every output dtype, and bitwise the same for every worker count. (Its state line:
test_bf16_dot.py, with the bf16 family's.)"""

from __future__ import annotations

import itertools

import pytest
import torch

import moe_xpu
from moe_xpu import quant
from reference import moe_gemm_reference
from test_moe_gemm import ROUTINGS, offsets, route


@pytest.fixture
def int8_dot(C):
    """The launcher (conftest.py), on a CPU whose int8 kernels include the W8A8 dot-product kernel."""
    if not C.device_description(0)["int8_dot"]:
        pytest.skip("no W8A8 dot-product kernel here: needs a CPU with AVX512-VNNI and the OpenCL CPU "
                    "compiler targeting it (not MOE_XPU_INT8_DOT=0)")
    return C


def int8_problem(E, T, K, N, rows=None):
    """int8 A over the full range (-128 and 127 included) with a scale per row; int8 weights in
    nn.Linear layout ([E, N, K] seen as [E, K, N], contiguous along K) with a scale per channel."""
    rows = T if rows is None else rows
    a = torch.randint(-128, 128, (rows, K), dtype=torch.int8)
    a[0, :] = -128
    b = torch.randint(-128, 128, (E, N, K), dtype=torch.int8)
    b[:, 0, :] = 127
    if N > 1:
        b[:, 1, :] = -128
    a_scale = torch.rand(rows) * 0.1 + 0.01
    b_scale = torch.rand(E, N) * 0.01 + 0.001
    return a, b.transpose(1, 2), a_scale, b_scale


def exact_reference(a, b, a_scale, b_scale, go, gather_index=None, bias=None):
    """float64: the int8 products and their sums are exact there, then both scales and the bias."""
    rows = a if gather_index is None else a[gather_index.long()]
    scale = a_scale if gather_index is None else a_scale[gather_index.long()]
    ref = moe_gemm_reference(rows.double(), b.double(), go) * scale.double()[:, None]
    start = 0
    for g, end in enumerate(go.tolist()):
        ref[start:end] *= b_scale[g].double()
        if bias is not None:
            ref[start:end] += bias[g].double()
        start = end
    return ref


def assert_close(out, ref, rows):
    """The kernel's int32 sums are exact; what is left is float32 rounding of the sum, the scales'
    product and the bias: a few float32 ulps of the largest value (then the output dtype's)."""
    got, ref = out[:rows].double(), ref[:rows]
    eps = torch.finfo(out.dtype).eps
    tol = 4 * max(eps, torch.finfo(torch.float32).eps) * max(1.0, ref.abs().max().item()) if ref.numel() else 0
    err = (got - ref).abs().max().item() if ref.numel() else 0.0
    assert err <= tol, f"max error {err:.3g} exceeds {tol:.3g}"
    assert not out[rows:].any(), "rows past group_offsets[-1] must be zero"


def launch(a, b, go, a_scale, b_scale, gather_index=None, bias=None, out_dtype=torch.float32, **overrides):
    """run_quant with the plan recorded and the launcher's arguments overridden (the kernel name is
    in plans[0])."""
    C = moe_xpu._runtime.sycl_module()
    q = quant.QuantizedExperts.from_int8(b, b_scale)
    plans = []

    def configure(args):
        for name, value in overrides.items():
            setattr(args, name, value)
        plans.append(C.plan_gemm(args))

    out = quant.run_quant(a, q, go, a_scale, gather_index, bias, out_dtype, configure=configure)
    return out, plans[0].kernel_name


def test_plan_picks_the_dot_kernel_for_w8a8_groups_of_several_rows(int8_dot):
    E, K, N = 8, 256, 90  # (N not a multiple of 16: the shapes an AMX engine does not take)
    a, b, a_scale, b_scale = int8_problem(E, 8 * E, K, N)
    go = offsets([8] * E)
    assert "moe_gemm_quant_dot<float," in launch(a, b, go, a_scale, b_scale)[1]
    assert "moe_gemm_quant_dot<uint16_t," in launch(a, b, go, a_scale, b_scale, out_dtype=torch.bfloat16)[1]
    # Decode (a row or two a group) streams the weights: the vector kernel's one-row tile.
    assert "quant_dot" not in launch(a[:E], b, offsets([1] * E), a_scale[:E], b_scale)[1]
    # [E, K, N] weights, the vector kernels forced, a tile override: not this family.
    assert "quant_dot" not in launch(a, b.contiguous(), go, a_scale, b_scale)[1]
    assert "quant_dot" not in launch(a, b, go, a_scale, b_scale, engine=1)[1]
    assert "quant_dot" not in launch(a, b, go, a_scale, b_scale, tile_m=1, tile_n=8)[1]
    # Weight-only int8 (float activations) is not W8A8: the weight-only kernels.
    q = quant.QuantizedExperts.from_int8(b, b_scale)
    plans = []
    quant.run_quant(torch.randn(8 * E, K), q, go, None, None, None, torch.float32,
                    configure=lambda args: plans.append(int8_dot.plan_gemm(args)))
    assert "quant_dot" not in plans[0].kernel_name


@pytest.mark.parametrize("K,N,routing",
                         list(itertools.product([64, 65, 127, 128, 200, 2051], [1, 6, 7, 13], ROUTINGS)))
def test_exact_sums_on_breaking_shapes(int8_dot, K, N, routing):
    E, T = 5, 41
    counts = route(routing, E, T)
    go = offsets(counts)
    a, b, a_scale, b_scale = int8_problem(E, T, K, N)
    bias = torch.randn(E, N)
    out, kernel = launch(a, b, go, a_scale, b_scale, bias=bias)
    if sum(counts) / E > 2:
        assert "quant_dot" in kernel
    assert_close(out, exact_reference(a, b, a_scale, b_scale, go, bias=bias), sum(counts))


@pytest.mark.parametrize("K,index_dtype", list(itertools.product([63, 64, 192], [torch.int32, torch.int64])))
def test_index_table_strided_rows_and_output_dtypes(int8_dot, K, index_dtype):
    E, T, N = 4, 30, 20
    wide = torch.randint(-128, 128, (T, K + 9), dtype=torch.int8)
    a = wide[:, 3 : 3 + K]  # rows K + 9 bytes apart
    _, b, a_scale, b_scale = int8_problem(E, T, K, N)
    counts = [11, 0, 27, 22]
    go = offsets(counts, index_dtype)
    gather = torch.randint(0, T, (sum(counts),), dtype=index_dtype)
    ref = exact_reference(a, b, a_scale, b_scale, go, gather)
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        out, kernel = launch(a, b, go, a_scale, b_scale, gather_index=gather, out_dtype=out_dtype)
        assert "quant_dot" in kernel and out.dtype == out_dtype
        assert_close(out, ref, sum(counts))
    # The public API gives the same bits.
    public = moe_xpu.moe_gemm(a, b, go, a_scale=a_scale, b_scale=b_scale, gather_index=gather,
                              out_dtype=torch.float32)
    assert torch.equal(public, launch(a, b, go, a_scale, b_scale, gather_index=gather)[0])


def test_one_expert_takes_everything_and_zero_tokens(int8_dot):
    K, N = 4096 + 16, 30
    a, b, a_scale, b_scale = int8_problem(3, 300, K, N)
    go = offsets([0, 300, 0])
    out, kernel = launch(a, b, go, a_scale, b_scale)
    assert "quant_dot" in kernel
    assert_close(out, exact_reference(a, b, a_scale, b_scale, go), 300)
    empty = moe_xpu.moe_gemm(a[:0], b, offsets([0, 0, 0]), a_scale=a_scale[:0], b_scale=b_scale)
    assert empty.shape == (0, N)


def test_quantized_activations_match_the_vector_kernel(int8_dot):
    """quantize_per_token activations and quantize_experts weights, as a user calls W8A8: the dot
    kernel against float64 on the dequantized values, and within float rounding of the vector
    W8A8 kernel (which scales per lane before its cross-lane sum)."""
    E, K, N = 6, 320, 44
    counts = [10, 3, 0, 25, 7, 15]
    go = offsets(counts)
    x = torch.randn(sum(counts), K) * torch.rand(sum(counts), 1) * 4
    a, a_scale = moe_xpu.quantize_per_token(x)
    qw = moe_xpu.quantize_experts(torch.randn(E, N, K).transpose(1, 2), "int8")
    plans = []
    C = int8_dot
    out = quant.run_quant(a, qw, go, a_scale, None, None, torch.float32,
                          configure=lambda args: plans.append(C.plan_gemm(args)))
    assert "quant_dot" in plans[0].kernel_name
    vector = quant.run_quant(a, qw, go, a_scale, None, None, torch.float32,
                             configure=lambda args: setattr(args, "engine", 1))
    ref = moe_gemm_reference(a.double() * a_scale.double()[:, None], qw.dequantize().double(), go)
    assert_close(out, ref, sum(counts))
    assert torch.allclose(out, vector, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_bitwise_the_same_for_every_worker_count(int8_dot):
    E, K, N = 6, 200, 50
    a, b, a_scale, b_scale = int8_problem(E, 60, K, N)
    go = offsets([10, 3, 0, 25, 7, 15])
    outs = []
    for workers in (0, 1, 3, 16):
        out, kernel = launch(a, b, go, a_scale, b_scale, num_workers=workers)
        assert "quant_dot" in kernel
        outs.append(out)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    assert_close(outs[0], exact_reference(a, b, a_scale, b_scale, go), 60)


def test_a_row_does_not_depend_on_its_tile(int8_dot):
    """A row tile runs only the rows it holds (1 to 4: a group's last tile may be short): every group
    size's sums are exact, and a row's output is bitwise the same whatever else its group holds."""
    K, N = 192 + 5, 7
    a, b, a_scale, b_scale = int8_problem(2, 9, K, N)
    first = None
    for rows in range(3, 10):
        go = offsets([rows, 3])
        x, xs = torch.cat([a[:rows], a[:3]]), torch.cat([a_scale[:rows], a_scale[:3]])
        out, kernel = launch(x, b, go, xs, b_scale)
        assert "quant_dot" in kernel, kernel
        assert_close(out, exact_reference(x, b, xs, b_scale, go), rows + 3)
        if first is None:
            first = out[:3], out[3:]
        assert torch.equal(out[:3], first[0]), rows
        assert torch.equal(out[rows:], first[1]), rows
