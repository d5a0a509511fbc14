"""The matrix-engine kernels (joint_matrix; AMX on the SYCL CPU device) against the float64
reference: bf16 weights in both layouts (nn.Linear [E, N, K] transposed, contiguous [E, K, N]),
forced onto the engine, on shapes that break its tiles (16-token tiles, 64-row blocks, 32-column
units, a last unit of 16 columns)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import moe_xpu
from moe_xpu import ops
from reference import assert_matches_reference
from test_moe_gemm import make_b, offsets, route

VECTOR, MATRIX = 1, 2  # GemmArgs.engine


@pytest.fixture
def C(C):
    """The launcher (conftest.py), on a device whose bf16 kernels run on a matrix engine."""
    if not C.device_info(0).matrix_engine:
        pytest.skip("no matrix engine: needs a CPU with AMX-BF16 (CL_CONFIG_CPU_TARGET_ARCH is set "
                    "by moe_xpu on such CPUs)")
    return C


def run(C, a, b, offs, gather_index=None, bias=None, out_dtype=None, engine=MATRIX, workers=0,
        activation=0, up_offset=0, n_out=None):
    rows = a.shape[0] if gather_index is None else gather_index.shape[0]
    n_out = b.shape[2] if n_out is None else n_out
    out = torch.full((rows, n_out), float("nan"), dtype=out_dtype or b.dtype)
    a_, b_, offs_, gi_, bias_ = ops.kernel_ready(a, b, offs, gather_index, bias)
    args = ops.gemm_args(a_, b_, offs_, gi_, bias_, out)
    args.engine, args.num_workers = engine, workers
    if activation:
        args.activation, args.up_offset, args.N = activation, up_offset, n_out
    assert C.plan_gemm(args).matrix_engine == (engine == MATRIX)
    C.moe_gemm(args)
    return out


LAYOUTS = ["linear", "kn"]


@pytest.mark.parametrize(
    "layout,E,K,N,routing",
    list(itertools.product(LAYOUTS, [1, 8, 64], [32, 96, 256], [16, 48, 64],
                           ["random", "empty_groups", "one_group_all", "partial"])),
)
def test_matches_reference(C, layout, E, K, N, routing):
    T = 150  # one group taking every row spans three 64-row blocks and a short 16-token tile
    a = torch.randn(T, K, dtype=torch.bfloat16)
    b = make_b(E, K, N, torch.bfloat16, layout)
    offs = offsets(route(routing, E, T))
    assert_matches_reference(run(C, a, b, offs), a, b, offs)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gather_bias_out_dtype(C, layout, index_dtype):
    T, E, K, N = 70, 5, 64, 80
    a = torch.randn(T, K, dtype=torch.bfloat16)
    b = make_b(E, K, N, torch.bfloat16, layout)
    bias = torch.randn(E, N, dtype=torch.bfloat16)
    gi = torch.cat([torch.randperm(T), torch.randint(0, T, (33,))]).to(index_dtype)  # repeats too
    offs = offsets([40, 0, 1, 45, 17], index_dtype)
    for out_dtype in (None, torch.float32):
        out = run(C, a, b, offs, gi, bias, out_dtype)
        assert_matches_reference(out, a, b, offs, gi, bias, out_dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_strided_a_and_padded_weight_rows(C, layout):
    """A with a row stride wider than K and weights whose rows are padded (row stride > K for
    nn.Linear weights, > N for [E, K, N])."""
    T, E, K, N = 40, 3, 64, 32
    a = torch.randn(T, K + 32, dtype=torch.bfloat16)[:, :K]
    if layout == "linear":
        b = torch.randn(E, N, K + 16, dtype=torch.bfloat16)[:, :, :K].transpose(1, 2)
    else:
        b = torch.randn(E, K, N + 16, dtype=torch.bfloat16)[:, :, :N]
    offs = offsets([10, 20, 10])
    assert_matches_reference(run(C, a, b, offs), a, b, offs)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_wide_n_spans_several_units(C, layout):
    """N past one [E, K, N] unit (4096 columns) with an odd number of 16-column tiles left, and K
    over many engine steps."""
    T, E, K, N = 40, 2, 128, 4096 + 48
    a = torch.randn(T, K, dtype=torch.bfloat16)
    b = make_b(E, K, N, torch.bfloat16, layout)
    bias = torch.randn(E, N, dtype=torch.bfloat16)
    offs = offsets([25, 12])
    assert_matches_reference(run(C, a, b, offs, bias=bias), a, b, offs, bias=bias)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_worker_counts_agree_bitwise(C, layout):
    """Skewed groups cut at many worker boundaries: each unit is computed once, and where it is
    computed does not change a bit."""
    T, E, K, N = 400, 6, 64, 48
    a = torch.randn(T, K, dtype=torch.bfloat16)
    b = make_b(E, K, N, torch.bfloat16, layout)
    offs = offsets([1, 311, 0, 2, 5, 70])  # the last 11 rows are the zeroed tail
    first = None
    for workers in [1, 2, 3, 7, 13, 64, 1000]:
        out = run(C, a, b, offs, workers=workers)
        assert_matches_reference(out, a, b, offs)
        first = out if first is None else first
        assert torch.equal(out, first)


def test_float_a_is_rounded_to_bf16(C):
    """Float32 A (the fused block's h) is packed to bf16 for the engine: the result is the bf16
    product of the rounded A, accumulated in float32."""
    T, E, K, N = 50, 4, 96, 64
    a = torch.randn(T, K)
    b = make_b(E, K, N, torch.bfloat16, "linear")
    offs = offsets([12, 20, 0, 18])
    out = run(C, a, b, offs, out_dtype=torch.float32)
    assert_matches_reference(out, a.bfloat16(), b, offs, out_dtype=torch.float32)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_epilogue(C, activation):
    from moe_xpu.fused import ACTIVATIONS

    T, E, K, I = 45, 4, 64, 48
    a = torch.randn(T, K, dtype=torch.bfloat16)
    b = make_b(E, K, 2 * I, torch.bfloat16, "linear")
    bias = torch.randn(E, 2 * I, dtype=torch.bfloat16)
    offs = offsets([20, 0, 17, 15])
    gi = torch.randint(0, T, (52,))
    plain = run(C, a, b, offs, gi, bias, torch.float32).double()
    act = {"silu": F.silu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}[activation]
    expected = act(plain[:, :I]) * plain[:, I:]
    out = run(C, a, b, offs, gi, bias, torch.float32, activation=ACTIVATIONS[activation],
              up_offset=I, n_out=I)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_public_api_picks_the_engine_for_tall_groups(C):
    """moe_gemm uses the engine when groups hold several rows, the vector kernels for decode-like
    launches and shapes outside whole engine tiles; all match the reference."""
    E, K, N = 8, 64, 48

    def plan(rows_per_group, k=K, layout="linear"):
        a = torch.randn(E * rows_per_group, k, dtype=torch.bfloat16)
        b = make_b(E, k, N, torch.bfloat16, layout)
        out = torch.empty(a.shape[0], N, dtype=torch.bfloat16)
        return C.plan_gemm(ops.gemm_args(a, b, offsets([rows_per_group] * E), None, None, out))

    assert plan(16).matrix_engine and not plan(16).widen_a
    assert not plan(1).matrix_engine
    assert not plan(16, k=40).matrix_engine  # K not a multiple of 32
    assert plan(16, layout="kn").matrix_engine
    assert plan(3).matrix_engine and not plan(3, layout="kn").matrix_engine  # kn: from 5 rows a group
    # one row per expert: the engine only for K-contiguous experts whose weights (>= 4 MB) stream
    # from memory; [E, K, N] weights go to the vector kernel's streaming decode tile on the CPU
    a1 = torch.randn(2, 2048, dtype=torch.bfloat16)
    out1 = torch.empty(2, 1024, dtype=torch.bfloat16)
    for n, layout, expected in ((1024, "linear", True), (512, "linear", False), (1024, "kn", False)):
        b1 = make_b(2, 2048, n, torch.bfloat16, layout)
        args = ops.gemm_args(a1, b1, offsets([1, 1]), None, None, out1[:, :n])
        assert C.plan_gemm(args).matrix_engine == expected
    a = torch.randn(E * 16, K, dtype=torch.bfloat16)
    b = make_b(E, K, N, torch.bfloat16, "linear")
    offs = offsets(route("random", E, E * 16))
    out = moe_xpu.moe_gemm(a, b, offs)
    assert_matches_reference(out, a, b, offs)
    assert torch.equal(out, run(C, a, b, offs))  # the public path ran the same kernel
    vector = run(C, a, b, offs, engine=VECTOR)
    assert_matches_reference(vector, a, b, offs)


def test_engine_rejects_what_it_cannot_run(C):
    a = torch.randn(8, 40, dtype=torch.bfloat16)
    b = make_b(2, 40, 16, torch.bfloat16, "linear")
    out = torch.empty(8, 16, dtype=torch.bfloat16)
    args = ops.gemm_args(a, b, offsets([4, 4]), None, None, out)
    args.engine = MATRIX
    with pytest.raises(ValueError, match="K % 32 == 0"):
        C.plan_gemm(args)


def test_fused_moe_on_the_engine(C):
    """The whole expert block with bf16 weights whose shapes fit the engine, against float64."""
    from reference import fused_moe_reference

    T, E, k, H, I = 40, 8, 2, 64, 48
    x = torch.randn(T, H, dtype=torch.bfloat16)
    gate_up = torch.randn(E, 2 * I, H, dtype=torch.bfloat16) / 8
    down = torch.randn(E, H, I, dtype=torch.bfloat16) / 8
    logits = torch.randn(T, E)
    weights, ids = torch.topk(logits.softmax(-1), k)
    out = moe_xpu.fused_moe(x, gate_up, down, weights, ids)
    ref = fused_moe_reference(x, gate_up, down, weights, ids)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    assert torch.equal(moe_xpu.fused_moe(x, gate_up, down, weights, ids), out)


def test_concurrent_launches_share_scratch_safely(C):
    """Threads launching at once with growing K (the per-queue scratch area is reallocated while
    other launches use it) get exactly the results of one-at-a-time launches."""
    from concurrent.futures import ThreadPoolExecutor

    problems = []
    for K in (32, 64, 128, 256, 512, 1024) * 2:
        a = torch.randn(48, K, dtype=torch.bfloat16)
        b = make_b(3, K, 64, torch.bfloat16, "linear" if K % 64 else "kn")
        problems.append((a, b, offsets([20, 8, 20])))
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda p: moe_xpu.moe_gemm(*p), problems))
    for (a, b, offs), out in zip(problems, results):
        assert torch.equal(out, moe_xpu.moe_gemm(a, b, offs))
        assert_matches_reference(out, a, b, offs)


def test_engine_stays_off_when_the_opencl_runtime_loaded_first(C):
    """The OpenCL CPU compiler reads its target when it loads: if another SYCL user loaded it
    before moe_xpu could set the AMX target, moe_xpu must not hand it matrix-engine code (the
    compiler would abort the process); the vector kernels run instead."""
    import os
    import subprocess
    import sys

    script = (
        "import ctypes, os, sys\n"
        "ctypes.CDLL(os.path.join(sys.prefix, 'lib', 'libintelocl.so'))\n"
        "import moe_xpu\n"
        "from moe_xpu import _runtime\n"
        "assert os.environ['MOE_XPU_MATRIX_ENGINE'] == '0'\n"
        "assert not _runtime.sycl_module().device_info(0).matrix_engine\n"
        "print('vector kernels only')\n"
    )
    env = {k: v for k, v in os.environ.items()
           if k not in ("CL_CONFIG_CPU_TARGET_ARCH", "MOE_XPU_MATRIX_ENGINE")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "vector kernels only" in done.stdout


# ---------------------------------------------------------------------------------------------
# W8A8 on the engine's int8 tile (moe_gemm_quant_matrix: AMX-INT8 here; XMX int8 on GPUs)
# ---------------------------------------------------------------------------------------------

def _w8a8_inputs(counts, K, N, rows, gathered, with_bias):
    E, M = len(counts), sum(counts)
    b = torch.randint(-127, 128, (E, N, K), dtype=torch.int8).transpose(1, 2)  # K contiguous
    b_scale = torch.rand(E, N) * 0.01
    a = torch.randint(-127, 128, (rows, K), dtype=torch.int8)
    a_scale = torch.rand(rows) * 0.1
    gather = torch.randint(0, rows, (M,)) if gathered else None
    bias = torch.randn(E, N) if with_bias else None
    return a, a_scale, b, b_scale, gather, bias


def _w8a8_reference(a, a_scale, b, b_scale, counts, gather, bias, rows_out):
    """Exact int products in float64, then the scales and bias; rows past the last offset zero."""
    out = torch.zeros(rows_out, b.shape[2], dtype=torch.float64)
    start = 0
    for g, n in enumerate(counts):
        src = torch.arange(start, start + n) if gather is None else gather[start:start + n].long()
        out[start:start + n] = (a[src].double() @ b[g].double()) * a_scale[src].double()[:, None] * b_scale[g].double()
        if bias is not None:
            out[start:start + n] += bias[g].double()
        start += n
    return out


def _run_w8a8(C, a, a_scale, b, b_scale, counts, gather, bias, out_dtype, engine, workers=0, variants_for=""):
    from moe_xpu import quant

    q = quant.QuantizedExperts.from_int8(b, b_scale)
    planned = []

    def configure(args):
        args.engine, args.num_workers, args.variants_for = engine, workers, variants_for
        planned.append(C.plan_gemm(args))

    out = quant.run_quant(a, q, offsets(counts), a_scale, gather, bias, out_dtype, configure=configure)
    assert planned[0].matrix_engine == (engine == MATRIX), planned[0].kernel_name
    return out


@pytest.fixture
def C8(C):
    if not C.device_info(0).matrix_engine_int8:
        pytest.skip("no int8 matrix tile: needs a CPU with AMX-INT8")
    return C


@pytest.mark.parametrize("counts,K,N,tail,gathered", [
    ([0, 37, 0, 3, 1], 128, 48, 2, False),       # empty experts, a short tile, an odd last column tile
    ([0, 0, 150], 64, 32, 0, False),             # one expert taking every row: three 64-row blocks
    ([1, 0, 2, 1] * 16, 256, 16, 3, True),       # many experts of a row or two, through an index table
    ([17, 33, 64, 5], 1024, 80, 0, True),        # K over many engine steps
    ([0, 0, 0], 64, 16, 4, False),               # no routed rows: only the zeroed tail
])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tile", ["amx", "pvc"])
def test_w8a8_engine_matches_exact_reference(C8, counts, K, N, tail, gathered, out_dtype, tile):
    """At AMX's int8 tile (16 x 16 x 64) and at the GPU's (Xe-HPC, Xe2, Xe3 XMX: 8 x 16 x 32 on
    16 lanes), both run here by AMX."""
    rows = sum(counts) + tail if not gathered else 40
    a, a_scale, b, b_scale, gather, bias = _w8a8_inputs(counts, K, N, rows, gathered, with_bias=True)
    out = _run_w8a8(C8, a, a_scale, b, b_scale, counts, gather, bias, out_dtype, MATRIX,
                    variants_for="" if tile == "amx" else tile)
    ref = _w8a8_reference(a, a_scale, b, b_scale, counts, gather, bias, out.shape[0])
    # int32 sums are exact; one float rounding of the scaled sum, then the output dtype's
    eps = torch.finfo(out_dtype).eps
    torch.testing.assert_close(out.double(), ref, rtol=2 * eps, atol=2 * eps * max(1.0, ref.abs().max().item()))


def test_w8a8_engine_strided_rows_and_workers_bitwise(C8):
    """Padded weight rows and A rows, int32 offsets and index table; every worker count gives the
    same bits (the unit a worker computes does not depend on where it falls)."""
    counts, K, N = [1, 200, 0, 2, 30, 70], 128, 48
    E, M = len(counts), sum(counts)
    b = torch.randint(-127, 128, (E, N, K + 64), dtype=torch.int8)[:, :, :K].transpose(1, 2)
    b_scale = torch.rand(E, N) * 0.01
    a = torch.randint(-127, 128, (90, K + 16), dtype=torch.int8)[:, :K]
    a_scale = torch.rand(90) * 0.1
    gather = torch.randint(0, 90, (M,), dtype=torch.int32)
    ref = _w8a8_reference(a, a_scale, b, b_scale, counts, gather, None, M)
    first = None
    for workers in [1, 3, 7, 64, 1000]:
        out = _run_w8a8(C8, a, a_scale, b, b_scale, counts, gather, None, torch.float32, MATRIX, workers)
        torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())
        first = out if first is None else first
        assert torch.equal(out, first)


def test_w8a8_engine_is_chosen_where_its_tiles_fit(C8):
    """The launcher puts W8A8 on the engine where K and N are whole tiles, decode included, and
    keeps the vector kernel for K off the engine's step, N off its tile and [E, K, N] weights."""
    from moe_xpu import quant

    def plan(counts, K, N, layout="linear"):
        w = torch.randn(len(counts), N, K).transpose(1, 2) if layout == "linear" else torch.randn(len(counts), K, N)
        q = moe_xpu.quantize_experts(w, "int8")
        a, s = moe_xpu.quantize_per_token(torch.randn(sum(counts), K))
        plans = []
        quant.run_quant(a, q, offsets(counts), s, None, None, torch.float32,
                        configure=lambda args: plans.append(C8.plan_gemm(args)))
        return plans[0]

    assert plan([16] * 4, 256, 64).kernel_name.startswith("moe_xpu::moe_gemm_quant_matrix<")
    assert plan([1, 0, 2, 1] * 2, 256, 64).matrix_engine      # decode too
    assert not plan([16] * 4, 256 + 32, 64).matrix_engine    # K not a whole number of int8 steps
    assert not plan([16] * 4, 256, 64 + 8).matrix_engine     # N not whole tiles
    assert not plan([16] * 4, 256, 64, "kn").matrix_engine   # weights contiguous along N


def test_w8a8_engine_refused_off_its_shapes(C8):
    a, a_scale, b, b_scale, _, _ = _w8a8_inputs([8, 8], 96, 32, 16, False, False)
    with pytest.raises(ValueError, match="int8 tiles"):
        _run_w8a8(C8, a, a_scale, b, b_scale, [8, 8], None, None, torch.float32, MATRIX)


# Weight-only formats with bf16 activations, dequantized into the engine's bf16 tiles
# (moe_gemm_dequant_matrix): exact values; per-channel scales on the float32 sums, K-block scales
# on each block's sums, MXFP4's power-of-two scales folded into its values.
# ---------------------------------------------------------------------------------------------

DEQUANT_FORMATS = {
    "int8": ("int8", {}),
    "fp8": ("fp8", {"block_size": None}),             # per output channel
    "fp8-128x128": ("fp8", {}),                        # DeepSeek-V3's blocks: scales per 128 k
    "int4-g32": ("int4", {"group_size": 32}),
    "int4-g128-zp": ("int4", {"group_size": 128, "zero_point": True}),
    "mxfp4": ("mxfp4", {}),
}


def _dequant_inputs(counts, K, N, rows, fmt, gathered, with_bias, gated=False):
    E, M = len(counts), sum(counts)
    cols = 2 * N if gated else N
    w = torch.randn(E, cols, K).transpose(1, 2)  # nn.Linear layout: K contiguous
    name, kwargs = DEQUANT_FORMATS[fmt]
    q = moe_xpu.quantize_experts(w, name, **kwargs)
    a = torch.randn(rows, K).to(torch.bfloat16)
    gather = torch.randint(0, rows, (M,)) if gathered else None
    bias = torch.randn(E, cols) if with_bias else None
    return a, q, gather, bias


def _dequant_reference(a, q, counts, gather, bias, rows_out, dtype):
    """The products on the dequantized weights in `dtype` (float64: the reference; float32: the
    naive computation whose error bounds ours); rows past the last offset zero."""
    w = q.dequantize(torch.float32).to(dtype)
    out = torch.zeros(rows_out, w.shape[2], dtype=dtype)
    start = 0
    for g, n in enumerate(counts):
        src = torch.arange(start, start + n) if gather is None else gather[start:start + n].long()
        out[start:start + n] = a[src].to(dtype) @ w[g]
        if bias is not None:
            out[start:start + n] += bias[g].to(dtype)
        start += n
    return out


def _run_dequant(C, a, q, counts, gather, bias, out_dtype, engine, workers=0, variants_for="", gated=False):
    from moe_xpu import quant

    planned = []

    def configure(args):
        args.engine, args.num_workers, args.variants_for = engine, workers, variants_for
        planned.append(C.plan_gemm(args))

    N = q.shape[2] // 2 if gated else None
    out = quant.run_quant(a, q, offsets(counts), None, gather, bias, out_dtype, configure=configure,
                          activation=1 if gated else 0, up_offset=N or 0, out_columns=N)
    assert planned[0].matrix_engine == (engine == MATRIX), planned[0].kernel_name
    if engine == MATRIX:
        assert planned[0].kernel_name.startswith("moe_xpu::moe_gemm_dequant_matrix<"), planned[0].kernel_name
    return out


def _assert_within_naive_error(out, ref64, naive32, out_dtype):
    """Our error against float64 at most twice the naive float32 computation's, plus a few ulps
    of the output dtype."""
    err = (out.double() - ref64).abs().max().item() if out.numel() else 0.0
    naive = (naive32.double() - ref64).abs().max().item() if out.numel() else 0.0
    scale = max(1.0, ref64.abs().max().item()) if out.numel() else 1.0
    assert err <= 2 * naive + 4 * torch.finfo(out_dtype).eps * scale, (err, naive)


@pytest.mark.parametrize("counts,K,N,tail,gathered", [
    ([0, 37, 0, 3, 1], 128, 48, 2, False),       # empty experts, a short tile, an odd last column tile
    ([0, 0, 150], 64, 32, 0, False),             # one expert taking every row: three 64-row blocks
    ([1, 0, 2, 1] * 16, 256, 16, 3, True),       # many experts of a row or two, through an index table
    ([17, 33, 64, 5], 1024, 80, 0, True),        # K over many engine steps and scale blocks
    ([0, 0, 0], 64, 16, 4, False),               # no routed rows: only the zeroed tail
    ([9, 3], 160, 32, 0, False),                 # K past the last whole 128-k block of packed 4-bit words
])
@pytest.mark.parametrize("fmt", list(DEQUANT_FORMATS))
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tile", ["amx", "pvc"])
def test_dequant_engine_matches_reference(C, counts, K, N, tail, gathered, fmt, out_dtype, tile):
    """AMX's bf16 tile and the XMX tile of pvc (also bmg, lnl, ptl), both run here by AMX."""
    if fmt.startswith("int4") and K % DEQUANT_FORMATS[fmt][1]["group_size"]:
        pytest.skip("K is not a multiple of the group size")
    rows = sum(counts) + tail if not gathered else 40
    a, q, gather, bias = _dequant_inputs(counts, K, N, rows, fmt, gathered, with_bias=True)
    out = _run_dequant(C, a, q, counts, gather, bias, out_dtype, MATRIX, variants_for="" if tile == "amx" else tile)
    ref = _dequant_reference(a, q, counts, gather, bias, out.shape[0], torch.float64)
    naive = _dequant_reference(a, q, counts, gather, bias, out.shape[0], torch.float32)
    _assert_within_naive_error(out, ref, naive, out_dtype)


@pytest.mark.parametrize("fmt", list(DEQUANT_FORMATS))
@pytest.mark.parametrize("tile", ["amx", "pvc"])
def test_dequant_engine_gated_epilogue(C, fmt, tile):
    """The fused MoE's first GEMM: gate and up columns from one weight tensor, silu(gate) * up,
    each with its own scale and bias."""
    counts, K, N = [20, 0, 3, 41], 256, 48
    a, q, gather, bias = _dequant_inputs(counts, K, N, 64, fmt, True, with_bias=True, gated=True)
    out = _run_dequant(C, a, q, counts, gather, bias, torch.float32, MATRIX,
                       variants_for="" if tile == "amx" else tile, gated=True)
    h = _dequant_reference(a, q, counts, gather, bias, sum(counts), torch.float64)
    ref = F.silu(h[:, :N]) * h[:, N:]
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("fmt", ["int8", "fp8-128x128"])
def test_dequant_engine_strided_and_workers_bitwise(C, fmt):
    """Padded weight and activation rows, int32 index table, per-channel and K-block scales; every
    worker count gives the same bits."""
    counts, K, N = [1, 200, 0, 2, 30, 70], 256, 48
    E, M = len(counts), sum(counts)
    w = torch.randn(E, N, K + 64)[:, :, :K].transpose(1, 2)
    name, kwargs = DEQUANT_FORMATS[fmt]
    q = moe_xpu.quantize_experts(w, name, **kwargs)
    a = torch.randn(90, K + 16).to(torch.bfloat16)[:, :K]
    gather = torch.randint(0, 90, (M,), dtype=torch.int32)
    ref = _dequant_reference(a, q, counts, gather, None, M, torch.float64)
    naive = _dequant_reference(a, q, counts, gather, None, M, torch.float32)
    first = None
    for workers in [1, 3, 7, 64, 1000]:
        out = _run_dequant(C, a, q, counts, gather, None, torch.float32, MATRIX, workers)
        _assert_within_naive_error(out, ref, naive, torch.float32)
        first = out if first is None else first
        assert torch.equal(out, first)


def test_dequant_engine_is_chosen_where_it_fits(C):
    """bf16 activations with weight-only B contiguous along K go to the engine when groups average
    more than four rows; the vector kernel keeps decode, scale blocks that split an engine step,
    float32 activations, [E, K, N] weights and shapes off the engine's tiles."""
    from moe_xpu import quant

    def plan(counts, K, N, fmt="int8", layout="linear", a_dtype=torch.bfloat16, **kw):
        w = torch.randn(len(counts), N, K).transpose(1, 2) if layout == "linear" else torch.randn(len(counts), K, N)
        q = moe_xpu.quantize_experts(w, fmt, **kw)
        plans = []
        quant.run_quant(torch.randn(sum(counts), K).to(a_dtype), q, offsets(counts), None, None, None, torch.float32,
                        configure=lambda args: plans.append(C.plan_gemm(args)))
        return plans[0]

    assert plan([16] * 4, 256, 64).kernel_name.startswith("moe_xpu::moe_gemm_dequant_matrix<moe_xpu::Int8Weights")
    assert plan([16] * 4, 256, 64, "fp8", block_size=None).matrix_engine
    assert plan([16] * 4, 256, 64, "fp8").matrix_engine                       # 128 x 128 block scales
    assert plan([16] * 4, 256, 64, "int4", group_size=32).matrix_engine
    assert plan([16] * 4, 256, 64, "mxfp4").matrix_engine
    assert not plan([16] * 4, 256, 64, "fp8", block_size=(128, 16)).matrix_engine  # blocks of half an engine step
    assert not plan([1, 0, 2, 1] * 2, 256, 64).matrix_engine                  # decode
    assert not plan([4] * 4, 256, 64).matrix_engine                           # 16tok-E8: 4 rows a group
    assert plan([5] * 4, 256, 64).matrix_engine
    assert not plan([16] * 4, 256, 64, a_dtype=torch.float32).matrix_engine   # float32 activations
    assert not plan([16] * 4, 256, 64, layout="kn").matrix_engine             # contiguous along N
    assert not plan([16] * 4, 256 + 16, 64).matrix_engine                     # K off the engine's step
    assert not plan([16] * 4, 256, 64 + 8).matrix_engine                      # N off its tile


@pytest.mark.parametrize("fmt", ["int8", "int4-g32", "mxfp4"])
@pytest.mark.parametrize("routing", ["random", "empty_experts", "one_expert_all"])
def test_fused_moe_quantized_bf16_on_the_engine(C, fmt, routing):
    """A bf16 block with quantized weights whose second GEMM plans on the engine gets h in bf16
    from the first (both GEMMs dequantize into bf16 tiles): against float64 on the dequantized
    weights within the quantized fused tests' bound, bitwise the same when repeated."""
    from moe_xpu import fused_quant
    from test_fused_moe import make_block
    from test_fused_moe_quant import check, quantize_block

    x, gu, dn, w, ids, biases = make_block(48, 128, 64, 8, 2, torch.bfloat16, routing, bias=True)
    name, kwargs = DEQUANT_FORMATS[fmt]
    q1, q2, w1, w2 = quantize_block(gu, dn, name, kwargs)
    group_offsets = torch.bincount(ids.flatten(), minlength=8).cumsum(0).to(torch.int32)
    assert fused_quant._multiplies_bf16(q2, group_offsets, ids.numel())
    out = moe_xpu.fused_moe(x, q1, q2, w, ids, gate_up_bias=biases[0], down_bias=biases[1])
    check(out, x, w1, w2, w, ids, "silu", biases)
    assert torch.equal(moe_xpu.fused_moe(x, q1, q2, w, ids, gate_up_bias=biases[0], down_bias=biases[1]), out)
    assert not fused_quant._multiplies_bf16(q2, group_offsets, 2)  # decode: 0.25 rows a group


def test_dequant_engine_refused_off_its_shapes(C):
    a, q, _, _ = _dequant_inputs([8, 8], 80, 32, 16, "int8", False, False)
    with pytest.raises(ValueError, match="bf16 tiles"):
        _run_dequant(C, a, q, [8, 8], None, None, torch.float32, MATRIX)


# The weight gradient on the matrix engine: dB[g] = A[rows of g]^T dY[rows of g], both operands
# rearranged into the worker's scratch (A^T tiles, dY pair-interleaved, rows padded to 32), AMX's
# tile and the XMX tiles of pvc and dg2 run here, against float64.

WGRAD_TILES = {"amx": "", "pvc": "pvc", "dg2": "dg2"}


def _wgrad_inputs(counts, K, N, gathered, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = sum(counts)
    a_rows = rows + 7 if gathered else rows
    a = torch.randn(a_rows, K, generator=g).bfloat16()
    dy = torch.randn(rows, N, generator=g).bfloat16()
    gather = torch.randint(0, a_rows, (rows,), generator=g, dtype=torch.int32) if gathered else None
    return a, dy, offsets(counts, torch.int64), gather


def _run_wgrad(C, a, dy, offs, gather, layout, engine, workers=0, variants_for="", out_dtype=torch.bfloat16,
               out=None):
    from test_moe_gemm_backward import _wgrad_args

    E, K, N = offs.shape[0], a.shape[1], dy.shape[1]
    if out is None:
        out = (torch.full((E, K, N), float("nan"), dtype=out_dtype) if layout == "kn"
               else torch.full((E, N, K), float("nan"), dtype=out_dtype).transpose(1, 2))
    w = _wgrad_args(C, a, dy, offs, gather, out)
    w.out_dtype = ops._launcher_dtype(out.dtype)
    w.engine, w.num_workers, w.variants_for = engine, workers, variants_for
    assert C.plan_wgrad(w).matrix_engine == (engine == MATRIX)
    C.moe_gemm_wgrad(w)
    return out


def _assert_wgrad_close(out, a, dy, offs, gather):
    from reference import moe_gemm_grad_reference

    E, K, N = offs.shape[0], a.shape[1], dy.shape[1]
    _, want, _ = moe_gemm_grad_reference(a, torch.zeros(E, K, N), offs, dy, gather)
    scale = max(1.0, want.abs().max().item())
    # bf16 products are exact in float32: float32 output is the float32 sum (within its rounding),
    # bf16 output that sum rounded once more.
    tol = (4e-3 if out.dtype == torch.bfloat16 else 1e-5) * scale
    err = (out.double() - want).abs().max().item()
    assert err <= tol, f"max error {err:.3g} exceeds {tol:.3g}"


@pytest.mark.parametrize("tile", list(WGRAD_TILES))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("counts,K,N", [
    ([5, 0, 17, 3, 9], 37, 45),         # odd K and N: last tiles cut in both
    ([0, 200, 0, 3, 1], 64, 64),        # one group of 200 rows (7 row steps), empty groups
    ([33, 1, 0, 0], 96, 130),           # 33 rows: a second row step with one real row
    ([0, 0, 0], 32, 32),                # zero rows: every group stores zeros
    ([2, 0, 40, 0, 0, 6, 1, 9], 130, 33),
])
@pytest.mark.parametrize("gathered", [False, True])
def test_matrix_wgrad_matches_reference(C, tile, layout, counts, K, N, gathered):
    a, dy, offs, gather = _wgrad_inputs(counts, K, N, gathered)
    for out_dtype in (torch.bfloat16, torch.float32):
        out = _run_wgrad(C, a, dy, offs, gather, layout, MATRIX, variants_for=WGRAD_TILES[tile], out_dtype=out_dtype)
        _assert_wgrad_close(out, a, dy, offs, gather)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_matrix_wgrad_splits_tall_groups_into_column_blocks(C, layout):
    """A group whose packed operand exceeds a worker's block budget (2000 rows x 300 columns, either
    way round) is walked in several column blocks; every worker count gives the same bits."""
    a, dy, offs, gather = _wgrad_inputs([3, 2000, 0, 40], 300, 300, True, seed=1)
    first = None
    for workers in [0, 1, 3, 7, 100]:
        out = _run_wgrad(C, a, dy, offs, gather, layout, MATRIX, workers=workers)
        _assert_wgrad_close(out, a, dy, offs, gather)
        first = out if first is None else first
        assert torch.equal(out, first), "worker count must not change the result"


def test_matrix_wgrad_strided_operands_and_output(C):
    """A and dY with row strides wider than their rows; dB a view with padded rows (not dense), so
    empty groups store their zeros element by element; the untouched padding stays as it was."""
    counts, K, N = [9, 0, 30], 48, 40
    a_full = torch.randn(sum(counts), K + 8).bfloat16()
    dy_full = torch.randn(sum(counts), N + 3).bfloat16()
    a, dy = a_full[:, :K], dy_full[:, :N]
    offs = offsets(counts, torch.int64)
    store = torch.full((3, K, N + 5), 7.0).bfloat16()
    out = _run_wgrad(C, a, dy, offs, None, "kn", MATRIX, out=store[:, :, :N])
    _assert_wgrad_close(out, a, dy, offs, None)
    assert torch.all(store[:, :, N:] == 7.0)
    store_t = torch.full((3, N, K + 4), 7.0).bfloat16()
    out = _run_wgrad(C, a, dy, offs, None, "linear", MATRIX, out=store_t[:, :, :K].transpose(1, 2))
    _assert_wgrad_close(out, a, dy, offs, None)
    assert torch.all(store_t[:, :, K:] == 7.0)


def test_matrix_wgrad_is_chosen_for_groups_of_several_rows(C):
    """bf16 weight gradients run on the engine when groups average more than 4 rows and dB is two
    engine tiles each way; float32 ones, few rows a group, and the bias gradient's single column
    stay on the vector kernel; forcing the engine where it cannot run is refused."""
    from test_moe_gemm_backward import _wgrad_args

    def plan(counts, K, N, dtype=torch.bfloat16, engine=0):
        a, dy, offs, _ = _wgrad_inputs(counts, K, N, False)
        out = torch.empty(len(counts), K, N, dtype=dtype)
        w = _wgrad_args(C, a.to(dtype), dy.to(dtype), offs, None, out)
        w.engine = engine
        return C.plan_wgrad(w)

    assert plan([16] * 4, 64, 64).kernel_name.startswith("moe_xpu::moe_gemm_matrix_wgrad<")
    assert not plan([4] * 4, 64, 64).matrix_engine                     # 4 rows a group
    assert not plan([16] * 4, 64, 64, torch.float32).matrix_engine     # no float32 tile
    assert not plan([16] * 4, 1, 64).matrix_engine                     # a bias gradient
    with pytest.raises(ValueError, match="matrix-engine weight gradient"):
        plan([16] * 4, 64, 64, torch.float32, engine=MATRIX)
    with pytest.raises(ValueError, match="matrix-engine weight gradient"):
        plan([16] * 4, 16, 64, engine=MATRIX)


def test_matrix_wgrad_through_autograd(C):
    """moe_gemm's backward on bf16 nn.Linear weights with 20 rows an expert takes the engine's
    weight gradient, bitwise the same on a second run."""
    T, E, K, N = 100, 5, 64, 96
    a = torch.randn(T, K).bfloat16()
    w = torch.randn(E, N, K).bfloat16().requires_grad_()
    offs = offsets([20] * E)
    grad_out = torch.randn(T, N).bfloat16()
    grads = []
    for _ in range(2):
        w.grad = None
        moe_xpu.moe_gemm(a, w.transpose(1, 2), offs).backward(grad_out)
        grads.append(w.grad.clone())
    _assert_wgrad_close(grads[0].transpose(1, 2), a, grad_out, offs.to(torch.int64), None)
    assert torch.equal(grads[0], grads[1])
