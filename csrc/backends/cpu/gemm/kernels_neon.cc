// The quantized linear kernels (kernel_table.h) with AArch64 Advanced SIMD
// (128-bit vectors): built twice, as "neon" (armv8-a: every AArch64 CPU;
// smull + sadalp for the int8 dot products) and as "neon_dotprod"
// (armv8.2-a+dotprod, PAGEDSERVE_GEMM_DOTPROD=1: sdot, which Apple M1 and
// later, Graviton 2 and later, Ampere Altra and the Raspberry Pi 5 have).
// 4 output rows per vector (a quarter of a row group), each 32-bit lane one
// output row: a 16-byte run of a tile row is 4 rows x 4 consecutive
// k-elements, sdot's operand shape, as it is vpdpbusd's on x86 (the same
// repacked tiles run under every variant).
//   gemm (int8 activations): per 32-block and quarter, the eight 16-byte
//     runs of weight bytes (signed: Q8_0 as stored, Q4_1 / u4k 0..15, u5f
//     0..31, i6f v - 32) times the broadcast activation dwords, then per block
//     in float the steps kernels_common.h describes (u4k's d sc and nm mn
//     formed exactly, i6f a scale per 16 elements) -- the x86 variants' float
//     steps, so the results are theirs bit for bit.
//   gemm_f32 (exact): per k and quarter the 4 rows' weights expanded to
//     gguf-py's float32 values (shift, mask, convert, one fma or multiply:
//     kernels_common.h's exactness argument) and one fma per output along k
//     in order: the x86 SIMD variants' chain, the same bits.
// Algorithm: llama.cpp's int8-activation scheme (kernels_common.h); the NEON
// forms are our own (sdot on 4-byte lanes as ggml's NEON paths use it).
//
// Everything but the table getters has internal linkage and no standard-library
// template is used (tests/cpp/check_isa_objects.cmake verifies the objects).
#include <arm_neon.h>

#include "backends/cpu/gemm/kernels_common.h"

#if !defined(PAGEDSERVE_GEMM_DOTPROD)
#error "PAGEDSERVE_GEMM_DOTPROD must be 0 (the neon build) or 1 (neon_dotprod)"
#elif PAGEDSERVE_GEMM_DOTPROD && !defined(__ARM_FEATURE_DOTPROD)
#error "the neon_dotprod build needs -march=armv8.2-a+dotprod"
#endif

namespace pagedserve {
namespace cpu {
namespace {

// The lane primitives kernels_simd.h's activation quantisation runs on: 4 lanes, each the x86 form's result.
using VecF = float32x4_t;
using VecI = int32x4_t;
constexpr int kLanes = 4;

template <bool kBf16>
inline VecF load_lanes(const char* p) {
  if constexpr (kBf16) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16));
  } else {
    return vld1q_f32(reinterpret_cast<const float*>(p));
  }
}
// |v| > mx ? |v| : mx, as x86's max_ps: a NaN |v| never replaces the running value.
inline VecF abs_max(VecF v, VecF mx) {
  const VecF a = vabsq_f32(v);
  return vbslq_f32(vcgtq_f32(a, mx), a, mx);
}
inline float hmax(VecF mx) { return vmaxvq_f32(mx); }  // mx holds no NaN (abs_max)
inline VecF nan_to_zero(VecF t) {
  return vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(t), vceqq_f32(t, t)));
}
inline VecF set1f(float v) { return vdupq_n_f32(v); }
inline VecF mulf(VecF a, VecF b) { return vmulq_f32(a, b); }
inline VecF addf(VecF a, VecF b) { return vaddq_f32(a, b); }
inline VecF subf(VecF a, VecF b) { return vsubq_f32(a, b); }
inline VecF fmaddf(VecF a, VecF b, VecF c) { return vfmaq_f32(c, a, b); }  // a * b + c, one rounding
inline VecF minf(VecF a, VecF b) { return vminq_f32(a, b); }  // no NaN reaches these (nan_to_zero first)
inline VecF maxf(VecF a, VecF b) { return vmaxq_f32(a, b); }
inline VecI trunc_i32(VecF t) { return vcvtq_s32_f32(t); }  // toward zero
inline int32_t store_q(int8_t* q, const VecI* qi) {  // 8 vectors: no saturation (|q| <= 127)
  const int16x8_t h0 = vcombine_s16(vmovn_s32(qi[0]), vmovn_s32(qi[1]));
  const int16x8_t h1 = vcombine_s16(vmovn_s32(qi[2]), vmovn_s32(qi[3]));
  const int16x8_t h2 = vcombine_s16(vmovn_s32(qi[4]), vmovn_s32(qi[5]));
  const int16x8_t h3 = vcombine_s16(vmovn_s32(qi[6]), vmovn_s32(qi[7]));
  vst1q_s8(q, vcombine_s8(vmovn_s16(h0), vmovn_s16(h1)));
  vst1q_s8(q + 16, vcombine_s8(vmovn_s16(h2), vmovn_s16(h3)));
  const int32x4_t s = vaddq_s32(vaddq_s32(vaddq_s32(qi[0], qi[1]), vaddq_s32(qi[2], qi[3])),
                                vaddq_s32(vaddq_s32(qi[4], qi[5]), vaddq_s32(qi[6], qi[7])));
  return vaddvq_s32(s);
}

}  // namespace
}  // namespace cpu
}  // namespace pagedserve

