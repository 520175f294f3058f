// One step's Metal attention work, planned in plain C++ (no Metal types): the
// host dispatch (metal_attention.cc; metal_device.cc runs it through Metal on
// a Mac) and the Linux emulator tests
// (tests/metal_emu/) run the very same plan, so the grid sizes, the split-KV
// choice and the argument packing they verify are the ones a Mac executes.
//
// Sequences whose query length is 1 go to the decode kernel (one threadgroup
// per sequence, KV head tile and KV partition; SIMD groups split the keys);
// every other sequence with queries goes to the prefill kernel in tiles of
// kPrefillSimdGroups query tokens. Split-KV (flash-decoding, Dao et al. 2023):
// when the decode grid has fewer threadgroups than the GPU wants and some
// sequence is long, decode runs in partitions of partition_size keys and the
// merge kernel combines them by log-sum-exp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "backends/common/attention_checks.h"
#include "backends/common/tensor_arg.h"
#include "pagedserve_args.h"  // metal/: the structs the kernels read

namespace pagedserve {
namespace metal {

// Threadgroups x threads of one kernel launch (dispatchThreadgroups).
struct MetalLaunch {
  uint32_t threadgroups[3] = {0, 1, 1};
  uint32_t threads_per_threadgroup = 0;
  bool empty() const { return threadgroups[0] == 0 || threadgroups[1] == 0 || threadgroups[2] == 0; }
};

enum class SplitKv { kAuto, kOn, kOff };

struct MetalPlanOptions {
  SplitKv split = SplitKv::kAuto;
  int32_t partition_size = 512;      // keys per partition (a multiple of kSimdWidth)
  int32_t target_threadgroups = 64;  // auto: split when the decode grid has fewer (a few per GPU core)
};

// The plan of one step for one (num_heads, num_kv_heads, head_size, block_size)
// geometry. query/out strides are filled per layer call (set_strides).
struct MetalAttentionPlan {
  AttentionGeometry geometry;
  pagedserve_metal::PagedAttentionArgs decode_args{};
  pagedserve_metal::PagedAttentionArgs prefill_args{};
  std::vector<int32_t> decode_work;   // [decode items] sequence index
  std::vector<int32_t> prefill_work;  // [prefill tiles * 2] (sequence, first query token)
  MetalLaunch decode, merge, prefill;
  bool split = false;               // decode writes partials and merge runs
  size_t partial_out_floats = 0;    // items * num_heads * max_partitions * head_size
  size_t partial_lse_floats = 0;    // items * num_heads * max_partitions

  // Sets query/out strides (elements) in both arg structs.
  void set_strides(int64_t query_token_stride, int64_t query_head_stride, int64_t out_token_stride,
                   int64_t out_head_stride);
};

// Validates the metadata (check_attention_metadata, plus the kernels' limits:
// head_size <= kMaxHeadSize, indices within int32) and plans the step.
// query_start_loc [B+1], seq_lens [B], block_tables [B, max_blocks] int32.
// Throws KernelArgumentError.
MetalAttentionPlan make_metal_plan(const TensorArg& query_start_loc, const TensorArg& seq_lens,
                                   const TensorArg& block_tables, int64_t num_heads, int64_t num_kv_heads,
                                   int64_t head_size, int64_t block_size, int64_t num_blocks, bool causal,
                                   float scale, const MetalPlanOptions& options = {});

// The reshape_and_cache launch and arguments for key/value [T, Hkv, D] with the
// given strides (elements). Throws KernelArgumentError if a size exceeds int32.
struct ReshapeAndCacheLaunch {
  pagedserve_metal::ReshapeAndCacheArgs args{};
  MetalLaunch launch;
};
ReshapeAndCacheLaunch make_reshape_and_cache_launch(int64_t num_tokens, int64_t num_kv_heads, int64_t head_size,
                                                    int64_t block_size, int64_t num_blocks,
                                                    int64_t key_token_stride, int64_t key_head_stride,
                                                    int64_t value_token_stride, int64_t value_head_stride);

}  // namespace metal
}  // namespace pagedserve
