"""python -m moe_xpu.gpu_check: compile every kernel variant for Intel GPUs and check the result.

No Intel GPU is needed. For each target the launcher's own variant choice, evaluated for that
GPU's description, names the kernels it can pick (every dtype pair, tile shape and epilogue; the
weight layout and index table are run-time arguments of the same kernels). They are built on the
SYCL CPU device, whose runtime compiler emits device-independent SPIR-V; Intel's GPU compiler
(ocloc + IGC, from Debian's testing or unstable suite, unpacked into a cache folder, nothing
installed system-wide) compiles that SPIR-V for the target, and the tool reads each kernel's SIMD
width, register file, spills and SLM from the binary's ``.ze_info`` and counts DPAS (XMX)
instructions in IGC's assembly dump.

Exits non-zero if any kernel fails to compile, has no required sub-group size, compiles at
another SIMD width than it requires, spills, asks for more SLM than the target gives a
work-group, or is a matrix-engine variant without DPAS.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from moe_xpu import _runtime

DEFAULT_TARGETS = ("pvc", "bmg", "lnl", "dg2", "mtl", "ptl")
DTYPE_PAIRS = (("float32", "float32"), ("bfloat16", "bfloat16"), ("bfloat16", "float32"),
               ("float16", "float16"), ("float16", "float32"))
# Quantized weights (B format, output dtype): float32 output bundles hold every activation dtype
# (and W8A8 for int8), bfloat16 ones the bf16 activations models run in.
QUANT_PAIRS = tuple((fmt, out) for fmt in ("int8", "int4", "fp8_e4m3", "mxfp4") for out in ("bfloat16", "float32"))
COMPILER_PACKAGES = ("intel-ocloc", "libigc2", "libigdfcl2", "libigdgmm12",
                     "libc6", "libstdc++6", "libgcc-s1", "zlib1g")
COMPILER_SUITES = ("forky", "sid")  # Debian testing, then unstable
AMX_TARGET = "graniterapids"  # AMX-BF16 and AMX-FP16: compiles bf16 and fp16 joint_matrix


class GpuCheckError(RuntimeError):
    pass


def default_compiler_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moe_xpu" / "intel-gpu-compiler"


# ---------------------------------------------------------------------------------------------
# Fetching Intel's GPU compiler
# ---------------------------------------------------------------------------------------------

def _debian_mirror() -> str:
    """The Debian mirror this machine's apt sources already name."""
    for path in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")) + [Path("/etc/apt/sources.list")]:
        try:
            text = path.read_text()
        except OSError:
            continue
        for match in re.finditer(r"^(?:URIs:\s*|deb\s+(?:\[[^\]]*\]\s*)?)(\S+)", text, re.M):
            uri = match.group(1)
            if uri.rstrip("/").endswith("/debian"):
                return uri.rstrip("/")
    raise GpuCheckError("no Debian mirror found in /etc/apt/sources.list.d/*.sources or "
                        "/etc/apt/sources.list: the GPU compiler comes from Debian's archive")


@dataclass
class Compiler:
    root: Path

    @property
    def libdir(self) -> Path:
        return self.root / "usr" / "lib" / "x86_64-linux-gnu"

    @property
    def ocloc(self) -> Path:
        found = sorted((self.root / "usr" / "bin").glob("ocloc-*"))
        if not found:
            raise GpuCheckError(f"no ocloc-* under {self.root / 'usr' / 'bin'}")
        return found[-1]

    def version(self) -> str:
        return self.ocloc.name.removeprefix("ocloc-")

    def command(self, *args: str) -> list[str]:
        # Run through the unpacked glibc's loader: ocloc needs a newer glibc and libstdc++ than
        # the host's, and they stay inside the cache folder.
        return [str(self.libdir / "ld-linux-x86-64.so.2"), "--library-path", str(self.libdir),
                str(self.ocloc), *args]


