#include "backends/cpu/runtime/isa_registry.h"

#include <atomic>
#include <cstdlib>
#include <mutex>

#include "backends/cpu/runtime/cpu_features.h"
#include "core/errors.h"

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

[[maybe_unused]] inline bool v3() { return cpu_features().x86_64_v3(); }
[[maybe_unused]] inline bool v4() { return cpu_features().x86_64_v4(); }

#if defined(PAGEDSERVE_HAVE_ISA_NATIVE)
// The native build's GEMM: the best compiled GEMM table this CPU executes.
const QuantKernelTable& best_gemm() {
#if defined(PAGEDSERVE_HAVE_GEMM_AVX512_VNNI)
  if (v4() && cpu_features().avx512_vnni) return quant_kernel_table_avx512_vnni();
#endif
#if defined(PAGEDSERVE_HAVE_GEMM_AVX_VNNI)
  if (v3() && cpu_features().avx_vnni) return quant_kernel_table_avx_vnni();
#endif
#if defined(PAGEDSERVE_HAVE_GEMM_AVX2)
  if (v3()) return quant_kernel_table_avx2();
#endif
#if defined(PAGEDSERVE_HAVE_GEMM_NEON_DOTPROD)
  if (cpu_features().arm_dotprod) return quant_kernel_table_neon_dotprod();
#endif
#if defined(PAGEDSERVE_HAVE_GEMM_NEON)
  return quant_kernel_table_neon();
#endif
  return quant_kernel_table_scalar();
}
#endif

std::atomic<const IsaVariant*> g_active{nullptr};

}  // namespace

const std::vector<IsaVariant>& compiled_isas() {
  static const std::vector<IsaVariant> variants = {
#if defined(PAGEDSERVE_HAVE_ISA_BASELINE)
      {"baseline", "nothing beyond the architecture's baseline", [] { return true; }, &kernel_table_baseline,
       &fused_kernel_table_baseline, &quant_kernel_table_scalar},
#endif
#if defined(PAGEDSERVE_HAVE_ISA_NEON)
      // the reference GEMM (scalar) beside the Advanced SIMD attention and ops, which are the AArch64 baseline
      {"baseline", "nothing beyond the architecture's baseline", [] { return true; }, &kernel_table_neon,
       &fused_kernel_table_neon, &quant_kernel_table_scalar},
#endif
#if defined(PAGEDSERVE_HAVE_ISA_NEON) && defined(PAGEDSERVE_HAVE_GEMM_NEON)
      {"neon", "AArch64 Advanced SIMD", [] { return cpu_features().neon; }, &kernel_table_neon,
       &fused_kernel_table_neon, &quant_kernel_table_neon},
#endif
#if defined(PAGEDSERVE_HAVE_ISA_NEON) && defined(PAGEDSERVE_HAVE_GEMM_NEON_DOTPROD)
      {"neon_dotprod", "AArch64 Advanced SIMD and the dot-product extension (asimddp)",
       [] { return cpu_features().neon && cpu_features().arm_dotprod; }, &kernel_table_neon,
       &fused_kernel_table_neon, &quant_kernel_table_neon_dotprod},
#endif
#if defined(PAGEDSERVE_HAVE_ISA_AVX2) && defined(PAGEDSERVE_HAVE_GEMM_AVX2)
      {"avx2", "x86-64-v3: avx2 fma f16c bmi2", &v3, &kernel_table_avx2, &fused_kernel_table_avx2,
       &quant_kernel_table_avx2},
#endif
#if defined(PAGEDSERVE_HAVE_ISA_AVX2) && defined(PAGEDSERVE_HAVE_GEMM_AVX_VNNI)
      {"avx_vnni", "x86-64-v3 and avx_vnni", [] { return v3() && cpu_features().avx_vnni; }, &kernel_table_avx2,
       &fused_kernel_table_avx2, &quant_kernel_table_avx_vnni},
#endif
#if defined(PAGEDSERVE_HAVE_ISA_AVX512) && defined(PAGEDSERVE_HAVE_GEMM_AVX2)
      {"avx512", "x86-64-v4: avx512f avx512bw avx512vl avx512dq avx512cd", &v4, &kernel_table_avx512,
       &fused_kernel_table_avx512, &quant_kernel_table_avx2},
#endif
#if defined(PAGEDSERVE_HAVE_ISA_AVX512) && defined(PAGEDSERVE_HAVE_GEMM_AVX512_VNNI)
      {"avx512_vnni", "x86-64-v4 and avx512_vnni", [] { return v4() && cpu_features().avx512_vnni; },
       &kernel_table_avx512, &fused_kernel_table_avx512, &quant_kernel_table_avx512_vnni},
#endif
#if defined(PAGEDSERVE_HAVE_ISA_NATIVE)
      // built with -march=native for the build machine: assumed runnable
      // (PAGEDSERVE_NATIVE_ARCH is the opt-in non-portable build)
      {"native", "the CPU this build was compiled on", [] { return true; }, &kernel_table_native,
       &fused_kernel_table_native, &best_gemm},
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

const char* table_name(const IsaVariant& v, KernelFamily family) {
  switch (family) {
    case KernelFamily::kAttention: return v.attention().isa;
    case KernelFamily::kOps: return v.ops().isa;
    case KernelFamily::kGemm: return v.gemm().name;
  }
  return "";
}

std::vector<std::string> variants_for(KernelFamily family) {
  std::vector<std::string> names, seen;
  for (const IsaVariant& v : compiled_isas()) {
    if (!v.supported()) continue;
    const std::string table = table_name(v, family);
    bool new_table = true;
    for (const std::string& s : seen) new_table = new_table && s != table;
    if (!new_table) continue;
    seen.push_back(table);
    names.push_back(v.name);
  }
  return names;
}

}  // namespace cpu
}  // namespace pagedserve
