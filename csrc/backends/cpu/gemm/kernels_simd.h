// What the SIMD variants of the quantized linear kernels share
// (kernels_avx2.cc, kernels_avx512.cc include it after kernels_common.h and
// after defining their lane primitives: VecF / VecI, kLanes, load_lanes,
// abs_max, hmax, nan_to_zero, set1f, mulf, addf, subf, fmaddf, minf, maxf,
// trunc_i32, store_q): the activation quantisation over those primitives, the
// float half of the roofline's peak probe (peak_fma_ops), the integer
// GEMM of the decoded tiles (256-bit AVX2 instructions in every SIMD variant),
// and the dispatch of gemm and gemm_f32 to the file's gemm_typed and
// gemm_f32_typed. Internal linkage throughout, as kernels_common.h.
#pragma once

#include <immintrin.h>

#include "backends/cpu/gemm/kernels_common.h"

namespace pagedserve {
namespace cpu {
namespace {

// The scalar variant's steps, lane-wise, hence bit-identical to it: amax is the
// max of the non-NaN |v| (max_ps(a, b) is a > b ? a : b, so a NaN |v| never
// replaces the running value, as in the scalar loop; the max of non-NaN values
// does not depend on the order); d, id and xs are the same scalar expressions;
// per element the same multiply, NaN -> 0, clamp (min then max: no NaN is left),
// + (2^23 + 2^22) - (2^23 + 2^22) and truncation; the integer sum is exact in any
// order.

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

// ---- the integer GEMM of the decoded tiles (u4k, u5f, i6f): every SIMD variant ----
//
// 8 output rows per ymm (half a row group), up to 4 activation rows a pass,
// in AVX2 instructions only (the AVX2 variant's vpmaddubsw + vpmaddwd forms),
// so the VNNI variants run the very sequence the AVX2 variant runs (and its
// tests check on any AVX2 CPU); a vpdpbusd form for them is left for later.
//   u4k / u5f: unsigned quants (0..15 / 0..31; the high bit of element e is
//     bit e of the row's qh word, spread to bit 4 of its byte by a multiply),
//     four vpmaddubsw per i16 partial sum (each at most 2 * 31 * 127, four
//     below 32767), then per block, d and m float32 (u4k: formed from its
//     bytes and the super-block scales, exactly):
//       acc = fma(isum, d * xd, acc); acc = fma(m, xs, acc)
//   i6f: the nibble and the 2-bit field joined, - 32, then signed as the
//     AVX2 Q8_0 form (|q| times sign(xq, q)), one integer sum per 16
//     elements (a scale each):
//       acc = fma(isum_lo, d_lo * xd, acc); acc = fma(isum_hi, d_hi * xd, acc)

constexpr int kDecodedRowsPerPass = 4;

// The activation dword at p in every lane (the 256-bit integer kernels' operand: these and the decoded tiles').
inline __m256i bcast_dword(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, sizeof v);
  return _mm256_set1_epi32(v);
}

// The 8 bytes at p (u4k's 6-bit scales or minima of 8 rows) as floats.
inline __m256 bytes_to_floats(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Per dword lane: bit 4 of byte b = bit b of the lane's low 4 bits (v * 0x00204081 places copies of those 4
// bits at bits 0, 7, 14 and 21 without overlap; bit 8 b of the product is bit b of v).
inline __m256i high_bits_to_bytes(__m256i v) {
  const __m256i low4 = _mm256_and_si256(v, _mm256_set1_epi32(0x0F));
  const __m256i spread = _mm256_mullo_epi32(low4, _mm256_set1_epi32(0x00204081));
  return _mm256_slli_epi32(_mm256_and_si256(spread, _mm256_set1_epi32(0x01010101)), 4);
}

// Out rows r .. r+R-1, columns 16 g + 8 h .. 16 g + 8 h + 7. pf: nullptr, or
// the next row group's tiles, prefetched block by block into L2 (as
// kernels_avx512.cc's pass; a group of i6f tiles at K = 1536 is 24 KB, more
// than L1 keeps beside the group being read): a cold GEMV of Q6_K tiles ran
// 1.2-1.9x faster with it (docs/benchmarks.md, "Behind the code").
template <TileFormat Q, int R>
void pass_decoded(const QuantGemmArgs& a, int64_t g, int h, int64_t r, const uint8_t* pf) {
  constexpr int64_t kTile = tile_bytes(Q);
  constexpr int kLines = (kTile + 63) / 64;
  const int64_t nb = a.k / kQBlock, m = a.m;
  const uint8_t* t = a.w + g * nb * kTile;
  const int8_t* xq = a.x.xq + r * kQBlock;  // then + 32 m per block; row i at + 32 i
  const float* xd = a.x.xd + r;             // then + m per block (xs alike)
  const float* xs = a.x.xs + r;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, t += kTile, xq += m * kQBlock, xd += m, xs += m) {
    if (pf != nullptr) {
      for (int j = 0; j < kLines; ++j) _mm_prefetch(reinterpret_cast<const char*>(pf) + 64 * j, _MM_HINT_T1);
      pf += kTile;
    }
    if constexpr (Q == TileFormat::kI6F) {
      const __m256i low = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30), bias = _mm256_set1_epi8(32);
      const __m256i qh[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + kI6FHigh + 32 * h)),
                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + kI6FHigh + 64 + 32 * h))};
      __m256i s[2][R], p16[R];
      for (int half = 0; half < 2; ++half) {  // elements 16 half + 4 p + b, a scale each half
        for (int i = 0; i < R; ++i) p16[i] = _mm256_setzero_si256();
        for (int p = 0; p < 4; ++p) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + kI6FNibbles + 64 * p + 32 * h));
          const __m256i nib = _mm256_and_si256(half == 0 ? raw : _mm256_srli_epi16(raw, 4), low);
          // the 2-bit field at bit 4 (p & 1) + 2 half of each byte, moved to bits 4..5 (16-bit shifts: the
          // mask keeps only bits that came from the same byte)
          const int at = 4 * (p & 1) + 2 * half;
          const __m256i q2 = qh[p >> 1];
          const __m256i hi = _mm256_and_si256(at < 4 ? _mm256_slli_epi16(q2, 4 - at)
                                              : at > 4 ? _mm256_srli_epi16(q2, at - 4) : q2, bits45);
          const __m256i w = _mm256_sub_epi8(_mm256_or_si256(nib, hi), bias);  // v - 32 in -32 .. 31
          const __m256i aw = _mm256_sign_epi8(w, w);                           // |v - 32| <= 32
          for (int i = 0; i < R; ++i) {  // four products of at most 2 * 32 * 127 each: no i16 overflow
            const __m256i sx = _mm256_sign_epi8(bcast_dword(xq + kQBlock * i + 16 * half + 4 * p), w);
            p16[i] = _mm256_add_epi16(p16[i], _mm256_maddubs_epi16(aw, sx));
          }
        }
        for (int i = 0; i < R; ++i) s[half][i] = _mm256_madd_epi16(p16[i], ones);
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
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + nibbles_at<Q>() + 64 * p + 32 * h));
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
      __m256 dv, mv;
      if constexpr (Q == TileFormat::kU4K) {  // d sc and nm mn, both exact (kernel_table.h)
        const float* super = u4k_super(a.w, a.n, a.k, g, b);
        dv = _mm256_mul_ps(_mm256_loadu_ps(super + 8 * h), bytes_to_floats(t + 8 * h));
        mv = _mm256_mul_ps(_mm256_loadu_ps(super + kQRows + 8 * h), bytes_to_floats(t + kQRows + 8 * h));
      } else {
        dv = _mm256_loadu_ps(reinterpret_cast<const float*>(t) + 8 * h);       // float d[16] at 0
        mv = _mm256_loadu_ps(reinterpret_cast<const float*>(t + 64) + 8 * h);  // float m[16] at 64
      }
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

