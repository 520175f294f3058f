// The CPU backend's one registry of ISA variants, for every kernel family:
// attention (attention/kernel_table.h), the fused elementwise ops
// (ops/kernel_table.h) and the GEMM of the quantised and tiled linear layers
// (gemm/kernel_table.h). Each family's kernels are compiled once per
// instruction set (CMake: csrc/backends/cpu/CMakeLists.txt) and a variant names
// the table of each family it runs with:
//   baseline     attention/ops baseline (SSE2 on x86-64; neon on arm64), GEMM scalar
//   neon         attention/ops neon (the AArch64 baseline),  GEMM neon (smull + sadalp)
//   neon_dotprod attention/ops neon,                         GEMM neon_dotprod (sdot)
//   avx2         attention/ops avx2 (x86-64-v3),             GEMM avx2 (vpmaddubsw)
//   avx_vnni     attention/ops avx2,                         GEMM avx_vnni (256-bit vpdpbusd)
//   avx512       attention/ops avx512 (x86-64-v4),           GEMM avx2
//   avx512_vnni  attention/ops avx512,                       GEMM avx512_vnni (512-bit vpdpbusd)
//   native       attention/ops -march=native (opt-in build), GEMM the best this CPU runs
// A variant is listed only when every table it names is compiled in. The
// default is the last (best) variant this CPU can execute; the environment
// variable PAGEDSERVE_CPU_ISA names another, which must be compiled in and
// supported by the CPU, so a forced choice can lower the ISA of every family at
// once but never crash on a missing instruction.
#pragma once

#include <string>
#include <vector>

#include "backends/cpu/attention/kernel_table.h"
#include "backends/cpu/gemm/kernel_table.h"
#include "backends/cpu/ops/kernel_table.h"

namespace pagedserve {
namespace cpu {

struct IsaVariant {
  const char* name;       // "baseline", "neon", "neon_dotprod", "avx2", "avx_vnni", "avx512", "avx512_vnni" or "native"
  const char* requires_;  // what the CPU must have, for messages ("x86-64-v3: avx2 fma f16c bmi2")
  bool (*supported)();    // can this CPU execute it
  const KernelTable& (*attention)();
  const FusedKernelTable& (*ops)();
  const QuantKernelTable& (*gemm)();
};

// The kernel families a variant holds a table of.
enum class KernelFamily { kAttention, kOps, kGemm };

// Variants compiled into this build, lowest ISA first.
const std::vector<IsaVariant>& compiled_isas();

// The variant every family runs with now. The first call reads
// PAGEDSERVE_CPU_ISA; throws InvalidArgumentError if it names a variant that
// is not compiled in or that this CPU cannot execute (every later call throws
// the same).
const IsaVariant& active_isa();

// Makes `name` the active variant of every family (tests run their parity
// suites under each). Throws InvalidArgumentError if it is not compiled in or
// not supported here.
void set_active_isa(const std::string& name);

// The name of the table variant v runs `family` with ("avx2" for avx_vnni's attention).
const char* table_name(const IsaVariant& v, KernelFamily family);

// The names of the variants this CPU supports, lowest first, whose table of
// `family` differs from every earlier one's: the set a test runs to cover each
// compiled table of the family once.
std::vector<std::string> variants_for(KernelFamily family);

}  // namespace cpu
}  // namespace pagedserve
