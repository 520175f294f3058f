// The quantized linear kernels (quant_isa.h), compiled once per variant: CMake
// builds this file with PAGEDSERVE_QISA set to scalar, avx2, avx_vnni or
// avx512_vnni and PAGEDSERVE_QISA_LEVEL to 0..3, each with its own -m flags,
// and always with -ffp-contract=off (the float steps are written out; FMAs are
// explicit intrinsics), so the activation quantisation is bit-identical in
// every variant.
//
// Algorithm: llama.cpp's scheme for GGUF Q4_1 / Q8_0 weights times Q8_1-style
// activations (our own code): per 32-block the integer dot sum(q * xq) of the
// weight quants and the int8 activations, then in float
//   Q4_1: acc += d * xd * isum + m * xs      (xs = xd * sum(xq))
//   Q8_0: acc += d * xd * isum
// The SIMD variants compute 16 (AVX-512) or 8 (256-bit) output rows at once
// from the interleaved tiles of quant_isa.h: each 32-bit lane is one output row
// and four consecutive k-elements, so one vpdpbusd (u8 x s8 -> i32, Intel's
// VNNI) per 4-element group with the activation dword broadcast, no horizontal
// sums. Weights are unsigned operands: Q4_1 nibbles as they are (0..15), Q8_0
// as q + 128 (xor 0x80) with -128 * sum(xq) as the accumulator's start value.
// AVX2 has no VNNI: vpmaddubsw (u8 x s8 pairs -> i16) then vpmaddwd with ones
// (i16 pairs -> i32); Q4_1 sums eight vpmaddubsw results in i16 first (each
// at most 2 * 15 * 127, eight of them below 32767); Q8_0 would saturate i16 as
// q + 128, so it uses the |w| / sign(x, w) form instead. Several activation
// rows reuse each unpacked weight tile in registers (compute-bound prefill).
//
// Everything but the table getter has internal linkage and no standard-library
// template is used (tests/cpp/check_isa_objects.cmake verifies the objects).
#include <math.h>
#include <string.h>

#include <cstdint>

#include "quant_isa.h"
#include "scalar_convert.h"

#if PAGEDSERVE_QISA_LEVEL >= 1
#include <immintrin.h>
#endif
#if PAGEDSERVE_QISA_LEVEL == 3 && defined(__GNUC__) && !defined(__clang__)
// GCC 12's _mm512_cvtph_ps / _mm512_cvtepi32_ps pass _mm512_undefined_ps() (a
// deliberately self-initialised value) as the unused merge source: a false alarm.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#ifndef PAGEDSERVE_QISA
#error "PAGEDSERVE_QISA must name the variant this file is compiled for"
#endif

