#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` and `llama-bench` from source, for the
# side-by-side serving benchmark (bench/serving.py --compare). The source comes
# from the PyPI sdist of llama-cpp-python (its vendor/llama.cpp), through the
# same package registry as everything else: no binary is downloaded and no
# llama.cpp code enters this repository.
#
#   bench/build_llama_server.sh [--isa avx2] [BUILD_DIR]
#       (default BUILD_DIR: build/llama.cpp, with --isa avx2 build/llama.cpp-avx2)
#   LLAMA_CPP_PYTHON_VERSION=0.3.36 bench/build_llama_server.sh
#
# --isa avx2: built for an AVX2-only CPU (GGML_NATIVE=OFF, GGML_AVX2/FMA/F16C
# on, every AVX-512 and AVX-VNNI option off), so that on an AVX-512 host it can
# be set beside PagedServe's AVX2 variant (PAGEDSERVE_CPU_ISA=avx2): the pair an
# AVX2-only laptop runs. The binary then uses no instruction past x86-64-v3.
#
# Built for this CPU (GGML_NATIVE=ON, as llama.cpp's own default) but without
# AMX: CPUID and XCR0 report AMX tiles on some of this project's machines, yet
# the first tile instruction kills the process (SIGILL at `tilezero`: the
# sandbox does not grant the per-process AMX permission), so -mno-amx-* keep
# them out whatever the CPU says. Without libcurl. 7-15 minutes on 2 cores.
# Prints the path of llama-server.
set -euo pipefail
cd "$(dirname "$0")/.."
ISA=native
if [ "${1:-}" = "--isa" ]; then
  ISA=${2:?--isa takes native or avx2}
  shift 2
fi
case "$ISA" in
  native) ISA_FLAGS=(-DGGML_NATIVE=ON); DEFAULT_DIR=build/llama.cpp ;;
  avx2) ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
                   -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
                   -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
        DEFAULT_DIR=build/llama.cpp-avx2 ;;
  *) echo "--isa: native or avx2, not '$ISA'" >&2; exit 2 ;;
esac
BUILD_DIR=${1:-$DEFAULT_DIR}
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
  "${ISA_FLAGS[@]}" -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \
  -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" >/dev/null
cmake --build "$BUILD_DIR" --target llama-server llama-bench -j"$(nproc)"
echo "$BUILD_DIR/bin/llama-server"