def fetch_compiler(folder: Path) -> Compiler:
    """The compiler unpacked in ``folder``, downloaded first if it is not there."""
    folder = folder.resolve()
    root = folder / "root"
    if list((root / "usr" / "bin").glob("ocloc-*")) and (root / "usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2").exists():
        return Compiler(root)
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        raise GpuCheckError("fetching Intel's GPU compiler needs apt-get and dpkg (Debian's tools)")
    mirror = _debian_mirror()
    errors = []
    for suite in COMPILER_SUITES:
        work = folder / f"apt-{suite}"
        shutil.rmtree(work, ignore_errors=True)
        (work / "lists" / "partial").mkdir(parents=True)
        (work / "debs").mkdir()
        (work / "sources.list").write_text(f"deb {mirror} {suite} main\n")
        opts = ["-o", f"Dir::Etc::SourceList={work / 'sources.list'}", "-o", "Dir::Etc::SourceParts=/dev/null",
                "-o", f"Dir::State::Lists={work / 'lists'}", "-o", "APT::Sandbox::User=root"]
        update = subprocess.run(["apt-get", *opts, "update"], capture_output=True, text=True)
        if update.returncode != 0:
            errors.append(f"{suite}: apt-get update failed: {update.stderr.strip()[-500:]}")
            continue
        download = subprocess.run(["apt-get", *opts, "download", *COMPILER_PACKAGES], cwd=work / "debs",
                                  capture_output=True, text=True)
        if download.returncode != 0:
            errors.append(f"{suite}: apt-get download {' '.join(COMPILER_PACKAGES)} failed: "
                          f"{download.stderr.strip()[-500:]}")
            continue
        shutil.rmtree(root, ignore_errors=True)
        for deb in sorted((work / "debs").glob("*.deb")):
            subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True)
        shutil.rmtree(work / "lists", ignore_errors=True)
        return Compiler(root)
    raise GpuCheckError("could not fetch Intel's GPU compiler (packages " + ", ".join(COMPILER_PACKAGES) +
                        ") from Debian " + " or ".join(COMPILER_SUITES) + ":\n" + "\n".join(errors))


# ---------------------------------------------------------------------------------------------
# Reading what the compiler made
# ---------------------------------------------------------------------------------------------

def elf_section(data: bytes, wanted: str) -> bytes | None:
    """One section of a 64-bit little-endian ELF file (a zebin) by name."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise GpuCheckError("the compiler's output is not a 64-bit ELF (zebin)")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_offset = headers[shstrndx][4]
    for h in headers:
        name_end = data.index(b"\0", names_offset + h[0])
        if data[names_offset + h[0]:name_end].decode() == wanted:
            return data[h[4]:h[4] + h[5]]
    return None


@dataclass
class KernelBuild:
    name: str            # moe_xpu's variant name
    required_simd: int   # intel_reqd_sub_group_size (0: none)
    simd: int
    grf: int
    spill: int
    slm: int
    dpas: int = 0


def _field(block: str, key: str) -> int:
    m = re.search(rf"^\s+{key}:\s+(\d+)", block, re.M)
    return int(m.group(1)) if m else 0


def parse_ze_info(text: str) -> dict[str, KernelBuild]:
    """Per-kernel facts from a zebin's .ze_info (YAML), keyed by mangled name."""
    kernels_part = text.split("\nkernels:", 1)[1] if "\nkernels:" in text else text
    kernels_part = re.split(r"\n\S", kernels_part, maxsplit=1)[0]  # up to the next top-level key
    builds = {}
    for block in re.split(r"\n  - name:\s+", "\n" + kernels_part)[1:]:
        mangled = block.split("\n", 1)[0].strip()
        builds[mangled] = KernelBuild(
            name=mangled, required_simd=_field(block, "intel_reqd_sub_group_size"),
            simd=_field(block, "simd_size"), grf=_field(block, "grf_count"),
            spill=_field(block, "spill_size"), slm=_field(block, "slm_size"))
    return builds