namespace pagedserve {
namespace cpu {
namespace {


inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

inline int32_t load_i32(const void* p) {
  int32_t v;
  memcpy(&v, p, sizeof v);
  return v;
}

inline uint16_t load_u16(const void* p) {
  uint16_t v;
  memcpy(&v, p, sizeof v);
  return v;
}

// ---- activation quantisation (plain C++, identical in every variant) ----

template <typename T>
void quantize_rows_typed(const T* x, int64_t k, int64_t r0, int64_t r1, int8_t* xq, float* xd, int32_t* xsum,
                         float* xs) {
  const int64_t nb = k / kQBlock;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const T* src = x + r * k + b * kQBlock;
      float v[kQBlock];
      for (int i = 0; i < kQBlock; ++i) {
        if constexpr (sizeof(T) == sizeof(float)) {
          v[i] = src[i];
        } else {
          v[i] = bf16_to_float(src[i]);
        }
      }
      float amax = 0.f;
      for (int i = 0; i < kQBlock; ++i) {
        const float a = fabsf(v[i]);
        amax = a > amax ? a : amax;  // NaN never wins
      }
      const float d = amax / 127.f;
      const float id = d != 0.f ? 1.f / d : 0.f;
      int8_t* q = xq + r * k + b * kQBlock;
      int32_t sum = 0;
      for (int i = 0; i < kQBlock; ++i) {
        float t = v[i] * id;
        t = t == t ? t : 0.f;                       // NaN -> 0
        t = t > 127.f ? 127.f : (t < -127.f ? -127.f : t);
        t = (t + 12582912.f) - 12582912.f;          // round half to even (|t| < 2^22)
        const int32_t qi = static_cast<int32_t>(t);
        q[i] = static_cast<int8_t>(qi);
        sum += qi;
      }
      xd[r * nb + b] = d;
      xsum[r * nb + b] = sum;
      xs[r * nb + b] = d * static_cast<float>(sum);
    }
  }
}

void quantize_rows(const void* x, DType dtype, int64_t k, int64_t r0, int64_t r1, int8_t* xq, float* xd,
                   int32_t* xsum, float* xs) {
  if (dtype == DType::kFloat32) {
    quantize_rows_typed(static_cast<const float*>(x), k, r0, r1, xq, xd, xsum, xs);
  } else {
    quantize_rows_typed(static_cast<const bf16*>(x), k, r0, r1, xq, xd, xsum, xs);
  }
}

// out[r, c0 + j] = acc[j] (+ bias) for j < min(width, N - c0).
inline void write_out(const QuantGemmArgs& a, int64_t r, int64_t c0, int width, const float* acc) {
  const int64_t nv = imin(width, a.n - c0);
  if (a.out_dtype == DType::kFloat32) {
    float* o = static_cast<float*>(a.out) + r * a.n + c0;
    for (int64_t j = 0; j < nv; ++j) o[j] = a.bias != nullptr ? acc[j] + a.bias[c0 + j] : acc[j];
  } else {
    bf16* o = static_cast<bf16*>(a.out) + r * a.n + c0;
    for (int64_t j = 0; j < nv; ++j) o[j] = float_to_bf16(a.bias != nullptr ? acc[j] + a.bias[c0 + j] : acc[j]);
  }
}

#if PAGEDSERVE_QISA_LEVEL == 0
// ---- scalar: the reference integer math, one row at a time ----

void gemm_group(const QuantGemmArgs& a, int64_t g, int64_t r) {
  const int64_t nb = a.k / kQBlock;
  float acc[kQRows];
  for (int j = 0; j < kQRows; ++j) acc[j] = 0.f;
  const int8_t* xrow = a.x.xq + r * a.k;
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* xq = xrow + b * kQBlock;
    const float xd = a.x.xd[r * nb + b], xs = a.x.xs[r * nb + b];
    if (a.qtype == QType::kQ4_1) {
      const uint8_t* t = a.w + (g * nb + b) * kQ41TileBytes;
      for (int j = 0; j < kQRows; ++j) {
        int32_t isum = 0;
        for (int p = 0; p < 4; ++p) {
          const uint8_t* qs = t + 64 + p * 64 + j * 4;
          for (int e = 0; e < 4; ++e) {
            isum += static_cast<int32_t>(qs[e] & 0x0F) * xq[4 * p + e];
            isum += static_cast<int32_t>(qs[e] >> 4) * xq[16 + 4 * p + e];
          }
        }
        const float d = half_to_float(load_u16(t + 2 * j)), m = half_to_float(load_u16(t + 32 + 2 * j));
        acc[j] = acc[j] + static_cast<float>(isum) * (d * xd);
        acc[j] = acc[j] + m * xs;
      }
    } else {
      const uint8_t* t = a.w + (g * nb + b) * kQ80TileBytes;
      for (int j = 0; j < kQRows; ++j) {
        int32_t isum = 0;
        for (int c = 0; c < 8; ++c) {
          const int8_t* qs = reinterpret_cast<const int8_t*>(t + 32 + c * 64 + j * 4);
          for (int e = 0; e < 4; ++e) isum += static_cast<int32_t>(qs[e]) * xq[4 * c + e];
        }
        const float d = half_to_float(load_u16(t + 2 * j));
        acc[j] = acc[j] + static_cast<float>(isum) * (d * xd);
      }
    }
  }
  write_out(a, r, g * kQRows, kQRows, acc);
}

void gemm(const QuantGemmArgs& a, int64_t g0, int64_t g1, int64_t m0, int64_t m1) {
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t r = m0; r < m1; ++r) gemm_group(a, g, r);
  }
}

#elif PAGEDSERVE_QISA_LEVEL == 3
// ---- AVX-512 VNNI: 16 output rows per zmm, up to 4 activation rows per pass ----

constexpr int kRowsPerPass = 4;