#include "backends/cpu/gemm/kernels_simd.h"

namespace pagedserve {
namespace cpu {
namespace {

// ---- shared by both GEMMs: a quarter's scales ----

// 4 fp16 at p widened (exact).
inline float32x4_t halves4(const uint8_t* p) {
  return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p))));
}
// 4 bytes at p (u4k's 6-bit scales or minima) as floats.
inline float32x4_t bytes4(const uint8_t* p) {
  uint32_t v;
  memcpy(&v, p, sizeof v);
  return vcvtq_f32_u32(vmovl_u16(vget_low_u16(vmovl_u8(vcreate_u8(v)))));
}
inline float32x4_t floats4(const uint8_t* p) { return vld1q_f32(reinterpret_cast<const float*>(p)); }

// Rows 4 q .. 4 q + 3 of the tile at t: d and m (zero where the format has none), the stored values (Q4_1, Q8_0:
// fp16 widened; u5f, i6f: float) or u4k's exact products (super: the group's super-block scales at this block);
// eh: which 16 elements of the block (i6f's d changes there).
template <TileFormat Q>
inline __attribute__((always_inline)) void quarter_scales(const uint8_t* t, int q, float32x4_t* d, float32x4_t* m,
                                                          int eh = 0, const float* super = nullptr) {
  *m = vdupq_n_f32(0.f);
  if constexpr (Q == TileFormat::kQ4_1 || Q == TileFormat::kQ8_0) {
    *d = halves4(t + 8 * q);
    if constexpr (Q == TileFormat::kQ4_1) *m = halves4(t + 32 + 8 * q);
  } else if constexpr (five_bit<Q>()) {
    *d = floats4(t + 16 * q);
    *m = floats4(t + 64 + 16 * q);
  } else if constexpr (Q == TileFormat::kU4K) {
    *d = vmulq_f32(vld1q_f32(super + 4 * q), bytes4(t + 4 * q));
    *m = vmulq_f32(vld1q_f32(super + kQRows + 4 * q), bytes4(t + kQRows + 4 * q));
  } else if constexpr (Q == TileFormat::kI6F) {
    *d = floats4(t + 4 * (kQRows * eh + 4 * q));
  } else {  // dense: no scales
    *d = vdupq_n_f32(0.f);
  }
  (void)eh;
  (void)super;
}

// ---- the integer GEMM: 4 output rows per vector, the 4 quarters of a row group x up to 4 activation rows ----

constexpr int kRowsPerPass = 4;

// The activation dword at p in every 32-bit lane.
inline int8x16_t bcast_dword(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, sizeof v);
  return vreinterpretq_s8_s32(vdupq_n_s32(v));
}

