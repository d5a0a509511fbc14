"""Loads the SYCL launcher (moe_xpu._C) and decides which backend runs CPU tensors.

The SYCL runtime reads its environment when it first loads, so the variables below are set
before ``_C`` is imported: the OpenCL CPU driver shipped in the ``intel-opencl-rt`` wheel (its ICD
file holds a placeholder path), the runtime's persistent kernel cache, and on CPUs with AMX the
OpenCL CPU compiler's target (its default target has no matrix engine; with this one the bf16
matrix-engine kernels compile to AMX instructions).
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import torch

from moe_xpu import isa


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "moe_xpu", "sycl")


def _cpu_has_amx_bf16() -> bool:
    return {"amx_bf16", "amx_tile"} <= isa.cpu_flags()


def _opencl_cpu_runtime_loaded() -> bool:
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
            return any("libintelocl" in line for line in f)
    except OSError:
        return False


def _load_jit_compiler_by_canonical_path() -> None:
    """The SYCL runtime compiler (libsycl-jit.so) finds its own headers from the path it was
    loaded under, which must end in ``/lib/libsycl-jit.so``. libsycl loads it lazily from its own
    directory, as spelled by whoever loaded libsycl: dpctl's modules reach it through the RPATH
    ``$ORIGIN/../../..``, so after ``import dpctl`` the path ends in ``/../libsycl-jit.so`` and
    every kernel build fails with "Could not locate DPCPP root directory". Loading it first under
    its real path makes the loader hand that same copy, under that name, to libsycl later."""
    jit = Path(sys.prefix) / "lib" / "libsycl-jit.so"
    if jit.exists():
        try:
            ctypes.CDLL(os.path.realpath(jit), mode=os.RTLD_GLOBAL | os.RTLD_NOW)
        except OSError:
            pass  # no usable runtime: the import of _C below reports it


def _prepare_environment() -> None:
    _load_jit_compiler_by_canonical_path()
    ocl_cpu = Path(sys.prefix) / "lib" / "libintelocl.so"
    if ocl_cpu.exists():
        os.environ.setdefault("OCL_ICD_FILENAMES", str(ocl_cpu))
    os.environ.setdefault("SYCL_CACHE_PERSISTENT", "1")
    os.environ.setdefault("SYCL_CACHE_DIR", _default_cache_dir())
    if _cpu_has_amx_bf16() and "CL_CONFIG_CPU_TARGET_ARCH" not in os.environ:
        if _opencl_cpu_runtime_loaded():
            # Too late: the OpenCL CPU compiler (loaded by dpctl or another SYCL user before us)
            # has read its target already, and would abort on matrix-engine code. Vector kernels.
            os.environ.setdefault("MOE_XPU_MATRIX_ENGINE", "0")
        else:
            os.environ["CL_CONFIG_CPU_TARGET_ARCH"] = "sapphirerapids"
    _separate_cache_per_cpu_target()


def _separate_cache_per_cpu_target() -> None:
    """The runtime's persistent cache keys a device binary by device and intermediate code, not by
    the OpenCL CPU compiler's target: a binary built for one target (skx) was handed to a process
    compiling for another (core-avx2), which failed with UR_RESULT_ERROR_INVALID_BINARY. So each
    target gets its own subdirectory of SYCL_CACHE_DIR."""
    target = os.environ.get("CL_CONFIG_CPU_TARGET_ARCH") or "default"
    base = os.path.normpath(os.environ["SYCL_CACHE_DIR"])
    if os.path.basename(base).startswith("cpu-target-"):  # inherited from a process that imported moe_xpu
        base = os.path.dirname(base)
    os.environ["SYCL_CACHE_DIR"] = os.path.join(base, f"cpu-target-{target}")


_prepare_environment()

try:
    from moe_xpu import _C  # noqa: E402  (after the environment is prepared)

    _IMPORT_ERROR: Exception | None = None
except ImportError as exc:  # the runtime or the built module is missing: plain-PyTorch fallback
    _C = None
    _IMPORT_ERROR = exc

_cpu_device: bool | None = None


def sycl_module():
    """The launcher module, or None when it could not be loaded."""
    return _C


def import_error() -> Exception | None:
    return _IMPORT_ERROR


def requested_backend() -> str:
    """MOE_XPU_BACKEND: "auto" (default), "sycl" or "torch"."""
    value = os.environ.get("MOE_XPU_BACKEND", "auto").strip().lower() or "auto"
    if value not in ("auto", "sycl", "torch"):
        raise ValueError(f"MOE_XPU_BACKEND must be 'auto', 'sycl' or 'torch', got {value!r}")
    return value


_cpu_backend_memo: tuple[object, str] | None = None  # (MOE_XPU_BACKEND as read, the answer)
# os.environ's own dict (what os.environ.get reads, with keys encoded): an unset variable makes
# os.environ.get raise and catch a KeyError inside, a few microseconds on every call.
_ENVIRON_DATA = getattr(os.environ, "_data", None)
_BACKEND_KEY = os.environ.encodekey("MOE_XPU_BACKEND") if _ENVIRON_DATA is not None else None


def cpu_backend() -> str:
    """Backend for CPU tensors: "sycl" (kernels on the SYCL CPU device) or "torch" (fallback).
    Asked on every call, so the answer is kept until MOE_XPU_BACKEND changes."""
    global _cpu_backend_memo
    raw = _ENVIRON_DATA.get(_BACKEND_KEY) if _ENVIRON_DATA is not None else os.environ.get("MOE_XPU_BACKEND")
    if _cpu_backend_memo is not None and _cpu_backend_memo[0] == raw:
        return _cpu_backend_memo[1]
    answer = _choose_cpu_backend()
    _cpu_backend_memo = (raw, answer)
    return answer


def _choose_cpu_backend() -> str:
    global _cpu_device
    requested = requested_backend()
    if requested == "torch":
        return "torch"
    if _C is not None and _cpu_device is None:
        _cpu_device = bool(_C.cpu_device_available())
    available = _C is not None and bool(_cpu_device)
    if requested == "sycl" and not available:
        reason = _IMPORT_ERROR if _C is None else "no SYCL CPU device was found"
        raise RuntimeError(f"MOE_XPU_BACKEND=sycl but the SYCL CPU path is unavailable: {reason}")
    return "sycl" if available else "torch"


def queue_address(device: torch.device) -> int:
    """Address of the sycl::queue to launch on: torch's current XPU stream, 0 for the CPU device."""
    if device.type == "cpu":
        return 0
    if device.type == "xpu":
        queue = torch.xpu.current_stream(device).sycl_queue
        if not isinstance(queue, int):  # older IPEX builds hand out a capsule
            raise RuntimeError("moe_xpu needs torch.xpu streams that expose sycl_queue as an address")
        return queue
    return 0


def loaded_sycl_library() -> str | None:
    """Path of the libsycl the launcher runs on (its soname says the runtime generation:
    libsycl.so.8 is oneAPI 2025.x, libsycl.so.9 is 2026.x), or None when none is loaded."""
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
            for line in f:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libsycl.so"):
                    return path
    except OSError:
        pass
    return None


def cache_dir() -> str:
    return os.environ.get("SYCL_CACHE_DIR", "")
