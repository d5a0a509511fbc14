"""What the kernels require of a device is requested, checked after every build, and refused
loudly when missing; launches go to queues moe_xpu did not create; dpctl may be imported first."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import moe_xpu
from moe_xpu import isa, ops
from reference import assert_matches_reference

DTYPE_PAIRS = [("float32", "float32"), ("bfloat16", "bfloat16"), ("bfloat16", "float32"),
               ("float16", "float16")]


@pytest.mark.parametrize("dtype,out_dtype", DTYPE_PAIRS)
def test_every_built_kernel_runs_with_the_sub_group_size_it_requires(C, dtype, out_dtype):
    """Each kernel of the bundle was compiled requiring sub-groups of 16 and got exactly 16, and
    the local memory each declares fits the device."""
    reports = C.kernel_report(0, getattr(C.DType, dtype), getattr(C.DType, out_dtype))
    assert len(reports) >= 6  # K-split plain and gated, N-split: decode and tall tiles each
    device = C.device_info(0)
    for r in reports:
        assert r.required_sub_group_size == 16, r.name
        assert r.compiled_sub_group_size == 16, r.name
        assert r.max_work_group_size >= 16, r.name
        assert 0 <= r.local_memory_bytes <= device.local_mem_size, r.name


def _source_without_requirement(C, kernel: str, file: str = "moe_gemm.cpp") -> str:
    """The kernel source with the sub-group requirement of one kernel replaced by the bare
    sub_group_size property (a hint the runtime compiler does not honour)."""
    source = dict(C.kernel_files())[file]
    marker = f"MOE_XPU_KERNEL\nvoid {kernel}("
    assert source.count(marker) == 1, f"{kernel} is no longer declared with MOE_XPU_KERNEL"
    hint = ("SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::nd_range_kernel<1>))\n"
            "SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::sub_group_size<16>))\n")
    return source.replace(marker, f"{hint}void {kernel}(")


@pytest.mark.parametrize("kernel,layout", [("moe_gemm_k_lanes", "linear"), ("moe_gemm_n_lanes", "kn"),
                                           ("moe_gemm_quant", "int8"), ("moe_gemm_k_fma", "fma"),
                                           ("moe_gemm_n_fma", "fma_kn")])
def test_kernel_without_sub_group_requirement_is_refused(C, kernel, layout, tmp_path, monkeypatch):
    """Removing the requirement from one kernel makes every launch fail with a RuntimeError
    naming the device, the property and the fallback, on every CPU target (on AVX-512 targets
    the compiler happens to pick 16 anyway: the check does not rely on that). The quantized and
    the FMA kernels' sources are swapped through their own variables."""
    if layout.startswith("fma") and not C.device_description(0)["fma_dot"]:
        pytest.skip(f"no FMA dot-product kernels here: {C.fma_dot_state()}")
    if layout == "fma_kn" and C.device_description(0)["vector_width"] != 8:
        pytest.skip("the N-contiguous FMA kernel is AVX2's")
    quant = layout == "int8"
    fma_source = ("moe_gemm_fma.cpp", "MOE_XPU_FMA_KERNEL_SOURCE")
    file, variable = {"int8": ("moe_gemm_quant.cpp", "MOE_XPU_QUANT_KERNEL_SOURCE"), "fma": fma_source,
                      "fma_kn": fma_source}.get(layout, ("moe_gemm.cpp", "MOE_XPU_KERNEL_SOURCE"))
    path = tmp_path / "unpinned.cpp"
    path.write_text(_source_without_requirement(C, kernel, file))
    monkeypatch.setenv(variable, str(path))
    monkeypatch.setattr(ops, "_PREPARED", type(ops._PREPARED)())  # prepared calls keep their kernel
    a = torch.randn(8, 32)
    # [E, K, N] weights: N = 40 for the vector kernel (the FMA kernel takes whole 16-column tiles).
    b = {"kn": torch.randn(2, 32, 40), "fma_kn": torch.randn(2, 32, 48)}.get(layout, torch.randn(2, 48, 32).transpose(1, 2))
    if layout == "fma":  # bf16 B: the family's on AVX2 and AVX-512 alike
        a, b = a.bfloat16(), b.bfloat16()
    if quant:
        b = moe_xpu.quantize_experts(b, "int8")
    device = C.device_info(0).name
    with pytest.raises(RuntimeError, match="sub-group size") as info:
        moe_xpu.moe_gemm(a, b, torch.tensor([3, 8], dtype=torch.int32))
    message = str(info.value)
    assert device in message and kernel in message and "MOE_XPU_BACKEND=torch" in message