// w[c] (c = 0..7): elements 4 c .. 4 c + 3 of rows 4 q .. 4 q + 3 of the tile at t as signed bytes (byte b of
// dword j: element 4 c + b of row 4 q + j).
template <TileFormat Q>
inline __attribute__((always_inline)) void weight_bytes(const uint8_t* t, int q, int8x16_t* w) {
  if constexpr (Q == TileFormat::kQ8_0) {
    for (int c = 0; c < 8; ++c) w[c] = vld1q_s8(reinterpret_cast<const int8_t*>(t + 32 + 64 * c + 16 * q));
  } else {
    const int at = Q == TileFormat::kI6F ? kI6FNibbles : nibbles_at<Q>();
    uint32x4_t qh = vdupq_n_u32(0);
    if constexpr (five_bit<Q>()) qh = vld1q_u32(reinterpret_cast<const uint32_t*>(t + k5FHigh + 16 * q));
    (void)qh;
    for (int p = 0; p < 4; ++p) {  // the low nibbles are elements 4 p + b, the high ones 16 + 4 p + b
      const uint8x16_t raw = vld1q_u8(t + at + 64 * p + 16 * q);
      uint8x16_t v[2] = {vandq_u8(raw, vdupq_n_u8(0x0F)), vshrq_n_u8(raw, 4)};
      for (int half = 0; half < 2; ++half) {
        const int c = 4 * half + p;
        if constexpr (five_bit<Q>()) {
          // bit 4 c + b of the row's word to bit 4 of byte b: the 4 bits times 0x00204081 (copies at bits
          // 0, 7, 14, 21, no overlap), bit 8 b kept
          const uint32x4_t bits = vandq_u32(vshlq_u32(qh, vdupq_n_s32(-4 * c)), vdupq_n_u32(0x0F));
          const uint32x4_t spread = vandq_u32(vmulq_u32(bits, vdupq_n_u32(0x00204081)), vdupq_n_u32(0x01010101));
          v[half] = vorrq_u8(v[half], vreinterpretq_u8_u32(vshlq_n_u32(spread, 4)));
        } else if constexpr (Q == TileFormat::kI6F) {
          // the 2-bit field at bit 4 (p & 1) + 2 half of each byte, to bits 4..5
          const uint8x16_t q2 = vld1q_u8(t + kI6FHigh + 64 * (p >> 1) + 16 * q);
          const uint8x16_t hi = vandq_u8(vshlq_u8(q2, vdupq_n_s8(static_cast<int8_t>(-(4 * (p & 1) + 2 * half)))),
                                         vdupq_n_u8(0x03));
          v[half] = vsubq_u8(vorrq_u8(v[half], vshlq_n_u8(hi, 4)), vdupq_n_u8(32));  // v - 32, two's complement
        }
        w[c] = vreinterpretq_s8_u8(v[half]);
      }
    }
  }
}

// The 4 rows' integer sums over c = c0 .. c0 + 3 of w times the activation row at xq (32 int8).
inline __attribute__((always_inline)) int32x4_t dot4(const int8x16_t* w, const int8_t* xq, int c0) {
#if PAGEDSERVE_GEMM_DOTPROD
  int32x4_t s = vdupq_n_s32(0);
  for (int c = c0; c < c0 + 4; ++c) s = vdotq_s32(s, w[c], bcast_dword(xq + 4 * c));
  return s;
#else
  // smull: 8 products (rows 4q, 4q+1 or 4q+2, 4q+3, 4 each, |each| <= 128 * 127); sadalp: pairs into int32
  int32x4_t lo = vdupq_n_s32(0), hi = vdupq_n_s32(0);
  for (int c = c0; c < c0 + 4; ++c) {
    const int8x16_t x = bcast_dword(xq + 4 * c);
    lo = vpadalq_s16(lo, vmull_s8(vget_low_s8(w[c]), vget_low_s8(x)));
    hi = vpadalq_s16(hi, vmull_high_s8(w[c], x));
  }
  return vpaddq_s32(lo, hi);  // [row 0, 1, 2, 3]: each lane pair of lo / hi summed
#endif
}

