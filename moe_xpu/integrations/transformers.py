"""Hugging Face transformers integration: ``experts_implementation="moe_xpu"``.

    import moe_xpu.integrations.transformers as moe_xpu_hf
    moe_xpu_hf.register()
    model = AutoModelForCausalLM.from_config(config, experts_implementation="moe_xpu")

Expert modules decorated with transformers' ``@use_experts_implementation`` then run through
moe_xpu. The standard layout (``gate_up_proj`` [E, 2I, H] with gate rows first, ``down_proj``
[E, H, I], the default gate with a silu or gelu-tanh activation, optional biases) runs
``moe_xpu.fused_moe``. Other layouts (transposed weights, interleaved gate/up, a module's own
``_apply_gate``, non-gated experts, a post-expert norm: e.g. GPT-OSS) run the same two grouped GEMM
kernels with the module's own gate applied between them. What neither path can honour raises
an error at the first call, never a wrong answer.

``quantize_experts(model, format)`` replaces every experts module's weights by
``moe_xpu.QuantizedExperts`` in place and switches the model to this backend (the only one that
reads them): int8, int4, fp8 or MXFP4 weights, dequantized inside the kernels.
"""

from __future__ import annotations

import torch

from moe_xpu import fused, ops
from moe_xpu.quant import QuantizedExperts, quantize_experts as _quantize_weights

NAME = "moe_xpu"

# transformers' config.hidden_act names -> fused_moe activations
_FUSED_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


class UnsupportedExpertsLayout(NotImplementedError):
    """The experts module's layout is one moe_xpu cannot run correctly."""


def _hidden_act(module) -> str | None:
    config = getattr(module, "config", None)
    act = getattr(config, "hidden_act", None)
    return act if isinstance(act, str) else None


def _is_quantized(module) -> bool:
    return isinstance(getattr(module, "down_proj", None), QuantizedExperts)


def _fused_activation(module) -> str | None:
    """fused_moe's activation when the module's layout is the standard one, else None."""
    from transformers.integrations.moe import _default_apply_gate

    quantized = _is_quantized(module)  # QuantizedExperts stand for moe_gemm's b whatever the layout
    standard = (
        getattr(module, "has_gate", False)
        and (quantized or not getattr(module, "is_transposed", False))
        and getattr(module, "is_concatenated", True)
        and not getattr(module, "has_post_expert_norm", False)
        and getattr(type(module), "_apply_gate", _default_apply_gate) is _default_apply_gate
        and isinstance(getattr(module, "gate_up_proj", None), (torch.Tensor, QuantizedExperts))
    )
    return _FUSED_ACTIVATIONS.get(_hidden_act(module) or "") if standard else None


def _expert_ids(module, top_k_index: torch.Tensor) -> torch.Tensor:
    if getattr(module, "_is_expert_parallel", False):  # ids >= num_experts live on other ranks
        return torch.where(top_k_index >= module.num_experts, fused.SENTINEL_EXPERT, top_k_index)
    return top_k_index


def _biases(module):
    if not getattr(module, "has_bias", False):
        return None, None
    first = module.gate_up_proj_bias if getattr(module, "has_gate", True) else module.up_proj_bias
    return first, module.down_proj_bias


def _first_weight_name(module) -> str:
    return "gate_up_proj" if module.has_gate else "up_proj"


def _moe_gemm_weights(module):
    """The module's two weights as moe_gemm's b: [E, H, 2I or I] and [E, I, H]."""
    as_b = lambda w: w if module.is_transposed or isinstance(w, QuantizedExperts) else w.transpose(1, 2)  # noqa: E731
    return as_b(getattr(module, _first_weight_name(module))), as_b(module.down_proj)


def _unfused_forward(module, hidden_states, top_k_index, top_k_weights):
    """Two moe_gemm launches with the module's own gate or activation between them."""
    if getattr(module, "_is_expert_parallel", False):
        raise UnsupportedExpertsLayout(
            f"moe_xpu: expert parallelism is only supported for the standard experts layout, "
            f"not {type(module).__name__}'s"
        )
    sorted_tokens = fused.sort_tokens(top_k_index, module.num_experts)
    first_bias, down_bias = _biases(module)
    b1, b2 = _moe_gemm_weights(module)  # [E, H, 2I or I], [E, I, H]
    h = ops.moe_gemm(hidden_states, b1, sorted_tokens.group_offsets,
                     gather_index=sorted_tokens.gather_index, bias=first_bias)
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
    y = ops.moe_gemm(h, b2, sorted_tokens.group_offsets, bias=down_bias,
                     out_dtype=torch.float32 if hidden_states.dtype != torch.float32 else None)
    if getattr(module, "has_post_expert_norm", False):
        y = module.post_expert_norm(y.to(hidden_states.dtype)).float()
    return fused.weighted_slot_sum(y, sorted_tokens.scatter_index, top_k_weights, hidden_states.dtype)


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers experts-interface backend: (hidden [T, H], top_k_index, top_k_weights) -> [T, H]."""
    activation = _fused_activation(self)
    sharded = getattr(self, "_moe_xpu_expert_parallel", None)
    if sharded is not None:
        return _expert_parallel_forward(self, sharded, activation, hidden_states, top_k_index, top_k_weights)
    if activation is not None:
        gate_up_bias, down_bias = _biases(self)
        if _is_quantized(self):
            return fused.fused_moe(hidden_states, self.gate_up_proj, self.down_proj, top_k_weights,
                                   _expert_ids(self, top_k_index), activation=activation,
                                   gate_up_bias=gate_up_bias, down_bias=down_bias)
        return fused.fused_moe(hidden_states, self.gate_up_proj, self.down_proj, top_k_weights,
                               _expert_ids(self, top_k_index), activation=activation,
                               gate_up_bias=gate_up_bias, down_bias=down_bias)
    if not all(hasattr(self, name) for name in ("has_gate", "is_transposed", "down_proj", "num_experts")):
        raise UnsupportedExpertsLayout(
            f"moe_xpu: {type(self).__name__} does not follow transformers' experts interface "
            f"(@use_experts_implementation)"
        )
    return _unfused_forward(self, hidden_states, top_k_index, top_k_weights)


def register(name: str = NAME) -> None:
    """Registers moe_xpu in transformers' experts interface under ``name``."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(name, experts_forward)


