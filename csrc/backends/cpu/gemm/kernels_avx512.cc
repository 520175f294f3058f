// The quantized linear kernels (kernel_table.h) with AVX-512 VNNI: the
// "avx512_vnni" variant (x86-64-v4 + -mavx512vnni). 16 output rows per zmm
// from the interleaved tiles of kernel_table.h: each 32-bit lane is one output
// row and four consecutive k-elements, so one vpdpbusd (u8 x s8 -> i32) per
// 4-element group with the activation dword broadcast, no horizontal sums.
// Weights are unsigned operands: Q4_1 nibbles as they are (0..15), Q8_0 as
// q + 128 (xor 0x80) with -128 * sum(xq) as the accumulator's start value.
// Several activation rows reuse each unpacked weight tile in registers (8 per
// pass). The decoded tiles (u4k, u5f, i6f) run the 256-bit integer kernel of
// kernels_decoded_x86.h; gemm_f32 (the exact float32 GEMM) is described at its section.
//
// Everything but the table getter has internal linkage and no standard-library
// template is used (tests/cpp/check_isa_objects.cmake verifies the objects).
#include <immintrin.h>

#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's _mm512_cvtph_ps / _mm512_cvtepi32_ps pass _mm512_undefined_ps() (a
// deliberately self-initialised value) as the unused merge source: a false alarm.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "backends/cpu/gemm/kernels_common.h"

#if !defined(__AVX512VNNI__)
// vpdpbusd is written as inline assembly (dpbusd_bcst), which no target check covers
#error "kernels_avx512.cc needs -mavx512vnni"
#endif

namespace pagedserve {
namespace cpu {
namespace {

// The lane primitives kernels_simd.h's activation quantisation runs on: 16 lanes.
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
inline VecF fmaddf(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c, one rounding
inline VecF minf(VecF a, VecF b) { return _mm512_min_ps(a, b); }
inline VecF maxf(VecF a, VecF b) { return _mm512_max_ps(a, b); }
inline VecI trunc_i32(VecF t) { return _mm512_cvttps_epi32(t); }
// The 32 quants (int32 in [-127, 127]) to int8 at q; returns their sum.
inline int32_t store_q(int8_t* q, const VecI* qi) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qi[0]));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qi[1]));
  return _mm512_reduce_add_epi32(_mm512_add_epi32(qi[0], qi[1]));
}

}  // namespace
}  // namespace cpu
}  // namespace pagedserve

#include "backends/cpu/gemm/kernels_decoded_x86.h"

