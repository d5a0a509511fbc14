"""Intel Extension for PyTorch (IPEX 2.8) integration: run IPEX's MoE layers on moe_xpu.

    import moe_xpu.integrations.ipex as moe_xpu_ipex
    moe_xpu_ipex.enable()            # or: with moe_xpu_ipex.enabled(): ...
    model = ipex.llm.optimize(model, dtype=torch.float32)   # before or after enable()
    model.generate(...)              # its MoE layers now run moe_xpu.fused_moe
    moe_xpu_ipex.disable()           # IPEX's own kernels again, bitwise as before

``enable()`` routes three things through moe_xpu, and ``disable()`` puts IPEX's own back:

- ``torch.xpu.moe_gemm`` (and ``intel_extension_for_pytorch.xpu.intrinsic.moe_gemm`` where the
  XPU build has it): IPEX's grouped GEMM on tokens already in expert order, here ``moe_gemm``
  below, one launch whatever the number of experts, no host synchronisation;
- ``ipex.llm.modules.GatedMLPMOE``: routing (softmax or grouped top-k, as IPEX computes it) and then
  ``fused_moe`` on the module's own ``W13``/``W2`` (``W3``), tokens read through the index table
  instead of being scattered into expert order;
- the MoE layers of ``ipex.llm.optimize``d Mixtral, Qwen3-MoE and DeepSeek-V2/V3 models: IPEX's
  own routing, then ``fused_moe`` on the expert weights in their plain layout (read back once
  from IPEX's prepacked ones and kept while enabled: one more copy of the experts' weights).

What moe_xpu does not run (scaled fp8 GEMMs, weight-only-quantized or fused bf16 expert stacks,
DeepSpeed tensor parallelism, a dtype mismatch) stays on IPEX's path, with one warning per
reason saying why.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from typing import Callable

import torch

from moe_xpu import fused, ops

__all__ = ["moe_gemm", "enable", "disable", "enabled", "is_enabled", "UnsupportedByMoeXpu"]


class UnsupportedByMoeXpu(NotImplementedError):
    """An IPEX MoE call that moe_xpu does not run; the message says why."""


def _counts_to_offsets(rows_for_experts: torch.Tensor, n_experts: int, rows: int) -> torch.Tensor:
    if not isinstance(rows_for_experts, torch.Tensor) or rows_for_experts.dim() != 1:
        raise ops.MoeXpuInputError(
            f"rows_for_experts must be a 1-D tensor of per-expert row counts, got "
            f"{getattr(rows_for_experts, 'shape', type(rows_for_experts).__name__)}")
    if rows_for_experts.dtype not in ops.INDEX_DTYPES:
        raise ops.MoeXpuInputError(f"rows_for_experts must be int32 or int64, got {rows_for_experts.dtype}")
    if rows_for_experts.numel() < n_experts:
        raise ops.MoeXpuInputError(
            f"rows_for_experts must have at least n_experts = {n_experts} entries (it may be padded "
            f"past them), got {rows_for_experts.numel()}")
    counts = rows_for_experts[:n_experts]
    if counts.device.type == "cpu":  # free to read on the host; on XPU the kernel's checks apply
        if n_experts and int(counts.min()) < 0:
            raise ops.MoeXpuInputError(f"rows_for_experts must be non-negative, found {int(counts.min())}")
        total = int(counts.sum())
        if total > rows:
            raise ops.MoeXpuInputError(
                f"rows_for_experts sums to {total} over the first {n_experts} experts, more than the "
                f"{rows} rows of matrix_a")
    return counts.cumsum(0, dtype=torch.int32)


def _bind_moe_gemm_arguments(rows_for_experts_cpu, n_experts, matrix_a_scale_inv, matrix_b_scale_inv):
    """IPEX 2.8.10's signature has ``rows_for_experts_cpu`` before ``n_experts``; the later one
    drops it. A positional int in the fourth place is therefore ``n_experts``."""
    if rows_for_experts_cpu is not None and not isinstance(rows_for_experts_cpu, torch.Tensor):
        if matrix_b_scale_inv is not None:
            raise ops.MoeXpuInputError("moe_gemm takes at most 6 arguments without rows_for_experts_cpu")
        return rows_for_experts_cpu, n_experts, matrix_a_scale_inv
    return n_experts, matrix_a_scale_inv, matrix_b_scale_inv


def moe_gemm(
    matrix_a: torch.Tensor,
    matrix_b: torch.Tensor,
    rows_for_experts: torch.Tensor,
    rows_for_experts_cpu: torch.Tensor | int | None = None,
    n_experts: int | None = None,
    matrix_a_scale_inv: torch.Tensor | None = None,
    matrix_b_scale_inv: torch.Tensor | None = None,
) -> torch.Tensor:
    """IPEX's ``torch.xpu.moe_gemm`` on moe_xpu's kernel.

    Both IPEX signatures: ``moe_gemm(a, b, rows_for_experts, rows_for_experts_cpu, n_experts)``
    (IPEX 2.8.10) and ``moe_gemm(a, b, rows_for_experts, n_experts)`` (its later one).
    ``matrix_a`` [sum M, K] holds the rows of expert 0, then expert 1, ...; ``matrix_b``
    [E, K, N]; ``rows_for_experts`` int32/int64 per-expert row counts, on a's device, possibly
    padded past ``n_experts`` (IPEX pads it to a multiple of 8). ``rows_for_experts_cpu`` is
    accepted and never read: the offsets are a cumulative sum on the device, no host
    synchronisation. Returns [sum M, N] in a's dtype; rows past the counted ones are zero.
    fp8 scales (``matrix_*_scale_inv``) are not supported: ``UnsupportedByMoeXpu``.
    """
    n_experts, a_scale, b_scale = _bind_moe_gemm_arguments(
        rows_for_experts_cpu, n_experts, matrix_a_scale_inv, matrix_b_scale_inv)
    if a_scale is not None or b_scale is not None:
        raise UnsupportedByMoeXpu("moe_xpu's moe_gemm has no fp8 path: matrix_a_scale_inv and "
                                  "matrix_b_scale_inv must be None")
    if not isinstance(matrix_b, torch.Tensor) or matrix_b.dim() != 3:
        raise ops.MoeXpuInputError(f"matrix_b must be 3-D [E, K, N], got {getattr(matrix_b, 'shape', matrix_b)}")
    if n_experts is None:
        n_experts = matrix_b.shape[0]
    if isinstance(n_experts, bool) or not isinstance(n_experts, int) or n_experts != matrix_b.shape[0]:
        raise ops.MoeXpuInputError(f"n_experts must be an int equal to matrix_b.shape[0] = {matrix_b.shape[0]}, "
                                   f"got {n_experts!r}")
    if not isinstance(matrix_a, torch.Tensor) or matrix_a.dim() != 2:
        raise ops.MoeXpuInputError(f"matrix_a must be 2-D [rows, K], got {getattr(matrix_a, 'shape', matrix_a)}")
    offsets = _counts_to_offsets(rows_for_experts, n_experts, matrix_a.shape[0])
    return ops.moe_gemm(matrix_a, matrix_b, offsets)


# --- routing, as IPEX's GatedMLPMOE computes it -------------------------------------------------

def _select_experts(hidden_states, router_logits, top_k, renormalize, use_grouped_topk, topk_group,
                    num_expert_group, custom_routing_function, scoring_func, e_score_correction_bias):
    """(topk_weights, topk_ids) for GatedMLPMOE's arguments, in IPEX's order of operations."""
    if use_grouped_topk:
        if topk_group is None or num_expert_group is None:
            raise ops.MoeXpuInputError("use_grouped_topk needs topk_group and num_expert_group")
        if scoring_func == "softmax":
            scores = torch.softmax(router_logits, dim=-1)
        elif scoring_func == "sigmoid":
            scores = router_logits.sigmoid()
        else:
            raise ops.MoeXpuInputError(f"scoring_func must be 'softmax' or 'sigmoid', got {scoring_func!r}")
        if e_score_correction_bias is not None:
            scores = scores + e_score_correction_bias.unsqueeze(0)
        tokens = scores.shape[0]
        group_best = scores.view(tokens, num_expert_group, -1).max(dim=-1).values
        chosen_groups = torch.topk(group_best, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_best).scatter_(1, chosen_groups, 1).bool()
        per_group = scores.shape[-1] // num_expert_group
        expert_mask = group_mask.unsqueeze(-1).expand(tokens, num_expert_group, per_group).reshape(tokens, -1)
        weights, ids = torch.topk(scores.masked_fill(~expert_mask, 0.0), k=top_k, dim=-1, sorted=False)
    elif custom_routing_function is None:
        if scoring_func != "softmax":
            raise ops.MoeXpuInputError(f"scoring_func must be 'softmax' without grouped top-k, got {scoring_func!r}")
        weights, ids = torch.topk(torch.softmax(router_logits, dim=1, dtype=torch.float32), top_k, dim=-1)
    else:
        return custom_routing_function(hidden_states=hidden_states, gating_output=router_logits, topk=top_k,
                                       renormalize=renormalize)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


# --- where the experts' weights come from -------------------------------------------------------

def _plain_linear_weight(linear: torch.nn.Module) -> torch.Tensor:
    """The [out, in] weight of an nn.Linear or of IPEX's prepacked replacement for it."""
    weight = getattr(linear, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise UnsupportedByMoeXpu(f"{type(linear).__name__} holds no float weight (weight-only quantized?)")
    plain = weight.detach()
    if getattr(weight, "is_blocked", lambda: False)():  # TPP's blocked (VNNI) layout
        plain = weight.blocking_manager.unblock(plain).to(weight.unblocked_dtype)
    elif getattr(linear, "ctx", None) is not None and hasattr(linear.ctx, "to_public"):  # oneDNN / MKL
        plain = linear.ctx.to_public(plain)
    expected = (getattr(linear, "out_features", None), getattr(linear, "in_features", None))
    if tuple(plain.shape) != expected or not plain.is_floating_point():
        raise UnsupportedByMoeXpu(f"the weight of {type(linear).__name__} could not be read back in its "
                                  f"plain [out, in] = {list(expected)} layout")
    return plain


def _stack_experts(experts, gate: str, up: str, down: str):
    """gate_up_proj [E, 2I, H] (gate rows first) and down_proj [E, H, I] from per-expert linears."""
    gate_up, down_weights = [], []
    for expert in experts:
        if not all(hasattr(expert, name) for name in (gate, up, down)):
            raise UnsupportedByMoeXpu(
                f"{type(expert).__name__} has no {gate}/{up}/{down} linears (IPEX fused them into one "
                f"prepacked expert stack, e.g. use_fused_moe)")
        if not isinstance(getattr(expert, "act_fn", torch.nn.SiLU()), torch.nn.SiLU):
            raise UnsupportedByMoeXpu(f"the experts' activation is {type(expert.act_fn).__name__}, not SiLU")
        gate_up.append(torch.cat([_plain_linear_weight(getattr(expert, gate)),
                                  _plain_linear_weight(getattr(expert, up))]))
        down_weights.append(_plain_linear_weight(getattr(expert, down)))
    return torch.stack(gate_up), torch.stack(down_weights)


_LAYOUTS = {  # IPEX's model_backbone -> (path to the MoE block, gate, up, down linear names)
    "MixtralForCausalLM": ("block_sparse_moe", "w1", "w3", "w2"),
    "Qwen3MoeForCausalLM": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "DeepseekV2ForCausalLM": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "DeepseekV3ForCausalLM": ("mlp", "gate_proj", "up_proj", "down_proj"),
}


def _read_layer_experts(layer):
    if getattr(layer, "distributed", False):
        raise UnsupportedByMoeXpu("the layer is tensor-parallel (DeepSpeed): IPEX all-reduces inside its MoE op")
    if getattr(layer, "unify_experts", False) and (getattr(layer, "use_fused_moe", False)
                                                   or getattr(layer, "use_fused_moe_woq", False)):
        raise UnsupportedByMoeXpu("IPEX fused the shared expert into the routed ones (unify_experts)")
    block, gate, up, down = _LAYOUTS[layer.model_backbone]
    return _stack_experts(getattr(layer, block).experts, gate, up, down)


def _read_gated_mlp_weights(module):
    if module.W3 is not None:
        return torch.cat([module.W13, module.W3], dim=1), module.W2
    return module.W13, module.W2


# --- state: what is patched, the weights read back, the warnings given ---------------------------

_lock = threading.RLock()
_originals: dict[str, tuple[object, str, object]] = {}  # key -> (owner, attribute, original value)
_weights: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()
_warned: set[str] = set()
_MISSING = object()


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"moe_xpu: staying on IPEX's own path: {reason}", RuntimeWarning, stacklevel=3)


