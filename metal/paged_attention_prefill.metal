// Varlen prefill paged attention: sequences with more than one query token
// (a prompt, a chunk of a chunked prefill, the tail after a prefix-cache hit),
// over every earlier key of the sequence in the cache plus the causal part of
// the chunk itself. One threadgroup per (query tile of kPrefillSimdGroups
// tokens, KV head tile); SIMD group s serves the tile's token s for up to
// kPrefillHeadsPerThreadgroup query heads of the GQA group, walking the keys in
// chunks of 32 (attend_chunk). SIMD groups share nothing, so the only
// synchronisation is within each SIMD group.
#include <metal_stdlib>

#include "kernel_utils.h"

template <typename T>
kernel void paged_attention_prefill(constant PagedAttentionArgs& args [[buffer(0)]],
                                    device const T* query [[buffer(1)]],
                                    device const T* k_cache [[buffer(2)]],
                                    device const T* v_cache [[buffer(3)]],
                                    device const int* block_tables [[buffer(4)]],
                                    device const int* seq_lens [[buffer(5)]],
                                    device const int* query_start_loc [[buffer(6)]],
                                    device const int* work [[buffer(7)]],
                                    device T* out [[buffer(8)]],
                                    uint3 tgid [[threadgroup_position_in_grid]],
                                    uint sg [[simdgroup_index_in_threadgroup]],
                                    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float q_tg[kPrefillSimdGroups][kPrefillHeadsPerThreadgroup * kMaxHeadSize];
  threadgroup float p_tg[kPrefillSimdGroups][kMaxHeadsPerThreadgroup * kSimdWidth];

  const int tile = static_cast<int>(tgid.x);
  const int seq = work[2 * tile];
  const int q_index = work[2 * tile + 1] + static_cast<int>(sg);
  const int q_len = query_start_loc[seq + 1] - query_start_loc[seq];
  if (q_index >= q_len) return;  // the whole SIMD group: the sequence's last tile is partial
  const int group = args.num_heads / args.num_kv_heads;
  const int kv_head = static_cast<int>(tgid.y) / args.head_tiles;
  const int head_tile = static_cast<int>(tgid.y) % args.head_tiles;
  const int first_head = kv_head * group + head_tile * args.heads_per_threadgroup;
  const int num_heads = min(args.heads_per_threadgroup, group - head_tile * args.heads_per_threadgroup);
  const int seq_len = seq_lens[seq];
  const long token = static_cast<long>(query_start_loc[seq]) + q_index;

  for (int x = static_cast<int>(lane); x < num_heads * head_size_fc; x += kSimdWidth) {
    const int h = x / head_size_fc;
    const int d = x % head_size_fc;
    q_tg[sg][x] = load_float(query[token * args.query_token_stride + static_cast<long>(first_head + h) * args.query_head_stride + d]) *
                  args.scale;
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);  // this SIMD group's queries loaded

  const int position = seq_len - q_len + q_index;
  const int key_end = args.causal ? position + 1 : seq_len;
  AttentionState st;
  init_state(st);
  device const int* table = block_tables + static_cast<long>(seq) * args.max_blocks_per_seq;
  for (int c = 0; c < key_end; c += kSimdWidth) {
    attend_chunk<T>(st, q_tg[sg], p_tg[sg], num_heads, c, min(c + static_cast<int>(kSimdWidth), key_end), k_cache,
                    v_cache, table, kv_head, args.num_kv_heads, lane);
  }
  for (int h = 0; h < num_heads; ++h) {
    for (int i = 0; i < kDimsPerLane; ++i) {
      const int d = static_cast<int>(lane) + i * kSimdWidth;
      if (d < head_size_fc) {
        out[token * args.out_token_stride + static_cast<long>(first_head + h) * args.out_head_stride + d] =
            store_as<T>(st.acc[h][i] / st.l[h]);
      }
    }
  }
}

PAGEDSERVE_INSTANTIATE_KERNEL("paged_attention_prefill_float", paged_attention_prefill, float)
PAGEDSERVE_INSTANTIATE_KERNEL("paged_attention_prefill_half", paged_attention_prefill, half)
PAGEDSERVE_INSTANTIATE_KERNEL("paged_attention_prefill_bfloat", paged_attention_prefill, bfloat)
