"""Checks moe_xpu as built in an environment whose SYCL runtime is another generation.

torch's XPU wheels bring their own SYCL runtime (oneAPI 2025.x, libsycl.so.8, for torch 2.8-2.12;
2026.x, libsycl.so.9, from 2.13), and moe_xpu must be built against the one in the environment.
``make check-runtime-2026`` builds moe_xpu against the 2026.x wheels in a second environment and
runs this there (with ``python -I``, so the source tree is not imported instead). Those wheels
ship no OpenCL adapter, so there is no SYCL CPU device: moe_xpu must still import, name the
runtime it loaded, say that no SYCL device is available, run CPU tensors on the PyTorch fallback
and refuse MOE_XPU_BACKEND=sycl with a clear error.

    python -I tests/check_runtime_generation.py --soname libsycl.so.9
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--soname", required=True, help="the libsycl soname the build must load")
    args = parser.parse_args()

    import torch

    import moe_xpu
    from moe_xpu import _runtime

    checks = []

    def check(name, ok, detail=""):
        checks.append(ok)
        print(f"{'PASS' if ok else 'FAIL'} {name}" + (f": {detail}" if detail and not ok else ""), flush=True)

    check("package imported from the installed copy", "site-packages" in moe_xpu.__file__, moe_xpu.__file__)
    check("launcher module loaded", _runtime.sycl_module() is not None, str(_runtime.import_error()))
    lib = _runtime.loaded_sycl_library() or ""
    check(f"runs on {args.soname} from this environment",
          os.path.basename(lib) == args.soname and lib.startswith(sys.prefix), lib)
    C = _runtime.sycl_module()
    has_device = bool(C is not None and C.cpu_device_available())
    check("reports that no SYCL CPU device is available", not has_device)
    check("CPU tensors take the PyTorch fallback", _runtime.cpu_backend() == "torch")

    a, b = torch.randn(6, 16), torch.randn(2, 16, 8)
    got = moe_xpu.moe_gemm(a, b, torch.tensor([2, 6], dtype=torch.int32))
    want = torch.cat([a[:2] @ b[0], a[2:] @ b[1]])
    check("moe_gemm on the fallback matches PyTorch", torch.allclose(got, want, atol=1e-5))

    os.environ["MOE_XPU_BACKEND"] = "sycl"
    try:
        moe_xpu.moe_gemm(a, b, torch.tensor([2, 6], dtype=torch.int32))
        check("MOE_XPU_BACKEND=sycl is refused", False, "no error raised")
    except RuntimeError as e:
        check("MOE_XPU_BACKEND=sycl is refused", "no SYCL CPU device" in str(e), str(e))
    finally:
        del os.environ["MOE_XPU_BACKEND"]

    info = subprocess.run([sys.executable, "-I", "-m", "moe_xpu", "info"], capture_output=True, text=True)
    check("`python -m moe_xpu info` names the runtime and the missing device",
          info.returncode == 0 and args.soname in info.stdout and "SYCL CPU device  none" in info.stdout,
          info.stdout + info.stderr)

    passed = sum(checks)
    print(f"runtime-generation: {passed} passed, {len(checks) - passed} failed")
    return 0 if passed == len(checks) else 1


if __name__ == "__main__":
    sys.exit(main())