def count_dpas(dump_dir: Path) -> dict[str, int]:
    """DPAS instructions per kernel (mangled name) in IGC's assembly dump."""
    counts: dict[str, int] = {}
    for asm in dump_dir.glob("*.asm"):
        lines = asm.read_text(errors="replace").splitlines()
        if not lines or not lines[0].startswith("//.kernel "):
            continue
        name = lines[0].split(None, 1)[1].strip()
        counts[name] = counts.get(name, 0) + sum(1 for line in lines if re.match(r"\s*(\(.*?\)\s*)?dpas", line))
    return counts


def demangle(names: list[str]) -> dict[str, str]:
    """Mangled kernel name -> moe_xpu's variant name (moe_xpu::moe_gemm_<family><args>)."""
    out = {n: n for n in names}
    if shutil.which("c++filt") is None:
        return out
    proc = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    for mangled, plain in zip(names, proc.stdout.splitlines()):
        plain = plain.replace("__sycl_kernel_", "")
        depth, end = 0, len(plain)
        for i, ch in enumerate(plain):  # cut the parameter list after the template arguments
            if ch == "<":
                depth += 1
            elif ch == ">":
                depth -= 1
            elif ch == "(" and depth == 0:
                end = i
                break
        out[mangled] = plain[:end].removeprefix("void ").strip()
    return out


def _canonical(name: str) -> str:
    """A variant name as the demangler spells it (uint16_t and sycl::half are typedefs)."""
    return (name.replace("uint16_t", "unsigned short").replace("int8_t", "signed char")
            .replace("sycl::_V1::detail::half_impl::half", "sycl::half").replace(" ", ""))


# ---------------------------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------------------------

@dataclass
class Row:
    target: str
    dtypes: str
    build: KernelBuild
    problems: list[str]


def compile_module(compiler: Compiler, spv: Path, target: str, work: Path) -> tuple[dict[str, KernelBuild], str]:
    out_dir, dump_dir = work / "out", work / "dump"
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, IGC_ShaderDumpEnable="1", IGC_DumpToCustomDir=str(dump_dir))
    proc = subprocess.run(compiler.command("compile", "-spirv_input", "-file", str(spv), "-device", target,
                                           "-out_dir", str(out_dir), "-output", spv.stem),
                          capture_output=True, text=True, env=env)
    bins = sorted(out_dir.glob("*.bin"))
    if proc.returncode != 0 or not bins:
        return {}, (proc.stdout + proc.stderr).strip()[-3000:]
    ze_info = elf_section(bins[0].read_bytes(), ".ze_info")
    if ze_info is None:
        return {}, f"{bins[0]} has no .ze_info section"
    builds = parse_ze_info(ze_info.decode(errors="replace"))
    for mangled, n in count_dpas(dump_dir).items():
        if mangled in builds:
            builds[mangled].dpas = n
    return builds, ""


