"""``python -m moe_xpu.bench ipex``: fused_moe beside Intel Extension for PyTorch's CPU MoE paths.

Run in an environment with IPEX 2.8 (``make bench-ipex``). For each of the bench's moe cases and
dtypes, on the same weights, routing and hidden states, timed round-robin:

- ``moe_xpu fused``: ``moe_xpu.fused_moe`` (routing given);
- ``IPEX GatedMLPMOE prepacked`` / ``IPEX GatedMLPMOE``: ``ipex.llm.modules.GatedMLPMOE`` with
  and without weight prepacking (its forward routes from the router logits: softmax, top-k,
  renormalise; then a loop over experts of ``torch_ipex.mixtral_moe*``);
- ``moe_xpu in GatedMLPMOE``: the same module call routed to moe_xpu
  (``moe_xpu.integrations.ipex.enabled()``), routing included;
- ``IPEX deepseek_moe (<kernel>)``: the op ``ipex.llm.optimize``'s Qwen3-MoE and DeepSeek layers
  call, on the prepacked expert linears, with the kernel IPEX picked for them (oneDNN, MKL or TPP);
- ``IPEX fused_experts``: the op of those layers with ``use_fused_moe`` (bf16, VNNI-packed).

A path IPEX refuses on this CPU (bf16 prepacking and ``fused_experts`` need AVX-512) is left out
with IPEX's reason.
"""

from __future__ import annotations

from typing import Callable

import torch

import moe_xpu
from moe_xpu.bench import Ceilings, MoeCase, Row, median_times


def _deepseek_moe(module, x, ids, weights) -> tuple[str, Callable[[], torch.Tensor]]:
    """IPEX's deepseek_moe* call on a prepacked GatedMLPMOE's expert linears, chosen as IPEX's
    own CPU decoder layer chooses it (its moe_linear_type)."""
    experts = module.linear_fusion.linear_module_list  # per expert: gate, down, up
    gate, down, up = ([e[i] for e in experts] for i in range(3))
    first = gate[0]
    ids64, w = ids.to(torch.int64), weights.to(x.dtype)
    ops = torch.ops.torch_ipex
    if getattr(first, "use_tpp", False) and not first.tpp_fallback:
        ws = [[m.weight for m in ms] for ms in (gate, up, down)]
        return "TPP", lambda: ops.deepseek_moe_tpp(x, ids64, *ws, False, w, False)
    if hasattr(first, "use_dnnl"):
        op, name = (ops.deepseek_moe, "oneDNN") if first.use_dnnl else (ops.deepseek_moe_mkl, "MKL")
        args = [t for ms in (gate, up, down) for t in ([m._get_forward_weight() for m in ms], [m.ctx for m in ms])]
        return name, lambda: op(x, ids64, *args, w, False)
    raise RuntimeError(f"IPEX kept plain {type(first).__name__} expert linears (no prepacked kernel)")


def _candidates(gate_up, down, x, logits, weights, ids, top_k):
    """Name -> a builder returning the timed call; a builder raises when IPEX refuses the path."""
    from intel_extension_for_pytorch.llm.modules import GatedMLPMOE

    from moe_xpu.integrations import ipex as moe_xpu_ipex

    modules: dict[bool, GatedMLPMOE] = {}

    def gated_module(prepack: bool) -> GatedMLPMOE:
        """One module per prepacking choice, shared by the rows that time it (prepacking copies
        every expert's weights once)."""
        if prepack not in modules:
            module = GatedMLPMOE(gate_up, down, use_prepack=prepack)
            module(x, False, top_k, logits, True)  # IPEX builds (and prepacks) on the first call
            modules[prepack] = module
        return modules[prepack]

    def gated(prepack: bool):
        def build():
            module = gated_module(prepack)
            return lambda: module(x, False, top_k, logits, True)
        return build

    def swapped():
        module = GatedMLPMOE(gate_up, down, use_prepack=False)

        def run():
            with moe_xpu_ipex.enabled():
                return module(x, False, top_k, logits, True)
        return run

    def deepseek():
        kernel, run = _deepseek_moe(gated_module(True), x, ids, weights)
        run()
        return kernel, run

    def fused_experts():
        if x.dtype != torch.bfloat16:
            raise RuntimeError("IPEX's fused_experts takes bfloat16 (or weight-only quantized) experts")
        w13, w2 = torch.ops.torch_ipex.convert_weight_packed_moe_bf16(gate_up, down)
        w, i = weights.float(), ids.to(torch.int32)

        def run():
            return torch.ops.torch_ipex.fused_experts(x, w13, w2, w, i, False, True, False, False, 0, 0, 0,
                                                      None, None, None, None, None, None)
        run()
        return run

    return {"IPEX GatedMLPMOE prepacked": gated(True), "IPEX GatedMLPMOE": gated(False),
            "moe_xpu in GatedMLPMOE": swapped, "IPEX deepseek_moe": deepseek, "IPEX fused_experts": fused_experts}


def bench_ipex(cases: list[MoeCase], dtypes, ceilings: Ceilings, repeats: int,
               flush: Callable[[], None] | None = None) -> list[Row]:
    rows: list[Row] = []
    refused: set[str] = set()
    gen = torch.Generator().manual_seed(0)
    for case in cases:
        logits = torch.randn(case.tokens, case.experts, generator=gen)
        weights, ids = logits.softmax(-1).topk(case.top_k, dim=1)
        weights = weights / weights.sum(-1, keepdim=True)  # GatedMLPMOE's renormalize=True
        touched = int(ids.unique().numel())
        for dtype in dtypes:
            gate_up = (torch.randn(case.experts, 2 * case.I, case.H, generator=gen) * 0.02).to(dtype)
            down = (torch.randn(case.experts, case.H, case.I, generator=gen) * 0.02).to(dtype)
            x = torch.randn(case.tokens, case.H, generator=gen).to(dtype)
            w = weights.to(dtype)
            impls = {"moe_xpu fused": lambda: moe_xpu.fused_moe(x, gate_up, down, w, ids)}
            with torch.no_grad():
                for name, build in _candidates(gate_up, down, x, logits, weights, ids, case.top_k).items():
                    try:
                        built = build()
                    except (RuntimeError, AssertionError) as error:
                        reason = f"{name} ({str(dtype).removeprefix('torch.')}): {str(error).splitlines()[0][:160]}"
                        if reason not in refused:
                            refused.add(reason)
                            print(f"note: left out {reason}")
                        continue
                    if isinstance(built, tuple):
                        kernel, built = built
                        name = f"{name} ({kernel})"
                    impls[name] = built
                times = median_times(impls, repeats, flush)
            esize = x.element_size()
            flops = 6 * case.tokens * case.top_k * case.H * case.I
            bytes_read = touched * 3 * case.H * case.I * esize + case.tokens * case.H * esize
            roofline_s = ceilings.roofline_seconds(flops, bytes_read, str(dtype).removeprefix("torch."))
            for name, t in times.items():
                rows.append(Row(case.name, str(dtype).removeprefix("torch."), name, t, flops / t / 1e9,
                                100 * roofline_s / t, t / times["moe_xpu fused"]))
    return rows
