// Argument structs and limits shared by the Metal kernels (metal/*.metal) and
// their host (csrc/backends/metal/). The same file is compiled three ways: by
// Apple's Metal compiler (__METAL_VERSION__ set), by the host C++ compiler,
// and by clang as C++ in the Linux emulator (tests/metal_emu/). Only 32-bit
// ints and floats appear in the structs, so their layout is the same in every
// build; the static_asserts at the bottom pin sizes and offsets, and each build
// checks them.
//
// Units: counts are tokens, heads, blocks or elements as named; strides are in
// elements of the tensor's dtype.
#pragma once

#ifdef __METAL_VERSION__
#define PAGEDSERVE_I32 int
#else
#include <cstdint>
#define PAGEDSERVE_I32 int32_t
#endif

namespace pagedserve_metal {

// Limits the kernels are compiled for (per-lane register arrays are sized by them).
enum : int {
  kSimdWidth = 32,               // lanes per SIMD group (every Apple GPU)
  kMaxHeadSize = 256,            // head_size the kernels accept (any value up to this)
  kMaxHeadsPerThreadgroup = 8,   // query heads of one GQA group a decode threadgroup serves at once
  kPrefillHeadsPerThreadgroup = 4,  // the same for prefill (each SIMD group keeps its queries in threadgroup memory)
  kDecodeSimdGroups = 4,         // SIMD groups of a decode threadgroup (they split the keys)
  kPrefillSimdGroups = 4,        // SIMD groups of a prefill threadgroup (one query token each)
  kReshapeThreads = 128,         // threads of a reshape_and_cache threadgroup
};

// Function-constant indices: specialised when the pipeline is built.
enum : int {
  kFunctionConstantHeadSize = 0,   // int, head_size
  kFunctionConstantBlockSize = 1,  // int, tokens per KV block
};

// reshape_and_cache: grid (num_tokens, num_kv_heads), kReshapeThreads threads.
// key/value [num_tokens, num_kv_heads, head_size] with the strides below;
// k_cache/v_cache [num_blocks, num_kv_heads, block_size, head_size] contiguous;
// slot_mapping [num_tokens] int64 (block * block_size + offset, negative: skip),
// as the engine makes it.
struct ReshapeAndCacheArgs {
  PAGEDSERVE_I32 num_tokens;
  PAGEDSERVE_I32 num_kv_heads;
  PAGEDSERVE_I32 head_size;
  PAGEDSERVE_I32 block_size;
  PAGEDSERVE_I32 num_blocks;
  PAGEDSERVE_I32 key_token_stride;
  PAGEDSERVE_I32 key_head_stride;
  PAGEDSERVE_I32 value_token_stride;
  PAGEDSERVE_I32 value_head_stride;
};

// paged_attention_decode / _prefill / _merge. The caches are
// [num_blocks, num_kv_heads, block_size, head_size]; query and out
// [num_tokens, num_heads, head_size] with the strides below; block_tables
// [num_seqs, max_blocks_per_seq] int32; seq_lens [num_seqs] and
// query_start_loc [num_seqs + 1] int32 (docs/architecture.md's contract).
//
// A threadgroup serves one KV head and up to heads_per_threadgroup of its
// query heads (head tile t of KV head hk covers query heads
// hk * group + t * heads_per_threadgroup ...), so K/V are read once per tile;
// head_tiles = ceil(group / heads_per_threadgroup) (decode and prefill differ).
//  - decode: grid (num_work_items, num_kv_heads * head_tiles, max_partitions);
//    work[i] = the sequence (query length 1) of item i. Partition p covers keys
//    [p * partition_size, (p + 1) * partition_size) (partition_size 0: the
//    whole sequence, max_partitions 1, the output written directly); split
//    items write partial_out [items, num_heads, max_partitions, head_size] and
//    partial_lse [items, num_heads, max_partitions] (float32) for the merge.
//  - merge: grid (num_work_items, num_heads), one SIMD group.
//  - prefill: grid (num_work_items, num_kv_heads * head_tiles); work[2i] = the
//    sequence, work[2i + 1] = the first query token of tile i (an index into
//    the sequence's queries); SIMD group s serves query token work[2i+1] + s.
struct PagedAttentionArgs {
  PAGEDSERVE_I32 num_seqs;
  PAGEDSERVE_I32 num_heads;
  PAGEDSERVE_I32 num_kv_heads;
  PAGEDSERVE_I32 head_size;
  PAGEDSERVE_I32 block_size;
  PAGEDSERVE_I32 num_blocks;
  PAGEDSERVE_I32 max_blocks_per_seq;
  PAGEDSERVE_I32 heads_per_threadgroup;
  PAGEDSERVE_I32 head_tiles;
  PAGEDSERVE_I32 num_work_items;
  PAGEDSERVE_I32 partition_size;
  PAGEDSERVE_I32 max_partitions;
  PAGEDSERVE_I32 query_token_stride;
  PAGEDSERVE_I32 query_head_stride;
  PAGEDSERVE_I32 out_token_stride;
  PAGEDSERVE_I32 out_head_stride;
  PAGEDSERVE_I32 causal;
  float scale;
};

static_assert(sizeof(ReshapeAndCacheArgs) == 36, "ReshapeAndCacheArgs layout");
static_assert(__builtin_offsetof(ReshapeAndCacheArgs, value_head_stride) == 32, "ReshapeAndCacheArgs layout");
static_assert(sizeof(PagedAttentionArgs) == 72, "PagedAttentionArgs layout");
static_assert(__builtin_offsetof(PagedAttentionArgs, heads_per_threadgroup) == 28, "PagedAttentionArgs layout");
static_assert(__builtin_offsetof(PagedAttentionArgs, partition_size) == 40, "PagedAttentionArgs layout");
static_assert(__builtin_offsetof(PagedAttentionArgs, causal) == 64, "PagedAttentionArgs layout");
static_assert(__builtin_offsetof(PagedAttentionArgs, scale) == 68, "PagedAttentionArgs layout");

}  // namespace pagedserve_metal

#undef PAGEDSERVE_I32
