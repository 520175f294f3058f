// The interface between the fused elementwise ops' dispatcher (fused_ops.cc,
// built for the baseline ISA) and their kernel translation unit
// (ops/kernels.cc), which CMake compiles once per ISA variant alongside
// attention/kernels.cc (attention/kernel_table.h explains the variants and why only plain structs
// and declarations may live here).
//
// Every kernel takes a half-open range of rows [r0, r1) so the dispatcher can
// run it inline (few rows) or split it over the thread pool (many rows). The
// dispatcher has validated every pointer, stride and index; the kernels check
// nothing.
#pragma once

#include <cstdint>

#include "backends/common/dtype.h"

namespace pagedserve {
namespace cpu {

// rms_norm / fused_add_rms_norm over rows of length h (elements).
// rms_norm:           out[r] = weight * to_dtype(x[r] * rsqrt(mean(x[r]^2) + eps))
// fused_add_rms_norm: residual[r] = to_dtype(x[r] + residual[r]); x[r] = rms_norm(residual[r])
// (for fused_add_rms_norm `out` is x and `residual` is written).
struct NormArgs {
  DType dtype;  // kFloat32 or kBFloat16 (every tensor alike)
  int64_t h;
  const void* x;
  int64_t x_stride;  // elements between rows
  void* out;
  int64_t out_stride;
  void* residual;  // fused_add_rms_norm only
  int64_t residual_stride;
  const void* weight;  // [h], contiguous
  float eps;
};

// out[r, i] = to_dtype(to_dtype(act(x[r, i])) * x[r, d + i]) for i < d, act
// silu (silu_and_mul) or tanh-approximated gelu (gelu_tanh_and_mul).
struct SiluMulArgs {
  DType dtype;
  int64_t d;
  const void* x;  // [rows, 2d], row stride x_stride, last dim contiguous
  int64_t x_stride;
  void* out;  // [rows, d]
  int64_t out_stride;
};

constexpr int64_t kMaxRotaryDim = 1024;  // rot_dim bound (a kernel's stack buffer)

// In-place rotary embedding of `num_heads` heads of head_size elements per
// token row; the first rot_dim elements of each head rotate (rot_dim even,
// <= head_size, <= kMaxRotaryDim), with cos = cache[pos, i] and
// sin = cache[pos, rot_dim/2 + i] for i < rot_dim/2.
struct RotaryArgs {
  DType dtype;
  const int64_t* positions;  // [rows], each in [0, max_position)
  const float* cos_sin_cache;  // [max_position, rot_dim] contiguous float32
  int64_t rot_dim;
  bool is_neox;
  void* x;
  int64_t row_stride, head_stride;  // elements
  int64_t num_heads;
};

struct FusedKernelTable {
  const char* isa;
  void (*rms_norm)(const NormArgs& a, int64_t r0, int64_t r1);
  void (*fused_add_rms_norm)(const NormArgs& a, int64_t r0, int64_t r1);
  void (*silu_and_mul)(const SiluMulArgs& a, int64_t r0, int64_t r1);
  void (*gelu_tanh_and_mul)(const SiluMulArgs& a, int64_t r0, int64_t r1);
  void (*rotary_embedding)(const RotaryArgs& a, int64_t r0, int64_t r1);
};

// One getter per compiled variant (defined in ops/kernels.cc under PAGEDSERVE_ISA).
const FusedKernelTable& fused_kernel_table_baseline();
const FusedKernelTable& fused_kernel_table_avx2();
const FusedKernelTable& fused_kernel_table_avx512();
const FusedKernelTable& fused_kernel_table_neon();
const FusedKernelTable& fused_kernel_table_native();

}  // namespace cpu
}  // namespace pagedserve
