#include "backends/cpu/runtime/cpu_features.h"

#include <utility>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#define PAGEDSERVE_X86_64 1
#elif defined(__aarch64__) || defined(_M_ARM64)
#define PAGEDSERVE_ARM64 1
#if defined(__linux__)
#include <sys/auxv.h>
#elif defined(__APPLE__)
#include <sys/sysctl.h>
#endif
#endif

namespace pagedserve {
namespace cpu {
namespace {

#if PAGEDSERVE_X86_64
bool bit(unsigned v, int i) { return (v >> i) & 1u; }

// XCR0: which register states the OS saves (XGETBV, only valid with OSXSAVE).
unsigned long long xgetbv0() {
  unsigned eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<unsigned long long>(edx) << 32) | eax;
}

void detect(CpuFeatures& f) {
  f.arch = "x86_64";
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return;
  const bool osxsave = bit(c, 27);
  const unsigned long long xcr0 = osxsave ? xgetbv0() : 0;
  const bool ymm = (xcr0 & 0x6) == 0x6;            // SSE + AVX state
  const bool zmm = ymm && (xcr0 & 0xE0) == 0xE0;   // opmask + ZMM_Hi256 + Hi16_ZMM
  const bool tiles = (xcr0 & 0x60000) == 0x60000;  // XTILECFG + XTILEDATA
  f.avx = ymm && bit(c, 28);
  f.fma = f.avx && bit(c, 12);
  f.f16c = f.avx && bit(c, 29);
  unsigned max_leaf = __get_cpuid_max(0, nullptr);
  if (max_leaf < 7) return;
  __cpuid_count(7, 0, a, b, c, d);
  f.avx2 = f.avx && bit(b, 5);
  f.bmi2 = bit(b, 8);
  f.avx512f = zmm && bit(b, 16);
  f.avx512dq = f.avx512f && bit(b, 17);
  f.avx512cd = f.avx512f && bit(b, 28);
  f.avx512bw = f.avx512f && bit(b, 30);
  f.avx512vl = f.avx512f && bit(b, 31);
  f.avx512_vnni = f.avx512f && bit(c, 11);
  f.avx512_fp16 = f.avx512f && bit(d, 23);
  f.amx_bf16 = tiles && bit(d, 22);
  f.amx_tile = tiles && bit(d, 24);
  f.amx_int8 = tiles && bit(d, 25);
  const unsigned sub_leaves = a;
  if (sub_leaves >= 1) {
    __cpuid_count(7, 1, a, b, c, d);
    f.avx_vnni = f.avx && bit(a, 4);
    f.avx512_bf16 = f.avx512f && bit(a, 5);
    f.avx_ne_convert = f.avx && bit(d, 5);
  }
}
#elif PAGEDSERVE_ARM64
#if defined(__APPLE__)
bool sysctl_flag(const char* name) {
  int v = 0;
  size_t n = sizeof v;
  return sysctlbyname(name, &v, &n, nullptr, 0) == 0 && v != 0;
}
#endif

void detect(CpuFeatures& f) {
  f.arch = "arm64";
  f.neon = true;  // Advanced SIMD is part of every AArch64 CPU
#if defined(__linux__)
  const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
  f.arm_dotprod = (hw >> 20) & 1ul;  // HWCAP_ASIMDDP
  f.sve = (hw >> 22) & 1ul;        // HWCAP_SVE
  f.arm_i8mm = (hw2 >> 13) & 1ul;  // HWCAP2_I8MM
  f.arm_bf16 = (hw2 >> 14) & 1ul;  // HWCAP2_BF16
#elif defined(__APPLE__)
  f.arm_dotprod = sysctl_flag("hw.optional.arm.FEAT_DotProd");
  f.arm_bf16 = sysctl_flag("hw.optional.arm.FEAT_BF16");
  f.arm_i8mm = sysctl_flag("hw.optional.arm.FEAT_I8MM");
#endif
}
#else
void detect(CpuFeatures& f) { f.arch = "other"; }
#endif

}  // namespace

std::vector<std::string> CpuFeatures::names() const {
  std::vector<std::string> out;
  const std::pair<const char*, bool> all[] = {
      {"avx", avx}, {"avx2", avx2}, {"fma", fma}, {"f16c", f16c}, {"bmi2", bmi2}, {"avx512f", avx512f},
      {"avx512bw", avx512bw}, {"avx512vl", avx512vl}, {"avx512dq", avx512dq}, {"avx512cd", avx512cd},
      {"avx512_bf16", avx512_bf16}, {"avx512_fp16", avx512_fp16}, {"avx512_vnni", avx512_vnni},
      {"avx_vnni", avx_vnni}, {"avx_ne_convert", avx_ne_convert}, {"amx_tile", amx_tile},
      {"amx_bf16", amx_bf16}, {"amx_int8", amx_int8}, {"neon", neon}, {"dotprod", arm_dotprod}, {"bf16", arm_bf16},
      {"i8mm", arm_i8mm}, {"sve", sve}};
  for (const auto& [name, on] : all) {
    if (on) out.push_back(name);
  }
  return out;
}

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = [] {
    CpuFeatures f;
    detect(f);
    return f;
  }();
  return features;
}

}  // namespace cpu
}  // namespace pagedserve