// Out rows r .. r+R-1, columns 16 g .. 16 g + 15.
template <TileFormat Q, int R>
void pass(const QuantGemmArgs& a, int64_t g, int64_t r) {
  constexpr int64_t kTile = tile_bytes(Q);
  const int64_t nb = a.k / kQBlock, m = a.m;
  const int quarters = static_cast<int>(imin(4, (a.n - g * kQRows + 3) / 4));  // past N: padding rows only
  const uint8_t* t = a.w + g * nb * kTile;
  const int8_t* xq = a.x.xq + r * kQBlock;  // then + 32 m per block; row i at + 32 i
  const float* xd = a.x.xd + r;             // then + m per block (xs alike)
  const float* xs = a.x.xs + r;
  const float* super = super_scales<Q>(a, g, 0);  // u4k: the group's block-0 super-block scales, then 8 blocks each
  float32x4_t acc[4][R];
  for (int q = 0; q < 4; ++q) {
    for (int i = 0; i < R; ++i) acc[q][i] = vdupq_n_f32(0.f);
  }
  for (int64_t b = 0; b < nb; ++b, t += kTile, xq += m * kQBlock, xd += m, xs += m) {
    const float* sb = Q == TileFormat::kU4K ? super + (b / 8) * (kU4KSuperBytes / 4) : nullptr;
    for (int q = 0; q < quarters; ++q) {
      int8x16_t w[8];
      weight_bytes<Q>(t, q, w);
      float32x4_t d, mv;
      quarter_scales<Q>(t, q, &d, &mv, 0, sb);
      if constexpr (Q == TileFormat::kI6F) {  // a scale per 16 elements
        float32x4_t d1, unused;
        quarter_scales<Q>(t, q, &d1, &unused, 1);
        for (int i = 0; i < R; ++i) {
          const int8_t* x = xq + kQBlock * i;
          acc[q][i] = vfmaq_f32(acc[q][i], vcvtq_f32_s32(dot4(w, x, 0)), vmulq_f32(d, vdupq_n_f32(xd[i])));
          acc[q][i] = vfmaq_f32(acc[q][i], vcvtq_f32_s32(dot4(w, x, 4)), vmulq_f32(d1, vdupq_n_f32(xd[i])));
        }
      } else {
        for (int i = 0; i < R; ++i) {
          const int8_t* x = xq + kQBlock * i;
          const int32x4_t s = vaddq_s32(dot4(w, x, 0), dot4(w, x, 4));
          acc[q][i] = vfmaq_f32(acc[q][i], vcvtq_f32_s32(s), vmulq_f32(d, vdupq_n_f32(xd[i])));
          if constexpr (Q != TileFormat::kQ8_0) acc[q][i] = vfmaq_f32(acc[q][i], mv, vdupq_n_f32(xs[i]));
        }
      }
    }
  }
  for (int q = 0; q < quarters; ++q) {
    for (int i = 0; i < R; ++i) {
      float buf[4];
      vst1q_f32(buf, acc[q][i]);
      write_out(a, r + i, g * kQRows + 4 * q, 4, buf);
    }
  }
}

template <TileFormat Q>
void gemm_typed(const QuantGemmArgs& a, int64_t g0, int64_t g1, int64_t m0, int64_t m1) {
  for (int64_t g = g0; g < g1; ++g) {
    int64_t r = m0;
    for (; r + kRowsPerPass <= m1; r += kRowsPerPass) pass<Q, kRowsPerPass>(a, g, r);
    switch (m1 - r) {
      case 3: pass<Q, 3>(a, g, r); break;
      case 2: pass<Q, 2>(a, g, r); break;
      case 1: pass<Q, 1>(a, g, r); break;
      default: break;
    }
  }
}

// ---- the exact float32 GEMM: 4 rows per vector, the 4 quarters of a row group x up to 4 (in registers) or
// 6 (from the expanded group in scratch) activation rows ----

