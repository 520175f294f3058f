// Shared by every PagedServe Metal kernel: the function constants the host
// specialises each pipeline with, and dtype conversions. Kernels keep
// threadgroup memory only in arrays declared at kernel scope (never as a
// `threadgroup T*` parameter), so the Linux emulator can run the same source.
#pragma once

#include <metal_stdlib>

#include "pagedserve_args.h"

using namespace metal;
using namespace pagedserve_metal;

// Specialised at pipeline creation (host: MTLFunctionConstantValues; indices
// kFunctionConstantHeadSize / kFunctionConstantBlockSize in pagedserve_args.h).
constant int head_size_fc [[function_constant(0)]];
constant int block_size_fc [[function_constant(1)]];
static_assert(kFunctionConstantHeadSize == 0 && kFunctionConstantBlockSize == 1, "function constant indices");

// Instantiates kernel template `func` for element type T under the function
// name `host_name` the host looks up (e.g. "paged_attention_decode_half").
// Metal takes the [[host_name]] attribute on an explicit instantiation; a C++
// compiler (the Linux emulator) does not, and needs no name.
#ifdef __METAL_VERSION__
#define PAGEDSERVE_INSTANTIATE_KERNEL(host_name_, func, T) \
  template [[host_name(host_name_)]] [[kernel]] decltype(func<T>) func<T>;
#else
#define PAGEDSERVE_INSTANTIATE_KERNEL(host_name_, func, T) template decltype(func<T>) func<T>;
#endif

// Each lane of a SIMD group owns the head dimensions lane, lane + 32, ...
enum : int { kDimsPerLane = kMaxHeadSize / kSimdWidth };

// Loads and stores in float32 (all arithmetic accumulates in float32).
template <typename T>
inline float load_float(T x) {
  return static_cast<float>(x);
}

template <typename T>
inline T store_as(float x) {
  return static_cast<T>(x);
}

// Offset (elements) of key slot `offset` of block `block`, KV head `kv_head`,
// in a [num_blocks, num_kv_heads, block_size, head_size] cache.
inline long cache_offset(int block, int kv_head, int offset, int num_kv_heads) {
  return ((static_cast<long>(block) * num_kv_heads + kv_head) * block_size_fc + offset) * head_size_fc;
}

// One SIMD group's online-softmax state (Milakov & Gimelshein 2018; the
// running max m, sum l and unnormalised accumulator of FlashAttention) for up
// to kMaxHeadsPerThreadgroup query heads; lane owns acc dims lane + 32 * i.
struct AttentionState {
  float m[kMaxHeadsPerThreadgroup];
  float l[kMaxHeadsPerThreadgroup];
  float acc[kMaxHeadsPerThreadgroup][kDimsPerLane];
};

inline void init_state(thread AttentionState& st) {
  for (int h = 0; h < kMaxHeadsPerThreadgroup; ++h) {
    st.m[h] = -INFINITY;
    st.l[h] = 0.0f;
    for (int i = 0; i < kDimsPerLane; ++i) st.acc[h][i] = 0.0f;
  }
}

// Folds keys [chunk_begin, chunk_end) (at most kSimdWidth, chunk_begin <
// chunk_end) of one sequence into st, for num_heads query heads. Lane j scores
// key chunk_begin + j against every head's query (q: threadgroup memory
// [num_heads][head_size], already scaled); the SIMD group takes the chunk's max
// and sum with simd_max / simd_sum; then every lane accumulates its own head
// dims over the chunk's values, reading the probabilities from p (this SIMD
// group's threadgroup scratch, [kMaxHeadsPerThreadgroup][kSimdWidth]).
// block_table: the sequence's row of physical block ids. Every lane of the
// SIMD group must call it (it contains SIMD-group collectives).
template <typename T, typename QMem, typename PMem>
inline void attend_chunk(thread AttentionState& st, QMem q, PMem p, int num_heads, int chunk_begin, int chunk_end,
                         device const T* k_cache, device const T* v_cache, device const int* block_table,
                         int kv_head, int num_kv_heads, uint lane) {
  const int key = chunk_begin + static_cast<int>(lane);
  const bool valid = key < chunk_end;
  float s[kMaxHeadsPerThreadgroup];
  for (int h = 0; h < kMaxHeadsPerThreadgroup; ++h) s[h] = valid ? 0.0f : -INFINITY;
  if (valid) {
    const int block = block_table[key / block_size_fc];
    device const T* k = k_cache + cache_offset(block, kv_head, key % block_size_fc, num_kv_heads);
    for (int d = 0; d < head_size_fc; ++d) {
      const float kd = load_float(k[d]);
      for (int h = 0; h < num_heads; ++h) s[h] += q[h * head_size_fc + d] * kd;
    }
  }
  for (int h = 0; h < num_heads; ++h) {
    const float m_new = max(st.m[h], simd_max(s[h]));  // finite: lane 0 always holds a key
    const float alpha = exp(st.m[h] - m_new);           // 0 on the first chunk (m = -inf)
    const float prob = valid ? exp(s[h] - m_new) : 0.0f;
    st.l[h] = st.l[h] * alpha + simd_sum(prob);
    st.m[h] = m_new;
    for (int i = 0; i < kDimsPerLane; ++i) st.acc[h][i] *= alpha;
    p[h * kSimdWidth + static_cast<int>(lane)] = prob;
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);  // every lane's probabilities are in p
  const int n = min(static_cast<int>(kSimdWidth), chunk_end - chunk_begin);
  for (int j = 0; j < n; ++j) {
    const int key_j = chunk_begin + j;
    const int block = block_table[key_j / block_size_fc];
    device const T* v = v_cache + cache_offset(block, kv_head, key_j % block_size_fc, num_kv_heads);
    for (int i = 0; i < kDimsPerLane; ++i) {
      const int d = static_cast<int>(lane) + i * kSimdWidth;
      if (d < head_size_fc) {
        const float vd = load_float(v[d]);
        for (int h = 0; h < num_heads; ++h) st.acc[h][i] += p[h * kSimdWidth + j] * vd;
      }
    }
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);  // p is rewritten by the next chunk
}
