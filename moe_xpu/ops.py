"""The torch op layer: argument checks, the ``moe_xpu::moe_gemm`` custom op and its CPU, XPU and
fake implementations. Tensors are unpacked here into the launcher's ``GemmArgs``."""

from __future__ import annotations

import torch

from moe_xpu import _dispatch, _runtime, torch_fallback

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


class MoeXpuInputError(ValueError, TypeError):
    """Bad argument to a moe_xpu op. A ValueError and a TypeError, so either ``except`` works."""


def _fail(message: str) -> None:
    raise MoeXpuInputError(message)


def _resolve_out_dtype(a: torch.Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    if out_dtype is None or out_dtype == a.dtype:
        return a.dtype
    if out_dtype == torch.float32:
        return out_dtype
    allowed = ("None or torch.float32 (a.dtype)" if a.dtype == torch.float32
               else f"None, {a.dtype} (a.dtype) or torch.float32")
    _fail(f"out_dtype must be {allowed}, got {out_dtype}")
    raise AssertionError  # unreachable


def check_moe_gemm_metadata(
    a: torch.Tensor,
    b: torch.Tensor,
    group_offsets: torch.Tensor,
    gather_index: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype | None,
) -> torch.dtype:
    """Checks everything knowable without reading tensor values (so it also runs on fake tensors).
    Returns the output dtype."""
    for name, t in (("a", a), ("b", b), ("group_offsets", group_offsets)):
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if a.dim() != 2:
        _fail(f"a must be 2-D [T, K], got shape {tuple(a.shape)}")
    if b.dim() != 3:
        _fail(f"b must be 3-D [E, K, N], got shape {tuple(b.shape)}")
    if group_offsets.dim() != 1:
        _fail(f"group_offsets must be 1-D [E], got shape {tuple(group_offsets.shape)}")
    if a.dtype not in SUPPORTED_DTYPES:
        _fail(f"a must be float32, bfloat16 or float16, got {a.dtype}")
    if b.dtype != a.dtype:
        _fail(f"b must have a's dtype {a.dtype}, got {b.dtype}")
    if group_offsets.dtype not in INDEX_DTYPES:
        _fail(f"group_offsets must be int32 or int64, got {group_offsets.dtype}")
    E, K, N = b.shape
    if a.shape[1] != K:
        _fail(f"b's K dimension (b.shape[1] = {K}) must equal a.shape[1] = {a.shape[1]}")
    if group_offsets.shape[0] != E:
        _fail(f"group_offsets must have E = b.shape[0] = {E} entries, got {group_offsets.shape[0]}")
    tensors = {"b": b, "group_offsets": group_offsets}
    if gather_index is not None:
        if gather_index.dim() != 1:
            _fail(f"gather_index must be 1-D [M], got shape {tuple(gather_index.shape)}")
        if gather_index.dtype not in INDEX_DTYPES:
            _fail(f"gather_index must be int32 or int64, got {gather_index.dtype}")
        tensors["gather_index"] = gather_index
    if bias is not None:
        if tuple(bias.shape) != (E, N):
            _fail(f"bias must have shape [E, N] = [{E}, {N}], got {tuple(bias.shape)}")
        if bias.dtype != a.dtype:
            _fail(f"bias must have a's dtype {a.dtype}, got {bias.dtype}")
        tensors["bias"] = bias
    for name, t in tensors.items():
        if t.device != a.device:
            _fail(f"{name} is on {t.device} but a is on {a.device}: all inputs must share a device")
    if a.device.type not in ("cpu", "xpu"):
        _fail(f"a must be a CPU or XPU tensor, got device {a.device}")
    return _resolve_out_dtype(a, out_dtype)


def _check_values_on_host(
    a: torch.Tensor, group_offsets: torch.Tensor, gather_index: torch.Tensor | None
) -> None:
    """Value checks for CPU tensors on the plain-PyTorch path (the SYCL launcher makes the same
    checks in C++ before its kernel runs: sycl/host_checks.cpp)."""
    available = a.shape[0] if gather_index is None else gather_index.shape[0]
    if group_offsets.numel():
        if int(group_offsets[0]) < 0:
            _fail(f"group_offsets must be non-negative, got group_offsets[0] = {int(group_offsets[0])}")
        steps = group_offsets[1:] < group_offsets[:-1]
        if bool(steps.any()):
            g = int(steps.nonzero()[0]) + 1
            _fail(
                f"group_offsets must be non-decreasing (cumulative end offsets), but "
                f"group_offsets[{g}] = {int(group_offsets[g])} < group_offsets[{g - 1}] = "
                f"{int(group_offsets[g - 1])}"
            )
        last = int(group_offsets[-1])
    else:
        last = 0
    if gather_index is None:
        if last > available:
            _fail(f"group_offsets[-1] = {last} exceeds the {available} rows of a")
        return
    if last != available:
        _fail(f"gather_index must have group_offsets[-1] = {last} entries, got {available}")
    if gather_index.numel():
        lo, hi = int(gather_index.min()), int(gather_index.max())
        if lo < 0 or hi >= a.shape[0]:
            bad = lo if lo < 0 else hi
            _fail(f"gather_index values must lie in [0, {a.shape[0]}) (rows of a), found {bad}")


def _check_values_on_device(
    a: torch.Tensor, group_offsets: torch.Tensor, gather_index: torch.Tensor | None
) -> None:
    """The same checks for XPU tensors, queued on the device (no host synchronisation). The
    kernel also clamps every offset and index, so bad values can never address memory out of
    range."""
    available = a.shape[0] if gather_index is None else gather_index.shape[0]
    if group_offsets.numel():
        ok = (group_offsets[0] >= 0) & (group_offsets[1:] >= group_offsets[:-1]).all()
        last = group_offsets[-1]
        ok &= (last == available) if gather_index is not None else (last <= available)
        torch._assert_async(ok, "moe_xpu: group_offsets must be non-negative, non-decreasing and within the rows")
    if gather_index is not None and gather_index.numel():
        ok = (gather_index.min() >= 0) & (gather_index.max() < a.shape[0])
        torch._assert_async(ok, "moe_xpu: gather_index values must lie in [0, rows of a)")


_LAUNCHER_DTYPES: dict = {}


def _launcher_dtype(dtype: torch.dtype):
    """The launcher's DType of the same name (float32, float16, bfloat16)."""
    found = _LAUNCHER_DTYPES.get(dtype)
    if found is None:
        found = _LAUNCHER_DTYPES[dtype] = getattr(_runtime.sycl_module().DType, str(dtype).removeprefix("torch."))
    return found


def gemm_args(
    a: torch.Tensor,
    b: torch.Tensor,
    group_offsets: torch.Tensor,
    gather_index: torch.Tensor | None,
    bias: torch.Tensor | None,
    out: torch.Tensor,
):
    """Fills the launcher's argument struct. Inputs must already be in a kernel-ready layout
    (see ``kernel_ready``); the caller keeps the tensors alive until the launch completes."""
    E, K, N = b.shape
    stride_e, stride_k, stride_n = b.stride()
    # Strides of size-1 dimensions carry no information: normalise them so the layout test
    # (K contiguous or N contiguous) sees the truth.
    stride_k = 1 if K <= 1 else stride_k
    stride_n = 1 if (N <= 1 and stride_k != 1) else stride_n
    args = _runtime.sycl_module().GemmArgs(
        _runtime.queue_address(a.device), _launcher_dtype(b.dtype), _launcher_dtype(a.dtype),
        _launcher_dtype(out.dtype), a.data_ptr(), a.stride(0), a.shape[0], b.data_ptr(), stride_e, stride_k,
        stride_n, out.data_ptr(), out.stride(0), out.shape[0], group_offsets.data_ptr(),
        group_offsets.dtype == torch.int64, E, K, N)
    return set_optional_inputs(args, gather_index, bias)


def set_optional_inputs(args, gather_index: torch.Tensor | None, bias: torch.Tensor | None):
    """Points the launcher's arguments at the index table and the bias, where given."""
    if gather_index is not None:
        args.gather_index = gather_index.data_ptr()
        args.gather_is_int64 = gather_index.dtype == torch.int64
    if bias is not None:
        args.bias = bias.data_ptr()
        args.bias_stride_e = bias.stride(0)
    return args


def launch(args, a: torch.Tensor) -> bool:
    """Plans and launches the grouped GEMM described by ``args`` (from ``gemm_args``; ``a`` is its
    A) once, widening A where the plan says so (see ``prepare_launch``). Returns whether it did."""
    prepared = prepare_launch(args, a)
    prepared.launch(args.queue, a, args.b, args.group_offsets, args.gather_index, args.bias, args.out,
                    args.scatter_index, args.row_weight)
    return prepared.widen_a


_LAUNCH_ERRORS = (_runtime.sycl_module().ArgumentError,) if _runtime.sycl_module() is not None else ()


def checked_launch(launcher, *args):
    """Calls a launcher function (or the planner), turning its value checks' errors into
    MoeXpuInputError; returns what it returns."""
    try:
        return launcher(*args)
    except _LAUNCH_ERRORS as error:  # a value check of the launcher (CPU device)
        raise MoeXpuInputError(str(error)) from None


def rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """A 2-D tensor whose rows the kernels read as runs of consecutive elements (any row stride):
    itself, or a contiguous copy when its columns are strided."""
    return t if t.shape[1] <= 1 or t.stride(1) == 1 else t.contiguous()


def kernel_ready(a, b, group_offsets, gather_index, bias):
    """Copies only what the kernel cannot read in place: a needs unit stride along K, b needs
    unit stride along K (nn.Linear weights transposed) or along N (a contiguous [E, K, N])."""
    a = rows_contiguous(a)
    K, N = b.shape[1], b.shape[2]
    if K > 1 and N > 1 and b.stride(1) != 1 and b.stride(2) != 1:
        b = b.contiguous()
    group_offsets = group_offsets.contiguous()
    if gather_index is not None:
        gather_index = gather_index.contiguous()
    if bias is not None:
        bias = rows_contiguous(bias)
    return a, b, group_offsets, gather_index, bias


class PreparedCall:
    """What the metadata of a call (shapes, strides, dtypes, devices, out_dtype) settles: the
    output's shape and dtype, whether every input is read in place, the implementation for its
    device and, once the SYCL path has run, the launcher's prepared launch (planned, its kernel
    looked up; a PreparedLaunch). Kept per metadata (see ``prepared``) so that a repeated call (a
    decode step's shapes, token after token) is neither re-checked nor re-planned: it only reads
    its tensors' addresses."""

    __slots__ = ("out_dtype", "rows", "n", "in_place", "run", "on_cpu", "launcher")

    def __init__(self, out_dtype, rows, n, in_place, device_type):
        self.out_dtype, self.rows, self.n, self.in_place = out_dtype, rows, n, in_place
        self.on_cpu = device_type == "cpu"
        self.run = _moe_gemm_on_cpu if self.on_cpu else _moe_gemm_on_xpu
        self.launcher = None


_PREPARED = _dispatch.MetadataTable()


def prepared(a, b, group_offsets, gather_index, bias, out_dtype) -> PreparedCall:
    """The checked metadata of a call: raises MoeXpuInputError for bad metadata (nothing is kept
    then), else returns the kept PreparedCall for it."""
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        check_moe_gemm_metadata(a, b, group_offsets, gather_index, bias, out_dtype)  # raises, naming it
    # Everything check_moe_gemm_metadata, kernel_ready and the launch plan read of the inputs.
    try:
        metadata = _dispatch.metadata
        key = (metadata(a), metadata(b), metadata(group_offsets), out_dtype, metadata(gather_index), metadata(bias))
    except AttributeError:  # something that is not a tensor: the checks name it
        check_moe_gemm_metadata(a, b, group_offsets, gather_index, bias, out_dtype)
        raise
    found = _PREPARED.get(key)
    if found is not None:
        return found
    resolved = check_moe_gemm_metadata(a, b, group_offsets, gather_index, bias, out_dtype)
    ready = kernel_ready(a, b, group_offsets, gather_index, bias)
    in_place = all(x is y for x, y in zip(ready, (a, b, group_offsets, gather_index, bias)))
    rows = a.shape[0] if gather_index is None else gather_index.shape[0]
    return _PREPARED.keep(key, PreparedCall(resolved, rows, b.shape[2], in_place, a.device.type))


class PreparedLaunch:
    """A planned launch (``_C.PreparedGemm``: its kernel looked up), whether A is widened to float32
    before it and whether it then writes float32 output (``prepare_launch``'s ``widen_out``).
    ``launch`` takes A as a tensor and widens it itself, so that no caller can hand 16-bit A to a
    launch planned for float32 A."""

    __slots__ = ("launcher", "widen_a", "widen_out")

    def __init__(self, launcher, widen_a: bool, widen_out: bool = False):
        self.launcher, self.widen_a, self.widen_out = launcher, widen_a, widen_out

    def out_dtype(self, requested: torch.dtype) -> torch.dtype:
        """The dtype of the output buffer the launch writes, for a call that asked for ``requested``."""
        return torch.float32 if self.widen_out else requested

    def launch(self, queue: int, a: torch.Tensor, *addresses: int) -> None:
        """Launches on ``queue`` with A and the other operands' ``addresses`` in the launcher's
        order; the launcher's value errors become MoeXpuInputError."""
        if self.widen_a:
            a = a.float()  # freed after an enqueue on the same stream: safe under torch's stream semantics
        try:
            self.launcher.launch(queue, a.data_ptr(), *addresses)
        except _LAUNCH_ERRORS as error:  # a value check of the launcher (CPU device)
            raise MoeXpuInputError(str(error)) from None


def prepare_launch(args, a: torch.Tensor, *, widen_out: bool = False) -> PreparedLaunch:
    """The prepared launch for ``args`` (from ``gemm_args`` or ``quant.quant_args``; ``a`` is its
    A). When the planned kernel is faster with float32 A (16-bit inputs on tiles of several rows,
    where A is re-read for every column tile but each B value serves a whole row tile), it is
    planned for float32 A and every launch widens A once, one pass over A, so that the k loop
    converts only B. ``widen_out``: such a launch also writes float32 (the quantized kernels are
    compiled for float A with float32 output only) and the caller rounds it; never then with a
    scatter index, whose output rows several launches' epilogues write."""
    C = _runtime.sycl_module()
    widen = (a.dtype in (torch.bfloat16, torch.float16) and not (widen_out and args.scatter_index)
             and checked_launch(C.plan_gemm, args).widen_a)
    if widen:
        wide = a.float()  # the strides every widened A of this metadata gets
        args.a_dtype, args.a_row_stride = _launcher_dtype(wide.dtype), wide.stride(0)
        if widen_out:
            args.out_dtype = _launcher_dtype(torch.float32)
    return PreparedLaunch(checked_launch(C.PreparedGemm, args), widen, widen and widen_out)


def _run_sycl(a, b, group_offsets, gather_index, bias, p: PreparedCall):
    if not p.in_place:
        a, b, group_offsets, gather_index, bias = kernel_ready(a, b, group_offsets, gather_index, bias)
    out = torch.empty(p.rows, p.n, dtype=p.out_dtype, device=a.device)
    launcher = p.launcher
    if launcher is None:  # the first call with this metadata plans it, the same for every later one
        launcher = p.launcher = prepare_launch(gemm_args(a, b, group_offsets, gather_index, bias, out), a)
    launcher.launch(0 if p.on_cpu else _runtime.queue_address(a.device), a, b.data_ptr(), group_offsets.data_ptr(),
                    0 if gather_index is None else gather_index.data_ptr(), 0 if bias is None else bias.data_ptr(),
                    out.data_ptr())
    return out


@torch.library.custom_op("moe_xpu::moe_gemm", mutates_args=())
def _moe_gemm_op(
    a: torch.Tensor,
    b: torch.Tensor,
    group_offsets: torch.Tensor,
    gather_index: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    raise NotImplementedError(f"moe_xpu.moe_gemm has no implementation for device {a.device}")


def _moe_gemm_on_cpu(a, b, group_offsets, gather_index, bias, p: PreparedCall):
    """CPU tensors, arguments' metadata checked."""
    if _runtime.cpu_backend() == "torch":
        _check_values_on_host(a, group_offsets, gather_index)
        return torch_fallback.moe_gemm(a, b, group_offsets, gather_index, bias, p.out_dtype)
    return _run_sycl(a, b, group_offsets, gather_index, bias, p)  # values checked by the launcher


def _moe_gemm_on_xpu(a, b, group_offsets, gather_index, bias, p: PreparedCall):
    """XPU tensors, arguments' metadata checked."""
    _check_values_on_device(a, group_offsets, gather_index)
    if _runtime.sycl_module() is None:
        raise RuntimeError(f"moe_xpu: the SYCL launcher is not available: {_runtime.import_error()}")
    return _run_sycl(a, b, group_offsets, gather_index, bias, p)


def _moe_gemm_cpu(a, b, group_offsets, gather_index=None, bias=None, out_dtype=None):
    p = prepared(a, b, group_offsets, gather_index, bias, out_dtype)
    return _moe_gemm_on_cpu(a, b, group_offsets, gather_index, bias, p)


def _moe_gemm_xpu(a, b, group_offsets, gather_index=None, bias=None, out_dtype=None):
    p = prepared(a, b, group_offsets, gather_index, bias, out_dtype)
    return _moe_gemm_on_xpu(a, b, group_offsets, gather_index, bias, p)


_dispatch.register_device_kernel(_moe_gemm_op, _moe_gemm_cpu, ("cpu",))
_dispatch.register_device_kernel(_moe_gemm_op, _moe_gemm_xpu, ("xpu",))


@_moe_gemm_op.register_fake
def _moe_gemm_fake(a, b, group_offsets, gather_index=None, bias=None, out_dtype=None):
    out_dtype = check_moe_gemm_metadata(a, b, group_offsets, gather_index, bias, out_dtype)
    rows = a.shape[0] if gather_index is None else gather_index.shape[0]
    return a.new_empty(rows, b.shape[2], dtype=out_dtype)


def moe_gemm(
    a: torch.Tensor,
    b,
    group_offsets: torch.Tensor,
    *,
    a_scale: torch.Tensor | None = None,
    b_scale: torch.Tensor | None = None,
    gather_index: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Grouped GEMM over experts in one kernel.

    a: [T, K]; b: [E, K, N] (a contiguous tensor, or ``w.transpose(1, 2)`` of nn.Linear-layout
    weights w [E, N, K], both read in place); group_offsets: int32/int64 [E], cumulative end
    offsets as in ``torch.nn.functional.grouped_mm``'s ``offs``.

    Without gather_index, row i of the output (T rows) is ``a[i] @ b[g]`` for the group g that
    owns row i; rows at or past ``group_offsets[-1]`` are zero. With gather_index [M]
    (M == group_offsets[-1]), row i is ``a[gather_index[i]] @ b[g]``: the kernel reads token rows
    through the index, no gathered copy of ``a`` is made. ``bias`` [E, N] is added per group.
    Accumulation is in float32; out_dtype is None (a.dtype) or torch.float32.

    Quantized weights: b may be a ``moe_xpu.QuantizedExperts`` (int8, int4, fp8, mxfp4; see
    ``moe_xpu.quantize_experts``), dequantized in the kernel's k loop, or an int8 tensor [E, K, N]
    with ``b_scale`` float32 [E, N] (one scale per output channel). With int8 weights, a may be int8
    with ``a_scale`` float32 [T] (one scale per row, see ``moe_xpu.quantize_per_token``): W8A8,
    int32 accumulation, the scales applied in the epilogue, output bfloat16 by default (or
    float16, float32). Bias with quantized weights is any float dtype.
    """
    if a_scale is not None or b_scale is not None or not isinstance(b, torch.Tensor) or b.dtype == torch.int8:
        from moe_xpu import quant

        q = quant.as_quantized(b, b_scale)
        if q is None:
            _fail(f"b must be a torch.Tensor or a moe_xpu.QuantizedExperts, got {type(b).__name__}")
        return quant.moe_gemm_quantized(a, q, group_offsets, a_scale=a_scale, gather_index=gather_index, bias=bias,
                                        out_dtype=out_dtype)
    if _dispatch.direct_call_ok(a, b, group_offsets, gather_index, bias):
        p = prepared(a, b, group_offsets, gather_index, bias, out_dtype)
        return p.run(a, b, group_offsets, gather_index, bias, p)
    check_moe_gemm_metadata(a, b, group_offsets, gather_index, bias, out_dtype)
    return _moe_gemm_op(a, b, group_offsets, gather_index, bias, out_dtype)
