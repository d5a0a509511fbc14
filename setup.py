"""Builds moe_xpu: the pure-Python package plus the pybind11 module moe_xpu._C, via CMake.

Build without isolation so CMake sees the SYCL runtime and pybind11 already installed in the
environment: pip install --no-build-isolation -e .
"""

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: CMakeExtension) -> None:
        import pybind11

        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        # One CMake build folder per environment: CMake caches the SYCL runtime it found, and a
        # build for another environment (another runtime generation) must not reuse it. The module
        # is built there too and then copied: setuptools' output folder is shared by every
        # environment, and CMake, finding its own build up to date, would not write it again
        # (a wheel for one environment once shipped the module linked against another's runtime).
        env_tag = hashlib.sha1(sys.prefix.encode()).hexdigest()[:10]
        build_dir = Path(self.build_temp).resolve() / f"{ext.name}-{env_tag}"
        out_dir = build_dir / "module"
        build_dir.mkdir(parents=True, exist_ok=True)
        cfg = "Debug" if self.debug else "Release"
        configure = [
            "cmake",
            str(ROOT),
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DSYCL_PREFIX={sys.prefix}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DCMAKE_BUILD_TYPE={cfg}",
        ]
        jobs = f"-j{os.cpu_count() or 1}"
        subprocess.run(configure, cwd=build_dir, check=True)
        subprocess.run(["cmake", "--build", ".", "--config", cfg, jobs], cwd=build_dir, check=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(out_dir / target.name, target)


setup(
    name="moe_xpu",
    version="0.1.0",
    description="Mixture-of-Experts grouped GEMM for Intel GPUs (XPU) in SYCL, with a SYCL CPU path",
    packages=find_packages(include=["moe_xpu", "moe_xpu.*"]),
    ext_modules=[CMakeExtension("moe_xpu._C")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.10",
    install_requires=["torch>=2.8", "numpy"],
    zip_safe=False,
)
