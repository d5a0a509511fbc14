"""python -m moe_xpu info: what moe_xpu runs on here."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys

import torch

from moe_xpu import _runtime


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def info(warm_up: bool = False) -> None:
    import hashlib

    import moe_xpu

    C = _runtime.sycl_module()
    print(f"moe_xpu          {moe_xpu.__version__}")
    print(f"torch            {torch.__version__}")
    print(f"intel-sycl-rt    {_version('intel-sycl-rt')}")
    print(f"dpctl            {_version('dpctl')}")
    print(f"MOE_XPU_BACKEND  {_runtime.requested_backend()}")
    xpu = hasattr(torch, "xpu") and torch.xpu.is_available()
    print(f"XPU tensors      {'available: ' + torch.xpu.get_device_name() if xpu else 'no XPU device'}")
    if C is None:
        print(f"SYCL launcher    not loaded ({_runtime.import_error()})")
    else:
        print(f"SYCL runtime     {_runtime.loaded_sycl_library() or 'not found'}")
    print(f"CPU backend      {_runtime.cpu_backend()}")
    if C is not None and not C.cpu_device_available():
        print("SYCL CPU device  none: this SYCL runtime found no CPU device (oneAPI 2026.x wheels "
              "ship no OpenCL adapter); CPU tensors run on the PyTorch fallback")
    if C is not None and C.cpu_device_available():
        d = C.device_info(0)
        print("SYCL CPU device")
        print(f"  name           {d.name}")
        print(f"  backend        {d.backend} (driver {d.driver_version})")
        print(f"  compute units  {d.compute_units}")
        print(f"  sub-groups     {list(d.sub_group_sizes)}")
        print(f"  max work-group {d.max_work_group_size}")
        print(f"  local memory   {d.local_mem_size} bytes")
        target = os.environ.get("CL_CONFIG_CPU_TARGET_ARCH", "default")
        engine = ("AMX via joint_matrix (bf16 forward and weight gradient, weight-only formats "
                  "dequantized to bf16" + (", int8 W8A8" if d.matrix_engine_int8 else "") + ")"
                  if d.matrix_engine else "none (vector kernels only)")
        print(f"  matrix engine  {engine}; OpenCL CPU target {target}")
        t = C.device_description(0)

        def shapes(tiles):
            return ", ".join(f"{m}x{n}" for m, n in tiles)

        print(f"  tuning         vector class {t['vector_class']} ({t['vector_width']} floats a register): "
              f"K-split tiles {shapes(t['k_lanes_tiles'])}, N-split tiles {shapes(t['n_lanes_tiles'])} "
              f"(16-bit B: {shapes(t['n_lanes_tiles_16bit'])}) "
              f"(rows x columns per lane group; decode shape first); quantized weights' tiles "
              f"{shapes(t['quant_tiles_8bit'])} (8-bit), {shapes(t['quant_tiles_4bit'])} (4-bit, decoded "
              f"{'by a sub-group table lookup' if t['nibble_lookup'] else 'arithmetically'})")
        print("  bf16 dot       " + ("AVX512-BF16 (vdpbf16ps) kernels for bf16 A and B where groups average "
                                     "more than 2 rows (weights contiguous along K, or along N in 64-column "
                                     "tiles), and for bf16 weight gradients of groups of 2 rows or more (N in "
                                     "64-column tiles); self-check passed (MOE_XPU_BF16_DOT=0: off)"
                                     if t["bf16_dot"] else C.bf16_dot_state()))
        print("  int8 dot       " + ("AVX512-VNNI (vpdpbusd) kernel for W8A8 where groups average more than 2 rows, "
                                     "weights contiguous along K with one scale per output channel; self-check passed "
                                     "(MOE_XPU_INT8_DOT=0: off)" if t["int8_dot"] else C.int8_dot_state()))
        print("  4-bit/fp8 dot  " + ("AVX512-BF16 (vdpbf16ps) kernels for int4 (one zero point), MXFP4 and fp8 e4m3 "
                                     "weights with bf16 activations (decode included: a tile runs only the rows a group "
                                     "holds), the values decoded to bf16 in registers; self-check passed (MOE_XPU_NIBBLE_DOT=0: off)"
                                     if t["nibble_dot"] else C.nibble_dot_state()))
        fma_tiles = ("AVX2 FMA kernels (register tiles 3 x 4, and 1 x 8 where groups average up to 2 rows) for "
                     "float32, bf16 and fp16 weights" if t["vector_width"] == 8 else
                     "AVX-512 FMA kernels (register tiles 4 x 6, and 1 x 8 where "
                     "groups average up to 2 rows) for bf16 and fp16 weights")
        fma_kn = ("; for the same weights contiguous along N ([E, K, N]) a 6 x 16 outer-product tile where groups "
                  "average more than 2 rows and N is a multiple of 16, on A of the weights' dtype or float32"
                  if t["vector_width"] == 8 else "")
        print("  FMA dot        " + (fma_tiles + " contiguous along K, on float32 A (16-bit A widened to it once a "
                                     "call)" + fma_kn + "; self-check passed (MOE_XPU_FMA_DOT=0: off)"
                                     if t["fma_dot"] else C.fma_dot_state()))
        limit = t["inline_flops"]
        weights = t["inline_bytes"]
        print("  small launches " + (f"up to {limit / 1e6:.2f} MFLOP" +
                                     (f" and {weights / 2**20:.1f} MiB of weights" if weights < 1e18 else "") +
                                     " run on the calling thread, larger ones on the runtime's thread pool "
                                     "(MOE_XPU_INLINE_FLOPS)" if limit > 0 else
                                     "all on the runtime's thread pool (MOE_XPU_INLINE_FLOPS=0)"))
        print("  launches       " + ("prepared launches enqueued through OpenCL, only their changed arguments set "
                                     "(MOE_XPU_NATIVE_LAUNCH=0: through SYCL)" if C.native_cpu_launches() else
                                     "through SYCL (MOE_XPU_NATIVE_LAUNCH=0)" if os.environ.get("MOE_XPU_NATIVE_LAUNCH") == "0"
                                     else "through SYCL"))
        parked = C.parked_openmp_library()
        print("  thread pool    " + (f"torch's OpenMP threads ({os.path.basename(parked)}) sleep while it runs a launch "
                                     "(MOE_XPU_PARK_OPENMP=0: not)" if parked else
                                     "shares the cores with torch's OpenMP threads (MOE_XPU_PARK_OPENMP=0)"
                                     if os.environ.get("MOE_XPU_PARK_OPENMP") == "0" else
                                     "shares the cores (no OpenMP threads of torch's to park)"))
    if C is not None:
        files = C.kernel_files()
        digest = hashlib.sha256("".join(text for _, text in files).encode()).hexdigest()[:12]
        print(f"kernel source    sha256 {digest} ({', '.join(name for name, _ in files)}: "
              f"{sum(len(text) for _, text in files)} bytes, embedded)")
    print(f"kernel cache     {_runtime.cache_dir()} (persistent: {_persistent()})")
    if warm_up and C is not None and C.cpu_device_available():
        # Compiles the kernels, or loads them from the persistent cache when they are there.
        for name in ("float32", "bfloat16", "float16"):
            dtype = getattr(C.DType, name)
            print(f"  {name} kernels ready in {C.warm_up(0, dtype, dtype):.1f} s")


def _persistent() -> bool:
    return os.environ.get("SYCL_CACHE_PERSISTENT", "0") == "1"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_xpu")
    parser.add_argument("command", choices=["info"], help="info: backend, device, versions, cache")
    parser.add_argument("--warm-up", action="store_true",
                        help="build (or load from the cache) the kernels of each dtype and report the time")
    args = parser.parse_args(argv)
    info(args.warm_up)
    return 0


if __name__ == "__main__":
    sys.exit(main())
