// ModelInput: one step's SchedulerOutput laid out for the forward pass as a
// flat varlen (packed) batch, the FlashAttention / vLLM metadata convention.
// Index arrays that torch consumes as indices (input_ids, positions,
// slot_mapping, logits_indices) are int64 from the start, so nothing is
// narrowed or widened between the block table and the kernel; the attention
// metadata the kernels read per sequence (query_start_loc, seq_lens,
// block_tables) stays int32. See docs/architecture.md, "One engine step".
#pragma once

#include <cstdint>
#include <vector>

#include "scheduler_output.h"

namespace pagedserve {

struct ModelInput {
  std::vector<int64_t> input_ids;        // [T] token ids to compute
  std::vector<int64_t> positions;        // [T] their positions in their sequences (RoPE)
  std::vector<int32_t> query_start_loc;  // [B+1] prefix sums of num_scheduled_tokens
  std::vector<int32_t> seq_lens;         // [B] num_computed + num_scheduled (keys visible)
  int32_t max_num_blocks_per_seq = 0;    // columns of block_tables
  std::vector<int32_t> block_tables;     // [B, max_num_blocks_per_seq], row-major, -1 padded
  // [T] physical KV slot of each token: block_id * block_size + position % block_size.
  std::vector<int64_t> slot_mapping;
  std::vector<int64_t> logits_indices;   // [S] flat token index whose logits are sampled
  std::vector<int32_t> blocks_to_copy;   // [C, 2] copy-on-write (src, dst), applied first

  int32_t num_seqs() const { return static_cast<int32_t>(seq_lens.size()); }
  int32_t num_tokens() const { return static_cast<int32_t>(input_ids.size()); }
};

// Builds the ModelInput of a SchedulerOutput. Throws InvalidArgumentError if
// the output is inconsistent (a block table too short for its tokens, arrays
// of mismatched lengths): it cannot be, coming from Scheduler::schedule().
ModelInput build_model_input(const SchedulerOutput& out);

}  // namespace pagedserve