template <int R>
void q41_pass(const QuantGemmArgs& a, int64_t g, int64_t r) {
  const int64_t nb = a.k / kQBlock;
  const uint8_t* t = a.w + g * nb * kQ41TileBytes;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, t += kQ41TileBytes) {
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)));
    const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32)));
    __m512i w[8];
    for (int p = 0; p < 4; ++p) {
      const __m512i raw = _mm512_loadu_si512(t + 64 + 64 * p);
      w[p] = _mm512_and_si512(raw, low);
      w[p + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    }
    for (int i = 0; i < R; ++i) {
      const int64_t row = r + i;
      const int8_t* xq = a.x.xq + row * a.k + b * kQBlock;
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int c = 0; c < 8; c += 2) {
        s0 = _mm512_dpbusd_epi32(s0, w[c], _mm512_set1_epi32(load_i32(xq + 4 * c)));
        s1 = _mm512_dpbusd_epi32(s1, w[c + 1], _mm512_set1_epi32(load_i32(xq + 4 * c + 4)));
      }
      const __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(a.x.xd[row * nb + b]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), scale, acc[i]);
      acc[i] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a.x.xs[row * nb + b]), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) {
    alignas(64) float buf[16];
    _mm512_store_ps(buf, acc[i]);
    write_out(a, r + i, g * kQRows, kQRows, buf);
  }
}

template <int R>
void q80_pass(const QuantGemmArgs& a, int64_t g, int64_t r) {
  const int64_t nb = a.k / kQBlock;
  const uint8_t* t = a.w + g * nb * kQ80TileBytes;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, t += kQ80TileBytes) {
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)));
    __m512i w[8];
    for (int c = 0; c < 8; ++c) w[c] = _mm512_xor_si512(_mm512_loadu_si512(t + 32 + 64 * c), flip);  // q + 128
    for (int i = 0; i < R; ++i) {
      const int64_t row = r + i;
      const int8_t* xq = a.x.xq + row * a.k + b * kQBlock;
      __m512i s0 = _mm512_set1_epi32(-128 * a.x.xsum[row * nb + b]), s1 = _mm512_setzero_si512();
      for (int c = 0; c < 8; c += 2) {
        s0 = _mm512_dpbusd_epi32(s0, w[c], _mm512_set1_epi32(load_i32(xq + 4 * c)));
        s1 = _mm512_dpbusd_epi32(s1, w[c + 1], _mm512_set1_epi32(load_i32(xq + 4 * c + 4)));
      }
      const __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(a.x.xd[row * nb + b]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), scale, acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) {
    alignas(64) float buf[16];
    _mm512_store_ps(buf, acc[i]);
    write_out(a, r + i, g * kQRows, kQRows, buf);
  }
}

template <int R>
void pass(const QuantGemmArgs& a, int64_t g, int64_t r) {
  if (a.qtype == QType::kQ4_1) {
    q41_pass<R>(a, g, r);
  } else {
    q80_pass<R>(a, g, r);
  }
}

void gemm(const QuantGemmArgs& a, int64_t g0, int64_t g1, int64_t m0, int64_t m1) {
  for (int64_t g = g0; g < g1; ++g) {
    int64_t r = m0;
    for (; r + kRowsPerPass <= m1; r += kRowsPerPass) pass<kRowsPerPass>(a, g, r);
    switch (m1 - r) {
      case 3: pass<3>(a, g, r); break;
      case 2: pass<2>(a, g, r); break;
      case 1: pass<1>(a, g, r); break;
      default: break;
    }
  }
}

#else
// ---- 256-bit (AVX-VNNI or AVX2): 8 output rows per ymm (half a row group), up to 2 activation rows ----

constexpr int kRowsPerPass = 2;

// sum over the 8 four-element groups c of w[c] . x[c] (u8 x s8) into i32 lanes, added to s.
inline __m256i dot_q41(__m256i s, const __m256i* w, const __m256i* x) {
#if PAGEDSERVE_QISA_LEVEL == 2
  __m256i s1 = _mm256_setzero_si256();
  for (int c = 0; c < 8; c += 2) {
    s = _mm256_dpbusd_avx_epi32(s, w[c], x[c]);
    s1 = _mm256_dpbusd_avx_epi32(s1, w[c + 1], x[c + 1]);
  }
  return _mm256_add_epi32(s, s1);
#else
  // i16 partial sums: |each| <= 2 * 15 * 127, eight of them < 32767
  __m256i p = _mm256_maddubs_epi16(w[0], x[0]);
  for (int c = 1; c < 8; ++c) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[c], x[c]));
  return _mm256_add_epi32(s, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
}

