// Decode paged attention: one query token per sequence. One threadgroup per
// (sequence, KV head tile, KV partition) serves up to kMaxHeadsPerThreadgroup
// query heads of the KV head's GQA group, so each key and value is read once
// for all of them. Its kDecodeSimdGroups SIMD groups take interleaved chunks of
// 32 keys (attend_chunk), then merge their softmax states through threadgroup
// memory. With partition_size > 0 (split-KV, flash-decoding) each partition
// writes a normalised partial output and its log-sum-exp for
// paged_attention_merge; otherwise the output is written directly.
#include <metal_stdlib>

#include "kernel_utils.h"

template <typename T>
kernel void paged_attention_decode(constant PagedAttentionArgs& args [[buffer(0)]],
                                   device const T* query [[buffer(1)]],
                                   device const T* k_cache [[buffer(2)]],
                                   device const T* v_cache [[buffer(3)]],
                                   device const int* block_tables [[buffer(4)]],
                                   device const int* seq_lens [[buffer(5)]],
                                   device const int* query_start_loc [[buffer(6)]],
                                   device const int* work [[buffer(7)]],
                                   device T* out [[buffer(8)]],
                                   device float* partial_out [[buffer(9)]],
                                   device float* partial_lse [[buffer(10)]],
                                   uint3 tgid [[threadgroup_position_in_grid]],
                                   uint tid [[thread_index_in_threadgroup]],
                                   uint sg [[simdgroup_index_in_threadgroup]],
                                   uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float q_tg[kMaxHeadsPerThreadgroup * kMaxHeadSize];
  threadgroup float p_tg[kDecodeSimdGroups][kMaxHeadsPerThreadgroup * kSimdWidth];
  threadgroup float ml_tg[kDecodeSimdGroups][2 * kMaxHeadsPerThreadgroup];
  threadgroup float acc_tg[kDecodeSimdGroups][kMaxHeadSize];
  constexpr int kThreads = kDecodeSimdGroups * kSimdWidth;

  const int item = static_cast<int>(tgid.x);
  const int seq = work[item];
  const int group = args.num_heads / args.num_kv_heads;
  const int kv_head = static_cast<int>(tgid.y) / args.head_tiles;
  const int tile = static_cast<int>(tgid.y) % args.head_tiles;
  const int first_head = kv_head * group + tile * args.heads_per_threadgroup;
  const int num_heads = min(args.heads_per_threadgroup, group - tile * args.heads_per_threadgroup);
  const int seq_len = seq_lens[seq];
  const long token = query_start_loc[seq];
  const int partition = static_cast<int>(tgid.z);
  int key_begin = 0;
  int key_end = seq_len;
  if (args.partition_size > 0) {
    key_begin = partition * args.partition_size;
    if (key_begin >= seq_len) return;  // the whole threadgroup: this sequence has fewer partitions
    key_end = min(seq_len, key_begin + args.partition_size);
  }

  for (int x = static_cast<int>(tid); x < num_heads * head_size_fc; x += kThreads) {
    const int h = x / head_size_fc;
    const int d = x % head_size_fc;
    q_tg[x] = load_float(query[token * args.query_token_stride + static_cast<long>(first_head + h) * args.query_head_stride + d]) *
              args.scale;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // queries loaded

  AttentionState st;
  init_state(st);
  device const int* table = block_tables + static_cast<long>(seq) * args.max_blocks_per_seq;
  for (int c = key_begin + static_cast<int>(sg) * kSimdWidth; c < key_end; c += kThreads) {
    attend_chunk<T>(st, q_tg, p_tg[sg], num_heads, c, min(c + static_cast<int>(kSimdWidth), key_end), k_cache,
                    v_cache, table, kv_head, args.num_kv_heads, lane);
  }

  // Merge the SIMD groups' states: rescale each to the common max, sum.
  if (lane == 0) {
    for (int h = 0; h < num_heads; ++h) {
      ml_tg[sg][2 * h] = st.m[h];
      ml_tg[sg][2 * h + 1] = st.l[h];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // every SIMD group's (m, l) visible
  for (int h = 0; h < num_heads; ++h) {
    float m_all = -INFINITY;
    for (int s = 0; s < kDecodeSimdGroups; ++s) m_all = max(m_all, ml_tg[s][2 * h]);
    float l_all = 0.0f;
    for (int s = 0; s < kDecodeSimdGroups; ++s) {
      if (ml_tg[s][2 * h] > -INFINITY) l_all += ml_tg[s][2 * h + 1] * exp(ml_tg[s][2 * h] - m_all);
    }
    const float own = st.m[h] > -INFINITY ? exp(st.m[h] - m_all) : 0.0f;
    for (int i = 0; i < kDimsPerLane; ++i) {
      const int d = static_cast<int>(lane) + i * kSimdWidth;
      if (d < head_size_fc) acc_tg[sg][d] = st.acc[h][i] * own;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // every SIMD group's rescaled accumulator visible
    const int head = first_head + h;
    for (int d = static_cast<int>(tid); d < head_size_fc; d += kThreads) {
      float sum = 0.0f;
      for (int s = 0; s < kDecodeSimdGroups; ++s) sum += acc_tg[s][d];
      if (args.partition_size == 0) {
        out[token * args.out_token_stride + static_cast<long>(head) * args.out_head_stride + d] = store_as<T>(sum / l_all);
      } else {
        const long idx = (static_cast<long>(item) * args.num_heads + head) * args.max_partitions + partition;
        partial_out[idx * head_size_fc + d] = sum / l_all;
        if (d == 0) partial_lse[idx] = m_all + log(l_all);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // acc_tg is rewritten for the next head
  }
}

PAGEDSERVE_INSTANTIATE_KERNEL("paged_attention_decode_float", paged_attention_decode, float)
PAGEDSERVE_INSTANTIATE_KERNEL("paged_attention_decode_half", paged_attention_decode, half)
PAGEDSERVE_INSTANTIATE_KERNEL("paged_attention_decode_bfloat", paged_attention_decode, bfloat)
