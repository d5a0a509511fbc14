"""Backward of ``moe_gemm`` and ``fused_moe``: their autograd formulas and the weight-gradient
op they use.

For out[m] = a[row(m)] @ b[g] + bias[g] (row(m) = gather_index[m] with an index table, else m):
  - dA: the same grouped GEMM with the weights read transposed in place (``b.transpose(1, 2)``);
    through an index table its rows go back to token rows in a fixed order (no atomics);
  - dB[g] = A[rows of g]^T @ dOut[rows of g]: ``moe_xpu::moe_gemm_wgrad``, one launch of the
    weight-gradient kernel (sycl/kernels/moe_gemm_wgrad.cpp), written in b's own layout;
  - dbias[g]: the sum of dOut over g's rows, the same kernel with a column of ones as A.
Every sum runs in a fixed order, so the same inputs give bitwise the same gradients.
"""

from __future__ import annotations

import torch

from moe_xpu import _runtime
from moe_xpu._host_memory import empty_strided_for_write, gradient_buffers
from moe_xpu.ops import SUPPORTED_DTYPES, MoeXpuInputError, _launcher_dtype, _moe_gemm_op, moe_gemm, rows_contiguous


def _check_wgrad_metadata(a, grad_out, group_offsets, gather_index) -> None:
    if a.dim() != 2 or grad_out.dim() != 2 or group_offsets.dim() != 1:
        raise MoeXpuInputError("moe_gemm_wgrad: a and grad_out must be 2-D and group_offsets 1-D")
    if a.dtype not in SUPPORTED_DTYPES or grad_out.dtype != a.dtype:
        raise MoeXpuInputError(f"moe_gemm_wgrad: a and grad_out must share a float dtype, got {a.dtype} and "
                               f"{grad_out.dtype}")
    if gather_index is not None and gather_index.shape[0] != grad_out.shape[0]:
        raise MoeXpuInputError("moe_gemm_wgrad: gather_index must have one entry per row of grad_out")
    if gather_index is None and a.shape[0] != grad_out.shape[0]:
        raise MoeXpuInputError("moe_gemm_wgrad: without gather_index, a and grad_out must have the same rows")


def _empty_weight_grad(a, grad_out, group_offsets, k_contiguous: bool, pooled: bool = False) -> torch.Tensor:
    """[E, K, N] in the layout of the weights it is the gradient of: K contiguous (nn.Linear
    weights seen through ``.transpose(1, 2)``) or N contiguous. ``pooled``: a CPU buffer from the
    gradient pool, for a kernel that writes every element (a reused buffer needs no clearing)."""
    E, K, N = group_offsets.shape[0], a.shape[1], grad_out.shape[1]
    size, stride = (E, K, N), _weight_grad_strides(K, N, k_contiguous)
    if pooled and a.device.type == "cpu":
        return gradient_buffers.empty_strided(size, stride, dtype=a.dtype)
    return empty_strided_for_write(size, stride, dtype=a.dtype, device=a.device)


def _weight_grad_strides(K: int, N: int, k_contiguous: bool) -> tuple[int, int, int]:
    return (N * K, 1, K) if k_contiguous else (K * N, N, 1)


def _wgrad_args(C, a, grad_out, group_offsets, gather_index, out):
    w = C.WgradArgs()
    w.queue = _runtime.queue_address(a.device)
    w.dtype = w.out_dtype = _launcher_dtype(a.dtype)
    w.a, w.a_row_stride, w.a_rows = a.data_ptr(), a.stride(0), a.shape[0]
    if gather_index is not None:
        w.gather_index, w.gather_is_int64 = gather_index.data_ptr(), gather_index.dtype == torch.int64
    w.dy, w.dy_row_stride, w.dy_rows = grad_out.data_ptr(), grad_out.stride(0), grad_out.shape[0]
    w.group_offsets, w.offsets_are_int64 = group_offsets.data_ptr(), group_offsets.dtype == torch.int64
    w.num_groups, w.K, w.N = group_offsets.shape[0], a.shape[1], grad_out.shape[1]
    w.out = out.data_ptr()
    w.out_stride_e, w.out_stride_k, w.out_stride_n = out.stride()
    return w


