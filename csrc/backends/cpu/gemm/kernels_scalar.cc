// The quantized linear kernels (kernel_table.h), plain C++: the "scalar"
// variant, on every architecture, and the reference the SIMD variants' tests
// compare with (the integer math one row at a time; gemm_f32 rounds the
// product and the sum separately).
//
// Everything but the table getter has internal linkage and no standard-library
// template is used (tests/cpp/check_isa_objects.cmake verifies the objects).
#include "backends/cpu/gemm/kernels_common.h"

namespace pagedserve {
namespace cpu {
namespace {

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

// ---- scalar: the reference integer math, one row at a time ----

// Row j's scale d and minimum m of block b of row group g in a u5f weight (stored) or a u4k one (formed: both
// products exact, kernel_table.h); Args: QuantGemmArgs or QuantF32GemmArgs.
template <typename Args>
void u5f_or_u4k_scales(const Args& a, int64_t g, int64_t b, int j, float* d, float* m) {
  if (a.format == TileFormat::kU5F) {
    const uint8_t* t = a.w + (g * (a.k / kQBlock) + b) * k5FTileBytes;
    memcpy(d, t + 4 * j, 4);
    memcpy(m, t + 64 + 4 * j, 4);
    return;
  }
  u4k_scales(a.w, a.n, a.k, g, b, j, d, m);
}

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
    } else if (a.format == TileFormat::kU5F || a.format == TileFormat::kU4K) {
      const bool five = a.format == TileFormat::kU5F;
      const uint8_t* t = a.w + (g * nb + b) * (five ? k5FTileBytes : kU4KTileBytes);
      const int nibbles = five ? k5FNibbles : kU4KNibbles;
      for (int j = 0; j < kQRows; ++j) {
        uint32_t qh = 0;
        if (five) memcpy(&qh, t + k5FHigh + 4 * j, 4);
        int32_t isum = 0;
        for (int e = 0; e < kQBlock; ++e) {
          const uint8_t qs = t[nibbles + 64 * ((e & 15) >> 2) + 4 * j + (e & 3)];
          const int v = (e < 16 ? qs & 0x0F : qs >> 4) | static_cast<int>((qh >> e) & 1u) << 4;
          isum += v * xq[e];
        }
        float d, m;
        u5f_or_u4k_scales(a, g, b, j, &d, &m);
        acc[j] = acc[j] + static_cast<float>(isum) * (d * xd);
        acc[j] = acc[j] + m * xs;
      }
    } else {  // i6f: a scale per 16 elements, no minimum
      const uint8_t* t = a.w + (g * nb + b) * kI6FTileBytes;
      for (int j = 0; j < kQRows; ++j) {
        for (int half = 0; half < 2; ++half) {
          int32_t isum = 0;
          for (int e = 16 * half; e < 16 * half + 16; ++e) isum += i6f_quant(t, j, e) * xq[e];
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
  } else if (a.format == TileFormat::kU5F || a.format == TileFormat::kU4K) {
    const bool five = a.format == TileFormat::kU5F;
    const uint8_t* t = a.w + (g * nb + b) * (five ? k5FTileBytes : kU4KTileBytes);
    const int p = (e & 15) >> 2, byte = e & 3;
    for (int j = 0; j < kQRows; ++j) {
      const uint8_t qs = t[(five ? k5FNibbles : kU4KNibbles) + 64 * p + 4 * j + byte];
      uint32_t qh = 0;
      if (five) memcpy(&qh, t + k5FHigh + 4 * j, 4);
      int v = (e < 16 ? qs & 0x0F : qs >> 4) | static_cast<int>((qh >> e) & 1u) << 4;
      float d, m;
      u5f_or_u4k_scales(a, g, b, j, &d, &m);
      const float prod = d * static_cast<float>(v);
      w[j] = prod + m;
    }
  } else {
    const uint8_t* t = a.w + (g * nb + b) * kI6FTileBytes;
    const float* d = reinterpret_cast<const float*>(t) + kQRows * (e >> 4);
    for (int j = 0; j < kQRows; ++j) w[j] = d[j] * static_cast<float>(i6f_quant(t, j, e));  // exact
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

// kernel_table.h's peak_ops in plain C++: 32 independent chains (the
// compiler may vectorise them; what it makes of scalar code is this variant's
// peak), the int8 products each from its own operands, marked as changed every
// round by an empty asm statement so that none is computed once outside the loop.
double peak_ops(int kind, int64_t iters) {
  constexpr int kChains = 32;
  volatile float fsink = 0.f;
  volatile uint32_t isink = 0;
  if (kind == kPeakFma) {
    float acc[kChains], x = 1.0000001f, y = 0.999999f;
    for (int j = 0; j < kChains; ++j) acc[j] = static_cast<float>(j) + fsink;
    for (int64_t i = 0; i < iters; ++i) {
      for (int j = 0; j < kChains; ++j) acc[j] = acc[j] * x + y;
    }
    float s = 0.f;
    for (int j = 0; j < kChains; ++j) s += acc[j];
    fsink = s;
  } else {
    uint32_t acc[kChains];
    int32_t w[kChains], x[kChains];
    for (int j = 0; j < kChains; ++j) {
      acc[j] = static_cast<uint32_t>(j);
      w[j] = static_cast<int8_t>(j + 3 + static_cast<int>(isink));
      x[j] = static_cast<int8_t>(j - 5);
    }
    for (int64_t i = 0; i < iters; ++i) {
      __asm__ volatile("" : : "r"(w), "r"(x) : "memory");  // w, x may have changed: load them again
      for (int j = 0; j < kChains; ++j) acc[j] += static_cast<uint32_t>(w[j] * x[j]);
    }
    uint32_t s = 0;
    for (int j = 0; j < kChains; ++j) s += acc[j];
    isink = s;
  }
  (void)fsink;
  (void)isink;
  return 2.0 * kChains * static_cast<double>(iters);
}

const QuantKernelTable kTable{PS_STR(PAGEDSERVE_GEMM_ISA), &quantize_rows, &gemm, &gemm_f32, &peak_ops};

}  // namespace

const QuantKernelTable& PS_CAT(quant_kernel_table_, PAGEDSERVE_GEMM_ISA)() { return kTable; }

}  // namespace cpu
}  // namespace pagedserve
