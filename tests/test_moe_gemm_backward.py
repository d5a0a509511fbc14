"""Gradients of moe_xpu.moe_gemm (dA, dB, dbias) against a float64 reference, bitwise
reproducibility, the weight-gradient kernel's scheduling, and the torch integration (opcheck,
torch.compile)."""

from __future__ import annotations

import itertools

import pytest
import torch

import moe_xpu
from moe_xpu import ops
from moe_xpu.backward import sum_rows_by_token
from reference import moe_gemm_grad_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def offsets(counts, dtype=torch.int32):
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(dtype)


def make_b(E, K, N, dtype, layout):
    if layout == "kn":
        return torch.randn(E, K, N, dtype=dtype)
    return torch.randn(E, N, K, dtype=dtype).transpose(1, 2)


def grads(a, b, offs, bias, gather_index, grad_out, out_dtype=None):
    a = a.detach().requires_grad_()
    b = b.detach().requires_grad_()
    bias = bias.detach().requires_grad_()
    out = moe_xpu.moe_gemm(a, b, offs, gather_index=gather_index, bias=bias, out_dtype=out_dtype)
    out.backward(grad_out)
    return a.grad, b.grad, bias.grad


def assert_close_to(got, want, dtype, what):
    assert got.dtype == dtype, f"{what}: dtype {got.dtype}, expected {dtype}"
    scale = max(1.0, want.abs().max().item())
    err = (got.double() - want).abs().max().item() if want.numel() else 0.0
    assert err <= TOL[dtype] * scale, f"{what}: max error {err:.3g} exceeds {TOL[dtype] * scale:.3g}"