// The dequantised weights of element e of rows 4 q .. 4 q + 3 of the tile at t; d, m their scales
// (quarter_scales). Each is gguf-py's float32 value (kernels_common.h): d * q exact, one rounding with m.
template <TileFormat Q>
inline __attribute__((always_inline)) float32x4_t expand4(const uint8_t* t, int q, int e, float32x4_t d,
                                                          float32x4_t m) {
  if constexpr (Q == TileFormat::kF32) {
    return vld1q_f32(reinterpret_cast<const float*>(t) + kQRows * e + 4 * q);
  } else if constexpr (Q == TileFormat::kF16) {
    return halves4(t + 2 * (kQRows * e + 4 * q));
  } else if constexpr (Q == TileFormat::kBF16) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(t) + kQRows * e + 4 * q), 16));
  } else if constexpr (Q == TileFormat::kQ8_0) {  // byte e & 3 of each lane, sign-extended
    const int32x4_t raw = vld1q_s32(reinterpret_cast<const int32_t*>(t + 32 + 64 * (e >> 2) + 16 * q));
    const int32x4_t v = vshlq_s32(vshlq_s32(raw, vdupq_n_s32(24 - 8 * (e & 3))), vdupq_n_s32(-24));
    return vmulq_f32(vcvtq_f32_s32(v), d);  // exact
  } else {
    // the nibble of element e: byte e & 3 of each lane, low (e < 16) or high
    const int p = (e & 15) >> 2, half = e >> 4;
    const int at = Q == TileFormat::kI6F ? kI6FNibbles : nibbles_at<Q>();
    const uint32x4_t raw = vld1q_u32(reinterpret_cast<const uint32_t*>(t + at + 64 * p + 16 * q));
    uint32x4_t v = vandq_u32(vshlq_u32(raw, vdupq_n_s32(-(8 * (e & 3) + 4 * half))), vdupq_n_u32(0x0F));
    if constexpr (five_bit<Q>()) {  // bit e of the row's word, to bit 4
      const uint32x4_t qh = vld1q_u32(reinterpret_cast<const uint32_t*>(t + k5FHigh + 16 * q));
      v = vorrq_u32(v, vandq_u32(vshlq_u32(qh, vdupq_n_s32(4 - e)), vdupq_n_u32(0x10)));
    }
    if constexpr (Q == TileFormat::kI6F) {  // the 2-bit field, to bits 4..5; then v - 32 times d
      const uint32x4_t q2 = vld1q_u32(reinterpret_cast<const uint32_t*>(t + kI6FHigh + 64 * (p >> 1) + 16 * q));
      const int shift = 8 * (e & 3) + 4 * (p & 1) + 2 * half;
      v = vorrq_u32(v, vshlq_n_u32(vandq_u32(vshlq_u32(q2, vdupq_n_s32(-shift)), vdupq_n_u32(0x03)), 4));
      (void)m;
      return vmulq_f32(vcvtq_f32_s32(vsubq_s32(vreinterpretq_s32_u32(v), vdupq_n_s32(32))), d);  // exact
    } else {
      return vfmaq_f32(m, vcvtq_f32_u32(v), d);  // exact d * q: one rounding either way
    }
  }
}

// out[r, c0 + j] = v[j] (+ bias) for j < min(4, N - c0).
inline void store_row_f32(const QuantF32GemmArgs& a, int64_t r, int64_t c0, float32x4_t v) {
  if (c0 >= a.n) return;
  if (a.n - c0 < 4) {
    float buf[4];
    vst1q_f32(buf, v);
    for (int64_t j = 0; j < a.n - c0; ++j) a.out[r * a.ldo + c0 + j] = a.bias != nullptr ? buf[j] + a.bias[c0 + j] : buf[j];
    return;
  }
  if (a.bias != nullptr) v = vaddq_f32(v, vld1q_f32(a.bias + c0));
  vst1q_f32(a.out + r * a.ldo + c0, v);
}

// Rows 4 q .. 4 q + 3's scales of the tile at t for expand4, all four quarters.
template <TileFormat Q>
inline __attribute__((always_inline)) void group_scales(const uint8_t* t, float32x4_t* d, float32x4_t* m, int eh,
                                                        const float* super) {
  for (int q = 0; q < 4; ++q) quarter_scales<Q>(t, q, &d[q], &m[q], eh, super);
}

