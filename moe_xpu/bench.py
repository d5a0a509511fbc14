"""python -m moe_xpu.bench {gemm,moe,skew,small,ipex}: moe_xpu beside its peers, in one process, on the same inputs.

gemm: moe_gemm beside F.grouped_mm and a per-expert loop of torch.mm.
moe:  fused_moe beside transformers' eager and grouped_mm experts backends (a MixtralExperts
      module) and an unfused moe_xpu pipeline (copy tokens into expert order, moe_gemm,
      activation, moe_gemm, weighted sum).
skew: moe_gemm and fused_moe with Zipf-skewed expert popularity beside uniform routing (same
      rows, same touched experts), timed round-robin: the zipf / uniform time ratio.
small: the per-call cost at small shapes (warm cache, median of --repeats, default 300):
      moe_gemm beside F.grouped_mm, with the host time beyond the kernel and the runtime's
      floor (an empty kernel's launch); 64 rows per expert at K = 128 through an index table
      (gathered in the kernel) beside index_select then moe_gemm or grouped_mm; fused_moe beside
      transformers' backends on small layers (the demo model's among them).
ipex: fused_moe beside Intel Extension for PyTorch's CPU MoE paths on the moe cases (in an
      environment with IPEX 2.8: make bench-ipex; see moe_xpu/bench_ipex.py).

--isa avx2|avx512|native reruns the bench with moe_xpu and torch limited to one instruction set
(see moe_xpu/isa.py): the peers and the compute ceiling are then measured under the same limit.

For every case and dtype it prints the median time of moe_xpu.moe_gemm, F.grouped_mm and a
per-expert loop of torch.mm, their GFLOP/s, moe_xpu's speed-up over each peer, and the share of
the roofline each reaches. The roofline is measured in the same run: the compute ceiling is the
GFLOP/s of a large float32 torch.mm, the memory ceiling the read bandwidth of a reduction over a
tensor far larger than the caches; a case's roofline time is the larger of its FLOPs over the
compute ceiling and the bytes it must read (the touched experts' weights plus the activations)
over the memory ceiling.

Every timed call starts with a cold last-level cache (--cache cold, the default): the bench first
writes over a buffer at least twice the cache's size, on one thread (numpy) so that no thread pool
is left spinning against the call. Layers of a model do not find their experts' weights in cache
(the model is far larger), and the roofline's memory ceiling is read from memory; with a warm
cache the decode-sized weights (0.2-0.4 GB) partly fit this host's 480 MB L3, and which peer found
them there depended on the order of the calls. --cache warm times calls back to back instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

import moe_xpu
from moe_xpu import _runtime, isa
from moe_xpu.fused import weighted_slot_sum

#: torch.nn.functional.grouped_mm (torch 2.9+): a peer where the installed torch has it.
GROUPED_MM = getattr(F, "grouped_mm", None)


def _say_once(message: str) -> None:
    if message not in _said_missing:
        _said_missing.add(message)
        print(message)


def _available(impls: dict[str, Callable[[], object] | None]) -> dict[str, Callable[[], object]]:
    """The implementations this environment has (a peer missing from the installed torch or
    transformers is None or False); each one left out is said once."""
    for name, fn in impls.items():
        if not fn:
            _say_once(f"note: {name} is not available with torch {torch.__version__} and the installed "
                      f"transformers; left out")
    return {name: fn for name, fn in impls.items() if fn}


_said_missing: set[str] = set()


def _hf_mixtral_experts():
    """transformers 5.x's MixtralExperts (the experts-interface module), or None before 5.x."""
    try:
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    except ImportError:
        return None
    return MixtralExperts


@dataclasses.dataclass(frozen=True)
class GemmCase:
    name: str
    tokens: int
    top_k: int
    experts: int
    K: int
    N: int

    @property
    def rows(self) -> int:
        return self.tokens * self.top_k


GEMM_CASES = [
    GemmCase("decode", 4, 8, 128, 2048, 1536),
    GemmCase("prefill", 256, 8, 128, 2048, 1536),
    GemmCase("64tok-E64", 64, 8, 64, 2048, 2048),
    GemmCase("16tok-E8", 16, 2, 8, 4096, 4096),
]


