// reshape_and_cache: writes the new tokens' key/value [T, Hkv, D] into the
// paged KV cache [num_blocks, Hkv, block_size, D] at slot_mapping [T]
// (block * block_size + offset; negative: skip). One threadgroup per (token,
// KV head); its threads copy the head's D elements of K and of V.
#include <metal_stdlib>

#include "kernel_utils.h"

template <typename T>
kernel void reshape_and_cache(constant ReshapeAndCacheArgs& args [[buffer(0)]],
                              device const T* key [[buffer(1)]],
                              device const T* value [[buffer(2)]],
                              device T* k_cache [[buffer(3)]],
                              device T* v_cache [[buffer(4)]],
                              device const long* slot_mapping [[buffer(5)]],
                              uint3 tgid [[threadgroup_position_in_grid]],
                              uint tid [[thread_index_in_threadgroup]]) {
  const int token = static_cast<int>(tgid.x);
  const int kv_head = static_cast<int>(tgid.y);
  const long slot = slot_mapping[token];
  if (slot < 0) return;  // the whole threadgroup skips this token
  const int block = static_cast<int>(slot / block_size_fc);
  const int offset = static_cast<int>(slot % block_size_fc);
  const long dst = cache_offset(block, kv_head, offset, args.num_kv_heads);
  const long k_src = static_cast<long>(token) * args.key_token_stride + static_cast<long>(kv_head) * args.key_head_stride;
  const long v_src =
      static_cast<long>(token) * args.value_token_stride + static_cast<long>(kv_head) * args.value_head_stride;
  for (int d = static_cast<int>(tid); d < head_size_fc; d += kReshapeThreads) {
    k_cache[dst + d] = key[k_src + d];
    v_cache[dst + d] = value[v_src + d];
  }
}

PAGEDSERVE_INSTANTIATE_KERNEL("reshape_and_cache_float", reshape_and_cache, float)
PAGEDSERVE_INSTANTIATE_KERNEL("reshape_and_cache_half", reshape_and_cache, half)
PAGEDSERVE_INSTANTIATE_KERNEL("reshape_and_cache_bfloat", reshape_and_cache, bfloat)
