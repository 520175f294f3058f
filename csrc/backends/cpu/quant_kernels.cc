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
// rows reuse each unpacked weight tile in registers (compute-bound batches):
// 8 per pass with AVX-512, 4 with 256 bits.
//
// The other GGUF types' decoded tiles (u4f, u5f, i8f) have their own integer
// kernel, shared by the SIMD variants (its section below).
//
// Within a variant a row's result does not depend on the pass, the work item
// or the thread that computed it: the integer sums are exact (any order) and
// the float steps per (row, block) are always the same: scale = d * xd, then
// acc = fma(isum, scale, acc) and, for Q4_1, acc = fma(m, xs, acc) (the scalar
// variant rounds the product and the sum separately instead).
//
// gemm_f32 (the exact float32 GEMM of linear_f32, float32 activations, no
// integer math) is described at its section below.
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

inline uint16_t load_u16(const void* p) {
  uint16_t v;
  memcpy(&v, p, sizeof v);
  return v;
}

// ---- activation quantisation (bit-identical in every variant) ----

// The scales of activation block i (row r, k-block b: i = b * m + r) once its
// int8 values, whose sum is `sum`, are stored: xd = d, xsum128 = -128 * sum
// (the Q8_0 kernels' accumulator start), xs = d * sum (Q4_1's min term).
inline void store_block_scales(int64_t i, float d, int32_t sum, float* xd, int32_t* xsum128, float* xs) {
  xd[i] = d;
  xsum128[i] = -128 * sum;
  xs[i] = d * static_cast<float>(sum);
}

#if PAGEDSERVE_QISA_LEVEL == 0
template <typename T>
void quantize_rows_typed(const T* x, int64_t k, int64_t m, int64_t r0, int64_t r1, int8_t* xq, float* xd,
                         int32_t* xsum128, float* xs) {
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
      int8_t* q = xq + (b * m + r) * kQBlock;
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
      store_block_scales(b * m + r, d, sum, xd, xsum128, xs);
    }
  }
}

void quantize_rows(const void* x, DType dtype, int64_t k, int64_t m, int64_t r0, int64_t r1, int8_t* xq,
                   float* xd, int32_t* xsum128, float* xs) {
  if (dtype == DType::kFloat32) {
    quantize_rows_typed(static_cast<const float*>(x), k, m, r0, r1, xq, xd, xsum128, xs);
  } else {
    quantize_rows_typed(static_cast<const bf16*>(x), k, m, r0, r1, xq, xd, xsum128, xs);
  }
}

#else
// The scalar variant's steps, lane-wise, hence bit-identical to it: amax is the
// max of the non-NaN |v| (max_ps(a, b) is a > b ? a : b, so a NaN |v| never
// replaces the running value, as in the scalar loop; the max of non-NaN values
// does not depend on the order); d, id and xs are the same scalar expressions;
// per element the same multiply, NaN -> 0, clamp (min then max: no NaN is left),
// + (2^23 + 2^22) - (2^23 + 2^22) and truncation; the integer sum is exact in any
// order.
#if PAGEDSERVE_QISA_LEVEL == 3
using VecF = __m512;   // 16 lanes
using VecI = __m512i;
constexpr int kLanes = 16;

template <bool kBf16>
inline VecF load_lanes(const char* p) {  // float32 or bfloat16 (-> float32 exactly: bits << 16)
  if constexpr (kBf16) {
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
  } else {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(p));
  }
}
inline VecF abs_max(VecF v, VecF mx) {
  return _mm512_max_ps(_mm512_and_ps(v, _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF))), mx);
}
inline float hmax(VecF mx) { return _mm512_reduce_max_ps(mx); }
inline VecF nan_to_zero(VecF t) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(t, t, _CMP_ORD_Q), t); }
inline VecF set1f(float v) { return _mm512_set1_ps(v); }
inline VecF mulf(VecF a, VecF b) { return _mm512_mul_ps(a, b); }
inline VecF addf(VecF a, VecF b) { return _mm512_add_ps(a, b); }
inline VecF subf(VecF a, VecF b) { return _mm512_sub_ps(a, b); }
inline VecF minf(VecF a, VecF b) { return _mm512_min_ps(a, b); }
inline VecF maxf(VecF a, VecF b) { return _mm512_max_ps(a, b); }
inline VecI trunc_i32(VecF t) { return _mm512_cvttps_epi32(t); }
// The 32 quants (int32 in [-127, 127]) to int8 at q; returns their sum.
inline int32_t store_q(int8_t* q, const VecI* qi) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qi[0]));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qi[1]));
  return _mm512_reduce_add_epi32(_mm512_add_epi32(qi[0], qi[1]));
}
#else
using VecF = __m256;  // 8 lanes
using VecI = __m256i;
constexpr int kLanes = 8;

template <bool kBf16>
inline VecF load_lanes(const char* p) {
  if constexpr (kBf16) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
  } else {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  }
}
inline VecF abs_max(VecF v, VecF mx) {
  return _mm256_max_ps(_mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))), mx);
}
inline float hmax(VecF mx) {
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  return _mm_cvtss_f32(m4);
}
inline VecF nan_to_zero(VecF t) { return _mm256_and_ps(t, _mm256_cmp_ps(t, t, _CMP_ORD_Q)); }
inline VecF set1f(float v) { return _mm256_set1_ps(v); }
inline VecF mulf(VecF a, VecF b) { return _mm256_mul_ps(a, b); }
inline VecF addf(VecF a, VecF b) { return _mm256_add_ps(a, b); }
inline VecF subf(VecF a, VecF b) { return _mm256_sub_ps(a, b); }
inline VecF minf(VecF a, VecF b) { return _mm256_min_ps(a, b); }
inline VecF maxf(VecF a, VecF b) { return _mm256_max_ps(a, b); }
inline VecI trunc_i32(VecF t) { return _mm256_cvttps_epi32(t); }
inline int32_t store_q(int8_t* q, const VecI* qi) {
  // packs interleave the 128-bit lanes; the permute restores the element order (no saturation: |q| <= 127)
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
  s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 1));
  return _mm_cvtsi128_si32(s4);
}
#endif

template <bool kBf16>
void quantize_rows_simd(const void* x, int64_t k, int64_t m, int64_t r0, int64_t r1, int8_t* xq, float* xd,
                        int32_t* xsum128, float* xs) {
  constexpr int kVecs = kQBlock / kLanes;
  constexpr int64_t kElem = kBf16 ? 2 : 4;  // bytes per input element
  const int64_t nb = k / kQBlock;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const char* src = static_cast<const char*>(x) + (r * k + b * kQBlock) * kElem;
      VecF v[kVecs];
      VecF mx = set1f(0.f);
      for (int i = 0; i < kVecs; ++i) {
        v[i] = load_lanes<kBf16>(src + i * kLanes * kElem);
        mx = abs_max(v[i], mx);
      }
      const float amax = hmax(mx);
      const float d = amax / 127.f;
      const float id = d != 0.f ? 1.f / d : 0.f;
      const VecF idv = set1f(id), magic = set1f(12582912.f);
      VecI qi[kVecs];
      for (int i = 0; i < kVecs; ++i) {
        VecF t = nan_to_zero(mulf(v[i], idv));
        t = maxf(minf(t, set1f(127.f)), set1f(-127.f));
        qi[i] = trunc_i32(subf(addf(t, magic), magic));
      }
      const int32_t sum = store_q(xq + (b * m + r) * kQBlock, qi);
      store_block_scales(b * m + r, d, sum, xd, xsum128, xs);
    }
  }
}

void quantize_rows(const void* x, DType dtype, int64_t k, int64_t m, int64_t r0, int64_t r1, int8_t* xq,
                   float* xd, int32_t* xsum128, float* xs) {
  if (dtype == DType::kFloat32) {
    quantize_rows_simd<false>(x, k, m, r0, r1, xq, xd, xsum128, xs);
  } else {
    quantize_rows_simd<true>(x, k, m, r0, r1, xq, xd, xsum128, xs);
  }
}
#endif

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

// ---- the exact float32 GEMM (gemm_f32): float32 activations, weights expanded exactly ----
//
// The weights are expanded from the tiles to gguf-py's float32 values (Q4_1
// d * q + m, Q8_0 d * q, i8f d * q + m: quant_isa.h) and multiplied with the float32
// activations, accumulated in float32 along k in order. The SIMD variants
// hold vectors along N (lane j = row 16 g + j): element e of a block is byte
// e % 4 (Q4_1: nibble e / 16) of every lane of one 64-byte qs row, so one
// shift (or byte shuffle) and a conversion give the 16 rows' weights for that
// k. Exactness: d (fp16: 11 significant bits) times q (Q4_1: 4 bits, Q8_0: 8)
// is exact in float32 (at most 19 significant bits, no overflow or underflow
// for any finite fp16 d), so round(d * q) = d * q and the single rounding of
// fma(q, d, m) equals numpy's round(round(d * q) + m); Q8_0 multiplies
// (q * 2^24) by (d * 2^-24), both exact scalings, for the same exact product.
// u5f / u4f / i8f: d * q is exact by construction (gguf_types.h: at most 23 significant
// bits for every type), d * 2^-24 stays normal for every d the repacking
// makes (|d| >= 2^-24 or 0), and fma(q, d, m) rounds once, as numpy's
// d * q + m (or d * q - dm) does after its exact product.
// Per (row, column) the accumulation is one chain acc = fma(x, w, acc) over
// k = 0 .. K-1 (the scalar variant: acc + x * w, two roundings) in every
// path, so a row's result does not depend on the tiling, the work split or
// the thread count.

