// SchedulerOutput: what one engine step computes, as flat int32 arrays laid out
// for a varlen (packed) batch, the FlashAttention / vLLM metadata convention.
// B = scheduled sequences, T = total scheduled tokens, S = sequences that
// sample a token this step (their last prompt/output token is computed now).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sequence.h"

namespace pagedserve {

struct SchedulerOutput {
  std::vector<std::string> request_ids;       // [B]
  std::vector<int32_t> seq_indices;           // [B] choice index of each sequence in its request
  std::vector<int32_t> num_scheduled_tokens;  // [B] query length of each sequence
  std::vector<int32_t> num_computed_tokens;   // [B] tokens already cached before this step
  std::vector<int32_t> query_start_loc;       // [B+1] prefix sums of num_scheduled_tokens
  std::vector<int32_t> seq_lens;              // [B] num_computed + num_scheduled (keys visible)
  int32_t max_num_blocks_per_seq = 0;         // columns of block_tables
  std::vector<int32_t> block_tables;          // [B, max_num_blocks_per_seq], row-major, -1 padded
  std::vector<int32_t> input_ids;             // [T] token ids to compute
  std::vector<int32_t> positions;             // [T] their positions (RoPE)
  std::vector<int32_t> slot_mapping;          // [T] physical cache slot of each token
  std::vector<int32_t> logits_indices;        // [S] flat token index whose logits are sampled
  std::vector<int32_t> sampling_seq_indices;  // [S] row in [0, B) of each sampling sequence
  // [S] tokens to sample from each row: n for a request's first sample when it
  // forks into n sequences (parallel sampling), else 1. update() takes sum(num_samples).
  std::vector<int32_t> num_samples;
  // [C, 2] (src, dst) block copies (copy-on-write) to apply before the forward pass.
  std::vector<int32_t> blocks_to_copy;
  std::vector<std::string> preempted_request_ids;  // preempted while scheduling this step

  int32_t num_seqs() const { return static_cast<int32_t>(request_ids.size()); }
  int32_t total_num_scheduled_tokens() const { return static_cast<int32_t>(input_ids.size()); }
  int32_t num_block_copies() const { return static_cast<int32_t>(blocks_to_copy.size() / 2); }
  bool empty() const { return request_ids.empty(); }
};

// One sampling sequence's committed token (Scheduler::update's result).
struct SequenceUpdate {
  std::string request_id;
  int32_t index = 0;  // choice index
  int32_t token_id = 0;
  FinishReason finish_reason = FinishReason::kNone;  // kNone: still running
  int32_t num_cached_tokens = 0;  // prompt tokens served from the prefix cache
};

}  // namespace pagedserve