def check(targets: list[str], compiler: Compiler, spirv_out: Path | None, work: Path) -> tuple[list[Row], list[str]]:
    C = _runtime.sycl_module()
    if C is None or not C.cpu_device_available():
        raise GpuCheckError("gpu_check builds the SPIR-V on the SYCL CPU device, which is not available: "
                            f"{_runtime.import_error() or 'no SYCL CPU device'}")
    rows, failures = [], []
    spirv_of: dict[tuple, list[bytes]] = {}  # one build per distinct set of variants
    for target in targets:
        description = C.gpu_description(target)
        limit = description["local_mem_size"]
        for dtype, out_dtype in DTYPE_PAIRS + QUANT_PAIRS:
            dt, odt = getattr(C.DType, dtype), getattr(C.DType, out_dtype)
            names = tuple(C.bundle_kernel_names(0, target, dt, odt))
            if names not in spirv_of:
                # The runtime may split a bundle into several modules (by the optional device
                # features their kernels use: joint_matrix kernels come apart).
                spirv_of[names] = list(C.spirv_modules(target, dt, odt))
            label = dtype if dtype == out_dtype else f"{dtype}->{out_dtype}"
            builds, error = {}, ""
            for i, module in enumerate(spirv_of[names]):
                stem = f"{dtype}_{out_dtype}" + (f"_{i}" if len(spirv_of[names]) > 1 else "")
                spv = work / target / f"{stem}.spv"
                spv.parent.mkdir(parents=True, exist_ok=True)
                spv.write_bytes(module)
                if spirv_out is not None:
                    (spirv_out / target).mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(spv, spirv_out / target / spv.name)
                module_builds, module_error = compile_module(compiler, spv, target, work / target / stem)
                # The ISA dumps take about 1 GB over all targets: free each module's as soon as it is read.
                shutil.rmtree(work / target / stem, ignore_errors=True)
                spv.unlink()
                builds.update(module_builds)
                error = error or module_error
            if error:
                failures.append(f"{target} {label}: ocloc failed:\n{error}")
                continue
            ours = {_canonical(n): n for n in names}
            plain = demangle(list(builds))
            built = {ours.get(_canonical(plain[m]), plain[m]): b for m, b in builds.items()
                     if plain[m].startswith("moe_xpu::")}
            for name in names:
                if name not in built:
                    failures.append(f"{target} {label}: {name} is missing from the compiled module")
            if description["matrix_shapes"] and dtype in ("bfloat16", "float16"):
                if not any(n.startswith("moe_xpu::moe_gemm_matrix<") for n in names):
                    failures.append(f"{target} {label}: the target has XMX but no matrix-engine variant was chosen")
                if not any(n.startswith("moe_xpu::moe_gemm_matrix_wgrad<") for n in names):
                    failures.append(f"{target} {label}: the target has XMX but no matrix-engine weight gradient was chosen")
            if description["int8_matrix"] and dtype == "int8" and not any("moe_gemm_quant_matrix<" in n for n in names):
                failures.append(f"{target} {label}: the target has int8 XMX tiles but no W8A8 matrix-engine variant was chosen")
            xmx_16_lanes = any(shape[3] == 16 for shape in description["matrix_shapes"])
            if xmx_16_lanes and (dtype, out_dtype) in QUANT_PAIRS and not any("moe_gemm_dequant_matrix<" in n for n in names):
                failures.append(f"{target} {label}: the target has XMX on 16 lanes but no dequantizing matrix-engine variant was chosen")
            for name, b in sorted(built.items()):
                b.name = name
                problems = []
                if b.required_simd == 0:
                    problems.append("no required sub-group size")
                elif b.simd != b.required_simd:
                    problems.append(f"compiled at SIMD{b.simd}, requires {b.required_simd}")
                if b.spill > 0:
                    problems.append(f"spills {b.spill} bytes")
                if b.slm > limit:
                    problems.append(f"SLM {b.slm} > {limit} bytes a work-group gets")
                if re.search(r"moe_gemm_(quant_|dequant_)?matrix", name) and b.dpas == 0:
                    problems.append("matrix-engine variant without DPAS")
                rows.append(Row(target, label, b, problems))
                failures.extend(f"{target} {label}: {name}: {p}" for p in problems)
    return rows, failures


def print_table(rows: list[Row]) -> None:
    header = f"{'kernel variant':<72} {'target':<6} {'dtypes':<17} {'req':>4} {'SIMD':>4} {'GRF':>4} {'spill':>6} {'SLM':>7} {'DPAS':>5}  status"
    print(header)
    print("-" * len(header))
    for r in rows:
        b = r.build
        name = b.name.removeprefix("moe_xpu::moe_gemm_")
        status = "ok" if not r.problems else "; ".join(r.problems)
        print(f"{name:<72} {r.target:<6} {r.dtypes:<17} {b.required_simd:>4} {b.simd:>4} {b.grf:>4} "
              f"{b.spill:>6} {b.slm:>7} {b.dpas:>5}  {status}")


GENERATIONS = {"pvc": "Xe-HPC (Data Center GPU Max)", "bmg": "Xe2 (Arc B-series)", "lnl": "Xe2 (Lunar Lake)",
               "ptl": "Xe3 (Panther Lake)", "dg2": "Xe-HPG (Arc A-series)", "mtl": "Xe-LPG (Meteor Lake)"}