// Out rows r .. r+R-1 x row group g, the weights expanded in registers.
template <TileFormat Q, int R>
void f32_pass_direct(const QuantF32GemmArgs& a, int64_t g, int64_t r) {
  constexpr int64_t kTile = tile_bytes(Q);
  const int64_t nb = a.k / kQBlock;
  const uint8_t* t = a.w + g * nb * kTile;
  const float* xr[R];
  for (int i = 0; i < R; ++i) xr[i] = a.x + (r + i) * a.k;
  float32x4_t acc[4][R];
  for (int q = 0; q < 4; ++q) {
    for (int i = 0; i < R; ++i) acc[q][i] = vdupq_n_f32(0.f);
  }
  for (int64_t b = 0; b < nb; ++b, t += kTile) {
    float32x4_t d[4], m[4];
    group_scales<Q>(t, d, m, 0, super_scales<Q>(a, g, b));
    const int64_t kb = b * kQBlock;
#pragma GCC unroll 32
    for (int e = 0; e < kQBlock; ++e) {
      if (half_scales<Q>() && e == kQBlock / 2) group_scales<Q>(t, d, m, 1, nullptr);
      float32x4_t w[4];
      for (int q = 0; q < 4; ++q) w[q] = expand4<Q>(t, q, e, d[q], m[q]);
      for (int i = 0; i < R; ++i) {
        const float32x4_t xv = vdupq_n_f32(xr[i][kb + e]);
        for (int q = 0; q < 4; ++q) acc[q][i] = vfmaq_f32(acc[q][i], w[q], xv);
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int q = 0; q < 4; ++q) store_row_f32(a, r + i, g * kQRows + 4 * q, acc[q][i]);
  }
}

// ws[16 k + j] = the weight of row 16 g + j, element k.
template <TileFormat Q>
void f32_expand(const QuantF32GemmArgs& a, int64_t g, float* ws) {
  constexpr int64_t kTile = tile_bytes(Q);
  const int64_t nb = a.k / kQBlock;
  const uint8_t* t = a.w + g * nb * kTile;
  for (int64_t b = 0; b < nb; ++b, t += kTile, ws += kQBlock * kQRows) {
    float32x4_t d[4], m[4];
    group_scales<Q>(t, d, m, 0, super_scales<Q>(a, g, b));
#pragma GCC unroll 32
    for (int e = 0; e < kQBlock; ++e) {
      if (half_scales<Q>() && e == kQBlock / 2) group_scales<Q>(t, d, m, 1, nullptr);
      for (int q = 0; q < 4; ++q) vst1q_f32(ws + kQRows * e + 4 * q, expand4<Q>(t, q, e, d[q], m[q]));
    }
  }
}

// The same rows' results from f32_expand's ws (R <= 6: 24 accumulators of the 32 registers).
template <int R>
void f32_pass_scratch(const QuantF32GemmArgs& a, int64_t g, int64_t r, const float* ws) {
  const int64_t k_end = a.k;
  const float* xr[R];
  for (int i = 0; i < R; ++i) xr[i] = a.x + (r + i) * a.k;
  float32x4_t acc[4][R];
  for (int q = 0; q < 4; ++q) {
    for (int i = 0; i < R; ++i) acc[q][i] = vdupq_n_f32(0.f);
  }
#pragma GCC unroll 2
  for (int64_t k = 0; k < k_end; ++k, ws += kQRows) {
    float32x4_t w[4];
    for (int q = 0; q < 4; ++q) w[q] = vld1q_f32(ws + 4 * q);
    for (int i = 0; i < R; ++i) {
      const float32x4_t xv = vdupq_n_f32(xr[i][k]);
      for (int q = 0; q < 4; ++q) acc[q][i] = vfmaq_f32(acc[q][i], w[q], xv);
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int q = 0; q < 4; ++q) store_row_f32(a, r + i, g * kQRows + 4 * q, acc[q][i]);
  }
}

constexpr int kF32DirectRows = 4;

// rows (1 .. 6) rows from r: in registers (ws == nullptr, rows <= kF32DirectRows) or from ws.
template <TileFormat Q>
void f32_rows(const QuantF32GemmArgs& a, int64_t g, int64_t r, int64_t rows, const float* ws) {
  if (ws == nullptr) {
    switch (rows) {
      case 1: f32_pass_direct<Q, 1>(a, g, r); break;
      case 2: f32_pass_direct<Q, 2>(a, g, r); break;
      case 3: f32_pass_direct<Q, 3>(a, g, r); break;
      default: f32_pass_direct<Q, 4>(a, g, r); break;
    }
    return;
  }
  switch (rows) {
    case 1: f32_pass_scratch<1>(a, g, r, ws); break;
    case 2: f32_pass_scratch<2>(a, g, r, ws); break;
    case 3: f32_pass_scratch<3>(a, g, r, ws); break;
    case 4: f32_pass_scratch<4>(a, g, r, ws); break;
    case 5: f32_pass_scratch<5>(a, g, r, ws); break;
    default: f32_pass_scratch<6>(a, g, r, ws); break;
  }
}

// Up to kF32DirectRows rows expand in registers; more expand the group once into scratch, then run in tiles of
// kF32Rows rows as passes of equal size (at most 6).
template <TileFormat Q>
void gemm_f32_typed(const QuantF32GemmArgs& a, int64_t g0, int64_t g1, int64_t m0, int64_t m1, float* scratch) {
  constexpr int64_t kPassRows = kF32Rows / 2;
  if (m1 <= m0) return;
  for (int64_t g = g0; g < g1; ++g) {
    if (m1 - m0 <= kF32DirectRows) {
      f32_rows<Q>(a, g, m0, m1 - m0, nullptr);
      continue;
    }
    f32_expand<Q>(a, g, scratch);
    for (int64_t t0 = m0; t0 < m1; t0 += kF32Rows) {
      const int64_t rt = imin(kF32Rows, m1 - t0), passes = (rt + kPassRows - 1) / kPassRows;
      const int64_t per_pass = (rt + passes - 1) / passes;
      for (int64_t i0 = 0; i0 < rt; i0 += per_pass) f32_rows<Q>(a, g, t0 + i0, imin(per_pass, rt - i0), scratch);
    }
  }
}

// kernel_table.h's peak_ops: the FMA half is kernels_simd.h's. int8: sdot (neon_dotprod) or smull + sadalp
// (neon) on register-resident chains; an empty asm statement marks the operands changed every round so the
// loop-invariant products are not hoisted.
double peak_ops(int kind, int64_t iters) {
  if (kind == kPeakFma) return peak_fma_ops(iters);
  volatile int sink = 0;
  const int8_t base = static_cast<int8_t>(sink);
  int8x16_t w = vdupq_n_s8(static_cast<int8_t>(base + 3));
  int8x16_t x0 = vdupq_n_s8(static_cast<int8_t>(base - 5)), x1 = vdupq_n_s8(static_cast<int8_t>(base - 4));
  int8x16_t x2 = vdupq_n_s8(static_cast<int8_t>(base - 3)), x3 = vdupq_n_s8(static_cast<int8_t>(base - 2));
  int32x4_t a0 = vdupq_n_s32(0), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
#if PAGEDSERVE_GEMM_DOTPROD
#define PS_PEAK_STEP(a, b, x) (a = vdotq_s32(a, w, x), b = vdotq_s32(b, w, x))
#else
#define PS_PEAK_STEP(a, b, x) \
  (a = vpadalq_s16(a, vmull_s8(vget_low_s8(w), vget_low_s8(x))), b = vpadalq_s16(b, vmull_high_s8(w, x)))
#endif
  for (int64_t i = 0; i < iters; ++i) {
    __asm__ volatile("" : "+w"(w), "+w"(x0), "+w"(x1), "+w"(x2), "+w"(x3));
    PS_PEAK_STEP(a0, a1, x0);
    PS_PEAK_STEP(a2, a3, x1);
    PS_PEAK_STEP(a4, a5, x2);
    PS_PEAK_STEP(a6, a7, x3);
  }
#undef PS_PEAK_STEP
  const int32x4_t s = vaddq_s32(vaddq_s32(vaddq_s32(a0, a1), vaddq_s32(a2, a3)),
                                vaddq_s32(vaddq_s32(a4, a5), vaddq_s32(a6, a7)));
  sink = vaddvq_s32(s);
  // per step: sdot x 2 = 32 multiply-adds; smull + sadalp x 2 = 16
  return 2.0 * (PAGEDSERVE_GEMM_DOTPROD ? 32 : 16) * 4 * static_cast<double>(iters);
}

const QuantKernelTable kTable{PS_STR(PAGEDSERVE_GEMM_ISA), &quantize_rows, &gemm, &gemm_f32, &peak_ops};

}  // namespace

const QuantKernelTable& PS_CAT(quant_kernel_table_, PAGEDSERVE_GEMM_ISA)() { return kTable; }

}  // namespace cpu
}  // namespace pagedserve
