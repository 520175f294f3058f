// What this CPU can execute, read once from the hardware (CPUID and XGETBV on
// x86-64, so a feature the OS does not save across context switches counts as
// absent; getauxval / sysctl on arm64). The ISA registry (isa_registry.h) and
// Python's dtype and GEMM-path choices (pagedserve.hardware) both read it.
#pragma once

#include <string>
#include <vector>

namespace pagedserve {
namespace cpu {

struct CpuFeatures {
  std::string arch;  // "x86_64", "arm64" or "other"
  // x86-64
  bool avx = false, avx2 = false, fma = false, f16c = false, bmi2 = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false, avx512cd = false;
  bool avx512_bf16 = false, avx512_fp16 = false, avx512_vnni = false, avx_vnni = false, avx_ne_convert = false;
  bool amx_tile = false, amx_bf16 = false, amx_int8 = false;
  // arm64
  bool neon = false, arm_dotprod = false, arm_bf16 = false, arm_i8mm = false, sve = false;

  // x86-64-v3: AVX2, FMA, F16C, BMI2 with the OS saving YMM state.
  bool x86_64_v3() const { return avx && avx2 && fma && f16c && bmi2; }
  // x86-64-v4: v3 plus AVX-512 F/BW/VL/DQ/CD with the OS saving ZMM state.
  bool x86_64_v4() const { return x86_64_v3() && avx512f && avx512bw && avx512vl && avx512dq && avx512cd; }
  // Native bfloat16 arithmetic (dot products or matrix tiles): avx512_bf16, AMX-BF16 or Arm BF16.
  bool native_bf16() const { return avx512_bf16 || amx_bf16 || arm_bf16; }
  // Names of the features present, e.g. {"avx2", "fma", ...}.
  std::vector<std::string> names() const;
};

// The features of the CPU this process runs on (detected on first call).
const CpuFeatures& cpu_features();

}  // namespace cpu
}  // namespace pagedserve