def summarize(rows: list[Row], targets: list[str], markdown: bool) -> None:
    """One line per target; with markdown, the rows of the README's Intel GPU table."""
    if markdown:
        print("| generation | ocloc target | compiled | kernels | SIMD | spills | SLM | XMX (DPAS) | executed on hardware |")
        print("| --- | --- | --- | ---: | --- | ---: | ---: | --- | --- |")
    for t in targets:
        mine = [r for r in rows if r.target == t]
        if not mine:
            continue
        simds = "/".join(map(str, sorted({r.build.simd for r in mine})))
        spills = max(r.build.spill for r in mine)
        slm = max(r.build.slm for r in mine)
        xmx = sorted({r.dtypes.split("->")[0] for r in mine if r.build.dpas})
        ok = all(not r.problems for r in mine)
        if markdown:
            used = f"used: {', '.join(xmx)}" if xmx else "none"
            print(f"| {GENERATIONS.get(t, t)} | `{t}` | {'yes' if ok else 'FAILED'} | {len(mine)} | {simds} | "
                  f"{spills} B | {slm} B | {used} | no |")
        else:
            print(f"{t}: {len(mine)} kernels compiled, SIMD {simds}, max spill {spills} B, max SLM {slm} B, "
                  f"XMX (DPAS) {'used for ' + ', '.join(xmx) if xmx else 'not used'}")


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("SYCL_CACHE_PERSISTENT") != "0" or os.environ.get("CL_CONFIG_CPU_TARGET_ARCH") != AMX_TARGET:
        # A kernel bundle loaded from the runtime's persistent cache comes back as a device binary
        # without its SPIR-V, so this process builds from source: rerun with that cache off. And
        # the CPU device compiles the XMX variants' joint_matrix code only for an AMX target, fp16
        # only for one with AMX-FP16 (compile only: nothing is launched here). The SYCL runtime
        # reads both variables when it loads.
        env = dict(os.environ, SYCL_CACHE_PERSISTENT="0", CL_CONFIG_CPU_TARGET_ARCH=AMX_TARGET)
        args = sys.argv[1:] if argv is None else argv
        return subprocess.run([sys.executable, "-m", "moe_xpu.gpu_check", *args], env=env).returncode
    parser = argparse.ArgumentParser(prog="python -m moe_xpu.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                        help="comma-separated ocloc device names (default: %(default)s)")
    parser.add_argument("--spirv-out", type=Path, help="also write the SPIR-V modules as DIR/<target>/*.spv")
    parser.add_argument("--markdown", action="store_true", help="print the summary as the README's table rows")
    parser.add_argument("--compiler-dir", type=Path, default=None,
                        help=f"where the GPU compiler is unpacked (default: {default_compiler_dir()})")
    args = parser.parse_args(argv)
    targets = [t for t in args.targets.split(",") if t]
    C = _runtime.sycl_module()
    known = set(C.gpu_targets()) if C is not None else set(DEFAULT_TARGETS)
    for t in targets:
        if t not in known:
            parser.error(f"unknown target {t!r}; known: {', '.join(sorted(known))}")
    try:
        compiler = fetch_compiler(args.compiler_dir or default_compiler_dir())
        print(f"Intel GPU compiler: ocloc {compiler.version()} ({compiler.root})", flush=True)
        with tempfile.TemporaryDirectory(prefix="moe_xpu_gpu_check_") as tmp:
            rows, failures = check(targets, compiler, args.spirv_out, Path(tmp))
    except GpuCheckError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    print_table(rows)
    print()
    summarize(rows, targets, args.markdown)
    bad_rows = sum(1 for r in rows if r.problems)
    not_built = len(failures) - sum(len(r.problems) for r in rows)  # compile errors, missing kernels
    print(f"gpu-check: {len(rows) - bad_rows} passed, {bad_rows + not_built} failed")
    if failures:
        print("\nFAILED:\n" + "\n".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
