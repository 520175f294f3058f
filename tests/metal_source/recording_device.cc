#include "recording_device.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <new>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "pagedserve_args.h"

namespace pagedserve {
namespace metal {
namespace testing {

namespace pm = pagedserve_metal;

HostBuffer::HostBuffer(size_t bytes) : DeviceBuffer(bytes), size_(bytes) {
  const size_t page = 4096, rounded = (bytes + page - 1) / page * page;
  if (posix_memalign(&data_, page, rounded) != 0) throw std::bad_alloc();
  std::memset(data_, 0, rounded);
}

HostBuffer::~HostBuffer() { std::free(data_); }

DeviceInfo RecordingDevice::info() const {
  DeviceInfo i;
  i.name = "recording device (host memory, CPU executor of the kernel contract)";
  i.library = library;
  i.max_buffer_length = max_buffer_length;
  i.unified_memory = true;
  return i;
}

std::shared_ptr<DeviceBuffer> RecordingDevice::new_shared_buffer(size_t bytes) {
  if (bytes == 0 || bytes > max_buffer_length) {
    throw std::runtime_error("cannot allocate a shared Metal buffer of " + std::to_string(bytes) + " bytes");
  }
  ++allocations;
  return std::make_shared<HostBuffer>(bytes);
}

namespace {

// float16 <-> float, rounding to nearest even (portable: no _Float16).
float half_to_float(uint16_t h) {
  const float sign = (h & 0x8000u) ? -1.f : 1.f;
  const int exp = (h >> 10) & 0x1f;
  const int mant = h & 0x3ff;
  if (exp == 0) return sign * std::ldexp(static_cast<float>(mant), -24);
  if (exp == 31) return mant ? std::numeric_limits<float>::quiet_NaN() : sign * std::numeric_limits<float>::infinity();
  return sign * std::ldexp(static_cast<float>(mant + 1024), exp - 25);
}

uint16_t float_to_half(float f) {
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const float a = std::fabs(f);
  if (std::isnan(f)) return sign | 0x7e00;
  if (a >= 65520.f) return sign | 0x7c00;
  if (a < 6.103515625e-05f) return sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.f));  // subnormal
  int e = 0;
  const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  uint32_t q = static_cast<uint32_t>(std::nearbyint(std::ldexp(m, 11)));  // 1024..2048
  int exp = e - 1;
  if (q == 2048) {
    q = 1024;
    ++exp;
  }
  if (exp > 15) return sign | 0x7c00;
  return sign | static_cast<uint16_t>(((exp + 15) << 10) | (q - 1024));
}

// float <-> the kernels' element types (bfloat16 and float16: round to nearest even).
float load(const void* p, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat32: return static_cast<const float*>(p)[i];
    case DType::kBFloat16: {
      const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
    case DType::kFloat16: return half_to_float(static_cast<const uint16_t*>(p)[i]);
    default: throw std::logic_error("not a float dtype");
  }
}

void store(void* p, DType dtype, int64_t i, float f) {
  switch (dtype) {
    case DType::kFloat32: static_cast<float*>(p)[i] = f; return;
    case DType::kBFloat16: {
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      bits += 0x7fffu + ((bits >> 16) & 1u);
      static_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(bits >> 16);
      return;
    }
    case DType::kFloat16: static_cast<uint16_t*>(p)[i] = float_to_half(f); return;
    default: throw std::logic_error("not a float dtype");
  }
}

struct View {
  const Dispatch& d;
  const char* kernel;

