// QuantizedWeight: GGUF weights repacked into the tiles of gemm/kernel_table.h
// (Q4_1 / Q8_0 as they are, Q4_0 / Q5_0 rewritten as those, the other types decoded into u5f / u4k / i6f by
// gguf_types.cc), dequantisation and
// the threaded linear (quant_linear.h). Built with -ffp-contract=off (the
// dequantisation must round d * q and + m separately, as numpy does).
#include "backends/cpu/gemm/quant_linear.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <thread>

#include "core/errors.h"
#include "backends/cpu/runtime/huge_pages.h"
#include "backends/cpu/runtime/isa_registry.h"
#include "backends/cpu/runtime/cpu_relax.h"
#include "backends/cpu/ops/fused_ops.h"  // for_rows
#include "backends/cpu/gemm/gguf_types.h"
#include "backends/cpu/runtime/scalar_convert.h"
#include "backends/cpu/runtime/thread_pool.h"

namespace pagedserve {
namespace cpu {
namespace {

constexpr int kMaxLinearThreads = 1024;
// Below this many (16-row group x 32-block x 4-row) tile passes a call runs on
// the calling thread: waking the pool costs more than the work (docs/benchmarks.md, "Behind the code").
constexpr int64_t kInlineTilePasses = 512;
constexpr int64_t kMaxDim = int64_t{1} << 31;
constexpr int64_t kRowsPerItem = 64;  // activation rows per work item when M is large
// linear_f32: below this many multiply-adds (M x N x K) a call runs on the
// calling thread: waking sleeping workers costs about as much as such a call
// takes on one core, polling ones (ThreadPool::set_spin_micros) little
// (docs/benchmarks.md, "Behind the code").
constexpr int64_t kInlineF32Macs = int64_t{1} << 21;
constexpr int64_t kInlineF32MacsSpinning = int64_t{1} << 17;
// linear_f32: activation rows per work item when M is large (a multiple of kF32Rows; docs/benchmarks.md,
// "Behind the code").
constexpr int64_t kF32RowsPerItem = 8 * kF32Rows;

uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Per calling thread: the quantised activations of the call in flight.
struct Scratch {
  std::vector<int8_t> xq;
  std::vector<float> xd, xs;
  std::vector<int32_t> xsum128;
};

// linear_f32's per-thread expanded-weight scratch.
struct F32Scratch {
  std::vector<float> w;
  // 64-byte aligned room for n floats in w
  float* aligned_w(int64_t n) {
    w.resize(static_cast<size_t>(n + 16));
    const uintptr_t p = reinterpret_cast<uintptr_t>(w.data());
    return reinterpret_cast<float*>((p + 63) & ~uintptr_t{63});
  }
};

// num_threads within [1, kMaxLinearThreads], or KernelArgumentError.
void check_num_threads(int num_threads) {
  if (num_threads < 1 || num_threads > kMaxLinearThreads) {
    throw KernelArgumentError("num_threads must be in [1, " + std::to_string(kMaxLinearThreads) + "], got " +
                              std::to_string(num_threads));
  }
}

}  // namespace

// The checks linear and linear_f32 share (x's dtype is checked by the caller):
// x [M, k] and out [M, n] of x's dtype, both 2-d and contiguous, not
// overlapping; bias float32 [n] contiguous or null; num_threads in range.
// Returns M. Throws KernelArgumentError.
int64_t check_linear_args(const TensorArg& x, const TensorArg& out, const TensorArg* bias, int num_threads,
                          int64_t n, int64_t k) {
  x.check_dim(2);
  const int64_t m = x.size(0);
  x.check_shape({m, k});
  x.check_contiguous();
  out.check_dtype(x.dtype);
  out.check_dim(2);
  out.check_shape({m, n});
  out.check_contiguous();
  out.check_no_overlap();
  if (bias != nullptr) {
    bias->check_dtype(DType::kFloat32);
    bias->check_dim(1);
    bias->check_shape({n});
    bias->check_contiguous();
  }
  check_num_threads(num_threads);
  return m;
}

void QuantizedWeight::Free::operator()(uint8_t* p) const { huge_page_free(p); }

namespace {

void check_dims(QType q, int64_t n, int64_t k) {
  if (n < 1 || n > kMaxDim) {
    throw KernelArgumentError("out_features must be in [1, 2^31], got " + std::to_string(n));
  }
  const int64_t be = qtype_block_elements(q);
  if (k < be || k > kMaxDim || k % be != 0) {
    throw KernelArgumentError("in_features must be a positive multiple of " + std::to_string(be) + " (" +
                              qtype_name(q) + " blocks hold " + std::to_string(be) + " elements), got " +
                              std::to_string(k));
  }
  if (n * (k / kQBlock) > (int64_t{1} << 36)) {
    throw KernelArgumentError("the weight has too many blocks (" + std::to_string(n) + " x " + std::to_string(k) +
                              ")");
  }
}

const TensorArg& checked_raw(const TensorArg& raw, QType q, int64_t n, int64_t k) {
  check_dims(q, n, k);
  raw.check_dtype(DType::kUInt8);
  raw.check_dim(2);
  raw.check_shape({n, k / qtype_block_elements(q) * qtype_block_bytes(q)});
  raw.check_contiguous();
  return raw;
}

}  // namespace

QuantizedWeight::QuantizedWeight(const TensorArg& raw, const std::string& qtype, int64_t out_features,
                                 int64_t in_features)
    : QuantizedWeight(checked_raw(raw, parse_qtype(qtype), out_features, in_features).ptr<uint8_t>(),
                      parse_qtype(qtype), out_features, in_features) {}

QuantizedWeight::QuantizedWeight(const uint8_t* raw, QType qtype, int64_t out_features, int64_t in_features)
    : qtype_(qtype), format_(tile_format_of(qtype)), n_(out_features), k_(in_features) {
  check_dims(qtype_, n_, k_);
  // Q4_0 / Q5_0 become Q4_1 / Q8_0 blocks of the same values (gguf_types.h), kept in those types' tiles
  std::vector<uint8_t> stored;
  QType stored_type = qtype_;
  if (qtype_ == QType::kQ4_0 || qtype_ == QType::kQ5_0) {
    const int64_t blocks = n_ * (k_ / kQBlock);
    stored.resize(static_cast<size_t>(blocks * qtype_block_bytes(QType::kQ8_0)));
    stored_type = as_stored_blocks(qtype_, raw, blocks, stored.data());
    format_ = tile_format_of(stored_type);
    raw = stored.data();
  }
  const int64_t nb = k_ / kQBlock, groups = (n_ + kQRows - 1) / kQRows, tb = tile_bytes(format_);
  const int64_t bb = qtype_block_bytes(stored_type);
  nbytes_ = groups * nb * tb + (format_ == TileFormat::kU4K ? groups * (nb / 8) * kU4KSuperBytes : 0);
  // every decode step streams all tiles of a model: huge pages spare the TLB misses (huge_pages.h)
  tiles_.reset(static_cast<uint8_t*>(huge_page_alloc(static_cast<size_t>(nbytes_))));
  uint8_t* tiles = tiles_.get();
  std::memset(tiles, 0, static_cast<size_t>(nbytes_));  // padding rows: d = m = q = 0
  if (dense_format(format_)) {
    integer_ok_ = false;
    repack_dense(raw);
    return;
  }
  if (format_ != TileFormat::kQ4_1 && format_ != TileFormat::kQ8_0) {
    repack_decoded(raw);
    return;
  }
  for (int64_t row = 0; row < n_; ++row) {
    const int64_t g = row / kQRows, j = row % kQRows;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* src = raw + (row * nb + b) * bb;
      uint8_t* t = tiles + (g * nb + b) * tb;
      if (stored_type == QType::kQ4_1) {
        std::memcpy(t + 2 * j, src, 2);           // d
        std::memcpy(t + 32 + 2 * j, src + 2, 2);  // m
        for (int p = 0; p < 4; ++p) std::memcpy(t + 64 + 64 * p + 4 * j, src + 4 + 4 * p, 4);
      } else {
        std::memcpy(t + 2 * j, src, 2);  // d
        for (int c = 0; c < 8; ++c) std::memcpy(t + 32 + 64 * c + 4 * j, src + 2 + 4 * c, 4);
      }
    }
  }
}

QuantizedWeight::~QuantizedWeight() = default;

void QuantizedWeight::repack_dense(const uint8_t* raw) {
  const int64_t nb = k_ / kQBlock, tb = tile_bytes(format_);
  const int64_t es = format_ == TileFormat::kF32 ? 4 : 2;  // bytes per element
  for (int64_t row = 0; row < n_; ++row) {
    const int64_t g = row / kQRows, j = row % kQRows;
    const uint8_t* src = raw + row * k_ * es;
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* t = tiles_.get() + (g * nb + b) * tb;
      for (int e = 0; e < kQBlock; ++e) std::memcpy(t + (e * kQRows + j) * es, src + (b * kQBlock + e) * es, es);
    }
  }
}