def _plan_if_gathered(C, w, rows: int):
    """The plan of launch arguments ``w`` (through an index table) had A's ``rows`` rows been
    gathered first. Planning reads no tensor, so nothing is gathered to ask; ``w`` is left as it was."""
    kept = w.a_rows, w.a_row_stride, w.gather_index
    w.a_rows, w.a_row_stride, w.gather_index = rows, w.K, 0
    try:
        return C.plan_wgrad(w)
    finally:
        w.a_rows, w.a_row_stride, w.gather_index = kept


def _wgrad_sycl(a, grad_out, group_offsets, gather_index, k_contiguous):
    a, grad_out, group_offsets = rows_contiguous(a), rows_contiguous(grad_out), group_offsets.contiguous()
    gather_index = None if gather_index is None else gather_index.contiguous()
    out = _empty_weight_grad(a, grad_out, group_offsets, k_contiguous, pooled=True)
    C = _runtime.sycl_module()
    w = _wgrad_args(C, a, grad_out, group_offsets, gather_index, out)
    if gather_index is not None and k_contiguous and "dot_wgrad" not in C.plan_wgrad(w).kernel_name \
            and "dot_wgrad" in _plan_if_gathered(C, w, grad_out.shape[0]).kernel_name:
        # The bf16 dot kernel computes K-contiguous dB transposed, reading A's rows in place, so not
        # through an index table: where it would run, A's rows are gathered first (rows x K, small
        # beside dB), clamped as the kernels clamp an index.
        rows = a.index_select(0, gather_index.clamp(0, a.shape[0] - 1))
        a, w = rows, _wgrad_args(C, rows, grad_out, group_offsets, None, out)  # (a keeps the rows alive)
    C.moe_gemm_wgrad(w)
    return out


def _wgrad_torch(a, grad_out, group_offsets, gather_index, k_contiguous):
    """Plain PyTorch (MOE_XPU_BACKEND=torch, or no SYCL runtime): a loop over the groups."""
    out = _empty_weight_grad(a, grad_out, group_offsets, k_contiguous)
    start = 0
    for g, end in enumerate(group_offsets.tolist()):
        end = max(start, min(end, grad_out.shape[0]))
        src = a[start:end] if gather_index is None else a[gather_index[start:end]]
        out[g] = (src.float().t() @ grad_out[start:end].float()).to(out.dtype)
        start = end
    return out


@torch.library.custom_op("moe_xpu::moe_gemm_wgrad", mutates_args=())
def _moe_gemm_wgrad_op(a: torch.Tensor, grad_out: torch.Tensor, group_offsets: torch.Tensor,
                       gather_index: torch.Tensor | None, k_contiguous: bool) -> torch.Tensor:
    """dB [E, K, N] of moe_gemm: for each group g, a[rows of g]^T @ grad_out[rows of g]."""
    _check_wgrad_metadata(a, grad_out, group_offsets, gather_index)
    if a.device.type == "cpu" and _runtime.cpu_backend() == "torch":
        return _wgrad_torch(a, grad_out, group_offsets, gather_index, k_contiguous)
    if _runtime.sycl_module() is None:
        raise RuntimeError(f"moe_xpu: the SYCL launcher is not available: {_runtime.import_error()}")
    return _wgrad_sycl(a, grad_out, group_offsets, gather_index, k_contiguous)


@_moe_gemm_wgrad_op.register_fake
def _moe_gemm_wgrad_fake(a, grad_out, group_offsets, gather_index, k_contiguous):
    _check_wgrad_metadata(a, grad_out, group_offsets, gather_index)
    return _empty_weight_grad(a, grad_out, group_offsets, k_contiguous)


