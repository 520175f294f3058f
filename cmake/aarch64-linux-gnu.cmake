# Cross-compiling for arm64 (AArch64) Linux with Debian's toolchain
# (g++-aarch64-linux-gnu), the test binaries run by qemu-user (qemu-aarch64)
# with the target's libraries: `make test-arm64` (Makefile). On Apple silicon or
# another arm64 machine build natively instead; this file is for checking the
# arm64 code paths (the neon kernel variant, the CPU feature detection) on an
# x86-64 host.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
# Debian multiarch: the target's libraries (libssl-dev:arm64, for libcrypto) under /usr/lib/aarch64-linux-gnu
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
# Linked statically: Debian 12's qemu-aarch64 (7.2) hangs in the first thread a dynamically linked
# program starts (a 10-line std::thread + condition_variable program never returns; its static build runs)
set(CMAKE_EXE_LINKER_FLAGS_INIT "-static")
set(CMAKE_CXX_FLAGS_INIT "-DPAGEDSERVE_STATIC_EXECUTABLES=1")  # tests of what a static binary lacks skip
set(OPENSSL_USE_STATIC_LIBS TRUE)
# add_test and gtest_discover_tests run the test executables through this
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64)
set(ENV{PKG_CONFIG_LIBDIR} /usr/lib/aarch64-linux-gnu/pkgconfig:/usr/share/pkgconfig)
set(CMAKE_IGNORE_PATH /usr/lib/x86_64-linux-gnu /lib/x86_64-linux-gnu)