void QuantizedWeight::repack_decoded(const uint8_t* raw) {
  const int64_t nb = k_ / kQBlock, tb = tile_bytes(format_);
  const int64_t row_bytes = k_ / qtype_block_elements(qtype_) * qtype_block_bytes(qtype_);
  std::vector<int8_t> qs(static_cast<size_t>(k_));
  std::vector<float> d(static_cast<size_t>(k_ / 16)), m(static_cast<size_t>(k_ / 16));
  float sd = 0.f, sdmin = 0.f;
  uint8_t sc[8] = {}, mn[8] = {};
  for (int64_t row = 0; row < n_; ++row) {
    decode_row(qtype_, raw + row * row_bytes, k_, qs.data(), d.data(), m.data());
    const int64_t g = row / kQRows, j = row % kQRows;
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* t = tiles_.get() + (g * nb + b) * tb;
      // v(e): the unsigned quant of element e of this block (u4k 0..15, u5f 0..31, i6f q + 32 in 0..63); each
      // tile byte of row j is written once, whole (the tiles start zeroed only for the padding rows' sake)
      const int8_t* q = qs.data() + b * kQBlock;
      const auto v = [&](int e) { return static_cast<unsigned>(q[e] + (format_ == TileFormat::kI6F ? 32 : 0)); };
      const int nibbles = format_ == TileFormat::kU4K   ? kU4KNibbles
                          : format_ == TileFormat::kU5F ? k5FNibbles
                                                        : kI6FNibbles;
      for (int p = 0; p < 4; ++p) {  // q4_1's nibble order: element 4 p + c low, 16 + 4 p + c high
        for (int c = 0; c < 4; ++c) {
          t[nibbles + 64 * p + 4 * j + c] = static_cast<uint8_t>((v(4 * p + c) & 0x0Fu) | (v(16 + 4 * p + c) & 0x0Fu) << 4);
        }
      }
      if (format_ == TileFormat::kU4K) {  // Q4_K: its 6-bit scale and minimum; per 256 its d and -dmin
        if (b % 8 == 0) {
          q4_k_scales(raw + row * row_bytes + (b / 8) * qtype_block_bytes(qtype_), &sd, &sdmin, sc, mn);
          float* super = const_cast<float*>(u4k_super(tiles_.get(), n_, k_, g, b));
          super[j] = sd;
          super[kQRows + j] = -sdmin;
        }
        t[j] = sc[b % 8];
        t[kQRows + j] = mn[b % 8];
        continue;
      }
      if (format_ == TileFormat::kU5F) {  // one scale per 32 (both halves' are equal), bit 4 of each quant
        std::memcpy(t + 4 * j, &d[static_cast<size_t>(2 * b)], 4);
        std::memcpy(t + 64 + 4 * j, &m[static_cast<size_t>(2 * b)], 4);
        uint32_t high = 0;
        for (int e = 0; e < kQBlock; ++e) high |= (v(e) >> 4 & 1u) << e;
        std::memcpy(t + k5FHigh + 4 * j, &high, 4);
        continue;
      }
      // i6f: a scale per 16 elements; the 2-bit fields of elements 4 p + c and 16 + 4 p + c (p = 2 s, 2 s + 1)
      // in byte c of row j's dword of plane s, at bits 4 (p & 1) + 2 half (kernel_table.h)
      for (int h = 0; h < 2; ++h) {
        std::memcpy(t + 4 * (kQRows * h + j), &d[static_cast<size_t>(2 * b + h)], 4);
        if (m[static_cast<size_t>(2 * b + h)] != 0.f) {  // Q6_K, the one type held in i6f, has none
          throw KernelArgumentError(std::string(qtype_name(qtype_)) + ": i6f tiles hold no minimum");
        }
      }
      for (int plane = 0; plane < 2; ++plane) {
        for (int c = 0; c < 4; ++c) {
          unsigned byte = 0;
          for (int odd = 0; odd < 2; ++odd) {
            const int p = 2 * plane + odd;
            byte |= (v(4 * p + c) >> 4) << (4 * odd) | (v(16 + 4 * p + c) >> 4) << (4 * odd + 2);
          }
          t[kI6FHigh + 64 * plane + 4 * j + c] = static_cast<uint8_t>(byte);
        }
      }
    }
  }
}

