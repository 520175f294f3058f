#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` and `llama-bench` from source, for the
# side-by-side serving benchmark (bench/serving.py --compare). The source comes
# from the PyPI sdist of llama-cpp-python (its vendor/llama.cpp), through the
# same package registry as everything else: no binary is downloaded and no
# llama.cpp code enters this repository.
#
#   bench/build_llama_server.sh [BUILD_DIR]     (default build/llama.cpp)
#   LLAMA_CPP_PYTHON_VERSION=0.3.36 bench/build_llama_server.sh
#
# Built for this CPU (GGML_NATIVE=ON, as llama.cpp's own default) but without
# AMX: CPUID and XCR0 report AMX tiles on some of this project's machines, yet
# the first tile instruction kills the process (SIGILL at `tilezero`: the
# sandbox does not grant the per-process AMX permission), so -mno-amx-* keep
# them out whatever the CPU says. Without libcurl. 7-15 minutes on 2 cores.
# Prints the path of llama-server.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build/llama.cpp}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] && PYTHON=.venv/bin/python
SRC=build/llama-cpp-python-src
mkdir -p "$SRC" "$BUILD_DIR"
if [ ! -f "$SRC/llama_cpp_python-$VERSION/vendor/llama.cpp/CMakeLists.txt" ]; then
  "$PYTHON" -m pip download --quiet --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$SRC"
  tar -xzf "$SRC/llama_cpp_python-$VERSION.tar.gz" -C "$SRC"
fi
cmake -S "$SRC/llama_cpp_python-$VERSION/vendor/llama.cpp" -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \
  -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" >/dev/null
cmake --build "$BUILD_DIR" --target llama-server llama-bench -j"$(nproc)"
echo "$BUILD_DIR/bin/llama-server"
