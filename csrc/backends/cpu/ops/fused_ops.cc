// The fused elementwise ops' dispatcher (fused_ops.h): argument checks, the
// ISA variant's kernel table, and the row split over the thread pool.
#include "backends/cpu/ops/fused_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "backends/cpu/attention/attention_cpu.h"  // kMaxThreads
#include "core/errors.h"
#include "backends/cpu/runtime/isa_registry.h"
#include "backends/cpu/ops/kernel_table.h"
#include "backends/cpu/runtime/thread_pool.h"

namespace pagedserve {
namespace cpu {
namespace {

const FusedKernelTable& table() { return active_isa().ops(); }

int64_t elem_size(DType d) { return d == DType::kBFloat16 ? 2 : 4; }

void check_float_dtype(const TensorArg& t) {
  if (t.dtype != DType::kFloat32 && t.dtype != DType::kBFloat16) {
    throw KernelArgumentError(t.name + " must be float32 or bfloat16, got " + dtype_name(t.dtype));
  }
}

void check_threads(int num_threads) {
  if (num_threads < 1 || num_threads > kMaxThreads) {
    throw KernelArgumentError("num_threads must be in [1, " + std::to_string(kMaxThreads) + "], got " +
                              std::to_string(num_threads));
  }
}

void check_strides_non_negative(const TensorArg& t) {
  if (t.strides.size() != t.shape.size()) throw KernelArgumentError(t.name + " has strides of the wrong rank");
  for (int64_t s : t.strides) {
    if (s < 0) throw KernelArgumentError(t.name + " has a negative stride");
  }
  if (t.numel() > 0 && t.data == nullptr) throw KernelArgumentError(t.name + " has no data");
}

// A [rows, cols] tensor of rows read or written by the kernels: 2-D, with
// `cols` columns (-1: any), a contiguous last dimension; when `written`, rows
// that do not overlap (row stride >= cols, or a single row).
void check_rows(const TensorArg& t, int64_t rows, int64_t cols, bool written) {
  t.check_dim(2);
  check_strides_non_negative(t);
  if (rows >= 0 && t.size(0) != rows) {
    throw KernelArgumentError(t.name + " must have " + std::to_string(rows) + " rows, got " +
                              std::to_string(t.size(0)));
  }
  if (cols >= 0 && t.size(1) != cols) {
    throw KernelArgumentError(t.name + " must have " + std::to_string(cols) + " columns, got " +
                              std::to_string(t.size(1)));
  }
  t.check_last_dim_contiguous();
  if (written && t.size(0) > 1 && t.size(1) > 0 && t.strides[0] < t.size(1)) {
    throw KernelArgumentError(t.name + " has overlapping rows (row stride " + std::to_string(t.strides[0]) + " < " +
                              std::to_string(t.size(1)) + " columns): it cannot be written");
  }
}

// The bytes [lo, hi) a tensor's elements span (empty for no elements).
struct Span {
  uintptr_t lo, hi;
};
Span span(const TensorArg& t) {
  if (t.numel() == 0) return {0, 0};
  int64_t last = 0;
  for (int64_t i = 0; i < t.dim(); ++i) last += (t.shape[i] - 1) * t.strides[i];
  const uintptr_t lo = reinterpret_cast<uintptr_t>(t.data);
  return {lo, lo + static_cast<uintptr_t>((last + 1) * elem_size(t.dtype))};
}
bool overlap(const TensorArg& a, const TensorArg& b) {
  const Span x = span(a), y = span(b);
  return x.lo < x.hi && y.lo < y.hi && x.lo < y.hi && y.lo < x.hi;
}
bool same_view(const TensorArg& a, const TensorArg& b) {
  return a.data == b.data && a.shape == b.shape && a.strides == b.strides && a.dtype == b.dtype;
}

void check_weight(const TensorArg& w, int64_t h, DType dtype) {
  w.check_dim(1);
  check_strides_non_negative(w);
  w.check_shape({h});
  w.check_dtype(dtype);
  w.check_contiguous();
}

void check_eps(float eps) {
  if (!std::isfinite(eps) || eps < 0.f) {
    throw KernelArgumentError("eps must be finite and >= 0, got " + std::to_string(eps));
  }
}

// A query/key tensor of rotary_embedding: its head layout.
struct HeadLayout {
  int64_t num_heads, row_stride, head_stride;
};

HeadLayout check_heads(const TensorArg& t, int64_t rows, int64_t head_size) {
  check_float_dtype(t);
  check_strides_non_negative(t);
  if (t.dim() != 2 && t.dim() != 3) {
    throw KernelArgumentError(t.name + " must be [T, num_heads * head_size] or [T, num_heads, head_size]");
  }
  if (t.size(0) != rows) {
    throw KernelArgumentError(t.name + " must have " + std::to_string(rows) + " rows (one per position), got " +
                              std::to_string(t.size(0)));
  }
  t.check_last_dim_contiguous();
  HeadLayout l{};
  int64_t row_extent = 0;
  if (t.dim() == 2) {
    if (t.size(1) % head_size != 0) {
      throw KernelArgumentError(t.name + "'s " + std::to_string(t.size(1)) +
                                " columns are not a multiple of head_size " + std::to_string(head_size));
    }
    l = {t.size(1) / head_size, t.strides[0], head_size};
    row_extent = t.size(1);
  } else {
    if (t.size(2) != head_size) {
      throw KernelArgumentError(t.name + "'s last dimension must be head_size " + std::to_string(head_size) +
                                ", got " + std::to_string(t.size(2)));
    }
    l = {t.size(1), t.strides[0], t.strides[1]};
    if (l.num_heads > 1 && l.head_stride < head_size) {
      throw KernelArgumentError(t.name + " has overlapping heads: it cannot be written");
    }
    row_extent = l.num_heads > 0 ? (l.num_heads - 1) * l.head_stride + head_size : 0;
  }
  if (rows > 1 && row_extent > 0 && l.row_stride < row_extent) {
    throw KernelArgumentError(t.name + " has overlapping rows: it cannot be written");
  }
  return l;
}

}  // namespace

void rms_norm(const TensorArg& out, const TensorArg& x, const TensorArg& weight, float eps, int num_threads) {
  check_threads(num_threads);
  check_float_dtype(x);
  check_rows(x, -1, -1, false);
  const int64_t T = x.size(0), H = x.size(1);
  check_rows(out, T, H, true);
  out.check_dtype(x.dtype);
  check_weight(weight, H, x.dtype);
  check_eps(eps);
  if (!same_view(out, x) && overlap(out, x)) {
    throw KernelArgumentError("out overlaps x without being x itself");
  }
  if (T == 0 || H == 0) return;
  const NormArgs a{x.dtype, H, x.data, x.strides[0], out.data, out.strides[0], nullptr, 0, weight.data, eps};
  const FusedKernelTable& k = table();
  for_rows(T, H, num_threads, [&](int64_t r0, int64_t r1) { k.rms_norm(a, r0, r1); });
}

void fused_add_rms_norm(const TensorArg& x, const TensorArg& residual, const TensorArg& weight, float eps,
                        int num_threads) {
  check_threads(num_threads);
  check_float_dtype(x);
  check_rows(x, -1, -1, true);
  const int64_t T = x.size(0), H = x.size(1);
  check_rows(residual, T, H, true);
  residual.check_dtype(x.dtype);
  check_weight(weight, H, x.dtype);
  check_eps(eps);
  if (overlap(x, residual)) throw KernelArgumentError("x and residual overlap: both are written");
  if (T == 0 || H == 0) return;
  const NormArgs a{x.dtype, H, x.data, x.strides[0], x.data, x.strides[0], residual.data, residual.strides[0],
                   weight.data, eps};
  const FusedKernelTable& k = table();
  for_rows(T, H, num_threads, [&](int64_t r0, int64_t r1) { k.fused_add_rms_norm(a, r0, r1); });
}

namespace {

// The checks and row split shared by the gated activations (silu_and_mul, gelu_tanh_and_mul).
void gated_activation(const TensorArg& out, const TensorArg& x, int num_threads,
                      void (*kernel)(const SiluMulArgs&, int64_t, int64_t)) {
  check_threads(num_threads);
  check_float_dtype(x);
  check_rows(x, -1, -1, false);
  const int64_t T = x.size(0);
  if (x.size(1) % 2 != 0) {
    throw KernelArgumentError("x must have an even number of columns (gate and up halves), got " +
                              std::to_string(x.size(1)));
  }
  const int64_t I = x.size(1) / 2;
  check_rows(out, T, I, true);
  out.check_dtype(x.dtype);
  if (overlap(out, x)) throw KernelArgumentError("out overlaps x");
  if (T == 0 || I == 0) return;
  const SiluMulArgs a{x.dtype, I, x.data, x.strides[0], out.data, out.strides[0]};
  for_rows(T, 2 * I, num_threads, [&](int64_t r0, int64_t r1) { kernel(a, r0, r1); });
}

}  // namespace

void silu_and_mul(const TensorArg& out, const TensorArg& x, int num_threads) {
  gated_activation(out, x, num_threads, table().silu_and_mul);
}

void gelu_tanh_and_mul(const TensorArg& out, const TensorArg& x, int num_threads) {
  gated_activation(out, x, num_threads, table().gelu_tanh_and_mul);
}

void rotary_embedding(const TensorArg& positions, const TensorArg& query, const TensorArg* key, int64_t head_size,
                      const TensorArg& cos_sin_cache, bool is_neox, int num_threads) {
  check_threads(num_threads);
  if (head_size <= 0) throw KernelArgumentError("head_size must be positive, got " + std::to_string(head_size));
  positions.check_dim(1);
  positions.check_dtype(DType::kInt64);
  check_strides_non_negative(positions);
  positions.check_contiguous();
  const int64_t T = positions.size(0);
  cos_sin_cache.check_dim(2);
  cos_sin_cache.check_dtype(DType::kFloat32);
  check_strides_non_negative(cos_sin_cache);
  cos_sin_cache.check_contiguous();
  const int64_t max_pos = cos_sin_cache.size(0), rot_dim = cos_sin_cache.size(1);
  if (rot_dim < 2 || rot_dim % 2 != 0 || rot_dim > head_size || rot_dim > kMaxRotaryDim) {
    throw KernelArgumentError("cos_sin_cache's rotary dimension (its 2nd) must be even and in [2, min(head_size " +
                              std::to_string(head_size) + ", " + std::to_string(kMaxRotaryDim) + ")], got " +
                              std::to_string(rot_dim));
  }
  const HeadLayout ql = check_heads(query, T, head_size);
  HeadLayout kl{0, 0, 0};
  if (key != nullptr) {
    kl = check_heads(*key, T, head_size);
    key->check_dtype(query.dtype);
  }
  const int64_t* pos = positions.ptr<const int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    if (pos[t] < 0 || pos[t] >= max_pos) {
      throw KernelArgumentError("positions[" + std::to_string(t) + "] = " + std::to_string(pos[t]) +
                                " is outside cos_sin_cache's [0, " + std::to_string(max_pos) + ")");
    }
  }
  if (T == 0) return;
  const FusedKernelTable& k = table();
  const RotaryArgs qa{query.dtype, pos,           cos_sin_cache.ptr<const float>(), rot_dim, is_neox, query.data,
                      ql.row_stride, ql.head_stride, ql.num_heads};
  RotaryArgs ka = qa;
  if (key != nullptr) {
    ka.x = key->data;
    ka.row_stride = kl.row_stride;
    ka.head_stride = kl.head_stride;
    ka.num_heads = kl.num_heads;
  }
  const int64_t per_row = (ql.num_heads + kl.num_heads) * rot_dim;
  for_rows(T, per_row, num_threads, [&](int64_t r0, int64_t r1) {
    if (ql.num_heads > 0) k.rotary_embedding(qa, r0, r1);
    if (key != nullptr && kl.num_heads > 0) k.rotary_embedding(ka, r0, r1);
  });
}

}  // namespace cpu
}  // namespace pagedserve
