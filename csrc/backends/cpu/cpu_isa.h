// Run-time choice of the CPU kernels' ISA variant (kernel_isa.h). The default
// is the best variant this build has and this CPU can execute; the
// environment variable PAGEDSERVE_CPU_ISA (baseline, avx2, avx512, neon,
// native) forces another one, which must be compiled in and supported by the
// CPU, so a forced choice can lower the ISA but never crash on a missing
// instruction.
#pragma once

#include <string>
#include <vector>

#include "kernel_isa.h"

namespace pagedserve {
namespace cpu {

struct IsaVariant {
  const char* name;       // "baseline", "avx2", "avx512", "neon" or "native"
  const char* requires_;  // what the CPU must have, for messages ("x86-64-v3: avx2 fma f16c bmi2")
  bool (*supported)();    // can this CPU execute it
  const KernelTable& (*table)();
};

// Variants compiled into this build, lowest ISA first.
const std::vector<IsaVariant>& compiled_isas();

// The variant kernels run with now. The first call reads PAGEDSERVE_CPU_ISA;
// throws InvalidArgumentError if it names a variant that is not compiled in
// or that this CPU cannot execute (every later call throws the same).
const IsaVariant& active_isa();

// Makes `name` the active variant (tests run the parity suite under each).
// Throws InvalidArgumentError if it is not compiled in or not supported here.
void set_active_isa(const std::string& name);

}  // namespace cpu
}  // namespace pagedserve
