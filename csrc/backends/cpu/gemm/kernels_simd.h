// What the SIMD variants of the quantized linear kernels share
// (kernels_neon.cc includes it, the x86 files through kernels_decoded_x86.h,
// after kernels_common.h and after defining their lane primitives: VecF / VecI,
// kLanes, load_lanes, abs_max, hmax, nan_to_zero, set1f, mulf, addf, subf,
// fmaddf, minf, maxf, trunc_i32, store_q): the activation quantisation over
// those primitives, the float half of the roofline's peak probe
// (peak_fma_ops), and the dispatch of gemm and gemm_f32 to the file's
// gemm_typed and gemm_f32_typed. No intrinsics of one architecture: the x86
// files share the integer GEMM of the decoded tiles too (kernels_decoded_x86.h).
// Internal linkage throughout, as kernels_common.h.
#pragma once

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

// The integer GEMM: the file's gemm_typed per quantised tile format (QuantGemmArgs never holds a dense one).
void gemm(const QuantGemmArgs& a, int64_t g0, int64_t g1, int64_t m0, int64_t m1) {
  switch (a.format) {
    case TileFormat::kQ4_1: gemm_typed<TileFormat::kQ4_1>(a, g0, g1, m0, m1); break;
    case TileFormat::kQ8_0: gemm_typed<TileFormat::kQ8_0>(a, g0, g1, m0, m1); break;
    case TileFormat::kU5F: gemm_typed<TileFormat::kU5F>(a, g0, g1, m0, m1); break;
    case TileFormat::kU4K: gemm_typed<TileFormat::kU4K>(a, g0, g1, m0, m1); break;
    case TileFormat::kI6F: gemm_typed<TileFormat::kI6F>(a, g0, g1, m0, m1); break;
    default: break;
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
