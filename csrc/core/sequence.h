// Sequence: the scheduler's state of one request (one sampled continuation).
// Holds data and derived properties only; the Scheduler changes it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace pagedserve {

enum class SequenceStatus { kWaiting, kRunning, kFinished };

// Why a sequence ended. kNone while it runs.
enum class FinishReason { kNone, kStop, kLength, kAbort };

// "stop", "length", "abort" or "" (kNone), as the OpenAI API spells them.
const char* finish_reason_str(FinishReason r);

// What the caller of Scheduler::update found for one sampled token, from what
// only it sees (the text, the grammar, the request kind): kStop ends the
// sequence with kStop (a stop string, a grammar's end, an embedding request's
// prompt pooled); kStopIfFinished: a stop string completes in text the
// detokenizer still holds back, so if the sequence ends at this token for
// another reason (length) the reason is kStop.
enum class CallerFinish : uint8_t { kNone, kStop, kStopIfFinished };

// Stopping rules the core applies in Scheduler::update (stop *strings* are a
// text matter: Python finds them and passes CallerFinish to update()).
struct StopCriteria {
  int32_t max_tokens = 16;              // output tokens, >= 1
  bool ignore_eos = false;
  std::vector<int32_t> eos_token_ids;   // ignored when ignore_eos
  std::vector<int32_t> stop_token_ids;  // always honoured
};

struct Sequence {
  std::string request_id;
  int64_t seq_id = 0;
  int32_t index = 0;       // choice index within its request (parallel sampling)
  int32_t num_forks = 1;   // sequences this one becomes at its first sample (n); 1 = none pending
  std::vector<int32_t> token_ids;  // prompt tokens then output tokens
  int32_t num_prompt_tokens = 0;
  // Tokens whose K/V are in the paged cache. A decode step computes the one
  // token after them; a prefill chunk computes several.
  int32_t num_computed_tokens = 0;
  // Prompt tokens served from the prefix cache at first admission (usage report).
  int32_t num_cached_tokens = -1;  // -1: not admitted yet
  std::string cache_salt;          // extra key of the prefix-cache hashes
  int32_t priority = 0;            // priority policy: lower is served first
  int64_t arrival = 0;             // order of add_request (forks share their parent's)
  bool skip_reading_prefix_cache = false;  // never start from cached blocks (prompt logprobs)
  StopCriteria stop;
  SequenceStatus status = SequenceStatus::kWaiting;
  FinishReason finish_reason = FinishReason::kNone;
  int32_t num_preemptions = 0;
  // Speculative decoding: proposed tokens at the end of token_ids, not yet
  // verified (Scheduler::add_draft_tokens / accept_draft_tokens); 0 otherwise.
  int32_t num_draft_tokens = 0;

  int32_t num_tokens() const { return static_cast<int32_t>(token_ids.size()); }
  // Output tokens, unverified drafts included (a running sequence's, from add_draft_tokens
  // until update(); a finished sequence has none).
  int32_t num_output_tokens() const { return num_tokens() - num_prompt_tokens; }
  // The output so far: token_ids after the prompt, without unverified drafts.
  std::vector<int32_t> output_token_ids() const {
    return {token_ids.begin() + num_prompt_tokens, token_ids.end() - num_draft_tokens};
  }
};

}  // namespace pagedserve
