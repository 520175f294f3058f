#include "attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "errors.h"
#include "thread_pool.h"

// The hot loops are plain C++ with `omp simd` hints; the compiler vectorises
// them for the ISA this file is built for (CMake: PAGEDSERVE_NATIVE_ARCH builds
// it with -march=native, e.g. AVX-512 here, NEON on arm64; off -> the
// portable baseline). Compile-time block_size / head_dim variants keep scores
// and accumulators in registers.

namespace pagedserve {
namespace {

using bf16 = uint16_t;

inline float bf16_to_float(bf16 x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline bf16 float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if (std::isnan(f)) return 0x7FC0;
  bits += 0x7FFF + ((bits >> 16) & 1);  // round to nearest even
  return static_cast<bf16>(bits >> 16);
}

inline void load(const float* src, float* dst, int n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void load(const bf16* src, float* dst, int n) {
  for (int i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
}
inline void store(const float* src, float* dst, int n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store(const float* src, bf16* dst, int n) {
  for (int i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
}

// s[t] = q . k_t for t < n, from a transposed key block kt[i * bs + t]
// (generic path): vector FMAs across the keys, no horizontal sums.
void block_scores(const float* q, const float* kt, int n, int d, int bs, float* s) {
  for (int t = 0; t < n; ++t) s[t] = 0.f;
  for (int i = 0; i < d; ++i) {
    const float qi = q[i];
    const float* row = kt + static_cast<ptrdiff_t>(i) * bs;
#pragma omp simd
    for (int t = 0; t < n; ++t) s[t] += qi * row[t];
  }
}

// max_t s[t] (s non-empty).
float block_max(const float* s, int n) {
  float m = s[0];
#pragma omp simd reduction(max : m)
  for (int t = 1; t < n; ++t) m = s[t] > m ? s[t] : m;
  return m;
}

// s[t] = exp(s[t] - m) for t < n (all s[t] <= m, finite); returns the sum.
// exp by range reduction to r in [-ln2/2, ln2/2] and a degree-6 polynomial
// (Cephes expf; relative error ~2e-7), written so the loop vectorises.
float block_exp(float* s, int n, float m) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int t = 0; t < n; ++t) {
    float x = s[t] - m;
    x = x < -87.0f ? -87.0f : x;
    const float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln2)
    const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    s[t] = p * scale;
    sum += s[t];
  }
  return sum;
}

// acc = acc * alpha + sum_t p[t] * v[t]
void block_accumulate(float* acc, float alpha, const float* p, const float* v, int n, int d) {
#pragma omp simd
  for (int i = 0; i < d; ++i) acc[i] *= alpha;
  for (int t = 0; t < n; ++t) {
    const float pt = p[t];
    const float* vt = v + static_cast<ptrdiff_t>(t) * d;
#pragma omp simd
    for (int i = 0; i < d; ++i) acc[i] += pt * vt[i];
  }
}

// The online-softmax update for one row over a block's n scores: turns s into
// exp(s - m_new), updates the running max m and sum l, returns the factor
// alpha = exp(m_old - m_new) the accumulator must be scaled by (0 on the first block).
inline float online_softmax_step(float* s, int n, float* m, float* l) {
  const float m_new = std::max(*m, block_max(s, n));
  const float alpha = std::isinf(*m) ? 0.f : std::exp(*m - m_new);
  *l = *l * alpha + block_exp(s, n, m_new);
  *m = m_new;
  return alpha;
}

// One (query row, KV block) step of the online softmax: scores of the row's
// query against the block's n visible keys (transposed: kt[i * BS + t]),
// running max m and sum l, accumulator acc[D] = acc * alpha + p . V.
// Compile-time BS and D keep the scores and the accumulator in registers.
template <int BS, int D>
inline void row_block_fixed(const float* q, const float* kt, const float* v, int n, float* m, float* l,
                            float* acc) {
  float s[BS];  // all BS lanes computed (finite cache contents), the first n used
#pragma omp simd
  for (int t = 0; t < BS; ++t) s[t] = 0.f;
  for (int i = 0; i < D; ++i) {
    const float qi = q[i];
#pragma omp simd
    for (int t = 0; t < BS; ++t) s[t] += qi * kt[i * BS + t];
  }
  const float alpha = online_softmax_step(s, n, m, l);
  float a[D];
#pragma omp simd
  for (int i = 0; i < D; ++i) a[i] = acc[i] * alpha;
  for (int t = 0; t < n; ++t) {
    const float pt = s[t];
#pragma omp simd
    for (int i = 0; i < D; ++i) a[i] += pt * v[t * D + i];
  }
#pragma omp simd
  for (int i = 0; i < D; ++i) acc[i] = a[i];
}

using RowBlockFn = void (*)(const float*, const float*, const float*, int, float*, float*, float*);

#define PS_ROW_BLOCK(BS, D)                                                                         \
  void row_block_##BS##_##D(const float* q, const float* kt, const float* v, int n, \
                            float* m, float* l, float* acc) {                                   \
    row_block_fixed<BS, D>(q, kt, v, n, m, l, acc);                                             \
  }
PS_ROW_BLOCK(16, 64)
PS_ROW_BLOCK(16, 128)
PS_ROW_BLOCK(32, 64)
PS_ROW_BLOCK(32, 128)
#undef PS_ROW_BLOCK

// The specialised step for (block_size, head_dim), or nullptr (generic path).
RowBlockFn fixed_row_block(int64_t bs, int64_t d) {
  if (bs == 16 && d == 64) return row_block_16_64;
  if (bs == 16 && d == 128) return row_block_16_128;
  if (bs == 32 && d == 64) return row_block_32_64;
  if (bs == 32 && d == 128) return row_block_32_128;
  return nullptr;
}

// Asks the cache hierarchy for n elements starting at p (one hint per 64-byte line).
template <typename T>
inline void prefetch_block(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(c + off);
}

struct Geometry {
  int64_t num_tokens, num_heads, num_kv_heads, head_dim, num_blocks, block_size;
  int64_t num_seqs, max_blocks;
  int64_t group() const { return num_heads / num_kv_heads; }
};

// One unit of work: sequence b, KV head hk, query tokens [q0, q1) of that
// sequence (relative), KV blocks [j0, j1). split >= 0 marks a partial result.
struct WorkItem {
  int32_t b, hk, q0, q1, j0, j1, split;
};

struct Partial {  // online-softmax state of one row, for split merging
  float m, l;
};

template <typename T>
class Kernel {
 public:
  Kernel(const Geometry& g, const TensorArg& out, const TensorArg& query, const T* k_cache,
         const T* v_cache, const int32_t* qsl, const int32_t* seq_lens, const int32_t* tables,
         float scale, bool causal)
      : g_(g), out_(out), query_(query), k_(k_cache), v_(v_cache), qsl_(qsl), seq_lens_(seq_lens),
        tables_(tables), scale_(scale), causal_(causal), fixed_(fixed_row_block(g.block_size, g.head_dim)) {}