def _experts_of(module, read: Callable, dtype: torch.dtype):
    """The module's (gate_up_proj, down_proj), read once while enabled, or None after warning why
    moe_xpu cannot run it."""
    found = _weights.get(module)
    if found is None:
        try:
            found = read(module)
        except UnsupportedByMoeXpu as reason:
            found = str(reason)
        _weights[module] = found
    if isinstance(found, str):
        _warn_once(found)
        return None
    if found[0].dtype != dtype:
        _warn_once(f"expert weights are {found[0].dtype} but the hidden states are {dtype}")
        return None
    return found


def _original(key: str):
    return _originals[key][2]


def _routed_moe_gemm(*args, **kwargs):
    """``torch.xpu.moe_gemm`` while enabled: moe_xpu, or IPEX's own for what moe_xpu lacks."""
    try:
        return moe_gemm(*args, **kwargs)
    except UnsupportedByMoeXpu as reason:
        original = _original("torch.xpu.moe_gemm")
        if original is _MISSING:
            raise
        _warn_once(str(reason))
        return original(*args, **kwargs)


def _gated_mlp_moe_forward(self, hidden_states, use_grouped_topk, top_k, router_logits, renormalize,
                           topk_group=None, num_expert_group=None, custom_routing_function=None,
                           scoring_func="softmax", e_score_correction_bias=None):
    experts = _experts_of(self, _read_gated_mlp_weights, hidden_states.dtype)
    if experts is None:
        return _original("GatedMLPMOE.forward")(
            self, hidden_states, use_grouped_topk, top_k, router_logits, renormalize, topk_group,
            num_expert_group, custom_routing_function, scoring_func, e_score_correction_bias)
    weights, ids = _select_experts(hidden_states, router_logits, top_k, renormalize, use_grouped_topk,
                                   topk_group, num_expert_group, custom_routing_function, scoring_func,
                                   e_score_correction_bias)
    # IPEX rounds the routing weights to the hidden states' dtype before using them.
    return fused.fused_moe(hidden_states, experts[0], experts[1], weights.to(hidden_states.dtype), ids)


