# Every target sets up its own environment from nothing: a virtual environment in .venv with
# torch 2.13.0 (installed first, so pip never pulls CUDA packages), the pinned SYCL runtime,
# and moe_xpu built in place (its CMake build reruns when sycl/ changes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.moe_xpu-installed
export SYCL_CACHE_PERSISTENT ?= 1
export SYCL_CACHE_DIR ?= $(CURDIR)/.cache/sycl

.PHONY: setup demo demo-gemm test bench info clean

setup: $(STAMP)

$(VENV)/.deps: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

$(STAMP): $(VENV)/.deps setup.py CMakeLists.txt $(wildcard sycl/*.cpp sycl/*.hpp sycl/kernels/*.cpp)
	$(PY) -m pip install --quiet --no-build-isolation --no-deps -e .
	touch $@

demo: setup
	$(PY) examples/hf_generate.py

demo-gemm: setup
	$(PY) examples/moe_gemm_demo.py

test: setup
	$(PY) -m pytest

bench: setup
	$(PY) -m moe_xpu.bench gemm --plot bench_out/gemm.png
	$(PY) -m moe_xpu.bench moe --plot bench_out/moe.png
	$(PY) -m moe_xpu.bench skew

info: setup
	$(PY) -m moe_xpu info

clean:
	rm -rf build $(VENV) .cache *.egg-info moe_xpu/_C*.so
