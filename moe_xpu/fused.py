"""The fused MoE expert block: device-side token sorting and ``fused_moe``, as torch ops.

fused_moe runs two grouped GEMM launches and never copies tokens into expert order:
  1. gate_up: token rows are read through the index table (gather in the kernel), and the gated
     activation act(gate) * up is applied in the epilogue, so only the [T*k, I] result is written;
  2. down: each row is multiplied by its top-k weight in the epilogue and written to its (token,
     slot) position; the k contributions of a token are then summed in slot order (a fixed order,
     no floating-point atomics: the same inputs give bitwise the same output).
No step reads routing data on the host, so the XPU path never synchronises.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from moe_xpu import _dispatch, _runtime, torch_fallback
from moe_xpu._dispatch import metadata
from moe_xpu.ops import (INDEX_DTYPES, SUPPORTED_DTYPES, MoeXpuInputError, checked_launch, gemm_args,
                         prepare_launch, rows_contiguous)

#: Expert id marking a (token, slot) whose expert lives elsewhere (expert parallelism): it is
#: skipped and contributes nothing. Any other id outside [0, num_experts) is an error.
SENTINEL_EXPERT = -1

ACTIVATIONS = {"silu": 1, "gelu_tanh": 2}  # the kernel's epilogue codes


class SortedTokens(NamedTuple):
    """The (token, slot) pairs of ``topk_ids`` grouped by expert (stable: token order kept)."""

    gather_index: torch.Tensor  # int64 [T*k]: token row of each expert-ordered pair
    group_offsets: torch.Tensor  # int32 [E]: cumulative end offsets; sentinel pairs sit past the end
    scatter_index: torch.Tensor  # int64 [T*k]: flat position token * k + slot of each pair


def _fail(message: str) -> None:
    raise MoeXpuInputError(message)


def _check_topk_ids(topk_ids: torch.Tensor, num_experts: int) -> None:
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        _fail(f"topk_ids must be a 2-D [T, k] tensor, got {getattr(topk_ids, 'shape', type(topk_ids))}")
    if topk_ids.dtype not in INDEX_DTYPES:
        _fail(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if isinstance(num_experts, torch.SymInt):  # symbolic under torch.compile's dynamic shapes
        return
    if not isinstance(num_experts, int) or num_experts < 1:
        _fail(f"num_experts must be a positive int, got {num_experts!r}")


def _check_topk_id_values(topk_ids: torch.Tensor, num_experts: int) -> None:
    bad = (topk_ids != SENTINEL_EXPERT) & ((topk_ids < 0) | (topk_ids >= num_experts))
    if topk_ids.device.type == "cpu":  # free to read on the host
        if bool(bad.any()):
            value = int(topk_ids[bad][0])
            _fail(f"topk_ids values must lie in [0, {num_experts}) or be {SENTINEL_EXPERT} "
                  f"(expert elsewhere), found {value}")
    else:  # checked on the device, no synchronisation
        torch._assert_async(~bad.any(), "moe_xpu: topk_ids outside [0, num_experts)")


def _sort_tokens_impl(topk_ids: torch.Tensor, num_experts: int):
    """gather_index, group_offsets, scatter_index of a routing whose ids were checked."""
    C = _runtime.sycl_module()
    if topk_ids.device.type == "cpu" and C is not None:  # one counting sort in host memory
        return _sort_tokens_on_host(C, topk_ids, num_experts)
    return _sort_tokens_torch(topk_ids, num_experts)


def _sort_tokens_torch(topk_ids: torch.Tensor, num_experts: int):
    """The sort in torch ops on the tensors' device (XPU: no host synchronisation)."""
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).to(torch.int64)
    keys = torch.where(flat == SENTINEL_EXPERT, num_experts, flat)  # sentinels sort last
    order = torch.argsort(keys, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, keys, torch.ones_like(keys))
    group_offsets = counts[:num_experts].cumsum(0).to(torch.int32)
    return order // k, group_offsets, order


