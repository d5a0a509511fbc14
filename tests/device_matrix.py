"""Runs the correctness tests once per CPU code-generation target this host can execute.

The OpenCL CPU runtime compiles kernels for the target named by CL_CONFIG_CPU_TARGET_ARCH (read
when the runtime loads), and a kernel that leans on a property it did not request (its sub-group
size, above all) can be right on one target and wrong on another. So besides the full suite on
the host's default target (``make test`` runs that first), every kernel family is run again
under each older target the CPU can execute, one process per target, each with its own kernel
cache, and with an odd persistent-worker count (MOE_XPU_NUM_WORKERS) so the scheduler's uneven
shares are covered too, every launch on the runtime's thread pool (MOE_XPU_INLINE_FLOPS=0: the
default suite runs its small launches on the calling thread, one work-group after another, which
would hide work-groups racing each other).

    python tests/device_matrix.py [--targets corei7,core-avx2] [-- extra pytest arguments]

Prints one summary line per target and a closing ``matrix: N passed, N failed, N skipped``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from moe_xpu.isa import cpu_flags

ROOT = Path(__file__).resolve().parent.parent

# OpenCL CPU targets, oldest first, with the CPU flags (/proc/cpuinfo) each needs to execute.
TARGETS = {
    "corei7": {"sse4_2", "popcnt"},
    "corei7-avx": {"sse4_2", "popcnt", "avx"},
    "core-avx2": {"sse4_2", "popcnt", "avx", "avx2", "fma", "bmi2", "f16c"},
    "skx": {"avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"},
    "sapphirerapids": {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_bf16", "amx_tile"},
}

# Every kernel family, tile path, dtype, weight layout, index-table use, the fused op and the
# transformers integration; the host-only tests (argument errors, opcheck, torch.compile, bench)
# do not depend on the code-generation target and run once, in the default-target suite.
TEST_FILES = [
    "tests/test_moe_gemm.py",
    "tests/test_moe_gemm_backward.py",
    "tests/test_fused_moe.py",
    "tests/test_fused_moe_backward.py",
    "tests/test_matrix_engine.py",
    "tests/test_transformers_integration.py",
    "tests/test_portability.py",
    "tests/test_gpu_variants.py",
    # the AVX2 FMA kernels, which an AVX-512 host runs only under core-avx2
    "tests/test_fma_dot.py",
    "tests/test_fma_kn.py",
    # the quantized kernels: every format on the breaking shapes, and W8A8
    "tests/test_quant.py::test_formats_float32_on_breaking_shapes",
    "tests/test_quant.py::test_w8a8",
]

# An odd worker count: share boundaries fall mid-group and mid-unit (the default is even).
MATRIX_WORKERS = "7"


def host_targets(flags: set[str]) -> list[str]:
    """Targets the host can execute, but for the vector classes other runs already cover: the
    default run's own (skx where the host's default target is AVX-512 without AMX; moe_xpu selects
    the AMX target itself on AMX CPUs) and corei7-avx where core-avx2 runs (both 8-lane vectors in
    16 registers, the same tile table)."""
    chosen = "CL_CONFIG_CPU_TARGET_ARCH" in os.environ
    amx_default = {"amx_bf16", "amx_tile"} <= flags and not chosen
    executable = [t for t, needs in TARGETS.items() if needs <= flags]
    skip = {"sapphirerapids"} if amx_default else set()
    if "core-avx2" in executable:
        skip.add("corei7-avx")
    if "skx" in executable and not amx_default and not chosen:
        skip.add("skx")
    return [t for t in executable if t not in skip]


def run_target(target: str, pytest_args: list[str]) -> tuple[dict[str, int], int, float]:
    env = dict(os.environ)
    env["CL_CONFIG_CPU_TARGET_ARCH"] = target
    env["MOE_XPU_NUM_WORKERS"] = MATRIX_WORKERS
    env["MOE_XPU_INLINE_FLOPS"] = "0"
    # (moe_xpu gives each target its own kernel cache directory: moe_xpu/_runtime.py.)
    env["SYCL_CACHE_PERSISTENT"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TEST_FILES, *pytest_args]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.monotonic() - start
    counts = {k: 0 for k in ("passed", "failed", "skipped", "error", "errors")}
    lines = proc.stdout.strip().splitlines()
    summary = lines[-1] if lines else ""
    for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary):
        counts[word] += int(n)
    if proc.returncode != 0:
        sys.stdout.write(proc.stdout[-20000:])
        sys.stdout.write(proc.stderr[-5000:])
    return counts, proc.returncode, seconds


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1:]
        argv = argv[:argv.index("--")]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", help="comma-separated targets (default: all the host executes)")
    args = parser.parse_args(argv)
    flags = cpu_flags()
    targets = args.targets.split(",") if args.targets else host_targets(flags)
    for t in targets:
        if t not in TARGETS:
            parser.error(f"unknown target {t!r}; known: {', '.join(TARGETS)}")
        if not TARGETS[t] <= flags:
            parser.error(f"this CPU cannot execute code for {t} (missing {sorted(TARGETS[t] - flags)})")
    total = {"passed": 0, "failed": 0, "skipped": 0}
    failed_targets = []
    for t in targets:
        counts, rc, seconds = run_target(t, extra)
        errors = counts["error"] + counts["errors"]
        print(f"target {t:15s} workers {MATRIX_WORKERS}: {counts['passed']} passed, "
              f"{counts['failed'] + errors} failed, {counts['skipped']} skipped in {seconds:.0f} s"
              + ("" if rc == 0 else f" (pytest exit {rc})"), flush=True)
        total["passed"] += counts["passed"]
        total["failed"] += counts["failed"] + errors
        total["skipped"] += counts["skipped"]
        if rc != 0:
            failed_targets.append(t)
            total["failed"] += 0 if counts["failed"] + errors else 1  # a run that died counts
    print(f"matrix: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
    return 1 if failed_targets else 0


if __name__ == "__main__":
    sys.exit(main())