def _run_python(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MOE_XPU_KERNEL_SOURCE", "MOE_XPU_QUANT_KERNEL_SOURCE", "MOE_XPU_FMA_KERNEL_SOURCE")}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, timeout=600)


CHECK_GEMM = """
    a = torch.randn(10, 64); b = torch.randn(3, 64, 40)
    offs = torch.tensor([4, 4, 10], dtype=torch.int32)
    want = torch.cat([a[:4] @ b[0], a[4:] @ b[2]])
    got = moe_xpu.moe_gemm(a, b, offs)
    assert (got - want).abs().max() < 1e-4, (got - want).abs().max()
    print("ok")
"""


@pytest.mark.parametrize("prelude", [
    "import dpctl\nimport torch\nimport moe_xpu\n",
    "import dpctl\nimport torch\nq = dpctl.SyclQueue('cpu')\nimport moe_xpu\n",
    "import torch\nimport moe_xpu\nimport dpctl\nq = dpctl.SyclQueue('cpu')\n",
], ids=["dpctl-first", "dpctl-queue-first", "moe_xpu-first"])
def test_dpctl_in_the_same_process(C, prelude):
    """dpctl loads the SYCL runtime through another path; the runtime compiler still finds its
    headers and moe_xpu's kernels build and run, in either import order."""
    proc = _run_python(prelude + textwrap.dedent(CHECK_GEMM))
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_launch_on_a_queue_moe_xpu_did_not_create(C):
    """The XPU path hands the launcher the address of torch's current queue; here a dpctl queue
    on the CPU device stands in for it (same integer form). The queue is first blocked by a
    kernel that spins on a flag: moe_xpu's launch must return at once without running (its work
    is queued behind the spinner, on that queue), and produce the right result once released."""
    dpctl = pytest.importorskip("dpctl")
    import dpctl.memory as dpmem
    import dpctl.program as dpprog

    queue = dpctl.SyclQueue("cpu", property="in_order")
    assert C.device_info(queue.addressof_ref()).name == C.device_info(0).name
    spinner = dpprog.create_program_from_source(
        queue, "kernel void wait_for_flag(volatile global int* flag) { while (flag[0] == 0) {} }"
    ).get_sycl_kernel("wait_for_flag")
    flag = dpmem.MemoryUSMShared(4, queue=queue)
    flag_view = memoryview(flag).cast("i")

    T, E, K, N = 37, 5, 96, 72
    a = torch.randn(T, K)
    b = torch.randn(E, N, K).transpose(1, 2)
    group_offsets = torch.tensor([0, 9, 9, 30, 37], dtype=torch.int32)
    gather_index = torch.randint(0, T, (37,), dtype=torch.int64)
    out = torch.full((37, N), float("nan"))
    args = ops.gemm_args(a, b, group_offsets, gather_index, None, out)
    args.queue = queue.addressof_ref()
    C.warm_up(args.queue, args.dtype, args.out_dtype)  # build outside the timed window

    flag_view[0] = 0
    spinning = queue.submit_async(spinner, [flag], [1])
    try:
        C.moe_gemm(args)
        time.sleep(0.2)
        assert torch.isnan(out).all(), "the kernel ran although its queue was blocked"
        assert spinning.execution_status != dpctl.event_status_type.complete
    finally:
        flag_view[0] = 1
        queue.wait()
    assert_matches_reference(out, a, b, group_offsets, gather_index)


@pytest.mark.parametrize("inherited", [None, "cpu-target-skx"])
def test_each_cpu_target_gets_its_own_kernel_cache(tmp_path, inherited):
    """The runtime's persistent cache does not key device binaries by the OpenCL CPU target (a
    binary built for skx was handed to a core-avx2 process: UR_RESULT_ERROR_INVALID_BINARY), so
    moe_xpu puts each target's binaries in a directory of its own, also when the variable was
    inherited from a process that imported moe_xpu under another target."""
    base = tmp_path if inherited is None else tmp_path / inherited
    env = dict(os.environ, SYCL_CACHE_DIR=str(base), CL_CONFIG_CPU_TARGET_ARCH="core-avx2")
    out = subprocess.run([sys.executable, "-c", "import os, moe_xpu; print(os.environ['SYCL_CACHE_DIR'])"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out == str(tmp_path / "cpu-target-core-avx2")


@pytest.mark.parametrize("target,vector_class", [("corei7", "sse"), ("core-avx2", "avx2"), ("skx", "avx512")])
def test_tiles_follow_the_vector_class_of_the_cpu_target(target, vector_class):
    """The tile tables are chosen per vector class: the CPU's width, capped by the compiler target."""
    if vector_class in isa.LIMITS and vector_class not in isa.host_classes():
        pytest.skip(f"this CPU cannot execute {target} code (no {vector_class})")
    probe = ("from moe_xpu import _runtime; d = _runtime.sycl_module().device_description(0); "
             "print(d['vector_class'], d['vector_width'], d['k_lanes_tiles'][1])")
    env = dict(os.environ, CL_CONFIG_CPU_TARGET_ARCH=target)
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    name, width, prefill_tile = out.stdout.split(maxsplit=2)
    assert name == vector_class and int(width) == {"sse": 4, "avx2": 8, "avx512": 16}[vector_class]
    if vector_class != "avx512":  # narrower registers, smaller register tile
        rows, cols = eval(prefill_tile)
        assert rows * cols < 24


def test_cpu_tile_table_override_sets_float32_n_split_tiles_apart():
    """MOE_XPU_CPU_TILES replaces the CPU tile table; its f= part gives float32 B its own N-split
    tiles (16-bit B keeps the n= ones), and the kernels built for them match the reference."""
    code = """
        import os
        os.environ["MOE_XPU_CPU_TILES"] = "k=1x8,2x2;n=1x128,2x2;f=1x128,5x1"
        import torch, moe_xpu
        from moe_xpu import _runtime
        C = _runtime.sycl_module()
        assert C.tile_shapes(False) == [(1, 128), (5, 1)], C.tile_shapes(False)
        assert C.tile_shapes(False, dtype=C.DType.bfloat16) == [(1, 128), (2, 2)]
        assert C.tile_shapes(True) == [(1, 8), (2, 2)]
        torch.manual_seed(0)
        a = torch.randn(37, 45, dtype=torch.float64); b = torch.randn(3, 45, 70, dtype=torch.float64)
        offs = torch.tensor([11, 11, 37], dtype=torch.int32)  # an empty expert, 11 and 26 rows
        for dtype in (torch.float32, torch.bfloat16):
            got = moe_xpu.moe_gemm(a.to(dtype), b.to(dtype), offs).double()
            ref = torch.cat([a[:11].to(dtype).double() @ b[0].to(dtype).double(),
                             a[11:].to(dtype).double() @ b[2].to(dtype).double()])
            tol = 1e-3 if dtype == torch.float32 else 0.25
            assert (got - ref).abs().max() < tol, (dtype, (got - ref).abs().max())
        print("ok")
    """
    out = _run_python(code)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_the_launcher_runs_on_this_environments_runtime(C):
    """moe_xpu._C links the SYCL runtime of the environment it was built for and finds the CPU
    device there (a wheel once shipped a module built against another environment's runtime, and
    every CPU call quietly took the plain-PyTorch fallback)."""
    from moe_xpu import _runtime

    loaded = os.path.realpath(_runtime.loaded_sycl_library())
    assert loaded.startswith(os.path.realpath(sys.prefix) + os.sep), loaded
    assert os.environ.get("MOE_XPU_BACKEND", "auto") != "auto" or _runtime.cpu_backend() == "sycl"
