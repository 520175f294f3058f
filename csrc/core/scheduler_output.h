// SchedulerOutput: what the scheduler decided for one engine step, and nothing
// about how the model consumes it (vLLM v1 keeps the same split between its
// SchedulerOutput and the model runner's input batch). B = scheduled
// sequences, T = total scheduled tokens, S = sequences that sample a token
// this step (their last known token is computed now). build_model_input()
// (model_input.h) turns it into the flat varlen arrays the model runs on.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "sequence.h"

namespace pagedserve {

struct SchedulerOutput {
  int32_t block_size = 0;                     // tokens per KV block
  std::vector<std::string> request_ids;       // [B]
  std::vector<int32_t> seq_indices;           // [B] choice index of each sequence in its request
  std::vector<int32_t> num_scheduled_tokens;  // [B] tokens computed this step (query length)
  std::vector<int32_t> num_computed_tokens;   // [B] tokens already in the KV cache before this step
  // [B] speculative (draft) tokens among the scheduled ones: the last num_draft_tokens[b] of sequence b's
  // (0 for all but a decode with drafts); the step computes logits at each scheduled position to verify them.
  std::vector<int32_t> num_draft_tokens;
  // [T] the scheduled tokens' ids, sequence after sequence (sequence b's start
  // at the prefix sum of num_scheduled_tokens).
  std::vector<int32_t> token_ids;
  // Every scheduled sequence's block table, concatenated: sequence b owns
  // block_ids[block_table_offsets[b] .. block_table_offsets[b + 1]) ([B + 1] offsets).
  std::vector<int32_t> block_ids;
  std::vector<int32_t> block_table_offsets;
  std::vector<int32_t> sampling_seq_indices;  // [S] row in [0, B) of each sampling sequence
  // [S] tokens to sample from each row: n for a request's first sample when it
  // forks into n sequences (parallel sampling), else 1. update() takes sum(num_samples).
  std::vector<int32_t> num_samples;
  // [C, 2] (src, dst) block copies (copy-on-write) to apply before the forward pass.
  std::vector<int32_t> blocks_to_copy;
  std::vector<std::string> preempted_request_ids;  // preempted while scheduling this step
  // [P] why each of them was: "kv_blocks" (a running sequence needed blocks none were free for) or
  // "priority" (an arrival of strictly better priority needed its place, --scheduling-policy priority)
  std::vector<std::string> preemption_reasons;

  int32_t num_seqs() const { return static_cast<int32_t>(request_ids.size()); }
  int32_t total_num_scheduled_tokens() const { return static_cast<int32_t>(token_ids.size()); }
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
  // The sequence itself: the one record of its token ids, which the caller may
  // keep and read (never change) after the scheduler has let go of it.
  std::shared_ptr<const Sequence> sequence;
};

}  // namespace pagedserve