@torch.library.custom_op("moe_xpu::sum_rows_by_token", mutates_args=())
def sum_rows_by_token(rows: torch.Tensor, index: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """out[t] = the sum of rows[i] over the i with index[i] == t, in ascending i: each row gets
    the slot given by its rank among its token's rows, then each token's slots are summed. A fixed
    order on every device (no floating-point atomics). Reads the largest count per token on the
    host (free for CPU tensors; one synchronisation on XPU), hence an op of its own: graphs see
    only its output shape."""
    index = index.to(torch.int64)
    if index.numel() == 0:
        return rows.new_zeros(num_tokens, rows.shape[1])
    counts = torch.bincount(index, minlength=num_tokens)
    width = int(counts.max())
    order = torch.argsort(index, stable=True)
    token = index[order]
    rank = torch.arange(index.numel(), device=index.device) - (counts.cumsum(0) - counts)[token]
    slot = torch.empty_like(index)
    slot[order] = token * width + rank  # each row's slot, so the rows are copied in one pass
    slots = rows.new_zeros(num_tokens * width, rows.shape[1])
    slots.index_copy_(0, slot, rows)
    return slots.view(num_tokens, width, rows.shape[1]).sum(1)


@sum_rows_by_token.register_fake
def _sum_rows_by_token_fake(rows, index, num_tokens):
    return rows.new_empty(num_tokens, rows.shape[1])


def _group_row_sums(rows: torch.Tensor, group_offsets: torch.Tensor) -> torch.Tensor:
    """[E, N]: each group's rows summed in row order (a bias gradient), by the weight-gradient
    kernel with a column of ones as A."""
    return _moe_gemm_wgrad_op(rows.new_ones(rows.shape[0], 1), rows, group_offsets, None, False).squeeze(1)


def _reads_k_contiguous(b: torch.Tensor) -> bool:
    """Whether the kernels read b along contiguous K (nn.Linear weights seen as [E, K, N])."""
    return b.shape[1] > 1 and b.stride(1) == 1


def _setup_context(ctx, inputs, output) -> None:
    a, b, group_offsets, gather_index, bias, out_dtype = inputs
    ctx.save_for_backward(a, b, group_offsets, gather_index)
    ctx.k_contiguous = _reads_k_contiguous(b)
    ctx.bias_needs_grad = bias is not None and bias.requires_grad


def _backward(ctx, grad):
    a, b, group_offsets, gather_index = ctx.saved_tensors
    grad = grad.to(a.dtype)  # out_dtype float32 of 16-bit inputs: gradients in the inputs' dtype
    grad_a = grad_b = grad_bias = None
    if ctx.needs_input_grad[0]:
        rows = moe_gemm(grad, b.transpose(1, 2), group_offsets)
        grad_a = rows if gather_index is None else sum_rows_by_token(rows, gather_index, a.shape[0])
    if ctx.needs_input_grad[1]:
        grad_b = _moe_gemm_wgrad_op(a, grad, group_offsets, gather_index, ctx.k_contiguous)
    if ctx.bias_needs_grad:
        grad_bias = _group_row_sums(grad, group_offsets)
    return grad_a, grad_b, None, None, grad_bias, None


_moe_gemm_op.register_autograd(_backward, setup_context=_setup_context)


# fused_moe's backward, for two forwards: moe_xpu::fused_moe_train keeps the gate/up
# pre-activations (float32 [T*k, 2I] per layer, alive from the forward to the backward) and the
# backward reads them; moe_xpu::fused_moe keeps only its inputs and the backward runs the first
# GEMM again (one forward-sized GEMM more: the backward then runs it and 4 gradient GEMMs). Both
# give the same gradients: the saved pre-activations come from the same launch as the recomputed.


def _activation_and_slope(activation: str, gate: torch.Tensor):
    """act(gate) and d act / d gate, float32, in closed form (silu; gelu with the tanh
    approximation, as transformers' gelu_pytorch_tanh)."""
    if activation == "silu":
        s = torch.sigmoid(gate)
        return gate * s, s * (1 + gate * (1 - s))
    c, a3 = 0.7978845608028654, 0.044715
    t = torch.tanh(c * (gate + a3 * gate ** 3))
    return 0.5 * gate * (1 + t), 0.5 * (1 + t) + 0.5 * gate * (1 - t * t) * c * (1 + 3 * a3 * gate * gate)


def _fused_setup_context(ctx, inputs, output, pre: torch.Tensor | None = None) -> None:
    x, gate_up, down, weights, ids, activation, gate_up_bias, down_bias = inputs
    ctx.save_for_backward(x, gate_up, down, weights, ids, gate_up_bias, down_bias, pre)
    ctx.activation = activation
    ctx.wants = [t is not None and t.requires_grad for t in (x, gate_up, down, weights)]
    ctx.wants += [gate_up_bias is not None and gate_up_bias.requires_grad,
                  down_bias is not None and down_bias.requires_grad]


def _slots_to_tokens(rows: torch.Tensor, positions: torch.Tensor, T: int, k: int) -> torch.Tensor:
    """[M, H] expert-ordered rows to [T, H]: each row at its (token, slot) place, then the slot
    sum in slot order (sentinel slots stay zero; without sentinels every slot is written)."""
    per_slot = (rows.new_empty if rows.shape[0] == T * k else rows.new_zeros)(T * k, rows.shape[1])
    per_slot[positions] = rows  # a permutation: no collisions
    return per_slot.view(T, k, rows.shape[1]).sum(1)


@torch.library.custom_op("moe_xpu::fused_moe_backward", mutates_args=())
def _fused_moe_backward_op(grad: torch.Tensor, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                           weights: torch.Tensor, ids: torch.Tensor, activation: str,
                           gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
                           pre: torch.Tensor | None, wants: list[bool]) -> list[torch.Tensor]:
    """The gradients of fused_moe that `wants` asks for (hidden_states, gate_up_proj, down_proj,
    topk_weights, gate_up_bias, down_bias; an empty tensor for the others). ``pre``: the forward's
    gate/up pre-activations (fused_moe_train's second output), or None to recompute them. An op of
    its own: it reads how many routing pairs have an expert here (group_offsets[-1]), which graphs
    cannot."""
    from moe_xpu.fused import sort_tokens

    want_x, want_gate_up, want_down, want_weights, want_gate_up_bias, want_down_bias = wants
    dtype, (T, H), (E, I2), k = x.dtype, x.shape, gate_up.shape[:2], ids.shape[1]
    I = I2 // 2
    s = sort_tokens(ids, E)
    # Pairs of experts elsewhere (id -1) sort past the last group: moe_gemm's index table covers
    # the first group_offsets[-1] pairs (one host read on XPU).
    M = int(s.group_offsets[-1]) if E else 0
    gather, positions, offsets = s.gather_index[:M], s.scatter_index[:M], s.group_offsets

    if pre is None:
        pre = moe_gemm(x, gate_up.transpose(1, 2), offsets, gather_index=gather, bias=gate_up_bias,
                       out_dtype=torch.float32)
    else:
        pre = pre[:M]
    gate, up = pre[:, :I], pre[:, I:]
    act, slope = _activation_and_slope(activation, gate)
    h = (act * up).to(dtype)
    # (index_select: torch's gather by a plain index, about twice as fast on the CPU as indexing)
    grad_rows = grad.float().index_select(0, gather)  # dOut of each pair's token
    row_weight = weights.reshape(-1).float().index_select(0, positions)
    grad_y = (grad_rows * row_weight[:, None]).to(dtype)  # gradient of each pair's expert output

    # One GEMM serves both the top-k weights' gradient and h's: with g a pair's dOut and y = D h + b
    # its expert's output, d/dweight = <g, y> = <D^T g, h> + <g, b>, and dh = weight * D^T g. (The
    # second GEMM is not recomputed for y.)
    grad_weights = grad_h_unweighted = None
    if want_weights or want_x or want_gate_up or want_gate_up_bias:
        grad_h_unweighted = moe_gemm(grad_rows.to(dtype), down, offsets, out_dtype=torch.float32)
    if want_weights:
        per_pair = (grad_h_unweighted * h.float()).sum(1)
        if down_bias is not None:
            pair_expert = ids.reshape(-1)[positions].long()
            per_pair = per_pair + (grad_rows * down_bias.float().index_select(0, pair_expert)).sum(1)
        grad_weights = per_pair.new_zeros(T * k)
        grad_weights[positions] = per_pair
        grad_weights = grad_weights.view(T, k).to(weights.dtype)
    grad_down = _moe_gemm_wgrad_op(h, grad_y, offsets, None, True).transpose(1, 2) if want_down else None
    grad_down_bias = None
    if want_down_bias:
        grad_down_bias = _group_row_sums(grad_y, offsets)

    grad_x = grad_gate_up = grad_gate_up_bias = None
    if want_x or want_gate_up or want_gate_up_bias:
        grad_h = grad_h_unweighted * row_weight[:, None]
        grad_pre = torch.cat([grad_h * up * slope, grad_h * act], dim=1).to(dtype)
        if want_x:
            rows = moe_gemm(grad_pre, gate_up, offsets, out_dtype=torch.float32)
            grad_x = _slots_to_tokens(rows, positions, T, k).to(dtype)
        if want_gate_up:
            grad_gate_up = _moe_gemm_wgrad_op(x, grad_pre, offsets, gather, True).transpose(1, 2)
        if want_gate_up_bias:
            grad_gate_up_bias = _group_row_sums(grad_pre, offsets)
    grads = [grad_x, grad_gate_up, grad_down, grad_weights, grad_gate_up_bias, grad_down_bias]
    return [x.new_empty(0) if g is None else g for g in grads]


@_fused_moe_backward_op.register_fake
def _fused_moe_backward_fake(grad, x, gate_up, down, weights, ids, activation, gate_up_bias, down_bias, pre, wants):
    E, I2, H = gate_up.shape
    like = [x, gate_up, down, weights, gate_up_bias, down_bias]
    grads = [torch.empty_like(t) if want else x.new_empty(0) for t, want in zip(like, wants)]
    grads[1] = torch.empty_strided((E, I2, H), (I2 * H, H, 1), dtype=x.dtype, device=x.device) if wants[1] else grads[1]
    grads[2] = torch.empty_strided(down.shape, (down.shape[1] * down.shape[2], down.shape[2], 1), dtype=x.dtype,
                                   device=x.device) if wants[2] else grads[2]
    return grads


def _fused_backward(ctx, grad, grad_pre=None):
    x, gate_up, down, weights, ids, gate_up_bias, down_bias, pre = ctx.saved_tensors
    grads = _fused_moe_backward_op(grad, x, gate_up, down, weights, ids, ctx.activation, gate_up_bias, down_bias,
                                   pre, ctx.wants)
    kept = [g if want else None for g, want in zip(grads, ctx.wants)]
    return kept[0], kept[1], kept[2], kept[3], None, None, kept[4], kept[5]


def _fused_train_setup_context(ctx, inputs, output) -> None:
    out, pre = output
    ctx.mark_non_differentiable(pre)
    _fused_setup_context(ctx, inputs, out, pre)


def _register_fused_autograd() -> None:
    from moe_xpu.fused import _fused_moe_op, _fused_moe_train_op

    _fused_moe_op.register_autograd(_fused_backward, setup_context=_fused_setup_context)
    _fused_moe_train_op.register_autograd(_fused_backward, setup_context=_fused_train_setup_context)


_register_fused_autograd()