namespace pagedserve {
namespace cpu {
namespace {

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
// pf: nullptr, or the next row group's tiles, prefetched block by block into
// L2 (a model's weights do not stay in the caches from one step to the next;
// once a group's first pass has brought its tiles in, the other passes find
// them in L1 or L2). Prefetched into L1, a cold GEMV read its tiles slower
// (docs/benchmarks.md, "Behind the code").
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
      for (int j = 0; j < kLines; ++j) _mm_prefetch(reinterpret_cast<const char*>(pf) + 64 * j, _MM_HINT_T1);
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
// (one group ahead: its first pass then finds the tiles in L2 instead of
// waiting on L3 / memory).
template <TileFormat Q>
void gemm_stored(const QuantGemmArgs& a, int64_t g0, int64_t g1, int64_t m0, int64_t m1) {
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
  } else if constexpr (Q == TileFormat::kQ4_1 || Q == TileFormat::kU4K) {
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
  } else if constexpr (Q == TileFormat::kI6F) {  // as kernels_avx2.cc's expand8, 16 rows
    const int p = (e & 15) >> 2, byte = e & 3, half = e >> 4, at = 4 * (p & 1) + 2 * half;
    const __m512i raw = _mm512_loadu_si512(t + kI6FNibbles + 64 * p);
    const __m512i nib = _mm512_and_si512(half == 0 ? raw : _mm512_srli_epi16(raw, 4), _mm512_set1_epi8(0x0F));
    const __m512i qh = _mm512_loadu_si512(t + kI6FHigh + 64 * (p >> 1));
    const __m512i hi = _mm512_and_si512(at < 4 ? _mm512_slli_epi16(qh, 4 - at) : at > 4 ? _mm512_srli_epi16(qh, at - 4)
                                                                                        : qh, _mm512_set1_epi8(0x30));
    const __m512i v = _mm512_sub_epi8(_mm512_or_si512(nib, hi), _mm512_set1_epi8(32));
    const int32_t top = static_cast<int32_t>(0x808080u | static_cast<uint32_t>(byte) << 24);
    const __m512i ctl = _mm512_add_epi32(_mm512_set1_epi32(top), _mm512_set_epi32(
        12 << 24, 8 << 24, 4 << 24, 0, 12 << 24, 8 << 24, 4 << 24, 0, 12 << 24, 8 << 24, 4 << 24, 0, 12 << 24,
        8 << 24, 4 << 24, 0));
    (void)m;
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_shuffle_epi8(v, ctl)), d);  // (v - 32) 2^24 * d 2^-24: exact
  } else {
    const int c = e >> 2, byte = e & 3;
    const __m512i raw = _mm512_loadu_si512(t + 32 + 64 * c);
    // byte `byte` of each dword to its top byte, the rest zero: q * 2^24 as int32
    const int32_t top = static_cast<int32_t>(0x808080u | static_cast<uint32_t>(byte) << 24);
    const __m512i ctl = _mm512_add_epi32(_mm512_set1_epi32(top), _mm512_set_epi32(
        12 << 24, 8 << 24, 4 << 24, 0, 12 << 24, 8 << 24, 4 << 24, 0, 12 << 24, 8 << 24, 4 << 24, 0, 12 << 24,
        8 << 24, 4 << 24, 0));
    const __m512 q = _mm512_cvtepi32_ps(_mm512_shuffle_epi8(raw, ctl));
    (void)m;
    return _mm512_mul_ps(q, d);
  }
}