void QuantizedWeight::dequantize_row(int64_t row, float* dst) const {
  const int64_t nb = k_ / kQBlock, tb = tile_bytes(format_);
  const int64_t g = row / kQRows, j = row % kQRows;
  for (int64_t b = 0; b < nb; ++b, dst += kQBlock) {
    const uint8_t* t = tiles_.get() + (g * nb + b) * tb;
    if (dense_format(format_)) {  // widened exactly
      for (int e = 0; e < kQBlock; ++e) {
        if (format_ == TileFormat::kF32) {
          std::memcpy(&dst[e], t + 4 * (e * kQRows + j), 4);
        } else {
          const uint16_t v = load_u16(t + 2 * (e * kQRows + j));
          dst[e] = format_ == TileFormat::kF16 ? half_to_float(v) : bf16_to_float(v);
        }
      }
      continue;
    }
    if (format_ == TileFormat::kU4K) {
      float d, m;
      u4k_scales(tiles_.get(), n_, k_, g, b, j, &d, &m);
      for (int e = 0; e < kQBlock; ++e) {  // both products exact (kernel_table.h)
        const uint8_t byte = t[kU4KNibbles + 64 * ((e & 15) >> 2) + 4 * j + (e & 3)];
        const float prod = d * static_cast<float>(e < 16 ? byte & 0x0F : byte >> 4);
        dst[e] = prod + m;  // two roundings, the first exact (gguf_types.h)
      }
      continue;
    }
    if (format_ == TileFormat::kU5F) {
      float d, m;
      uint32_t high = 0;
      std::memcpy(&d, t + 4 * j, 4);
      std::memcpy(&m, t + 64 + 4 * j, 4);
      std::memcpy(&high, t + k5FHigh + 4 * j, 4);
      for (int e = 0; e < kQBlock; ++e) {
        const uint8_t byte = t[k5FNibbles + 64 * ((e & 15) >> 2) + 4 * j + (e & 3)];
        const int v = (e < 16 ? byte & 0x0F : byte >> 4) | static_cast<int>((high >> e) & 1u) << 4;
        const float prod = d * static_cast<float>(v);
        dst[e] = prod + m;  // two roundings, the first exact (gguf_types.h)
      }
      continue;
    }
    if (format_ == TileFormat::kI6F) {
      for (int e = 0; e < kQBlock; ++e) {
        float d;
        std::memcpy(&d, t + 4 * (kQRows * (e / 16) + j), 4);
        dst[e] = d * static_cast<float>(i6f_quant(t, static_cast<int>(j), e));  // exact (gguf_types.h)
      }
      continue;
    }
    const float d = half_to_float(load_u16(t + 2 * j));
    if (format_ == TileFormat::kQ4_1) {
      const float m = half_to_float(load_u16(t + 32 + 2 * j));
      for (int p = 0; p < 4; ++p) {
        for (int e = 0; e < 4; ++e) {
          const uint8_t q = t[64 + 64 * p + 4 * j + e];
          const float lo = d * static_cast<float>(q & 0x0F), hi = d * static_cast<float>(q >> 4);
          dst[4 * p + e] = lo + m;  // two roundings (no FMA: -ffp-contract=off)
          dst[16 + 4 * p + e] = hi + m;
        }
      }
    } else {
      for (int c = 0; c < 8; ++c) {
        for (int e = 0; e < 4; ++e) {
          dst[4 * c + e] = d * static_cast<float>(static_cast<int8_t>(t[32 + 64 * c + 4 * j + e]));
        }
      }
    }
  }
}