def median_time(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


class CacheFlush:
    """Evicts the caches by writing over a buffer of at least twice the last-level cache (and at
    least 1 GiB). numpy does the writing on the calling thread: a torch op would leave its OpenMP
    pool spinning into the timed call, taking cores from whichever implementation runs next."""

    def __init__(self) -> None:
        import numpy as np

        self._buffer = np.zeros(max(1 << 30, 2 * _last_level_cache_bytes()) // 4, dtype=np.float32)

    def __call__(self) -> None:
        self._buffer += 1.0


def median_times(impls: dict[str, Callable[[], object]], repeats: int,
                 flush: Callable[[], None] | None = None) -> dict[str, float]:
    """Median time of each implementation, timed round-robin (every repeat runs each one once) so
    that a slow spell of the machine falls on all of them alike, not on one. With `flush`, it runs
    before every timed call (outside the timed region)."""
    for fn in impls.values():
        fn()  # warm-up: kernel build or cache load, first-touch of outputs
    samples: dict[str, list[float]] = {name: [] for name in impls}
    for _ in range(repeats):
        for name, fn in impls.items():
            if flush is not None:
                flush()
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: sorted(ts)[len(ts) // 2] for name, ts in samples.items()}


@dataclasses.dataclass
class Ceilings:
    gflops: float  # large float32 torch.mm
    read_gbs: float  # reduction over a tensor far larger than the caches
    # GFLOP/s (int8: GOP/s) of the same product in a narrower dtype: torch.mm in bfloat16 or
    # float16, torch._int_mm for int8 (oneDNN's bf16 / int8 dot products or AMX where the CPU has them)
    narrow: dict[str, float] = dataclasses.field(default_factory=dict)

    def compute(self, dtype: str) -> float:
        """The compute ceiling for products of ``dtype`` operands: the faster of float32 torch.mm
        and that dtype's own (a kernel may always widen to float32)."""
        return max(self.gflops, self.narrow.get(dtype, 0.0))

    def roofline_seconds(self, flops: float, bytes_read: float, dtype: str) -> float:
        return max(flops / (self.compute(dtype) * 1e9), bytes_read / (self.read_gbs * 1e9))

    def describe(self) -> str:
        narrow = "".join(f", {g:.0f} {d}" for d, g in self.narrow.items())
        return f"compute {self.gflops:.0f} GFLOP/s float32{narrow}"


def _last_level_cache_bytes() -> int:
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    if os.path.isdir(base):
        for entry in os.listdir(base):
            try:
                with open(os.path.join(base, entry, "size")) as f:
                    text = f.read().strip()
            except OSError:
                continue
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            digits = text[:-1] if text[-1:] in "KMG" else text
            if digits.isdigit():
                best = max(best, int(digits) * scale)
    return best


def measure_ceilings(repeats: int, narrow_dtypes=()) -> Ceilings:
    """The compute ceiling of a 4096^3 product in float32 and in each of ``narrow_dtypes``
    ("bfloat16", "float16", "int8"), and the memory read ceiling."""
    n = 4096
    x, y = torch.randn(n, n), torch.randn(n, n)
    t = median_time(lambda: torch.mm(x, y), repeats)
    gflops = 2 * n**3 / t / 1e9
    narrow = {}
    for name in narrow_dtypes:
        def product(size, name=name):
            if name == "int8":
                xi = torch.randint(-128, 128, (size, size), dtype=torch.int8)
                yi = torch.randint(-128, 128, (size, size), dtype=torch.int8)
                return lambda: torch._int_mm(xi, yi)
            xd, yd = x[:size, :size].to(getattr(torch, name)), y[:size, :size].to(getattr(torch, name))
            return lambda: torch.mm(xd, yd)
        # A 512^3 probe first: where torch has no fast kernel for the dtype under the instruction
        # set in force (bf16 under an AVX2 limit runs a scalar loop, minutes at 4096^3), its
        # ceiling is float32's anyway (compute() takes the faster).
        probe = product(512)
        try:
            probe()
        except RuntimeError:  # (torch builds without an int8 CPU GEMM)
            continue
        if 2 * 512**3 / median_time(probe, 1) / 1e9 < gflops / 4:
            continue
        narrow[name] = 2 * n**3 / median_time(product(n), min(repeats, 3)) / 1e9
    # Four times the last-level cache (at least 1 GiB), so the reduction streams from memory.
    nbytes = max(1 << 30, 4 * _last_level_cache_bytes())
    big = torch.ones(nbytes // 4)
    t = median_time(lambda: big.sum(), repeats)
    read_gbs = nbytes / t / 1e9
    del big
    return Ceilings(gflops, read_gbs, narrow)


def zipf_counts(counts: torch.Tensor, cap: int | None = None) -> torch.Tensor:
    """Rows per expert with the same total and the same touched experts as ``counts``, but
    popularity skewed (Zipf, s=1.2, in expert order: the first touched expert takes about a third
    of the rows). ``cap`` bounds any expert's rows (a fused MoE routes a token to an expert once)."""
    touched = (counts > 0).nonzero().flatten()
    weights = 1.0 / torch.arange(1, touched.numel() + 1, dtype=torch.float64) ** 1.2
    extra = int(counts.sum()) - touched.numel()  # every touched expert keeps at least one row
    share = torch.floor(weights / weights.sum() * extra).to(torch.int64)
    share[0] += extra - int(share.sum())
    skewed = 1 + share
    if cap is not None:  # move the excess down the popularity order
        for i in range(skewed.numel() - 1):
            if skewed[i] > cap:
                skewed[i + 1] += skewed[i] - cap
                skewed[i] = cap
    out = torch.zeros_like(counts)
    out[touched] = skewed
    return out


def routed_offsets(case: GemmCase, generator: torch.Generator, routing: str = "uniform") -> torch.Tensor:
    """Cumulative rows per expert (int32). uniform: tokens routed top-k by random logits.
    zipf: the same number of rows and the same touched experts, popularity skewed (zipf_counts)."""
    logits = torch.randn(case.tokens, case.experts, generator=generator)
    ids = logits.topk(case.top_k, dim=1).indices.flatten()
    counts = torch.bincount(ids, minlength=case.experts)
    if routing == "zipf":
        counts = zipf_counts(counts)
    return counts.cumsum(0).to(torch.int32)


def skewed_topk_ids(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """topk_ids [T, k] with the same touched experts and rows as ``ids`` but Zipf-skewed
    popularity, each token still routed to k distinct experts (so no expert exceeds T rows)."""
    T, k = ids.shape
    counts = zipf_counts(torch.bincount(ids.flatten(), minlength=num_experts), cap=T)
    flat = torch.repeat_interleave(torch.arange(num_experts), counts)  # T * k expert ids
    # Position p goes to token p % T, slot p // T: an expert's consecutive positions (at most T)
    # land on distinct tokens.
    return flat.view(k, T).t().contiguous()


def per_expert_loop(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    out = torch.empty(a.shape[0], b.shape[2], dtype=a.dtype)
    start = 0
    for g, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(a[start:end], b[g], out=out[start:end])
        start = end
    return out


@dataclasses.dataclass
class Row:
    case: str
    dtype: str
    impl: str
    seconds: float
    gflops: float
    roofline_pct: float
    speedup: float  # moe_xpu time advantage: peer time / moe_xpu time (1.0 for moe_xpu itself)


def gemm_inputs(case: GemmCase, dtype: torch.dtype, gen: torch.Generator, layout: str):
    """A [rows, K] and B [E, K, N] of a case: nn.Linear weights [E, N, K] seen as [E, K, N]
    (layout "linear") or a contiguous [E, K, N] ("kn")."""
    a = torch.randn(case.rows, case.K, generator=gen).to(dtype)
    if layout == "linear":
        return a, torch.randn(case.experts, case.N, case.K, generator=gen).to(dtype).transpose(1, 2)
    return a, torch.randn(case.experts, case.K, case.N, generator=gen).to(dtype)


def forward_backward(gemm, a, b, offsets, grad_out):
    """One training step's GEMM work: the forward and the gradients of a and b."""
    a, b = a.detach().requires_grad_(), b.detach().requires_grad_()
    return torch.autograd.grad(gemm(a, b, offsets), [a, b], grad_out)


def bench_gemm(cases, dtypes, ceilings: Ceilings, repeats: int, layout: str, routing: str,
               flush: Callable[[], None] | None = None, backward: bool = False) -> list[Row]:
    """moe_gemm beside its peers; with backward, the forward plus dA and dB (three GEMMs' FLOPs;
    bytes: the weights read twice and their gradient written, the activations and the incoming
    gradient read twice, dA written)."""
    rows: list[Row] = []
    gen = torch.Generator().manual_seed(0)
    for case in cases:
        offsets = routed_offsets(case, gen, routing)
        counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
        touched = int((counts > 0).sum())
        for dtype in dtypes:
            a, b = gemm_inputs(case, dtype, gen, layout)
            esize = a.element_size()
            flops = 2 * case.rows * case.K * case.N
            bytes_read = touched * case.K * case.N * esize + case.rows * case.K * esize
            if backward:
                flops *= 3
                bytes_read = ((2 * touched + case.experts) * case.K * case.N + 3 * case.rows * case.K
                              + 2 * case.rows * case.N) * esize
                grad_out = torch.randn(case.rows, case.N, generator=gen).to(dtype)
                impls = _available({
                    "moe_xpu": lambda: forward_backward(moe_xpu.moe_gemm, a, b, offsets, grad_out),
                    "grouped_mm": GROUPED_MM and (lambda: forward_backward(
                        lambda x, w, o: GROUPED_MM(x, w, offs=o), a, b, offsets, grad_out)),
                })
            else:
                impls = _available({
                    "moe_xpu": lambda: moe_xpu.moe_gemm(a, b, offsets),
                    "grouped_mm": GROUPED_MM and (lambda: GROUPED_MM(a, b, offs=offsets)),
                    "torch.mm loop": lambda: per_expert_loop(a, b, offsets),
                })
            roofline_s = ceilings.roofline_seconds(flops, bytes_read, str(dtype).removeprefix("torch."))
            times = median_times(impls, repeats, flush)
            for name, t in times.items():
                rows.append(
                    Row(case.name, str(dtype).removeprefix("torch."), name, t, flops / t / 1e9,
                        100 * roofline_s / t, t / times["moe_xpu"])
                )
    return rows


QUANT_FORMATS = {"int8": {}, "int4": {"group_size": 128}, "fp8": {}, "mxfp4": {}}


def bench_gemm_quant(cases, fmt: str, ceilings: Ceilings, repeats: int, layout: str, routing: str,
                     flush: Callable[[], None] | None = None) -> list[Row]:
    """moe_gemm on quantized weights (bfloat16 activations; for int8 also W8A8, the activations'
    per-token quantization included in its time) beside moe_xpu's own bfloat16 and the bfloat16
    peers. The roofline counts the quantized bytes: values plus scales of the touched experts."""
    from moe_xpu import quant

    rows: list[Row] = []
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    for case in cases:
        offsets = routed_offsets(case, gen, routing)
        counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
        touched = int((counts > 0).sum())
        a, b = gemm_inputs(case, dtype, gen, layout)
        q = quant.quantize_experts(b, fmt, **QUANT_FORMATS[fmt])
        impls = {f"moe_xpu {fmt}": lambda: moe_xpu.moe_gemm(a, q, offsets)}
        if fmt == "int8":
            def w8a8(a=a, q=q, offsets=offsets):
                a8, a_scale = moe_xpu.quantize_per_token(a)
                return moe_xpu.moe_gemm(a8, q, offsets, a_scale=a_scale, out_dtype=dtype)

            impls["moe_xpu int8 W8A8"] = w8a8
        impls.update(_available({
            "moe_xpu bfloat16": lambda: moe_xpu.moe_gemm(a, b, offsets),
            "grouped_mm": GROUPED_MM and (lambda: GROUPED_MM(a, b, offs=offsets)),
        }))
        flops = 2 * case.rows * case.K * case.N
        times = median_times(impls, repeats, flush)
        ours = times[f"moe_xpu {fmt}"]
        for name, t in times.items():
            weight_bytes = q.nbytes if name.startswith(f"moe_xpu {fmt}") or "W8A8" in name else b.numel() * 2
            act_bytes = case.rows * case.K * (1 if "W8A8" in name else 2)
            bytes_read = weight_bytes * touched / case.experts + act_bytes
            roofline_s = ceilings.roofline_seconds(flops, bytes_read, "int8" if "W8A8" in name else "bfloat16")
            rows.append(Row(case.name, f"bf16/{fmt}", name, t, flops / t / 1e9, 100 * roofline_s / t, t / ours))
    return rows


@dataclasses.dataclass(frozen=True)
class MoeCase:
    name: str
    tokens: int
    experts: int
    top_k: int
    H: int
    I: int


# transformers' eager backend indexes each expert's weights out of the stacked parameter, so its
# backward adds a zero-filled gradient of every expert's weights per expert it ran.
EAGER_BACKWARD_MAX_EXPERTS = 64

MOE_CASES = [
    MoeCase("decode", 4, 128, 8, 2048, 768),
    MoeCase("prefill", 256, 128, 8, 2048, 768),
    MoeCase("64tok-E64", 64, 64, 8, 2048, 1024),
    MoeCase("16tok-E8", 16, 8, 2, 4096, 4096),
]


def unfused_moe_pipeline(x, gate_up, down, weights, ids):
    """The same kernels without fusion: tokens copied into expert order, separate activation and
    weighted-sum passes."""
    I = gate_up.shape[1] // 2
    s = moe_xpu.sort_tokens(ids, gate_up.shape[0])
    rows = x[s.gather_index]  # the copy fused_moe avoids
    h = moe_xpu.moe_gemm(rows, gate_up.transpose(1, 2), s.group_offsets)
    h = F.silu(h[:, :I]) * h[:, I:]
    y = moe_xpu.moe_gemm(h, down.transpose(1, 2), s.group_offsets, out_dtype=torch.float32)
    return weighted_slot_sum(y, s.scatter_index, weights, x.dtype)


def _gradients(forward: Callable[[], torch.Tensor], leaves: list[torch.Tensor], grad_out: torch.Tensor):
    """The forward with every leaf requiring a gradient, then the gradients of all of them."""
    for t in leaves:
        t.requires_grad_(True)
    try:
        return torch.autograd.grad(forward(), leaves, grad_out)
    finally:
        for t in leaves:
            t.requires_grad_(False)


def mixtral_experts(case: "MoeCase", dtype: torch.dtype, gen: torch.Generator):
    """A transformers MixtralExperts module with the case's shapes and small random weights, or,
    before transformers 5.x, a plain holder of the same two tensors (no HF peers then)."""
    MixtralExperts = _hf_mixtral_experts()
    gate_up = (torch.randn(case.experts, 2 * case.I, case.H, generator=gen) * 0.02).to(dtype)
    down = (torch.randn(case.experts, case.H, case.I, generator=gen) * 0.02).to(dtype)
    if MixtralExperts is None:
        return argparse.Namespace(gate_up_proj=gate_up, down_proj=down)
    import transformers

    config = transformers.MixtralConfig(hidden_size=case.H, intermediate_size=case.I,
                                        num_local_experts=case.experts, num_experts_per_tok=case.top_k)
    experts = MixtralExperts(config).to(dtype)
    with torch.no_grad():
        experts.gate_up_proj.copy_(gate_up)
        experts.down_proj.copy_(down)
    return experts


def hf_backends(experts, x, ids, w) -> dict[str, Callable[[], object] | None]:
    """transformers' eager and grouped_mm backends on the experts module (None without one)."""
    def hf(backend):
        def run():
            experts.config._experts_implementation = backend
            return experts(x, ids, w)
        return run

    hf_module = isinstance(experts, torch.nn.Module)
    return {"HF eager": hf_module and hf("eager"), "HF grouped_mm": hf_module and hf("grouped_mm")}


def bench_moe(cases, dtypes, ceilings: Ceilings, repeats: int,
              flush: Callable[[], None] | None = None, backward: bool = False) -> list[Row]:
    """fused_moe beside transformers' expert backends; with backward, the forward plus the
    gradients of the hidden states, both weight tensors and the top-k weights (FLOPs: the three
    forward GEMMs and six gradient GEMMs; bytes: the touched experts' weights read three times and
    every expert's weight gradient written)."""
    rows: list[Row] = []
    gen = torch.Generator().manual_seed(0)
    for case in cases:
        logits = torch.randn(case.tokens, case.experts, generator=gen)
        weights, ids = logits.softmax(-1).topk(case.top_k, dim=1)
        touched = int(ids.unique().numel())
        for dtype in dtypes:
            experts = mixtral_experts(case, dtype, gen)
            x = torch.randn(case.tokens, case.H, generator=gen).to(dtype)
            w = weights.to(dtype)
            esize = x.element_size()
            flops = 6 * case.tokens * case.top_k * case.H * case.I
            bytes_read = touched * 3 * case.H * case.I * esize + case.tokens * case.H * esize
            if backward:
                flops *= 3
                bytes_read = (3 * touched + case.experts) * 3 * case.H * case.I * esize + \
                    4 * case.tokens * case.H * esize
            roofline_s = ceilings.roofline_seconds(flops, bytes_read, str(dtype).removeprefix("torch."))

            impls = _available({
                "moe_xpu fused": lambda: moe_xpu.fused_moe(x, experts.gate_up_proj, experts.down_proj, w, ids),
                **hf_backends(experts, x, ids, w),
                "moe_xpu unfused": lambda: unfused_moe_pipeline(x, experts.gate_up_proj, experts.down_proj, w, ids),
            })
            if backward:
                grad_out = torch.randn(case.tokens, case.H, generator=gen).to(dtype)
                leaves = [x, experts.gate_up_proj, experts.down_proj, w]
                skipped = {"moe_xpu unfused"}
                if case.experts > EAGER_BACKWARD_MAX_EXPERTS:
                    skipped.add("HF eager")
                    _say_once(f"note: HF eager's backward is left out of cases with more than "
                              f"{EAGER_BACKWARD_MAX_EXPERTS} experts (each expert's weight slice sends back a "
                              f"gradient the size of all experts' weights: minutes per call)")
                impls = {name: (lambda fn=fn: _gradients(fn, leaves, grad_out)) for name, fn in impls.items()
                         if name not in skipped}
                times = median_times(impls, repeats, flush)
            else:
                with torch.no_grad():
                    times = median_times(impls, repeats, flush)
            for name, t in times.items():
                rows.append(Row(case.name, str(dtype).removeprefix("torch."), name, t, flops / t / 1e9,
                                100 * roofline_s / t, t / times["moe_xpu fused"]))
    return rows


def bench_moe_quant(cases, fmt: str, ceilings: Ceilings, repeats: int,
                    flush: Callable[[], None] | None = None) -> list[Row]:
    """fused_moe on quantized weights (bfloat16 activations) beside moe_xpu's own bfloat16 fused_moe
    and transformers' bfloat16 backends. The roofline counts the quantized bytes of the touched
    experts (values plus scales)."""
    rows: list[Row] = []
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    for case in cases:
        logits = torch.randn(case.tokens, case.experts, generator=gen)
        weights, ids = logits.softmax(-1).topk(case.top_k, dim=1)
        touched = int(ids.unique().numel())
        experts = mixtral_experts(case, dtype, gen)
        x = torch.randn(case.tokens, case.H, generator=gen).to(dtype)
        w = weights.to(dtype)
        q1 = moe_xpu.quantize_experts(experts.gate_up_proj.transpose(1, 2), fmt, **QUANT_FORMATS[fmt])
        q2 = moe_xpu.quantize_experts(experts.down_proj.transpose(1, 2), fmt, **QUANT_FORMATS[fmt])
        flops = 6 * case.tokens * case.top_k * case.H * case.I
        ours = f"moe_xpu fused {fmt}"
        impls = _available({
            ours: lambda: moe_xpu.fused_moe(x, q1, q2, w, ids),
            "moe_xpu fused bfloat16": lambda: moe_xpu.fused_moe(x, experts.gate_up_proj, experts.down_proj, w, ids),
            **hf_backends(experts, x, ids, w),
        })
        with torch.no_grad():
            times = median_times(impls, repeats, flush)
        for name, t in times.items():
            weight_bytes = q1.nbytes + q2.nbytes if name == ours else 3 * case.experts * case.H * case.I * 2
            bytes_read = weight_bytes * touched / case.experts + case.tokens * case.H * 2
            roofline_s = ceilings.roofline_seconds(flops, bytes_read, "bfloat16")
            rows.append(Row(case.name, f"bf16/{fmt}", name, t, flops / t / 1e9, 100 * roofline_s / t, t / times[ours]))
    return rows


def bench_skew(gemm_cases, moe_cases, dtypes, repeats: int, flush: Callable[[], None] | None = None) -> None:
    """moe_gemm and fused_moe under Zipf-skewed routing beside uniform routing with the same rows
    and touched experts, timed round-robin in one process (the issue-4 bar: at most 1.15x)."""
    print(f"Zipf-skewed vs uniform routing, same rows and touched experts, median of {repeats}, round-robin, "
          f"{'cold' if flush is not None else 'warm'} cache")
    header = f"{'op':<10} {'case':<11} {'dtype':<9} {'uniform ms':>11} {'zipf ms':>9} {'zipf / uniform':>15} {'top expert rows':>16}"
    print(header)
    print("-" * len(header))

    def line(op, case_name, dtype, t, top, rows):
        print(f"{op:<10} {case_name:<11} {str(dtype).removeprefix('torch.'):<9} {t['uniform'] * 1e3:>11.2f} "
              f"{t['zipf'] * 1e3:>9.2f} {t['zipf'] / t['uniform']:>14.2f}x {top:>9} of {rows}")

    gen = torch.Generator().manual_seed(0)
    for case in gemm_cases:
        offsets = {r: routed_offsets(case, torch.Generator().manual_seed(1), r) for r in ("uniform", "zipf")}
        top = int(torch.diff(offsets["zipf"], prepend=offsets["zipf"].new_zeros(1)).max())
        for dtype in dtypes:
            a, b = gemm_inputs(case, dtype, gen, "linear")
            t = median_times({r: (lambda o=o: moe_xpu.moe_gemm(a, b, o)) for r, o in offsets.items()}, repeats, flush)
            line("moe_gemm", case.name, dtype, t, top, case.rows)
    for case in moe_cases:
        logits = torch.randn(case.tokens, case.experts, generator=gen)
        weights, ids = logits.softmax(-1).topk(case.top_k, dim=1)
        routed = {"uniform": ids, "zipf": skewed_topk_ids(ids, case.experts)}
        top = int(torch.bincount(routed["zipf"].flatten()).max())
        for dtype in dtypes:
            x = torch.randn(case.tokens, case.H, generator=gen).to(dtype)
            gate_up = (torch.randn(case.experts, 2 * case.I, case.H, generator=gen) * 0.02).to(dtype)
            down = (torch.randn(case.experts, case.H, case.I, generator=gen) * 0.02).to(dtype)
            w = weights.to(dtype)
            t = median_times({r: (lambda i=i: moe_xpu.fused_moe(x, gate_up, down, w, i)) for r, i in routed.items()},
                             repeats, flush)
            line("fused_moe", case.name, dtype, t, top, case.tokens * case.top_k)


@dataclasses.dataclass(frozen=True)
class SmallGemm:
    tokens: int  # rows, each routed to one expert
    experts: int
    K: int
    N: int

    @property
    def name(self) -> str:
        return f"T{self.tokens} E{self.experts} K{self.K} N{self.N}"


SMALL_GEMMS = [SmallGemm(8, 8, 128, 64), SmallGemm(64, 8, 128, 128), SmallGemm(8, 64, 512, 256),
               SmallGemm(32, 8, 512, 256)]
# The index-table case: 256 tokens, top-2 of 8 experts (64 rows an expert on average), K = N = 128.
GATHER_CASE = dict(tokens=256, top_k=2, experts=8, K=128, N=128)
# fused_moe layers: 4 tokens top-2 of 8 (H 512, I 256), and the demo model's (examples/hf_generate.py,
# Qwen3-MoE: 32 experts, top-4, H 512, I 256) at decode (1 token) and at its 32-token prompt.
SMALL_MOES = [MoeCase("T4 E8 k2", 4, 8, 2, 512, 256), MoeCase("demo decode", 1, 32, 4, 512, 256),
              MoeCase("demo prefill", 32, 32, 4, 512, 256)]


@dataclasses.dataclass
class SmallRow:
    case: str
    impl: str
    seconds: float
    speedup: float  # peer time / moe_xpu time
    host_us: float | None = None  # moe_gemm: host time beyond the kernel


def _floors_text(floors: dict[bool, float]) -> str:
    return (f"runtime floor (an empty kernel launched and waited for): thread pool {floors[False] * 1e6:.1f} us, "
            f"calling thread {floors[True] * 1e6:.1f} us")


def _markdown_small(rows: list[SmallRow], floors: dict[bool, float], repeats: int) -> None:
    print(f"\n**Small shapes**, float32, warm cache, median of {repeats}; {_floors_text(floors)}\n")
    print("| case | implementation | median us | moe_xpu speed-up | host us beyond the kernel |")
    print("| --- | --- | ---: | ---: | ---: |")
    for r in rows:
        speed = "" if r.impl.startswith("moe_xpu") and r.speedup == 1.0 else f"{r.speedup:.2f}x"
        host = "" if r.host_us is None else f"{r.host_us:.1f}"
        print(f"| {r.case} | {r.impl} | {r.seconds * 1e6:.1f} | {speed} | {host} |")


def _print_small(rows: list[SmallRow], floors: dict[bool, float], repeats: int) -> None:
    print(f"small shapes, float32, warm cache, median of {repeats} (speed-up = peer time / moe_xpu time); "
          f"{_floors_text(floors)}")
    header = f"{'case':<22} {'impl':<24} {'median us':>10} {'moe_xpu speed-up':>17} {'host us beyond kernel':>22}"
    print(header)
    print("-" * len(header))
    for r in rows:
        speed = "" if r.impl.startswith("moe_xpu") and r.speedup == 1.0 else f"{r.speedup:.2f}x"
        host = "" if r.host_us is None else f"{r.host_us:.1f}"
        print(f"{r.case:<22} {r.impl:<24} {r.seconds * 1e6:>10.1f} {speed:>17} {host:>22}")


def bench_small(repeats: int, flush: Callable[[], None] | None = None, markdown: bool = False) -> list[SmallRow]:
    """Per-call cost at small shapes. The host time beyond the kernel of a moe_gemm call is its
    time minus the kernel's: the launcher's prepared launch (as moe_gemm's calls run it) less the runtime's
    floor (an empty kernel's launch and wait, itself host time) on the same executor (the thread
    pool, or the calling thread for launches the plan runs there)."""
    from moe_xpu import ops

    C = _runtime.sycl_module()
    rows: list[SmallRow] = []
    gen = torch.Generator().manual_seed(0)
    empty = median_times({"pool": C.launch_empty, "calling": lambda: C.launch_empty(0, True)}, repeats)
    floors = {False: empty["pool"], True: empty["calling"]}
    for case in SMALL_GEMMS:
        a = torch.randn(case.tokens, case.K, generator=gen)
        b = torch.randn(case.experts, case.K, case.N, generator=gen)
        ids = torch.randn(case.tokens, case.experts, generator=gen).argmax(1)
        offsets = torch.bincount(ids, minlength=case.experts).cumsum(0).to(torch.int32)
        out = torch.empty(case.tokens, case.N)
        prepared = ops.prepare_launch(ops.gemm_args(a, b, offsets, None, None, out), a).launcher  # as moe_gemm's calls run
        addresses = (a.data_ptr(), b.data_ptr(), offsets.data_ptr(), 0, 0, out.data_ptr())
        t = median_times(_available({"moe_xpu": lambda: moe_xpu.moe_gemm(a, b, offsets),
                                     "grouped_mm": GROUPED_MM and (lambda: GROUPED_MM(a, b, offs=offsets)),
                                     "launcher": lambda: prepared.launch(0, *addresses)}), repeats, flush)
        kernel = max(t["launcher"] - floors[prepared.plan.calling_thread], 0.0)
        rows.append(SmallRow(case.name, "moe_xpu", t["moe_xpu"], 1.0, (t["moe_xpu"] - kernel) * 1e6))
        if "grouped_mm" in t:
            rows.append(SmallRow(case.name, "grouped_mm", t["grouped_mm"], t["grouped_mm"] / t["moe_xpu"]))

    c = GATHER_CASE
    logits = torch.randn(c["tokens"], c["experts"], generator=gen)
    s = moe_xpu.sort_tokens(logits.topk(c["top_k"], dim=1).indices, c["experts"])
    x = torch.randn(c["tokens"], c["K"], generator=gen)
    b = torch.randn(c["experts"], c["K"], c["N"], generator=gen)
    name = f"64 rows/expert K{c['K']}"
    t = median_times(_available({
        "moe_xpu gather in kernel": lambda: moe_xpu.moe_gemm(x, b, s.group_offsets, gather_index=s.gather_index),
        "index_select + moe_xpu": lambda: moe_xpu.moe_gemm(x.index_select(0, s.gather_index), b, s.group_offsets),
        "index_select + grouped_mm": GROUPED_MM and (lambda: GROUPED_MM(x.index_select(0, s.gather_index), b,
                                                                        offs=s.group_offsets)),
    }), repeats, flush)
    ours = t["moe_xpu gather in kernel"]
    rows += [SmallRow(name, impl, v, v / ours) for impl, v in t.items()]

    for case in SMALL_MOES:
        experts = mixtral_experts(case, torch.float32, gen)
        weights, ids = torch.randn(case.tokens, case.experts, generator=gen).softmax(-1).topk(case.top_k, dim=1)
        x = torch.randn(case.tokens, case.H, generator=gen)
        with torch.no_grad():
            t = median_times(_available({
                "moe_xpu fused_moe": lambda: moe_xpu.fused_moe(x, experts.gate_up_proj, experts.down_proj, weights, ids),
                **hf_backends(experts, x, ids, weights)}), repeats, flush)
        ours = t["moe_xpu fused_moe"]
        label = f"fused {case.name} H{case.H} I{case.I}"
        rows += [SmallRow(label, impl, v, v / ours) for impl, v in t.items()]
    _print_small(rows, floors, repeats)
    if markdown:
        _markdown_small(rows, floors, repeats)
    return rows


def print_table(rows: list[Row], title: str) -> None:
    print(title)
    width = max([16] + [len(r.impl) for r in rows])
    header = f"{'case':<11} {'dtype':<9} {'impl':<{width}} {'median ms':>10} {'GFLOP/s':>8} {'roofline':>9} {'moe_xpu speed-up':>17}"
    print(header)
    print("-" * len(header))
    for r in rows:
        speed = "" if r.impl.startswith("moe_xpu") and r.speedup == 1.0 else f"{r.speedup:.2f}x"
        print(f"{r.case:<11} {r.dtype:<9} {r.impl:<{width}} {r.seconds * 1e3:>10.2f} {r.gflops:>8.1f} "
              f"{r.roofline_pct:>8.0f}% {speed:>17}")


def print_markdown(rows: list[Row], title: str) -> None:
    """The table as Markdown (the README's performance tables)."""
    print(f"\n**{title}**\n")
    print("| case | dtype | implementation | median ms | GFLOP/s | % of roofline | moe_xpu speed-up |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        speed = "" if r.impl.startswith("moe_xpu") and r.speedup == 1.0 else f"{r.speedup:.2f}x"
        print(f"| {r.case} | {r.dtype} | {r.impl} | {r.seconds * 1e3:.2f} | {r.gflops:.1f} | {r.roofline_pct:.0f}% | {speed} |")


def plot(rows: list[Row], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    impls = list(dict.fromkeys(r.impl for r in rows))
    groups = list(dict.fromkeys((r.case, r.dtype) for r in rows))
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(groups)), 4.8))
    width = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        # An implementation that did not run for a case (a peer refusing a dtype) gets no bar there.
        values = [next((r.roofline_pct for r in rows if (r.case, r.dtype) == g and r.impl == impl), float("nan"))
                  for g in groups]
        xs = [j + (i - (len(impls) - 1) / 2) * width for j in range(len(groups))]
        bars = ax.bar(xs, values, width, label=impl)
        for bar, v in zip(bars, values):
            if v != v:  # NaN: no bar
                continue
            ax.annotate(f"{v:.0f}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom", fontsize=7)
    ax.axhline(100, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{c}\n{d}" for c, d in groups], fontsize=8)
    ax.set_ylabel("% of measured roofline (higher is better)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars, never over them
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    backend = _runtime.cpu_backend()
    return (f"{cpu}, {os.cpu_count()} cores, instruction set {isa.describe(isa.current())}, "
            f"torch {torch.__version__}, CPU backend {backend}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_xpu.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", nargs="?", default="gemm", choices=["gemm", "moe", "skew", "small", "ipex", "ep"])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--cases", default="decode,prefill,64tok-E64,16tok-E8")
    parser.add_argument("--layout", choices=["linear", "kn"], default="linear",
                        help="weights as nn.Linear [E, N, K] transposed (default) or contiguous [E, K, N]")
    parser.add_argument("--routing", choices=["uniform", "zipf"], default="uniform",
                        help="gemm: expert popularity; zipf keeps the rows and touched experts of uniform")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per implementation "
                        "(default 5; small: 300)")
    parser.add_argument("--isa", choices=sorted(isa.LIMITS), help="limit moe_xpu and torch to one instruction "
                        "set (reruns the bench in a new process; see moe_xpu/isa.py)")
    parser.add_argument("--cache", choices=["cold", "warm"], default=None,
                        help="cold (default; small: warm): evict the caches before every timed call; warm: "
                        "back to back")
    parser.add_argument("--plot", metavar="PNG", help="write a plot of the table")
    parser.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    parser.add_argument("--backward", action="store_true", help="gemm, moe: time the forward plus the "
                        "gradients of the inputs and weights (training)")
    parser.add_argument("--quant", metavar="FORMATS", help="gemm, moe: quantized weights, comma-separated formats "
                        f"({', '.join(QUANT_FORMATS)}), beside moe_xpu's and the peers' bfloat16")
    args = parser.parse_args(argv)
    if args.isa is not None:
        code = isa.rerun_limited(args.isa, "moe_xpu.bench", sys.argv[1:] if argv is None else list(argv))
        if code is not None:
            return code
    if args.repeats is None:
        args.repeats = 300 if args.suite == "small" else 5
    if args.cache is None:
        args.cache = "warm" if args.suite == "small" else "cold"

    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    wanted = args.cases.split(",")
    print(f"machine: {machine_line()}")
    flush = CacheFlush() if args.cache == "cold" else None
    print(f"cache: {args.cache} (see --help)")
    if args.suite == "small":
        bench_small(args.repeats, flush, args.markdown)
        return 0
    if args.suite == "ep":
        from moe_xpu.bench_ep import bench_ep

        bench_ep(repeats=args.repeats)
        return 0
    if args.suite == "skew":
        bench_skew([c for c in GEMM_CASES if c.name in wanted], [c for c in MOE_CASES if c.name in wanted],
                   dtypes, args.repeats, flush)
        return 0
    narrow = {str(d).removeprefix("torch.") for d in dtypes} - {"float32"}
    if args.quant and args.suite in ("gemm", "moe"):
        narrow |= {"bfloat16"} | ({"int8"} if args.suite == "gemm" and "int8" in args.quant.split(",") else set())
    ceilings = measure_ceilings(args.repeats, sorted(narrow))
    print(f"ceilings: {ceilings.describe()} (torch.mm, int8 torch._int_mm, 4096^3; a row's compute ceiling "
          f"is the faster of float32 and its dtype), memory read {ceilings.read_gbs:.1f} GB/s (sum over a "
          f"tensor 4x the last-level cache)")
    for dtype in dtypes:  # build (or load) kernels outside the timed region
        moe_xpu.moe_gemm(torch.zeros(1, 1, dtype=dtype), torch.zeros(1, 1, 1, dtype=dtype),
                         torch.ones(1, dtype=torch.int32))
    if args.quant and args.suite in ("gemm", "moe"):
        formats = args.quant.split(",")
        unknown = sorted(set(formats) - set(QUANT_FORMATS))
        if unknown:
            parser.error(f"unknown --quant format(s) {unknown}; known: {', '.join(QUANT_FORMATS)}")
        if args.suite == "gemm":
            rows = [r for fmt in formats for r in bench_gemm_quant(
                [c for c in GEMM_CASES if c.name in wanted], fmt, ceilings, args.repeats, args.layout, args.routing,
                flush)]
            title = f"moe_gemm on quantized weights vs bfloat16, weights {args.layout}, {args.routing} routing, "
        else:
            rows = [r for fmt in formats for r in bench_moe_quant(
                [c for c in MOE_CASES if c.name in wanted], fmt, ceilings, args.repeats, flush)]
            title = "fused_moe on quantized weights vs bfloat16, "
        title += f"{args.cache} cache, median of {args.repeats}"
        speedup_of = "moe_xpu quantized"
    elif args.suite == "gemm":
        rows = bench_gemm([c for c in GEMM_CASES if c.name in wanted], dtypes, ceilings, args.repeats,
                          args.layout, args.routing, flush, args.backward)
        title = (f"moe_gemm{' forward + backward' if args.backward else ''} vs peers, weights {args.layout}, "
                 f"{args.routing} routing, {args.cache} cache, "
                 f"median of {args.repeats}")
        speedup_of = "moe_xpu"
    elif args.suite == "ipex":
        from moe_xpu.bench_ipex import bench_ipex

        rows = bench_ipex([c for c in MOE_CASES if c.name in wanted], dtypes, ceilings, args.repeats, flush)
        title = f"fused_moe vs IPEX's CPU MoE paths, {args.cache} cache, median of {args.repeats}"
        speedup_of = "moe_xpu fused"
    else:
        rows = bench_moe([c for c in MOE_CASES if c.name in wanted], dtypes, ceilings, args.repeats, flush,
                         args.backward)
        title = (f"fused_moe{' forward + backward' if args.backward else ''} vs peers, {args.cache} cache, "
                 f"median of {args.repeats}")
        speedup_of = "moe_xpu fused"
    print_table(rows, title + f" (speed-up = peer time / {speedup_of} time)")
    if args.markdown:
        print_markdown(rows, f"{title}: {machine_line()}; ceilings {ceilings.describe().removeprefix('compute ')}, "
                             f"{ceilings.read_gbs:.1f} GB/s")
    if args.plot:
        plot(rows, args.plot, f"{title}\n{machine_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
