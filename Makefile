# Every target sets up its own environment from nothing: a virtual environment in .venv with
# torch 2.13.0 (installed first, so pip never pulls CUDA packages), the pinned SYCL runtime,
# and moe_xpu built in place (its CMake build reruns when sycl/ changes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.moe_xpu-installed
export SYCL_CACHE_PERSISTENT ?= 1
export SYCL_CACHE_DIR ?= $(CURDIR)/.cache/sycl

# A second environment on the other SYCL runtime generation (oneAPI 2026.x, libsycl.so.9, the one
# torch 2.13's XPU wheels use), where moe_xpu is built from a wheel and only has to import.
VENV26 := .venv-sycl2026
PY26 := $(VENV26)/bin/python
SYCL2026 := intel-sycl-rt==2026.0.0 intel-cmplr-lib-ur==2026.0.0 intel-cmplr-lib-rt==2026.0.0

.PHONY: setup demo demo-gemm finetune test test-matrix check-runtime-2026 gpu-check bench info clean

setup: $(STAMP)

$(VENV)/.deps: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

$(STAMP): $(VENV)/.deps setup.py CMakeLists.txt $(wildcard sycl/*.cpp sycl/*.hpp sycl/kernels/*.cpp sycl/kernels/*.hpp)
	$(PY) -m pip install --quiet --no-build-isolation --no-deps -e .
	touch $@

demo: setup
	$(PY) examples/hf_generate.py

demo-gemm: setup
	$(PY) examples/moe_gemm_demo.py

finetune: setup
	$(PY) examples/finetune.py

# The full suite on the host's default CPU target, the correctness tests again under every other
# CPU target the host can execute (tests/device_matrix.py), every kernel variant compiled for the
# Intel GPU generations (gpu-check), and the build against the other SYCL runtime generation.
test: setup
	$(PY) -m pytest
	$(MAKE) --no-print-directory test-matrix gpu-check check-runtime-2026

# Intel's GPU compiler is unpacked under .cache/ (from Debian's archive, nothing installed system-wide).
gpu-check: setup
	$(PY) -m moe_xpu.gpu_check --compiler-dir .cache/intel-gpu-compiler

test-matrix: setup
	$(PY) tests/device_matrix.py

$(VENV26)/.deps:
	$(PYTHON) -m venv $(VENV26)
	$(PY26) -m pip install --quiet --upgrade pip
	$(PY26) -m pip install --quiet torch==2.13.0
	$(PY26) -m pip install --quiet $(SYCL2026) "pybind11>=2.12" "cmake>=3.18" ninja "setuptools>=64" wheel numpy
	touch $@

check-runtime-2026: $(VENV26)/.deps
	rm -rf build/wheel-sycl2026
	$(PY26) -m pip wheel --quiet --no-build-isolation --no-deps -w build/wheel-sycl2026 .
	$(PY26) -m pip install --quiet --force-reinstall --no-deps build/wheel-sycl2026/moe_xpu-*.whl
	$(PY26) -I tests/check_runtime_generation.py --soname libsycl.so.9

bench: setup
	$(PY) -m moe_xpu.bench gemm --plot bench_out/gemm.png
	$(PY) -m moe_xpu.bench moe --plot bench_out/moe.png
	$(PY) -m moe_xpu.bench skew
	$(PY) -m moe_xpu.bench small

info: setup
	$(PY) -m moe_xpu info

clean:
	rm -rf build $(VENV) $(VENV26) .cache *.egg-info moe_xpu/_C*.so
