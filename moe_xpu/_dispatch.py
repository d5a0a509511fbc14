"""When an eager call may skip torch's dispatcher.

moe_xpu's ops are registered with ``torch.library`` so that torch.compile, fake tensors, opcheck,
functorch and autograd see them as ops. Going through the dispatcher costs a Python custom op
10-25 us a call, more than a small MoE layer's GEMM. A call that needs none of that machinery
(plain tensors, no active mode or transform, no gradient to record, not being traced) runs the
implementation the dispatcher would pick, directly; everything else takes the op.
"""

from __future__ import annotations

import torch

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def direct_call_ok(*tensors: torch.Tensor | None) -> bool:
    if (torch.compiler.is_compiling()
            or torch._C._len_torch_dispatch_stack()  # fake tensors, FlopCounter, make_fx, ...
            or torch._C._len_torch_function_stack()  # TorchFunctionMode
            or torch._C._functorch.peek_interpreter_stack() is not None  # vmap, grad, jvp
            or torch._C._get_tracing_state() is not None):  # torch.jit.trace
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if type(t) not in _PLAIN or (grad and t.requires_grad):
            return False
    return True


def metadata(t):
    """What a call's checks and plan read of one tensor argument (None stays None): the key piece of
    a MetadataTable."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


class MetadataTable(dict):
    """What a call's metadata (shapes, strides, dtypes, devices) settles, kept per metadata so that
    a repeated call is neither re-checked nor re-planned. Past ``limit`` distinct keys the table
    starts over, so shapes that never repeat cannot grow it without bound; lookups are dict.get."""

    def __init__(self, limit: int = 512):
        super().__init__()
        self.limit = limit

    def keep(self, key, value):
        """Stores ``value`` under ``key`` (first one wins) and returns what is stored."""
        if len(self) >= self.limit:
            self.clear()
        return self.setdefault(key, value)
