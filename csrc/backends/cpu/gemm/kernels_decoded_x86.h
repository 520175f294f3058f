// The integer GEMM of the decoded tiles (u4k, u5f, i6f) the x86 variants share
// (kernels_avx2.cc and kernels_avx512.cc include it, in place of kernels_simd.h,
// which it includes, after defining their lane primitives; their gemm_typed
// hands these formats to gemm_decoded). Internal linkage
// throughout, as kernels_common.h.
#pragma once

#include <immintrin.h>

#include "backends/cpu/gemm/kernels_simd.h"

namespace pagedserve {
namespace cpu {
namespace {

// ---- the integer GEMM of the decoded tiles (u4k, u5f, i6f): every x86 SIMD variant ----
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

// Rows 8 h .. 8 h + 7 of the u4k tile at t: d = (d sc), m = (nm mn), both products exact (kernel_table.h);
// super: the group's super-block scales at this block (u4k_super).
inline void u4k_scales8(const uint8_t* t, int h, const float* super, __m256* d, __m256* m) {
  *d = _mm256_mul_ps(_mm256_loadu_ps(super + 8 * h), bytes_to_floats(t + 8 * h));
  *m = _mm256_mul_ps(_mm256_loadu_ps(super + kQRows + 8 * h), bytes_to_floats(t + kQRows + 8 * h));
}

// The bytes v - 32 (-32 .. 31) of elements 16 half + 4 p + b (b = 0..3, byte b of each dword) of rows 8 h ..
// 8 h + 7 of the i6f tile at t: the nibbles masked, the 2-bit fields at bit 4 (p & 1) + 2 half moved to bits
// 4..5 (16-bit shifts: the mask keeps only bits that came from the same byte), joined, - 32.
inline __attribute__((always_inline)) __m256i i6f_bytes8(const uint8_t* t, int p, int half, int h) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + kI6FNibbles + 64 * p + 32 * h));
  const __m256i nib = _mm256_and_si256(half == 0 ? raw : _mm256_srli_epi16(raw, 4), _mm256_set1_epi8(0x0F));
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + kI6FHigh + 64 * (p >> 1) + 32 * h));
  const int at = 4 * (p & 1) + 2 * half;
  const __m256i hi = _mm256_and_si256(at < 4 ? _mm256_slli_epi16(qh, 4 - at) : at > 4 ? _mm256_srli_epi16(qh, at - 4)
                                                                                      : qh, _mm256_set1_epi8(0x30));
  return _mm256_sub_epi8(_mm256_or_si256(nib, hi), _mm256_set1_epi8(32));
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
  const float* super = super_scales<Q>(a, g, 0);  // u4k: the group's block-0 super-block scales, then 8 blocks each
  (void)super;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, t += kTile, xq += m * kQBlock, xd += m, xs += m) {
    if (pf != nullptr) {
      for (int j = 0; j < kLines; ++j) _mm_prefetch(reinterpret_cast<const char*>(pf) + 64 * j, _MM_HINT_T1);
      pf += kTile;
    }
    if constexpr (Q == TileFormat::kI6F) {
      __m256i s[2][R], p16[R];
      for (int half = 0; half < 2; ++half) {  // elements 16 half + 4 p + b, a scale each half
        for (int i = 0; i < R; ++i) p16[i] = _mm256_setzero_si256();
        for (int p = 0; p < 4; ++p) {
          const __m256i w = i6f_bytes8(t, p, half, h);  // v - 32 in -32 .. 31
          const __m256i aw = _mm256_sign_epi8(w, w);    // |v - 32| <= 32
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
      if constexpr (Q == TileFormat::kU4K) {
        u4k_scales8(t, h, super + (b / 8) * (kU4KSuperBytes / 4), &dv, &mv);
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

// A pass's row count as a type, for half_group_passes' callback (no standard-library template in these objects).
template <int R>
struct PassRows {
  static constexpr int kRows = R;
};

// The 256-bit integer kernels' loop (gemm_decoded here, kernels_avx2.cc's q4_1 / q8_0 passes): per row group
// of [g0, g1) and half of it (8 rows; none past N), passes of kDecodedRowsPerPass activation rows of [m0, m1),
// then one of the 3, 2 or 1 left; the first pass over a group gets the next group's tiles to prefetch (pf),
// the others nullptr. pass(PassRows<R>{}, g, h, r, pf) computes rows r .. r + R - 1 of half h of group g.
template <TileFormat Q, typename Pass>
inline void half_group_passes(const QuantGemmArgs& a, int64_t g0, int64_t g1, int64_t m0, int64_t m1, Pass&& pass) {
  constexpr int64_t kTile = tile_bytes(Q);
  const int64_t groups = (a.n + kQRows - 1) / kQRows, group_bytes = a.k / kQBlock * kTile;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* pf = g + 1 < groups ? a.w + (g + 1) * group_bytes : nullptr;
    for (int h = 0; h < 2; ++h) {
      if (g * kQRows + 8 * h >= a.n) break;  // padding rows only
      int64_t r = m0;
      for (; r + kDecodedRowsPerPass <= m1; r += kDecodedRowsPerPass, pf = nullptr) {
        pass(PassRows<kDecodedRowsPerPass>{}, g, h, r, pf);
      }
      switch (m1 - r) {
        case 3: pass(PassRows<3>{}, g, h, r, pf); break;
        case 2: pass(PassRows<2>{}, g, h, r, pf); break;
        case 1: pass(PassRows<1>{}, g, h, r, pf); break;
        default: break;
      }
      pf = nullptr;
    }
  }
}

template <TileFormat Q>
void gemm_decoded(const QuantGemmArgs& a, int64_t g0, int64_t g1, int64_t m0, int64_t m1) {
  half_group_passes<Q>(a, g0, g1, m0, m1, [&](auto rows, int64_t g, int h, int64_t r, const uint8_t* pf) {
    pass_decoded<Q, decltype(rows)::kRows>(a, g, h, r, pf);
  });
}

// The including file's kernels for the formats it holds as stored (q4_1, q8_0), defined after this header.
template <TileFormat Q>
void gemm_stored(const QuantGemmArgs& a, int64_t g0, int64_t g1, int64_t m0, int64_t m1);

// kernels_simd.h's gemm per format: the decoded tiles (u4k, u5f, i6f) here, q4_1 / q8_0 the file's gemm_stored
// (if constexpr: neither is instantiated for the other's formats).
template <TileFormat Q>
void gemm_typed(const QuantGemmArgs& a, int64_t g0, int64_t g1, int64_t m0, int64_t m1) {
  if constexpr (Q == TileFormat::kU4K || Q == TileFormat::kU5F || Q == TileFormat::kI6F) {
    gemm_decoded<Q>(a, g0, g1, m0, m1);
  } else {
    gemm_stored<Q>(a, g0, g1, m0, m1);
  }
}

}  // namespace
}  // namespace cpu
}  // namespace pagedserve
