// Merge of split-KV decode partitions (flash-decoding, Dao et al. 2023): the
// output of (sequence, head) is the log-sum-exp weighted sum of its
// partitions' normalised partial outputs. One SIMD group per (decode item,
// query head); lanes own head dims lane, lane + 32, ...
#include <metal_stdlib>

#include "kernel_utils.h"

template <typename T>
kernel void paged_attention_merge(constant PagedAttentionArgs& args [[buffer(0)]],
                                  device const float* partial_out [[buffer(1)]],
                                  device const float* partial_lse [[buffer(2)]],
                                  device const int* seq_lens [[buffer(3)]],
                                  device const int* query_start_loc [[buffer(4)]],
                                  device const int* work [[buffer(5)]],
                                  device T* out [[buffer(6)]],
                                  uint3 tgid [[threadgroup_position_in_grid]],
                                  uint lane [[thread_index_in_simdgroup]]) {
  const int item = static_cast<int>(tgid.x);
  const int head = static_cast<int>(tgid.y);
  const int seq = work[item];
  const int num_partitions = (seq_lens[seq] + args.partition_size - 1) / args.partition_size;
  const long base = (static_cast<long>(item) * args.num_heads + head) * args.max_partitions;

  float m = -INFINITY;
  for (int p = static_cast<int>(lane); p < num_partitions; p += kSimdWidth) m = max(m, partial_lse[base + p]);
  m = simd_max(m);
  float weight_sum = 0.0f;
  for (int p = static_cast<int>(lane); p < num_partitions; p += kSimdWidth) weight_sum += exp(partial_lse[base + p] - m);
  weight_sum = simd_sum(weight_sum);

  const long token = query_start_loc[seq];
  for (int i = 0; i < kDimsPerLane; ++i) {
    const int d = static_cast<int>(lane) + i * kSimdWidth;
    if (d >= head_size_fc) break;
    float acc = 0.0f;
    for (int p = 0; p < num_partitions; ++p) acc += exp(partial_lse[base + p] - m) * partial_out[(base + p) * head_size_fc + d];
    out[token * args.out_token_stride + static_cast<long>(head) * args.out_head_stride + d] = store_as<T>(acc / weight_sum);
  }
}

PAGEDSERVE_INSTANTIATE_KERNEL("paged_attention_merge_float", paged_attention_merge, float)
PAGEDSERVE_INSTANTIATE_KERNEL("paged_attention_merge_half", paged_attention_merge, half)
PAGEDSERVE_INSTANTIATE_KERNEL("paged_attention_merge_bfloat", paged_attention_merge, bfloat)