// The first pass over a group prefetches the next one.
template <TileFormat Q>
void gemm_decoded(const QuantGemmArgs& a, int64_t g0, int64_t g1, int64_t m0, int64_t m1) {
  constexpr int64_t kTile = tile_bytes(Q);
  const int64_t groups = (a.n + kQRows - 1) / kQRows, group_bytes = a.k / kQBlock * kTile;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* pf = g + 1 < groups ? a.w + (g + 1) * group_bytes : nullptr;
    for (int h = 0; h < 2; ++h) {
      if (g * kQRows + 8 * h >= a.n) break;  // padding rows only
      int64_t r = m0;
      for (; r + kDecodedRowsPerPass <= m1; r += kDecodedRowsPerPass, pf = nullptr) {
        pass_decoded<Q, kDecodedRowsPerPass>(a, g, h, r, pf);
      }
      switch (m1 - r) {
        case 3: pass_decoded<Q, 3>(a, g, h, r, pf); break;
        case 2: pass_decoded<Q, 2>(a, g, h, r, pf); break;
        case 1: pass_decoded<Q, 1>(a, g, h, r, pf); break;
        default: break;
      }
      pf = nullptr;
    }
  }
}

// The SIMD variants' gemm for the decoded tiles; false for q4_1 / q8_0 (the variant's own kernels).
inline bool gemm_of_decoded_tiles(const QuantGemmArgs& a, int64_t g0, int64_t g1, int64_t m0, int64_t m1) {
  switch (a.format) {
    case TileFormat::kU4K: gemm_decoded<TileFormat::kU4K>(a, g0, g1, m0, m1); return true;
    case TileFormat::kU5F: gemm_decoded<TileFormat::kU5F>(a, g0, g1, m0, m1); return true;
    case TileFormat::kI6F: gemm_decoded<TileFormat::kI6F>(a, g0, g1, m0, m1); return true;
    default: return false;
  }
}

