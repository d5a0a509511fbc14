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


# Holds the device kernels registered below for as long as the package is loaded (a Library
# deregisters what it registered when it is collected).
_KERNELS = torch.library.Library("moe_xpu", "IMPL")


def register_device_kernel(op, kernel, device_types=("cpu", "xpu")) -> None:
    """Registers ``kernel`` as the ``torch.library.custom_op`` ``op``'s implementation for tensors
    on ``device_types``, straight on the dispatcher. custom_op's own ``register_kernel`` wraps every
    call in Python (a dynamo guard, a look-up, the output aliasing check): about 8 us a call on a
    2-core Xeon, as much as the kernel of a small expert layer. The op keeps everything else that
    custom_op gives it: schema, fake implementation, autograd, opcheck. The kernels return fresh
    tensors, which the tests' opcheck verifies."""
    name = op._qualname.split("::", 1)[1]
    for device_type in device_types:
        _KERNELS.impl(name, kernel, torch._C._dispatch_key_for_device(device_type))

