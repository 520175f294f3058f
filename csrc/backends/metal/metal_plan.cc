#include "metal_plan.h"

#include <algorithm>
#include <limits>
#include <string>

#include "core/errors.h"

namespace pagedserve {
namespace metal {

namespace pm = pagedserve_metal;

namespace {

int32_t narrow(int64_t v, const char* what) {
  if (v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max()) {
    throw KernelArgumentError(std::string(what) + " = " + std::to_string(v) + " does not fit the Metal kernels' int32");
  }
  return static_cast<int32_t>(v);
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

void MetalAttentionPlan::set_strides(int64_t query_token_stride, int64_t query_head_stride,
                                     int64_t out_token_stride, int64_t out_head_stride) {
  for (pm::PagedAttentionArgs* a : {&decode_args, &prefill_args}) {
    a->query_token_stride = narrow(query_token_stride, "query token stride");
    a->query_head_stride = narrow(query_head_stride, "query head stride");
    a->out_token_stride = narrow(out_token_stride, "out token stride");
    a->out_head_stride = narrow(out_head_stride, "out head stride");
  }
}

MetalAttentionPlan make_metal_plan(const TensorArg& query_start_loc, const TensorArg& seq_lens,
                                   const TensorArg& block_tables, int64_t num_heads, int64_t num_kv_heads,
                                   int64_t head_size, int64_t block_size, int64_t num_blocks, bool causal,
                                   float scale, const MetalPlanOptions& options) {
  MetalAttentionPlan p;
  p.geometry = check_attention_metadata(query_start_loc, seq_lens, block_tables, num_heads, num_kv_heads, head_size,
                                        block_size, num_blocks);
  const AttentionGeometry& g = p.geometry;
  if (head_size > pm::kMaxHeadSize) {
    throw KernelArgumentError("head_size " + std::to_string(head_size) + " exceeds the Metal kernels' limit of " +
                              std::to_string(pm::kMaxHeadSize));
  }
  if (options.partition_size < pm::kSimdWidth || options.partition_size % pm::kSimdWidth != 0) {
    throw KernelArgumentError("partition_size must be a positive multiple of " + std::to_string(pm::kSimdWidth) +
                              ", got " + std::to_string(options.partition_size));
  }
  narrow(g.num_tokens, "num_tokens");
  narrow(g.num_blocks * g.block_size, "KV slots");

  const int32_t* qsl = query_start_loc.ptr<int32_t>();
  const int32_t* lens = seq_lens.ptr<int32_t>();
  int64_t longest_decode = 0;
  for (int64_t b = 0; b < g.num_seqs; ++b) {
    const int64_t q_len = static_cast<int64_t>(qsl[b + 1]) - qsl[b];
    if (q_len == 1) {
      p.decode_work.push_back(static_cast<int32_t>(b));
      longest_decode = std::max<int64_t>(longest_decode, lens[b]);
    } else {
      for (int64_t first = 0; first < q_len; first += pm::kPrefillSimdGroups) {
        p.prefill_work.push_back(static_cast<int32_t>(b));
        p.prefill_work.push_back(static_cast<int32_t>(first));
      }
    }
  }

  const int64_t group = g.group();
  const int64_t heads_per_tg = std::min<int64_t>(group, pm::kMaxHeadsPerThreadgroup);
  const int64_t head_tiles = ceil_div(group, heads_per_tg);
  const int64_t prefill_heads_per_tg = std::min<int64_t>(group, pm::kPrefillHeadsPerThreadgroup);
  const int64_t prefill_head_tiles = ceil_div(group, prefill_heads_per_tg);
  const int64_t decode_items = static_cast<int64_t>(p.decode_work.size());
  const int64_t prefill_tiles = static_cast<int64_t>(p.prefill_work.size() / 2);

  // Split-KV: worth it when the grid is too small to fill the GPU and a decode
  // is long enough for at least two partitions.
  const int64_t decode_tgs = decode_items * g.num_kv_heads * head_tiles;
  bool split = false;
  if (options.split == SplitKv::kOn) {
    split = decode_items > 0;
  } else if (options.split == SplitKv::kAuto) {
    split = decode_items > 0 && decode_tgs < options.target_threadgroups &&
            longest_decode >= 2 * static_cast<int64_t>(options.partition_size);
  }
  const int64_t max_partitions = split ? std::max<int64_t>(1, ceil_div(longest_decode, options.partition_size)) : 1;
  p.split = split;

  pm::PagedAttentionArgs base{};
  base.num_seqs = narrow(g.num_seqs, "num_seqs");
  base.num_heads = narrow(g.num_heads, "num_heads");
  base.num_kv_heads = narrow(g.num_kv_heads, "num_kv_heads");
  base.head_size = narrow(g.head_dim, "head_size");
  base.block_size = narrow(g.block_size, "block_size");
  base.num_blocks = narrow(g.num_blocks, "num_blocks");
  base.max_blocks_per_seq = narrow(g.max_blocks, "max_blocks_per_seq");
  base.heads_per_threadgroup = narrow(heads_per_tg, "heads_per_threadgroup");
  base.head_tiles = narrow(head_tiles, "head_tiles");
  base.causal = causal ? 1 : 0;
  base.scale = scale;
  // contiguous [T, H, D] until set_strides says otherwise
  base.query_token_stride = base.out_token_stride = narrow(g.num_heads * g.head_dim, "token stride");
  base.query_head_stride = base.out_head_stride = base.head_size;

  p.decode_args = base;
  p.decode_args.num_work_items = narrow(decode_items, "decode items");
  p.decode_args.partition_size = split ? options.partition_size : 0;
  p.decode_args.max_partitions = narrow(max_partitions, "max_partitions");
  p.prefill_args = base;
  p.prefill_args.num_work_items = narrow(prefill_tiles, "prefill tiles");
  p.prefill_args.heads_per_threadgroup = narrow(prefill_heads_per_tg, "heads_per_threadgroup");
  p.prefill_args.head_tiles = narrow(prefill_head_tiles, "head_tiles");
  p.prefill_args.partition_size = 0;
  p.prefill_args.max_partitions = 1;

  const uint32_t kv_tiles = static_cast<uint32_t>(g.num_kv_heads * head_tiles);
  p.decode.threadgroups[0] = static_cast<uint32_t>(decode_items);
  p.decode.threadgroups[1] = kv_tiles;
  p.decode.threadgroups[2] = static_cast<uint32_t>(max_partitions);
  p.decode.threads_per_threadgroup = pm::kDecodeSimdGroups * pm::kSimdWidth;
  if (split) {
    p.merge.threadgroups[0] = static_cast<uint32_t>(decode_items);
    p.merge.threadgroups[1] = static_cast<uint32_t>(g.num_heads);
    p.merge.threads_per_threadgroup = pm::kSimdWidth;
    p.partial_lse_floats = static_cast<size_t>(decode_items * g.num_heads * max_partitions);
    p.partial_out_floats = p.partial_lse_floats * static_cast<size_t>(g.head_dim);
  }
  p.prefill.threadgroups[0] = static_cast<uint32_t>(prefill_tiles);
  p.prefill.threadgroups[1] = static_cast<uint32_t>(g.num_kv_heads * prefill_head_tiles);
  p.prefill.threads_per_threadgroup = pm::kPrefillSimdGroups * pm::kSimdWidth;
  return p;
}

ReshapeAndCacheLaunch make_reshape_and_cache_launch(int64_t num_tokens, int64_t num_kv_heads, int64_t head_size,
                                                    int64_t block_size, int64_t num_blocks,
                                                    int64_t key_token_stride, int64_t key_head_stride,
                                                    int64_t value_token_stride, int64_t value_head_stride) {
  ReshapeAndCacheLaunch r;
  if (head_size < 1 || head_size > pm::kMaxHeadSize) {
    throw KernelArgumentError("head_size must be in [1, " + std::to_string(pm::kMaxHeadSize) + "], got " +
                              std::to_string(head_size));
  }
  narrow(num_blocks * block_size * num_kv_heads * head_size, "KV cache elements");
  r.args.num_tokens = narrow(num_tokens, "num_tokens");
  r.args.num_kv_heads = narrow(num_kv_heads, "num_kv_heads");
  r.args.head_size = narrow(head_size, "head_size");
  r.args.block_size = narrow(block_size, "block_size");
  r.args.num_blocks = narrow(num_blocks, "num_blocks");
  r.args.key_token_stride = narrow(key_token_stride, "key token stride");
  r.args.key_head_stride = narrow(key_head_stride, "key head stride");
  r.args.value_token_stride = narrow(value_token_stride, "value token stride");
  r.args.value_head_stride = narrow(value_head_stride, "value head stride");
  r.launch.threadgroups[0] = static_cast<uint32_t>(num_tokens);
  r.launch.threadgroups[1] = static_cast<uint32_t>(num_kv_heads);
  r.launch.threads_per_threadgroup = pm::kReshapeThreads;
  return r;
}

}  // namespace metal
}  // namespace pagedserve