  // Scratch layout per worker, in floats.
  static size_t scratch_floats(int64_t group, int64_t d, int64_t bs) {
    const int64_t rows = group * kQueryChunk;
    return rows * d * 2 + rows * 2 + bs + bs * d * 2;
  }

  // Runs one item. partial_acc/partial_ml receive split results (nullptr otherwise).
  void run(const WorkItem& it, float* scratch, float* partial_acc, Partial* partial_ml) const {
    const int64_t d = g_.head_dim, bs = g_.block_size, G = g_.group();
    const int64_t nq = it.q1 - it.q0, rows = G * nq;
    float* qf = scratch;
    float* acc = qf + G * kQueryChunk * d;
    float* m = acc + G * kQueryChunk * d;
    float* l = m + G * kQueryChunk;
    float* s = l + G * kQueryChunk;
    float* kf = s + bs;
    float* vf = kf + bs * d;
    const int64_t seq_len = seq_lens_[it.b];
    const int64_t q_len = qsl_[it.b + 1] - qsl_[it.b];
    const int64_t first_pos = seq_len - q_len;  // position of query token 0

    for (int64_t gi = 0; gi < G; ++gi) {
      for (int64_t qi = 0; qi < nq; ++qi) {
        const int64_t r = gi * nq + qi;
        const int64_t tok = qsl_[it.b] + it.q0 + qi, head = it.hk * G + gi;
        load(query_.ptr<T>() + tok * query_.strides[0] + head * query_.strides[1], qf + r * d, d);
        for (int64_t i = 0; i < d; ++i) qf[r * d + i] *= scale_;
        m[r] = -std::numeric_limits<float>::infinity();
        l[r] = 0.f;
        std::fill(acc + r * d, acc + (r + 1) * d, 0.f);
      }
    }
    for (int64_t j = it.j0; j < it.j1; ++j) {
      const int64_t phys = tables_[it.b * g_.max_blocks + j];
      const int64_t base = ((phys * g_.num_kv_heads + it.hk) * bs) * d;
      if (j + 1 < it.j1) {  // blocks sit anywhere in the pool: fetch the next one while computing this one
        const int64_t next = ((tables_[it.b * g_.max_blocks + j + 1] * g_.num_kv_heads + it.hk) * bs) * d;
        prefetch_block(k_ + next, bs * d);
        prefetch_block(v_ + next, bs * d);
      }
      const int64_t n_valid = std::min<int64_t>(bs, seq_len - j * bs);
      const float* kb;
      const float* vb;
      if constexpr (std::is_same_v<T, float>) {
        kb = k_ + base;
        vb = v_ + base;
      } else {  // bf16: widen the block once, reuse it for every row
        load(k_ + base, kf, bs * d);
        load(v_ + base, vf, n_valid * d);
        kb = kf;
        vb = vf;
      }
      for (int64_t gi = 0; gi < G; ++gi) {
        for (int64_t qi = 0; qi < nq; ++qi) {
          const int64_t r = gi * nq + qi;
          const int64_t qpos = first_pos + it.q0 + qi;
          const int64_t n = causal_ ? std::min<int64_t>(n_valid, qpos - j * bs + 1) : n_valid;
          if (n <= 0) continue;
          if (fixed_ != nullptr) {
            fixed_(qf + r * d, kb, vb, static_cast<int>(n), m + r, l + r, acc + r * d);
            continue;
          }
          block_scores(qf + r * d, kb, static_cast<int>(n), static_cast<int>(d), static_cast<int>(bs), s);
          const float alpha = online_softmax_step(s, static_cast<int>(n), m + r, l + r);
          block_accumulate(acc + r * d, alpha, s, vb, static_cast<int>(n), static_cast<int>(d));
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      if (partial_acc != nullptr) {  // unnormalised state, merged later
        std::copy(acc + r * d, acc + (r + 1) * d, partial_acc + r * d);
        partial_ml[r] = {m[r], l[r]};
        continue;
      }
      const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
      for (int64_t i = 0; i < d; ++i) acc[r * d + i] *= inv;
      const int64_t gi = r / nq, qi = r % nq;
      const int64_t tok = qsl_[it.b] + it.q0 + qi, head = it.hk * G + gi;
      store(acc + r * d, out_.ptr<T>() + tok * out_.strides[0] + head * out_.strides[1], d);
    }
  }

  // Merges `splits` partial states of one decode row group (G rows) into out.
  void merge(int32_t b, int32_t hk, int splits, const float* partial_acc, const Partial* partial_ml,
             float* scratch) const {
    const int64_t d = g_.head_dim, G = g_.group();
    for (int64_t gi = 0; gi < G; ++gi) {
      float m_max = -std::numeric_limits<float>::infinity();
      for (int sp = 0; sp < splits; ++sp) m_max = std::max(m_max, partial_ml[sp * G + gi].m);
      std::fill(scratch, scratch + d, 0.f);
      float l_sum = 0.f;
      for (int sp = 0; sp < splits; ++sp) {
        const Partial& p = partial_ml[sp * G + gi];
        if (p.l == 0.f) continue;
        const float w = std::exp(p.m - m_max);
        l_sum += w * p.l;
        const float* a = partial_acc + (sp * G + gi) * d;
        for (int64_t i = 0; i < d; ++i) scratch[i] += w * a[i];
      }
      const float inv = l_sum > 0.f ? 1.f / l_sum : 0.f;
      for (int64_t i = 0; i < d; ++i) scratch[i] *= inv;
      const int64_t tok = qsl_[b], head = hk * G + gi;
      store(scratch, out_.ptr<T>() + tok * out_.strides[0] + head * out_.strides[1], d);
    }
  }

 private:
  const Geometry& g_;
  const TensorArg& out_;
  const TensorArg& query_;
  const T* k_;
  const T* v_;
  const int32_t* qsl_;
  const int32_t* seq_lens_;
  const int32_t* tables_;
  float scale_;
  bool causal_;
  RowBlockFn fixed_;
};

// k_cache [N, Hkv, D, bs] (keys transposed per block), v_cache [N, Hkv, bs, D].
Geometry check_caches(const TensorArg& k_cache, const TensorArg& v_cache) {
  k_cache.check_dim(4);
  k_cache.check_contiguous();
  v_cache.check_contiguous();
  v_cache.check_shape({k_cache.size(0), k_cache.size(1), k_cache.size(3), k_cache.size(2)});
  v_cache.check_dtype(k_cache.dtype);
  if (k_cache.dtype != DType::kFloat32 && k_cache.dtype != DType::kBFloat16) {
    throw KernelArgumentError("k_cache must be float32 or bfloat16, got " +
                              std::string(dtype_name(k_cache.dtype)));
  }
  Geometry g{};
  g.num_blocks = k_cache.size(0);
  g.num_kv_heads = k_cache.size(1);
  g.head_dim = k_cache.size(2);
  g.block_size = k_cache.size(3);
  if (g.num_blocks < 1 || g.num_kv_heads < 1 || g.head_dim < 1 || g.block_size < 1) {
    throw KernelArgumentError("k_cache must have non-zero num_blocks, num_kv_heads, head_dim and block_size");
  }
  return g;
}

void check_heads(const TensorArg& t, const Geometry& g, int64_t heads, DType dtype) {
  t.check_dim(3);
  t.check_dtype(dtype);
  t.check_last_dim_contiguous();
  if (t.size(1) != heads || t.size(2) != g.head_dim) {
    throw KernelArgumentError(t.name + " must be [T, " + std::to_string(heads) + ", " +
                              std::to_string(g.head_dim) + "] to match the cache");
  }
}

// Writes token t of src [T, Hkv, D] at slot: V rows as [bs, D], K transposed as [D, bs].
template <typename T>
void write_token(const TensorArg& src, int64_t t, T* cache, int64_t slot, const Geometry& g, bool transposed) {
  const int64_t block = slot / g.block_size, off = slot % g.block_size, d = g.head_dim;
  for (int64_t h = 0; h < g.num_kv_heads; ++h) {
    const T* s = src.ptr<T>() + t * src.strides[0] + h * src.strides[1];
    T* base = cache + (block * g.num_kv_heads + h) * g.block_size * d;
    if (transposed) {
      for (int64_t i = 0; i < d; ++i) base[i * g.block_size + off] = s[i];
    } else {
      std::memcpy(base + off * d, s, d * sizeof(T));
    }
  }
}

}  // namespace

void reshape_and_cache(const TensorArg& key, const TensorArg& value, const TensorArg& k_cache,
                       const TensorArg& v_cache, const TensorArg& slot_mapping) {
  const Geometry g = check_caches(k_cache, v_cache);
  check_heads(key, g, g.num_kv_heads, k_cache.dtype);
  check_heads(value, g, g.num_kv_heads, k_cache.dtype);
  const int64_t T = key.size(0);
  value.check_shape(key.shape);
  slot_mapping.check_dim(1);
  slot_mapping.check_contiguous();
  slot_mapping.check_shape({T});
  if (slot_mapping.dtype != DType::kInt32 && slot_mapping.dtype != DType::kInt64) {
    throw KernelArgumentError("slot_mapping must be int32 or int64");
  }
  std::vector<int64_t> slots(T);
  const int64_t num_slots = g.num_blocks * g.block_size;
  for (int64_t t = 0; t < T; ++t) {
    slots[t] = slot_mapping.dtype == DType::kInt32 ? slot_mapping.ptr<int32_t>()[t]
                                                   : slot_mapping.ptr<int64_t>()[t];
    if (slots[t] >= num_slots) {
      throw KernelArgumentError("slot_mapping[" + std::to_string(t) + "] = " + std::to_string(slots[t]) +
                                " is outside the cache's " + std::to_string(num_slots) + " slots");
    }
  }
  for (int64_t t = 0; t < T; ++t) {
    if (slots[t] < 0) continue;
    if (k_cache.dtype == DType::kFloat32) {
      write_token<float>(key, t, k_cache.ptr<float>(), slots[t], g, true);
      write_token<float>(value, t, v_cache.ptr<float>(), slots[t], g, false);
    } else {
      write_token<bf16>(key, t, k_cache.ptr<bf16>(), slots[t], g, true);
      write_token<bf16>(value, t, v_cache.ptr<bf16>(), slots[t], g, false);
    }
  }
}

size_t paged_attention_scratch_bytes(int num_heads, int num_kv_heads, int head_dim, int block_size) {
  return Kernel<float>::scratch_floats(num_heads / std::max(num_kv_heads, 1), head_dim, block_size) *
         sizeof(float);
}

void paged_attention(const TensorArg& out, const TensorArg& query, const TensorArg& k_cache,
                     const TensorArg& v_cache, const TensorArg& query_start_loc,
                     const TensorArg& seq_lens, const TensorArg& block_tables, float scale,
                     bool causal, int num_threads) {
  Geometry g = check_caches(k_cache, v_cache);
  query.check_dim(3);
  g.num_tokens = query.size(0);
  g.num_heads = query.size(1);
  if (g.num_heads % g.num_kv_heads != 0) {
    throw KernelArgumentError("num_heads " + std::to_string(g.num_heads) + " is not a multiple of num_kv_heads " +
                              std::to_string(g.num_kv_heads));
  }
  check_heads(query, g, g.num_heads, k_cache.dtype);
  check_heads(out, g, g.num_heads, k_cache.dtype);
  out.check_shape(query.shape);
  for (const TensorArg* t : {&query_start_loc, &seq_lens, &block_tables}) {
    t->check_dtype(DType::kInt32);
    t->check_contiguous();
  }
  query_start_loc.check_dim(1);
  seq_lens.check_dim(1);
  block_tables.check_dim(2);
  g.num_seqs = seq_lens.size(0);
  g.max_blocks = block_tables.size(1);
  query_start_loc.check_shape({g.num_seqs + 1});
  if (block_tables.size(0) != g.num_seqs) {
    throw KernelArgumentError("block_tables must have one row per sequence");
  }
  const int32_t* qsl = query_start_loc.ptr<int32_t>();
  const int32_t* lens = seq_lens.ptr<int32_t>();
  const int32_t* tables = block_tables.ptr<int32_t>();
  if (qsl[0] != 0 || qsl[g.num_seqs] != g.num_tokens) {
    throw KernelArgumentError("query_start_loc must start at 0 and end at the number of query tokens");
  }
  // Validate every index the kernel will read, and build the work items.
  std::vector<WorkItem> items;
  int64_t base_items = 0;
  for (int64_t b = 0; b < g.num_seqs; ++b) {
    const int64_t q_len = qsl[b + 1] - qsl[b];
    if (q_len < 0 || q_len > lens[b]) {
      throw KernelArgumentError("sequence " + std::to_string(b) + ": query length " + std::to_string(q_len) +
                                " must be in [0, seq_len = " + std::to_string(lens[b]) + "]");
    }
    const int64_t nb = (lens[b] + g.block_size - 1) / g.block_size;
    if (nb > g.max_blocks) {
      throw KernelArgumentError("sequence " + std::to_string(b) + " needs " + std::to_string(nb) +
                                " blocks but block_tables has " + std::to_string(g.max_blocks) + " columns");
    }
    for (int64_t j = 0; j < nb; ++j) {
      const int32_t id = tables[b * g.max_blocks + j];
      if (id < 0 || id >= g.num_blocks) {
        throw KernelArgumentError("block_tables[" + std::to_string(b) + ", " + std::to_string(j) + "] = " +
                                  std::to_string(id) + " is outside [0, " + std::to_string(g.num_blocks) + ")");
      }
    }
    if (q_len > 0) base_items += g.num_kv_heads * ((q_len + kQueryChunk - 1) / kQueryChunk);
  }
  const int64_t target = 4 * static_cast<int64_t>(std::max(num_threads, 1));
  const int64_t split_factor = base_items > 0 && base_items < target ? (target + base_items - 1) / base_items : 1;
  struct SplitGroup {
    int32_t b, hk, splits;
    int64_t first_item;
  };
  std::vector<SplitGroup> split_groups;
  for (int32_t b = 0; b < g.num_seqs; ++b) {
    const int32_t q_len = qsl[b + 1] - qsl[b];
    if (q_len == 0) continue;
    const int32_t seq_len = lens[b];
    const int32_t nb = static_cast<int32_t>((seq_len + g.block_size - 1) / g.block_size);
    for (int32_t hk = 0; hk < g.num_kv_heads; ++hk) {
      int32_t splits = 1;
      if (q_len == 1 && split_factor > 1) {
        splits = static_cast<int32_t>(std::min<int64_t>(split_factor, std::max(1, nb / kMinBlocksPerSplit)));
      }
      if (splits > 1) {
        split_groups.push_back({b, hk, splits, static_cast<int64_t>(items.size())});
        const int32_t per = (nb + splits - 1) / splits;
        for (int32_t sp = 0; sp < splits; ++sp) {
          items.push_back({b, hk, 0, 1, sp * per, std::min(nb, (sp + 1) * per), sp});
        }
        continue;
      }
      for (int32_t q0 = 0; q0 < q_len; q0 += kQueryChunk) {
        const int32_t q1 = std::min(q_len, q0 + kQueryChunk);
        // causal: the chunk's last query sees keys up to its own position
        const int64_t last_pos = causal ? seq_len - q_len + q1 - 1 : seq_len - 1;
        items.push_back({b, hk, q0, q1, 0, static_cast<int32_t>(last_pos / g.block_size + 1), -1});
      }
    }
  }
  const int64_t group = g.group(), d = g.head_dim;
  const size_t scratch = Kernel<float>::scratch_floats(group, d, g.block_size);
  std::shared_ptr<ThreadPool> pool_ref = ThreadPool::get(num_threads);
  ThreadPool& pool = *pool_ref;
  std::vector<std::vector<float>> scratch_per_worker(pool.num_threads(), std::vector<float>(scratch));
  // Split results: per item G rows of (acc[d], m, l).
  std::vector<float> partial_acc;
  std::vector<Partial> partial_ml;
  std::vector<int64_t> partial_slot(items.size(), -1);
  int64_t n_partial = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    if (items[i].split >= 0) partial_slot[i] = n_partial++;
  }
  partial_acc.resize(n_partial * group * d);
  partial_ml.resize(n_partial * group);

  auto run_all = [&](auto kernel) {
    pool.run(static_cast<int64_t>(items.size()), [&](int64_t i, int worker) {
      const int64_t ps = partial_slot[i];
      kernel.run(items[i], scratch_per_worker[worker].data(),
                 ps >= 0 ? partial_acc.data() + ps * group * d : nullptr,
                 ps >= 0 ? partial_ml.data() + ps * group : nullptr);
    });
    pool.run(static_cast<int64_t>(split_groups.size()), [&](int64_t i, int worker) {
      const SplitGroup& sg = split_groups[i];
      const int64_t ps = partial_slot[sg.first_item];
      kernel.merge(sg.b, sg.hk, sg.splits, partial_acc.data() + ps * group * d,
                   partial_ml.data() + ps * group, scratch_per_worker[worker].data());
    });
  };
  if (k_cache.dtype == DType::kFloat32) {
    run_all(Kernel<float>(g, out, query, k_cache.ptr<float>(), v_cache.ptr<float>(), qsl, lens, tables, scale, causal));
  } else {
    run_all(Kernel<bf16>(g, out, query, k_cache.ptr<bf16>(), v_cache.ptr<bf16>(), qsl, lens, tables, scale, causal));
  }
}

}  // namespace pagedserve
