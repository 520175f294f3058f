#!/usr/bin/env bash
# The system packages `make test` uses (Debian names), installed when missing
# if we are root with apt-get; otherwise each missing one is named with what
# it is for, and the parts that need it skip (the Makefile and the tests say
# which). Needed to build at all: cmake, g++, make, libssl-dev (libcrypto's
# headers), python3-venv. Needed by the C++ tests (test-cpp, test-sanitize,
# test-metal-host): libgtest-dev. Optional, each test that uses one skips
# with the reason without it: qemu-user (the kernels on emulated AVX2-only and
# SSE-only CPUs), clang-19 (the Metal kernels' CPU emulator), chromium (the
# web chat page's test), util-linux and iproute2 (the loopback-only network
# namespace of the Ray tests), ccache (the C++ tests reuse the wheel's objects),
# g++-aarch64-linux-gnu and libssl-dev:arm64 (the C++ tests built for arm64 and
# run under qemu-aarch64: test-arm64; the second needs Debian's arm64
# architecture added, which this script does as root).
#
# `tests/system_deps.sh build` looks at the build's packages only (make serve).
# Exit status: 0, unless a package needed to build is missing and could not be
# installed; with CI=true (.ci/run), unless every package is there at the end.
set -uo pipefail

build=(cmake g++ make libssl-dev python3-venv)
tests=(libgtest-dev)
optional=(qemu-user clang-19 chromium util-linux iproute2 ccache g++-aarch64-linux-gnu libssl-dev:arm64)
if [ "${1:-}" = build ]; then tests=(); optional=(); fi
declare -A why=(
  [cmake]="the build" [g++]="the build" [make]="the build" [libssl-dev]="the build (SHA-256 from libcrypto)"
  [python3-venv]="the virtual environment" [libgtest-dev]="the C++ tests (test-cpp, test-sanitize, test-metal-host)"
  [qemu-user]="the kernels on emulated AVX2-only and SSE-only CPUs (ctest)"
  [clang-19]="the Metal kernels' CPU emulator (ctest)" [chromium]="the web chat page's test (pytest)"
  [util-linux]="the Ray tests' network namespace (unshare)" [iproute2]="the Ray tests' network namespace (ip)"
  [ccache]="a faster make test (the C++ tests reuse the wheel's objects)"
  [g++-aarch64-linux-gnu]="the C++ tests built for arm64 (test-arm64)"
  [libssl-dev:arm64]="the C++ tests built for arm64 (test-arm64; first: dpkg --add-architecture arm64)"
)

# Whether a package's files are here: dpkg where there is one, else the file or command it provides.
have() {
  if command -v dpkg >/dev/null 2>&1; then
    dpkg -s "$1" >/dev/null 2>&1 && return 0
  fi
  case "$1" in
    libgtest-dev) [ -f /usr/include/gtest/gtest.h ] || [ -f /usr/local/include/gtest/gtest.h ] ;;
    libssl-dev) [ -f /usr/include/openssl/sha.h ] || [ -f /usr/local/include/openssl/sha.h ] ;;
    python3-venv) python3 -c 'import ensurepip, venv' >/dev/null 2>&1 ;;
    qemu-user) command -v qemu-x86_64 >/dev/null 2>&1 ;;
    libssl-dev:arm64) [ -f /usr/lib/aarch64-linux-gnu/libcrypto.a ] ;;
    g++-aarch64-linux-gnu) command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 ;;
    clang-19) command -v clang++-19 >/dev/null 2>&1 ;;
    util-linux) command -v unshare >/dev/null 2>&1 ;;
    iproute2) command -v ip >/dev/null 2>&1 ;;
    *) command -v "$1" >/dev/null 2>&1 ;;
  esac
}

missing() { local p; for p in "$@"; do have "$p" || echo "$p"; done; }

need=($(missing "${build[@]}" "${tests[@]+"${tests[@]}"}" "${optional[@]+"${optional[@]}"}"))
if [ ${#need[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing ${need[*]} (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  host=() foreign=()
  for p in "${need[@]}"; do
    case "$p" in *:arm64) foreign+=("$p") ;; *) host+=("$p") ;; esac
  done
  # the package lists first: a fresh machine has none, an old one may name versions gone from the mirror
  if [ ${#host[@]} -gt 0 ]; then
    apt-get update -q >/dev/null && apt-get install -y -q "${host[@]}" >/dev/null \
      || echo "apt-get could not install every package (offline?); see below"
  fi
  # another architecture's packages after the host's, so that a mirror without it costs only these; if its
  # package lists cannot be read the architecture is taken out again (every later apt-get update would fail)
  if [ ${#foreign[@]} -gt 0 ]; then
    dpkg --add-architecture arm64
    if ! { apt-get update -q >/dev/null && apt-get install -y -q "${foreign[@]}" >/dev/null; }; then
      echo "apt-get could not install ${foreign[*]} (the mirror may not serve arm64); see below"
      dpkg -l '*:arm64' 2>/dev/null | grep -q '^ii' || { dpkg --remove-architecture arm64; apt-get update -q >/dev/null; }
    fi
  fi
fi

rc=0
for p in $(missing "${build[@]}" "${tests[@]+"${tests[@]}"}" "${optional[@]+"${optional[@]}"}"); do
  echo "missing $p: ${why[$p]} (Debian: apt-get install $p)"
  [ "${CI:-}" = true ] && rc=1
done
for p in $(missing "${build[@]}"); do rc=1; done
exit $rc
