// What the CPU backend's per-ISA translation units (attention/kernels.cc,
// ops/kernels.cc, gemm/kernels_*.cc) and gemm/quant_linear.cc share: the
// token-pasting macros that name each variant's table, the scalar
// conversions between float32 and bfloat16 / IEEE half, and exp_poly (an
// exp written so that loops around it vectorise).
//
// The functions live in an unnamed namespace (internal linkage): each object
// gets its own copy compiled for its own ISA, so the linker can never pick an
// AVX-512 copy for a caller built for an older CPU (tests/cpp/
// check_isa_objects.cmake checks that the kernel objects define no weak
// symbols). No standard-library templates, for the same reason.
#pragma once

#include <string.h>

#include <cstdint>

#define PS_CAT2(a, b) a##b
#define PS_CAT(a, b) PS_CAT2(a, b)
#define PS_STR2(a) #a
#define PS_STR(a) PS_STR2(a)

namespace pagedserve {
namespace cpu {
namespace {

using bf16 = uint16_t;  // the bits of a bfloat16

inline float bits_to_float(uint32_t bits) {
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

inline float bf16_to_float(bf16 x) { return bits_to_float(static_cast<uint32_t>(x) << 16); }

// Round to nearest even, NaN to the canonical quiet NaN (c10::BFloat16's
// rounding); branch-free so the loops that store bfloat16 vectorise.
inline bf16 float_to_bf16(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof bits);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<bf16>(f != f ? 0x7FC0u : rounded);
}

// IEEE half -> float, exact (subnormals, infinities and NaNs included).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  if (exp == 0) {
    const float f = static_cast<float>(man) * 5.9604644775390625e-08f;  // man * 2^-24, exact
    return sign ? -f : f;
  }
  if (exp == 31) return bits_to_float(sign | 0x7F800000u | (man << 13));
  return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
}

// exp(x) for x in [-88, 88] (callers clamp; NaN must not reach it): range
// reduction to r in [-ln2/2, ln2/2] and a degree-6 polynomial (Cephes expf,
// relative error ~2e-7), written so that loops around it vectorise.
inline float exp_poly(float x) {
  const float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln2)
  const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace
}  // namespace cpu
}  // namespace pagedserve