def _moe_infer(self, x, topk_ids, topk_weight):
    """IPEX's routed-experts step of Qwen3-MoE and DeepSeek-V2/V3 layers."""
    experts = _experts_of(self, _read_layer_experts, x.dtype)
    if experts is None:
        return _original("moe_infer")(self, x, topk_ids, topk_weight)
    return fused.fused_moe(x, experts[0], experts[1], topk_weight.to(x.dtype), topk_ids)


def _mixtral_decoder_layer_forward(self, hidden_states, attention_mask=None, position_ids=None,
                                   past_key_value=None, output_attentions=False, output_router_logits=False,
                                   use_cache=False, **kwargs):
    """IPEX's Mixtral decoder layer (attention as IPEX runs it) with its per-expert loop replaced
    by fused_moe; same routing, same outputs tuple."""
    experts = _experts_of(self, _read_layer_experts, hidden_states.dtype)
    if experts is None:
        return _original("MixtralDecoderLayer_forward")(
            self, hidden_states, attention_mask, position_ids, past_key_value, output_attentions,
            output_router_logits, use_cache, **kwargs)
    residual = hidden_states
    hidden_states, self_attn_weights, present_key_value = self.self_attn(
        hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
        position_ids=position_ids, past_key_value=past_key_value, output_attentions=output_attentions,
        use_cache=use_cache)
    hidden_states = self.mha_linear_add(hidden_states, residual)
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
    shape = hidden_states.shape
    tokens = hidden_states.view(-1, shape[-1])
    moe = self.block_sparse_moe
    weights, ids = torch.topk(torch.softmax(moe.gate(tokens), dim=1, dtype=torch.float32), moe.top_k, dim=-1)
    weights = (weights / weights.sum(dim=-1, keepdim=True)).to(tokens.dtype)
    hidden_states = residual + fused.fused_moe(tokens, experts[0], experts[1], weights, ids).view(shape)
    outputs = (hidden_states,)
    if output_attentions:
        outputs += (self_attn_weights,)
    if use_cache:
        outputs += (present_key_value,)
    return outputs


