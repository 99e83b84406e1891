# fastdp: the two commands of the README.
#   make demo  -- set up a venv and train a DP CNN on Fashion-MNIST at (eps=3, delta=1e-5)
#   make test  -- set up a venv and run the test suite (what CI runs)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH  ?= torch==2.13.0
PYTEST_ARGS ?=
FMNIST_DIR ?= /usr/share/datasets/fashion-mnist

.PHONY: demo test test-backends install fashion-mnist cuda-check native-bounds cuda-lib bench clean

$(VENV)/.created:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel pybind11
	touch $@

# torch first (the CPU wheel where pip's index serves it, as the project's machines do from local
# disk; else set TORCH, see the README), then the package without build isolation so that no
# build step can pull a CUDA torch of its own.
$(VENV)/.installed: $(VENV)/.created pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.h)
	$(PIP) install -q $(TORCH)
	$(PIP) install -q --no-build-isolation -e ".[test,triton,bench,data]"
	touch $@

install: $(VENV)/.installed

fashion-mnist:
	@if [ ! -f "$(FMNIST_DIR)/train-images-idx3-ubyte.gz" ]; then \
	  echo "installing Debian's dataset-fashion-mnist"; \
	  (apt-get install -y -q dataset-fashion-mnist || (apt-get update -q && apt-get install -y -q dataset-fashion-mnist)) >/dev/null; \
	fi

demo: install fashion-mnist
	$(PY) -m fastdp train --dataset fashion-mnist --target-epsilon 3 --delta 1e-5 \
	    --metrics-json out/metrics.json --plot out/accuracy.png

test: install fashion-mnist cuda-check native-bounds
	$(PY) -m pytest -q $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-backends

# The engine's exactness tests again with each kernel backend forced: the PyTorch references
# alone, native, and Triton through its CPU interpreter, with fewer hypothesis examples (slow).
ENGINE_TESTS := tests/test_layers.py tests/test_engine.py tests/test_errors.py
test-backends: install
	FASTDP_BACKEND=reference $(PY) -m pytest -q $(ENGINE_TESTS)
	FASTDP_BACKEND=native $(PY) -m pytest -q $(ENGINE_TESTS)
	TRITON_INTERPRET=1 FASTDP_BACKEND=triton FASTDP_EXAMPLES=4 $(PY) -m pytest -q $(ENGINE_TESTS)

# The fused convolution kernel's reads and writes under AddressSanitizer and UBSan, on
# exactly sized buffers (its vector loads may run past a row of g, masked).
native-bounds:
	@mkdir -p build/native-bounds
	g++ -std=c++17 -O1 -g -fopenmp -fsanitize=address,undefined -fno-sanitize-recover=undefined -Icsrc \
	    tests/native/conv_bounds.cpp csrc/linear_norms.cpp -o build/native-bounds/conv_bounds
	ASAN_OPTIONS=detect_leaks=0 build/native-bounds/conv_bounds

# The CUDA sources must compile even on machines without a GPU.
cuda-check:
	@if command -v nvcc >/dev/null 2>&1 && ls csrc/*.cu >/dev/null 2>&1; then \
	  mkdir -p build/cuda && for f in csrc/*.cu; do \
	    nvcc -std=c++17 -O2 -arch=sm_90 -c $$f -o build/cuda/$$(basename $$f .cu).o || exit 1; \
	  done && echo "cuda-check: compiled $$(ls csrc/*.cu | wc -l) CUDA source(s)"; \
	else echo "cuda-check: skipped (no nvcc or no .cu sources)"; fi

# The CUDA kernels as a shared library for fastdp/_cuda_ops.py (on a machine with a GPU):
# machine code for Hopper plus PTX that any GPU from Turing (sm_75) on compiles at load time.
CUDA_GENCODE ?= -gencode arch=compute_90,code=sm_90 -gencode arch=compute_75,code=compute_75
cuda-lib:
	nvcc -std=c++17 -O3 $(CUDA_GENCODE) -Xcompiler -fPIC -shared csrc/noise.cu -o fastdp/_cuda_noise.so

bench: install
	$(PY) -m fastdp bench

clean:
	rm -rf build *.egg-info fastdp/*.so .pytest_cache .hypothesis $(VENV)/.installed
