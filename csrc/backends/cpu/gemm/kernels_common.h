// What every variant of the quantized linear kernels shares (kernel_table.h:
// one file per variant, kernels_scalar.cc, kernels_avx2.cc, kernels_avx512.cc,
// kernels_neon.cc, include it): the activation quantisation's scales, the output stores and the
// tile formats' offsets. Only for those files: everything here has internal
// linkage (an anonymous namespace), so no symbol compiled for one ISA can stand
// in for another's (tests/cpp/check_isa_objects.cmake).
//
// Algorithm: llama.cpp's scheme for GGUF Q4_1 / Q8_0 weights times Q8_1-style
// activations (our own code): per 32-block the integer dot sum(q * xq) of the
// weight quants and the int8 activations, then in float
//   Q4_1: acc += d * xd * isum + m * xs      (xs = xd * sum(xq))
//   Q8_0: acc += d * xd * isum
// Within a variant a row's result does not depend on the pass, the work item
// or the thread that computed it: the integer sums are exact (any order) and
// the float steps per (row, block) are always the same: scale = d * xd, then
// acc = fma(isum, scale, acc) and, for Q4_1, acc = fma(m, xs, acc) (the scalar
// variant rounds the product and the sum separately instead). Every file is
// built with -ffp-contract=off (the float steps are written out; FMAs are
// explicit intrinsics), so the activation quantisation is bit-identical in
// every variant.
#pragma once

#include <math.h>
#include <string.h>

#include <cstdint>

#include "backends/cpu/gemm/kernel_table.h"
#include "backends/cpu/runtime/scalar_convert.h"

#ifndef PAGEDSERVE_GEMM_ISA
#error "PAGEDSERVE_GEMM_ISA must name the variant this file is compiled for"
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
// d * q + m, Q8_0 d * q, i6f d * (v - 32): kernel_table.h) and multiplied with the float32
// activations, accumulated in float32 along k in order. The SIMD variants
// hold vectors along N (lane j = row 16 g + j): element e of a block is byte
// e % 4 (Q4_1: nibble e / 16) of every lane of one 64-byte qs row, so one
// shift (or byte shuffle) and a conversion give the 16 rows' weights for that
// k. Exactness: d (fp16: 11 significant bits) times q (Q4_1: 4 bits, Q8_0: 8)
// is exact in float32 (at most 19 significant bits, no overflow or underflow
// for any finite fp16 d), so round(d * q) = d * q and the single rounding of
// fma(q, d, m) equals numpy's round(round(d * q) + m); Q8_0 multiplies
// (q * 2^24) by (d * 2^-24), both exact scalings, for the same exact product
// (x86: the byte shuffled to the top of its lane; NEON sign-extends q and
// multiplies q by d, the same value and sign of zero).
// u5f / u4k / i6f: d * q is exact by construction (gguf_types.h: at most 23 significant
// bits for every type), d * 2^-24 stays normal for every d the repacking
// makes (|d| >= 2^-24 or 0), and fma(q, d, m) rounds once, as numpy's
// d * q + m (or d * q - dm) does after its exact product; i6f's v - 32 is
// formed exactly (as an integer or a float) and multiplied by d, the zero's
// sign as numpy's d * q gives it.
// Per (row, column) the accumulation is one chain acc = fma(x, w, acc) over
// k = 0 .. K-1 (the scalar variant: acc + x * w, two roundings) in every
// path, so a row's result does not depend on the tiling, the work split or
// the thread count.

// The dense formats (kernel_table.h: dense_format): the expansion is a load (and,
// for the 16-bit ones, an exact widening).

// The 5-bit format (u5f: kernel_table.h), the one whose tiles hold float32 d[16] at 0 and m[16] at 64,
// the nibbles at k5FNibbles in q4_1's order, the high bits (uint32 per row) at k5FHigh.
template <TileFormat Q>
constexpr bool five_bit() {
  return Q == TileFormat::kU5F;
}
// Byte offset of the nibbles (q4_1's order) in a tile of the 4-bit formats (q4_1, u4k).
template <TileFormat Q>
constexpr int nibbles_at() {
  return Q == TileFormat::kQ4_1 ? 64 : Q == TileFormat::kU4K ? kU4KNibbles : k5FNibbles;
}

// u4k's super-block scales for row group g at block b (kernel_table.h), or nullptr for the other formats;
// Args: QuantGemmArgs or QuantF32GemmArgs.
template <TileFormat Q, typename Args>
inline const float* super_scales(const Args& a, int64_t g, int64_t b) {
  if constexpr (Q == TileFormat::kU4K) {
    return u4k_super(a.w, a.n, a.k, g, b);
  } else {
    (void)a;
    (void)g;
    (void)b;
    return nullptr;
  }
}

// Whether a format's scales change at element 16 of a block (i6f: one d per
// 16 elements); the SIMD loops reload them there.
template <TileFormat Q>
constexpr bool half_scales() {
  return Q == TileFormat::kI6F;
}

// out[r, c0 + j] = acc[j] (+ bias) for j < min(16, N - c0).
inline void write_out_f32(const QuantF32GemmArgs& a, int64_t r, int64_t c0, const float* acc) {
  const int64_t nv = imin(kQRows, a.n - c0);
  float* o = a.out + r * a.ldo + c0;
  for (int64_t j = 0; j < nv; ++j) o[j] = a.bias != nullptr ? acc[j] + a.bias[c0 + j] : acc[j];
}

}  // namespace
}  // namespace cpu
}  // namespace pagedserve