// The tile's scales for expand16: d (Q8_0, i6f: d * 2^-24) and m (Q4_1, u5f,
// u4k; else zero); eh: which 16 elements of the block (i6f's
// scales change there); super: u4k's super-block scales (super_scales).
template <TileFormat Q>
inline __attribute__((always_inline)) void tile_scales(const uint8_t* t, __m512* d, __m512* m, int eh = 0,
                                                       const float* super = nullptr) {
  if constexpr (dense_format(Q)) {  // no scales
    (void)t;
    (void)eh;
    *d = *m = _mm512_setzero_ps();
    return;
  }
  if constexpr (five_bit<Q>()) {
    *d = _mm512_loadu_ps(reinterpret_cast<const float*>(t));
    *m = _mm512_loadu_ps(reinterpret_cast<const float*>(t + 64));
    return;
  }
  if constexpr (Q == TileFormat::kU4K) {  // d sc and nm mn, both exact
    const auto bytes = [](const uint8_t* p) {
      return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    };
    *d = _mm512_mul_ps(_mm512_loadu_ps(super), bytes(t));
    *m = _mm512_mul_ps(_mm512_loadu_ps(super + kQRows), bytes(t + kQRows));
    return;
  }
  if constexpr (Q == TileFormat::kI6F) {
    *d = _mm512_mul_ps(_mm512_loadu_ps(reinterpret_cast<const float*>(t) + kQRows * eh), _mm512_set1_ps(0x1p-24f));
    *m = _mm512_setzero_ps();
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

// Prefetches block b's tiles of row groups pg .. pg + G - 1 (those < groups)
// into L2 (where the CPU's prefetch hints reach it: Intel, Zen 4), not L1: the
// callers prefetch whole row groups ahead (tens of KB at a model's K), more
// than an L1 of 32-48 KB keeps beside the lines being read, so prefetched into
// L1 they were probably evicted again before use; into L2, cold GEMVs of Gemma
// 3 270M's shapes read their tiles from memory faster on an AMD EPYC
// (docs/benchmarks.md, "Behind the code").
template <TileFormat Q, int G>
inline __attribute__((always_inline)) void prefetch_tiles(const QuantF32GemmArgs& a, int64_t pg, int64_t groups,
                                                          int64_t b) {
  constexpr int64_t kTile = tile_bytes(Q);
  constexpr int kLines = (kTile + 63) / 64;
  const int64_t nb = a.k / kQBlock;
  for (int gi = 0; gi < G; ++gi) {
    if (pg + gi >= groups) break;
    const char* p = reinterpret_cast<const char*>(a.w + ((pg + gi) * nb + b) * kTile);
    for (int j = 0; j < kLines; ++j) _mm_prefetch(p + 64 * j, _MM_HINT_T1);
  }
}

// Out rows t0 .. t0+R-1 (the whole row tile at t0) x row groups g .. g+G-1,
// expanding in registers; prefetches the tiles of the G groups after the next
// G (at one row a little faster than the next G, within the noise:
// docs/benchmarks.md, "Behind the code").
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
    prefetch_tiles<Q, G>(a, g + 2 * G, groups, b);
    __m512 d[G], m[G];
    for (int gi = 0; gi < G; ++gi) tile_scales<Q>(t + gi * gstride, &d[gi], &m[gi], 0, super_scales<Q>(a, g + gi, b));
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
    for (int gi = 0; gi < G; ++gi) tile_scales<Q>(t + gi * gstride, &d[gi], &m[gi], 0, super_scales<Q>(a, g + gi, b));
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

// The accumulators of rows t0 .. t0+R-1 x row groups g .. g+G-1 at the start of
// the K range from k0: zero, or the partial sums the previous range stored in
// out; mask[gi]: the group's columns that exist (N's edge).
template <int G, int R>
inline __attribute__((always_inline)) void load_partial_sums(const QuantF32GemmArgs& a, int64_t g, int64_t t0,
                                                             int64_t k0, __m512 (&acc)[G][R], __mmask16 (&mask)[G]) {
  for (int gi = 0; gi < G; ++gi) {
    const int64_t nv = imin(kQRows, a.n - (g + gi) * kQRows);
    mask[gi] = static_cast<__mmask16>(nv >= 16 ? 0xFFFF : nv <= 0 ? 0 : (1u << nv) - 1);
    for (int i = 0; i < R; ++i) {
      acc[gi][i] = k0 == 0 ? _mm512_setzero_ps()
                           : _mm512_maskz_loadu_ps(mask[gi], a.out + (t0 + i) * a.ldo + (g + gi) * kQRows);
    }
  }
}

// Stores load_partial_sums' accumulators after the K range ending at k1: as
// they are (a float32 store and load are exact), or + bias when k1 = K.
template <int G, int R>
inline __attribute__((always_inline)) void store_partial_sums(const QuantF32GemmArgs& a, int64_t g, int64_t t0,
                                                              int64_t k1, const __m512 (&acc)[G][R],
                                                              const __mmask16 (&mask)[G]) {
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
  load_partial_sums<G, R>(a, g, t0, k0, acc, mask);
#pragma GCC unroll 4
  for (int64_t k = 0; k < k1 - k0; ++k, ws += 16 * G) {
    __m512 w[G];
    for (int gi = 0; gi < G; ++gi) w[gi] = _mm512_load_ps(ws + 16 * gi);
    for (int i = 0; i < R; ++i) {
      const __m512 xv = _mm512_set1_ps(xr[i][k]);
      for (int gi = 0; gi < G; ++gi) acc[gi][i] = _mm512_fmadd_ps(w[gi], xv, acc[gi][i]);
    }
  }
  store_partial_sums<G, R>(a, g, t0, k1, acc, mask);
}

// f32_expand of blocks [b0, b1) into ws and, in the same loop, f32_from_scratch
// of the row tile t0 .. t0+R-1 over them: the expansion's shuffles and stores
// issue beside that tile's FMAs instead of before every tile's. The same sums,
// k in order, as f32_from_scratch from the stored ws.
template <TileFormat Q, int G, int R>
void f32_expand_tile(const QuantF32GemmArgs& a, int64_t g, int64_t b0, int64_t b1, float* ws, int64_t t0) {
  constexpr int64_t kTile = tile_bytes(Q);
  const int64_t nb = a.k / kQBlock, gstride = nb * kTile, groups = (a.n + kQRows - 1) / kQRows;
  const int64_t k0 = b0 * kQBlock, k1 = b1 * kQBlock;
  const float* xr[R];  // x[t0 + i, k] at xr[i][k - k0]
  for (int i = 0; i < R; ++i) xr[i] = a.x + (t0 + i) * a.k + k0;
  __m512 acc[G][R];
  __mmask16 mask[G];
  load_partial_sums<G, R>(a, g, t0, k0, acc, mask);
  const uint8_t* t = a.w + g * gstride + b0 * kTile;
  for (int64_t b = b0; b < b1; ++b, t += kTile, ws += kQBlock * 16 * G) {
    prefetch_tiles<Q, G>(a, g + G, groups, b);
    __m512 d[G], m[G];
    for (int gi = 0; gi < G; ++gi) tile_scales<Q>(t + gi * gstride, &d[gi], &m[gi], 0, super_scales<Q>(a, g + gi, b));
    const int64_t kb = (b - b0) * kQBlock;
#pragma GCC unroll 4
    for (int e = 0; e < kQBlock; ++e) {
      if (half_scales<Q>() && e == kQBlock / 2) {
        for (int gi = 0; gi < G; ++gi) tile_scales<Q>(t + gi * gstride, &d[gi], &m[gi], 1);
      }
      __m512 w[G];
      for (int gi = 0; gi < G; ++gi) {
        w[gi] = expand16<Q>(t + gi * gstride, e, d[gi], m[gi]);
        _mm512_store_ps(ws + (e * G + gi) * 16, w[gi]);
      }
      for (int i = 0; i < R; ++i) {
        const __m512 xv = _mm512_set1_ps(xr[i][kb + e]);
        for (int gi = 0; gi < G; ++gi) acc[gi][i] = _mm512_fmadd_ps(w[gi], xv, acc[gi][i]);
      }
    }
  }
  store_partial_sums<G, R>(a, g, t0, k1, acc, mask);
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
    if constexpr (G == 3) {
      // the first row tile (8 rows: more than kF32Rows in all here) with the expansion, the others from scratch
      f32_expand_tile<Q, 3, kF32Rows3>(a, g, b0, b1, scratch, m0);
      for (int64_t t0 = m0 + kF32Rows3; t0 < m1; t0 += kF32Rows3) {
        f32_tile_rows3(a, g, t0, imin(kF32Rows3, m1 - t0), scratch, b0 * kQBlock, b1 * kQBlock);
      }
    } else {
      f32_expand<Q, G>(a, g, b0, b1, scratch);
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

// kernel_table.h's peak_ops: the FMA half is kernels_simd.h's (Zen 4 runs each
// 512-bit op as two 256-bit halves); int8: 12 vpdpbusd chains, which accumulate
// in place (the loop-carried dependence keeps them in the loop).
double peak_ops(int kind, int64_t iters) {
  if (kind == kPeakFma) return peak_fma_ops(iters);
  constexpr int kChains = 12;
  volatile int sink = 0;
  __m512i acc[kChains];
  const __m512i w = _mm512_set1_epi8(static_cast<char>(3 + sink)), x = _mm512_set1_epi8(static_cast<char>(-5 + sink));
  for (int j = 0; j < kChains; ++j) acc[j] = _mm512_set1_epi32(j);
  for (int64_t i = 0; i < iters; ++i) {
    for (int j = 0; j < kChains; ++j) acc[j] = _mm512_dpbusd_epi32(acc[j], w, x);
  }
  __m512i s = acc[0];
  for (int j = 1; j < kChains; ++j) s = _mm512_add_epi32(s, acc[j]);
  sink = _mm512_reduce_add_epi32(s);
  return 2.0 * 64 * kChains * static_cast<double>(iters);
}

const QuantKernelTable kTable{PS_STR(PAGEDSERVE_GEMM_ISA), &quantize_rows, &gemm, &gemm_f32, &peak_ops};

}  // namespace

const QuantKernelTable& PS_CAT(quant_kernel_table_, PAGEDSERVE_GEMM_ISA)() { return kTable; }

}  // namespace cpu
}  // namespace pagedserve
