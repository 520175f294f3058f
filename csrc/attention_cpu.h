// CPU paged attention: DESIGN.md section 4's contract on raw CPU buffers.
//
// Caches (one layer of the store in python/pagedserve/model/kv_cache.py),
// float32 or bfloat16: k_cache [num_blocks, num_kv_heads, head_dim, block_size]
// (each block's keys transposed, so a query's scores against a block are
// head_dim vector FMAs across block_size lanes, no horizontal sums), and
// v_cache [num_blocks, num_kv_heads, block_size, head_dim].
//
// paged_attention reads K/V straight from the blocks named by the block table
// with an online softmax (running max m, running sum l, float32 accumulator;
// Milakov & Gimelshein 2018, FlashAttention, Dao et al. 2022): per worker the
// scratch is O(block_size * head_dim + rows * head_dim), independent of the
// sequence length (paged_attention_scratch_bytes). Work items are (sequence,
// KV head group, chunk of up to kQueryChunk query tokens); when there are too
// few of them to keep the threads busy, long decodes are split along the KV
// length and the splits merged by log-sum-exp (flash-decoding, Dao et al. 2023).
#pragma once

#include <cstddef>
#include <cstdint>

#include "tensor_arg.h"

namespace pagedserve {

constexpr int kQueryChunk = 16;         // query tokens per work item
constexpr int kMinBlocksPerSplit = 16;  // KV blocks a decode split covers at least

// Writes key/value [T, Hkv, D] into k_cache/v_cache at slot_mapping [T]
// (int32 or int64; slot = block * block_size + offset; a negative slot skips
// the token). Throws KernelArgumentError on a shape/dtype/layout mismatch or a
// slot out of range (checked before anything is written).
void reshape_and_cache(const TensorArg& key, const TensorArg& value, const TensorArg& k_cache,
                       const TensorArg& v_cache, const TensorArg& slot_mapping);

// out [T, H, D] = causal attention of query [T, H, D] over each sequence's
// blocks. query_start_loc [B+1] int32, seq_lens [B] int32, block_tables
// [B, max_blocks] int32 (-1 padding allowed past the blocks a sequence uses).
// Query token i of sequence b sits at position seq_lens[b] - q_len[b] + i and
// sees key positions <= its own (all keys when causal is false). GQA/MQA by
// head grouping (H % Hkv == 0). num_threads: worker threads (>= 1), usually
// torch.get_num_threads(). Throws KernelArgumentError on bad arguments; every
// index is checked before any memory is read.
void paged_attention(const TensorArg& out, const TensorArg& query, const TensorArg& k_cache,
                     const TensorArg& v_cache, const TensorArg& query_start_loc,
                     const TensorArg& seq_lens, const TensorArg& block_tables, float scale,
                     bool causal, int num_threads);

// Scratch bytes one worker uses (float32), whatever the sequence lengths.
size_t paged_attention_scratch_bytes(int num_heads, int num_kv_heads, int head_dim, int block_size);

}  // namespace pagedserve