void QuantizedWeight::dequantize(const TensorArg& out, int num_threads) const {
  if (out.dtype != DType::kFloat32 && out.dtype != DType::kBFloat16) {
    throw KernelArgumentError(out.name + " must be float32 or bfloat16, got " + dtype_name(out.dtype));
  }
  out.check_dim(2);
  out.check_shape({n_, k_});
  out.check_contiguous();
  check_num_threads(num_threads);
  const bool to_bf16 = out.dtype == DType::kBFloat16;
  // rows [r0, r1) of the output; float32 first (exact), then rounded to bfloat16 when asked
  const auto rows = [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(to_bf16 ? static_cast<size_t>(k_) : 0);
    for (int64_t row = r0; row < r1; ++row) {
      if (!to_bf16) {
        dequantize_row(row, out.ptr<float>() + row * k_);
        continue;
      }
      dequantize_row(row, buf.data());
      bf16* o = out.ptr<bf16>() + row * k_;
      for (int64_t e = 0; e < k_; ++e) o[e] = float_to_bf16(buf[static_cast<size_t>(e)]);
    }
  };
  const int64_t kRowsPerTask = 256;
  const int64_t tasks = (n_ + kRowsPerTask - 1) / kRowsPerTask;
  if (num_threads == 1 || tasks == 1) {
    rows(0, n_);
    return;
  }
  ThreadPool::get(num_threads)->run(tasks, [&](int64_t i, int) { rows(i * kRowsPerTask, std::min(n_, (i + 1) * kRowsPerTask)); });
}

