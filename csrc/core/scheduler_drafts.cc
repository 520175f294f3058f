// Speculative decoding's part of the Scheduler (scheduler.h): draft tokens
// appended before schedule(), the verified prefix kept after the forward pass.
#include <algorithm>
#include <string>

#include "errors.h"
#include "scheduler.h"

namespace pagedserve {

Scheduler::SeqPtr Scheduler::find_sequence(const std::string& request_id, int32_t index) const {
  auto it = requests_.find(request_id);
  if (it != requests_.end()) {
    for (const SeqPtr& seq : it->second) {
      if (seq->index == index) return seq;
    }
  }
  throw UnknownRequestError("unknown request '" + request_id + "' or choice " + std::to_string(index));
}

void Scheduler::drop_drafts(Sequence& seq, int32_t count) {
  count = std::min(count, seq.num_draft_tokens);
  if (count <= 0) return;
  seq.token_ids.resize(seq.token_ids.size() - static_cast<size_t>(count));
  seq.num_draft_tokens -= count;
}

int32_t Scheduler::add_draft_tokens(const std::string& request_id, int32_t index,
                                    const std::vector<int32_t>& draft) {
  const SeqPtr seq = find_sequence(request_id, index);
  if (seq->status != SequenceStatus::kRunning || seq->num_draft_tokens > 0 || seq->num_forks > 1 ||
      seq->num_computed_tokens != seq->num_tokens() - 1 || seq->num_output_tokens() < 1) {
    return 0;
  }
  // the sampled token after the drafts is output too: drafts + 1 within max_tokens and max_model_len
  const int32_t room = std::min(seq->stop.max_tokens - seq->num_output_tokens() - 1,
                                config_.max_model_len - seq->num_tokens() - 1);
  const int32_t n = std::max(0, std::min(room, static_cast<int32_t>(draft.size())));
  seq->token_ids.insert(seq->token_ids.end(), draft.begin(), draft.begin() + n);
  seq->num_draft_tokens = n;
  return n;
}

void Scheduler::accept_draft_tokens(const std::string& request_id, int32_t index, int32_t num_accepted) {
  const SeqPtr seq = find_sequence(request_id, index);
  auto it = std::find_if(last_scheduled_.begin(), last_scheduled_.end(),
                         [&](const std::pair<SeqPtr, int32_t>& s) { return s.first == seq; });
  if (it == last_scheduled_.end() || seq->num_draft_tokens == 0) {
    throw InvalidArgumentError("request '" + request_id + "' choice " + std::to_string(index) +
                               " was not scheduled with draft tokens in the last step");
  }
  if (num_accepted < 0 || num_accepted > seq->num_draft_tokens) {
    throw InvalidArgumentError("num_accepted " + std::to_string(num_accepted) + " outside [0, " +
                               std::to_string(seq->num_draft_tokens) + "]");
  }
  const int32_t rejected = seq->num_draft_tokens - num_accepted;
  num_drafts_verified_ += seq->num_draft_tokens;
  num_drafts_accepted_ += num_accepted;
  seq->num_draft_tokens = rejected;
  drop_drafts(*seq, rejected);  // num_draft_tokens back to 0
  it->second -= rejected;
  kv_.truncate(seq->seq_id, seq->num_computed_tokens + it->second);
}

}  // namespace pagedserve