def _sort_tokens_on_host(C, topk_ids: torch.Tensor, num_experts: int):
    """_sort_tokens_impl for CPU tensors, in the launcher (sycl/host_checks.cpp): the same result,
    bit for bit, and it checks the ids as it counts them."""
    ids = topk_ids.contiguous()
    pairs = ids.numel()
    gather_index = torch.empty(pairs, dtype=torch.int64)
    group_offsets = torch.empty(num_experts, dtype=torch.int32)
    scatter_index = torch.empty(pairs, dtype=torch.int64)
    checked_launch(C.sort_tokens_on_host, ids.data_ptr(), ids.dtype == torch.int64, pairs, max(ids.shape[1], 1),
                   num_experts, gather_index.data_ptr(), group_offsets.data_ptr(), scatter_index.data_ptr())
    return gather_index, group_offsets, scatter_index


def _sort_tokens_checked(topk_ids: torch.Tensor, num_experts: int):
    _check_topk_ids(topk_ids, num_experts)
    if topk_ids.device.type != "cpu" or _runtime.sycl_module() is None:
        _check_topk_id_values(topk_ids, num_experts)  # the host sort checks them as it counts
    return _sort_tokens_impl(topk_ids, num_experts)


@torch.library.custom_op("moe_xpu::sort_tokens", mutates_args=())
def _sort_tokens_op(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _sort_tokens_checked(topk_ids, num_experts)


@_sort_tokens_op.register_fake
def _sort_tokens_fake(topk_ids, num_experts):
    _check_topk_ids(topk_ids, num_experts)
    pairs = topk_ids.numel()
    return (topk_ids.new_empty(pairs, dtype=torch.int64),
            topk_ids.new_empty(num_experts, dtype=torch.int32),
            topk_ids.new_empty(pairs, dtype=torch.int64))


def sort_tokens(topk_ids: torch.Tensor, num_experts: int) -> SortedTokens:
    """Groups the (token, slot) pairs of ``topk_ids`` [T, k] by expert, on the device, with no
    host synchronisation. Returns ``SortedTokens(gather_index, group_offsets, scatter_index)``:
    ``moe_gemm(hidden, w, group_offsets, gather_index=gather_index)`` computes every pair's expert
    GEMM, and row m of its result belongs at flat position ``scatter_index[m]`` of [T, k].
    Pairs with the sentinel id -1 (expert elsewhere) are sorted past ``group_offsets[-1]``."""
    if _dispatch.direct_call_ok(topk_ids):
        return SortedTokens(*_sort_tokens_checked(topk_ids, num_experts))
    return SortedTokens(*_sort_tokens_op(topk_ids, num_experts))


def weighted_slot_sum(rows: torch.Tensor, scatter_index: torch.Tensor,
                      topk_weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Combines expert-ordered rows [T*k, H] (from ``sort_tokens``' order) into [T, H]: each row
    times its top-k weight, placed at its (token, slot), then summed over slots in slot order
    (float32, no atomics). The unfused paths' counterpart of the second launch's epilogue."""
    T, k = topk_weights.shape
    weights = topk_weights.reshape(-1).float()[scatter_index]
    per_slot = torch.empty(T * k, rows.shape[1], dtype=torch.float32, device=rows.device)
    per_slot[scatter_index] = rows.float() * weights[:, None]  # a permutation: no collisions
    return per_slot.view(T, k, -1).sum(dim=1).to(out_dtype)


def _expert_weight_shape(w) -> tuple[int, ...]:
    """fused_moe's layout of a weight: a tensor's own shape; a QuantizedExperts stands for moe_gemm's
    b = weight.transpose(1, 2), so its (E, K, N) is read back as [E, N, K]."""
    if _is_quantized(w):
        E, K, N = w.shape
        return (E, N, K)
    return tuple(w.shape)


def _is_quantized(w) -> bool:
    from moe_xpu.quant import QuantizedExperts

    return isinstance(w, QuantizedExperts)


def check_fused_moe_metadata(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids,
                             activation, gate_up_bias, down_bias) -> None:
    quantized = _is_quantized(gate_up_proj), _is_quantized(down_proj)
    for name, t in (("hidden_states", hidden_states), ("gate_up_proj", gate_up_proj),
                    ("down_proj", down_proj), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if not isinstance(t, torch.Tensor) and not (name.endswith("proj") and _is_quantized(t)):
            _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if quantized[0] != quantized[1]:
        _fail("gate_up_proj and down_proj must both be QuantizedExperts or both be tensors")
    if hidden_states.dim() != 2:
        _fail(f"hidden_states must be 2-D [T, H], got shape {tuple(hidden_states.shape)}")
    if hidden_states.dtype not in SUPPORTED_DTYPES:
        _fail(f"hidden_states must be float32, bfloat16 or float16, got {hidden_states.dtype}")
    T, H = hidden_states.shape
    gate_up_shape, down_shape = _expert_weight_shape(gate_up_proj), _expert_weight_shape(down_proj)
    hint = " (as QuantizedExperts: quantize_experts(gate_up_proj.transpose(1, 2), ...))" if quantized[0] else ""
    if len(gate_up_shape) != 3 or gate_up_shape[2] != H or gate_up_shape[1] % 2:
        _fail(f"gate_up_proj must be [E, 2I, H] with H = {H}{hint}, got shape {gate_up_shape}")
    E, I = gate_up_shape[0], gate_up_shape[1] // 2
    if down_shape != (E, H, I):
        hint = " (as QuantizedExperts: quantize_experts(down_proj.transpose(1, 2), ...))" if quantized[1] else ""
        _fail(f"down_proj must be [E, H, I] = [{E}, {H}, {I}]{hint}, got shape {down_shape}")
    for name, t in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if isinstance(t, torch.Tensor) and t.dtype != hidden_states.dtype:
            _fail(f"{name} must have hidden_states' dtype {hidden_states.dtype}, got {t.dtype}")
    _check_topk_ids(topk_ids, E)
    if topk_ids.shape[0] != T:
        _fail(f"topk_ids must have T = {T} rows, got shape {tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        _fail(f"topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}, got {tuple(topk_weights.shape)}")
    if not topk_weights.is_floating_point():
        _fail(f"topk_weights must be a floating-point tensor, got {topk_weights.dtype}")
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        _fail(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    for name, bias, shape in (("gate_up_bias", gate_up_bias, (E, 2 * I)), ("down_bias", down_bias, (E, H))):
        if bias is None:
            continue
        if tuple(bias.shape) != shape:
            _fail(f"{name} must have shape {list(shape)}, got {tuple(bias.shape)}")
        if quantized[0]:  # the quantized kernels add a float32 copy of the bias
            if not bias.is_floating_point():
                _fail(f"{name} must be a floating-point tensor, got {bias.dtype}")
        elif bias.dtype != hidden_states.dtype:
            _fail(f"{name} must have hidden_states' dtype {hidden_states.dtype}, got {bias.dtype}")
    for name, t in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj), ("topk_weights", topk_weights),
                    ("topk_ids", topk_ids), ("gate_up_bias", gate_up_bias), ("down_bias", down_bias)):
        if t is not None and t.device != hidden_states.device:
            _fail(f"{name} is on {t.device} but hidden_states is on {hidden_states.device}")


def _k_contiguous_view(w: torch.Tensor) -> torch.Tensor:
    """[E, N, K] weights viewed as [E, K, N] with K contiguous (copied only if K is strided)."""
    view = w.transpose(1, 2)
    return view if view.shape[1] <= 1 or view.stride(1) == 1 else w.contiguous().transpose(1, 2)


class PreparedFused:
    """What a fused_moe call's metadata settles once its metadata is checked: both launches'
    prepared launches (``ops.PreparedLaunch``: planned, kernels looked up) and the dtype of the
    hidden rows between them. Kept per metadata (see ``prepared_fused``), so a decode step
    repeating an earlier step's shapes skips the checks and the planning, on every path (direct
    call, torch op, training forward). ``pre_activations``: the first launch writes the gate/up
    pre-activations (the training forward) instead of the activated rows; a different plan."""

    __slots__ = ("gate_up", "down", "h_dtype", "pre_activations")

    def __init__(self, pre_activations: bool = False):
        self.gate_up = self.down = None
        self.h_dtype = torch.float32
        self.pre_activations = pre_activations


_PREPARED = _dispatch.MetadataTable()


def prepared_fused(args: tuple, pre_activations: bool = False) -> PreparedFused:
    """The checked metadata of fused_moe arguments (tensors, not QuantizedExperts): raises
    MoeXpuInputError for bad metadata (nothing is kept then), else returns its PreparedFused (see
    there for ``pre_activations``)."""
    hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids, activation, gate_up_bias, down_bias = args
    if not isinstance(activation, str):
        check_fused_moe_metadata(*args)  # raises, naming it
    try:
        key = (metadata(hidden_states), metadata(gate_up_proj), metadata(down_proj), metadata(topk_weights),
               metadata(topk_ids), activation, metadata(gate_up_bias), metadata(down_bias), pre_activations)
    except AttributeError:  # something that is not a tensor: the checks name it
        check_fused_moe_metadata(*args)
        raise
    found = _PREPARED.get(key)
    if found is not None:
        return found
    check_fused_moe_metadata(*args)
    return _PREPARED.keep(key, PreparedFused(pre_activations))


def _fused_moe_sycl(*args, prepared: PreparedFused):
    per_slot = _per_slot_sycl(*args, prepared=prepared)
    return per_slot.sum(dim=1).to(args[0].dtype)


def _per_slot_sycl(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids, activation,
                   gate_up_bias, down_bias, prepared: PreparedFused, pre: torch.Tensor | None = None,
                   sorted_tokens: tuple | None = None):
    """Every (token, slot) pair's weighted expert output, float32 [T, k, H] (zeros for sentinel
    slots), before the slot sum. ``prepared``: the PreparedFused of these arguments' metadata, whose
    launches are planned here on its first call. ``pre`` (float32 [T*k, 2I], zero-filled; given
    exactly when ``prepared.pre_activations``): the first launch writes the gate/up
    pre-activations there and the activation runs in torch (the training forward, which keeps
    them for the backward). ``sorted_tokens``: the routing's
    ``_sort_tokens_impl`` result where the caller already has it."""
    T, H = hidden_states.shape
    E, I = gate_up_proj.shape[0], gate_up_proj.shape[1] // 2
    k = topk_ids.shape[1]
    x = rows_contiguous(hidden_states)
    # ids checked (on the CPU: by the sort)
    gather_index, group_offsets, scatter_index = sorted_tokens or _sort_tokens_impl(topk_ids, E)
    gate_up_bias = None if gate_up_bias is None else gate_up_bias.contiguous()
    down_bias = None if down_bias is None else down_bias.contiguous()
    # Locals keep every tensor the kernels read alive until the launches are done.
    # h is float32: the second GEMM reads it as float A (no widening in its k loop) and both
    # launches share one compiled kernel bundle. The vector kernels use h unrounded; the bf16
    # matrix-engine kernels round it to bf16 as they pack it (the engine multiplies bf16), as a
    # bf16 model's own expert block would. Where the second GEMM would run on the bf16 dot-product
    # kernels (CPUs with AVX512-BF16), h is bf16 for the same reason: they multiply bf16.
    w_gate_up, w_down = _k_contiguous_view(gate_up_proj), _k_contiguous_view(down_proj)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    per_slot = torch.empty(T * k, H, dtype=torch.float32, device=x.device)
    p = prepared
    if p.pre_activations != (pre is not None):
        raise RuntimeError("moe_xpu: a fused launch planned for the other first-launch output")
    if p.gate_up is None and x.dtype == torch.bfloat16:
        probe = torch.empty(T * k, I, dtype=torch.bfloat16, device=x.device)
        args = gemm_args(probe, w_down, group_offsets, None, down_bias, per_slot)
        if "moe_gemm_k_dot<" in _runtime.sycl_module().plan_gemm(args).kernel_name:
            p.h_dtype = torch.bfloat16
    h = torch.empty(T * k, I, dtype=p.h_dtype, device=x.device)
    if p.gate_up is None:  # the first call with this metadata plans both launches
        args = gemm_args(x, w_gate_up, group_offsets, gather_index, gate_up_bias, h if pre is None else pre)
        if pre is None:
            args.activation, args.up_offset, args.N = ACTIVATIONS[activation], I, I
        args.gather_matches_offsets = False  # slots of experts elsewhere sort past the last group
        gate_up = prepare_launch(args, x)
        args = gemm_args(h, w_down, group_offsets, None, down_bias, per_slot)
        args.scatter_index, args.scatter_is_int64 = scatter_index.data_ptr(), True
        args.row_weight = weights.data_ptr()
        p.down = prepare_launch(args, h)
        p.gate_up = gate_up
    queue = _runtime.queue_address(x.device)
    bias_up = 0 if gate_up_bias is None else gate_up_bias.data_ptr()
    bias_down = 0 if down_bias is None else down_bias.data_ptr()
    # 1. h = act(x[token] @ gate^T) * (x[token] @ up^T), rows in expert order, read via the index.
    p.gate_up.launch(queue, x, w_gate_up.data_ptr(), group_offsets.data_ptr(), gather_index.data_ptr(), bias_up,
                     h.data_ptr() if pre is None else pre.data_ptr())
    if pre is not None:
        h.copy_(torch_fallback.ACTIVATIONS[activation](pre[:, :I]) * pre[:, I:])
    # 2. each row times its top-k weight, written to its (token, slot) place; then the slot sum.
    p.down.launch(queue, h, w_down.data_ptr(), group_offsets.data_ptr(), 0, bias_down, per_slot.data_ptr(),
                  scatter_index.data_ptr(), weights.data_ptr())
    return per_slot.view(T, k, H)


@torch.library.custom_op("moe_xpu::fused_moe", mutates_args=())
def _fused_moe_op(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    raise NotImplementedError(f"moe_xpu.fused_moe has no implementation for device {hidden_states.device}")


def run_on_backend(args: tuple, fallback, sycl, **sycl_options):
    """Runs fused-MoE arguments whose metadata was checked (hidden_states, gate_up_proj, down_proj,
    topk_weights, topk_ids, ...) with ``fallback`` (plain PyTorch: CPU tensors with the torch
    backend) or ``sycl`` (given ``sycl_options`` too), checking the routing ids on the way."""
    hidden_states, topk_ids, num_experts = args[0], args[4], args[1].shape[0]
    if hidden_states.device.type == "cpu" and _runtime.cpu_backend() == "torch":
        _check_topk_id_values(topk_ids, num_experts)
        return fallback(*args)
    if _runtime.sycl_module() is None:
        raise RuntimeError(f"moe_xpu: the SYCL launcher is not available: {_runtime.import_error()}")
    if hidden_states.device.type != "cpu":
        _check_topk_id_values(topk_ids, num_experts)  # on the CPU the host sort checks them
    return sycl(*args, **sycl_options)


def _fused_moe_checked(*args, prepared: PreparedFused):
    """fused_moe on arguments whose metadata was checked (``prepared``: their PreparedFused)."""
    return run_on_backend(args, torch_fallback.fused_moe, _fused_moe_sycl, prepared=prepared)


def _zeroed_pre_activations(x: torch.Tensor, group_offsets: torch.Tensor, rows: int, I: int) -> torch.Tensor:
    """float32 [rows, 2I] for the first GEMM's output, zero past the pairs with an expert here
    (which the kernels leave unwritten). CPU offsets are read on the host to clear only those."""
    if x.device.type != "cpu":
        return torch.zeros(rows, 2 * I, dtype=torch.float32, device=x.device)
    pre = torch.empty(rows, 2 * I, dtype=torch.float32)
    pre[int(group_offsets[-1]) if group_offsets.numel() else 0:].zero_()
    return pre


def _fused_moe_train_sycl(*args, prepared: PreparedFused):
    x, gate_up_proj, topk_ids = args[0], args[1], args[4]
    T, k, (E, I2) = x.shape[0], topk_ids.shape[1], gate_up_proj.shape[:2]
    sorted_tokens = _sort_tokens_impl(topk_ids, E)
    pre = _zeroed_pre_activations(x, sorted_tokens[1], T * k, I2 // 2)
    per_slot = _per_slot_sycl(*args, prepared=prepared, pre=pre, sorted_tokens=sorted_tokens)
    return per_slot.sum(dim=1).to(x.dtype), pre


def _fused_moe_train_torch(*args):
    x, gate_up_proj, topk_ids, gate_up_bias = args[0], args[1], args[4], args[6]
    gather_index, group_offsets, _ = _sort_tokens_torch(topk_ids, gate_up_proj.shape[0])
    pre = torch_fallback.moe_gemm(x, gate_up_proj.transpose(1, 2), group_offsets, gather_index, gate_up_bias,
                                  torch.float32)
    return torch_fallback.fused_moe(*args), pre


@torch.library.custom_op("moe_xpu::fused_moe_train", mutates_args=())
def _fused_moe_train_op(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_moe for training: its output and the gate/up pre-activations its backward reads,
    float32 [T*k, 2I], rows in expert order (the order of ``sort_tokens``), zero past the pairs
    with an expert here. The first launch writes them and the activation runs in torch, so the
    output can differ from ``fused_moe``'s in the last bits of the activation."""
    args = (hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids, activation, gate_up_bias, down_bias)
    return run_on_backend(args, _fused_moe_train_torch, _fused_moe_train_sycl,
                          prepared=prepared_fused(args, pre_activations=True))


@_fused_moe_train_op.register_fake
def _fused_moe_train_fake(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids, activation="silu",
                          gate_up_bias=None, down_bias=None):
    check_fused_moe_metadata(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids,
                             activation, gate_up_bias, down_bias)
    rows = topk_ids.shape[0] * topk_ids.shape[1]
    return torch.empty_like(hidden_states), hidden_states.new_empty(rows, gate_up_proj.shape[1], dtype=torch.float32)


def fused_moe_per_slot(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids, activation="silu",
                       gate_up_bias=None, down_bias=None) -> torch.Tensor:
    """fused_moe before its slot sum: float32 [T, k, H], row (t, j) the weighted output of token t's
    expert in slot j (zeros for sentinel slots). ``fused_moe`` is ``per_slot.sum(dim=1)`` cast
    to hidden_states' dtype, bit for bit (the expert parallel path sums these rows on the tokens'
    home ranks). Float weights, no autograd."""
    args = (hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids, activation, gate_up_bias, down_bias)
    if _is_quantized(gate_up_proj) or _is_quantized(down_proj):
        _fail("fused_moe_per_slot takes float weights")
    # prepared_fused checks the metadata (once per metadata)
    return run_on_backend(args, torch_fallback.fused_moe_per_slot, _per_slot_sycl, prepared=prepared_fused(args))


def _fused_moe_impl(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids, activation="silu",
                    gate_up_bias=None, down_bias=None):
    args = (hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids, activation, gate_up_bias, down_bias)
    return _fused_moe_checked(*args, prepared=prepared_fused(args))


_dispatch.register_device_kernel(_fused_moe_op, _fused_moe_impl)


@_fused_moe_op.register_fake
def _fused_moe_fake(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids, activation="silu",
                    gate_up_bias=None, down_bias=None):
    check_fused_moe_metadata(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids,
                             activation, gate_up_bias, down_bias)
    return torch.empty_like(hidden_states)


def fused_moe(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    recompute_activations: bool = False,
) -> torch.Tensor:
    """A whole MoE expert block, Hugging Face transformers' expert semantics.

    hidden_states [T, H]; gate_up_proj [E, 2I, H] (gate rows first); down_proj [E, H, I];
    topk_weights, topk_ids [T, k]. For every token t and slot j with e = topk_ids[t, j]:
    ``y[t] += topk_weights[t, j] * down_proj[e] @ (act(gate[e] @ x[t]) * (up[e] @ x[t]))``
    (+ biases when given). activation: "silu" or "gelu_tanh" (both gated). Output [T, H] in
    hidden_states' dtype. Ids equal to -1 (expert elsewhere) are skipped.

    Quantized weights: pass :class:`moe_xpu.QuantizedExperts` for both, made from the weights as
    moe_gemm's b, ``quantize_experts(gate_up_proj.transpose(1, 2), fmt)`` and
    ``quantize_experts(down_proj.transpose(1, 2), fmt)`` (any float activations; each weight is
    dequantized in the kernels' k loop).

    Training: differentiable in hidden_states, both weights, topk_weights and the biases. By
    default the forward keeps the gate/up pre-activations for the backward (float32, T*k*2I
    values); ``recompute_activations=True`` keeps only the inputs and the backward runs the first
    GEMM again instead (one forward-sized GEMM more).
    """
    args = (hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids, activation, gate_up_bias, down_bias)
    # Plain tensors only (never QuantizedExperts): their metadata is checked once per metadata.
    if _dispatch.direct_call_ok(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids, gate_up_bias,
                                down_bias):
        return _fused_moe_checked(*args, prepared=prepared_fused(args))
    check_fused_moe_metadata(*args)
    if _is_quantized(gate_up_proj):
        from moe_xpu import fused_quant

        return fused_quant.fused_moe_quantized(*args)
    if not recompute_activations and torch.is_grad_enabled() and any(
            t is not None and t.requires_grad
            for t in (hidden_states, gate_up_proj, down_proj, topk_weights, gate_up_bias, down_bias)):
        return _fused_moe_train_op(*args)[0]
    return _fused_moe_op(*args)