void QuantizedWeight::embedding(const TensorArg& ids, const TensorArg& out) const {
  ids.check_dim(1);
  ids.check_dtype(DType::kInt64);
  ids.check_contiguous();
  out.check_dtype(DType::kFloat32);
  out.check_contiguous();
  out.check_shape({ids.size(0), k_});
  const int64_t* id = ids.ptr<const int64_t>();
  for (int64_t i = 0; i < ids.size(0); ++i) {
    if (id[i] < 0 || id[i] >= n_) {
      throw KernelArgumentError(ids.name + "[" + std::to_string(i) + "] = " + std::to_string(id[i]) +
                                " is outside [0, " + std::to_string(n_) + ")");
    }
  }
  for (int64_t i = 0; i < ids.size(0); ++i) dequantize_row(id[i], out.ptr<float>() + i * k_);
}

void QuantizedWeight::linear(const TensorArg& x, const TensorArg& out, const TensorArg* bias,
                             int num_threads) const {
  if (x.dtype != DType::kFloat32 && x.dtype != DType::kBFloat16) {
    throw KernelArgumentError(x.name + " must be float32 or bfloat16, got " + dtype_name(x.dtype));
  }
  const int64_t m = check_linear_args(x, out, bias, num_threads, n_, k_);
  if (m == 0) return;
  linear_raw(x.data, x.dtype, m, out.data, bias != nullptr ? bias->ptr<float>() : nullptr, num_threads,
             active_isa().gemm());
}

