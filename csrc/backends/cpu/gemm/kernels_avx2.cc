// The quantized linear kernels (kernel_table.h) with 256-bit vectors: built
// twice, as "avx2" (x86-64-v3: vpmaddubsw + vpmaddwd, no VNNI) and as
// "avx_vnni" (x86-64-v3 + -mavxvnni, PAGEDSERVE_GEMM_AVX_VNNI=1: 256-bit
// vpdpbusd). 8 output rows per ymm (half a row group) from the interleaved
// tiles of kernel_table.h, each 32-bit lane one output row and four consecutive
// k-elements. AVX2 has no VNNI: vpmaddubsw (u8 x s8 pairs -> i16) then vpmaddwd
// with ones (i16 pairs -> i32); Q4_1 sums eight vpmaddubsw results in i16 first
// (each at most 2 * 15 * 127, eight of them below 32767); Q8_0 would saturate
// i16 as q + 128, so it uses the |w| / sign(x, w) form instead. 4 activation
// rows share each unpacked weight tile per pass. The decoded tiles (u4k, u5f,
// i6f) run the integer kernel of kernels_decoded_x86.h; gemm_f32 (the exact float32
// GEMM) is described at its section.
//
// Everything but the table getter has internal linkage and no standard-library
// template is used (tests/cpp/check_isa_objects.cmake verifies the objects).
#include <immintrin.h>

#include "backends/cpu/gemm/kernels_common.h"

#if !defined(PAGEDSERVE_GEMM_AVX_VNNI)
#error "PAGEDSERVE_GEMM_AVX_VNNI must be 0 (the avx2 build) or 1 (avx_vnni)"
#elif PAGEDSERVE_GEMM_AVX_VNNI && !defined(__AVXVNNI__)
#error "the avx_vnni build needs -mavxvnni"
#endif

namespace pagedserve {
namespace cpu {
namespace {

// The lane primitives kernels_simd.h's activation quantisation runs on: 8 lanes.
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
inline VecF fmaddf(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }  // a * b + c, one rounding
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

}  // namespace
}  // namespace cpu
}  // namespace pagedserve

#include "backends/cpu/gemm/kernels_decoded_x86.h"

namespace pagedserve {
namespace cpu {
namespace {

// ---- 256-bit (AVX-VNNI or AVX2): 8 output rows per ymm (half a row group), up to 4 activation rows ----
//
// Only 16 ymm: the tile is unpacked one 4-element group c at a time and used by
// every row of the pass before the next (R integer sums + R accumulators + the
// scales stay in registers). Passes of kDecodedRowsPerPass (4) rows, as the decoded tiles' kernel
// (half_group_passes, kernels_decoded_x86.h).

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

// Out rows r .. r+R-1, columns 16 g + 8 h .. 16 g + 8 h + 7; pf as in
// kernels_avx512.cc's pass, but into L1 (_MM_HINT_T0): into L2 was mixed for
// this kernel (docs/benchmarks.md, "Behind the code").
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
#if PAGEDSERVE_GEMM_AVX_VNNI
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
#if PAGEDSERVE_GEMM_AVX_VNNI
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

// The first pass over a group prefetches the next one (as kernels_avx512.cc's gemm_stored does, into L1 here:
// pass's _MM_HINT_T0).
template <TileFormat Q>
void gemm_stored(const QuantGemmArgs& a, int64_t g0, int64_t g1, int64_t m0, int64_t m1) {
  half_group_passes<Q>(a, g0, g1, m0, m1, [&](auto rows, int64_t g, int h, int64_t r, const uint8_t* pf) {
    pass<Q, decltype(rows)::kRows>(a, g, h, r, pf);
  });
}

// ---- exact float32 GEMM, 256-bit (AVX2 + FMA): one row group (two ymm) x up to 6 activation rows ----
//
// 2 x R accumulators (R <= 6) of the 16 ymm; a 12-row tile of the
// activations runs as two passes of up to 6 rows. Per k and half group the
// expansion is a byte shuffle of the masked nibbles and a conversion then the
// fma with d and m (Q4_1; vpermps would index only 8 entries), or a byte
// shuffle, a conversion and a multiply (Q8_0). One pass of rows expands in registers; more rows
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
  } else if constexpr (Q == TileFormat::kQ4_1 || Q == TileFormat::kU4K) {
    // The 32-bit lane of row j holds elements 4p .. 4p+3 (low nibbles) and 16 + 4p .. (high) in its bytes: one
    // mask (and a shift for the high ones) gives four elements' bytes, the same expression for the four e that
    // share it (the unrolled callers compute it once), and a byte shuffle zero-extends the one wanted, in place
    // of a shift and a mask per element (docs/benchmarks.md, "Behind the code").
    const int p = (e & 15) >> 2, byte = e & 3;
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + nibbles_at<Q>() + 64 * p + 32 * h));
    const __m256i nib = _mm256_and_si256(e < 16 ? raw : _mm256_srli_epi16(raw, 4), _mm256_set1_epi8(0x0F));
    const int32_t lo = static_cast<int32_t>(0x80808000u | static_cast<uint32_t>(byte));
    const __m256i ctl = _mm256_add_epi32(_mm256_set1_epi32(lo), _mm256_set_epi32(12, 8, 4, 0, 12, 8, 4, 0));
    const __m256i q = _mm256_shuffle_epi8(nib, ctl);
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
  } else if constexpr (Q == TileFormat::kI6F) {
    // The bytes v - 32 of the four elements 16 half + 4 p + b (b = 0..3) of each lane (i6f_bytes8: the same
    // expression for the four e that share it, computed once by the unrolled callers); then the one wanted to
    // the top byte, q * 2^24 as int32 (as Q8_0's below), times d * 2^-24: exact.
    const int p = (e & 15) >> 2, byte = e & 3, half = e >> 4;
    const __m256i v = i6f_bytes8(t, p, half, h);
    const int32_t top = static_cast<int32_t>(0x808080u | static_cast<uint32_t>(byte) << 24);
    const __m256i ctl = _mm256_add_epi32(_mm256_set1_epi32(top),
                                         _mm256_set_epi32(12 << 24, 8 << 24, 4 << 24, 0, 12 << 24, 8 << 24, 4 << 24, 0));
    (void)m;
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_shuffle_epi8(v, ctl)), d);
  } else {
    const int c = e >> 2, byte = e & 3;
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32 + 64 * c + 32 * h));
    const int32_t top = static_cast<int32_t>(0x808080u | static_cast<uint32_t>(byte) << 24);
    const __m256i ctl = _mm256_add_epi32(_mm256_set1_epi32(top),
                                         _mm256_set_epi32(12 << 24, 8 << 24, 4 << 24, 0, 12 << 24, 8 << 24, 4 << 24, 0));
    const __m256 q = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(raw, ctl));
    (void)m;
    return _mm256_mul_ps(q, d);
  }
}

