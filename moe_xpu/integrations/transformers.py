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
"""

from __future__ import annotations

import torch

from moe_xpu import fused, ops

NAME = "moe_xpu"

# transformers' config.hidden_act names -> fused_moe activations
_FUSED_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


class UnsupportedExpertsLayout(NotImplementedError):
    """The experts module's layout is one moe_xpu cannot run correctly."""


def _hidden_act(module) -> str | None:
    config = getattr(module, "config", None)
    act = getattr(config, "hidden_act", None)
    return act if isinstance(act, str) else None


def _fused_activation(module) -> str | None:
    """fused_moe's activation when the module's layout is the standard one, else None."""
    from transformers.integrations.moe import _default_apply_gate

    standard = (
        getattr(module, "has_gate", False)
        and not getattr(module, "is_transposed", False)
        and getattr(module, "is_concatenated", True)
        and not getattr(module, "has_post_expert_norm", False)
        and getattr(type(module), "_apply_gate", _default_apply_gate) is _default_apply_gate
        and isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
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


def _unfused_forward(module, hidden_states, top_k_index, top_k_weights):
    """Two moe_gemm launches with the module's own gate or activation between them."""
    if getattr(module, "_is_expert_parallel", False):
        raise UnsupportedExpertsLayout(
            f"moe_xpu: expert parallelism is only supported for the standard experts layout, "
            f"not {type(module).__name__}'s"
        )
    sorted_tokens = fused.sort_tokens(top_k_index, module.num_experts)
    first_bias, down_bias = _biases(module)
    w1 = module.gate_up_proj if module.has_gate else module.up_proj
    b1 = w1 if module.is_transposed else w1.transpose(1, 2)  # [E, H, 2I or I]
    h = ops.moe_gemm(hidden_states, b1, sorted_tokens.group_offsets,
                     gather_index=sorted_tokens.gather_index, bias=first_bias)
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
    b2 = module.down_proj if module.is_transposed else module.down_proj.transpose(1, 2)  # [E, I, H]
    y = ops.moe_gemm(h, b2, sorted_tokens.group_offsets, bias=down_bias,
                     out_dtype=torch.float32 if hidden_states.dtype != torch.float32 else None)
    if getattr(module, "has_post_expert_norm", False):
        y = module.post_expert_norm(y.to(hidden_states.dtype)).float()
    return fused.weighted_slot_sum(y, sorted_tokens.scatter_index, top_k_weights, hidden_states.dtype)


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers experts-interface backend: (hidden [T, H], top_k_index, top_k_weights) -> [T, H]."""
    activation = _fused_activation(self)
    if activation is not None:
        gate_up_bias, down_bias = _biases(self)
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