void QuantizedWeight::linear_raw(const void* x, DType dtype, int64_t m, void* out, const float* bias,
                                 int num_threads, const QuantKernelTable& kernels) const {
  if (!integer_ok_) {
    throw KernelArgumentError(std::string("linear (int8 activations) cannot run this ") + qtype_name(qtype_) +
                              " weight: its tiles hold unquantised values, which the integer kernels do not "
                              "take; use linear_f32");
  }
  if (m <= 0) return;
  const int64_t nb = k_ / kQBlock, groups = (n_ + kQRows - 1) / kQRows;
  // the calling thread's buffers, named through a local reference: the pool's
  // workers must see these, not their own thread_local instances
  thread_local Scratch tls;
  Scratch& s = tls;
  s.xq.resize(static_cast<size_t>(m * k_));
  s.xd.resize(static_cast<size_t>(m * nb));
  s.xs.resize(static_cast<size_t>(m * nb));
  s.xsum128.resize(static_cast<size_t>(m * nb));

  const int64_t passes = groups * nb * ((m + 3) / 4);
  std::shared_ptr<ThreadPool> pool;
  if (num_threads > 1 && passes >= kInlineTilePasses) pool = ThreadPool::get(num_threads);

  QuantGemmArgs a{};
  a.format = format_;
  a.w = tiles_.get();
  a.n = n_;
  a.k = k_;
  a.m = m;
  a.x = QuantActivations{s.xq.data(), s.xd.data(), s.xsum128.data(), s.xs.data()};
  a.bias = bias;
  a.out = out;
  a.out_dtype = dtype;
  const auto quantize = [&](int64_t r0, int64_t r1) {
    kernels.quantize_rows(x, dtype, k_, m, r0, r1, s.xq.data(), s.xd.data(), s.xsum128.data(), s.xs.data());
  };
  if (!pool) {
    quantize(0, m);
    kernels.gemm(a, 0, groups, 0, m);
    return;
  }
  // One pool run: first the activation quantisation in row chunks (about two
  // per thread, at least kMinQuantRows rows; fewer rows are quantised here
  // before the run), then the GEMM items, each waiting until every chunk is
  // quantised. The pool hands items out in index order, so every chunk is
  // claimed by a running thread before any GEMM item waits: one hand-off and
  // barrier per call instead of two.
  constexpr int64_t kMinQuantRows = 4;
  constexpr int kSpinsBeforeYield = 1 << 12;  // pause instructions: ~10-150 us
  const int64_t threads = pool->num_threads();
  const int64_t q_rows = std::max(kMinQuantRows, (m + 2 * threads - 1) / (2 * threads));
  const int64_t q_items = m >= 2 * kMinQuantRows ? (m + q_rows - 1) / q_rows : 0;
  if (q_items == 0) quantize(0, m);
  std::atomic<int64_t> quantized{0};
  // About kItemsPerThread items per thread for the pool's dynamic scheduling to
  // even out (a busy core, a slow tail), the row groups split into near-equal
  // ranges (sizes differ by at most one group; ceil-sized chunks cut a 36-group
  // layer into 7 items of 5 and one of 1, which two threads can only split 20 : 16).
  constexpr int64_t kItemsPerThread = 8;
  const int64_t m_chunk = m <= kRowsPerItem ? m : kRowsPerItem;
  const int64_t m_items = (m + m_chunk - 1) / m_chunk;
  const int64_t target = kItemsPerThread * threads;
  const int64_t g_items = std::min(groups, std::max<int64_t>(1, (target + m_items - 1) / m_items));
  pool->run(q_items + g_items * m_items, [&](int64_t i, int) {
    if (i < q_items) {
      quantize(i * q_rows, std::min(m, (i + 1) * q_rows));
      quantized.fetch_add(1, std::memory_order_release);
      return;
    }
    // the chunks in flight take microseconds; yield after a while in case their
    // thread is not running (more threads than free cores)
    for (int spins = 0; quantized.load(std::memory_order_acquire) < q_items; ++spins) {
      if (spins < kSpinsBeforeYield) {
        PAGEDSERVE_CPU_RELAX();
      } else {
        std::this_thread::yield();
      }
    }
    i -= q_items;
    const int64_t gi = i % g_items, mi = i / g_items;
    kernels.gemm(a, gi * groups / g_items, (gi + 1) * groups / g_items, mi * m_chunk,
                 std::min(m, (mi + 1) * m_chunk));
  });
}