// The dense formats (quant_isa.h: dense_format): the expansion is a load (and,
// for the 16-bit ones, an exact widening).

// The 5-bit format (u5f: quant_isa.h): float d[16] at 0, m[16] at 64,
// the nibbles at k5FNibbles in q4_1's order, the high bits (uint32 per row) at k5FHigh.
template <TileFormat Q>
constexpr bool five_bit() {
  return Q == TileFormat::kU5F;
}
// The formats whose tiles hold float32 d[16] at 0 and m[16] at 64 (u5f, u4f).
template <TileFormat Q>
constexpr bool float_scales() {
  return Q == TileFormat::kU5F || Q == TileFormat::kU4F;
}
constexpr int k5FNibbles = 128;
constexpr int k5FHigh = 384;
// Byte offset of the nibbles (q4_1's order) in a tile of the 4-bit formats (q4_1, u4f).
template <TileFormat Q>
constexpr int nibbles_at() {
  return Q == TileFormat::kQ4_1 ? 64 : k5FNibbles;
}

// Whether a format's scales change at element 16 of a block (i8f: one d and m
// per 16 elements); the SIMD loops reload them there.
template <TileFormat Q>
constexpr bool half_scales() {
  return Q == TileFormat::kI8F;
}

// Byte offset of the quants in an i8f tile (after float d[2][16] and m[2][16]).
constexpr int kI8FQuants = 256;

// out[r, c0 + j] = acc[j] (+ bias) for j < min(16, N - c0).
inline void write_out_f32(const QuantF32GemmArgs& a, int64_t r, int64_t c0, const float* acc) {
  const int64_t nv = imin(kQRows, a.n - c0);
  float* o = a.out + r * a.ldo + c0;
  for (int64_t j = 0; j < nv; ++j) o[j] = a.bias != nullptr ? acc[j] + a.bias[c0 + j] : acc[j];
}

#if PAGEDSERVE_QISA_LEVEL >= 1
// ---- the integer GEMM of the decoded tiles (u4f, u5f, i8f): every SIMD variant ----
//
// 8 output rows per ymm (half a row group), up to 4 activation rows a pass,
// in AVX2 instructions only (the AVX2 variant's vpmaddubsw + vpmaddwd forms),
// so the VNNI variants run the very sequence the AVX2 variant runs (and its
// tests check on any AVX2 CPU); a vpdpbusd form for them is left for later.
//   u4f / u5f: unsigned quants (0..15 / 0..31; the high bit of element e is
//     bit e of the row's qh word, spread to bit 4 of its byte by a multiply),
//     four vpmaddubsw per i16 partial sum (each at most 2 * 31 * 127, four
//     below 32767), then per block, d and m float32:
//       acc = fma(isum, d * xd, acc); acc = fma(m, xs, acc)
//   i8f: signed quants as the AVX2 Q8_0 form (|q| times sign(xq, q)), one
//     integer sum per 16 elements (a scale each):
//       acc = fma(isum_lo, d_lo * xd, acc); acc = fma(isum_hi, d_hi * xd, acc)
//     (its minima are zero: QuantizedWeight::linear refuses an i8f weight
//     whose minima are not).

constexpr int kDecodedRowsPerPass = 4;

// The activation dword at p in every lane (the 256-bit integer kernels' operand: these and the decoded tiles').
inline __m256i bcast_dword(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, sizeof v);
  return _mm256_set1_epi32(v);
}

// Per dword lane: bit 4 of byte b = bit b of the lane's low 4 bits (v * 0x00204081 places copies of those 4
// bits at bits 0, 7, 14 and 21 without overlap; bit 8 b of the product is bit b of v).
inline __m256i high_bits_to_bytes(__m256i v) {
  const __m256i low4 = _mm256_and_si256(v, _mm256_set1_epi32(0x0F));
  const __m256i spread = _mm256_mullo_epi32(low4, _mm256_set1_epi32(0x00204081));
  return _mm256_slli_epi32(_mm256_and_si256(spread, _mm256_set1_epi32(0x01010101)), 4);
}

// Out rows r .. r+R-1, columns 16 g + 8 h .. 16 g + 8 h + 7.
template <TileFormat Q, int R>
void pass_decoded(const QuantGemmArgs& a, int64_t g, int h, int64_t r) {
  constexpr int64_t kTile = tile_bytes(Q);
  const int64_t nb = a.k / kQBlock, m = a.m;
  const uint8_t* t = a.w + g * nb * kTile;
  const int8_t* xq = a.x.xq + r * kQBlock;  // then + 32 m per block; row i at + 32 i
  const float* xd = a.x.xd + r;             // then + m per block (xs alike)
  const float* xs = a.x.xs + r;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, t += kTile, xq += m * kQBlock, xd += m, xs += m) {
    if constexpr (Q == TileFormat::kI8F) {
      __m256i s[2][R];
      for (int i = 0; i < R; ++i) s[0][i] = s[1][i] = _mm256_setzero_si256();
      for (int c = 0; c < 8; ++c) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + kI8FQuants + 64 * c + 32 * h));
        const __m256i aw = _mm256_sign_epi8(w, w);  // |q| (-128 -> 128 as u8)
        for (int i = 0; i < R; ++i) {
          const __m256i sx = _mm256_sign_epi8(bcast_dword(xq + kQBlock * i + 4 * c), w);  // x * sign(q)
          s[c >> 2][i] = _mm256_add_epi32(s[c >> 2][i], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones));
        }
      }
      for (int half = 0; half < 2; ++half) {  // d[half][16] at 0: row j's at 4 (16 half + j)
        const __m256 dv = _mm256_loadu_ps(reinterpret_cast<const float*>(t) + kQRows * half + 8 * h);
        for (int i = 0; i < R; ++i) {
          acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[half][i]), _mm256_mul_ps(dv, _mm256_set1_ps(xd[i])), acc[i]);
        }
      }
    } else {
      const __m256i low = _mm256_set1_epi8(0x0F);
      __m256i qh = _mm256_setzero_si256();
      if constexpr (five_bit<Q>()) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + k5FHigh + 32 * h));
      __m256i s[R], p16[R];
      for (int half = 0; half < 2; ++half) {  // elements 16 half + 4 p + b: the low (0) or high (1) nibbles
        for (int p = 0; p < 4; ++p) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + k5FNibbles + 64 * p + 32 * h));
          __m256i w = _mm256_and_si256(half == 0 ? raw : _mm256_srli_epi16(raw, 4), low);
          if constexpr (five_bit<Q>()) w = _mm256_or_si256(w, high_bits_to_bytes(_mm256_srli_epi32(qh, 16 * half + 4 * p)));
          for (int i = 0; i < R; ++i) {
            const __m256i v = _mm256_maddubs_epi16(w, bcast_dword(xq + kQBlock * i + 16 * half + 4 * p));
            p16[i] = p == 0 ? v : _mm256_add_epi16(p16[i], v);
          }
        }
        for (int i = 0; i < R; ++i) {
          const __m256i v = _mm256_madd_epi16(p16[i], ones);
          s[i] = half == 0 ? v : _mm256_add_epi32(s[i], v);
        }
      }
      const __m256 dv = _mm256_loadu_ps(reinterpret_cast<const float*>(t) + 8 * h);       // float d[16] at 0
      const __m256 mv = _mm256_loadu_ps(reinterpret_cast<const float*>(t + 64) + 8 * h);  // float m[16] at 64
      for (int i = 0; i < R; ++i) {
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i]), _mm256_mul_ps(dv, _mm256_set1_ps(xd[i])), acc[i]);
        acc[i] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs[i]), acc[i]);
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    alignas(32) float buf[8];
    _mm256_store_ps(buf, acc[i]);
    write_out(a, r + i, g * kQRows + 8 * h, 8, buf);
  }
}

template <TileFormat Q>
void gemm_decoded(const QuantGemmArgs& a, int64_t g0, int64_t g1, int64_t m0, int64_t m1) {
  for (int64_t g = g0; g < g1; ++g) {
    for (int h = 0; h < 2; ++h) {
      if (g * kQRows + 8 * h >= a.n) break;  // padding rows only
      int64_t r = m0;
      for (; r + kDecodedRowsPerPass <= m1; r += kDecodedRowsPerPass) pass_decoded<Q, kDecodedRowsPerPass>(a, g, h, r);
      switch (m1 - r) {
        case 3: pass_decoded<Q, 3>(a, g, h, r); break;
        case 2: pass_decoded<Q, 2>(a, g, h, r); break;
        case 1: pass_decoded<Q, 1>(a, g, h, r); break;
        default: break;
      }
    }
  }
}

// The SIMD variants' gemm for the decoded tiles; false for q4_1 / q8_0 (the variant's own kernels).
inline bool gemm_of_decoded_tiles(const QuantGemmArgs& a, int64_t g0, int64_t g1, int64_t m0, int64_t m1) {
  switch (a.format) {
    case TileFormat::kU4F: gemm_decoded<TileFormat::kU4F>(a, g0, g1, m0, m1); return true;
    case TileFormat::kU5F: gemm_decoded<TileFormat::kU5F>(a, g0, g1, m0, m1); return true;
    case TileFormat::kI8F: gemm_decoded<TileFormat::kI8F>(a, g0, g1, m0, m1); return true;
    default: return false;
  }
}
#endif

#if PAGEDSERVE_QISA_LEVEL == 0
// ---- scalar: the reference integer math, one row at a time ----

