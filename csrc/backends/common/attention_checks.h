// Argument checks every attention backend shares (docs/architecture.md, "The
// attention backend contract"): the step's metadata is validated once per
// step, before any kernel reads memory through it, and each layer's tensors
// are checked against that validated geometry in O(1).
#pragma once

#include <cstdint>
#include <vector>

#include "tensor_arg.h"

namespace pagedserve {

// The shape of one step's attention problem.
struct AttentionGeometry {
  int64_t num_seqs = 0;      // B
  int64_t num_tokens = 0;    // T, query tokens of all sequences
  int64_t max_blocks = 0;    // columns of block_tables
  int64_t num_heads = 0;     // H
  int64_t num_kv_heads = 0;  // Hkv (H % Hkv == 0: MHA, GQA, MQA)
  int64_t head_dim = 0;      // D
  int64_t block_size = 0;    // tokens per KV block
  int64_t num_blocks = 0;    // physical blocks in the cache
  int64_t group() const { return num_heads / num_kv_heads; }
};

// Bounds on a plan's geometry: far above any model served, low enough that no
// index or scratch size computed from them overflows.
constexpr int64_t kMaxHeads = 1024;      // num_heads, num_kv_heads
constexpr int64_t kMaxHeadDim = 1024;    // head_dim
constexpr int64_t kMaxBlockSize = 1024;  // tokens per block
constexpr int64_t kMaxBlocks = 2147483647;  // block ids are int32

// Validates query_start_loc [B+1], seq_lens [B] and block_tables [B, max_blocks]
// (int32, contiguous) against a cache of num_blocks x block_size slots: query
// lengths in [0, seq_len], query_start_loc from 0 to T, every block id a
// sequence uses inside [0, num_blocks), the geometry within the bounds above.
// Returns the geometry; throws KernelArgumentError naming the first bad value.
AttentionGeometry check_attention_metadata(const TensorArg& query_start_loc, const TensorArg& seq_lens,
                                           const TensorArg& block_tables, int64_t num_heads,
                                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                           int64_t num_blocks);

// Checks a [T, heads, head_dim] tensor of the given dtype with a contiguous last
// dimension (T unchecked when num_tokens < 0). Throws KernelArgumentError.
void check_token_heads(const TensorArg& t, int64_t num_tokens, int64_t heads, int64_t head_dim, DType dtype);

// Reads slot_mapping [num_tokens] (int64; int32 accepted) and checks every slot
// is < num_slots (a negative slot means "skip this token"). Returns the slots.
// Throws KernelArgumentError before anything is written.
std::vector<int64_t> check_slot_mapping(const TensorArg& slot_mapping, int64_t num_tokens, int64_t num_slots);

}  // namespace pagedserve