void QuantizedWeight::linear_f32(const TensorArg& x, const TensorArg& out, const TensorArg* bias,
                                 int num_threads) const {
  if (x.dtype != DType::kBFloat16) x.check_dtype(DType::kFloat32);
  const int64_t m = check_linear_args(x, out, bias, num_threads, n_, k_);
  if (m == 0) return;
  const float* b = bias != nullptr ? bias->ptr<float>() : nullptr;
  if (x.dtype == DType::kFloat32) {
    linear_f32_parts({this}, x.ptr<float>(), m, out.ptr<float>(), n_, b, num_threads, active_isa().gemm());
    return;
  }
  // bfloat16: widened exactly into float32 rows, the float32 results rounded once (to nearest even, as
  // torch's conversion), on our own pool: O(M (K + N)) beside the GEMM's O(M N K), and no library call
  // (torch's parallel conversion leaves OpenMP threads spinning on the cores the pool needs:
  // docs/benchmarks.md, "Behind the code")
  thread_local std::vector<float> xf, of;
  xf.resize(static_cast<size_t>(m * k_));
  of.resize(static_cast<size_t>(m * n_));
  const bf16* xb = x.ptr<bf16>();
  float* xw = xf.data();
  for_rows(m, k_, num_threads, [&](int64_t r0, int64_t r1) {  // the fused elementwise ops' split
    for (int64_t i = r0 * k_; i < r1 * k_; ++i) xw[i] = bf16_to_float(xb[i]);
  });
  linear_f32_parts({this}, xw, m, of.data(), n_, b, num_threads, active_isa().gemm());
  bf16* ob = out.ptr<bf16>();
  const float* ow = of.data();
  for_rows(m, n_, num_threads, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0 * n_; i < r1 * n_; ++i) ob[i] = float_to_bf16(ow[i]);
  });
}

void QuantizedWeight::linear_f32_parts(const std::vector<const QuantizedWeight*>& parts, const float* x, int64_t m,
                                       float* out, int64_t ldo, const float* bias, int num_threads,
                                       const QuantKernelTable& kernels) {
  check_num_threads(num_threads);
  if (m <= 0 || parts.empty()) return;
  struct Part {
    QuantF32GemmArgs a;
    int64_t groups, units;
  };
  std::vector<Part> ps;
  ps.reserve(parts.size());
  int64_t col = 0, macs = 0, total_units = 0;
  const int64_t k = parts.front()->k_;
  // Row groups per unit of work: the AVX-512 kernel's tile spans two groups for one row tile, three when
  // several row tiles share the expanded weights
  const int64_t unit = m > kF32Rows ? 3 : 2;
  for (const QuantizedWeight* w : parts) {
    Part p{};
    p.a = w->f32_args(x, m, out + col, ldo, bias != nullptr ? bias + col : nullptr);
    p.groups = (w->n_ + kQRows - 1) / kQRows;
    p.units = (p.groups + unit - 1) / unit;
    ps.push_back(p);
    col += w->n_;
    macs += m * w->n_ * k;
    total_units += p.units;
  }
  const int64_t scratch_floats = k * 3 * kQRows;  // gemm_f32's scratch: three row groups' expanded weights
  thread_local F32Scratch tls;
  const int64_t inline_macs = ThreadPool::spin_micros() > 0 ? kInlineF32MacsSpinning : kInlineF32Macs;
  if (num_threads == 1 || macs < inline_macs) {
    for (const Part& p : ps) kernels.gemm_f32(p.a, 0, p.groups, 0, m, tls.aligned_w(scratch_floats));
    return;
  }
  std::shared_ptr<ThreadPool> pool = ThreadPool::get(num_threads);
  // Items as in linear_raw, over the parts together: N cut into near-equal
  // ranges of units (above), each part's in proportion to its share of the
  // units, M into chunks of whole row tiles; up to 16 items per thread in all,
  // so a layer of a few dozen units (576 -> 576 at one row tile: 18 pairs)
  // runs one unit per item and the dynamic scheduling evens the threads out.
  constexpr int64_t kItemsPerThread = 16;
  const int64_t target = kItemsPerThread * pool->num_threads();
  const int64_t m_chunk = m <= 2 * kF32RowsPerItem ? m : kF32RowsPerItem;
  const int64_t m_items = (m + m_chunk - 1) / m_chunk;
  struct Item {
    int part;
    int64_t g0, g1;
  };
  std::vector<Item> items;
  for (size_t pi = 0; pi < ps.size(); ++pi) {
    const Part& p = ps[pi];
    const int64_t share = std::max<int64_t>(1, (target * p.units + total_units * m_items - 1) / (total_units * m_items));
    const int64_t g_items = std::min(p.units, share);
    for (int64_t gi = 0; gi < g_items; ++gi) {
      items.push_back({static_cast<int>(pi), unit * (gi * p.units / g_items),
                       std::min(p.groups, unit * ((gi + 1) * p.units / g_items))});
    }
  }
  const int64_t n_items = static_cast<int64_t>(items.size());
  pool->run(n_items * m_items, [&](int64_t i, int) {
    thread_local F32Scratch worker;
    const Item& it = items[static_cast<size_t>(i % n_items)];
    const int64_t mi = i / n_items;
    kernels.gemm_f32(ps[static_cast<size_t>(it.part)].a, it.g0, it.g1, mi * m_chunk, std::min(m, (mi + 1) * m_chunk),
                     worker.aligned_w(scratch_floats));
  });
}

}  // namespace cpu
}  // namespace pagedserve