// The file's kernels for one tile format (defined after this header is included).
template <TileFormat Q>
void gemm_typed(const QuantGemmArgs& a, int64_t g0, int64_t g1, int64_t m0, int64_t m1);
template <TileFormat Q>
void gemm_f32_typed(const QuantF32GemmArgs& a, int64_t g0, int64_t g1, int64_t m0, int64_t m1, float* scratch);

// kernel_table.h's peak_ops, kind kPeakFma: 12 register-resident chains of the
// variant's widest float32 FMA (Zen / Intel latency 4-5 x 2 pipes needs at
// least 10), `iters` rounds; returns the operations done (2 per lane).
double peak_fma_ops(int64_t iters) {
  constexpr int kChains = 12;
  volatile float sink = 0.f;
  VecF acc[kChains];
  const VecF x = set1f(1.0000001f), y = set1f(0.999999f);
  for (int j = 0; j < kChains; ++j) acc[j] = set1f(static_cast<float>(j) + sink);
  for (int64_t i = 0; i < iters; ++i) {
    for (int j = 0; j < kChains; ++j) acc[j] = fmaddf(acc[j], x, y);
  }
  VecF s = acc[0];
  for (int j = 1; j < kChains; ++j) s = addf(s, acc[j]);
  sink = hmax(s);
  return 2.0 * kLanes * kChains * static_cast<double>(iters);
}

void gemm(const QuantGemmArgs& a, int64_t g0, int64_t g1, int64_t m0, int64_t m1) {
  if (gemm_of_decoded_tiles(a, g0, g1, m0, m1)) return;
  if (a.format == TileFormat::kQ4_1) {
    gemm_typed<TileFormat::kQ4_1>(a, g0, g1, m0, m1);
  } else {
    gemm_typed<TileFormat::kQ8_0>(a, g0, g1, m0, m1);
  }
}

// The exact float32 GEMM: the file's gemm_f32_typed per tile format.
void gemm_f32(const QuantF32GemmArgs& a, int64_t g0, int64_t g1, int64_t m0, int64_t m1, float* scratch) {
  switch (a.format) {
    case TileFormat::kQ4_1: gemm_f32_typed<TileFormat::kQ4_1>(a, g0, g1, m0, m1, scratch); break;
    case TileFormat::kQ8_0: gemm_f32_typed<TileFormat::kQ8_0>(a, g0, g1, m0, m1, scratch); break;
    case TileFormat::kU5F: gemm_f32_typed<TileFormat::kU5F>(a, g0, g1, m0, m1, scratch); break;
    case TileFormat::kU4K: gemm_f32_typed<TileFormat::kU4K>(a, g0, g1, m0, m1, scratch); break;
    case TileFormat::kI6F: gemm_f32_typed<TileFormat::kI6F>(a, g0, g1, m0, m1, scratch); break;
    case TileFormat::kF32: gemm_f32_typed<TileFormat::kF32>(a, g0, g1, m0, m1, scratch); break;
    case TileFormat::kF16: gemm_f32_typed<TileFormat::kF16>(a, g0, g1, m0, m1, scratch); break;
    case TileFormat::kBF16: gemm_f32_typed<TileFormat::kBF16>(a, g0, g1, m0, m1, scratch); break;
  }
}

}  // namespace
}  // namespace cpu
}  // namespace pagedserve