CASES = {
    "random": [5, 0, 17, 3, 9],
    "empty_experts": [0, 0, 12, 0, 0],
    "one_expert_all": [0, 0, 0, 0, 40],
    "zero_tokens": [0, 0, 0, 0, 0],
    "many_rows": [70, 1, 0, 33, 2],
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["kn", "linear"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("use_gather", [False, True])
def test_gradients_match_float64(dtype, layout, case, use_gather, backend):
    counts = CASES[case]
    E, K, N = len(counts), 37, 45
    M = sum(counts)
    T = M + 3  # rows past the last offset: zero output, zero gradient
    a = torch.randn(T, K, dtype=dtype)
    b = make_b(E, K, N, dtype, layout)
    bias = torch.randn(E, N, dtype=dtype)
    offs = offsets(counts)
    gather = torch.randint(0, T, (M,)) if use_gather else None
    rows = M if use_gather else T
    grad_out = torch.randn(rows, N, dtype=dtype)
    da, db, dbias = grads(a, b, offs, bias, gather, grad_out)
    ra, rb, rbias = moe_gemm_grad_reference(a, b, offs, grad_out, gather)
    assert_close_to(da, ra, dtype, "grad a")
    assert_close_to(db, rb, dtype, "grad b")
    assert_close_to(dbias, rbias, dtype, "grad bias")
    assert db.shape == b.shape


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float32_output_of_16bit_inputs(dtype):
    """out_dtype=float32: the incoming gradient is float32; the gradients keep the inputs' dtype."""
    counts = [4, 0, 9]
    a = torch.randn(13, 24, dtype=dtype)
    b = make_b(3, 24, 20, dtype, "linear")
    bias = torch.randn(3, 20, dtype=dtype)
    grad_out = torch.randn(13, 20)
    da, db, dbias = grads(a, b, offsets(counts), bias, None, grad_out, out_dtype=torch.float32)
    ra, rb, rbias = moe_gemm_grad_reference(a, b, offsets(counts), grad_out.to(dtype))
    assert_close_to(da, ra, dtype, "grad a")
    assert_close_to(db, rb, dtype, "grad b")
    assert_close_to(dbias, rbias, dtype, "grad bias")


def test_strided_inputs_and_weight_layout():
    """A column slice of a wider tensor as a, nn.Linear weights seen through transpose(1, 2), a
    non-contiguous incoming gradient; the weight gradient comes back in the weights' own layout."""
    E, K, N = 3, 19, 26
    a_store = torch.randn(30, 2 * K)
    a = a_store[:, ::2]
    w = torch.randn(E, N, K, requires_grad=True)
    offs = offsets([10, 0, 15])
    out = moe_xpu.moe_gemm(a.requires_grad_(), w.transpose(1, 2), offs)
    grad_out = torch.randn(N, 30).t()
    out.backward(grad_out)
    ra, rb, _ = moe_gemm_grad_reference(a.detach(), w.detach().transpose(1, 2), offs, grad_out)
    assert_close_to(a.grad, ra, torch.float32, "grad a")
    assert_close_to(w.grad.transpose(1, 2), rb, torch.float32, "grad w")
    assert w.grad.is_contiguous(), "nn.Linear-layout weights get a contiguous gradient"


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_bitwise_identical_across_runs(dtype):
    counts = [30, 0, 2, 64, 7]
    E, K, N, M = 5, 130, 70, 103
    a = torch.randn(80, K, dtype=dtype)
    b = make_b(E, K, N, dtype, "linear")
    bias = torch.randn(E, N, dtype=dtype)
    gather = torch.randint(0, 80, (M,))
    grad_out = torch.randn(M, N, dtype=dtype)
    first = grads(a, b, offsets(counts), bias, gather, grad_out)
    for _ in range(2):
        again = grads(a, b, offsets(counts), bias, gather, grad_out)
        for x, y in zip(first, again):
            assert torch.equal(x, y)


def _wgrad_args(C, a, dy, offs, gather, out):
    from moe_xpu.backward import _wgrad_args as wgrad_args

    return wgrad_args(C, a, dy, offs, gather, out)


@pytest.mark.parametrize("variants_for", ["", "pvc", "dg2"])
@pytest.mark.parametrize("N", [16, 48, 64, 77, 130])
@pytest.mark.parametrize("layout", ["kn", "linear"])
def test_weight_gradient_kernel_workers_and_tiles(C, variants_for, N, layout):
    """The weight-gradient kernel alone: one group holding almost every row (skew), empty groups,
    K and N cut mid-tile (whole-vector and ragged last column tiles), worker counts that cut the
    unit list anywhere, the GPU generations' tiles run on the CPU device: all bitwise equal. dB
    contiguous along K ("linear") is computed transposed, the index table on the second operand.
    The same on the runtime's thread pool and on the calling thread (small dB runs there)."""
    counts = [0, 200, 0, 3, 1]
    E, K, M = len(counts), 41, sum(counts)
    a = torch.randn(M + 5, K)
    dy = torch.randn(M, N)
    gather = torch.randint(0, M + 5, (M,), dtype=torch.int32)
    offs = offsets(counts, torch.int64)
    _, want, _ = moe_gemm_grad_reference(a, torch.zeros(E, K, N), offs, dy, gather)
    first = None
    for workers, calling_thread in itertools.product([0, 1, 3, 7, 100], [1, 2]):
        out = torch.full((E, K, N), float("nan")) if layout == "kn" else torch.full((E, N, K), float("nan")).transpose(1, 2)
        w = _wgrad_args(C, a, dy, offs, gather, out)
        w.num_workers, w.variants_for, w.calling_thread = workers, variants_for, calling_thread
        C.moe_gemm_wgrad(w)
        assert_close_to(out, want, torch.float32, f"workers {workers}, calling thread {calling_thread}")
        first = out if first is None else first
        assert torch.equal(out, first), "worker count must not change the result"


def _bf16_rounding_cases(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 pairs (hi, lo) whose float32 sum is exact and lands on bf16's rounding cases: ties
    (which go to even, up or down), values a quarter ulp either side of one, the largest finite
    bf16 plus half an ulp (rounds to infinity), infinities and NaN."""
    hi = torch.randn(n, generator=gen).bfloat16()
    ulp = torch.ldexp(torch.ones(n), torch.frexp(hi.float()).exponent - 8)  # bf16 ulp at hi
    fraction = torch.tensor([0.5, -0.5, 0.25, 0.75, -0.75, 0.0])[torch.randint(0, 6, (n,), generator=gen)]
    lo = (ulp * fraction).bfloat16()
    hi[:4] = torch.tensor([torch.finfo(torch.bfloat16).max, float("inf"), float("-inf"), float("nan")])
    lo[:4] = torch.tensor([torch.finfo(torch.bfloat16).max * 2.0 ** -8, 1.0, 1.0, 1.0])
    assert torch.equal((hi.double() + lo.double()).float().double()[4:], (hi.double() + lo.double())[4:])
    return hi, lo


def _assert_rounded_like_torch(got: torch.Tensor, exact: torch.Tensor, what: str) -> None:
    """Bitwise torch's float32 -> bf16 rounding, NaN where it gives NaN (its payload may differ)."""
    want = exact.to(torch.bfloat16)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), what
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16)), what