namespace pagedserve {
namespace cpu {

QuantF32GemmArgs QuantizedWeight::f32_args(const float* x, int64_t m, float* out, int64_t ldo,
                                           const float* bias) const {
  QuantF32GemmArgs a{};
  a.format = format_;
  a.w = tiles_.get();
  a.n = n_;
  a.k = k_;
  a.m = m;
  a.x = x;
  a.bias = bias;
  a.out = out;
  a.ldo = ldo;
  return a;
}

void QuantizedWeight::linear_f32_groups(const float* x, int64_t m, float* out, const std::vector<int64_t>& items,
                                        int num_threads, const QuantKernelTable& kernels) const {
  check_num_threads(num_threads);
  if (m <= 0 || items.empty()) return;
  const int64_t groups = (n_ + kQRows - 1) / kQRows, scratch_floats = k_ * 3 * kQRows;
  const int64_t count = static_cast<int64_t>(items.size());
  // one row x one row group per item: gemm_f32's single-row path, the same sums as any other row tile's
  const auto run = [&](int64_t i0, int64_t i1, float* scratch) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = items[static_cast<size_t>(i)] / groups, g = items[static_cast<size_t>(i)] % groups;
      // row r alone (a variant may compute a whole row tile from m0 on)
      kernels.gemm_f32(f32_args(x + r * k_, 1, out + r * n_, n_, nullptr), g, g + 1, 0, 1, scratch);
    }
  };
  constexpr int64_t kItemsPerTask = 16;
  const int64_t tasks = (count + kItemsPerTask - 1) / kItemsPerTask;
  if (num_threads == 1 || tasks == 1) {
    thread_local F32Scratch tls;
    run(0, count, tls.aligned_w(scratch_floats));
    return;
  }
  ThreadPool::get(num_threads)->run(tasks, [&](int64_t t, int) {
    thread_local F32Scratch worker;
    run(t * kItemsPerTask, std::min(count, (t + 1) * kItemsPerTask), worker.aligned_w(scratch_floats));
  });
}

const float* QuantizedWeight::row_norms(int num_threads) const {
  check_num_threads(num_threads);
  std::call_once(norms_once_, [&] {
    std::vector<float> norms(static_cast<size_t>(n_));
    std::vector<uint8_t> finite(static_cast<size_t>(n_), 1);
    const auto rows = [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(static_cast<size_t>(k_));
      for (int64_t row = r0; row < r1; ++row) {
        dequantize_row(row, buf.data());
        double t = 0.0;  // squares exact in double; the sum's relative error below K 2^-53: the factor covers it
        for (float v : buf) t += static_cast<double>(v) * static_cast<double>(v);
        t = std::sqrt(t) * (1.0 + 0x1p-30);
        if (!(t <= 3.0e38)) {
          finite[static_cast<size_t>(row)] = 0;
          continue;
        }
        float f = static_cast<float>(t);
        if (static_cast<double>(f) < t) f = std::nextafter(f, INFINITY);
        norms[static_cast<size_t>(row)] = f;
      }
    };
    const int64_t kRowsPerTask = 1024, tasks = (n_ + kRowsPerTask - 1) / kRowsPerTask;
    if (num_threads == 1 || tasks == 1) {
      rows(0, n_);
    } else {
      ThreadPool::get(num_threads)->run(tasks, [&](int64_t i, int) {
        rows(i * kRowsPerTask, std::min(n_, (i + 1) * kRowsPerTask));
      });
    }
    norms_finite_ = std::all_of(finite.begin(), finite.end(), [](uint8_t f) { return f != 0; });
    norms_ = std::move(norms);
  });
  return norms_finite_ ? norms_.data() : nullptr;
}

}  // namespace cpu
}  // namespace pagedserve