def _patch_points():
    """(key, owner, attribute, replacement) for everything enable() patches."""
    import intel_extension_for_pytorch as ipex  # noqa: F401  (sets torch.xpu.moe_gemm on XPU builds)
    from intel_extension_for_pytorch.llm.modules import GatedMLPMOE
    from intel_extension_for_pytorch.transformers.models.reference.modules import decoder

    points = [("torch.xpu.moe_gemm", torch.xpu, "moe_gemm", _routed_moe_gemm),
              ("GatedMLPMOE.forward", GatedMLPMOE, "forward", _gated_mlp_moe_forward),
              ("moe_infer", decoder, "moe_infer", _moe_infer),
              ("MixtralDecoderLayer_forward", decoder, "MixtralDecoderLayer_forward",
               _mixtral_decoder_layer_forward)]
    try:
        from intel_extension_for_pytorch.xpu import intrinsic
    except ImportError:  # the CPU build has no XPU intrinsics
        pass
    else:
        points.append(("intrinsic.moe_gemm", intrinsic, "moe_gemm", _routed_moe_gemm))
    return points


def enable() -> None:
    """Routes IPEX's MoE entry points through moe_xpu (calling it again changes nothing)."""
    with _lock:
        if _originals:
            return
        for key, owner, attribute, replacement in _patch_points():
            _originals[key] = (owner, attribute, getattr(owner, attribute, _MISSING))
            setattr(owner, attribute, replacement)


def disable() -> None:
    """Restores IPEX's own entry points and drops the expert weights read back for moe_xpu."""
    with _lock:
        for owner, attribute, original in _originals.values():
            if original is _MISSING:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, original)
        _originals.clear()
        _weights.clear()


def is_enabled() -> bool:
    return bool(_originals)


@contextlib.contextmanager
def enabled():
    """``with enabled(): ...``: IPEX's MoE layers run on moe_xpu inside the block; afterwards the
    state before it (enabled or not) is back."""
    was_enabled = is_enabled()
    enable()
    try:
        yield
    finally:
        if not was_enabled:
            disable()