void gemm_group(const QuantGemmArgs& a, int64_t g, int64_t r) {
  const int64_t nb = a.k / kQBlock;
  float acc[kQRows];
  for (int j = 0; j < kQRows; ++j) acc[j] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* xq = a.x.xq + (b * a.m + r) * kQBlock;
    const float xd = a.x.xd[b * a.m + r], xs = a.x.xs[b * a.m + r];
    if (a.format == TileFormat::kQ4_1) {
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
    } else if (a.format == TileFormat::kQ8_0) {
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
    } else if (a.format == TileFormat::kU5F || a.format == TileFormat::kU4F) {
      const bool five = a.format == TileFormat::kU5F;
      const uint8_t* t = a.w + (g * nb + b) * (five ? k5FTileBytes : kU4FTileBytes);
      for (int j = 0; j < kQRows; ++j) {
        uint32_t qh = 0;
        if (five) memcpy(&qh, t + k5FHigh + 4 * j, 4);
        int32_t isum = 0;
        for (int e = 0; e < kQBlock; ++e) {
          const uint8_t qs = t[k5FNibbles + 64 * ((e & 15) >> 2) + 4 * j + (e & 3)];
          const int v = (e < 16 ? qs & 0x0F : qs >> 4) | static_cast<int>((qh >> e) & 1u) << 4;
          isum += v * xq[e];
        }
        float d, m;
        memcpy(&d, t + 4 * j, 4);
        memcpy(&m, t + 64 + 4 * j, 4);
        acc[j] = acc[j] + static_cast<float>(isum) * (d * xd);
        acc[j] = acc[j] + m * xs;
      }
    } else {  // i8f: a scale per 16 elements; its minima are zero (QuantizedWeight checks that for linear)
      const uint8_t* t = a.w + (g * nb + b) * kI8FTileBytes;
      for (int j = 0; j < kQRows; ++j) {
        for (int half = 0; half < 2; ++half) {
          int32_t isum = 0;
          for (int e = 16 * half; e < 16 * half + 16; ++e) {
            isum += static_cast<int32_t>(static_cast<int8_t>(t[kI8FQuants + 64 * (e >> 2) + 4 * j + (e & 3)])) * xq[e];
          }
          float d;
          memcpy(&d, t + 4 * (kQRows * half + j), 4);
          acc[j] = acc[j] + static_cast<float>(isum) * (d * xd);
        }
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

// ---- exact float32 GEMM, scalar: one row group and one row tile at a time ----

// w[j] = the dequantised weight of row 16 g + j, element e of block b (gguf-py's
// float32: the product and the sum rounded separately, -ffp-contract=off).
void expand_scalar(const QuantF32GemmArgs& a, int64_t g, int64_t b, int e, float* w) {
  const int64_t nb = a.k / kQBlock;
  if (a.format == TileFormat::kF32) {
    memcpy(w, a.w + (g * nb + b) * kF32TileBytes + 4 * kQRows * e, 4 * kQRows);
  } else if (a.format == TileFormat::kF16 || a.format == TileFormat::kBF16) {
    const uint8_t* t = a.w + (g * nb + b) * kF16TileBytes + 2 * kQRows * e;
    for (int j = 0; j < kQRows; ++j) {
      const uint16_t v = load_u16(t + 2 * j);
      w[j] = a.format == TileFormat::kF16 ? half_to_float(v) : bf16_to_float(v);
    }
  } else if (a.format == TileFormat::kQ4_1) {
    const uint8_t* t = a.w + (g * nb + b) * kQ41TileBytes;
    const int p = (e & 15) >> 2, byte = e & 3;
    for (int j = 0; j < kQRows; ++j) {
      const uint8_t qs = t[64 + 64 * p + 4 * j + byte];
      const float q = static_cast<float>(e < 16 ? qs & 0x0F : qs >> 4);
      const float prod = half_to_float(load_u16(t + 2 * j)) * q;
      w[j] = prod + half_to_float(load_u16(t + 32 + 2 * j));
    }
  } else if (a.format == TileFormat::kQ8_0) {
    const uint8_t* t = a.w + (g * nb + b) * kQ80TileBytes;
    for (int j = 0; j < kQRows; ++j) {
      const int8_t q = static_cast<int8_t>(t[32 + 64 * (e >> 2) + 4 * j + (e & 3)]);
      w[j] = half_to_float(load_u16(t + 2 * j)) * static_cast<float>(q);
    }
  } else if (a.format == TileFormat::kU5F || a.format == TileFormat::kU4F) {
    const bool five = a.format == TileFormat::kU5F;
    const uint8_t* t = a.w + (g * nb + b) * (five ? k5FTileBytes : kU4FTileBytes);
    const int p = (e & 15) >> 2, byte = e & 3;
    for (int j = 0; j < kQRows; ++j) {
      const uint8_t qs = t[k5FNibbles + 64 * p + 4 * j + byte];
      uint32_t qh = 0;
      if (five) memcpy(&qh, t + k5FHigh + 4 * j, 4);
      int v = (e < 16 ? qs & 0x0F : qs >> 4) | static_cast<int>((qh >> e) & 1u) << 4;
      float d, m;
      memcpy(&d, t + 4 * j, 4);
      memcpy(&m, t + 64 + 4 * j, 4);
      const float prod = d * static_cast<float>(v);
      w[j] = prod + m;
    }
  } else {
    const uint8_t* t = a.w + (g * nb + b) * kI8FTileBytes;
    const float* d = reinterpret_cast<const float*>(t) + kQRows * (e >> 4);
    const float* m = reinterpret_cast<const float*>(t + 128) + kQRows * (e >> 4);
    for (int j = 0; j < kQRows; ++j) {
      const int8_t q = static_cast<int8_t>(t[kI8FQuants + 64 * (e >> 2) + 4 * j + (e & 3)]);
      const float prod = d[j] * static_cast<float>(q);
      w[j] = prod + m[j];
    }
  }
}

void gemm_f32(const QuantF32GemmArgs& a, int64_t g0, int64_t g1, int64_t m0, int64_t m1, float* /*scratch*/) {
  const int64_t nb = a.k / kQBlock;
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t t0 = m0; t0 < m1; t0 += kF32Rows) {
      const int64_t rt = imin(kF32Rows, a.m - t0);
      const float* xt = a.x + t0 * a.k;  // row t0 + i at xt + i * K
      float acc[kF32Rows][kQRows];
      for (auto& row : acc) {
        for (float& v : row) v = 0.f;
      }
      for (int64_t b = 0; b < nb; ++b) {
        for (int e = 0; e < kQBlock; ++e) {
          float w[kQRows];
          expand_scalar(a, g, b, e, w);
          const float* xe = xt + b * kQBlock + e;
          for (int64_t i = 0; i < rt; ++i) {
            for (int j = 0; j < kQRows; ++j) acc[i][j] = acc[i][j] + xe[i * a.k] * w[j];
          }
        }
      }
      for (int64_t i = 0; i < rt; ++i) write_out_f32(a, t0 + i, g * kQRows, acc[i]);
    }
  }
}

#elif PAGEDSERVE_QISA_LEVEL == 3
// ---- AVX-512 VNNI: 16 output rows per zmm, up to 8 activation rows per pass ----
//
// Each unpacked weight register serves every row of the pass (8 integer sums +
// 8 float accumulators + a few temporaries stay in the 32 zmm). The activations
// of the pass's rows for one block are one contiguous run (QuantActivations'
// layout), so one pointer with fixed offsets addresses them, as
// embedded-broadcast operands of vpdpbusd.
//
// What bounds it (a 2-core Sapphire Rapids VM without PMU counters, so found by
// removing instructions): vpdpbusd, the unpack and the float epilogue all issue
// to ports 0 and 5, two per cycle; per row and block that is 8 vpdpbusd + 4
// epilogue (cvt, d * xd, fma, fma for Q4_1) + 1.5 unpack, and the loads (mostly
// the broadcasts) come near their limit too: ~185 GMAC/s per core at M >= 8
// with the weights in cache, against ~410 for vpdpbusd alone.

constexpr int kRowsPerPass = 8;

typedef int32_t unaligned_i32 __attribute__((may_alias, aligned(1)));

// s += w . broadcast(the 4 int8 at p) per dword lane, the activation dword as an
// embedded-broadcast memory operand (GCC 12 would load it with a separate
// vpbroadcastd, one more instruction to issue per vpdpbusd).
inline __m512i dpbusd_bcst(__m512i s, __m512i w, const int8_t* p) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(s) : "v"(w), "m"(*reinterpret_cast<const unaligned_i32*>(p)));
  return s;
}

// out[r, c0 + j] = v[j] (+ bias) for j < min(16, N - c0): write_out's steps
// (one float add, float_to_bf16's rounding) lane-wise, masked at the right edge.
inline void store_row(const QuantGemmArgs& a, int64_t r, int64_t c0, __m512 v) {
  const int64_t nv = imin(kQRows, a.n - c0);
  const __mmask16 mask = static_cast<__mmask16>(nv >= 16 ? 0xFFFF : (1u << nv) - 1);
  if (a.bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, a.bias + c0));
  if (a.out_dtype == DType::kFloat32) {
    _mm512_mask_storeu_ps(static_cast<float*>(a.out) + r * a.n + c0, mask, v);
  } else {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i h = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    h = _mm512_mask_mov_epi32(h, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm512_mask_cvtepi32_storeu_epi16(static_cast<bf16*>(a.out) + r * a.n + c0, mask, h);
  }
}

