"""fused_moe with quantized expert weights, as the torch op ``moe_xpu::fused_moe_quant``.

The same two launches as the float fused MoE (see ``fused.py``), run by the quantized kernel family
(``sycl/kernels/moe_gemm_quant.cpp``): gate_up reads token rows through the index table and writes
act(gate) * up in float32 (bf16 in a bf16 block whose second GEMM runs on the matrix engine); down
multiplies each row by its top-k weight and scatters it to its (token, slot) place; the slots of a
token are then summed in slot order. Both weights stay in their quantized format and are
dequantized in the k loop.

A QuantizedExperts stands for moe_gemm's b, so gate_up_proj [E, 2I, H] is quantized as
``gate_up_proj.transpose(1, 2)`` (logical [E, H, 2I]) and down_proj [E, H, I] as
``down_proj.transpose(1, 2)`` (logical [E, I, H]).
"""

from __future__ import annotations

import torch

from moe_xpu import _dispatch, _runtime, fused, torch_fallback
from moe_xpu.ops import rows_contiguous
from moe_xpu.quant import QuantizedExperts, output_columns, quant_args, run_quant


def _containers(hidden_states, gate_up_data, gate_up_scale, gate_up_zero, gate_up_format, gate_up_block,
                down_data, down_scale, down_zero, down_format, down_block):
    """The two QuantizedExperts from the op's flat arguments (checked as they are made)."""
    H = hidden_states.shape[1]
    E, N1 = gate_up_data.shape[0], output_columns(gate_up_format, gate_up_data, gate_up_scale)
    gate_up = QuantizedExperts(gate_up_format, gate_up_data, gate_up_scale, gate_up_zero, tuple(gate_up_block),
                               (E, H, N1))
    down = QuantizedExperts(down_format, down_data, down_scale, down_zero, tuple(down_block),
                            (down_data.shape[0], N1 // 2, output_columns(down_format, down_data, down_scale)))
    return gate_up, down


def _fused_sycl(hidden_states, gate_up: QuantizedExperts, down: QuantizedExperts, topk_weights, topk_ids,
                activation, gate_up_bias, down_bias):
    T, H = hidden_states.shape
    E, I = gate_up.shape[0], gate_up.shape[2] // 2
    k = topk_ids.shape[1]
    x = rows_contiguous(hidden_states)
    gather_index, group_offsets, scatter_index = fused._sort_tokens_impl(topk_ids, E)

    # 1. h = act(x[token] @ gate) * (x[token] @ up), rows in expert order: float32, or bf16 in a
    # bf16 block whose second GEMM multiplies bf16 (the matrix engine, the 4-bit or fp8 dot-product kernel;
    # a bf16 model's own expert block rounds h so too), written at half the bytes instead of
    # rounded in the packing.
    h_dtype = torch.float32
    if x.dtype == torch.bfloat16 and _multiplies_bf16(down, group_offsets, T * k):
        h_dtype = torch.bfloat16
    h = run_quant(x, gate_up, group_offsets, None, gather_index, gate_up_bias, h_dtype,
                  activation=fused.ACTIVATIONS[activation], up_offset=I, out_columns=I,
                  gather_matches_offsets=False)  # slots of experts elsewhere sort past the last group
    # 2. each row times its top-k weight, written to its (token, slot) place; then the slot sum.
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    per_slot = run_quant(h, down, group_offsets, None, None, down_bias, torch.float32,
                         scatter_index=scatter_index, row_weight=weights, out_rows=T * k)
    return per_slot.view(T, k, H).sum(dim=1).to(x.dtype)


_ENGINE_PLANS = _dispatch.MetadataTable()


def _multiplies_bf16(q: QuantizedExperts, group_offsets, rows: int) -> bool:
    """Whether the launcher plans q's GEMM over ``rows`` rows of bf16 A (float32 output) on a
    kernel that multiplies bf16 values (the matrix engine, the 4-bit and fp8 dot-product kernels). Planning
    reads no tensor values: empty tensors stand for A and the output. Kept per metadata, so a
    repeated call (a decode step's shapes) does not plan it again."""
    a_dtype = torch.bfloat16
    key = (q.format, q.shape, q.block, q.data.stride(), group_offsets.shape[0], group_offsets.device, rows)
    found = _ENGINE_PLANS.get(key)
    if found is not None:
        return found
    probe = torch.empty(0, q.shape[1], dtype=a_dtype, device=group_offsets.device)
    out = torch.empty(0, q.shape[2], dtype=torch.float32, device=group_offsets.device)
    args = quant_args(probe, q, group_offsets, None, None, None, out)
    args.a_rows = args.out_rows = rows
    plan = _runtime.sycl_module().plan_gemm(args) if rows > 0 else None
    bf16_kernel = plan is not None and ("nibble_dot" in plan.kernel_name or "fp8_dot" in plan.kernel_name)
    return _ENGINE_PLANS.keep(key, plan is not None and (plan.matrix_engine or bf16_kernel))


def _fused_reference(hidden_states, gate_up: QuantizedExperts, down: QuantizedExperts, topk_weights, topk_ids,
                     activation, gate_up_bias, down_bias):
    """The plain-PyTorch path: the float fused MoE on the dequantized weights."""
    w1 = gate_up.dequantize(torch.float32).transpose(1, 2)  # [E, 2I, H]
    w2 = down.dequantize(torch.float32).transpose(1, 2)  # [E, H, I]
    return torch_fallback.fused_moe(hidden_states, w1, w2, topk_weights, topk_ids, activation, gate_up_bias,
                                    down_bias)


def _run_checked(hidden_states, gate_up, down, topk_weights, topk_ids, activation, gate_up_bias, down_bias):
    args = (hidden_states, gate_up, down, topk_weights, topk_ids, activation, gate_up_bias, down_bias)
    return fused.run_on_backend(args, _fused_reference, _fused_sycl)


@torch.library.custom_op("moe_xpu::fused_moe_quant", mutates_args=())
def _fused_moe_quant_op(
    hidden_states: torch.Tensor,
    gate_up_data: torch.Tensor,
    gate_up_scale: torch.Tensor,
    gate_up_zero: torch.Tensor | None,
    gate_up_format: str,
    gate_up_block: list[int],
    down_data: torch.Tensor,
    down_scale: torch.Tensor,
    down_zero: torch.Tensor | None,
    down_format: str,
    down_block: list[int],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    raise NotImplementedError(f"moe_xpu.fused_moe (quantized) has no implementation for device {hidden_states.device}")


def _op_impl(hidden_states, gate_up_data, gate_up_scale, gate_up_zero, gate_up_format, gate_up_block, down_data,
             down_scale, down_zero, down_format, down_block, topk_weights, topk_ids, activation="silu",
             gate_up_bias=None, down_bias=None):
    gate_up, down = _containers(hidden_states, gate_up_data, gate_up_scale, gate_up_zero, gate_up_format,
                                gate_up_block, down_data, down_scale, down_zero, down_format, down_block)
    args = (hidden_states, gate_up, down, topk_weights, topk_ids, activation, gate_up_bias, down_bias)
    fused.check_fused_moe_metadata(*args)
    return _run_checked(*args)


_dispatch.register_device_kernel(_fused_moe_quant_op, _op_impl)


@_fused_moe_quant_op.register_fake
def _fused_moe_quant_fake(hidden_states, gate_up_data, gate_up_scale, gate_up_zero, gate_up_format, gate_up_block,
                          down_data, down_scale, down_zero, down_format, down_block, topk_weights, topk_ids,
                          activation="silu", gate_up_bias=None, down_bias=None):
    gate_up, down = _containers(hidden_states, gate_up_data, gate_up_scale, gate_up_zero, gate_up_format,
                                gate_up_block, down_data, down_scale, down_zero, down_format, down_block)
    fused.check_fused_moe_metadata(hidden_states, gate_up, down, topk_weights, topk_ids, activation, gate_up_bias,
                                   down_bias)
    return torch.empty_like(hidden_states)


def op_arguments(hidden_states, gate_up: QuantizedExperts, down: QuantizedExperts, topk_weights, topk_ids,
                 activation="silu", gate_up_bias=None, down_bias=None) -> tuple:
    """The op's flat arguments for two containers."""
    return (hidden_states, gate_up.data, gate_up.scale, gate_up.zero, gate_up.format, list(gate_up.block),
            down.data, down.scale, down.zero, down.format, list(down.block), topk_weights, topk_ids, activation,
            gate_up_bias, down_bias)


def fused_moe_quantized(hidden_states, gate_up: QuantizedExperts, down: QuantizedExperts, topk_weights, topk_ids,
                        activation, gate_up_bias, down_bias) -> torch.Tensor:
    """fused_moe on checked arguments with quantized weights: direct when no torch machinery is
    active, else through the op."""
    tensors = (hidden_states, gate_up.data, gate_up.scale, gate_up.zero, down.data, down.scale, down.zero,
               topk_weights, topk_ids, gate_up_bias, down_bias)
    if _dispatch.direct_call_ok(*tensors):
        return _run_checked(hidden_states, gate_up, down, topk_weights, topk_ids, activation, gate_up_bias,
                            down_bias)
    return _fused_moe_quant_op(*op_arguments(hidden_states, gate_up, down, topk_weights, topk_ids, activation,
                                             gate_up_bias, down_bias))