  unsigned char* at(int index) const {
    const BufferBinding& b = d.buffers[index];
    return static_cast<unsigned char*>(b.buffer->contents()) + b.offset;
  }
  // Checks that binding `index` holds `bytes` from its offset, aligned to `align`.
  void need(int index, size_t bytes, size_t align) const {
    if (index >= d.num_buffers || d.buffers[index].buffer == nullptr) {
      throw std::logic_error(std::string(kernel) + ": buffer " + std::to_string(index) + " is not bound");
    }
    const BufferBinding& b = d.buffers[index];
    if (b.offset % align != 0) {
      throw std::logic_error(std::string(kernel) + ": buffer " + std::to_string(index) + " offset " +
                             std::to_string(b.offset) + " is not a multiple of " + std::to_string(align));
    }
    if (b.offset > b.buffer->size() || bytes > b.buffer->size() - b.offset) {
      throw std::logic_error(std::string(kernel) + ": buffer " + std::to_string(index) + " holds " +
                             std::to_string(b.buffer->size() - std::min(b.offset, b.buffer->size())) +
                             " bytes from its offset, the kernel reaches " + std::to_string(bytes));
    }
  }
  void grid(uint32_t x, uint32_t y, uint32_t z, uint32_t threads) const {
    const MetalLaunch& l = d.launch;
    if (l.threadgroups[0] != x || l.threadgroups[1] != y || l.threadgroups[2] != z ||
        l.threads_per_threadgroup != threads) {
      throw std::logic_error(std::string(kernel) + ": launch (" + std::to_string(l.threadgroups[0]) + ", " +
                             std::to_string(l.threadgroups[1]) + ", " + std::to_string(l.threadgroups[2]) + ") x " +
                             std::to_string(l.threads_per_threadgroup) + " differs from the contract's (" +
                             std::to_string(x) + ", " + std::to_string(y) + ", " + std::to_string(z) + ") x " +
                             std::to_string(threads));
    }
  }
};

size_t extent(int64_t rows, int64_t row_stride, int64_t heads, int64_t head_stride, int64_t d, size_t elem) {
  if (rows == 0) return 0;
  return static_cast<size_t>((rows - 1) * row_stride + (heads - 1) * head_stride + d) * elem;
}

// Attention of one query over keys [lo, hi) of a sequence: (unnormalised max m,
// sum l, normalised output o). Empty range: m = -inf, l = 0, o = 0.
void attend(const float* q, const pm::PagedAttentionArgs& a, const void* kc, const void* vc, DType dt,
            const int32_t* table, int kv_head, int64_t lo, int64_t hi, float* m_out, float* l_out, float* o) {
  const int D = a.head_size, bs = a.block_size, hkv = a.num_kv_heads;
  std::vector<float> scores;
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t k = lo; k < hi; ++k) {
    const int64_t base = ((static_cast<int64_t>(table[k / bs]) * hkv + kv_head) * bs + k % bs) * D;
    float s = 0.f;
    for (int i = 0; i < D; ++i) s += q[i] * load(kc, dt, base + i);
    s *= a.scale;
    scores.push_back(s);
    m = std::max(m, s);
  }
  float l = 0.f;
  for (int i = 0; i < D; ++i) o[i] = 0.f;
  for (int64_t k = lo; k < hi; ++k) {
    const float p = std::exp(scores[k - lo] - m);
    l += p;
    const int64_t base = ((static_cast<int64_t>(table[k / bs]) * hkv + kv_head) * bs + k % bs) * D;
    for (int i = 0; i < D; ++i) o[i] += p * load(vc, dt, base + i);
  }
  if (l > 0.f) {
    for (int i = 0; i < D; ++i) o[i] /= l;
  }
  *m_out = m;
  *l_out = l;
}

// The query heads of KV-head tile y (pagedserve_args.h): hk * group + t * heads_per_threadgroup + j.
std::vector<int> tile_heads(const pm::PagedAttentionArgs& a, uint32_t y, int* kv_head) {
  const int group = a.num_heads / a.num_kv_heads;
  *kv_head = static_cast<int>(y) / a.head_tiles;
  const int t = static_cast<int>(y) % a.head_tiles;
  std::vector<int> heads;
  for (int j = 0; j < a.heads_per_threadgroup; ++j) {
    const int in_group = t * a.heads_per_threadgroup + j;
    if (in_group < group) heads.push_back(*kv_head * group + in_group);
  }
  return heads;
}

void reshape_and_cache(const View& v, bool execute) {
  pm::ReshapeAndCacheArgs a;
  std::memcpy(&a, v.d.args, sizeof(a));
  if (v.d.args_size != sizeof(a)) throw std::logic_error("reshape_and_cache: args size");
  const size_t elem = v.d.pipeline.dtype == DType::kFloat32 ? 4 : 2;
  v.grid(static_cast<uint32_t>(a.num_tokens), static_cast<uint32_t>(a.num_kv_heads), 1, pm::kReshapeThreads);
  v.need(1, extent(a.num_tokens, a.key_token_stride, a.num_kv_heads, a.key_head_stride, a.head_size, elem), elem);
  v.need(2, extent(a.num_tokens, a.value_token_stride, a.num_kv_heads, a.value_head_stride, a.head_size, elem), elem);
  const size_t cache = static_cast<size_t>(a.num_blocks) * a.num_kv_heads * a.block_size * a.head_size * elem;
  v.need(3, cache, elem);
  v.need(4, cache, elem);
  v.need(5, static_cast<size_t>(a.num_tokens) * 8, 8);
  if (!execute) return;
  const DType dt = v.d.pipeline.dtype;
  const void* key = v.at(1);
  const void* value = v.at(2);
  void* kc = v.at(3);
  void* vc = v.at(4);
  const auto* slots = reinterpret_cast<const int64_t*>(v.at(5));
  for (int t = 0; t < a.num_tokens; ++t) {
    if (slots[t] < 0) continue;
    const int64_t block = slots[t] / a.block_size, off = slots[t] % a.block_size;
    for (int h = 0; h < a.num_kv_heads; ++h) {
      const int64_t dst = ((block * a.num_kv_heads + h) * a.block_size + off) * a.head_size;
      for (int i = 0; i < a.head_size; ++i) {
        store(kc, dt, dst + i, load(key, dt, t * a.key_token_stride + h * a.key_head_stride + i));
        store(vc, dt, dst + i, load(value, dt, t * a.value_token_stride + h * a.value_head_stride + i));
      }
    }
  }
}

void attention(const View& v, MetalKernel kernel, bool execute) {
  pm::PagedAttentionArgs a;
  if (v.d.args_size != sizeof(a)) throw std::logic_error(std::string(v.kernel) + ": args size");
  std::memcpy(&a, v.d.args, sizeof(a));
  const size_t elem = v.d.pipeline.dtype == DType::kFloat32 ? 4 : 2;
  if (v.d.pipeline.head_size != a.head_size || v.d.pipeline.block_size != a.block_size) {
    throw std::logic_error(std::string(v.kernel) + ": function constants differ from the arguments");
  }
  const bool merge = kernel == MetalKernel::kPagedAttentionMerge;
  const bool decode = kernel == MetalKernel::kPagedAttentionDecode;
  const int qsl_at = merge ? 4 : 6, lens_at = merge ? 3 : 5, work_at = merge ? 5 : 7, out_at = merge ? 6 : 8;
  v.need(qsl_at, static_cast<size_t>(a.num_seqs + 1) * 4, 4);
  v.need(lens_at, static_cast<size_t>(a.num_seqs) * 4, 4);
  const auto* qsl = reinterpret_cast<const int32_t*>(v.at(qsl_at));
  const auto* lens = reinterpret_cast<const int32_t*>(v.at(lens_at));
  const int64_t tokens = qsl[a.num_seqs];
  const int items = a.num_work_items;
  v.need(work_at, static_cast<size_t>(items) * (kernel == MetalKernel::kPagedAttentionPrefill ? 8 : 4), 4);
  const auto* work = reinterpret_cast<const int32_t*>(v.at(work_at));
  v.need(out_at, extent(tokens, a.out_token_stride, a.num_heads, a.out_head_stride, a.head_size, elem), elem);
  const size_t partials = static_cast<size_t>(items) * a.num_heads * a.max_partitions;
  if (merge || (decode && a.partition_size > 0)) {
    v.need(merge ? 1 : 9, partials * a.head_size * 4, 4);
    v.need(merge ? 2 : 10, partials * 4, 4);
  }
  const uint32_t kv_tiles = static_cast<uint32_t>(a.num_kv_heads * a.head_tiles);
  if (merge) {
    v.grid(static_cast<uint32_t>(items), static_cast<uint32_t>(a.num_heads), 1, pm::kSimdWidth);
  } else {
    v.need(1, extent(tokens, a.query_token_stride, a.num_heads, a.query_head_stride, a.head_size, elem), elem);
    const size_t cache = static_cast<size_t>(a.num_blocks) * a.num_kv_heads * a.block_size * a.head_size * elem;
    v.need(2, cache, elem);
    v.need(3, cache, elem);
    v.need(4, static_cast<size_t>(a.num_seqs) * a.max_blocks_per_seq * 4, 4);
    v.grid(static_cast<uint32_t>(items), kv_tiles, decode ? static_cast<uint32_t>(a.max_partitions) : 1,
           (decode ? pm::kDecodeSimdGroups : pm::kPrefillSimdGroups) * pm::kSimdWidth);
  }
  if (!execute) return;

  const DType dt = v.d.pipeline.dtype;
  void* out = v.at(out_at);
  const int D = a.head_size;
  if (merge) {
    const auto* po = reinterpret_cast<const float*>(v.at(1));
    const auto* lse = reinterpret_cast<const float*>(v.at(2));
    for (int i = 0; i < items; ++i) {
      const int seq = work[i];
      const int parts = (lens[seq] + a.partition_size - 1) / a.partition_size;
      for (int h = 0; h < a.num_heads; ++h) {
        const size_t row = (static_cast<size_t>(i) * a.num_heads + h) * a.max_partitions;
        float m = -std::numeric_limits<float>::infinity();
        for (int p = 0; p < parts; ++p) m = std::max(m, lse[row + p]);
        float total = 0.f;
        std::vector<float> o(D, 0.f);
        for (int p = 0; p < parts; ++p) {
          const float w = std::exp(lse[row + p] - m);
          total += w;
          for (int k = 0; k < D; ++k) o[k] += w * po[(row + p) * D + k];
        }
        const int64_t dst = static_cast<int64_t>(qsl[seq]) * a.out_token_stride + h * a.out_head_stride;
        for (int k = 0; k < D; ++k) store(out, dt, dst + k, total > 0.f ? o[k] / total : 0.f);
      }
    }
    return;
  }
  const void* query = v.at(1);
  const void* kc = v.at(2);
  const void* vc = v.at(3);
  const auto* tables = reinterpret_cast<const int32_t*>(v.at(4));
  std::vector<float> o(D), q(D);
  const auto load_query = [&](int64_t token, int h) {
    for (int k = 0; k < D; ++k) q[k] = load(query, dt, token * a.query_token_stride + h * a.query_head_stride + k);
  };
  const auto store_out = [&](int64_t token, int h) {
    for (int k = 0; k < D; ++k) store(out, dt, token * a.out_token_stride + h * a.out_head_stride + k, o[k]);
  };
  for (int i = 0; i < items; ++i) {
    for (uint32_t y = 0; y < kv_tiles; ++y) {
      int kv_head = 0;
      const std::vector<int> heads = tile_heads(a, y, &kv_head);
      if (decode) {
        const int seq = work[i];
        const int64_t n = lens[seq], token = qsl[seq];
        const int32_t* table = tables + static_cast<int64_t>(seq) * a.max_blocks_per_seq;
        for (int p = 0; p < a.max_partitions; ++p) {
          const int64_t lo = a.partition_size ? static_cast<int64_t>(p) * a.partition_size : 0;
          const int64_t hi = a.partition_size ? std::min<int64_t>(lo + a.partition_size, n) : n;
          for (int h : heads) {
            load_query(token, h);
            float m = 0.f, l = 0.f;
            attend(q.data(), a, kc, vc, dt, table, kv_head, lo, std::max(lo, hi), &m, &l, o.data());
            if (a.partition_size == 0) {
              store_out(token, h);
            } else {
              auto* po = reinterpret_cast<float*>(v.at(9));
              auto* lse = reinterpret_cast<float*>(v.at(10));
              const size_t at = (static_cast<size_t>(i) * a.num_heads + h) * a.max_partitions + p;
              std::copy(o.begin(), o.end(), po + at * D);
              lse[at] = l > 0.f ? m + std::log(l) : -std::numeric_limits<float>::infinity();
            }
          }
        }
      } else {
        const int seq = work[2 * i], first = work[2 * i + 1];
        const int64_t n = lens[seq], q_len = qsl[seq + 1] - qsl[seq];
        const int32_t* table = tables + static_cast<int64_t>(seq) * a.max_blocks_per_seq;
        for (int s = 0; s < pm::kPrefillSimdGroups; ++s) {
          const int64_t qi = first + s;
          if (qi >= q_len) continue;
          const int64_t token = qsl[seq] + qi, pos = n - q_len + qi;
          const int64_t hi = a.causal ? pos + 1 : n;
          for (int h : heads) {
            load_query(token, h);
            float m = 0.f, l = 0.f;
            attend(q.data(), a, kc, vc, dt, table, kv_head, 0, hi, &m, &l, o.data());
            store_out(token, h);
          }
        }
      }
    }
  }
}

}  // namespace

double RecordingDevice::run(const Dispatch* dispatches, size_t count) {
  if (record) command_buffers.emplace_back(dispatches, dispatches + count);
  for (size_t i = 0; i < count; ++i) {
    const Dispatch& d = dispatches[i];
    if (d.launch.empty()) continue;
    const View v{d, metal_kernel_name(d.pipeline.kernel)};
    if (d.pipeline.kernel == MetalKernel::kReshapeAndCache) {
      reshape_and_cache(v, execute);
    } else {
      attention(v, d.pipeline.kernel, execute);
    }
  }
  return 1e-6 * static_cast<double>(count);
}

}  // namespace testing
}  // namespace metal
}  // namespace pagedserve
