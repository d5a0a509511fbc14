"""moe_xpu: Mixture-of-Experts grouped GEMM in one SYCL kernel, for Intel GPUs (XPU) and the
SYCL CPU device, exposed as torch ops."""

from moe_xpu import _runtime  # noqa: F401  (prepares the SYCL environment first)
from moe_xpu.fused import SENTINEL_EXPERT, SortedTokens, fused_moe, sort_tokens
from moe_xpu.ops import MoeXpuInputError, moe_gemm
from moe_xpu.quant import QuantizedExperts, quantize_experts, quantize_per_token
from moe_xpu import fused_quant as _fused_quant  # noqa: F401  (registers moe_xpu::fused_moe_quant)
from moe_xpu import backward as _backward  # noqa: F401  (registers moe_gemm's autograd formula)
from moe_xpu._host_memory import release_gradient_buffers

__version__ = "0.1.0"
__all__ = ["moe_gemm", "fused_moe", "QuantizedExperts", "quantize_experts", "quantize_per_token", "sort_tokens", "SortedTokens", "SENTINEL_EXPERT", "MoeXpuInputError", "release_gradient_buffers",
           "__version__"]
