// The CPU attention kernels, compiled once per ISA variant (kernel_isa.h):
// CMake builds this file several times with PAGEDSERVE_ISA set to baseline,
// avx2, avx512 (x86-64) or native, each with its own -m flags; the hot loops
// are plain C++ with `omp simd` hints that the compiler vectorises for that ISA.
//
// Algorithm: online softmax over the blocks named by the block table (running
// max m, running sum l, float32 accumulator; Milakov & Gimelshein 2018,
// FlashAttention, Dao et al. 2022), K/V read in place. Long decodes split
// along the KV length are merged by log-sum-exp (flash-decoding, Dao et al. 2023).
//
// Everything but the table getter has internal linkage and no standard-library
// template is used, so no symbol compiled for one ISA can stand in for
// another's (tests/cpp/check_isa_objects.cmake verifies the objects).
#include <math.h>
#include <string.h>

#include <cstdint>

#include "kernel_isa.h"
#include "scalar_convert.h"

#ifndef PAGEDSERVE_ISA
#error "PAGEDSERVE_ISA must name the variant this file is compiled for"
#endif

namespace pagedserve {
namespace cpu {
namespace {


inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
inline float fmax2(float a, float b) { return a > b ? a : b; }

inline void load(const float* src, float* dst, int64_t n) { memcpy(dst, src, n * sizeof(float)); }
inline void load(const bf16* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
}
inline void store(const float* src, float* dst, int64_t n) { memcpy(dst, src, n * sizeof(float)); }
inline void store(const float* src, bf16* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
}

// s[t] = q . k_t for t < n, from a transposed key block kt[i * bs + t]
// (generic path): vector FMAs across the keys, no horizontal sums.
void block_scores(const float* q, const float* kt, int n, int d, int bs, float* s) {
  for (int t = 0; t < n; ++t) s[t] = 0.f;
  for (int i = 0; i < d; ++i) {
    const float qi = q[i];
    const float* row = kt + static_cast<int64_t>(i) * bs;
#pragma omp simd
    for (int t = 0; t < n; ++t) s[t] += qi * row[t];
  }
}

// s[t] = cap * tanh(s[t] / cap) for t < n (attention logit soft-capping, Gemma 2).
void soft_cap(float* s, int n, float cap) {
  const float inv = 1.f / cap;
  for (int t = 0; t < n; ++t) s[t] = cap * tanhf(s[t] * inv);
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
    memcpy(&scale, &bits, sizeof scale);
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
    const float* vt = v + static_cast<int64_t>(t) * d;
#pragma omp simd
    for (int i = 0; i < d; ++i) acc[i] += pt * vt[i];
  }
}

// The online-softmax update for one row over a block's n scores: turns s into
// exp(s - m_new), updates the running max m and sum l, returns the factor
// alpha = exp(m_old - m_new) the accumulator must be scaled by (0 on the first block).
inline float online_softmax_step(float* s, int n, float* m, float* l) {
  const float m_new = fmax2(*m, block_max(s, n));
  const float alpha = __builtin_isinf(*m) ? 0.f : expf(*m - m_new);
  *l = *l * alpha + block_exp(s, n, m_new);
  *m = m_new;
  return alpha;
}

// One (query row, KV block) step with compile-time block_size BS and head_dim
// D, so the scores and the accumulator stay in registers. Keys [lo, n) of the
// block are visible (lo > 0 under a sliding window, n < BS at the causal edge).
template <int BS, int D>
void row_block_fixed(const float* q, const float* kt, const float* v, int lo, int n, float cap, float* m, float* l,
                     float* acc) {
  float s[BS];  // all BS lanes computed (finite cache contents), [lo, n) used
#pragma omp simd
  for (int t = 0; t < BS; ++t) s[t] = 0.f;
  for (int i = 0; i < D; ++i) {
    const float qi = q[i];
#pragma omp simd
    for (int t = 0; t < BS; ++t) s[t] += qi * kt[i * BS + t];
  }
  if (cap > 0.f) soft_cap(s + lo, n - lo, cap);
  const float alpha = online_softmax_step(s + lo, n - lo, m, l);
  float a[D];
#pragma omp simd
  for (int i = 0; i < D; ++i) a[i] = acc[i] * alpha;
  for (int t = lo; t < n; ++t) {
    const float pt = s[t];
#pragma omp simd
    for (int i = 0; i < D; ++i) a[i] += pt * v[t * D + i];
  }
#pragma omp simd
  for (int i = 0; i < D; ++i) acc[i] = a[i];
}

using RowBlockFn = void (*)(const float*, const float*, const float*, int, int, float, float*, float*, float*);

// The specialised step for (block_size, head_dim), or nullptr (generic path).
RowBlockFn fixed_row_block(int64_t bs, int64_t d) {
  if (bs == 16 && d == 64) return &row_block_fixed<16, 64>;
  if (bs == 16 && d == 128) return &row_block_fixed<16, 128>;
  if (bs == 32 && d == 64) return &row_block_fixed<32, 64>;
  if (bs == 32 && d == 128) return &row_block_fixed<32, 128>;
  return nullptr;
}

// Asks the cache hierarchy for n elements starting at p (one hint per 64-byte line).
template <typename T>
inline void prefetch_block(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(c + off);
}

template <typename T>
void run_item_typed(const KernelArgs& a, const WorkItem& it, float* scratch, float* partial_acc, Partial* partial_ml) {
  const int64_t d = a.head_dim, bs = a.block_size, G = a.group;
  const int64_t nq = it.q1 - it.q0, rows = G * nq;
  const RowBlockFn fixed = fixed_row_block(bs, d);
  const T* query = static_cast<const T*>(a.query);
  const T* k_cache = static_cast<const T*>(a.k_cache);
  const T* v_cache = static_cast<const T*>(a.v_cache);
  float* qf = scratch;
  float* acc = qf + G * kQueryChunk * d;
  float* m = acc + G * kQueryChunk * d;
  float* l = m + G * kQueryChunk;
  float* s = l + G * kQueryChunk;
  float* kf = s + bs;
  float* vf = kf + bs * d;
  const int64_t seq_len = a.seq_lens[it.b];
  const int64_t q_start = a.query_start_loc[it.b];
  const int64_t q_len = a.query_start_loc[it.b + 1] - q_start;
  const int64_t first_pos = seq_len - q_len;  // position of query token 0
  const int32_t* table = a.block_tables + it.b * a.max_blocks;

  for (int64_t gi = 0; gi < G; ++gi) {
    for (int64_t qi = 0; qi < nq; ++qi) {
      const int64_t r = gi * nq + qi;
      const int64_t tok = q_start + it.q0 + qi, head = it.hk * G + gi;
      load(query + tok * a.query_stride_token + head * a.query_stride_head, qf + r * d, d);
      for (int64_t i = 0; i < d; ++i) qf[r * d + i] *= a.scale;
      m[r] = -__builtin_inff();
      l[r] = 0.f;
      for (int64_t i = 0; i < d; ++i) acc[r * d + i] = 0.f;
    }
  }
  for (int64_t j = it.j0; j < it.j1; ++j) {
    const int64_t base = ((table[j] * a.num_kv_heads + it.hk) * bs) * d;
    if (j + 1 < it.j1) {  // blocks sit anywhere in the pool: fetch the next one while computing this one
      const int64_t next = ((table[j + 1] * a.num_kv_heads + it.hk) * bs) * d;
      prefetch_block(k_cache + next, bs * d);
      prefetch_block(v_cache + next, bs * d);
    }
    const int64_t n_valid = imin(bs, seq_len - j * bs);
    const float* kb;
    const float* vb;
    if constexpr (sizeof(T) == sizeof(float)) {
      kb = reinterpret_cast<const float*>(k_cache + base);
      vb = reinterpret_cast<const float*>(v_cache + base);
    } else {  // bf16: widen the block once, reuse it for every row
      load(k_cache + base, kf, bs * d);
      load(v_cache + base, vf, n_valid * d);
      kb = kf;
      vb = vf;
    }
    for (int64_t gi = 0; gi < G; ++gi) {
      for (int64_t qi = 0; qi < nq; ++qi) {
        const int64_t r = gi * nq + qi;
        const int64_t qpos = first_pos + it.q0 + qi;
        const int64_t n = a.causal ? imin(n_valid, qpos - j * bs + 1) : n_valid;
        // sliding window: keys at positions <= qpos - window are hidden
        const int64_t lo = a.sliding_window > 0 ? imax(0, qpos - a.sliding_window + 1 - j * bs) : 0;
        if (n <= lo) continue;
        if (fixed != nullptr) {
          fixed(qf + r * d, kb, vb, static_cast<int>(lo), static_cast<int>(n), a.softcap, m + r, l + r, acc + r * d);
          continue;
        }
        block_scores(qf + r * d, kb, static_cast<int>(n), static_cast<int>(d), static_cast<int>(bs), s);
        if (a.softcap > 0.f) soft_cap(s + lo, static_cast<int>(n - lo), a.softcap);
        const float alpha = online_softmax_step(s + lo, static_cast<int>(n - lo), m + r, l + r);
        block_accumulate(acc + r * d, alpha, s + lo, vb + lo * d, static_cast<int>(n - lo), static_cast<int>(d));
      }
    }
  }
  T* out = static_cast<T*>(a.out);
  for (int64_t r = 0; r < rows; ++r) {
    if (partial_acc != nullptr) {  // unnormalised state, merged later
      for (int64_t i = 0; i < d; ++i) partial_acc[r * d + i] = acc[r * d + i];
      partial_ml[r] = {m[r], l[r]};
      continue;
    }
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    for (int64_t i = 0; i < d; ++i) acc[r * d + i] *= inv;
    const int64_t gi = r / nq, qi = r % nq;
    const int64_t tok = q_start + it.q0 + qi, head = it.hk * G + gi;
    store(acc + r * d, out + tok * a.out_stride_token + head * a.out_stride_head, d);
  }
}

template <typename T>
void merge_typed(const KernelArgs& a, int32_t b, int32_t hk, int32_t splits, const float* partial_acc,
                 const Partial* partial_ml, float* scratch) {
  const int64_t d = a.head_dim, G = a.group;
  T* out = static_cast<T*>(a.out);
  for (int64_t gi = 0; gi < G; ++gi) {
    float m_max = -__builtin_inff();
    for (int32_t sp = 0; sp < splits; ++sp) m_max = fmax2(m_max, partial_ml[sp * G + gi].m);
    for (int64_t i = 0; i < d; ++i) scratch[i] = 0.f;
    float l_sum = 0.f;
    for (int32_t sp = 0; sp < splits; ++sp) {
      const Partial& p = partial_ml[sp * G + gi];
      if (p.l == 0.f) continue;
      const float w = expf(p.m - m_max);
      l_sum += w * p.l;
      const float* acc = partial_acc + (sp * G + gi) * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) scratch[i] += w * acc[i];
    }
    const float inv = l_sum > 0.f ? 1.f / l_sum : 0.f;
    for (int64_t i = 0; i < d; ++i) scratch[i] *= inv;
    const int64_t tok = a.query_start_loc[b], head = hk * G + gi;
    store(scratch, out + tok * a.out_stride_token + head * a.out_stride_head, d);
  }
}

void run_item(const KernelArgs& a, const WorkItem& it, float* scratch, float* partial_acc, Partial* partial_ml) {
  if (a.dtype == DType::kFloat32) {
    run_item_typed<float>(a, it, scratch, partial_acc, partial_ml);
  } else {
    run_item_typed<bf16>(a, it, scratch, partial_acc, partial_ml);
  }
}

void merge_splits(const KernelArgs& a, int32_t b, int32_t hk, int32_t splits, const float* partial_acc,
                  const Partial* partial_ml, float* scratch) {
  if (a.dtype == DType::kFloat32) {
    merge_typed<float>(a, b, hk, splits, partial_acc, partial_ml, scratch);
  } else {
    merge_typed<bf16>(a, b, hk, splits, partial_acc, partial_ml, scratch);
  }
}

const KernelTable kTable{PS_STR(PAGEDSERVE_ISA), &run_item, &merge_splits};

}  // namespace

const KernelTable& PS_CAT(kernel_table_, PAGEDSERVE_ISA)() { return kTable; }

}  // namespace cpu
}  // namespace pagedserve