// Out rows r .. r+R-1, columns 16 g .. 16 g + 15. Per block the tile is
// unpacked one 4-element group c at a time (one weight register), used by the
// R rows in turn: R independent vpdpbusd chains (two per row when R <= 2, to
// hide the latency), then per row the float epilogue.
// pf: nullptr, or the next row group's tiles, prefetched block by block (a
// model's weights do not stay in the caches from one step to the next; once a
// group's first pass has brought its tiles in, the other passes find them in L1).
template <TileFormat Q, int R>
void pass(const QuantGemmArgs& a, int64_t g, int64_t r, const uint8_t* pf) {
  constexpr int64_t kTile = tile_bytes(Q);
  // cache lines per tile: 320 bytes from a 64-byte boundary (Q4_1); 544 bytes
  // from offset 0 or 32 (Q8_0): 9 lines at pf + 64 j either way
  constexpr int kLines = (kTile + 63) / 64;
  constexpr int C = R <= 2 ? 2 : 1;  // integer chains per row
  const int64_t nb = a.k / kQBlock, m = a.m;
  const uint8_t* t = a.w + g * nb * kTile;
  const int8_t* xq = a.x.xq + r * kQBlock;  // then + 32 m per block
  const float* xd = a.x.xd + r;             // then + m per block (xs, xsum128 alike)
  const float* xs = a.x.xs + r;
  const int32_t* xsum128 = a.x.xsum128 + r;
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, t += kTile, xq += m * kQBlock, xd += m, xs += m, xsum128 += m) {
    if (pf != nullptr) {
      for (int j = 0; j < kLines; ++j) _mm_prefetch(reinterpret_cast<const char*>(pf) + 64 * j, _MM_HINT_T0);
      pf += kTile;
    }
    __m512i s[C][R];
    for (int i = 0; i < R; ++i) {
      s[0][i] = Q == TileFormat::kQ4_1 ? _mm512_setzero_si512() : _mm512_set1_epi32(xsum128[i]);
      if constexpr (C == 2) s[1][i] = _mm512_setzero_si512();
    }
    for (int c = 0; c < 8; ++c) {
      __m512i w;
      if constexpr (Q == TileFormat::kQ4_1) {
        const __m512i raw = _mm512_loadu_si512(t + 64 + 64 * (c & 3));
        w = _mm512_and_si512(c < 4 ? raw : _mm512_srli_epi16(raw, 4), _mm512_set1_epi8(0x0F));
      } else {
        w = _mm512_xor_si512(_mm512_loadu_si512(t + 32 + 64 * c), _mm512_set1_epi8(static_cast<char>(0x80)));
      }
      for (int i = 0; i < R; ++i) s[c % C][i] = dpbusd_bcst(s[c % C][i], w, xq + kQBlock * i + 4 * c);
    }
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)));
    for (int i = 0; i < R; ++i) {
      const __m512i si = C == 2 ? _mm512_add_epi32(s[0][i], s[C - 1][i]) : s[0][i];
      const __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(xd[i]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(si), scale, acc[i]);
    }
    if constexpr (Q == TileFormat::kQ4_1) {
      const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32)));
      for (int i = 0; i < R; ++i) acc[i] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[i]), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) store_row(a, r + i, g * kQRows, acc[i]);
}

// Row group by row group; the first pass over a group prefetches the next one
// (one group ahead: its first pass then finds the tiles in L1 or L2 instead of
// waiting on L3 / memory).
template <TileFormat Q>
void gemm_typed(const QuantGemmArgs& a, int64_t g0, int64_t g1, int64_t m0, int64_t m1) {
  constexpr int64_t kTile = tile_bytes(Q);
  const int64_t groups = (a.n + kQRows - 1) / kQRows, group_bytes = a.k / kQBlock * kTile;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* pf = g + 1 < groups ? a.w + (g + 1) * group_bytes : nullptr;
    int64_t r = m0;
    for (; r + kRowsPerPass <= m1; r += kRowsPerPass, pf = nullptr) pass<Q, kRowsPerPass>(a, g, r, pf);
    switch (m1 - r) {
      case 7: pass<Q, 7>(a, g, r, pf); break;
      case 6: pass<Q, 6>(a, g, r, pf); break;
      case 5: pass<Q, 5>(a, g, r, pf); break;
      case 4: pass<Q, 4>(a, g, r, pf); break;
      case 3: pass<Q, 3>(a, g, r, pf); break;
      case 2: pass<Q, 2>(a, g, r, pf); break;
      case 1: pass<Q, 1>(a, g, r, pf); break;
      default: break;
    }
  }
}

void gemm(const QuantGemmArgs& a, int64_t g0, int64_t g1, int64_t m0, int64_t m1) {
  if (gemm_of_decoded_tiles(a, g0, g1, m0, m1)) return;
  if (a.format == TileFormat::kQ4_1) {
    gemm_typed<TileFormat::kQ4_1>(a, g0, g1, m0, m1);
  } else {
    gemm_typed<TileFormat::kQ8_0>(a, g0, g1, m0, m1);
  }
}

// ---- exact float32 GEMM, AVX-512: 16 rows per zmm, G row groups x R activation rows ----
//
// A pass holds G x R accumulators (24 of the 32 zmm) and each expanded weight
// vector serves the R rows of the tile, the activation broadcast. Per k and
// row group the expansion costs a shift and a vpermps from the table 0.0 ..
// 15.0 (it reads the low 4 bits of each lane: the nibble, no mask) and the
// fma with d and m (Q4_1), or a byte shuffle, a conversion and a multiply
// (Q8_0). A single tile of rows (up to 12) expands two groups in registers
// (direct); more rows first expand three groups once into scratch, 192 k at a
// time (36 KB), which every tile of 8 rows then streams, keeping its partial
// sums in out between the K ranges. Why 3 x 8 and not 2 x 12 there: the
// 12-row tile's row pointers do not fit the general registers and spill
// (docs/benchmarks.md, "Behind the code").

// The dequantised weights of element e (0..31) of the tile at t for its 16
// rows: d, m the tile's scales (Q8_0: d * 2^-24).
template <TileFormat Q>
inline __attribute__((always_inline)) __m512 expand16(const uint8_t* t, int e, __m512 d, __m512 m) {
  if constexpr (dense_format(Q)) {
    (void)d;
    (void)m;
    if constexpr (Q == TileFormat::kF32) return _mm512_loadu_ps(reinterpret_cast<const float*>(t) + kQRows * e);
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 2 * kQRows * e));
    if constexpr (Q == TileFormat::kF16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));  // bfloat16: exact
  } else if constexpr (Q == TileFormat::kQ4_1 || Q == TileFormat::kU4F) {
    const int p = (e & 15) >> 2, shift = 8 * (e & 3) + (e < 16 ? 0 : 4);
    const __m512i raw = _mm512_loadu_si512(t + nibbles_at<Q>() + 64 * p);
    const __m512i idx = shift == 0 ? raw : _mm512_srli_epi32(raw, shift);
    const __m512 table = _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f,
                                        14.f, 15.f);
    return _mm512_fmadd_ps(_mm512_permutexvar_ps(idx, table), d, m);  // exact d * q: one rounding either way
  } else if constexpr (five_bit<Q>()) {
    const int p = (e & 15) >> 2, shift = 8 * (e & 3) + (e < 16 ? 0 : 4);
    const __m512i raw = _mm512_loadu_si512(t + k5FNibbles + 64 * p);
    const __m512i nib = _mm512_and_si512(_mm512_srli_epi32(raw, shift), _mm512_set1_epi32(0x0F));
    const __m512i qh = _mm512_loadu_si512(t + k5FHigh);
    const __m512i hb = _mm512_and_si512(e >= 4 ? _mm512_srli_epi32(qh, e - 4) : _mm512_slli_epi32(qh, 4 - e),
                                        _mm512_set1_epi32(0x10));
    const __m512i v = _mm512_or_si512(nib, hb);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), d, m);  // exact d * v, one rounding
  } else {
    const int c = e >> 2, byte = e & 3;
    const __m512i raw = _mm512_loadu_si512(t + (Q == TileFormat::kQ8_0 ? 32 : kI8FQuants) + 64 * c);
    // byte `byte` of each dword to its top byte, the rest zero: q * 2^24 as int32
    const int32_t top = static_cast<int32_t>(0x808080u | static_cast<uint32_t>(byte) << 24);
    const __m512i ctl = _mm512_add_epi32(_mm512_set1_epi32(top), _mm512_set_epi32(
        12 << 24, 8 << 24, 4 << 24, 0, 12 << 24, 8 << 24, 4 << 24, 0, 12 << 24, 8 << 24, 4 << 24, 0, 12 << 24,
        8 << 24, 4 << 24, 0));
    const __m512 q = _mm512_cvtepi32_ps(_mm512_shuffle_epi8(raw, ctl));
    if constexpr (Q == TileFormat::kI8F) return _mm512_fmadd_ps(q, d, m);  // exact d * q, one rounding
    (void)m;
    return _mm512_mul_ps(q, d);
  }
}

