"""Instruction-set classes of x86 CPUs, and running a moe_xpu tool limited to one of them.

A limit applies to moe_xpu (the OpenCL CPU compiler's target) and to torch alike (ATen's
vectorised kernels, oneDNN and MKL), so that moe_xpu, its peers and the roofline's compute
ceiling are measured under the same instruction set. Every variable is read once, when its
library loads: a limited run is a new process (``rerun_limited``).
"""

from __future__ import annotations

import os
import subprocess
import sys

#: Environment of each class. "native" limits nothing (on AMX CPUs moe_xpu then uses AMX).
LIMITS: dict[str, dict[str, str]] = {
    "avx2": {"CL_CONFIG_CPU_TARGET_ARCH": "core-avx2", "ATEN_CPU_CAPABILITY": "avx2",
             "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "MOE_XPU_MATRIX_ENGINE": "0"},
    "avx512": {"CL_CONFIG_CPU_TARGET_ARCH": "skx", "ATEN_CPU_CAPABILITY": "avx512",
               "ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "MKL_ENABLE_INSTRUCTIONS": "AVX512",
               "MOE_XPU_MATRIX_ENGINE": "0"},
    "native": {},
}
# /proc/cpuinfo flags a class needs.
_NEEDS = {"avx2": {"avx2", "fma"}, "avx512": {"avx512f", "avx512bw", "avx512dq", "avx512vl"}, "native": set()}
_MARKER = "MOE_XPU_ISA"  # set in the limited process: which class it runs under


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def host_classes() -> list[str]:
    """The classes this host can run, narrowest first ("native" last)."""
    flags = cpu_flags()
    return [name for name in LIMITS if _NEEDS[name] <= flags]


def current() -> str:
    """The class this process runs under ("native" unless started by rerun_limited)."""
    return os.environ.get(_MARKER, "native")


def describe(name: str) -> str:
    limit = LIMITS[name]
    if not limit:
        return "native (no limit)"
    return (f"{name} (moe_xpu: OpenCL CPU target {limit['CL_CONFIG_CPU_TARGET_ARCH']}; torch: ATen "
            f"{limit['ATEN_CPU_CAPABILITY']}, oneDNN {limit['ONEDNN_MAX_CPU_ISA']}, MKL {limit['MKL_ENABLE_INSTRUCTIONS']})")


def rerun_limited(name: str, module: str, argv: list[str]) -> int | None:
    """Runs ``python -m module argv`` under class ``name`` and returns its exit code, or None when
    this process already runs under it (the caller then goes on)."""
    if name not in LIMITS:
        raise ValueError(f"unknown instruction-set class {name!r}: one of {sorted(LIMITS)}")
    if current() == name:
        return None
    if name not in host_classes():
        raise SystemExit(f"this CPU cannot run {name} code (needs {sorted(_NEEDS[name])})")
    limited = {key for limit in LIMITS.values() for key in limit}
    env = {k: v for k, v in os.environ.items() if k not in limited}
    env.update(LIMITS[name])
    env[_MARKER] = name
    return subprocess.run([sys.executable, "-m", module, *argv], env=env).returncode


if __name__ == "__main__":  # python -m moe_xpu.isa: the class, CPU target and ATen capability in force
    import torch

    print(current(), os.environ.get("CL_CONFIG_CPU_TARGET_ARCH", "default"), torch.backends.cpu.get_cpu_capability())