@pytest.mark.parametrize("layout", ["kn", "linear"])
def test_bf16_outputs_round_like_torch(layout):
    """The kernels' float32 -> bf16 conversion (the forward's epilogue, and the weight gradient's
    whole and partial tiles) against torch's: round to nearest even, overflow to infinity, NaN
    kept. Each output is one exact float32 sum hi + lo of bf16 values."""
    gen = torch.Generator().manual_seed(5)
    E, K, N = 2, 9, 80  # whole and partial tiles along both of dB's dimensions
    hi, lo = _bf16_rounding_cases(E * N, gen)
    exact = hi.float() + lo.float()
    # Forward: a row [1, 1] times B's two rows (hi; lo) of each group.
    b = torch.stack([hi.view(E, N), lo.view(E, N)], dim=1)  # [E, 2, N]
    b = b if layout == "kn" else b.transpose(1, 2).contiguous().transpose(1, 2)
    a = torch.ones(E * 3, 2, dtype=torch.bfloat16)
    out = moe_xpu.moe_gemm(a, b, offsets([3, 3]))
    _assert_rounded_like_torch(out, exact.view(E, 1, N).expand(E, 3, N).reshape(E * 3, N), f"forward, {layout}")
    # Weight gradient: two rows of A of ones per group, dY rows hi and lo, so dB[g, k, n] = hi + lo.
    a = torch.ones(2 * E, K, dtype=torch.bfloat16, requires_grad=True)
    weights = make_b(E, K, N, torch.bfloat16, layout).requires_grad_()
    grad_out = torch.stack([hi.view(E, N), lo.view(E, N)], dim=1).reshape(2 * E, N)
    moe_xpu.moe_gemm(a, weights, offsets([2, 2])).backward(grad_out)
    _assert_rounded_like_torch(weights.grad, exact.view(E, 1, N).expand(E, K, N), f"weight gradient, {layout}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gathered_weight_gradient_planned_without_gathering(C, dtype):
    """dB through an index table asks the planner whether A's rows, gathered first, would take the
    bf16 dot kernel (which reads A in place) without gathering them: the answer equals the plan of
    arguments really gathered, and the arguments asked with are left as they were."""
    from moe_xpu.backward import _plan_if_gathered

    counts = [40, 0, 3, 77, 12]
    E, K, N, T = len(counts), 96, 64, 70
    a, dy = torch.randn(T, K).to(dtype), torch.randn(sum(counts), N).to(dtype)
    gather = torch.randint(0, T, (sum(counts),))
    offs = offsets(counts)
    out = torch.empty(E, N, K, dtype=dtype).transpose(1, 2)
    w = _wgrad_args(C, a, dy, offs, gather, out)
    asked = (w.a_rows, w.a_row_stride, w.gather_index, w.a)
    got = _plan_if_gathered(C, w, dy.shape[0])
    rows = a.index_select(0, gather)
    want = C.plan_wgrad(_wgrad_args(C, rows, dy, offs, None, out))
    assert (got.kernel_name, got.num_workers, got.tile_m, got.tile_n) == \
        (want.kernel_name, want.num_workers, want.tile_m, want.tile_n)
    assert (w.a_rows, w.a_row_stride, w.gather_index, w.a) == asked


def test_sum_rows_by_token_in_row_order():
    rows = torch.randn(9, 5, dtype=torch.float64)
    index = torch.tensor([2, 0, 2, 2, 4, 0, 4, 2, 1])
    got = sum_rows_by_token(rows, index, 6)
    want = torch.zeros(6, 5, dtype=torch.float64).index_add_(0, index, rows)
    torch.testing.assert_close(got, want)
    assert torch.equal(got[3], torch.zeros(5)) and torch.equal(got[5], torch.zeros(5))
    assert sum_rows_by_token(rows[:0], index[:0], 3).shape == (3, 5)


def test_opcheck_with_gradients():
    a = torch.randn(20, 33, requires_grad=True)
    b = torch.randn(4, 50, 33).transpose(1, 2).detach().requires_grad_()
    bias = torch.randn(4, 50, requires_grad=True)
    offs = offsets([3, 0, 9, 5])
    gather = torch.randint(0, 20, (17,))
    torch.library.opcheck(torch.ops.moe_xpu.moe_gemm.default, (a, b, offs, gather, bias, None))
    torch.library.opcheck(torch.ops.moe_xpu.moe_gemm.default, (a, b, offs, None, None, None))
    torch.library.opcheck(torch.ops.moe_xpu.moe_gemm_wgrad.default,
                          (a.detach(), torch.randn(17, 50), offs, gather, True))
    torch.library.opcheck(torch.ops.moe_xpu.sum_rows_by_token.default,
                          (torch.randn(17, 33), gather, 20))


def test_backward_under_torch_compile():
    a = torch.randn(24, 32, requires_grad=True)
    b = torch.randn(3, 32, 40, requires_grad=True)
    offs = offsets([8, 0, 14])

    def loss(a, b):
        return (moe_xpu.moe_gemm(a, b, offs) ** 2).sum()

    eager = torch.autograd.grad(loss(a, b), [a, b])
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True)(a, b), [a, b])
    for x, y in zip(eager, compiled):
        assert torch.equal(x, y)