// The tile's scales for expand16: d (Q8_0, i8f: d * 2^-24) and m (Q4_1, u5f,
// u4f, i8f; else zero); eh: which 16 elements of the block (i8f's
// scales change there).
template <TileFormat Q>
inline __attribute__((always_inline)) void tile_scales(const uint8_t* t, __m512* d, __m512* m, int eh = 0) {
  if constexpr (dense_format(Q)) {  // no scales
    (void)t;
    (void)eh;
    *d = *m = _mm512_setzero_ps();
    return;
  }
  if constexpr (float_scales<Q>()) {
    *d = _mm512_loadu_ps(reinterpret_cast<const float*>(t));
    *m = _mm512_loadu_ps(reinterpret_cast<const float*>(t + 64));
    return;
  }
  if constexpr (Q == TileFormat::kI8F) {
    *d = _mm512_mul_ps(_mm512_loadu_ps(reinterpret_cast<const float*>(t) + kQRows * eh), _mm512_set1_ps(0x1p-24f));
    *m = _mm512_loadu_ps(reinterpret_cast<const float*>(t + 128) + kQRows * eh);
    return;
  }
  *d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)));
  if constexpr (Q == TileFormat::kQ4_1) {
    *m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32)));
  } else {
    *d = _mm512_mul_ps(*d, _mm512_set1_ps(0x1p-24f));
    *m = _mm512_setzero_ps();
  }
}

// out[r, c0 + j] = v[j] (+ bias) for j < min(16, N - c0), masked at the right edge.
inline void store_row_f32(const QuantF32GemmArgs& a, int64_t r, int64_t c0, __m512 v) {
  const int64_t nv = imin(kQRows, a.n - c0);
  const __mmask16 mask = static_cast<__mmask16>(nv >= 16 ? 0xFFFF : (1u << nv) - 1);
  if (a.bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, a.bias + c0));
  _mm512_mask_storeu_ps(a.out + r * a.ldo + c0, mask, v);
}

// Prefetches block b's tiles of row groups pg .. pg + G - 1 (those < groups).
template <TileFormat Q, int G>
inline __attribute__((always_inline)) void prefetch_tiles(const QuantF32GemmArgs& a, int64_t pg, int64_t groups,
                                                          int64_t b) {
  constexpr int64_t kTile = tile_bytes(Q);
  constexpr int kLines = (kTile + 63) / 64;
  const int64_t nb = a.k / kQBlock;
  for (int gi = 0; gi < G; ++gi) {
    if (pg + gi >= groups) break;
    const char* p = reinterpret_cast<const char*>(a.w + ((pg + gi) * nb + b) * kTile);
    for (int j = 0; j < kLines; ++j) _mm_prefetch(p + 64 * j, _MM_HINT_T0);
  }
}

// Out rows t0 .. t0+R-1 (the whole row tile at t0) x row groups g .. g+G-1,
// expanding in registers; prefetches the next G groups' tiles.
template <TileFormat Q, int G, int R>
void f32_direct(const QuantF32GemmArgs& a, int64_t g, int64_t t0) {
  constexpr int64_t kTile = tile_bytes(Q);
  const int64_t nb = a.k / kQBlock, gstride = nb * kTile, groups = (a.n + kQRows - 1) / kQRows;
  const uint8_t* t = a.w + g * gstride;
  const float* xr[R];  // the tile's rows; x[t0 + i, 32 b + e] at xr[i][e] in block b's iteration
  for (int i = 0; i < R; ++i) xr[i] = a.x + (t0 + i) * a.k;
  __m512 acc[G][R];
  for (int gi = 0; gi < G; ++gi) {
    for (int i = 0; i < R; ++i) acc[gi][i] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b, t += kTile) {
    prefetch_tiles<Q, G>(a, g + G, groups, b);
    __m512 d[G], m[G];
    for (int gi = 0; gi < G; ++gi) tile_scales<Q>(t + gi * gstride, &d[gi], &m[gi]);
#pragma GCC unroll 32
    for (int e = 0; e < kQBlock; ++e) {
      if (half_scales<Q>() && e == kQBlock / 2) {
        for (int gi = 0; gi < G; ++gi) tile_scales<Q>(t + gi * gstride, &d[gi], &m[gi], 1);
      }
      __m512 w[G];
      for (int gi = 0; gi < G; ++gi) w[gi] = expand16<Q>(t + gi * gstride, e, d[gi], m[gi]);
      for (int i = 0; i < R; ++i) {
        const __m512 xv = _mm512_set1_ps(xr[i][e]);
        for (int gi = 0; gi < G; ++gi) acc[gi][i] = _mm512_fmadd_ps(w[gi], xv, acc[gi][i]);
      }
    }
    for (int i = 0; i < R; ++i) xr[i] += kQBlock;
  }
  for (int i = 0; i < R; ++i) {
    for (int gi = 0; gi < G; ++gi) store_row_f32(a, t0 + i, (g + gi) * kQRows, acc[gi][i]);
  }
}

// ws[(k - 32 b0) * 16 G + 16 gi + j] = the weight of row 16 (g + gi) + j,
// element k, for the blocks [b0, b1).
template <TileFormat Q, int G>
void f32_expand(const QuantF32GemmArgs& a, int64_t g, int64_t b0, int64_t b1, float* ws) {
  constexpr int64_t kTile = tile_bytes(Q);
  const int64_t nb = a.k / kQBlock, gstride = nb * kTile, groups = (a.n + kQRows - 1) / kQRows;
  const uint8_t* t = a.w + g * gstride + b0 * kTile;
  for (int64_t b = b0; b < b1; ++b, t += kTile, ws += kQBlock * 16 * G) {
    prefetch_tiles<Q, G>(a, g + G, groups, b);
    __m512 d[G], m[G];
    for (int gi = 0; gi < G; ++gi) tile_scales<Q>(t + gi * gstride, &d[gi], &m[gi]);
#pragma GCC unroll 32
    for (int e = 0; e < kQBlock; ++e) {
      if (half_scales<Q>() && e == kQBlock / 2) {
        for (int gi = 0; gi < G; ++gi) tile_scales<Q>(t + gi * gstride, &d[gi], &m[gi], 1);
      }
      for (int gi = 0; gi < G; ++gi) {
        _mm512_store_ps(ws + (e * G + gi) * 16, expand16<Q>(t + gi * gstride, e, d[gi], m[gi]));
      }
    }
  }
}

// Out rows t0 .. t0+R-1 x row groups g .. g+G-1, the elements [k0, k1) of the
// sums from f32_expand's ws (the same blocks): the accumulators start at zero
// (k0 = 0) or at the partial sums stored in out by the previous range, and
// are stored back as they are, or + bias when k1 = K (the float steps of a
// single pass over K: a float32 store and load are exact).
template <int G, int R>
void f32_from_scratch(const QuantF32GemmArgs& a, int64_t g, int64_t t0, const float* ws, int64_t k0, int64_t k1) {
  const float* xr[R];  // x[t0 + i, k] at xr[i][k - k0]
  for (int i = 0; i < R; ++i) xr[i] = a.x + (t0 + i) * a.k + k0;
  __m512 acc[G][R];
  __mmask16 mask[G];
  for (int gi = 0; gi < G; ++gi) {
    const int64_t nv = imin(kQRows, a.n - (g + gi) * kQRows);
    mask[gi] = static_cast<__mmask16>(nv >= 16 ? 0xFFFF : nv <= 0 ? 0 : (1u << nv) - 1);
    for (int i = 0; i < R; ++i) {
      acc[gi][i] = k0 == 0 ? _mm512_setzero_ps()
                           : _mm512_maskz_loadu_ps(mask[gi], a.out + (t0 + i) * a.ldo + (g + gi) * kQRows);
    }
  }
#pragma GCC unroll 4
  for (int64_t k = 0; k < k1 - k0; ++k, ws += 16 * G) {
    __m512 w[G];
    for (int gi = 0; gi < G; ++gi) w[gi] = _mm512_load_ps(ws + 16 * gi);
    for (int i = 0; i < R; ++i) {
      const __m512 xv = _mm512_set1_ps(xr[i][k]);
      for (int gi = 0; gi < G; ++gi) acc[gi][i] = _mm512_fmadd_ps(w[gi], xv, acc[gi][i]);
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int gi = 0; gi < G; ++gi) {
      if (k1 == a.k) {
        store_row_f32(a, t0 + i, (g + gi) * kQRows, acc[gi][i]);
      } else {
        _mm512_mask_storeu_ps(a.out + (t0 + i) * a.ldo + (g + gi) * kQRows, mask[gi], acc[gi][i]);
      }
    }
  }
}

template <TileFormat Q, int G, int R>
void f32_tile(const QuantF32GemmArgs& a, int64_t g, int64_t t0, const float* ws, int64_t k0, int64_t k1) {
  if (ws == nullptr) {
    f32_direct<Q, G, R>(a, g, t0);
  } else {
    f32_from_scratch<G, R>(a, g, t0, ws, k0, k1);
  }
}

// One row tile (rt = its row count, 1 .. 12) x groups g .. g+G-1; ws: nullptr
// (expand in registers, all of K) or the groups' expanded weights of [k0, k1).
template <TileFormat Q, int G>
void f32_tile_rows(const QuantF32GemmArgs& a, int64_t g, int64_t t0, int64_t rt, const float* ws, int64_t k0,
                   int64_t k1) {
  switch (rt) {
    case 1: f32_tile<Q, G, 1>(a, g, t0, ws, k0, k1); break;
    case 2: f32_tile<Q, G, 2>(a, g, t0, ws, k0, k1); break;
    case 3: f32_tile<Q, G, 3>(a, g, t0, ws, k0, k1); break;
    case 4: f32_tile<Q, G, 4>(a, g, t0, ws, k0, k1); break;
    case 5: f32_tile<Q, G, 5>(a, g, t0, ws, k0, k1); break;
    case 6: f32_tile<Q, G, 6>(a, g, t0, ws, k0, k1); break;
    case 7: f32_tile<Q, G, 7>(a, g, t0, ws, k0, k1); break;
    case 8: f32_tile<Q, G, 8>(a, g, t0, ws, k0, k1); break;
    case 9: f32_tile<Q, G, 9>(a, g, t0, ws, k0, k1); break;
    case 10: f32_tile<Q, G, 10>(a, g, t0, ws, k0, k1); break;
    case 11: f32_tile<Q, G, 11>(a, g, t0, ws, k0, k1); break;
    default: f32_tile<Q, G, 12>(a, g, t0, ws, k0, k1); break;
  }
}