template <int R>
void q41_pass(const QuantGemmArgs& a, int64_t g, int h, int64_t r) {
  const int64_t nb = a.k / kQBlock;
  const uint8_t* t = a.w + g * nb * kQ41TileBytes;
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, t += kQ41TileBytes) {
    const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 16 * h)));
    const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 32 + 16 * h)));
    __m256i w[8];
    for (int p = 0; p < 4; ++p) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 64 + 64 * p + 32 * h));
      w[p] = _mm256_and_si256(raw, low);
      w[p + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    }
    for (int i = 0; i < R; ++i) {
      const int64_t row = r + i;
      const int8_t* xq = a.x.xq + row * a.k + b * kQBlock;
      __m256i x[8];
      for (int c = 0; c < 8; ++c) x[c] = _mm256_set1_epi32(load_i32(xq + 4 * c));
      const __m256i s = dot_q41(_mm256_setzero_si256(), w, x);
      const __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(a.x.xd[row * nb + b]));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[i]);
      acc[i] = _mm256_fmadd_ps(mv, _mm256_set1_ps(a.x.xs[row * nb + b]), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) {
    alignas(32) float buf[8];
    _mm256_store_ps(buf, acc[i]);
    write_out(a, r + i, g * kQRows + 8 * h, 8, buf);
  }
}

template <int R>
void q80_pass(const QuantGemmArgs& a, int64_t g, int h, int64_t r) {
  const int64_t nb = a.k / kQBlock;
  const uint8_t* t = a.w + g * nb * kQ80TileBytes;
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, t += kQ80TileBytes) {
    const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 16 * h)));
    __m256i w[8];
    for (int c = 0; c < 8; ++c) {
      w[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32 + 64 * c + 32 * h));
    }
#if PAGEDSERVE_QISA_LEVEL == 2
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int c = 0; c < 8; ++c) w[c] = _mm256_xor_si256(w[c], flip);  // q + 128
#else
    __m256i aw[8];
    for (int c = 0; c < 8; ++c) aw[c] = _mm256_sign_epi8(w[c], w[c]);  // |q| (-128 -> 128 as u8)
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    for (int i = 0; i < R; ++i) {
      const int64_t row = r + i;
      const int8_t* xq = a.x.xq + row * a.k + b * kQBlock;
#if PAGEDSERVE_QISA_LEVEL == 2
      __m256i s0 = _mm256_set1_epi32(-128 * a.x.xsum[row * nb + b]), s1 = _mm256_setzero_si256();
      for (int c = 0; c < 8; c += 2) {
        s0 = _mm256_dpbusd_avx_epi32(s0, w[c], _mm256_set1_epi32(load_i32(xq + 4 * c)));
        s1 = _mm256_dpbusd_avx_epi32(s1, w[c + 1], _mm256_set1_epi32(load_i32(xq + 4 * c + 4)));
      }
      const __m256i s = _mm256_add_epi32(s0, s1);
#else
      __m256i s = _mm256_setzero_si256();
      for (int c = 0; c < 8; ++c) {
        const __m256i sx = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(xq + 4 * c)), w[c]);  // x * sign(q)
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(aw[c], sx), ones));
      }
#endif
      const __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(a.x.xd[row * nb + b]));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) {
    alignas(32) float buf[8];
    _mm256_store_ps(buf, acc[i]);
    write_out(a, r + i, g * kQRows + 8 * h, 8, buf);
  }
}

template <int R>
void pass(const QuantGemmArgs& a, int64_t g, int h, int64_t r) {
  if (a.qtype == QType::kQ4_1) {
    q41_pass<R>(a, g, h, r);
  } else {
    q80_pass<R>(a, g, h, r);
  }
}

void gemm(const QuantGemmArgs& a, int64_t g0, int64_t g1, int64_t m0, int64_t m1) {
  for (int64_t g = g0; g < g1; ++g) {
    for (int h = 0; h < 2; ++h) {
      if (g * kQRows + 8 * h >= a.n) break;  // padding rows only
      int64_t r = m0;
      for (; r + kRowsPerPass <= m1; r += kRowsPerPass) pass<kRowsPerPass>(a, g, h, r);
      if (r < m1) pass<1>(a, g, h, r);
    }
  }
}
#endif

const QuantKernelTable kTable{PS_STR(PAGEDSERVE_QISA), &quantize_rows, &gemm};

}  // namespace

const QuantKernelTable& PS_CAT(quant_kernel_table_, PAGEDSERVE_QISA)() { return kTable; }

}  // namespace cpu
}  // namespace pagedserve