// The scales of rows 8 h .. 8 h + 7 for expand8: d (Q8_0, i6f: d * 2^-24) and
// m (Q4_1, u5f, u4k; else zero); eh: which 16 elements of the
// block (i6f's scales change there); super: u4k's super-block scales (super_scales).
template <TileFormat Q>
inline __attribute__((always_inline)) void tile_scales(const uint8_t* t, int h, __m256* d, __m256* m, int eh = 0,
                                                       const float* super = nullptr) {
  if constexpr (dense_format(Q)) {  // no scales
    (void)t;
    (void)h;
    (void)eh;
    *d = *m = _mm256_setzero_ps();
    return;
  }
  if constexpr (five_bit<Q>()) {
    *d = _mm256_loadu_ps(reinterpret_cast<const float*>(t) + 8 * h);
    *m = _mm256_loadu_ps(reinterpret_cast<const float*>(t + 64) + 8 * h);
    return;
  }
  if constexpr (Q == TileFormat::kU4K) {
    u4k_scales8(t, h, super, d, m);
    return;
  }
  if constexpr (Q == TileFormat::kI6F) {
    *d = _mm256_mul_ps(_mm256_loadu_ps(reinterpret_cast<const float*>(t) + kQRows * eh + 8 * h),
                       _mm256_set1_ps(0x1p-24f));
    *m = _mm256_setzero_ps();
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
  // the group after next, into L2 (as f32_pass_direct_pair's, below)
  const uint8_t* pf = g + 2 < groups ? t + 2 * nb * kTile : nullptr;
  const float* xr[R];  // x[t0 + i0 + i, k] at xr[i][k]
  for (int i = 0; i < R; ++i) xr[i] = a.x + (t0 + i0 + i) * a.k;
  __m256 acc[2][R];
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < R; ++i) acc[h][i] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b, t += kTile) {
    if (pf != nullptr) {
      for (int j = 0; j < kLines; ++j) _mm_prefetch(reinterpret_cast<const char*>(pf) + 64 * j, _MM_HINT_T1);
      pf += kTile;
    }
    __m256 d[2], m[2];
    const float* super = super_scales<Q>(a, g, b);
    for (int h = 0; h < 2; ++h) tile_scales<Q>(t, h, &d[h], &m[h], 0, super);
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
  // the pair after next, into L2 (where the CPU's prefetch hints reach it: Intel, Zen 4): a pair's tiles are
  // tens of KB at a model's K, so prefetched into L1 they were probably evicted again before they were read;
  // into L2 a cold single-row GEMV ran faster, and the pair after next a little faster than the next pair,
  // within the noise (docs/benchmarks.md, "Behind the code")
  const uint8_t* pf = g + 4 < groups ? t[1] + 3 * group_bytes : nullptr;
  const int64_t pf_groups = g + 5 < groups ? 2 : 1;
  const float* xr = a.x + r * a.k;
  __m256 acc[2][2];
  for (auto& row : acc) {
    for (__m256& v : row) v = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b, t[0] += kTile, t[1] += kTile) {
    if (pf != nullptr) {
      for (int64_t p = 0; p < pf_groups; ++p) {
        for (int j = 0; j < kLines; ++j) {
          _mm_prefetch(reinterpret_cast<const char*>(pf + p * group_bytes) + 64 * j, _MM_HINT_T1);
        }
      }
      pf += kTile;
    }
    __m256 d[2][2], m[2][2];
    for (int p = 0; p < 2; ++p) {
      const float* super = super_scales<Q>(a, g + p, b);
      for (int h = 0; h < 2; ++h) tile_scales<Q>(t[p], h, &d[p][h], &m[p][h], 0, super);
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
    const float* super = super_scales<Q>(a, g, b);
    for (int h = 0; h < 2; ++h) tile_scales<Q>(t, h, &d[h], &m[h], 0, super);
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

// kernel_table.h's peak_ops: the FMA half is kernels_simd.h's. int8: the
// operands are marked as changed every round by an empty asm statement, so that
// the compiler cannot compute the (loop-invariant) products once outside the loop.
double peak_ops(int kind, int64_t iters) {
  if (kind == kPeakFma) return peak_fma_ops(iters);
  volatile int sink = 0;
  // named variables, not arrays (GCC kept arrays of vectors on the stack). vpdpbusd accumulates in place: 8
  // chains cover its latency; vpmaddubsw + vpmaddwd's chain is the addition alone, and 6 spilled: 4
#if PAGEDSERVE_GEMM_AVX_VNNI
  constexpr int kChains = 8;
#else
  constexpr int kChains = 4;
#endif
  const char base = static_cast<char>(sink);
  __m256i w = _mm256_set1_epi8(static_cast<char>(base + 3));
  __m256i x0 = _mm256_set1_epi8(static_cast<char>(base - 5)), x1 = _mm256_set1_epi8(static_cast<char>(base - 4));
  __m256i x2 = _mm256_set1_epi8(static_cast<char>(base - 3)), x3 = _mm256_set1_epi8(static_cast<char>(base - 2));
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
#if PAGEDSERVE_GEMM_AVX_VNNI
  __m256i a4 = a0, a5 = a0, a6 = a0, a7 = a0;
#define PS_PEAK_STEP(a, x) a = _mm256_dpbusd_avx_epi32(a, w, x)
#else
#define PS_PEAK_STEP(a, x) a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)))
#endif
  for (int64_t i = 0; i < iters; ++i) {
    __asm__ volatile("" : "+x"(w), "+x"(x0), "+x"(x1), "+x"(x2), "+x"(x3));
    PS_PEAK_STEP(a0, x0);
    PS_PEAK_STEP(a1, x1);
    PS_PEAK_STEP(a2, x2);
    PS_PEAK_STEP(a3, x3);
#if PAGEDSERVE_GEMM_AVX_VNNI
    PS_PEAK_STEP(a4, x0);
    PS_PEAK_STEP(a5, x1);
    PS_PEAK_STEP(a6, x2);
    PS_PEAK_STEP(a7, x3);
#endif
  }
#undef PS_PEAK_STEP
#if PAGEDSERVE_GEMM_AVX_VNNI
  a0 = _mm256_add_epi32(_mm256_add_epi32(a0, a4), _mm256_add_epi32(a5, _mm256_add_epi32(a6, a7)));
#endif
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3));
  sink = _mm256_movemask_epi8(s);
  return 2.0 * 32 * kChains * static_cast<double>(iters);
}

const QuantKernelTable kTable{PS_STR(PAGEDSERVE_GEMM_ISA), &quantize_rows, &gemm, &gemm_f32, &peak_ops};

}  // namespace

const QuantKernelTable& PS_CAT(quant_kernel_table_, PAGEDSERVE_GEMM_ISA)() { return kTable; }

}  // namespace cpu
}  // namespace pagedserve
