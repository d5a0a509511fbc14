# Every target sets up its own environment from nothing: a virtual environment in .venv with
# torch 2.13.0 (installed first, so pip never pulls CUDA packages), the pinned SYCL runtime,
# and moe_xpu built in place (its CMake build reruns when sycl/ changes).
PYTHON ?= python3
VENV := .venv
# transformers is for the tests and examples only (the core import does not need it).
TRANSFORMERS := transformers==5.23.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.moe_xpu-installed
export SYCL_CACHE_PERSISTENT ?= 1
# The three environments take about 13 GB; pip's wheel cache would add several more (torch 2.8's
# CUDA packages for the IPEX environment).
export PIP_NO_CACHE_DIR ?= 1
export SYCL_CACHE_DIR ?= $(CURDIR)/.cache/sycl

# A second environment on the other SYCL runtime generation (oneAPI 2026.x, libsycl.so.9, the one
# torch 2.13's XPU wheels use), where moe_xpu is built from a wheel and only has to import.
VENV26 := .venv-sycl2026
PY26 := $(VENV26)/bin/python
SYCL2026 := intel-sycl-rt==2026.0.0 intel-cmplr-lib-ur==2026.0.0 intel-cmplr-lib-rt==2026.0.0

# A third environment with Intel Extension for PyTorch: IPEX 2.8 (its last release) is built against
# torch 2.8.0 exactly and validated with transformers 4.51.3; moe_xpu is installed there from a wheel.
VENV_IPEX := .venv-ipex
PY_IPEX := $(VENV_IPEX)/bin/python
IPEX := torch==2.8.0 intel-extension-for-pytorch==2.8.0
IPEX_TRANSFORMERS := transformers==4.51.3
SOURCES := setup.py CMakeLists.txt $(wildcard sycl/*.cpp sycl/*.hpp sycl/kernels/*.cpp sycl/kernels/*.hpp)

.PHONY: setup setup-ipex demo demo-gemm demo-ipex finetune test test-matrix test-ipex check-runtime-2026 \
	gpu-check bench bench-ipex info clean

setup: $(STAMP)

$(VENV)/.deps: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -r requirements.txt $(TRANSFORMERS)
	touch $@

$(STAMP): $(VENV)/.deps $(SOURCES)
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
# Intel GPU generations (gpu-check), the build against the other SYCL runtime generation, and the
# torch-facing tests again on torch 2.8 with IPEX (test-ipex: the IPEX integration tests run there).
test: setup
	$(PY) -m pytest
	$(MAKE) --no-print-directory test-matrix gpu-check check-runtime-2026 test-ipex

setup-ipex: $(VENV_IPEX)/.moe_xpu-installed

$(VENV_IPEX)/.deps: requirements.txt
	$(PYTHON) -m venv $(VENV_IPEX)
	$(PY_IPEX) -m pip install --quiet --upgrade pip
	$(PY_IPEX) -m pip install --quiet $(IPEX)
	$(PY_IPEX) -m pip install --quiet -r requirements.txt $(IPEX_TRANSFORMERS)
	touch $@

$(VENV_IPEX)/.moe_xpu-installed: $(VENV_IPEX)/.deps $(SOURCES) $(wildcard moe_xpu/*.py moe_xpu/*/*.py)
	rm -rf build/wheel-ipex
	$(PY_IPEX) -m pip wheel --quiet --no-build-isolation --no-deps -w build/wheel-ipex .
	$(PY_IPEX) -m pip install --quiet --force-reinstall --no-deps build/wheel-ipex/moe_xpu-*.whl
	touch $@

# The torch-facing tests on torch 2.8: ops, fake implementations, autograd, torch.compile, the
# fused and quantized ops, the integrations and the bench (the kernels' numerics do not depend on
# torch's version: the main suite and the device matrix cover them).
# -P: moe_xpu comes from the installed wheel, not from this folder (whose _C is built for .venv).
IPEX_TESTS = tests/ipex tests/test_bench.py tests/test_distributed.py tests/test_fused_moe.py \
	tests/test_fused_moe_backward.py tests/test_gradient_buffers.py tests/test_moe_gemm_backward.py \
	tests/test_moe_gemm_errors.py tests/test_moe_gemm_torch_integration.py tests/test_transformers_integration.py \
	tests/test_quant.py::test_opcheck tests/test_quant.py::test_torch_compile_fullgraph \
	tests/test_quant.py::test_errors_name_the_argument tests/test_fused_moe_quant.py::test_errors_name_the_argument \
	tests/test_fused_moe_quant.py::test_opcheck_and_torch_compile_fullgraph
test-ipex: setup-ipex
	$(PY_IPEX) -P -m pytest -p no:cacheprovider $(IPEX_TESTS)

demo-ipex: setup-ipex
	$(PY_IPEX) -P examples/ipex_swap.py

bench-ipex: setup-ipex
	$(PY_IPEX) -P -m moe_xpu.bench ipex --plot bench_out/ipex.png

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
	rm -rf build $(VENV) $(VENV26) $(VENV_IPEX) .cache *.egg-info moe_xpu/_C*.so