// Blocks per K range of the scratch path: the range's expanded weights (36 KB
// for three groups) are read by every row tile; fewer partial-sum reloads
// beat keeping them in L1 (docs/benchmarks.md, "Behind the code").
constexpr int64_t kF32ChunkBlocks = 6;

// Three row groups x up to 8 rows from the scratch (24 accumulators, as the
// 2 x 12 tile, but 8 row pointers: see the section's comment).
inline void f32_tile_rows3(const QuantF32GemmArgs& a, int64_t g, int64_t t0, int64_t rt, const float* ws, int64_t k0,
                           int64_t k1) {
  switch (rt) {
    case 1: f32_from_scratch<3, 1>(a, g, t0, ws, k0, k1); break;
    case 2: f32_from_scratch<3, 2>(a, g, t0, ws, k0, k1); break;
    case 3: f32_from_scratch<3, 3>(a, g, t0, ws, k0, k1); break;
    case 4: f32_from_scratch<3, 4>(a, g, t0, ws, k0, k1); break;
    case 5: f32_from_scratch<3, 5>(a, g, t0, ws, k0, k1); break;
    case 6: f32_from_scratch<3, 6>(a, g, t0, ws, k0, k1); break;
    case 7: f32_from_scratch<3, 7>(a, g, t0, ws, k0, k1); break;
    default: f32_from_scratch<3, 8>(a, g, t0, ws, k0, k1); break;
  }
}

constexpr int64_t kF32Rows3 = 8;  // rows per tile of the three-group scratch path

template <TileFormat Q, int G>
void f32_groups(const QuantF32GemmArgs& a, int64_t g, int64_t m0, int64_t m1, float* scratch) {
  if (G < 3 && m1 - m0 <= kF32Rows) {  // one tile: expand in registers
    f32_tile_rows<Q, G>(a, g, m0, m1 - m0, nullptr, 0, a.k);
    return;
  }
  const int64_t nb = a.k / kQBlock;
  for (int64_t b0 = 0; b0 < nb; b0 += kF32ChunkBlocks) {
    const int64_t b1 = imin(nb, b0 + kF32ChunkBlocks);
    f32_expand<Q, G>(a, g, b0, b1, scratch);
    if constexpr (G == 3) {
      for (int64_t t0 = m0; t0 < m1; t0 += kF32Rows3) {
        f32_tile_rows3(a, g, t0, imin(kF32Rows3, m1 - t0), scratch, b0 * kQBlock, b1 * kQBlock);
      }
    } else {
      for (int64_t t0 = m0; t0 < m1; t0 += kF32Rows) {
        f32_tile_rows<Q, G>(a, g, t0, imin(kF32Rows, a.m - t0), scratch, b0 * kQBlock, b1 * kQBlock);
      }
    }
  }
}

template <TileFormat Q>
void gemm_f32_typed(const QuantF32GemmArgs& a, int64_t g0, int64_t g1, int64_t m0, int64_t m1, float* scratch) {
  int64_t g = g0;
  if (m1 - m0 > kF32Rows) {
    for (; g + 3 <= g1; g += 3) f32_groups<Q, 3>(a, g, m0, m1, scratch);
  }
  for (; g + 2 <= g1; g += 2) f32_groups<Q, 2>(a, g, m0, m1, scratch);
  if (g < g1) f32_groups<Q, 1>(a, g, m0, m1, scratch);
}

#else
// ---- 256-bit (AVX-VNNI or AVX2): 8 output rows per ymm (half a row group), up to 4 activation rows ----
//
// Only 16 ymm: the tile is unpacked one 4-element group c at a time and used by
// every row of the pass before the next (R integer sums + R accumulators + the
// scales stay in registers).

constexpr int kRowsPerPass = 4;

// out[r, c0 + j] = v[j] (+ bias) for j < min(8, N - c0): write_out's steps
// (one float add, float_to_bf16's rounding) lane-wise; write_out itself at the
// right edge.
inline void store_row(const QuantGemmArgs& a, int64_t r, int64_t c0, __m256 v) {
  if (a.n - c0 < 8) {
    alignas(32) float buf[8];
    _mm256_store_ps(buf, v);
    write_out(a, r, c0, 8, buf);
    return;
  }
  if (a.bias != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(a.bias + c0));
  if (a.out_dtype == DType::kFloat32) {
    _mm256_storeu_ps(static_cast<float*>(a.out) + r * a.n + c0, v);
  } else {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i h = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    h = _mm256_blendv_epi8(h, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    const __m128i h16 = _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<bf16*>(a.out) + r * a.n + c0), h16);
  }
}

// Out rows r .. r+R-1, columns 16 g + 8 h .. 16 g + 8 h + 7; pf as in the
// AVX-512 pass.
template <TileFormat Q, int R>
void pass(const QuantGemmArgs& a, int64_t g, int h, int64_t r, const uint8_t* pf) {
  constexpr int64_t kTile = tile_bytes(Q);
  constexpr int kLines = (kTile + 63) / 64;
  const int64_t nb = a.k / kQBlock, m = a.m;
  const uint8_t* t = a.w + g * nb * kTile;
  const int8_t* xq = a.x.xq + r * kQBlock;  // then + 32 m per block; row i at + 32 i
  const float* xd = a.x.xd + r;             // then + m per block (xs, xsum128 alike)
  const float* xs = a.x.xs + r;
  const int32_t* xsum128 = a.x.xsum128 + r;
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, t += kTile, xq += m * kQBlock, xd += m, xs += m, xsum128 += m) {
    if (pf != nullptr) {
      for (int j = 0; j < kLines; ++j) _mm_prefetch(reinterpret_cast<const char*>(pf) + 64 * j, _MM_HINT_T0);
      pf += kTile;
    }
    __m256i s[R];
    if constexpr (Q == TileFormat::kQ4_1) {
      const __m256i low = _mm256_set1_epi8(0x0F);
#if PAGEDSERVE_QISA_LEVEL == 2
      for (int i = 0; i < R; ++i) s[i] = _mm256_setzero_si256();
      for (int p = 0; p < 4; ++p) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 64 + 64 * p + 32 * h));
        const __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        for (int i = 0; i < R; ++i) s[i] = _mm256_dpbusd_avx_epi32(s[i], lo, bcast_dword(xq + kQBlock * i + 4 * p));
        for (int i = 0; i < R; ++i) {
          s[i] = _mm256_dpbusd_avx_epi32(s[i], hi, bcast_dword(xq + kQBlock * i + 16 + 4 * p));
        }
      }
#else
      // i16 partial sums: |each vpmaddubsw| <= 2 * 15 * 127, eight of them < 32767
      __m256i p16[R];
      for (int p = 0; p < 4; ++p) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 64 + 64 * p + 32 * h));
        const __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        for (int i = 0; i < R; ++i) {
          const __m256i v = _mm256_maddubs_epi16(lo, bcast_dword(xq + kQBlock * i + 4 * p));
          p16[i] = p == 0 ? v : _mm256_add_epi16(p16[i], v);
        }
        for (int i = 0; i < R; ++i) {
          p16[i] = _mm256_add_epi16(p16[i], _mm256_maddubs_epi16(hi, bcast_dword(xq + kQBlock * i + 16 + 4 * p)));
        }
      }
      for (int i = 0; i < R; ++i) s[i] = _mm256_madd_epi16(p16[i], _mm256_set1_epi16(1));
#endif
    } else {
#if PAGEDSERVE_QISA_LEVEL == 2
      const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
      for (int i = 0; i < R; ++i) s[i] = _mm256_set1_epi32(xsum128[i]);
      for (int c = 0; c < 8; ++c) {
        const __m256i w =  // q + 128
            _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32 + 64 * c + 32 * h)), flip);
        for (int i = 0; i < R; ++i) s[i] = _mm256_dpbusd_avx_epi32(s[i], w, bcast_dword(xq + kQBlock * i + 4 * c));
      }
#else
      const __m256i ones = _mm256_set1_epi16(1);
      for (int i = 0; i < R; ++i) s[i] = _mm256_setzero_si256();
      for (int c = 0; c < 8; ++c) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32 + 64 * c + 32 * h));
        const __m256i aw = _mm256_sign_epi8(w, w);  // |q| (-128 -> 128 as u8)
        for (int i = 0; i < R; ++i) {
          const __m256i sx = _mm256_sign_epi8(bcast_dword(xq + kQBlock * i + 4 * c), w);  // x * sign(q)
          s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones));
        }
      }
#endif
    }
    const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 16 * h)));
    for (int i = 0; i < R; ++i) {
      const __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(xd[i]));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i]), scale, acc[i]);
    }
    if constexpr (Q == TileFormat::kQ4_1) {
      const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 32 + 16 * h)));
      for (int i = 0; i < R; ++i) acc[i] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs[i]), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) store_row(a, r + i, g * kQRows + 8 * h, acc[i]);
}