def test_gradient_of_b_alone_skips_a():
    """Only the gradients asked for are computed (frozen inputs, LoRA-style fine-tuning)."""
    a = torch.randn(10, 16)
    b = torch.randn(2, 16, 8, requires_grad=True)
    offs = offsets([4, 6])
    moe_xpu.moe_gemm(a, b, offs).sum().backward()
    _, rb, _ = moe_gemm_grad_reference(a, b.detach(), offs, torch.ones(10, 8))
    assert_close_to(b.grad, rb, torch.float32, "grad b")
    assert a.grad is None


def _mapping_flags(address: int) -> list[str] | None:
    """The VmFlags of the mapping holding address (None where /proc/self/smaps lacks them)."""
    try:
        with open("/proc/self/smaps") as f:
            lines = f.readlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return None


def _transparent_huge_pages_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


@pytest.mark.parametrize("layout", ["linear", "kn"])
def test_large_weight_gradient(layout):
    """A weight gradient large enough (128 MB; glibc serves allocations above 32 MB from fresh
    mappings) to be asked for on huge pages: right values, experts without rows zero, and, where
    the kernel offers transparent huge pages, its mapping advised for them (VmFlags hg; whether
    the kernel then finds free huge pages depends on the host's memory, not on moe_xpu)."""
    torch.manual_seed(0)
    E, K, N = 8, 2048, 2048
    counts = [3, 0, 5, 0, 0, 1, 7, 0]
    offs = offsets(counts)
    a = torch.randn(sum(counts), K)
    b = make_b(E, K, N, torch.float32, layout)
    grad_out = torch.randn(sum(counts), N)
    b = b.detach().requires_grad_()
    moe_xpu.moe_gemm(a, b, offs).backward(grad_out)
    start = 0
    for g, n in enumerate(counts):
        want = a[start:start + n].double().t() @ grad_out[start:start + n].double()
        torch.testing.assert_close(b.grad[g].double(), want, rtol=1e-5, atol=1e-4)
        start += n
    assert b.grad.stride() == b.stride()
    if _transparent_huge_pages_mode() in ("always", "madvise"):
        flags = _mapping_flags(b.grad.data_ptr() + b.grad.nbytes // 2)
        assert flags is None or "hg" in flags, f"the weight gradient was not advised for huge pages: {flags}"
