#include "cpu_isa.h"

#include <atomic>
#include <cstdlib>
#include <mutex>

#include "core/errors.h"
#include "cpu_features.h"

namespace pagedserve {
namespace cpu {
namespace {

const IsaVariant* find(const std::string& name) {
  for (const IsaVariant& v : compiled_isas()) {
    if (name == v.name) return &v;
  }
  return nullptr;
}

const IsaVariant& checked(const std::string& name, const char* source) {
  const IsaVariant* v = find(name);
  if (v == nullptr) {
    std::string have;
    for (const IsaVariant& c : compiled_isas()) have += std::string(have.empty() ? "" : ", ") + c.name;
    throw InvalidArgumentError(std::string(source) + " names CPU kernel variant '" + name +
                               "', which this build does not have (compiled: " + have + ")");
  }
  if (!v->supported()) {
    throw InvalidArgumentError(std::string(source) + " names CPU kernel variant '" + name +
                               "', which this CPU cannot execute (it needs " + v->requires_ + ")");
  }
  return *v;
}

std::atomic<const IsaVariant*> g_active{nullptr};

}  // namespace

const std::vector<IsaVariant>& compiled_isas() {
  static const std::vector<IsaVariant> variants = {
#if defined(PAGEDSERVE_HAVE_ISA_BASELINE)
      {"baseline", "nothing beyond the architecture's baseline", [] { return true; }, &kernel_table_baseline},
#endif
#if defined(PAGEDSERVE_HAVE_ISA_NEON)
      {"neon", "AArch64 Advanced SIMD", [] { return cpu_features().neon; }, &kernel_table_neon},
#endif
#if defined(PAGEDSERVE_HAVE_ISA_AVX2)
      {"avx2", "x86-64-v3: avx2 fma f16c bmi2", [] { return cpu_features().x86_64_v3(); }, &kernel_table_avx2},
#endif
#if defined(PAGEDSERVE_HAVE_ISA_AVX512)
      {"avx512", "x86-64-v4: avx512f avx512bw avx512vl avx512dq avx512cd",
       [] { return cpu_features().x86_64_v4(); }, &kernel_table_avx512},
#endif
#if defined(PAGEDSERVE_HAVE_ISA_NATIVE)
      // built with -march=native for the build machine: assumed runnable
      // (PAGEDSERVE_NATIVE_ARCH is the opt-in non-portable build)
      {"native", "the CPU this build was compiled on", [] { return true; }, &kernel_table_native},
#endif
  };
  return variants;
}

const IsaVariant& active_isa() {
  const IsaVariant* v = g_active.load();
  if (v != nullptr) return *v;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if ((v = g_active.load()) != nullptr) return *v;
  const char* forced = std::getenv("PAGEDSERVE_CPU_ISA");
  if (forced != nullptr && *forced != '\0') {
    v = &checked(forced, "PAGEDSERVE_CPU_ISA");  // throws: the error reaches start-up
  } else {
    for (const IsaVariant& c : compiled_isas()) {
      if (c.supported()) v = &c;  // lowest first: the last supported is the best
    }
  }
  g_active.store(v);
  return *v;
}

void set_active_isa(const std::string& name) { g_active.store(&checked(name, "set_active_isa")); }

}  // namespace cpu
}  // namespace pagedserve