// The first pass over a group prefetches the next one (as in the AVX-512 gemm).
template <TileFormat Q>
void gemm_typed(const QuantGemmArgs& a, int64_t g0, int64_t g1, int64_t m0, int64_t m1) {
  constexpr int64_t kTile = tile_bytes(Q);
  const int64_t groups = (a.n + kQRows - 1) / kQRows, group_bytes = a.k / kQBlock * kTile;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* pf = g + 1 < groups ? a.w + (g + 1) * group_bytes : nullptr;
    for (int h = 0; h < 2; ++h) {
      if (g * kQRows + 8 * h >= a.n) break;  // padding rows only
      int64_t r = m0;
      for (; r + kRowsPerPass <= m1; r += kRowsPerPass, pf = nullptr) pass<Q, kRowsPerPass>(a, g, h, r, pf);
      switch (m1 - r) {
        case 3: pass<Q, 3>(a, g, h, r, pf); break;
        case 2: pass<Q, 2>(a, g, h, r, pf); break;
        case 1: pass<Q, 1>(a, g, h, r, pf); break;
        default: break;
      }
      pf = nullptr;
    }
  }
}

void gemm(const QuantGemmArgs& a, int64_t g0, int64_t g1, int64_t m0, int64_t m1) {
  if (gemm_of_decoded_tiles(a, g0, g1, m0, m1)) return;
  if (a.format == TileFormat::kQ4_1) {
    gemm_typed<TileFormat::kQ4_1>(a, g0, g1, m0, m1);
  } else {
    gemm_typed<TileFormat::kQ8_0>(a, g0, g1, m0, m1);
  }
}
// ---- exact float32 GEMM, 256-bit (AVX2 + FMA): one row group (two ymm) x up to 6 activation rows ----
//
// 2 x R accumulators (R <= 6) of the 16 ymm; a 12-row tile of the
// activations runs as two passes of up to 6 rows. Per k and half group the
// expansion is a shift, a mask and a conversion then the fma with d and m
// (Q4_1; vpermps would index only 8 entries), or a byte shuffle, a conversion
// and a multiply (Q8_0). One pass of rows expands in registers; more rows
// first expand the group once into scratch (K x 16 floats).

// The dequantised weights of element e of the tile at t for rows 8 h .. 8 h + 7
// of its group; d, m that half's scales (Q8_0: d * 2^-24).
template <TileFormat Q>
inline __attribute__((always_inline)) __m256 expand8(const uint8_t* t, int h, int e, __m256 d, __m256 m) {
  if constexpr (dense_format(Q)) {
    (void)d;
    (void)m;
    if constexpr (Q == TileFormat::kF32) return _mm256_loadu_ps(reinterpret_cast<const float*>(t) + kQRows * e + 8 * h);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 2 * kQRows * e + 16 * h));
    if constexpr (Q == TileFormat::kF16) return _mm256_cvtph_ps(v);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));  // bfloat16: exact
  } else if constexpr (Q == TileFormat::kQ4_1 || Q == TileFormat::kU4F) {
    const int p = (e & 15) >> 2, shift = 8 * (e & 3) + (e < 16 ? 0 : 4);
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + nibbles_at<Q>() + 64 * p + 32 * h));
    const __m256i q = shift == 28 ? _mm256_srli_epi32(raw, 28)
                                  : _mm256_and_si256(_mm256_srli_epi32(raw, shift), _mm256_set1_epi32(0x0F));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m);  // exact d * q: one rounding either way
  } else if constexpr (five_bit<Q>()) {
    const int p = (e & 15) >> 2, shift = 8 * (e & 3) + (e < 16 ? 0 : 4);
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + k5FNibbles + 64 * p + 32 * h));
    const __m256i nib = shift == 28 ? _mm256_srli_epi32(raw, 28)
                                    : _mm256_and_si256(_mm256_srli_epi32(raw, shift), _mm256_set1_epi32(0x0F));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + k5FHigh + 32 * h));
    const __m256i hb = _mm256_and_si256(e >= 4 ? _mm256_srli_epi32(qh, e - 4) : _mm256_slli_epi32(qh, 4 - e),
                                        _mm256_set1_epi32(0x10));
    const __m256i v = _mm256_or_si256(nib, hb);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), d, m);  // exact d * v, one rounding
  } else {
    const int c = e >> 2, byte = e & 3;
    const int base = Q == TileFormat::kQ8_0 ? 32 : kI8FQuants;
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + base + 64 * c + 32 * h));
    const int32_t top = static_cast<int32_t>(0x808080u | static_cast<uint32_t>(byte) << 24);
    const __m256i ctl = _mm256_add_epi32(_mm256_set1_epi32(top),
                                         _mm256_set_epi32(12 << 24, 8 << 24, 4 << 24, 0, 12 << 24, 8 << 24, 4 << 24, 0));
    const __m256 q = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(raw, ctl));
    if constexpr (Q == TileFormat::kI8F) return _mm256_fmadd_ps(q, d, m);  // exact d * q, one rounding
    (void)m;
    return _mm256_mul_ps(q, d);
  }
}

// The scales of rows 8 h .. 8 h + 7 for expand8: d (Q8_0, i8f: d * 2^-24) and
// m (Q4_1, u5f, u4f, i8f; else zero); eh: which 16 elements of the
// block (i8f's scales change there).
template <TileFormat Q>
inline __attribute__((always_inline)) void tile_scales(const uint8_t* t, int h, __m256* d, __m256* m, int eh = 0) {
  if constexpr (dense_format(Q)) {  // no scales
    (void)t;
    (void)h;
    (void)eh;
    *d = *m = _mm256_setzero_ps();
    return;
  }
  if constexpr (float_scales<Q>()) {
    *d = _mm256_loadu_ps(reinterpret_cast<const float*>(t) + 8 * h);
    *m = _mm256_loadu_ps(reinterpret_cast<const float*>(t + 64) + 8 * h);
    return;
  }
  if constexpr (Q == TileFormat::kI8F) {
    const float* s = reinterpret_cast<const float*>(t) + kQRows * eh + 8 * h;
    *d = _mm256_mul_ps(_mm256_loadu_ps(s), _mm256_set1_ps(0x1p-24f));
    *m = _mm256_loadu_ps(s + 2 * kQRows);
    return;
  }
  *d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 16 * h)));
  if constexpr (Q == TileFormat::kQ4_1) {
    *m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 32 + 16 * h)));
  } else {
    *d = _mm256_mul_ps(*d, _mm256_set1_ps(0x1p-24f));
    *m = _mm256_setzero_ps();
  }
}

// out[r, c0 + j] = v[j] (+ bias) for j < min(8, N - c0).
inline void store_row_f32(const QuantF32GemmArgs& a, int64_t r, int64_t c0, __m256 v) {
  if (c0 >= a.n) return;
  if (a.n - c0 < 8) {
    alignas(32) float buf[8];
    _mm256_store_ps(buf, v);
    for (int64_t j = 0; j < a.n - c0; ++j) a.out[r * a.ldo + c0 + j] = a.bias != nullptr ? buf[j] + a.bias[c0 + j] : buf[j];
    return;
  }
  if (a.bias != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(a.bias + c0));
  _mm256_storeu_ps(a.out + r * a.ldo + c0, v);
}

// Out rows t0 + i0 .. t0 + i0 + R - 1 of the row tile at t0 x row group g,
// the weights expanded in registers (R <= kF32DirectRows, see f32_pass).
template <TileFormat Q, int R>
void f32_pass_direct(const QuantF32GemmArgs& a, int64_t g, int64_t t0, int64_t i0) {
  constexpr int64_t kTile = tile_bytes(Q);
  constexpr int kLines = (kTile + 63) / 64;
  const int64_t nb = a.k / kQBlock, groups = (a.n + kQRows - 1) / kQRows;
  const uint8_t* t = a.w + g * nb * kTile;
  const uint8_t* pf = g + 1 < groups ? t + nb * kTile : nullptr;
  const float* xr[R];  // x[t0 + i0 + i, k] at xr[i][k]
  for (int i = 0; i < R; ++i) xr[i] = a.x + (t0 + i0 + i) * a.k;
  __m256 acc[2][R];
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < R; ++i) acc[h][i] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b, t += kTile) {
    if (pf != nullptr) {
      for (int j = 0; j < kLines; ++j) _mm_prefetch(reinterpret_cast<const char*>(pf) + 64 * j, _MM_HINT_T0);
      pf += kTile;
    }
    __m256 d[2], m[2];
    for (int h = 0; h < 2; ++h) tile_scales<Q>(t, h, &d[h], &m[h]);
    const int64_t kb = b * kQBlock;
#pragma GCC unroll 32
    for (int e = 0; e < kQBlock; ++e) {
      if (half_scales<Q>() && e == kQBlock / 2) {
        for (int h = 0; h < 2; ++h) tile_scales<Q>(t, h, &d[h], &m[h], 1);
      }
      __m256 w[2];
      for (int h = 0; h < 2; ++h) w[h] = expand8<Q>(t, h, e, d[h], m[h]);
      for (int i = 0; i < R; ++i) {
        const __m256 xv = _mm256_broadcast_ss(xr[i] + kb + e);
        for (int h = 0; h < 2; ++h) acc[h][i] = _mm256_fmadd_ps(w[h], xv, acc[h][i]);
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int h = 0; h < 2; ++h) store_row_f32(a, t0 + i0 + i, g * kQRows + 8 * h, acc[h][i]);
  }
}