def _experts_modules(model: torch.nn.Module):
    """Modules following transformers' experts interface (@use_experts_implementation)."""
    for name, module in model.named_modules():
        if all(hasattr(module, attr) for attr in ("has_gate", "is_transposed", "num_experts", "down_proj")):
            yield name, module


def quantize_experts(model: torch.nn.Module, format: str, *, group_size: int = 128, zero_point: bool = False,
                     block_size: tuple[int, int] | None = (128, 128)) -> int:
    """Converts, in place, the weights of every experts module of ``model`` (GPT-OSS included) to
    ``moe_xpu.QuantizedExperts`` of ``format`` ("int8", "int4", "fp8", "mxfp4"; keywords as
    ``moe_xpu.quantize_experts``), registers this backend and sets it as the model's experts
    implementation. Returns the number of modules converted.

    The quantized weights replace the modules' parameters (they are no longer parameters: not in
    ``state_dict``, not moved by ``model.to``: move or load the model first, quantize last)."""
    modules = list(_experts_modules(model))
    if not modules:
        raise UnsupportedExpertsLayout(f"moe_xpu: {type(model).__name__} has no experts module following "
                                       f"transformers' experts interface (@use_experts_implementation)")
    kwargs = dict(group_size=group_size, zero_point=zero_point, block_size=block_size)
    converted = []
    for name, module in modules:  # quantize everything first: an error leaves the model untouched
        if _is_quantized(module):
            continue
        b1, b2 = _moe_gemm_weights(module)
        converted.append((module, _quantize_weights(b1, format, **kwargs), _quantize_weights(b2, format, **kwargs)))
    for module, q1, q2 in converted:
        for attr, q in ((_first_weight_name(module), q1), ("down_proj", q2)):
            module._parameters.pop(attr, None)
            setattr(module, attr, q)
    register()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(NAME)
    else:
        for _, module in modules:
            module.config._experts_implementation = NAME
    return len(converted)


def _expert_parallel_forward(module, sharded, activation, hidden_states, top_k_index, top_k_weights):
    from moe_xpu.distributed import expert_parallel_fused_moe

    placement, group = sharded
    gate_up_bias, down_bias = _biases(module)
    return expert_parallel_fused_moe(hidden_states, module.gate_up_proj, module.down_proj, top_k_weights,
                                     top_k_index, placement, group=group, activation=activation,
                                     gate_up_bias=gate_up_bias, down_bias=down_bias)


def shard_experts(model: torch.nn.Module, group=None, placement=None) -> int:
    """Expert parallelism: keeps in every experts module of ``model`` only this rank's experts
    (``placement``, an ``ExpertPlacement``; contiguous shares of the group's ranks by default) and
    runs its MoE with ``moe_xpu.distributed.expert_parallel_fused_moe``: each rank routes its own
    tokens (data-parallel attention, expert-parallel experts), token rows cross to the ranks
    holding their experts and come back. Every rank of ``group`` must run the same number of
    forward passes. Registers this backend and sets it as the model's experts implementation.
    The standard experts layout only (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3). Returns the
    number of modules sharded."""
    import torch.distributed as dist

    from moe_xpu.distributed import ExpertPlacement

    modules = list(_experts_modules(model))
    if not modules:
        raise UnsupportedExpertsLayout(f"moe_xpu: {type(model).__name__} has no experts module following "
                                       f"transformers' experts interface (@use_experts_implementation)")
    for name, module in modules:
        if _fused_activation(module) is None or _is_quantized(module):
            raise UnsupportedExpertsLayout(f"moe_xpu: expert parallelism needs the standard float experts layout; "
                                           f"{name} ({type(module).__name__}) is not")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    for _, module in modules:
        E = module.gate_up_proj.shape[0]
        owner = placement if placement is not None else ExpertPlacement.contiguous(E, world)
        mine = owner.local_experts(rank)
        for attr in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
            w = getattr(module, attr, None)
            if isinstance(w, torch.Tensor):
                setattr(module, attr, torch.nn.Parameter(w.detach()[mine].clone(), requires_grad=w.requires_grad))
        module._moe_xpu_expert_parallel = (owner, group)
    register()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(NAME)
    return len(modules)