// One activation row r x the two row groups g, g + 1: four independent FMA
// chains (two per group) instead of f32_pass_direct's two, whose 5-cycle FMA
// latency otherwise bounds a single-row call (a decode step of one sequence;
// docs/benchmarks.md, "Behind the code"). Each output's chain is
// f32_pass_direct's, k = 0 .. K-1 in order, so the results are the same bits.
template <TileFormat Q>
void f32_pass_direct_pair(const QuantF32GemmArgs& a, int64_t g, int64_t r) {
  constexpr int64_t kTile = tile_bytes(Q);
  constexpr int kLines = (kTile + 63) / 64;
  const int64_t nb = a.k / kQBlock, groups = (a.n + kQRows - 1) / kQRows, group_bytes = nb * kTile;
  const uint8_t* t[2] = {a.w + g * group_bytes, a.w + (g + 1) * group_bytes};
  const uint8_t* pf = g + 2 < groups ? t[1] + group_bytes : nullptr;  // the next pair's first group
  const int64_t pf_groups = g + 3 < groups ? 2 : 1;
  const float* xr = a.x + r * a.k;
  __m256 acc[2][2];
  for (auto& row : acc) {
    for (__m256& v : row) v = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b, t[0] += kTile, t[1] += kTile) {
    if (pf != nullptr) {
      for (int64_t p = 0; p < pf_groups; ++p) {
        for (int j = 0; j < kLines; ++j) {
          _mm_prefetch(reinterpret_cast<const char*>(pf + p * group_bytes) + 64 * j, _MM_HINT_T0);
        }
      }
      pf += kTile;
    }
    __m256 d[2][2], m[2][2];
    for (int p = 0; p < 2; ++p) {
      for (int h = 0; h < 2; ++h) tile_scales<Q>(t[p], h, &d[p][h], &m[p][h]);
    }
    const float* xb = xr + b * kQBlock;
#pragma GCC unroll 32
    for (int e = 0; e < kQBlock; ++e) {
      if (half_scales<Q>() && e == kQBlock / 2) {
        for (int p = 0; p < 2; ++p) {
          for (int h = 0; h < 2; ++h) tile_scales<Q>(t[p], h, &d[p][h], &m[p][h], 1);
        }
      }
      const __m256 xv = _mm256_broadcast_ss(xb + e);
      for (int p = 0; p < 2; ++p) {
        for (int h = 0; h < 2; ++h) acc[p][h] = _mm256_fmadd_ps(expand8<Q>(t[p], h, e, d[p][h], m[p][h]), xv, acc[p][h]);
      }
    }
  }
  for (int p = 0; p < 2; ++p) {
    for (int h = 0; h < 2; ++h) store_row_f32(a, r, (g + p) * kQRows + 8 * h, acc[p][h]);
  }
}

// The same rows from f32_expand's ws. Its own function, with the trip count
// in a local: sharing the accumulators with f32_pass_direct's loop made GCC
// keep them in memory and store all 12 after every k (half the FMA peak:
// docs/benchmarks.md, "Behind the code").
template <int R>
void f32_pass_scratch(const QuantF32GemmArgs& a, int64_t g, int64_t t0, int64_t i0, const float* ws) {
  const int64_t k_end = a.k;
  const float* xr[R];  // x[t0 + i0 + i, k] at xr[i][k]
  for (int i = 0; i < R; ++i) xr[i] = a.x + (t0 + i0 + i) * a.k;
  __m256 acc0[R], acc1[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) acc0[i] = acc1[i] = _mm256_setzero_ps();
#pragma GCC unroll 4
  for (int64_t k = 0; k < k_end; ++k, ws += 16) {
    const __m256 w0 = _mm256_load_ps(ws), w1 = _mm256_load_ps(ws + 8);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m256 xv = _mm256_broadcast_ss(xr[i] + k);
      acc0[i] = _mm256_fmadd_ps(w0, xv, acc0[i]);
      acc1[i] = _mm256_fmadd_ps(w1, xv, acc1[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    store_row_f32(a, t0 + i0 + i, g * kQRows, acc0[i]);
    store_row_f32(a, t0 + i0 + i, g * kQRows + 8, acc1[i]);
  }
}

// Up to kF32DirectRows rows expand in registers: 2 x 4 accumulators, the
// scales, the expanded pair and the broadcast take the 16 ymm (with 6 rows
// GCC spilled accumulators in the unrolled loop: docs/benchmarks.md, "Behind the code"); more rows go
// through f32_expand.
constexpr int kF32DirectRows = 4;

// ws: nullptr (expand in registers; R <= kF32DirectRows) or f32_expand's weights.
template <TileFormat Q, int R>
void f32_pass(const QuantF32GemmArgs& a, int64_t g, int64_t t0, int64_t i0, const float* ws) {
  if constexpr (R <= kF32DirectRows) {
    if (ws == nullptr) {
      f32_pass_direct<Q, R>(a, g, t0, i0);
      return;
    }
  }
  f32_pass_scratch<R>(a, g, t0, i0, ws);
}

// ws[16 k + 8 h + j] = the weight of row 16 g + 8 h + j, element k.
template <TileFormat Q>
void f32_expand(const QuantF32GemmArgs& a, int64_t g, float* ws) {
  constexpr int64_t kTile = tile_bytes(Q);
  const int64_t nb = a.k / kQBlock;
  const uint8_t* t = a.w + g * nb * kTile;
  for (int64_t b = 0; b < nb; ++b, t += kTile, ws += kQBlock * 16) {
    __m256 d[2], m[2];
    for (int h = 0; h < 2; ++h) tile_scales<Q>(t, h, &d[h], &m[h]);
#pragma GCC unroll 32
    for (int e = 0; e < kQBlock; ++e) {
      if (half_scales<Q>() && e == kQBlock / 2) {
        for (int h = 0; h < 2; ++h) tile_scales<Q>(t, h, &d[h], &m[h], 1);
      }
      for (int h = 0; h < 2; ++h) _mm256_store_ps(ws + 16 * e + 8 * h, expand8<Q>(t, h, e, d[h], m[h]));
    }
  }
}

template <TileFormat Q>
void f32_rows(const QuantF32GemmArgs& a, int64_t g, int64_t t0, int64_t i0, int64_t rows, const float* ws) {
  switch (rows) {
    case 1: f32_pass<Q, 1>(a, g, t0, i0, ws); break;
    case 2: f32_pass<Q, 2>(a, g, t0, i0, ws); break;
    case 3: f32_pass<Q, 3>(a, g, t0, i0, ws); break;
    case 4: f32_pass<Q, 4>(a, g, t0, i0, ws); break;
    case 5: f32_pass<Q, 5>(a, g, t0, i0, ws); break;
    default: f32_pass<Q, 6>(a, g, t0, i0, ws); break;
  }
}

// A tile's rows run as passes of equal size (8 rows: 4 + 4, not 6 + 2, whose
// 4 accumulators cannot cover the FMA latency).
template <TileFormat Q>
void gemm_f32_typed(const QuantF32GemmArgs& a, int64_t g0, int64_t g1, int64_t m0, int64_t m1, float* scratch) {
  constexpr int64_t kPassRows = kF32Rows / 2;
  for (int64_t g = g0; g < g1; ++g) {
    if (m1 - m0 == 1 && g + 1 < g1) {  // one row: two groups at a time (f32_pass_direct_pair)
      f32_pass_direct_pair<Q>(a, g, m0);
      ++g;
      continue;
    }
    const float* ws = nullptr;
    if (m1 - m0 > kF32DirectRows) {  // expand the group once for all passes
      f32_expand<Q>(a, g, scratch);
      ws = scratch;
    }
    for (int64_t t0 = m0; t0 < m1; t0 += kF32Rows) {
      const int64_t rt = imin(kF32Rows, a.m - t0), passes = (rt + kPassRows - 1) / kPassRows;
      const int64_t per_pass = (rt + passes - 1) / passes;
      for (int64_t i0 = 0; i0 < rt; i0 += per_pass) f32_rows<Q>(a, g, t0, i0, imin(per_pass, rt - i0), ws);
    }
  }
}

#endif

#if PAGEDSERVE_QISA_LEVEL != 0
// Both SIMD levels: their gemm_f32_typed per block type.
void gemm_f32(const QuantF32GemmArgs& a, int64_t g0, int64_t g1, int64_t m0, int64_t m1, float* scratch) {
  switch (a.format) {
    case TileFormat::kQ4_1: gemm_f32_typed<TileFormat::kQ4_1>(a, g0, g1, m0, m1, scratch); break;
    case TileFormat::kQ8_0: gemm_f32_typed<TileFormat::kQ8_0>(a, g0, g1, m0, m1, scratch); break;
    case TileFormat::kU5F: gemm_f32_typed<TileFormat::kU5F>(a, g0, g1, m0, m1, scratch); break;
    case TileFormat::kU4F: gemm_f32_typed<TileFormat::kU4F>(a, g0, g1, m0, m1, scratch); break;
    case TileFormat::kI8F: gemm_f32_typed<TileFormat::kI8F>(a, g0, g1, m0, m1, scratch); break;
    case TileFormat::kF32: gemm_f32_typed<TileFormat::kF32>(a, g0, g1, m0, m1, scratch); break;
    case TileFormat::kF16: gemm_f32_typed<TileFormat::kF16>(a, g0, g1, m0, m1, scratch); break;
    case TileFormat::kBF16: gemm_f32_typed<TileFormat::kBF16>(a, g0, g1, m0, m1, scratch); break;
  }
}
#endif

const QuantKernelTable kTable{PS_STR(PAGEDSERVE_QISA), &quantize_rows, &gemm, &gemm_f32};

}  // namespace

const QuantKernelTable& PS_CAT(quant_kernel_table_, PAGEDSERVE_QISA)() { return kTable; }

}  // namespace cpu
}  // namespace pagedserve
